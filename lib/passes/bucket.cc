// Pass bucket: merge collectives so that a block's parameters travel in one
// round instead of one collective each.
//
// The shard pass makes one all-gather per parameter and one reduce-scatter
// (and all-reduce) per gradient. Each costs a round of ring steps and, on the
// serial comm stream, waits for the one before it. This pass merges, within a
// phase, the all-gathers whose first reader lies in the same segment (a run of
// compute nodes of one block), and separately the reduce-scatters (and the
// all-reduces) whose gradients are produced in the same segment, into one
// node with many inputs and outputs. The communicator runs such a node as one
// batch (CommIface::batch): every parameter is gathered straight into its own
// full tensor and every gradient reduced straight into its own shard, so no
// flat staging buffer and no copy is needed.
//
// Modes (option "bucket"): "block" (default) as above; "bytes" merges
// consecutive collectives of one kind regardless of blocks up to
// "bucket_bytes" per bucket; "none" leaves one collective per tensor. A merged
// all-gather takes the place of the earliest of its members, a merged
// reduction the place of the latest, so every node still follows what it reads.
// The arithmetic is unchanged: each tensor's collective is the same ring.

#include <algorithm>
#include <functional>
#include <tuple>
#include <map>
#include <set>

#include "core/options.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

void bucket_phase(Graph &g, int begin, int end, bool backward, const CompileOptions &opt, std::vector<Node> &out) {
  const PhaseSegments segs = segment_phase(g, begin, end);
  const std::vector<int> &seg_of = segs.seg_of;
  const std::map<int, int> &first_reader = segs.first_reader, &producer = segs.producer;
  std::map<int, int> coll_of_output;  // tensor -> collective writing it
  for (int ni = begin; ni < end; ++ni)
    if (is_collective(g.nodes[ni]))
      for (int t : g.nodes[ni].outputs) coll_of_output[t] = ni;

  // The key of each collective: (op, axis, segment); -1 segment = not bucketed.
  std::map<int, int> seg_key;
  std::function<int(int)> seg_of_coll = [&](int ni) -> int {
    if (seg_key.count(ni)) return seg_key[ni];
    const Node &n = g.nodes[ni];
    int s = -1;
    if (collective_kind(n) == CollKind::AllGather) {
      auto r = first_reader.find(n.outputs[0]);
      if (r != first_reader.end()) s = seg_of[r->second];
    } else {
      const int in = n.inputs[0];
      if (coll_of_output.count(in)) {
        s = seg_of_coll(coll_of_output[in]);  // behind a reduce-scatter: its segment
      } else if (producer.count(in)) {
        s = seg_of[producer.at(in)];
      }
    }
    return seg_key[ni] = s;
  };

  // Groups, in node order of their first member.
  std::vector<std::vector<int>> groups;
  std::map<std::tuple<std::string, std::string, int>, size_t> open;  // key -> group (block mode)
  std::map<std::pair<std::string, std::string>, size_t> running;      // (op, axis) -> group (bytes mode)
  std::map<size_t, int64_t> group_bytes;
  for (int ni = begin; ni < end; ++ni) {
    const Node &n = g.nodes[ni];
    if (!is_collective(n) || n.inputs.size() != 1 || is_immediate(n)) continue;
    const std::string axis = n.attr_string("axis", "");
    const int64_t bytes = g.tensors[static_cast<size_t>(n.outputs[0])].alloc_size();
    size_t gi;
    if (opt.bucket == "bytes") {
      auto key = std::make_pair(n.op, axis);
      auto it = running.find(key);
      if (it != running.end() && (opt.bucket_bytes <= 0 || group_bytes[it->second] + bytes <= opt.bucket_bytes)) {
        gi = it->second;
      } else {
        gi = groups.size();
        groups.emplace_back();
        running[key] = gi;
      }
    } else {
      const int s = seg_of_coll(ni);
      if (s < 0) continue;
      auto key = std::make_tuple(n.op, axis, s);
      auto it = open.find(key);
      if (it != open.end()) {
        gi = it->second;
      } else {
        gi = groups.size();
        groups.emplace_back();
        open[key] = gi;
      }
    }
    groups[gi].push_back(ni);
    group_bytes[gi] += bytes;
  }

  // The edges of a phase that nothing can hide: forward waits for the first
  // block's gathers before it computes anything of weight, and backward ends
  // waiting for the last block's reduce-scatters. In block mode each of these
  // two buckets is cut in two near half its bytes, in node order (order of
  // first use, of gradients), so that one part travels while the block
  // computes with the other.
  if (opt.bucket == "block") {
    const CollKind edge = backward ? CollKind::ReduceScatter : CollKind::AllGather;
    int target = -1;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const int s = seg_of_coll(groups[gi].front());
      if (collective_kind(g.nodes[groups[gi].front()]) != edge || s < 0 || segs.block(g, s) < 0) continue;
      if (backward || target < 0) target = static_cast<int>(gi);  // the last, or the first
    }
    if (target >= 0 && groups[static_cast<size_t>(target)].size() >= 2) {
      std::vector<int> &members = groups[static_cast<size_t>(target)];
      const int64_t total = group_bytes[static_cast<size_t>(target)];
      int64_t run = 0;
      // Forward: the largest first part within half the bytes (what compute waits
      // for first is small); backward: the smallest first part of at least half
      // (what is left to wait for at the end is small).
      auto bytes_of = [&](size_t k) {
        return g.tensors[static_cast<size_t>(g.nodes[members[k]].outputs[0])].alloc_size();
      };
      size_t cut = 1;
      run = bytes_of(0);
      while (cut + 1 < members.size() && (backward ? 2 * run < total : 2 * (run + bytes_of(cut)) <= total))
        run += bytes_of(cut++);
      groups.emplace_back(members.begin() + static_cast<long>(cut), members.end());
      groups[static_cast<size_t>(target)].resize(cut);
    }
  }

  // Merged nodes: a gather goes before its earliest member; a reduction after
  // its latest member and after every collective it reads (an all-reduce merged
  // over several reduce-scatters may read one merged later than itself), and,
  // at one position, behind the merged reductions it reads.
  struct Merged {
    Node node;
    int at = 0;     // comes out right after the node at this position
    int depth = 0;  // merged reductions it reads at the same position, in a chain
  };
  std::vector<Merged> reductions;
  std::map<int, size_t> reduction_of;  // member -> its merged reduction
  std::map<int, Node> merged_before;
  std::set<int> dropped;
  for (const std::vector<int> &members : groups) {
    const Node &first = g.nodes[members.front()];
    if (members.size() < 2) {
      // A lone reduction behind a merged one moves with it.
      if (collective_kind(first) == CollKind::AllGather || !coll_of_output.count(first.inputs[0])) continue;
      reduction_of[members.front()] = reductions.size();
      reductions.push_back({first, members.front(), 0});
      dropped.insert(members.front());
      continue;
    }
    Node m;
    m.op = first.op;
    m.name = strformat("bucket.%s.%s", first.op.c_str(), first.name.c_str());
    m.attrs = {{"axis", Attr::of_string(first.attr_string("axis", ""))},
               {"tensors", Attr::of_int(static_cast<int64_t>(members.size()))}};
    m.block = first.block;
    m.backward = first.backward;
    for (int ni : members) {
      m.inputs.push_back(g.nodes[ni].inputs[0]);
      m.outputs.push_back(g.nodes[ni].outputs[0]);
      dropped.insert(ni);
    }
    if (collective_kind(first) == CollKind::AllGather) {
      merged_before[members.front()] = std::move(m);
      continue;
    }
    for (int ni : members) reduction_of[ni] = reductions.size();
    reductions.push_back({std::move(m), members.back(), 0});
  }
  // Positions settle in at most one round per merged reduction (chains are short).
  for (size_t round = 0; round <= reductions.size(); ++round) {
    bool moved = false;
    for (Merged &r : reductions) {
      int at = r.at, depth = 0;
      std::vector<std::pair<int, int>> reads;  // (position, depth + 1 or 0) of what it reads
      for (int in : r.node.inputs) {
        auto c = coll_of_output.find(in);
        if (c == coll_of_output.end()) continue;
        auto h = reduction_of.find(c->second);
        if (h == reduction_of.end()) {
          reads.emplace_back(c->second, 0);
        } else {
          reads.emplace_back(reductions[h->second].at, reductions[h->second].depth + 1);
        }
      }
      for (auto [p, d] : reads) at = std::max(at, p);
      for (auto [p, d] : reads)
        if (p == at) depth = std::max(depth, d);
      moved |= at != r.at || depth != r.depth;
      r.at = at;
      r.depth = depth;
    }
    if (!moved) break;
  }
  std::map<int, std::vector<Merged *>> after;
  for (Merged &r : reductions) after[r.at].push_back(&r);
  for (auto &[at, list] : after)
    std::stable_sort(list.begin(), list.end(), [](const Merged *a, const Merged *b) { return a->depth < b->depth; });
  for (int ni = begin; ni < end; ++ni) {
    if (auto it = merged_before.find(ni); it != merged_before.end()) out.push_back(std::move(it->second));
    if (!dropped.count(ni)) out.push_back(std::move(g.nodes[ni]));
    if (auto it = after.find(ni); it != after.end())
      for (Merged *r : it->second) out.push_back(std::move(r->node));
  }
}

}  // namespace

void pass_bucket(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward >= 0);
  if (opt.bucket == "none") return;
  std::vector<Node> nodes;
  bucket_phase(g, 0, g.num_forward, false, opt, nodes);
  const int nf = static_cast<int>(nodes.size());
  bucket_phase(g, g.num_forward, static_cast<int>(g.nodes.size()), true, opt, nodes);
  g.nodes = std::move(nodes);
  g.num_forward = nf;
}

void read_bucket_options(OptionReader &r, CompileOptions &o) {
  o.bucket = r.get_string("bucket", "block", {"block", "bytes", "none"});
  o.bucket_bytes = r.get_int("bucket_bytes", 0, 0);
  CTR_REQUIRE(o.bucket == "bytes" || o.bucket_bytes == 0, CTR_STATUS_INVALID_OPTION,
              "option 'bucket_bytes' applies only with bucket = \"bytes\"");
}

}  // namespace ctr
