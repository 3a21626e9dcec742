// The fp32 FMA peak of this machine's cores, as a register-only loop reaches it.
//
// MFU is reported against this: no real step can do more fused multiply-adds
// per second than a loop that does nothing else, so an MFU computed over it
// stays below 1. Each thread of the process pool runs independent chains of
// vector FMAs (enough of them to cover the FMA latency) on registers only, in
// the widest vector width the CPU has (chosen at run time, not at build time),
// over short windows; the best window of each thread counts, so a moment of
// load elsewhere on the machine does not lower the figure.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

constexpr int64_t kIters = 1 << 14;  // per window: 16 chains x 16K FMAs

// Returns FLOPs done (2 per lane per FMA).
__attribute__((target("avx512f"))) double chains_avx512(float seed) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t k = 0; k < kIters; ++k)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return 2.0 * 16 * 16 * static_cast<double>(kIters);
}

__attribute__((target("avx2,fma"))) double chains_avx2(float seed) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(seed + static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t k = 0; k < kIters; ++k)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return 2.0 * 12 * 8 * static_cast<double>(kIters);
}

double chains_scalar(float seed) {
  float acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = seed + static_cast<float>(i);
  for (int64_t k = 0; k < kIters; ++k)
    for (int i = 0; i < 8; ++i) acc[i] = __builtin_fmaf(acc[i], 0.999999f, 1e-7f);
  volatile float sink = acc[0] + acc[7];
  (void)sink;
  return 2.0 * 8 * static_cast<double>(kIters);
}

double measure() {
  double (*chains)(float) = chains_scalar;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    chains = chains_avx512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    chains = chains_avx2;
  const int threads = std::max(1, num_threads());
  std::vector<double> best(static_cast<size_t>(threads), 0.0);
  using Clock = std::chrono::steady_clock;
  // Every thread measures windows for the same wall time, all at once, as a
  // step's kernels run: the figure is the machine's, not one core's.
  const auto until = Clock::now() + std::chrono::milliseconds(150);
  parallel_for(threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      double top = 0;
      int windows = 0;
      do {
        const auto t0 = Clock::now();
        const double flops = chains(1.0f + static_cast<float>(t));
        const double s = std::chrono::duration<double>(Clock::now() - t0).count();
        if (s > 0) top = std::max(top, flops / s);
        ++windows;
      } while (Clock::now() < until || windows < 3);
      best[static_cast<size_t>(t)] = top;
    }
  });
  double sum = 0;
  for (double b : best) sum += b;
  return sum;
}

}  // namespace

double fma_peak_flops() {
  static std::once_flag once;
  static double peak = 0;
  std::call_once(once, [] { peak = measure(); });
  return peak;
}

}  // namespace ctr::cpu
