// Shape rules, FLOP counts and VJP rules of the op set (see ops.h).
//
// Each forward op is a few small functions next to each other, so the shape rule
// and the gradient of an op are read together. Shape rules throw INVALID_GRAPH
// naming the node and the tensor at fault; VJP rules only emit nodes, whose
// shapes follow from the forward tensors they mirror.

#include "graph/ops.h"

#include <cmath>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>

#include "common/op_params.h"
#include "core/status.h"
#include "graph/ops_internal.h"

namespace ctr {
namespace opdef {

// ---------------------------------------------------------------------------
// Helpers

const Tensor &T(const Graph &g, int id) { return g.tensors[id]; }
const std::vector<int64_t> &S(const Graph &g, const Node &n, int i) {
  return g.tensors[n.inputs[i]].shape;
}

[[noreturn]] void bad_node(const Graph &g, const Node &n, const std::string &what) {
  fail(CTR_STATUS_INVALID_GRAPH,
       strformat("node '%s' (%s): %s", n.name.c_str(), n.op.c_str(), what.c_str()));
  (void)g;
}

void need_dtype(const Graph &g, const Node &n, int i, ctr_dtype d) {
  const Tensor &t = T(g, n.inputs[i]);
  if (t.dtype != d)
    bad_node(g, n, strformat("input %d %s has dtype %s, expected %s", i,
                             g.describe_tensor(n.inputs[i]).c_str(), dtype_name(t.dtype),
                             dtype_name(d)));
}

void need_rank_at_least(const Graph &g, const Node &n, int i, size_t r) {
  if (S(g, n, i).size() < r)
    bad_node(g, n, strformat("input %d %s has shape %s, needs at least %zu dims", i,
                             g.describe_tensor(n.inputs[i]).c_str(),
                             shape_string(S(g, n, i)).c_str(), r));
}

void shape_mismatch(const Graph &g, const Node &n, int i, const std::string &expect) {
  bad_node(g, n, strformat("shape mismatch: input %d %s has shape %s, expected %s", i,
                           g.describe_tensor(n.inputs[i]).c_str(),
                           shape_string(S(g, n, i)).c_str(), expect.c_str()));
}

int64_t numel(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

OutInfo f32(std::vector<int64_t> s) { return OutInfo{CTR_DTYPE_F32, std::move(s)}; }

double zero_flops(const Graph &, const Node &) { return 0; }
double elementwise_flops(const Graph &g, const Node &n) {
  return static_cast<double>(numel(S(g, n, 0)));
}

void infer_same_f32(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  for (size_t i = 0; i < n.inputs.size(); ++i) need_dtype(g, n, static_cast<int>(i), CTR_DTYPE_F32);
  for (size_t i = 1; i < n.inputs.size(); ++i)
    if (S(g, n, static_cast<int>(i)) != S(g, n, 0)) shape_mismatch(g, n, static_cast<int>(i), shape_string(S(g, n, 0)));
  out = {f32(S(g, n, 0))};
}

std::vector<int64_t> check_logits_targets(const Graph &g, const Node &n) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  need_rank_at_least(g, n, 0, 1);
  const auto &l = S(g, n, 0);
  std::vector<int64_t> rows(l.begin(), l.end() - 1);
  if (S(g, n, 1) != rows) shape_mismatch(g, n, 1, shape_string(rows));
  return rows;
}

}  // namespace opdef

namespace {

using namespace opdef;

// ---------------------------------------------------------------------------
// embedding(table[V,C], ids[...]) -> [..., C]

void embedding_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  if (S(g, n, 0).size() != 2) shape_mismatch(g, n, 0, "[vocab, dim]");
  const int64_t pad = n.attr_int("padding_idx", -1);
  if (pad < -1 || pad >= S(g, n, 0)[0])
    bad_node(g, n, "attribute 'padding_idx' (" + std::to_string(pad) + ") must be a row of the table or -1 (none)");
  auto s = S(g, n, 1);
  s.push_back(S(g, n, 0)[1]);
  out = {f32(s)};
}

// ---------------------------------------------------------------------------
// linear(x[...,K], w[N,K], b[N]?) -> [..., N]

void linear_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  for (size_t i = 0; i < n.inputs.size(); ++i) need_dtype(g, n, static_cast<int>(i), CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  const auto &x = S(g, n, 0), &w = S(g, n, 1);
  if (w.size() != 2 || w[1] != x.back())
    shape_mismatch(g, n, 1, strformat("[out, %lld]", static_cast<long long>(x.back())));
  if (n.inputs.size() == 3 && S(g, n, 2) != std::vector<int64_t>{w[0]})
    shape_mismatch(g, n, 2, shape_string({w[0]}));
  auto s = x;
  s.back() = w[0];
  out = {f32(s)};
}

double linear_flops(const Graph &g, const Node &n) {
  const auto &x = S(g, n, 0), &w = S(g, n, 1);
  return 2.0 * static_cast<double>(numel(x)) * static_cast<double>(w[0]);
}

void linear_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  int x = n.inputs[0], w = n.inputs[1];
  if (b.needs(x)) {
    int gx = b.new_grad_tensor(x, "grad");
    b.emit("linear_bwd_x", {gy, w}, {gx}, {}, n.block);
    b.accumulate(x, gx);
  }
  if (b.needs(w)) {
    int gw = b.new_grad_tensor(w, "grad");
    b.emit("linear_bwd_w", {gy, x}, {gw}, {}, n.block);
    b.accumulate(w, gw);
  }
  if (n.inputs.size() == 3 && b.needs(n.inputs[2])) {
    int gb = b.new_grad_tensor(n.inputs[2], "grad");
    b.emit("linear_bwd_b", {gy}, {gb}, {}, n.block);
    b.accumulate(n.inputs[2], gb);
  }
}

// ---------------------------------------------------------------------------
// matmul(a[..., M, K], b[K, N] or b[..., K, N]) -> [..., M, N]

void matmul_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 2);
  need_rank_at_least(g, n, 1, 2);
  const auto &a = S(g, n, 0), &bb = S(g, n, 1);
  int64_t K = a.back();
  if (bb[bb.size() - 2] != K) shape_mismatch(g, n, 1, strformat("[..., %lld, N]", static_cast<long long>(K)));
  if (bb.size() != 2) {
    if (bb.size() != a.size() ||
        !std::equal(a.begin(), a.end() - 2, bb.begin()))
      shape_mismatch(g, n, 1, "a 2-D matrix or the same batch dims as input 0");
  }
  auto s = a;
  s.back() = bb.back();
  out = {f32(s)};
}

double matmul_flops(const Graph &g, const Node &n) {
  const auto &a = S(g, n, 0), &bb = S(g, n, 1);
  return 2.0 * static_cast<double>(numel(a)) * static_cast<double>(bb.back());
}

// ---------------------------------------------------------------------------
// layernorm(x[..., C], w[C], b[C]?) -> y, saved mean[R], rstd[R]
// rmsnorm(x[..., C], w[C]) -> y, saved rstd[R]

void norm_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  for (size_t i = 0; i < n.inputs.size(); ++i) need_dtype(g, n, static_cast<int>(i), CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  const auto &x = S(g, n, 0);
  int64_t C = x.back();
  for (size_t i = 1; i < n.inputs.size(); ++i)
    if (S(g, n, static_cast<int>(i)) != std::vector<int64_t>{C})
      shape_mismatch(g, n, static_cast<int>(i), shape_string({C}));
  int64_t R = numel(x) / C;
  out = {f32(x)};
  if (n.op == "layernorm") out.push_back(f32({R}));
  out.push_back(f32({R}));
}

double norm_flops(const Graph &g, const Node &n) { return 8.0 * static_cast<double>(numel(S(g, n, 0))); }

// ---------------------------------------------------------------------------
// exp, log, tanh, erf, rsqrt, sqrt, neg, reciprocal, sigmoid, relu (x) ; pow(x)
// attr exponent (required) ; clamp(x) attrs min, max (floats, at least one):
// element-wise, same shape. The backward reads the output
// where the derivative is a function of it alone, the input otherwise (see
// kernels/common/math.h). No op checks its domain (log of a negative is NaN).

void clamp_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  if (!n.has_attr("min") && !n.has_attr("max")) bad_node(g, n, "attribute 'min' or 'max' (a float) is required");
  const double lo = n.attr_float("min", -INFINITY), hi = n.attr_float("max", INFINITY);
  if (std::isnan(lo) || std::isnan(hi)) bad_node(g, n, "attributes 'min' and 'max' must not be NaN");
  if (lo > hi) bad_node(g, n, strformat("attribute 'min' (%g) is above 'max' (%g)", lo, hi));
  infer_same_f32(g, n, out);
}

void pow_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  if (!n.has_attr("exponent")) bad_node(g, n, "missing attribute 'exponent' (a float)");
  if (!std::isfinite(n.attr_float("exponent", 1.0)))
    bad_node(g, n, "attribute 'exponent' must be finite");
  infer_same_f32(g, n, out);
}

// ---------------------------------------------------------------------------
// silu (x) ; swiglu(gate, up) (gelu and softmax: ops_math.cc)

// ---------------------------------------------------------------------------
// rope(x[B, T, H*D]) attrs heads, theta, interleaved (0: pairs (i, i + D/2), 1: (2i, 2i+1))

void rope_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  const auto &x = S(g, n, 0);
  if (x.size() != 3) shape_mismatch(g, n, 0, "[batch, seq, heads*head_dim]");
  int64_t H = n.attr_int("heads", 0);
  if (H <= 0 || x[2] % H != 0 || (x[2] / H) % 2 != 0)
    bad_node(g, n, strformat("attribute heads=%lld must divide the last dim %lld into even "
                             "head sizes",
                             static_cast<long long>(H), static_cast<long long>(x[2])));
  const int64_t il = n.attr_int("interleaved", 0);
  if (il != 0 && il != 1)
    bad_node(g, n, strformat("attribute interleaved=%lld must be 0 or 1", static_cast<long long>(il)));
  out = {f32(x)};
}

// ---------------------------------------------------------------------------
// attention(q[B,T,Hq*D], k[B,T,Hkv*D], v[B,T,Hkv*D]) attrs heads, kv_heads,
// causal, scale -> out[B,T,Hq*D], saved probs[B,Hq,T,T]

void attention_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  for (int i = 0; i < 3; ++i) need_dtype(g, n, i, CTR_DTYPE_F32);
  const auto &q = S(g, n, 0), &k = S(g, n, 1), &v = S(g, n, 2);
  if (q.size() != 3) shape_mismatch(g, n, 0, "[batch, seq, heads*head_dim]");
  int64_t H = n.attr_int("heads", 0);
  int64_t Hkv = n.attr_int("kv_heads", H);
  if (H <= 0 || q[2] % H != 0)
    bad_node(g, n, strformat("attribute heads=%lld must divide the query width %lld",
                             static_cast<long long>(H), static_cast<long long>(q[2])));
  if (Hkv <= 0 || H % Hkv != 0)
    bad_node(g, n, strformat("attribute kv_heads=%lld must divide heads=%lld",
                             static_cast<long long>(Hkv), static_cast<long long>(H)));
  const int64_t window = n.attr_int("window", 0);
  if (window < 0 || (window > 0 && n.attr_int("causal", 1) == 0))
    bad_node(g, n, strformat("attribute window=%lld must be 0 (none) or positive on a causal attention",
                             static_cast<long long>(window)));
  const double softcap = n.attr_float("softcap", 0.0);
  if (!(softcap >= 0.0) || std::isinf(softcap))
    bad_node(g, n, strformat("attribute softcap=%g must be 0 (none) or a positive number", softcap));
  int64_t D = q[2] / H;
  std::vector<int64_t> kv = {q[0], q[1], Hkv * D};
  if (k != kv) shape_mismatch(g, n, 1, shape_string(kv));
  if (v != kv) shape_mismatch(g, n, 2, shape_string(kv));
  out = {f32(q), f32({q[0], H, q[1], q[1]})};
}

// cp_attention(q[B,Tq,Hq*D], k[B,R*Tq,Hkv*D], v) attrs those of attention and
// cp_ranks R, cp_index: this rank's two chunks of the sequence against every
// rank's keys (placed by the place pass, see ctr_cp_position) -> out[B,Tq,Hq*D],
// saved probs[B,Hq,Tq,R*Tq]. cp_index -1 (all-to-all over heads): the query
// rows are every rank's chunks in rank order too, k and v [B,Tq,Hkv*D].
void cp_attention_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const int64_t R = n.attr_int("cp_ranks", 0), index = n.attr_int("cp_index", -2);
  const auto &q = S(g, n, 0);
  if (R < 1 || index < -1 || index >= R)
    bad_node(g, n, strformat("attributes cp_ranks=%lld and cp_index=%lld do not name a rank (or -1: every rank)",
                             static_cast<long long>(R), static_cast<long long>(index)));
  const bool all = index < 0;
  if (q.size() != 3 || q[1] % (all ? 2 * R : 2) != 0)
    shape_mismatch(g, n, 0, all ? "[batch, 2 chunks of seq per rank, heads*head_dim]"
                                : "[batch, 2 chunks of seq, heads*head_dim]");
  const int64_t Tk = all ? q[1] : R * q[1];
  Node whole = n;
  Graph local;  // the shape rule of attention on q and k, v of q's rows
  for (int i = 0; i < 3; ++i) {
    Tensor t = g.tensors[n.inputs[static_cast<size_t>(i)]];
    if (i > 0) {
      if (t.shape.size() != 3 || t.shape[0] != q[0] || t.shape[1] != Tk)
        shape_mismatch(g, n, i, strformat("[%lld, %lld, kv_heads*head_dim]", static_cast<long long>(q[0]),
                                          static_cast<long long>(Tk)));
      t.shape[1] = q[1];
    }
    whole.inputs[static_cast<size_t>(i)] = local.add_tensor(std::move(t));
  }
  attention_infer(local, whole, out);
  out[1].shape[3] = Tk;
}

double cp_attention_flops(const Graph &g, const Node &n) {
  const auto &q = S(g, n, 0), &k = S(g, n, 1);
  return 4.0 * static_cast<double>(q[0]) * static_cast<double>(q[1]) * static_cast<double>(k[1]) *
         static_cast<double>(q[2]);
}

void cp_rope_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const int64_t R = n.attr_int("cp_ranks", 0), index = n.attr_int("cp_index", -1);
  if (R < 1 || index < 0 || index >= R)
    bad_node(g, n, strformat("attributes cp_ranks=%lld and cp_index=%lld do not name a rank",
                             static_cast<long long>(R), static_cast<long long>(index)));
  rope_infer(g, n, out);
  if (out[0].shape[1] % 2 != 0) shape_mismatch(g, n, 0, "[batch, 2 chunks of seq, heads*head_dim]");
}

// cp_attention_block(q[B,Tq,Hq*D], k[B,Tq,Hkv*D], v) attrs those of
// cp_attention and cp_source: this rank's query rows against rank cp_source's
// rows (ring attention) -> out[B,Tq,Hq*D], lse[B,Hq,Tq], saved probs[B,Hq,Tq,Tq].
void cp_attention_block_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const int64_t R = n.attr_int("cp_ranks", 0), index = n.attr_int("cp_index", -1);
  const int64_t source = n.attr_int("cp_source", -1);
  if (R < 1 || index < 0 || index >= R || source < 0 || source >= R)
    bad_node(g, n, strformat("attributes cp_ranks=%lld, cp_index=%lld and cp_source=%lld do not name ranks",
                             static_cast<long long>(R), static_cast<long long>(index),
                             static_cast<long long>(source)));
  const auto &q = S(g, n, 0);
  if (q.size() != 3 || q[1] % 2 != 0) shape_mismatch(g, n, 0, "[batch, 2 chunks of seq, heads*head_dim]");
  attention_infer(g, n, out);
  const int64_t H = n.attr_int("heads", 1);
  out = {out[0], f32({q[0], H, q[1]}), out[1]};
}

void attn_merge_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const auto &o = S(g, n, 0), &l = S(g, n, 1);
  if (S(g, n, 2) != o) shape_mismatch(g, n, 2, shape_string(o));
  if (S(g, n, 3) != l) shape_mismatch(g, n, 3, shape_string(l));
  const int64_t H = n.attr_int("heads", 0);
  if (o.size() != 3 || H <= 0 || o[2] % H != 0 || l != std::vector<int64_t>{o[0], H, o[1]})
    shape_mismatch(g, n, 1, "[batch, heads, seq] beside o [batch, seq, heads*head_dim]");
  out = {f32(o), f32(l)};
}

void attn_merge_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_attn_merge_params *>(out)->heads = n.attr_int("heads", 1);
}

void attention_decode_at(const Graph &g, const Node &n, ctr_attention_params *p, size_t q_input);

// The forward reads q as input 0, the backward as input 2 (after two gradients).
template <int Q>
void cp_attention_block_decode(const Graph &g, const Node &n, void *out) {
  auto *p = static_cast<ctr_attention_block_params *>(out);
  attention_decode_at(g, n, &p->attention, Q);
  p->cp_source = n.attr_int("cp_source", 0);
}

// attn_merge's gradient: attn_merge_bwd(dout, oa, la, ob, lb, out, lse[, dlse]);
// the merged lse of the last merge has no reader, so no gradient.
void attn_merge_vjp(VjpBuilder &b, const Node &n) {
  const int go = b.grad(n.outputs[0]);
  if (go < 0) return;
  std::vector<int> in = {go, n.inputs[0], n.inputs[1], n.inputs[2], n.inputs[3], n.outputs[0], n.outputs[1]};
  if (const int gl = b.grad(n.outputs[1]); gl >= 0) in.push_back(gl);
  std::vector<int> out;
  for (int i = 0; i < 4; ++i) out.push_back(b.new_grad_tensor(n.inputs[static_cast<size_t>(i)], "grad"));
  b.emit("attn_merge_bwd", std::move(in), out, n.attrs, n.block);
  for (int i = 0; i < 4; ++i)
    if (b.needs(n.inputs[static_cast<size_t>(i)])) b.accumulate(n.inputs[static_cast<size_t>(i)], out[static_cast<size_t>(i)]);
}

double attention_flops(const Graph &g, const Node &n) {
  const auto &q = S(g, n, 0);
  return 4.0 * static_cast<double>(q[0]) * static_cast<double>(q[1]) *
         static_cast<double>(q[1]) * static_cast<double>(q[2]);
}

// ---------------------------------------------------------------------------
// cross_entropy(logits[..., V], targets[...]) -> loss (scalar), saved lse[R], count

void xent_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const std::vector<int64_t> rows = check_logits_targets(g, n);
  if (n.has_attr("ignore_index") && (n.attrs.at("ignore_index").type != Attr::Int || n.attr_int("ignore_index", -1) >= 0))
    bad_node(g, n, "attribute ignore_index must be a negative integer (targets at or above it and below 0 are ignored)");
  out = {f32({}), f32({numel(rows)}), OutInfo{CTR_DTYPE_I64, {1}}};
}

double xent_flops(const Graph &g, const Node &n) { return 4.0 * static_cast<double>(numel(S(g, n, 0))); }

// ---------------------------------------------------------------------------
// reshape(x) attr shape (0 keeps the input dim at that position, one -1 infers)
//   or attr dims, the same as a string whose entries may be size expressions
//   ("batch*seq,-1"); exactly one of the two.
// transpose(x) attr perm

// The entries of attribute `dims`: -1, 0 or a size expression each.
std::vector<int64_t> reshape_dims(const Graph &g, const Node &n) {
  const std::string dims = n.attr_string("dims", "");
  std::vector<int64_t> s;
  size_t pos = 0;
  while (true) {
    const size_t comma = dims.find(',', pos);
    std::string e = dims.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const size_t b = e.find_first_not_of(" \t"), l = e.find_last_not_of(" \t");
    e = b == std::string::npos ? "" : e.substr(b, l - b + 1);
    if (e.empty())
      bad_node(g, n, strformat("attribute 'dims'=\"%s\" has an empty entry", dims.c_str()));
    s.push_back(e == "-1" ? -1 : e == "0" ? 0 : eval_size(g, n, "dims", e));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return s;
}

std::vector<int64_t> reshape_target(const Graph &g, const Node &n) {
  const auto &x = S(g, n, 0);
  const bool has_shape = n.has_attr("shape"), has_dims = n.has_attr("dims");
  if (has_shape == has_dims)
    bad_node(g, n, has_shape ? "both attributes 'shape' and 'dims' are given (exactly one, please)"
                             : "missing attribute 'shape' (ints) or 'dims' (a string)");
  if (has_dims && n.attrs.at("dims").type != Attr::String)
    bad_node(g, n, "attribute 'dims' must be a string such as \"batch*seq,-1\"");
  std::vector<int64_t> s = has_shape ? n.attr_ints("shape") : reshape_dims(g, n);
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == 0) {
      if (i >= x.size()) bad_node(g, n, "shape entry 0 past the input's rank");
      s[i] = x[i];
    }
    if (s[i] == -1) {
      if (infer >= 0) bad_node(g, n, "more than one -1 in attribute 'shape' or 'dims'");
      infer = static_cast<int>(i);
    } else if (s[i] < 0) {
      bad_node(g, n, "negative size in attribute 'shape'");
    } else if (__builtin_mul_overflow(known, s[i], &known)) {
      bad_node(g, n, "the sizes in attribute 'shape' or 'dims' overflow int64");
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel(x) % known != 0)
      bad_node(g, n, "cannot infer the -1 dim of attribute 'shape' or 'dims'");
    s[infer] = numel(x) / known;
  }
  if (numel(s) != numel(x))
    bad_node(g, n, strformat("shape mismatch: cannot reshape %s to %s",
                             shape_string(x).c_str(), shape_string(s).c_str()));
  return s;
}

void reshape_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  out = {OutInfo{T(g, n.inputs[0]).dtype, reshape_target(g, n)}};
}

void reshape_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("reshape", {gy}, {gx}, {{"shape", Attr::of_ints(b.graph().tensors[n.inputs[0]].shape)}},
         n.block);
  b.accumulate(n.inputs[0], gx);
}

void transpose_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const ctr_dtype dt = T(g, n.inputs[0]).dtype;
  if (dt != CTR_DTYPE_I32) need_dtype(g, n, 0, CTR_DTYPE_F32);
  const auto &x = S(g, n, 0);
  auto perm = n.attr_ints("perm");
  if (perm.size() != x.size() || x.size() > 6)
    bad_node(g, n, strformat("attribute 'perm' must list %zu dims (at most 6)", x.size()));
  std::vector<bool> seen(x.size(), false);
  std::vector<int64_t> s;
  for (int64_t p : perm) {
    if (p < 0 || p >= static_cast<int64_t>(x.size()) || seen[p])
      bad_node(g, n, "attribute 'perm' is not a permutation");
    seen[p] = true;
    s.push_back(x[p]);
  }
  out = {OutInfo{dt, s}};
}

void transpose_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  auto perm = n.attr_ints("perm");
  std::vector<int64_t> inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = static_cast<int64_t>(i);
  b.emit("transpose", {gy}, {gx}, {{"perm", Attr::of_ints(inverse)}}, n.block);
  b.accumulate(n.inputs[0], gx);
}

// take_rows(table[N, ...], like) attr axis: table[0 : like.shape[axis]].
// Positional tables are stored for the maximum length and used for the bound seq.

void take_rows_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  const auto &t = S(g, n, 0), &like = S(g, n, 1);
  int64_t axis = n.attr_int("axis", 1);
  if (axis < 0 || axis >= static_cast<int64_t>(like.size()))
    bad_node(g, n, strformat("attribute axis=%lld is not a dim of input 1 %s",
                             static_cast<long long>(axis), shape_string(like).c_str()));
  if (like[axis] > t[0])
    bad_node(g, n, strformat("needs %lld rows but %s has only %lld (sequence longer than the "
                             "positional table?)",
                             static_cast<long long>(like[axis]),
                             g.describe_tensor(n.inputs[0]).c_str(), static_cast<long long>(t[0])));
  auto s = t;
  s[0] = like[axis];
  out = {f32(s)};
}

// ---------------------------------------------------------------------------
// Mixture of experts. N tokens (leading dims), E experts, k choices per token.
//
// moe_router(logits[..., E]) attrs top_k, score, renorm
//   -> weights[..., k], experts[..., k] (i32), saved scores[..., E]
// moe_aux_loss(logits[..., E], experts[..., k]) attr coef -> scalar
// moe_z_loss(logits[..., E]) attr coef -> scalar
// moe_permute(x[..., D], experts[..., k]) attr experts
//   -> xp[N*k, D], counts[E] (i32), slots[..., k] (i32)
// moe_grouped_linear(x[M, K], w[E, N, K], counts[E]) -> [M, N]
// moe_unpermute(yp[M, D], weights[..., k], slots[..., k]) -> [..., D]

std::vector<int64_t> leading(const std::vector<int64_t> &s) { return {s.begin(), s.end() - 1}; }

void need_leading(const Graph &g, const Node &n, int i, const std::vector<int64_t> &rows, int64_t last) {
  auto want = rows;
  want.push_back(last);
  if (S(g, n, i) != want) shape_mismatch(g, n, i, shape_string(want));
}

void moe_router_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  const auto &l = S(g, n, 0);
  const int64_t E = l.back(), k = n.attr_int("top_k", 0);
  if (k < 1 || k > E)
    bad_node(g, n, strformat("attribute top_k=%lld must be in 1..%lld (the experts of the logits' last dim)",
                             static_cast<long long>(k), static_cast<long long>(E)));
  const std::string score = n.attr_string("score", "softmax");
  if (score != "softmax" && score != "sigmoid")
    bad_node(g, n, strformat("attribute score='%s' is not softmax or sigmoid", score.c_str()));
  auto ks = leading(l);
  ks.push_back(k);
  out = {f32(ks), OutInfo{CTR_DTYPE_I32, ks}, f32(l)};
}

void moe_aux_loss_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  need_rank_at_least(g, n, 0, 1);
  need_rank_at_least(g, n, 1, 1);
  need_leading(g, n, 1, leading(S(g, n, 0)), S(g, n, 1).back());
  out = {f32({})};
}

void moe_z_loss_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  out = {f32({})};
}

void moe_permute_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  need_rank_at_least(g, n, 0, 1);
  need_rank_at_least(g, n, 1, 1);
  const auto &x = S(g, n, 0), &ex = S(g, n, 1);
  need_leading(g, n, 1, leading(x), ex.back());
  const int64_t E = n.attr_int("experts", 0);
  if (E < 1 || E > (int64_t{1} << 20))
    bad_node(g, n, strformat("attribute experts=%lld must be in 1..2^20", static_cast<long long>(E)));
  out = {f32({numel(ex), x.back()}), OutInfo{CTR_DTYPE_I32, {E}}, OutInfo{CTR_DTYPE_I32, ex}};
}

void moe_grouped_linear_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  need_dtype(g, n, 2, CTR_DTYPE_I32);
  const auto &x = S(g, n, 0), &w = S(g, n, 1);
  if (x.size() != 2) shape_mismatch(g, n, 0, "[rows, in]");
  if (w.size() != 3 || w[2] != x[1])
    shape_mismatch(g, n, 1, strformat("[experts, out, %lld]", static_cast<long long>(x[1])));
  const auto &cnt = S(g, n, 2);
  if (cnt.size() != 1 || cnt[0] < w[0] || cnt[0] % w[0] != 0)
    shape_mismatch(g, n, 2, strformat("[a multiple of %lld] (row counts per expert, segment s for expert s %% %lld)",
                                      static_cast<long long>(w[0]), static_cast<long long>(w[0])));
  out = {f32({x[0], w[1]})};
}

double moe_grouped_linear_flops(const Graph &g, const Node &n) {
  return 2.0 * static_cast<double>(numel(S(g, n, 0))) * static_cast<double>(S(g, n, 1)[1]);
}

void moe_unpermute_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  need_dtype(g, n, 2, CTR_DTYPE_I32);
  const auto &yp = S(g, n, 0), &w = S(g, n, 1);
  if (yp.size() != 2) shape_mismatch(g, n, 0, "[rows, dim]");
  need_rank_at_least(g, n, 1, 1);
  if (S(g, n, 2) != w) shape_mismatch(g, n, 2, shape_string(w));
  auto s = leading(w);
  s.push_back(yp[1]);
  out = {f32(s)};
}

// Expert parallelism (inserted by the expert pass, not in files): ranks = the
// ep group's size P; experts are split into P contiguous blocks of E/P.
// moe_dispatch(xp[M, D], counts[E]) -> xr[P*M, D], seg_counts[E] (i32): each
//   rank sends its rows for block j to rank j and receives, from each rank p in
//   order, p's rows for its own experts; seg_counts[p*E/P + e] counts the rows
//   of p for local expert e.
// moe_combine(yr[P*M, D], counts[E], seg_counts[E]) -> yp[M, D]: the reverse.
// moe_dispatch_rows(y[M, D], counts[E], seg_counts[E]) -> [P*M, D]: dispatch of
//   rows with both counts known (the combine's gradient).
// moe_aux_stats(logits[..., E], experts[..., k]) -> [2E + 1]: per-expert
//   assignment counts, per-expert sums of the softmax, and the token count.
// moe_aux_loss_global(logits, experts, stats[2E + 1]): moe_aux_loss over the
//   statistics of every rank's batch (stats summed over the world).

void moe_dispatch_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const auto &x = S(g, n, 0);
  const int64_t P = n.attr_int("ranks", 1);
  out = {f32({P * x[0], x[1]}), OutInfo{CTR_DTYPE_I32, S(g, n, 1)}};
}

void moe_combine_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const auto &x = S(g, n, 0);
  const int64_t P = n.attr_int("ranks", 1);
  out = {f32({x[0] / P, x[1]})};
}

void moe_dispatch_rows_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const auto &x = S(g, n, 0);
  out = {f32({n.attr_int("ranks", 1) * x[0], x[1]})};
}

void moe_aux_stats_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  out = {f32({2 * S(g, n, 0).back() + 1})};
}

void all_reduce_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  out.clear();
  for (int in : n.inputs) out.push_back(OutInfo{g.tensors[in].dtype, g.tensors[in].shape});
}

void moe_dispatch_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("moe_combine", {gy, n.inputs[1], n.outputs[1]}, {gx}, n.attrs, n.block);
  b.accumulate(n.inputs[0], gx);
}

void moe_combine_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("moe_dispatch_rows", {gy, n.inputs[1], n.inputs[2]}, {gx}, n.attrs, n.block);
  b.accumulate(n.inputs[0], gx);
}

void moe_grouped_linear_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_grouped_linear_params *>(out)->weight_grad_scale =
      static_cast<float>(n.attr_float("weight_grad_scale", 1.0));
}

void moe_router_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_moe_router_params *>(out);
  p->top_k = n.attr_int("top_k", 1);
  p->sigmoid = n.attr_string("score", "softmax") == "sigmoid";
  p->renorm = n.attr_int("renorm", p->top_k > 1) != 0;
}

template <int PerMille>
void moe_loss_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_moe_loss_params *>(out)->coef = static_cast<float>(n.attr_float("coef", PerMille / 1000.0));
}

// Expert ids index the experts; slots index the permuted rows; counts are row counts.
bool moe_expert_ids(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 1) return false;
  *lo = 0;
  *hi = n.op == "moe_permute" ? n.attr_int("experts", 1) : S(g, n, 0).back();
  return true;
}
bool moe_slot_ids(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 2) return false;
  *lo = 0;
  *hi = S(g, n, 0)[0];
  return true;
}
bool moe_count_ids(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 2) return false;
  *lo = 0;
  *hi = S(g, n, 0)[0] + 1;
  return true;
}

// ---------------------------------------------------------------------------
// Attribute decoding and id ranges

void embedding_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_embedding_params *>(out)->padding_idx = n.attr_int("padding_idx", -1);
}

void norm_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_norm_params *>(out);
  p->eps = static_cast<float>(n.attr_float("eps", 1e-5));
}

// Required: pow_infer refuses a node without it, so the default is never used.
void pow_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_pow_params *>(out)->exponent = static_cast<float>(n.attr_float("exponent", 1.0));
}

void clamp_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_clamp_params *>(out);
  p->min = static_cast<float>(n.attr_float("min", -INFINITY));
  p->max = static_cast<float>(n.attr_float("max", INFINITY));
}

void rope_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_rope_params *>(out);
  p->heads = n.attr_int("heads", 1);
  p->theta = static_cast<float>(n.attr_float("theta", 10000.0));
  p->interleaved = n.attr_int("interleaved", 0) != 0;
  p->cp_ranks = n.attr_int("cp_ranks", 1);
  p->cp_index = n.attr_int("cp_index", 0);
}

// attention reads q as input 0, attention_bwd as input 1 (after the gradient).
void attention_decode_at(const Graph &g, const Node &n, ctr_attention_params *p, size_t q_input) {
  p->heads = n.attr_int("heads", 1);
  p->kv_heads = n.attr_int("kv_heads", p->heads);
  const int64_t D = S(g, n, q_input)[2] / p->heads;
  p->scale = static_cast<float>(n.attr_float("scale", 1.0 / std::sqrt(static_cast<double>(D))));
  p->causal = n.attr_int("causal", 1) != 0;
  p->window = n.attr_int("window", 0);
  p->softcap = static_cast<float>(n.attr_float("softcap", 0.0));
  p->cp_ranks = n.attr_int("cp_ranks", 1);
  p->cp_index = n.attr_int("cp_index", 0);
}

template <int Q>
void attention_decode(const Graph &g, const Node &n, void *out) {
  attention_decode_at(g, n, static_cast<ctr_attention_params *>(out), Q);
}

void transpose_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_transpose_params *>(out);
  auto perm = n.attr_ints("perm");
  p->ndim = static_cast<int32_t>(perm.size());
  for (size_t i = 0; i < perm.size() && i < 8; ++i) p->perm[i] = static_cast<int32_t>(perm[i]);
}

// embedding: ids index the table's rows.
bool embedding_ids(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 1) return false;
  *lo = 0;
  *hi = S(g, n, 0)[0];
  return true;
}

// cross_entropy: targets are classes of the last dim, or negative down to
// attr ignore_index (default -1; PyTorch's default is -100): ignored.
bool xent_ids(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 1) return false;
  *lo = std::min<int64_t>(-1, n.attr_int("ignore_index", -1));
  *hi = S(g, n, 0).back();
  return true;
}

// ---------------------------------------------------------------------------
// The library's ops

std::vector<OpDef> library_ops() {
  std::vector<OpDef> v;
  OpDef e = with_bwd(fwd("embedding", 2, 2, embedding_infer, zero_flops), "embedding_bwd", {G(0), In(1)}, 1);
  e.id_range = embedding_ids;
  v.push_back(with_params<ctr_embedding_params>(e, embedding_decode));
  OpDef lin = fwd("linear", 2, 3, linear_infer, linear_flops);
  lin.vjp = linear_vjp;
  v.push_back(lin);
  v.push_back(with_bwd(fwd("matmul", 2, 2, matmul_infer, matmul_flops), "matmul_bwd", {G(0), In(0), In(1)}));
  OpDef ln = with_bwd(fwd("layernorm", 2, 3, norm_infer, norm_flops), "layernorm_bwd",
                      {G(0), In(0), In(1), Out(1), Out(2)});
  ln.saved = {"mean", "rstd"};
  v.push_back(with_params<ctr_norm_params>(ln, norm_decode));
  OpDef rms = with_bwd(fwd("rmsnorm", 2, 2, norm_infer, norm_flops), "rmsnorm_bwd", {G(0), In(0), In(1), Out(1)});
  rms.saved = {"rstd"};
  v.push_back(with_params<ctr_norm_params>(rms, norm_decode));
  v.push_back(with_bwd(fwd("silu", 1, 1, infer_same_f32, elementwise_flops), "silu_bwd", {G(0), In(0)}));
  v.push_back(with_bwd(fwd("swiglu", 2, 2, infer_same_f32, elementwise_flops), "swiglu_bwd", {G(0), In(0), In(1)}));
  v.push_back(with_bwd(fwd("exp", 1, 1, infer_same_f32, elementwise_flops), "exp_bwd", {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("log", 1, 1, infer_same_f32, elementwise_flops), "log_bwd", {G(0), In(0)}));
  v.push_back(with_bwd(fwd("tanh", 1, 1, infer_same_f32, elementwise_flops), "tanh_bwd", {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("erf", 1, 1, infer_same_f32, elementwise_flops), "erf_bwd", {G(0), In(0)}));
  v.push_back(with_bwd(fwd("rsqrt", 1, 1, infer_same_f32, elementwise_flops), "rsqrt_bwd", {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("sqrt", 1, 1, infer_same_f32, elementwise_flops), "sqrt_bwd", {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("neg", 1, 1, infer_same_f32, elementwise_flops), "neg_bwd", {G(0)}));
  v.push_back(with_bwd(fwd("reciprocal", 1, 1, infer_same_f32, elementwise_flops), "reciprocal_bwd",
                       {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("sigmoid", 1, 1, infer_same_f32, elementwise_flops), "sigmoid_bwd", {G(0), Out(0)}));
  v.push_back(with_bwd(fwd("relu", 1, 1, infer_same_f32, elementwise_flops), "relu_bwd", {G(0), In(0)}));
  v.push_back(with_params<ctr_clamp_params>(
      with_bwd(fwd("clamp", 1, 1, clamp_infer, elementwise_flops), "clamp_bwd", {G(0), In(0)}), clamp_decode));
  v.push_back(with_params<ctr_pow_params>(
      with_bwd(fwd("pow", 1, 1, pow_infer, elementwise_flops), "pow_bwd", {G(0), In(0)}), pow_decode));
  v.push_back(with_params<ctr_rope_params>(
      with_bwd(fwd("rope", 1, 1, rope_infer, elementwise_flops), "rope_bwd", {G(0)}), rope_decode));
  // attention_bwd also reads the output: a backend whose backward needs it
  // (cuDNN's fused SDPA sums dout * out per row) reads it there; the others
  // ignore it. It is alive then anyway (the output projection's weight
  // gradient reads it).
  OpDef at = with_bwd(fwd("attention", 3, 3, attention_infer, attention_flops), "attention_bwd",
                      {G(0), In(0), In(1), In(2), Out(1), Out(0)});
  at.saved = {"probs"};
  v.push_back(with_params<ctr_attention_params>(at, attention_decode<0>));
  // Context parallelism (the place pass): the same ops on a sequence split over cp.
  OpDef cpa = with_bwd(internal("cp_attention", 3, 1), "cp_attention_bwd",
                       {G(0), In(0), In(1), In(2), Out(1), Out(0)});
  cpa.infer = cp_attention_infer;
  cpa.flops = cp_attention_flops;
  cpa.saved = {"probs"};
  v.push_back(with_params<ctr_attention_params>(cpa, attention_decode<0>));
  // Ring attention over cp: one block per source rank, merged pairwise.
  OpDef cpb = with_bwd(internal("cp_attention_block", 3, 2), "cp_attention_block_bwd",
                       {G(0), G(1), In(0), In(1), In(2), Out(2)});
  cpb.infer = cp_attention_block_infer;
  cpb.flops = attention_flops;
  cpb.saved = {"probs"};
  v.push_back(with_params<ctr_attention_block_params>(cpb, cp_attention_block_decode<0>));
  OpDef merge = internal("attn_merge", 4, 2);
  merge.infer = attn_merge_infer;
  merge.flops = elementwise_flops;
  merge.vjp = attn_merge_vjp;
  v.push_back(with_params<ctr_attn_merge_params>(merge, attn_merge_decode));
  OpDef cpr = with_bwd(internal("cp_rope", 1, 1), "cp_rope_bwd", {G(0)});
  cpr.infer = cp_rope_infer;
  cpr.flops = elementwise_flops;
  v.push_back(with_params<ctr_rope_params>(cpr, rope_decode));
  OpDef xe = with_bwd(fwd("cross_entropy", 2, 2, xent_infer, xent_flops), "cross_entropy_bwd",
                      {G(0), In(0), In(1), Out(1), Out(2)}, 1);
  xe.saved = {"lse", "count"};
  xe.id_range = xent_ids;
  v.push_back(xe);
  OpDef rs = fwd("reshape", 1, 1, reshape_infer, zero_flops);
  rs.vjp = reshape_vjp;
  rs.moves_values = true;
  v.push_back(rs);
  OpDef tr = fwd("transpose", 1, 1, transpose_infer, zero_flops);
  tr.vjp = transpose_vjp;
  tr.moves_values = true;
  v.push_back(with_params<ctr_transpose_params>(tr, transpose_decode));
  v.push_back(with_bwd(fwd("take_rows", 2, 2, take_rows_infer, zero_flops), "take_rows_bwd", {G(0)}, 1));
  append_layout_ops(v);
  OpDef router = with_bwd(fwd("moe_router", 1, 1, moe_router_infer, elementwise_flops), "moe_router_bwd",
                          {G(0), Out(2), Out(1)});
  router.num_outputs = 2;
  router.saved = {"scores"};
  v.push_back(with_params<ctr_moe_router_params>(router, moe_router_decode));
  OpDef aux = with_bwd(fwd("moe_aux_loss", 2, 2, moe_aux_loss_infer, elementwise_flops), "moe_aux_loss_bwd",
                       {G(0), In(0), In(1)}, 1);
  aux.id_range = moe_expert_ids;
  v.push_back(with_params<ctr_moe_loss_params>(aux, moe_loss_decode<10>));
  v.push_back(with_params<ctr_moe_loss_params>(
      with_bwd(fwd("moe_z_loss", 1, 1, moe_z_loss_infer, elementwise_flops), "moe_z_loss_bwd", {G(0), In(0)}),
      moe_loss_decode<1>));
  OpDef perm = with_bwd(fwd("moe_permute", 2, 2, moe_permute_infer, zero_flops), "moe_permute_bwd",
                        {G(0), Out(2)}, 1);
  perm.num_outputs = 3;
  perm.id_range = moe_expert_ids;
  v.push_back(perm);
  OpDef gl = with_bwd(fwd("moe_grouped_linear", 3, 3, moe_grouped_linear_infer, moe_grouped_linear_flops),
                      "moe_grouped_linear_bwd", {G(0), In(0), In(1), In(2)}, 2);
  gl.id_range = moe_count_ids;
  v.push_back(with_params<ctr_grouped_linear_params>(gl, moe_grouped_linear_decode));
  OpDef disp = fwd("moe_dispatch", 2, 2, moe_dispatch_infer, zero_flops);
  disp.num_outputs = 2;
  disp.internal = true;
  disp.vjp = moe_dispatch_vjp;
  disp.collective = CollKind::Dispatch;
  v.push_back(disp);
  OpDef comb = fwd("moe_combine", 3, 3, moe_combine_infer, zero_flops);
  comb.internal = true;
  comb.vjp = moe_combine_vjp;
  comb.collective = CollKind::Combine;
  v.push_back(comb);
  OpDef drows = fwd("moe_dispatch_rows", 3, 3, moe_dispatch_rows_infer, zero_flops);
  drows.internal = true;
  drows.collective = CollKind::DispatchRows;
  v.push_back(drows);
  OpDef stats = fwd("moe_aux_stats", 2, 2, moe_aux_stats_infer, elementwise_flops);
  stats.internal = true;
  v.push_back(stats);
  OpDef auxg = with_bwd(fwd("moe_aux_loss_global", 3, 3, moe_aux_loss_infer, elementwise_flops),
                        "moe_aux_loss_global_bwd", {G(0), In(0), In(1), In(2)}, 1);
  auxg.internal = true;
  v.push_back(with_params<ctr_moe_loss_params>(auxg, moe_loss_decode<10>));
  OpDef unperm = with_bwd(fwd("moe_unpermute", 3, 3, moe_unpermute_infer, elementwise_flops),
                          "moe_unpermute_bwd", {G(0), In(0), In(2), In(1)}, 2);
  unperm.id_range = moe_slot_ids;
  v.push_back(unperm);

  // Cheap to recompute: everything but GEMMs, attention and lookups.
  for (OpDef &d : v)
    d.cheap_to_recompute = d.name != "linear" && d.name != "matmul" && d.name != "attention" &&
                           d.name != "cp_attention" &&
                           d.name != "embedding" && d.name != "cross_entropy" &&
                           d.name != "moe_grouped_linear";

  // Internal ops emitted by autodiff.
  v.push_back(with_params<ctr_embedding_params>(internal("embedding_bwd", 2, 1), embedding_decode));
  v.push_back(internal("linear_bwd_x", 2, 1));
  v.push_back(internal("linear_bwd_w", 2, 1));
  v.push_back(internal("linear_bwd_b", 1, 1));
  // Fused by the epilogues pass where the backend has them (GEMM epilogues):
  // (dy, x) -> (dw, db); (x, w [, b]) -> (gelu(h), h); (g, w, h) -> g w * gelu'(h).
  v.push_back(internal("linear_bwd_wb", 2, 2));
  OpDef linear_gelu = internal("linear_gelu", 2, 2);
  linear_gelu.max_inputs = 3;
  v.push_back(linear_gelu);
  v.push_back(internal("linear_bwd_x_dgelu", 3, 1));
  v.push_back(internal("matmul_bwd", 3, 2));
  v.push_back(with_params<ctr_norm_params>(internal("layernorm_bwd", 5, 3), norm_decode));
  v.push_back(with_params<ctr_norm_params>(internal("rmsnorm_bwd", 4, 2), norm_decode));
  v.push_back(internal("silu_bwd", 2, 1));
  v.push_back(internal("swiglu_bwd", 3, 2));
  for (const char *name : {"exp_bwd", "log_bwd", "tanh_bwd", "erf_bwd", "rsqrt_bwd", "sqrt_bwd",
                           "reciprocal_bwd", "sigmoid_bwd", "relu_bwd"})
    v.push_back(internal(name, 2, 1));
  v.push_back(with_params<ctr_clamp_params>(internal("clamp_bwd", 2, 1), clamp_decode));
  v.push_back(internal("neg_bwd", 1, 1));
  v.push_back(with_params<ctr_pow_params>(internal("pow_bwd", 2, 1), pow_decode));
  v.push_back(with_params<ctr_rope_params>(internal("rope_bwd", 1, 1), rope_decode));
  v.push_back(with_params<ctr_attention_params>(internal("attention_bwd", 6, 3), attention_decode<1>));
  v.push_back(with_params<ctr_rope_params>(internal("cp_rope_bwd", 1, 1), rope_decode));
  v.push_back(with_params<ctr_attention_params>(internal("cp_attention_bwd", 6, 3), attention_decode<1>));
  v.push_back(with_params<ctr_attention_block_params>(internal("cp_attention_block_bwd", 6, 3),
                                                      cp_attention_block_decode<2>));
  OpDef merge_bwd = internal("attn_merge_bwd", 7, 4);
  merge_bwd.max_inputs = 8;
  v.push_back(with_params<ctr_attn_merge_params>(merge_bwd, attn_merge_decode));
  v.push_back(internal("cross_entropy_bwd", 5, 1));
  v.push_back(internal("add_same", 2, 1));
  v.push_back(internal("take_rows_bwd", 1, 1));
  // precision pass: a copy of an f32 tensor in the output's dtype (bf16).
  v.push_back(internal("cast", 1, 1));
  v.push_back(with_params<ctr_moe_router_params>(internal("moe_router_bwd", 3, 1), moe_router_decode));
  v.push_back(with_params<ctr_moe_loss_params>(internal("moe_aux_loss_bwd", 3, 1), moe_loss_decode<10>));
  v.push_back(with_params<ctr_moe_loss_params>(internal("moe_z_loss_bwd", 2, 1), moe_loss_decode<1>));
  v.push_back(internal("moe_permute_bwd", 2, 1));
  v.push_back(with_params<ctr_grouped_linear_params>(internal("moe_grouped_linear_bwd", 4, 2),
                                                     moe_grouped_linear_decode));
  v.push_back(with_params<ctr_moe_loss_params>(internal("moe_aux_loss_global_bwd", 4, 1), moe_loss_decode<10>));
  v.push_back(internal("moe_unpermute_bwd", 4, 2));
  // Broadcasting arithmetic, reductions, softmax and gelu (ops_math.cc).
  append_math_ops(v);
  // Kernels that write an f32 gradient from bf16 data (precision pass).
  const std::pair<const char *, uint32_t> f32_writers[] = {
      {"linear_bwd_w", 1u}, {"linear_bwd_x", 1u}, {"linear_bwd_b", 1u}, {"linear_bwd_wb", 3u}, {"matmul_bwd", 3u},
      {"reduce_rows", 1u},  {"layernorm_bwd", 6u}, {"rmsnorm_bwd", 2u}, {"embedding_bwd", 1u},
      {"mul_bwd", 2u},      {"add_same", 1u},      {"take_rows_bwd", 1u}};
  for (OpDef &d : v)
    for (const auto &[name, mask] : f32_writers)
      if (d.name == name) d.f32_outputs = mask;
  // Collectives inserted by the shard pass (one output per input; the bucket
  // pass merges several into one node); the executor runs them on the comm stream.
  const std::pair<const char *, CollKind> colls[] = {{"all_gather", CollKind::AllGather},
                                                      {"reduce_scatter", CollKind::ReduceScatter},
                                                      {"all_reduce", CollKind::AllReduce},
                                                      {"all_to_all", CollKind::AllToAll},
                                                      {"ring_shift", CollKind::Shift}};
  for (const auto &[name, kind] : colls) {
    OpDef c = internal(name, 1, 1);
    c.max_inputs = 1 << 20;
    c.collective = kind;
    // The expert pass inserts an all-reduce before shapes are final.
    if (kind == CollKind::AllReduce) c.infer = all_reduce_infer;
    v.push_back(c);
  }
  append_placement_ops(v);
  return v;
}

// ---------------------------------------------------------------------------
// The registry

struct Registry {
  std::mutex mu;
  std::deque<OpDef> defs;  // stable addresses; index == id
  std::unordered_map<std::string, OpId> by_name;

  OpId add(OpDef d) {
    std::lock_guard<std::mutex> lock(mu);
    CTR_REQUIRE(!d.name.empty(), CTR_STATUS_INVALID_ARGUMENT, "register_op: the op has no name");
    CTR_REQUIRE(!by_name.count(d.name), CTR_STATUS_INVALID_ARGUMENT,
                "register_op: op '%s' is already registered", d.name.c_str());
    CTR_REQUIRE(d.min_inputs >= 0 && d.min_inputs <= d.max_inputs && d.num_outputs >= 1,
                CTR_STATUS_INVALID_ARGUMENT, "register_op: op '%s' has an inconsistent arity",
                d.name.c_str());
    CTR_REQUIRE(d.internal || d.infer, CTR_STATUS_INVALID_ARGUMENT,
                "register_op: op '%s' may appear in files but has no shape rule", d.name.c_str());
    CTR_REQUIRE((d.params_size == 0) == (d.decode == nullptr), CTR_STATUS_INVALID_ARGUMENT,
                "register_op: op '%s' needs both params_size and decode, or neither", d.name.c_str());
    d.id = static_cast<OpId>(defs.size());
    by_name[d.name] = d.id;
    defs.push_back(std::move(d));
    return defs.back().id;
  }
};

Registry &registry() {
  static Registry *r = [] {
    auto *reg = new Registry;  // never destroyed: ops outlive every static user
    for (OpDef &d : library_ops()) reg->add(std::move(d));
    return reg;
  }();
  return *r;
}

}  // namespace

OpId register_op(OpDef def) {
  // A declarative gradient names its backward op, which must exist (possibly
  // registered by the same host just before).
  Registry &r = registry();
  if (!def.bwd.op.empty())
    CTR_REQUIRE(find_op(def.bwd.op) != nullptr || def.bwd.op == def.name, CTR_STATUS_INVALID_ARGUMENT,
                "register_op: op '%s' names backward op '%s', which is not registered", def.name.c_str(),
                def.bwd.op.c_str());
  return r.add(std::move(def));
}

const OpDef *find_op(const std::string &name) {
  // Every pass looks ops up by name, from the planner's threads at once: each
  // thread keeps what it found (definitions are never removed and keep their
  // addresses), so a lookup takes the registry's lock only the first time.
  thread_local std::unordered_map<std::string, const OpDef *> seen;
  if (auto hit = seen.find(name); hit != seen.end()) return hit->second;
  Registry &r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_name.find(name);
  if (it == r.by_name.end()) return nullptr;  // (it may be registered later)
  const OpDef *d = &r.defs[static_cast<size_t>(it->second)];
  seen.emplace(name, d);
  return d;
}

CollKind collective_kind(const Node &n) {
  const OpDef *d = find_op(n.op);
  return d ? d->collective : CollKind::None;
}

const OpDef *op_by_id(OpId id) {
  Registry &r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return id >= 0 && static_cast<size_t>(id) < r.defs.size() ? &r.defs[static_cast<size_t>(id)] : nullptr;
}

std::vector<std::string> file_op_names() {
  Registry &r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const OpDef &d : r.defs)
    if (!d.internal) out.push_back(d.name);
  return out;
}

std::vector<uint8_t> decode_params(const Graph &g, const Node &n) {
  const OpDef *d = find_op(n.op);
  CTR_CHECK(d != nullptr);
  std::vector<uint8_t> out(d->params_size);
  if (d->decode) d->decode(g, n, out.data());
  return out;
}

}  // namespace ctr
