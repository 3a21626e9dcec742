// Multi-head attention with grouped-query heads on the GPU, forward and
// backward, without materialising the T x T matrix (flash style), and without
// atomics, so every result is deterministic.
//
// Layout as on the CPU: q, out, dout [B, T, Hq*D], k, v [B, T, Hkv*D]; query
// head h reads kv head h / (Hq / Hkv). The op's saved output "probs"
// [B, Hq, T, T] is this backend's own state: the forward writes the row's
// log-sum-exp (f32) into its first B*Hq*T floats and the backward reads it back.
// With T == 1 nothing is written (a bf16 buffer would be too small) and the
// backward uses the fact that a softmax over one key is 1.
//
// Every kernel has the same shape. A block owns 32 rows (8 warps of 4) of one
// (batch, head) and walks the other side's rows in tiles of 32 staged in shared
// memory as f32. In a tile, lane j computes the dot products of key (or query)
// j with the warp's rows, reading its own row of the tile (padded pitch, so the
// lanes hit distinct banks) and the warp's rows by broadcast; the outputs are
// then accumulated with lane l owning dims l, l + 32, ... and the tile's
// weights broadcast by shuffles. Head dims up to 256 are template sizes
// (32, 64, 128, 256) so the accumulators stay in registers.
//
// Forward: online softmax per query row (running max and sum, the accumulator
// rescaled when the max grows); out = acc / sum, lse = max + log(sum).
//
// Backward, three kernels in stream order:
//  1. delta: D_i = sum_j P_ij dP_ij (dP = dout v^T), per query row, recomputing
//     P from q, k and the saved lse. D_i is parked in dq's own row segment for
//     (b, i, h) (its first 4 bytes, as raw bits): dq is written only in step 3.
//  2. dk, dv per key row of a kv head, summing over the query rows of every
//     query head of its group: dv_j = sum_i P_ij dout_i, dk_j = scale *
//     sum_i dS_ij q_i with dS = P * (dP - D_i).
//  3. dq per query row: it reads its D_i back from its own segment, then
//     dq_i = scale * sum_j dS_ij k_j overwrites the segment.
// Each output row has one owner that adds in a fixed order.
// A sliding window (attribute window) masks the keys before it in every kernel,
// as the causal mask masks those after the query; the tiles it leaves empty are
// still walked (the CPU kernels skip them). Logit soft-capping (attribute
// softcap) caps each scaled score where it is computed, and the score gradients
// take the cap's slope 1 - tanh^2.
// Head dims above 256 (or a device whose shared memory per block is too small
// for the 256 tiles) take the same kernels with every operand read from global
// memory instead of shared memory and the accumulated dims processed in windows
// of 256 (each window recomputes the dot products): slower, same math.
//
// Both directions are first offered to the stream's library attention
// (cuDNN's fused SDPA, lib/backend/cuda/cudnn_sdpa.cu), which keeps the same
// lse, so either backward serves either forward.

#include <algorithm>

#include "common/math.h"
#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

constexpr int kWarps = 8, kRowsPerWarp = 4, kRows = kWarps * kRowsPerWarp, kTile = 32;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFull = 0xffffffffu;

struct Dims {
  int64_t B, T, Hq, Hkv, D, group;
  int64_t ldq, ldkv;  // row strides of q/out/dout and of k/v
  float scale;
  bool causal;
  int64_t window;  // > 0 (causal only): query i sees keys i - window < j <= i
  float softcap;   // > 0: scaled scores capped to softcap * tanh(s / softcap)
  bool have_lse;  // T > 1: the lse was written (see the file comment)
};

Dims make_dims(const Args &c, int q_input) {
  const auto &p = c.params<ctr_attention_params>();
  Dims d{};
  d.B = c.in_dim(q_input, 0);
  d.T = c.in_dim(q_input, 1);
  d.Hq = p.heads;
  d.Hkv = p.kv_heads;
  d.D = c.in_dim(q_input, 2) / d.Hq;
  d.group = d.Hq / d.Hkv;
  d.ldq = d.Hq * d.D;
  d.ldkv = d.Hkv * d.D;
  d.scale = p.scale;
  d.causal = p.causal != 0;
  d.window = d.causal ? p.window : 0;
  d.softcap = p.softcap > 0.0f ? p.softcap : 0.0f;
  d.have_lse = d.T > 1;
  return d;
}

// ---------------------------------------------------------------------------
// Operand views: a tile of 32 rows staged in shared memory as f32 (Staged),
// or read in place from global memory (Direct, for head dims above 256).

// Shared-memory tile of 32 rows at pitch P floats.
struct Staged {
  float *s;
  int P;
  __device__ float at(int r, int64_t d) const { return s[r * P + d]; }
};

// Copies rows [r0, r0 + 32) of a strided [rows, D] view into a staged tile
// (zeros past the last row and past D, so masked products are exact zeros).
template <typename T>
__device__ void stage(float *dst, int P, int width, const T *src, int64_t ld, int64_t r0, int64_t rows, int64_t D) {
  for (int e = threadIdx.x; e < kTile * width; e += blockDim.x) {
    const int r = e / width, dd = e - r * width;
    const int64_t i = r0 + r;
    dst[r * P + dd] = (i < rows && dd < D) ? load(src, i * ld + dd) : 0.0f;
  }
}

// Global-memory view of rows [r0, r0 + 32) of a strided [rows, D] view.
template <typename T>
struct Direct {
  const T *p;
  int64_t ld, r0, rows;
  __device__ float at(int r, int64_t d) const { return r0 + r < rows ? load(p, (r0 + r) * ld + d) : 0.0f; }
};

// The stored D_i of a query row, in the first bytes of its dq segment: raw f32
// bits (two bf16 slots when dq is bf16; a rounded bf16 when the segment has one).
__device__ __forceinline__ void put_delta(float *seg, int64_t, float v) { seg[0] = v; }
__device__ __forceinline__ void put_delta(__nv_bfloat16 *seg, int64_t D, float v) {
  if (D >= 2) {
    const unsigned bits = __float_as_uint(v);
    unsigned short *h = reinterpret_cast<unsigned short *>(seg);
    h[0] = static_cast<unsigned short>(bits & 0xffffu);
    h[1] = static_cast<unsigned short>(bits >> 16);
  } else {
    seg[0] = __float2bfloat16_rn(v);
  }
}
__device__ __forceinline__ float get_delta(const float *seg, int64_t) { return seg[0]; }
__device__ __forceinline__ float get_delta(const __nv_bfloat16 *seg, int64_t D) {
  if (D >= 2) {
    const unsigned short *h = reinterpret_cast<const unsigned short *>(seg);
    return __uint_as_float(static_cast<unsigned>(h[0]) | (static_cast<unsigned>(h[1]) << 16));
  }
  return __bfloat162float(seg[0]);
}

// Whether query i sees key j: inside the sequence, not after i when causal, and
// within the sliding window when there is one. Every kernel masks through this, so
// the window is honoured throughout (the key tiles left of a window are still
// visited, their scores masked).
__device__ __forceinline__ bool visible(int64_t i, int64_t j, const Dims &d) {
  return j < d.T && (!d.causal || (j <= i && (d.window <= 0 || i - j < d.window)));
}

// The logit of an unscaled dot: scaled, and soft-capped when the op caps.
__device__ __forceinline__ float logit(float dot, const Dims &d) {
  const float s = dot * d.scale;
  return d.softcap > 0.0f ? d.softcap * tanhf(s / d.softcap) : s;
}

// The derivative of the cap at an unscaled dot (1 without one): 1 - tanh^2.
__device__ __forceinline__ float cap_slope(float dot, const Dims &d) {
  if (d.softcap <= 0.0f) return 1.0f;
  const float th = tanhf(dot * d.scale / d.softcap);
  return 1.0f - th * th;
}

// Softmax weight of one (query, key) score s (unscaled dot) given the row's lse.
__device__ __forceinline__ float prob(float dot, float lse, bool ok, const Dims &d) {
  if (!ok) return 0.0f;
  return d.have_lse ? math::exp_fast(logit(dot, d) - lse) : 1.0f;
}

// Work items: (batch, head, 32-row tile), tiles fastest. With a causal mask
// the last query tiles see the most keys; `last_first` hands them out first so
// the long items do not all start at the end of the grid.
struct Item {
  int64_t b, h, r0;
};
__device__ __forceinline__ Item item_of(int64_t it, int64_t heads, int64_t T, bool last_first) {
  const int64_t tiles = (T + kRows - 1) / kRows;
  const int64_t bh = it / tiles, t = it % tiles;
  return Item{bh / heads, bh % heads, (last_first ? tiles - 1 - t : t) * kRows};
}

// ---------------------------------------------------------------------------
// Forward. Staged: Q rows [32][DM], K tile [32][DM + 1], V tile [32][DM].
// Accumulated dims [w0, w0 + DM) (w0 > 0 only with Direct operands).

template <typename T, int DM, bool Stage>
__global__ void __launch_bounds__(kThreads) attn_fwd_kernel(const T *q, const T *k, const T *v, T *out, float *lse,
                                                             Dims d, int64_t w0) {
  CTR_DYNAMIC_SHARED(float, sm);
  constexpr int NC = DM / 32, P = DM + 1;
  float *Qs = sm, *Ks = Qs + kRows * DM, *Vs = Ks + kTile * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t items = (d.T + kRows - 1) / kRows * d.B * d.Hq;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const Item w = item_of(it, d.Hq, d.T, d.causal);
    const int64_t g = w.h / d.group;
    const T *qb = q + w.b * d.T * d.ldq + w.h * d.D;
    const T *kb = k + w.b * d.T * d.ldkv + g * d.D, *vb = v + w.b * d.T * d.ldkv + g * d.D;
    const int64_t rbase = w.r0 + warp * kRowsPerWarp;  // this warp's first query row
    if constexpr (Stage) {
      __syncthreads();  // the previous item is done with the shared tiles
      stage(Qs, DM, DM, qb, d.ldq, w.r0, d.T, d.D);
    }
    const Direct<T> qd{qb, d.ldq, rbase, d.T};
    float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][NC];
    for (int r = 0; r < kRowsPerWarp; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.0f;
      for (int c = 0; c < NC; ++c) acc[r][c] = 0.0f;
    }
    const int64_t kend = d.causal ? (w.r0 + kRows < d.T ? w.r0 + kRows : d.T) : d.T;
    for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
      if constexpr (Stage) {
        __syncthreads();
        stage(Ks, P, DM, kb, d.ldkv, j0, d.T, d.D);
        stage(Vs, DM, DM, vb, d.ldkv, j0, d.T, d.D);
        __syncthreads();
      }
      const Staged ks{Ks, P}, vs{Vs, DM}, qs{Qs + warp * kRowsPerWarp * DM, DM};
      const Direct<T> kd{kb, d.ldkv, j0, d.T}, vd{vb, d.ldkv, j0, d.T};
      float s[kRowsPerWarp] = {};
      for (int64_t dd = 0; dd < d.D; ++dd) {
        const float kv = Stage ? ks.at(lane, dd) : kd.at(lane, dd);
        for (int r = 0; r < kRowsPerWarp; ++r) s[r] += (Stage ? qs.at(r, dd) : qd.at(r, dd)) * kv;
      }
      const int64_t j = j0 + lane;
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const bool ok = visible(rbase + r, j, d);
        const float sv = ok ? logit(s[r], d) : -INFINITY;
        const float mn = fmaxf(m[r], warp_max(sv));
        const float p = ok ? math::exp_fast(sv - mn) : 0.0f;
        const float corr = m[r] == -INFINITY ? 0.0f : math::exp_fast(m[r] - mn);
        l[r] = l[r] * corr + warp_sum(p);
        m[r] = mn;
        for (int c = 0; c < NC; ++c) acc[r][c] *= corr;
        s[r] = p;
      }
      for (int jj = 0; jj < kTile; ++jj) {
        float pj[kRowsPerWarp];
        for (int r = 0; r < kRowsPerWarp; ++r) pj[r] = __shfl_sync(kFull, s[r], jj);
        for (int c = 0; c < NC; ++c) {
          const int64_t dd = w0 + lane + 32 * c;
          if (!Stage && dd >= d.D) continue;
          const float vv = Stage ? vs.at(jj, dd) : vd.at(jj, dd);
          for (int r = 0; r < kRowsPerWarp; ++r) acc[r][c] += pj[r] * vv;
        }
      }
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t i = rbase + r;
      if (i >= d.T) continue;
      const float inv = 1.0f / l[r];
      T *o = out + w.b * d.T * d.ldq + i * d.ldq + w.h * d.D;
      for (int c = 0; c < NC; ++c) {
        const int64_t dd = w0 + lane + 32 * c;
        if (dd < d.D) store(o, dd, acc[r][c] * inv);
      }
      if (lane == 0 && w0 == 0 && d.have_lse) lse[(w.b * d.Hq + w.h) * d.T + i] = m[r] + logf(l[r]);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward 1: D_i = sum_j P_ij (dout_i . v_j), parked in dq's segment.
// Staged: Q, dO rows [32][DM]; K, V tiles [32][DM + 1].

template <typename T, int DM, bool Stage>
__global__ void __launch_bounds__(kThreads) attn_delta_kernel(const T *dout, const T *q, const T *k, const T *v,
                                                               const float *lse, T *dq, Dims d) {
  CTR_DYNAMIC_SHARED(float, sm);
  constexpr int P = DM + 1;
  float *Qs = sm, *Gs = Qs + kRows * DM, *Ks = Gs + kRows * DM, *Vs = Ks + kTile * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t items = (d.T + kRows - 1) / kRows * d.B * d.Hq;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const Item w = item_of(it, d.Hq, d.T, d.causal);
    const int64_t g = w.h / d.group;
    const T *qb = q + w.b * d.T * d.ldq + w.h * d.D, *gb = dout + w.b * d.T * d.ldq + w.h * d.D;
    const T *kb = k + w.b * d.T * d.ldkv + g * d.D, *vb = v + w.b * d.T * d.ldkv + g * d.D;
    const int64_t rbase = w.r0 + warp * kRowsPerWarp;
    if constexpr (Stage) {
      __syncthreads();
      stage(Qs, DM, DM, qb, d.ldq, w.r0, d.T, d.D);
      stage(Gs, DM, DM, gb, d.ldq, w.r0, d.T, d.D);
    }
    const Direct<T> qd{qb, d.ldq, rbase, d.T}, gd{gb, d.ldq, rbase, d.T};
    float L[kRowsPerWarp], acc[kRowsPerWarp] = {};
    for (int r = 0; r < kRowsPerWarp; ++r)
      L[r] = d.have_lse && rbase + r < d.T ? lse[(w.b * d.Hq + w.h) * d.T + rbase + r] : 0.0f;
    const int64_t kend = d.causal ? (w.r0 + kRows < d.T ? w.r0 + kRows : d.T) : d.T;
    for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
      if constexpr (Stage) {
        __syncthreads();
        stage(Ks, P, DM, kb, d.ldkv, j0, d.T, d.D);
        stage(Vs, P, DM, vb, d.ldkv, j0, d.T, d.D);
        __syncthreads();
      }
      const Staged ks{Ks, P}, vs{Vs, P}, qs{Qs + warp * kRowsPerWarp * DM, DM}, gs{Gs + warp * kRowsPerWarp * DM, DM};
      const Direct<T> kd{kb, d.ldkv, j0, d.T}, vd{vb, d.ldkv, j0, d.T};
      float s[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
      for (int64_t dd = 0; dd < d.D; ++dd) {
        const float kv = Stage ? ks.at(lane, dd) : kd.at(lane, dd);
        const float vv = Stage ? vs.at(lane, dd) : vd.at(lane, dd);
        for (int r = 0; r < kRowsPerWarp; ++r) {
          s[r] += (Stage ? qs.at(r, dd) : qd.at(r, dd)) * kv;
          dp[r] += (Stage ? gs.at(r, dd) : gd.at(r, dd)) * vv;
        }
      }
      const int64_t j = j0 + lane;
      for (int r = 0; r < kRowsPerWarp; ++r)
        acc[r] += prob(s[r], L[r], visible(rbase + r, j, d), d) * dp[r];
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float delta = warp_sum(acc[r]);
      const int64_t i = rbase + r;
      if (lane == 0 && i < d.T) put_delta(dq + w.b * d.T * d.ldq + i * d.ldq + w.h * d.D, d.D, delta);
    }
  }
}

// ---------------------------------------------------------------------------
// Backward 2: dk, dv per key row of kv head g over the query rows of its
// group's heads. Staged: K, V rows [32][DM]; Q, dO tiles [32][DM + 1].
// Accumulated dims [w0, w0 + DM).

template <typename T, int DM, bool Stage>
__global__ void __launch_bounds__(kThreads) attn_dkv_kernel(const T *dout, const T *q, const T *k, const T *v,
                                                             const float *lse, const T *dq, T *dk, T *dv, Dims d,
                                                             int64_t w0) {
  CTR_DYNAMIC_SHARED(float, sm);
  constexpr int NC = DM / 32, P = DM + 1;
  float *Ks = sm, *Vs = Ks + kRows * DM, *Qs = Vs + kRows * DM, *Gs = Qs + kTile * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t items = (d.T + kRows - 1) / kRows * d.B * d.Hkv;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const Item w = item_of(it, d.Hkv, d.T, false);  // w.h: the kv head; first key tiles are the long ones
    const T *kb = k + w.b * d.T * d.ldkv + w.h * d.D, *vb = v + w.b * d.T * d.ldkv + w.h * d.D;
    const int64_t rbase = w.r0 + warp * kRowsPerWarp;  // this warp's first key row
    if constexpr (Stage) {
      __syncthreads();
      stage(Ks, DM, DM, kb, d.ldkv, w.r0, d.T, d.D);
      stage(Vs, DM, DM, vb, d.ldkv, w.r0, d.T, d.D);
    }
    const Direct<T> kd{kb, d.ldkv, rbase, d.T}, vd{vb, d.ldkv, rbase, d.T};
    float ak[kRowsPerWarp][NC] = {}, av[kRowsPerWarp][NC] = {};
    for (int64_t h = w.h * d.group; h < (w.h + 1) * d.group; ++h) {
      const T *qb = q + w.b * d.T * d.ldq + h * d.D, *gb = dout + w.b * d.T * d.ldq + h * d.D;
      // Causal: query rows before this block's first key see none of its keys.
      for (int64_t i0 = d.causal ? w.r0 : 0; i0 < d.T; i0 += kTile) {
        if constexpr (Stage) {
          __syncthreads();
          stage(Qs, P, DM, qb, d.ldq, i0, d.T, d.D);
          stage(Gs, P, DM, gb, d.ldq, i0, d.T, d.D);
          __syncthreads();
        }
        const Staged qs{Qs, P}, gs{Gs, P}, ks{Ks + warp * kRowsPerWarp * DM, DM}, vs{Vs + warp * kRowsPerWarp * DM, DM};
        const Direct<T> qd{qb, d.ldq, i0, d.T}, gd{gb, d.ldq, i0, d.T};
        const int64_t i = i0 + lane;  // this lane's query row
        float L = 0.0f, delta = 0.0f;
        if (i < d.T) {
          if (d.have_lse) L = lse[(w.b * d.Hq + h) * d.T + i];
          delta = get_delta(dq + w.b * d.T * d.ldq + i * d.ldq + h * d.D, d.D);
        }
        float s[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
        for (int64_t dd = 0; dd < d.D; ++dd) {
          const float qv = Stage ? qs.at(lane, dd) : qd.at(lane, dd);
          const float gv = Stage ? gs.at(lane, dd) : gd.at(lane, dd);
          for (int r = 0; r < kRowsPerWarp; ++r) {
            s[r] += qv * (Stage ? ks.at(r, dd) : kd.at(r, dd));
            dp[r] += gv * (Stage ? vs.at(r, dd) : vd.at(r, dd));
          }
        }
        float p[kRowsPerWarp], ds[kRowsPerWarp];
        for (int r = 0; r < kRowsPerWarp; ++r) {
          const int64_t j = rbase + r;
          p[r] = prob(s[r], L, i < d.T && visible(i, j, d), d);
          ds[r] = p[r] * (dp[r] - delta) * cap_slope(s[r], d);
        }
        for (int ii = 0; ii < kTile; ++ii) {
          float pi[kRowsPerWarp], si[kRowsPerWarp];
          for (int r = 0; r < kRowsPerWarp; ++r) {
            pi[r] = __shfl_sync(kFull, p[r], ii);
            si[r] = __shfl_sync(kFull, ds[r], ii);
          }
          for (int c = 0; c < NC; ++c) {
            const int64_t dd = w0 + lane + 32 * c;
            if (!Stage && dd >= d.D) continue;
            const float gv = Stage ? gs.at(ii, dd) : gd.at(ii, dd);
            const float qv = Stage ? qs.at(ii, dd) : qd.at(ii, dd);
            for (int r = 0; r < kRowsPerWarp; ++r) {
              av[r][c] += pi[r] * gv;
              ak[r][c] += si[r] * qv;
            }
          }
        }
      }
    }
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t j = rbase + r;
      if (j >= d.T) continue;
      const int64_t off = w.b * d.T * d.ldkv + j * d.ldkv + w.h * d.D;
      for (int c = 0; c < NC; ++c) {
        const int64_t dd = w0 + lane + 32 * c;
        if (dd >= d.D) continue;
        store(dk, off + dd, ak[r][c] * d.scale);
        store(dv, off + dd, av[r][c]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Backward 3: dq_i = scale * sum_j P_ij (dP_ij - D_i) k_j. Staged: Q, dO rows
// [32][DM]; K, V tiles [32][DM + 1]. The warp reads its rows' D_i into
// registers first; then the windows of DM accumulated dims (one unless D > DM)
// run in this kernel and overwrite the segments.

template <typename T, int DM, bool Stage>
__global__ void __launch_bounds__(kThreads) attn_dq_kernel(const T *dout, const T *q, const T *k, const T *v,
                                                            const float *lse, T *dq, Dims d) {
  CTR_DYNAMIC_SHARED(float, sm);
  constexpr int NC = DM / 32, P = DM + 1;
  float *Qs = sm, *Gs = Qs + kRows * DM, *Ks = Gs + kRows * DM, *Vs = Ks + kTile * P;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t items = (d.T + kRows - 1) / kRows * d.B * d.Hq;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const Item w = item_of(it, d.Hq, d.T, d.causal);
    const int64_t g = w.h / d.group;
    const T *qb = q + w.b * d.T * d.ldq + w.h * d.D, *gb = dout + w.b * d.T * d.ldq + w.h * d.D;
    const T *kb = k + w.b * d.T * d.ldkv + g * d.D, *vb = v + w.b * d.T * d.ldkv + g * d.D;
    const int64_t rbase = w.r0 + warp * kRowsPerWarp;
    if constexpr (Stage) {
      __syncthreads();
      stage(Qs, DM, DM, qb, d.ldq, w.r0, d.T, d.D);
      stage(Gs, DM, DM, gb, d.ldq, w.r0, d.T, d.D);
    }
    const Direct<T> qd{qb, d.ldq, rbase, d.T}, gd{gb, d.ldq, rbase, d.T};
    float L[kRowsPerWarp], delta[kRowsPerWarp];
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t i = rbase + r;
      L[r] = d.have_lse && i < d.T ? lse[(w.b * d.Hq + w.h) * d.T + i] : 0.0f;
      delta[r] = i < d.T ? get_delta(dq + w.b * d.T * d.ldq + i * d.ldq + w.h * d.D, d.D) : 0.0f;
    }
    __syncwarp();  // every lane has its deltas before a lane overwrites a segment
    for (int64_t w0 = 0; w0 < d.D; w0 += DM) {
      float acc[kRowsPerWarp][NC] = {};
      const int64_t kend = d.causal ? (w.r0 + kRows < d.T ? w.r0 + kRows : d.T) : d.T;
      for (int64_t j0 = 0; j0 < kend; j0 += kTile) {
        if constexpr (Stage) {
          __syncthreads();
          stage(Ks, P, DM, kb, d.ldkv, j0, d.T, d.D);
          stage(Vs, P, DM, vb, d.ldkv, j0, d.T, d.D);
          __syncthreads();
        }
        const Staged ks{Ks, P}, vs{Vs, P}, qs{Qs + warp * kRowsPerWarp * DM, DM},
            gs{Gs + warp * kRowsPerWarp * DM, DM};
        const Direct<T> kd{kb, d.ldkv, j0, d.T}, vd{vb, d.ldkv, j0, d.T};
        float s[kRowsPerWarp] = {}, dp[kRowsPerWarp] = {};
        for (int64_t dd = 0; dd < d.D; ++dd) {
          const float kv = Stage ? ks.at(lane, dd) : kd.at(lane, dd);
          const float vv = Stage ? vs.at(lane, dd) : vd.at(lane, dd);
          for (int r = 0; r < kRowsPerWarp; ++r) {
            s[r] += (Stage ? qs.at(r, dd) : qd.at(r, dd)) * kv;
            dp[r] += (Stage ? gs.at(r, dd) : gd.at(r, dd)) * vv;
          }
        }
        const int64_t j = j0 + lane;
        float ds[kRowsPerWarp];
        for (int r = 0; r < kRowsPerWarp; ++r)
          ds[r] = prob(s[r], L[r], visible(rbase + r, j, d), d) * (dp[r] - delta[r]) * cap_slope(s[r], d);
        for (int jj = 0; jj < kTile; ++jj) {
          float sj[kRowsPerWarp];
          for (int r = 0; r < kRowsPerWarp; ++r) sj[r] = __shfl_sync(kFull, ds[r], jj);
          for (int c = 0; c < NC; ++c) {
            const int64_t dd = w0 + lane + 32 * c;
            if (!Stage && dd >= d.D) continue;
            const float kv = Stage ? ks.at(jj, dd) : kd.at(jj, dd);
            for (int r = 0; r < kRowsPerWarp; ++r) acc[r][c] += sj[r] * kv;
          }
        }
      }
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int64_t i = rbase + r;
        if (i >= d.T) continue;
        T *o = dq + w.b * d.T * d.ldq + i * d.ldq + w.h * d.D;
        for (int c = 0; c < NC; ++c) {
          const int64_t dd = w0 + lane + 32 * c;
          if (dd < d.D) store(o, dd, acc[r][c] * d.scale);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Launchers.

unsigned blocks_for(int64_t items) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(items, 1 << 22)));
}

// Dynamic shared memory of the staged kernels: two row blocks of [32][DM] and
// two tiles of [32][DM + 1] (the forward uses one tile less; same size asked).
template <int DM>
constexpr size_t smem_bytes() { return sizeof(float) * (2 * kRows * DM + 2 * kTile * (DM + 1)); }

// Whether the staged kernels of DM fit this device's shared memory per block
// (sm_86/89 offer 99 KB, too little for 256); otherwise the operands stay in
// global memory.
template <int DM>
bool staged_fits() {
  int dev = 0, optin = 0;
  CTR_CUDA_CHECK(cudaGetDevice(&dev));
  CTR_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return smem_bytes<DM>() <= static_cast<size_t>(optin);
}

template <typename K>
void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CTR_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <typename T, int DM, bool Stage>
void forward_as(const Args &c, const Dims &d) {
  const size_t sm = Stage ? smem_bytes<DM>() : 0;
  const auto kern = attn_fwd_kernel<T, DM, Stage>;
  allow_smem(kern, sm);
  const unsigned grid = blocks_for((d.T + kRows - 1) / kRows * d.B * d.Hq);
  for (int64_t w0 = 0; w0 < d.D; w0 += DM)
    CTR_LAUNCH(kern, grid, kThreads, sm, c.stream())(c.in<const T>(0), c.in<const T>(1), c.in<const T>(2), c.out<T>(0),
                                             c.out<float>(1), d, w0);
}

template <typename T, int DM, bool Stage>
void backward_as(const Args &c, const Dims &d) {
  const size_t sm = Stage ? smem_bytes<DM>() : 0;
  const auto k1 = attn_delta_kernel<T, DM, Stage>;
  const auto k2 = attn_dkv_kernel<T, DM, Stage>;
  const auto k3 = attn_dq_kernel<T, DM, Stage>;
  allow_smem(k1, sm);
  allow_smem(k2, sm);
  allow_smem(k3, sm);
  const T *dout = c.in<const T>(0), *q = c.in<const T>(1), *k = c.in<const T>(2), *v = c.in<const T>(3);
  const float *lse = c.in<const float>(4);
  T *dq = c.out<T>(0), *dk = c.out<T>(1), *dv = c.out<T>(2);
  const int64_t qtiles = (d.T + kRows - 1) / kRows;
  CTR_LAUNCH(k1, blocks_for(qtiles * d.B * d.Hq), kThreads, sm, c.stream())(dout, q, k, v, lse, dq, d);
  for (int64_t w0 = 0; w0 < d.D; w0 += DM)
    CTR_LAUNCH(k2, blocks_for(qtiles * d.B * d.Hkv), kThreads, sm, c.stream())(dout, q, k, v, lse, dq, dk, dv, d, w0);
  CTR_LAUNCH(k3, blocks_for(qtiles * d.B * d.Hq), kThreads, sm, c.stream())(dout, q, k, v, lse, dq, d);
}

// The head dim picks the register size of the accumulators; above 256 the
// operands stay in global memory.
template <typename T>
void attention(const Args &c) {
  const Dims d = make_dims(c, 0);
  if (d.B * d.T * d.Hq * d.D == 0) return;
  if (d.D <= 32) forward_as<T, 32, true>(c, d);
  else if (d.D <= 64) forward_as<T, 64, true>(c, d);
  else if (d.D <= 128) forward_as<T, 128, true>(c, d);
  else if (d.D <= 256 && staged_fits<256>()) forward_as<T, 256, true>(c, d);
  else forward_as<T, 256, false>(c, d);
}

// attention_bwd(dout, q, k, v, probs, out) -> dq, dk, dv (out is not read here)
template <typename T>
void attention_bwd(const Args &c) {
  const Dims d = make_dims(c, 1);
  if (d.B * d.T * d.Hq * d.D == 0) return;
  if (d.D <= 32) backward_as<T, 32, true>(c, d);
  else if (d.D <= 64) backward_as<T, 64, true>(c, d);
  else if (d.D <= 128) backward_as<T, 128, true>(c, d);
  else if (d.D <= 256 && staged_fits<256>()) backward_as<T, 256, true>(c, d);
  else backward_as<T, 256, false>(c, d);
}

// cuDNN's fused attention where the stream has it and takes the shape.
void k_attention(const Args &c) {
  if (c.s->attn && c.s->attn->forward(c.s->attn, c)) return;
  CTR_CUDA_DISPATCH(c, attention);
}
void k_attention_bwd(const Args &c) {
  if (c.s->attn && c.s->attn->backward(c.s->attn, c)) return;
  CTR_CUDA_DISPATCH(c, attention_bwd);
}

}  // namespace

const KernelEntry kAttentionKernels[] = {
    {"attention", bind<k_attention>},
    {"attention_bwd", bind<k_attention_bwd>},
};
const size_t kAttentionKernelCount = sizeof(kAttentionKernels) / sizeof(kAttentionKernels[0]);

}  // namespace ctr::cuda
