// The CPU backend: the reference every other backend is tested against.
//
// Kernels: each op's kernel in kernels/cpu behind a small binding that reads
// shapes from the resolved tensor refs and attributes from the op's decoded
// parameter struct. Bindings are registered by op name once and looked up by op
// id, so a launch is an indirect call and nothing more.
//
// Streams: stream 0 runs work on the calling thread as it is launched (each
// kernel spreads over the process thread pool). Every further stream is a
// worker thread draining a queue, so a collective queued there is progressed
// while stream 0 computes. Events are generation counters: a record bumps the
// event's target generation and, when the stream reaches that point, its
// completed generation; a wait blocks (the caller for stream 0, the worker for
// others) until the completed generation reaches the target seen at the wait.
//
// Memory: once a communicator of this process reads shared host allocations
// in place (comm/shared_host.h: its ranks share this host), allocations of
// kSharedBytes or more are such allocations, so that its collectives read
// parameters, gradients and the arena in place (one copy per byte instead of
// two). The mesh is made before the step allocates.
//
// Fenced mode (a test backend): memory comes from mmap and is mapped PROT_NONE
// whenever no backend call or queued task is running, so any host code that
// dereferences step memory outside the backend faults at once.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/host_worker.h"
#include "comm/shared_host.h"
#include "common/op_params.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "graph/ops.h"

namespace ctr {
namespace {

using Shape = std::span<const int64_t>;

int64_t numel(Shape s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// What a binding reads: the resolved tensors and the decoded parameters.
struct Args {
  const ctr_kernel_args *a;
  template <typename T>
  T *in(int i) const { return static_cast<T *>(a->inputs[i].data); }
  template <typename T>
  T *out(int i) const { return static_cast<T *>(a->outputs[i].data); }
  Shape in_shape(int i) const { return {a->inputs[i].shape, static_cast<size_t>(a->inputs[i].ndim)}; }
  Shape out_shape(int i) const { return {a->outputs[i].shape, static_cast<size_t>(a->outputs[i].ndim)}; }
  int num_inputs() const { return a->num_inputs; }
  int num_outputs() const { return a->num_outputs; }
  template <typename P>
  const P &params() const { return *static_cast<const P *>(a->params); }
};

// ---------------------------------------------------------------------------
// bf16 storage (precision bf16). The kernels compute in f32; a kernel without
// bf16 code of its own runs on f32 copies of its bf16 tensors: inputs widened
// exactly into per-thread scratch, outputs written to scratch by the f32 kernel,
// and the bf16 outputs rounded back to nearest even. f32 tensors (statistics,
// parameter gradients) are used in place. The GEMMs have bf16 code (oneDNN);
// the norms, rope, attention, the cross-entropy and the embedding lookup read
// and write bf16 rows themselves (each row or head widened into f32 in cache,
// computed by the f32 code, rounded once), which saves the whole-tensor copies
// through memory (a 50k-word table was widened whole for a lookup of a few
// hundred rows). All but attention give the same bits as widened copies;
// attention's GEMMs on contiguous heads may round differently within f32 (see
// kernels/cpu/attention.cc).

bool any_bf16(const ctr_kernel_args *a) {
  for (int i = 0; i < a->num_inputs; ++i)
    if (a->inputs[i].dtype == CTR_DTYPE_BF16) return true;
  for (int i = 0; i < a->num_outputs; ++i)
    if (a->outputs[i].dtype == CTR_DTYPE_BF16) return true;
  return false;
}

struct Scratch {
  std::vector<std::vector<float>> bufs;
  std::vector<ctr_tensor_ref> refs;
};

template <void (*F)(const Args &)>
void widened(const ctr_kernel_args *a) {
  thread_local Scratch s;
  const int n = a->num_inputs + a->num_outputs;
  if (s.bufs.size() < static_cast<size_t>(n)) s.bufs.resize(static_cast<size_t>(n));
  s.refs.assign(a->inputs, a->inputs + a->num_inputs);
  s.refs.insert(s.refs.end(), a->outputs, a->outputs + a->num_outputs);
  for (int i = 0; i < n; ++i) {
    ctr_tensor_ref &r = s.refs[static_cast<size_t>(i)];
    if (r.dtype != CTR_DTYPE_BF16 || !r.data) continue;
    std::vector<float> &b = s.bufs[static_cast<size_t>(i)];
    if (b.size() < static_cast<size_t>(r.numel)) b.resize(static_cast<size_t>(r.numel));
    // Only inputs: a bf16 output is an activation or an activation's gradient,
    // which every kernel overwrites whole (only parameter gradients accumulate,
    // and those are f32), so its old contents are never read. Widening it too
    // cost a tenth of a bf16 gpt step in memory traffic.
    if (i < a->num_inputs) cpu::bf16_to_f32(static_cast<const uint16_t *>(r.data), b.data(), r.numel);
    r.data = b.data();
    r.dtype = CTR_DTYPE_F32;
    r.bytes = r.numel * 4;
  }
  ctr_kernel_args w = *a;
  w.inputs = s.refs.data();
  w.outputs = s.refs.data() + a->num_inputs;
  F(Args{&w});
  for (int i = 0; i < a->num_outputs; ++i) {
    const ctr_tensor_ref &r = a->outputs[i];
    if (r.dtype == CTR_DTYPE_BF16 && r.data)
      cpu::f32_to_bf16(s.bufs[static_cast<size_t>(a->num_inputs + i)].data(), static_cast<uint16_t *>(r.data),
                       r.numel);
  }
}

// An element-wise kernel on bf16 data (every tensor of one shape, element i of
// each output depending on element i of each input alone): run over chunks of
// kChunk elements, each widened into scratch that stays in the core's cache,
// computed and rounded back, instead of widening whole tensors through memory.
// The same f32 arithmetic and rounding as `widened`; chunks are cut at fixed
// multiples of kChunk, so the bits do not depend on the thread count.
constexpr int64_t kChunk = 4096;

bool same_shapes(const ctr_kernel_args *a) {
  const ctr_tensor_ref &r0 = a->outputs[0];
  auto same = [&](const ctr_tensor_ref &r) {
    return r.data && r.ndim == r0.ndim && std::equal(r.shape, r.shape + r.ndim, r0.shape);
  };
  for (int i = 0; i < a->num_inputs; ++i)
    if (!same(a->inputs[i])) return false;
  for (int i = 0; i < a->num_outputs; ++i)
    if (!same(a->outputs[i])) return false;
  return true;
}

template <void (*F)(const Args &)>
void elementwise_chunks(const ctr_kernel_args *a) {
  const int n = a->num_inputs + a->num_outputs;
  const int64_t total = a->outputs[0].numel;
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  ctr::parallel_for(chunks, 8, [=](int64_t c0, int64_t c1) {
    thread_local std::vector<float> buf;
    thread_local std::vector<ctr_tensor_ref> refs;
    if (buf.size() < static_cast<size_t>(n * kChunk)) buf.resize(static_cast<size_t>(n * kChunk));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t off = c * kChunk, len = std::min(kChunk, total - off);
      refs.assign(a->inputs, a->inputs + a->num_inputs);
      refs.insert(refs.end(), a->outputs, a->outputs + a->num_outputs);
      for (int i = 0; i < n; ++i) {
        ctr_tensor_ref &r = refs[static_cast<size_t>(i)];
        const bool b16 = r.dtype == CTR_DTYPE_BF16;
        char *base = static_cast<char *>(r.data) + off * (b16 ? 2 : 4);
        float *scratch = buf.data() + i * kChunk;
        if (b16 && i < a->num_inputs) cpu::bf16_to_f32(reinterpret_cast<const uint16_t *>(base), scratch, len);
        r.data = b16 ? scratch : reinterpret_cast<float *>(base);
        r.dtype = CTR_DTYPE_F32;
        r.numel = len;
        r.bytes = len * 4;
        r.ndim = 1;
        r.shape[0] = len;
      }
      ctr_kernel_args w = *a;
      w.inputs = refs.data();
      w.outputs = refs.data() + a->num_inputs;
      F(Args{&w});  // its own parallel_for runs serially here (nested)
      for (int i = 0; i < a->num_outputs; ++i) {
        const ctr_tensor_ref &r = a->outputs[i];
        if (r.dtype == CTR_DTYPE_BF16)
          cpu::f32_to_bf16(buf.data() + (a->num_inputs + i) * kChunk, static_cast<uint16_t *>(r.data) + off, len);
      }
    }
  });
}

// An element-wise kernel: chunked in bf16 where every tensor has one shape,
// else as bind does.
template <void (*F)(const Args &)>
void bind_ew(const ctr_kernel_args *a, void *) {
  if (!any_bf16(a))
    F(Args{a});
  else if (same_shapes(a))
    elementwise_chunks<F>(a);
  else
    widened<F>(a);
}

template <void (*F)(const Args &)>
void bind(const ctr_kernel_args *a, void *) {
  if (any_bf16(a))
    widened<F>(a);
  else
    F(Args{a});
}

// A kernel with bf16 code of its own (oneDNN's GEMMs, or kernels that read and
// write bf16 rows themselves): F16 returns false for a mix of dtypes it does
// not take (or, for a GEMM, a build without oneDNN), which then goes the
// widened way.
template <bool (*F16)(const Args &), void (*F)(const Args &)>
void bind16(const ctr_kernel_args *a, void *) {
  if (!any_bf16(a))
    F(Args{a});
  else if (!F16(Args{a}))
    widened<F>(a);
}

bool is16(const ctr_tensor_ref &r) { return r.dtype == CTR_DTYPE_BF16; }
bool is32(const ctr_tensor_ref &r) { return r.dtype == CTR_DTYPE_F32; }

// ---------------------------------------------------------------------------
// Kernel bindings

void k_embedding(const Args &c) {
  const auto &t = c.in_shape(0);
  cpu::embedding_fwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[0], t[1]);
}
// A bf16 table's rows copied into bf16 output rows (what widening and
// rounding back would give).
bool k16_embedding(const Args &c) {
  if (!is16(c.a->inputs[0]) || !is16(c.a->outputs[0])) return false;
  const auto &t = c.in_shape(0);
  cpu::embedding_fwd_bf16(c.in<int32_t>(1), c.in<uint16_t>(0), c.out<uint16_t>(0), numel(c.in_shape(1)), t[1]);
  return true;
}
void k_embedding_bwd(const Args &c) {
  const auto &t = c.out_shape(0);
  cpu::embedding_bwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[0], t[1], false,
                     c.params<ctr_embedding_params>().padding_idx);
}
void k_linear(const Args &c) {
  const auto &w = c.in_shape(1);
  int64_t M = numel(c.in_shape(0)) / w[1];
  cpu::linear_fwd(c.in<float>(0), c.in<float>(1), c.num_inputs() > 2 ? c.in<float>(2) : nullptr,
                  c.out<float>(0), M, w[1], w[0]);
}
void k_linear_bwd_x(const Args &c) {
  const auto &w = c.in_shape(1);
  int64_t M = numel(c.in_shape(0)) / w[0];
  cpu::linear_bwd_x(c.in<float>(0), c.in<float>(1), c.out<float>(0), M, w[1], w[0]);
}
void k_linear_bwd_w(const Args &c) {
  const auto &w = c.out_shape(0);
  int64_t M = numel(c.in_shape(1)) / w[1];
  cpu::linear_bwd_w(c.in<float>(0), c.in<float>(1), c.out<float>(0), M, w[1], w[0], false);
}
void k_linear_bwd_b(const Args &c) {
  int64_t N = c.out_shape(0)[0];
  cpu::linear_bwd_b(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)) / N, N, false);
}
// bf16 GEMMs: bf16 operands, f32 accumulation, the output in its own dtype.
bool k16_linear(const Args &c) {
  const auto &r = c.a->inputs;
  if (!cpu::have_dnnl() || !is16(r[0]) || !is16(r[1]) ||
      (c.num_inputs() > 2 && r[2].dtype != c.a->outputs[0].dtype))
    return false;
  const auto &w = c.in_shape(1);
  const int64_t M = numel(c.in_shape(0)) / w[1];
  cpu::gemm_bf16(false, true, M, w[0], w[1], c.in<uint16_t>(0), w[1], c.in<uint16_t>(1), w[1], c.out<void>(0), w[0],
                 is16(c.a->outputs[0]), c.num_inputs() > 2 ? c.in<void>(2) : nullptr);
  return true;
}
bool k16_linear_bwd_x(const Args &c) {
  if (!cpu::have_dnnl() || !is16(c.a->inputs[0]) || !is16(c.a->inputs[1])) return false;
  const auto &w = c.in_shape(1);  // [N, K]
  const int64_t M = numel(c.in_shape(0)) / w[0];
  cpu::gemm_bf16(false, false, M, w[1], w[0], c.in<uint16_t>(0), w[0], c.in<uint16_t>(1), w[1], c.out<void>(0), w[1],
                 is16(c.a->outputs[0]), nullptr);
  return true;
}
bool k16_linear_bwd_w(const Args &c) {
  if (!cpu::have_dnnl() || !is16(c.a->inputs[0]) || !is16(c.a->inputs[1])) return false;
  const auto &w = c.out_shape(0);  // [N, K]
  const int64_t M = numel(c.in_shape(1)) / w[1];
  cpu::gemm_bf16(true, false, w[0], w[1], M, c.in<uint16_t>(0), w[0], c.in<uint16_t>(1), w[1], c.out<void>(0), w[1],
                 is16(c.a->outputs[0]), nullptr);
  return true;
}
bool k16_linear_bwd_b(const Args &c) {
  if (!is16(c.a->inputs[0]) || c.a->outputs[0].dtype != CTR_DTYPE_F32) return false;
  const int64_t N = c.out_shape(0)[0];
  cpu::linear_bwd_b_bf16(c.in<uint16_t>(0), c.out<float>(0), numel(c.in_shape(0)) / N, N, false);
  return true;
}
// The cast of the precision pass: f32 <-> bf16, or a copy.
void k_cast(const ctr_kernel_args *a, void *) {
  const ctr_tensor_ref &x = a->inputs[0], &y = a->outputs[0];
  if (x.dtype == y.dtype)
    cpu::copy(x.data, y.data, x.bytes);
  else if (is16(y))
    cpu::f32_to_bf16(static_cast<const float *>(x.data), static_cast<uint16_t *>(y.data), x.numel);
  else
    cpu::bf16_to_f32(static_cast<const uint16_t *>(x.data), static_cast<float *>(y.data), x.numel);
}
struct MatmulDims { int64_t batch, M, K, N; bool shared; };
MatmulDims matmul_dims(Shape a, Shape b) {
  MatmulDims d;
  d.M = a[a.size() - 2];
  d.K = a.back();
  d.N = b.back();
  d.batch = numel(a) / (d.M * d.K);
  d.shared = b.size() == 2;
  return d;
}
void k_matmul(const Args &c) {
  auto d = matmul_dims(c.in_shape(0), c.in_shape(1));
  cpu::matmul_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), d.batch, d.M, d.K, d.N, d.shared);
}
void k_matmul_bwd(const Args &c) {
  auto d = matmul_dims(c.in_shape(1), c.in_shape(2));
  cpu::matmul_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                  d.batch, d.M, d.K, d.N, d.shared);
}
// Broadcasting arithmetic. The row layout (b a trailing part of a, or one
// element, and the output a's shape) keeps add's and mul's row kernels; the
// rest goes to the general strided kernel.
cpu::ShapeRef ref(Shape s) { return {s.data(), static_cast<int>(s.size())}; }
bool row_layout(Shape out, Shape a, Shape b) {
  if (!std::equal(out.begin(), out.end(), a.begin(), a.end())) return false;
  if (numel(b) == 1) return true;
  return b.size() <= a.size() && std::equal(b.begin(), b.end(), a.end() - static_cast<long>(b.size()));
}
template <cpu::Binary B>
void k_binary(const Args &c) {
  const Shape a = c.in_shape(0), b = c.in_shape(1), o = c.out_shape(0);
  if (B == cpu::Binary::Add && row_layout(o, a, b)) {
    cpu::add_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(a), numel(b));
  } else if (B == cpu::Binary::Mul && row_layout(o, a, b)) {
    cpu::mul_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(a), numel(b));
  } else {
    cpu::binary_fwd(B, c.in<float>(0), ref(a), c.in<float>(1), ref(b), c.out<float>(0), ref(o));
  }
}
void k_div_bwd_b(const Args &c) {
  cpu::div_bwd_b(c.in<float>(0), c.in<float>(1), c.in<float>(2), ref(c.in_shape(2)), c.out<float>(0),
                 ref(c.out_shape(0)));
}
void k_reduce_to(const Args &c) {
  cpu::reduce(cpu::Reduction::Sum, c.in<float>(0), ref(c.in_shape(0)), c.out<float>(0), ref(c.out_shape(0)));
}
void k_masked_fill(const Args &c) {
  cpu::masked_fill(c.in<float>(0), c.in<float>(1), ref(c.in_shape(1)), c.out<float>(0), ref(c.in_shape(0)),
                   c.params<ctr_masked_fill_params>().value);
}
void k_expand(const Args &c) {
  cpu::broadcast_to(c.in<float>(0), ref(c.in_shape(0)), c.out<float>(0), ref(c.out_shape(0)));
}

// Reductions: x's shape with the reduced dims set to 1 (the keepdim shape,
// which has the output's elements in the output's order).
struct KeptShape {
  int64_t dims[cpu::kMaxDims];
  int rank;
  int64_t n;  // elements reduced into one output
  cpu::ShapeRef ref() const { return {dims, rank}; }
};
KeptShape kept_shape(Shape x, const ctr_reduce_params &p) {
  KeptShape k;
  k.rank = static_cast<int>(x.size());
  k.n = 1;
  for (int i = 0; i < k.rank; ++i) k.dims[i] = x[i];
  for (int i = 0; i < p.ndims; ++i) {
    const int d = p.dims[i] < 0 ? p.dims[i] + k.rank : p.dims[i];
    k.n *= x[d];
    k.dims[d] = 1;
  }
  return k;
}
template <cpu::Reduction R>
void k_reduce(const Args &c) {
  const auto &p = c.params<ctr_reduce_params>();
  const KeptShape k = kept_shape(c.in_shape(0), p);
  cpu::reduce(R, c.in<float>(0), ref(c.in_shape(0)), c.out<float>(0), k.ref(), p.correction,
              R == cpu::Reduction::Var ? c.out<float>(1) : nullptr);
}
// sum_bwd, mean_bwd: the gradient broadcast back (over N for mean).
template <bool Mean>
void k_reduce_bcast_bwd(const Args &c) {
  const KeptShape k = kept_shape(c.out_shape(0), c.params<ctr_reduce_params>());
  cpu::broadcast_to(c.in<float>(0), k.ref(), c.out<float>(0), ref(c.out_shape(0)),
                    Mean ? 1.0f / static_cast<float>(k.n) : 1.0f);
}
void k_amax_bwd(const Args &c) {
  const KeptShape k = kept_shape(c.out_shape(0), c.params<ctr_reduce_params>());
  cpu::amax_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), ref(c.out_shape(0)), k.ref());
}
void k_var_bwd(const Args &c) {
  const auto &p = c.params<ctr_reduce_params>();
  const KeptShape k = kept_shape(c.out_shape(0), p);
  cpu::var_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), ref(c.out_shape(0)), k.ref(),
               p.correction);
}
void k_reduce_rows(const Args &c) {
  cpu::reduce_rows(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)), numel(c.out_shape(0)), false);
}
void k_mul_bwd(const Args &c) {
  cpu::mul_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
               numel(c.in_shape(1)), numel(c.in_shape(2)), false);
}
void k_add_same(const Args &c) {
  cpu::add_same(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
float eps_of(const Args &c) { return c.params<ctr_norm_params>().eps; }
void k_layernorm(const Args &c) {
  const auto &x = c.in_shape(0);
  int64_t C = x.back();
  cpu::layernorm_fwd(c.in<float>(0), c.in<float>(1), c.num_inputs() > 2 ? c.in<float>(2) : nullptr,
                     c.out<float>(0), c.out<float>(1), c.out<float>(2), numel(x) / C, C, eps_of(c));
}
void k_layernorm_bwd(const Args &c) {
  const auto &x = c.in_shape(1);
  int64_t C = x.back();
  cpu::layernorm_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                     c.out<float>(0), c.out<float>(1), c.num_outputs() > 2 ? c.out<float>(2) : nullptr,
                     numel(x) / C, C, false);
}
void k_rmsnorm(const Args &c) {
  const auto &x = c.in_shape(0);
  int64_t C = x.back();
  cpu::rmsnorm_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), c.out<float>(1), numel(x) / C, C, eps_of(c));
}
void k_rmsnorm_bwd(const Args &c) {
  const auto &x = c.in_shape(1);
  int64_t C = x.back();
  cpu::rmsnorm_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.out<float>(0),
                   c.out<float>(1), numel(x) / C, C, false);
}
// bf16 activations and their gradients; the norm's weight and bias f32 or
// their bf16 copies (widened here, exactly: one row of C); statistics and
// weight gradients f32.
bool is16or32(const ctr_tensor_ref &r) { return is16(r) || is32(r); }
// Input i as f32: itself, or widened into this thread's buffer `slot`.
const float *weight_f32(const Args &c, int i, int slot) {
  const ctr_tensor_ref &r = c.a->inputs[i];
  if (is32(r)) return static_cast<const float *>(r.data);
  thread_local std::vector<float> buf[2];
  std::vector<float> &b = buf[slot];
  if (b.size() < static_cast<size_t>(r.numel)) b.resize(static_cast<size_t>(r.numel));
  cpu::bf16_to_f32(static_cast<const uint16_t *>(r.data), b.data(), r.numel);
  return b.data();
}
bool k16_layernorm(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16or32(r[1]) || (c.num_inputs() > 2 && !is16or32(r[2])) || !is16(o[0]) || !is32(o[1]) ||
      !is32(o[2]))
    return false;
  const auto &x = c.in_shape(0);
  const int64_t C = x.back();
  cpu::layernorm_fwd_bf16(c.in<uint16_t>(0), weight_f32(c, 1, 0), c.num_inputs() > 2 ? weight_f32(c, 2, 1) : nullptr,
                          c.out<uint16_t>(0), c.out<float>(1), c.out<float>(2), numel(x) / C, C, eps_of(c));
  return true;
}
bool k16_layernorm_bwd(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16(r[1]) || !is16or32(r[2]) || !is32(r[3]) || !is32(r[4]) || !is16(o[0]) ||
      !is32(o[1]) || (c.num_outputs() > 2 && !is32(o[2])))
    return false;
  const auto &x = c.in_shape(1);
  const int64_t C = x.back();
  cpu::layernorm_bwd_bf16(c.in<uint16_t>(0), c.in<uint16_t>(1), weight_f32(c, 2, 0), c.in<float>(3),
                          c.in<float>(4), c.out<uint16_t>(0), c.out<float>(1),
                          c.num_outputs() > 2 ? c.out<float>(2) : nullptr, numel(x) / C, C, false);
  return true;
}
bool k16_rmsnorm(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16or32(r[1]) || !is16(o[0]) || !is32(o[1])) return false;
  const auto &x = c.in_shape(0);
  const int64_t C = x.back();
  cpu::rmsnorm_fwd_bf16(c.in<uint16_t>(0), weight_f32(c, 1, 0), c.out<uint16_t>(0), c.out<float>(1), numel(x) / C,
                        C, eps_of(c));
  return true;
}
bool k16_rmsnorm_bwd(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16(r[1]) || !is16or32(r[2]) || !is32(r[3]) || !is16(o[0]) || !is32(o[1])) return false;
  const auto &x = c.in_shape(1);
  const int64_t C = x.back();
  cpu::rmsnorm_bwd_bf16(c.in<uint16_t>(0), c.in<uint16_t>(1), weight_f32(c, 2, 0), c.in<float>(3),
                        c.out<uint16_t>(0), c.out<float>(1), numel(x) / C, C, false);
  return true;
}
void k_gelu(const Args &c) {
  if (c.params<ctr_gelu_params>().exact)
    cpu::gelu_exact_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)));
  else
    cpu::gelu_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)));
}
void k_gelu_bwd(const Args &c) {
  if (c.params<ctr_gelu_params>().exact)
    cpu::gelu_exact_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
  else
    cpu::gelu_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_silu(const Args &c) { cpu::silu_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0))); }
void k_silu_bwd(const Args &c) {
  cpu::silu_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_geglu(const Args &c) {
  cpu::geglu_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)),
                 c.params<ctr_gelu_params>().exact != 0);
}
void k_geglu_bwd(const Args &c) {
  cpu::geglu_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                 numel(c.in_shape(0)), c.params<ctr_gelu_params>().exact != 0);
}
void k_swiglu(const Args &c) {
  cpu::swiglu_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_swiglu_bwd(const Args &c) {
  cpu::swiglu_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                  numel(c.in_shape(0)));
}
// Unary math: input 0 is x (forward) or the output gradient (backward), input 1
// what the backward reads (none for neg_bwd).
// The op's parameters for cpu::unary_fwd/bwd: pow's exponent, clamp's bounds.
template <cpu::Unary U>
std::pair<float, float> unary_params(const Args &c) {
  if constexpr (U == cpu::Unary::Pow) return {c.params<ctr_pow_params>().exponent, 0.0f};
  if constexpr (U == cpu::Unary::Clamp) return {c.params<ctr_clamp_params>().min, c.params<ctr_clamp_params>().max};
  (void)c;
  return {0.0f, 0.0f};
}
template <cpu::Unary U>
void k_unary(const Args &c) {
  const auto [p, q] = unary_params<U>(c);
  cpu::unary_fwd(U, c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)), p, q);
}
template <cpu::Unary U>
void k_unary_bwd(const Args &c) {
  const auto [p, q] = unary_params<U>(c);
  cpu::unary_bwd(U, c.in<float>(0), c.num_inputs() > 1 ? c.in<float>(1) : nullptr, c.out<float>(0),
                 numel(c.in_shape(0)), p, q);
}
// softmax and log_softmax see x as [outer, C, inner] around their dim; inner
// is 1 for the last dim, which keeps softmax's row kernels.
struct DimSplit { int64_t outer, C, inner; };
DimSplit dim_split(Shape x, const ctr_softmax_params &p) {
  const int r = static_cast<int>(x.size()), d = p.dim < 0 ? p.dim + r : p.dim;
  DimSplit s{1, x[d], 1};
  for (int i = 0; i < d; ++i) s.outer *= x[i];
  for (int i = d + 1; i < r; ++i) s.inner *= x[i];
  return s;
}
void k_softmax(const Args &c) {
  const auto s = dim_split(c.in_shape(0), c.params<ctr_softmax_params>());
  if (s.inner == 1)
    cpu::softmax_fwd(c.in<float>(0), c.out<float>(0), s.outer, s.C);
  else
    cpu::softmax_dim_fwd(c.in<float>(0), c.out<float>(0), s.outer, s.C, s.inner);
}
void k_softmax_bwd(const Args &c) {
  const auto s = dim_split(c.in_shape(0), c.params<ctr_softmax_params>());
  if (s.inner == 1)
    cpu::softmax_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), s.outer, s.C);
  else
    cpu::softmax_dim_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), s.outer, s.C, s.inner);
}
void k_log_softmax(const Args &c) {
  const auto s = dim_split(c.in_shape(0), c.params<ctr_softmax_params>());
  cpu::log_softmax_fwd(c.in<float>(0), c.out<float>(0), s.outer, s.C, s.inner);
}
void k_log_softmax_bwd(const Args &c) {
  const auto s = dim_split(c.in_shape(0), c.params<ctr_softmax_params>());
  cpu::log_softmax_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), s.outer, s.C, s.inner);
}
struct RopeDims { int64_t B, T, H, D; float theta; bool interleaved; int64_t cp_ranks, cp_index; };
RopeDims rope_dims(const Args &c) {
  const auto &x = c.in_shape(0);
  RopeDims d;
  d.B = x[0];
  d.T = x[1];
  const auto &p = c.params<ctr_rope_params>();
  d.H = p.heads;
  d.D = x[2] / d.H;
  d.theta = p.theta;
  d.interleaved = p.interleaved != 0;
  d.cp_ranks = p.cp_ranks;
  d.cp_index = p.cp_index;
  return d;
}
void k_rope(const Args &c) {
  auto d = rope_dims(c);
  cpu::rope_fwd(c.in<float>(0), c.out<float>(0), d.B, d.T, d.H, d.D, d.theta, d.interleaved, d.cp_ranks,
                d.cp_index);
}
void k_rope_bwd(const Args &c) {
  auto d = rope_dims(c);
  cpu::rope_bwd(c.in<float>(0), c.out<float>(0), d.B, d.T, d.H, d.D, d.theta, d.interleaved, d.cp_ranks,
                d.cp_index);
}
bool k16_rope(const Args &c) {
  if (!is16(c.a->inputs[0]) || !is16(c.a->outputs[0])) return false;
  auto d = rope_dims(c);
  cpu::rope_fwd_bf16(c.in<uint16_t>(0), c.out<uint16_t>(0), d.B, d.T, d.H, d.D, d.theta, d.interleaved,
                     d.cp_ranks, d.cp_index);
  return true;
}
bool k16_rope_bwd(const Args &c) {
  if (!is16(c.a->inputs[0]) || !is16(c.a->outputs[0])) return false;
  auto d = rope_dims(c);
  cpu::rope_bwd_bf16(c.in<uint16_t>(0), c.out<uint16_t>(0), d.B, d.T, d.H, d.D, d.theta, d.interleaved,
                     d.cp_ranks, d.cp_index);
  return true;
}
struct AttnDims { int64_t B, T, Hq, Hkv, D; float scale; bool causal; int64_t window; float softcap; };
AttnDims attn_dims(const Args &c, int q_input) {
  const auto &q = c.in_shape(q_input);
  AttnDims d;
  d.B = q[0];
  d.T = q[1];
  const auto &p = c.params<ctr_attention_params>();
  d.Hq = p.heads;
  d.Hkv = p.kv_heads;
  d.D = q[2] / d.Hq;
  d.scale = p.scale;
  d.causal = p.causal != 0;
  d.window = p.causal != 0 ? p.window : 0;
  d.softcap = p.softcap;
  return d;
}
void k_attention(const Args &c) {
  auto d = attn_dims(c, 0);
  cpu::attention_fwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                     d.B, d.T, d.Hq, d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap);
}
void k_attention_bwd(const Args &c) {
  auto d = attn_dims(c, 1);
  cpu::attention_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                     c.out<float>(0), c.out<float>(1), c.out<float>(2), d.B, d.T, d.Hq, d.Hkv, d.D,
                     d.scale, d.causal, d.window, d.softcap);
}
bool k16_attention(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16(r[1]) || !is16(r[2]) || !is16(o[0]) || !is32(o[1])) return false;
  auto d = attn_dims(c, 0);
  cpu::attention_fwd_bf16(c.in<uint16_t>(0), c.in<uint16_t>(1), c.in<uint16_t>(2), c.out<uint16_t>(0),
                          c.out<float>(1), d.B, d.T, d.Hq, d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap);
  return true;
}
// (The sixth input, the forward's output, is for cuDNN's backward; not read here.)
bool k16_attention_bwd(const Args &c) {
  const auto &r = c.a->inputs, &o = c.a->outputs;
  if (!is16(r[0]) || !is16(r[1]) || !is16(r[2]) || !is16(r[3]) || !is32(r[4]) || !is16(o[0]) || !is16(o[1]) ||
      !is16(o[2]))
    return false;
  auto d = attn_dims(c, 1);
  cpu::attention_bwd_bf16(c.in<uint16_t>(0), c.in<uint16_t>(1), c.in<uint16_t>(2), c.in<uint16_t>(3),
                          c.in<float>(4), c.out<uint16_t>(0), c.out<uint16_t>(1), c.out<uint16_t>(2), d.B, d.T,
                          d.Hq, d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap);
  return true;
}
void k_cp_attention(const Args &c) {
  auto d = attn_dims(c, 0);
  const auto &p = c.params<ctr_attention_params>();
  cpu::cp_attention_fwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1), d.B,
                        d.T, d.Hq, d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap, p.cp_ranks, p.cp_index);
}
void k_cp_attention_bwd(const Args &c) {
  auto d = attn_dims(c, 1);
  const auto &p = c.params<ctr_attention_params>();
  cpu::cp_attention_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                        c.out<float>(0), c.out<float>(1), c.out<float>(2), d.B, d.T, d.Hq, d.Hkv, d.D, d.scale,
                        d.causal, d.window, d.softcap, p.cp_ranks, p.cp_index);
}
void k_cp_attention_block(const Args &c) {
  auto d = attn_dims(c, 0);
  const auto &p = c.params<ctr_attention_block_params>();
  cpu::cp_attention_block_fwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                              c.out<float>(2), d.B, d.T, d.Hq, d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap,
                              p.attention.cp_ranks, p.attention.cp_index, p.cp_source);
}
void k_cp_attention_block_bwd(const Args &c) {
  auto d = attn_dims(c, 2);
  const auto &p = c.params<ctr_attention_block_params>();
  cpu::cp_attention_block_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                              c.in<float>(5), c.out<float>(0), c.out<float>(1), c.out<float>(2), d.B, d.T, d.Hq,
                              d.Hkv, d.D, d.scale, d.causal, d.window, d.softcap, p.attention.cp_ranks,
                              p.attention.cp_index, p.cp_source);
}
void k_attn_merge(const Args &c) {
  const auto &o = c.in_shape(0);
  const int64_t H = c.params<ctr_attn_merge_params>().heads;
  cpu::attn_merge_fwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.out<float>(0),
                      c.out<float>(1), o[0], o[1], H, o[2] / H);
}
void k_attn_merge_bwd(const Args &c) {
  const auto &o = c.in_shape(1);
  const int64_t H = c.params<ctr_attn_merge_params>().heads;
  cpu::attn_merge_bwd(c.in<float>(0), c.num_inputs() > 7 ? c.in<float>(7) : nullptr, c.in<float>(1),
                      c.in<float>(2), c.in<float>(3), c.in<float>(4), c.in<float>(5), c.in<float>(6),
                      c.out<float>(0), c.out<float>(1), c.out<float>(2), c.out<float>(3), o[0], o[1], H, o[2] / H);
}
void k_cross_entropy(const Args &c) {
  const auto &l = c.in_shape(0);
  int64_t V = l.back();
  cpu::cross_entropy_fwd(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), c.out<float>(1),
                         c.out<int64_t>(2), numel(l) / V, V);
}
void k_cross_entropy_bwd(const Args &c) {
  const auto &l = c.in_shape(1);
  int64_t V = l.back();
  cpu::cross_entropy_bwd(c.in<float>(1), c.in<int32_t>(2), c.in<float>(3), *c.in<float>(0),
                         *c.in<int64_t>(4), c.out<float>(0), numel(l) / V, V);
}
bool k16_cross_entropy(const Args &c) {
  const auto &o = c.a->outputs;
  if (!is16(c.a->inputs[0]) || !is32(o[0]) || !is32(o[1])) return false;
  const auto &l = c.in_shape(0);
  const int64_t V = l.back();
  cpu::cross_entropy_fwd_bf16(c.in<uint16_t>(0), c.in<int32_t>(1), c.out<float>(0), c.out<float>(1),
                              c.out<int64_t>(2), numel(l) / V, V);
  return true;
}
bool k16_cross_entropy_bwd(const Args &c) {
  const auto &r = c.a->inputs;
  if (!is32(r[0]) || !is16(r[1]) || !is32(r[3]) || !is16(c.a->outputs[0])) return false;
  const auto &l = c.in_shape(1);
  const int64_t V = l.back();
  cpu::cross_entropy_bwd_bf16(c.in<uint16_t>(1), c.in<int32_t>(2), c.in<float>(3), *c.in<float>(0),
                              *c.in<int64_t>(4), c.out<uint16_t>(0), numel(l) / V, V);
  return true;
}
void k_vocab_embedding(const Args &c) {
  const auto &t = c.in_shape(0);
  const auto &p = c.params<ctr_vocab_embedding_params>();
  cpu::vocab_embedding_fwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[1], p.offset,
                           p.valid);
}
void k_vocab_embedding_bwd(const Args &c) {
  const auto &t = c.out_shape(0);
  const auto &p = c.params<ctr_vocab_embedding_params>();
  cpu::vocab_embedding_bwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[0], t[1],
                           p.offset, p.valid, p.padding_idx);
}
void k_vocab_ce_stats(const Args &c) {
  const auto &l = c.in_shape(0);
  const auto &p = c.params<ctr_vocab_ce_params>();
  cpu::vocab_ce_stats(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), numel(l) / l.back(), l.back(), p.offset,
                      p.valid);
}
void k_vocab_ce_loss(const Args &c) {
  const auto &p = c.params<ctr_vocab_ce_params>();
  cpu::vocab_ce_loss(c.in<int32_t>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1), c.out<int64_t>(2),
                     numel(c.in_shape(1)), p.ranks);
}
void k_vocab_ce_bwd(const Args &c) {
  const auto &l = c.in_shape(1);
  const auto &p = c.params<ctr_vocab_ce_params>();
  cpu::vocab_ce_bwd(c.in<float>(1), c.in<int32_t>(2), c.in<float>(3), *c.in<float>(0), *c.in<int64_t>(4),
                    c.out<float>(0), numel(l) / l.back(), l.back(), p.offset, p.valid);
}
void k_reshape(const Args &c) {
  cpu::copy(c.in<void>(0), c.out<void>(0), c.a->inputs[0].bytes);
}
void k_transpose(const Args &c) {
  const auto &x = c.in_shape(0);
  const auto &p = c.params<ctr_transpose_params>();
  int perm[8];
  for (int i = 0; i < p.ndim; ++i) perm[i] = p.perm[i];
  if (c.a->inputs[0].dtype == CTR_DTYPE_I32)
    cpu::transpose(c.in<int32_t>(0), c.out<int32_t>(0), x.data(), perm, static_cast<int>(x.size()));
  else
    cpu::transpose(c.in<float>(0), c.out<float>(0), x.data(), perm, static_cast<int>(x.size()));
}
// slice, slice_bwd, cat: sizes resolved at decode (op_params.h).
void k_slice(const Args &c) {
  const auto &p = c.params<ctr_slice_params>();
  cpu::slice_fwd(c.in<void>(0), c.out<void>(0), p.outer, p.size, p.inner, p.start, p.len, p.step);
}
void k_slice_bwd(const Args &c) {
  const auto &p = c.params<ctr_slice_params>();
  cpu::slice_bwd(c.in<float>(0), c.out<float>(0), p.outer, p.size, p.inner, p.start, p.len, p.step);
}
void k_cat(const Args &c) {
  // The registry caps cat's inputs at 1024; the tables live on the stack.
  constexpr int kMax = 1 << 10;
  const void *xs[kMax];
  int64_t widths[kMax];
  const auto &p = c.params<ctr_cat_params>();
  const int n = std::min(c.num_inputs(), kMax);
  for (int k = 0; k < n; ++k) {
    xs[k] = c.in<void>(k);
    widths[k] = p.outer > 0 ? c.a->inputs[k].numel / p.outer : 0;
  }
  cpu::cat_fwd(xs, widths, n, c.out<void>(0), p.outer);
}
void k_take_rows(const Args &c) {
  cpu::copy(c.in<void>(0), c.out<void>(0), c.a->outputs[0].bytes);
}
void k_take_rows_bwd(const Args &c) {
  int64_t n = numel(c.in_shape(0)), total = numel(c.out_shape(0));
  cpu::copy(c.in<void>(0), c.out<void>(0), n * 4);
  cpu::fill(c.out<float>(0) + n, 0.0f, total - n);
}

// Mixture of experts: N tokens and the last dims are read from the tensors.
void k_moe_router(const Args &c) {
  const auto &l = c.in_shape(0);
  const auto &p = c.params<ctr_moe_router_params>();
  const int64_t E = l.back(), k = c.out_shape(0).back();
  cpu::moe_router_fwd(c.in<float>(0), c.out<float>(0), c.out<int32_t>(1), c.out<float>(2), numel(l) / E, E, k,
                      p.sigmoid != 0, p.renorm != 0);
}
void k_moe_router_bwd(const Args &c) {
  const auto &p = c.params<ctr_moe_router_params>();
  const int64_t E = c.in_shape(1).back(), k = c.in_shape(0).back();
  cpu::moe_router_bwd(c.in<float>(0), c.in<float>(1), c.in<int32_t>(2), c.out<float>(0),
                      numel(c.in_shape(1)) / E, E, k, p.sigmoid != 0, p.renorm != 0);
}
void k_moe_aux_loss(const Args &c) {
  const int64_t E = c.in_shape(0).back(), k = c.in_shape(1).back();
  cpu::moe_aux_loss_fwd(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), numel(c.in_shape(0)) / E, E, k,
                        c.params<ctr_moe_loss_params>().coef);
}
void k_moe_aux_loss_bwd(const Args &c) {
  const int64_t E = c.in_shape(1).back(), k = c.in_shape(2).back();
  cpu::moe_aux_loss_bwd(*c.in<float>(0), c.in<float>(1), c.in<int32_t>(2), c.out<float>(0),
                        numel(c.in_shape(1)) / E, E, k, c.params<ctr_moe_loss_params>().coef);
}
void k_moe_z_loss(const Args &c) {
  const int64_t E = c.in_shape(0).back();
  cpu::moe_z_loss_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)) / E, E,
                      c.params<ctr_moe_loss_params>().coef);
}
void k_moe_z_loss_bwd(const Args &c) {
  const int64_t E = c.in_shape(1).back();
  cpu::moe_z_loss_bwd(*c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(1)) / E, E,
                      c.params<ctr_moe_loss_params>().coef);
}
void k_moe_permute(const Args &c) {
  const int64_t D = c.in_shape(0).back(), k = c.in_shape(1).back();
  cpu::moe_permute_fwd(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), c.out<int32_t>(1), c.out<int32_t>(2),
                       numel(c.in_shape(1)) / k, k, D, c.out_shape(1)[0]);
}
void k_moe_permute_bwd(const Args &c) {
  const int64_t D = c.in_shape(0).back(), k = c.in_shape(1).back();
  cpu::moe_permute_bwd(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), numel(c.in_shape(1)) / k, k, D,
                       c.in_shape(0)[0]);
}
void k_moe_grouped_linear(const Args &c) {
  const auto &x = c.in_shape(0), &w = c.in_shape(1);
  cpu::grouped_linear_fwd(c.in<float>(0), c.in<int32_t>(2), c.in_shape(2)[0], c.in<float>(1), c.out<float>(0), x[0],
                          x[1], w[1], w[0]);
}
void k_moe_grouped_linear_bwd(const Args &c) {
  const auto &x = c.in_shape(1), &w = c.in_shape(2);
  cpu::grouped_linear_bwd(c.in<float>(0), c.in<float>(1), c.in<int32_t>(3), c.in_shape(3)[0], c.in<float>(2),
                          c.out<float>(0), c.out<float>(1), x[0], x[1], w[1], w[0],
                          c.params<ctr_grouped_linear_params>().weight_grad_scale);
}
void k_moe_aux_stats(const Args &c) {
  const int64_t E = c.in_shape(0).back(), k = c.in_shape(1).back();
  cpu::moe_aux_stats(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), numel(c.in_shape(0)) / E, E, k);
}
void k_moe_aux_loss_global(const Args &c) {
  const int64_t E = c.in_shape(0).back(), k = c.in_shape(1).back();
  cpu::moe_aux_loss_global_fwd(c.in<float>(2), c.out<float>(0), E, k, c.params<ctr_moe_loss_params>().coef);
}
void k_moe_aux_loss_global_bwd(const Args &c) {
  const int64_t E = c.in_shape(1).back(), k = c.in_shape(2).back();
  cpu::moe_aux_loss_global_bwd(*c.in<float>(0), c.in<float>(1), c.in<float>(3), c.out<float>(0),
                               numel(c.in_shape(1)) / E, E, k, c.params<ctr_moe_loss_params>().coef);
}
void k_moe_unpermute(const Args &c) {
  const auto &yp = c.in_shape(0);
  const int64_t k = c.in_shape(1).back();
  cpu::moe_unpermute_fwd(c.in<float>(0), c.in<int32_t>(2), c.in<float>(1), c.out<float>(0),
                         numel(c.in_shape(1)) / k, k, yp[1], yp[0]);
}
void k_moe_unpermute_bwd(const Args &c) {
  // inputs: dy, yp, slots, weights; outputs: dyp, dweights
  const auto &yp = c.in_shape(1);
  const int64_t k = c.in_shape(3).back();
  cpu::moe_unpermute_bwd(c.in<float>(0), c.in<float>(1), c.in<int32_t>(2), c.in<float>(3), c.out<float>(0),
                         c.out<float>(1), numel(c.in_shape(3)) / k, k, yp[1], yp[0]);
}

// ---------------------------------------------------------------------------
// The kernel table: registered by name, looked up by op id.

struct KernelTable {
  std::mutex mu;
  std::vector<KernelFn> by_id;
};

KernelTable &kernel_table() {
  static KernelTable *t = [] {
    auto *kt = new KernelTable;  // never destroyed: read by backends until exit
    return kt;
  }();
  return *t;
}

void set_kernel(const std::string &op, KernelFn fn) {
  const OpDef *d = find_op(op);
  CTR_REQUIRE(d != nullptr, CTR_STATUS_INVALID_ARGUMENT,
              "register_cpu_kernel: op '%s' is not registered (register_op first)", op.c_str());
  KernelTable &t = kernel_table();
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.by_id.size() <= static_cast<size_t>(d->id)) t.by_id.resize(static_cast<size_t>(d->id) + 1, nullptr);
  t.by_id[static_cast<size_t>(d->id)] = fn;
}

void register_library_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::pair<const char *, KernelFn> k[] = {
        {"embedding", bind16<k16_embedding, k_embedding>},         {"embedding_bwd", bind<k_embedding_bwd>},
        {"linear", bind16<k16_linear, k_linear>}, {"linear_bwd_x", bind16<k16_linear_bwd_x, k_linear_bwd_x>},
        {"linear_bwd_w", bind16<k16_linear_bwd_w, k_linear_bwd_w>}, {"linear_bwd_b", bind16<k16_linear_bwd_b, k_linear_bwd_b>},
        {"cast", k_cast},
        {"matmul", bind<k_matmul>},               {"matmul_bwd", bind<k_matmul_bwd>},
        {"add", bind_ew<k_binary<cpu::Binary::Add>>}, {"reduce_rows", bind<k_reduce_rows>},
        {"sub", bind_ew<k_binary<cpu::Binary::Sub>>}, {"div", bind_ew<k_binary<cpu::Binary::Div>>},
        {"mul", bind_ew<k_binary<cpu::Binary::Mul>>}, {"mul_bwd", bind<k_mul_bwd>},
        {"div_bwd_b", bind<k_div_bwd_b>},         {"reduce_to", bind<k_reduce_to>},
        {"masked_fill", bind<k_masked_fill>},     {"expand", bind<k_expand>},
        {"sum", bind<k_reduce<cpu::Reduction::Sum>>}, {"sum_bwd", bind<k_reduce_bcast_bwd<false>>},
        {"mean", bind<k_reduce<cpu::Reduction::Mean>>}, {"mean_bwd", bind<k_reduce_bcast_bwd<true>>},
        {"amax", bind<k_reduce<cpu::Reduction::Amax>>}, {"amax_bwd", bind<k_amax_bwd>},
        {"var", bind<k_reduce<cpu::Reduction::Var>>}, {"var_bwd", bind<k_var_bwd>},
        {"log_softmax", bind<k_log_softmax>},     {"log_softmax_bwd", bind<k_log_softmax_bwd>},
        {"add_same", bind_ew<k_add_same>},           {"layernorm", bind16<k16_layernorm, k_layernorm>},
        {"layernorm_bwd", bind16<k16_layernorm_bwd, k_layernorm_bwd>}, {"rmsnorm", bind16<k16_rmsnorm, k_rmsnorm>},
        {"rmsnorm_bwd", bind16<k16_rmsnorm_bwd, k_rmsnorm_bwd>},     {"gelu", bind_ew<k_gelu>},
        {"gelu_bwd", bind_ew<k_gelu_bwd>},           {"silu", bind_ew<k_silu>},
        {"silu_bwd", bind_ew<k_silu_bwd>},           {"swiglu", bind_ew<k_swiglu>},
        {"geglu", bind_ew<k_geglu>},                 {"geglu_bwd", bind_ew<k_geglu_bwd>},
        {"swiglu_bwd", bind_ew<k_swiglu_bwd>},       {"softmax", bind<k_softmax>},
        {"softmax_bwd", bind<k_softmax_bwd>},     {"rope", bind16<k16_rope, k_rope>},
        {"exp", bind_ew<k_unary<cpu::Unary::Exp>>},  {"exp_bwd", bind_ew<k_unary_bwd<cpu::Unary::Exp>>},
        {"log", bind_ew<k_unary<cpu::Unary::Log>>},  {"log_bwd", bind_ew<k_unary_bwd<cpu::Unary::Log>>},
        {"tanh", bind_ew<k_unary<cpu::Unary::Tanh>>}, {"tanh_bwd", bind_ew<k_unary_bwd<cpu::Unary::Tanh>>},
        {"erf", bind_ew<k_unary<cpu::Unary::Erf>>},  {"erf_bwd", bind_ew<k_unary_bwd<cpu::Unary::Erf>>},
        {"rsqrt", bind_ew<k_unary<cpu::Unary::Rsqrt>>}, {"rsqrt_bwd", bind_ew<k_unary_bwd<cpu::Unary::Rsqrt>>},
        {"sqrt", bind_ew<k_unary<cpu::Unary::Sqrt>>}, {"sqrt_bwd", bind_ew<k_unary_bwd<cpu::Unary::Sqrt>>},
        {"neg", bind_ew<k_unary<cpu::Unary::Neg>>},  {"neg_bwd", bind_ew<k_unary_bwd<cpu::Unary::Neg>>},
        {"reciprocal", bind_ew<k_unary<cpu::Unary::Reciprocal>>},
        {"reciprocal_bwd", bind_ew<k_unary_bwd<cpu::Unary::Reciprocal>>},
        {"sigmoid", bind_ew<k_unary<cpu::Unary::Sigmoid>>},
        {"sigmoid_bwd", bind_ew<k_unary_bwd<cpu::Unary::Sigmoid>>},
        {"relu", bind_ew<k_unary<cpu::Unary::Relu>>}, {"relu_bwd", bind_ew<k_unary_bwd<cpu::Unary::Relu>>},
        {"clamp", bind_ew<k_unary<cpu::Unary::Clamp>>},
        {"clamp_bwd", bind_ew<k_unary_bwd<cpu::Unary::Clamp>>},
        {"pow", bind_ew<k_unary<cpu::Unary::Pow>>},  {"pow_bwd", bind_ew<k_unary_bwd<cpu::Unary::Pow>>},
        {"rope_bwd", bind16<k16_rope_bwd, k_rope_bwd>},           {"attention", bind16<k16_attention, k_attention>},
        {"attention_bwd", bind16<k16_attention_bwd, k_attention_bwd>}, {"cp_attention", bind<k_cp_attention>},
        {"cp_attention_bwd", bind<k_cp_attention_bwd>}, {"cp_attention_block", bind<k_cp_attention_block>},
        {"cp_attention_block_bwd", bind<k_cp_attention_block_bwd>}, {"attn_merge", bind<k_attn_merge>},
        {"attn_merge_bwd", bind<k_attn_merge_bwd>},
        {"cp_rope", bind16<k16_rope, k_rope>},                {"cp_rope_bwd", bind16<k16_rope_bwd, k_rope_bwd>},
        {"cross_entropy", bind16<k16_cross_entropy, k_cross_entropy>},
        {"vocab_ce_stats", bind<k_vocab_ce_stats>}, {"vocab_ce_loss", bind<k_vocab_ce_loss>},
        {"vocab_ce_bwd", bind<k_vocab_ce_bwd>}, {"vocab_embedding", bind<k_vocab_embedding>},
        {"vocab_embedding_bwd", bind<k_vocab_embedding_bwd>},
        {"cross_entropy_bwd", bind16<k16_cross_entropy_bwd, k_cross_entropy_bwd>},
        {"reshape", bind<k_reshape>},             {"transpose", bind<k_transpose>},
        {"fanout", bind<k_reshape>},
        {"slice", bind<k_slice>},                 {"slice_bwd", bind<k_slice_bwd>},
        {"cat", bind<k_cat>},
        {"take_rows", bind<k_take_rows>},         {"take_rows_bwd", bind<k_take_rows_bwd>},
        {"moe_router", bind<k_moe_router>},       {"moe_router_bwd", bind<k_moe_router_bwd>},
        {"moe_aux_loss", bind<k_moe_aux_loss>},   {"moe_aux_loss_bwd", bind<k_moe_aux_loss_bwd>},
        {"moe_z_loss", bind<k_moe_z_loss>},       {"moe_z_loss_bwd", bind<k_moe_z_loss_bwd>},
        {"moe_permute", bind<k_moe_permute>},     {"moe_permute_bwd", bind<k_moe_permute_bwd>},
        {"moe_unpermute", bind<k_moe_unpermute>}, {"moe_unpermute_bwd", bind<k_moe_unpermute_bwd>},
        {"moe_grouped_linear", bind<k_moe_grouped_linear>},
        {"moe_grouped_linear_bwd", bind<k_moe_grouped_linear_bwd>},
        {"moe_aux_stats", bind<k_moe_aux_stats>},
        {"moe_aux_loss_global", bind<k_moe_aux_loss_global>},
        {"moe_aux_loss_global_bwd", bind<k_moe_aux_loss_global_bwd>},
    };
    for (const auto &[name, fn] : k) set_kernel(name, fn);
  });
}

// ---------------------------------------------------------------------------
// Fence: which regions to protect, and how many backend calls are running.

class Fence {
 public:
  void add(void *p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    regions_[p] = bytes;
    if (active_ == 0) ::mprotect(p, bytes, PROT_NONE);
  }
  // Forgets a region and returns its size (0 if unknown).
  size_t remove(void *p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(p);
    if (it == regions_.end()) return 0;
    size_t n = it->second;
    regions_.erase(it);
    return n;
  }
  void enter() {
    std::lock_guard<std::mutex> lock(mu_);
    if (active_++ == 0)
      for (auto &[p, n] : regions_) ::mprotect(p, n, PROT_READ | PROT_WRITE);
  }
  void leave() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--active_ == 0)
      for (auto &[p, n] : regions_) ::mprotect(p, n, PROT_NONE);
  }

 private:
  std::mutex mu_;
  std::map<void *, size_t> regions_;
  int active_ = 0;
};

// ---------------------------------------------------------------------------
// Streams and events

struct Event {
  uint64_t target = 0;  // generation of the latest record
  uint64_t done = 0;    // generation the stream has reached
};

struct Cpu {
  bool fenced = false;
  Fence fence;
  std::mutex mu;  // events
  std::condition_variable cv;
  std::deque<Event> events;
  std::vector<std::unique_ptr<HostWorker>> workers;  // stream s >= 1 is workers[s - 1]

  // Runs fn inside the fence (a no-op unless fenced).
  template <typename F>
  void guarded(F &&fn) {
    if (!fenced) {
      fn();
      return;
    }
    fence.enter();
    fn();
    fence.leave();
  }
  // Runs fn on `stream`: at once for stream 0 and CTR_STREAM_SYNC, queued otherwise.
  void submit(int stream, std::function<void()> fn) {
    if (stream <= 0) {
      guarded(fn);
      return;
    }
    workers[static_cast<size_t>(stream - 1)]->push(std::move(fn));
  }
  void complete(int e, uint64_t gen) {
    {
      std::lock_guard<std::mutex> lock(mu);
      Event &ev = events[static_cast<size_t>(e)];
      ev.done = std::max(ev.done, gen);
    }
    cv.notify_all();
  }
  void block_until(int e, uint64_t gen) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return events[static_cast<size_t>(e)].done >= gen; });
  }
};

Cpu &C(void *ctx) { return *static_cast<Cpu *>(ctx); }

// ---------------------------------------------------------------------------
// Interface slots

// Allocations from this size on are shared host allocations (see the top).
constexpr size_t kSharedBytes = size_t{256} << 10;

void *cpu_alloc(void *ctx, size_t bytes) {
  Cpu &c = C(ctx);
  if (c.fenced) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const size_t n = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
    void *p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    c.fence.add(p, n);
    return p;
  }
  if (bytes >= kSharedBytes && shared_host_wanted())
    if (void *p = shared_host_alloc(bytes)) return p;  // zeroed
  size_t n = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void *p = std::aligned_alloc(64, n);
  if (p) std::memset(p, 0, n);
  return p;
}
void cpu_free(void *ctx, void *p) {
  if (!p) return;
  Cpu &c = C(ctx);
  if (c.fenced) {
    if (size_t n = c.fence.remove(p)) ::munmap(p, n);
    return;
  }
  if (!shared_host_free(p)) std::free(p);
}
void cpu_copy(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  if (!bytes) return;
  // A synchronous copy comes from host work on a comm stream: one thread, so
  // that it takes no core from the compute on stream 0.
  if (stream == CTR_STREAM_SYNC) {
    C(ctx).guarded([=] { std::memcpy(dst, src, bytes); });
    return;
  }
  C(ctx).submit(stream, [=] { cpu::copy(src, dst, static_cast<int64_t>(bytes)); });
}
void cpu_fill(void *ctx, void *dst, int byte, size_t bytes, int stream) {
  if (!bytes) return;
  C(ctx).submit(stream, [=] { std::memset(dst, byte, bytes); });
}
int cpu_create_stream(void *ctx) {
  Cpu &c = C(ctx);
  Cpu *cp = &c;
  // Worker streams carry communication: they run at the comm threads' priority.
  c.workers.push_back(
      std::make_unique<HostWorker>(apply_comm_nice, [cp](std::function<void()> &fn) { cp->guarded(fn); }));
  return static_cast<int>(c.workers.size());
}
int cpu_create_event(void *ctx) {
  Cpu &c = C(ctx);
  std::lock_guard<std::mutex> lock(c.mu);
  c.events.emplace_back();
  return static_cast<int>(c.events.size() - 1);
}
void cpu_record_event(void *ctx, int e, int stream) {
  Cpu &c = C(ctx);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    gen = ++c.events[static_cast<size_t>(e)].target;
  }
  if (stream == 0) {
    c.complete(e, gen);
    return;
  }
  Cpu *cp = &c;
  c.workers[static_cast<size_t>(stream - 1)]->push([cp, e, gen] { cp->complete(e, gen); });
}
void cpu_wait_event(void *ctx, int e, int stream) {
  Cpu &c = C(ctx);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    gen = c.events[static_cast<size_t>(e)].target;
  }
  if (stream == 0) {
    c.block_until(e, gen);
    return;
  }
  Cpu *cp = &c;
  c.workers[static_cast<size_t>(stream - 1)]->push([cp, e, gen] { cp->block_until(e, gen); });
}
void cpu_host_fn(void *ctx, int stream, ctr_host_fn fn, void *user) {
  C(ctx).submit(stream, [fn, user] { fn(user); });
}
void cpu_synchronize(void *ctx, int stream) {
  Cpu &c = C(ctx);
  if (stream > 0) c.workers[static_cast<size_t>(stream - 1)]->drain();
}
KernelFn cpu_kernel(void *, int32_t op, const char *) {
  // Without bf16 on this CPU there is no cast: the step refuses precision bf16.
  static const OpDef *cast = find_op("cast");
  if (cast && op == cast->id && !cpu::bf16_unavailable().empty()) return nullptr;
  KernelTable &t = kernel_table();
  std::lock_guard<std::mutex> lock(t.mu);
  return op >= 0 && static_cast<size_t>(op) < t.by_id.size() ? t.by_id[static_cast<size_t>(op)] : nullptr;
}
void cpu_launch(void *ctx, KernelFn fn, const ctr_kernel_args *args, int stream) {
  Cpu &c = C(ctx);
  if (stream == 0 && !c.fenced) {
    fn(args, nullptr);
    return;
  }
  c.submit(stream, [fn, args] { fn(args, nullptr); });
}
double cpu_sum_squares(void *ctx, const float *x, int64_t n, int stream) {
  cpu_synchronize(ctx, stream);
  double r = 0;
  C(ctx).guarded([&] { r = cpu::sum_squares(x, n); });
  return r;
}
void cpu_add_into(void *ctx, float *acc, const float *x, int64_t n, int stream) {
  C(ctx).submit(stream, [=] { cpu::add_same(acc, x, acc, n); });
}
void cpu_adamw(void *ctx, const ctr_adamw_args *a, int stream) {
  // The segment table is borrowed for the call: copy what a queued task needs.
  std::vector<int64_t> off(static_cast<size_t>(a->num_segments)), cnt(off.size());
  std::vector<float> wd(off.size());
  for (int64_t k = 0; k < a->num_segments; ++k) {
    off[k] = a->segments[k].offset;
    cnt[k] = a->segments[k].count;
    wd[k] = a->segments[k].weight_decay;
  }
  ctr_adamw_args args = *a;
  C(ctx).submit(stream, [args, off = std::move(off), cnt = std::move(cnt), wd = std::move(wd)] {
    cpu::adamw_flat(args.param, args.grad, args.m, args.v, off.data(), cnt.data(), wd.data(),
                    args.num_segments, args.lr, args.beta1, args.beta2, args.eps, args.t, args.grad_scale);
  });
}
void cpu_destroy(void *ctx) { delete static_cast<Cpu *>(ctx); }

// The fenced backend presents itself as device memory, so that everything that
// stages device memory for host code (collectives) is exercised on the CPU.
constexpr ctr_backend_iface cpu_iface(uint32_t flags) {
  return {
      sizeof(ctr_backend_iface),
      CTR_BACKEND_ABI,
      "cpu",
      cpu_alloc,
      cpu_free,
      cpu_copy,
      cpu_copy,
      cpu_copy,
      cpu_fill,
      cpu_create_stream,
      cpu_create_event,
      cpu_record_event,
      cpu_wait_event,
      cpu_host_fn,
      cpu_synchronize,
      cpu_kernel,
      cpu_launch,
      cpu_sum_squares,
      cpu_add_into,
      cpu_adamw,
      cpu_destroy,
      flags,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
}
const ctr_backend_iface kCpuIface = cpu_iface(CTR_BACKEND_BF16_OPT_IN);
const ctr_backend_iface kFencedIface = cpu_iface(CTR_BACKEND_DEVICE_MEMORY | CTR_BACKEND_BF16_OPT_IN);

}  // namespace

void register_cpu_kernel(const std::string &op, KernelFn fn) {
  register_library_kernels();
  set_kernel(op, fn);
}

Backend cpu_backend_create(bool fenced) {
  CTR_REQUIRE(cpu::cpu_features_error().empty(), CTR_STATUS_INVALID_ARGUMENT, "device 'cpu': %s",
              cpu::cpu_features_error().c_str());
  register_library_kernels();
  auto *c = new Cpu;
  c->fenced = fenced;
  return Backend{fenced ? &kFencedIface : &kCpuIface, c};
}

}  // namespace ctr
