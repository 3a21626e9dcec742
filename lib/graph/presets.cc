// The gpt and llama presets as graph builders.
//
// Parameter names follow the PyTorch modules users already know (nanoGPT's for
// gpt, Meta's reference for llama), so that weights exported from libctr load
// into those modules by name. Init follows GPT-2: std 0.02, residual output
// projections scaled by 1/sqrt(2 * layers); norms start at one, biases at zero and
// neither is decayed.

#include "graph/presets.h"

#include <cmath>

#include "core/status.h"

namespace ctr {
namespace {

class Builder {
 public:
  Graph g;

  int input(const std::string &name) {
    Tensor t;
    t.name = name;
    t.dtype = CTR_DTYPE_I32;
    t.role = Role::Input;
    t.dims = {Dim{0, "batch"}, Dim{0, "seq"}};
    return g.add_tensor(std::move(t));
  }

  int param(const std::string &name, std::vector<int64_t> shape, InitKind kind, float std = 0) {
    Tensor t;
    t.name = name;
    t.role = Role::Param;
    for (int64_t d : shape) t.dims.push_back(Dim{d, ""});
    t.init.kind = kind;
    t.init.std = std;
    t.no_decay = shape.size() == 1;
    return g.add_tensor(std::move(t));
  }

  int op(const std::string &op, std::vector<int> in, const std::string &out, int block = -1,
         std::map<std::string, Attr> attrs = {}) {
    return ops(op, std::move(in), {out}, block, std::move(attrs))[0];
  }

  // A node with several outputs, named in order.
  std::vector<int> ops(const std::string &op, std::vector<int> in, const std::vector<std::string> &outs,
                       int block = -1, std::map<std::string, Attr> attrs = {}) {
    Node n;
    n.op = op;
    n.name = outs[0];
    for (const std::string &name : outs) {
      Tensor t;
      t.name = name;
      n.outputs.push_back(g.add_tensor(std::move(t)));
    }
    n.inputs = std::move(in);
    n.attrs = std::move(attrs);
    n.block = block;
    g.add_node(n);
    return n.outputs;
  }
};

void check(bool ok, const std::string &msg) {
  if (!ok) fail(CTR_STATUS_INVALID_OPTION, msg);
}

// A SwiGLU feed-forward of width F on h[B, T, C]: PREFIX{w1,w3}.weight [F, C]
// and PREFIXw2.weight [C, F]; its nodes PREFIX{gate,up,swiglu,down}. Returns
// the output [B, T, C].
int swiglu_ffn(Builder &b, int h, const std::string &p, int bl, int64_t F, int64_t C, float std, float proj_std) {
  int w1 = b.param(p + "w1.weight", {F, C}, InitKind::Normal, std);
  int w3 = b.param(p + "w3.weight", {F, C}, InitKind::Normal, std);
  int w2 = b.param(p + "w2.weight", {C, F}, InitKind::Normal, proj_std);
  int gt = b.op("linear", {h, w1}, p + "gate", bl);
  int up = b.op("linear", {h, w3}, p + "up", bl);
  int s = b.op("swiglu", {gt, up}, p + "swiglu", bl);
  return b.op("linear", {s, w2}, p + "down", bl);
}

// The mixture-of-experts feed-forward of one block on h[B, T, C]; appends the
// block's auxiliary losses to aux. Tensors named PREFIX... ("layers.N.moe."):
// router.weight [E, C]; experts.w1, experts.w3 [E, F, C] and experts.w2 [E, C, F];
// shared.{w1,w3,w2}.weight when there is a shared expert; counts [E], the tokens
// each expert received (metrics read it).
int moe_ffn(Builder &b, const PresetConfig &c, int h, const std::string &p, int bl, int64_t F, float std,
            float proj_std, std::vector<int> &aux) {
  const int64_t C = c.dim, E = c.experts;
  int rw = b.param(p + "router.weight", {E, C}, InitKind::Normal, std);
  int logits = b.op("linear", {h, rw}, p + "router.logits", bl);
  std::map<std::string, Attr> route = {{"top_k", Attr::of_int(c.top_k)},
                                       {"score", Attr::of_string(c.router_score)}};
  if (c.router_renorm >= 0) route["renorm"] = Attr::of_int(c.router_renorm);
  auto r = b.ops("moe_router", {logits}, {p + "router.weights", p + "router.experts"}, bl, route);
  auto pm = b.ops("moe_permute", {h, r[1]}, {p + "permuted", p + "counts", p + "slots"}, bl,
                  {{"experts", Attr::of_int(E)}});
  int w1 = b.param(p + "experts.w1", {E, F, C}, InitKind::Normal, std);
  int w3 = b.param(p + "experts.w3", {E, F, C}, InitKind::Normal, std);
  int w2 = b.param(p + "experts.w2", {E, C, F}, InitKind::Normal, proj_std);
  int gt = b.op("moe_grouped_linear", {pm[0], w1, pm[1]}, p + "experts.gate", bl);
  int up = b.op("moe_grouped_linear", {pm[0], w3, pm[1]}, p + "experts.up", bl);
  int s = b.op("swiglu", {gt, up}, p + "experts.swiglu", bl);
  int dn = b.op("moe_grouped_linear", {s, w2, pm[1]}, p + "experts.down", bl);
  int y = b.op("moe_unpermute", {dn, r[0], pm[2]}, p + "combined", bl);
  if (c.shared_ffn_dim > 0)
    y = b.op("add", {y, swiglu_ffn(b, h, p + "shared.", bl, c.shared_ffn_dim, C, std, proj_std)}, p + "out", bl);
  if (c.aux_loss > 0)
    aux.push_back(b.op("moe_aux_loss", {logits, r[1]}, p + "aux_loss", bl, {{"coef", Attr::of_float(c.aux_loss)}}));
  if (c.z_loss > 0)
    aux.push_back(b.op("moe_z_loss", {logits}, p + "z_loss", bl, {{"coef", Attr::of_float(c.z_loss)}}));
  return y;
}

}  // namespace

Graph build_preset(const std::string &preset, const PresetConfig &c) {
  check(preset == "gpt" || preset == "llama" || preset == "moe",
        strformat("unknown preset '%s' (known: gpt, llama, moe)", preset.c_str()));
  check(c.layers >= 1 && c.layers <= 1024, "preset option 'layers' must be in 1..1024");
  check(c.dim >= 1 && c.heads >= 1 && c.dim % c.heads == 0,
        strformat("preset option 'dim' (%lld) must be a positive multiple of 'heads' (%lld)",
                  static_cast<long long>(c.dim), static_cast<long long>(c.heads)));
  int64_t kv = c.kv_heads > 0 ? c.kv_heads : c.heads;
  check(c.heads % kv == 0, strformat("preset option 'heads' (%lld) must be a multiple of "
                                     "'kv_heads' (%lld)",
                                     static_cast<long long>(c.heads), static_cast<long long>(kv)));
  check(c.vocab >= 2 && c.vocab <= (int64_t{1} << 31), "preset option 'vocab' must be >= 2");
  check(c.seq >= 1, "preset option 'seq' must be >= 1");
  check(c.init_std > 0, "preset option 'init_std' must be > 0");
  const int64_t C = c.dim, H = c.heads, D = C / H, L = c.layers, V = c.vocab;
  const float std = static_cast<float>(c.init_std);
  const float proj_std = static_cast<float>(c.init_std / std::sqrt(2.0 * static_cast<double>(L)));
  const bool moe = preset == "moe";
  const bool llama = preset == "llama" || moe;
  if (moe) {
    check(c.experts >= 1 && c.experts <= 4096, "preset option 'experts' must be in 1..4096");
    check(c.top_k >= 1 && c.top_k <= c.experts,
          strformat("preset option 'top_k' (%lld) must be in 1..experts (%lld)", static_cast<long long>(c.top_k),
                    static_cast<long long>(c.experts)));
    check(c.shared_ffn_dim >= 0, "preset option 'shared_ffn_dim' must be >= 0");
    check(c.router_score == "softmax" || c.router_score == "sigmoid",
          strformat("preset option 'router_score' is '%s'; known: softmax, sigmoid", c.router_score.c_str()));
    check(c.aux_loss >= 0 && c.z_loss >= 0, "preset options 'aux_loss' and 'z_loss' must be >= 0");
  }
  check(!llama || D % 2 == 0, "llama preset needs an even head dim (dim / heads) for rotary");
  check(llama || kv == c.heads, "gpt preset has no grouped-query attention: leave kv_heads unset");

  Builder b;
  b.g.name = preset;
  std::vector<int> aux_terms;  // moe: the auxiliary losses, added to the loss in block order
  int tokens = b.input("tokens");
  int targets = b.input("targets");
  Attr eps = Attr::of_float(c.norm_eps);
  int x;
  int head_w;
  if (!llama) {
    bool tied = c.tied != 0;
    int64_t F = c.ffn_dim > 0 ? c.ffn_dim : 4 * C;
    int wte = b.param("wte", {V, C}, InitKind::Normal, std);
    int wpe = b.param("wpe", {c.seq, C}, InitKind::Normal, std);
    int tok = b.op("embedding", {wte, tokens}, "tok_emb");
    int pos = b.op("take_rows", {wpe, tokens}, "pos_emb", -1, {{"axis", Attr::of_int(1)}});
    x = b.op("add", {tok, pos}, "emb");
    for (int64_t l = 0; l < L; ++l) {
      int bl = static_cast<int>(l);
      std::string p = "layers." + std::to_string(l) + ".";
      int ln1w = b.param(p + "ln1.weight", {C}, InitKind::Ones);
      int ln1b = b.param(p + "ln1.bias", {C}, InitKind::Zeros);
      int h = b.op("layernorm", {x, ln1w, ln1b}, p + "ln1", bl, {{"eps", eps}});
      int qw = b.param(p + "attn.wq.weight", {C, C}, InitKind::Normal, std);
      int qb = b.param(p + "attn.wq.bias", {C}, InitKind::Zeros);
      int kw = b.param(p + "attn.wk.weight", {C, C}, InitKind::Normal, std);
      int kb = b.param(p + "attn.wk.bias", {C}, InitKind::Zeros);
      int vw = b.param(p + "attn.wv.weight", {C, C}, InitKind::Normal, std);
      int vb = b.param(p + "attn.wv.bias", {C}, InitKind::Zeros);
      int q = b.op("linear", {h, qw, qb}, p + "attn.q", bl);
      int k = b.op("linear", {h, kw, kb}, p + "attn.k", bl);
      int v = b.op("linear", {h, vw, vb}, p + "attn.v", bl);
      int a = b.op("attention", {q, k, v}, p + "attn.out", bl,
                   {{"heads", Attr::of_int(H)}, {"kv_heads", Attr::of_int(H)}, {"causal", Attr::of_int(1)}});
      int ow = b.param(p + "attn.wo.weight", {C, C}, InitKind::Normal, proj_std);
      int ob = b.param(p + "attn.wo.bias", {C}, InitKind::Zeros);
      int o = b.op("linear", {a, ow, ob}, p + "attn.proj", bl);
      x = b.op("add", {x, o}, p + "resid1", bl);
      int ln2w = b.param(p + "ln2.weight", {C}, InitKind::Ones);
      int ln2b = b.param(p + "ln2.bias", {C}, InitKind::Zeros);
      h = b.op("layernorm", {x, ln2w, ln2b}, p + "ln2", bl, {{"eps", eps}});
      int fw = b.param(p + "mlp.fc.weight", {F, C}, InitKind::Normal, std);
      int fb = b.param(p + "mlp.fc.bias", {F}, InitKind::Zeros);
      int f = b.op("linear", {h, fw, fb}, p + "mlp.fc", bl);
      int gl = b.op("gelu", {f}, p + "mlp.gelu", bl);
      int pw = b.param(p + "mlp.proj.weight", {C, F}, InitKind::Normal, proj_std);
      int pb = b.param(p + "mlp.proj.bias", {C}, InitKind::Zeros);
      int m = b.op("linear", {gl, pw, pb}, p + "mlp.proj", bl);
      x = b.op("add", {x, m}, p + "resid2", bl);
    }
    int lnw = b.param("ln_f.weight", {C}, InitKind::Ones);
    int lnb = b.param("ln_f.bias", {C}, InitKind::Zeros);
    x = b.op("layernorm", {x, lnw, lnb}, "ln_f", -1, {{"eps", eps}});
    head_w = tied ? wte : b.param("lm_head.weight", {V, C}, InitKind::Normal, std);
  } else {
    bool tied = c.tied == 1;
    // F = 256 * ceil((8C/3) / 256), in exact integer arithmetic.
    int64_t F = c.ffn_dim > 0 ? c.ffn_dim : 256 * ((8 * C + 3 * 256 - 1) / (3 * 256));
    int emb = b.param("tok_embeddings.weight", {V, C}, InitKind::Normal, std);
    x = b.op("embedding", {emb, tokens}, "tok_emb");
    Attr theta = Attr::of_float(c.rope_theta);
    for (int64_t l = 0; l < L; ++l) {
      int bl = static_cast<int>(l);
      std::string p = "layers." + std::to_string(l) + ".";
      int nw = b.param(p + "attention_norm.weight", {C}, InitKind::Ones);
      int h = b.op("rmsnorm", {x, nw}, p + "attention_norm", bl, {{"eps", eps}});
      int qw = b.param(p + "attention.wq.weight", {H * D, C}, InitKind::Normal, std);
      int kw = b.param(p + "attention.wk.weight", {kv * D, C}, InitKind::Normal, std);
      int vw = b.param(p + "attention.wv.weight", {kv * D, C}, InitKind::Normal, std);
      int q = b.op("linear", {h, qw}, p + "attention.q", bl);
      int k = b.op("linear", {h, kw}, p + "attention.k", bl);
      int v = b.op("linear", {h, vw}, p + "attention.v", bl);
      q = b.op("rope", {q}, p + "attention.q_rot", bl, {{"heads", Attr::of_int(H)}, {"theta", theta}});
      k = b.op("rope", {k}, p + "attention.k_rot", bl, {{"heads", Attr::of_int(kv)}, {"theta", theta}});
      int a = b.op("attention", {q, k, v}, p + "attention.out", bl,
                   {{"heads", Attr::of_int(H)}, {"kv_heads", Attr::of_int(kv)}, {"causal", Attr::of_int(1)}});
      int ow = b.param(p + "attention.wo.weight", {C, H * D}, InitKind::Normal, proj_std);
      int o = b.op("linear", {a, ow}, p + "attention.proj", bl);
      x = b.op("add", {x, o}, p + "resid1", bl);
      int fnw = b.param(p + "ffn_norm.weight", {C}, InitKind::Ones);
      h = b.op("rmsnorm", {x, fnw}, p + "ffn_norm", bl, {{"eps", eps}});
      int d;
      if (moe) {
        d = moe_ffn(b, c, h, p + "moe.", bl, F, std, proj_std, aux_terms);
      } else {
        d = swiglu_ffn(b, h, p + "feed_forward.", bl, F, C, std, proj_std);
      }
      x = b.op("add", {x, d}, p + "resid2", bl);
    }
    int nw = b.param("norm.weight", {C}, InitKind::Ones);
    x = b.op("rmsnorm", {x, nw}, "norm", -1, {{"eps", eps}});
    head_w = tied ? emb : b.param("output.weight", {V, C}, InitKind::Normal, std);
  }
  int logits = b.op("linear", {x, head_w}, "logits");
  // Declared so that hosts can size a buffer for it (ctr_step_get_output).
  b.g.tensors[logits].dims = {Dim{0, "batch"}, Dim{0, "seq"}, Dim{V, ""}};
  b.g.loss = b.op("cross_entropy", {logits, targets}, aux_terms.empty() ? "loss" : "lm_loss");
  for (size_t i = 0; i < aux_terms.size(); ++i)
    b.g.loss = b.op("add", {b.g.loss, aux_terms[i]}, i + 1 == aux_terms.size() ? "loss" : "loss." + std::to_string(i));
  auto &m = b.g.metadata;
  m.emplace_back("preset", preset);
  m.emplace_back("layers", std::to_string(L));
  m.emplace_back("dim", std::to_string(C));
  m.emplace_back("heads", std::to_string(H));
  m.emplace_back("kv_heads", std::to_string(kv));
  m.emplace_back("vocab", std::to_string(V));
  m.emplace_back("max_seq", std::to_string(c.seq));
  if (moe) {
    m.emplace_back("experts", std::to_string(c.experts));
    m.emplace_back("top_k", std::to_string(c.top_k));
  }
  return std::move(b.g);
}

}  // namespace ctr
