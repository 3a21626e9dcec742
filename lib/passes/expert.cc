// Pass expert: mixture-of-experts layers placed on the mesh (see passes.h).
//
// It runs before autodiff, so what it inserts is differentiated like any other
// op: the exchange that sends tokens to their experts has the reverse exchange
// as its gradient, and the other way round.
//
// Expert parallelism (mesh axis ep of size P > 1): the E experts of a layer are
// split into P contiguous blocks, block j on the ep group's rank j. After
// moe_permute (rows grouped by expert, so rows for one rank are contiguous) a
// moe_dispatch sends each block's rows to its rank, and receives from every
// rank the rows for the local experts, in segments (source rank, local
// expert) that the grouped GEMMs read through their segment counts; before
// moe_unpermute a moe_combine returns the expert outputs to the rows they came
// from. The exchanges are collectives on the comm stream, so compute waits for
// them only where it reads their result. Expert weights become this rank's rows
// [j E/P, (j+1) E/P); every rank of the ep group computes its experts' gradient
// from the tokens of the whole group, so that gradient is scaled by 1/P (the
// shard pass then averages it over the other axes, as for any parameter).
//
// Load balance over the global batch (any mesh of more than one rank): the
// load-balancing loss is computed from the statistics of every rank's tokens
// (summed over the world by an all-reduce — over the ranks of this rank's
// pipeline stage, axis "stage", when there are several stages), so it does
// not depend on how the batch is split between ranks and a run on N ranks
// trains as one rank with the whole batch does.

#include <set>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

int add_activation(Graph &g, const std::string &name) {
  Tensor t;
  t.name = name;
  return g.add_tensor(std::move(t));
}

}  // namespace

void pass_expert(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward < 0);
  const int64_t P = opt.mesh.size("ep");
  int64_t world = 1;
  for (const MeshPlacement::Axis &a : opt.mesh.axes) world *= a.size;
  bool has_moe = false;
  for (const Node &n : g.nodes) has_moe |= n.op == "moe_permute" || n.op == "moe_aux_loss";
  // The statistics sum over the ranks that run the layer: with pipeline stages,
  // those of this rank's stage (one rank per stage: nothing to sum).
  const int64_t pp = opt.mesh.size("pp");
  if (!has_moe || world / pp <= 1) return;
  const std::string stage_axis = pp > 1 ? "stage" : "world";

  std::vector<std::vector<Node>> before(g.nodes.size()), after(g.nodes.size());
  std::set<int> expert_params;
  std::map<int, int64_t> experts_of;  // expert param -> experts in its layer

  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    Node &n = g.nodes[ni];
    if (n.op == "moe_aux_loss") {
      const int stats = add_activation(g, n.name + ".stats");
      const int global = add_activation(g, n.name + ".stats_all");
      before[ni].push_back(Node::make("moe_aux_stats", n.name + ".stats", {n.inputs[0], n.inputs[1]}, {stats},
                                     n.block, {}));
      before[ni].push_back(Node::make("all_reduce", n.name + ".stats_all", {stats}, {global}, n.block,
                                     {{"axis", Attr::of_string(stage_axis)}, {"reduce", Attr::of_string("sum")}}));
      n.op = "moe_aux_loss_global";
      g.nodes[ni].inputs.push_back(global);
      continue;
    }
    if (n.op != "moe_permute" || P <= 1) continue;
    const int64_t E = n.attr_int("experts", 0);
    CTR_REQUIRE(E % P == 0, CTR_STATUS_UNSUPPORTED,
                "expert: node '%s' has %lld experts, which the ep axis (%lld ranks) does not divide evenly",
                n.name.c_str(), static_cast<long long>(E), static_cast<long long>(P));
    const int xp = n.outputs[0], counts = n.outputs[1], slots = n.outputs[2];
    const std::string base = n.name;
    const int block = n.block;
    const int xr = add_activation(g, base + ".received");
    const int seg = add_activation(g, base + ".received_counts");
    const std::map<std::string, Attr> ex = {{"axis", Attr::of_string("ep")}, {"ranks", Attr::of_int(P)}};
    after[ni].push_back(Node::make("moe_dispatch", base + ".dispatch", {xp, counts}, {xr, seg}, block, ex));
    for (size_t k = 0; k < g.nodes.size(); ++k) {
      Node &m = g.nodes[k];
      const bool reads_xp = std::find(m.inputs.begin(), m.inputs.end(), xp) != m.inputs.end();
      if (m.op == "moe_grouped_linear" && m.inputs[2] == counts) {
        if (m.inputs[0] == xp) m.inputs[0] = xr;
        m.inputs[2] = seg;
        m.attrs["weight_grad_scale"] = Attr::of_float(1.0 / static_cast<double>(P));
        const int w = m.inputs[1];
        CTR_REQUIRE(g.tensors[w].role == Role::Param, CTR_STATUS_UNSUPPORTED,
                    "expert: the weights %s of node '%s' are not a parameter, so they cannot be split over ep",
                    g.describe_tensor(w).c_str(), m.name.c_str());
        expert_params.insert(w);
        experts_of[w] = E;
      } else if (reads_xp && k != ni) {
        fail(CTR_STATUS_UNSUPPORTED,
             strformat("expert: node '%s' (%s) reads the permuted tokens of '%s'; under expert parallelism only "
                       "moe_grouped_linear may",
                       m.name.c_str(), m.op.c_str(), base.c_str()));
      }
      if (m.op == "moe_unpermute" && m.inputs[2] == slots) {
        const int local = add_activation(g, g.tensors[m.inputs[0]].name + ".returned");
        before[k].push_back(
            Node::make("moe_combine", m.name + ".combine", {m.inputs[0], counts, seg}, {local}, m.block, ex));
        g.nodes[k].inputs[0] = local;
      }
    }
  }

  std::vector<Node> nodes;
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    for (Node &n : before[ni]) nodes.push_back(std::move(n));
    nodes.push_back(std::move(g.nodes[ni]));
    for (Node &n : after[ni]) nodes.push_back(std::move(n));
  }
  g.nodes = std::move(nodes);
  pass_infer_shapes(g, opt);

  // Expert weights: this rank's block of experts (rows of dim 0).
  for (int w : expert_params) {
    Tensor &t = g.tensors[w];
    const int64_t E = experts_of[w];
    CTR_REQUIRE(!t.shape.empty() && t.shape[0] == E, CTR_STATUS_UNSUPPORTED,
                "expert: parameter %s has shape %s; expert weights must have the experts (%lld) as dim 0",
                g.describe_tensor(w).c_str(), shape_string(t.shape).c_str(), static_cast<long long>(E));
    t.placement.add_shard("ep", 0, t.shape);
    t.shape[0] = E / P;
  }
}

}  // namespace ctr
