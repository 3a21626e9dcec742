// Context-parallel attention, forward and backward: this rank's query rows (two
// chunks of the sequence, see ctr_cp_position) against every rank's keys and
// values, gathered over the cp axis in rank order.
//
// The keys a query row sees are not a contiguous range of the gathered rows (the
// chunks of each rank are mirrored), so the mask is applied by comparing global
// positions, once per entry, and the products run over whole [Tq, Tk] blocks:
// simpler than the blocked single-rank kernel, and the masked entries are
// exactly zero in probs, so backward needs no mask of its own. Work is split over
// (batch, kv head) pairs as in attention.cc, so that a group's query heads add
// into their dk/dv block in a fixed order on one thread.

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
  int64_t ranks, index;

  int64_t qpos(int64_t t) const { return ctr_cp_position(t, Tq, ranks, index); }
  int64_t kpos(int64_t j) const { return ctr_cp_position(j % Tq, Tq, ranks, j / Tq); }
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

void forward_head(const CpDims &d, const float *q, const float *k, const float *v, float *out, float *P) {
  const int64_t Tq = d.Tq, Tk = d.Tk;
  gemm(false, true, Tq, Tk, d.D, d.scale, q, d.ldq, k, d.ldkv, 0.0f, P, Tk);
  for (int64_t t = 0; t < Tq; ++t) {
    float *p = P + t * Tk;
    const int64_t qp = d.qpos(t);
    float m = -INFINITY;
    for (int64_t j = 0; j < Tk; ++j) {
      if (!d.visible(qp, d.kpos(j))) continue;
      if (d.softcap > 0.0f) p[j] = d.softcap * std::tanh(p[j] / d.softcap);
      m = std::max(m, p[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < Tk; ++j) {
      if (!d.visible(qp, d.kpos(j))) {
        p[j] = 0.0f;
        continue;
      }
      p[j] = math::exp_fast(p[j] - m);
      sum += p[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < Tk; ++j) p[j] *= inv;
  }
  gemm(false, false, Tq, d.D, Tk, 1.0f, P, Tk, v, d.ldkv, 0.0f, out, d.ldq);
}

void backward_head(const CpDims &d, const float *dout, const float *q, const float *k, const float *v,
                   const float *P, float *dq, float *dk, float *dv, float beta, float *dS) {
  const int64_t Tq = d.Tq, Tk = d.Tk;
  // dP = dout v^T, then dS = P * (dP - rowsum(P * dP)); masked entries have P = 0.
  gemm(false, true, Tq, Tk, d.D, 1.0f, dout, d.ldq, v, d.ldkv, 0.0f, dS, Tk);
  float *raw = nullptr;
  if (d.softcap > 0.0f) {
    raw = scores_scratch(Tq * Tk);
    gemm(false, true, Tq, Tk, d.D, d.scale, q, d.ldq, k, d.ldkv, 0.0f, raw, Tk);
  }
  for (int64_t t = 0; t < Tq; ++t) {
    const float *p = P + t * Tk;
    float *s = dS + t * Tk;
    const float dot = rows::row_dot(p, s, Tk);
    for (int64_t j = 0; j < Tk; ++j) s[j] = p[j] * (s[j] - dot);
    if (raw)
      for (int64_t j = 0; j < Tk; ++j) {
        const float th = std::tanh(raw[t * Tk + j] / d.softcap);
        s[j] *= 1.0f - th * th;
      }
  }
  gemm(false, false, Tq, d.D, Tk, d.scale, dS, Tk, k, d.ldkv, 0.0f, dq, d.ldq);
  gemm(true, false, Tk, d.D, Tq, d.scale, dS, Tk, q, d.ldq, beta, dk, d.ldkv);
  gemm(true, false, Tk, d.D, Tq, 1.0f, P, Tk, dout, d.ldq, beta, dv, d.ldkv);
}

CpDims make_dims(int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                 int64_t window, float softcap, int64_t ranks, int64_t index) {
  return CpDims{B,      Tq,     ranks * Tq, Hq,    Hkv, D, Hq / Hkv, Hq * D, Hkv * D, scale, causal,
                causal && window > 0 ? window : 0, softcap > 0.0f ? softcap : 0.0f, ranks, index};
}

int64_t pair_grain(const CpDims &d) {
  const double flops = 4.0 * d.Tq * d.Tk * d.D * d.group;
  return flops >= 2e5 ? 1 : std::max<int64_t>(1, static_cast<int64_t>(2e5 / flops));
}

}  // namespace

void cp_attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs, int64_t B,
                      int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal, int64_t window,
                      float softcap, int64_t ranks, int64_t index) {
  const CpDims d = make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index);
  struct Args {
    const float *q, *k, *v;
    float *out, *probs;
  } a{q, k, v, out, probs};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &a](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.Tk * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.Tq * d.ldq + h * d.D;
        forward_head(d, a.q + q_off, a.k + kv_off, a.v + kv_off, a.out + q_off,
                     a.probs + (b * d.Hq + h) * d.Tq * d.Tk);
      }
    }
  });
}

void cp_attention_bwd(const float *dout, const float *q, const float *k, const float *v, const float *probs,
                      float *dq, float *dk, float *dv, int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D,
                      float scale, bool causal, int64_t window, float softcap, int64_t ranks, int64_t index) {
  const CpDims d = make_dims(B, Tq, Hq, Hkv, D, scale, causal, window, softcap, ranks, index);
  struct Args {
    const float *dout, *q, *k, *v, *probs;
    float *dq, *dk, *dv;
  } a{dout, q, k, v, probs, dq, dk, dv};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &a](int64_t p0, int64_t p1) {
    float *dS = scratch(d.Tq * d.Tk);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.Tk * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.Tq * d.ldq + h * d.D;
        backward_head(d, a.dout + q_off, a.q + q_off, a.k + kv_off, a.v + kv_off,
                      a.probs + (b * d.Hq + h) * d.Tq * d.Tk, a.dq + q_off, a.dk + kv_off, a.dv + kv_off,
                      h == g * d.group ? 0.0f : 1.0f, dS);
      }
    }
  });
}

}  // namespace ctr::cpu
