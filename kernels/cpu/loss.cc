// Fused softmax cross-entropy over rows of logits.
//
// Forward computes each row's log-sum-exp (split over rows, saved for backward),
// then adds up the per-row losses in double on one thread: the loss is a mean of
// up to millions of terms and is reported and compared across ranks and runs, so
// it should not depend on float rounding order or on the thread count. Backward
// rebuilds softmax from the saved log-sum-exp, one exp per element, without a
// second max/sum pass.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_max;

// Elements per chunk below which a loop stays on the calling thread (one exp each).
constexpr int64_t kGrain = 1 << 12;


// log(sum(exp(x))) of one row, shifted by its maximum; sixteen independent
// partial sums vectorise without reassociating.
float row_logsumexp(const float *x, int64_t n) {
  const float m = row_max(x, n);
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += math::exp_fast(x[i + k] - m);
  float s = 0.0f;
  for (; i < n; ++i) s += math::exp_fast(x[i] - m);
  for (int k = 0; k < 16; ++k) s += acc[k];
  return m + std::log(s);
}

}  // namespace

void cross_entropy_fwd(const float *logits, const int32_t *targets, float *loss, float *lse,
                       int64_t *count, int64_t R, int64_t V) {
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)),
                    [=](int64_t r0, int64_t r1) {
                      for (int64_t r = r0; r < r1; ++r) lse[r] = row_logsumexp(logits + r * V, V);
                    });
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t t = targets[r];
    if (t < 0) continue;
    sum += static_cast<double>(lse[r]) - static_cast<double>(logits[r * V + t]);
    ++n;
  }
  *count = n;
  loss[0] = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
}

void cross_entropy_bwd(const float *logits, const int32_t *targets, const float *lse, float dloss,
                       int64_t count, float *dlogits, int64_t R, int64_t V) {
  const float g = count > 0 ? dloss / static_cast<float>(count) : 0.0f;
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)),
                    [=](int64_t r0, int64_t r1) {
                      for (int64_t r = r0; r < r1; ++r) {
                        float *o = dlogits + r * V;
                        const int32_t t = targets[r];
                        if (t < 0 || count <= 0) {
                          std::memset(o, 0, V * sizeof(float));
                          continue;
                        }
                        const float *x = logits + r * V;
                        const float l = lse[r];
                        for (int64_t j = 0; j < V; ++j) o[j] = g * math::exp_fast(x[j] - l);
                        o[t] -= g;
                      }
                    });
}

}  // namespace ctr::cpu
