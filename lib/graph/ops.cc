// Shape rules, FLOP counts and VJP rules of the op set (see ops.h).
//
// Each forward op is a few small functions next to each other, so the shape rule
// and the gradient of an op are read together. Shape rules throw INVALID_GRAPH
// naming the node and the tensor at fault; VJP rules only emit nodes, whose
// shapes follow from the forward tensors they mirror.

#include "graph/ops.h"

#include <cmath>
#include <map>

#include "core/status.h"

namespace ctr {
namespace {

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

std::map<std::string, Attr> same_attrs(const Node &n) { return n.attrs; }

void infer_same_f32(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  for (size_t i = 0; i < n.inputs.size(); ++i) need_dtype(g, n, static_cast<int>(i), CTR_DTYPE_F32);
  for (size_t i = 1; i < n.inputs.size(); ++i)
    if (S(g, n, static_cast<int>(i)) != S(g, n, 0)) shape_mismatch(g, n, static_cast<int>(i), shape_string(S(g, n, 0)));
  out = {f32(S(g, n, 0))};
}

// ---------------------------------------------------------------------------
// embedding(table[V,C], ids[...]) -> [..., C]

void embedding_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  if (S(g, n, 0).size() != 2) shape_mismatch(g, n, 0, "[vocab, dim]");
  auto s = S(g, n, 1);
  s.push_back(S(g, n, 0)[1]);
  out = {f32(s)};
}

void embedding_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gt = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("embedding_bwd", {gy, n.inputs[1]}, {gt}, {}, n.block);
  b.accumulate(n.inputs[0], gt);
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

void matmul_vjp(VjpBuilder &b, const Node &n) {
  int gc = b.grad(n.outputs[0]);
  if (gc < 0) return;
  int a = n.inputs[0], bb = n.inputs[1];
  if (!b.needs(a) && !b.needs(bb)) return;
  int ga = b.new_grad_tensor(a, "grad");
  int gb = b.new_grad_tensor(bb, "grad");
  b.emit("matmul_bwd", {gc, a, bb}, {ga, gb}, {}, n.block);
  if (b.needs(a)) b.accumulate(a, ga);
  if (b.needs(bb)) b.accumulate(bb, gb);
}

// ---------------------------------------------------------------------------
// add / mul (a, b): b's shape is a trailing part of a's (broadcast over rows).

bool is_suffix(const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
  if (b.size() > a.size()) return false;
  return std::equal(b.begin(), b.end(), a.end() - static_cast<long>(b.size()));
}

void binary_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  if (!is_suffix(S(g, n, 0), S(g, n, 1)))
    shape_mismatch(g, n, 1, "a trailing part of " + shape_string(S(g, n, 0)) + " (broadcast)");
  out = {f32(S(g, n, 0))};
}

void add_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  int a = n.inputs[0], bb = n.inputs[1];
  if (b.needs(a)) b.accumulate(a, gy);
  if (b.needs(bb)) {
    if (b.graph().tensors[bb].shape == b.graph().tensors[a].shape) {
      b.accumulate(bb, gy);
    } else {
      int gb = b.new_grad_tensor(bb, "grad");
      b.emit("reduce_rows", {gy}, {gb}, {}, n.block);
      b.accumulate(bb, gb);
    }
  }
}

void mul_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  int a = n.inputs[0], bb = n.inputs[1];
  if (!b.needs(a) && !b.needs(bb)) return;
  int ga = b.new_grad_tensor(a, "grad");
  int gb = b.new_grad_tensor(bb, "grad");
  b.emit("mul_bwd", {gy, a, bb}, {ga, gb}, {}, n.block);
  if (b.needs(a)) b.accumulate(a, ga);
  if (b.needs(bb)) b.accumulate(bb, gb);
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

void layernorm_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  std::vector<int> outs;
  for (int i : n.inputs) outs.push_back(b.new_grad_tensor(i, "grad"));
  b.emit("layernorm_bwd", {gy, n.inputs[0], n.inputs[1], n.outputs[1], n.outputs[2]}, outs,
         same_attrs(n), n.block);
  for (size_t i = 0; i < n.inputs.size(); ++i)
    if (b.needs(n.inputs[i])) b.accumulate(n.inputs[i], outs[i]);
}

void rmsnorm_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  int gw = b.new_grad_tensor(n.inputs[1], "grad");
  b.emit("rmsnorm_bwd", {gy, n.inputs[0], n.inputs[1], n.outputs[1]}, {gx, gw}, same_attrs(n),
         n.block);
  if (b.needs(n.inputs[0])) b.accumulate(n.inputs[0], gx);
  if (b.needs(n.inputs[1])) b.accumulate(n.inputs[1], gw);
}

double norm_flops(const Graph &g, const Node &n) { return 8.0 * static_cast<double>(numel(S(g, n, 0))); }

// ---------------------------------------------------------------------------
// gelu / silu (x) ; swiglu(gate, up) ; softmax(x)

void unary_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit(n.op + "_bwd", {gy, n.inputs[0]}, {gx}, {}, n.block);
  b.accumulate(n.inputs[0], gx);
}

void swiglu_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  int gg = b.new_grad_tensor(n.inputs[0], "grad");
  int gu = b.new_grad_tensor(n.inputs[1], "grad");
  b.emit("swiglu_bwd", {gy, n.inputs[0], n.inputs[1]}, {gg, gu}, {}, n.block);
  if (b.needs(n.inputs[0])) b.accumulate(n.inputs[0], gg);
  if (b.needs(n.inputs[1])) b.accumulate(n.inputs[1], gu);
}

void softmax_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("softmax_bwd", {gy, n.outputs[0]}, {gx}, {}, n.block);
  b.accumulate(n.inputs[0], gx);
}

// ---------------------------------------------------------------------------
// rope(x[B, T, H*D]) attrs heads, theta

void rope_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  const auto &x = S(g, n, 0);
  if (x.size() != 3) shape_mismatch(g, n, 0, "[batch, seq, heads*head_dim]");
  int64_t H = n.attr_int("heads", 0);
  if (H <= 0 || x[2] % H != 0 || (x[2] / H) % 2 != 0)
    bad_node(g, n, strformat("attribute heads=%lld must divide the last dim %lld into even "
                             "head sizes",
                             static_cast<long long>(H), static_cast<long long>(x[2])));
  out = {f32(x)};
}

void rope_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("rope_bwd", {gy}, {gx}, same_attrs(n), n.block);
  b.accumulate(n.inputs[0], gx);
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
  int64_t D = q[2] / H;
  std::vector<int64_t> kv = {q[0], q[1], Hkv * D};
  if (k != kv) shape_mismatch(g, n, 1, shape_string(kv));
  if (v != kv) shape_mismatch(g, n, 2, shape_string(kv));
  out = {f32(q), f32({q[0], H, q[1], q[1]})};
}

double attention_flops(const Graph &g, const Node &n) {
  const auto &q = S(g, n, 0);
  return 4.0 * static_cast<double>(q[0]) * static_cast<double>(q[1]) *
         static_cast<double>(q[1]) * static_cast<double>(q[2]);
}

void attention_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  std::vector<int> outs;
  for (int i : n.inputs) outs.push_back(b.new_grad_tensor(i, "grad"));
  b.emit("attention_bwd", {gy, n.inputs[0], n.inputs[1], n.inputs[2], n.outputs[1]}, outs,
         same_attrs(n), n.block);
  for (size_t i = 0; i < 3; ++i)
    if (b.needs(n.inputs[i])) b.accumulate(n.inputs[i], outs[i]);
}

// ---------------------------------------------------------------------------
// cross_entropy(logits[..., V], targets[...]) -> loss (scalar), saved lse[R], count

void xent_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  need_rank_at_least(g, n, 0, 1);
  const auto &l = S(g, n, 0);
  std::vector<int64_t> rows(l.begin(), l.end() - 1);
  if (S(g, n, 1) != rows) shape_mismatch(g, n, 1, shape_string(rows));
  out = {f32({}), f32({numel(rows)}), OutInfo{CTR_DTYPE_I64, {1}}};
}

void xent_vjp(VjpBuilder &b, const Node &n) {
  int gl = b.grad(n.outputs[0]);
  if (gl < 0 || !b.needs(n.inputs[0])) return;
  int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("cross_entropy_bwd", {gl, n.inputs[0], n.inputs[1], n.outputs[1], n.outputs[2]}, {gx},
         {}, n.block);
  b.accumulate(n.inputs[0], gx);
}

double xent_flops(const Graph &g, const Node &n) { return 4.0 * static_cast<double>(numel(S(g, n, 0))); }

// ---------------------------------------------------------------------------
// reshape(x) attr shape (0 keeps the input dim at that position, one -1 infers)
// transpose(x) attr perm

std::vector<int64_t> reshape_target(const Graph &g, const Node &n) {
  const auto &x = S(g, n, 0);
  std::vector<int64_t> s = n.attr_ints("shape");
  if (!n.has_attr("shape")) bad_node(g, n, "missing attribute 'shape'");
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == 0) {
      if (i >= x.size()) bad_node(g, n, "shape entry 0 past the input's rank");
      s[i] = x[i];
    }
    if (s[i] == -1) {
      if (infer >= 0) bad_node(g, n, "more than one -1 in attribute 'shape'");
      infer = static_cast<int>(i);
    } else if (s[i] < 0) {
      bad_node(g, n, "negative size in attribute 'shape'");
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel(x) % known != 0)
      bad_node(g, n, "cannot infer the -1 dim of attribute 'shape'");
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
  need_dtype(g, n, 0, CTR_DTYPE_F32);
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
  out = {f32(s)};
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

void take_rows_vjp(VjpBuilder &b, const Node &n) {
  int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  int gt = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("take_rows_bwd", {gy}, {gt}, {}, n.block);
  b.accumulate(n.inputs[0], gt);
}

void no_infer(const Graph &g, const Node &n, std::vector<OutInfo> &) {
  bad_node(g, n, "internal op cannot be shape-inferred");
}

// ---------------------------------------------------------------------------
// The table

const std::vector<OpDef> &table() {
  static const std::vector<OpDef> ops = {
      {"embedding", 2, 2, 1, {}, false, embedding_infer, embedding_vjp, zero_flops},
      {"linear", 2, 3, 1, {}, false, linear_infer, linear_vjp, linear_flops},
      {"matmul", 2, 2, 1, {}, false, matmul_infer, matmul_vjp, matmul_flops},
      {"add", 2, 2, 1, {}, false, binary_infer, add_vjp, elementwise_flops},
      {"mul", 2, 2, 1, {}, false, binary_infer, mul_vjp, elementwise_flops},
      {"layernorm", 2, 3, 1, {"mean", "rstd"}, false, norm_infer, layernorm_vjp, norm_flops},
      {"rmsnorm", 2, 2, 1, {"rstd"}, false, norm_infer, rmsnorm_vjp, norm_flops},
      {"gelu", 1, 1, 1, {}, false, infer_same_f32, unary_vjp, elementwise_flops},
      {"silu", 1, 1, 1, {}, false, infer_same_f32, unary_vjp, elementwise_flops},
      {"swiglu", 2, 2, 1, {}, false, infer_same_f32, swiglu_vjp, elementwise_flops},
      {"softmax", 1, 1, 1, {}, false, infer_same_f32, softmax_vjp, elementwise_flops},
      {"rope", 1, 1, 1, {}, false, rope_infer, rope_vjp, elementwise_flops},
      {"attention", 3, 3, 1, {"probs"}, false, attention_infer, attention_vjp, attention_flops},
      {"cross_entropy", 2, 2, 1, {"lse", "count"}, false, xent_infer, xent_vjp, xent_flops},
      {"reshape", 1, 1, 1, {}, false, reshape_infer, reshape_vjp, zero_flops},
      {"transpose", 1, 1, 1, {}, false, transpose_infer, transpose_vjp, zero_flops},
      {"take_rows", 2, 2, 1, {}, false, take_rows_infer, take_rows_vjp, zero_flops},
      // Internal ops emitted by autodiff.
      {"embedding_bwd", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"linear_bwd_x", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"linear_bwd_w", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"linear_bwd_b", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      {"matmul_bwd", 3, 3, 2, {}, true, no_infer, nullptr, zero_flops},
      {"reduce_rows", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      {"mul_bwd", 3, 3, 2, {}, true, no_infer, nullptr, zero_flops},
      {"layernorm_bwd", 5, 5, 3, {}, true, no_infer, nullptr, zero_flops},
      {"rmsnorm_bwd", 4, 4, 2, {}, true, no_infer, nullptr, zero_flops},
      {"gelu_bwd", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"silu_bwd", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"swiglu_bwd", 3, 3, 2, {}, true, no_infer, nullptr, zero_flops},
      {"softmax_bwd", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"rope_bwd", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      {"attention_bwd", 5, 5, 3, {}, true, no_infer, nullptr, zero_flops},
      {"cross_entropy_bwd", 5, 5, 1, {}, true, no_infer, nullptr, zero_flops},
      {"add_same", 2, 2, 1, {}, true, no_infer, nullptr, zero_flops},
      {"take_rows_bwd", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      // Collectives inserted by the shard pass.
      {"all_gather", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      {"reduce_scatter", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
      {"all_reduce", 1, 1, 1, {}, true, no_infer, nullptr, zero_flops},
  };
  return ops;
}

}  // namespace

const OpDef *find_op(const std::string &name) {
  for (const OpDef &d : table())
    if (name == d.name) return &d;
  return nullptr;
}

std::vector<std::string> file_op_names() {
  std::vector<std::string> out;
  for (const OpDef &d : table())
    if (!d.internal) out.push_back(d.name);
  return out;
}

}  // namespace ctr
