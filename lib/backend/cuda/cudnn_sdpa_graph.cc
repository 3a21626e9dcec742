// cuDNN's fused scaled-dot-product attention, forward and backward, as graphs
// of the backend API (cudnn_graph.h; no frontend library), in the form cuDNN's
// fused flash-attention engines recognise. The forward:
//
//   S = Q K^T                    matmul, f32 [B, Hq, T, T] (K has Hkv heads)
//   S = S * scale                pointwise, scale by value
//   S = row >= col ? S : lowest  gen_index on axes 2 and 3, cmp_ge, select (causal only)
//   M = max_j S                  reduction [B, Hq, T, 1]
//   E = exp(S - M)
//   L = sum_j E                  reduction [B, Hq, T, 1]
//   Stats = M + log(L)           output, f32
//   P = E / L                    bf16
//   O = P V                      matmul [B, Hq, T, D] (V has Hkv heads)
//
// Q, O are [B, T, Hq*D] and K, V [B, T, Hkv*D] in memory: [B, H, T, D] views
// with strides [T*H*D, D, H*D, 1] (BSHD); K^T is the same memory with the last
// two strides swapped. Stats is the natural-log log-sum-exp of each scaled,
// masked score row, [B, Hq, T] contiguous. The backward (sdpa_backward_plan)
// recomputes P from Stats; its form is described there.

#include "backend/cuda/cudnn_sdpa_graph.h"

#include <cfloat>
#include <string>
#include <vector>

namespace ctr::cuda {

std::string cudnn_words(const CudnnApi &api, cudnnStatus_t st) {
  char last[512] = {0};
  api.last_error(last, sizeof last);
  std::string s = api.error_string(st);
  s += " (cuDNN status " + std::to_string(static_cast<int>(st)) + ")";
  if (last[0]) s += ": " + std::string(last);
  return s;
}

namespace {

// A graph under construction: every call checked, the first failure kept as
// the reason (later calls are skipped), every descriptor destroyed with it.
struct Builder {
  const CudnnApi &api;
  std::string why;  // the first failure
  std::vector<cudnnBackendDescriptor_t> owned;

  explicit Builder(const CudnnApi &a) : api(a) {}
  ~Builder() {
    for (auto it = owned.rbegin(); it != owned.rend(); ++it) api.destroy_descriptor(*it);
  }
  bool ok() const { return why.empty(); }
  bool check(cudnnStatus_t st, const char *what) {
    if (st == CUDNN_STATUS_SUCCESS) return true;
    if (why.empty()) why = std::string(what) + ": " + cudnn_words(api, st);
    return false;
  }
  cudnnBackendDescriptor_t make(cudnnBackendDescriptorType_t type, const char *what) {
    if (!ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    if (!check(api.create_descriptor(type, &d), what)) return nullptr;
    owned.push_back(d);
    return d;
  }
  void set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void *values, const char *what) {
    if (ok() && d) check(api.set_attribute(d, name, type, count, values), what);
  }
  void finalize(cudnnBackendDescriptor_t d, const char *what) {
    if (ok() && d) check(api.finalize(d), what);
  }

  // A 4-D tensor. Strides in elements.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const int64_t (&dims)[4],
                                  const int64_t (&strides)[4], bool is_virtual, bool by_value = false) {
    cudnnBackendDescriptor_t t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor descriptor");
    const int64_t align = 16;
    const bool v = is_virtual, bv = by_value;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims, "tensor dimensions");
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides, "tensor strides");
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, "tensor id");
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v, "tensor virtual flag");
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv, "tensor by-value flag");
    finalize(t, "tensor descriptor");
    return t;
  }

  // y = a x b (batched over the first two dims), computed in f32.
  cudnnBackendDescriptor_t matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                  cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t m = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul descriptor");
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul compute type");
    finalize(m, "matmul descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a, "matmul A");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "matmul B");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "matmul C");
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m, "matmul descriptor");
    finalize(op, "matmul operation");
    return op;
  }

  // y = mode(x[, b[, t]]); axis >= 0 for gen_index.
  cudnnBackendDescriptor_t pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                                     cudnnBackendDescriptor_t y, int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise descriptor");
    set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, "pointwise precision");
    if (axis >= 0) set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    finalize(pw, "pointwise descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pointwise mode");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "pointwise x");
    if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b, "pointwise b");
    if (t) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t, "pointwise t");
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "pointwise y");
    finalize(op, "pointwise operation");
    return op;
  }

  // y = x seen with y's dims and strides (a transpose of the last two dims).
  cudnnBackendDescriptor_t reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reshape x");
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reshape y");
    finalize(op, "reshape operation");
    return op;
  }

  // y = reduction of x over the dims where y has size 1, in f32.
  // deterministic: asked of the engine (the backward's dQ is then summed in
  // a fixed order).
  cudnnBackendDescriptor_t reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t y, bool deterministic = false) {
    cudnnBackendDescriptor_t r = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction descriptor");
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, "reduction operator");
    set(r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction compute type");
    if (deterministic)
      set(r, CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, 1, &deterministic, "reduction determinism");
    finalize(r, "reduction descriptor");
    cudnnBackendDescriptor_t op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x, "reduction x");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y, "reduction y");
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r, "reduction descriptor");
    finalize(op, "reduction operation");
    return op;
  }
};

// The global index of the engine behind configuration cfg (which engine
// cuDNN chose, for the log), or -1 where cuDNN does not say.
int64_t engine_index(const CudnnApi &api, cudnnBackendDescriptor_t cfg) {
  cudnnBackendDescriptor_t engine = nullptr;
  if (api.create_descriptor(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &engine) != CUDNN_STATUS_SUCCESS) return -1;
  int64_t n = 0, index = -1;
  if (api.get_attribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine) !=
          CUDNN_STATUS_SUCCESS ||
      api.get_attribute(engine, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index) !=
          CUDNN_STATUS_SUCCESS)
    index = -1;
  api.destroy_descriptor(engine);
  return index;
}

// The first engine configuration of heuristic mode A, then of the fallback
// list, that cuDNN finalizes into an execution plan for `graph`, into *plan;
// else plan->why says what each list's first choice answered.
void find_plan(const CudnnApi &api, cudnnHandle_t handle, cudnnBackendDescriptor_t device_prop,
               cudnnBackendDescriptor_t graph, SdpaPlan *plan) {
  // Engine configurations, best first, by heuristic A and then the fallback
  // list; the first one cuDNN finalizes into a plan is taken.
  std::string refusals;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Builder h(api);
    cudnnBackendDescriptor_t heur = h.make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    h.set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "heuristics graph");
    h.set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
    if (device_prop)
      h.set(heur, CUDNN_ATTR_ENGINEHEUR_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &device_prop, "heuristics device");
    h.finalize(heur, "engine heuristics");
    int64_t count = 0;
    if (h.ok()) h.check(api.get_attribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                          nullptr), "engine heuristics results (count)");
    std::vector<cudnnBackendDescriptor_t> cfgs;
    for (int64_t i = 0; i < count && h.ok(); ++i) cfgs.push_back(h.make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration"));
    int64_t got = 0;
    if (h.ok() && count > 0)
      h.check(api.get_attribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                cfgs.data()), "engine heuristics results");
    if (!h.ok()) {
      refusals += (refusals.empty() ? "" : "; ") + h.why;
      continue;
    }
    const char *mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristic A" : "fallback list";
    if (got == 0) refusals += (refusals.empty() ? "" : "; ") + std::string(mode_name) + ": no engine";
    for (int64_t i = 0; i < got; ++i) {
      cudnnBackendDescriptor_t ep = nullptr;
      if (api.create_descriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &ep) != CUDNN_STATUS_SUCCESS) continue;
      cudnnStatus_t st =
          handle ? api.set_attribute(ep, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle)
                 : api.set_attribute(ep, CUDNN_ATTR_EXECUTION_PLAN_DEVICEPROP, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                     &device_prop);
      if (st == CUDNN_STATUS_SUCCESS)
        st = api.set_attribute(ep, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfgs[i]);
      if (st == CUDNN_STATUS_SUCCESS) st = api.finalize(ep);
      int64_t ws = 0, n = 0;
      if (st == CUDNN_STATUS_SUCCESS)
        st = api.get_attribute(ep, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws);
      const std::string which = std::string(mode_name) + ", choice " + std::to_string(i) + " (engine " +
                                std::to_string(engine_index(api, cfgs[i])) + ")";
      if (st == CUDNN_STATUS_SUCCESS) {
        plan->plan = ep;
        plan->workspace = ws;
        plan->engine = which;
        return;
      }
      // The first choice's answer in full, the others' status names.
      refusals += (refusals.empty() ? "" : "; ") + which + ": " +
                  (i == 0 ? cudnn_words(api, st) : std::string(api.error_string(st)));
      api.destroy_descriptor(ep);
    }
  }
  plan->why = "no engine runs the graph (" + refusals + ")";
}

}  // namespace

SdpaPlan::~SdpaPlan() {
  if (plan) api->destroy_descriptor(plan);
}

// The plan is the first engine configuration of heuristic mode A, then of
// the fallback list, that cuDNN finalizes.
std::unique_ptr<SdpaPlan> sdpa_forward_plan(const CudnnApi &api, cudnnHandle_t handle,
                                            cudnnBackendDescriptor_t device_prop, const SdpaShape &s) {
  auto plan = std::make_unique<SdpaPlan>();
  plan->api = &api;
  plan->scale = s.scale;
  plan->lowest = -FLT_MAX;
  Builder g(api);
  const int64_t B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D;
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  int64_t vid = 100;  // virtual tensors
  const int64_t q_dims[4] = {B, Hq, T, D}, q_str[4] = {T * Hq * D, D, Hq * D, 1};
  const int64_t kv_dims[4] = {B, Hkv, T, D}, kv_str[4] = {T * Hkv * D, D, Hkv * D, 1};
  const int64_t kt_dims[4] = {B, Hkv, D, T}, kt_str[4] = {T * Hkv * D, D, 1, Hkv * D};
  const int64_t s_dims[4] = {B, Hq, T, T}, s_str[4] = {Hq * T * T, T * T, T, 1};
  const int64_t r_dims[4] = {B, Hq, T, 1}, r_str[4] = {Hq * T, T, 1, 1};
  const int64_t one[4] = {1, 1, 1, 1};

  auto q = g.tensor(kSdpaQ, bf16, q_dims, q_str, false);
  auto kt = g.tensor(kSdpaK, bf16, kt_dims, kt_str, false);
  auto v = g.tensor(kSdpaV, bf16, kv_dims, kv_str, false);
  auto o = g.tensor(kSdpaO, bf16, q_dims, q_str, false);
  auto stats = g.tensor(kSdpaStats, f32, r_dims, r_str, false);
  auto scale_t = g.tensor(kSdpaScale, f32, one, one, false, true);
  auto sv = [&](cudnnDataType_t t = CUDNN_DATA_FLOAT) { return g.tensor(vid++, t, s_dims, s_str, true); };
  auto rv = [&] { return g.tensor(vid++, f32, r_dims, r_str, true); };

  std::vector<cudnnBackendDescriptor_t> ops;
  auto scores = sv();
  ops.push_back(g.matmul(q, kt, scores));
  auto scaled = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_MUL, f32, scores, scale_t, nullptr, scaled));
  auto masked = scaled;
  if (s.causal) {
    auto lowest = g.tensor(kSdpaLowest, f32, one, one, false, true);
    auto row = sv(CUDNN_DATA_INT32), col = sv(CUDNN_DATA_INT32), keep = sv(CUDNN_DATA_BOOLEAN);
    ops.push_back(g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scaled, nullptr, nullptr, row, 2));
    ops.push_back(g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scaled, nullptr, nullptr, col, 3));
    ops.push_back(g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep));
    masked = sv();
    ops.push_back(g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, scaled, lowest, keep, masked));
  }
  auto row_max = rv();
  ops.push_back(g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max));
  auto shifted = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_SUB, f32, masked, row_max, nullptr, shifted));
  auto e = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_EXP, f32, shifted, nullptr, nullptr, e));
  auto row_sum = rv();
  ops.push_back(g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum));
  auto log_sum = rv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_LOG, f32, row_sum, nullptr, nullptr, log_sum));
  ops.push_back(g.pointwise(CUDNN_POINTWISE_ADD, f32, row_max, log_sum, nullptr, stats));
  auto p = sv(bf16);
  ops.push_back(g.pointwise(CUDNN_POINTWISE_DIV, f32, e, row_sum, nullptr, p));
  ops.push_back(g.matmul(p, v, o));

  cudnnBackendDescriptor_t graph = g.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
        ops.data(), "operation graph ops");
  if (handle) g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle");
  g.finalize(graph, "operation graph");
  if (!g.ok()) {
    plan->why = g.why;
    return plan;
  }

  find_plan(api, handle, device_prop, graph, plan.get());
  return plan;
}


// The backward:
//
//   delta = sum_d dO * O           per query row, into the workspace (f32);
//                                  asked deterministic
//   P = exp(select(Q K^T * scale) - Stats)
//   dV = P^T dO                    P^T: a reshape of P, bf16
//   dS = P * (dO V^T - delta) * scale, bf16
//   dQacc = dS K                   f32 accumulator in the workspace, zeroed first
//   dQ = dQacc
//   dK = dS^T Q
//
// cuDNN's fused backward engine wants Q K^T and dO V^T as matmuls without
// producers, so K^T and V^T are inputs (transposed views) and K is an input
// once more, untransposed, for dQ. With grouped-query heads K and V have Hkv
// heads (query head h reads kv head h / (Hq / Hkv), as in the forward) while
// dK and dV come out per query head, Hq of them: the caller sums each group.
std::unique_ptr<SdpaPlan> sdpa_backward_plan(const CudnnApi &api, cudnnHandle_t handle,
                                             cudnnBackendDescriptor_t device_prop, const SdpaShape &s) {
  auto plan = std::make_unique<SdpaPlan>();
  plan->api = &api;
  plan->scale = s.scale;
  plan->lowest = -FLT_MAX;
  Builder g(api);
  const int64_t B = s.B, T = s.T, H = s.Hq, Hk = s.Hkv, D = s.D;
  const cudnnDataType_t bf16 = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  int64_t vid = 100;  // virtual tensors
  const int64_t x_dims[4] = {B, H, T, D}, x_str[4] = {T * H * D, D, H * D, 1};
  const int64_t kv_dims[4] = {B, Hk, T, D}, kv_str[4] = {T * Hk * D, D, Hk * D, 1};
  const int64_t kt_dims[4] = {B, Hk, D, T}, kt_str[4] = {T * Hk * D, D, 1, Hk * D};
  const int64_t s_dims[4] = {B, H, T, T}, s_str[4] = {H * T * T, T * T, T, 1};
  const int64_t st_str[4] = {H * T * T, T * T, 1, T};  // the transpose of an [.., T, T] score tensor
  const int64_t r_dims[4] = {B, H, T, 1}, r_str[4] = {H * T, T, 1, 1};
  const int64_t one[4] = {1, 1, 1, 1};

  auto q = g.tensor(kSdpaQ, bf16, x_dims, x_str, false);
  auto kt = g.tensor(kSdpaK, bf16, kt_dims, kt_str, false);
  auto k = g.tensor(kSdpaKRows, bf16, kv_dims, kv_str, false);  // K's memory again, untransposed
  auto vt = g.tensor(kSdpaV, bf16, kt_dims, kt_str, false);
  auto o = g.tensor(kSdpaO, bf16, x_dims, x_str, false);
  auto dout = g.tensor(kSdpaDO, bf16, x_dims, x_str, false);
  auto stats = g.tensor(kSdpaStats, f32, r_dims, r_str, false);
  auto scale_t = g.tensor(kSdpaScale, f32, one, one, false, true);
  auto dq = g.tensor(kSdpaDQ, bf16, x_dims, x_str, false);
  // With grouped-query heads, dK and dV per query head ([B, T, Hq*D], in the
  // workspace): the caller sums each kv head's group.
  auto dk = g.tensor(kSdpaDK, bf16, x_dims, x_str, false);
  auto dv = g.tensor(kSdpaDV, bf16, x_dims, x_str, false);
  // In the workspace: the row sums of dO * O, and dQ accumulated in f32.
  auto delta = g.tensor(kSdpaDelta, f32, r_dims, r_str, false);
  auto dq_acc = g.tensor(kSdpaDQAcc, f32, x_dims, x_str, false);
  auto sv = [&](cudnnDataType_t t = CUDNN_DATA_FLOAT) { return g.tensor(vid++, t, s_dims, s_str, true); };
  auto svt = [&](cudnnDataType_t t) { return g.tensor(vid++, t, s_dims, st_str, true); };

  std::vector<cudnnBackendDescriptor_t> ops;
  // delta_i = sum_d dO * O.
  auto do_o = g.tensor(vid++, f32, x_dims, x_str, true);
  ops.push_back(g.pointwise(CUDNN_POINTWISE_MUL, f32, dout, o, nullptr, do_o));
  // Deterministic: cuDNN then sums dQ in a fixed order (a replayed graph and
  // a launched step agree bitwise, as on the own kernels).
  ops.push_back(g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, delta, true));
  // P, recomputed from the scores and the forward's Stats.
  auto scores = sv();
  ops.push_back(g.matmul(q, kt, scores));
  auto scaled = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_MUL, f32, scores, scale_t, nullptr, scaled));
  auto masked = scaled;
  if (s.causal) {
    auto lowest = g.tensor(kSdpaLowest, f32, one, one, false, true);
    auto row = sv(CUDNN_DATA_INT32), col = sv(CUDNN_DATA_INT32), keep = sv(CUDNN_DATA_BOOLEAN);
    ops.push_back(g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scaled, nullptr, nullptr, row, 2));
    ops.push_back(g.pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, scaled, nullptr, nullptr, col, 3));
    ops.push_back(g.pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep));
    masked = sv();
    ops.push_back(g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, f32, scaled, lowest, keep, masked));
  }
  auto shifted = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_SUB, f32, masked, stats, nullptr, shifted));
  auto p = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_EXP, f32, shifted, nullptr, nullptr, p));
  // dV = P^T dO.
  auto pt = svt(bf16);
  ops.push_back(g.reshape(p, pt));
  ops.push_back(g.matmul(pt, dout, dv));
  // dS = P * (dO V^T - delta) * scale.
  auto dp = sv();
  ops.push_back(g.matmul(dout, vt, dp));
  auto dp_centered = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_SUB, f32, dp, delta, nullptr, dp_centered));
  auto ds_unscaled = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_MUL, f32, p, dp_centered, nullptr, ds_unscaled));
  auto ds = sv();
  ops.push_back(g.pointwise(CUDNN_POINTWISE_MUL, f32, ds_unscaled, scale_t, nullptr, ds));
  auto ds16 = sv(bf16);
  ops.push_back(g.pointwise(CUDNN_POINTWISE_IDENTITY, f32, ds, nullptr, nullptr, ds16));
  // dQ = dS K (through the f32 accumulator), dK = dS^T Q.
  ops.push_back(g.matmul(ds16, k, dq_acc));
  ops.push_back(g.pointwise(CUDNN_POINTWISE_IDENTITY, f32, dq_acc, nullptr, nullptr, dq));
  auto dst = svt(bf16);
  ops.push_back(g.reshape(ds16, dst));
  ops.push_back(g.matmul(dst, q, dk));

  cudnnBackendDescriptor_t graph = g.make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
  g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops.size()),
        ops.data(), "operation graph ops");
  if (handle) g.set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle, "operation graph handle");
  g.finalize(graph, "operation graph");
  if (!g.ok()) {
    plan->why = g.why;
    return plan;
  }
  find_plan(api, handle, device_prop, graph, plan.get());
  return plan;
}

}  // namespace ctr::cuda
