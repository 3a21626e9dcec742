// The CPU backend's kernels: forward and backward of every op in the graph op set.
//
// Every kernel works on fp32 row-major contiguous buffers (token ids are int32);
// bf16 storage is widened around them by the backend, except for the GEMMs and
// bias gradients with bf16 code of their own and the conversions themselves.
// A kernel takes plain pointers and sizes, and never allocates on the heap in its
// hot loop. Loops are split over the process thread pool (core/thread_pool.h);
// GEMMs go to oneDNN's matmul (OpenBLAS without it; gemm.cc). Kernels trust their
// arguments: the graph verifier and the step check shapes, ranges and token ids
// before anything runs, so no kernel validates input.
//
// Backward kernels that produce a parameter gradient take `accumulate`: false
// overwrites the output, true adds to it (gradient accumulation, shared weights).
// Backward kernels producing activation gradients always overwrite.
#pragma once

#include <cstdint>
#include <string>

namespace ctr::cpu {

// ---------------------------------------------------------------------------
// CPU features (features.cc): what the running CPU offers, read by cpuid once
// per process, less what CTR_CPU_FEATURES turns off.
struct CpuFeatures {
  bool avx512f = false;
  bool avx512_bf16 = false;  // vdpbf16ps, vcvtneps2bf16
  bool amx_bf16 = false;     // AMX tiles with bf16 dot products
  bool masked = false;       // CTR_CPU_FEATURES was set
};
const CpuFeatures &cpu_features();
// Empty, or what is wrong with CTR_CPU_FEATURES (the CPU backend refuses to start).
const std::string &cpu_features_error();
// Empty when bf16 precision can run on this CPU, else why not.
std::string bf16_unavailable();
// Whether the library was built with oneDNN (the GEMMs, gemm.cc and dnnl_matmul.cc).
bool have_dnnl();

// ---------------------------------------------------------------------------
// bf16 storage (bf16.cc): the upper 16 bits of an f32. Widening is exact;
// narrowing rounds to nearest even (a NaN stays a quiet NaN). Both split large
// arrays over the thread pool.
void bf16_to_f32(const uint16_t *x, float *y, int64_t n);
void f32_to_bf16(const float *x, uint16_t *y, int64_t n);

// bf16 products with f32 accumulation (gemm.cc), on oneDNN's matmul (AMX
// or AVX512_BF16 code chosen by oneDNN at run time). Only when have_dnnl().
// C[M,N] = op(A) op(B) (+ bias[N]), A and B bf16 (bias in C's dtype), C f32 or
// bf16 (c_bf16), row-major with row strides lda/ldb/ldc; overwrites C.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t *A,
               int64_t lda, const uint16_t *B, int64_t ldb, void *C, int64_t ldc, bool c_bf16,
               const void *bias);

// ---------------------------------------------------------------------------
// The machine's fp32 FMA peak (FLOP/s) over the process thread pool, measured
// once per process by a register-only loop in the widest vectors the CPU has
// (peak.cc): what MFU is reported against.
double fma_peak_flops();
// The bf16 peak in the same way: vdpbf16ps chains, or AMX tile products where
// the bf16 GEMMs use AMX; 0 where bf16 is unavailable.
double bf16_peak_flops();

// ---------------------------------------------------------------------------
// GEMM

// C[M,N] = alpha * op(A) * op(B) + beta * C, row-major, op = transpose if set.
// lda/ldb/ldc are row strides in elements.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
          int64_t ldc);
// The same as one product call on the calling thread, however large. gemm cuts
// a large product by the thread count, and a block's bits depend on the cut;
// kernels that cut their work into pieces themselves use this so that each
// piece's bits depend on the piece alone.
void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                 const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                 int64_t ldc);

// linear: y[M,N] = x[M,K] * w[N,K]^T (+ b[N] when b is not null).
void linear_fwd(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t K,
                int64_t N);
// dx[M,K] = dy[M,N] * w[N,K]
void linear_bwd_x(const float *dy, const float *w, float *dx, int64_t M, int64_t K, int64_t N);
// dw[N,K] (+)= dy[M,N]^T * x[M,K]
void linear_bwd_w(const float *dy, const float *x, float *dw, int64_t M, int64_t K, int64_t N,
                  bool accumulate);
// db[N] (+)= sum over rows of dy[M,N]
void linear_bwd_b(const float *dy, float *db, int64_t M, int64_t N, bool accumulate);
// The same from bf16 dy (widened exactly as it is read; the same sums).
void linear_bwd_b_bf16(const uint16_t *dy, float *db, int64_t M, int64_t N, bool accumulate);

// matmul: c[batch,M,N] = a[batch,M,K] * b[batch,K,N]; when b_batch == 1, b is
// shared by every batch entry.
void matmul_fwd(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K,
                int64_t N, bool b_shared);
// da = dc * b^T ; db (+)= a^T * dc (summed over batch when b is shared).
void matmul_bwd(const float *dc, const float *a, const float *b, float *da, float *db,
                int64_t batch, int64_t M, int64_t K, int64_t N, bool b_shared);

// ---------------------------------------------------------------------------
// Embedding. ids are in [0, V).

// out[n,C] = table[ids[n], :]
void embedding_fwd(const int32_t *ids, const float *table, float *out, int64_t n, int64_t V,
                   int64_t C);
// The same with a bf16 table and output: the rows copied as they are.
void embedding_fwd_bf16(const int32_t *ids, const uint16_t *table, uint16_t *out, int64_t n, int64_t C);
// dtable[V,C] (+)= scatter-add of dout[n,C] rows into rows ids[n], leaving out the
// rows whose id is padding_idx (-1: none).
void embedding_bwd(const int32_t *ids, const float *dout, float *dtable, int64_t n, int64_t V,
                   int64_t C, bool accumulate, int64_t padding_idx = -1);
// The lookups of a table split over ranks by rows: this rank's table[rows, C]
// holds words [offset, offset + valid). A word elsewhere gives a zero row (the
// all-reduce over the ranks adds the holder's); backward adds only this rank's
// words (never padding_idx, a word of the whole vocabulary).
void vocab_embedding_fwd(const int32_t *ids, const float *table, float *out, int64_t n, int64_t C, int64_t offset,
                         int64_t valid);
void vocab_embedding_bwd(const int32_t *ids, const float *dout, float *dtable, int64_t n, int64_t rows, int64_t C,
                         int64_t offset, int64_t valid, int64_t padding_idx);

// ---------------------------------------------------------------------------
// Element-wise with trailing broadcast: b has nb elements, nb divides n, and
// b[i % nb] pairs with a[i] (bias, positional table, per-channel scale).

void add_fwd(const float *a, const float *b, float *out, int64_t n, int64_t nb);
// db[nb] (+)= sum of dout over the broadcast rows. (da = dout is an alias, no kernel.)
void reduce_rows(const float *dout, float *db, int64_t n, int64_t nb, bool accumulate);
void mul_fwd(const float *a, const float *b, float *out, int64_t n, int64_t nb);
// da[n] = dout * b ; db[nb] (+)= sum over rows of dout * a. Either output may be null.
void mul_bwd(const float *dout, const float *a, const float *b, float *da, float *db, int64_t n,
             int64_t nb, bool accumulate_db);
// out[n] = a[n] + b[n] (same size; gradient accumulation of activations).
void add_same(const float *a, const float *b, float *out, int64_t n);
// y[n] = alpha * x[n]
void scale(const float *x, float *y, int64_t n, float alpha);

// ---------------------------------------------------------------------------
// General broadcasting (broadcast.cc), NumPy/PyTorch rules: shapes of at most
// kMaxDims dims aligned at their trailing end, a dim of size 1 stretching to
// the other's size. Dims are merged where both operands stay contiguous, so a
// scalar operand or a trailing bias costs no index arithmetic per element.

constexpr int kMaxDims = 8;

struct ShapeRef {
  const int64_t *dims;
  int rank;
};

enum class Binary { Add, Sub, Mul, Div };

// out[os] = a[as] op b[bs]; os is the broadcast of as and bs.
void binary_fwd(Binary op, const float *a, ShapeRef as, const float *b, ShapeRef bs, float *out,
                ShapeRef os);
// out[os] = scale * x[xs] broadcast to os (expand; sum and mean gradients).
void broadcast_to(const float *x, ShapeRef xs, float *out, ShapeRef os, float scale = 1.0f);
// out[xs] = mask != 0 ? value : x, mask[ms] broadcast to xs.
void masked_fill(const float *x, const float *mask, ShapeRef ms, float *out, ShapeRef xs,
                 float value);
// div's gradient for b before reduction: out[os] = -(g * (y / b)), with g and
// y (the forward output) of shape os and b[bs] broadcast (PyTorch's formula).
void div_bwd_b(const float *g, const float *y, const float *b, ShapeRef bs, float *out,
               ShapeRef os);

// ---------------------------------------------------------------------------
// Reductions (reduce.cc): x[xs] reduced over the dims where os (aligned at the
// trailing end, missing leading dims counting as 1) has size 1 and xs does
// not; out holds numel(os) elements. Each output is summed in a fixed order by
// one thread. N below is the number of elements reduced into one output.

enum class Reduction { Sum, Mean, Amax, Var };

// Sum (also reduce_to), Mean (sum / N), Amax, Var (sum of squared deviations
// / (N - correction), with the mean written to `mean` when not null).
void reduce(Reduction op, const float *x, ShapeRef xs, float *out, ShapeRef os,
            int64_t correction = 1, float *mean = nullptr);
// gx[xs] = g / ties where x equals y (its output's max), 0 elsewhere; ties is
// the count of such elements of that output (PyTorch's amax gradient).
void amax_bwd(const float *g, const float *x, const float *y, float *gx, ShapeRef xs, ShapeRef os);
// gx[xs] = g * 2 (x - mean) / (N - correction).
void var_bwd(const float *g, const float *x, const float *mean, float *gx, ShapeRef xs,
             ShapeRef os, int64_t correction);

// ---------------------------------------------------------------------------
// Normalisation over the last dim C of R rows.

// y = (x - mean) * rstd * w + b ; saves mean[R] and rstd[R] for backward.
void layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean,
                   float *rstd, int64_t R, int64_t C, float eps);
// dx overwritten; dw, db (+)= ; db may be null when the op had no bias.
void layernorm_bwd(const float *dy, const float *x, const float *w, const float *mean,
                   const float *rstd, float *dx, float *dw, float *db, int64_t R, int64_t C,
                   bool accumulate);
// y = x * rstd * w with rstd = 1/sqrt(mean(x^2) + eps); saves rstd[R].
void rmsnorm_fwd(const float *x, const float *w, float *y, float *rstd, int64_t R, int64_t C,
                 float eps);
void rmsnorm_bwd(const float *dy, const float *x, const float *w, const float *rstd, float *dx,
                 float *dw, int64_t R, int64_t C, bool accumulate);
// The same on bf16 storage of x, y, dy and dx (weights, statistics and the
// weight gradients f32): each row widened, computed as above, rounded once, so
// the bits equal the f32 kernels' on widened copies.
void layernorm_fwd_bf16(const uint16_t *x, const float *w, const float *b, uint16_t *y, float *mean, float *rstd,
                        int64_t R, int64_t C, float eps);
void layernorm_bwd_bf16(const uint16_t *dy, const uint16_t *x, const float *w, const float *mean,
                        const float *rstd, uint16_t *dx, float *dw, float *db, int64_t R, int64_t C,
                        bool accumulate);
void rmsnorm_fwd_bf16(const uint16_t *x, const float *w, uint16_t *y, float *rstd, int64_t R, int64_t C,
                      float eps);
void rmsnorm_bwd_bf16(const uint16_t *dy, const uint16_t *x, const float *w, const float *rstd, uint16_t *dx,
                      float *dw, int64_t R, int64_t C, bool accumulate);

// ---------------------------------------------------------------------------
// Activations (n elements).

// GELU, tanh approximation (as GPT-2 and torch's approximate="tanh").
void gelu_fwd(const float *x, float *y, int64_t n);
void gelu_bwd(const float *dy, const float *x, float *dx, int64_t n);
// GELU, exact (torch's approximate="none"): 0.5 x (1 + erf(x / sqrt 2)).
void gelu_exact_fwd(const float *x, float *y, int64_t n);
void gelu_exact_bwd(const float *dy, const float *x, float *dx, int64_t n);
// SiLU: x * sigmoid(x)
void silu_fwd(const float *x, float *y, int64_t n);
void silu_bwd(const float *dy, const float *x, float *dx, int64_t n);
// GeGLU: y = gelu(gate) * up, the tanh approximation or exact; backward overwrites dgate
// and dup.
void geglu_fwd(const float *gate, const float *up, float *y, int64_t n, bool exact);
void geglu_bwd(const float *dy, const float *gate, const float *up, float *dgate, float *dup,
               int64_t n, bool exact);
// SwiGLU: y = silu(gate) * up
void swiglu_fwd(const float *gate, const float *up, float *y, int64_t n);
void swiglu_bwd(const float *dy, const float *gate, const float *up, float *dgate, float *dup,
                int64_t n);

// ---------------------------------------------------------------------------
// Element-wise unary math (n elements), the formulas of common/math.h (libm).
// Domains are not checked (log of a negative gives NaN, as libm does).

enum class Unary { Exp, Log, Tanh, Erf, Rsqrt, Sqrt, Neg, Reciprocal, Sigmoid, Relu, Clamp, Pow };

// y = f(x); p is pow's exponent, p and q clamp's bounds; the other ops ignore them.
void unary_fwd(Unary op, const float *x, float *y, int64_t n, float p = 0.0f, float q = 0.0f);
// dx = dy * f'(x), from v: the forward output y for exp, tanh, sigmoid, sqrt,
// rsqrt and reciprocal, the input x for log, erf, relu, clamp and pow; neg
// reads no v (it may be null) and gives dx = -dy.
void unary_bwd(Unary op, const float *dy, const float *v, float *dx, int64_t n, float p = 0.0f,
               float q = 0.0f);

// ---------------------------------------------------------------------------
// Rotary position embedding on x[B,T,H*D] (H heads of size D, D even), the
// "rotate half" form used by Llama/NeoX: for i < D/2 the pair (x[i], x[i+D/2]) at
// position t is rotated by angle t * theta^(-2i/D). interleaved: the pair is
// (x[2i], x[2i+1]) instead (Meta's complex form), same angles. Backward is the
// inverse rotation. cp_ranks > 1: row t is at ctr_cp_position(t, T, cp_ranks,
// cp_index) of a context-parallel sequence (cp_rope).
void rope_fwd(const float *x, float *y, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
              bool interleaved = false, int64_t cp_ranks = 1, int64_t cp_index = 0);
void rope_bwd(const float *dy, float *dx, int64_t B, int64_t T, int64_t H, int64_t D,
              float theta, bool interleaved = false, int64_t cp_ranks = 1, int64_t cp_index = 0);
void rope_fwd_bf16(const uint16_t *x, uint16_t *y, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   bool interleaved, int64_t cp_ranks, int64_t cp_index);
void rope_bwd_bf16(const uint16_t *dy, uint16_t *dx, int64_t B, int64_t T, int64_t H, int64_t D, float theta,
                   bool interleaved, int64_t cp_ranks, int64_t cp_index);

// ---------------------------------------------------------------------------
// Multi-head attention with grouped-query heads.
// q[B,T,Hq*D], k and v [B,T,Hkv*D], Hq % Hkv == 0; query head h reads kv head
// h / (Hq/Hkv). out[B,T,Hq*D]. probs[B,Hq,T,T] keeps the softmax for backward
// (row t is zero past column t when causal). scale is usually 1/sqrt(D). window > 0
// (causal only): row t sees columns t - window < j <= t, the rest of the row is zero.
// softcap > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
void attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs,
                   int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                   bool causal, int64_t window = 0, float softcap = 0.0f);
// dq, dk, dv overwritten.
void attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                   const float *probs, float *dq, float *dk, float *dv, int64_t B, int64_t T,
                   int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                   int64_t window = 0, float softcap = 0.0f);
// The same on bf16 storage of q, k, v, out, dout, dq, dk and dv (probabilities f32).
void attention_fwd_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, uint16_t *out, float *probs,
                        int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                        int64_t window, float softcap);
void attention_bwd_bf16(const uint16_t *dout, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                        const float *probs, uint16_t *dq, uint16_t *dk, uint16_t *dv, int64_t B, int64_t T,
                        int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal, int64_t window,
                        float softcap);

// Context-parallel attention (cp_attention): q[B,Tq,Hq*D] holds this rank's two
// chunks of the sequence, k and v [B,ranks*Tq,Hkv*D] every rank's rows in rank
// order (an all-gather over cp); the causal mask and the window compare global
// positions (ctr_cp_position). probs[B,Hq,Tq,ranks*Tq]; the rest as above.
void cp_attention_fwd(const float *q, const float *k, const float *v, float *out, float *probs,
                      int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                      bool causal, int64_t window, float softcap, int64_t ranks, int64_t index);
// dq overwritten; dk and dv overwritten with this rank's queries' share of the
// keys' gradients (a reduce-scatter over cp sums the shares).
void cp_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                      const float *probs, float *dq, float *dk, float *dv, int64_t B, int64_t Tq,
                      int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                      int64_t window, float softcap, int64_t ranks, int64_t index);
// One block of ring attention (cp_attention_block): this rank's query rows
// (index) against rank source's two chunks of keys and values [B, Tq, Hkv*D];
// out normalised over the block's visible keys, lse[B, Hq, Tq] their log-sum-exp
// (-inf and out 0 where a row sees none), probs [B, Hq, Tq, Tq]. The backward
// takes the gradients of both outputs.
void cp_attention_block_fwd(const float *q, const float *k, const float *v, float *out, float *lse, float *probs,
                            int64_t B, int64_t Tq, int64_t Hq, int64_t Hkv, int64_t D, float scale, bool causal,
                            int64_t window, float softcap, int64_t ranks, int64_t index, int64_t source);
void cp_attention_block_bwd(const float *dout, const float *dlse, const float *q, const float *k, const float *v,
                            const float *probs, float *dq, float *dk, float *dv, int64_t B, int64_t Tq, int64_t Hq,
                            int64_t Hkv, int64_t D, float scale, bool causal, int64_t window, float softcap,
                            int64_t ranks, int64_t index, int64_t source);
// Two blocks' attention merged by their log-sum-exps (attn_merge): o [B, T, H*D], l [B, H, T].
void attn_merge_fwd(const float *oa, const float *la, const float *ob, const float *lb, float *out, float *lse,
                    int64_t B, int64_t T, int64_t H, int64_t D);
void attn_merge_bwd(const float *dout, const float *dlse, const float *oa, const float *la, const float *ob,
                    const float *lb, const float *out, const float *lse, float *doa, float *dla, float *dob,
                    float *dlb, int64_t B, int64_t T, int64_t H, int64_t D);

// ---------------------------------------------------------------------------
// Softmax over the last dim C of R rows.
void softmax_fwd(const float *x, float *y, int64_t R, int64_t C);
void softmax_bwd(const float *dy, const float *y, float *dx, int64_t R, int64_t C);
// Over the middle dim of x[outer, C, inner] (a dim other than the last; inner
// > 1), in tiles of columns of the inner dim.
void softmax_dim_fwd(const float *x, float *y, int64_t outer, int64_t C, int64_t inner);
void softmax_dim_bwd(const float *dy, const float *y, float *dx, int64_t outer, int64_t C,
                     int64_t inner);
// log_softmax over the middle dim of x[outer, C, inner] (inner == 1: the last
// dim): y = x - max - log(sum exp(x - max)). Backward: dx = dy - exp(y) sum(dy).
void log_softmax_fwd(const float *x, float *y, int64_t outer, int64_t C, int64_t inner);
void log_softmax_bwd(const float *dy, const float *y, float *dx, int64_t outer, int64_t C,
                     int64_t inner);

// ---------------------------------------------------------------------------
// Fused cross-entropy over logits[R,V] with targets[R]; a target < 0 is ignored.
// loss[0] = mean over counted rows of (logsumexp(row) - row[target]); 0 when no
// row counts. lse[R] is saved for backward; *count receives the counted rows.
void cross_entropy_fwd(const float *logits, const int32_t *targets, float *loss, float *lse,
                       int64_t *count, int64_t R, int64_t V);
// dlogits[R,V] = dloss * (softmax(row) - onehot(target)) / count ; zero rows for ignored.
void cross_entropy_bwd(const float *logits, const int32_t *targets, const float *lse,
                       float dloss, int64_t count, float *dlogits, int64_t R, int64_t V);
// The same on bf16 logits and dlogits (each row widened, computed as above and
// rounded once: the bits of the f32 kernels on widened copies).
void cross_entropy_fwd_bf16(const uint16_t *logits, const int32_t *targets, float *loss, float *lse,
                            int64_t *count, int64_t R, int64_t V);
void cross_entropy_bwd_bf16(const uint16_t *logits, const int32_t *targets, const float *lse, float dloss,
                            int64_t count, uint16_t *dlogits, int64_t R, int64_t V);

// Cross-entropy over a vocabulary split over ranks: this rank's logits[R,V]
// hold words [offset, offset + valid) in their first `valid` columns.
// stats[R,3] per row: the max of its valid columns, the sum of exp(x - max)
// over them, and the logit of the target when this rank holds it (else 0).
void vocab_ce_stats(const float *logits, const int32_t *targets, float *stats, int64_t R, int64_t V,
                    int64_t offset, int64_t valid);
// From every rank's stats (all[ranks * R, 3], rank-major): lse[R] of the whole
// vocabulary and loss[0] the mean of lse - target logit over counted rows.
void vocab_ce_loss(const int32_t *targets, const float *all, float *loss, float *lse, int64_t *count, int64_t R,
                   int64_t ranks);
// dlogits[R,V] = dloss * (softmax - onehot) / count over this rank's columns;
// padding columns and ignored rows zero.
void vocab_ce_bwd(const float *logits, const int32_t *targets, const float *lse, float dloss, int64_t count,
                  float *dlogits, int64_t R, int64_t V, int64_t offset, int64_t valid);

// ---------------------------------------------------------------------------
// Mixture of experts (moe.cc). N tokens, E experts, k experts per token, D the
// width; slots[n*k + j] is the row of the permuted buffer xp[M = N*k, D] that
// holds token n's j-th choice, rows grouped by expert in slot order.

// scores = softmax or sigmoid of logits[N,E]; experts[N,k] the k best (ties to
// the lower index), weights[N,k] their scores, divided by their sum if renorm.
void moe_router_fwd(const float *logits, float *weights, int32_t *experts, float *scores, int64_t N,
                    int64_t E, int64_t k, bool sigmoid, bool renorm);
void moe_router_bwd(const float *dweights, const float *scores, const int32_t *experts, float *dlogits,
                    int64_t N, int64_t E, int64_t k, bool sigmoid, bool renorm);
// loss = coef * E * sum_e f_e P_e: f_e the fraction of the N*k assignments to
// expert e, P_e the mean softmax probability of e. Gradient through P only.
void moe_aux_loss_fwd(const float *logits, const int32_t *experts, float *loss, int64_t N, int64_t E,
                      int64_t k, float coef);
void moe_aux_loss_bwd(float dloss, const float *logits, const int32_t *experts, float *dlogits, int64_t N,
                      int64_t E, int64_t k, float coef);
// loss = coef * mean over tokens of logsumexp(logits)^2.
void moe_z_loss_fwd(const float *logits, float *loss, int64_t N, int64_t E, float coef);
void moe_z_loss_bwd(float dloss, const float *logits, float *dlogits, int64_t N, int64_t E, float coef);
// xp[slots[i]] = x[i / k]; counts[E] the rows per expert.
void moe_permute_fwd(const float *x, const int32_t *experts, float *xp, int32_t *counts, int32_t *slots,
                     int64_t N, int64_t k, int64_t D, int64_t E);
// dx[n] = sum_j dxp[slots[n*k + j]] (dx overwritten).
void moe_permute_bwd(const float *dxp, const int32_t *slots, float *dx, int64_t N, int64_t k, int64_t D,
                     int64_t M);
// y[n] = sum_j weights[n,j] * yp[slots[n*k + j]].
void moe_unpermute_fwd(const float *yp, const int32_t *slots, const float *weights, float *y, int64_t N,
                       int64_t k, int64_t D, int64_t M);
// dyp[slots[n*k+j]] = weights[n,j] dy[n] (other rows zero); dweights[n,j] = <dy[n], yp[slot]>.
void moe_unpermute_bwd(const float *dy, const float *yp, const int32_t *slots, const float *weights,
                       float *dyp, float *dweights, int64_t N, int64_t k, int64_t D, int64_t M);
// y[M,N]: segment s of x[M,K] (counts[S] rows per segment, in order, clamped
// to M) times w[s % E]^T (w[E,N,K]); rows past the last counted one are zero.
void grouped_linear_fwd(const float *x, const int32_t *counts, int64_t S, const float *w, float *y, int64_t M,
                        int64_t K, int64_t N, int64_t E);
// dx[M,K] and dw[E,N,K] overwritten (an expert without rows gets zero); dw is
// multiplied by weight_grad_scale.
void grouped_linear_bwd(const float *dy, const float *x, const int32_t *counts, int64_t S, const float *w,
                        float *dx, float *dw, int64_t M, int64_t K, int64_t N, int64_t E, float weight_grad_scale);
// stats[2E+1]: assignments per expert, softmax sums per expert, token count N.
void moe_aux_stats(const float *logits, const int32_t *experts, float *stats, int64_t N, int64_t E, int64_t k);
// The load-balancing loss of statistics summed over every rank, and this
// rank's share of its gradient (see moe.cc).
void moe_aux_loss_global_fwd(const float *stats, float *loss, int64_t E, int64_t k, float coef);
void moe_aux_loss_global_bwd(float dloss, const float *logits, const float *stats, float *dlogits, int64_t N,
                             int64_t E, int64_t k, float coef);

// ---------------------------------------------------------------------------
// Layout.

// y = x permuted: x has shape dims[0..ndim), y has shape dims[perm[i]]; ndim <= 6.
// Values are moved, never computed on: the int32 form serves token ids.
void transpose(const float *x, float *y, const int64_t *dims, const int *perm, int ndim);
void transpose(const int32_t *x, int32_t *y, const int64_t *dims, const int *perm, int ndim);

// Slices and concatenation (layout.cc) of 4-byte elements (f32 or i32), as row
// copies. x is [outer, size, inner]; y[outer, len, inner] takes x's rows
// start, start + step, ... along the middle dim.
void slice_fwd(const void *x, void *y, int64_t outer, int64_t size, int64_t inner, int64_t start,
               int64_t len, int64_t step);
// dx[outer, size, inner] = zeros with dy's rows put back where slice_fwd took them.
void slice_bwd(const float *dy, float *dx, int64_t outer, int64_t size, int64_t inner, int64_t start,
               int64_t len, int64_t step);
// y[outer, sum of widths] = the xs side by side: x_k is [outer, widths[k]] (in
// elements), n inputs.
void cat_fwd(const void *const *xs, const int64_t *widths, int64_t n, void *y, int64_t outer);
void copy(const void *x, void *y, int64_t bytes);
void fill(float *y, float value, int64_t n);

// ---------------------------------------------------------------------------
// Optimizer and reductions.

// sum of squares, accumulated in double.
double sum_squares(const float *x, int64_t n);

// One AdamW step on n elements with decoupled weight decay:
//   g = grad * grad_scale
//   m = beta1 m + (1-beta1) g ; v = beta2 v + (1-beta2) g^2
//   p -= lr * ( (m / (1-beta1^t)) / (sqrt(v / (1-beta2^t)) + eps) + weight_decay * p )
// t >= 1 is the step count for bias correction (as torch.optim.AdamW).
void adamw_update(float *param, const float *grad, float *m, float *v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t t,
                  float grad_scale);

// The same update over segments of flat buffers in one pass: segment k covers
// elements [offsets[k], offsets[k] + counts[k]) with weight decay weight_decay[k];
// elements outside every segment are left alone. Per element it computes
// exactly what adamw_update does.
void adamw_flat(float *param, const float *grad, float *m, float *v, const int64_t *offsets,
                const int64_t *counts, const float *weight_decay, int64_t nseg, float lr, float beta1,
                float beta2, float eps, int64_t t, float grad_scale);

}  // namespace ctr::cpu
