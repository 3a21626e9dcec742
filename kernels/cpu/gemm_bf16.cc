// bf16 matrix products with f32 accumulation, on oneDNN's matmul primitive.
//
// oneDNN picks its code at run time from cpuid (features.cc caps it where
// CTR_CPU_FEATURES turns features off): AMX tile products where the CPU has
// them, AVX512_BF16 dot products otherwise.
//
// Threads as in gemm.cc: the process pool cuts C into row or column blocks and
// each thread runs oneDNN single-threaded on its block (oneDNN's OpenMP team
// is kept to one thread on every pool thread, so no OpenMP threads spin beside
// the pool). Primitives are cached per thread and shape, with a scratchpad the
// thread owns, so no two threads share a primitive's memory.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/status.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"

#if CTR_HAVE_DNNL
#include <omp.h>

#include <dnnl.hpp>
#include <unordered_map>
#endif

namespace ctr::cpu {

#if CTR_HAVE_DNNL
namespace {

constexpr double kParallelFlops = 2e6;
constexpr int64_t kTile = 32;

using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool>;

struct Prim {
  dnnl::matmul mm;
  dnnl::memory::desc a, b, c, bias, scratch;
};

dnnl::engine &engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct ThreadState {
  std::map<Key, Prim> prims;
  std::vector<char> scratch;
  dnnl::stream stream{engine()};
  ThreadState() { omp_set_num_threads(1); }
};

ThreadState &thread_state() {
  thread_local ThreadState t;
  return t;
}

Prim make(const Key &k) {
  using dt = dnnl::memory::data_type;
  const auto [ta, tb, M, N, K, lda, ldb, ldc, c16, bias] = k;
  Prim p;
  p.a = dnnl::memory::desc({M, K}, dt::bf16, ta ? dnnl::memory::dims{1, lda} : dnnl::memory::dims{lda, 1});
  p.b = dnnl::memory::desc({K, N}, dt::bf16, tb ? dnnl::memory::dims{1, ldb} : dnnl::memory::dims{ldb, 1});
  p.c = dnnl::memory::desc({M, N}, c16 ? dt::bf16 : dt::f32, dnnl::memory::dims{ldc, 1});
  if (bias) p.bias = dnnl::memory::desc({1, N}, c16 ? dt::bf16 : dt::f32, dnnl::memory::dims{N, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  auto pd = bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.a, p.b, p.bias, p.c), attr, engine())
                 : dnnl::matmul::primitive_desc(dnnl::matmul::desc(p.a, p.b, p.c), attr, engine());
  p.scratch = pd.scratchpad_desc();
  p.mm = dnnl::matmul(pd);
  return p;
}

void block_run(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
           int64_t ldb, void *C, int64_t ldc, bool c16, const void *bias) {
  ThreadState &t = thread_state();
  const Key k{ta, tb, M, N, K, lda, ldb, ldc, c16, bias != nullptr};
  auto it = t.prims.find(k);
  if (it == t.prims.end()) it = t.prims.emplace(k, make(k)).first;
  Prim &p = it->second;
  const size_t need = p.scratch.get_size();
  if (t.scratch.size() < need) t.scratch.resize(need);
  auto mem = [](const dnnl::memory::desc &d, const void *ptr) {
    return dnnl::memory(d, engine(), const_cast<void *>(ptr));
  };
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, mem(p.a, A)},
                                             {DNNL_ARG_WEIGHTS, mem(p.b, B)},
                                             {DNNL_ARG_DST, mem(p.c, C)},
                                             {DNNL_ARG_SCRATCHPAD, mem(p.scratch, t.scratch.data())}};
  if (bias) args.emplace(DNNL_ARG_BIAS, mem(p.bias, bias));
  p.mm.execute(t.stream, args);
  t.stream.wait();
}

// block_run, with any failure returned as text: the pool's threads must not
// throw, so the caller raises it.
std::string block(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                  const uint16_t *B, int64_t ldb, void *C, int64_t ldc, bool c16, const void *bias) {
  try {
    block_run(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, c16, bias);
    return "";
  } catch (const dnnl::error &e) {
    return strformat("oneDNN bf16 matmul %lldx%lldx%lld: %s (status %d)", static_cast<long long>(M),
                     static_cast<long long>(N), static_cast<long long>(K), e.what(), static_cast<int>(e.status));
  } catch (const std::exception &e) {
    return strformat("oneDNN bf16 matmul %lldx%lldx%lld: %s", static_cast<long long>(M), static_cast<long long>(N),
                     static_cast<long long>(K), e.what());
  }
}

}  // namespace

void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
               int64_t ldb, void *C, int64_t ldc, bool c16, const void *bias) {
  if (M <= 0 || N <= 0) return;
  const size_t esize = c16 ? 2 : 4;
  if (K <= 0) {
    // An empty sum: C = bias (or 0).
    for (int64_t r = 0; r < M; ++r) {
      char *row = static_cast<char *>(C) + static_cast<size_t>(r * ldc) * esize;
      if (bias)
        std::memcpy(row, bias, static_cast<size_t>(N) * esize);
      else
        std::memset(row, 0, static_cast<size_t>(N) * esize);
    }
    return;
  }
  const int threads = ctr::num_threads();
  const double flops = 2.0 * static_cast<double>(M) * N * K;
  std::string err;
  if (threads == 1 || flops < kParallelFlops) {
    err = block(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, c16, bias);
  } else {
    const bool rows = M >= N;
    const int64_t n = rows ? M : N;
    int64_t grain = (n + threads - 1) / threads;
    grain = (grain + kTile - 1) / kTile * kTile;
    std::mutex mu;
    ctr::parallel_for(n, grain, [&](int64_t b, int64_t e) {
      std::string r =
          rows ? block(ta, tb, e - b, N, K, ta ? A + b : A + b * lda, lda, B, ldb,
                       static_cast<char *>(C) + static_cast<size_t>(b * ldc) * esize, ldc, c16, bias)
               : block(ta, tb, M, e - b, K, A, lda, tb ? B + b * ldb : B + b, ldb,
                       static_cast<char *>(C) + b * esize, ldc, c16,
                       bias ? static_cast<const char *>(bias) + b * esize : nullptr);
      if (!r.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (err.empty()) err = std::move(r);
      }
    });
  }
  CTR_REQUIRE(err.empty(), CTR_STATUS_INTERNAL, "%s", err.c_str());
}

#else

void gemm_bf16(bool, bool, int64_t, int64_t, int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t, void *,
               int64_t, bool, const void *) {
  CTR_CHECK(!"gemm_bf16 without oneDNN");
}

#endif

}  // namespace ctr::cpu
