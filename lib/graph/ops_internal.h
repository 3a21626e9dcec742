// What the files that define the library's ops share (ops.cc, ops_math.cc,
// ops_layout.cc):
// the checks that name a node in their errors and the small builders of an
// OpDef. Not for passes or backends: they read the registry through ops.h.
#pragma once

#include <string>
#include <vector>

#include "graph/ops.h"

namespace ctr {

// Appends the broadcasting arithmetic (add, sub, mul, div), masked_fill,
// expand, the reductions (sum, mean, amax, var), softmax and log_softmax on
// any dim, gelu (tanh or exact) and their internal backward ops.
void append_math_ops(std::vector<OpDef> &v);
// fanout and the sharding rules of the ops already in v (ops_shard.cc).
void append_placement_ops(std::vector<OpDef> &v);

namespace opdef {

const Tensor &T(const Graph &g, int id);
const std::vector<int64_t> &S(const Graph &g, const Node &n, int i);  // input i's shape

// Throws CTR_STATUS_INVALID_GRAPH: "node 'name' (op): what".
[[noreturn]] void bad_node(const Graph &g, const Node &n, const std::string &what);
void need_dtype(const Graph &g, const Node &n, int i, ctr_dtype d);
void need_rank_at_least(const Graph &g, const Node &n, int i, size_t r);
void shape_mismatch(const Graph &g, const Node &n, int i, const std::string &expect);

int64_t numel(const std::vector<int64_t> &s);
OutInfo f32(std::vector<int64_t> s);
double zero_flops(const Graph &, const Node &);
double elementwise_flops(const Graph &g, const Node &n);  // input 0's element count
void infer_same_f32(const Graph &g, const Node &n, std::vector<OutInfo> &out);
// logits[..., V] (f32) and targets[...] (i32) with the logits' leading dims:
// the shape of the targets, or a refusal naming the input.
std::vector<int64_t> check_logits_targets(const Graph &g, const Node &n);

constexpr BwdSlot G(int i) { return {BwdSlot::Grad, i}; }
constexpr BwdSlot In(int i) { return {BwdSlot::Input, i}; }
constexpr BwdSlot Out(int i) { return {BwdSlot::Output, i}; }

inline OpDef fwd(const char *name, int min_in, int max_in,
                 void (*infer)(const Graph &, const Node &, std::vector<OutInfo> &),
                 double (*flops)(const Graph &, const Node &)) {
  OpDef d;
  d.name = name;
  d.min_inputs = min_in;
  d.max_inputs = max_in;
  d.infer = infer;
  d.flops = flops;
  return d;
}

// An internal op (a backward op or a collective): inputs and produced outputs.
inline OpDef internal(const char *name, int inputs, int outputs) {
  OpDef d;
  d.name = name;
  d.min_inputs = d.max_inputs = inputs;
  d.num_outputs = outputs;
  d.internal = true;
  return d;
}

template <typename P>
OpDef with_params(OpDef d, void (*decode)(const Graph &, const Node &, void *)) {
  d.params_size = sizeof(P);
  d.decode = decode;
  return d;
}

inline OpDef with_bwd(OpDef d, const char *op, std::vector<BwdSlot> inputs, int grads = 0) {
  d.bwd.op = op;
  d.bwd.inputs = std::move(inputs);
  d.bwd.grads = grads;
  return d;
}

// slice, cat (ops_layout.cc), appended to the library's ops.
void append_layout_ops(std::vector<OpDef> &v);

}  // namespace opdef
}  // namespace ctr
