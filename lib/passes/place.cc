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
  Placer(Graph &g, int64_t ranks) : g_(g), ranks_(ranks) {
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

  int regions() const { return static_cast<int>(regions_.size()); }
  const std::string &first_refusal() const { return first_refusal_; }

 private:
  Graph &g_;
  int64_t ranks_;
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
      std::string why = d->shard_rule(g_, &trial, in, ranks_, out);
      if (why.find("is not divisible by") != std::string::npos) {
        // A head count the axis does not divide: the region's misfit; it grows
        // on as if the heads fitted, to learn whether it is otherwise valid.
        if (r.misfit.empty())
          r.misfit = strformat("place: node '%s' (%s) cannot be split over tp=%lld: %s", n.name.c_str(),
                               n.op.c_str(), static_cast<long long>(ranks_), why.c_str());
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
      if (attempt == 1) return n.op + " '" + n.name + "': " + why;
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
    std::vector<Node> nodes;
    for (size_t ni = 0; ni < g_.nodes.size(); ++ni) {
      for (Node &n : before[ni]) nodes.push_back(std::move(n));
      nodes.push_back(std::move(g_.nodes[ni]));
      for (Node &n : after[ni]) nodes.push_back(std::move(n));
    }
    g_.nodes = std::move(nodes);
    // Local shapes, in order, from the parameters' blocks.
    for (Node &n : g_.nodes) {
      const OpDef *d = find_op(n.op);
      CTR_CHECK(d != nullptr && d->infer != nullptr);
      std::vector<OutInfo> out;
      d->infer(g_, n, out);
      CTR_CHECK(out.size() == n.outputs.size());
      for (size_t k = 0; k < out.size(); ++k) {
        Tensor &t = g_.tensors[n.outputs[k]];
        t.shape = out[k].shape;
        t.dtype = out[k].dtype;
        t.has_shape = true;
      }
    }
  }
};

}  // namespace

std::string pass_place(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward < 0);
  const int64_t tp = opt.mesh.size(kAxis);
  if (tp <= 1) return "place: no tensor-parallel axis";
  for (const Node &n : g.nodes)
    CTR_REQUIRE(n.op.rfind("moe_", 0) != 0, CTR_STATUS_UNSUPPORTED,
                "place: graph '%s' has mixture-of-experts layers (node '%s'), which tp does not split yet; use "
                "ep, fsdp and dp",
                g.name.c_str(), n.name.c_str());
  Placer p(g, tp);
  std::string report = p.run();
  CTR_REQUIRE(p.regions() > 0, CTR_STATUS_UNSUPPORTED,
              "place: mesh axis 'tp' has size %lld, but graph '%s' has no tensor-parallel region (a linear whose "
              "output reaches another linear through ops that run on split heads or features):\n%s",
              static_cast<long long>(tp), g.name.c_str(), report.c_str());
  p.rewrite();
  return report;
}

}  // namespace ctr
