// Context-parallel attention, forward and backward: this rank's query rows (two
// chunks of the sequence, see ctr_cp_position) against every rank's keys and
// values, gathered over the cp axis in rank order. With index -1 (the heads
// exchanged all-to-all over cp) the query rows are every rank's chunks too, in
// rank order: the whole sequence, permuted, for this rank's share of the heads.
//
// The rows are chunks of L positions: the query rows are this rank's two (or
// every rank's), the key rows every rank's two in rank order. Under a causal mask a query chunk
// sees the key chunks before it whole, its own one up to the diagonal and none
// after it, so the products run per (query chunk, key chunk) block and skip the
// blocks after the diagonal: each rank does about half the [Tq, Tk] products,
// the same share on every rank (that is what the mirrored chunks are for).
// Inside the computed blocks the mask (and a window) compares global positions
// entry by entry; masked entries are exactly zero in probs, and the skipped
// blocks are zero too. Work is split over (batch, kv head) pairs as in
// attention.cc, so that a group's query heads add into their dk/dv block in a
// fixed order on one thread.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/math.h"
#include "common/op_params.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

struct CpDims {
  int64_t B, Tq, Tk, Hq, Hkv, D, group;
  int64_t ldq, ldkv;
  float scale;
  bool causal;
  int64_t window;
  float softcap;
  int64_t ranks, index;         // index -1: the query rows are the key rows
  int64_t source = -1;          // >= 0: the key rows are that rank's two chunks only (ring)
  const int64_t *kp = nullptr;  // the key rows' global positions, [Tk]

  int64_t qpos(int64_t t) const { return index < 0 ? kp[t] : ctr_cp_position(t, Tq, ranks, index); }
  int64_t kpos(int64_t j) const { return kp[j]; }
  int64_t L() const { return index < 0 ? Tq / (2 * ranks) : Tq / 2; }
  int64_t query_chunks() const { return Tq / L(); }
  // Whether query chunk qb sees any key of key chunk kb (0 .. 2 * ranks - 1).
  bool sees(int64_t qb, int64_t kb) const { return !causal || kpos(kb * L()) <= qpos(qb * L()); }
  bool visible(int64_t qp, int64_t kp) const {
    if (!causal) return true;
    return kp <= qp && (window <= 0 || qp - kp < window);
  }
};

float *scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}
float *scores_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

// lse (nullable): per query row, log of the sum of exp(score) over the visible
// keys, -inf where none is visible (that row's probabilities and output are 0).
void forward_head(const CpDims &d, const float *q, const float *k, const float *v, float *out, float *P,
                  float *lse = nullptr) {
  const int64_t Tq = d.Tq, Tk = d.Tk, L = d.L();
  for (int64_t qb = 0; qb < d.query_chunks(); ++qb)
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      float *blk = P + qb * L * Tk + kb * L;
      if (d.sees(qb, kb))
        gemm(false, true, L, L, d.D, d.scale, q + qb * L * d.ldq, d.ldq, k + kb * L * d.ldkv, d.ldkv, 0.0f, blk, Tk);
      else
        for (int64_t t = 0; t < L; ++t) std::fill(blk + t * Tk, blk + t * Tk + L, 0.0f);
    }
  for (int64_t t = 0; t < Tq; ++t) {
    float *p = P + t * Tk;
    const int64_t qp = d.qpos(t), qb = t / L;
    float m = -INFINITY;
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      if (!d.sees(qb, kb)) continue;
      for (int64_t j = kb * L; j < (kb + 1) * L; ++j) {
        if (!d.visible(qp, d.kpos(j))) continue;
        if (d.softcap > 0.0f) p[j] = d.softcap * math::tanh_fast(p[j] / d.softcap);
        m = std::max(m, p[j]);
      }
    }
    float sum = 0.0f;
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      if (!d.sees(qb, kb)) continue;
      for (int64_t j = kb * L; j < (kb + 1) * L; ++j) {
        if (!d.visible(qp, d.kpos(j))) {
          p[j] = 0.0f;
          continue;
        }
        p[j] = math::exp_fast(p[j] - m);
        sum += p[j];
      }
    }
    if (lse) lse[t] = sum > 0.0f ? m + std::log(sum) : -INFINITY;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t kb = 0; kb < Tk / L; ++kb)
      if (d.sees(qb, kb))
        for (int64_t j = kb * L; j < (kb + 1) * L; ++j) p[j] *= inv;
  }
  for (int64_t qb = 0; qb < d.query_chunks(); ++qb) {
    float beta = 0.0f;
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      if (!d.sees(qb, kb)) continue;
      gemm(false, false, L, d.D, L, 1.0f, P + qb * L * Tk + kb * L, Tk, v + kb * L * d.ldkv, d.ldkv, beta,
           out + qb * L * d.ldq, d.ldq);
      beta = 1.0f;
    }
    if (beta == 0.0f)  // no key chunk visible (a ring block): the chunk's output is 0
      for (int64_t t = qb * L; t < (qb + 1) * L; ++t) std::fill(out + t * d.ldq, out + t * d.ldq + d.D, 0.0f);
  }
}

// dlse (nullable): the gradient of forward_head's lse, which adds dlse * P to dS.
void backward_head(const CpDims &d, const float *dout, const float *q, const float *k, const float *v,
                   const float *P, float *dq, float *dk, float *dv, float beta, float *dS,
                   const float *dlse = nullptr) {
  const int64_t Tq = d.Tq, Tk = d.Tk, L = d.L();
  // dP = dout v^T, then dS = P * (dP - rowsum(P * dP)); masked entries have P = 0,
  // and the skipped blocks are zeroed so that the row sums may run over them.
  float *raw = d.softcap > 0.0f ? scores_scratch(Tq * Tk) : nullptr;
  for (int64_t qb = 0; qb < d.query_chunks(); ++qb)
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      float *blk = dS + qb * L * Tk + kb * L;
      if (!d.sees(qb, kb)) {
        for (int64_t t = 0; t < L; ++t) std::fill(blk + t * Tk, blk + t * Tk + L, 0.0f);
        continue;
      }
      gemm(false, true, L, L, d.D, 1.0f, dout + qb * L * d.ldq, d.ldq, v + kb * L * d.ldkv, d.ldkv, 0.0f, blk, Tk);
      if (raw)
        gemm(false, true, L, L, d.D, d.scale, q + qb * L * d.ldq, d.ldq, k + kb * L * d.ldkv, d.ldkv, 0.0f,
             raw + qb * L * Tk + kb * L, Tk);
    }
  for (int64_t t = 0; t < Tq; ++t) {
    const float *p = P + t * Tk;
    float *s = dS + t * Tk;
    const float dot = rows::row_dot(p, s, Tk) - (dlse ? dlse[t] : 0.0f);
    for (int64_t j = 0; j < Tk; ++j) s[j] = p[j] * (s[j] - dot);
    if (raw)
      for (int64_t j = 0; j < Tk; ++j) {
        if (p[j] == 0.0f) continue;  // masked or skipped: raw may be unset there
        const float th = math::tanh_fast(raw[t * Tk + j] / d.softcap);
        s[j] *= 1.0f - th * th;
      }
  }
  // dk and dv rows no query of this rank sees stay zero (first head of a group).
  if (beta == 0.0f)
    for (int64_t j = 0; j < Tk; ++j) {
      std::fill(dk + j * d.ldkv, dk + j * d.ldkv + d.D, 0.0f);
      std::fill(dv + j * d.ldkv, dv + j * d.ldkv + d.D, 0.0f);
    }
  for (int64_t qb = 0; qb < d.query_chunks(); ++qb) {
    float dq_beta = 0.0f;
    for (int64_t kb = 0; kb < Tk / L; ++kb) {
      if (!d.sees(qb, kb)) continue;
      const float *sb = dS + qb * L * Tk + kb * L, *pb = P + qb * L * Tk + kb * L;
      gemm(false, false, L, d.D, L, d.scale, sb, Tk, k + kb * L * d.ldkv, d.ldkv, dq_beta, dq + qb * L * d.ldq,
           d.ldq);
      dq_beta = 1.0f;
      gemm(true, false, L, d.D, L, d.scale, sb, Tk, q + qb * L * d.ldq, d.ldq, 1.0f, dk + kb * L * d.ldkv, d.ldkv);
      gemm(true, false, L, d.D, L, 1.0f, pb, Tk, dout + qb * L * d.ldq, d.ldq, 1.0f, dv + kb * L * d.ldkv, d.ldkv);
    }
    if (dq_beta == 0.0f)
      for (int64_t t = qb * L; t < (qb + 1) * L; ++t) std::fill(dq + t * d.ldq, dq + t * d.ldq + d.D, 0.0f);
  }
}

CpDims make_dims(int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                 int64_t window, float softcap, int64_t ranks, int64_t index, int64_t source = -1) {
  const int64_t Tk = index < 0 || source >= 0 ? Tq : ranks * Tq;
  CpDims d{B,      Tq,     Tk, Hq,    Hkv, D, Hq / Hkv, Hq * D, Hkv * D, scale, causal,
           causal && window > 0 ? window : 0, softcap > 0.0f ? softcap : 0.0f, ranks, index};
  d.source = source;
  return d;
}

// Key row j is row j % rows of rank j / rows (rows = 2L per rank), or with a
// source, row j of that rank.
std::vector<int64_t> key_positions(const CpDims &d) {
  const int64_t rows = 2 * d.L();
  std::vector<int64_t> kp(static_cast<size_t>(d.Tk));
  for (int64_t j = 0; j < d.Tk; ++j)
    kp[static_cast<size_t>(j)] = ctr_cp_position(j % rows, rows, d.ranks, d.source >= 0 ? d.source : j / rows);
  return kp;
}

int64_t pair_grain(const CpDims &d) {
  const double flops = 4.0 * d.Tq * d.Tk * d.D * d.group;
  return flops >= 2e5 ? 1 : std::max<int64_t>(1, static_cast<int64_t>(2e5 / flops));
}

// Every (batch, kv head) pair on the pool; a group's query heads in order on
// one thread, so that they add into their dk/dv block in a fixed order. lse and
// dlse may be null (cp_attention has no log-sum-exp output).
void run_forward(CpDims d, const float *q, const float *k, const float *v, float *out, float *lse, float *probs) {
  const std::vector<int64_t> kp = key_positions(d);
  d.kp = kp.data();
  ctr::parallel_for(d.B * d.Hkv, pair_grain(d), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.Tk * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.Tq * d.ldq + h * d.D, row = (b * d.Hq + h) * d.Tq;
        forward_head(d, q + q_off, k + kv_off, v + kv_off, out + q_off, probs + row * d.Tk,
                     lse ? lse + row : nullptr);
      }
    }
  });
}

void run_backward(CpDims d, const float *dout, const float *dlse, const float *q, const float *k, const float *v,
                  const float *probs, float *dq, float *dk, float *dv) {
  const std::vector<int64_t> kp = key_positions(d);
  d.kp = kp.data();
  ctr::parallel_for(d.B * d.Hkv, pair_grain(d), [&](int64_t p0, int64_t p1) {
    float *dS = scratch(d.Tq * d.Tk);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.Tk * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.Tq * d.ldq + h * d.D, row = (b * d.Hq + h) * d.Tq;
        backward_head(d, dout + q_off, q + q_off, k + kv_off, v + kv_off, probs + row * d.Tk, dq + q_off,
                      dk + kv_off, dv + kv_off, h == g * d.group ? 0.0f : 1.0f, dS, dlse ? dlse + row : nullptr);
      }
    }
  });
}

}  // namespace

void cp_attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs, int64_t B,
                      int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal, int64_t window,
                      float softcap, int64_t ranks, int64_t index) {
  run_forward(make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index), q, k, v, out, nullptr,
              probs);
}

void cp_attention_bwd(const float *dout, const float *q, const float *k, const float *v, const float *probs,
                      float *dq, float *dk, float *dv, int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D,
                      float scale, bool causal, int64_t window, float softcap, int64_t ranks, int64_t index) {
  run_backward(make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index), dout, nullptr, q, k, v,
               probs, dq, dk, dv);
}

void cp_attention_block_fwd(const float *q, const float *k, const float *v, float *out, float *lse, float *probs,
                            int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                            int64_t window, float softcap, int64_t ranks, int64_t index, int64_t source) {
  run_forward(make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index, source), q, k, v, out, lse,
              probs);
}

void cp_attention_block_bwd(const float *dout, const float *dlse, const float *q, const float *k, const float *v,
                            const float *probs, float *dq, float *dk, float *dv, int64_t B, int64_t Tq, int64_t Hq,
                            int64_t Hkv, int64_t D, float scale, bool causal, int64_t window, float softcap,
                            int64_t ranks, int64_t index, int64_t source) {
  run_backward(make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index, source), dout, dlse, q, k,
               v, probs, dq, dk, dv);
}

// Two partial attentions over disjoint key sets merged: out = wa oa + wb ob with
// wa = exp(la - lse), wb = exp(lb - lse), lse = log(exp la + exp lb); o* [B, T,
// H * D], l* [B, H, T]; rows where both are -inf stay 0 with lse -inf.
void attn_merge_fwd(const float *oa, const float *la, const float *ob, const float *lb, float *out, float *lse,
                    int64_t B, int64_t T, int64_t H, int64_t D) {
  ctr::parallel_for(B * H, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / H, h = p % H;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t li = p * T + t, oi = (b * T + t) * H * D + h * D;
        const float a = la[li], c = lb[li], m = std::max(a, c);
        if (m == -INFINITY) {
          lse[li] = -INFINITY;
          std::fill(out + oi, out + oi + D, 0.0f);
          continue;
        }
        const float ea = std::exp(a - m), ec = std::exp(c - m), sum = ea + ec;
        lse[li] = m + std::log(sum);
        const float wa = ea / sum, wb = ec / sum;
        for (int64_t e = 0; e < D; ++e) out[oi + e] = wa * oa[oi + e] + wb * ob[oi + e];
      }
    }
  });
}

// The gradients of attn_merge_fwd: doa = wa dout, dla = wa (<dout, oa - out> + dlse)
// (dlse nullable: 0), and likewise for b.
void attn_merge_bwd(const float *dout, const float *dlse, const float *oa, const float *la, const float *ob,
                    const float *lb, const float *out, const float *lse, float *doa, float *dla, float *dob,
                    float *dlb, int64_t B, int64_t T, int64_t H, int64_t D) {
  ctr::parallel_for(B * H, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / H, h = p % H;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t li = p * T + t, oi = (b * T + t) * H * D + h * D;
        const float l = lse[li];
        const float wa = l == -INFINITY ? 0.0f : std::exp(la[li] - l);
        const float wb = l == -INFINITY ? 0.0f : std::exp(lb[li] - l);
        float da = 0.0f, db = 0.0f;
        for (int64_t e = 0; e < D; ++e) {
          const float g = dout[oi + e];
          da += g * (oa[oi + e] - out[oi + e]);
          db += g * (ob[oi + e] - out[oi + e]);
          doa[oi + e] = wa * g;
          dob[oi + e] = wb * g;
        }
        const float dl = dlse ? dlse[li] : 0.0f;
        dla[li] = wa * (da + dl);
        dlb[li] = wb * (db + dl);
      }
    }
  });
}

}  // namespace ctr::cpu
