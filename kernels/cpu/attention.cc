// Multi-head attention with grouped-query heads, forward and backward.
//
// Each (batch, head) pair is a handful of GEMMs on strided views: query head h of
// batch b starts at q + b*T*Hq*D + h*D with row stride Hq*D (and likewise k, v,
// out), so the GEMM reads the [B,T,H*D] layout directly and nothing is transposed.
// The probabilities are materialised in probs[B,Hq,T,T], which backward needs anyway.
//
// Work is split over (batch, kv head) pairs rather than (batch, query head): the
// query heads of one group all add into the same dk/dv block, and giving the whole
// group to one thread keeps that accumulation free of races and in a fixed order.
// The products go through gemm(), which runs on the calling thread inside a
// parallel loop (see gemm.cc on why the GEMM engines are kept to one thread).
//
// With a causal mask, rows are processed in blocks of kBlock: block i only needs
// keys 0 .. end of block i, so the products skip the blocks above the diagonal
// (forward and backward), which cuts the GEMM work nearly in half for long
// sequences. With a sliding window (window W > 0, causal only: row t sees keys
// t - W < j <= t) a row block also skips the key blocks left of its first row's
// window, so the work grows as T * W rather than T^2. The parallel loop's captures
// fit std::function's inline storage, so a call does not allocate.
//
// Logit soft-capping (softcap c > 0, Gemma-2's) replaces each scaled score s by
// c * tanh(s / c) before the softmax; the backward multiplies the score gradient by
// 1 - tanh^2, recomputing the row block's scores (one more product) since the saved
// probabilities do not give them back.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/bf16_rows.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_max;
using rows::exp_sum;
using rows::row_dot;

// Rows per causal block: small enough to skip most of the masked triangle, large
// enough that each product still runs near full speed.
constexpr int64_t kBlock = 64;




// In-place softmax of entries lo .. hi of a row; the other entries up to end are zeroed.
void softmax_range(float *p, int64_t lo, int64_t hi, int64_t end) {
  const int64_t n = hi - lo;
  const float inv = 1.0f / exp_sum(p + lo, p + lo, row_max(p + lo, n), n);
  for (int64_t j = 0; j < lo; ++j) p[j] = 0.0f;
  for (int64_t j = lo; j < hi; ++j) p[j] *= inv;
  for (int64_t j = hi; j < end; ++j) p[j] = 0.0f;
}

// Backward needs a T x T buffer per thread for dP (and, with soft-capping, one of
// a row block's scores); each grows once and is reused.
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

struct Dims {
  int64_t B, T, Hq, Hkv, D, group;
  int64_t ldq, ldkv;  // row strides of q/out/dout and of k/v
  float scale;
  bool causal;
  int64_t window;  // 0: none
  float softcap;   // 0: none

  // The keys row t sees: [first(t), last(t)).
  int64_t first(int64_t t) const { return window > 0 ? std::max<int64_t>(0, t - window + 1) : 0; }
  int64_t last(int64_t t) const { return causal ? t + 1 : T; }
};

// One query head: probs and out for (b, h) reading kv head g.
void forward_head(const Dims &d, const float *q, const float *k, const float *v, float *out,
                  float *P) {
  const int64_t T = d.T, D = d.D;
  const int64_t blk = d.causal ? kBlock : T;
  for (int64_t r0 = 0; r0 < T; r0 += blk) {
    const int64_t r1 = std::min(T, r0 + blk);
    const int64_t c0 = d.first(r0), cols = d.causal ? r1 : T;  // keys this row block can see
    gemm(false, true, r1 - r0, cols - c0, D, d.scale, q + r0 * d.ldq, d.ldq, k + c0 * d.ldkv, d.ldkv,
         0.0f, P + r0 * T + c0, T);
    for (int64_t t = r0; t < r1; ++t) {
      float *p = P + t * T;
      if (d.softcap > 0.0f) {
        // (bounds and cap in locals: stores through p may not alias them, so the loop vectorises)
        const int64_t lo = d.first(t), hi = d.last(t);
        const float cap = d.softcap;
        for (int64_t j = lo; j < hi; ++j) p[j] = cap * math::tanh_fast(p[j] / cap);
      }
      softmax_range(p, d.first(t), d.last(t), T);
    }
    gemm(false, false, r1 - r0, D, cols - c0, 1.0f, P + r0 * T + c0, T, v + c0 * d.ldkv, d.ldkv, 0.0f,
         out + r0 * d.ldq, d.ldq);
  }
}

// One query head's contribution to dq (overwritten) and dk, dv (beta 0: overwrite,
// 1: add the group's earlier heads).
void backward_head(const Dims &d, const float *dout, const float *q, const float *k, const float *v,
                   const float *P, float *dq, float *dk, float *dv, float beta, float *dS) {
  const int64_t T = d.T, D = d.D;
  const int64_t blk = d.causal ? kBlock : T;
  for (int64_t r0 = 0; r0 < T; r0 += blk) {
    const int64_t r1 = std::min(T, r0 + blk);
    const int64_t c0 = d.first(r0), cols = d.causal ? r1 : T;
    // dP = dout v^T, then dS = P * (dP - rowsum(P * dP)) in place.
    gemm(false, true, r1 - r0, cols - c0, D, 1.0f, dout + r0 * d.ldq, d.ldq, v + c0 * d.ldkv, d.ldkv,
         0.0f, dS + r0 * T + c0, T);
    float *raw = nullptr;  // the block's scaled scores before capping, [r1 - r0, T]
    if (d.softcap > 0.0f) {
      raw = scores_scratch((r1 - r0) * T);
      gemm(false, true, r1 - r0, cols - c0, D, d.scale, q + r0 * d.ldq, d.ldq, k + c0 * d.ldkv, d.ldkv, 0.0f,
           raw + c0, T);
    }
    for (int64_t t = r0; t < r1; ++t) {
      const int64_t lo = d.first(t), hi = d.last(t);
      const float *p = P + t * T;
      float *s = dS + t * T;
      const float dot = row_dot(p + lo, s + lo, hi - lo);
      // Zero outside the row's keys, also left of the block's first key: the dk and
      // dv gathers below read whole columns of dS.
      for (int64_t j = 0; j < lo; ++j) s[j] = 0.0f;
      for (int64_t j = lo; j < hi; ++j) s[j] = p[j] * (s[j] - dot);
      if (raw)
        for (int64_t j = lo; j < hi; ++j) {
          const float th = math::tanh_fast(raw[(t - r0) * T + j] / d.softcap);
          s[j] *= 1.0f - th * th;
        }
      for (int64_t j = hi; j < cols; ++j) s[j] = 0.0f;
    }
    // dq rows of this block only see keys c0 .. cols.
    gemm(false, false, r1 - r0, D, cols - c0, d.scale, dS + r0 * T + c0, T, k + c0 * d.ldkv, d.ldkv,
         0.0f, dq + r0 * d.ldq, d.ldq);
  }
  // dk[c0:c1] and dv[c0:c1] gather from query rows t >= c0 only when causal, since
  // dS and P are zero above the diagonal, and with a window from rows t < c1 + W - 1
  // only. This runs after every row block of dS is done.
  for (int64_t c0 = 0; c0 < T; c0 += blk) {
    const int64_t c1 = std::min(T, c0 + blk);
    const int64_t t0 = d.causal ? c0 : 0;
    const int64_t t1 = d.window > 0 ? std::min(T, c1 + d.window - 1) : T;
    gemm(true, false, c1 - c0, D, t1 - t0, d.scale, dS + t0 * T + c0, T, q + t0 * d.ldq, d.ldq, beta,
         dk + c0 * d.ldkv, d.ldkv);
    gemm(true, false, c1 - c0, D, t1 - t0, 1.0f, P + t0 * T + c0, T, dout + t0 * d.ldq, d.ldq, beta,
         dv + c0 * d.ldkv, d.ldkv);
  }
}

Dims make_dims(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
               int64_t window, float softcap) {
  return Dims{B,     T,      Hq, Hkv, D, Hq / Hkv, Hq * D, Hkv * D, scale, causal, causal && window > 0 ? window : 0,
              softcap > 0.0f ? softcap : 0.0f};
}

// One (batch, kv head) task costs about 4 T^2 D flops per query head; below a few
// hundred thousand the pool's wake-up costs more than it saves.
int64_t pair_grain(const Dims &d) {
  const double flops = 4.0 * d.T * d.T * d.D * d.group;
  return flops >= 2e5 ? 1 : std::max<int64_t>(1, static_cast<int64_t>(2e5 / flops));
}

// bf16 storage: one head's [T, D] rows (row stride ld) widened into a
// contiguous f32 block, or a block rounded back into them.
void widen_head(const uint16_t *x, int64_t ld, int64_t T, int64_t D, float *out) {
  for (int64_t t = 0; t < T; ++t) row_f32(x + t * ld, D, out + t * D);
}
void narrow_head(const float *x, uint16_t *out, int64_t ld, int64_t T, int64_t D) {
  for (int64_t t = 0; t < T; ++t) store_row(x + t * D, out + t * ld, D);
}
float *head_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

}  // namespace

void attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs,
                   int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                   bool causal, int64_t window, float softcap) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal, window, softcap);
  struct Args {
    const float *q, *k, *v;
    float *out, *probs;
  } a{q, k, v, out, probs};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &a](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.T * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.T * d.ldq + h * d.D;
        forward_head(d, a.q + q_off, a.k + kv_off, a.v + kv_off, a.out + q_off,
                     a.probs + (b * d.Hq + h) * d.T * d.T);
      }
    }
  });
}

void attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                   const float *probs, float *dq, float *dk, float *dv, int64_t B, int64_t T,
                   int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                   int64_t window, float softcap) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal, window, softcap);
  struct Args {
    const float *dout, *q, *k, *v, *probs;
    float *dq, *dk, *dv;
  } a{dout, q, k, v, probs, dq, dk, dv};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &a](int64_t p0, int64_t p1) {
    float *dS = scratch(d.T * d.T);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.T * d.ldkv + g * d.D;
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.T * d.ldq + h * d.D;
        backward_head(d, a.dout + q_off, a.q + q_off, a.k + kv_off, a.v + kv_off,
                      a.probs + (b * d.Hq + h) * d.T * d.T, a.dq + q_off, a.dk + kv_off,
                      a.dv + kv_off, h == g * d.group ? 0.0f : 1.0f, dS);
      }
    }
  });
}

// bf16 storage of q, k, v, out, dout, dq, dk and dv (the probabilities f32):
// each (batch, kv head) pair's rows widened into contiguous f32 blocks of the
// calling thread, computed by the same per-head code, and the outputs rounded
// once (dk and dv after the whole group): no whole-tensor f32 copies through
// memory. The GEMMs read the blocks with a row stride of D rather than H * D,
// and the GEMM library may block such a product differently: the f32 results
// can differ from the strided kernel's in the last bit (the unit test bounds
// it: probabilities within 1e-6, outputs within one bf16 step).
void attention_fwd_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, float *probs,
                        int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                        int64_t window, float softcap) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal, window, softcap);
  Dims hd = d;  // on the contiguous blocks
  hd.ldq = hd.ldkv = D;
  struct Args {
    const uint16_t *q, *k, *v;
    uint16_t *out;
    float *probs;
  } a{q, k, v, out, probs};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &hd, &a](int64_t p0, int64_t p1) {
    const int64_t n = d.T * d.D;
    float *kb = head_scratch(4 * n), *vb = kb + n, *qb = vb + n, *ob = qb + n;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.T * d.ldkv + g * d.D;
      widen_head(a.k + kv_off, d.ldkv, d.T, d.D, kb);
      widen_head(a.v + kv_off, d.ldkv, d.T, d.D, vb);
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.T * d.ldq + h * d.D;
        widen_head(a.q + q_off, d.ldq, d.T, d.D, qb);
        forward_head(hd, qb, kb, vb, ob, a.probs + (b * d.Hq + h) * d.T * d.T);
        narrow_head(ob, a.out + q_off, d.ldq, d.T, d.D);
      }
    }
  });
}

void attention_bwd_bf16(const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                        const float *probs, uint16_t *dq, uint16_t *dk, uint16_t *dv, int64_t B, int64_t T,
                        int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal, int64_t window,
                        float softcap) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal, window, softcap);
  Dims hd = d;
  hd.ldq = hd.ldkv = D;
  struct Args {
    const uint16_t *dout, *q, *k, *v;
    const float *probs;
    uint16_t *dq, *dk, *dv;
  } a{dout, q, k, v, probs, dq, dk, dv};
  ctr::parallel_for(B * Hkv, pair_grain(d), [&d, &hd, &a](int64_t p0, int64_t p1) {
    float *dS = scratch(d.T * d.T);
    const int64_t n = d.T * d.D;
    float *kb = head_scratch(7 * n), *vb = kb + n, *qb = vb + n, *gb = qb + n, *dqb = gb + n, *dkb = dqb + n,
          *dvb = dkb + n;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / d.Hkv, g = p % d.Hkv;
      const int64_t kv_off = b * d.T * d.ldkv + g * d.D;
      widen_head(a.k + kv_off, d.ldkv, d.T, d.D, kb);
      widen_head(a.v + kv_off, d.ldkv, d.T, d.D, vb);
      for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
        const int64_t q_off = b * d.T * d.ldq + h * d.D;
        widen_head(a.q + q_off, d.ldq, d.T, d.D, qb);
        widen_head(a.dout + q_off, d.ldq, d.T, d.D, gb);
        backward_head(hd, gb, qb, kb, vb, a.probs + (b * d.Hq + h) * d.T * d.T, dqb, dkb, dvb,
                      h == g * d.group ? 0.0f : 1.0f, dS);
        narrow_head(dqb, a.dq + q_off, d.ldq, d.T, d.D);
      }
      narrow_head(dkb, a.dk + kv_off, d.ldkv, d.T, d.D);
      narrow_head(dvb, a.dv + kv_off, d.ldkv, d.T, d.D);
    }
  });
}

}  // namespace ctr::cpu
