// Pass recompute: activation checkpointing per block.
//
// For each block (a transformer layer: nodes with block >= 0), the activations
// its backward reads are normally kept from forward to backward. This pass
// instead copies the block's forward nodes into the backward graph, right
// before the first backward node that reads one of them, and points the
// backward nodes at the copies; the originals die as soon as forward no longer
// needs them, and the planned peak falls.
//
// Modes: "all" recomputes every activation of the block that backward reads;
// "selective" keeps the outputs of the ops whose definition is not marked
// cheap_to_recompute (GEMMs and attention) and recomputes the rest (norms,
// activations, rotary embeddings, residual adds). Tensors forward reads after
// the block (its output, the next block's input) and tensors named in the step
// option "keep" are never recomputed.
//
// It runs after autodiff and before shard, so the shard pass sees the copies as
// ordinary backward uses of the parameters and gathers for them in backward.
// Kernels are deterministic, so the copies compute the same bits: losses are
// bitwise unchanged.

#include <algorithm>
#include <map>
#include <set>

#include "core/options.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

void recompute_block(Graph &g, int block, bool selective) {
  const int nf = g.num_forward;
  const int nn = static_cast<int>(g.nodes.size());
  std::vector<int> fwd;  // the block's forward nodes, in order
  std::map<int, int> producer;
  for (int ni = 0; ni < nf; ++ni)
    if (g.nodes[ni].block == block) {
      fwd.push_back(ni);
      for (int t : g.nodes[ni].outputs) producer[t] = ni;
    }
  if (fwd.empty()) return;

  // Kept: read by forward after the block, named in "keep", or (selective)
  // produced by an op that is not cheap to recompute.
  std::set<int> keep;
  for (int ni = 0; ni < nf; ++ni) {
    if (g.nodes[ni].block == block) continue;
    for (int t : g.nodes[ni].inputs)
      if (producer.count(t)) keep.insert(t);
  }
  for (const auto &[t, ni] : producer) {
    if (g.tensors[t].keep || t == g.loss) keep.insert(t);
    // What a collective produced (an expert exchange, summed statistics) is
    // kept: recomputing it would repeat the communication.
    if (is_collective(g.nodes[ni])) keep.insert(t);
    if (selective) {
      const OpDef *d = find_op(g.nodes[ni].op);
      if (!d || !d->cheap_to_recompute) keep.insert(t);
    }
  }
  // Recomputed: what backward reads of the block, and what those need.
  std::set<int> recompute;
  std::vector<int> work;
  for (int ni = nf; ni < nn; ++ni)
    for (int t : g.nodes[ni].inputs)
      if (producer.count(t) && !keep.count(t) && recompute.insert(t).second) work.push_back(t);
  if (recompute.empty()) return;
  std::set<int> nodes;
  while (!work.empty()) {
    int t = work.back();
    work.pop_back();
    int ni = producer[t];
    if (!nodes.insert(ni).second) continue;
    for (int o : g.nodes[ni].outputs)
      if (!keep.count(o)) recompute.insert(o);
    for (int in : g.nodes[ni].inputs)
      if (producer.count(in) && !keep.count(in) && recompute.insert(in).second) work.push_back(in);
  }

  // Where the copies go: before the first backward node reading a recomputed tensor.
  int at = -1;
  for (int ni = nf; ni < nn && at < 0; ++ni)
    for (int t : g.nodes[ni].inputs)
      if (recompute.count(t)) at = ni;
  CTR_CHECK(at >= 0);

  std::map<int, int> copy_of;
  std::vector<Node> copies;
  for (int ni : fwd) {
    if (!nodes.count(ni)) continue;
    Node c = g.nodes[ni];
    c.name += ".recompute";
    c.backward = true;
    for (int &in : c.inputs)
      if (copy_of.count(in)) in = copy_of[in];
    for (int &o : c.outputs) {
      Tensor t = g.tensors[o];
      t.name += ".recompute";
      t.keep = false;
      const int nt = g.add_tensor(std::move(t));
      copy_of[o] = nt;
      o = nt;
    }
    copies.push_back(std::move(c));
  }
  for (int ni = at; ni < nn; ++ni)
    for (int &in : g.nodes[ni].inputs)
      if (copy_of.count(in)) in = copy_of[in];
  g.nodes.insert(g.nodes.begin() + at, copies.begin(), copies.end());
}

// Chains of forward nodes (each node of one input and one output) done again
// in backward: each chain is copied (names and tensors suffixed) before the
// first backward node that reads one of its outputs, in that node's block, and
// the backward nodes from there on read the copies; forward's results then die
// with forward. For exact operations (gathers, shifts) the bits are unchanged.
class Redo {
 public:
  Redo(Graph &g, std::string suffix) : g_(g), suffix_(std::move(suffix)) {}

  void add(const std::vector<int> &chain) {
    const int nf = g_.num_forward;
    std::set<int> outs;
    for (int k : chain) outs.insert(g_.nodes[static_cast<size_t>(k)].outputs[0]);
    int first = -1;
    for (int k = nf; k < static_cast<int>(g_.nodes.size()) && first < 0; ++k)
      for (int t : g_.nodes[static_cast<size_t>(k)].inputs)
        if (outs.count(t)) first = k;
    if (first < 0) return;
    std::map<int, int> copy_of;
    std::vector<Node> list;
    for (int k : chain) {
      Node c = g_.nodes[static_cast<size_t>(k)];
      c.name += suffix_;
      c.backward = true;
      c.block = g_.nodes[static_cast<size_t>(first)].block;
      for (int &in : c.inputs)
        if (copy_of.count(in)) in = copy_of[in];
      const int o = c.outputs[0];
      Tensor t = g_.tensors[static_cast<size_t>(o)];
      t.name += suffix_;
      t.keep = false;
      copy_of[o] = g_.add_tensor(std::move(t));
      c.outputs = {copy_of[o]};
      list.push_back(std::move(c));
    }
    for (int k = first; k < static_cast<int>(g_.nodes.size()); ++k)
      for (int &in : g_.nodes[static_cast<size_t>(k)].inputs)
        if (copy_of.count(in)) in = copy_of[in];
    copies_.push_back(std::move(list));
    at_.push_back(first);
  }

  // Inserts the copies, from the last position back so that earlier positions
  // stay valid (chains read first at the same node keep their order reversed).
  void insert() {
    std::vector<size_t> order(copies_.size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return at_[a] > at_[b]; });
    for (size_t k : order) g_.nodes.insert(g_.nodes.begin() + at_[k], copies_[k].begin(), copies_[k].end());
  }

 private:
  Graph &g_;
  std::string suffix_;
  std::vector<std::vector<Node>> copies_;
  std::vector<int> at_;
};

// Sequence parallelism's gathers of a region's input (activation all-gathers
// over tp) are done again in backward for the backward nodes that read the
// whole rows (the column-parallel weight gradients; through the reshapes that
// view the rows as [batch, seq, width]), as Megatron does: forward
// then keeps only this rank's 1/tp of the rows to backward, not the gathered
// whole. Reorder issues each copy at the start of its reader's block, under
// the block's backward compute.
void regather_sequence_parallel(Graph &g) {
  const int nf = g.num_forward;
  Redo redo(g, ".regather");
  for (int ni = 0; ni < nf; ++ni) {
    const Node &n = g.nodes[static_cast<size_t>(ni)];
    if (collective_kind(n) != CollKind::AllGather || n.attr_int("activation", 0) == 0 ||
        n.attr_string("axis", "") != "tp" || n.outputs.size() != 1)
      continue;
    // The gathered rows and their reshapes (views of the same memory), in forward order.
    std::vector<int> chain = {ni};
    std::set<int> views = {n.outputs[0]};
    for (int k = ni + 1; k < nf; ++k) {
      const Node &r = g.nodes[static_cast<size_t>(k)];
      if (r.op == "reshape" && views.count(r.inputs[0])) {
        chain.push_back(k);
        views.insert(r.outputs[0]);
      }
    }
    redo.add(chain);
  }
  redo.insert();
}

// Ring attention's keys and values (cp_mode ring: chains of activation
// ring_shifts over cp, each passing the block the one before received) are
// passed around the ring again in backward for the backward nodes that read
// them, rather than every rank's blocks being kept from forward to backward:
// forward then keeps only this rank's own keys and values, 1/cp of the whole,
// as Ulysses does. Reorder issues the copies ahead under the backward compute
// before them.
void resend_ring(Graph &g) {
  const int nf = g.num_forward;
  std::vector<int> produced_by(g.tensors.size(), -1);
  for (int ni = 0; ni < nf; ++ni)
    for (int t : g.nodes[static_cast<size_t>(ni)].outputs) produced_by[static_cast<size_t>(t)] = ni;
  auto is_ring = [&](int ni) {
    const Node &n = g.nodes[static_cast<size_t>(ni)];
    return collective_kind(n) == CollKind::Shift && n.attr_int("activation", 0) != 0 && n.inputs.size() == 1 &&
           n.outputs.size() == 1;
  };
  std::vector<std::vector<int>> chains;  // forward node indices, in order
  for (int ni = 0; ni < nf; ++ni) {
    if (!is_ring(ni)) continue;
    const int from = produced_by[static_cast<size_t>(g.nodes[static_cast<size_t>(ni)].inputs[0])];
    bool joined = false;
    if (from >= 0 && is_ring(from))
      for (auto &c : chains)
        if (c.back() == from) {
          c.push_back(ni);
          joined = true;
        }
    if (!joined) chains.push_back({ni});
  }
  Redo redo(g, ".resend");
  for (const std::vector<int> &chain : chains) redo.add(chain);
  redo.insert();
}

}  // namespace

void pass_recompute(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward >= 0);
  regather_sequence_parallel(g);
  resend_ring(g);
  if (opt.recompute == "none") return;
  std::set<int> blocks;
  for (int ni = 0; ni < g.num_forward; ++ni)
    if (g.nodes[ni].block >= 0) blocks.insert(g.nodes[ni].block);
  for (int b : blocks) recompute_block(g, b, opt.recompute == "selective");
}

void read_recompute_options(OptionReader &r, CompileOptions &o) {
  o.recompute = r.get_string("recompute", "none", {"none", "all", "selective"});
}

}  // namespace ctr
