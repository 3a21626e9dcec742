// Built-in model presets, built directly as IR (and saved as .ctrg by the CLI).
#pragma once

#include <string>

#include "graph/ir.h"

namespace ctr {

struct PresetConfig {
  int64_t layers = 4;
  int64_t dim = 256;
  int64_t heads = 4;
  int64_t kv_heads = 0;  // 0 = heads
  int64_t vocab = 256;
  int64_t seq = 256;     // maximum positions
  int64_t ffn_dim = 0;   // 0 = preset default (gpt 4*dim, llama 256-aligned 8/3*dim)
  int tied = -1;         // -1 = preset default (gpt tied, llama untied)
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  // moe: the feed-forward of every block is a mixture of `experts` SwiGLU
  // experts of width ffn_dim, top_k of them per token, plus an optional shared
  // expert of width shared_ffn_dim (0 = none).
  int64_t experts = 8;
  int64_t top_k = 2;
  int64_t shared_ffn_dim = 0;
  std::string router_score = "softmax";  // or "sigmoid"
  int router_renorm = -1;                // -1 = renormalise the top-k weights when top_k > 1
  double aux_loss = 0.01;                // load-balancing loss coefficient (0 = none)
  double z_loss = 0.001;                 // router z-loss coefficient (0 = none)
};

// preset: "gpt" (GPT-2: learned positions, LayerNorm, GELU MLP, tied head),
// "llama" (RMSNorm, rotary, SwiGLU, grouped-query attention) or "moe" (llama
// with a mixture-of-experts feed-forward: dropless top-k routing, SwiGLU
// experts, an optional shared expert, load-balancing and z-loss). Fails with
// CTR_STATUS_INVALID_OPTION naming the inconsistent setting.
Graph build_preset(const std::string &preset, const PresetConfig &cfg);

}  // namespace ctr
