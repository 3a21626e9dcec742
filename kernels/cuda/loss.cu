// Softmax, log_softmax and the fused softmax cross-entropy on the GPU, the
// formulas of kernels/cpu/elementwise.cc, reduce.cc and loss.cc.
//
// softmax and log_softmax read x as [outer, C, inner] around their dim. With
// inner 1 a block owns a row; otherwise a thread owns a column (o, j) and walks
// its C elements, so neighbouring threads read neighbouring addresses.
//
// A row's max and sum of exponentials come from one pass: each thread keeps an
// online (max, sum) over its elements, rescaling the sum when the max grows;
// the block then combines them. Cross-entropy logits are read in their storage
// type, so no f32 copy of the logits is made.
//
// The cross-entropy loss is a mean over counted rows (target >= 0). It is added
// up in double by one block in a fixed order from the saved log-sum-exp and the
// target logits, so it does not depend on timing.

#include "common/math.h"
#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

bool is_bf16(const ctr_tensor_ref &r) { return r.dtype == CTR_DTYPE_BF16; }

int row_threads(int64_t C) {
  if (C >= 4096) return 512;
  if (C >= 256) return 256;
  return C > 64 ? 128 : 64;
}
unsigned row_blocks(int64_t R) { return static_cast<unsigned>(R < 1 ? 1 : (R > (1 << 20) ? (1 << 20) : R)); }

// Adds v to the online pair (m, s): s = sum of exp(x - m) over the values seen.
__device__ __forceinline__ void online_add(float &m, float &s, float v) {
  if (v > m) {
    s = s * math::exp_fast(m - v) + 1.0f;
    m = v;
  } else if (v != -INFINITY) {  // -inf adds 0 (and -inf - -inf would be NaN)
    s += math::exp_fast(v - m);
  }
}

// Combines every thread's (m, s) into the row's: m the max, s the sum of
// exp(x - m). A thread that saw nothing holds (-inf, 0).
__device__ __forceinline__ void block_max_sum(float &m, float &s, float *sh) {
  const float mb = block_max(m, sh);
  const float part = s > 0.0f ? s * math::exp_fast(m - mb) : 0.0f;
  s = block_sum(part, sh);
  m = mb;
}

// The row's (max, sum of exp(x - max)) over x[0 .. C).
template <typename T>
__device__ __forceinline__ void row_stats(const T *x, int64_t C, float &m, float &s, float *sh) {
  m = -INFINITY;
  s = 0.0f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) online_add(m, s, load(x, j));
  block_max_sum(m, s, sh);
}

// ---------------------------------------------------------------------------
// Softmax and log_softmax over rows (inner 1).

template <typename T, bool Log>
__global__ void softmax_rows_kernel(const T *x, T *y, int64_t R, int64_t C) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T *xr = x + r * C;
    T *yr = y + r * C;
    float m, s;
    row_stats(xr, C, m, s, sh);
    if constexpr (Log) {
      const float shift = m + logf(s);
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) store(yr, j, load(xr, j) - shift);
    } else {
      const float inv = 1.0f / s;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) store(yr, j, math::exp_fast(load(xr, j) - m) * inv);
    }
  }
}

// softmax_bwd: dx = y * (dy - sum(dy * y)); log_softmax_bwd: dx = dy - exp(y) * sum(dy).
template <typename T, bool Log>
__global__ void softmax_rows_bwd_kernel(const T *dy, const T *y, T *dx, int64_t R, int64_t C) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T *g = dy + r * C, *yr = y + r * C;
    T *o = dx + r * C;
    float a = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) a += Log ? load(g, j) : load(g, j) * load(yr, j);
    const float dot = block_sum(a, sh);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      if constexpr (Log)
        store(o, j, load(g, j) - math::exp_fast(load(yr, j)) * dot);
      else
        store(o, j, load(yr, j) * (load(g, j) - dot));
    }
  }
}

// ---------------------------------------------------------------------------
// Softmax and log_softmax over the middle dim of [outer, C, inner]: a thread
// per column (o, j), C elements inner apart.

template <typename T, bool Log>
__global__ void softmax_cols_kernel(const T *x, T *y, int64_t outer, int64_t C, int64_t inner) {
  const int64_t cols = outer * inner;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < cols; k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t o = k / inner, j = k - o * inner;
    const T *xc = x + o * C * inner + j;
    T *yc = y + o * C * inner + j;
    float m = -INFINITY;
    for (int64_t c = 0; c < C; ++c) m = fmaxf(m, load(xc, c * inner));
    float s = 0.0f;
    for (int64_t c = 0; c < C; ++c) s += math::exp_fast(load(xc, c * inner) - m);
    if constexpr (Log) {
      const float shift = m + logf(s);
      for (int64_t c = 0; c < C; ++c) store(yc, c * inner, load(xc, c * inner) - shift);
    } else {
      const float inv = 1.0f / s;
      for (int64_t c = 0; c < C; ++c) store(yc, c * inner, math::exp_fast(load(xc, c * inner) - m) * inv);
    }
  }
}

template <typename T, bool Log>
__global__ void softmax_cols_bwd_kernel(const T *dy, const T *y, T *dx, int64_t outer, int64_t C, int64_t inner) {
  const int64_t cols = outer * inner;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < cols; k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t off = (k / inner) * C * inner + k % inner;
    float a = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = off + c * inner;
      a += Log ? load(dy, i) : load(dy, i) * load(y, i);
    }
    for (int64_t c = 0; c < C; ++c) {
      const int64_t i = off + c * inner;
      if constexpr (Log)
        store(dx, i, load(dy, i) - math::exp_fast(load(y, i)) * a);
      else
        store(dx, i, load(y, i) * (load(dy, i) - a));
    }
  }
}

struct DimSplit {
  int64_t outer, C, inner;
};
DimSplit dim_split(const ctr_tensor_ref &x, const ctr_softmax_params &p) {
  const int r = x.ndim, d = p.dim < 0 ? p.dim + r : p.dim;
  DimSplit s{1, x.shape[d], 1};
  for (int i = 0; i < d; ++i) s.outer *= x.shape[i];
  for (int i = d + 1; i < r; ++i) s.inner *= x.shape[i];
  return s;
}

template <typename T, bool Log>
void softmax_fwd(const Args &c) {
  const DimSplit s = dim_split(c.in_ref(0), c.params<ctr_softmax_params>());
  if (s.outer * s.C * s.inner == 0) return;
  if (s.inner == 1)
    CTR_LAUNCH((softmax_rows_kernel<T, Log>), row_blocks(s.outer), row_threads(s.C), 0, c.stream())(c.in<const T>(0),
                                                                                         c.out<T>(0), s.outer, s.C);
  else
    CTR_LAUNCH((softmax_cols_kernel<T, Log>), grid_for(s.outer * s.inner), 256, 0, c.stream())(c.in<const T>(0), c.out<T>(0),
                                                                                     s.outer, s.C, s.inner);
}
// (dy, y) -> dx
template <typename T, bool Log>
void softmax_bwd(const Args &c) {
  const DimSplit s = dim_split(c.in_ref(0), c.params<ctr_softmax_params>());
  if (s.outer * s.C * s.inner == 0) return;
  if (s.inner == 1)
    CTR_LAUNCH((softmax_rows_bwd_kernel<T, Log>), row_blocks(s.outer), row_threads(s.C), 0, c.stream())(
        c.in<const T>(0), c.in<const T>(1), c.out<T>(0), s.outer, s.C);
  else
    CTR_LAUNCH((softmax_cols_bwd_kernel<T, Log>), grid_for(s.outer * s.inner), 256, 0, c.stream())(
        c.in<const T>(0), c.in<const T>(1), c.out<T>(0), s.outer, s.C, s.inner);
}

// ---------------------------------------------------------------------------
// Cross-entropy: logits[R, V], targets[R] (negative: ignored) -> loss (f32
// scalar), lse[R] (f32), count (i64).

template <typename T>
__global__ void xent_lse_kernel(const T *logits, float *lse, int64_t R, int64_t V) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    float m, s;
    row_stats(logits + r * V, V, m, s, sh);
    if (threadIdx.x == 0) lse[r] = m + logf(s);
  }
}

constexpr int kLossThreads = 1024;

// One block: thread k adds rows k, k + 1024, ... in double; the partials are
// added in a fixed tree order.
template <typename T>
__global__ void xent_mean_kernel(const T *logits, const int32_t *targets, const float *lse, float *loss,
                                 int64_t *count, int64_t R, int64_t V) {
  __shared__ double sd[kLossThreads];
  __shared__ long long sn[kLossThreads];
  double s = 0.0;
  long long n = 0;
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
    const int32_t t = targets[r];
    if (t < 0) continue;
    s += static_cast<double>(lse[r]) - static_cast<double>(load(logits, r * V + t));
    ++n;
  }
  sd[threadIdx.x] = s;
  sn[threadIdx.x] = n;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      sd[threadIdx.x] += sd[threadIdx.x + w];
      sn[threadIdx.x] += sn[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const long long total = sn[0];
    *count = total;
    loss[0] = total > 0 ? static_cast<float>(sd[0] / static_cast<double>(total)) : 0.0f;
  }
}

// dlogits[r, j] = g * softmax(r)[j] - g * (j == target), g = dloss / count;
// rows with a negative target (or no counted row at all) get zeros.
template <typename T, typename L>
__global__ void xent_bwd_kernel(const L *dloss, const T *logits, const int32_t *targets, const float *lse,
                                const int64_t *count, T *dlogits, int64_t R, int64_t V) {
  const int64_t n = *count;
  const float g = n > 0 ? load(dloss, 0) / static_cast<float>(n) : 0.0f;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const T *x = logits + r * V;
    T *o = dlogits + r * V;
    const int32_t t = targets[r];
    if (t < 0 || n <= 0) {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) store(o, j, 0.0f);
      continue;
    }
    const float l = lse[r];
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float p = g * math::exp_fast(load(x, j) - l);
      store(o, j, j == t ? p - g : p);
    }
  }
}

template <typename T>
void cross_entropy(const Args &c) {
  const int64_t V = c.in_dim(0, -1), R = V > 0 ? c.in_numel(0) / V : 0;
  const T *logits = c.in<const T>(0);
  float *lse = c.out<float>(1);
  if (R > 0) CTR_LAUNCH(xent_lse_kernel, row_blocks(R), row_threads(V), 0, c.stream())(logits, lse, R, V);
  CTR_LAUNCH(xent_mean_kernel, 1, kLossThreads, 0, c.stream())(logits, c.in<const int32_t>(1), lse, c.out<float>(0),
                                                       c.out<int64_t>(2), R, V);
}

// (dloss, logits, targets, lse, count) -> dlogits
template <typename T>
void cross_entropy_bwd(const Args &c) {
  const int64_t V = c.in_dim(1, -1), R = V > 0 ? c.in_numel(1) / V : 0;
  if (R == 0) return;
  const auto grid = row_blocks(R);
  const int threads = row_threads(V);
  if (is_bf16(c.in_ref(0)))
    CTR_LAUNCH(xent_bwd_kernel, grid, threads, 0, c.stream())(c.in<const __nv_bfloat16>(0), c.in<const T>(1),
                                                      c.in<const int32_t>(2), c.in<const float>(3),
                                                      c.in<const int64_t>(4), c.out<T>(0), R, V);
  else
    CTR_LAUNCH(xent_bwd_kernel, grid, threads, 0, c.stream())(c.in<const float>(0), c.in<const T>(1), c.in<const int32_t>(2),
                                                      c.in<const float>(3), c.in<const int64_t>(4), c.out<T>(0), R, V);
}

// The storage type of input i.
#define CTR_LOSS_DISPATCH(c, i, F) \
  (is_bf16((c).in_ref(i)) ? F<__nv_bfloat16>(c) : F<float>(c))

template <typename T>
void softmax(const Args &c) { softmax_fwd<T, false>(c); }
template <typename T>
void log_softmax(const Args &c) { softmax_fwd<T, true>(c); }
template <typename T>
void softmax_grad(const Args &c) { softmax_bwd<T, false>(c); }
template <typename T>
void log_softmax_grad(const Args &c) { softmax_bwd<T, true>(c); }

void k_softmax(const Args &c) { CTR_LOSS_DISPATCH(c, 0, softmax); }
void k_softmax_bwd(const Args &c) { CTR_LOSS_DISPATCH(c, 0, softmax_grad); }
void k_log_softmax(const Args &c) { CTR_LOSS_DISPATCH(c, 0, log_softmax); }
void k_log_softmax_bwd(const Args &c) { CTR_LOSS_DISPATCH(c, 0, log_softmax_grad); }
void k_cross_entropy(const Args &c) { CTR_LOSS_DISPATCH(c, 0, cross_entropy); }
void k_cross_entropy_bwd(const Args &c) { CTR_LOSS_DISPATCH(c, 1, cross_entropy_bwd); }

}  // namespace

const KernelEntry kLossKernels[] = {
    {"softmax", bind<k_softmax>},
    {"softmax_bwd", bind<k_softmax_bwd>},
    {"log_softmax", bind<k_log_softmax>},
    {"log_softmax_bwd", bind<k_log_softmax_bwd>},
    {"cross_entropy", bind<k_cross_entropy>},
    {"cross_entropy_bwd", bind<k_cross_entropy_bwd>},
};
const size_t kLossKernelCount = sizeof(kLossKernels) / sizeof(kLossKernels[0]);

}  // namespace ctr::cuda
