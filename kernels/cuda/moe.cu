// Mixture-of-experts kernels on the GPU, the formulas of kernels/cpu/moe.cc:
// routing, the auxiliary losses, the stable permutation of token choices by
// expert, the grouped expert GEMMs and the weighted combine. f32 storage only
// (the precision pass keeps graphs with these ops in f32); ids, counts and
// slots are int32. Expert counts stay on the device: every kernel that needs
// them reads them there, and no binding waits on the GPU.
//
// Per-token work gives a token to a warp, lane l owning experts l, l + 32, ...
// Whatever the CPU forms in double (softmax sums, the router's scores, the
// gradients' dot products) is formed in double here too, and the top-k
// selection keeps the CPU's order (score descending, the lower expert on ties),
// so the chosen experts agree with the CPU's.
//
// Nothing uses float atomics. Scalar losses and per-expert sums are added by
// one block in a fixed order; expert counts are integer histograms (shared or
// global integer atomics, whose result does not depend on order).
//
// moe_permute is a stable counting sort in tiles of consecutive slots: a
// histogram per tile, a scan over (expert, tile) that gives each tile its first
// row per expert, then a warp per tile ranks its slots in order (equal experts
// found with __match_any_sync). The histograms live in the permuted buffer xp,
// which is written only at the end, so nothing is allocated; when xp is too
// small for them (more experts than its elements) each slot counts the slots
// that sort before it instead.
//
// moe_grouped_linear is a tiled f32 GEMM (64 x 64 output tiles, 16-deep slices
// staged in shared memory). Segments have row counts known only on the device,
// so each block of the forward and of dx scans the counts itself (a warp scan
// per 32 segments) to find its tile: the tiles of segment 0, then 1, ...; the
// grid has room for every segment's partial last tile, and the blocks past the
// last tile zero the rows past the last counted one. The weight gradient gives
// each output tile of each expert to one block, which adds the rows of that
// expert's segments in segment order.

#include "common/op_params.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace ctr::cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTokenThreads = 256;  // warp per token: 8 tokens per block
constexpr int kTokenWarps = kTokenThreads / 32;

int64_t per(int64_t total, int64_t d) { return d > 0 ? total / d : 0; }
unsigned token_grid(int64_t N) { return grid_for(N, kTokenWarps); }

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// The log-sum-exp of one row of E logits, by a warp, as the CPU's softmax_row
// forms it: the max in float, the sum of exp(l - max) in double.
__device__ double warp_row_lse(const float *l, int64_t E) {
  const int lane = threadIdx.x & 31;
  float m = -INFINITY;
  for (int64_t e = lane; e < E; e += 32) m = fmaxf(m, l[e]);
  m = warp_max(m);
  double s = 0;
  for (int64_t e = lane; e < E; e += 32) s += exp(static_cast<double>(l[e] - m));
  return static_cast<double>(m) + log(warp_sum_d(s));
}

// softmax probability of logit l given the row's log-sum-exp, rounded to float
// as the CPU stores it.
__device__ __forceinline__ float prob(float l, double lse) {
  return static_cast<float>(exp(static_cast<double>(l) - lse));
}

// ---------------------------------------------------------------------------
// Router

__global__ void router_kernel(const float *logits, float *weights, int32_t *experts, float *scores, int64_t N,
                              int64_t E, int64_t k, bool sigmoid, bool renorm) {
  const int lane = threadIdx.x & 31;
  for (int64_t n = blockIdx.x * int64_t{kTokenWarps} + (threadIdx.x >> 5); n < N;
       n += int64_t{gridDim.x} * kTokenWarps) {
    const float *l = logits + n * E;
    float *s = scores + n * E;
    if (sigmoid) {
      for (int64_t e = lane; e < E; e += 32) s[e] = static_cast<float>(1.0 / (1.0 + exp(-static_cast<double>(l[e]))));
    } else {
      const double lse = warp_row_lse(l, E);
      for (int64_t e = lane; e < E; e += 32) s[e] = prob(l[e], lse);
    }
    // Choice j is the best score after choice j - 1 in the order (score
    // descending, expert ascending): the CPU's best not-yet-taken expert. Each
    // lane reads back only the scores it wrote.
    int32_t *ex = experts + n * k;
    float *w = weights + n * k;
    float last_v = 0.0f;
    int64_t last_e = -1;
    double total = 0;
    for (int64_t j = 0; j < k; ++j) {
      float bv = 0.0f;
      int64_t be = -1;
      for (int64_t e = lane; e < E; e += 32) {
        const float v = s[e];
        if (j > 0 && !(v < last_v || (v == last_v && e > last_e))) continue;
        if (be < 0 || v > bv) {
          bv = v;
          be = e;
        }
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFull, bv, o);
        const int64_t oe = __shfl_xor_sync(kFull, be, o);
        if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) {
          bv = ov;
          be = oe;
        }
      }
      last_v = bv;
      last_e = be;
      total += bv;
      if (lane == 0) {
        ex[j] = static_cast<int32_t>(be);
        w[j] = bv;
      }
    }
    if (renorm && lane == 0)
      for (int64_t j = 0; j < k; ++j)
        w[j] = total > 0 ? static_cast<float>(w[j] / total) : 1.0f / static_cast<float>(k);
  }
}

__global__ void router_bwd_kernel(const float *dweights, const float *scores, const int32_t *experts, float *dlogits,
                                  int64_t N, int64_t E, int64_t k, bool sigmoid, bool renorm) {
  const int lane = threadIdx.x & 31;
  for (int64_t n = blockIdx.x * int64_t{kTokenWarps} + (threadIdx.x >> 5); n < N;
       n += int64_t{gridDim.x} * kTokenWarps) {
    const float *s = scores + n * E;
    const float *dw = dweights + n * k;
    const int32_t *ex = experts + n * k;
    // w_j = v_j / S: dv_j = (dw_j - sum_i dw_i w_i) / S, in the CPU's order.
    double S = 1, dot = 0;
    if (renorm) {
      S = 0;
      for (int64_t j = 0; j < k; ++j) S += s[ex[j]];
      if (S <= 0) S = 1;
      for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(dw[j]) * s[ex[j]] / S;
    }
    // d loss / d score of expert e: its choices' terms in choice order.
    auto ds_of = [&](int64_t e) {
      double d = 0;
      for (int64_t j = 0; j < k; ++j)
        if (ex[j] == e) d += renorm ? (dw[j] - dot) / S : static_cast<double>(dw[j]);
      return d;
    };
    float *dl = dlogits + n * E;
    if (sigmoid) {
      for (int64_t e = lane; e < E; e += 32) dl[e] = static_cast<float>(ds_of(e) * s[e] * (1.0 - s[e]));
    } else {
      double sd = 0;
      for (int64_t e = lane; e < E; e += 32) sd += ds_of(e) * s[e];
      sd = warp_sum_d(sd);
      for (int64_t e = lane; e < E; e += 32) dl[e] = static_cast<float>(s[e] * (ds_of(e) - sd));
    }
  }
}

// ---------------------------------------------------------------------------
// Auxiliary losses

constexpr int kSumThreads = 1024;  // 32 warps
constexpr int kSumSlots = 8;       // experts per lane per pass
constexpr int64_t kSumChunk = 32 * kSumSlots;

// Per-expert assignment counts and softmax sums over every token, experts in
// chunks of 256 (lane l owns experts c0 + l + 32 i): warp w adds the
// probabilities of tokens w, w + 32, ... in double, and the warps' partial
// sums are added in warp order. Stats: the moe_aux_stats vector into out (one
// block per chunk); otherwise one block adds coef * E * sum_e f_e P_e into
// out[0] (moe_aux_loss).
template <bool Stats>
__global__ void __launch_bounds__(kSumThreads) aux_sums_kernel(const float *logits, const int32_t *experts,
                                                               float *out, int64_t N, int64_t E, int64_t k,
                                                               float coef) {
  __shared__ double part[32][33];
  __shared__ int cnt[kSumChunk];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double acc = 0;  // warp 0: its lanes' share of sum_e f_e P_e / N
  for (int64_t c0 = blockIdx.x * kSumChunk; c0 < E; c0 += int64_t{gridDim.x} * kSumChunk) {
    for (int i = threadIdx.x; i < kSumChunk; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < N * k; i += blockDim.x) {
      const int64_t e = experts[i];
      if (e >= c0 && e < c0 + kSumChunk && e < E) atomicAdd(&cnt[e - c0], 1);
    }
    double P[kSumSlots] = {};
    for (int64_t n = warp; n < N; n += 32) {
      const float *l = logits + n * E;
      const double lse = warp_row_lse(l, E);
#pragma unroll
      for (int i = 0; i < kSumSlots; ++i) {
        const int64_t e = c0 + i * 32 + lane;
        if (e < E) P[i] += prob(l[e], lse);
      }
    }
#pragma unroll
    for (int i = 0; i < kSumSlots; ++i) {
      __syncthreads();  // the counts are complete; part is free
      part[warp][lane] = P[i];
      __syncthreads();
      const int64_t e = c0 + i * 32 + lane;
      if (warp == 0 && e < E) {
        double sum = 0;
        for (int v = 0; v < 32; ++v) sum += part[v][lane];
        const double count = cnt[i * 32 + lane];
        if constexpr (Stats) {
          out[e] = static_cast<float>(count);
          out[E + e] = static_cast<float>(sum);
        } else {
          const double f = count / static_cast<double>(N * k > 1 ? N * k : 1);
          acc += f * sum / static_cast<double>(N > 1 ? N : 1);
        }
      }
    }
    __syncthreads();
  }
  if constexpr (Stats) {
    if (blockIdx.x == 0 && threadIdx.x == 0) out[2 * E] = static_cast<float>(N);
  } else if (warp == 0) {
    acc = warp_sum_d(acc);
    if (lane == 0) out[0] = static_cast<float>(coef * static_cast<double>(E) * acc);
  }
}

// loss = coef * mean over tokens of lse^2; one block, warp w adding tokens
// w, w + 32, ..., the warps' sums added in order.
__global__ void __launch_bounds__(kSumThreads) z_loss_kernel(const float *logits, float *loss, int64_t N, int64_t E,
                                                             float coef) {
  __shared__ double part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double acc = 0;
  for (int64_t n = warp; n < N; n += 32) {
    const double lse = warp_row_lse(logits + n * E, E);
    acc += lse * lse;
  }
  if (lane == 0) part[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0;
    for (int v = 0; v < 32; ++v) sum += part[v];
    loss[0] = static_cast<float>(coef * sum / static_cast<double>(N > 1 ? N : 1));
  }
}

__global__ void z_loss_bwd_kernel(const float *dloss, const float *logits, float *dlogits, int64_t N, int64_t E,
                                  float coef) {
  const int lane = threadIdx.x & 31;
  const double scale = static_cast<double>(*dloss) * coef * 2.0 / static_cast<double>(N > 1 ? N : 1);
  for (int64_t n = blockIdx.x * int64_t{kTokenWarps} + (threadIdx.x >> 5); n < N;
       n += int64_t{gridDim.x} * kTokenWarps) {
    const float *l = logits + n * E;
    const double lse = warp_row_lse(l, E);
    for (int64_t e = lane; e < E; e += 32) dlogits[n * E + e] = static_cast<float>(scale * lse * prob(l[e], lse));
  }
}

__global__ void aux_loss_global_kernel(const float *stats, float *loss, int64_t E, int64_t k, float coef) {
  const double n = fmax(1.0, static_cast<double>(stats[2 * E]));
  double acc = 0;
  for (int64_t e = 0; e < E; ++e) acc += (stats[e] / (n * static_cast<double>(k))) * (stats[E + e] / n);
  loss[0] = static_cast<float>(coef * static_cast<double>(E) * acc);
}

constexpr int kCountWindow = 4096;  // experts counted at once in shared memory

// The gradient of a loss linear in each token's softmax, d loss / d p[n, e] =
// c_e: dlogits[n] = p (c - <c, p>). Global: c_e from the summed statistics
// (moe_aux_loss_global_bwd); otherwise from this batch's assignment fractions
// (moe_aux_loss_bwd), which every block counts itself into shared memory, in
// windows of kCountWindow experts (recounted per token tile only when E is
// larger than one window).
template <bool Global>
__global__ void __launch_bounds__(kTokenThreads) aux_bwd_kernel(const float *dloss, const float *logits,
                                                                const int32_t *experts, const float *stats,
                                                                float *dlogits, int64_t N, int64_t E, int64_t k,
                                                                float coef) {
  __shared__ int cnt[Global ? 1 : kCountWindow];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double g = static_cast<double>(*dloss) * coef * static_cast<double>(E);
  const double n_tok = static_cast<double>(N > 1 ? N : 1);
  const double n_all = Global ? fmax(1.0, static_cast<double>(stats[2 * E])) : 0.0;
  const int64_t win = Global ? (E > 0 ? E : 1) : kCountWindow;
  const int64_t windows = (E + win - 1) / win;
  auto count = [&](int64_t w0) {
    __syncthreads();
    for (int i = threadIdx.x; i < win; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < N * k; i += blockDim.x) {
      const int64_t e = experts[i];
      if (e >= w0 && e < w0 + win && e < E) atomicAdd(&cnt[e - w0], 1);
    }
    __syncthreads();
  };
  auto c_of = [&](int64_t e, int64_t w0) -> double {
    if constexpr (Global)
      return g * (stats[e] / (n_all * static_cast<double>(k))) / n_tok;
    else
      return g * (cnt[e - w0] / static_cast<double>(N * k > 1 ? N * k : 1)) / n_tok;
  };
  if (!Global && windows == 1) count(0);
  // The token loop is the same for the whole block (count synchronises it).
  for (int64_t t0 = blockIdx.x * int64_t{kTokenWarps}; t0 < N; t0 += int64_t{gridDim.x} * kTokenWarps) {
    const int64_t n = t0 + warp;
    const bool live = n < N;
    const float *l = logits + (live ? n : 0) * E;
    const double lse = live ? warp_row_lse(l, E) : 0.0;
    double dot = 0;
    for (int64_t w0 = 0; w0 < E; w0 += win) {
      if (!Global && windows > 1) count(w0);
      const int64_t w1 = w0 + win < E ? w0 + win : E;
      if (live)
        for (int64_t e = w0 + lane; e < w1; e += 32) dot += c_of(e, w0) * prob(l[e], lse);
    }
    dot = warp_sum_d(dot);
    for (int64_t w0 = 0; w0 < E; w0 += win) {
      if (!Global && windows > 1) count(w0);
      const int64_t w1 = w0 + win < E ? w0 + win : E;
      if (live)
        for (int64_t e = w0 + lane; e < w1; e += 32) {
          const float p = prob(l[e], lse);
          dlogits[n * E + e] = static_cast<float>(p * (c_of(e, w0) - dot));
        }
    }
  }
}

unsigned aux_bwd_grid(const Args &c, int64_t N) {
  // Each block counts every assignment once: a few blocks per SM suffice.
  const int64_t cap = static_cast<int64_t>(c.s->sm_count > 0 ? c.s->sm_count : 80) * 2;
  const int64_t want = (N + kTokenWarps - 1) / kTokenWarps;
  return static_cast<unsigned>(want < 1 ? 1 : (want < cap ? want : cap));
}

// ---------------------------------------------------------------------------
// Permute and combine

// An expert id out of range (only possible from a file's input) sends its slot
// to the last expert, as on the CPU.
__device__ __forceinline__ int32_t expert_of(const int32_t *experts, int64_t i, int64_t E) {
  const int32_t e = experts[i];
  return e >= 0 && e < E ? e : static_cast<int32_t>(E - 1);
}

// H[t][e] = slots of tile t (L consecutive slots) that chose e.
__global__ void sort_hist_kernel(const int32_t *experts, int32_t *H, int64_t M, int64_t E, int64_t L) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < M; i += int64_t{gridDim.x} * blockDim.x)
    atomicAdd(&H[(i / L) * E + expert_of(experts, i, E)], 1);
}

// Exclusive scan of v over the block (up to 1024 threads); *total gets the sum.
__device__ int block_scan_excl(int v, int *sh, int *total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();
  if (lane == 31) sh[warp] = incl;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < nw; ++w) {
    if (w < warp) before += sh[w];
    all += sh[w];
  }
  *total = all;
  return before + incl - v;
}

// One block: counts[e] = sum_t H[t][e], and H[t][e] becomes the first row of
// tile t's slots for expert e: the rows of experts < e, then of e's earlier tiles.
__global__ void __launch_bounds__(1024) sort_offsets_kernel(int32_t *H, int32_t *counts, int64_t T, int64_t E) {
  __shared__ int sh[32];
  int base = 0;
  for (int64_t e0 = 0; e0 < E; e0 += blockDim.x) {
    const int64_t e = e0 + threadIdx.x;
    int total = 0;
    if (e < E)
      for (int64_t t = 0; t < T; ++t) {
        const int h = H[t * E + e];
        H[t * E + e] = total;
        total += h;
      }
    if (e < E) counts[e] = total;
    int chunk = 0;
    const int off = base + block_scan_excl(total, sh, &chunk);
    if (e < E)
      for (int64_t t = 0; t < T; ++t) H[t * E + e] += off;
    base += chunk;
  }
}

// A warp per tile ranks its slots in order: a slot's row is its tile's next
// row for its expert plus the slots of the same expert before it in its group
// of 32; the lowest such lane then advances the tile's cursor.
__global__ void sort_rank_kernel(const int32_t *experts, int32_t *H, int32_t *slots, int64_t M, int64_t E, int64_t L,
                                 int64_t T) {
  const int lane = threadIdx.x & 31;
  for (int64_t t = blockIdx.x * int64_t{blockDim.x / 32} + (threadIdx.x >> 5); t < T;
       t += int64_t{gridDim.x} * (blockDim.x / 32)) {
    const int64_t end = (t + 1) * L < M ? (t + 1) * L : M;
    for (int64_t i0 = t * L; i0 < end; i0 += 32) {
      const int64_t i = i0 + lane;
      const bool valid = i < end;
      const int32_t e = valid ? expert_of(experts, i, E) : -1;
      const unsigned same = __match_any_sync(kFull, e);
      const int rank = __popc(same & ((1u << lane) - 1u));
      int32_t *cursor = H + t * E + (valid ? e : 0);
      const int32_t row = valid ? *cursor : 0;
      if (valid) slots[i] = row + rank;
      __syncwarp();
      if (valid && lane == __ffs(same) - 1) *cursor = row + __popc(same);
      __syncwarp();
    }
  }
}

// Without room for the histograms: counts by a global histogram (zeroed
// before), and each slot's row is the number of slots before it in the order
// (expert, slot).
__global__ void sort_count_kernel(const int32_t *experts, int32_t *counts, int64_t M, int64_t E) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < M; i += int64_t{gridDim.x} * blockDim.x)
    atomicAdd(&counts[expert_of(experts, i, E)], 1);
}
__global__ void sort_direct_kernel(const int32_t *experts, int32_t *slots, int64_t M, int64_t E) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < M; i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t e = expert_of(experts, i, E);
    int32_t r = 0;
    for (int64_t j = 0; j < M; ++j) {
      const int32_t f = expert_of(experts, j, E);
      r += f < e || (f == e && j < i);
    }
    slots[i] = r;
  }
}

// xp[slots[i]] = x[i / k]
__global__ void permute_gather_kernel(const float *x, const int32_t *slots, float *xp, int64_t M, int64_t k,
                                      int64_t D) {
  for (int64_t q = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; q < M * D; q += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = q / D, d = q - i * D;
    xp[static_cast<int64_t>(slots[i]) * D + d] = x[(i / k) * D + d];
  }
}

// dx[n] = sum_j dxp[slots[n, j]] (Weighted: y[n] = sum_j w[n, j] yp[slots[n, j]]),
// a thread per element adding in choice order; slots out of range are skipped.
template <bool Weighted>
__global__ void combine_kernel(const float *src, const int32_t *slots, const float *weights, float *dst, int64_t N,
                               int64_t k, int64_t D, int64_t M) {
  for (int64_t q = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; q < N * D; q += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = q / D, d = q - n * D;
    float acc = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = slots[n * k + j];
      if (r < 0 || r >= M) continue;
      const float v = src[r * D + d];
      acc += Weighted ? weights[n * k + j] * v : v;
    }
    dst[q] = acc;
  }
}

// A warp per slot: dyp[slot] = w dy[n] (dyp zeroed before), dweights = <dy[n], yp[slot]>.
__global__ void unpermute_bwd_kernel(const float *dy, const float *yp, const int32_t *slots, const float *weights,
                                     float *dyp, float *dweights, int64_t NK, int64_t k, int64_t D, int64_t M) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * int64_t{kTokenWarps} + (threadIdx.x >> 5); i < NK;
       i += int64_t{gridDim.x} * kTokenWarps) {
    const int64_t r = slots[i];
    if (r < 0 || r >= M) {
      if (lane == 0) dweights[i] = 0.0f;
      continue;
    }
    const float w = weights[i];
    const float *g = dy + (i / k) * D, *src = yp + r * D;
    float *o = dyp + r * D;
    double dot = 0;
    for (int64_t d = lane; d < D; d += 32) {
      dot += static_cast<double>(g[d]) * src[d];
      o[d] = w * g[d];
    }
    dot = warp_sum_d(dot);
    if (lane == 0) dweights[i] = static_cast<float>(dot);
  }
}

// ---------------------------------------------------------------------------
// Grouped GEMMs

constexpr int kTile = 64;         // output tile (rows and columns)
constexpr int kSlice = 16;        // inner dim per shared-memory stage
constexpr int kGemmThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPitch = kTile + 4;

// Segments c0 .. c0 + 31, one per lane: rows [start, end), with off[s + 1] =
// min(M, counts[0] + ... + counts[s]) (negative counts as 0), the CPU's
// expert_offsets. `run` carries the unclamped total from chunk to chunk.
struct Segment {
  int64_t start, end;
};
__device__ Segment segment_chunk(const int32_t *counts, int64_t S, int64_t M, int64_t c0, int64_t &run) {
  const int lane = threadIdx.x & 31;
  const int64_t s = c0 + lane;
  const int64_t c = s < S && counts[s] > 0 ? counts[s] : 0;
  int64_t incl = c;
  for (int o = 1; o < 32; o <<= 1) {
    const int64_t t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  const int64_t a = run + incl - c, b = run + incl;
  run += __shfl_sync(kFull, incl, 31);
  return {a < M ? a : M, b < M ? b : M};
}

// This block's row tile among every segment's tiles in order (ceil(rows / 64)
// each): segment, first row, end of the segment's rows. Blocks past the last
// tile get, with seg = -1, a tile of the rows past the last counted one.
struct RowTile {
  int64_t seg, row0, row1;
};
__device__ RowTile find_row_tile(const int32_t *counts, int64_t S, int64_t M, int64_t b, RowTile *sh) {
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int64_t run = 0, tiles = 0;
    for (int64_t c0 = 0; c0 < S; c0 += 32) {
      const Segment r = segment_chunk(counts, S, M, c0, run);
      const int64_t nt = (r.end - r.start + kTile - 1) / kTile;
      int64_t incl = nt;
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t t = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += t;
      }
      const int64_t first = tiles + incl - nt;
      if (c0 + lane < S && b >= first && b < first + nt) *sh = {c0 + lane, r.start + (b - first) * kTile, r.end};
      tiles += __shfl_sync(kFull, incl, 31);
    }
    if (lane == 0 && b >= tiles) *sh = {-1, (run < M ? run : M) + (b - tiles) * kTile, M};
  }
  __syncthreads();
  return *sh;
}

// acc += A B over the inner range [p0, p1): A(i, p) for the tile's 64 rows,
// B(p, j) for its 64 columns (each 0 outside the operand), staged 16 deep.
// AP / BP: the operand is contiguous along p, so consecutive threads load
// consecutive p (otherwise consecutive i or j).
template <bool AP, bool BP, class FA, class FB>
__device__ void gemm_tile(float (&acc)[4][4], int64_t p0, int64_t p1, FA a, FB b, float (*As)[kPitch],
                          float (*Bs)[kPitch]) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  for (int64_t q = p0; q < p1; q += kSlice) {
    for (int l = threadIdx.x; l < kSlice * kTile; l += kGemmThreads) {
      const int ai = AP ? l / kSlice : l % kTile, ap = AP ? l % kSlice : l / kTile;
      const int bj = BP ? l / kSlice : l % kTile, bp = BP ? l % kSlice : l / kTile;
      As[ap][ai] = q + ap < p1 ? a(ai, q + ap) : 0.0f;
      Bs[bp][bj] = q + bp < p1 ? b(q + bp, bj) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kSlice; ++p) {
      float ar[4], br[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        ar[r] = As[p][ty + 16 * r];
        br[r] = Bs[p][tx + 16 * r];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] += ar[r] * br[c];
    }
    __syncthreads();
  }
}

// Writes the tile's outputs inside [rows, cols) of out (pitch ld), times scale.
__device__ void store_tile(const float (&acc)[4][4], float *out, int64_t ld, int64_t row0, int64_t row1, int64_t col0,
                           int64_t cols, float scale) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int64_t row = row0 + ty + 16 * r;
    if (row >= row1) continue;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t col = col0 + tx + 16 * c;
      if (col < cols) out[row * ld + col] = scale * acc[r][c];
    }
  }
}

// Per segment s with expert e = s % E (w[E, N, K]): Fwd y[M, N] = x[M, K] w_e^T;
// otherwise dx[M, K] = dy[M, N] w_e. `a` is x or dy (inner dim P), out has
// `cols` columns; rows past the last segment are zero.
template <bool Fwd>
__global__ void __launch_bounds__(kGemmThreads) grouped_rows_kernel(const float *a, const int32_t *counts, int64_t S,
                                                                    const float *w, float *out, int64_t M, int64_t P,
                                                                    int64_t cols, int64_t E) {
  __shared__ float As[kSlice][kPitch], Bs[kSlice][kPitch];
  __shared__ RowTile sh;
  const RowTile t = find_row_tile(counts, S, M, blockIdx.x, &sh);
  if (t.row0 >= M) return;
  const int64_t row1 = t.row0 + kTile < t.row1 ? t.row0 + kTile : t.row1;
  const int64_t col0 = blockIdx.y * int64_t{kTile};
  float acc[4][4] = {};
  if (t.seg >= 0) {
    const float *ar = a + t.row0 * P;
    const float *we = w + (t.seg % E) * cols * P;
    const int64_t rows = row1 - t.row0;
    auto fa = [=](int i, int64_t p) { return i < rows ? ar[i * P + p] : 0.0f; };
    if constexpr (Fwd) {
      auto fb = [=](int64_t p, int j) { return col0 + j < cols ? we[(col0 + j) * P + p] : 0.0f; };
      gemm_tile<true, true>(acc, 0, P, fa, fb, As, Bs);
    } else {
      auto fb = [=](int64_t p, int j) { return col0 + j < cols ? we[p * cols + col0 + j] : 0.0f; };
      gemm_tile<true, false>(acc, 0, P, fa, fb, As, Bs);
    }
  }
  store_tile(acc, out, cols, t.row0, row1, col0, cols, 1.0f);
}

// dw[e] = scale * sum over the segments s of expert e (s % E == e), in order,
// of dy_s^T x_s: a block per 64 x 64 tile of dw[e] ([N, K]); an expert without
// rows gets zeros.
__global__ void __launch_bounds__(kGemmThreads) grouped_dw_kernel(const float *dy, const float *x,
                                                                  const int32_t *counts, int64_t S, float *dw,
                                                                  int64_t M, int64_t K, int64_t N, int64_t E,
                                                                  float scale) {
  __shared__ float As[kSlice][kPitch], Bs[kSlice][kPitch];
  __shared__ Segment seg[32];
  const int64_t k0 = blockIdx.x * int64_t{kTile}, c0 = blockIdx.y * int64_t{kTile};
  for (int64_t e = blockIdx.z; e < E; e += gridDim.z) {
    float acc[4][4] = {};
    int64_t run = 0;  // warp 0's
    for (int64_t s0 = 0; s0 < S; s0 += 32) {
      if (threadIdx.x < 32) seg[threadIdx.x] = segment_chunk(counts, S, M, s0, run);
      __syncthreads();
      for (int q = 0; q < 32 && s0 + q < S; ++q) {
        if ((s0 + q) % E != e || seg[q].end <= seg[q].start) continue;
        auto fa = [=](int i, int64_t p) { return c0 + i < N ? dy[p * N + c0 + i] : 0.0f; };
        auto fb = [=](int64_t p, int j) { return k0 + j < K ? x[p * K + k0 + j] : 0.0f; };
        gemm_tile<false, false>(acc, seg[q].start, seg[q].end, fa, fb, As, Bs);
      }
      __syncthreads();
    }
    store_tile(acc, dw + e * N * K, K, c0, N, k0, K, scale);
  }
}

unsigned tiles(int64_t n) { return static_cast<unsigned>((n + kTile - 1) / kTile); }

// ---------------------------------------------------------------------------
// Bindings: N tokens and the last dims are read from the tensors, as on the CPU.

void k_moe_router(const Args &c) {
  const auto &p = c.params<ctr_moe_router_params>();
  const int64_t E = c.in_dim(0, -1), k = c.out_dim(0, -1), N = per(c.in_numel(0), E);
  if (N == 0) return;
  CTR_LAUNCH(router_kernel, token_grid(N), kTokenThreads, 0, c.stream())(c.in<const float>(0), c.out<float>(0),
                                                                 c.out<int32_t>(1), c.out<float>(2), N, E, k,
                                                                 p.sigmoid != 0, p.renorm != 0);
}

// (dweights, scores, experts) -> dlogits
void k_moe_router_bwd(const Args &c) {
  const auto &p = c.params<ctr_moe_router_params>();
  const int64_t E = c.in_dim(1, -1), k = c.in_dim(0, -1), N = per(c.in_numel(1), E);
  if (N == 0) return;
  CTR_LAUNCH(router_bwd_kernel, token_grid(N), kTokenThreads, 0, c.stream())(c.in<const float>(0), c.in<const float>(1),
                                                                     c.in<const int32_t>(2), c.out<float>(0), N, E,
                                                                     k, p.sigmoid != 0, p.renorm != 0);
}

// (logits, experts) -> loss
void k_moe_aux_loss(const Args &c) {
  const int64_t E = c.in_dim(0, -1), k = c.in_dim(1, -1), N = per(c.in_numel(0), E);
  CTR_LAUNCH(aux_sums_kernel<false>, 1, kSumThreads, 0, c.stream())(c.in<const float>(0), c.in<const int32_t>(1),
                                                            c.out<float>(0), N, E, k,
                                                            c.params<ctr_moe_loss_params>().coef);
}

// (dloss, logits, experts) -> dlogits
void k_moe_aux_loss_bwd(const Args &c) {
  const int64_t E = c.in_dim(1, -1), k = c.in_dim(2, -1), N = per(c.in_numel(1), E);
  if (N == 0) return;
  CTR_LAUNCH(aux_bwd_kernel<false>, aux_bwd_grid(c, N), kTokenThreads, 0, c.stream())(
      c.in<const float>(0), c.in<const float>(1), c.in<const int32_t>(2), nullptr, c.out<float>(0), N, E, k,
      c.params<ctr_moe_loss_params>().coef);
}

// (logits) -> loss
void k_moe_z_loss(const Args &c) {
  const int64_t E = c.in_dim(0, -1), N = per(c.in_numel(0), E);
  CTR_LAUNCH(z_loss_kernel, 1, kSumThreads, 0, c.stream())(c.in<const float>(0), c.out<float>(0), N, E,
                                                   c.params<ctr_moe_loss_params>().coef);
}

// (dloss, logits) -> dlogits
void k_moe_z_loss_bwd(const Args &c) {
  const int64_t E = c.in_dim(1, -1), N = per(c.in_numel(1), E);
  if (N == 0) return;
  CTR_LAUNCH(z_loss_bwd_kernel, token_grid(N), kTokenThreads, 0, c.stream())(c.in<const float>(0), c.in<const float>(1),
                                                                     c.out<float>(0), N, E,
                                                                     c.params<ctr_moe_loss_params>().coef);
}

constexpr int64_t kSortTileSlots = 256;

// (x, experts) -> xp, counts, slots
void k_moe_permute(const Args &c) {
  const int64_t D = c.in_dim(0, -1), k = c.in_dim(1, -1), M = c.in_numel(1), E = c.out_dim(1, 0);
  const int32_t *ex = c.in<const int32_t>(1);
  int32_t *counts = c.out<int32_t>(1), *slots = c.out<int32_t>(2);
  float *xp = c.out<float>(0);
  if (M == 0 || E == 0) {
    CTR_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * sizeof(int32_t), c.stream()));
    return;
  }
  // Tiles of L slots; their histograms [T, E] (int32) borrow xp, gathered into last.
  int64_t L = kSortTileSlots;
  while (L < M && per(M + L - 1, L) * E > M * D) L *= 2;
  const int64_t T = (M + L - 1) / L;
  if (T * E <= M * D) {
    int32_t *H = reinterpret_cast<int32_t *>(xp);
    CTR_CUDA_CHECK(cudaMemsetAsync(H, 0, static_cast<size_t>(T * E) * sizeof(int32_t), c.stream()));
    CTR_LAUNCH(sort_hist_kernel, grid_for(M), 256, 0, c.stream())(ex, H, M, E, L);
    CTR_LAUNCH(sort_offsets_kernel, 1, 1024, 0, c.stream())(H, counts, T, E);
    CTR_LAUNCH(sort_rank_kernel, grid_for(T, kTokenWarps), kTokenThreads, 0, c.stream())(ex, H, slots, M, E, L, T);
  } else {
    CTR_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * sizeof(int32_t), c.stream()));
    CTR_LAUNCH(sort_count_kernel, grid_for(M), 256, 0, c.stream())(ex, counts, M, E);
    CTR_LAUNCH(sort_direct_kernel, grid_for(M), 256, 0, c.stream())(ex, slots, M, E);
  }
  if (D > 0)
    CTR_LAUNCH(permute_gather_kernel, grid_for(M * D), 256, 0, c.stream())(c.in<const float>(0), slots, xp, M, k, D);
}

// (dxp, slots) -> dx
void k_moe_permute_bwd(const Args &c) {
  const int64_t D = c.in_dim(0, -1), k = c.in_dim(1, -1), N = per(c.in_numel(1), k), M = c.in_dim(0, 0);
  if (N * D == 0) return;
  CTR_LAUNCH(combine_kernel<false>, grid_for(N * D), 256, 0, c.stream())(c.in<const float>(0), c.in<const int32_t>(1),
                                                                  nullptr, c.out<float>(0), N, k, D, M);
}

// (yp, weights, slots) -> y
void k_moe_unpermute(const Args &c) {
  const int64_t M = c.in_dim(0, 0), D = c.in_dim(0, 1), k = c.in_dim(1, -1), N = per(c.in_numel(1), k);
  if (N * D == 0) return;
  CTR_LAUNCH(combine_kernel<true>, grid_for(N * D), 256, 0, c.stream())(c.in<const float>(0), c.in<const int32_t>(2),
                                                                 c.in<const float>(1), c.out<float>(0), N, k, D, M);
}

// (dy, yp, slots, weights) -> dyp, dweights
void k_moe_unpermute_bwd(const Args &c) {
  const int64_t M = c.in_dim(1, 0), D = c.in_dim(1, 1), k = c.in_dim(3, -1), NK = c.in_numel(3);
  // Rows no slot points at get no gradient.
  CTR_CUDA_CHECK(cudaMemsetAsync(c.out<void>(0), 0, static_cast<size_t>(c.out_ref(0).bytes), c.stream()));
  if (NK == 0) return;
  CTR_LAUNCH(unpermute_bwd_kernel, token_grid(NK), kTokenThreads, 0, c.stream())(
      c.in<const float>(0), c.in<const float>(1), c.in<const int32_t>(2), c.in<const float>(3), c.out<float>(0),
      c.out<float>(1), NK, k, D, M);
}

// (x[M, K], w[E, N, K], counts[S]) -> y[M, N]
void k_moe_grouped_linear(const Args &c) {
  const int64_t M = c.in_dim(0, 0), K = c.in_dim(0, 1), E = c.in_dim(1, 0), N = c.in_dim(1, 1), S = c.in_dim(2, 0);
  if (M == 0 || N == 0) return;
  const dim3 grid(tiles(M) + static_cast<unsigned>(S), tiles(N));
  CTR_LAUNCH(grouped_rows_kernel<true>, grid, kGemmThreads, 0, c.stream())(c.in<const float>(0), c.in<const int32_t>(2), S,
                                                                   c.in<const float>(1), c.out<float>(0), M, K, N, E);
}

// (dy[M, N], x[M, K], w[E, N, K], counts[S]) -> dx[M, K], dw[E, N, K]
void k_moe_grouped_linear_bwd(const Args &c) {
  const int64_t M = c.in_dim(1, 0), K = c.in_dim(1, 1), E = c.in_dim(2, 0), N = c.in_dim(2, 1), S = c.in_dim(3, 0);
  const float *dy = c.in<const float>(0), *x = c.in<const float>(1), *w = c.in<const float>(2);
  const int32_t *counts = c.in<const int32_t>(3);
  if (M > 0 && K > 0) {
    const dim3 grid(tiles(M) + static_cast<unsigned>(S), tiles(K));
    CTR_LAUNCH(grouped_rows_kernel<false>, grid, kGemmThreads, 0, c.stream())(dy, counts, S, w, c.out<float>(0), M, N, K, E);
  }
  if (E > 0 && N > 0 && K > 0) {
    const dim3 grid(tiles(K), tiles(N), static_cast<unsigned>(E < 65535 ? E : 65535));
    CTR_LAUNCH(grouped_dw_kernel, grid, kGemmThreads, 0, c.stream())(dy, x, counts, S, c.out<float>(1), M, K, N, E,
                                                            c.params<ctr_grouped_linear_params>().weight_grad_scale);
  }
}

// (logits, experts) -> stats[2E + 1]
void k_moe_aux_stats(const Args &c) {
  const int64_t E = c.in_dim(0, -1), k = c.in_dim(1, -1), N = per(c.in_numel(0), E);
  const int64_t chunks = (E + kSumChunk - 1) / kSumChunk;
  CTR_LAUNCH(aux_sums_kernel<true>, static_cast<unsigned>(chunks < 1 ? 1 : chunks), kSumThreads, 0, c.stream())(
      c.in<const float>(0), c.in<const int32_t>(1), c.out<float>(0), N, E, k, 0.0f);
}

// (logits, experts, stats) -> loss
void k_moe_aux_loss_global(const Args &c) {
  const int64_t E = c.in_dim(0, -1), k = c.in_dim(1, -1);
  CTR_LAUNCH(aux_loss_global_kernel, 1, 1, 0, c.stream())(c.in<const float>(2), c.out<float>(0), E, k,
                                                  c.params<ctr_moe_loss_params>().coef);
}

// (dloss, logits, experts, stats) -> dlogits
void k_moe_aux_loss_global_bwd(const Args &c) {
  const int64_t E = c.in_dim(1, -1), k = c.in_dim(2, -1), N = per(c.in_numel(1), E);
  if (N == 0) return;
  CTR_LAUNCH(aux_bwd_kernel<true>, token_grid(N), kTokenThreads, 0, c.stream())(
      c.in<const float>(0), c.in<const float>(1), nullptr, c.in<const float>(3), c.out<float>(0), N, E, k,
      c.params<ctr_moe_loss_params>().coef);
}

}  // namespace

const KernelEntry kMoeKernels[] = {
    {"moe_router", bind<k_moe_router>},
    {"moe_router_bwd", bind<k_moe_router_bwd>},
    {"moe_aux_loss", bind<k_moe_aux_loss>},
    {"moe_aux_loss_bwd", bind<k_moe_aux_loss_bwd>},
    {"moe_z_loss", bind<k_moe_z_loss>},
    {"moe_z_loss_bwd", bind<k_moe_z_loss_bwd>},
    {"moe_permute", bind<k_moe_permute>},
    {"moe_permute_bwd", bind<k_moe_permute_bwd>},
    {"moe_unpermute", bind<k_moe_unpermute>},
    {"moe_unpermute_bwd", bind<k_moe_unpermute_bwd>},
    {"moe_grouped_linear", bind<k_moe_grouped_linear>},
    {"moe_grouped_linear_bwd", bind<k_moe_grouped_linear_bwd>},
    {"moe_aux_stats", bind<k_moe_aux_stats>},
    {"moe_aux_loss_global", bind<k_moe_aux_loss_global>},
    {"moe_aux_loss_global_bwd", bind<k_moe_aux_loss_global_bwd>},
};
const size_t kMoeKernelCount = sizeof(kMoeKernels) / sizeof(kMoeKernels[0]);

}  // namespace ctr::cuda
