// Pass shard: FSDP / HSDP placement of the parameters (see passes.h), and the
// gradient reductions of expert weights placed by the expert pass.
//
// The pass runs after autodiff, on the whole training graph, so it sees every
// use of a parameter — forward and backward — and can decide where each full
// copy is rebuilt and how long it lives. Padding makes every shard the same
// size (all_gather and reduce_scatter then move equal blocks): the gathered
// tensor and the full gradient reserve fsdp * rows rows, and consumers read only
// the first rows of the whole of them. Pad rows of a shard start at zero and their
// gradients are zero, so AdamW keeps them at zero.

#include <algorithm>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {


void pass_shard(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward >= 0);
  bool has_experts = false, has_tp = false, has_cp = false;
  for (const Tensor &t : g.tensors) {
    has_experts |= t.placement.on("ep") != nullptr;
    has_tp |= t.placement.on("tp") != nullptr;
  }
  // Context parallelism places no parameter: its sequence split is the place
  // pass's collectives over cp.
  for (const Node &n : g.nodes) has_cp |= is_collective(n) && n.attr_string("axis", "") == "cp";
  for (const MeshPlacement::Axis &a : opt.mesh.axes)
    CTR_REQUIRE(a.size == 1 || a.name == "fsdp" || a.name == "dp" || a.name == "pp" || (a.name == "ep" && has_experts) ||
                    (a.name == "tp" && has_tp) || (a.name == "cp" && has_cp),
                CTR_STATUS_UNSUPPORTED,
                "shard: mesh axis '%s' has size %lld, but graph '%s' has nothing to place on it (%s); "
                "use dp and fsdp",
                a.name.c_str(), static_cast<long long>(a.size), g.name.c_str(),
                a.name == "ep"   ? "no expert layers"
                                 : "no tensor-parallel layout");
  const int64_t fsdp = opt.mesh.size("fsdp"), dp = opt.mesh.size("dp"), ep = opt.mesh.size("ep");
  const int64_t cp = opt.mesh.size("cp");
  if (fsdp <= 1 && dp <= 1 && ep <= 1 && cp <= 1) return;
  const int F = static_cast<int>(fsdp);

  // New node order: collectives are inserted in front of the node that first
  // needs them (gathers) or right after the node that completes a gradient.
  // Casts of shards (below) open their phase: `prologue[0]` the forward's,
  // `prologue[1]` the backward's; `dropped` marks the casts they replace.
  std::vector<std::vector<Node>> before(g.nodes.size()), after(g.nodes.size());
  std::vector<Node> prologue[2];
  std::vector<char> dropped(g.nodes.size(), 0);
  const int nf = g.num_forward;
  const int ntensors = static_cast<int>(g.tensors.size());

  // Which forward copies backward reuses (reshard_after_forward 1): those of the
  // parameters whose last forward reader is in the last block or after it (the
  // head) and whose first backward reader is in the head's backward or the last
  // block's. Backward reads them first, so a fresh gather there would be waited
  // for in full with no compute to hide under; kept, they stay alive only over
  // the head's nodes and are freed after their last backward reader as before.
  const PhaseSegments fwd_segs = segment_phase(g, 0, nf);
  const PhaseSegments bwd_segs = segment_phase(g, nf, static_cast<int>(g.nodes.size()));
  int last_block = -1;
  for (int s = 0; s < fwd_segs.count(); ++s) last_block = std::max(last_block, fwd_segs.block(g, s));
  // The last block's (last) forward segment and its first backward segment;
  // with no blocks, the whole of each phase.
  int keep_from = 0, keep_until = std::max(0, bwd_segs.count() - 1);
  if (last_block >= 0) {
    for (int s = 0; s < fwd_segs.count(); ++s)
      if (fwd_segs.block(g, s) == last_block) keep_from = s;
    keep_until = 0;
    for (int s = bwd_segs.count() - 1; s >= 0; --s)
      if (bwd_segs.block(g, s) == last_block) keep_until = s;
  }

  // Each parameter's gradient, its readers (node, input slot) in node order,
  // and each tensor's producer, found once (the loop below adds nodes only
  // beside the existing ones and tensors only past ntensors).
  std::vector<int> grad_for(static_cast<size_t>(ntensors), -1), producer_of(static_cast<size_t>(ntensors), -1);
  std::vector<std::vector<std::pair<int, int>>> readers(static_cast<size_t>(ntensors));
  for (int t = 0; t < ntensors; ++t)
    if (g.tensors[t].grad_of >= 0 && g.tensors[t].grad_of < ntensors) grad_for[static_cast<size_t>(g.tensors[t].grad_of)] = t;
  for (int ni = 0; ni < static_cast<int>(g.nodes.size()); ++ni) {
    const Node &n = g.nodes[ni];
    for (size_t k = 0; k < n.inputs.size(); ++k)
      if (n.inputs[k] >= 0 && n.inputs[k] < ntensors && g.tensors[n.inputs[k]].role == Role::Param)
        readers[static_cast<size_t>(n.inputs[k])].emplace_back(ni, static_cast<int>(k));
    for (int o : n.outputs)
      if (o >= 0 && o < ntensors) producer_of[static_cast<size_t>(o)] = ni;
  }

  for (int p = 0; p < ntensors; ++p) {
    if (g.tensors[p].role != Role::Param) continue;
    const std::vector<int64_t> full_shape = g.tensors[p].shape;
    const std::string name = g.tensors[p].name;
    int64_t row_elems = 1;
    for (size_t d = 1; d < full_shape.size(); ++d) row_elems *= full_shape[d];
    const int64_t N0 = full_shape.empty() ? 1 : full_shape[0];
    const int64_t rows = (N0 + F - 1) / F;
    const int64_t padded_bytes = rows * F * row_elems * 4;

    const int grad = grad_for[static_cast<size_t>(p)];

    // Expert weights were split over ep by the expert pass (Shard(0) on ep).
    // Within the ep group's fsdp ranks they are sharded further when fsdp
    // divides their rows evenly (fsdp nests inside ep: the fsdp shards of one
    // ep block are consecutive rows of the whole tensor); otherwise each fsdp
    // rank keeps its ep block whole.
    const bool expert = g.tensors[p].placement.on("ep") != nullptr;
    const bool shard_expert = expert && F > 1 && N0 % F == 0;
    if (F > 1 && (!expert || shard_expert)) {
      // The param itself becomes this rank's shard.
      Tensor &pt = g.tensors[p];
      if (pt.shape.empty()) pt.shape = {1};
      pt.placement.add_shard("fsdp", 0, pt.shape);
      pt.shape[0] = rows;

      // Full copies: one for forward uses, one for backward uses (or one for both).
      auto make_full = [&](const char *suffix) {
        Tensor t;
        t.name = name + suffix;
        t.dtype = CTR_DTYPE_F32;
        t.shape = full_shape;
        t.has_shape = true;
        t.alloc_bytes = padded_bytes;
        return g.add_tensor(std::move(t));
      };
      int first_fwd = -1, first_bwd = -1, last_fwd = -1;
      for (const auto &[ni, slot] : readers[static_cast<size_t>(p)]) {
        if (ni < nf && first_fwd < 0) first_fwd = ni;
        if (ni < nf) last_fwd = ni;
        if (ni >= nf && first_bwd < 0) first_bwd = ni;
      }
      bool reshard = opt.reshard_after_forward == 2;
      if (opt.reshard_after_forward == 1 && last_fwd >= 0 && first_bwd >= 0)
        reshard = fwd_segs.seg_of[static_cast<size_t>(last_fwd)] < keep_from ||
                  bwd_segs.seg_of[static_cast<size_t>(first_bwd)] > keep_until;
      // Under precision bf16 a phase whose only reader is the bf16 copy (the
      // precision pass's cast) gathers the copy instead: this rank's shard is
      // cast at the phase's start and the gather moves bf16, half the bytes,
      // straight into the whole copy (no whole f32 weight). Not where the
      // backward reuses the forward's gathered weight, nor for expert weights.
      auto only_cast = [&](bool fwd) -> int {
        int cast = -1, n = 0;
        for (const auto &[ni, slot] : readers[static_cast<size_t>(p)]) {
          if ((ni < nf) != fwd) continue;
          ++n;
          const Node &r = g.nodes[ni];
          if (r.op == "cast" && r.outputs.size() == 1 &&
              g.tensors[static_cast<size_t>(r.outputs[0])].dtype == CTR_DTYPE_BF16)
            cast = ni;
        }
        return n == 1 ? cast : -1;
      };
      // An all-gather of `from` (this rank's rows) into `full`, run before node `at`.
      auto gather_into = [&](int from, int full, int at, bool backward) {
        Node n;
        n.op = "all_gather";
        n.name = g.tensors[full].name;
        n.inputs = {from};
        n.outputs = {full};
        n.attrs = {{"axis", Attr::of_string("fsdp")}, {"rows", Attr::of_int(N0)}};
        n.block = g.nodes[at].block;
        n.backward = backward;
        before[at].push_back(std::move(n));
      };
      auto gather_copy = [&](int cast, bool fwd) {
        Node c = g.nodes[cast];
        const int whole = c.outputs[0];
        Tensor sh;
        sh.name = g.tensors[whole].name + ".shard";
        sh.dtype = CTR_DTYPE_BF16;
        sh.role = Role::Activation;
        sh.shape = g.tensors[p].shape;
        sh.has_shape = true;
        for (int64_t d : sh.shape) sh.dims.push_back(Dim{d, ""});
        const int st = g.add_tensor(std::move(sh));
        g.tensors[whole].alloc_bytes = rows * F * row_elems * 2;
        c.inputs = {p};
        c.outputs = {st};
        c.block = -1;
        prologue[fwd ? 0 : 1].push_back(std::move(c));
        dropped[static_cast<size_t>(cast)] = 1;
        int first = -1;  // the copy's first reader
        for (int ni = cast + 1; ni < static_cast<int>(g.nodes.size()) && first < 0; ++ni)
          for (int in : g.nodes[ni].inputs)
            if (in == whole) first = ni;
        CTR_CHECK(first >= 0);
        gather_into(st, whole, first, !fwd);
      };
      const int cast_fwd = expert || first_fwd < 0 || !(reshard || first_bwd < 0) ? -1 : only_cast(true);
      const int cast_bwd = expert || first_bwd < 0 || !(reshard || first_fwd < 0) ? -1 : only_cast(false);
      if (cast_fwd >= 0) gather_copy(cast_fwd, true);
      if (cast_bwd >= 0) gather_copy(cast_bwd, false);
      if (cast_fwd >= 0) first_fwd = -1;
      if (cast_bwd >= 0) first_bwd = -1;

      int full_fwd = -1, full_bwd = -1;
      auto gather = [&](int full, int at) { gather_into(p, full, at, at >= nf); };
      if (first_fwd >= 0) {
        full_fwd = make_full(".full");
        gather(full_fwd, first_fwd);
      }
      if (first_bwd >= 0) {
        if (reshard || full_fwd < 0) {
          full_bwd = make_full(".full_bwd");
          gather(full_bwd, first_bwd);
        } else {
          full_bwd = full_fwd;
        }
      }
      for (const auto &[ni, slot] : readers[static_cast<size_t>(p)])
        if (!dropped[static_cast<size_t>(ni)])
          g.nodes[ni].inputs[static_cast<size_t>(slot)] = ni < nf ? full_fwd : full_bwd;
    }

    if (grad < 0) continue;
    const int producer = producer_of[static_cast<size_t>(grad)];
    CTR_CHECK(producer >= 0);
    // Collectives that turn the full gradient into this rank's reduced shard,
    // inserted right after the node that completes the gradient.
    auto reduce = [&](int in, const char *op, const char *suffix, std::map<std::string, Attr> attrs) {
      Tensor t;
      t.name = name + suffix;
      t.dtype = CTR_DTYPE_F32;
      t.shape = g.tensors[p].shape;
      t.has_shape = true;
      int out = g.add_tensor(std::move(t));
      Node n;
      n.op = op;
      n.name = name + "." + op;
      n.inputs = {in};
      n.outputs = {out};
      n.attrs = std::move(attrs);
      n.block = g.nodes[producer].block;
      n.backward = true;
      after[producer].push_back(std::move(n));
      return out;
    };
    int cur = grad;
    if (F > 1 && expert && !shard_expert) {
      cur = reduce(cur, "all_reduce", ".grad_fsdp", {{"axis", Attr::of_string("fsdp")}});
    } else if (F > 1) {
      g.tensors[grad].alloc_bytes = padded_bytes;
      cur = reduce(cur, "reduce_scatter", ".grad_shard",
                   {{"axis", Attr::of_string("fsdp")}, {"rows", Attr::of_int(N0)}});
    }
    if (dp > 1) cur = reduce(cur, "all_reduce", ".grad_dp", {{"axis", Attr::of_string("dp")}});
    // Every rank of a cp group holds the whole parameter and computed its
    // gradient from its own chunks of the sequences: the mean over cp is that
    // of the whole sequences' mean loss.
    if (cp > 1) cur = reduce(cur, "all_reduce", ".grad_cp", {{"axis", Attr::of_string("cp")}});
    // Every rank of an ep group holds the same non-expert weights and computed
    // their gradient from its own tokens.
    if (ep > 1 && !expert) cur = reduce(cur, "all_reduce", ".grad_ep", {{"axis", Attr::of_string("ep")}});
    g.tensors[grad].grad_of = -1;
    g.tensors[cur].grad_of = p;
  }

  std::vector<Node> nodes;
  int new_nf = 0;
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    if (ni == 0)
      for (Node &n : prologue[0]) nodes.push_back(std::move(n));
    if (static_cast<int>(ni) == nf)
      for (Node &n : prologue[1]) nodes.push_back(std::move(n));
    for (Node &n : before[ni]) nodes.push_back(std::move(n));
    if (!dropped[ni]) nodes.push_back(std::move(g.nodes[ni]));
    for (Node &n : after[ni]) nodes.push_back(std::move(n));
    if (static_cast<int>(ni) + 1 == nf) new_nf = static_cast<int>(nodes.size());
  }
  g.nodes = std::move(nodes);
  g.num_forward = new_nf;
}

}  // namespace ctr
