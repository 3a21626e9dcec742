/*
 * Decoded attributes of the ops that have any, one C struct per op family.
 *
 * The op registry (lib/graph/ops.cc) decodes a node's attributes once, with
 * their defaults, into these structs when a step is created; kernels of every
 * backend read them through ctr_kernel_args.params. Plain C, so a backend
 * plugin compiled by another compiler (nvcc) shares the layout.
 */
#ifndef CTR_KERNELS_OP_PARAMS_H
#define CTR_KERNELS_OP_PARAMS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* embedding, embedding_bwd */
typedef struct ctr_embedding_params {
  int64_t padding_idx;    /* "padding_idx", default -1 (none): the row whose lookups
                             pass no gradient back to the table, as PyTorch's */
} ctr_embedding_params;

/* layernorm, rmsnorm and their backward ops */
typedef struct ctr_norm_params {
  float eps;              /* "eps", default 1e-5 */
} ctr_norm_params;

/* rope, rope_bwd: x[B, T, heads * head_dim] */
typedef struct ctr_rope_params {
  int64_t heads;          /* "heads", required */
  float theta;            /* "theta", default 10000 */
  int32_t interleaved;    /* "interleaved", default 0: pairs (i, i + D/2); 1: (2i, 2i+1) */
  int64_t cp_ranks;       /* cp_rope: "cp_ranks", default 1; > 1: the rows are this rank's
                             two chunks of a context-parallel sequence (ctr_cp_position) */
  int64_t cp_index;       /* cp_rope: "cp_index", default 0: this rank's place on the cp axis */
} ctr_rope_params;

/* attention, attention_bwd */
typedef struct ctr_attention_params {
  int64_t heads;          /* "heads", required */
  int64_t kv_heads;       /* "kv_heads", default heads */
  float scale;            /* "scale", default 1/sqrt(head_dim) */
  int32_t causal;         /* "causal", default 1 */
  int64_t window;         /* "window", default 0 (none); with causal, query t sees the
                             keys j with t - window < j <= t (a sliding window) */
  float softcap;          /* "softcap", default 0 (none); > 0: each scaled score s is
                             capped to softcap * tanh(s / softcap) before the mask */
  int64_t cp_ranks;       /* cp_attention: "cp_ranks", default 1; > 1: the query rows are this
                             rank's two chunks, the key rows every rank's in rank order */
  int64_t cp_index;       /* cp_attention: "cp_index", default 0: this rank's place on cp;
                             -1: the query rows are every rank's chunks in rank order too,
                             keys and values as many (heads exchanged all-to-all) */
} ctr_attention_params;

/* Context parallelism splits a sequence of T positions into 2 * ranks chunks of
   L = T / (2 * ranks); rank r holds chunks r and 2 * ranks - 1 - r (so that each
   rank's share of a causal mask is the same), in that order, as rows of 2 * L.
   The global position of row t of rank r's rows: */
static inline int64_t ctr_cp_position(int64_t t, int64_t rows, int64_t ranks, int64_t r) {
  const int64_t L = rows / 2;
  const int64_t chunk = t < L ? r : 2 * ranks - 1 - r;
  return chunk * L + t % L;
}

/* cp_attention_block, cp_attention_block_bwd (ring attention over cp) */
typedef struct ctr_attention_block_params {
  ctr_attention_params attention;  /* as cp_attention's; cp_index: the query rows' rank */
  int64_t cp_source;               /* "cp_source": the rank whose two chunks are the key rows */
} ctr_attention_block_params;

/* attn_merge, attn_merge_bwd: two attentions over disjoint keys merged by their
   log-sum-exps; o[B, T, heads * head_dim], lse[B, heads, T] */
typedef struct ctr_attn_merge_params {
  int64_t heads;          /* "heads", required */
} ctr_attn_merge_params;

/* transpose */
typedef struct ctr_transpose_params {
  int32_t ndim;
  int32_t perm[8];        /* "perm" */
} ctr_transpose_params;

/* moe_router, moe_router_bwd */
typedef struct ctr_moe_router_params {
  int64_t top_k;          /* "top_k", required */
  int32_t sigmoid;        /* "score": "softmax" (default) 0, "sigmoid" 1 */
  int32_t renorm;         /* "renorm", default 1 when top_k > 1 */
} ctr_moe_router_params;

/* moe_aux_loss, moe_z_loss and their backward ops */
typedef struct ctr_moe_loss_params {
  float coef;             /* "coef", default 0.01 (aux) or 0.001 (z) */
} ctr_moe_loss_params;

/* moe_grouped_linear, moe_grouped_linear_bwd */
typedef struct ctr_grouped_linear_params {
  float weight_grad_scale; /* "weight_grad_scale", default 1: the weight gradient's factor */
} ctr_grouped_linear_params;

/* clamp, clamp_bwd: x held to [min, max] */
typedef struct ctr_clamp_params {
  float min;              /* "min", default -inf (none) */
  float max;              /* "max", default +inf (none) */
} ctr_clamp_params;

/* pow, pow_bwd: x^exponent */
typedef struct ctr_pow_params {
  float exponent;         /* "exponent", required */
} ctr_pow_params;

/* vocab_ce_stats, vocab_ce_loss, vocab_ce_bwd: cross-entropy over logits whose
   vocabulary is split over ranks; this rank holds words [offset, offset + valid)
   in the first `valid` of its columns (the rest pad the last rank's block). */
typedef struct ctr_vocab_ce_params {
  int64_t offset;         /* "offset": the first word of this rank's columns */
  int64_t valid;          /* "valid": how many of its columns are words */
  int64_t ranks;          /* "ranks": the ranks the vocabulary is split over */
} ctr_vocab_ce_params;

/* vocab_embedding, vocab_embedding_bwd: lookups in a table split over ranks
   by rows; this rank's rows hold words [offset, offset + valid). */
typedef struct ctr_vocab_embedding_params {
  int64_t offset;         /* "offset" */
  int64_t valid;          /* "valid" */
  int64_t padding_idx;    /* "padding_idx", default -1 (none), a word of the whole vocabulary */
} ctr_vocab_embedding_params;

/* gelu, gelu_bwd */
typedef struct ctr_gelu_params {
  int32_t exact;          /* "approximate": "tanh" (default) 0, "none" 1 */
} ctr_gelu_params;

/* softmax, log_softmax and their backward ops */
typedef struct ctr_softmax_params {
  int32_t dim;            /* "dim", default -1; negatives count from the end */
} ctr_softmax_params;

/* sum, mean, amax, var and their backward ops */
typedef struct ctr_reduce_params {
  int32_t ndims;
  int32_t dims[8];        /* "dims", required; as given (negatives count from the end) */
  int32_t keepdim;        /* "keepdim", default 0 */
  int32_t correction;     /* "correction" (var), default 1 */
} ctr_reduce_params;

/* masked_fill */
typedef struct ctr_masked_fill_params {
  float value;            /* "value", required; may be infinite */
} ctr_masked_fill_params;
/* slice, slice_bwd: along dim, rows start, start + step, ... (len of them);
 * the tensor is read as [outer, size, inner] around dim (size: the sliced
 * input's dim). Negative and clamped bounds are resolved at decode. */
typedef struct ctr_slice_params {
  int64_t outer, size, inner;
  int64_t start;          /* "start", default 0 */
  int64_t len;            /* rows of the output along dim */
  int64_t step;           /* "step", default 1 */
} ctr_slice_params;

/* cat: along dim; the tensors are read as [outer, size * inner] around dim */
typedef struct ctr_cat_params {
  int64_t outer, inner;
} ctr_cat_params;

#ifdef __cplusplus
}
#endif

#endif /* CTR_KERNELS_OP_PARAMS_H */
