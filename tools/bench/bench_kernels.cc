// bench_kernels — speed of the CPU backend's large kernels on a small GPT's shapes.
//
//   bench_kernels [--seconds S] [--only linear|attention|moe|memory]
//                                     (threads: CTR_NUM_THREADS, default all cores)
//
// For each GEMM-based kernel it prints the kernel's GFLOP/s next to the rate of raw
// cblas_sgemm calls doing the same products in the same process, and their ratio:
// the share of the machine's GEMM speed the kernel keeps after its own overheads
// (splitting, bias, softmax, masking). Raw calls run with OpenBLAS's own threading at
// the same thread count, and for attention also as single-threaded calls spread over
// the thread pool; the faster of the two counts. Memory-bound kernels print GB/s of
// compulsory traffic instead.
//
// The grouped expert GEMMs of the mixture-of-experts layer are compared with one
// dense linear of the same total rows (the same FLOPs): the share of the dense
// rate the per-expert split keeps, for an even and a skewed routing.
//
// Each figure is the fastest of repeated calls within a time budget (0.5 s per
// function, the kernel and its raw reference alternating), because on a shared
// machine the slow calls measure the neighbours.

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace {

double g_seconds = 0.5;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double time_once(const std::function<void()> &fn) {
  const double t0 = now();
  fn();
  return now() - t0;
}

// Fastest wall time of each function, calling them in turn (after a warm-up call
// each) until the time budget is spent, so that all of them see the same
// background load.
std::vector<double> best_times(const std::vector<std::function<void()>> &fns) {
  std::vector<double> best(fns.size(), 1e30);
  for (auto &fn : fns) fn();
  const double start = now();
  for (int round = 0; round < 5 || now() - start < g_seconds * fns.size(); ++round)
    for (size_t i = 0; i < fns.size(); ++i) best[i] = std::min(best[i], time_once(fns[i]));
  return best;
}

double best_time(const std::function<void()> &fn) { return best_times({fn})[0]; }

std::vector<float> random_vec(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto &x : v) x = dist(rng);
  return v;
}

// OpenBLAS's own threading, for the raw reference only. The kernels expect one
// thread (they set it on their first product only), so every raw measurement
// restores it before the kernels run.
void raw_blas_threads(int n) { openblas_set_num_threads(n); }

void raw_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
               const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0f, A,
              static_cast<int>(lda), B, static_cast<int>(ldb), beta, C, static_cast<int>(ldc));
}

void print_gemm_line(const std::string &name, double flops, double t_kernel, double t_raw) {
  std::printf("%-34s %8.3f ms %8.1f GFLOP/s   raw sgemm %8.1f GFLOP/s   ratio %.2f\n", name.c_str(),
              t_kernel * 1e3, flops / t_kernel * 1e-9, flops / t_raw * 1e-9, t_raw / t_kernel);
}

void print_mem_line(const std::string &name, double bytes, double t) {
  std::printf("%-34s %8.3f ms %8.1f GB/s\n", name.c_str(), t * 1e3, bytes / t * 1e-9);
}

// ---------------------------------------------------------------------------

void bench_linear(int threads) {
  const int64_t M = 2048, K = 256, N = 1024;
  auto x = random_vec(M * K, 1), w = random_vec(N * K, 2), b = random_vec(N, 3);
  auto dy = random_vec(M * N, 4);
  std::vector<float> y(M * N), dx(M * K), dw(N * K), db(N);
  const double f = 2.0 * M * N * K;
  const std::string shape = " M=2048 K=256 N=1024";

  // Raw calls switch OpenBLAS to its own threads and back for each timing.
  auto raw = [threads](const std::function<void()> &fn) {
    return [threads, fn] {
      raw_blas_threads(threads);
      fn();
      raw_blas_threads(1);
    };
  };
  const auto t = best_times({
      raw([&] { raw_sgemm(false, true, M, N, K, x.data(), K, w.data(), K, 0, y.data(), N); }),
      raw([&] { raw_sgemm(false, false, M, K, N, dy.data(), N, w.data(), K, 0, dx.data(), K); }),
      raw([&] { raw_sgemm(true, false, N, K, M, dy.data(), N, x.data(), K, 1, dw.data(), K); }),
      [&] { ctr::cpu::linear_fwd(x.data(), w.data(), b.data(), y.data(), M, K, N); },
      [&] { ctr::cpu::linear_bwd_x(dy.data(), w.data(), dx.data(), M, K, N); },
      [&] { ctr::cpu::linear_bwd_w(dy.data(), x.data(), dw.data(), M, K, N, true); },
      [&] { ctr::cpu::linear_bwd_b(dy.data(), db.data(), M, N, true); },
  });
  const double r_fwd = t[0], r_bx = t[1], r_bw = t[2];
  const double t_fwd = t[3], t_bx = t[4], t_bw = t[5], t_bb = t[6];
  print_gemm_line("linear_fwd (+bias)" + shape, f, t_fwd, r_fwd);
  print_gemm_line("linear_bwd_x" + shape, f, t_bx, r_bx);
  print_gemm_line("linear_bwd_w (accumulate)" + shape, f, t_bw, r_bw);
  print_gemm_line("linear fwd+bwd total", 3 * f, t_fwd + t_bx + t_bw + t_bb, r_fwd + r_bx + r_bw);
  print_mem_line("linear_bwd_b", 4.0 * M * N, t_bb);
}

void bench_attention(int threads, bool causal) {
  const int64_t B = 8, T = 256, H = 4, D = 64;
  const int64_t n = B * T * H * D;
  auto q = random_vec(n, 1), k = random_vec(n, 2), v = random_vec(n, 3), dout = random_vec(n, 4);
  std::vector<float> out(n), probs(B * H * T * T), dq(n), dk(n), dv(n), scratch(B * H * T * T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int64_t ld = H * D;

  // The dense products of the forward (S = q k^T, out = P v) and backward
  // (dP = dout v^T, dq = dS k, dk = dS^T q, dv = P^T dout) for every (batch, head).
  auto fwd_products = [&](int64_t p) {
    const int64_t b = p / H, h = p % H, off = b * T * ld + h * D;
    float *S = scratch.data() + p * T * T;
    raw_sgemm(false, true, T, T, D, q.data() + off, ld, k.data() + off, ld, 0, S, T);
    raw_sgemm(false, false, T, D, T, S, T, v.data() + off, ld, 0, out.data() + off, ld);
  };
  auto bwd_products = [&](int64_t p) {
    const int64_t b = p / H, h = p % H, off = b * T * ld + h * D;
    float *S = scratch.data() + p * T * T;
    const float *P = probs.data() + p * T * T;
    raw_sgemm(false, true, T, T, D, dout.data() + off, ld, v.data() + off, ld, 0, S, T);
    raw_sgemm(false, false, T, D, T, S, T, k.data() + off, ld, 0, dq.data() + off, ld);
    raw_sgemm(true, false, T, D, T, S, T, q.data() + off, ld, 0, dk.data() + off, ld);
    raw_sgemm(true, false, T, D, T, P, T, dout.data() + off, ld, 0, dv.data() + off, ld);
  };
  auto serial = [&](const std::function<void(int64_t)> &products) {
    return [&, products] {
      raw_blas_threads(threads);
      for (int64_t p = 0; p < B * H; ++p) products(p);
      raw_blas_threads(1);
    };
  };
  auto pooled = [&](const std::function<void(int64_t)> &products) {
    return [&, products] {
      ctr::parallel_for(B * H, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) products(p);
      });
    };
  };
  const auto t = best_times({
      serial(fwd_products),
      pooled(fwd_products),
      serial(bwd_products),
      pooled(bwd_products),
      [&] {
        ctr::cpu::attention_fwd(q.data(), k.data(), v.data(), out.data(), probs.data(), B, T, H, H,
                                D, scale, causal);
      },
      [&] {
        ctr::cpu::attention_bwd(dout.data(), q.data(), k.data(), v.data(), probs.data(), dq.data(),
                                dk.data(), dv.data(), B, T, H, H, D, scale, causal);
      },
  });
  const double r_fwd = std::min(t[0], t[1]), r_bwd = std::min(t[2], t[3]);
  const double t_fwd = t[4], t_bwd = t[5];
  // FLOPs are those of the dense products for both variants, so a causal kernel
  // that skips the masked blocks shows up as a rate above the raw one.
  const double f_fwd = 4.0 * B * H * T * T * D, f_bwd = 8.0 * B * H * T * T * D;
  const std::string tag = causal ? " causal" : " full";
  print_gemm_line("attention_fwd" + tag + " B=8 T=256 H=4 D=64", f_fwd, t_fwd, r_fwd);
  print_gemm_line("attention_bwd" + tag, f_bwd, t_bwd, r_bwd);
}

// Grouped expert GEMMs over E experts (M rows in all, counts[e] rows for expert
// e, each multiplied by its own w[e]) against one dense linear of M rows: the
// same FLOPs, one weight. The backward is dx and dw together on both sides.
void bench_grouped(int64_t E, int64_t M, int64_t K, int64_t N) {
  auto x = random_vec(M * K, 1), w = random_vec(E * N * K, 2, 0.05f), dy = random_vec(M * N, 3);
  std::vector<float> y(M * N), dx(M * K), dw(E * N * K);

  // Even: M / E rows each. Skewed: rows in proportion to 1 / (e + 1), the
  // remainder to expert 0 (for E = 8, 37% of the rows to one expert, 4.6% to
  // the last).
  std::vector<int32_t> even(E, static_cast<int32_t>(M / E)), skewed(E);
  even[0] += static_cast<int32_t>(M - M / E * E);
  double h = 0;
  for (int64_t e = 0; e < E; ++e) h += 1.0 / static_cast<double>(e + 1);
  int64_t given = 0;
  for (int64_t e = 0; e < E; ++e) {
    skewed[e] = static_cast<int32_t>(static_cast<double>(M) / (h * static_cast<double>(e + 1)));
    given += skewed[e];
  }
  skewed[0] += static_cast<int32_t>(M - given);

  auto fwd = [&](const std::vector<int32_t> &c) {
    return [&] { ctr::cpu::grouped_linear_fwd(x.data(), c.data(), E, w.data(), y.data(), M, K, N, E); };
  };
  auto bwd = [&](const std::vector<int32_t> &c) {
    return [&] {
      ctr::cpu::grouped_linear_bwd(dy.data(), x.data(), c.data(), E, w.data(), dx.data(), dw.data(), M, K,
                                   N, E, 1.0f);
    };
  };
  const auto t = best_times({
      [&] { ctr::cpu::linear_fwd(x.data(), w.data(), nullptr, y.data(), M, K, N); },
      [&] {
        ctr::cpu::linear_bwd_x(dy.data(), w.data(), dx.data(), M, K, N);
        ctr::cpu::linear_bwd_w(dy.data(), x.data(), dw.data(), M, K, N, false);
      },
      fwd(even),
      bwd(even),
      fwd(skewed),
      bwd(skewed),
  });
  const double f = 2.0 * M * N * K;
  auto line = [](const std::string &name, double flops, double t_grouped, double t_dense) {
    std::printf("%-34s %8.3f ms %8.1f GFLOP/s   dense %8.1f GFLOP/s   ratio %.2f\n", name.c_str(),
                t_grouped * 1e3, flops / t_grouped * 1e-9, flops / t_dense * 1e-9, t_dense / t_grouped);
  };
  std::printf("grouped GEMM E=%lld M=%lld K=%lld N=%lld; skewed rows per expert:", static_cast<long long>(E),
              static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N));
  for (int64_t e = 0; e < E; ++e) std::printf(" %d", skewed[e]);
  std::printf("\n");
  line("grouped_linear_fwd even", f, t[2], t[0]);
  line("grouped_linear_bwd even (dx+dw)", 2 * f, t[3], t[1]);
  line("grouped_linear_fwd skewed", f, t[4], t[0]);
  line("grouped_linear_bwd skewed (dx+dw)", 2 * f, t[5], t[1]);
}

void bench_layernorm() {
  const int64_t R = 2048, C = 256;
  auto x = random_vec(R * C, 1), w = random_vec(C, 2), b = random_vec(C, 3),
       dy = random_vec(R * C, 4);
  std::vector<float> y(R * C), mean(R), rstd(R), dx(R * C), dw(C), db(C);
  const double t_f = best_time([&] {
    ctr::cpu::layernorm_fwd(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), R, C,
                            1e-5f);
  });
  const double t_b = best_time([&] {
    ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                            dw.data(), db.data(), R, C, true);
  });
  print_mem_line("layernorm_fwd R=2048 C=256", 8.0 * R * C, t_f);
  print_mem_line("layernorm_bwd", 12.0 * R * C, t_b);
}

void bench_cross_entropy() {
  const int64_t R = 2048, V = 256;
  auto x = random_vec(R * V, 1, 3.0f);
  std::vector<int32_t> tgt(R);
  for (int64_t r = 0; r < R; ++r) tgt[r] = static_cast<int32_t>((r * 37) % V);
  std::vector<float> lse(R), dx(R * V);
  float loss = 0.0f;
  int64_t count = 0;
  const double t_f = best_time(
      [&] { ctr::cpu::cross_entropy_fwd(x.data(), tgt.data(), &loss, lse.data(), &count, R, V); });
  const double t_b = best_time([&] {
    ctr::cpu::cross_entropy_bwd(x.data(), tgt.data(), lse.data(), 1.0f, count, dx.data(), R, V);
  });
  print_mem_line("cross_entropy_fwd R=2048 V=256", 4.0 * R * V, t_f);
  print_mem_line("cross_entropy_bwd", 8.0 * R * V, t_b);
}

void bench_other() {
  const int64_t n = 2048 * 1024;
  auto x = random_vec(n, 1), dy = random_vec(n, 2);
  std::vector<float> y(n);
  const double t_gf = best_time([&] { ctr::cpu::gelu_fwd(x.data(), y.data(), n); });
  const double t_gb = best_time([&] { ctr::cpu::gelu_bwd(dy.data(), x.data(), y.data(), n); });
  print_mem_line("gelu_fwd n=2048*1024", 8.0 * n, t_gf);
  print_mem_line("gelu_bwd", 12.0 * n, t_gb);

  // A small GPT's parameter count.
  const int64_t np = 3300000;
  auto p = random_vec(np, 3), g = random_vec(np, 4);
  std::vector<float> m(np), v(np);
  int64_t t = 1;
  const double t_a = best_time([&] {
    ctr::cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), np, 1e-3f, 0.9f, 0.95f, 1e-8f,
                           0.1f, t++, 1.0f);
  });
  print_mem_line("adamw_update n=3.3M", 28.0 * np, t_a);
}

bool is_section(const char *name) {
  for (const char *s : {"linear", "attention", "moe", "memory"})
    if (!std::strcmp(name, s)) return true;
  return false;
}

}  // namespace

int main(int argc, char **argv) {
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) {
      g_seconds = std::atof(argv[++i]);
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc && is_section(argv[i + 1])) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--seconds S] [--only linear|attention|moe|memory]\n", argv[0]);
      return 2;
    }
  }
  auto want = [&only](const char *section) { return only.empty() || only == section; };
  const int threads = ctr::num_threads();
  std::printf("bench_kernels: %d threads, OpenBLAS core %s\n", threads, openblas_get_corename());
  if (want("linear")) bench_linear(threads);
  if (want("attention")) {
    bench_attention(threads, true);
    bench_attention(threads, false);
  }
  // The moe preset's expert layer on the benchmarks' sizes (C=128, F=512, 1024
  // tokens, top-2 of 8), and a larger one (2048 tokens, C=512, F=1408).
  if (want("moe")) {
    bench_grouped(8, 2048, 128, 512);
    bench_grouped(8, 4096, 512, 1408);
  }
  if (want("memory")) {
    bench_layernorm();
    bench_cross_entropy();
    bench_other();
  }
  return 0;
}
