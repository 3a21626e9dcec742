// Pass epilogues: element-wise work that a GEMM library applies while it
// stores a product (cuBLASLt's epilogues) is moved into the GEMM's node, where
// the step's backend has a kernel for the fused op (the CUDA backend; the CPU
// backend has none, so its graphs are left as they are). It runs after reorder,
// on the final node order, and rewrites three patterns:
//
//   linear_bwd_w(dy, x) -> dw and linear_bwd_b(dy) -> db
//       -> linear_bwd_wb(dy, x) -> (dw, db)        (bias gradient: BGRADB)
//   linear(x, w [, b]) -> h and gelu(h) -> y, gelu in its tanh form
//       -> linear_gelu(x, w [, b]) -> (y, h)        (GELU_AUX[_BIAS])
//   linear_bwd_x(g, w) -> dy and gelu_bwd(dy, h) -> dh, tanh form, dy read by
//   the gelu_bwd alone
//       -> linear_bwd_x_dgelu(g, w, h) -> dh        (DGELU)
//
// Each rewrite writes the same tensors the pattern wrote (the pre-activation h
// stays written for whoever reads it; only dy, read by nothing else, is
// dropped), so the plan and the other passes see the same values up to
// round-off. A fused node takes the place of the pattern's node that keeps
// every read before its write: the first for linear_gelu (the gelu reads only
// h), the second for the others, and a pair is fused only when no node between
// the two reads what the first wrote. Option `epilogues` (1 by default; 0 off).

#include <set>

#include "core/options.h"
#include "core/status.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {
namespace {

bool has(const std::function<bool(OpId)> &has_kernel, const char *op) {
  const OpDef *d = find_op(op);
  return d && has_kernel(d->id);
}

bool gelu_tanh(const Node &n) { return n.attr_string("approximate", "tanh") == "tanh"; }

struct Rewriter {
  Graph &g;
  std::vector<int> producer;             // per tensor: the node writing it, or -1
  std::vector<std::vector<int>> readers;  // per tensor: nodes reading it
  std::set<int> dropped;

  explicit Rewriter(Graph &graph) : g(graph) {
    producer.assign(g.tensors.size(), -1);
    readers.assign(g.tensors.size(), {});
    for (int ni = 0; ni < static_cast<int>(g.nodes.size()); ++ni) {
      for (int t : g.nodes[static_cast<size_t>(ni)].outputs) producer[static_cast<size_t>(t)] = ni;
      for (int t : g.nodes[static_cast<size_t>(ni)].inputs) readers[static_cast<size_t>(t)].push_back(ni);
    }
  }
  bool same_phase(int a, int b) const { return (a < g.num_forward) == (b < g.num_forward); }
  // No node strictly between a and b reads an output of a.
  bool nothing_between_reads(int a, int b) const {
    for (int t : g.nodes[static_cast<size_t>(a)].outputs)
      for (int r : readers[static_cast<size_t>(t)])
        if (r > a && r < b) return false;
    return true;
  }
  const Node &node(int i) const { return g.nodes[static_cast<size_t>(i)]; }
  bool live(int i) const { return dropped.count(i) == 0; }
  ctr_dtype dtype(int t) const { return g.tensors[static_cast<size_t>(t)].dtype; }

  // Replaces node `at` by `n` and drops node `gone`.
  void replace(int at, int gone, Node n) {
    n.block = node(at).block;
    n.backward = node(at).backward;
    g.nodes[static_cast<size_t>(at)] = std::move(n);
    dropped.insert(gone);
  }

  void finish() {
    if (dropped.empty()) return;
    std::vector<Node> kept;
    int nf = g.num_forward;
    for (int ni = 0; ni < static_cast<int>(g.nodes.size()); ++ni) {
      if (dropped.count(ni)) {
        if (ni < g.num_forward) --nf;
        continue;
      }
      kept.push_back(std::move(g.nodes[static_cast<size_t>(ni)]));
    }
    g.nodes = std::move(kept);
    g.num_forward = nf;
  }
};

}  // namespace

void read_epilogue_options(OptionReader &r, CompileOptions &opt) {
  opt.epilogues = r.get_int("epilogues", 1, 0, 1) != 0;
}

std::string pass_epilogues(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel) {
  CTR_CHECK(g.num_forward >= 0);
  if (!opt.epilogues) return "epilogues: off (option epilogues=0)\n";
  const bool wb = has(has_kernel, "linear_bwd_wb"), fwd = has(has_kernel, "linear_gelu"),
             bwd = has(has_kernel, "linear_bwd_x_dgelu");
  if (!wb && !fwd && !bwd) return "epilogues: the backend has no fused GEMM kernels\n";
  Rewriter r(g);
  int n_fwd = 0, n_bwd = 0, n_wb = 0;
  const int nn = static_cast<int>(g.nodes.size());
  for (int ni = 0; ni < nn; ++ni) {
    if (!r.live(ni)) continue;
    const Node &n = r.node(ni);
    if (fwd && n.op == "gelu" && gelu_tanh(n) && n.inputs.size() == 1 && n.outputs.size() == 1) {
      const int h = n.inputs[0], p = r.producer[static_cast<size_t>(h)];
      if (p < 0 || !r.live(p) || r.node(p).op != "linear" || !r.same_phase(p, ni) ||
          r.dtype(h) != r.dtype(n.outputs[0]))
        continue;
      const Node &lin = r.node(p);
      Node f = Node::make("linear_gelu", lin.name, lin.inputs, {n.outputs[0], h}, lin.block);
      r.replace(p, ni, std::move(f));
      ++n_fwd;
    } else if (bwd && n.op == "gelu_bwd" && gelu_tanh(n) && n.inputs.size() == 2) {
      const int dy = n.inputs[0], p = r.producer[static_cast<size_t>(dy)];
      if (p < 0 || !r.live(p) || r.node(p).op != "linear_bwd_x" || !r.same_phase(p, ni) ||
          r.readers[static_cast<size_t>(dy)].size() != 1 || dy == g.loss || g.tensors[static_cast<size_t>(dy)].keep)
        continue;
      const Node &lin = r.node(p);
      Node f = Node::make("linear_bwd_x_dgelu", n.name, {lin.inputs[0], lin.inputs[1], n.inputs[1]}, n.outputs,
                          n.block);
      r.replace(ni, p, std::move(f));
      ++n_bwd;
    }
  }
  // Weight and bias gradients of one product: the same dy.
  for (int ni = 0; wb && ni < nn; ++ni) {
    if (!r.live(ni) || r.node(ni).op != "linear_bwd_b") continue;
    const int dy = r.node(ni).inputs[0];
    for (int w : r.readers[static_cast<size_t>(dy)]) {
      if (!r.live(w) || r.node(w).op != "linear_bwd_w" || r.node(w).inputs[0] != dy || !r.same_phase(w, ni))
        continue;
      const int first = std::min(w, ni), second = std::max(w, ni);
      if (!r.nothing_between_reads(first, second)) continue;
      const Node &nw = r.node(w), &nb = r.node(ni);
      Node f = Node::make("linear_bwd_wb", nw.name, nw.inputs, {nw.outputs[0], nb.outputs[0]}, nw.block);
      r.replace(second, first, std::move(f));
      ++n_wb;
      break;
    }
  }
  r.finish();
  return strformat("epilogues: %d linear+gelu (GELU_AUX), %d gelu_bwd into linear_bwd_x (DGELU), %d bias gradients "
                   "with their weight gradient (BGRADB)\n",
                   n_fwd, n_bwd, n_wb);
}

}  // namespace ctr
