// Pass 8 (of the full pipeline), plan_memory: a static memory plan made once,
// before the first step, as inference runtimes do.
//
// Every activation gets a lifetime [first write, last read] in node order and a
// byte offset in one arena; tensors whose lifetimes do not overlap share bytes.
// Placement is greedy by size (largest first, lowest offset that fits among the
// tensors it overlaps in time), which is close to optimal on transformer graphs
// whose big saved activations dominate. The loss and the parameter gradients stay
// live to the end of the step: the host and the optimizer read them afterwards.

#include <algorithm>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

constexpr int64_t kAlign = 64;

int64_t align_up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

MemoryPlan pass_plan_memory(Graph &g, const CompileOptions &opt) {
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

  // Lifetimes in node positions.
  std::vector<int> first(nt, -1), last(nt, -1);
  for (int ni = 0; ni < nn; ++ni) {
    for (int o : g.nodes[ni].outputs) {
      if (first[o] < 0) first[o] = ni;
      last[o] = std::max(last[o], ni);
    }
    for (int in : g.nodes[ni].inputs) last[in] = std::max(last[in], ni);
  }
  std::vector<int> order;
  for (int i = 0; i < nt; ++i) {
    Tensor &t = g.tensors[i];
    if (t.role != Role::Activation || first[i] < 0) continue;
    if (i == g.loss || t.grad_of >= 0 || t.keep) last[i] = nn;
    t.storage = Storage::Arena;
    order.push_back(i);
    plan.naive_bytes += align_up(t.alloc_size());
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return g.tensors[a].alloc_size() > g.tensors[b].alloc_size();
  });

  std::vector<int> placed;
  std::vector<std::pair<int64_t, int64_t>> busy;  // [offset, end) of overlapping tensors
  for (int i : order) {
    Tensor &t = g.tensors[i];
    int64_t size = align_up(std::max<int64_t>(t.alloc_size(), 1));
    busy.clear();
    for (int p : placed)
      if (first[p] <= last[i] && first[i] <= last[p])
        busy.emplace_back(g.tensors[p].offset,
                          g.tensors[p].offset + align_up(std::max<int64_t>(g.tensors[p].alloc_size(), 1)));
    std::sort(busy.begin(), busy.end());
    int64_t off = 0;
    for (const auto &r : busy) {
      if (r.first - off >= size) break;
      off = std::max(off, r.second);
    }
    t.offset = off;
    plan.arena_bytes = std::max(plan.arena_bytes, off + size);
    placed.push_back(i);
  }
  return plan;
}

}  // namespace ctr
