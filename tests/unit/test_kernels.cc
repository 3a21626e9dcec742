// Tests of the CPU kernels (kernels/cpu/kernels.h).
//
// Every forward kernel is compared with a plain double-precision reference written
// here, and every backward kernel with central finite differences of that double
// reference: for L = sum(dy * f(x)) with a random dy, dL/dx_i is estimated as
// (L(x + h e_i) - L(x - h e_i)) / 2h in double with h = 1e-6, which is accurate to
// about 1e-9 for these smooth functions, so the tolerances below measure only the
// fp32 error of the kernel. Shapes are small and deliberately odd (R=3, C=7, T=5,
// V=11, ...); a few larger shapes exercise the blocked and multi-threaded paths, and
// the determinism tests check that reductions do not depend on the thread count.
//
// Tolerances are absolute + relative: |got - ref| <= atol + rtol * |ref|.

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/math.h"
#include "common/op_params.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace {

using F = std::vector<float>;
using Dv = std::vector<double>;
using RefFn = std::function<Dv(const Dv &)>;

// ---------------------------------------------------------------------------
// Helpers

F random_vec(int64_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  F v(static_cast<size_t>(n));
  for (auto &x : v) x = dist(rng);
  return v;
}

Dv to_d(const F &v) { return Dv(v.begin(), v.end()); }

void expect_close(const F &got, const Dv &ref, double atol, double rtol, const std::string &what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double worst = 0.0;
  size_t worst_i = 0;
  int bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double lim = atol + rtol * std::fabs(ref[i]);
    if (!(err <= lim)) ++bad;
    if (!(err <= worst) || std::isnan(err)) {
      worst = err;
      worst_i = i;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size()
                    << " elements out of tolerance; worst at " << worst_i << ": got "
                    << got[worst_i] << ", want " << ref[worst_i];
}

void expect_close(const F &got, const F &ref, double atol, double rtol, const std::string &what) {
  expect_close(got, to_d(ref), atol, rtol, what);
}

double dot(const Dv &a, const Dv &b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central finite differences of L(x) = sum(dy * f(x)) at the listed indices of x
// (all of them when `idx` is empty).
Dv fd_grad(const RefFn &f, Dv x, const Dv &dy, std::vector<size_t> idx = {}) {
  constexpr double h = 1e-6;
  if (idx.empty())
    for (size_t i = 0; i < x.size(); ++i) idx.push_back(i);
  Dv g(x.size(), 0.0);
  for (size_t i : idx) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double lp = dot(dy, f(x));
    x[i] = x0 - h;
    const double lm = dot(dy, f(x));
    x[i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

// Compares an analytic gradient with finite differences, on all indices or on a
// random sample of `samples` of them for larger inputs.
// `prior` holds what an accumulating kernel's output held before the call.
void expect_grad(const F &got, const RefFn &f, const F &x, const F &dy, double atol, double rtol,
                 const std::string &what, size_t samples = 0, const F *prior = nullptr) {
  std::vector<size_t> idx;
  if (samples && samples < x.size()) {
    std::mt19937 rng(7);
    std::uniform_int_distribution<size_t> pick(0, x.size() - 1);
    for (size_t s = 0; s < samples; ++s) idx.push_back(pick(rng));
  }
  Dv ref = fd_grad(f, to_d(x), to_d(dy), idx);
  if (prior)
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += (*prior)[i];
  if (idx.empty()) {
    expect_close(got, ref, atol, rtol, what);
    return;
  }
  F g2;
  Dv r2;
  for (size_t i : idx) {
    g2.push_back(got[i]);
    r2.push_back(ref[i]);
  }
  expect_close(g2, r2, atol, rtol, what + " (sampled)");
}

// Runs fn with the pool at `n` threads, restoring the default afterwards.
template <class Fn>
void with_threads(int n, Fn fn) {
  ctr::set_num_threads(n);
  fn();
  ctr::set_num_threads(0);
}

// ---------------------------------------------------------------------------
// Double-precision references

Dv ref_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const Dv &A,
            int64_t lda, const Dv &B, int64_t ldb, double beta, Dv C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta ? A[k * lda + i] : A[i * lda + k];
        const double b = tb ? B[j * ldb + k] : B[k * ldb + j];
        s += a * b;
      }
      double &c = C[i * ldc + j];
      c = alpha * s + (beta == 0.0 ? 0.0 : beta * c);
    }
  return C;
}

Dv ref_linear(const Dv &x, const Dv &w, const Dv *b, int64_t M, int64_t K, int64_t N) {
  Dv y(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = b ? (*b)[j] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += x[i * K + k] * w[j * K + k];
      y[i * N + j] = s;
    }
  return y;
}

Dv ref_matmul(const Dv &a, const Dv &b, int64_t batch, int64_t M, int64_t K, int64_t N,
              bool shared) {
  Dv c(batch * M * N);
  for (int64_t p = 0; p < batch; ++p) {
    const double *bp = b.data() + (shared ? 0 : p * K * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0.0;
        for (int64_t k = 0; k < K; ++k) s += a[(p * M + i) * K + k] * bp[k * N + j];
        c[(p * M + i) * N + j] = s;
      }
  }
  return c;
}

double gelu_d(double x) {
  const double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
  return 0.5 * x * (1.0 + std::tanh(u));
}
double sigmoid_d(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu_d(double x) { return x * sigmoid_d(x); }

Dv ref_softmax(const Dv &x, int64_t R, int64_t C) {
  Dv y(x.size());
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY, s = 0.0;
    for (int64_t j = 0; j < C; ++j) m = std::max(m, x[r * C + j]);
    for (int64_t j = 0; j < C; ++j) s += std::exp(x[r * C + j] - m);
    for (int64_t j = 0; j < C; ++j) y[r * C + j] = std::exp(x[r * C + j] - m) / s;
  }
  return y;
}

struct NormOut {
  Dv y, mean, rstd;
};

NormOut ref_layernorm(const Dv &x, const Dv &w, const Dv *b, int64_t R, int64_t C, double eps) {
  NormOut o{Dv(x.size()), Dv(R), Dv(R)};
  for (int64_t r = 0; r < R; ++r) {
    double m = 0.0, v = 0.0;
    for (int64_t j = 0; j < C; ++j) m += x[r * C + j];
    m /= C;
    for (int64_t j = 0; j < C; ++j) v += (x[r * C + j] - m) * (x[r * C + j] - m);
    v /= C;
    const double s = 1.0 / std::sqrt(v + eps);
    o.mean[r] = m;
    o.rstd[r] = s;
    for (int64_t j = 0; j < C; ++j)
      o.y[r * C + j] = (x[r * C + j] - m) * s * w[j] + (b ? (*b)[j] : 0.0);
  }
  return o;
}

NormOut ref_rmsnorm(const Dv &x, const Dv &w, int64_t R, int64_t C, double eps) {
  NormOut o{Dv(x.size()), Dv(), Dv(R)};
  for (int64_t r = 0; r < R; ++r) {
    double ms = 0.0;
    for (int64_t j = 0; j < C; ++j) ms += x[r * C + j] * x[r * C + j];
    const double s = 1.0 / std::sqrt(ms / C + eps);
    o.rstd[r] = s;
    for (int64_t j = 0; j < C; ++j) o.y[r * C + j] = x[r * C + j] * s * w[j];
  }
  return o;
}

// Pair i is (i, i + D/2), or (2i, 2i+1) when interleaved.
Dv ref_rope(const Dv &x, int64_t B, int64_t T, int64_t H, int64_t D, double theta, bool interleaved = false) {
  Dv y(x.size());
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * T + t) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const double ang = t * std::pow(theta, -2.0 * i / D);
          const int64_t j1 = base + (interleaved ? 2 * i : i), j2 = base + (interleaved ? 2 * i + 1 : i + half);
          const double x1 = x[j1], x2 = x[j2];
          y[j1] = x1 * std::cos(ang) - x2 * std::sin(ang);
          y[j2] = x1 * std::sin(ang) + x2 * std::cos(ang);
        }
      }
  return y;
}

struct AttnOut {
  Dv out, probs;
};

AttnOut ref_attention(const Dv &q, const Dv &k, const Dv &v, int64_t B, int64_t T, int64_t Hq,
                      int64_t Hkv, int64_t D, double scale, bool causal, int64_t window = 0,
                      double softcap = 0.0) {
  AttnOut o{Dv(B * T * Hq * D, 0.0), Dv(B * Hq * T * T, 0.0)};
  const int64_t group = Hq / Hkv;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / group;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = causal ? t + 1 : T;
        const int64_t j0 = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;  // sliding window
        Dv s(n, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = j0; j < n; ++j) {
          double acc = 0.0;
          for (int64_t d = 0; d < D; ++d)
            acc += q[((b * T + t) * Hq + h) * D + d] * k[((b * T + j) * Hkv + g) * D + d];
          s[j] = softcap > 0.0 ? softcap * std::tanh(scale * acc / softcap) : scale * acc;
          m = std::max(m, s[j]);
        }
        double sum = 0.0;
        for (auto &e : s) sum += (e = std::exp(e - m));
        for (int64_t j = j0; j < n; ++j) {
          const double p = s[j] / sum;
          o.probs[((b * Hq + h) * T + t) * T + j] = p;
          for (int64_t d = 0; d < D; ++d)
            o.out[((b * T + t) * Hq + h) * D + d] += p * v[((b * T + j) * Hkv + g) * D + d];
        }
      }
    }
  return o;
}

struct CeOut {
  double loss;
  Dv lse;
  int64_t count;
};

CeOut ref_cross_entropy(const Dv &x, const std::vector<int32_t> &tgt, int64_t R, int64_t V) {
  CeOut o{0.0, Dv(R), 0};
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY, s = 0.0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, x[r * V + j]);
    for (int64_t j = 0; j < V; ++j) s += std::exp(x[r * V + j] - m);
    o.lse[r] = m + std::log(s);
    if (tgt[r] >= 0) {
      o.loss += o.lse[r] - x[r * V + tgt[r]];
      ++o.count;
    }
  }
  if (o.count) o.loss /= static_cast<double>(o.count);
  return o;
}

// ---------------------------------------------------------------------------
// Scalar math (common/math.h)

TEST(Math, ExpFastMatchesExp) {
  // Within 4 float ulps (relative 2.4e-7) over the range where exp is normal.
  double worst = 0.0;
  for (double x = -87.0; x < 88.0; x += 0.00731) {
    const float xf = static_cast<float>(x);
    const double ref = std::exp(static_cast<double>(xf));
    worst = std::max(worst, std::fabs(ctr::math::exp_fast(xf) - ref) / ref);
  }
  EXPECT_LT(worst, 2.4e-7);
  EXPECT_EQ(ctr::math::exp_fast(-100.0f), 0.0f);
  EXPECT_EQ(ctr::math::exp_fast(-INFINITY), 0.0f);
  EXPECT_TRUE(std::isfinite(ctr::math::exp_fast(100.0f)));
  EXPECT_TRUE(std::isnan(ctr::math::exp_fast(NAN)));
  EXPECT_EQ(ctr::math::exp_fast(0.0f), 1.0f);
}

TEST(Math, TanhFastMatchesTanh) {
  // Relative to tanh within a few float ulps everywhere, the small arguments (the
  // series) included: soft-capped attention scores are mostly small.
  double worst = 0.0;
  for (double x = -20.0; x < 20.0; x += 0.000917) {
    const float xf = static_cast<float>(x);
    const double ref = std::tanh(static_cast<double>(xf));
    if (ref != 0.0) worst = std::max(worst, std::fabs(ctr::math::tanh_fast(xf) - ref) / std::fabs(ref));
  }
  EXPECT_LT(worst, 6e-7);
  for (float x : {1e-30f, -3e-9f, 1e-4f, 0.2499f, 0.25f, -0.25f}) {
    const double ref = std::tanh(static_cast<double>(x));
    EXPECT_NEAR(ctr::math::tanh_fast(x), ref, 6e-7 * std::fabs(ref)) << x;
  }
  EXPECT_EQ(ctr::math::tanh_fast(0.0f), 0.0f);
  EXPECT_EQ(ctr::math::tanh_fast(100.0f), 1.0f);
  EXPECT_EQ(ctr::math::tanh_fast(-INFINITY), -1.0f);
  EXPECT_TRUE(std::isnan(ctr::math::tanh_fast(NAN)));
}

TEST(Math, FastFormsMatchDefinitions) {
  // The vectorisable forms equal gelu/silu and their derivatives up to float
  // rounding: 2e-6 absolute + 1e-5 relative over [-12, 12].
  for (double x = -12.0; x < 12.0; x += 0.0173) {
    const float xf = static_cast<float>(x);
    EXPECT_NEAR(ctr::math::gelu_fast(xf), ctr::math::gelu(xf), 2e-6 + 1e-5 * std::fabs(x));
    EXPECT_NEAR(ctr::math::gelu_grad_fast(xf), ctr::math::gelu_grad(xf), 2e-6);
    EXPECT_NEAR(ctr::math::silu_fast(xf), ctr::math::silu(xf), 2e-6 + 1e-5 * std::fabs(x));
    EXPECT_NEAR(ctr::math::silu_grad_fast(xf), ctr::math::silu_grad(xf), 2e-6);
    EXPECT_NEAR(ctr::math::sigmoid_fast(xf), ctr::math::sigmoid(xf), 2e-7);
  }
}

// ---------------------------------------------------------------------------
// GEMM

struct GemmCase {
  int64_t M, N, K;
};

TEST(Gemm, AllTransposesWithStridesAlphaBeta) {
  // Operands in [-1, 1]; fp32 dot products of K <= 130 terms are accurate to a few
  // 1e-6, so 2e-5 absolute + 1e-5 relative. The larger cases are above the
  // parallel threshold and split over rows (M >= N) or columns (M < N).
  for (GemmCase c :
       {GemmCase{3, 7, 5}, GemmCase{1, 1, 1}, GemmCase{150, 61, 130}, GemmCase{61, 200, 90}}) {
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        const int64_t pad = 3;  // leading dimensions larger than the rows
        const int64_t arows = ta ? c.K : c.M, acols = ta ? c.M : c.K;
        const int64_t brows = tb ? c.N : c.K, bcols = tb ? c.K : c.N;
        const int64_t lda = acols + pad, ldb = bcols + pad, ldc = c.N + pad;
        F A = random_vec(arows * lda, 1), B = random_vec(brows * ldb, 2);
        F C = random_vec(c.M * ldc, 3);
        const float alpha = 0.75f, beta = -0.5f;
        Dv ref =
            ref_gemm(ta, tb, c.M, c.N, c.K, alpha, to_d(A), lda, to_d(B), ldb, beta, to_d(C), ldc);
        ctr::cpu::gemm(ta, tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, beta, C.data(),
                       ldc);
        expect_close(C, ref, 2e-5, 1e-5,
                     "gemm M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) +
                         " K=" + std::to_string(c.K) + " ta=" + std::to_string(ta) +
                         " tb=" + std::to_string(tb));
      }
  }
}

TEST(Gemm, BetaZeroIgnoresNaNInOutput) {
  // beta = 0 must overwrite, not multiply: C may hold garbage (exact comparison is
  // not needed, 1e-5 as above).
  F A = random_vec(3 * 5, 1), B = random_vec(5 * 7, 2), C(3 * 7, NAN);
  ctr::cpu::gemm(false, false, 3, 7, 5, 1.0f, A.data(), 5, B.data(), 7, 0.0f, C.data(), 7);
  Dv ref = ref_gemm(false, false, 3, 7, 5, 1.0, to_d(A), 5, to_d(B), 7, 0.0, Dv(21, 0.0), 7);
  expect_close(C, ref, 1e-5, 1e-5, "gemm beta=0");
}

// ---------------------------------------------------------------------------
// Linear

TEST(Linear, Forward) {
  // K-term fp32 dot products of values in [-1, 1]: 2e-5 absolute + 1e-5 relative.
  // The larger cases split C over rows (M >= N) and over columns (M < N).
  for (GemmCase c : {GemmCase{3, 7, 5}, GemmCase{129, 67, 45}, GemmCase{40, 300, 100}}) {
    const int64_t M = c.M, N = c.N, K = c.K;
    F x = random_vec(M * K, 1), w = random_vec(N * K, 2), b = random_vec(N, 3);
    F y(M * N, NAN);
    Dv bd = to_d(b);
    ctr::cpu::linear_fwd(x.data(), w.data(), b.data(), y.data(), M, K, N);
    expect_close(y, ref_linear(to_d(x), to_d(w), &bd, M, K, N), 2e-5, 1e-5, "linear+bias");
    std::fill(y.begin(), y.end(), NAN);
    ctr::cpu::linear_fwd(x.data(), w.data(), nullptr, y.data(), M, K, N);
    expect_close(y, ref_linear(to_d(x), to_d(w), nullptr, M, K, N), 2e-5, 1e-5, "linear");
  }
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  // The function is linear in each input, so the central difference is exact up
  // to double rounding (~1e-10); the kernel's fp32 error dominates: 5e-5 + 1e-4 rel.
  const int64_t M = 5, K = 7, N = 3;
  F x = random_vec(M * K, 1), w = random_vec(N * K, 2), b = random_vec(N, 3),
    dy = random_vec(M * N, 4);
  const Dv xd = to_d(x), wd = to_d(w), bd = to_d(b);

  F dx(M * K, NAN);
  ctr::cpu::linear_bwd_x(dy.data(), w.data(), dx.data(), M, K, N);
  expect_grad(
      dx, [&](const Dv &v) { return ref_linear(v, wd, &bd, M, K, N); }, x, dy, 5e-5, 1e-4,
      "linear dx");

  for (bool acc : {false, true}) {
    F prior = random_vec(N * K, 5);
    F dw = acc ? prior : F(N * K, NAN);
    ctr::cpu::linear_bwd_w(dy.data(), x.data(), dw.data(), M, K, N, acc);
    expect_grad(
        dw, [&](const Dv &v) { return ref_linear(xd, v, &bd, M, K, N); }, w, dy, 5e-5, 1e-4,
        acc ? "linear dw accumulate" : "linear dw", 0, acc ? &prior : nullptr);

    F priorb = random_vec(N, 6);
    F db = acc ? priorb : F(N, NAN);
    ctr::cpu::linear_bwd_b(dy.data(), db.data(), M, N, acc);
    expect_grad(
        db, [&](const Dv &v) { return ref_linear(xd, wd, &v, M, K, N); }, b, dy, 5e-5, 1e-4,
        acc ? "linear db accumulate" : "linear db", 0, acc ? &priorb : nullptr);
  }
}

TEST(Linear, LargeBackwardMatchesReference) {
  // Above the parallel thresholds (both row and column splits): compare with the
  // double reference products directly; 200-term sums: 1e-4 + 1e-5 relative.
  const int64_t M = 200, K = 90, N = 130;
  F x = random_vec(M * K, 1), w = random_vec(N * K, 2), dy = random_vec(M * N, 3);
  F dx(M * K), dw(N * K), db(N);
  ctr::cpu::linear_bwd_x(dy.data(), w.data(), dx.data(), M, K, N);
  ctr::cpu::linear_bwd_w(dy.data(), x.data(), dw.data(), M, K, N, false);
  ctr::cpu::linear_bwd_b(dy.data(), db.data(), M, N, false);
  expect_close(dx, ref_gemm(false, false, M, K, N, 1, to_d(dy), N, to_d(w), K, 0, Dv(M * K), K),
               1e-4, 1e-5, "dx");
  expect_close(dw, ref_gemm(true, false, N, K, M, 1, to_d(dy), N, to_d(x), K, 0, Dv(N * K), K),
               1e-4, 1e-5, "dw");
  Dv dbr(N, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) dbr[j] += dy[i * N + j];
  expect_close(db, dbr, 1e-4, 1e-5, "db");
}

// ---------------------------------------------------------------------------
// Matmul

TEST(Matmul, ForwardSharedAndBatched) {
  // K <= 9 term products: 1e-5 absolute + 1e-5 relative.
  for (bool shared : {false, true})
    for (int64_t batch : {1, 3, 8}) {
      const int64_t M = 5, K = 9, N = 7;
      F a = random_vec(batch * M * K, 1), b = random_vec((shared ? 1 : batch) * K * N, 2);
      F c(batch * M * N, NAN);
      ctr::cpu::matmul_fwd(a.data(), b.data(), c.data(), batch, M, K, N, shared);
      expect_close(c, ref_matmul(to_d(a), to_d(b), batch, M, K, N, shared), 1e-5, 1e-5,
                   "matmul batch=" + std::to_string(batch) + (shared ? " shared" : ""));
    }
}

TEST(Matmul, BackwardMatchesFiniteDifferences) {
  // Linear in each input, so the difference quotient is exact to ~1e-10; the fp32
  // kernel error dominates: 5e-5 absolute + 1e-4 relative.
  for (bool shared : {false, true})
    for (int64_t batch : {1, 3}) {
      const int64_t M = 3, K = 5, N = 4;
      F a = random_vec(batch * M * K, 1), b = random_vec((shared ? 1 : batch) * K * N, 2);
      F dc = random_vec(batch * M * N, 3);
      F da(a.size(), NAN), db(b.size(), NAN);
      ctr::cpu::matmul_bwd(dc.data(), a.data(), b.data(), da.data(), db.data(), batch, M, K, N,
                           shared);
      const Dv ad = to_d(a), bd = to_d(b);
      const std::string tag = " batch=" + std::to_string(batch) + (shared ? " shared" : "");
      expect_grad(
          da, [&](const Dv &v) { return ref_matmul(v, bd, batch, M, K, N, shared); }, a, dc, 5e-5,
          1e-4, "matmul da" + tag);
      expect_grad(
          db, [&](const Dv &v) { return ref_matmul(ad, v, batch, M, K, N, shared); }, b, dc, 5e-5,
          1e-4, "matmul db" + tag);
      // Either output may be skipped.
      F db2(b.size(), NAN);
      ctr::cpu::matmul_bwd(dc.data(), a.data(), b.data(), nullptr, db2.data(), batch, M, K, N,
                           shared);
      expect_close(db2, db, 0.0, 0.0, "matmul db alone" + tag);
    }
}

TEST(Matmul, LargeBatchMatchesReference) {
  // Enough work per batch entry that the batch is spread over the threads;
  // backward checked against the double products da = dc b^T, db = a^T dc.
  // 56-term sums: 2e-5 absolute + 1e-5 relative.
  const int64_t batch = 16, M = 48, K = 40, N = 56;
  F a = random_vec(batch * M * K, 1), b = random_vec(batch * K * N, 2);
  F dc = random_vec(batch * M * N, 3);
  F c(batch * M * N, NAN), da(a.size(), NAN), db(b.size(), NAN);
  ctr::cpu::matmul_fwd(a.data(), b.data(), c.data(), batch, M, K, N, false);
  ctr::cpu::matmul_bwd(dc.data(), a.data(), b.data(), da.data(), db.data(), batch, M, K, N, false);
  expect_close(c, ref_matmul(to_d(a), to_d(b), batch, M, K, N, false), 2e-5, 1e-5, "c");
  Dv rda(a.size()), rdb(b.size());
  for (int64_t p = 0; p < batch; ++p) {
    Dv dcp(dc.begin() + p * M * N, dc.begin() + (p + 1) * M * N);
    Dv ap(a.begin() + p * M * K, a.begin() + (p + 1) * M * K);
    Dv bp(b.begin() + p * K * N, b.begin() + (p + 1) * K * N);
    Dv x = ref_gemm(false, true, M, K, N, 1, dcp, N, bp, N, 0, Dv(M * K), K);
    Dv y = ref_gemm(true, false, K, N, M, 1, ap, K, dcp, N, 0, Dv(K * N), N);
    std::copy(x.begin(), x.end(), rda.begin() + p * M * K);
    std::copy(y.begin(), y.end(), rdb.begin() + p * K * N);
  }
  expect_close(da, rda, 2e-5, 1e-5, "da");
  expect_close(db, rdb, 2e-5, 1e-5, "db");
}

// ---------------------------------------------------------------------------
// Embedding

TEST(Embedding, Forward) {
  // A gather: exact.
  const int64_t n = 6, V = 11, C = 7;
  std::vector<int32_t> ids = {3, 0, 10, 3, 7, 3};
  F table = random_vec(V * C, 1), out(n * C, NAN);
  ctr::cpu::embedding_fwd(ids.data(), table.data(), out.data(), n, V, C);
  Dv ref(n * C);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < C; ++j) ref[i * C + j] = table[ids[i] * C + j];
  expect_close(out, ref, 0.0, 0.0, "embedding");
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  // Repeated ids add up; a sum of at most 3 fp32 terms: 1e-6 + 1e-6 relative.
  const int64_t n = 6, V = 11, C = 7;
  std::vector<int32_t> ids = {3, 0, 10, 3, 7, 3};
  F table = random_vec(V * C, 1), dout = random_vec(n * C, 2);
  auto f = [&](const Dv &t) {
    Dv o(n * C);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < C; ++j) o[i * C + j] = t[ids[i] * C + j];
    return o;
  };
  for (bool acc : {false, true}) {
    F prior = random_vec(V * C, 3);
    F dt = acc ? prior : F(V * C, NAN);
    ctr::cpu::embedding_bwd(ids.data(), dout.data(), dt.data(), n, V, C, acc);
    expect_grad(dt, f, table, dout, 1e-6, 1e-6, acc ? "embedding accumulate" : "embedding", 0,
                acc ? &prior : nullptr);
  }
}

// ---------------------------------------------------------------------------
// Broadcast arithmetic

struct BcastCase {
  int64_t n, nb;
};

Dv ref_bcast(const Dv &a, const Dv &b, int64_t n, int64_t nb, bool mul) {
  Dv o(n);
  for (int64_t i = 0; i < n; ++i) o[i] = mul ? a[i] * b[i % nb] : a[i] + b[i % nb];
  return o;
}

TEST(Broadcast, AddAndMulForward) {
  // One fp32 operation per element: rounding only, 1e-7 + 1e-7 relative.
  for (BcastCase c : {BcastCase{21, 7}, BcastCase{21, 1}, BcastCase{21, 21},
                      BcastCase{3 * 40000, 40000}, BcastCase{50000, 1}}) {
    F a = random_vec(c.n, 1), b = random_vec(c.nb, 2), o(c.n, NAN);
    ctr::cpu::add_fwd(a.data(), b.data(), o.data(), c.n, c.nb);
    expect_close(o, ref_bcast(to_d(a), to_d(b), c.n, c.nb, false), 1e-7, 1e-7, "add");
    ctr::cpu::mul_fwd(a.data(), b.data(), o.data(), c.n, c.nb);
    expect_close(o, ref_bcast(to_d(a), to_d(b), c.n, c.nb, true), 1e-7, 1e-7, "mul");
  }
}

TEST(Broadcast, ReduceRowsAndMulBackwardMatchFiniteDifferences) {
  // Sums of n/nb fp32 terms (at most 21 here): 1e-5 + 1e-5 relative.
  for (BcastCase c : {BcastCase{21, 7}, BcastCase{21, 1}, BcastCase{21, 21}}) {
    const std::string tag = " n=" + std::to_string(c.n) + " nb=" + std::to_string(c.nb);
    F a = random_vec(c.n, 1), b = random_vec(c.nb, 2), dout = random_vec(c.n, 3);
    const Dv ad = to_d(a), bd = to_d(b);
    for (bool acc : {false, true}) {
      F prior = random_vec(c.nb, 4);
      F db = acc ? prior : F(c.nb, NAN);
      ctr::cpu::reduce_rows(dout.data(), db.data(), c.n, c.nb, acc);
      expect_grad(
          db, [&](const Dv &v) { return ref_bcast(ad, v, c.n, c.nb, false); }, b, dout, 1e-5, 1e-5,
          "reduce_rows" + tag, 0, acc ? &prior : nullptr);

      F da(c.n, NAN), dbm = acc ? prior : F(c.nb, NAN);
      ctr::cpu::mul_bwd(dout.data(), a.data(), b.data(), da.data(), dbm.data(), c.n, c.nb, acc);
      expect_grad(
          da, [&](const Dv &v) { return ref_bcast(v, bd, c.n, c.nb, true); }, a, dout, 1e-5, 1e-5,
          "mul da" + tag);
      expect_grad(
          dbm, [&](const Dv &v) { return ref_bcast(ad, v, c.n, c.nb, true); }, b, dout, 1e-5, 1e-5,
          "mul db" + tag, 0, acc ? &prior : nullptr);
    }
    // Either output of mul_bwd may be null; the other is unchanged by that.
    F da_both(c.n), db_both(c.nb), da(c.n, NAN), db(c.nb, NAN);
    ctr::cpu::mul_bwd(dout.data(), a.data(), b.data(), da_both.data(), db_both.data(), c.n, c.nb,
                      false);
    ctr::cpu::mul_bwd(dout.data(), a.data(), b.data(), da.data(), nullptr, c.n, c.nb, false);
    ctr::cpu::mul_bwd(dout.data(), a.data(), b.data(), nullptr, db.data(), c.n, c.nb, false);
    expect_close(da, da_both, 0.0, 0.0, "mul da alone" + tag);
    expect_close(db, db_both, 0.0, 0.0, "mul db alone" + tag);
  }
}

TEST(Broadcast, LargeReductionsMatchReference) {
  // Column-split reductions above the parallel threshold; 400-term sums of values
  // in [-1, 1]: 1e-4 absolute + 1e-5 relative.
  const int64_t rows = 400, nb = 333;
  F dout = random_vec(rows * nb, 1), a = random_vec(rows * nb, 2), b = random_vec(nb, 3);
  F db(nb), dm(nb);
  ctr::cpu::reduce_rows(dout.data(), db.data(), rows * nb, nb, false);
  ctr::cpu::mul_bwd(dout.data(), a.data(), b.data(), nullptr, dm.data(), rows * nb, nb, false);
  Dv r1(nb, 0.0), r2(nb, 0.0);
  for (int64_t i = 0; i < rows * nb; ++i) {
    r1[i % nb] += dout[i];
    r2[i % nb] += static_cast<double>(dout[i]) * a[i];
  }
  expect_close(db, r1, 1e-4, 1e-5, "reduce_rows large");
  expect_close(dm, r2, 1e-4, 1e-5, "mul db large");
}

TEST(Elementwise, AddSameAndScale) {
  // One fp32 operation per element: 1e-7 + 1e-7 relative.
  for (int64_t n : {7, 100003}) {
    F a = random_vec(n, 1), b = random_vec(n, 2), o(n, NAN);
    ctr::cpu::add_same(a.data(), b.data(), o.data(), n);
    Dv r(n);
    for (int64_t i = 0; i < n; ++i) r[i] = static_cast<double>(a[i]) + b[i];
    expect_close(o, r, 1e-7, 1e-7, "add_same");
    ctr::cpu::scale(a.data(), o.data(), n, -1.7f);
    for (int64_t i = 0; i < n; ++i) r[i] = -1.7 * a[i];
    expect_close(o, r, 1e-7, 1e-7, "scale");
  }
}

// ---------------------------------------------------------------------------
// Activations

Dv map_d(const Dv &x, const std::function<double(double)> &f) {
  Dv y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = f(x[i]);
  return y;
}

TEST(Activations, ForwardMatchesReference) {
  // Inputs in [-10, 10] (tails included). The polynomial exp is within 2 ulps, so
  // 1e-6 absolute + 2e-6 relative.
  for (int64_t n : {37, 70001}) {
    F x = random_vec(n, 1, -10.0f, 10.0f), up = random_vec(n, 2), y(n, NAN);
    const Dv xd = to_d(x);
    ctr::cpu::gelu_fwd(x.data(), y.data(), n);
    expect_close(y, map_d(xd, gelu_d), 1e-6, 2e-6, "gelu");
    ctr::cpu::silu_fwd(x.data(), y.data(), n);
    expect_close(y, map_d(xd, silu_d), 1e-6, 2e-6, "silu");
    ctr::cpu::swiglu_fwd(x.data(), up.data(), y.data(), n);
    Dv r = map_d(xd, silu_d);
    for (int64_t i = 0; i < n; ++i) r[i] *= up[i];
    expect_close(y, r, 1e-6, 2e-6, "swiglu");
  }
}

TEST(Activations, BackwardMatchesFiniteDifferences) {
  // Inputs in [-6, 6]. The derivatives go through one polynomial exp and a few
  // float operations: 5e-6 absolute + 1e-5 relative against the double quotient.
  const int64_t n = 37;
  F x = random_vec(n, 1, -6.0f, 6.0f), up = random_vec(n, 2), dy = random_vec(n, 3);
  F dx(n, NAN), dup(n, NAN);
  ctr::cpu::gelu_bwd(dy.data(), x.data(), dx.data(), n);
  expect_grad(
      dx, [](const Dv &v) { return map_d(v, gelu_d); }, x, dy, 5e-6, 1e-5, "gelu");
  ctr::cpu::silu_bwd(dy.data(), x.data(), dx.data(), n);
  expect_grad(
      dx, [](const Dv &v) { return map_d(v, silu_d); }, x, dy, 5e-6, 1e-5, "silu");
  ctr::cpu::swiglu_bwd(dy.data(), x.data(), up.data(), dx.data(), dup.data(), n);
  const Dv xd = to_d(x), ud = to_d(up);
  auto sw = [](const Dv &g, const Dv &u) {
    Dv o(g.size());
    for (size_t i = 0; i < g.size(); ++i) o[i] = silu_d(g[i]) * u[i];
    return o;
  };
  expect_grad(
      dx, [&](const Dv &v) { return sw(v, ud); }, x, dy, 5e-6, 1e-5, "swiglu dgate");
  expect_grad(
      dup, [&](const Dv &v) { return sw(xd, v); }, up, dy, 5e-6, 1e-5, "swiglu dup");
}

// ---------------------------------------------------------------------------
// Unary math

struct UnaryCase {
  std::string label;
  ctr::cpu::Unary op;
  float p;                          // pow's exponent
  std::function<double(double)> f;  // the double reference
  float lo, hi;                     // inputs: inside the domain, away from singularities
  enum Reads { X, Y, None } reads;  // what the backward kernel reads besides dy
};

std::vector<UnaryCase> unary_cases() {
  using U = ctr::cpu::Unary;
  using R = UnaryCase::Reads;
  auto pw = [](double p) { return [p](double x) { return std::pow(x, p); }; };
  return {
      {"exp", U::Exp, 0, [](double x) { return std::exp(x); }, -8, 8, R::Y},
      {"log", U::Log, 0, [](double x) { return std::log(x); }, 0.05f, 20, R::X},
      {"tanh", U::Tanh, 0, [](double x) { return std::tanh(x); }, -5, 5, R::Y},
      {"erf", U::Erf, 0, [](double x) { return std::erf(x); }, -4, 4, R::X},
      {"rsqrt", U::Rsqrt, 0, [](double x) { return 1.0 / std::sqrt(x); }, 0.05f, 20, R::Y},
      {"sqrt", U::Sqrt, 0, [](double x) { return std::sqrt(x); }, 0.05f, 20, R::Y},
      {"neg", U::Neg, 0, [](double x) { return -x; }, -10, 10, R::None},
      {"reciprocal", U::Reciprocal, 0, [](double x) { return 1.0 / x; }, 0.05f, 20, R::Y},
      {"reciprocal_negative", U::Reciprocal, 0, [](double x) { return 1.0 / x; }, -20, -0.05f, R::Y},
      {"sigmoid", U::Sigmoid, 0, sigmoid_d, -8, 8, R::Y},
      {"pow_2", U::Pow, 2.0f, pw(2.0), -3, 3, R::X},
      {"pow_3", U::Pow, 3.0f, pw(3.0), -3, 3, R::X},
      {"pow_1.5", U::Pow, 1.5f, pw(1.5), 0.05f, 10, R::X},
      {"pow_-0.7", U::Pow, -0.7f, pw(-0.7), 0.05f, 10, R::X},
      {"pow_0.5", U::Pow, 0.5f, pw(0.5), 0.05f, 10, R::X},
  };
}

TEST(Unary, ForwardMatchesReference) {
  // libm is within an ulp or two of the exact value, and 1/sqrtf, 1/(1+expf)
  // add a rounding or two: 1e-7 absolute + 1e-6 relative (8 ulps).
  for (const UnaryCase &c : unary_cases())
    for (int64_t n : {37, 70001}) {
      F x = random_vec(n, 1, c.lo, c.hi), y(n, NAN);
      ctr::cpu::unary_fwd(c.op, x.data(), y.data(), n, c.p);
      Dv r(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) r[i] = c.f(x[i]);
      expect_close(y, r, 1e-7, 1e-6, c.label + " n=" + std::to_string(n));
    }
}

TEST(Unary, BackwardMatchesFiniteDifferences) {
  // The derivative from a float x or y plus a few float operations: 1e-6
  // absolute (1 - y^2 and y (1 - y) lose bits where tanh and sigmoid saturate)
  // + 1e-5 relative against the double quotient. The ops are element-wise, so
  // the quotient is taken per element (dL/dx_i = dy_i f'(x_i)): a difference of
  // the whole sum L would drown in its round-off at the larger size.
  constexpr double h = 1e-6;
  for (const UnaryCase &c : unary_cases())
    for (int64_t n : {37, 70001}) {
      F x = random_vec(n, 1, c.lo, c.hi), dy = random_vec(n, 2), y(n), dx(n, NAN);
      ctr::cpu::unary_fwd(c.op, x.data(), y.data(), n, c.p);
      const float *v = c.reads == UnaryCase::X ? x.data() : c.reads == UnaryCase::Y ? y.data() : nullptr;
      ctr::cpu::unary_bwd(c.op, dy.data(), v, dx.data(), n, c.p);
      Dv r(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) r[i] = dy[i] * (c.f(x[i] + h) - c.f(x[i] - h)) / (2 * h);
      expect_close(dx, r, 1e-6, 1e-5, c.label + " n=" + std::to_string(n));
    }
}

// ---------------------------------------------------------------------------
// Softmax

TEST(Softmax, ForwardMatchesReference) {
  // Probabilities <= 1 from a 2-ulp exp and a float sum of C terms: 1e-6 + 1e-5 rel.
  for (auto [R, C] : {std::pair<int64_t, int64_t>{3, 7}, {5, 1}, {130, 257}}) {
    F x = random_vec(R * C, 1, -8.0f, 8.0f), y(R * C, NAN);
    ctr::cpu::softmax_fwd(x.data(), y.data(), R, C);
    expect_close(y, ref_softmax(to_d(x), R, C), 1e-6, 1e-5, "softmax");
  }
}

TEST(Softmax, BackwardMatchesFiniteDifferences) {
  // dx is a product of fp32 probabilities and gradient differences: 1e-6 + 1e-4 rel.
  const int64_t R = 3, C = 7;
  F x = random_vec(R * C, 1, -3.0f, 3.0f), dy = random_vec(R * C, 2), y(R * C), dx(R * C, NAN);
  ctr::cpu::softmax_fwd(x.data(), y.data(), R, C);
  ctr::cpu::softmax_bwd(dy.data(), y.data(), dx.data(), R, C);
  expect_grad(
      dx, [&](const Dv &v) { return ref_softmax(v, R, C); }, x, dy, 1e-6, 1e-4, "softmax");
}

// ---------------------------------------------------------------------------
// Normalisation

TEST(LayerNorm, ForwardMatchesReference) {
  // Normalised values are O(1); mean/variance sums of C fp32 terms: 2e-6 + 1e-5 rel.
  for (auto [R, C] : {std::pair<int64_t, int64_t>{3, 7}, {300, 130}})
    for (bool bias : {true, false}) {
      F x = random_vec(R * C, 1, -2.0f, 3.0f), w = random_vec(C, 2), b = random_vec(C, 3);
      F y(R * C, NAN), mean(R, NAN), rstd(R, NAN);
      ctr::cpu::layernorm_fwd(x.data(), w.data(), bias ? b.data() : nullptr, y.data(), mean.data(),
                              rstd.data(), R, C, 1e-5f);
      Dv bd = to_d(b);
      NormOut r = ref_layernorm(to_d(x), to_d(w), bias ? &bd : nullptr, R, C, 1e-5);
      expect_close(y, r.y, 2e-6, 1e-5, "layernorm y");
      expect_close(mean, r.mean, 2e-6, 1e-5, "layernorm mean");
      expect_close(rstd, r.rstd, 2e-6, 1e-5, "layernorm rstd");
    }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  // dx subtracts row means of O(1) terms (cancellation): 2e-5 + 1e-4 relative.
  const int64_t R = 3, C = 7;
  const double eps = 1e-5;
  F x = random_vec(R * C, 1, -2.0f, 3.0f), w = random_vec(C, 2), b = random_vec(C, 3);
  F dy = random_vec(R * C, 4);
  F y(R * C), mean(R), rstd(R);
  ctr::cpu::layernorm_fwd(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), R, C,
                          static_cast<float>(eps));
  const Dv xd = to_d(x), wd = to_d(w), bd = to_d(b);
  for (bool acc : {false, true}) {
    F pw = random_vec(C, 5), pb = random_vec(C, 6);
    F dx(R * C, NAN), dw = acc ? pw : F(C, NAN), db = acc ? pb : F(C, NAN);
    ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                            dw.data(), db.data(), R, C, acc);
    const std::string tag = acc ? " accumulate" : "";
    expect_grad(
        dx, [&](const Dv &v) { return ref_layernorm(v, wd, &bd, R, C, eps).y; }, x, dy, 2e-5, 1e-4,
        "layernorm dx" + tag);
    expect_grad(
        dw, [&](const Dv &v) { return ref_layernorm(xd, v, &bd, R, C, eps).y; }, w, dy, 2e-5, 1e-4,
        "layernorm dw" + tag, 0, acc ? &pw : nullptr);
    expect_grad(
        db, [&](const Dv &v) { return ref_layernorm(xd, wd, &v, R, C, eps).y; }, b, dy, 2e-5, 1e-4,
        "layernorm db" + tag, 0, acc ? &pb : nullptr);
  }
  // Without a bias, db is null and dw is unchanged.
  F dx(R * C), dw(C), dw_ref(C), db_ref(C);
  ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                          dw_ref.data(), db_ref.data(), R, C, false);
  ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                          dw.data(), nullptr, R, C, false);
  expect_close(dw, dw_ref, 0.0, 0.0, "layernorm dw without bias");
}

TEST(RmsNorm, ForwardMatchesReference) {
  // As layernorm: 2e-6 + 1e-5 relative.
  for (auto [R, C] : {std::pair<int64_t, int64_t>{3, 7}, {300, 130}}) {
    F x = random_vec(R * C, 1, -2.0f, 3.0f), w = random_vec(C, 2), y(R * C, NAN), rstd(R, NAN);
    ctr::cpu::rmsnorm_fwd(x.data(), w.data(), y.data(), rstd.data(), R, C, 1e-6f);
    NormOut r = ref_rmsnorm(to_d(x), to_d(w), R, C, 1e-6);
    expect_close(y, r.y, 2e-6, 1e-5, "rmsnorm y");
    expect_close(rstd, r.rstd, 2e-6, 1e-5, "rmsnorm rstd");
  }
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  // 2e-5 + 1e-4 relative, as layernorm.
  const int64_t R = 3, C = 7;
  const double eps = 1e-6;
  F x = random_vec(R * C, 1, -2.0f, 3.0f), w = random_vec(C, 2), dy = random_vec(R * C, 4);
  F y(R * C), rstd(R);
  ctr::cpu::rmsnorm_fwd(x.data(), w.data(), y.data(), rstd.data(), R, C, static_cast<float>(eps));
  const Dv xd = to_d(x), wd = to_d(w);
  for (bool acc : {false, true}) {
    F pw = random_vec(C, 5);
    F dx(R * C, NAN), dw = acc ? pw : F(C, NAN);
    ctr::cpu::rmsnorm_bwd(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), R, C,
                          acc);
    const std::string tag = acc ? " accumulate" : "";
    expect_grad(
        dx, [&](const Dv &v) { return ref_rmsnorm(v, wd, R, C, eps).y; }, x, dy, 2e-5, 1e-4,
        "rmsnorm dx" + tag);
    expect_grad(
        dw, [&](const Dv &v) { return ref_rmsnorm(xd, v, R, C, eps).y; }, w, dy, 2e-5, 1e-4,
        "rmsnorm dw" + tag, 0, acc ? &pw : nullptr);
  }
}

TEST(Norm, LargeBackwardMatchesReference) {
  // Above the parallel thresholds: the kernels' dx/dw/db against the double
  // reference's finite differences would be slow, so compare with the analytic
  // double formulas instead; 300-term sums: 1e-4 + 1e-4 relative.
  const int64_t R = 300, C = 130;
  F x = random_vec(R * C, 1, -2.0f, 3.0f), w = random_vec(C, 2), b = random_vec(C, 3);
  F dy = random_vec(R * C, 4), y(R * C), mean(R), rstd(R), dx(R * C), dw(C), db(C);
  ctr::cpu::layernorm_fwd(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), R, C,
                          1e-5f);
  ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                          dw.data(), db.data(), R, C, false);
  Dv bd = to_d(b);
  NormOut r = ref_layernorm(to_d(x), to_d(w), &bd, R, C, 1e-5);
  Dv rdx(R * C), rdw(C, 0.0), rdb(C, 0.0);
  for (int64_t i = 0; i < R; ++i) {
    double mg = 0.0, mgx = 0.0;
    for (int64_t j = 0; j < C; ++j) {
      const double xh = (x[i * C + j] - r.mean[i]) * r.rstd[i];
      const double g = dy[i * C + j] * static_cast<double>(w[j]);
      mg += g / C;
      mgx += g * xh / C;
      rdw[j] += dy[i * C + j] * xh;
      rdb[j] += dy[i * C + j];
    }
    for (int64_t j = 0; j < C; ++j) {
      const double xh = (x[i * C + j] - r.mean[i]) * r.rstd[i];
      rdx[i * C + j] = r.rstd[i] * (dy[i * C + j] * static_cast<double>(w[j]) - mg - xh * mgx);
    }
  }
  expect_close(dx, rdx, 1e-4, 1e-4, "layernorm dx large");
  expect_close(dw, rdw, 1e-4, 1e-4, "layernorm dw large");
  expect_close(db, rdb, 1e-4, 1e-4, "layernorm db large");
}

// ---------------------------------------------------------------------------
// RoPE

TEST(Rope, ForwardMatchesReference) {
  // A rotation of O(1) values with float cos/sin: 1e-6 + 1e-6 relative.
  for (auto d : {std::array<int64_t, 4>{2, 5, 3, 4}, std::array<int64_t, 4>{2, 300, 4, 64}}) {
    const int64_t B = d[0], T = d[1], H = d[2], D = d[3];
    F x = random_vec(B * T * H * D, 1), y(x.size(), NAN);
    ctr::cpu::rope_fwd(x.data(), y.data(), B, T, H, D, 10000.0f);
    expect_close(y, ref_rope(to_d(x), B, T, H, D, 10000.0), 1e-6, 1e-6, "rope");
  }
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  // Linear in x: 1e-6 + 1e-6 relative.
  const int64_t B = 2, T = 5, H = 3, D = 4;
  F x = random_vec(B * T * H * D, 1), dy = random_vec(x.size(), 2), dx(x.size(), NAN);
  ctr::cpu::rope_bwd(dy.data(), dx.data(), B, T, H, D, 500.0f);
  expect_grad(
      dx, [&](const Dv &v) { return ref_rope(v, B, T, H, D, 500.0); }, x, dy, 1e-6, 1e-6, "rope");
}

TEST(Rope, InterleavedMatchesReference) {
  for (auto d : {std::array<int64_t, 4>{2, 5, 3, 4}, std::array<int64_t, 4>{2, 300, 4, 64},
                 std::array<int64_t, 4>{1, 7, 2, 2}}) {
    const int64_t B = d[0], T = d[1], H = d[2], D = d[3];
    F x = random_vec(B * T * H * D, 1), y(x.size(), NAN);
    ctr::cpu::rope_fwd(x.data(), y.data(), B, T, H, D, 10000.0f, true);
    expect_close(y, ref_rope(to_d(x), B, T, H, D, 10000.0, true), 1e-6, 1e-6, "rope interleaved");
    // In place (x aliasing y) gives the same bits.
    F z = x;
    ctr::cpu::rope_fwd(z.data(), z.data(), B, T, H, D, 10000.0f, true);
    EXPECT_EQ(0, std::memcmp(z.data(), y.data(), y.size() * sizeof(float)));
  }
}

TEST(Rope, InterleavedIsRotateHalfOnPermutedHeads) {
  // Head dim j = 2i + r of the interleaved form is dim i + r*D/2 of the
  // rotate-half form: permuting x, rotating and permuting back gives the same bits.
  const int64_t B = 2, T = 33, H = 3, D = 16, half = D / 2;
  F x = random_vec(B * T * H * D, 3), xp(x.size()), yi(x.size(), NAN), yp(x.size(), NAN), dyi(x.size(), NAN),
    dyp(x.size(), NAN);
  auto perm = [&](int64_t k) {  // rotate-half position of interleaved element k
    const int64_t j = k % D;
    return k - j + (j % 2) * half + j / 2;
  };
  for (int64_t k = 0; k < static_cast<int64_t>(x.size()); ++k) xp[perm(k)] = x[k];
  ctr::cpu::rope_fwd(x.data(), yi.data(), B, T, H, D, 500.0f, true);
  ctr::cpu::rope_fwd(xp.data(), yp.data(), B, T, H, D, 500.0f);
  ctr::cpu::rope_bwd(x.data(), dyi.data(), B, T, H, D, 500.0f, true);
  ctr::cpu::rope_bwd(xp.data(), dyp.data(), B, T, H, D, 500.0f);
  for (int64_t k = 0; k < static_cast<int64_t>(x.size()); ++k) {
    ASSERT_EQ(yi[k], yp[perm(k)]) << "forward at " << k;
    ASSERT_EQ(dyi[k], dyp[perm(k)]) << "backward at " << k;
  }
}

TEST(Rope, InterleavedBackwardMatchesFiniteDifferences) {
  const int64_t B = 2, T = 5, H = 3, D = 6;
  F x = random_vec(B * T * H * D, 1), dy = random_vec(x.size(), 2), dx(x.size(), NAN);
  ctr::cpu::rope_bwd(dy.data(), dx.data(), B, T, H, D, 500.0f, true);
  expect_grad(
      dx, [&](const Dv &v) { return ref_rope(v, B, T, H, D, 500.0, true); }, x, dy, 1e-6, 1e-6,
      "rope interleaved");
}

// ---------------------------------------------------------------------------
// Attention

struct AttnCase {
  int64_t B, T, Hq, Hkv, D;
  bool causal;
  int64_t window = 0;
  float softcap = 0.0f;
};

std::string attn_tag(const AttnCase &c) {
  return " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " Hq=" + std::to_string(c.Hq) +
         " Hkv=" + std::to_string(c.Hkv) + " D=" + std::to_string(c.D) +
         (c.causal ? " causal" : "") + (c.window ? " window=" + std::to_string(c.window) : "") +
         (c.softcap > 0.0f ? " softcap=" + std::to_string(c.softcap) : "");
}

// Small odd shapes, GQA and MHA, causal and not; T=150 spans three causal blocks
// with a ragged last one. Sliding windows: shorter than a block (the later row blocks
// skip whole key blocks), longer than one, and one past the sequence (plain causal).
const AttnCase kAttnCases[] = {
    {2, 5, 4, 2, 4, true},    {2, 5, 4, 2, 4, false}, {1, 7, 3, 3, 6, true},
    {1, 7, 3, 3, 6, false},   {1, 5, 4, 1, 4, true},  {1, 150, 2, 1, 8, true},
    {1, 150, 2, 2, 8, false}, {2, 7, 4, 2, 4, true, 3}, {1, 150, 2, 1, 8, true, 20},
    {1, 150, 2, 2, 8, true, 90}, {1, 6, 2, 2, 4, true, 6},
    // Soft-capped logits (a cap near the scores' size, so tanh bends them), alone, with a
    // window over several blocks, and without the causal mask.
    {2, 7, 4, 2, 4, true, 0, 0.5f}, {1, 150, 2, 1, 8, true, 20, 0.8f}, {1, 7, 3, 3, 6, false, 0, 0.5f},
};

TEST(Attention, ForwardMatchesReference) {
  // D-term fp32 dot products, a 2-ulp exp and sums of T probabilities:
  // 2e-6 absolute + 1e-5 relative on out and probs.
  for (const AttnCase &c : kAttnCases) {
    const int64_t nq = c.B * c.T * c.Hq * c.D, nkv = c.B * c.T * c.Hkv * c.D;
    F q = random_vec(nq, 1), k = random_vec(nkv, 2), v = random_vec(nkv, 3);
    F out(nq, NAN), probs(c.B * c.Hq * c.T * c.T, NAN);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    ctr::cpu::attention_fwd(q.data(), k.data(), v.data(), out.data(), probs.data(), c.B, c.T, c.Hq,
                            c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    AttnOut r =
        ref_attention(to_d(q), to_d(k), to_d(v), c.B, c.T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    expect_close(out, r.out, 2e-6, 1e-5, "attention out" + attn_tag(c));
    expect_close(probs, r.probs, 2e-6, 1e-5, "attention probs" + attn_tag(c));
  }
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  // Gradients chain two products and a softmax in fp32: 2e-5 absolute + 1e-4
  // relative. The T=150 cases check a random sample of 300 entries per input.
  for (const AttnCase &c : kAttnCases) {
    const int64_t nq = c.B * c.T * c.Hq * c.D, nkv = c.B * c.T * c.Hkv * c.D;
    F q = random_vec(nq, 1), k = random_vec(nkv, 2), v = random_vec(nkv, 3);
    F dout = random_vec(nq, 4);
    F out(nq), probs(c.B * c.Hq * c.T * c.T);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    ctr::cpu::attention_fwd(q.data(), k.data(), v.data(), out.data(), probs.data(), c.B, c.T, c.Hq,
                            c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    F dq(nq, NAN), dk(nkv, NAN), dv(nkv, NAN);
    ctr::cpu::attention_bwd(dout.data(), q.data(), k.data(), v.data(), probs.data(), dq.data(),
                            dk.data(), dv.data(), c.B, c.T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    const Dv qd = to_d(q), kd = to_d(k), vd = to_d(v);
    const size_t samples = c.T > 64 ? 300 : 0;
    auto run = [&](const Dv &qq, const Dv &kk, const Dv &vv) {
      return ref_attention(qq, kk, vv, c.B, c.T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap).out;
    };
    expect_grad(
        dq, [&](const Dv &x) { return run(x, kd, vd); }, q, dout, 2e-5, 1e-4,
        "attention dq" + attn_tag(c), samples);
    expect_grad(
        dk, [&](const Dv &x) { return run(qd, x, vd); }, k, dout, 2e-5, 1e-4,
        "attention dk" + attn_tag(c), samples);
    expect_grad(
        dv, [&](const Dv &x) { return run(qd, kd, x); }, v, dout, 2e-5, 1e-4,
        "attention dv" + attn_tag(c), samples);
  }
}

// Context-parallel attention: the ranks' rows of the whole attention. Each rank
// holds chunks r and 2R-1-r of q; k and v are every rank's rows in rank order; its
// out and dq are its rows of the whole op's, and the ranks' dk and dv summed back
// at their global positions are the whole op's (the reduce-scatter over cp).
// With index -1 every rank's rows are the queries too (Ulysses).
struct CpCase {
  AttnCase a;
  int64_t ranks;
};

TEST(CpAttention, RanksMatchWholeAttention) {
  const CpCase cases[] = {{{2, 8, 4, 2, 4, true}, 2},          {{1, 12, 3, 3, 6, false}, 3},
                          {{1, 24, 2, 1, 8, true, 5}, 3},      {{2, 8, 4, 2, 4, true, 0, 0.5f}, 2},
                          {{1, 16, 2, 2, 4, true, 3, 0.8f}, 4}};
  for (const CpCase &cc : cases) {
    const AttnCase &c = cc.a;
    const int64_t R = cc.ranks, T = c.T, Tq = T / R, wq = c.Hq * c.D, wkv = c.Hkv * c.D;
    const int64_t nq = c.B * T * wq, nkv = c.B * T * wkv;
    F q = random_vec(nq, 1), k = random_vec(nkv, 2), v = random_vec(nkv, 3), dout = random_vec(nq, 4);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    F out(nq), probs(c.B * c.Hq * T * T), dq(nq), dk(nkv), dv(nkv);
    ctr::cpu::attention_fwd(q.data(), k.data(), v.data(), out.data(), probs.data(), c.B, T, c.Hq, c.Hkv, c.D, scale,
                            c.causal, c.window, c.softcap);
    ctr::cpu::attention_bwd(dout.data(), q.data(), k.data(), v.data(), probs.data(), dq.data(), dk.data(), dv.data(),
                            c.B, T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    // Rank s's rows of x [B, T, w] in its chunk order.
    auto rows_of = [&](const F &x, int64_t w, int64_t s) {
      F y(static_cast<size_t>(c.B * Tq * w));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < Tq; ++t)
          std::copy_n(x.data() + (b * T + ctr_cp_position(t, Tq, R, s)) * w, w, y.data() + (b * Tq + t) * w);
      return y;
    };
    // Every rank's rows, rank after rank, per batch entry (the gathered k and v).
    auto gathered = [&](const F &x, int64_t w) {
      F y(x.size());
      for (int64_t s = 0; s < R; ++s) {
        const F part = rows_of(x, w, s);
        for (int64_t b = 0; b < c.B; ++b)
          std::copy_n(part.data() + b * Tq * w, Tq * w, y.data() + (b * T + s * Tq) * w);
      }
      return y;
    };
    const F kg = gathered(k, wkv), vg = gathered(v, wkv);
    F dk_sum(nkv, 0.0f), dv_sum(nkv, 0.0f);
    for (int64_t r = 0; r < R; ++r) {
      const F qr = rows_of(q, wq, r), doutr = rows_of(dout, wq, r);
      F o(qr.size(), NAN), p(c.B * c.Hq * Tq * T, NAN), dqr(qr.size(), NAN), dkr(nkv, NAN), dvr(nkv, NAN);
      ctr::cpu::cp_attention_fwd(qr.data(), kg.data(), vg.data(), o.data(), p.data(), c.B, Tq, c.Hq, c.Hkv, c.D, scale,
                                 c.causal, c.window, c.softcap, R, r);
      ctr::cpu::cp_attention_bwd(doutr.data(), qr.data(), kg.data(), vg.data(), p.data(), dqr.data(), dkr.data(),
                                 dvr.data(), c.B, Tq, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap, R, r);
      const std::string tag = attn_tag(c) + " cp=" + std::to_string(R) + " rank " + std::to_string(r);
      expect_close(o, rows_of(out, wq, r), 2e-6, 1e-5, "cp attention out" + tag);
      expect_close(dqr, rows_of(dq, wq, r), 2e-5, 1e-4, "cp attention dq" + tag);
      // The gathered rows' gradients back at their global positions.
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t j = 0; j < T; ++j) {
          const int64_t g = b * T + ctr_cp_position(j % Tq, Tq, R, j / Tq);
          for (int64_t e = 0; e < wkv; ++e) {
            dk_sum[static_cast<size_t>(g * wkv + e)] += dkr[static_cast<size_t>((b * T + j) * wkv + e)];
            dv_sum[static_cast<size_t>(g * wkv + e)] += dvr[static_cast<size_t>((b * T + j) * wkv + e)];
          }
        }
    }
    const std::string tag = attn_tag(c) + " cp=" + std::to_string(R);
    expect_close(dk_sum, dk, 2e-5, 1e-4, "cp attention dk" + tag);
    expect_close(dv_sum, dv, 2e-5, 1e-4, "cp attention dv" + tag);
    // Index -1 (heads exchanged all-to-all): queries, keys and values are every
    // rank's rows in rank order, and so is everything out: the whole op permuted.
    {
      const F qg = gathered(q, wq), doutg = gathered(dout, wq);
      F o(nq, NAN), p(c.B * c.Hq * T * T, NAN), dqg(nq, NAN), dkg(nkv, NAN), dvg(nkv, NAN);
      ctr::cpu::cp_attention_fwd(qg.data(), kg.data(), vg.data(), o.data(), p.data(), c.B, T, c.Hq, c.Hkv, c.D, scale,
                                 c.causal, c.window, c.softcap, R, -1);
      ctr::cpu::cp_attention_bwd(doutg.data(), qg.data(), kg.data(), vg.data(), p.data(), dqg.data(), dkg.data(),
                                 dvg.data(), c.B, T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap, R, -1);
      expect_close(o, gathered(out, wq), 2e-6, 1e-5, "cp attention (all rows) out" + tag);
      expect_close(dqg, gathered(dq, wq), 2e-5, 1e-4, "cp attention (all rows) dq" + tag);
      expect_close(dkg, gathered(dk, wkv), 2e-5, 1e-4, "cp attention (all rows) dk" + tag);
      expect_close(dvg, gathered(dv, wkv), 2e-5, 1e-4, "cp attention (all rows) dv" + tag);
    }
  }
}

// Ring attention: each rank's blocks (its queries against one source rank's
// keys each, in ring order) merged by log-sum-exp are its rows of the whole
// attention; the blocks' gradients, through the merges, are its rows of dq and
// the source ranks' shares of dk and dv.
TEST(CpAttention, RingBlocksMergedMatchWholeAttention) {
  const CpCase cases[] = {{{2, 8, 4, 2, 4, true}, 2}, {{1, 16, 2, 2, 4, true}, 4}, {{1, 24, 2, 1, 8, true, 5}, 3},
                          {{2, 8, 4, 2, 4, true, 0, 0.5f}, 2}, {{1, 12, 3, 3, 6, false}, 3}};
  for (const CpCase &cc : cases) {
    const AttnCase &c = cc.a;
    const int64_t R = cc.ranks, T = c.T, Tq = T / R, wq = c.Hq * c.D, wkv = c.Hkv * c.D;
    const int64_t nq = c.B * T * wq, nkv = c.B * T * wkv;
    F q = random_vec(nq, 1), k = random_vec(nkv, 2), v = random_vec(nkv, 3), dout = random_vec(nq, 4);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.D));
    F out(nq), probs(c.B * c.Hq * T * T), dq(nq), dk(nkv), dv(nkv);
    ctr::cpu::attention_fwd(q.data(), k.data(), v.data(), out.data(), probs.data(), c.B, T, c.Hq, c.Hkv, c.D, scale,
                            c.causal, c.window, c.softcap);
    ctr::cpu::attention_bwd(dout.data(), q.data(), k.data(), v.data(), probs.data(), dq.data(), dk.data(), dv.data(),
                            c.B, T, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap);
    auto rows_of = [&](const F &x, int64_t w, int64_t s) {
      F y(static_cast<size_t>(c.B * Tq * w));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < Tq; ++t)
          std::copy_n(x.data() + (b * T + ctr_cp_position(t, Tq, R, s)) * w, w, y.data() + (b * Tq + t) * w);
      return y;
    };
    const int64_t nl = c.B * c.Hq * Tq, no = c.B * Tq * wq;
    std::vector<F> dk_of(static_cast<size_t>(R), F(c.B * Tq * wkv, 0.0f)), dv_of = dk_of;
    for (int64_t r = 0; r < R; ++r) {
      const F qr = rows_of(q, wq, r), doutr = rows_of(dout, wq, r);
      std::vector<F> o(static_cast<size_t>(R), F(no)), l(static_cast<size_t>(R), F(nl)), p(static_cast<size_t>(R));
      std::vector<F> acc_o(static_cast<size_t>(R), F(no)), acc_l(static_cast<size_t>(R), F(nl));
      for (int64_t s = 0; s < R; ++s) {
        const int64_t src = (r - s + R) % R;
        p[s].assign(static_cast<size_t>(c.B * c.Hq * Tq * Tq), NAN);
        const F ks = rows_of(k, wkv, src), vs = rows_of(v, wkv, src);
        ctr::cpu::cp_attention_block_fwd(qr.data(), ks.data(), vs.data(), o[s].data(), l[s].data(), p[s].data(), c.B,
                                         Tq, c.Hq, c.Hkv, c.D, scale, c.causal, c.window, c.softcap, R, r, src);
        if (s == 0) {
          acc_o[0] = o[0];
          acc_l[0] = l[0];
        } else {
          ctr::cpu::attn_merge_fwd(acc_o[s - 1].data(), acc_l[s - 1].data(), o[s].data(), l[s].data(),
                                   acc_o[s].data(), acc_l[s].data(), c.B, Tq, c.Hq, c.D);
        }
      }
      const std::string tag = attn_tag(c) + " ring cp=" + std::to_string(R) + " rank " + std::to_string(r);
      expect_close(acc_o[R - 1], rows_of(out, wq, r), 2e-6, 1e-5, "ring attention out" + tag);
      // Backward through the merges, last first, then each block.
      F g_acc = doutr, g_accl;  // gradient of the running result (its lse has none at the end)
      F dqr(no, 0.0f);
      for (int64_t s = R - 1; s >= 0; --s) {
        F go(no), gl(nl);
        if (s > 0) {
          F ga(no), gla(nl);
          ctr::cpu::attn_merge_bwd(g_acc.data(), g_accl.empty() ? nullptr : g_accl.data(), acc_o[s - 1].data(),
                                   acc_l[s - 1].data(), o[s].data(), l[s].data(), acc_o[s].data(), acc_l[s].data(),
                                   ga.data(), gla.data(), go.data(), gl.data(), c.B, Tq, c.Hq, c.D);
          g_acc = ga;
          g_accl = gla;
        } else {
          go = g_acc;
          gl = g_accl.empty() ? F(nl, 0.0f) : g_accl;
        }
        const int64_t src = (r - s + R) % R;
        const F ks = rows_of(k, wkv, src), vs = rows_of(v, wkv, src);
        F dqs(no, NAN), dks(c.B * Tq * wkv, NAN), dvs(c.B * Tq * wkv, NAN);
        ctr::cpu::cp_attention_block_bwd(go.data(), gl.data(), qr.data(), ks.data(), vs.data(), p[s].data(),
                                         dqs.data(), dks.data(), dvs.data(), c.B, Tq, c.Hq, c.Hkv, c.D, scale,
                                         c.causal, c.window, c.softcap, R, r, src);
        for (size_t e = 0; e < dqr.size(); ++e) dqr[e] += dqs[e];
        for (size_t e = 0; e < dks.size(); ++e) {
          dk_of[static_cast<size_t>(src)][e] += dks[e];
          dv_of[static_cast<size_t>(src)][e] += dvs[e];
        }
      }
      expect_close(dqr, rows_of(dq, wq, r), 2e-5, 1e-4, "ring attention dq" + tag);
    }
    for (int64_t s = 0; s < R; ++s) {
      const std::string tag = attn_tag(c) + " ring cp=" + std::to_string(R) + " keys of rank " + std::to_string(s);
      expect_close(dk_of[static_cast<size_t>(s)], rows_of(dk, wkv, s), 2e-5, 1e-4, "ring attention dk" + tag);
      expect_close(dv_of[static_cast<size_t>(s)], rows_of(dv, wkv, s), 2e-5, 1e-4, "ring attention dv" + tag);
    }
  }
}

TEST(CpRope, RowsAtGlobalPositions) {
  const int64_t B = 2, T = 12, H = 2, D = 4, R = 3, Tq = T / R;
  F x = random_vec(B * T * H * D, 5), y(x.size()), dx(x.size());
  ctr::cpu::rope_fwd(x.data(), y.data(), B, T, H, D, 500.0f);
  ctr::cpu::rope_bwd(x.data(), dx.data(), B, T, H, D, 500.0f);
  for (int64_t r = 0; r < R; ++r) {
    F xr(static_cast<size_t>(B * Tq * H * D)), want(xr.size()), want_dx(xr.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t g = (b * T + ctr_cp_position(t, Tq, R, r)) * H * D, l = (b * Tq + t) * H * D;
        std::copy_n(x.data() + g, H * D, xr.data() + l);
        std::copy_n(y.data() + g, H * D, want.data() + l);
        std::copy_n(dx.data() + g, H * D, want_dx.data() + l);
      }
    F yr(xr.size(), NAN), dxr(xr.size(), NAN);
    ctr::cpu::rope_fwd(xr.data(), yr.data(), B, Tq, H, D, 500.0f, false, R, r);
    ctr::cpu::rope_bwd(xr.data(), dxr.data(), B, Tq, H, D, 500.0f, false, R, r);
    expect_close(yr, want, 0.0, 0.0, "cp rope rank " + std::to_string(r));
    expect_close(dxr, want_dx, 0.0, 0.0, "cp rope bwd rank " + std::to_string(r));
  }
}

// ---------------------------------------------------------------------------
// Cross-entropy

TEST(CrossEntropy, ForwardMatchesReference) {
  // lse from a 2-ulp exp, a float sum and a float log: 2e-6 + 1e-6 relative; the
  // loss is summed in double: the same bound.
  const int64_t R = 6, V = 11;
  F x = random_vec(R * V, 1, -5.0f, 5.0f);
  for (const std::vector<int32_t> &tgt :
       {std::vector<int32_t>{3, 10, 0, 5, 7, 1}, std::vector<int32_t>{3, -1, 0, -1, 7, -1}}) {
    F loss(1, NAN), lse(R, NAN);
    int64_t count = -1;
    ctr::cpu::cross_entropy_fwd(x.data(), tgt.data(), loss.data(), lse.data(), &count, R, V);
    CeOut r = ref_cross_entropy(to_d(x), tgt, R, V);
    EXPECT_EQ(count, r.count);
    expect_close(loss, Dv{r.loss}, 2e-6, 1e-6, "cross_entropy loss");
    expect_close(lse, r.lse, 2e-6, 1e-6, "cross_entropy lse");
  }
  // No counted row: loss 0, count 0.
  std::vector<int32_t> none(R, -1);
  F loss(1, NAN), lse(R);
  int64_t count = -1;
  ctr::cpu::cross_entropy_fwd(x.data(), none.data(), loss.data(), lse.data(), &count, R, V);
  EXPECT_EQ(count, 0);
  EXPECT_EQ(loss[0], 0.0f);
}

TEST(CrossEntropy, LargeForwardMatchesReference) {
  // Parallel path, R=2048 V=256: 2e-6 + 1e-6 relative, as above.
  const int64_t R = 2048, V = 256;
  F x = random_vec(R * V, 1, -5.0f, 5.0f);
  std::vector<int32_t> tgt(R);
  for (int64_t r = 0; r < R; ++r) tgt[r] = r % 5 == 0 ? -1 : static_cast<int32_t>((r * 37) % V);
  F loss(1), lse(R);
  int64_t count = 0;
  ctr::cpu::cross_entropy_fwd(x.data(), tgt.data(), loss.data(), lse.data(), &count, R, V);
  CeOut r = ref_cross_entropy(to_d(x), tgt, R, V);
  EXPECT_EQ(count, r.count);
  expect_close(loss, Dv{r.loss}, 2e-6, 1e-6, "loss");
  expect_close(lse, r.lse, 2e-6, 1e-6, "lse");
}

TEST(CrossEntropy, BackwardMatchesFiniteDifferences) {
  // Softmax probabilities minus one-hot, scaled by dloss/count: 1e-6 + 1e-5 rel.
  const int64_t R = 6, V = 11;
  F x = random_vec(R * V, 1, -5.0f, 5.0f);
  const float dloss = 1.7f;
  for (const std::vector<int32_t> &tgt :
       {std::vector<int32_t>{3, 10, 0, 5, 7, 1}, std::vector<int32_t>{3, -1, 0, -1, 7, -1},
        std::vector<int32_t>(R, -1)}) {
    F loss(1), lse(R), dx(R * V, NAN);
    int64_t count = 0;
    ctr::cpu::cross_entropy_fwd(x.data(), tgt.data(), loss.data(), lse.data(), &count, R, V);
    ctr::cpu::cross_entropy_bwd(x.data(), tgt.data(), lse.data(), dloss, count, dx.data(), R, V);
    expect_grad(
        dx, [&](const Dv &v) { return Dv{ref_cross_entropy(v, tgt, R, V).loss}; }, x, F{dloss},
        1e-6, 1e-5, "cross_entropy count=" + std::to_string(count));
    for (int64_t r = 0; r < R; ++r) {
      if (tgt[r] >= 0) continue;
      for (int64_t j = 0; j < V; ++j) EXPECT_EQ(dx[r * V + j], 0.0f) << "ignored row " << r;
    }
  }
}

// ---------------------------------------------------------------------------
// Layout

Dv ref_transpose(const Dv &x, const std::vector<int64_t> &dims, const std::vector<int> &perm) {
  const int nd = static_cast<int>(dims.size());
  std::vector<int64_t> xs(nd), yd(nd);
  int64_t total = 1;
  for (int i = nd - 1; i >= 0; --i) {
    xs[i] = total;
    total *= dims[i];
  }
  for (int i = 0; i < nd; ++i) yd[i] = dims[perm[i]];
  Dv y(total);
  for (int64_t o = 0; o < total; ++o) {
    int64_t rem = o, xoff = 0;
    for (int i = nd - 1; i >= 0; --i) {
      xoff += (rem % yd[i]) * xs[perm[i]];
      rem /= yd[i];
    }
    y[o] = x[xoff];
  }
  return y;
}

TEST(Layout, TransposeMatchesReference) {
  // A permutation copies values: exact.
  struct Case {
    std::vector<int64_t> dims;
    std::vector<int> perm;
  };
  const Case cases[] = {
      {{2, 5, 3, 4}, {0, 2, 1, 3}},              // [B,T,H,D] -> [B,H,T,D]: rows stay rows
      {{2, 5, 3, 4}, {3, 1, 0, 2}},              // innermost axis moves
      {{3, 7, 5, 2}, {2, 0, 3, 1}},              // 4-D, x's rows land mid-way in y
      {{37, 45}, {1, 0}},                        // plain matrix transpose, ragged tiles
      {{4, 1, 6, 1}, {3, 2, 0, 1}},              // size-1 axes, x's innermost has size 1
      {{2, 3, 4, 5, 6, 7}, {5, 4, 3, 2, 1, 0}},  // 6-D reversal
      {{300, 2, 200}, {2, 1, 0}},                // large enough to split over threads
      {{333, 517}, {1, 0}},                      // a large matrix transpose splits too
      {{9}, {0}},
  };
  for (const Case &c : cases) {
    int64_t n = 1;
    for (int64_t d : c.dims) n *= d;
    F x = random_vec(n, 1), y(n, NAN);
    ctr::cpu::transpose(x.data(), y.data(), c.dims.data(), c.perm.data(),
                        static_cast<int>(c.dims.size()));
    std::string tag = "transpose perm";
    for (int p : c.perm) tag += ' ' + std::to_string(p);
    expect_close(y, ref_transpose(to_d(x), c.dims, c.perm), 0.0, 0.0, tag);
  }
}

TEST(Layout, CopyAndFill) {
  // Exact.
  for (int64_t n : {0, 13, 3 << 20}) {
    F x = random_vec(n, 1), y(n, NAN);
    ctr::cpu::copy(x.data(), y.data(), n * static_cast<int64_t>(sizeof(float)));
    EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin()));
    ctr::cpu::fill(y.data(), 2.5f, n);
    EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return v == 2.5f; }));
  }
}

TEST(Layout, TransposeOfInt32IdsIsExact) {
  // Token ids move through the same kernel bit for bit, up to rank 6.
  const std::vector<int64_t> dims = {2, 3, 1, 4, 2, 3};
  const std::vector<int> perm = {4, 0, 5, 2, 1, 3};
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  std::vector<int32_t> x(static_cast<size_t>(n)), y(static_cast<size_t>(n), -7);
  for (int64_t i = 0; i < n; ++i) x[static_cast<size_t>(i)] = static_cast<int32_t>(i * 2654435761u);
  ctr::cpu::transpose(x.data(), y.data(), dims.data(), perm.data(), 6);
  Dv ref = ref_transpose(Dv(x.begin(), x.end()), dims, perm);  // doubles hold every int32
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(static_cast<double>(y[static_cast<size_t>(i)]), ref[static_cast<size_t>(i)]) << i;
}

// x[outer, size, inner] -> rows start, start + step, ... (len of them).
Dv ref_slice(const F &x, int64_t outer, int64_t size, int64_t inner, int64_t start, int64_t len, int64_t step) {
  Dv y;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < len; ++j)
      for (int64_t i = 0; i < inner; ++i)
        y.push_back(x[static_cast<size_t>((o * size + start + j * step) * inner + i)]);
  return y;
}

TEST(Layout, SliceWithStepsAndBoundsMatchesReference) {
  // Copies: exact. Bounds are resolved by the op's decode (clamped, negative
  // from the end), so the kernel sees the resolved start and length: the cases
  // are what [1:], [-3:], [:1000], [::3], [2:9:4] and an empty range resolve to.
  struct Case {
    int64_t outer, size, inner, start, len, step;
  };
  const Case cases[] = {
      {3, 7, 5, 1, 6, 1},      // x[:, 1:]
      {2, 7, 1, 4, 3, 1},      // last dim, x[..., -3:]
      {1, 6, 4, 0, 6, 1},      // end clamped to the size: the whole tensor
      {4, 8, 3, 0, 3, 3},      // step 3: rows 0, 3, 6
      {2, 11, 2, 2, 2, 4},     // [2:9:4]: rows 2, 6
      {5, 3, 1, 1, 2, 1},      // a size-3 dim, x[:, 1:]
      {3, 4, 2, 2, 0, 1},      // empty range
      {1000, 64, 16, 3, 20, 3},  // large enough to split over threads
      {1, 4000, 64, 100, 2000, 1},  // dim 0: one block, split by rows
  };
  for (const Case &c : cases) {
    F x = random_vec(c.outer * c.size * c.inner, 3);
    F y(static_cast<size_t>(c.outer * c.len * c.inner), NAN);
    ctr::cpu::slice_fwd(x.data(), y.data(), c.outer, c.size, c.inner, c.start, c.len, c.step);
    const std::string tag = "slice outer " + std::to_string(c.outer) + " size " + std::to_string(c.size) +
                            " start " + std::to_string(c.start) + " step " + std::to_string(c.step);
    expect_close(y, ref_slice(x, c.outer, c.size, c.inner, c.start, c.len, c.step), 0.0, 0.0, tag);
    // Backward: zeros, with dy's rows back in their places.
    F dy = random_vec(static_cast<int64_t>(y.size()), 4), dx(x.size(), NAN);
    ctr::cpu::slice_bwd(dy.data(), dx.data(), c.outer, c.size, c.inner, c.start, c.len, c.step);
    Dv ref(x.size(), 0.0);
    size_t k = 0;
    for (int64_t o = 0; o < c.outer; ++o)
      for (int64_t j = 0; j < c.len; ++j)
        for (int64_t i = 0; i < c.inner; ++i) ref[static_cast<size_t>((o * c.size + c.start + j * c.step) * c.inner + i)] = dy[k++];
    expect_close(dx, ref, 0.0, 0.0, tag + " (backward)");
  }
}

TEST(Layout, CatMatchesReference) {
  // Copies: exact. Widths in elements per outer row, one of them empty.
  struct Case {
    int64_t outer;
    std::vector<int64_t> widths;
  };
  const Case cases[] = {
      {1, {6, 10}},             // dim 0: each input one block
      {3, {4, 0, 8, 4}},        // an input with a zero-size dim
      {5, {2, 3, 1}},
      {2000, {32, 64, 32}},     // large enough to split over threads
  };
  for (const Case &c : cases) {
    std::vector<F> xs;
    std::vector<const void *> ptrs;
    int64_t total = 0;
    for (size_t k = 0; k < c.widths.size(); ++k) {
      xs.push_back(random_vec(c.outer * c.widths[k], static_cast<uint32_t>(10 + k)));
      total += c.widths[k];
    }
    for (const F &x : xs) ptrs.push_back(x.data());
    F y(static_cast<size_t>(c.outer * total), NAN);
    ctr::cpu::cat_fwd(ptrs.data(), c.widths.data(), static_cast<int64_t>(c.widths.size()), y.data(), c.outer);
    Dv ref;
    for (int64_t o = 0; o < c.outer; ++o)
      for (size_t k = 0; k < xs.size(); ++k)
        for (int64_t i = 0; i < c.widths[k]; ++i) ref.push_back(xs[k][static_cast<size_t>(o * c.widths[k] + i)]);
    expect_close(y, ref, 0.0, 0.0, "cat of " + std::to_string(c.widths.size()) + " outer " + std::to_string(c.outer));
  }
}

TEST(Determinism, LayoutCopiesDoNotDependOnThreadCount) {
  const int saved = ctr::num_threads();
  F x = random_vec(600 * 50 * 8, 5);
  std::vector<F> outs;
  for (int threads : {1, 2, 3}) {
    ctr::set_num_threads(threads);
    F y(static_cast<size_t>(600 * 16 * 8)), dx(x.size());
    ctr::cpu::slice_fwd(x.data(), y.data(), 600, 50, 8, 2, 16, 3);
    ctr::cpu::slice_bwd(y.data(), dx.data(), 600, 50, 8, 2, 16, 3);
    y.insert(y.end(), dx.begin(), dx.end());
    outs.push_back(y);
  }
  ctr::set_num_threads(saved);
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_EQ(outs[0], outs[2]);
}

// ---------------------------------------------------------------------------
// Optimizer

TEST(Optim, SumSquares) {
  // Float squares are exact in double and the kernel adds them in chains of at
  // most a few thousand terms for these n (relative error below 1e-12); 1e-11
  // leaves a margin. The reference sums in long double so its own error is smaller.
  for (int64_t n : {0, 1, 7, 100003, 5000017}) {
    F x = random_vec(n, 1, -3.0f, 3.0f);
    long double r = 0.0L;
    for (float v : x) r += static_cast<long double>(v) * v;
    const double rd = static_cast<double>(r);
    EXPECT_NEAR(ctr::cpu::sum_squares(x.data(), n), rd, 1e-11 * std::max(1.0, rd)) << n;
  }
}

TEST(Optim, AdamWMatchesTorchFormulaOverThreeSteps) {
  // torch.optim.AdamW (foreach=False) in double: p *= 1 - lr*wd; m, v updated;
  // p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps). The kernel runs the same
  // sequence in float; after 3 steps parameters agree to 1e-6 absolute + 1e-6
  // relative and the moments to 1e-7 + 1e-5 relative.
  const int64_t n = 37;  // odd, so the vector loop has a tail
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  F p = random_vec(n, 1), m(n, 0.0f), v(n, 0.0f);
  Dv pd = to_d(p), md(n, 0.0), vd(n, 0.0);
  for (int64_t t = 1; t <= 3; ++t) {
    F g = random_vec(n, static_cast<uint32_t>(10 + t), -2.0f, 2.0f);
    g[0] = 0.0f;  // a zero gradient keeps v at 0 at first: denominator = eps
    ctr::cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, t, gs);
    const double bc1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(t));
    for (int64_t i = 0; i < n; ++i) {
      const double gi = static_cast<double>(g[i]) * gs;
      pd[i] *= 1.0 - static_cast<double>(lr) * wd;
      md[i] = static_cast<double>(b1) * md[i] + (1.0 - static_cast<double>(b1)) * gi;
      vd[i] = static_cast<double>(b2) * vd[i] + (1.0 - static_cast<double>(b2)) * gi * gi;
      const double denom = std::sqrt(vd[i]) / std::sqrt(bc2) + eps;
      pd[i] -= static_cast<double>(lr) / bc1 * md[i] / denom;
    }
    expect_close(p, pd, 1e-6, 1e-6, "adamw param step " + std::to_string(t));
    expect_close(m, md, 1e-7, 1e-5, "adamw m step " + std::to_string(t));
    expect_close(v, vd, 1e-7, 1e-5, "adamw v step " + std::to_string(t));
  }
}

// ---------------------------------------------------------------------------
// Mixture of experts

using I = std::vector<int32_t>;

TEST(Moe, RouterBreaksTiesTowardTheLowerExpert) {
  // Three tokens over four experts: a tie inside the top 2, a tie across the
  // top-2 boundary, and all four equal.
  F logits = {0.2f, 0.7f, 0.7f, 0.1f, 0.9f, 0.4f, 0.1f, 0.4f, 0.5f, 0.5f, 0.5f, 0.5f};
  F w(6), scores(12);
  I ex(6);
  ctr::cpu::moe_router_fwd(logits.data(), w.data(), ex.data(), scores.data(), 3, 4, 2, false, true);
  EXPECT_EQ(ex, (I{1, 2, 0, 1, 0, 1}));
  for (int n = 0; n < 3; ++n) EXPECT_NEAR(w[2 * n] + w[2 * n + 1], 1.0f, 1e-6f);
  EXPECT_FLOAT_EQ(w[0], 0.5f);
  EXPECT_FLOAT_EQ(w[4], 0.5f);
  // Scores are the softmax of each row.
  for (int n = 0; n < 3; ++n) {
    double z = 0;
    for (int e = 0; e < 4; ++e) z += std::exp(static_cast<double>(logits[n * 4 + e]));
    for (int e = 0; e < 4; ++e)
      EXPECT_NEAR(scores[n * 4 + e], std::exp(static_cast<double>(logits[n * 4 + e])) / z, 1e-6);
  }
}

TEST(Moe, PermuteIsStableAndDropless) {
  // Five tokens, k = 2, three experts; expert 2 receives nothing.
  const int64_t N = 5, k = 2, D = 3, E = 3;
  I ex = {1, 0, 0, 1, 1, 0, 0, 1, 1, 0};
  F x(N * D);
  for (int64_t i = 0; i < N * D; ++i) x[i] = static_cast<float>(i);
  F xp(N * k * D);
  I counts(E), slots(N * k);
  ctr::cpu::moe_permute_fwd(x.data(), ex.data(), xp.data(), counts.data(), slots.data(), N, k, D, E);
  EXPECT_EQ(counts, (I{5, 5, 0}));
  // Expert 0's rows come first, each group in slot order (token, then choice).
  EXPECT_EQ(slots, (I{5, 0, 1, 6, 7, 2, 3, 8, 9, 4}));
  for (int64_t i = 0; i < N * k; ++i)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(xp[slots[i] * D + d], x[(i / k) * D + d]);
  // Combine with weights inverts it: with weights 1, each token comes back k times.
  F ones(N * k, 1.0f), y(N * D);
  ctr::cpu::moe_unpermute_fwd(xp.data(), slots.data(), ones.data(), y.data(), N, k, D, N * k);
  for (int64_t i = 0; i < N * D; ++i) EXPECT_EQ(y[i], 2.0f * x[i]);
}

TEST(Moe, SkewedRoutingSendsEveryTokenToOneExpert) {
  const int64_t N = 64, k = 1, D = 8, E = 4, F_ = 5;
  I ex(N, 2);
  F x = random_vec(N * D, 31), xp(N * D), w = random_vec(E * F_ * D, 32), y(N * F_);
  I counts(E), slots(N);
  ctr::cpu::moe_permute_fwd(x.data(), ex.data(), xp.data(), counts.data(), slots.data(), N, k, D, E);
  EXPECT_EQ(counts, (I{0, 0, static_cast<int32_t>(N), 0}));
  ctr::cpu::grouped_linear_fwd(xp.data(), counts.data(), E, w.data(), y.data(), N, D, F_, E);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t o = 0; o < F_; ++o) {
      double ref = 0;
      for (int64_t d = 0; d < D; ++d) ref += static_cast<double>(xp[r * D + d]) * w[(2 * F_ + o) * D + d];
      EXPECT_NEAR(y[r * F_ + o], ref, 1e-5);
    }
}

TEST(Moe, GroupedLinearMatchesPerRowReference) {
  // Uneven counts (one expert empty) and rows past the counted ones.
  const int64_t M = 13, K = 7, N = 6, E = 4;
  I counts = {3, 0, 6, 2};  // 11 rows counted; rows 11 and 12 are not
  F x = random_vec(M * K, 41), w = random_vec(E * N * K, 42), y(M * N, 9.0f);
  ctr::cpu::grouped_linear_fwd(x.data(), counts.data(), E, w.data(), y.data(), M, K, N, E);
  auto expert_of = [&](int64_t r) { return r < 3 ? 0 : r < 9 ? 2 : r < 11 ? 3 : -1; };
  for (int64_t r = 0; r < M; ++r)
    for (int64_t o = 0; o < N; ++o) {
      const int64_t e = expert_of(r);
      double ref = 0;
      if (e >= 0)
        for (int64_t d = 0; d < K; ++d) ref += static_cast<double>(x[r * K + d]) * w[(e * N + o) * K + d];
      EXPECT_NEAR(y[r * N + o], ref, 1e-5) << r << "," << o;
    }
  // Backward: dx by the transpose, dw zero for the empty expert.
  F dy = random_vec(M * N, 43), dx(M * K, 9.0f), dw(E * N * K, 9.0f);
  ctr::cpu::grouped_linear_bwd(dy.data(), x.data(), counts.data(), E, w.data(), dx.data(), dw.data(), M, K, N, E, 1.0f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t d = 0; d < K; ++d) {
      const int64_t e = expert_of(r);
      double ref = 0;
      if (e >= 0)
        for (int64_t o = 0; o < N; ++o) ref += static_cast<double>(dy[r * N + o]) * w[(e * N + o) * K + d];
      EXPECT_NEAR(dx[r * K + d], ref, 1e-5);
    }
  for (int64_t i = 0; i < N * K; ++i) EXPECT_EQ(dw[1 * N * K + i], 0.0f);
  // Counts that claim more rows than exist are clamped, not read past the end.
  I huge = {1, 1 << 30, 5, 7};
  F y2(M * N);
  ctr::cpu::grouped_linear_fwd(x.data(), huge.data(), E, w.data(), y2.data(), M, K, N, E);
  for (int64_t o = 0; o < N; ++o) EXPECT_NEAR(y2[o], y[o], 1e-6);
}

// ---------------------------------------------------------------------------
// Determinism across thread counts

TEST(Determinism, ReductionsDoNotDependOnThreadCount) {
  // Bit-identical results with 1 and 3 threads for every kernel whose reduction
  // order the library controls.
  const int64_t R = 333, C = 129, V = 53, n = R * C;
  F x = random_vec(n, 1), dy = random_vec(n, 2), w = random_vec(C, 3);
  std::vector<int32_t> ids(R);
  for (int64_t i = 0; i < R; ++i) ids[i] = static_cast<int32_t>((i * 7) % V);
  auto run = [&] {
    std::vector<F> outs;
    F mean(R), rstd(R), y(n), dx(n), dw(C), db(C), dt(V * C), rr(C);
    ctr::cpu::layernorm_fwd(x.data(), w.data(), nullptr, y.data(), mean.data(), rstd.data(), R, C,
                            1e-5f);
    ctr::cpu::layernorm_bwd(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(),
                            dw.data(), db.data(), R, C, false);
    ctr::cpu::embedding_bwd(ids.data(), dy.data(), dt.data(), R, V, C, false);
    ctr::cpu::reduce_rows(dy.data(), rr.data(), n, C, false);
    F ss{static_cast<float>(ctr::cpu::sum_squares(x.data(), n))};
    for (F *f : {&y, &dx, &dw, &db, &dt, &rr, &ss}) outs.push_back(*f);
    return outs;
  };
  std::vector<F> one, three;
  with_threads(1, [&] { one = run(); });
  with_threads(3, [&] { three = run(); });
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_EQ(0, std::memcmp(one[i].data(), three[i].data(), one[i].size() * sizeof(float)))
        << "output " << i;
}

TEST(Determinism, GroupedLinearDoesNotDependOnThreadCount) {
  // The grouped GEMMs cut their products into pieces by FLOPs and thread count;
  // the bits must not follow. Two segments per expert (expert parallelism's
  // layout), skewed counts, an empty segment and an expert with no rows.
  const int64_t M = 1000, K = 128, N = 160, E = 4, S = 8;
  const I counts = {400, 0, 150, 0, 60, 0, 230, 90};  // 930 rows; expert 1 gets none
  F x = random_vec(M * K, 51), w = random_vec(E * N * K, 52), dy = random_vec(M * N, 53);
  auto run = [&] {
    F y(M * N, 9.0f), dx(M * K, 9.0f), dw(E * N * K, 9.0f);
    ctr::cpu::grouped_linear_fwd(x.data(), counts.data(), S, w.data(), y.data(), M, K, N, E);
    ctr::cpu::grouped_linear_bwd(dy.data(), x.data(), counts.data(), S, w.data(), dx.data(), dw.data(), M, K, N,
                                 E, 0.5f);
    return std::vector<F>{y, dx, dw};
  };
  std::vector<F> one, two, three;
  with_threads(1, [&] { one = run(); });
  with_threads(2, [&] { two = run(); });
  with_threads(3, [&] { three = run(); });
  for (size_t i = 0; i < one.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(one[i].data(), two[i].data(), one[i].size() * sizeof(float))) << "output " << i;
    EXPECT_EQ(0, std::memcmp(one[i].data(), three[i].data(), one[i].size() * sizeof(float))) << "output " << i;
  }
  // Expert 1 had no rows: zero gradient; expert 0 sums its two segments.
  for (int64_t i = 0; i < N * K; ++i) ASSERT_EQ(one[2][N * K + i], 0.0f);
  double ref = 0;
  for (int64_t r : {int64_t{0}, int64_t{400 + 150}})
    for (int64_t q = r; q < r + (r == 0 ? 400 : 60); ++q) ref += 0.5 * dy[q * N] * static_cast<double>(x[q * K]);
  EXPECT_NEAR(one[2][0], ref, 1e-3);
}

// ---------------------------------------------------------------------------
// General broadcasting, reductions over any dims, softmax on a dim, exact GELU

using Shp = std::vector<int64_t>;

int64_t count(const Shp &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

ctr::cpu::ShapeRef sref(const Shp &s) { return {s.data(), static_cast<int>(s.size())}; }

// The flat index in `of` (aligned at the trailing end of out, size-1 dims
// broadcast) of out's flat element i.
int64_t source_index(int64_t i, const Shp &out, const Shp &of) {
  int64_t idx = 0, stride = 1;
  for (int d = static_cast<int>(out.size()) - 1; d >= 0; --d) {
    const int64_t k = i % out[d];
    i /= out[d];
    const int j = d - static_cast<int>(out.size() - of.size());
    if (j < 0) continue;
    if (of[j] != 1) idx += k * stride;
    stride *= of[j];
  }
  return idx;
}

TEST(Math, ExactGeluMatchesErfFormula) {
  // Within a few ulps of the double formula; the derivative also against
  // central differences of that formula.
  auto gelu = [](double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); };
  for (double x = -10.0; x < 10.0; x += 0.0137) {
    const float xf = static_cast<float>(x);
    const double xd = xf;
    EXPECT_NEAR(ctr::math::gelu_exact(xf), gelu(xd), 1e-7 + 1e-6 * std::fabs(gelu(xd))) << x;
    const double fd = (gelu(xd + 1e-6) - gelu(xd - 1e-6)) / 2e-6;
    EXPECT_NEAR(ctr::math::gelu_exact_grad(xf), fd, 1e-6) << x;
  }
  // The tails: 0 far left (no NaN from 0 * inf), x far right.
  EXPECT_EQ(ctr::math::gelu_exact(-40.0f), -0.0f);
  EXPECT_EQ(ctr::math::gelu_exact(40.0f), 40.0f);
  EXPECT_EQ(ctr::math::gelu_exact_grad(-40.0f), 0.0f);
  EXPECT_EQ(ctr::math::gelu_exact_grad(40.0f), 1.0f);
}

// The kernels' form (normal_cdf_fast, no libm): as close to the double formula,
// relative to the value in the left tail too, where 1 + erf cancels (a few
// ulps: the exponent is summed in float).
TEST(Math, FastExactGeluMatchesErfFormula) {
  auto cdf = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  auto gelu = [&](double x) { return x * cdf(x); };
  for (double x = -12.0; x < 12.0; x += 0.0071) {
    const float xf = static_cast<float>(x);
    const double xd = xf;
    EXPECT_NEAR(ctr::math::normal_cdf_fast(xf), cdf(xd), 1.5e-6 * cdf(xd) + 1e-9) << x;
    EXPECT_NEAR(ctr::math::gelu_exact_fast(xf), gelu(xd), 1e-7 + 1e-6 * std::fabs(gelu(xd))) << x;
    const double grad = cdf(xd) + xd * std::exp(-0.5 * xd * xd) / std::sqrt(2.0 * M_PI);
    EXPECT_NEAR(ctr::math::gelu_exact_grad_fast(xf), grad, 1e-6 * (1.0 + std::fabs(grad))) << x;
  }
  EXPECT_EQ(ctr::math::gelu_exact_fast(-40.0f), -0.0f);
  EXPECT_EQ(ctr::math::gelu_exact_fast(40.0f), 40.0f);
  EXPECT_EQ(ctr::math::gelu_exact_grad_fast(-40.0f), 0.0f);
  EXPECT_EQ(ctr::math::gelu_exact_grad_fast(40.0f), 1.0f);
}

TEST(Activations, ExactGeluKernels) {
  const int64_t n = 10007;  // split over threads
  F x = random_vec(n, 3, -6.0f, 6.0f), dy = random_vec(n, 4), y(n), dx(n);
  ctr::cpu::gelu_exact_fwd(x.data(), y.data(), n);
  ctr::cpu::gelu_exact_bwd(dy.data(), x.data(), dx.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(y[i], ctr::math::gelu_exact_fast(x[i])) << i;
    ASSERT_EQ(dx[i], dy[i] * ctr::math::gelu_exact_grad_fast(x[i])) << i;
  }
}

struct BinCase {
  Shp a, b, out;
};

const std::vector<BinCase> kBinCases = {
    {{3, 4}, {3, 4}, {3, 4}},          {{3, 4}, {1}, {3, 4}},
    {{3, 4}, {}, {3, 4}},              {{}, {3, 4}, {3, 4}},
    {{2, 3, 4}, {3, 4}, {2, 3, 4}},    {{4}, {2, 3, 4}, {2, 3, 4}},
    {{2, 3, 4}, {3, 1}, {2, 3, 4}},    {{2, 1, 4}, {3, 1}, {2, 3, 4}},
    {{2, 3, 4}, {2, 1, 4}, {2, 3, 4}}, {{5, 1, 7, 1}, {1, 6, 1, 3}, {5, 6, 7, 3}},
    {{1}, {1}, {1}},                   {{}, {}, {}},
    {{300, 1}, {1, 513}, {300, 513}},  // rows and columns over several threads
    {{2, 1, 3, 1, 2, 1, 2, 1}, {1, 2, 1, 2, 1, 2, 1, 2}, {2, 2, 3, 2, 2, 2, 2, 2}},
};

TEST(Broadcast, GeneralBinaryMatchesReference) {
  using B = ctr::cpu::Binary;
  for (const BinCase &c : kBinCases)
    for (B op : {B::Add, B::Sub, B::Mul, B::Div}) {
      F a = random_vec(count(c.a), 1), b = random_vec(count(c.b), 2, 0.5f, 2.0f), out(count(c.out), NAN);
      ctr::cpu::binary_fwd(op, a.data(), sref(c.a), b.data(), sref(c.b), out.data(), sref(c.out));
      F ref(out.size());
      for (int64_t i = 0; i < count(c.out); ++i) {
        const float x = a[source_index(i, c.out, c.a)], y = b[source_index(i, c.out, c.b)];
        ref[i] = op == B::Add ? x + y : op == B::Sub ? x - y : op == B::Mul ? x * y : x / y;
      }
      // Element by element the same float operation: exact.
      EXPECT_EQ(0, std::memcmp(out.data(), ref.data(), out.size() * sizeof(float)))
          << "op " << static_cast<int>(op) << " " << c.a.size() << "-d with " << c.b.size() << "-d";
    }
}

TEST(Broadcast, ExpandMaskedFillAndDivGradient) {
  for (const BinCase &c : kBinCases) {
    // expand: a to out.
    F a = random_vec(count(c.a), 1), out(count(c.out), NAN);
    ctr::cpu::broadcast_to(a.data(), sref(c.a), out.data(), sref(c.out), 0.5f);
    for (int64_t i = 0; i < count(c.out); ++i) ASSERT_EQ(out[i], 0.5f * a[source_index(i, c.out, c.a)]) << i;
    // masked_fill of x[out] with a mask shaped like b, filled with +-inf.
    F x = random_vec(count(c.out), 3), m(count(c.b)), y(count(c.out), NAN);
    for (size_t i = 0; i < m.size(); ++i) m[i] = (i % 3 == 1) ? 0.0f : (i % 3 == 2 ? -2.0f : 1.0f);
    for (float v : {-INFINITY, INFINITY, 0.25f}) {
      ctr::cpu::masked_fill(x.data(), m.data(), sref(c.b), y.data(), sref(c.out), v);
      for (int64_t i = 0; i < count(c.out); ++i)
        ASSERT_EQ(y[i], m[source_index(i, c.out, c.b)] != 0.0f ? v : x[i]) << i;
    }
    // div's gradient for b before the reduction: -(g * (y / b)).
    F g = random_vec(count(c.out), 4), b = random_vec(count(c.b), 5, 0.5f, 2.0f), yd(count(c.out)), db(count(c.out));
    ctr::cpu::div_bwd_b(g.data(), x.data(), b.data(), sref(c.b), db.data(), sref(c.out));
    for (int64_t i = 0; i < count(c.out); ++i)
      ASSERT_EQ(db[i], -(g[i] * (x[i] / b[source_index(i, c.out, c.b)]))) << i;
  }
}

struct RedCase {
  Shp x, out;  // out: x's shape with the reduced dims 1 (or a shape x broadcasts from)
};

const std::vector<RedCase> kRedCases = {
    {{3, 7}, {3, 1}},          {{3, 7}, {1, 7}},         {{3, 7}, {1, 1}},
    {{3, 7}, {}},              {{2, 3, 4}, {2, 1, 4}},   {{2, 3, 4}, {1, 3, 1}},
    {{2, 3, 4}, {2, 3, 4}},    {{2, 3, 4}, {4}},         {{2, 3, 4}, {3, 1}},
    {{5, 300}, {1, 300}},      // kept innermost wider than a tile
    {{40, 3, 33}, {40, 1, 1}}, {{2, 1, 3, 5, 2}, {1, 1, 3, 1, 2}},
    {{1000, 67}, {1000, 1}},   // many outputs over threads
};

// The reduced output (sum, mean, max, var with the given correction) in double.
Dv ref_reduce(const Dv &x, const Shp &xs, const Shp &os, int kind, int64_t correction) {
  const int64_t no = count(os);
  std::vector<std::vector<double>> groups(static_cast<size_t>(no));
  for (int64_t i = 0; i < count(xs); ++i) groups[source_index(i, xs, os)].push_back(x[i]);
  Dv out;
  for (const auto &g : groups) {
    double s = 0, m = -INFINITY;
    for (double v : g) {
      s += v;
      m = std::max(m, v);
    }
    const double mu = s / static_cast<double>(g.size());
    double m2 = 0;
    for (double v : g) m2 += (v - mu) * (v - mu);
    out.push_back(kind == 0 ? s : kind == 1 ? mu : kind == 2 ? m : m2 / static_cast<double>(g.size() - correction));
  }
  return out;
}

TEST(Reduce, AllKindsMatchReference) {
  using R = ctr::cpu::Reduction;
  for (const RedCase &c : kRedCases) {
    F x = random_vec(count(c.x), 6, -2.0f, 2.0f);
    const int64_t n = count(c.x) / count(c.out);
    for (int kind = 0; kind < 4; ++kind)
      for (int64_t corr : {int64_t{1}, int64_t{0}}) {
        if (kind != 3 && corr == 0) continue;
        if (kind == 3 && n - corr <= 0) continue;
        F out(count(c.out), NAN), mean(count(c.out), NAN);
        ctr::cpu::reduce(static_cast<R>(kind), x.data(), sref(c.x), out.data(), sref(c.out), corr,
                         kind == 3 ? mean.data() : nullptr);
        // A float sum of n terms of magnitude <= 2.
        const double tol = 1e-6 * static_cast<double>(n) + 1e-6;
        expect_close(out, ref_reduce(to_d(x), c.x, c.out, kind, corr), tol, 1e-5,
                     "reduce kind " + std::to_string(kind) + " of " + std::to_string(c.x.size()) + "-d to " +
                         std::to_string(count(c.out)));
        if (kind == 3) expect_close(mean, ref_reduce(to_d(x), c.x, c.out, 1, 0), tol, 1e-5, "var's mean");
      }
  }
}

TEST(Reduce, AmaxGradientSplitsTiesEvenly) {
  // Rows (inner-reduced plan) and columns (kept-innermost plan) with 1, 2 and 3 ties.
  const Shp xs = {3, 4};
  const F x = {1.0f, 5.0f, 5.0f, 0.0f, 2.0f, 2.0f, 2.0f, -1.0f, -3.0f, -2.0f, -2.5f, -4.0f};
  for (const Shp &os : {Shp{3, 1}, Shp{1, 4}}) {
    F y(count(os)), g(count(os)), gx(x.size(), NAN);
    ctr::cpu::reduce(ctr::cpu::Reduction::Amax, x.data(), sref(xs), y.data(), sref(os));
    for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i + 1);
    ctr::cpu::amax_bwd(g.data(), x.data(), y.data(), gx.data(), sref(xs), sref(os));
    std::vector<int> ties(g.size(), 0);
    for (int64_t i = 0; i < 12; ++i) ties[source_index(i, xs, os)] += x[i] == y[source_index(i, xs, os)];
    for (int64_t i = 0; i < 12; ++i) {
      const int64_t o = source_index(i, xs, os);
      EXPECT_EQ(gx[i], x[i] == y[o] ? g[o] / static_cast<float>(ties[o]) : 0.0f) << i;
    }
  }
  // Row 1 has three ties: each gets a third.
  F y(3), g = {1.0f, 1.0f, 3.0f}, gx(12);
  const Shp os = {3, 1};
  ctr::cpu::reduce(ctr::cpu::Reduction::Amax, x.data(), sref(xs), y.data(), sref(os));
  ctr::cpu::amax_bwd(g.data(), x.data(), y.data(), gx.data(), sref(xs), sref(os));
  EXPECT_FLOAT_EQ(gx[4], 1.0f / 3);
  EXPECT_EQ(gx[7], 0.0f);
  EXPECT_EQ(gx[9], 3.0f);
}

TEST(Reduce, VarGradientMatchesFiniteDifferences) {
  for (const RedCase &c : {RedCase{{3, 7}, {3, 1}}, RedCase{{2, 3, 4}, {1, 3, 1}}, RedCase{{5, 300}, {1, 300}}})
    for (int64_t corr : {int64_t{1}, int64_t{0}}) {
      F x = random_vec(count(c.x), 7), g = random_vec(count(c.out), 8), y(count(c.out)), mean(count(c.out)),
        gx(count(c.x), NAN);
      ctr::cpu::reduce(ctr::cpu::Reduction::Var, x.data(), sref(c.x), y.data(), sref(c.out), corr, mean.data());
      ctr::cpu::var_bwd(g.data(), x.data(), mean.data(), gx.data(), sref(c.x), sref(c.out), corr);
      expect_grad(
          gx, [&](const Dv &v) { return ref_reduce(v, c.x, c.out, 3, corr); }, x, g, 1e-6, 1e-4, "var", 64);
    }
}

// softmax / log_softmax over the middle dim of [outer, C, inner], in double.
Dv ref_softmax_dim(const Dv &x, int64_t outer, int64_t C, int64_t inner, bool log) {
  Dv y(x.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      double m = -INFINITY, s = 0;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, x[(o * C + c) * inner + i]);
      for (int64_t c = 0; c < C; ++c) s += std::exp(x[(o * C + c) * inner + i] - m);
      for (int64_t c = 0; c < C; ++c) {
        const double v = x[(o * C + c) * inner + i] - m;
        y[(o * C + c) * inner + i] = log ? v - std::log(s) : std::exp(v) / s;
      }
    }
  return y;
}

TEST(Softmax, OnAnyDimMatchesReferenceAndFiniteDifferences) {
  struct Dims {
    int64_t outer, C, inner;
  };
  for (const Dims d : {Dims{3, 5, 4}, Dims{1, 7, 3}, Dims{2, 1, 5}, Dims{2, 6, 300}, Dims{4, 9, 1}})
    for (bool log : {false, true}) {
      if (!log && d.inner == 1) continue;  // the row kernels: tested above
      const int64_t n = d.outer * d.C * d.inner;
      F x = random_vec(n, 9, -6.0f, 6.0f), y(n, NAN), dy = random_vec(n, 10), dx(n, NAN);
      if (log) {
        ctr::cpu::log_softmax_fwd(x.data(), y.data(), d.outer, d.C, d.inner);
        ctr::cpu::log_softmax_bwd(dy.data(), y.data(), dx.data(), d.outer, d.C, d.inner);
      } else {
        ctr::cpu::softmax_dim_fwd(x.data(), y.data(), d.outer, d.C, d.inner);
        ctr::cpu::softmax_dim_bwd(dy.data(), y.data(), dx.data(), d.outer, d.C, d.inner);
      }
      const std::string what = std::string(log ? "log_softmax" : "softmax") + " inner " + std::to_string(d.inner);
      expect_close(y, ref_softmax_dim(to_d(x), d.outer, d.C, d.inner, log), 1e-6, 1e-5, what);
      expect_grad(
          dx, [&](const Dv &v) { return ref_softmax_dim(v, d.outer, d.C, d.inner, log); }, x, dy, 1e-5, 1e-4,
          what + " backward", 48);
    }
}

TEST(Determinism, BroadcastAndReductionsDoNotDependOnThreadCount) {
  const Shp a = {300, 1, 67}, b = {1, 40, 67}, o = {300, 40, 67};
  F x = random_vec(count(a), 1), y = random_vec(count(b), 2), big = random_vec(count(o), 3);
  auto run = [&] {
    std::vector<F> outs;
    F s(count(o)), r1(67), r2(300 * 40), r3(40 * 67), v(40 * 67), m(40 * 67), ls(count(o));
    ctr::cpu::binary_fwd(ctr::cpu::Binary::Div, x.data(), sref(a), y.data(), sref(b), s.data(), sref(o));
    ctr::cpu::reduce(ctr::cpu::Reduction::Sum, big.data(), sref(o), r1.data(), sref(Shp{67}));
    ctr::cpu::reduce(ctr::cpu::Reduction::Mean, big.data(), sref(o), r2.data(), sref(Shp{300, 40, 1}));
    ctr::cpu::reduce(ctr::cpu::Reduction::Amax, big.data(), sref(o), r3.data(), sref(Shp{40, 67}));
    ctr::cpu::reduce(ctr::cpu::Reduction::Var, big.data(), sref(o), v.data(), sref(Shp{40, 67}), 1, m.data());
    ctr::cpu::log_softmax_fwd(big.data(), ls.data(), 300, 40, 67);
    for (F *f : {&s, &r1, &r2, &r3, &v, &m, &ls}) outs.push_back(*f);
    return outs;
  };
  std::vector<F> one, three;
  with_threads(1, [&] { one = run(); });
  with_threads(3, [&] { three = run(); });
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_EQ(0, std::memcmp(one[i].data(), three[i].data(), one[i].size() * sizeof(float))) << "output " << i;
}

}  // namespace

// The vocabulary-parallel cross-entropy on 2 and 4 ranks (11 words: 6+5 and
// 3+3+3+2, the last rank's block padded with columns that must not count)
// equals the whole-vocabulary kernel: loss, log-sum-exp and every column of
// the gradient, ignored rows included.
TEST(VocabParallelCrossEntropy, RanksEqualTheWholeVocabulary) {
  const int64_t R = 7, V = 11;
  const F logits = random_vec(R * V, 71, -3.0f, 3.0f);
  const std::vector<int32_t> targets = {3, 10, -1, 0, 5, 6, -100};
  float loss = 0;
  int64_t count = 0;
  F lse(R), grad(R * V);
  ctr::cpu::cross_entropy_fwd(logits.data(), targets.data(), &loss, lse.data(), &count, R, V);
  ctr::cpu::cross_entropy_bwd(logits.data(), targets.data(), lse.data(), 0.7f, count, grad.data(), R, V);
  for (int64_t ranks : {2, 4}) {
    const int64_t per = (V + ranks - 1) / ranks;
    std::vector<F> local(ranks, F(R * per, 100.0f));  // padding columns hold junk
    F all(ranks * R * 3);
    for (int64_t k = 0; k < ranks; ++k) {
      const int64_t offset = k * per, valid = std::min(per, V - offset);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < valid; ++j) local[k][r * per + j] = logits[r * V + offset + j];
      ctr::cpu::vocab_ce_stats(local[k].data(), targets.data(), all.data() + k * R * 3, R, per, offset, valid);
    }
    for (int64_t k = 0; k < ranks; ++k) {
      const int64_t offset = k * per, valid = std::min(per, V - offset);
      float l = 0;
      int64_t n = 0;
      F ls(R), g(R * per, -5.0f);
      ctr::cpu::vocab_ce_loss(targets.data(), all.data(), &l, ls.data(), &n, R, ranks);
      EXPECT_EQ(n, count);
      EXPECT_NEAR(l, loss, 1e-6f * std::abs(loss) + 1e-6f) << ranks << " ranks, rank " << k;
      for (int64_t r = 0; r < R; ++r) EXPECT_NEAR(ls[r], lse[r], 1e-5f) << "row " << r;
      ctr::cpu::vocab_ce_bwd(local[k].data(), targets.data(), ls.data(), 0.7f, n, g.data(), R, per, offset, valid);
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t j = 0; j < valid; ++j)
          EXPECT_NEAR(g[r * per + j], grad[r * V + offset + j], 1e-6f) << ranks << " ranks, row " << r << " word "
                                                                          << offset + j;
        for (int64_t j = valid; j < per; ++j) EXPECT_EQ(g[r * per + j], 0.0f) << "padding column " << j;
      }
    }
  }
}
