// The flat optimizer primitives on the GPU: the gradient's sum of squares
// (for clipping), gradient accumulation, and AdamW over every parameter
// segment in one launch. Parameters, gradients and moments are f32.

#include <cmath>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

constexpr int kSumBlocks = 256;
constexpr int kSumThreads = 256;

// Block b sums its contiguous range in double; partials are then added in
// block order by one block: the result depends on n alone, not on timing.
__global__ void sum_squares_partial(const float *x, int64_t n, double *partial) {
  __shared__ double sh[kSumThreads];
  const int64_t len = (n + gridDim.x - 1) / gridDim.x;
  const int64_t i0 = blockIdx.x * len, i1 = min(n, i0 + len);
  double s = 0.0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const double v = x[i];
    s += v * v;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

__global__ void sum_partials(const double *partial, int n, double *out) {
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int i = 0; i < n; ++i) s += partial[i];
    *out = s;
  }
}

__global__ void add_into_kernel(float *acc, const float *x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    acc[i] += x[i];
}

struct AdamwScalars {
  float lr, b1, b2, c1, c2, eps, step, inv_sqrt_bc2, grad_scale;
};

// grid.y: segment; grid.x strides over the segment's elements.
__global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, const ctr_adamw_segment *seg,
                             AdamwScalars s) {
  const ctr_adamw_segment g = seg[blockIdx.y];
  const float decay = static_cast<float>(1.0 - static_cast<double>(s.lr) * g.weight_decay);
  for (int64_t j = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; j < g.count; j += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = g.offset + j;
    const float gi = grad[i] * s.grad_scale;
    const float mi = s.b1 * m[i] + s.c1 * gi;
    const float vi = s.b2 * v[i] + s.c2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) * s.inv_sqrt_bc2 + s.eps;
    param[i] = param[i] * decay - s.step * mi / denom;
  }
}

}  // namespace

int64_t sum_squares_scratch_len() { return kSumBlocks; }

void sum_squares(const float *x, int64_t n, double *out, double *scratch, int64_t scratch_len, cudaStream_t s) {
  const int blocks = static_cast<int>(scratch_len < kSumBlocks ? scratch_len : kSumBlocks);
  CTR_LAUNCH(sum_squares_partial, blocks, kSumThreads, 0, s)(x, n, scratch);
  CTR_LAUNCH(sum_partials, 1, 32, 0, s)(scratch, blocks, out);
}

void add_into(float *acc, const float *x, int64_t n, cudaStream_t s) {
  if (n > 0) CTR_LAUNCH(add_into_kernel, grid_for(n), 256, 0, s)(acc, x, n);
}

void adamw(const ctr_adamw_args &a, const ctr_adamw_segment *dev_segments, cudaStream_t s) {
  if (a.num_segments <= 0) return;
  // Bias corrections in double on the host, as the CPU backend forms them.
  const double bc1 = 1.0 - std::pow(static_cast<double>(a.beta1), static_cast<double>(a.t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(a.beta2), static_cast<double>(a.t));
  AdamwScalars k{};
  k.lr = a.lr;
  k.b1 = a.beta1;
  k.b2 = a.beta2;
  k.c1 = 1.0f - a.beta1;
  k.c2 = 1.0f - a.beta2;
  k.eps = a.eps;
  k.step = static_cast<float>(static_cast<double>(a.lr) / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.grad_scale = a.grad_scale;
  int64_t longest = 0;
  for (int64_t i = 0; i < a.num_segments; ++i) longest = a.segments[i].count > longest ? a.segments[i].count : longest;
  int64_t gx = (longest + 255) / 256;
  if (gx > 1024) gx = 1024;
  if (gx < 1) gx = 1;
  // Segments beyond 65535 (the grid's y limit) go in further launches.
  for (int64_t first = 0; first < a.num_segments; first += 65535) {
    const int64_t ns = a.num_segments - first < 65535 ? a.num_segments - first : 65535;
    CTR_LAUNCH(adamw_kernel, dim3(static_cast<unsigned>(gx), static_cast<unsigned>(ns)), 256, 0, s)(
        a.param, a.grad, a.m, a.v, dev_segments + first, k);
  }
}

}  // namespace ctr::cuda
