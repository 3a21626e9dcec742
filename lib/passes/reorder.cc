// Pass reorder: move collectives so that communication runs under compute.
//
// The shard pass puts each all-gather right before the first node that reads
// the parameter and each reduce-scatter right after the node that completes the
// gradient: correct, but the compute stream then waits for every gather. This
// pass works on segments — maximal runs of compute nodes of one block (a
// transformer layer; -1 for the embedding and the head) in the phase's order:
//
// - An all-gather is issued at the start of the segment `prefetch` segments
//   before the one that first reads it, so block i+1's parameters travel while
//   block i computes (forward and backward alike). prefetch 0 keeps the shard
//   pass's placement.
// - With defer_reduce, a gradient's reduce-scatter (and the all-reduce that
//   follows it) moves to the end of the next segment, so the comm stream carries
//   the next gathers first, which compute is waiting for.
// - memory_budget (bytes, 0 = none) bounds the planned activation arena: the
//   pass plans the schedule it would make (lower and plan_memory on the
//   reordered nodes) and, while the plan is over the budget, tries shallower
//   prefetch, then no deferral, down to the shard pass's placement.
//
// Collectives whose result compute reads at once (expert exchanges, summed
// statistics) stay right behind the node they read.
//
// Collectives keep their relative order within each kind of move, every node
// still follows what it reads, and no arithmetic changes: losses are bitwise
// the same for every setting.

#include <algorithm>
#include <map>

#include "core/options.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

void reorder_phase(Graph &g, int begin, int end, int64_t prefetch, bool defer, std::vector<Node> &out) {
  const PhaseSegments segs = segment_phase(g, begin, end);
  const std::vector<int> &compute = segs.compute, &seg_of_node = segs.seg_of, &seg_start = segs.start;
  const std::map<int, int> &first_reader = segs.first_reader, &producer = segs.producer;
  const int nseg = segs.count();
  if (nseg == 0) {
    for (int ni = begin; ni < end; ++ni) out.push_back(std::move(g.nodes[ni]));
    return;
  }

  std::vector<std::vector<int>> gathers_now(nseg);  // for segment s, issued at its start
  std::vector<std::vector<int>> gathers_at(nseg);   // for a later segment, issued at the start of s
  std::vector<std::vector<int>> reduces_after(nseg);  // issued at the end of segment s
  std::map<int, std::vector<int>> after_node;      // collectives kept right after a compute node
  std::map<int, std::vector<int>> before_node;     // collectives kept right before a compute node
  // A reduction chain: a collective reading another collective's output stays
  // right behind it.
  std::map<int, int> chain_head;  // collective node -> the node it follows
  std::map<int, std::vector<int>> chained;
  std::map<int, int> coll_of_output;

  for (int ni = begin; ni < end; ++ni) {
    const Node &n = g.nodes[ni];
    if (!is_collective(n.op)) continue;
    // Collectives that compute of this phase reads at once (an expert exchange,
    // summed load-balancing statistics) stay right behind what they read.
    if (is_exchange(n.op) || n.has_attr("reduce")) {
      int prod = -1;
      for (int in : n.inputs)
        if (auto p = producer.find(in); p != producer.end()) prod = std::max(prod, p->second);
      CTR_CHECK(prod >= 0);
      after_node[prod].push_back(ni);
      continue;
    }
    // A collective reading another's output (an all-reduce behind a
    // reduce-scatter) stays right behind it.
    int head = -1;
    for (int in : n.inputs)
      if (coll_of_output.count(in)) head = coll_of_output[in];
    if (head >= 0) {
      while (chain_head.count(head)) head = chain_head[head];
      chain_head[ni] = head;
      chained[head].push_back(ni);
      for (int o : n.outputs) coll_of_output[o] = ni;
      continue;
    }
    for (int o : n.outputs) coll_of_output[o] = ni;
    if (n.op == "all_gather") {
      // The first compute node reading any of its outputs.
      int reader = -1;
      for (int o : n.outputs) {
        auto r = first_reader.find(o);
        if (r != first_reader.end() && (reader < 0 || r->second < reader)) reader = r->second;
      }
      if (reader < 0) {  // read only in a later phase: leave it in place
        int next = -1;
        for (int k = ni + 1; k < end && next < 0; ++k)
          if (!is_collective(g.nodes[k].op)) next = k;
        if (next >= 0) before_node[next].push_back(ni);
        else reduces_after[nseg - 1].push_back(ni);
        continue;
      }
      const int use = seg_of_node[reader];
      const int target = std::max(0, use - static_cast<int>(prefetch));
      if (prefetch == 0) {
        // In place: right before its first reader (as the shard pass had it).
        before_node[reader].push_back(ni);
      } else if (target == use) {
        // Needed in this segment: ahead of the prefetches for later ones.
        gathers_now[static_cast<size_t>(use)].push_back(ni);
      } else {
        gathers_at[static_cast<size_t>(target)].push_back(ni);
      }
    } else {
      // After the last compute node producing any of its inputs.
      int prod = -1;
      for (int in : n.inputs) {
        auto p = producer.find(in);
        CTR_CHECK(p != producer.end());
        prod = std::max(prod, p->second);
      }
      const int seg = seg_of_node[prod];
      if (defer && seg + 1 < nseg) {
        reduces_after[static_cast<size_t>(seg + 1)].push_back(ni);
      } else {
        after_node[prod].push_back(ni);
      }
    }
  }

  auto emit = [&](int ni) {
    out.push_back(std::move(g.nodes[ni]));
    for (int c : chained[ni]) out.push_back(std::move(g.nodes[c]));
  };
  for (int s = 0; s < nseg; ++s) {
    for (int ni : gathers_now[static_cast<size_t>(s)]) emit(ni);
    for (int ni : gathers_at[static_cast<size_t>(s)]) emit(ni);
    const int last = s + 1 < nseg ? seg_start[static_cast<size_t>(s + 1)] : static_cast<int>(compute.size());
    for (int k = seg_start[static_cast<size_t>(s)]; k < last; ++k) {
      const int ni = compute[static_cast<size_t>(k)];
      for (int c : before_node[ni]) emit(c);
      out.push_back(std::move(g.nodes[ni]));
      for (int c : after_node[ni]) emit(c);
    }
    for (int ni : reduces_after[static_cast<size_t>(s)]) emit(ni);
  }
}


// The nodes of g in the order the schedule (prefetch, defer) gives them.
std::vector<Node> reordered(Graph &g, int64_t prefetch, bool defer) {
  std::vector<Node> saved = g.nodes, nodes;
  nodes.reserve(g.nodes.size());
  reorder_phase(g, 0, g.num_forward, prefetch, defer, nodes);
  const int nf = static_cast<int>(nodes.size());
  reorder_phase(g, g.num_forward, static_cast<int>(g.nodes.size()), prefetch, defer, nodes);
  CTR_CHECK(nodes.size() == saved.size() && nf == g.num_forward);
  g.nodes = std::move(saved);
  return nodes;
}

}  // namespace

std::string pass_reorder(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward >= 0);
  bool any = false;
  for (const Node &n : g.nodes) any |= is_collective(n.op);
  if (!any) return "reorder: no collectives";
  const std::vector<Node> original = g.nodes;
  int64_t prefetch = opt.prefetch;
  bool defer = opt.defer_reduce;
  int64_t arena = -1;
  for (;;) {
    g.nodes = reordered(g, prefetch, defer);
    if (opt.memory_budget <= 0) break;
    // Plan this schedule; the real lower and plan_memory run again afterwards.
    Program p = pass_lower(g, [](OpId) { return true; }, opt.overlap);
    arena = pass_plan_memory(g, opt, p).arena_bytes;
    if (arena <= opt.memory_budget || (prefetch == 0 && !defer)) break;
    g.nodes = original;
    if (prefetch > 0) {
      --prefetch;
    } else {
      defer = false;
    }
  }
  std::string summary = strformat("reorder: prefetch %lld blocks ahead, reduce-scatters %s",
                                  static_cast<long long>(prefetch), defer ? "deferred" : "in place");
  if (opt.memory_budget > 0)
    summary += strformat("; planned arena %lld bytes, budget %lld%s", static_cast<long long>(arena),
                         static_cast<long long>(opt.memory_budget),
                         arena > opt.memory_budget ? " (over: no schedule fits)" : "");
  return summary;
}

void read_reorder_options(OptionReader &r, CompileOptions &o) {
  o.prefetch = r.get_int("prefetch", 1, 0, 64);
  o.defer_reduce = r.get_int("defer_reduce", 1, 0, 1) != 0;
  o.memory_budget = r.get_int("memory_budget", 0, 0);
}

}  // namespace ctr
