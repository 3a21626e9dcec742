// Pass 9, lower: the planned graph becomes instruction lists, one per phase
// (forward, backward), each instruction naming its node, stream and events.
//
// On the CPU backend everything runs on stream 0 in node order and no events are
// needed. The shape of Instr is what the comm stream and a CUDA graph capture
// will use: the reorder pass moves collectives to stream 1 and the events between
// streams are placed here.

#include <algorithm>
#include <sstream>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {

Program pass_lower(const Graph &g, const std::vector<std::string> &backend_ops) {
  Program p;
  CTR_CHECK(g.num_forward >= 0);
  for (int ni = 0; ni < static_cast<int>(g.nodes.size()); ++ni) {
    const Node &n = g.nodes[ni];
    Instr in;
    in.node = ni;
    if (is_collective(n.op)) {
      // Collectives run on the comm stream; the executor hands them to the
      // communicator of their mesh axis.
      in.stream = 1;
      p.num_streams = 2;
      (ni < g.num_forward ? p.forward : p.backward).push_back(in);
      continue;
    }
    if (std::find(backend_ops.begin(), backend_ops.end(), n.op) == backend_ops.end())
      fail(CTR_STATUS_UNSUPPORTED,
           strformat("node '%s': the backend has no kernel for op '%s'", n.name.c_str(),
                     n.op.c_str()));
    (ni < g.num_forward ? p.forward : p.backward).push_back(in);
  }
  return p;
}

std::string dump_program(const Graph &g, const Program &p) {
  std::ostringstream os;
  auto list = [&](const char *name, const std::vector<Instr> &v) {
    os << name << ": " << v.size() << " instructions\n";
    for (size_t i = 0; i < v.size(); ++i) {
      const Node &n = g.nodes[v[i].node];
      os << "  " << i << ": stream " << v[i].stream << " " << n.op << " " << n.name;
      for (int e : v[i].wait_events) os << " wait e" << e;
      for (int e : v[i].record_events) os << " record e" << e;
      os << "\n";
    }
  };
  list("forward", p.forward);
  list("backward", p.backward);
  return os.str();
}

}  // namespace ctr
