// Pass place: activations placed over the tensor-parallel axis (see passes.h).
//
// It runs before autodiff on the forward graph, so what it inserts is
// differentiated like any other op: a `fanout` (the identity) where a replicated
// activation enters a tensor-parallel region has an all-reduce of the partial
// gradients as its gradient, and the all-reduce that closes a region has the
// identity as its gradient.
//
// Regions are found from the single-device graph, by the ops' sharding rules
// alone (OpDef::shard_rule): a linear whose weight is a parameter read by that
// linear only, on a replicated input, is a column-parallel seed (weight and bias
// split on the output dim, Shard(0); its output split on the last dim). The
// region grows through the readers of every split tensor: an op whose rule runs
// on the split placements joins (attention and rope by whole heads, element-wise
// ops), pulling in the other linears that feed it as column-parallel seeds; a
// linear reading a split tensor as its input becomes row-parallel (weight split
// on its input dim, Shard(1)) and ends the region with a partial sum, which an
// all-reduce over tp makes whole again before its bias is added. A region that
// reaches anything else (a norm, the loss, a layout op) is left replicated,
// and the reason is kept for `graph inspect --after place`. A region that is
// otherwise valid must fit the axis: a head count or a width that tp does not
// divide is refused naming the node, the axis size and the dimension.

#include <algorithm>
#include <map>
#include <set>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

const char *kAxis = "tp";

struct Region {
  std::set<int> col, row, nodes;             // node indices
  std::map<int, AxisState> state;            // tensors whose placement the region sets
  std::map<int, Node> rewritten;             // nodes whose rule rewrote attributes
  // A size the axis does not divide (a head count, a width): the step is
  // refused with this message if the region is otherwise valid, and nothing
  // is said if the region is left replicated for another reason.
  std::string misfit;
};

class Placer {
 public:
  Placer(Graph &g, int64_t ranks, int64_t index, bool vocab_kernels, bool vocab_embedding_kernels)
      : g_(g), ranks_(ranks), index_(index), vocab_kernels_(vocab_kernels),
        vocab_embedding_kernels_(vocab_embedding_kernels) {
    const int nf = static_cast<int>(g.nodes.size());
    producer_.assign(g.tensors.size(), -1);
    readers_.resize(g.tensors.size());
    for (int ni = 0; ni < nf; ++ni) {
      for (int o : g.nodes[ni].outputs) producer_[o] = ni;
      for (int i : g.nodes[ni].inputs) readers_[i].push_back(ni);
    }
    state_.assign(g.tensors.size(), AxisState::replicate());
    assigned_.assign(g.nodes.size(), false);
  }

  // Grows and commits every region; returns what was placed and left.
  std::string run() {
    find_head();
    for (int ni = 0; ni < static_cast<int>(g_.nodes.size()); ++ni) {
      if (assigned_[ni] || !eligible_column(ni)) continue;
      Region r;
      std::string why = grow(ni, r);
      if (!why.empty()) {
        left_ += "  left replicated: " + g_.nodes[ni].name + " (" + why + ")\n";
        continue;
      }
      if (!r.misfit.empty()) fail(CTR_STATUS_UNSUPPORTED, r.misfit);
      commit(r);
    }
    return report();
  }

  int regions() const { return static_cast<int>(regions_.size()) + (head_linear_ >= 0 ? 1 : 0); }
  const std::string &first_refusal() const { return first_refusal_; }

 private:
  Graph &g_;
  int64_t ranks_, index_;
  bool vocab_kernels_;
  bool vocab_embedding_kernels_;
  int head_linear_ = -1, head_loss_ = -1;  // the vocabulary-parallel head, when there is one
  int tied_embedding_ = -1;                // the embedding that shares the head's weight
  std::vector<int> producer_;
  std::vector<std::vector<int>> readers_;
  std::vector<AxisState> state_;
  std::vector<bool> assigned_;
  std::vector<Region> regions_;
  std::string left_, first_refusal_;

  bool single_use_param(int t) const {
    return g_.tensors[t].role == Role::Param && readers_[t].size() == 1 && g_.tensors[t].shape.size() == 2;
  }
  bool eligible_column(int ni) const {
    const Node &n = g_.nodes[ni];
    if (n.op != "linear" || !single_use_param(n.inputs[1])) return false;
    if (n.inputs.size() == 3 && !single_use_param_1d(n.inputs[2])) return false;
    return state_[n.inputs[0]].kind == AxisState::Replicate;
  }
  bool single_use_param_1d(int t) const {
    return g_.tensors[t].role == Role::Param && readers_[t].size() == 1;
  }
  AxisState at(const Region &r, int t) const {
    auto it = r.state.find(t);
    return it != r.state.end() ? it->second : state_[t];
  }

  // A size along the split dimension that the axis must divide.
  std::string check_divides(const Node &n, const char *what, int64_t size) const {
    if (size % ranks_ == 0) return "";
    return strformat("place: tp=%lld does not divide %s %lld of node '%s' (%s); use a tp that divides it",
                     static_cast<long long>(ranks_), what, static_cast<long long>(size), n.name.c_str(),
                     n.op.c_str());
  }

  // Adds linear ni as a column-parallel seed; a width the axis does not
  // divide is the region's misfit.
  void add_column(int ni, Region &r, std::vector<int> &work) {
    const Node &n = g_.nodes[ni];
    const std::string err = check_divides(n, "the output width", g_.tensors[n.inputs[1]].shape[0]);
    if (r.misfit.empty()) r.misfit = err;
    r.col.insert(ni);
    const int y = n.outputs[0];
    r.state[y] = AxisState::shard(static_cast<int>(g_.tensors[y].shape.size()) - 1);
    work.push_back(y);
  }

  // Makes tensor t split on its last dim inside region r: through the linear
  // or the chain of per-head ops that produces it. "" on success.
  std::string pull(int t, Region &r, std::vector<int> &work, int depth = 0) {
    const int p = producer_[t];
    if (p < 0 || depth > 8) return "'" + g_.tensors[t].name + "' is not computed by a linear";
    if (r.col.count(p) || r.nodes.count(p)) return at(r, t).kind == AxisState::Shard ? "" : "placed otherwise";
    if (assigned_[p]) return "'" + g_.tensors[t].name + "' belongs to another region";
    if (eligible_column(p)) {
      add_column(p, r, work);
      return "";
    }
    const OpDef *d = find_op(g_.nodes[p].op);
    if (!d || !d->shard_rule || g_.nodes[p].inputs.size() != 1)
      return "'" + g_.tensors[t].name + "' comes from " + g_.nodes[p].op;
    std::string why = pull(g_.nodes[p].inputs[0], r, work, depth + 1);
    if (!why.empty()) return why;
    return join(p, r, work);
  }

  // Node ni joins region r if its rule runs on the placements its inputs have
  // (pulling replicated inputs into the region when needed).
  std::string join(int ni, Region &r, std::vector<int> &work) {
    if (r.nodes.count(ni) || r.row.count(ni) || r.col.count(ni)) return "";
    const Node &n = g_.nodes[ni];
    if (assigned_[ni]) return "node '" + n.name + "' belongs to another region";
    if (n.op == "linear" && at(r, n.inputs[0]).kind == AxisState::Shard) {
      // Row-parallel: the weight split on its input dim, no bias inside.
      if (!single_use_param(n.inputs[1])) return "linear '" + n.name + "' has a shared or non-parameter weight";
      for (size_t i = 1; i < n.inputs.size(); ++i)
        if (at(r, n.inputs[i]).kind != AxisState::Replicate) return "linear '" + n.name + "' reads a split weight";
      const std::string err = check_divides(n, "the input width", g_.tensors[n.inputs[1]].shape[1]);
      if (r.misfit.empty()) r.misfit = err;
      // Its output is whole again once the all-reduce that closes the region ran.
      r.row.insert(ni);
      return "";
    }
    const OpDef *d = find_op(n.op);
    if (!d || !d->shard_rule) return n.op + " '" + n.name + "' runs on whole tensors only";
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::vector<AxisState> in;
      for (int i : n.inputs) in.push_back(at(r, i));
      Node trial = n;
      std::vector<AxisState> out;
      ShardRefusal why = d->shard_rule(g_, &trial, in, ranks_, out);
      if (why.misfit) {
        // A head count the axis does not divide: the region's misfit; it grows
        // on as if the heads fitted, to learn whether it is otherwise valid.
        if (r.misfit.empty())
          r.misfit = strformat("place: node '%s' (%s) cannot be split over tp=%lld: %s", n.name.c_str(),
                               n.op.c_str(), static_cast<long long>(ranks_), why.why.c_str());
        trial = n;
        out.clear();
        why = d->shard_rule(g_, &trial, in, 1, out);
      }
      if (why.empty()) {
        bool split = false;
        for (const AxisState &s : out) split |= s.kind != AxisState::Replicate;
        if (!split) return n.op + " '" + n.name + "' gives whole outputs";
        r.nodes.insert(ni);
        r.rewritten[ni] = trial;
        for (size_t k = 0; k < out.size(); ++k) {
          r.state[n.outputs[k]] = out[k];
          if (k == 0) work.push_back(n.outputs[k]);
        }
        return "";
      }
      if (attempt == 1) return n.op + " '" + n.name + "': " + why.why;
      // Pull the replicated float inputs in as split tensors, then retry.
      for (int i : n.inputs) {
        if (at(r, i).kind != AxisState::Replicate || g_.tensors[i].role != Role::Activation) continue;
        std::string pw = pull(i, r, work);
        if (!pw.empty()) return n.op + " '" + n.name + "': " + pw;
      }
    }
    return "";
  }

  std::string grow(int seed, Region &r) {
    std::vector<int> work;
    add_column(seed, r, work);
    while (!work.empty()) {
      const int t = work.back();
      work.pop_back();
      if (t == g_.loss) return "the loss is split";
      for (int reader : readers_[t]) {
        std::string why = join(reader, r, work);
        if (!why.empty()) return why;
      }
    }
    if (r.row.empty()) return "no row-parallel linear closes the region";
    // Every split tensor must be read inside the region only.
    for (const auto &[t, s] : r.state) {
      if (s.kind == AxisState::Replicate) continue;
      for (int reader : readers_[t])
        if (!r.nodes.count(reader) && !r.row.count(reader))
          return "'" + g_.tensors[t].name + "' is read by " + g_.nodes[reader].op + " '" + g_.nodes[reader].name + "'";
    }
    return "";
  }

  void commit(Region &r) {
    for (int ni : r.col) assigned_[ni] = true;
    for (int ni : r.row) assigned_[ni] = true;
    for (int ni : r.nodes) assigned_[ni] = true;
    for (const auto &[t, s] : r.state) state_[t] = s;
    for (auto &[ni, node] : r.rewritten) g_.nodes[ni].attrs = node.attrs;
    regions_.push_back(std::move(r));
  }

  // The head: logits = linear(h, W[, b]) read only by the cross_entropy that
  // is the loss. Split over the vocabulary (W and b on their rows, padded
  // where tp does not divide the words), with the loss computed from three
  // numbers per row of every rank: the logits are never whole anywhere.
  void find_head() {
    if (g_.loss < 0 || producer_[g_.loss] < 0) return;
    const int ce = producer_[g_.loss];
    const Node &c = g_.nodes[ce];
    if (c.op != "cross_entropy") return;
    const int logits = c.inputs[0];
    const int p = producer_[logits];
    std::string why;
    if (!vocab_kernels_)
      why = "the backend has no vocabulary-parallel cross-entropy kernels";
    else if (p < 0 || g_.nodes[p].op != "linear")
      why = "the logits are not computed by a linear";
    else if (assigned_[p])
      why = "its linear belongs to a region";
    else if (readers_[logits].size() != 1)
      why = "the logits are read by more than the loss";
    else if (!head_weight(g_.nodes[p].inputs[1], p))
      why = "the head's weight '" + g_.tensors[g_.nodes[p].inputs[1]].name +
            "' is read by more than the head and one embedding, or is no parameter";
    else if (g_.nodes[p].inputs.size() == 3 && !single_use_param_1d(g_.nodes[p].inputs[2]))
      why = "the head's bias is read elsewhere too";
    else if (state_[g_.nodes[p].inputs[0]].kind != AxisState::Replicate)
      why = "the head's input is split";
    if (why.empty() && tied_embedding_ >= 0 && !vocab_embedding_kernels_)
      why = "its weight is tied to the embedding and the backend has no vocabulary-parallel embedding kernels";
    if (!why.empty()) {
      tied_embedding_ = -1;
      left_ += "  left replicated: " + g_.tensors[logits].name + " and the loss (" + why + ")\n";
      return;
    }
    head_linear_ = p;
    head_loss_ = ce;
    assigned_[p] = assigned_[ce] = true;
    if (tied_embedding_ >= 0) assigned_[tied_embedding_] = true;
  }

  // The head's weight: a 2-D parameter read by the head only, or by the head
  // and one embedding as its table (tied; tied_embedding_ set).
  bool head_weight(int w, int head) {
    const Tensor &t = g_.tensors[w];
    if (t.role != Role::Param || t.shape.size() != 2) return false;
    int embedding = -1;
    for (int r : readers_[w]) {
      if (r == head) continue;
      const Node &n = g_.nodes[r];
      if (n.op != "embedding" || n.inputs[0] != w || embedding >= 0 || assigned_[r]) return false;
      embedding = r;
    }
    tied_embedding_ = embedding;
    return true;
  }

  // Regions, their all-reduces with the bytes each moves per micro-batch
  // (the textbook volumes: one activation forward, one gradient backward per
  // region), and what was left replicated.
  std::string report() const {
    std::string s = strformat("place: tp=%lld, %d tensor-parallel regions\n", static_cast<long long>(ranks_),
                              static_cast<int>(regions_.size()));
    int64_t total = 0, count = 0;
    std::set<int> fanned;
    for (const Region &r : regions_) {
      std::string cols, rows;
      int64_t fwd = 0, bwd = 0;
      for (int ni : r.col) {
        cols += (cols.empty() ? "" : ", ") + g_.nodes[ni].name;
        const int x = g_.nodes[ni].inputs[0];
        if (fanned.insert(x).second) {
          bwd += g_.tensors[x].bytes();
          ++count;
        }
      }
      for (int ni : r.row) {
        rows += (rows.empty() ? "" : ", ") + g_.nodes[ni].name;
        fwd += g_.tensors[g_.nodes[ni].outputs[0]].bytes();
        ++count;
      }
      total += fwd + bwd;
      s += "  column-parallel " + cols + " -> row-parallel " + rows + "\n";
      s += strformat("    all-reduce over tp: %lld bytes forward (the row-parallel sum), %lld bytes backward (the "
                     "gradient at the fanout)\n",
                     static_cast<long long>(fwd), static_cast<long long>(bwd));
    }
    s += strformat("  per micro-batch: %lld all-reduces over tp, %lld bytes\n", static_cast<long long>(count),
                   static_cast<long long>(total));
    if (head_linear_ >= 0) {
      const Node &lin = g_.nodes[head_linear_];
      const int64_t V = g_.tensors[lin.inputs[1]].shape[0];
      const int64_t per = (V + ranks_ - 1) / ranks_;
      const int64_t rows = g_.tensors[g_.nodes[head_loss_].inputs[1]].numel();
      s += strformat("  vocabulary-parallel head: %s over %lld words, %lld per rank (the last rank's %lld valid), "
                     "loss from an all-gather of 3 floats per row (%lld bytes per micro-batch), the gradient of "
                     "its input all-reduced (%lld bytes)\n",
                     lin.name.c_str(), static_cast<long long>(V), static_cast<long long>(per),
                     static_cast<long long>(V - per * (ranks_ - 1) > 0 ? V - per * (ranks_ - 1) : 0),
                     static_cast<long long>(12 * rows * ranks_),
                     static_cast<long long>(g_.tensors[lin.inputs[0]].bytes()));
      if (tied_embedding_ >= 0) {
        const Node &e = g_.nodes[tied_embedding_];
        s += strformat("    tied to embedding %s: each rank looks up its words, an all-reduce over tp completes the "
                       "rows (%lld bytes forward)\n",
                       e.name.c_str(), static_cast<long long>(g_.tensors[e.outputs[0]].bytes()));
      }
    }
    return s + left_;
  }

 public:
  // Rewrites the graph for the committed regions: parameters become this
  // rank's blocks, fanouts before column-parallel linears, all-reduces after
  // row-parallel ones (then their biases), shapes local.
  void rewrite() {
    std::vector<std::vector<Node>> before(g_.nodes.size()), after(g_.nodes.size());
    auto add_tensor = [&](const std::string &name, int like) {
      Tensor t;
      t.name = name;
      t.dtype = g_.tensors[like].dtype;
      t.shape = g_.tensors[like].shape;
      t.has_shape = true;
      return g_.add_tensor(std::move(t));
    };
    auto split_param = [&](int p, int dim) {
      Tensor &t = g_.tensors[p];
      t.placement.add_shard(kAxis, dim, t.shape);
      t.shape[static_cast<size_t>(dim)] /= ranks_;
    };
    std::map<int, int> fanned;      // replicated input -> its fanout
    std::map<int, int> first_col;   // replicated input -> its first column-parallel reader
    for (const Region &r : regions_)
      for (int ni : r.col) {
        const int x = g_.nodes[ni].inputs[0];
        auto it = first_col.find(x);
        if (it == first_col.end() || ni < it->second) first_col[x] = ni;
      }
    for (const Region &r : regions_) {
      for (int ni : r.col) {
        const int x = g_.nodes[ni].inputs[0];
        auto it = fanned.find(x);
        if (it == fanned.end()) {
          const int fx = add_tensor(g_.tensors[x].name + ".tp", x);
          const int first = first_col[x];
          before[first].push_back(Node::make("fanout", g_.tensors[x].name + ".fanout", {x}, {fx},
                                             g_.nodes[first].block, {{"axis", Attr::of_string(kAxis)}}));
          it = fanned.emplace(x, fx).first;
        }
        g_.nodes[ni].inputs[0] = it->second;
        split_param(g_.nodes[ni].inputs[1], 0);
        if (g_.nodes[ni].inputs.size() == 3) split_param(g_.nodes[ni].inputs[2], 0);
      }
      for (int ni : r.row) {
        Node &n = g_.nodes[ni];
        split_param(n.inputs[1], 1);
        const int y = n.outputs[0];
        const int bias = n.inputs.size() == 3 ? n.inputs[2] : -1;
        const int part = add_tensor(g_.tensors[y].name + ".partial", y);
        g_.tensors[part].placement.axes.push_back(AxisPlacement::partial(kAxis));
        n.outputs[0] = part;
        if (bias >= 0) n.inputs.pop_back();
        const std::map<std::string, Attr> red = {{"axis", Attr::of_string(kAxis)}, {"reduce", Attr::of_string("sum")}};
        if (bias < 0) {
          after[ni].push_back(Node::make("all_reduce", g_.tensors[y].name + ".all_reduce", {part}, {y}, n.block, red));
        } else {
          const int sum = add_tensor(g_.tensors[y].name + ".sum", y);
          after[ni].push_back(Node::make("all_reduce", g_.tensors[y].name + ".all_reduce", {part}, {sum}, n.block, red));
          after[ni].push_back(Node::make("add", g_.tensors[y].name + ".bias", {sum, bias}, {y}, n.block));
        }
      }
      for (const auto &[t, s] : r.state) {
        Tensor &x = g_.tensors[t];
        if (s.kind == AxisState::Shard) x.placement.add_shard(kAxis, s.dim, x.shape);
      }
    }
    if (head_linear_ >= 0) {
      Node &lin = g_.nodes[head_linear_];
      const int x = lin.inputs[0];
      auto it = fanned.find(x);
      if (it == fanned.end()) {
        const int fx = add_tensor(g_.tensors[x].name + ".tp", x);
        before[head_linear_].push_back(Node::make("fanout", g_.tensors[x].name + ".fanout", {x}, {fx}, lin.block,
                                                  {{"axis", Attr::of_string(kAxis)}}));
        it = fanned.emplace(x, fx).first;
      }
      lin.inputs[0] = it->second;
      const int64_t V = g_.tensors[lin.inputs[1]].shape[0];
      const int64_t per = (V + ranks_ - 1) / ranks_;
      const int64_t offset = std::min(V, index_ * per), valid = std::min(per, V - offset);
      for (size_t i = 1; i < lin.inputs.size(); ++i) {
        Tensor &t = g_.tensors[lin.inputs[i]];
        t.placement.add_shard(kAxis, 0, t.shape);
        t.shape[0] = per;
      }
      if (tied_embedding_ >= 0) {
        // This rank's words looked up, the others' rows zero; the sum over tp
        // completes every row (its gradient, the identity, reaches each
        // rank's rows of the table whole).
        Node &e = g_.nodes[tied_embedding_];
        const int y = e.outputs[0];
        const int part = add_tensor(g_.tensors[y].name + ".partial", y);
        g_.tensors[part].placement.axes.push_back(AxisPlacement::partial(kAxis));
        e.op = "vocab_embedding";
        e.outputs[0] = part;
        e.attrs["offset"] = Attr::of_int(offset);
        e.attrs["valid"] = Attr::of_int(valid);
        e.attrs["vocab"] = Attr::of_int(V);
        after[tied_embedding_].push_back(Node::make("all_reduce", g_.tensors[y].name + ".all_reduce", {part}, {y},
                                                    e.block,
                                                    {{"axis", Attr::of_string(kAxis)}, {"reduce", Attr::of_string("sum")}}));
      }
      Node &ce = g_.nodes[head_loss_];
      const int logits = ce.inputs[0], targets = ce.inputs[1];
      const int64_t rows = g_.tensors[targets].numel();
      std::map<std::string, Attr> a = ce.attrs;
      a["offset"] = Attr::of_int(offset);
      a["valid"] = Attr::of_int(valid);
      a["vocab"] = Attr::of_int(V);
      a["ranks"] = Attr::of_int(ranks_);
      auto add_shaped = [&](const std::string &name, std::vector<int64_t> shape) {
        Tensor t;
        t.name = name;
        t.shape = std::move(shape);
        t.has_shape = true;
        return g_.add_tensor(std::move(t));
      };
      const int stats = add_shaped(g_.tensors[logits].name + ".stats", {rows, 3});
      const int all = add_shaped(g_.tensors[logits].name + ".stats_all", {ranks_ * rows, 3});
      before[head_loss_].push_back(Node::make("vocab_ce_stats", ce.name + ".stats", {logits, targets}, {stats},
                                              ce.block, a));
      before[head_loss_].push_back(Node::make("all_gather", ce.name + ".stats_all", {stats}, {all}, ce.block,
                                              {{"axis", Attr::of_string(kAxis)},
                                               {"ranks", Attr::of_int(ranks_)},
                                               {"rows", Attr::of_int(ranks_ * rows)},
                                               {"activation", Attr::of_int(1)}}));
      ce.op = "vocab_ce_loss";
      ce.inputs = {logits, targets, all};
      ce.attrs = a;
    }
    std::vector<Node> nodes;
    for (size_t ni = 0; ni < g_.nodes.size(); ++ni) {
      for (Node &n : before[ni]) nodes.push_back(std::move(n));
      nodes.push_back(std::move(g_.nodes[ni]));
      for (Node &n : after[ni]) nodes.push_back(std::move(n));
    }
    g_.nodes = std::move(nodes);
  }
};

}  // namespace

// Output shapes again, in order, from the inputs' local shapes.
void infer_local_shapes(Graph &g) {
  for (Node &n : g.nodes) {
    const OpDef *d = find_op(n.op);
    CTR_CHECK(d != nullptr && d->infer != nullptr);
    std::vector<OutInfo> out;
    d->infer(g, n, out);
    CTR_CHECK(out.size() == n.outputs.size());
    for (size_t k = 0; k < out.size(); ++k) {
      Tensor &t = g.tensors[n.outputs[k]];
      t.shape = out[k].shape;
      t.dtype = out[k].dtype;
      t.has_shape = true;
    }
  }
}

namespace {

// Sequence parallelism (option sequence_parallel): between the regions the
// activations are split over tp by tokens, so that what runs there (norms,
// residual adds, bias adds, element-wise ops) runs on 1/tp of the tokens and
// its activations take 1/tp of the memory. The split is by rows of the
// [tokens, width] view of a [B, T, width] activation (tokens = B*T of one
// micro-batch), so every block is contiguous and the collectives move plain
// rank-ordered rows: where the region's fanout was, an all-gather of the rows
// (its gradient a reduce-scatter of the partial gradients); where its closing
// all-reduce was, a reduce-scatter (its gradient an all-gather). Per byte
// moved this is what the all-reduce moved, in two halves.
//
// The token-wise zone grows from the regions' edges through ops that work on
// each token's row alone. Where it begins at a tensor computed whole (the
// embeddings), each rank takes its rows (a slice behind a fanout, whose
// gradient all-reduces the rows' gradients back into the whole); where a
// token-wise tensor is read by whole-tensor compute (the head and the loss),
// an all-gather rebuilds it, whose gradient is each rank's rows of the same
// whole gradient. Parameters read in the zone (norm weights, biases of the
// row-parallel linears) are used on 1/tp of the tokens, so a fanout sums their
// gradients over tp.
class SequenceSplit {
 public:
  SequenceSplit(Graph &g, int64_t ranks, int64_t index) : g_(g), ranks_(ranks), index_(index) {
    producer_.assign(g.tensors.size(), -1);
    readers_.resize(g.tensors.size());
    for (int ni = 0; ni < static_cast<int>(g.nodes.size()); ++ni) {
      for (int o : g.nodes[ni].outputs) producer_[o] = ni;
      for (int i : g.nodes[ni].inputs) readers_[i].push_back(ni);
    }
    zone_t_.assign(g.tensors.size(), 0);
    zone_n_.assign(g.nodes.size(), 0);
  }

  std::string run() {
    std::vector<int> work;
    for (int ni = 0; ni < static_cast<int>(g_.nodes.size()); ++ni) {
      const Node &n = g_.nodes[ni];
      if (!edge(n)) continue;
      if (n.op == "fanout") seed(n.inputs[0], n, work);
      if (n.op != "all_reduce") continue;
      // A sum read by whole-tensor compute only (the tied embedding's, before
      // the position embedding is added) stays an all-reduce: a reduce-scatter
      // and an all-gather at once would move the same bytes in two steps.
      bool row_reader = false;
      for (int r : readers_[n.outputs[0]]) row_reader = row_reader || row_wise(g_.nodes[r]);
      if (row_reader)
        seed(n.outputs[0], n, work);
      else
        whole_.insert(ni);
    }
    while (!work.empty()) {
      const int t = work.back();
      work.pop_back();
      const int p = producer_[t];
      if (p >= 0 && !zone_n_[p] && row_wise(g_.nodes[p])) add_node(p, work);
      for (int r : readers_[t])
        if (!zone_n_[r] && row_wise(g_.nodes[r])) add_node(r, work);
    }
    rewrite();
    return report_;
  }

 private:
  Graph &g_;
  int64_t ranks_, index_;
  int64_t tokens_ = -1;
  std::vector<int> producer_;
  std::vector<std::vector<int>> readers_;
  std::vector<char> zone_t_, zone_n_;
  std::set<int> whole_;  // all-reduces left whole
  std::string report_;

  const std::vector<int64_t> &shape(int t) const { return g_.tensors[t].shape; }
  // A region's fanout or closing all-reduce.
  static bool edge(const Node &n) {
    return (n.op == "fanout" || n.op == "all_reduce") && n.attr_string("axis", "") == kAxis;
  }
  // An edge that the zone replaces (an all-gather or a reduce-scatter in its place).
  bool split_edge(int ni) const { return edge(g_.nodes[ni]) && !whole_.count(ni); }

  bool token_rows(int t) const {
    const Tensor &x = g_.tensors[t];
    if (x.dtype != CTR_DTYPE_F32 || x.shape.size() < 2 || x.shape.back() <= 0) return false;
    return x.numel() / x.shape.back() == tokens_;
  }

  void seed(int t, const Node &at, std::vector<int> &work) {
    const Tensor &x = g_.tensors[t];
    CTR_REQUIRE(x.shape.size() >= 2 && x.shape.back() > 0, CTR_STATUS_UNSUPPORTED,
                "place: sequence parallelism needs [tokens..., width] activations at the edges of the "
                "tensor-parallel regions; '%s' (at node '%s') has %d dims",
                x.name.c_str(), at.name.c_str(), static_cast<int>(x.shape.size()));
    const int64_t rows = x.numel() / x.shape.back();
    if (tokens_ < 0) {
      tokens_ = rows;
      CTR_REQUIRE(tokens_ % ranks_ == 0, CTR_STATUS_UNSUPPORTED,
                  "place: sequence parallelism splits the %lld tokens of a micro-batch (batch x seq) over "
                  "tp=%lld, which does not divide them; use a batch or sequence length that tp divides, or "
                  "no sequence parallelism",
                  static_cast<long long>(tokens_), static_cast<long long>(ranks_));
    }
    CTR_REQUIRE(rows == tokens_, CTR_STATUS_UNSUPPORTED,
                "place: sequence parallelism: '%s' (at node '%s') has %lld rows, other region edges %lld tokens",
                x.name.c_str(), at.name.c_str(), static_cast<long long>(rows), static_cast<long long>(tokens_));
    if (!zone_t_[t]) {
      zone_t_[t] = 1;
      work.push_back(t);
    }
  }

  // Whether node n computes each token's row from that token's rows alone:
  // norms over the last dim, element-wise ops on same-shaped token tensors and
  // rows broadcast over the tokens.
  bool row_wise(const Node &n) const {
    static const std::set<std::string> elementwise = {
        "silu", "swiglu", "exp", "log", "tanh", "erf", "rsqrt", "sqrt", "neg", "reciprocal",
        "sigmoid", "pow", "gelu", "relu", "clamp", "add", "sub", "mul", "div"};
    if (n.outputs.empty() || !token_rows(n.outputs[0])) return false;
    const std::vector<int64_t> &y = shape(n.outputs[0]);
    const std::vector<int64_t> row = {y.back()};
    if (n.op == "layernorm" || n.op == "rmsnorm") {
      if (shape(n.inputs[0]) != y) return false;
      for (size_t i = 1; i < n.inputs.size(); ++i)
        if (shape(n.inputs[i]) != row) return false;
      return true;
    }
    if (!elementwise.count(n.op)) return false;
    for (int i : n.inputs)
      if (shape(i) != y && shape(i) != row && g_.tensors[i].numel() != 1) return false;
    return true;
  }

  void add_node(int ni, std::vector<int> &work) {
    zone_n_[ni] = 1;
    const Node &n = g_.nodes[ni];
    auto mark = [&](int t) {
      if (!zone_t_[t]) {
        zone_t_[t] = 1;
        work.push_back(t);
      }
    };
    for (int i : n.inputs)
      if (shape(i) == shape(n.outputs[0])) mark(i);
    for (int o : n.outputs) mark(o);
  }

  int add_tensor(const std::string &name, int like, std::vector<int64_t> shape) {
    Tensor t;
    t.name = name;
    t.dtype = g_.tensors[like].dtype;
    t.shape = std::move(shape);
    t.has_shape = true;
    zone_t_.push_back(0);
    return g_.add_tensor(std::move(t));
  }

  std::map<std::string, Attr> coll_attrs() const {
    return {{"axis", Attr::of_string(kAxis)}, {"ranks", Attr::of_int(ranks_)}, {"activation", Attr::of_int(1)}};
  }

  void rewrite() {
    const int nn = static_cast<int>(g_.nodes.size());
    const int nt = static_cast<int>(g_.tensors.size());
    const int64_t local_rows = tokens_ / ranks_;
    std::vector<std::vector<Node>> before(nn), after(nn);
    std::vector<char> drop(nn, 0);
    auto rows_view = [&](int t) { return std::vector<int64_t>{tokens_, shape(t).back()}; };
    auto bytes = [&](int t) { return g_.tensors[t].bytes(); };
    int64_t fwd_bytes = 0, bwd_bytes = 0, entry_bytes = 0, exit_bytes = 0, param_bytes = 0;
    int64_t again_bytes = 0;  // the regions' inputs gathered again in backward (pass recompute)
    int gathers = 0, scatters = 0, entries = 0, exits = 0, params = 0;

    // Where the zone begins: this rank's rows of a whole tensor.
    std::map<int, int> local;  // whole zone tensor -> this rank's rows
    for (int t = 0; t < nt; ++t) {
      if (!zone_t_[t]) continue;
      const int p = producer_[t];
      if (p >= 0 && (zone_n_[p] || split_edge(p)))
        continue;
      int first = nn;
      for (int r : readers_[t])
        if (zone_n_[r] || g_.nodes[r].op == "fanout") first = std::min(first, r);
      if (first == nn) continue;
      const std::string name = g_.tensors[t].name;
      const int fan = add_tensor(name + ".sp_whole", t, shape(t));
      const int rows = add_tensor(name + ".sp_rows", t, rows_view(t));
      const int mine = add_tensor(name + ".sp", t, {local_rows, shape(t).back()});
      const int blk = g_.nodes[first].block;
      before[first].push_back(Node::make("fanout", name + ".sp_fanout", {t}, {fan}, blk, {{"axis", Attr::of_string(kAxis)}}));
      before[first].push_back(Node::make("reshape", name + ".sp_rows", {fan}, {rows}, blk, {{"shape", Attr::of_ints(rows_view(t))}}));
      before[first].push_back(Node::make("slice", name + ".sp", {rows}, {mine}, blk,
                                         {{"dim", Attr::of_int(0)},
                                          {"start", Attr::of_int(index_ * local_rows)},
                                          {"end", Attr::of_int((index_ + 1) * local_rows)}}));
      local[t] = mine;
      zone_t_[mine] = 1;
      ++entries;
      entry_bytes += bytes(t);
    }
    auto local_of = [&](int t) {
      auto it = local.find(t);
      return it == local.end() ? t : it->second;
    };

    // The regions' edges.
    for (int ni = 0; ni < nn; ++ni) {
      Node &n = g_.nodes[ni];
      if (!split_edge(ni)) continue;
      if (n.op == "fanout") {
        const int x = n.inputs[0], y = n.outputs[0];
        const int rows = add_tensor(g_.tensors[x].name + ".sp_gathered", x, rows_view(x));
        std::map<std::string, Attr> a = coll_attrs();
        a["rows"] = Attr::of_int(tokens_);
        after[ni].push_back(Node::make("all_gather", g_.tensors[x].name + ".sp_all_gather", {local_of(x)}, {rows}, n.block, a));
        after[ni].push_back(Node::make("reshape", g_.tensors[y].name, {rows}, {y}, n.block, {{"shape", Attr::of_ints(shape(x))}}));
        drop[ni] = 1;
        ++gathers;
        fwd_bytes += bytes(x);
        bwd_bytes += bytes(x);
        again_bytes += bytes(x);
      } else if (n.op == "all_reduce") {
        const int x = n.inputs[0], y = n.outputs[0];
        const int rows = add_tensor(g_.tensors[x].name + ".rows", x, rows_view(x));
        std::map<std::string, Attr> a = coll_attrs();
        a["reduce"] = Attr::of_string("sum");
        after[ni].push_back(Node::make("reshape", g_.tensors[x].name + ".rows", {x}, {rows}, n.block, {{"shape", Attr::of_ints(rows_view(x))}}));
        after[ni].push_back(Node::make("reduce_scatter", g_.tensors[y].name + ".reduce_scatter", {rows}, {y}, n.block, a));
        drop[ni] = 1;
        ++scatters;
        fwd_bytes += bytes(x);
        bwd_bytes += bytes(x);
      }
    }

    // Inside the zone: rows of the entries, and broadcast rows (parameters)
    // behind a fanout that sums their gradients over tp.
    std::map<int, int> fanned;
    for (int ni = 0; ni < nn; ++ni) {
      if (!zone_n_[ni]) continue;
      Node &n = g_.nodes[ni];
      for (int &in : n.inputs) {
        if (zone_t_[in]) {
          in = local_of(in);
          continue;
        }
        auto it = fanned.find(in);
        if (it == fanned.end()) {
          const int f = add_tensor(g_.tensors[in].name + ".sp", in, shape(in));
          before[ni].push_back(Node::make("fanout", g_.tensors[in].name + ".sp_fanout", {in}, {f}, n.block,
                                          {{"axis", Attr::of_string(kAxis)}}));
          it = fanned.emplace(in, f).first;
          if (g_.tensors[in].role == Role::Param) {
            ++params;
            param_bytes += bytes(in);
          }
        }
        in = it->second;
      }
    }

    // Where whole-tensor compute reads the zone: the rows gathered again.
    for (int t = 0; t < nt; ++t) {
      if (!zone_t_[t] || local.count(t)) continue;
      std::vector<int> outside;
      for (int r : readers_[t])
        if (!zone_n_[r] && !split_edge(r))
          outside.push_back(r);
      if (outside.empty()) continue;
      const std::string name = g_.tensors[t].name;
      const int rows = add_tensor(name + ".sp_gathered", t, rows_view(t));
      const int whole = add_tensor(name + ".whole", t, shape(t));
      std::map<std::string, Attr> a = coll_attrs();
      a["rows"] = Attr::of_int(tokens_);
      a["grad"] = Attr::of_string("slice");
      a["index"] = Attr::of_int(index_);
      const int first = outside.front();
      before[first].push_back(Node::make("all_gather", name + ".sp_all_gather", {t}, {rows}, g_.nodes[first].block, a));
      before[first].push_back(Node::make("reshape", name + ".whole", {rows}, {whole}, g_.nodes[first].block,
                                         {{"shape", Attr::of_ints(shape(t))}}));
      for (int r : outside)
        for (int &in : g_.nodes[r].inputs)
          if (in == t) in = whole;
      ++exits;
      exit_bytes += bytes(t);
    }

    std::vector<Node> nodes;
    for (int ni = 0; ni < nn; ++ni) {
      for (Node &n : before[ni]) nodes.push_back(std::move(n));
      if (!drop[ni]) nodes.push_back(std::move(g_.nodes[ni]));
      for (Node &n : after[ni]) nodes.push_back(std::move(n));
    }
    g_.nodes = std::move(nodes);
    infer_local_shapes(g_);
    for (int t = 0; t < static_cast<int>(zone_t_.size()); ++t) {
      Tensor &x = g_.tensors[t];
      if (!zone_t_[t] || local.count(t) || x.shape.empty()) continue;
      std::vector<int64_t> whole = x.shape;
      whole[0] *= ranks_;
      x.placement.add_shard(kAxis, 0, whole);
    }
    int zn = 0;
    for (char z : zone_n_) zn += z;
    report_ = strformat(
        "  sequence parallel: %lld tokens per micro-batch split over tp (%lld rows each) across %d token-wise "
        "nodes\n"
        "    per micro-batch: %d all-gathers and %d reduce-scatters over tp at the regions' edges, of %lld bytes "
        "of whole tensors forward and %lld backward; each moves half what an all-reduce of its tensor does, so "
        "on the wire they move what the all-reduces of tp alone do; backward gathers each region's input again "
        "for its weight gradients (%d all-gathers, %lld bytes), so forward keeps 1/tp of it\n"
        "    %d whole tensors split where the zone begins (%lld bytes all-reduced backward), %d gathered where "
        "whole-tensor compute reads it (%lld bytes forward), %d parameters' gradients all-reduced (%lld "
        "bytes)\n",
        static_cast<long long>(tokens_), static_cast<long long>(local_rows), zn, gathers, scatters,
        static_cast<long long>(fwd_bytes), static_cast<long long>(bwd_bytes), gathers,
        static_cast<long long>(again_bytes), entries,
        static_cast<long long>(entry_bytes), exits, static_cast<long long>(exit_bytes), params,
        static_cast<long long>(param_bytes));
  }
};

}  // namespace

std::string pass_place(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel) {
  CTR_CHECK(g.num_forward < 0);
  const int64_t tp = opt.mesh.size(kAxis);
  if (tp <= 1) {
    if (opt.mesh.size("cp") > 1) return place_context(g, opt, has_kernel);
    return "place: no tensor- or context-parallel axis";
  }
  auto kernels = [&](std::initializer_list<const char *> ops) {
    bool all = true;
    for (const char *op : ops) {
      const OpDef *d = find_op(op);
      all = all && d != nullptr && has_kernel && has_kernel(d->id);
    }
    return all;
  };
  Placer p(g, tp, opt.mesh.index(kAxis), kernels({"vocab_ce_stats", "vocab_ce_loss", "vocab_ce_bwd"}),
           kernels({"vocab_embedding", "vocab_embedding_bwd"}));
  std::string report = p.run();
  CTR_REQUIRE(p.regions() > 0, CTR_STATUS_UNSUPPORTED,
              "place: mesh axis 'tp' has size %lld, but graph '%s' has no tensor-parallel region (a linear whose "
              "output reaches another linear through ops that run on split heads or features):\n%s",
              static_cast<long long>(tp), g.name.c_str(), report.c_str());
  p.rewrite();
  infer_local_shapes(g);
  for (const Node &n : g.nodes)
    if (n.op == "moe_router") {
      report += "  mixture-of-experts layers run whole on every rank of the tp group (the same tokens' routing and "
                "expert work; experts split over ep only)\n";
      break;
    }
  // Context parallelism splits the sequence of what tp placed (heads and
  // features split on the last dim; the sequence is dim 1).
  report += place_context(g, opt, has_kernel);
  if (opt.sequence_parallel) {
    SequenceSplit sp(g, tp, opt.mesh.index(kAxis));
    report += sp.run();
  }
  return report;
}

}  // namespace ctr
