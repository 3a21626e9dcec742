// Row gathers and rotations on the GPU: embedding, rotary position embedding
// and take_rows, with their backward ops (kernels/cpu/elementwise.cc, rope.cc
// and the CPU backend's take_rows bindings).
//
// embedding_bwd is a scatter-add without atomics: a thread owns one column of
// one slice of the vocabulary, walks every id in token order and adds the rows
// whose id falls in its slice. Each output element then has one owner that adds
// in token order, as the CPU's serial loop does, so the result is
// deterministic; the slices give the GPU enough threads, and the id reads are
// the same address across a warp.
//
// rope computes its angles in double, as the CPU does: t * theta^(-2i/D)
// reaches thousands of radians for long sequences, where a float angle would
// lose its fractional part. A thread owns one (position, pair) and applies its
// cos/sin to several (batch, head) rows, so the double math is amortised.

#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

bool is_bf16(const ctr_tensor_ref &r) { return r.dtype == CTR_DTYPE_BF16; }

// ---------------------------------------------------------------------------
// Embedding: out[i, :] = table[ids[i], :]

template <typename S, typename D>
__global__ void embedding_fwd_kernel(const S *table, const int32_t *ids, D *out, int64_t n, int64_t C) {
  const int64_t total = n * C;
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < total; k += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = k / C, j = k - i * C;
    store(out, k, load(table, static_cast<int64_t>(ids[i]) * C + j));
  }
}

// dtable (zeroed first) [id, c] += dout[i, c] for ids in [v0, v1) of this
// thread's slice, in token order; lookups of padding_idx (-1: none) add nothing.
template <typename S, typename D>
__global__ void embedding_bwd_kernel(const S *dout, const int32_t *ids, D *dtable, int64_t n, int64_t V, int64_t C,
                                     int64_t slice, int64_t padding_idx) {
  const int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  for (int64_t v0 = blockIdx.y * slice; v0 < V; v0 += int64_t{gridDim.y} * slice) {
    const int64_t v1 = v0 + slice < V ? v0 + slice : V;
    if (j >= C) continue;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t id = __ldg(ids + i);
      if (id < v0 || id >= v1 || id == padding_idx) continue;
      const int64_t o = id * C + j;
      store(dtable, o, load(dtable, o) + load(dout, i * C + j));
    }
  }
}

template <typename S, typename D>
void embedding(const Args &c) {
  const int64_t n = c.in_numel(1), C = c.in_dim(0, 1);
  if (n * C == 0) return;
  CTR_LAUNCH(embedding_fwd_kernel, grid_for(n * C), 256, 0, c.stream())(c.in<const S>(0), c.in<const int32_t>(1),
                                                                 c.out<D>(0), n, C);
}

template <typename S, typename D>
void embedding_bwd(const Args &c) {
  const int64_t n = c.in_numel(1), V = c.out_dim(0, 0), C = c.out_dim(0, 1);
  CTR_CUDA_CHECK(cudaMemsetAsync(c.out<void>(0), 0, static_cast<size_t>(c.out_ref(0).bytes), c.stream()));
  if (n == 0 || C == 0 || V == 0) return;
  constexpr int kThreads = 128;
  const int64_t xblocks = (C + kThreads - 1) / kThreads;
  // About 8 blocks per SM in all; more slices shorten each owner's chain of
  // dependent additions but every slice re-reads all ids.
  int64_t target = static_cast<int64_t>(c.s->sm_count > 0 ? c.s->sm_count : 80) * 8;
  int64_t slices = target / xblocks;
  if (slices < 1) slices = 1;
  if (slices > V) slices = V;
  if (slices > 65535) slices = 65535;
  const int64_t slice = (V + slices - 1) / slices;
  const dim3 grid(static_cast<unsigned>(xblocks < 2147483647 ? xblocks : 2147483647),
                  static_cast<unsigned>((V + slice - 1) / slice));
  CTR_LAUNCH(embedding_bwd_kernel, grid, kThreads, 0, c.stream())(c.in<const S>(0), c.in<const int32_t>(1), c.out<D>(0), n,
                                                          V, C, slice,
                                                          c.params<ctr_embedding_params>().padding_idx);
}

// ---------------------------------------------------------------------------
// RoPE over x[B, T, H * D]: pairs (i, i + D/2), or (2i, 2i + 1) when
// interleaved, rotated by t * theta^(-2i/D) (backward: the opposite angle).
// x may alias y: each pair is read before it is written, by one thread.

template <typename T>
__global__ void rope_kernel(const T *x, T *y, int64_t T_, int64_t BH, int64_t H, int64_t D, double theta, float sign,
                            bool interleaved) {
  const int64_t half = D / 2, pairs = T_ * half, row = H * D;
  for (int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; p < pairs; p += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = p / half, i = p - t * half;
    const double ang = static_cast<double>(t) * pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    const float cs = static_cast<float>(cos(ang)), sn = sign * static_cast<float>(sin(ang));
    const int64_t i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
    for (int64_t bh = blockIdx.y; bh < BH; bh += gridDim.y) {
      const int64_t b = bh / H, h = bh - b * H;
      const int64_t base = (b * T_ + t) * row + h * D;
      const float a = load(x, base + i1), c = load(x, base + i2);
      store(y, base + i1, a * cs - c * sn);
      store(y, base + i2, a * sn + c * cs);
    }
  }
}

template <typename T>
void rope_dir(const Args &c, float sign) {
  const auto &p = c.params<ctr_rope_params>();
  const int64_t B = c.in_dim(0, 0), T_ = c.in_dim(0, 1), H = p.heads, D = c.in_dim(0, 2) / H;
  const int64_t pairs = T_ * (D / 2), BH = B * H;
  if (pairs == 0 || BH == 0) return;
  const unsigned gx = grid_for(pairs);
  // Enough (batch, head) groups that the GPU is busy when T * D/2 is small.
  const int64_t want = static_cast<int64_t>(c.s->sm_count > 0 ? c.s->sm_count : 80) * 8;
  int64_t gy = (want + gx - 1) / gx;
  if (gy > BH) gy = BH;
  if (gy > 65535) gy = 65535;
  if (gy < 1) gy = 1;
  CTR_LAUNCH(rope_kernel, dim3(gx, static_cast<unsigned>(gy)), 256, 0, c.stream())(
      c.in<const T>(0), c.out<T>(0), T_, BH, H, D, static_cast<double>(p.theta), sign, p.interleaved != 0);
}
template <typename T>
void rope(const Args &c) { rope_dir<T>(c, 1.0f); }
template <typename T>
void rope_bwd(const Args &c) { rope_dir<T>(c, -1.0f); }

// ---------------------------------------------------------------------------
// take_rows(table, like) = table[0 : rows]: a copy of the output's size.
// take_rows_bwd(dout) -> dtable: dout in the first rows, zeros after.

template <typename S, typename D>
__global__ void convert_kernel(const S *x, D *y, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    store(y, i, load(x, i));
}

// y[0:n] = x[0:n] with conversion between the refs' storage types.
void copy_convert(const Args &c, const ctr_tensor_ref &x, const ctr_tensor_ref &y, int64_t n) {
  if (n <= 0) return;
  const bool xb = is_bf16(x), yb = is_bf16(y);
  if (xb == yb) {
    CTR_CUDA_CHECK(cudaMemcpyAsync(y.data, x.data, static_cast<size_t>(n) * (xb ? 2 : 4), cudaMemcpyDeviceToDevice, c.stream()));
  } else if (xb) {
    CTR_LAUNCH(convert_kernel, grid_for(n), 256, 0, c.stream())(static_cast<const __nv_bfloat16 *>(x.data),
                                                        static_cast<float *>(y.data), n);
  } else {
    CTR_LAUNCH(convert_kernel, grid_for(n), 256, 0, c.stream())(static_cast<const float *>(x.data),
                                                        static_cast<__nv_bfloat16 *>(y.data), n);
  }
}

void k_take_rows(const Args &c) { copy_convert(c, c.in_ref(0), c.out_ref(0), c.out_numel(0)); }

void k_take_rows_bwd(const Args &c) {
  const ctr_tensor_ref &y = c.out_ref(0);
  const int64_t n = c.in_numel(0), total = c.out_numel(0);
  copy_convert(c, c.in_ref(0), y, n);
  if (total > n) {
    const int64_t es = is_bf16(y) ? 2 : 4;
    CTR_CUDA_CHECK(cudaMemsetAsync(static_cast<char *>(y.data) + n * es, 0, static_cast<size_t>((total - n) * es), c.stream()));
  }
}

// Storage types by two refs: S read, D written.
#define CTR_ROWS_DISPATCH2(c, F, sref, dref)                                 \
  (is_bf16(sref) ? (is_bf16(dref) ? F<__nv_bfloat16, __nv_bfloat16>(c)       \
                                  : F<__nv_bfloat16, float>(c))              \
                 : (is_bf16(dref) ? F<float, __nv_bfloat16>(c) : F<float, float>(c)))

void k_embedding(const Args &c) { CTR_ROWS_DISPATCH2(c, embedding, c.in_ref(0), c.out_ref(0)); }
void k_embedding_bwd(const Args &c) { CTR_ROWS_DISPATCH2(c, embedding_bwd, c.in_ref(0), c.out_ref(0)); }
void k_rope(const Args &c) { CTR_CUDA_DISPATCH(c, rope); }
void k_rope_bwd(const Args &c) { CTR_CUDA_DISPATCH(c, rope_bwd); }

}  // namespace

const KernelEntry kRowKernels[] = {
    {"embedding", bind<k_embedding>},
    {"embedding_bwd", bind<k_embedding_bwd>},
    {"rope", bind<k_rope>},
    {"rope_bwd", bind<k_rope_bwd>},
    {"take_rows", bind<k_take_rows>},
    {"take_rows_bwd", bind<k_take_rows_bwd>},
};
const size_t kRowKernelCount = sizeof(kRowKernels) / sizeof(kRowKernels[0]);

}  // namespace ctr::cuda
