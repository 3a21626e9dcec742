// Pass 1, verify: the semantic rules a loaded graph must meet before anything
// else reads it. The FlatBuffers verifier and id-range checks ran at load; this
// pass checks ops, arities, who produces what, and that the nodes form a DAG, and
// leaves the nodes in a topological order.

#include <queue>

#include "core/status.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {
namespace {

[[noreturn]] void bad(const std::string &what) { fail(CTR_STATUS_INVALID_GRAPH, what); }

}  // namespace

void pass_verify(Graph &g) {
  const int nt = static_cast<int>(g.tensors.size());
  if (nt == 0) bad("graph has no tensors");
  if (g.nodes.empty()) bad("graph has no nodes");

  // Tensor declarations.
  std::map<std::string, int> names;
  for (int i = 0; i < nt; ++i) {
    const Tensor &t = g.tensors[i];
    if (t.name.empty()) bad(strformat("tensor #%d has an empty name", i));
    if (!names.emplace(t.name, i).second)
      bad(strformat("tensor name '%s' is used twice (#%d and #%d)", t.name.c_str(),
                    names[t.name], i));
    if (dtype_size(t.dtype) == 0) bad(strformat("tensor '%s' has an unknown dtype", t.name.c_str()));
    for (const Dim &d : t.dims)
      if (d.symbol.empty() && d.size <= 0)
        bad(strformat("tensor '%s' has a dim of size %lld (sizes must be positive)",
                      t.name.c_str(), static_cast<long long>(d.size)));
    if (t.role == Role::Param) {
      if (t.dtype != CTR_DTYPE_F32)
        bad(strformat("parameter '%s' must be f32, is %s", t.name.c_str(), dtype_name(t.dtype)));
      if (t.dims.empty() && t.init.kind != InitKind::Data)
        bad(strformat("parameter '%s' has no shape", t.name.c_str()));
      for (const Dim &d : t.dims)
        if (!d.symbol.empty())
          bad(strformat("parameter '%s' has a symbolic dim '%s'; parameter shapes are fixed",
                        t.name.c_str(), d.symbol.c_str()));
    }
    if ((t.role == Role::Param || t.role == Role::Const) && t.init.kind == InitKind::Data) {
      // Bytes the shape needs, with overflow detected (dims are any positive int64).
      int64_t need = static_cast<int64_t>(dtype_size(t.dtype));
      bool overflow = false;
      for (const Dim &d : t.dims) overflow |= __builtin_mul_overflow(need, d.symbol.empty() ? d.size : 0, &need);
      if (overflow)
        bad(strformat("tensor '%s' embeds %zu bytes of data, its shape %s needs more than 2^63",
                      t.name.c_str(), t.data.size(), dims_string(t.dims).c_str()));
      if (static_cast<int64_t>(t.data.size()) != need)
        bad(strformat("tensor '%s' embeds %zu bytes of data, its shape %s needs %lld",
                      t.name.c_str(), t.data.size(), dims_string(t.dims).c_str(),
                      static_cast<long long>(need)));
    }
    if (t.role == Role::Const && t.init.kind != InitKind::Data)
      bad(strformat("constant '%s' has no embedded data", t.name.c_str()));
    if (t.init.kind == InitKind::Normal && !(t.init.std >= 0))
      bad(strformat("parameter '%s' has a negative init std", t.name.c_str()));
  }

  // Nodes: known ops, arity, single producer.
  std::vector<int> producer(nt, -1);
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    const Node &n = g.nodes[ni];
    const OpDef *def = find_op(n.op);
    if (!def || def->internal)
      bad(strformat("node '%s': unknown op '%s'", n.name.c_str(), n.op.c_str()));
    int nin = static_cast<int>(n.inputs.size());
    if (nin < def->min_inputs || nin > def->max_inputs)
      bad(strformat("node '%s' (%s): has %d inputs, expected %d..%d", n.name.c_str(),
                    n.op.c_str(), nin, def->min_inputs, def->max_inputs));
    if (static_cast<int>(n.outputs.size()) != def->num_outputs)
      bad(strformat("node '%s' (%s): has %zu outputs, expected %d", n.name.c_str(), n.op.c_str(),
                    n.outputs.size(), def->num_outputs));
    for (int o : n.outputs) {
      const Tensor &t = g.tensors[o];
      if (t.role != Role::Activation)
        bad(strformat("node '%s' (%s) writes %s, which is a %s and cannot be computed",
                      n.name.c_str(), n.op.c_str(), g.describe_tensor(o).c_str(),
                      t.role == Role::Param ? "parameter" : t.role == Role::Input ? "input" : "constant"));
      if (producer[o] >= 0)
        bad(strformat("tensor %s is written by two nodes: '%s' and '%s'",
                      g.describe_tensor(o).c_str(), g.nodes[producer[o]].name.c_str(),
                      n.name.c_str()));
      producer[o] = static_cast<int>(ni);
    }
  }
  for (int i = 0; i < nt; ++i)
    if (g.tensors[i].role == Role::Activation && producer[i] < 0) {
      bool used = false;
      for (const Node &n : g.nodes)
        for (int in : n.inputs) used |= in == i;
      if (used || i == g.loss)
        bad(strformat("tensor %s is an activation that no node computes",
                      g.describe_tensor(i).c_str()));
    }
  if (g.tensors[g.loss].role != Role::Activation || producer[g.loss] < 0)
    bad(strformat("loss tensor %s is not computed by any node", g.describe_tensor(g.loss).c_str()));

  // Topological sort (Kahn); whatever is left over sits on a cycle.
  const size_t nn = g.nodes.size();
  std::vector<int> indeg(nn, 0);
  std::vector<std::vector<int>> users(nn);
  for (size_t ni = 0; ni < nn; ++ni)
    for (int in : g.nodes[ni].inputs)
      if (producer[in] >= 0) {
        ++indeg[ni];
        users[producer[in]].push_back(static_cast<int>(ni));
      }
  std::queue<int> ready;
  for (size_t ni = 0; ni < nn; ++ni)
    if (indeg[ni] == 0) ready.push(static_cast<int>(ni));
  std::vector<int> order;
  while (!ready.empty()) {
    int ni = ready.front();
    ready.pop();
    order.push_back(ni);
    for (int u : users[ni])
      if (--indeg[u] == 0) ready.push(u);
  }
  if (order.size() != nn) {
    std::string list;
    for (size_t ni = 0; ni < nn && list.size() < 200; ++ni)
      if (indeg[ni] > 0) list += (list.empty() ? "'" : ", '") + g.nodes[ni].name + "'";
    bad("graph has a cycle through nodes " + list);
  }
  std::vector<Node> sorted;
  sorted.reserve(nn);
  for (int ni : order) sorted.push_back(std::move(g.nodes[ni]));
  g.nodes = std::move(sorted);
}

}  // namespace ctr
