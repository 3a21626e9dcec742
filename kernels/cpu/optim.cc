// Optimizer kernels: the sum of squares behind global-norm clipping, and AdamW.
//
// sum_squares cuts its input into a fixed number of equal blocks that depends only
// on n, sums each block in double and adds the block sums in order, so the norm is
// the same whatever the thread count (clipping decisions must not change when a run
// is resumed with another CTR_NUM_THREADS).
//
// adamw_flat is one pass over the segments of five arrays (adamw_update is its
// one-segment case); the bias corrections are formed once
// in double, the per-element work is float. Its sqrt vectorises only under
// -fno-math-errno, which the build passes: otherwise GCC keeps a scalar call that
// may set errno, and the update runs about 4x slower (same results either way).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

constexpr int64_t kMaxBlocks = 64;
constexpr int64_t kMinBlock = 1 << 15;

double block_sum_squares(const float *x, int64_t n) {
  double acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) {
      const double v = x[i + k];
      acc[k] += v * v;
    }
  double s = 0.0;
  for (; i < n; ++i) s += static_cast<double>(x[i]) * x[i];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

}  // namespace

double sum_squares(const float *x, int64_t n) {
  if (n <= 0) return 0.0;
  const int64_t nblocks = std::clamp<int64_t>(n / kMinBlock, 1, kMaxBlocks);
  const int64_t len = (n + nblocks - 1) / nblocks;
  double part[kMaxBlocks];
  ctr::parallel_for(nblocks, 1, [&part, x, n, len](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * len, i1 = std::min(n, i0 + len);
      part[b] = i0 < i1 ? block_sum_squares(x + i0, i1 - i0) : 0.0;
    }
  });
  double s = 0.0;
  for (int64_t b = 0; b < nblocks; ++b) s += part[b];
  return s;
}

void adamw_update(float *param, const float *grad, float *m, float *v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  float grad_scale) {
  const int64_t offset = 0;
  adamw_flat(param, grad, m, v, &offset, &n, &weight_decay, 1, lr, beta1, beta2, eps, t, grad_scale);
}

void adamw_flat(float *param, const float *grad, float *m, float *v, const int64_t *offsets,
                const int64_t *counts, const float *weight_decay, int64_t nseg, float lr, float beta1,
                float beta2, float eps, int64_t t, float grad_scale) {
  if (nseg <= 0) return;
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(t));
  const float step = static_cast<float>(static_cast<double>(lr) / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float b1 = beta1, b2 = beta2, c1 = 1.0f - beta1, c2 = 1.0f - beta2;
  // Chunks run over the concatenation of the segments; start[k] is where
  // segment k begins in it.
  std::vector<int64_t> start(static_cast<size_t>(nseg) + 1, 0);
  for (int64_t k = 0; k < nseg; ++k) start[k + 1] = start[k] + counts[k];
  ctr::parallel_for(start[nseg], 1 << 14, [&](int64_t j0, int64_t j1) {
    int64_t k = std::upper_bound(start.begin(), start.end(), j0) - start.begin() - 1;
    while (j0 < j1) {
      const int64_t e = std::min(j1, start[k + 1]);
      const int64_t base = offsets[k] - start[k];
      const float decay = static_cast<float>(1.0 - static_cast<double>(lr) * weight_decay[k]);
      for (int64_t j = j0; j < e; ++j) {
        const int64_t i = base + j;
        const float g = grad[i] * grad_scale;
        const float mi = b1 * m[i] + c1 * g;
        const float vi = b2 * v[i] + c2 * (g * g);
        m[i] = mi;
        v[i] = vi;
        const float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
        param[i] = param[i] * decay - step * mi / denom;
      }
      j0 = e;
      ++k;
    }
  });
}

}  // namespace ctr::cpu
