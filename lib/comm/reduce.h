// Element-wise reductions shared by the communicators (the UCX rings and the
// shared-memory path), so that both reduce with the same arithmetic: NaN wins
// max and min whatever the order, integer sums wrap instead of being undefined.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "comm/comm.h"

namespace ctr {

inline size_t dtype_bytes(ctr_dtype dt) {
  switch (dt) {
    case CTR_DTYPE_F32:
    case CTR_DTYPE_I32:
      return 4;
    case CTR_DTYPE_F64:
    case CTR_DTYPE_I64:
      return 8;
    case CTR_DTYPE_BF16:
      return 2;
    default:
      return 0;
  }
}

// ------------------------------------------------------------------------------------------
// Reductions: dst[i] = a[i] op b[i], then dst[i] /= divisor when divisor > 1.
// dst may alias a or b exactly (in-place accumulation).

template <typename T>
inline T reduce_max(T a, T b) {
  if (a != a) return a;  // NaN wins, whatever the order
  return (b > a || b != b) ? b : a;
}
template <typename T>
inline T reduce_min(T a, T b) {
  if (a != a) return a;
  return (b < a || b != b) ? b : a;
}

template <typename T>
void reduce_typed(void *dst_v, const void *a_v, const void *b_v, size_t n, ReduceOp op,
                  int64_t divisor) {
  T *dst = static_cast<T *>(dst_v);
  const T *a = static_cast<const T *>(a_v);
  const T *b = static_cast<const T *>(b_v);
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Avg:
      if constexpr (std::is_integral_v<T>) {
        // Wraps on overflow like the hardware does instead of being undefined.
        using U = std::make_unsigned_t<T>;
        for (size_t i = 0; i < n; ++i)
          dst[i] = static_cast<T>(static_cast<U>(a[i]) + static_cast<U>(b[i]));
      } else {
        for (size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i];
      }
      break;
    case ReduceOp::Max:
      for (size_t i = 0; i < n; ++i) dst[i] = reduce_max(a[i], b[i]);
      break;
    case ReduceOp::Min:
      for (size_t i = 0; i < n; ++i) dst[i] = reduce_min(a[i], b[i]);
      break;
  }
  if (divisor > 1) {
    const T d = static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) dst[i] = dst[i] / d;
  }
}

// bf16 (activations of precision bf16 under tp, sp and cp): each pair widened
// to f32, combined there and rounded to nearest even once, so a reduction over
// two members rounds exactly once. NaN stays NaN.
inline float bf16_widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t bf16_round(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline void reduce_bf16(void *dst_v, const void *a_v, const void *b_v, size_t n, ReduceOp op, int64_t divisor) {
  uint16_t *dst = static_cast<uint16_t *>(dst_v);
  const uint16_t *a = static_cast<const uint16_t *>(a_v);
  const uint16_t *b = static_cast<const uint16_t *>(b_v);
  const float d = divisor > 1 ? static_cast<float>(divisor) : 1.0f;
  for (size_t i = 0; i < n; ++i) {
    const float x = bf16_widen(a[i]), y = bf16_widen(b[i]);
    float r = op == ReduceOp::Max ? reduce_max(x, y) : op == ReduceOp::Min ? reduce_min(x, y) : x + y;
    if (divisor > 1) r = r / d;
    dst[i] = bf16_round(r);
  }
}

inline void reduce(void *dst, const void *a, const void *b, size_t n, ctr_dtype dt, ReduceOp op,
            int64_t divisor) {
  switch (dt) {
    case CTR_DTYPE_BF16:
      return reduce_bf16(dst, a, b, n, op, divisor);
    case CTR_DTYPE_F32:
      return reduce_typed<float>(dst, a, b, n, op, divisor);
    case CTR_DTYPE_F64:
      return reduce_typed<double>(dst, a, b, n, op, divisor);
    case CTR_DTYPE_I32:
      return reduce_typed<int32_t>(dst, a, b, n, op, divisor);
    case CTR_DTYPE_I64:
      return reduce_typed<int64_t>(dst, a, b, n, op, divisor);
    default:
      break;
  }
}

}  // namespace ctr
