// Pass plan_memory: a static memory plan made once, before the first step, as
// inference runtimes do.
//
// Every activation gets a lifetime [first write, last read] in node order and a
// byte offset in one arena; tensors whose lifetimes do not overlap share bytes.
// The schedule from lower extends lifetimes: a collective's input and output
// stay live until the node at which stream 0 has waited for it, since the comm
// stream may still read or write them before then.
// A reshape's output is its input's bytes under another shape: it is placed on
// its input (its root, through chains of reshapes) rather than copied, and the
// root lives as long as any of them; the executor drops the kernel.
// Placement is greedy by size (largest first, lowest offset that fits among the
// tensors it overlaps in time), which is close to optimal on transformer graphs
// whose big saved activations dominate. The loss stays live to the end of the
// step (the host reads it). Parameter gradients are not in the arena: they have
// a region laid out exactly like the parameters (same offsets), so the
// optimizer runs over three flat buffers — parameters, gradients, moments — in
// one pass.
//
// A pipeline stage with several micro-batches in flight keeps a copy of the
// activations each holds from one task to the next (saved for the backward,
// kept, or passed from B to W), while what lives within one task is needed by
// one task at a time: the plan places the held tensors first ([0, held_bytes))
// and the others after them, when the arena for that many micro-batches is
// then smaller (mostly under recompute, where little is held).

#include <algorithm>
#include <tuple>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

constexpr int64_t kAlign = 64;

int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

MemoryPlan pass_plan_memory(Graph &g, const CompileOptions &opt, const Program &prog, int64_t slots) {
  MemoryPlan plan;
  const int nt = static_cast<int>(g.tensors.size());
  const int nn = static_cast<int>(g.nodes.size());
  plan.param_grad.assign(nt, -1);

  for (int i = 0; i < nt; ++i) {
    Tensor &t = g.tensors[i];
    CTR_CHECK(t.has_shape || t.role == Role::Activation);
    switch (t.role) {
      case Role::Param:
        t.storage = Storage::Param;
        t.offset = plan.param_bytes;
        plan.param_bytes += align_up(t.bytes());
        break;
      case Role::Input:
        t.storage = Storage::Input;
        t.offset = plan.input_bytes;
        plan.input_bytes += align_up(t.bytes() * opt.micro_batches);
        break;
      case Role::Const:
        t.storage = Storage::Const;
        t.offset = plan.const_bytes;
        plan.const_bytes += align_up(t.bytes());
        break;
      case Role::Activation:
        t.storage = Storage::None;
        break;
    }
    if (t.grad_of >= 0) plan.param_grad[t.grad_of] = i;
  }
  for (int i = 0; i < nt; ++i) {
    Tensor &t = g.tensors[i];
    if (t.grad_of < 0 || t.role != Role::Activation) continue;
    const Tensor &p = g.tensors[t.grad_of];
    CTR_CHECK(p.role == Role::Param && t.bytes() == p.bytes());
    t.storage = Storage::Grad;
    t.offset = p.offset;
  }

  // Reshapes (and fanouts, the identity) that alias their input: an activation
  // of the arena or a constant,
  // never a gradient region or a host input (rebound per micro-batch).
  std::vector<int> root(nt, -1);
  for (int ni = 0; ni < nn; ++ni) {
    const Node &n = g.nodes[ni];
    if ((n.op != "reshape" && n.op != "fanout") || n.inputs.size() != 1 || n.outputs.size() != 1) continue;
    const int x = root[n.inputs[0]] >= 0 ? root[n.inputs[0]] : n.inputs[0];
    const int y = n.outputs[0];
    const Tensor &tx = g.tensors[x], &ty = g.tensors[y];
    const bool x_ok = (tx.role == Role::Activation && tx.storage == Storage::None) || tx.role == Role::Const;
    const bool y_ok = ty.role == Role::Activation && ty.storage == Storage::None && ty.grad_of < 0;
    if (x_ok && y_ok && tx.bytes() == ty.bytes() && tx.alloc_bytes == 0 && ty.alloc_bytes == 0)
      root[y] = x;
  }

  // Lifetimes in node positions.
  std::vector<int> first(nt, -1), last(nt, -1);
  for (int ni = 0; ni < nn; ++ni) {
    for (int o : g.nodes[ni].outputs) {
      if (first[o] < 0) first[o] = ni;
      last[o] = std::max(last[o], ni);
    }
    for (int in : g.nodes[ni].inputs) last[in] = std::max(last[in], ni);
  }
  for (int ni = 0; ni < nn && ni < static_cast<int>(prog.complete_at.size()); ++ni) {
    const int done = prog.complete_at[static_cast<size_t>(ni)];
    if (done < 0) continue;
    for (int t : g.nodes[ni].inputs) last[t] = std::max(last[t], done);
    for (int t : g.nodes[ni].outputs) last[t] = std::max(last[t], done);
  }
  for (int i = 0; i < nt; ++i)
    if ((i == g.loss || g.tensors[i].keep) && first[i] >= 0) last[i] = nn;
  // A root lives from its first write to the last read of any alias.
  for (int i = 0; i < nt; ++i)
    if (root[i] >= 0 && first[i] >= 0) last[root[i]] = std::max(last[root[i]], last[i]);
  std::vector<int> order;
  for (int i = 0; i < nt; ++i) {
    Tensor &t = g.tensors[i];
    if (t.role != Role::Activation || first[i] < 0 || t.storage == Storage::Grad || root[i] >= 0) continue;
    t.storage = Storage::Arena;
    order.push_back(i);
    plan.naive_bytes += align_up(t.alloc_size());
  }
  // Placement, largest first at the lowest offset free for its lifetime. With
  // `scratch` flags, the held tensors are placed from offset 0 and the scratch
  // ones after them; returns (arena, held) bytes.
  std::vector<int64_t> alloc_of(static_cast<size_t>(nt), 0), size_of(static_cast<size_t>(nt), 0);
  for (int i : order) {
    alloc_of[static_cast<size_t>(i)] = g.tensors[i].alloc_size();
    size_of[static_cast<size_t>(i)] = align_up(std::max<int64_t>(alloc_of[static_cast<size_t>(i)], 1));
  }
  auto place = [&](std::vector<int> order, const std::vector<char> &scratch) {
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      if (scratch[static_cast<size_t>(a)] != scratch[static_cast<size_t>(b)])
        return scratch[static_cast<size_t>(a)] < scratch[static_cast<size_t>(b)];
      return alloc_of[static_cast<size_t>(a)] > alloc_of[static_cast<size_t>(b)];
    });
    // The placed tensors in order of [offset, end): the first fit scans them in
    // that order, skipping those whose lifetime does not meet the new one's,
    // and stops at the first gap large enough.
    struct Placed {  // (the lifetime beside the bytes: the scan reads nothing else)
      int64_t off, end;
      int first, last;
    };
    std::vector<Placed> placed;
    int64_t arena = 0, held = -1, base = 0;
    for (int i : order) {
      Tensor &t = g.tensors[i];
      if (scratch[static_cast<size_t>(i)] && held < 0) {
        base = held = arena;
        placed.clear();  // the two parts never share bytes
      }
      const int64_t size = size_of[static_cast<size_t>(i)];
      int64_t off = base;
      for (const Placed &r : placed) {
        if (!(r.first <= last[i] && first[i] <= r.last)) continue;
        if (r.off - off >= size) break;
        off = std::max(off, r.end);
      }
      t.offset = off;
      arena = std::max(arena, off + size);
      const Placed me{off, off + size, first[i], last[i]};
      placed.insert(std::upper_bound(placed.begin(), placed.end(), me,
                                     [](const Placed &a, const Placed &b) {
                                       return std::tie(a.off, a.end) < std::tie(b.off, b.end);
                                     }),
                    me);
    }
    return std::make_pair(arena, held < 0 ? arena : held);
  };
  std::vector<char> none(static_cast<size_t>(nt), 0);
  std::tie(plan.arena_bytes, plan.held_bytes) = place(order, none);
  if (slots > 1) {
    // A tensor written and last read within one task (a phase: forward, backward,
    // weight gradients) is scratch, shared by the micro-batches in flight; one
    // that outlives its phase (or is kept, or is the loss) is held. Split when
    // that makes the arena for `slots` smaller.
    const int nf = g.num_forward, ni = g.num_input_grad >= 0 ? g.num_input_grad : nn;
    // (Interleaved: each chunk's part of a phase is a task of its own.)
    auto phase = [&](int pos) {
      const int ph = pos < nf ? 0 : pos < ni ? 1 : pos < nn ? 2 : 3;
      const bool chunked = pos >= 0 && pos < nn && static_cast<size_t>(pos) < prog.node_chunk.size();
      return ph * (1 << 16) + (chunked ? prog.node_chunk[static_cast<size_t>(pos)] : 0);
    };
    std::vector<char> scratch(static_cast<size_t>(nt), 0);
    for (int i : order) scratch[static_cast<size_t>(i)] = phase(first[i]) == phase(last[i]) ? 1 : 0;
    const MemoryPlan whole = plan;
    std::vector<int64_t> offsets(order.size());
    for (size_t k = 0; k < order.size(); ++k) offsets[k] = g.tensors[order[k]].offset;
    std::tie(plan.arena_bytes, plan.held_bytes) = place(order, scratch);
    if (plan.arena_for(slots) >= whole.arena_for(slots)) {  // the first placement, as it was
      plan = whole;
      for (size_t k = 0; k < order.size(); ++k) g.tensors[order[k]].offset = offsets[k];
    }
  }
  for (int i = 0; i < nt; ++i) {
    if (root[i] < 0 || first[i] < 0) continue;
    g.tensors[i].storage = g.tensors[root[i]].storage;
    g.tensors[i].offset = g.tensors[root[i]].offset;
  }
  return plan;
}

}  // namespace ctr
