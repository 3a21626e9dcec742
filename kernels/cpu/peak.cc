// The fp32 FMA peak of this machine's cores, as a register-only loop reaches it.
//
// MFU is reported against this: no real step can do more fused multiply-adds
// per second than a loop that does nothing else, so an MFU computed over it
// stays below 1. Each thread of the process pool runs independent chains of
// vector FMAs (enough of them to cover the FMA latency) on registers only, in
// the widest vector width the CPU has (chosen at run time, not at build time),
// over short windows; the best window of each thread counts, so a moment of
// load elsewhere on the machine does not lower the figure.
//
// The bf16 peak is measured the same way on the instructions the bf16 GEMMs
// run on: AMX tile products (tdpbf16ps) where the CPU has AMX and oneDNN is
// built in (gemm.cc then uses them), else vdpbf16ps chains.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

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

// vdpbf16ps: per lane two bf16 products added into an f32 (4 FLOPs).
__attribute__((target("avx512f,avx512bf16"))) double chains_bf16(float seed) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(seed + static_cast<float>(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-4f), _mm512_set1_ps(1e-4f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  for (int64_t k = 0; k < kIters; ++k)
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  volatile float sink = out[0];
  (void)sink;
  return 4.0 * 16 * 16 * static_cast<double>(kIters);
}

// AMX: four accumulator tiles of 16x16 f32, each tdpbf16ps a 16x32 by 32x16
// bf16 product (16384 FLOPs). Tiles need the kernel's permission for the
// thread's extended state, asked for once per process.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return ::syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

constexpr int64_t kTileIters = 1 << 12;

__attribute__((target("amx-tile,amx-bf16"))) double chains_amx(float) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  alignas(64) static const uint16_t data[16 * 32] = {};  // zero operands: AMX timing does not depend on values
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, data, 64);
  _tile_loadd(5, data, 64);
  _tile_loadd(6, data, 64);
  _tile_loadd(7, data, 64);
  for (int64_t k = 0; k < kTileIters; ++k) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float sink = out[0];
  (void)sink;
  return 4.0 * 16384.0 * static_cast<double>(kTileIters);
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

double measure(double (*chains)(float)) {
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
  std::call_once(once, [] {
    double (*chains)(float) = chains_scalar;
    const CpuFeatures &f = cpu_features();
    __builtin_cpu_init();
    if (f.avx512f)
      chains = chains_avx512;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      chains = chains_avx2;
    peak = measure(chains);
  });
  return peak;
}

double bf16_peak_flops() {
  static std::once_flag once;
  static double peak = 0;
  std::call_once(once, [] {
    const CpuFeatures &f = cpu_features();
    if (!bf16_unavailable().empty()) return;
    const bool amx = f.amx_bf16 && have_dnnl() && amx_permitted();
    peak = measure(amx ? chains_amx : chains_bf16);
  });
  return peak;
}

}  // namespace ctr::cpu
