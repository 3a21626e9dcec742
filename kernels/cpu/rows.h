// Row reductions shared by the CPU kernels (softmax, attention, cross-entropy,
// normalisation). Sixteen independent partial sums per loop let the compiler
// vectorise without reassociating floating-point additions, so results do not
// depend on -ffast-math.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/math.h"

namespace ctr::cpu::rows {

typedef float v16 __attribute__((vector_size(64)));

// GCC vectorises a float max reduction only under -ffinite-math-only, so the
// lanes are spelled out with the vector extension (GCC and Clang).
inline float row_max(const float *x, int64_t n) {
  v16 acc;
  for (int k = 0; k < 16; ++k) acc[k] = x[0];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    v16 v;
    std::memcpy(&v, x + i, sizeof v);
    acc = v > acc ? v : acc;
  }
  float m = acc[0];
  for (int k = 1; k < 16; ++k) m = acc[k] > m ? acc[k] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline float row_sum(const float *x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += x[i + k];
  float s = 0.0f;
  for (; i < n; ++i) s += x[i];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

// y[j] = exp(x[j] - m), returning their sum. y may be x.
inline float exp_sum(const float *x, float *y, float m, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) {
      const float e = math::exp_fast(x[i + k] - m);
      y[i + k] = e;
      acc[k] += e;
    }
  float s = 0.0f;
  for (; i < n; ++i) {
    const float e = math::exp_fast(x[i] - m);
    y[i] = e;
    s += e;
  }
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

inline float row_dot(const float *x, const float *y, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) acc[k] += x[i + k] * y[i + k];
  float s = 0.0f;
  for (; i < n; ++i) s += x[i] * y[i];
  for (int k = 0; k < 16; ++k) s += acc[k];
  return s;
}

}  // namespace ctr::cpu::rows
