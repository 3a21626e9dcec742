// Pass split_backward: for the zero-bubble schedule, the backward graph is
// ordered in two parts, run as two tasks per micro-batch: first the nodes the
// input gradients need (B: the gradients the previous stage waits for, and
// everything they depend on — recomputed forwards, gathers, tp reductions),
// then all the others (W: the weight gradients, their sums and reductions).
// Each part keeps the order the earlier passes chose. Graph::num_input_grad
// marks the boundary; lower makes each part a phase of its own.
//
// A W task runs after later micro-batches' B tasks, which share the parameter
// gradient region with it. So a B node that writes a parameter's gradient as
// one of its outputs (a norm's backward writes the input's and the weight's
// together) writes it to an arena tensor of its own micro-batch instead, and W
// starts by copying it to the gradient region.
//
// Other schedules leave the graph as it is (num_input_grad -1).

#include <algorithm>
#include <string>
#include <vector>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {

std::string pass_split_backward(Graph &g, const CompileOptions &opt) {
  g.num_input_grad = -1;
  if (opt.pp_schedule != ScheduleKind::ZeroBubble) return "";
  CTR_CHECK(g.num_forward >= 0);
  const int nf = g.num_forward, nn = static_cast<int>(g.nodes.size());
  std::vector<int> writer(g.tensors.size(), -1);
  for (int ni = nf; ni < nn; ++ni)
    for (int o : g.nodes[static_cast<size_t>(ni)].outputs) writer[static_cast<size_t>(o)] = ni;
  // B: the backward nodes the input gradients depend on.
  std::vector<char> in_b(static_cast<size_t>(nn), 0);
  std::vector<int> todo;
  for (const auto &[input, grad] : g.input_grads)
    if (grad >= 0 && writer[static_cast<size_t>(grad)] >= 0) todo.push_back(writer[static_cast<size_t>(grad)]);
  while (!todo.empty()) {
    const int ni = todo.back();
    todo.pop_back();
    if (in_b[static_cast<size_t>(ni)]) continue;
    in_b[static_cast<size_t>(ni)] = 1;
    for (int in : g.nodes[static_cast<size_t>(ni)].inputs)
      if (writer[static_cast<size_t>(in)] >= 0) todo.push_back(writer[static_cast<size_t>(in)]);
  }
  std::vector<Node> b, w, copies;
  for (int ni = nf; ni < nn; ++ni) {
    Node &n = g.nodes[static_cast<size_t>(ni)];
    if (!in_b[static_cast<size_t>(ni)]) {
      w.push_back(std::move(n));
      continue;
    }
    for (int &o : n.outputs) {
      if (g.tensors[static_cast<size_t>(o)].grad_of < 0) continue;
      Tensor t = g.tensors[static_cast<size_t>(o)];
      t.name += ".of_micro_batch";
      t.grad_of = -1;
      t.storage = Storage::None;
      const int held = g.add_tensor(std::move(t));
      const Tensor &grad = g.tensors[static_cast<size_t>(o)];
      Node c = Node::make("reshape", grad.name + ".copy", {held}, {o}, n.block,
                          {{"shape", Attr::of_ints(grad.shape)}});
      c.backward = true;
      copies.push_back(std::move(c));
      o = held;
    }
    b.push_back(std::move(n));
  }
  g.nodes.resize(static_cast<size_t>(nf));
  g.num_input_grad = nf + static_cast<int>(b.size());
  for (auto *part : {&b, &copies, &w})
    for (Node &n : *part) g.nodes.push_back(std::move(n));
  return strformat("backward split: %zu node(s) for the input gradients (B), %zu for the weight gradients (W), "
                   "%zu gradient(s) written in B copied in W\n",
                   b.size(), w.size() + copies.size(), copies.size());
}

}  // namespace ctr
