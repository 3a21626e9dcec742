// Pass `stages`: the forward graph cut down to this rank's pipeline stage.
//
// Every rank compiles the whole graph and cuts the same way, so the ranks
// agree on what crosses between stages without exchanging anything. A node's
// stage is its block's (Schedule::spans); a node outside every block belongs
// to the stage of the block before it, the nodes before the first block to
// the first stage and those after the last to the last. A tensor computed on
// stage P and read on a later stage S crosses from P to S: on S it becomes an
// input that the step fills from P before each forward (and whose gradient
// autodiff computes and the step sends back), on P it is kept past the forward
// to be sent, and an input holding the gradient S sends back seeds P's
// backward. Boundaries are listed by tensor, then by stage, so the k-th send
// from one stage to another matches the k-th receive there.

#include <algorithm>
#include <set>

#include "core/status.h"
#include "graph/placement.h"
#include "passes/passes.h"

namespace ctr {

StageCut pass_stages(Graph &g, const CompileOptions &opt, const Schedule &s) {
  StageCut cut;
  const int p = s.stages;
  if (p <= 1) return cut;
  CTR_CHECK(g.num_forward < 0 && static_cast<int>(s.spans.size()) == p);
  const int me = static_cast<int>(opt.mesh.index("pp"));
  cut.stage = me;
  cut.stages = p;
  const int nn = static_cast<int>(g.nodes.size());
  const int nt = static_cast<int>(g.tensors.size());

  int nblocks = 0, last_block_node = -1;
  for (int ni = 0; ni < nn; ++ni)
    if (g.nodes[ni].block >= 0) {
      nblocks = std::max(nblocks, g.nodes[ni].block + 1);
      last_block_node = ni;
    }
  std::vector<int> block_stage(static_cast<size_t>(nblocks), p - 1);
  for (int st = 0; st < p; ++st)
    for (int b = s.spans[st].first_block; b <= s.spans[st].last_block && b < nblocks; ++b) block_stage[b] = st;
  std::vector<int> node_stage(static_cast<size_t>(nn), 0);
  for (int ni = 0, cur = 0; ni < nn; ++ni) {
    if (g.nodes[ni].block >= 0) cur = block_stage[static_cast<size_t>(g.nodes[ni].block)];
    node_stage[ni] = ni > last_block_node ? p - 1 : cur;
  }

  // Where each tensor is computed, and which depend on a parameter (autodiff's rule).
  std::vector<int> producer(static_cast<size_t>(nt), -1);
  std::vector<char> needs(static_cast<size_t>(nt), 0);
  for (int t = 0; t < nt; ++t) needs[t] = g.tensors[t].role == Role::Param;
  for (int ni = 0; ni < nn; ++ni) {
    const Node &n = g.nodes[ni];
    bool any = false;
    for (int in : n.inputs) any |= needs[in] != 0;
    for (int o : n.outputs) {
      producer[o] = node_stage[ni];
      if (any) needs[o] = 1;
    }
  }
  CTR_REQUIRE(g.loss >= 0 && producer[g.loss] == p - 1, CTR_STATUS_UNSUPPORTED,
              "pipeline: the loss of graph '%s' is not computed after its last block, so it is not on the last "
              "stage",
              g.name.c_str());

  // (tensor, stage reading it) for every crossing; which stages read each tensor.
  std::set<std::pair<int, int>> crossing;
  std::vector<std::set<int>> read_on(static_cast<size_t>(nt));
  for (int ni = 0; ni < nn; ++ni) {
    const Node &n = g.nodes[ni];
    const int st = node_stage[ni];
    for (int in : n.inputs) {
      read_on[in].insert(st);
      const int from = producer[in];
      if (from < 0 || from == st) continue;
      CTR_REQUIRE(from < st, CTR_STATUS_UNSUPPORTED,
                  "pipeline: node '%s' on stage %d reads %s, which stage %d computes: the stages must follow the "
                  "graph's order",
                  n.name.c_str(), st, g.describe_tensor(in).c_str(), from);
      crossing.insert({in, st});
    }
  }

  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].keep && producer[t] >= 0) cut.kept_on[g.tensors[t].name] = producer[t];

  // A parameter no node reads stays with the first stage.
  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].role == Role::Param && read_on[t].empty()) read_on[t].insert(0);
  for (int t = 0; t < nt; ++t) {
    const Tensor &x = g.tensors[t];
    if (x.role == Role::Param)
      cut.params.push_back({x.name, global_shape(x), std::vector<int>(read_on[t].begin(), read_on[t].end())});
    if (x.role == Role::Input && !read_on[t].count(me)) cut.elsewhere_inputs.push_back({x.name, x.bytes()});
  }

  // The cut graph: this stage's nodes and the tensors they touch, in the
  // original order.
  std::vector<char> used(static_cast<size_t>(nt), 0);
  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].role == Role::Param && read_on[t].count(me)) used[t] = 1;
  for (int ni = 0; ni < nn; ++ni) {
    if (node_stage[ni] != me) continue;
    for (int in : g.nodes[ni].inputs) used[in] = 1;
    for (int o : g.nodes[ni].outputs) used[o] = 1;
  }
  Graph out;
  out.format_version = g.format_version;
  out.name = g.name;
  out.metadata = g.metadata;
  out.symbols = g.symbols;
  std::vector<int> map(static_cast<size_t>(nt), -1);
  for (int t = 0; t < nt; ++t)
    if (used[t]) map[t] = out.add_tensor(g.tensors[t]);
  for (const auto &[t, st] : crossing) {
    if (st == me) {
      // Received: once per tensor, whichever stages read it here.
      bool seen = false;
      for (const StageCut::Boundary &b : cut.recv) seen |= b.tensor == map[t];
      if (seen) continue;
      Tensor &x = out.tensors[static_cast<size_t>(map[t])];
      x.role = Role::Input;
      x.wants_grad = needs[t] != 0;
      cut.recv.push_back({map[t], producer[t], needs[t] != 0, -1});
    } else if (producer[t] == me) {
      StageCut::Boundary b{map[t], st, needs[t] != 0, -1};
      out.tensors[static_cast<size_t>(map[t])].keep = true;
      if (b.grad) {
        CTR_REQUIRE(g.tensors[t].dtype == CTR_DTYPE_F32, CTR_STATUS_UNSUPPORTED,
                    "pipeline: %s crosses from stage %d to %d as %s; only f32 activations carry a gradient "
                    "between stages",
                    g.describe_tensor(t).c_str(), me, st, dtype_name(g.tensors[t].dtype));
        Tensor seed = g.tensors[t];
        seed.name = strformat("%s.grad_from_stage%d", g.tensors[t].name.c_str(), st);
        seed.role = Role::Input;
        seed.keep = false;
        b.grad_tensor = out.add_tensor(std::move(seed));
        out.grad_seeds.push_back({b.tensor, b.grad_tensor});
      }
      cut.send.push_back(b);
    }
  }
  for (int ni = 0; ni < nn; ++ni) {
    if (node_stage[ni] != me) continue;
    Node n = g.nodes[ni];
    for (int &in : n.inputs) in = map[in];
    for (int &o : n.outputs) o = map[o];
    out.add_node(std::move(n));
  }
  out.loss = me == p - 1 ? map[g.loss] : -1;
  g = std::move(out);
  return cut;
}

}  // namespace ctr
