// Element-wise ops on the GPU: activations, unary math, broadcasting
// arithmetic, and the column sums their gradients need. The formulas are the
// host-device functions of kernels/common/math.h, the same ones the CPU kernels
// call, so the two backends differ only by rounding of the storage type.

#include "common/math.h"
#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

// ---------------------------------------------------------------------------
// Maps over n elements. Where every operand is 16-byte aligned (arena tensors
// are 64-byte aligned), a thread moves 16 bytes per operand at once (4 f32 or
// 8 bf16: one vector load or store each) and the last n % width elements go
// element by element; indices are a thread's own counter, never divided.

template <typename T>
struct alignas(16) Pack {
  static constexpr int kWidth = 16 / sizeof(T);
  T v[kWidth];
};

inline bool aligned16(const void *p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, typename F>
__global__ void map1(const T *x, T *y, int64_t n, bool packed, F f) {
  constexpr int W = Pack<T>::kWidth;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  int64_t done = 0;
  if (packed) {
    const int64_t packs = n / W;
    const Pack<T> *xp = reinterpret_cast<const Pack<T> *>(x);
    Pack<T> *yp = reinterpret_cast<Pack<T> *>(y);
    for (int64_t i = first; i < packs; i += stride) {
      const Pack<T> a = xp[i];
      Pack<T> o;
      for (int k = 0; k < W; ++k) store(o.v, k, f(load(a.v, k)));
      yp[i] = o;
    }
    done = packs * W;
  }
  for (int64_t i = done + first; i < n; i += stride) store(y, i, f(load(x, i)));
}
template <typename T, typename F>
__global__ void map2(const T *a, const T *b, T *y, int64_t n, bool packed, F f) {
  constexpr int W = Pack<T>::kWidth;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x, first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  int64_t done = 0;
  if (packed) {
    const int64_t packs = n / W;
    const Pack<T> *ap = reinterpret_cast<const Pack<T> *>(a), *bp = reinterpret_cast<const Pack<T> *>(b);
    Pack<T> *yp = reinterpret_cast<Pack<T> *>(y);
    for (int64_t i = first; i < packs; i += stride) {
      const Pack<T> u = ap[i], w = bp[i];
      Pack<T> o;
      for (int k = 0; k < W; ++k) store(o.v, k, f(load(u.v, k), load(w.v, k)));
      yp[i] = o;
    }
    done = packs * W;
  }
  for (int64_t i = done + first; i < n; i += stride) store(y, i, f(load(a, i), load(b, i)));
}

// Threads for n elements in packs of W (the tail fits in the same grid).
template <typename T>
unsigned map_grid(int64_t n, bool packed) {
  return grid_for(packed ? (n + Pack<T>::kWidth - 1) / Pack<T>::kWidth : n);
}

template <typename T, typename F>
void launch1(const Args &c, const T *x, T *y, int64_t n, F f) {
  const bool packed = aligned16(x) && aligned16(y);
  CTR_LAUNCH(map1, map_grid<T>(n, packed), 256, 0, c.stream())(x, y, n, packed, f);
}
template <typename T, typename F>
void launch2(const Args &c, const T *a, const T *b, T *y, int64_t n, F f) {
  const bool packed = aligned16(a) && aligned16(b) && aligned16(y);
  CTR_LAUNCH(map2, map_grid<T>(n, packed), 256, 0, c.stream())(a, b, y, n, packed, f);
}

struct GeluTanh { __device__ float operator()(float x) const { return math::gelu_fast(x); } };
struct GeluExact { __device__ float operator()(float x) const { return math::gelu_exact_fast(x); } };
struct GeluTanhBwd { __device__ float operator()(float g, float x) const { return g * math::gelu_grad_fast(x); } };
struct GeluExactBwd {
  __device__ float operator()(float g, float x) const { return g * math::gelu_exact_grad_fast(x); }
};
struct Silu { __device__ float operator()(float x) const { return math::silu_fast(x); } };
struct SiluBwd { __device__ float operator()(float g, float x) const { return g * math::silu_grad_fast(x); } };
struct AddOp { __device__ float operator()(float a, float b) const { return a + b; } };

template <typename T>
void gelu(const Args &c) {
  if (c.params<ctr_gelu_params>().exact)
    launch1(c, c.in<const T>(0), c.out<T>(0), c.in_numel(0), GeluExact{});
  else
    launch1(c, c.in<const T>(0), c.out<T>(0), c.in_numel(0), GeluTanh{});
}
template <typename T>
void gelu_bwd(const Args &c) {
  if (c.params<ctr_gelu_params>().exact)
    launch2(c, c.in<const T>(0), c.in<const T>(1), c.out<T>(0), c.in_numel(0), GeluExactBwd{});
  else
    launch2(c, c.in<const T>(0), c.in<const T>(1), c.out<T>(0), c.in_numel(0), GeluTanhBwd{});
}
template <typename T>
void silu(const Args &c) { launch1(c, c.in<const T>(0), c.out<T>(0), c.in_numel(0), Silu{}); }
template <typename T>
void silu_bwd(const Args &c) {
  launch2(c, c.in<const T>(0), c.in<const T>(1), c.out<T>(0), c.in_numel(0), SiluBwd{});
}
template <typename T>
void add_same(const Args &c) {
  launch2(c, c.in<const T>(0), c.in<const T>(1), c.out<T>(0), c.in_numel(0), AddOp{});
}

template <typename T>
__global__ void geglu_fwd_kernel(const T *gate, const T *up, T *y, int64_t n, bool exact) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = load(gate, i);
    store(y, i, (exact ? math::gelu_exact_fast(g) : math::gelu_fast(g)) * load(up, i));
  }
}
template <typename T>
__global__ void geglu_bwd_kernel(const T *dy, const T *gate, const T *up, T *dgate, T *dup, int64_t n, bool exact) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = load(gate, i), d = load(dy, i);
    store(dup, i, d * (exact ? math::gelu_exact_fast(g) : math::gelu_fast(g)));
    store(dgate, i, d * load(up, i) * (exact ? math::gelu_exact_grad_fast(g) : math::gelu_grad_fast(g)));
  }
}
template <typename T>
void geglu(const Args &c) {
  const int64_t n = c.in_numel(0);
  const bool exact = c.params<ctr_gelu_params>().exact != 0;
  CTR_LAUNCH(geglu_fwd_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.out<T>(0), n,
                                                         exact);
}
template <typename T>
void geglu_bwd(const Args &c) {
  const int64_t n = c.in_numel(0);
  const bool exact = c.params<ctr_gelu_params>().exact != 0;
  CTR_LAUNCH(geglu_bwd_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const T>(2),
                                                         c.out<T>(0), c.out<T>(1), n, exact);
}
template <typename T>
__global__ void swiglu_fwd_kernel(const T *gate, const T *up, T *y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, math::silu_fast(load(gate, i)) * load(up, i));
}
template <typename T>
__global__ void swiglu_bwd_kernel(const T *dy, const T *gate, const T *up, T *dgate, T *dup, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float g = load(gate, i), d = load(dy, i);
    store(dup, i, d * math::silu_fast(g));
    store(dgate, i, d * load(up, i) * math::silu_grad_fast(g));
  }
}
template <typename T>
void swiglu(const Args &c) {
  const int64_t n = c.in_numel(0);
  CTR_LAUNCH(swiglu_fwd_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.out<T>(0), n);
}
template <typename T>
void swiglu_bwd(const Args &c) {
  const int64_t n = c.in_numel(0);
  CTR_LAUNCH(swiglu_bwd_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const T>(2),
                                                          c.out<T>(0), c.out<T>(1), n);
}

// ---------------------------------------------------------------------------
// Unary math through the functors of math.h; backward reads what the CPU
// backward reads (the output or the input, see math.h), neg reads nothing.

template <typename F>
struct UnaryValue {
  F f;
  __device__ float operator()(float x) const { return f.value(x); }
};
template <typename F>
struct UnaryGrad {
  F f;
  __device__ float operator()(float g, float v) const { return g * f.grad(v); }
};
struct Negate { __device__ float operator()(float g) const { return -g; } };

template <typename F>
F make_functor(const Args &) { return F{}; }
template <>
math::Pow make_functor<math::Pow>(const Args &c) { return math::Pow{c.params<ctr_pow_params>().exponent}; }
template <>
math::Clamp make_functor<math::Clamp>(const Args &c) {
  const auto &p = c.params<ctr_clamp_params>();
  return math::Clamp{p.min, p.max};
}

template <typename F, typename T>
void unary(const Args &c) {
  launch1(c, c.in<const T>(0), c.out<T>(0), c.in_numel(0), UnaryValue<F>{make_functor<F>(c)});
}
template <typename F, typename T>
void unary_bwd(const Args &c) {
  if constexpr (std::is_same_v<F, math::Neg>)
    launch1(c, c.in<const T>(0), c.out<T>(0), c.in_numel(0), Negate{});
  else
    launch2(c, c.in<const T>(0), c.in<const T>(1), c.out<T>(0), c.in_numel(0), UnaryGrad<F>{make_functor<F>(c)});
}
template <typename F>
void unary_any(const Args &c) { c.bf16() ? unary<F, __nv_bfloat16>(c) : unary<F, float>(c); }
template <typename F>
void unary_bwd_any(const Args &c) { c.bf16() ? unary_bwd<F, __nv_bfloat16>(c) : unary_bwd<F, float>(c); }

// ---------------------------------------------------------------------------
// Broadcasting arithmetic: the output's index is decomposed over its dims and
// recomposed with each operand's strides (0 along a stretched dim).

struct Bcast {
  int rank;
  int64_t out[CTR_MAX_DIMS];
  int64_t sa[CTR_MAX_DIMS], sb[CTR_MAX_DIMS];
};

Bcast make_bcast(const ctr_tensor_ref &a, const ctr_tensor_ref &b, const ctr_tensor_ref &o) {
  Bcast p{};
  p.rank = o.ndim;
  auto strides = [&](const ctr_tensor_ref &x, int64_t *s) {
    int64_t st = 1;
    for (int d = o.ndim - 1; d >= 0; --d) {
      const int xd = d - (o.ndim - x.ndim);
      const int64_t size = xd >= 0 ? x.shape[xd] : 1;
      s[d] = size == 1 ? 0 : st;
      st *= size;
    }
  };
  for (int d = 0; d < o.ndim; ++d) p.out[d] = o.shape[d];
  strides(a, p.sa);
  strides(b, p.sb);
  return p;
}

enum class BinOp { Add, Sub, Mul, Div };

template <BinOp Op>
__device__ __forceinline__ float apply(float a, float b) {
  if constexpr (Op == BinOp::Add) return a + b;
  if constexpr (Op == BinOp::Sub) return a - b;
  if constexpr (Op == BinOp::Mul) return a * b;
  return a / b;
}

template <BinOp Op, typename T>
__global__ void binary_kernel(const T *a, const T *b, T *y, int64_t n, Bcast p) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    int64_t r = i, ia = 0, ib = 0;
    for (int d = p.rank - 1; d >= 0; --d) {
      const int64_t k = r % p.out[d];
      r /= p.out[d];
      ia += k * p.sa[d];
      ib += k * p.sb[d];
    }
    store(y, i, apply<Op>(load(a, ia), load(b, ib)));
  }
}

template <BinOp Op, typename T>
void binary(const Args &c) {
  const int64_t n = c.out_numel(0);
  const Bcast p = make_bcast(c.in_ref(0), c.in_ref(1), c.out_ref(0));
  CTR_LAUNCH(binary_kernel<Op>, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(1), c.out<T>(0), n, p);
}
template <BinOp Op>
void binary_any(const Args &c) { c.bf16() ? binary<Op, __nv_bfloat16>(c) : binary<Op, float>(c); }

// ---------------------------------------------------------------------------
// Column sums: db[nb] = sum over the n / nb rows of x (times a when given), in
// two stages (common.cuh): a block sums 32 columns of one range of rows, a
// warp reading 32 neighbours of a row and 8 row lanes in turn, its lanes'
// partials added in lane order.

template <typename T, typename O>
__global__ void column_sum_partial_kernel(const T *x, const T *a, O *dst, int64_t rows, int64_t nb,
                                          int64_t rows_per_chunk) {
  __shared__ float part[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = blockIdx.x * int64_t{kColTile} + tx;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float s = 0.0f;
  if (j < nb)
    for (int64_t i = (r0 + ty) * nb + j, end = r1 * nb; i < end; i += kRowLanes * nb)
      s += a ? load(x, i) * load(a, i) : load(x, i);
  part[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && j < nb) {
    float t = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) t += part[k][tx];
    store(dst, blockIdx.y * nb + j, t);
  }
}

// A sum over one column of all n elements: one block, a fixed order.
template <typename T, typename O>
__global__ void scalar_sum_kernel(const T *x, const T *a, O *out, int64_t n) {
  __shared__ float sh[32];
  float s = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += a ? load(x, i) * load(a, i) : load(x, i);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) store(out, 0, s);
}

template <typename T, typename O>
void column_sum(StreamCtx &sc, const T *x, const T *a, O *db, int64_t n, int64_t nb) {
  if (nb == 1) {
    CTR_LAUNCH(scalar_sum_kernel, 1, 1024, 0, sc.stream)(x, a, db, n);
    return;
  }
  const int64_t rows = n / nb;
  const ColumnSplit sp = column_split(rows, nb, sc.workspace_bytes);
  const dim3 grid(static_cast<unsigned>((nb + kColTile - 1) / kColTile), static_cast<unsigned>(sp.chunks));
  if (sp.chunks == 1) {
    CTR_LAUNCH(column_sum_partial_kernel, grid, dim3(kColTile, kRowLanes), 0, sc.stream)(x, a, db, rows, nb,
                                                                                         sp.rows_per_chunk);
    return;
  }
  float *partials = static_cast<float *>(sc.workspace);
  CTR_LAUNCH(column_sum_partial_kernel, grid, dim3(kColTile, kRowLanes), 0, sc.stream)(x, a, partials, rows, nb,
                                                                                       sp.rows_per_chunk);
  CTR_LAUNCH(sum_partials_kernel, grid_for(nb), 256, 0, sc.stream)(static_cast<const float *>(partials), db,
                                                                   sp.chunks, nb);
}

// reduce_rows and linear_bwd_b: db[nb] = column sums of dout[n]. The gradient
// of a parameter is f32 whatever the activations' storage.
template <typename T>
void column_sums_of(const ctr_tensor_ref &x, const ctr_tensor_ref &out, StreamCtx &sc) {
  const T *xp = static_cast<const T *>(x.data), *none = nullptr;
  if (out.dtype == CTR_DTYPE_BF16)
    column_sum(sc, xp, none, static_cast<__nv_bfloat16 *>(out.data), x.numel, out.numel);
  else
    column_sum(sc, xp, none, static_cast<float *>(out.data), x.numel, out.numel);
}
void reduce_rows_any(const Args &c) { launch_column_sums(c.in_ref(0), c.out_ref(0), *c.s); }

// mul_bwd(dout, a, b) -> (da, db): da = dout * b (b broadcast over rows), db =
// column sums of dout * a. Either output may be absent (a null ref).
template <typename T>
__global__ void mul_rows_kernel(const T *x, const T *b, T *y, int64_t n, int64_t nb) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(x, i) * load(b, i % nb));
}
template <typename T>
void mul_bwd(const Args &c) {
  const int64_t n = c.in_numel(1), nb = c.in_numel(2);
  if (T *da = c.out<T>(0))
    CTR_LAUNCH(mul_rows_kernel, grid_for(n), 256, 0, c.stream())(c.in<const T>(0), c.in<const T>(2), da, n, nb);
  if (c.num_outputs() > 1 && c.out<void>(1)) {
    if (c.out_ref(1).dtype == CTR_DTYPE_BF16)
      column_sum(*c.s, c.in<const T>(0), c.in<const T>(1), c.out<__nv_bfloat16>(1), n, nb);
    else
      column_sum(*c.s, c.in<const T>(0), c.in<const T>(1), c.out<float>(1), n, nb);
  }
}

// cast: a copy in the output's dtype (f32 <-> bf16, round to nearest even).
template <typename I, typename O>
__global__ void cast_kernel(const I *x, O *y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(x, i));
}
void k_cast(const Args &c) {
  const int64_t n = c.in_numel(0);
  if (n == 0) return;
  const bool in16 = c.in_ref(0).dtype == CTR_DTYPE_BF16, out16 = c.out_ref(0).dtype == CTR_DTYPE_BF16;
  if (in16 == out16)
    CTR_CUDA_CHECK(cudaMemcpyAsync(c.out<void>(0), c.in<void>(0), static_cast<size_t>(c.in_ref(0).bytes), cudaMemcpyDeviceToDevice,
                    c.stream()));
  else if (out16)
    CTR_LAUNCH(cast_kernel, grid_for(n), 256, 0, c.stream())(c.in<const float>(0), c.out<__nv_bfloat16>(0), n);
  else
    CTR_LAUNCH(cast_kernel, grid_for(n), 256, 0, c.stream())(c.in<const __nv_bfloat16>(0), c.out<float>(0), n);
}

void k_gelu(const Args &c) { CTR_CUDA_DISPATCH(c, gelu); }
void k_gelu_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, gelu_bwd); }
void k_silu(const Args &c) { CTR_CUDA_DISPATCH(c, silu); }
void k_silu_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, silu_bwd); }
void k_swiglu(const Args &c) { CTR_CUDA_DISPATCH(c, swiglu); }
void k_geglu(const Args &c) { CTR_CUDA_DISPATCH(c, geglu); }
void k_geglu_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, geglu_bwd); }
void k_swiglu_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, swiglu_bwd); }
void k_add_same(const Args &c) { CTR_CUDA_DISPATCH(c, add_same); }
void k_mul_bwd(const Args &c) { c.in_ref(0).dtype == CTR_DTYPE_BF16 ? mul_bwd<__nv_bfloat16>(c) : mul_bwd<float>(c); }

}  // namespace

void launch_column_sums(const ctr_tensor_ref &x, const ctr_tensor_ref &out, StreamCtx &s) {
  if (x.numel == 0 || out.numel == 0) return;
  x.dtype == CTR_DTYPE_BF16 ? column_sums_of<__nv_bfloat16>(x, out, s) : column_sums_of<float>(x, out, s);
}
void launch_gelu_tanh(const ctr_tensor_ref &x, const ctr_tensor_ref &y, cudaStream_t s) {
  const int64_t n = x.numel;
  if (n == 0) return;
  const bool packed = aligned16(x.data) && aligned16(y.data);
  if (x.dtype == CTR_DTYPE_BF16)
    CTR_LAUNCH(map1, map_grid<__nv_bfloat16>(n, packed), 256, 0, s)(
        static_cast<const __nv_bfloat16 *>(x.data), static_cast<__nv_bfloat16 *>(y.data), n, packed, GeluTanh{});
  else
    CTR_LAUNCH(map1, map_grid<float>(n, packed), 256, 0, s)(static_cast<const float *>(x.data),
                                                            static_cast<float *>(y.data), n, packed, GeluTanh{});
}
void launch_gelu_tanh_bwd(const ctr_tensor_ref &g, const ctr_tensor_ref &x, const ctr_tensor_ref &y, cudaStream_t s) {
  const int64_t n = x.numel;
  if (n == 0) return;
  const bool packed = aligned16(g.data) && aligned16(x.data) && aligned16(y.data);
  if (x.dtype == CTR_DTYPE_BF16)
    CTR_LAUNCH(map2, map_grid<__nv_bfloat16>(n, packed), 256, 0, s)(
        static_cast<const __nv_bfloat16 *>(g.data), static_cast<const __nv_bfloat16 *>(x.data),
        static_cast<__nv_bfloat16 *>(y.data), n, packed, GeluTanhBwd{});
  else
    CTR_LAUNCH(map2, map_grid<float>(n, packed), 256, 0, s)(static_cast<const float *>(g.data),
                                                            static_cast<const float *>(x.data),
                                                            static_cast<float *>(y.data), n, packed, GeluTanhBwd{});
}

const KernelEntry kElementwiseKernels[] = {
    {"cast", bind<k_cast>},
    {"gelu", bind<k_gelu>},
    {"gelu_bwd", bind<k_gelu_bwd>},
    {"silu", bind<k_silu>},
    {"silu_bwd", bind<k_silu_bwd>},
    {"swiglu", bind<k_swiglu>},
    {"geglu", bind<k_geglu>},
    {"geglu_bwd", bind<k_geglu_bwd>},
    {"swiglu_bwd", bind<k_swiglu_bwd>},
    {"add_same", bind<k_add_same>},
    {"add", bind<binary_any<BinOp::Add>>},
    {"sub", bind<binary_any<BinOp::Sub>>},
    {"mul", bind<binary_any<BinOp::Mul>>},
    {"div", bind<binary_any<BinOp::Div>>},
    {"mul_bwd", bind<k_mul_bwd>},
    {"reduce_rows", bind<reduce_rows_any>},
    {"linear_bwd_b", bind<reduce_rows_any>},
    {"exp", bind<unary_any<math::Exp>>},
    {"exp_bwd", bind<unary_bwd_any<math::Exp>>},
    {"log", bind<unary_any<math::Log>>},
    {"log_bwd", bind<unary_bwd_any<math::Log>>},
    {"tanh", bind<unary_any<math::Tanh>>},
    {"tanh_bwd", bind<unary_bwd_any<math::Tanh>>},
    {"erf", bind<unary_any<math::Erf>>},
    {"erf_bwd", bind<unary_bwd_any<math::Erf>>},
    {"rsqrt", bind<unary_any<math::Rsqrt>>},
    {"rsqrt_bwd", bind<unary_bwd_any<math::Rsqrt>>},
    {"sqrt", bind<unary_any<math::Sqrt>>},
    {"sqrt_bwd", bind<unary_bwd_any<math::Sqrt>>},
    {"relu", bind<unary_any<math::Relu>>},
    {"relu_bwd", bind<unary_bwd_any<math::Relu>>},
    {"clamp", bind<unary_any<math::Clamp>>},
    {"clamp_bwd", bind<unary_bwd_any<math::Clamp>>},
    {"neg", bind<unary_any<math::Neg>>},
    {"neg_bwd", bind<unary_bwd_any<math::Neg>>},
    {"reciprocal", bind<unary_any<math::Reciprocal>>},
    {"reciprocal_bwd", bind<unary_bwd_any<math::Reciprocal>>},
    {"sigmoid", bind<unary_any<math::Sigmoid>>},
    {"sigmoid_bwd", bind<unary_bwd_any<math::Sigmoid>>},
    {"pow", bind<unary_any<math::Pow>>},
    {"pow_bwd", bind<unary_bwd_any<math::Pow>>},
};
const size_t kElementwiseKernelCount = sizeof(kElementwiseKernels) / sizeof(kElementwiseKernels[0]);

}  // namespace ctr::cuda
