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
#include <type_traits>
#include <vector>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_max;

// Elements per chunk below which a loop stays on the calling thread (one exp each).
constexpr int64_t kGrain = 1 << 12;


// sum(exp(x - m)) of one row; sixteen independent partial sums vectorise
// without reassociating.
float row_sum_exp(const float *x, int64_t n, float m) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += math::exp_fast(x[i + k] - m);
  float s = 0.0f;
  for (; i < n; ++i) s += math::exp_fast(x[i] - m);
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

// log(sum(exp(x))) of one row, shifted by its maximum.
float row_logsumexp(const float *x, int64_t n) {
  const float m = row_max(x, n);
  return m + std::log(row_sum_exp(x, n, m));
}

}  // namespace

namespace {

// A thread's row of V floats for the bf16 kernels (unused for f32).
float *ce_row(int64_t V) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < V) buf.resize(static_cast<size_t>(V));
  return buf.data();
}

// T: float, or uint16_t for bf16 logits (and dlogits): each row widened into
// f32, computed as in f32 and rounded once, the bits of the f32 kernel on a
// widened copy.
template <typename T>
void cross_entropy_fwd_t(const T *logits, const int32_t *targets, float *loss, float *lse, int64_t *count, int64_t R,
                         int64_t V) {
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : ce_row(V);
    for (int64_t r = r0; r < r1; ++r) lse[r] = row_logsumexp(row_f32(logits + r * V, V, buf), V);
  });
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int32_t t = targets[r];
    if (t < 0) continue;
    sum += static_cast<double>(lse[r]) - static_cast<double>(widen(logits[r * V + t]));
    ++n;
  }
  *count = n;
  loss[0] = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
}

template <typename T>
void cross_entropy_bwd_t(const T *logits, const int32_t *targets, const float *lse, float dloss, int64_t count,
                         T *dlogits, int64_t R, int64_t V) {
  const float g = count > 0 ? dloss / static_cast<float>(count) : 0.0f;
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    float *buf = std::is_same_v<T, float> ? nullptr : ce_row(V);
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t t = targets[r];
      if (t < 0 || count <= 0) {
        std::memset(dlogits + r * V, 0, V * sizeof(T));
        continue;
      }
      const float *x = row_f32(logits + r * V, V, buf);
      float *o = out_f32(dlogits + r * V, buf);  // (bf16: computed in place over the widened row)
      const float l = lse[r];
      for (int64_t j = 0; j < V; ++j) o[j] = g * math::exp_fast(x[j] - l);
      o[t] -= g;
      store_row(o, dlogits + r * V, V);
    }
  });
}

}  // namespace

void cross_entropy_fwd(const float *logits, const int32_t *targets, float *loss, float *lse, int64_t *count,
                       int64_t R, int64_t V) {
  cross_entropy_fwd_t(logits, targets, loss, lse, count, R, V);
}
void cross_entropy_fwd_bf16(const uint16_t *logits, const int32_t *targets, float *loss, float *lse,
                            int64_t *count, int64_t R, int64_t V) {
  cross_entropy_fwd_t(logits, targets, loss, lse, count, R, V);
}
void cross_entropy_bwd(const float *logits, const int32_t *targets, const float *lse, float dloss, int64_t count,
                       float *dlogits, int64_t R, int64_t V) {
  cross_entropy_bwd_t(logits, targets, lse, dloss, count, dlogits, R, V);
}
void cross_entropy_bwd_bf16(const uint16_t *logits, const int32_t *targets, const float *lse, float dloss,
                            int64_t count, uint16_t *dlogits, int64_t R, int64_t V) {
  cross_entropy_bwd_t(logits, targets, lse, dloss, count, dlogits, R, V);
}

void vocab_ce_stats(const float *logits, const int32_t *targets, float *stats, int64_t R, int64_t V,
                    int64_t offset, int64_t valid) {
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *x = logits + r * V;
      float *o = stats + r * 3;
      if (valid <= 0) {
        o[0] = -INFINITY;
        o[1] = 0.0f;
      } else {
        o[0] = row_max(x, valid);
        o[1] = row_sum_exp(x, valid, o[0]);
      }
      const int64_t t = static_cast<int64_t>(targets[r]) - offset;
      o[2] = targets[r] >= 0 && t >= 0 && t < valid ? x[t] : 0.0f;
    }
  });
}

void vocab_ce_loss(const int32_t *targets, const float *all, float *loss, float *lse, int64_t *count, int64_t R,
                   int64_t ranks) {
  double sum = 0.0;
  int64_t n = 0;
  for (int64_t r = 0; r < R; ++r) {
    float m = -INFINITY;
    for (int64_t k = 0; k < ranks; ++k) m = std::max(m, all[(k * R + r) * 3]);
    float s = 0.0f, target = 0.0f;
    for (int64_t k = 0; k < ranks; ++k) {
      const float *st = all + (k * R + r) * 3;
      if (st[1] > 0.0f) s += st[1] * std::exp(st[0] - m);
      target += st[2];
    }
    lse[r] = m + std::log(s);
    if (targets[r] < 0) continue;
    sum += static_cast<double>(lse[r]) - static_cast<double>(target);
    ++n;
  }
  *count = n;
  loss[0] = n > 0 ? static_cast<float>(sum / static_cast<double>(n)) : 0.0f;
}

void vocab_ce_bwd(const float *logits, const int32_t *targets, const float *lse, float dloss, int64_t count,
                  float *dlogits, int64_t R, int64_t V, int64_t offset, int64_t valid) {
  const float g = count > 0 ? dloss / static_cast<float>(count) : 0.0f;
  ctr::parallel_for(R, std::max<int64_t>(1, kGrain / std::max<int64_t>(V, 1)), [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float *o = dlogits + r * V;
      if (targets[r] < 0 || count <= 0) {
        std::memset(o, 0, V * sizeof(float));
        continue;
      }
      const float *x = logits + r * V;
      const float l = lse[r];
      for (int64_t j = 0; j < valid; ++j) o[j] = g * math::exp_fast(x[j] - l);
      for (int64_t j = std::max<int64_t>(valid, 0); j < V; ++j) o[j] = 0.0f;
      const int64_t t = static_cast<int64_t>(targets[r]) - offset;
      if (t >= 0 && t < valid) o[t] -= g;
    }
  });
}

}  // namespace ctr::cpu
