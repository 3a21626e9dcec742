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
//   follows it) moves to the end of the next segment when that segment issues
//   gathers, so the comm stream carries those first, which compute is
//   waiting for; past the last gathers it is issued as soon as its gradient is.
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
#include <functional>
#include <map>
#include <set>

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
  std::vector<int> gathers_in(nseg);                  // gathers issued within segment s
  std::map<int, std::vector<int>> after_node;      // collectives kept right after a compute node
  std::map<int, std::vector<int>> before_node;     // collectives kept right before a compute node
  // A reduction chain: a collective reading other collectives' outputs (an
  // all-reduce behind reduce-scatters; merged by bucket, behind several) is
  // issued right behind the last of them to be issued, and behind the compute
  // node producing any other input it has.
  std::map<int, std::vector<int>> dependents;  // node -> chained collectives reading it
  std::map<int, int> missing;                  // chained collective -> its nodes not yet out
  std::map<int, int> coll_of_output;
  std::vector<std::pair<int, int>> reductions;  // (reduce-scatter or all-reduce, its producer)

  // Every collective's outputs first: a merged reduction may come before a
  // collective it reads (bucket places each at its latest member).
  for (int ni = begin; ni < end; ++ni)
    if (is_collective(g.nodes[ni]))
      for (int o : g.nodes[ni].outputs) coll_of_output[o] = ni;
  for (int ni = begin; ni < end; ++ni) {
    const Node &n = g.nodes[ni];
    if (!is_collective(n)) continue;
    // Collectives that compute of this phase reads at once (an expert exchange,
    // summed load-balancing statistics) stay right behind what they read.
    if (is_immediate(n)) {
      int prod = -1;
      std::set<int> colls;  // collectives it reads: issued right behind the last of them
      for (int in : n.inputs) {
        if (auto c = coll_of_output.find(in); c != coll_of_output.end())
          colls.insert(c->second);
        else if (auto p = producer.find(in); p != producer.end())
          prod = std::max(prod, p->second);
      }
      if (colls.empty() && prod < 0) {
        // What it reads comes from an earlier phase (sequence parallelism's
        // gather again in backward): issued at the start of its first
        // reader's segment, under that segment's compute.
        int reader = -1;
        for (int o : n.outputs)
          if (auto r = first_reader.find(o); r != first_reader.end() && (reader < 0 || r->second < reader))
            reader = r->second;
        CTR_CHECK(reader >= 0);
        gathers_now[static_cast<size_t>(seg_of_node[reader])].push_back(ni);
      } else if (colls.empty()) {
        after_node[prod].push_back(ni);
      } else {
        if (prod >= 0) colls.insert(prod);
        missing[ni] = static_cast<int>(colls.size());
        for (int d : colls) dependents[d].push_back(ni);
      }
      continue;
    }
    std::set<int> deps;
    bool reads_collective = false;
    for (int in : n.inputs) {
      if (auto c = coll_of_output.find(in); c != coll_of_output.end()) {
        deps.insert(c->second);
        reads_collective = true;
      } else if (auto p = producer.find(in); p != producer.end()) {
        deps.insert(p->second);
      }
    }
    if (reads_collective) {
      missing[ni] = static_cast<int>(deps.size());
      for (int d : deps) dependents[d].push_back(ni);
      continue;
    }
    if (collective_kind(n) == CollKind::AllGather) {
      // The first compute node reading any of its outputs.
      int reader = -1;
      for (int o : n.outputs) {
        auto r = first_reader.find(o);
        if (r != first_reader.end() && (reader < 0 || r->second < reader)) reader = r->second;
      }
      if (reader < 0) {  // read only in a later phase: leave it in place
        int next = -1;
        for (int k = ni + 1; k < end && next < 0; ++k)
          if (!is_collective(g.nodes[k])) next = k;
        if (next >= 0) before_node[next].push_back(ni);
        else reduces_after[nseg - 1].push_back(ni);
        continue;
      }
      const int use = seg_of_node[reader];
      const int target = std::max(0, use - static_cast<int>(prefetch));
      ++gathers_in[static_cast<size_t>(prefetch == 0 ? use : target)];
      // A gather of something this phase computes (the bf16 copy of a shard,
      // cast at the phase's start) is issued no earlier than right behind it.
      int prod = -1;
      for (int in : n.inputs)
        if (auto p = producer.find(in); p != producer.end()) prod = std::max(prod, p->second);
      if (prod >= 0 && seg_of_node[prod] >= (prefetch == 0 ? use : target)) {
        after_node[prod].push_back(ni);
      } else if (prefetch == 0) {
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
      reductions.emplace_back(ni, prod);
    }
  }
  // A reduction moves behind the next segment only where that segment issues
  // gathers for the comm stream to carry first; past the last gathers
  // (the end of backward) it is issued at once.
  for (auto [ni, prod] : reductions) {
    const int seg = seg_of_node[prod];
    const bool gathers_next = seg + 1 < nseg && gathers_in[static_cast<size_t>(seg + 1)] > 0;
    if (defer && gathers_next) {
      reduces_after[static_cast<size_t>(seg + 1)].push_back(ni);
    } else if (!reduces_after[static_cast<size_t>(seg)].empty()) {
      // Behind the earlier gradients deferred to this segment's end.
      reduces_after[static_cast<size_t>(seg)].push_back(ni);
    } else {
      after_node[prod].push_back(ni);
    }
  }

  // Puts node ni out, then every chained collective it was the last one missing for.
  std::function<void(int)> put = [&](int ni) {
    out.push_back(std::move(g.nodes[ni]));
    for (int c : dependents[ni])
      if (--missing[c] == 0) put(c);
  };
  for (int s = 0; s < nseg; ++s) {
    for (int ni : gathers_now[static_cast<size_t>(s)]) put(ni);
    for (int ni : gathers_at[static_cast<size_t>(s)]) put(ni);
    const int last = s + 1 < nseg ? seg_start[static_cast<size_t>(s + 1)] : static_cast<int>(compute.size());
    for (int k = seg_start[static_cast<size_t>(s)]; k < last; ++k) {
      const int ni = compute[static_cast<size_t>(k)];
      for (int c : before_node[ni]) put(c);
      put(ni);
      for (int c : after_node[ni]) put(c);
    }
    for (int ni : reduces_after[static_cast<size_t>(s)]) put(ni);
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
  for (const Node &n : g.nodes) any |= is_collective(n);
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
