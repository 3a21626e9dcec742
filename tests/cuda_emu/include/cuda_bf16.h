// The emulated CUDA device (tests/cuda_emu) in place of the toolkit's
// <cuda_bf16.h>: bfloat16 storage with the toolkit's conversions (round to
// nearest even; NaN becomes the canonical 0x7fff, as cuda_bf16.hpp does).
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16;
inline __nv_bfloat16 __float2bfloat16_rn(float f);
inline float __bfloat162float(__nv_bfloat16 h);

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(__float2bfloat16_rn(f).__x) {}
  operator float() const { return __bfloat162float(*this); }
};
typedef __nv_bfloat16 nv_bfloat16;

struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  __nv_bfloat16 h;
  h.__x = u;
  return h;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fffu);
  u += 0x7fffu + ((u >> 16) & 1u);
  return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __ushort_as_bfloat16(0x7fffu);
  return __ushort_as_bfloat16(static_cast<unsigned short>(u >> 16));
}
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.__x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
