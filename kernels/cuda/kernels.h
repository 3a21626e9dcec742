// The CUDA backend's kernel tables, one per kernel file, and the flat
// optimizer primitives. lib/backend/cuda/cuda_backend.cc joins the tables into
// the lookup by op name.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"

namespace ctr::cuda {

extern const KernelEntry kElementwiseKernels[];
extern const size_t kElementwiseKernelCount;
extern const KernelEntry kGemmKernels[];
extern const size_t kGemmKernelCount;
extern const KernelEntry kLayoutKernels[];
extern const size_t kLayoutKernelCount;
extern const KernelEntry kNormKernels[];
extern const size_t kNormKernelCount;
extern const KernelEntry kRowKernels[];
extern const size_t kRowKernelCount;
extern const KernelEntry kLossKernels[];
extern const size_t kLossKernelCount;
extern const KernelEntry kAttentionKernels[];
extern const size_t kAttentionKernelCount;
extern const KernelEntry kMoeKernels[];
extern const size_t kMoeKernelCount;

// GEMM state shared by a backend's streams: cuBLASLt algorithm choices per
// shape. Created and destroyed by the backend.
GemmCache *gemm_cache_create();
void gemm_cache_destroy(GemmCache *c);

// Launchers that the GEMM file falls back on where cuBLASLt has no fused
// epilogue for a shape (elementwise.cu). Column sums of x (rows of
// out.numel elements) into out, in out's dtype; y = gelu(x) and
// y = g * gelu'(x) in the tanh form (y may be g), in x's storage type.
void launch_column_sums(const ctr_tensor_ref &x, const ctr_tensor_ref &out, StreamCtx &s);
void launch_gelu_tanh(const ctr_tensor_ref &x, const ctr_tensor_ref &y, cudaStream_t s);
void launch_gelu_tanh_bwd(const ctr_tensor_ref &g, const ctr_tensor_ref &x, const ctr_tensor_ref &y, cudaStream_t s);

// Flat optimizer primitives over f32 device buffers (optim.cu).
// sum of squares of x[n] into *out (one double), in a fixed order.
void sum_squares(const float *x, int64_t n, double *out, double *scratch, int64_t scratch_len, cudaStream_t s);
int64_t sum_squares_scratch_len();
void add_into(float *acc, const float *x, int64_t n, cudaStream_t s);
// One launch for every segment (ctr_adamw_args); segments are copied to the
// device by the caller (dev_segments).
void adamw(const ctr_adamw_args &a, const ctr_adamw_segment *dev_segments, cudaStream_t s);

}  // namespace ctr::cuda
