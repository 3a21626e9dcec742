// Multi-head attention with grouped-query heads, forward and backward.
//
// Each (batch, head) pair is a handful of GEMMs on strided views: query head h of
// batch b starts at q + b*T*Hq*D + h*D with row stride Hq*D (and likewise k, v,
// out), so OpenBLAS reads the [B,T,H*D] layout directly and nothing is transposed.
// The probabilities are materialised in probs[B,Hq,T,T], which backward needs anyway.
//
// Work is split over (batch, kv head) pairs rather than (batch, query head): the
// query heads of one group all add into the same dk/dv block, and giving the whole
// group to one thread keeps that accumulation free of races and in a fixed order.
// The products go through gemm(), which runs on the calling thread inside a
// parallel loop (see gemm.cc on why OpenBLAS itself is kept to one thread).
//
// With a causal mask, rows are processed in blocks of kBlock: block i only needs
// keys 0 .. end of block i, so the products skip the blocks above the diagonal
// (forward and backward), which cuts the GEMM work nearly in half for long
// sequences. The parallel loop's captures fit std::function's inline storage, so
// a call does not allocate.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/math.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "cpu/rows.h"

namespace ctr::cpu {
namespace {

using rows::row_max;
using rows::exp_sum;
using rows::row_dot;

// Rows per causal block: small enough to skip most of the masked triangle, large
// enough that each sgemm call still runs near full speed.
constexpr int64_t kBlock = 64;




// In-place softmax of the first n entries of a row; entries n .. end are zeroed.
void softmax_prefix(float *p, int64_t n, int64_t end) {
  const float inv = 1.0f / exp_sum(p, p, row_max(p, n), n);
  for (int64_t j = 0; j < n; ++j) p[j] *= inv;
  for (int64_t j = n; j < end; ++j) p[j] = 0.0f;
}

// Backward needs a T x T buffer per thread for dP; it grows once and is reused.
float *scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

struct Dims {
  int64_t B, T, Hq, Hkv, D, group;
  int64_t ldq, ldkv;  // row strides of q/out/dout and of k/v
  float scale;
  bool causal;
};

// One query head: probs and out for (b, h) reading kv head g.
void forward_head(const Dims &d, const float *q, const float *k, const float *v, float *out,
                  float *P) {
  const int64_t T = d.T, D = d.D;
  const int64_t blk = d.causal ? kBlock : T;
  for (int64_t r0 = 0; r0 < T; r0 += blk) {
    const int64_t r1 = std::min(T, r0 + blk);
    const int64_t cols = d.causal ? r1 : T;  // keys this row block can see
    gemm(false, true, r1 - r0, cols, D, d.scale, q + r0 * d.ldq, d.ldq, k, d.ldkv, 0.0f, P + r0 * T,
         T);
    for (int64_t t = r0; t < r1; ++t) softmax_prefix(P + t * T, d.causal ? t + 1 : T, T);
    gemm(false, false, r1 - r0, D, cols, 1.0f, P + r0 * T, T, v, d.ldkv, 0.0f, out + r0 * d.ldq,
         d.ldq);
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
    const int64_t cols = d.causal ? r1 : T;
    // dP = dout v^T, then dS = P * (dP - rowsum(P * dP)) in place.
    gemm(false, true, r1 - r0, cols, D, 1.0f, dout + r0 * d.ldq, d.ldq, v, d.ldkv, 0.0f,
         dS + r0 * T, T);
    for (int64_t t = r0; t < r1; ++t) {
      const int64_t n = d.causal ? t + 1 : T;
      const float *p = P + t * T;
      float *s = dS + t * T;
      const float dot = row_dot(p, s, n);
      for (int64_t j = 0; j < n; ++j) s[j] = p[j] * (s[j] - dot);
      for (int64_t j = n; j < cols; ++j) s[j] = 0.0f;
    }
    // dq rows of this block only see keys 0 .. cols.
    gemm(false, false, r1 - r0, D, cols, d.scale, dS + r0 * T, T, k, d.ldkv, 0.0f, dq + r0 * d.ldq,
         d.ldq);
  }
  // dk[c0:c1] and dv[c0:c1] gather from query rows t >= c0 only when causal, since
  // dS and P are zero above the diagonal. This runs after every row block of dS is done.
  for (int64_t c0 = 0; c0 < T; c0 += blk) {
    const int64_t c1 = std::min(T, c0 + blk);
    const int64_t t0 = d.causal ? c0 : 0;
    gemm(true, false, c1 - c0, D, T - t0, d.scale, dS + t0 * T + c0, T, q + t0 * d.ldq, d.ldq, beta,
         dk + c0 * d.ldkv, d.ldkv);
    gemm(true, false, c1 - c0, D, T - t0, 1.0f, P + t0 * T + c0, T, dout + t0 * d.ldq, d.ldq, beta,
         dv + c0 * d.ldkv, d.ldkv);
  }
}

Dims make_dims(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal) {
  return Dims{B, T, Hq, Hkv, D, Hq / Hkv, Hq * D, Hkv * D, scale, causal};
}

// One (batch, kv head) task costs about 4 T^2 D flops per query head; below a few
// hundred thousand the pool's wake-up costs more than it saves.
int64_t pair_grain(const Dims &d) {
  const double flops = 4.0 * d.T * d.T * d.D * d.group;
  return flops >= 2e5 ? 1 : std::max<int64_t>(1, static_cast<int64_t>(2e5 / flops));
}

}  // namespace

void attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs,
                   int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                   bool causal) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal);
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
                   int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal) {
  const Dims d = make_dims(B, T, Hq, Hkv, D, scale, causal);
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

}  // namespace ctr::cpu
