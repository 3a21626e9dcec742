// Attention forward and backward through cuDNN's fused scaled-dot-product
// attention (the flash-attention engines of cuDNN 9), behind the AttentionLib
// slot of stream 0's StreamCtx (kernels/cuda/common.cuh).
// kernels/cuda/attention.cu asks it first and runs its own kernels where it
// declines.
//
// The graphs (cudnn_sdpa_graph.cc) keep the natural-log log-sum-exp of each
// scaled, masked score row, f32 [B, Hq, T], exactly what the own forward
// writes into the op's saved output and the own backward reads
// (CTR_BACKEND_ATTENTION_LSE), so either backward serves either forward.
//
// A plan (operation graph, engine configuration, execution plan) is built the
// first time a shape is seen in a direction, outside any capture (the
// executor's warm-up launches before it captures), and kept per shape; a
// shape cuDNN refuses is remembered as refused. Every cuDNN call is checked: a
// refusal while building is a fallback, said once per reason on stderr
// ("ctr: cudnn: ..."); a failure to run a built plan is the backend's sticky
// error (check.cuh), since the op's outputs were then not written.

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cuda/cudnn_load.h"
#include "backend/cuda/cudnn_sdpa.h"
#include "backend/cuda/cudnn_sdpa_graph.h"
#include "common/op_params.h"
#include "cuda/common.cuh"

namespace ctr::cuda {
namespace {

// ---------------------------------------------------------------------------
// The slot

struct CudnnAttention : AttentionLib {
  const CudnnApi *api = nullptr;
  cudnnHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  std::string off;  // non-empty: cuDNN is not used, and why
  std::mutex mu;
  std::map<SdpaShape, std::unique_ptr<SdpaPlan>> plans[2];  // forward, backward
  void *workspace = nullptr;
  int64_t workspace_bytes = 0;
  // Workspaces outgrown by a later shape: kept until the end, since a CUDA
  // graph captured with one may still be replayed.
  std::vector<void *> retired;
  std::set<std::string> said;
  bool said_on[2] = {false, false};

  void say_once(const std::string &line) {
    if (said.insert(line).second) std::fprintf(stderr, "ctr: cudnn: %s\n", line.c_str());
  }
  ~CudnnAttention() {
    plans[0].clear();
    plans[1].clear();
    if (workspace) CTR_CUDA_CHECK(cudaFree(workspace));
    for (void *w : retired) CTR_CUDA_CHECK(cudaFree(w));
    if (handle) {
      const cudnnStatus_t st = api->destroy(handle);
      if (st != CUDNN_STATUS_SUCCESS) note_error("cudnnDestroy", __FILE__, __LINE__, cudnn_words(*api, st).c_str());
    }
  }
};

bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// out[r, j, :] = sum over g < G of full[r, j * G + g, :] for the rows r and
// kv heads j (rj = r * Hkv + j < rows), D values each: dK and dV of a kv head
// from those of its query heads (cuDNN's backward with grouped-query heads).
// In f32, in a fixed order; a block per (r, j), its threads over d.
__global__ void group_sum_kernel(const __nv_bfloat16 *full, __nv_bfloat16 *out, int64_t rows, int64_t G,
                                 int64_t D) {
  for (int64_t rj = blockIdx.x; rj < rows; rj += gridDim.x) {
    const __nv_bfloat16 *src = full + rj * G * D;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t g = 0; g < G; ++g) acc += __bfloat162float(src[g * D + d]);
      out[rj * D + d] = __float2bfloat16_rn(acc);
    }
  }
}

// Rounds up to 256 bytes: where the workspace tensors start.
int64_t round256(int64_t n) { return (n + 255) / 256 * 256; }

// The plan of shape s in direction dir (0 forward, 1 backward), built at its
// first launch, or null (said once) when cuDNN does not take it here.
SdpaPlan *plan_of(CudnnAttention &a, int dir, const SdpaShape &s, int64_t extra_workspace, cudaStream_t stream) {
  auto it = a.plans[dir].find(s);
  if (it == a.plans[dir].end()) {
    const char *name = dir == 0 ? "forward" : "backward";
    // Building a plan may load modules and allocate: never inside a capture.
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (!CTR_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap))) return nullptr;
    if (cap != cudaStreamCaptureStatusNone) {
      a.say_once(std::string("attention ") + name + " of a shape first seen inside a CUDA graph capture: "
                 "captured on the own kernels");
      return nullptr;
    }
    auto plan = dir == 0 ? sdpa_forward_plan(*a.api, a.handle, nullptr, s)
                         : sdpa_backward_plan(*a.api, a.handle, nullptr, s);
    const int64_t need = round256(plan->workspace) + extra_workspace;
    if (plan->why.empty() && need > a.workspace_bytes) {
      // Too little memory is a refusal of this shape, not a fault.
      void *w = nullptr;
      if (const cudaError_t e = cudaMalloc(&w, static_cast<size_t>(need)); e != cudaSuccess) {
        cudaGetLastError();  // not sticky: out of memory
        plan->why = "its workspace of " + std::to_string(need) + " bytes cannot be allocated (" +
                    cudaGetErrorString(e) + ")";
      } else {
        if (a.workspace) a.retired.push_back(a.workspace);
        a.workspace = w;
        a.workspace_bytes = need;
      }
    }
    const std::string dims = "B " + std::to_string(s.B) + ", T " + std::to_string(s.T) + ", heads " +
                             std::to_string(s.Hq) + "/" + std::to_string(s.Hkv) + ", head dim " +
                             std::to_string(s.D) + (s.causal ? ", causal" : "");
    if (plan->why.empty()) {
      if (!a.said_on[dir]) {
        a.said_on[dir] = true;
        a.say_once(std::string("attention ") + name + " runs on cuDNN " + cudnn_version_string(a.api->version) +
                   "'s fused SDPA (" + plan->engine + "; " + dims + ", workspace " + std::to_string(need) +
                   " bytes; from " + a.api->path + ")");
      }
    } else {
      a.say_once(std::string("attention ") + name + " (" + dims + ") takes the own kernels: cuDNN's plan: " +
                 plan->why);
    }
    it = a.plans[dir].emplace(s, std::move(plan)).first;
  }
  return it->second->why.empty() ? it->second.get() : nullptr;
}

// Runs plan with the given tensors (ids and addresses, the workspace last).
// A plan that built but does not run leaves the outputs unwritten: a fault of
// the step (the sticky error), not a fallback.
void run_plan(CudnnAttention &a, SdpaPlan &plan, const char *name, int64_t n, int64_t *uids, void **ptrs) {
  const CudnnApi &api = *a.api;
  void *ws = a.workspace;
  cudnnBackendDescriptor_t pack = nullptr;
  cudnnStatus_t st = api.create_descriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  std::string what = "cudnnBackendCreateDescriptor(VARIANT_PACK)";
  if (st == CUDNN_STATUS_SUCCESS) {
    what = "cudnnBackendSetAttribute(VARIANT_PACK)";
    st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
    if (st == CUDNN_STATUS_SUCCESS)
      st = api.set_attribute(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (st == CUDNN_STATUS_SUCCESS) {
      what = "cudnnBackendFinalize(VARIANT_PACK)";
      st = api.finalize(pack);
    }
    if (st == CUDNN_STATUS_SUCCESS) {
      what = std::string("cudnnBackendExecute (fused SDPA ") + name + ")";
      st = api.execute(a.handle, plan.plan, pack);
    }
  }
  if (pack) api.destroy_descriptor(pack);
  if (st != CUDNN_STATUS_SUCCESS) note_error(what.c_str(), __FILE__, __LINE__, cudnn_words(api, st).c_str());
}

// The shape of an attention launch whose q is input qi, and whether this path
// takes it: bf16 storage, head dims that are multiples of 8 up to 128 (cuDNN's
// bf16 range on every supported GPU), more than one key (with one the saved
// output is too small for the stats), 16-byte aligned operands. Anything else
// is the own kernels' without a word: not a fault. A sliding window or a
// logit soft-cap (Mistral, Gemma-2) is not in the graphs built here, so such
// attention stays on the own kernels, which honour both.
bool shape_of(const Args &c, int qi, SdpaShape *s) {
  const auto &p = c.params<ctr_attention_params>();
  if ((p.causal != 0 && p.window > 0) || p.softcap > 0.0f) return false;
  s->B = c.in_dim(qi, 0);
  s->T = c.in_dim(qi, 1);
  s->Hq = p.heads;
  s->Hkv = p.kv_heads;
  s->D = c.in_dim(qi, 2) / s->Hq;
  s->causal = p.causal != 0;
  s->scale = p.scale;
  for (int i = 0; i < c.num_inputs(); ++i)
    if (!aligned16(c.in<void>(i)) || (c.in_ref(i).dtype != CTR_DTYPE_BF16 && c.in_ref(i).dtype != CTR_DTYPE_F32))
      return false;
  for (int i = 0; i < c.num_outputs(); ++i)
    if (!aligned16(c.out<void>(i))) return false;
  return c.bf16() && c.in_ref(qi).dtype == CTR_DTYPE_BF16 && s->D % 8 == 0 && s->D <= 128 && s->T > 1 &&
         s->B * s->Hq * s->T > 0;
}

// attention(q, k, v) -> out, probs (the lse in its first B*Hq*T floats).
bool cudnn_forward(AttentionLib *self, const Args &c) {
  auto &a = *static_cast<CudnnAttention *>(self);
  std::lock_guard<std::mutex> lock(a.mu);
  if (!a.off.empty()) {
    a.say_once("attention takes the own kernels: " + a.off);
    return false;
  }
  SdpaShape s{};
  if (!shape_of(c, 0, &s)) return false;
  SdpaPlan *plan = plan_of(a, 0, s, 0, c.stream());
  if (!plan) return false;
  int64_t uids[] = {kSdpaQ, kSdpaK, kSdpaV, kSdpaO, kSdpaStats, kSdpaScale, kSdpaLowest};
  void *ptrs[] = {c.in<void>(0), c.in<void>(1), c.in<void>(2), c.out<void>(0), c.out<void>(1), &plan->scale,
                  &plan->lowest};
  run_plan(a, *plan, "forward", s.causal ? 7 : 6, uids, ptrs);
  return true;
}

// attention_bwd(dout, q, k, v, probs, out) -> dq, dk, dv. The lse in probs is
// the forward's, whichever forward wrote it (the same definition). With
// grouped-query heads cuDNN writes dK and dV per query head into the
// workspace, and group_sum_kernel sums each kv head's group into dk and dv.
bool cudnn_backward(AttentionLib *self, const Args &c) {
  auto &a = *static_cast<CudnnAttention *>(self);
  std::lock_guard<std::mutex> lock(a.mu);
  if (!a.off.empty()) {
    a.say_once("attention takes the own kernels: " + a.off);
    return false;
  }
  SdpaShape s{};
  if (c.num_inputs() < 6 || !shape_of(c, 1, &s) || c.in_ref(5).dtype != CTR_DTYPE_BF16 ||
      c.in_ref(0).dtype != CTR_DTYPE_BF16)
    return false;
  // Workspace after the plan's own: the row sums, dQ's accumulator and, with
  // grouped-query heads, dK and dV per query head.
  const bool grouped = s.Hq != s.Hkv;
  const int64_t delta_bytes = round256(s.B * s.Hq * s.T * 4), acc_bytes = round256(s.B * s.T * s.Hq * s.D * 4),
                full_bytes = grouped ? round256(s.B * s.T * s.Hq * s.D * 2) : 0;
  SdpaPlan *plan = plan_of(a, 1, s, delta_bytes + acc_bytes + 2 * full_bytes, c.stream());
  if (!plan) return false;
  char *base = static_cast<char *>(a.workspace) + round256(plan->workspace);
  void *delta = base, *acc = base + delta_bytes;
  void *dk = grouped ? base + delta_bytes + acc_bytes : c.out<void>(1);
  void *dv = grouped ? base + delta_bytes + acc_bytes + full_bytes : c.out<void>(2);
  if (!CTR_CUDA_CHECK(cudaMemsetAsync(acc, 0, static_cast<size_t>(acc_bytes), c.stream()))) return true;
  int64_t uids[] = {kSdpaQ,     kSdpaK,      kSdpaKRows, kSdpaV,     kSdpaO,      kSdpaDO,    kSdpaStats,
                    kSdpaDelta, kSdpaDQAcc,  kSdpaDQ,    kSdpaDK,    kSdpaDV,     kSdpaScale, kSdpaLowest};
  void *ptrs[] = {c.in<void>(1), c.in<void>(2), c.in<void>(2), c.in<void>(3),  c.in<void>(5),
                  c.in<void>(0), c.in<void>(4), delta,         acc,            c.out<void>(0),
                  dk,            dv,            &plan->scale, &plan->lowest};
  run_plan(a, *plan, "backward", s.causal ? 14 : 13, uids, ptrs);
  if (grouped) {
    const int64_t rows = s.B * s.T * s.Hkv, G = s.Hq / s.Hkv;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20));
    CTR_LAUNCH(group_sum_kernel, grid, 128, 0, c.stream())(static_cast<const __nv_bfloat16 *>(dk),
                                                           c.out<__nv_bfloat16>(1), rows, G, s.D);
    CTR_LAUNCH(group_sum_kernel, grid, 128, 0, c.stream())(static_cast<const __nv_bfloat16 *>(dv),
                                                           c.out<__nv_bfloat16>(2), rows, G, s.D);
  }
  return true;
}

}  // namespace

AttentionLib *cudnn_attention_create(cudaStream_t stream, int knob) {
  auto a = std::make_unique<CudnnAttention>();
  a->forward = cudnn_forward;
  a->backward = cudnn_backward;
  a->stream = stream;
  if (knob == 0) {
    a->off = "CTR_CUDNN=0";
    return a.release();
  }
  std::string why;
  a->api = cudnn_api(&why);
  if (!a->api) {
    a->off = why;
    return a.release();
  }
  cudnnStatus_t st = a->api->create(&a->handle);
  if (st != CUDNN_STATUS_SUCCESS) {
    a->handle = nullptr;
    a->off = "cudnnCreate: " + cudnn_words(*a->api, st);
    return a.release();
  }
  st = a->api->set_stream(a->handle, stream);
  if (st != CUDNN_STATUS_SUCCESS) a->off = "cudnnSetStream: " + cudnn_words(*a->api, st);
  return a.release();
}

void cudnn_attention_destroy(AttentionLib *lib) { delete static_cast<CudnnAttention *>(lib); }

}  // namespace ctr::cuda
