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

#include "common/op_params.h"
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
ShardRefusal pointwise_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t,
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
ShardRefusal split_heads(Node *n, const char *attr, int64_t heads, int64_t ranks) {
  if (heads % ranks != 0)
    return {strformat("%s=%lld is not divisible by %lld ranks", attr, static_cast<long long>(heads),
                      static_cast<long long>(ranks)),
            true};
  n->attrs[attr] = Attr::of_int(heads / ranks);
  return "";
}

// rope(x [B, T, heads*D]): by whole heads of the last dim.
ShardRefusal rope_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t ranks,
                      std::vector<AxisState> &out) {
  if (all_replicated(in)) {
    out.assign(n->outputs.size(), AxisState::replicate());
    return "";
  }
  if (in[0] != AxisState::shard(last_dim(g, n->inputs[0]))) return "input placed " + describe(in);
  ShardRefusal why = split_heads(n, "heads", n->attr_int("heads", 0), ranks);
  if (!why.empty()) return why;
  out.assign(n->outputs.size(), in[0]);
  return "";
}

// attention(q, k, v [B, T, heads*D]) -> out [B, T, heads*D], probs [B, heads, T, T]:
// q, k and v split by whole heads (kv heads too, so that each rank's query
// heads find their key/value heads locally).
ShardRefusal attention_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t ranks,
                           std::vector<AxisState> &out) {
  if (all_replicated(in)) {
    out.assign(n->outputs.size(), AxisState::replicate());
    return "";
  }
  for (int i = 0; i < 3; ++i)
    if (in[static_cast<size_t>(i)] != AxisState::shard(2)) return "q, k and v placed " + describe(in);
  const int64_t H = n->attr_int("heads", 0), Hkv = n->attr_int("kv_heads", H);
  ShardRefusal why = split_heads(n, "heads", H, ranks);
  if (why.empty()) why = split_heads(n, "kv_heads", Hkv, ranks);
  if (!why.empty()) return why;
  out.assign(n->outputs.size(), AxisState::shard(1));
  out[0] = AxisState::shard(2);
  return "";
}

// linear(x [..., in], w [out, in], b [out]): column-parallel (w and b split on
// out, x whole: y split on its last dim) or row-parallel (w split on in, x
// split on its last dim, no bias: y a partial sum).
ShardRefusal linear_rule(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t,
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
ShardRefusal fanout_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t,
                        std::vector<AxisState> &out) {
  if (in[0].kind != AxisState::Replicate) return "input placed " + describe(in);
  out.assign(n->outputs.size(), AxisState::replicate());
  return "";
}

ShardRefusal all_reduce_rule(const Graph &, Node *n, const std::vector<AxisState> &in, int64_t,
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

// Activation gathers and scatters of the place pass (sequence parallelism):
// rows of a [rows, width] view, split over the axis in rank order. all_gather
// attr rows: the whole row count (the fsdp gathers of the shard pass have it
// too: their output is the whole parameter). reduce_scatter attr ranks: the
// output is this rank's 1/ranks of the rows.
void all_gather_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  if (n.inputs.size() != 1) bad_node(g, n, "an activation all_gather has one input");
  auto s = S(g, n, 0);
  if (s.empty()) bad_node(g, n, "cannot gather a scalar");
  s[0] = n.attr_int("rows", s[0]);
  out = {OutInfo{g.tensors[n.inputs[0]].dtype, s}};
}

void reduce_scatter_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  if (n.inputs.size() != 1) bad_node(g, n, "an activation reduce_scatter has one input");
  auto s = S(g, n, 0);
  const int64_t ranks = n.attr_int("ranks", 0);
  if (s.empty() || ranks <= 0 || s[0] % ranks != 0)
    bad_node(g, n, strformat("%lld ranks do not divide the rows of the input", static_cast<long long>(ranks)));
  s[0] /= ranks;
  out = {OutInfo{g.tensors[n.inputs[0]].dtype, s}};
}

// all_to_all attr ranks: dim 0 holds one block per member of the axis; the
// output has the same shape (block i now from member i).
void all_to_all_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  if (n.inputs.size() != 1) bad_node(g, n, "an activation all_to_all has one input");
  auto s = S(g, n, 0);
  const int64_t ranks = n.attr_int("ranks", 0);
  if (s.empty() || ranks <= 0 || s[0] % ranks != 0)
    bad_node(g, n, strformat("dim 0 of the input is not one block for each of %lld ranks",
                             static_cast<long long>(ranks)));
  out = {OutInfo{g.tensors[n.inputs[0]].dtype, s}};
}

std::map<std::string, Attr> activation_collective(const Node &n) {
  return {{"axis", Attr::of_string(n.attr_string("axis", ""))},
          {"ranks", Attr::of_int(n.attr_int("ranks", 1))},
          {"activation", Attr::of_int(1)}};
}

// The exchange undone is the same exchange: block j of member i went to member
// j's block i, so member i's block j of the output gradient goes back there.
void all_to_all_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("all_to_all", {gy}, {gx}, activation_collective(n), n.block);
  b.accumulate(n.inputs[0], gx);
}

// ring_shift attrs axis, ranks, shift: this rank's tensor goes `shift` ranks
// on along the axis, the one `shift` ranks back arrives. Its gradient goes back.
void ring_shift_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  std::map<std::string, Attr> attrs = activation_collective(n);
  const int64_t ranks = n.attr_int("ranks", 1);
  attrs["shift"] = Attr::of_int((ranks - n.attr_int("shift", 1) % ranks) % ranks);
  b.emit("ring_shift", {gy}, {gx}, attrs, n.block);
  b.accumulate(n.inputs[0], gx);
}

// The gradient of an activation gather: where the gathered rows feed compute
// that each rank does for its own share (a column-parallel linear), the
// partial gradients are summed and scattered back ("grad" = "reduce_scatter");
// where they feed compute that every rank repeats whole (the head after the
// last block), every rank holds the same whole gradient and keeps its own
// rows ("grad" = "slice", attr index: this rank's position on the axis).
void all_gather_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  const int64_t rows = b.graph().tensors[n.inputs[0]].shape[0];
  if (n.attr_string("grad", "reduce_scatter") == "slice") {
    const int64_t at = n.attr_int("index", 0) * rows;
    b.emit("slice", {gy}, {gx}, {{"dim", Attr::of_int(0)}, {"start", Attr::of_int(at)}, {"end", Attr::of_int(at + rows)}},
           n.block);
  } else {
    std::map<std::string, Attr> attrs = activation_collective(n);
    attrs["reduce"] = Attr::of_string("sum");
    b.emit("reduce_scatter", {gy}, {gx}, attrs, n.block);
  }
  b.accumulate(n.inputs[0], gx);
}

// The gradient of scattering a sum: every rank's share of the output gradient,
// gathered (each summand's gradient is the sum's).
void reduce_scatter_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  std::map<std::string, Attr> attrs = activation_collective(n);
  attrs["rows"] = Attr::of_int(b.graph().tensors[n.inputs[0]].shape[0]);
  b.emit("all_gather", {gy}, {gx}, attrs, n.block);
  b.accumulate(n.inputs[0], gx);
}

// The vocabulary-parallel cross-entropy (the place pass's head): each rank's
// logits cover words [offset, offset + valid) of `vocab`; vocab_ce_stats
// reduces them to three numbers per row, an all-gather brings every rank's,
// and vocab_ce_loss combines them into the loss every rank holds whole. Its
// gradient, vocab_ce_bwd, is each rank's columns of softmax - onehot: the
// statistics need none (the combined derivative is that of the whole loss).
void vocab_ce_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_vocab_ce_params *>(out);
  p->offset = n.attr_int("offset", 0);
  p->valid = n.attr_int("valid", 0);
  p->ranks = n.attr_int("ranks", 1);
}

void vocab_ce_check(const Graph &g, const Node &n) {
  check_logits_targets(g, n);
  const auto &l = S(g, n, 0);
  const int64_t offset = n.attr_int("offset", -1), valid = n.attr_int("valid", -1);
  if (offset < 0 || valid < 0 || valid > l.back() || offset + valid > n.attr_int("vocab", 0))
    bad_node(g, n, "attributes offset, valid and vocab do not describe this rank's columns");
}

void vocab_ce_stats_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  vocab_ce_check(g, n);
  out = {f32({numel(S(g, n, 1)), 3})};
}

void vocab_ce_loss_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  vocab_ce_check(g, n);
  const int64_t R = numel(S(g, n, 1));
  if (S(g, n, 2) != std::vector<int64_t>{n.attr_int("ranks", 1) * R, 3})
    shape_mismatch(g, n, 2, strformat("[%lld,3]", static_cast<long long>(n.attr_int("ranks", 1) * R)));
  out = {f32({}), f32({R}), OutInfo{CTR_DTYPE_I64, {1}}};
}

// Targets: words of the whole vocabulary, or ignored (negative down to ignore_index).
bool vocab_ce_ids(const Graph &, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 1) return false;
  *lo = std::min<int64_t>(-1, n.attr_int("ignore_index", -1));
  *hi = n.attr_int("vocab", 0);
  return true;
}

double vocab_ce_flops(const Graph &g, const Node &n) { return 4.0 * static_cast<double>(numel(S(g, n, 0))); }

// vocab_embedding(table [rows, C], ids [...]) -> [..., C]: the lookups of this
// rank's words (rows [offset, offset + valid) of the whole table of `vocab`),
// zero rows for the others; an all-reduce over the ranks completes them.
void vocab_embedding_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_vocab_embedding_params *>(out);
  p->offset = n.attr_int("offset", 0);
  p->valid = n.attr_int("valid", 0);
  p->padding_idx = n.attr_int("padding_idx", -1);
}

void vocab_embedding_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_I32);
  const auto &t = S(g, n, 0);
  if (t.size() != 2) bad_node(g, n, "the table must be [rows, width]");
  const int64_t offset = n.attr_int("offset", -1), valid = n.attr_int("valid", -1);
  if (offset < 0 || valid < 0 || valid > t[0] || offset + valid > n.attr_int("vocab", 0))
    bad_node(g, n, "attributes offset, valid and vocab do not describe this rank's rows");
  auto s = S(g, n, 1);
  s.push_back(t[1]);
  out = {f32(s)};
}

bool vocab_embedding_ids(const Graph &, const Node &n, int input, int64_t *lo, int64_t *hi) {
  if (input != 1) return false;
  *lo = 0;
  *hi = n.attr_int("vocab", 0);
  return true;
}

}  // namespace

void append_placement_ops(std::vector<OpDef> &v) {
  OpDef f = internal("fanout", 1, 1);
  f.infer = infer_same_f32;
  f.vjp = fanout_vjp;
  f.moves_values = true;
  f.shard_rule = fanout_rule;
  v.push_back(f);
  OpDef stats = internal("vocab_ce_stats", 2, 1);
  stats.infer = vocab_ce_stats_infer;
  stats.id_range = vocab_ce_ids;
  stats.flops = vocab_ce_flops;
  v.push_back(with_params<ctr_vocab_ce_params>(stats, vocab_ce_decode));
  OpDef loss = with_bwd(internal("vocab_ce_loss", 3, 3), "vocab_ce_bwd", {G(0), In(0), In(1), Out(1), Out(2)}, 1);
  loss.infer = vocab_ce_loss_infer;
  loss.id_range = vocab_ce_ids;
  v.push_back(with_params<ctr_vocab_ce_params>(loss, vocab_ce_decode));
  v.push_back(with_params<ctr_vocab_ce_params>(internal("vocab_ce_bwd", 5, 1), vocab_ce_decode));
  OpDef emb = with_bwd(internal("vocab_embedding", 2, 1), "vocab_embedding_bwd", {G(0), In(1)}, 1);
  emb.infer = vocab_embedding_infer;
  emb.id_range = vocab_embedding_ids;
  v.push_back(with_params<ctr_vocab_embedding_params>(emb, vocab_embedding_decode));
  OpDef emb_bwd = internal("vocab_embedding_bwd", 2, 1);
  emb_bwd.id_range = vocab_embedding_ids;
  v.push_back(with_params<ctr_vocab_embedding_params>(emb_bwd, vocab_embedding_decode));
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
    if (d.name == "all_gather") {
      d.infer = all_gather_infer;
      d.vjp = all_gather_vjp;
    }
    if (d.name == "ring_shift") {
      d.infer = infer_same_f32;
      d.vjp = ring_shift_vjp;
    }
    if (d.name == "all_to_all") {
      d.infer = all_to_all_infer;
      d.vjp = all_to_all_vjp;
    }
    if (d.name == "reduce_scatter") {
      d.infer = reduce_scatter_infer;
      d.vjp = reduce_scatter_vjp;
    }
  }
}

}  // namespace ctr
