// Layer normalisation and RMS normalisation over the last dimension on the GPU,
// the formulas of kernels/cpu/norm.cc.
//
// Forward and the input gradient run one block per row (grid-stride over rows):
// the row's statistics are block sums in a fixed order, two passes (mean, then
// squared deviations) as on the CPU. Saved mean and rstd are f32.
//
// The weight and bias gradients are sums over rows, reduced in two stages
// (common.cuh): the rows are cut into ranges so that about 256 blocks share
// the work, a block takes 32 columns of one range with 8 row lanes (lane y sums
// rows y, y + 8, ... of the range in order, the lanes' partials are added in
// lane order), and a second kernel adds each column's range partials in range
// order. Every sum has one owner and a fixed order, so the result does not
// depend on timing and needs no atomics; x̂ is recomputed from x, mean and rstd.

#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

// Threads for a block that walks a row of C elements: a multiple of 32.
int row_threads(int64_t C) {
  if (C >= 1024) return 512;
  if (C >= 256) return 256;
  return C > 64 ? 128 : 64;
}

// Blocks for one-block-per-row kernels over R rows (grid-stride beyond).
unsigned row_blocks(int64_t R) { return static_cast<unsigned>(R < 1 ? 1 : (R > (1 << 20) ? (1 << 20) : R)); }

bool is_bf16(const ctr_tensor_ref &r) { return r.dtype == CTR_DTYPE_BF16; }

// ---------------------------------------------------------------------------
// Forward. b may be null (layernorm without bias); mean null means RMSNorm.

template <typename X, typename W>
__global__ void layernorm_fwd_kernel(const X *x, const W *w, const W *b, X *y, float *mean, float *rstd,
                                     int64_t R, int64_t C, float eps) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X *xr = x + r * C;
    X *yr = y + r * C;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += load(xr, j);
    const float m = block_sum(s, sh) / static_cast<float>(C);
    float q = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float d = load(xr, j) - m;
      q += d * d;
    }
    const float rs = 1.0f / sqrtf(block_sum(q, sh) / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float v = (load(xr, j) - m) * rs * load(w, j);
      store(yr, j, b ? v + load(b, j) : v);
    }
  }
}

template <typename X, typename W>
__global__ void rmsnorm_fwd_kernel(const X *x, const W *w, X *y, float *rstd, int64_t R, int64_t C, float eps) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X *xr = x + r * C;
    X *yr = y + r * C;
    float q = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float v = load(xr, j);
      q += v * v;
    }
    const float rs = 1.0f / sqrtf(block_sum(q, sh) / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) store(yr, j, load(xr, j) * rs * load(w, j));
  }
}

// ---------------------------------------------------------------------------
// Input gradients. LayerNorm: dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)) with
// g = dy * w; RMSNorm (mean null): dx = rstd * (g - x * rstd² * mean(g * x)).

template <typename X, typename W>
__global__ void norm_bwd_dx_kernel(const X *dy, const X *x, const W *w, const float *mean, const float *rstd, X *dx,
                                   int64_t R, int64_t C) {
  __shared__ float sh[32];
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
    const X *g = dy + r * C;
    const X *xr = x + r * C;
    X *o = dx + r * C;
    const float s = rstd[r];
    if (mean) {
      const float m = mean[r];
      float a1 = 0.0f, a2 = 0.0f;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
        const float gw = load(g, j) * load(w, j);
        a1 += gw;
        a2 += gw * ((load(xr, j) - m) * s);
      }
      const float mg = block_sum(a1, sh) / static_cast<float>(C);
      const float mgx = block_sum(a2, sh) / static_cast<float>(C);
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
        store(o, j, s * (load(g, j) * load(w, j) - mg - ((load(xr, j) - m) * s) * mgx));
    } else {
      float a = 0.0f;
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) a += load(g, j) * load(w, j) * load(xr, j);
      const float c = s * s * block_sum(a, sh) / static_cast<float>(C);
      for (int64_t j = threadIdx.x; j < C; j += blockDim.x) store(o, j, s * (load(g, j) * load(w, j) - load(xr, j) * c));
    }
  }
}

// ---------------------------------------------------------------------------
// Parameter gradients: dw[j] = sum_r dy[r,j] * x̂[r,j], db[j] = sum_r dy[r,j]
// (db null: none), x̂ = (x - mean[r]) * rstd[r] (mean null: x * rstd[r]).
// Overwritten, not accumulated.

// Stage one: pw[chunk, j] and pb[chunk, j] for the block's range of rows
// (pb null: no bias).
template <typename X, typename O>
__global__ void norm_param_partials_kernel(const X *dy, const X *x, const float *mean, const float *rstd, O *pw,
                                           O *pb, int64_t R, int64_t C, int64_t rows_per_chunk) {
  __shared__ float sw[kRowLanes][kColTile + 1], sb[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = blockIdx.x * int64_t{kColTile} + tx;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
  float aw = 0.0f, ab = 0.0f;
  if (j < C) {
    for (int64_t r = r0 + ty; r < r1; r += kRowLanes) {
      const float g = load(dy, r * C + j);
      const float m = mean ? mean[r] : 0.0f;
      aw += g * ((load(x, r * C + j) - m) * rstd[r]);
      ab += g;
    }
  }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty == 0 && j < C) {
    float tw = 0.0f, tb = 0.0f;
    for (int k = 0; k < kRowLanes; ++k) {
      tw += sw[k][tx];
      tb += sb[k][tx];
    }
    store(pw, blockIdx.y * C + j, tw);
    if (pb) store(pb, blockIdx.y * C + j, tb);
  }
}

template <typename X, typename O>
void param_grads(const Args &c, const X *dy, const X *x, const float *mean, const float *rstd, O *dw, O *db,
                 int64_t R, int64_t C) {
  if (C == 0) return;
  const ColumnSplit sp = column_split(R < 1 ? 1 : R, C, c.s->workspace_bytes, 2);
  const dim3 grid(static_cast<unsigned>((C + kColTile - 1) / kColTile), static_cast<unsigned>(sp.chunks));
  if (sp.chunks == 1) {
    CTR_LAUNCH(norm_param_partials_kernel, grid, dim3(kColTile, kRowLanes), 0, c.stream())(
        dy, x, mean, rstd, dw, db, R, C, sp.rows_per_chunk);
    return;
  }
  float *pw = static_cast<float *>(c.s->workspace), *pb = db ? pw + sp.chunks * C : nullptr;
  CTR_LAUNCH(norm_param_partials_kernel, grid, dim3(kColTile, kRowLanes), 0, c.stream())(
      dy, x, mean, rstd, pw, pb, R, C, sp.rows_per_chunk);
  CTR_LAUNCH(sum_partials_kernel, grid_for(C), 256, 0, c.stream())(static_cast<const float *>(pw), dw, sp.chunks, C);
  if (db)
    CTR_LAUNCH(sum_partials_kernel, grid_for(C), 256, 0, c.stream())(static_cast<const float *>(pb), db, sp.chunks,
                                                                     C);
}

// ---------------------------------------------------------------------------
// Bindings. Activations (x, y, dy, dx) share one storage type X; the weight and
// bias have their own W; the saved statistics are f32; the parameter gradients
// are stored in their refs' dtype.

template <typename X, typename W>
void layernorm(const Args &c) {
  const int64_t C = c.in_dim(0, -1), R = C > 0 ? c.in_numel(0) / C : 0;
  if (R == 0) return;
  const W *b = c.num_inputs() > 2 ? c.in<const W>(2) : nullptr;
  CTR_LAUNCH(layernorm_fwd_kernel, row_blocks(R), row_threads(C), 0, c.stream())(
      c.in<const X>(0), c.in<const W>(1), b, c.out<X>(0), c.out<float>(1), c.out<float>(2), R, C,
      c.params<ctr_norm_params>().eps);
}

template <typename X, typename W>
void rmsnorm(const Args &c) {
  const int64_t C = c.in_dim(0, -1), R = C > 0 ? c.in_numel(0) / C : 0;
  if (R == 0) return;
  CTR_LAUNCH(rmsnorm_fwd_kernel, row_blocks(R), row_threads(C), 0, c.stream())(
      c.in<const X>(0), c.in<const W>(1), c.out<X>(0), c.out<float>(1), R, C, c.params<ctr_norm_params>().eps);
}

// layernorm_bwd(dy, x, w, mean, rstd) -> dx, dw, db?; rmsnorm_bwd(dy, x, w, rstd) -> dx, dw.
template <typename X, typename W>
void norm_bwd(const Args &c, bool layer) {
  const int64_t C = c.in_dim(1, -1), R = C > 0 ? c.in_numel(1) / C : 0;
  const float *mean = layer ? c.in<const float>(3) : nullptr;
  const float *rstd = c.in<const float>(layer ? 4 : 3);
  const X *dy = c.in<const X>(0), *x = c.in<const X>(1);
  if (R > 0)
    CTR_LAUNCH(norm_bwd_dx_kernel, row_blocks(R), row_threads(C), 0, c.stream())(dy, x, c.in<const W>(2), mean, rstd,
                                                                         c.out<X>(0), R, C);
  void *db = layer && c.num_outputs() > 2 ? c.out<void>(2) : nullptr;
  if (is_bf16(c.out_ref(1)))
    param_grads(c, dy, x, mean, rstd, c.out<__nv_bfloat16>(1), static_cast<__nv_bfloat16 *>(db), R, C);
  else
    param_grads(c, dy, x, mean, rstd, c.out<float>(1), static_cast<float *>(db), R, C);
}
template <typename X, typename W>
void layernorm_bwd(const Args &c) { norm_bwd<X, W>(c, true); }
template <typename X, typename W>
void rmsnorm_bwd(const Args &c) { norm_bwd<X, W>(c, false); }

// Storage types by the activation ref `xi` (an input) and the weight ref `wi`.
template <void (*FFF)(const Args &), void (*FFB)(const Args &), void (*FBF)(const Args &), void (*FBB)(const Args &)>
void dispatch2(const Args &c, int xi, int wi) {
  const bool xb = is_bf16(c.in_ref(xi)), wb = is_bf16(c.in_ref(wi));
  (xb ? (wb ? FBB : FBF) : (wb ? FFB : FFF))(c);
}
#define CTR_NORM_DISPATCH(c, F, xi, wi)                                                                    \
  dispatch2<F<float, float>, F<float, __nv_bfloat16>, F<__nv_bfloat16, float>, F<__nv_bfloat16, __nv_bfloat16>>( \
      c, xi, wi)

void k_layernorm(const Args &c) { CTR_NORM_DISPATCH(c, layernorm, 0, 1); }
void k_layernorm_bwd(const Args &c) { CTR_NORM_DISPATCH(c, layernorm_bwd, 1, 2); }
void k_rmsnorm(const Args &c) { CTR_NORM_DISPATCH(c, rmsnorm, 0, 1); }
void k_rmsnorm_bwd(const Args &c) { CTR_NORM_DISPATCH(c, rmsnorm_bwd, 1, 2); }

}  // namespace

const KernelEntry kNormKernels[] = {
    {"layernorm", bind<k_layernorm>},
    {"layernorm_bwd", bind<k_layernorm_bwd>},
    {"rmsnorm", bind<k_rmsnorm>},
    {"rmsnorm_bwd", bind<k_rmsnorm_bwd>},
};
const size_t kNormKernelCount = sizeof(kNormKernels) / sizeof(kNormKernels[0]);

}  // namespace ctr::cuda
