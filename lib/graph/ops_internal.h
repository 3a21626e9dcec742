// What the files defining the library's ops share (ops.cc, ops_layout.cc):
// the checks that throw INVALID_GRAPH naming the node, and the small builders
// of OpDef entries. Not for use outside lib/graph.
#pragma once

#include <string>
#include <vector>

#include "graph/ops.h"

namespace ctr::opdef {

inline const std::vector<int64_t> &S(const Graph &g, const Node &n, int i) {
  return g.tensors[n.inputs[i]].shape;
}

[[noreturn]] void bad_node(const Graph &g, const Node &n, const std::string &what);
void need_dtype(const Graph &g, const Node &n, int i, ctr_dtype d);
void shape_mismatch(const Graph &g, const Node &n, int i, const std::string &expect);

inline int64_t numel(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

inline double zero_flops(const Graph &, const Node &) { return 0; }

constexpr BwdSlot G(int i) { return {BwdSlot::Grad, i}; }
constexpr BwdSlot In(int i) { return {BwdSlot::Input, i}; }
constexpr BwdSlot Out(int i) { return {BwdSlot::Output, i}; }

// A forward op (files may name it).
OpDef fwd(const char *name, int min_in, int max_in,
          void (*infer)(const Graph &, const Node &, std::vector<OutInfo> &),
          double (*flops)(const Graph &, const Node &));
// An internal op (a backward op or a collective): inputs and produced outputs.
OpDef internal(const char *name, int inputs, int outputs);
OpDef with_bwd(OpDef d, const char *op, std::vector<BwdSlot> inputs, int grads = 0);

template <typename P>
OpDef with_params(OpDef d, void (*decode)(const Graph &, const Node &, void *)) {
  d.params_size = sizeof(P);
  d.decode = decode;
  return d;
}

// slice, cat (ops_layout.cc), appended to the library's ops.
void append_layout_ops(std::vector<OpDef> &v);

}  // namespace ctr::opdef
