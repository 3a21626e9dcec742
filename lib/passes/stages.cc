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
#include <map>
#include <set>

#include "core/status.h"
#include "graph/placement.h"
#include "passes/passes.h"

namespace ctr {

StageCut pass_stages(Graph &g, const CompileOptions &opt, const Schedule &s) {
  StageCut cut;
  const int p = s.stages, v = s.virtual_stages, V = s.virtual_count();
  if (p <= 1) return cut;
  CTR_CHECK(g.num_forward < 0 && static_cast<int>(s.spans.size()) == V);
  const int me = static_cast<int>(opt.mesh.index("pp"));
  cut.stage = me;
  cut.stages = p;
  cut.chunks = v;
  const int nn = static_cast<int>(g.nodes.size());
  const int nt = static_cast<int>(g.tensors.size());
  // (virtual stage k runs on stage k % p as its chunk k / p)
  auto vs_text = [&](int vs) {
    return v > 1 ? strformat("virtual stage %d (stage %d, chunk %d)", vs, vs % p, vs / p) : strformat("stage %d", vs);
  };

  int nblocks = 0, last_block_node = -1;
  for (int ni = 0; ni < nn; ++ni)
    if (g.nodes[ni].block >= 0) {
      nblocks = std::max(nblocks, g.nodes[ni].block + 1);
      last_block_node = ni;
    }
  std::vector<int> block_vs(static_cast<size_t>(nblocks), V - 1);
  for (int vs = 0; vs < V; ++vs)
    for (int b = s.spans[vs].first_block; b <= s.spans[vs].last_block && b < nblocks; ++b) block_vs[b] = vs;
  cut.block_chunk.assign(static_cast<size_t>(nblocks), -1);
  for (int b = 0; b < nblocks; ++b)
    if (block_vs[b] % p == me) cut.block_chunk[b] = block_vs[b] / p;
  std::vector<int> node_vs(static_cast<size_t>(nn), 0);
  for (int ni = 0, cur = 0; ni < nn; ++ni) {
    if (g.nodes[ni].block >= 0) cur = block_vs[static_cast<size_t>(g.nodes[ni].block)];
    node_vs[ni] = ni > last_block_node ? V - 1 : cur;
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
      producer[o] = node_vs[ni];
      if (any) needs[o] = 1;
    }
  }
  CTR_REQUIRE(g.loss >= 0 && producer[g.loss] == V - 1, CTR_STATUS_UNSUPPORTED,
              "pipeline: the loss of graph '%s' is not computed after its last block, so it is not on the last "
              "stage",
              g.name.c_str());

  // (tensor, virtual stage reading it) for every crossing; which stages
  // (ranks) and virtual stages read each tensor.
  std::set<std::pair<int, int>> crossing;
  std::map<std::pair<int, int>, int> first_reader;  // (tensor, stage) -> its first virtual stage reading it
  std::vector<std::set<int>> read_on(static_cast<size_t>(nt)), read_vs(static_cast<size_t>(nt));
  for (int ni = 0; ni < nn; ++ni) {
    const Node &n = g.nodes[ni];
    const int vs = node_vs[ni];
    for (int in : n.inputs) {
      read_on[in].insert(vs % p);
      read_vs[in].insert(vs);
      const int from = producer[in];
      if (from < 0 || from == vs) continue;
      CTR_REQUIRE(from < vs, CTR_STATUS_UNSUPPORTED,
                  "pipeline: node '%s' on %s reads %s, which %s computes: the stages must follow the graph's order",
                  n.name.c_str(), vs_text(vs).c_str(), g.describe_tensor(in).c_str(), vs_text(from).c_str());
      // Within a rank a later chunk reads it where the earlier left it (its
      // forward runs first, its backward after); another rank receives it
      // once, in its first chunk reading it, and sends its gradient back
      // from that chunk's backward, the last of that micro-batch to add to it.
      if (from % p == vs % p) continue;
      auto [it, fresh] = first_reader.insert({{in, vs % p}, vs});
      if (!fresh) it->second = std::min(it->second, vs);
    }
  }
  for (const auto &[key, vs] : first_reader) crossing.insert({key.first, vs});
  for (const auto &[t, to] : crossing)
    cut.crossings.push_back({producer[t], to, needs[t] != 0, g.tensors[t].name});

  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].keep && producer[t] >= 0) cut.kept_on[g.tensors[t].name] = producer[t] % p;

  // A parameter no node reads stays with the first stage.
  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].role == Role::Param && read_on[t].empty()) read_on[t].insert(0);
  for (int t = 0; t < nt; ++t) {
    const Tensor &x = g.tensors[t];
    if (x.role == Role::Param) {
      cut.params.push_back({x.name, global_shape(x), std::vector<int>(read_on[t].begin(), read_on[t].end())});
      // A chunk's gradients are whole after its backward task.
      int here = 0;
      for (int vs : read_vs[t]) here += vs % p == me;
      CTR_REQUIRE(here <= 1, CTR_STATUS_UNSUPPORTED,
                  "pipeline: parameter '%s' is read by %d chunks of stage %d; under the interleaved schedule a "
                  "parameter belongs to one chunk of a rank (choose another pp_virtual or pp_stages)",
                  x.name.c_str(), here, me);
    }
    if (x.role == Role::Input && !read_on[t].count(me)) cut.elsewhere_inputs.push_back({x.name, x.bytes()});
  }

  // The cut graph: this stage's nodes and the tensors they touch, in the
  // original order.
  std::vector<char> used(static_cast<size_t>(nt), 0);
  for (int t = 0; t < nt; ++t)
    if (g.tensors[t].role == Role::Param && read_on[t].count(me)) used[t] = 1;
  for (int ni = 0; ni < nn; ++ni) {
    if (node_vs[ni] % p != me) continue;
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
  int k = -1;
  for (const auto &[t, to] : crossing) {
    ++k;
    const int from = producer[t];
    if (to % p == me) {
      Tensor &x = out.tensors[static_cast<size_t>(map[t])];
      x.role = Role::Input;
      x.wants_grad = needs[t] != 0;
      cut.recv.push_back({map[t], from % p, needs[t] != 0, -1, k, to / p});
    } else if (from % p == me) {
      StageCut::Boundary b{map[t], to % p, needs[t] != 0, -1, k, from / p};
      out.tensors[static_cast<size_t>(map[t])].keep = true;
      if (b.grad) {
        CTR_REQUIRE(g.tensors[t].dtype == CTR_DTYPE_F32, CTR_STATUS_UNSUPPORTED,
                    "pipeline: %s crosses from %s to %s as %s; only f32 activations carry a gradient between "
                    "stages",
                    g.describe_tensor(t).c_str(), vs_text(from).c_str(), vs_text(to).c_str(),
                    dtype_name(g.tensors[t].dtype));
        Tensor seed = g.tensors[t];
        seed.name = v > 1 ? strformat("%s.grad_from_vstage%d", g.tensors[t].name.c_str(), to)
                          : strformat("%s.grad_from_stage%d", g.tensors[t].name.c_str(), to);
        seed.role = Role::Input;
        seed.keep = false;
        b.grad_tensor = out.add_tensor(std::move(seed));
        out.grad_seeds.push_back({b.tensor, b.grad_tensor});
      }
      cut.send.push_back(b);
    }
  }
  for (int ni = 0; ni < nn; ++ni) {
    if (node_vs[ni] % p != me) continue;
    Node n = g.nodes[ni];
    for (int &in : n.inputs) in = map[in];
    for (int &o : n.outputs) o = map[o];
    out.add_node(std::move(n));
  }
  out.loss = me == (V - 1) % p ? map[g.loss] : -1;
  g = std::move(out);
  return cut;
}

std::vector<int> node_chunks(const Graph &g, const StageCut &cut) {
  if (cut.chunks <= 1) return {};
  const int nn = static_cast<int>(g.nodes.size());
  const int nf = g.num_forward, ni = g.num_input_grad >= 0 ? g.num_input_grad : nn;
  CTR_CHECK(nf >= 0);
  std::vector<int> chunk(static_cast<size_t>(nn), -1);
  // Collectives go with the compute around them: reorder moves a prefetched
  // gather (or a deferred reduction) into another block's run, and it runs in
  // that task (its output, read by a later task, is held from one to the other).
  auto of_block = [&](const Node &n) {
    if (n.block < 0 || is_collective(n)) return -1;
    CTR_CHECK(static_cast<size_t>(n.block) < cut.block_chunk.size() && cut.block_chunk[n.block] >= 0);
    return cut.block_chunk[static_cast<size_t>(n.block)];
  };
  const int phases[4] = {0, nf, ni, nn};
  for (int ph = 0; ph < 3; ++ph) {
    const int begin = phases[ph], end = phases[ph + 1];
    int cur = -1;
    for (int i = begin; i < end; ++i) {
      const int c = of_block(g.nodes[static_cast<size_t>(i)]);
      if (c >= 0) cur = c;
      chunk[static_cast<size_t>(i)] = cur;
    }
    // Nodes before the phase's first block node: the chunk after them.
    cur = -1;
    for (int i = end - 1; i >= begin; --i) {
      if (chunk[static_cast<size_t>(i)] >= 0) {
        cur = chunk[static_cast<size_t>(i)];
        continue;
      }
      chunk[static_cast<size_t>(i)] = cur >= 0 ? cur : (ph == 0 ? 0 : cut.chunks - 1);
    }
    // A chunk's task runs its nodes alone: the forward's chunks in order, the
    // backward's in reverse, so every tensor a task reads from another task
    // of the same micro-batch was written before.
    for (int i = begin + 1; i < end; ++i) {
      const int a = chunk[static_cast<size_t>(i - 1)], b = chunk[static_cast<size_t>(i)];
      const bool ok = ph == 0 ? a <= b : a >= b;
      CTR_REQUIRE(ok, CTR_STATUS_UNSUPPORTED,
                  "pipeline schedule interleaved: in the %s, node '%s' (chunk %d) comes after node '%s' (chunk %d); a "
                  "compiler pass moved work across the rank's chunks, which run as separate tasks",
                  ph == 0 ? "forward" : ph == 1 ? "backward" : "weight gradients",
                  g.nodes[static_cast<size_t>(i)].name.c_str(), b, g.nodes[static_cast<size_t>(i - 1)].name.c_str(), a);
    }
  }
  return chunk;
}

}  // namespace ctr
