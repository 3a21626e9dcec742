// Layout ops and general reductions on the GPU: reshape (a copy where the
// memory plan did not place the output on its input), transpose, slice, cat,
// expand, masked_fill, sum/mean/amax/var over dims with their gradients,
// reduce_to and div's gradient for b. Layout ops move elements of 4 bytes (f32,
// i32) or 2 (bf16) without computing on them. Reductions give each output to
// one thread that walks its elements in a fixed order, as the CPU kernels do,
// so results do not depend on scheduling.

#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

int64_t elem_size(const ctr_tensor_ref &r) { return r.numel > 0 ? r.bytes / r.numel : 4; }

// A shape aligned at the trailing end to `rank` dims (missing leading dims 1).
struct Dims {
  int rank = 0;
  int64_t d[CTR_MAX_DIMS] = {};
};
Dims aligned(const ctr_tensor_ref &r, int rank) {
  Dims s;
  s.rank = rank;
  for (int i = 0; i < rank; ++i) {
    const int j = i - (rank - r.ndim);
    s.d[i] = j >= 0 ? r.shape[j] : 1;
  }
  return s;
}
// Contiguous strides of s, 0 where s has size 1 but the other shape does not
// (a stretched dim).
void strides_of(const Dims &s, const Dims &full, int64_t *st) {
  int64_t acc = 1;
  for (int i = s.rank - 1; i >= 0; --i) {
    st[i] = (s.d[i] == 1 && full.d[i] != 1) ? 0 : acc;
    acc *= s.d[i];
  }
}

// ---------------------------------------------------------------------------
// reshape, transpose

void k_reshape(const Args &c) {
  if (c.in<void>(0) != c.out<void>(0))
    CTR_CUDA_CHECK(cudaMemcpyAsync(c.out<void>(0), c.in<void>(0), static_cast<size_t>(c.in_ref(0).bytes), cudaMemcpyDeviceToDevice,
                    c.stream()));
}

struct Perm {
  int rank;
  int64_t out[CTR_MAX_DIMS];     // output dims
  int64_t in_st[CTR_MAX_DIMS];   // input stride of each output dim
};

template <typename E>
__global__ void transpose_kernel(const E *x, E *y, int64_t n, Perm p) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t r = i, src = 0;
    for (int d = p.rank - 1; d >= 0; --d) {
      src += (r % p.out[d]) * p.in_st[d];
      r /= p.out[d];
    }
    y[i] = x[src];
  }
}

void k_transpose(const Args &c) {
  const auto &prm = c.params<ctr_transpose_params>();
  const ctr_tensor_ref &x = c.in_ref(0);
  int64_t st[CTR_MAX_DIMS], acc = 1;
  for (int i = x.ndim - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= x.shape[i];
  }
  Perm p{};
  p.rank = prm.ndim;
  for (int i = 0; i < prm.ndim; ++i) {
    p.out[i] = x.shape[prm.perm[i]];
    p.in_st[i] = st[prm.perm[i]];
  }
  const int64_t n = x.numel;
  if (elem_size(x) == 2)
    CTR_LAUNCH(transpose_kernel, grid_for(n), 256, 0, c.stream())(c.in<const uint16_t>(0), c.out<uint16_t>(0), n, p);
  else
    CTR_LAUNCH(transpose_kernel, grid_for(n), 256, 0, c.stream())(c.in<const uint32_t>(0), c.out<uint32_t>(0), n, p);
}

// ---------------------------------------------------------------------------
// slice, slice_bwd, cat: pitched copies of row blocks.

template <typename E>
__global__ void slice_step_kernel(const E *x, E *y, int64_t outer, int64_t size, int64_t inner, int64_t start,
                                  int64_t len, int64_t step, bool backward) {
  const int64_t n = outer * len * inner;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t in = i % inner, row = (i / inner) % len, o = i / (inner * len);
    const int64_t full = (o * size + start + row * step) * inner + in;
    if (backward)
      y[full] = x[i];
    else
      y[i] = x[full];
  }
}

void slice_copy(const Args &c, bool backward) {
  const auto &p = c.params<ctr_slice_params>();
  const int64_t es = elem_size(backward ? c.out_ref(0) : c.in_ref(0));
  if (backward && p.len < p.size)
    CTR_CUDA_CHECK(cudaMemsetAsync(c.out<void>(0), 0, static_cast<size_t>(c.out_ref(0).bytes), c.stream()));
  if (p.outer == 0 || p.len == 0 || p.inner == 0) return;
  char *full = static_cast<char *>(backward ? c.out<void>(0) : c.in<void>(0));
  char *part = static_cast<char *>(backward ? c.in<void>(0) : c.out<void>(0));
  if (p.step == 1) {
    const size_t fp = static_cast<size_t>(p.size * p.inner * es), pp = static_cast<size_t>(p.len * p.inner * es);
    char *at = full + p.start * p.inner * es;
    if (backward)
      CTR_CUDA_CHECK(cudaMemcpy2DAsync(at, fp, part, pp, pp, static_cast<size_t>(p.outer), cudaMemcpyDeviceToDevice, c.stream()));
    else
      CTR_CUDA_CHECK(cudaMemcpy2DAsync(part, pp, at, fp, pp, static_cast<size_t>(p.outer), cudaMemcpyDeviceToDevice, c.stream()));
    return;
  }
  const int64_t n = p.outer * p.len * p.inner;
  const void *src = backward ? static_cast<const void *>(part) : full;
  void *dst = backward ? static_cast<void *>(full) : part;
  if (es == 2)
    CTR_LAUNCH(slice_step_kernel, grid_for(n), 256, 0, c.stream())(static_cast<const uint16_t *>(src),
                                                           static_cast<uint16_t *>(dst), p.outer, p.size, p.inner,
                                                           p.start, p.len, p.step, backward);
  else
    CTR_LAUNCH(slice_step_kernel, grid_for(n), 256, 0, c.stream())(static_cast<const uint32_t *>(src),
                                                           static_cast<uint32_t *>(dst), p.outer, p.size, p.inner,
                                                           p.start, p.len, p.step, backward);
}
void k_slice(const Args &c) { slice_copy(c, false); }
void k_slice_bwd(const Args &c) { slice_copy(c, true); }

void k_cat(const Args &c) {
  const auto &p = c.params<ctr_cat_params>();
  if (p.outer == 0) return;
  const int64_t es = elem_size(c.out_ref(0));
  const size_t row = static_cast<size_t>(c.out_numel(0) / p.outer * es);
  size_t col = 0;
  for (int k = 0; k < c.num_inputs(); ++k) {
    const size_t w = static_cast<size_t>(c.in_numel(k) / p.outer * es);
    if (w)
      CTR_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char *>(c.out<void>(0)) + col, row, c.in<void>(k), w, w,
                        static_cast<size_t>(p.outer), cudaMemcpyDeviceToDevice, c.stream()));
    col += w;
  }
}

// ---------------------------------------------------------------------------
// Broadcast reads: out[os] from x[xs] with xs aligned to os and stretched dims.

struct Bcast1 {
  int rank;
  int64_t out[CTR_MAX_DIMS], st[CTR_MAX_DIMS];
};
Bcast1 bcast_from(const ctr_tensor_ref &x, const ctr_tensor_ref &o) {
  Bcast1 b{};
  const Dims os = aligned(o, o.ndim), xs = aligned(x, o.ndim);
  b.rank = o.ndim;
  for (int i = 0; i < o.ndim; ++i) b.out[i] = os.d[i];
  strides_of(xs, os, b.st);
  return b;
}
__device__ __forceinline__ int64_t source(int64_t i, const Bcast1 &b) {
  int64_t r = i, s = 0;
  for (int d = b.rank - 1; d >= 0; --d) {
    s += (r % b.out[d]) * b.st[d];
    r /= b.out[d];
  }
  return s;
}

template <typename T>
__global__ void broadcast_kernel(const T *x, T *y, int64_t n, Bcast1 b, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, scale * load(x, source(i, b)));
}
template <typename T>
void broadcast_to(const Args &c, const ctr_tensor_ref &x, const ctr_tensor_ref &o, float scale) {
  const int64_t n = o.numel;
  if (n > 0)
    CTR_LAUNCH(broadcast_kernel, grid_for(n), 256, 0, c.stream())(static_cast<const T *>(x.data), static_cast<T *>(o.data), n,
                                                          bcast_from(x, o), scale);
}
template <typename T>
void expand(const Args &c) { broadcast_to<T>(c, c.in_ref(0), c.out_ref(0), 1.0f); }

template <typename T>
__global__ void masked_fill_kernel(const T *x, const T *mask, T *y, int64_t n, Bcast1 b, float value) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(mask, source(i, b)) != 0.0f ? value : load(x, i));
}
template <typename T>
void masked_fill(const Args &c) {
  const int64_t n = c.out_numel(0);
  if (n > 0)
    CTR_LAUNCH(masked_fill_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.out<T>(0), n,
                                                            bcast_from(c.in_ref(1), c.out_ref(0)),
                                                            c.params<ctr_masked_fill_params>().value);
}

// div_bwd_b(g, y, b): out[os] = -(g * (y / b)), b broadcast.
template <typename T>
__global__ void div_bwd_b_kernel(const T *g, const T *y, const T *b, T *out, int64_t n, Bcast1 bb) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(out, i, -(load(g, i) * (load(y, i) / load(b, source(i, bb)))));
}
template <typename T>
void div_bwd_b(const Args &c) {
  const int64_t n = c.out_numel(0);
  if (n > 0)
    CTR_LAUNCH(div_bwd_b_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const T>(2),
                                                          c.out<T>(0), n, bcast_from(c.in_ref(2), c.out_ref(0)));
}

// ---------------------------------------------------------------------------
// Reductions of x over the dims where the kept shape has size 1 and x does not.

enum class Red { Sum, Mean, Amax, Var };

struct Reduce {
  int rank;
  int64_t kept[CTR_MAX_DIMS];   // output (kept) dims; 1 on reduced dims
  int64_t xst[CTR_MAX_DIMS];    // x's strides
  int nred;
  int64_t red[CTR_MAX_DIMS];    // sizes of the reduced dims, outermost first
  int64_t red_st[CTR_MAX_DIMS]; // their strides in x
  int64_t n;                    // elements per output
};

Reduce make_reduce(const ctr_tensor_ref &x, const Dims &kept) {
  Reduce r{};
  r.rank = x.ndim;
  const Dims xs = aligned(x, x.ndim);
  int64_t acc = 1;
  for (int i = x.ndim - 1; i >= 0; --i) {
    r.xst[i] = acc;
    acc *= xs.d[i];
  }
  r.n = 1;
  for (int i = 0; i < x.ndim; ++i) {
    r.kept[i] = kept.d[i];
    if (kept.d[i] == 1 && xs.d[i] != 1) {
      r.red[r.nred] = xs.d[i];
      r.red_st[r.nred] = r.xst[i];
      ++r.nred;
      r.n *= xs.d[i];
    }
  }
  return r;
}

// x's offset of output o's first element, and of its j-th reduced element.
__device__ __forceinline__ int64_t base_of(int64_t o, const Reduce &r) {
  int64_t b = 0;
  for (int d = r.rank - 1; d >= 0; --d) {
    b += (o % r.kept[d]) * r.xst[d];
    o /= r.kept[d];
  }
  return b;
}
__device__ __forceinline__ int64_t offset_of(int64_t j, const Reduce &r) {
  int64_t off = 0;
  for (int d = r.nred - 1; d >= 0; --d) {
    off += (j % r.red[d]) * r.red_st[d];
    j /= r.red[d];
  }
  return off;
}

template <Red R, typename T>
__global__ void reduce_kernel(const T *x, T *out, float *mean_out, int64_t nout, Reduce r, float correction) {
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < nout; o += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = base_of(o, r);
    float acc = R == Red::Amax ? -INFINITY : 0.0f;
    for (int64_t j = 0; j < r.n; ++j) {
      const float v = load(x, b + offset_of(j, r));
      acc = R == Red::Amax ? fmaxf(acc, v) : acc + v;
    }
    if constexpr (R == Red::Mean) acc /= static_cast<float>(r.n);
    if constexpr (R == Red::Var) {
      const float mean = acc / static_cast<float>(r.n);
      float ss = 0.0f;
      for (int64_t j = 0; j < r.n; ++j) {
        const float d = load(x, b + offset_of(j, r)) - mean;
        ss += d * d;
      }
      acc = ss / (static_cast<float>(r.n) - correction);
      if (mean_out) mean_out[o] = mean;
    }
    store(out, o, acc);
  }
}

// The kept shape of a reduction node: x's dims with the params' dims set to 1.
Dims kept_dims(const ctr_tensor_ref &x, const ctr_reduce_params &p) {
  Dims k = aligned(x, x.ndim);
  for (int i = 0; i < p.ndims; ++i) k.d[p.dims[i] < 0 ? p.dims[i] + x.ndim : p.dims[i]] = 1;
  return k;
}

template <Red R, typename T>
void reduce(const Args &c) {
  const auto &p = c.params<ctr_reduce_params>();
  const Reduce r = make_reduce(c.in_ref(0), kept_dims(c.in_ref(0), p));
  const int64_t nout = c.out_numel(0);
  float *mean = R == Red::Var && c.num_outputs() > 1 ? c.out<float>(1) : nullptr;
  if (nout > 0)
    CTR_LAUNCH(reduce_kernel<R>, grid_for(nout), 256, 0, c.stream())(c.in<const T>(0), c.out<T>(0), mean, nout, r,
                                                              static_cast<float>(p.correction));
}
template <Red R>
void reduce_any(const Args &c) { c.bf16() ? reduce<R, __nv_bfloat16>(c) : reduce<R, float>(c); }

// reduce_to: x summed down to the output's shape (aligned at the trailing end).
template <typename T>
void reduce_to(const Args &c) {
  const Reduce r = make_reduce(c.in_ref(0), aligned(c.out_ref(0), c.in_ref(0).ndim));
  const int64_t nout = c.out_numel(0);
  if (nout > 0)
    CTR_LAUNCH(reduce_kernel<Red::Sum>, grid_for(nout), 256, 0, c.stream())(c.in<const T>(0), c.out<T>(0), nullptr, nout, r,
                                                                     0.0f);
}

// sum_bwd, mean_bwd: the output gradient (kept shape) broadcast back.
template <typename T, bool Mean>
void reduce_bcast_bwd(const Args &c) {
  const auto &p = c.params<ctr_reduce_params>();
  const ctr_tensor_ref &x = c.out_ref(0);
  const Dims k = kept_dims(x, p);
  int64_t n = 1;
  for (int i = 0; i < x.ndim; ++i)
    if (k.d[i] != x.shape[i]) n *= x.shape[i];
  ctr_tensor_ref g = c.in_ref(0);  // viewed in the kept shape
  g.ndim = x.ndim;
  for (int i = 0; i < x.ndim; ++i) g.shape[i] = k.d[i];
  broadcast_to<T>(c, g, x, Mean ? 1.0f / static_cast<float>(n) : 1.0f);
}

// amax_bwd(g, x, y): gx = g / ties where x equals its output's max.
template <typename T>
__global__ void amax_bwd_kernel(const T *g, const T *x, const T *y, T *gx, int64_t nout, Reduce r) {
  for (int64_t o = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; o < nout; o += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = base_of(o, r);
    const float m = load(y, o);
    float ties = 0.0f;
    for (int64_t j = 0; j < r.n; ++j) ties += load(x, b + offset_of(j, r)) == m ? 1.0f : 0.0f;
    const float share = load(g, o) / ties;
    for (int64_t j = 0; j < r.n; ++j) {
      const int64_t at = b + offset_of(j, r);
      store(gx, at, load(x, at) == m ? share : 0.0f);
    }
  }
}
template <typename T>
void amax_bwd(const Args &c) {
  const ctr_tensor_ref &x = c.in_ref(1);
  const Reduce r = make_reduce(x, kept_dims(x, c.params<ctr_reduce_params>()));
  const int64_t nout = c.in_numel(0);
  if (nout > 0)
    CTR_LAUNCH(amax_bwd_kernel, grid_for(nout), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const T>(2),
                                                            c.out<T>(0), nout, r);
}

// var_bwd(g, x, mean): gx = g * 2 (x - mean) / (N - correction).
template <typename T>
__global__ void var_bwd_kernel(const T *g, const T *x, const float *mean, T *gx, int64_t n, Bcast1 b, float denom) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t k = source(i, b);
    store(gx, i, load(g, k) * 2.0f * (load(x, i) - mean[k]) / denom);
  }
}
template <typename T>
void var_bwd(const Args &c) {
  const auto &p = c.params<ctr_reduce_params>();
  const ctr_tensor_ref &x = c.in_ref(1);
  const Dims k = kept_dims(x, p);
  int64_t n = 1;
  for (int i = 0; i < x.ndim; ++i)
    if (k.d[i] != x.shape[i]) n *= x.shape[i];
  ctr_tensor_ref kept = c.in_ref(0);
  kept.ndim = x.ndim;
  for (int i = 0; i < x.ndim; ++i) kept.shape[i] = k.d[i];
  const int64_t total = x.numel;
  if (total > 0)
    CTR_LAUNCH(var_bwd_kernel, grid_for(total), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const float>(2),
                                                            c.out<T>(0), total, bcast_from(kept, x),
                                                            static_cast<float>(n) - static_cast<float>(p.correction));
}

void k_expand(const Args &c) { CTR_CUDA_DISPATCH(c, expand); }
void k_masked_fill(const Args &c) { CTR_CUDA_DISPATCH(c, masked_fill); }
void k_div_bwd_b(const Args &c) { CTR_CUDA_DISPATCH(c, div_bwd_b); }
void k_reduce_to(const Args &c) { CTR_CUDA_DISPATCH(c, reduce_to); }
template <typename T>
void sum_bwd(const Args &c) { reduce_bcast_bwd<T, false>(c); }
template <typename T>
void mean_bwd(const Args &c) { reduce_bcast_bwd<T, true>(c); }
void k_sum_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, sum_bwd); }
void k_mean_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, mean_bwd); }
void k_amax_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, amax_bwd); }
void k_var_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, var_bwd); }

}  // namespace

const KernelEntry kLayoutKernels[] = {
    {"reshape", bind<k_reshape>},
    {"fanout", bind<k_reshape>},
    {"transpose", bind<k_transpose>},
    {"slice", bind<k_slice>},
    {"slice_bwd", bind<k_slice_bwd>},
    {"cat", bind<k_cat>},
    {"expand", bind<k_expand>},
    {"masked_fill", bind<k_masked_fill>},
    {"div_bwd_b", bind<k_div_bwd_b>},
    {"reduce_to", bind<k_reduce_to>},
    {"sum", bind<reduce_any<Red::Sum>>},
    {"mean", bind<reduce_any<Red::Mean>>},
    {"amax", bind<reduce_any<Red::Amax>>},
    {"var", bind<reduce_any<Red::Var>>},
    {"sum_bwd", bind<k_sum_bwd>},
    {"mean_bwd", bind<k_mean_bwd>},
    {"amax_bwd", bind<k_amax_bwd>},
    {"var_bwd", bind<k_var_bwd>},
};
const size_t kLayoutKernelCount = sizeof(kLayoutKernels) / sizeof(kLayoutKernels[0]);

}  // namespace ctr::cuda
