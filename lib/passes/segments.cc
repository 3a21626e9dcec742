// Segments of a phase (see passes.h): runs of compute nodes of one block, and
// which compute node first reads and last writes each tensor.

#include "passes/passes.h"

namespace ctr {

PhaseSegments segment_phase(const Graph &g, int begin, int end) {
  PhaseSegments s;
  s.seg_of.assign(g.nodes.size(), -1);
  for (int ni = begin; ni < end; ++ni) {
    const Node &n = g.nodes[static_cast<size_t>(ni)];
    if (is_collective(n)) continue;
    if (s.compute.empty() || n.block != g.nodes[static_cast<size_t>(s.compute.back())].block)
      s.start.push_back(static_cast<int>(s.compute.size()));
    s.seg_of[static_cast<size_t>(ni)] = s.count() - 1;
    s.compute.push_back(ni);
    for (int t : n.inputs) s.first_reader.emplace(t, ni);
    for (int t : n.outputs) s.producer[t] = ni;
  }
  return s;
}

}  // namespace ctr
