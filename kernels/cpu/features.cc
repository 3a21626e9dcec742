// The CPU features the kernels dispatch on, read once per process.
//
// Correctness never depends on how the library was compiled: every kernel that
// uses an instruction set beyond the baseline is compiled for it with a target
// attribute (or JIT-compiled by oneDNN) and only called when the running CPU
// reports the feature here. CTR_CPU_FEATURES turns features off, never on: a
// comma-separated list of "-NAME" (avx512f, avx512_bf16, amx_bf16), so a test
// can run this machine as one without them. Anything else in it is an error,
// reported by the first step that needs the features.

#include <cpuid.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if CTR_HAVE_DNNL
#include <dnnl.h>
#endif

#include "core/status.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

struct State {
  CpuFeatures f;
  std::string error;  // a malformed CTR_CPU_FEATURES
};

// AMX with bf16 tiles, read from cpuid (leaf 7: EDX bit 22 AMX-BF16, bit 24
// AMX-TILE) and from XCR0 (bits 17 and 18: the OS saves tile state); not every
// compiler's __builtin_cpu_supports knows the AMX names.
bool amx_bf16_supported() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 22)) || !(d & (1u << 24))) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);
}

State detect() {
  State s;
  __builtin_cpu_init();
  s.f.avx512f = __builtin_cpu_supports("avx512f");
  s.f.avx512_bf16 = s.f.avx512f && __builtin_cpu_supports("avx512bf16");
  s.f.amx_bf16 = s.f.avx512_bf16 && amx_bf16_supported();
  if (const char *env = std::getenv("CTR_CPU_FEATURES"); env && *env) {
    std::string list = env;
    size_t at = 0;
    while (at <= list.size()) {
      const size_t end = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, end - at);
      at = end + 1;
      if (item.empty()) continue;
      if (item == "-avx512f") {
        s.f.avx512f = s.f.avx512_bf16 = s.f.amx_bf16 = false;
      } else if (item == "-avx512_bf16") {
        s.f.avx512_bf16 = s.f.amx_bf16 = false;
      } else if (item == "-amx_bf16") {
        s.f.amx_bf16 = false;
      } else {
        s.error = strformat("CTR_CPU_FEATURES='%s': '%s' is not one of -avx512f, -avx512_bf16, -amx_bf16 (the "
                            "variable turns features off only)",
                            env, item.c_str());
        break;
      }
    }
    s.f.masked = true;
  }
#if CTR_HAVE_DNNL
  // oneDNN reads cpuid itself: keep its JIT within what is left.
  if (s.f.masked) {
    const dnnl_cpu_isa_t isa = s.f.amx_bf16      ? dnnl_cpu_isa_all
                               : s.f.avx512_bf16 ? dnnl_cpu_isa_avx512_core_bf16
                               : s.f.avx512f     ? dnnl_cpu_isa_avx512_core
                                                 : dnnl_cpu_isa_avx2;
    dnnl_set_max_cpu_isa(isa);
  }
#endif
  return s;
}

const State &state() {
  static const State s = detect();
  return s;
}

}  // namespace

const CpuFeatures &cpu_features() { return state().f; }

const std::string &cpu_features_error() { return state().error; }

std::string bf16_unavailable() {
  const State &s = state();
  if (!s.error.empty()) return s.error;
  if (!s.f.avx512_bf16)
    return s.f.masked ? "this CPU's AVX512_BF16 is turned off (CTR_CPU_FEATURES)"
                      : "this CPU has no AVX512_BF16 (bf16 dot products), which bf16 precision on the CPU needs";
  return "";
}

bool have_dnnl() { return CTR_HAVE_DNNL != 0; }

}  // namespace ctr::cpu
