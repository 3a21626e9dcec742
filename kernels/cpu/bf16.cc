// bf16 storage on the CPU: conversions between bf16 and f32.
//
// A bf16 value is the upper half of an f32, so widening is a shift and exact.
// Narrowing rounds to nearest even in integer arithmetic, the same on every
// CPU (vcvtneps2bf16 would treat subnormal inputs as zero, so results would
// depend on the CPU); the loops are plain enough for the compiler to vectorise.

#include <cstring>

#include "core/thread_pool.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

constexpr int64_t kGrain = 1 << 16;

}  // namespace

void bf16_to_f32(const uint16_t *x, float *y, int64_t n) {
  ctr::parallel_for(n, kGrain, [=](int64_t b, int64_t e) {
    uint32_t *o = reinterpret_cast<uint32_t *>(y);
    for (int64_t i = b; i < e; ++i) o[i] = static_cast<uint32_t>(x[i]) << 16;
  });
}

void f32_to_bf16(const float *x, uint16_t *y, int64_t n) {
  ctr::parallel_for(n, kGrain, [=](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] = narrow(x[i]);
  });
}

}  // namespace ctr::cpu
