// What every CUDA kernel file shares: the stream context a kernel is launched
// with, typed views of the resolved tensors, storage conversions (f32 or bf16
// in memory, f32 in registers) and warp/block reductions.
//
// A kernel binding is a host function `void k_NAME(const Args &)`, listed in
// its file's table as bind<k_NAME>; it reads
// shapes from the tensor refs and attributes from the decoded parameter struct
// (kernels/common/op_params.h), picks the storage type from the refs' dtype and
// launches on the context's stream. Bindings never fail: shapes and dtypes were
// checked when the graph was compiled.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/plugin.h"
#include "ctr/ctr.h"
#include "cuda/check.cuh"

namespace ctr::cuda {

struct GemmCache;
struct Args;

// Attention through a library, optional (cuDNN's fused SDPA:
// lib/backend/cuda/cudnn_sdpa.cu; absent in a build without cuDNN's headers
// and on the emulated device). forward and backward each queue the attention
// or attention_bwd op of the launch on its stream and return true, or return
// false having queued nothing: the op then takes the own kernels
// (attention.cu). Either direction may run on either side of the other: both
// keep the same lse.
struct AttentionLib {
  bool (*forward)(AttentionLib *self, const Args &c) = nullptr;
  bool (*backward)(AttentionLib *self, const Args &c) = nullptr;
};

// What a kernel's stream handle points to: the stream and the per-stream
// resources kernels may use (cuBLASLt and its workspace).
struct StreamCtx {
  cudaStream_t stream = nullptr;
  cublasLtHandle_t lt = nullptr;
  void *workspace = nullptr;
  size_t workspace_bytes = 0;
  GemmCache *gemm = nullptr;  // shared by the backend's streams
  int sm_count = 0;
  bool tf32 = true;  // f32 GEMMs on TF32 tensor cores (CTR_CUDA_TF32=0: off)
  AttentionLib *attn = nullptr;  // stream 0's only; null: the own kernels
};

// A binding's view of one launch.
struct Args {
  const ctr_kernel_args *a;
  StreamCtx *s;
  template <typename T>
  T *in(int i) const { return static_cast<T *>(a->inputs[i].data); }
  template <typename T>
  T *out(int i) const { return static_cast<T *>(a->outputs[i].data); }
  const ctr_tensor_ref &in_ref(int i) const { return a->inputs[i]; }
  const ctr_tensor_ref &out_ref(int i) const { return a->outputs[i]; }
  int64_t in_numel(int i) const { return a->inputs[i].numel; }
  int64_t out_numel(int i) const { return a->outputs[i].numel; }
  int64_t in_dim(int i, int d) const {  // negative d counts from the end
    const ctr_tensor_ref &r = a->inputs[i];
    return r.shape[d < 0 ? d + r.ndim : d];
  }
  int64_t out_dim(int i, int d) const {
    const ctr_tensor_ref &r = a->outputs[i];
    return r.shape[d < 0 ? d + r.ndim : d];
  }
  int num_inputs() const { return a->num_inputs; }
  int num_outputs() const { return a->num_outputs; }
  bool bf16() const { return a->outputs[0].dtype == CTR_DTYPE_BF16; }
  template <typename P>
  const P &params() const { return *static_cast<const P *>(a->params); }
  cudaStream_t stream() const { return s->stream; }
};

// The kernel function the backend hands out for a binding: the stream handle
// it is launched with is the stream's StreamCtx.
template <void (*F)(const Args &)>
void bind(const ctr_kernel_args *a, void *stream_handle) {
  F(Args{a, static_cast<StreamCtx *>(stream_handle)});
}

// One entry of a kernel file's table: op name and bound kernel.
struct KernelEntry {
  const char *name;
  ctr_kernel_fn fn;
};

// Storage <-> register conversions.
__device__ __forceinline__ float load(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float *p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result.
// `shared` holds 32 floats. Fixed order, so results do not depend on timing.
__device__ __forceinline__ float block_sum(float v, float *shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = (blockDim.x + 31) >> 5;
  v = lane < nw ? shared[lane] : 0.0f;
  return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float *shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int nw = (blockDim.x + 31) >> 5;
  v = lane < nw ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// A kernel's dynamic shared memory (the launch's shared bytes) as `T *name`.
// Only nvcc sees this definition; the emulated device (tests/cuda_emu) has
// its own.
#if defined(__CUDACC__)
#define CTR_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif

// Grid for an element-wise loop of n items (grid-stride loops inside).
inline unsigned grid_for(int64_t n, int threads = 256) {
  int64_t b = (n + threads - 1) / threads;
  if (b > 65535LL * 32) b = 65535LL * 32;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

// ---------------------------------------------------------------------------
// Sums over the rows of each column (bias and norm weight gradients), in two
// stages so that many blocks share a column: the rows are cut into `chunks`
// ranges, stage one writes each range's partial sums [chunks, cols] (f32) to
// the stream's cuBLASLt workspace, which work on one stream uses in turn, and
// stage two adds a column's partials in range order. The cut depends on the
// shape alone, so results are bitwise the same from run to run and device to
// device. With one range, stage one writes the result itself.

constexpr int kColTile = 32;  // columns per block: a warp reads 32 neighbours of a row
constexpr int kRowLanes = 8;  // row lanes per block

struct ColumnSplit {
  int64_t chunks, rows_per_chunk;
};

// `outputs` sums per column (the norms reduce two); about 256 blocks in all,
// at least 64 rows per range, partials within `scratch_bytes`.
inline ColumnSplit column_split(int64_t rows, int64_t cols, size_t scratch_bytes, int outputs = 1) {
  const int64_t tiles = (cols + kColTile - 1) / kColTile;
  int64_t chunks = (256 + tiles - 1) / tiles;
  const int64_t by_rows = (rows + 63) / 64, by_scratch = static_cast<int64_t>(scratch_bytes / (4 * cols * outputs));
  if (chunks > by_rows) chunks = by_rows;
  if (chunks > by_scratch) chunks = by_scratch;
  if (chunks > 65535) chunks = 65535;
  if (chunks < 1) chunks = 1;
  return ColumnSplit{chunks, (rows + chunks - 1) / chunks};
}

// Stage two: out[j] = sum over ranges c of partials[c * cols + j].
template <typename O>
__global__ void sum_partials_kernel(const float *partials, O *out, int64_t chunks, int64_t cols) {
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < cols; j += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) s += partials[c * cols + j];
    store(out, j, s);
  }
}

// Calls F<float> or F<__nv_bfloat16> by the storage type of the launch.
#define CTR_CUDA_DISPATCH(args, F) \
  ((args).bf16() ? F<__nv_bfloat16>(args) : F<float>(args))

}  // namespace ctr::cuda
