// Mixture-of-experts kernels: routing, the auxiliary losses, the dropless
// permutation of tokens by expert, grouped expert GEMMs and the weighted combine.
//
// Shapes: N tokens (every leading dim folded), E experts, k experts per token,
// D the model width. A token's k choices are its "slots" n*k + j. Permuting
// groups the N*k slots by expert (expert 0's first), each group in slot order,
// so the layout depends only on the routing, never on the thread count;
// slots[n*k + j] is the row of the permuted buffer that holds slot (n, j).
//
// The grouped GEMMs read per-expert row counts; a count past the rows that exist
// is clamped (a count can come from a file's input), and rows past the last
// counted one are zero in every output.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/thread_pool.h"
#include "cpu/kernels.h"

namespace ctr::cpu {
namespace {

// Rows per parallel chunk for the per-token loops: enough work to be worth a
// thread handoff.
int64_t token_grain(int64_t per_token) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(per_token, 1)); }

// softmax of one row of E logits into p (double accumulation); returns log-sum-exp.
double softmax_row(const float *l, float *p, int64_t E) {
  float m = l[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, l[e]);
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += std::exp(static_cast<double>(l[e] - m));
  const double lse = static_cast<double>(m) + std::log(s);
  for (int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(std::exp(static_cast<double>(l[e]) - lse));
  return lse;
}

// The gradient of a loss linear in the softmax of each row of logits[N, E]
// (d loss / d p[n, e] = c[e] for every row): dlogits[n] = p ⊙ (c - <c, p>).
void softmax_linear_bwd(const float *logits, const std::vector<double> &c, float *dlogits, int64_t N, int64_t E) {
  ctr::parallel_for(N, token_grain(E), [&](int64_t n0, int64_t n1) {
    std::vector<float> p(static_cast<size_t>(E));
    for (int64_t n = n0; n < n1; ++n) {
      softmax_row(logits + n * E, p.data(), E);
      double dot = 0;
      for (int64_t e = 0; e < E; ++e) dot += c[e] * p[e];
      for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] = static_cast<float>(p[e] * (c[e] - dot));
    }
  });
}

// Offsets of each expert's rows in the permuted buffer, clamped to M rows.
void expert_offsets(const int32_t *counts, int64_t E, int64_t M, std::vector<int64_t> &off) {
  off.assign(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = std::max<int64_t>(0, counts[e]);
    off[e + 1] = std::min(M, off[e] + c);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Router

void moe_router_fwd(const float *logits, float *weights, int32_t *experts, float *scores, int64_t N,
                    int64_t E, int64_t k, bool sigmoid, bool renorm) {
  ctr::parallel_for(N, token_grain(E * k), [=](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float *l = logits + n * E;
      float *s = scores + n * E;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) s[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(l[e]))));
      } else {
        softmax_row(l, s, E);
      }
      // Top-k by selection: the largest score not yet taken, the lower index on
      // ties. k and E are small (tens), so this beats a sort.
      int32_t *ex = experts + n * k;
      float *w = weights + n * k;
      double total = 0;
      for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          bool taken = false;
          for (int64_t i = 0; i < j; ++i) taken |= ex[i] == e;
          if (taken) continue;
          if (best < 0 || s[e] > s[best]) best = e;
        }
        ex[j] = static_cast<int32_t>(best);
        w[j] = s[best];
        total += s[best];
      }
      // Scores that all underflowed to zero (sigmoid of very negative logits)
      // share the token equally rather than divide by zero.
      if (renorm)
        for (int64_t j = 0; j < k; ++j)
          w[j] = total > 0 ? static_cast<float>(w[j] / total) : 1.0f / static_cast<float>(k);
    }
  });
}

void moe_router_bwd(const float *dweights, const float *scores, const int32_t *experts, float *dlogits,
                    int64_t N, int64_t E, int64_t k, bool sigmoid, bool renorm) {
  ctr::parallel_for(N, token_grain(E * k), [=](int64_t n0, int64_t n1) {
    std::vector<double> ds(static_cast<size_t>(E));
    for (int64_t n = n0; n < n1; ++n) {
      const float *s = scores + n * E;
      const float *dw = dweights + n * k;
      const int32_t *ex = experts + n * k;
      std::fill(ds.begin(), ds.end(), 0.0);
      if (renorm) {
        // w_j = v_j / S: dv_j = (dw_j - sum_i dw_i w_i) / S.
        double S = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) S += s[ex[j]];
        if (S <= 0) S = 1;  // the forward's equal split: no gradient to speak of
        for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[j]) * s[ex[j]] / S;
        for (int64_t j = 0; j < k; ++j) ds[ex[j]] += (dw[j] - dot) / S;
      } else {
        for (int64_t j = 0; j < k; ++j) ds[ex[j]] += dw[j];
      }
      float *dl = dlogits + n * E;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(ds[e] * s[e] * (1.0 - s[e]));
      } else {
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += ds[e] * s[e];
        for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<float>(s[e] * (ds[e] - dot));
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Auxiliary losses

// Fraction of the N*k assignments that went to each expert.
static void assignment_fractions(const int32_t *experts, int64_t N, int64_t E, int64_t k,
                                 std::vector<double> &f) {
  f.assign(static_cast<size_t>(E), 0.0);
  for (int64_t i = 0; i < N * k; ++i)
    if (experts[i] >= 0 && experts[i] < E) f[experts[i]] += 1.0;
  for (double &x : f) x /= static_cast<double>(std::max<int64_t>(N * k, 1));
}

void moe_aux_loss_fwd(const float *logits, const int32_t *experts, float *loss, int64_t N, int64_t E,
                      int64_t k, float coef) {
  std::vector<double> f;
  assignment_fractions(experts, N, E, k, f);
  std::vector<double> P(static_cast<size_t>(E), 0.0);
  std::vector<float> p(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    softmax_row(logits + n * E, p.data(), E);
    for (int64_t e = 0; e < E; ++e) P[e] += p[e];
  }
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += f[e] * P[e] / static_cast<double>(std::max<int64_t>(N, 1));
  loss[0] = static_cast<float>(coef * static_cast<double>(E) * acc);
}

void moe_aux_loss_bwd(float dloss, const float *logits, const int32_t *experts, float *dlogits, int64_t N,
                      int64_t E, int64_t k, float coef) {
  std::vector<double> f;
  assignment_fractions(experts, N, E, k, f);
  // d loss / d p[n, e] = coef * E * f_e / N, the same for every token.
  std::vector<double> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    c[e] = static_cast<double>(dloss) * coef * static_cast<double>(E) * f[e] / static_cast<double>(std::max<int64_t>(N, 1));
  softmax_linear_bwd(logits, c, dlogits, N, E);
}

void moe_z_loss_fwd(const float *logits, float *loss, int64_t N, int64_t E, float coef) {
  std::vector<float> p(static_cast<size_t>(E));
  double acc = 0;
  for (int64_t n = 0; n < N; ++n) {
    const double lse = softmax_row(logits + n * E, p.data(), E);
    acc += lse * lse;
  }
  loss[0] = static_cast<float>(coef * acc / static_cast<double>(std::max<int64_t>(N, 1)));
}

void moe_z_loss_bwd(float dloss, const float *logits, float *dlogits, int64_t N, int64_t E, float coef) {
  const double scale = static_cast<double>(dloss) * coef * 2.0 / static_cast<double>(std::max<int64_t>(N, 1));
  ctr::parallel_for(N, token_grain(E), [=](int64_t n0, int64_t n1) {
    std::vector<float> p(static_cast<size_t>(E));
    for (int64_t n = n0; n < n1; ++n) {
      const double lse = softmax_row(logits + n * E, p.data(), E);
      for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] = static_cast<float>(scale * lse * p[e]);
    }
  });
}

// ---------------------------------------------------------------------------
// Permute and combine

void moe_permute_fwd(const float *x, const int32_t *experts, float *xp, int32_t *counts, int32_t *slots,
                     int64_t N, int64_t k, int64_t D, int64_t E) {
  // A stable counting sort of the slots by expert. An expert id out of range
  // (only possible from a file's input) sends its slot to the last expert.
  std::vector<int64_t> next(static_cast<size_t>(E) + 1, 0);
  auto expert_of = [=](int64_t i) -> int64_t {
    const int64_t e = experts[i];
    return e >= 0 && e < E ? e : E - 1;
  };
  for (int64_t i = 0; i < N * k; ++i) ++next[expert_of(i) + 1];
  for (int64_t e = 0; e < E; ++e) counts[e] = static_cast<int32_t>(next[e + 1]);
  for (int64_t e = 0; e < E; ++e) next[e + 1] += next[e];
  for (int64_t i = 0; i < N * k; ++i) slots[i] = static_cast<int32_t>(next[expert_of(i)]++);
  ctr::parallel_for(N * k, token_grain(D), [=](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      std::memcpy(xp + static_cast<int64_t>(slots[i]) * D, x + (i / k) * D, static_cast<size_t>(D) * sizeof(float));
  });
}

void moe_permute_bwd(const float *dxp, const int32_t *slots, float *dx, int64_t N, int64_t k, int64_t D,
                     int64_t M) {
  ctr::parallel_for(N, token_grain(D * k), [=](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float *o = dx + n * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[n * k + j];
        if (r < 0 || r >= M) continue;
        const float *g = dxp + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += g[d];
      }
    }
  });
}

void moe_unpermute_fwd(const float *yp, const int32_t *slots, const float *weights, float *y, int64_t N,
                       int64_t k, int64_t D, int64_t M) {
  ctr::parallel_for(N, token_grain(D * k), [=](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float *o = y + n * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[n * k + j];
        if (r < 0 || r >= M) continue;
        const float w = weights[n * k + j];
        const float *src = yp + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * src[d];
      }
    }
  });
}

void moe_unpermute_bwd(const float *dy, const float *yp, const int32_t *slots, const float *weights,
                       float *dyp, float *dweights, int64_t N, int64_t k, int64_t D, int64_t M) {
  // Rows no slot points at get no gradient.
  std::memset(dyp, 0, static_cast<size_t>(M * D) * sizeof(float));
  ctr::parallel_for(N, token_grain(D * k), [=](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float *g = dy + n * D;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = slots[n * k + j];
        if (r < 0 || r >= M) {
          dweights[n * k + j] = 0.0f;
          continue;
        }
        const float w = weights[n * k + j];
        const float *src = yp + r * D;
        float *o = dyp + r * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) {
          dot += static_cast<double>(g[d]) * src[d];
          o[d] = w * g[d];
        }
        dweights[n * k + j] = static_cast<float>(dot);
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Grouped GEMMs: segment s (rows [off[s], off[s+1])) times the weight of expert
// s % E. On one rank there is a segment per expert; under expert parallelism a
// segment per (source rank, local expert).
//
// Every product of a call runs in one parallel loop over pieces of all of them,
// not one product after another each split over the pool: an expert's product
// is small (a few hundred rows), and splitting each in turn paid the pool's
// wake-up and join once per product and left a thread idle behind the slower
// half of each. A piece is a block of rows or columns of one product's output,
// cut along its larger dimension at multiples of 16, so no sum is ever split,
// and it is one product call (gemm_serial). A product gets pieces in
// proportion to its FLOPs, about kPieces over the whole call, so that a skewed
// routing (one expert with a third of the rows) still spreads evenly. The cut
// depends on the sizes only, never on the thread count, and a product's bits
// depend on the cut: the results are the same with any number of threads.

namespace {

struct Product {
  bool ta, tb;
  int64_t M, N, K;
  float alpha;
  const float *A;
  int64_t lda;
  const float *B;
  int64_t ldb;
  float *C;
  int64_t ldc;

  bool by_rows() const { return M >= N; }
  int64_t extent() const { return by_rows() ? M : N; }
  double flops() const { return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K); }
  // Rows (or columns) [b0, b1) of C = alpha op(A) op(B) + beta C.
  void run(int64_t b0, int64_t b1, float beta) const {
    if (by_rows())
      gemm_serial(ta, tb, b1 - b0, N, K, alpha, ta ? A + b0 : A + b0 * lda, lda, B, ldb, beta, C + b0 * ldc, ldc);
    else
      gemm_serial(ta, tb, M, b1 - b0, K, alpha, A, lda, tb ? B + b0 * ldb : B + b0, ldb, beta, C + b0, ldc);
  }
};

// A piece of work: rows or columns [b0, b1) of task `task`'s output.
struct Piece {
  int64_t task, b0, b1;
};

constexpr int64_t kPieceTile = 16;   // pieces end at multiples of the GEMM micro-kernels' tiles
constexpr double kPieces = 16;       // per call: 8 per thread on 2 threads
constexpr double kPieceFlops = 2e6;  // below this a piece is not worth a thread

// Cuts each task (its output's extent along the cut, and its FLOPs) into pieces
// as above and runs fn(piece) for every piece over the pool, or on the calling
// thread when the whole call is below kPieceFlops.
template <class Fn>
void run_pieces(const std::vector<std::pair<int64_t, double>> &tasks, const Fn &fn) {
  double total = 0;
  for (const auto &t : tasks) total += t.second;
  const double target = std::max(kPieceFlops, total / kPieces);
  std::vector<Piece> pieces;
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) {
    const int64_t extent = tasks[i].first;
    if (extent <= 0) continue;
    const int64_t want = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(tasks[i].second / target)));
    int64_t size = (extent + want - 1) / want;
    size = (size + kPieceTile - 1) / kPieceTile * kPieceTile;
    for (int64_t b = 0; b < extent; b += size) pieces.push_back({i, b, std::min(extent, b + size)});
  }
  const int64_t n = static_cast<int64_t>(pieces.size());
  ctr::parallel_for(n, total < kPieceFlops ? n : 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) fn(pieces[p]);
  });
}

}  // namespace

void grouped_linear_fwd(const float *x, const int32_t *counts, int64_t S, const float *w, float *y, int64_t M,
                        int64_t K, int64_t N, int64_t E) {
  std::vector<int64_t> off;
  expert_offsets(counts, S, M, off);
  std::vector<Product> prods(static_cast<size_t>(S));
  std::vector<std::pair<int64_t, double>> tasks(static_cast<size_t>(S), {0, 0.0});
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = off[s + 1] - off[s];
    if (rows <= 0) continue;
    prods[s] = {false, true, rows, N, K, 1.0f, x + off[s] * K, K, w + (s % E) * N * K, K, y + off[s] * N, N};
    tasks[s] = {prods[s].extent(), prods[s].flops()};
  }
  run_pieces(tasks, [&](const Piece &pc) { prods[pc.task].run(pc.b0, pc.b1, 0.0f); });
  std::memset(y + off[S] * N, 0, static_cast<size_t>((M - off[S]) * N) * sizeof(float));
}

void grouped_linear_bwd(const float *dy, const float *x, const int32_t *counts, int64_t S, const float *w,
                        float *dx, float *dw, int64_t M, int64_t K, int64_t N, int64_t E, float weight_grad_scale) {
  std::vector<int64_t> off;
  expert_offsets(counts, S, M, off);
  // Tasks [0, S): dx of segment s. Tasks [S, S + E): dw of expert e, the sum of
  // its segments' products in segment order (the first overwrites); an expert
  // that received no rows gets a zero gradient.
  std::vector<Product> dxp(static_cast<size_t>(S)), dwp(static_cast<size_t>(S));
  std::vector<std::vector<int64_t>> segments(static_cast<size_t>(E));
  std::vector<std::pair<int64_t, double>> tasks(static_cast<size_t>(S + E), {0, 0.0});
  for (int64_t s = 0; s < S; ++s) {
    const int64_t rows = off[s + 1] - off[s], e = s % E;
    if (rows <= 0) continue;
    dxp[s] = {false, false, rows, K, N, 1.0f, dy + off[s] * N, N, w + e * N * K, K, dx + off[s] * K, K};
    dwp[s] = {true, false, N, K, rows, weight_grad_scale, dy + off[s] * N, N, x + off[s] * K, K, dw + e * N * K, K};
    tasks[s] = {dxp[s].extent(), dxp[s].flops()};
    tasks[S + e].first = dwp[s].extent();
    tasks[S + e].second += dwp[s].flops();
    segments[e].push_back(s);
  }
  for (int64_t e = 0; e < E; ++e)
    if (segments[e].empty()) std::memset(dw + e * N * K, 0, static_cast<size_t>(N * K) * sizeof(float));
  run_pieces(tasks, [&](const Piece &pc) {
    if (pc.task < S) {
      dxp[pc.task].run(pc.b0, pc.b1, 0.0f);
      return;
    }
    float beta = 0.0f;
    for (int64_t s : segments[pc.task - S]) {
      dwp[s].run(pc.b0, pc.b1, beta);
      beta = 1.0f;
    }
  });
  std::memset(dx + off[S] * K, 0, static_cast<size_t>((M - off[S]) * K) * sizeof(float));
}

// ---------------------------------------------------------------------------
// Load balance over every rank's batch

void moe_aux_stats(const float *logits, const int32_t *experts, float *stats, int64_t N, int64_t E, int64_t k) {
  std::vector<double> acc(static_cast<size_t>(2 * E), 0.0);
  for (int64_t i = 0; i < N * k; ++i)
    if (experts[i] >= 0 && experts[i] < E) acc[experts[i]] += 1.0;
  std::vector<float> p(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    softmax_row(logits + n * E, p.data(), E);
    for (int64_t e = 0; e < E; ++e) acc[E + e] += p[e];
  }
  for (int64_t i = 0; i < 2 * E; ++i) stats[i] = static_cast<float>(acc[i]);
  stats[2 * E] = static_cast<float>(N);
}

void moe_aux_loss_global_fwd(const float *stats, float *loss, int64_t E, int64_t k, float coef) {
  const double n = std::max(1.0, static_cast<double>(stats[2 * E]));
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += (stats[e] / (n * static_cast<double>(k))) * (stats[E + e] / n);
  loss[0] = static_cast<float>(coef * static_cast<double>(E) * acc);
}

void moe_aux_loss_global_bwd(float dloss, const float *logits, const float *stats, float *dlogits, int64_t N,
                             int64_t E, int64_t k, float coef) {
  // The loss is the same on every rank, but each rank's gradient is averaged
  // with the others' (divided by the number of ranks, world): so each rank
  // scales its own tokens' share by its local token count, not the global one.
  const double n = std::max(1.0, static_cast<double>(stats[2 * E]));
  std::vector<double> c(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e)
    c[e] = static_cast<double>(dloss) * coef * static_cast<double>(E) * (stats[e] / (n * static_cast<double>(k))) /
           static_cast<double>(std::max<int64_t>(N, 1));
  softmax_linear_bwd(logits, c, dlogits, N, E);
}

}  // namespace ctr::cpu
