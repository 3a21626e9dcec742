// Sharding rules of the library's ops (OpDef::shard_rule), and the ops that
// move activations between placements inside the forward graph: `fanout`
// (identity forward; its gradient, a sum of partial gradients, all-reduced)
// and the gradient of a forward `all_reduce` (the identity).
//
// A rule sees one mesh axis at a time. The rules here cover what tensor
// parallelism needs: element-wise ops run on any common placement of
// same-shaped inputs, ops that work per attention head (rope, attention) run on
// tensors split by whole heads of their last dim with their head counts divided,
// and linear runs column-parallel (weight split on its output dim) or
// row-parallel (weight split on its input dim, a partial sum out).

#include <string>
#include <vector>

#include "core/status.h"
#include "graph/ops_internal.h"

namespace ctr {

std::string axis_state_string(const AxisState &s) {
  switch (s.kind) {
    case AxisState::Replicate: return "R";
    case AxisState::Shard: return "S(" + std::to_string(s.dim) + ")";
    case AxisState::Partial: return "P";
  }
  return "?";
}

namespace {

using namespace opdef;

bool all_replicated(const std::vector<AxisState> &in) {
  for (const AxisState &s : in)
    if (s.kind != AxisState::Replicate) return false;
  return true;
}

std::string describe(const std::vector<AxisState> &in) {
  std::string s;
  for (const AxisState &a : in) s += (s.empty() ? "" : ", ") + axis_state_string(a);
  return "(" + s + ")";
}

// Element-wise: every input the same shape and the same placement (a shard or
// a replica); the outputs take it. Partial sums pass through ops linear in
// their single input only (neg), which no rule here needs.
std::string pointwise_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t,
                           std::vector<AxisState> &out) {
  for (size_t i = 1; i < in.size(); ++i) {
    if (g.tensors[n->inputs[i]].shape != g.tensors[n->inputs[0]].shape)
      return in[i] == in[0] && in[0].kind == AxisState::Replicate ? "" : "inputs of different shapes (broadcast)";
    if (in[i] != in[0]) return "inputs placed differently " + describe(in);
  }
  if (in[0].kind == AxisState::Partial) return "a partial sum into a non-linear op";
  out.assign(n->outputs.size(), in[0]);
  return "";
}

int last_dim(const Graph &g, int t) { return static_cast<int>(g.tensors[t].shape.size()) - 1; }

// Divides the head-count attribute `attr` by ranks, or says why it cannot.
std::string split_heads(Node *n, const char *attr, int64_t heads, int64_t ranks) {
  if (heads % ranks != 0)
    return strformat("%s=%lld is not divisible by %lld ranks", attr, static_cast<long long>(heads),
                     static_cast<long long>(ranks));
  n->attrs[attr] = Attr::of_int(heads / ranks);
  return "";
}

// rope(x [B, T, heads*D]): by whole heads of the last dim.
std::string rope_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t ranks,
                      std::vector<AxisState> &out) {
  if (all_replicated(in)) {
    out.assign(n->outputs.size(), AxisState::replicate());
    return "";
  }
  if (in[0] != AxisState::shard(last_dim(g, n->inputs[0]))) return "input placed " + describe(in);
  std::string why = split_heads(n, "heads", n->attr_int("heads", 0), ranks);
  if (!why.empty()) return why;
  out.assign(n->outputs.size(), in[0]);
  return "";
}

// attention(q, k, v [B, T, heads*D]) -> out [B, T, heads*D], probs [B, heads, T, T]:
// q, k and v split by whole heads (kv heads too, so that each rank's query
// heads find their key/value heads locally).
std::string attention_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t ranks,
                           std::vector<AxisState> &out) {
  if (all_replicated(in)) {
    out.assign(n->outputs.size(), AxisState::replicate());
    return "";
  }
  for (int i = 0; i < 3; ++i)
    if (in[static_cast<size_t>(i)] != AxisState::shard(2)) return "q, k and v placed " + describe(in);
  const int64_t H = n->attr_int("heads", 0), Hkv = n->attr_int("kv_heads", H);
  std::string why = split_heads(n, "heads", H, ranks);
  if (why.empty()) why = split_heads(n, "kv_heads", Hkv, ranks);
  if (!why.empty()) return why;
  out.assign(n->outputs.size(), AxisState::shard(1));
  out[0] = AxisState::shard(2);
  return "";
}

// linear(x [..., in], w [out, in], b [out]): column-parallel (w and b split on
// out, x whole: y split on its last dim) or row-parallel (w split on in, x
// split on its last dim, no bias: y a partial sum).
std::string linear_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t,
                        std::vector<AxisState> &out) {
  const int xl = last_dim(g, n->inputs[0]);
  const bool bias = in.size() == 3;
  if (all_replicated(in)) {
    out = {AxisState::replicate()};
    return "";
  }
  if (in[0].kind == AxisState::Replicate && in[1] == AxisState::shard(0) && (!bias || in[2] == AxisState::shard(0))) {
    out = {AxisState::shard(xl)};
    return "";
  }
  if (in[0] == AxisState::shard(xl) && in[1] == AxisState::shard(1) && !bias) {
    out = {AxisState::partial()};
    return "";
  }
  return "neither column- nor row-parallel: " + describe(in);
}

// fanout / all_reduce: the forward identity or reduction.
std::string fanout_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t,
                        std::vector<AxisState> &out) {
  if (in[0].kind != AxisState::Replicate) return "input placed " + describe(in);
  out.assign(n->outputs.size(), AxisState::replicate());
  return "";
}

std::string all_reduce_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t,
                            std::vector<AxisState> &out) {
  if (in[0].kind != AxisState::Partial) return "input placed " + describe(in);
  out.assign(n->outputs.size(), AxisState::replicate());
  return "";
}

void fanout_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  std::map<std::string, Attr> attrs = {{"axis", Attr::of_string(n.attr_string("axis", ""))},
                                       {"reduce", Attr::of_string("sum")}};
  b.emit("all_reduce", {gy}, {gx}, attrs, n.block);
  b.accumulate(n.inputs[0], gx);
}

// A forward all-reduce of partial sums: each summand's gradient is the sum's.
void all_reduce_vjp(VjpBuilder &b, const Node &n) {
  for (size_t i = 0; i < n.inputs.size(); ++i) {
    const int gy = b.grad(n.outputs[i]);
    if (gy >= 0 && b.needs(n.inputs[i])) b.accumulate(n.inputs[i], gy);
  }
}

}  // namespace

void append_placement_ops(std::vector<OpDef> &v) {
  OpDef f = internal("fanout", 1, 1);
  f.infer = infer_same_f32;
  f.vjp = fanout_vjp;
  f.moves_values = true;
  f.shard_rule = fanout_rule;
  v.push_back(f);
  const char *pointwise[] = {"silu", "swiglu", "exp",  "log", "tanh", "erf", "rsqrt", "sqrt", "neg",
                             "reciprocal", "sigmoid", "pow", "gelu", "geglu", "relu", "clamp", "add", "sub", "mul", "div"};
  for (OpDef &d : v) {
    for (const char *name : pointwise)
      if (d.name == name) d.shard_rule = pointwise_rule;
    if (d.name == "rope") d.shard_rule = rope_rule;
    if (d.name == "attention") d.shard_rule = attention_rule;
    if (d.name == "linear") d.shard_rule = linear_rule;
    if (d.name == "all_reduce") {
      d.shard_rule = all_reduce_rule;
      d.vjp = all_reduce_vjp;
    }
  }
}

}  // namespace ctr
