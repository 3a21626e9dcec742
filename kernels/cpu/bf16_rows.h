// bf16 <-> f32 for one row at a time, inside a kernel's own loops: the same
// exact widening and round-to-nearest-even narrowing as bf16_to_f32 and
// f32_to_bf16 (kernels.h), without their pass over the pool, for kernels that
// read and write bf16 storage row by row through a row of f32 in cache.

#pragma once

#include <cstdint>
#include <cstring>

namespace ctr::cpu {

inline float widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float widen(float f) { return f; }

inline uint16_t narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Row x[0, n) as f32: x itself, or widened into buf.
inline const float *row_f32(const float *x, int64_t, float *) { return x; }
inline const float *row_f32(const uint16_t *x, int64_t n, float *buf) {
  uint32_t *o = reinterpret_cast<uint32_t *>(buf);
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint32_t>(x[i]) << 16;
  return buf;
}

// Where a kernel writes an output row in f32: the row itself, or buf, which
// store_row then rounds into the bf16 row.
inline float *out_f32(float *y, float *) { return y; }
inline float *out_f32(uint16_t *, float *buf) { return buf; }
inline void store_row(const float *, float *, int64_t) {}
inline void store_row(const float *buf, uint16_t *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = narrow(buf[i]);
}

}  // namespace ctr::cpu
