// Pass 3, autodiff: reverse-mode differentiation of the forward graph.
//
// Forward nodes are visited last to first; each op's VJP rule (graph/ops.cc)
// emits backward nodes and hands their results to accumulate(), which sums the
// contributions of a tensor used more than once (residual streams, tied
// embeddings) with add_same nodes. Only tensors that depend on a parameter get
// gradients: token ids, targets and constants cost nothing. Backward nodes are
// appended after the forward ones, so the node order stays topological and
// num_forward marks the boundary the executor uses for evaluate().

#include <algorithm>

#include "core/status.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {
namespace {

class Builder : public VjpBuilder {
 public:
  explicit Builder(Graph &g) : g_(g), grad_(g.tensors.size(), -1), needs_(g.tensors.size(), false) {
    for (size_t i = 0; i < g.tensors.size(); ++i)
      needs_[i] = g.tensors[i].role == Role::Param || g.tensors[i].wants_grad;
    for (const Node &n : g.nodes) {
      bool any = false;
      for (int in : n.inputs) any |= needs_[in];
      if (any)
        for (int o : n.outputs) needs_[o] = true;
    }
  }

  Graph &graph() override { return g_; }
  int grad(int t) override { return t < static_cast<int>(grad_.size()) ? grad_[t] : -1; }
  bool needs(int t) override { return t < static_cast<int>(needs_.size()) && needs_[t]; }

  void accumulate(int t, int gt) override {
    CTR_CHECK(t < static_cast<int>(grad_.size()));
    if (grad_[t] < 0) {
      grad_[t] = gt;
      return;
    }
    int sum = new_grad_tensor(t, "grad_sum");
    emit("add_same", {grad_[t], gt}, {sum}, {}, current_block_);
    grad_[t] = sum;
  }

  int new_grad_tensor(int like, const std::string &suffix) override {
    Tensor t;
    const Tensor &src = g_.tensors[like];
    t.name = src.name + "." + suffix + std::to_string(counter_++);
    t.dtype = CTR_DTYPE_F32;
    t.shape = src.shape;
    t.has_shape = true;
    t.role = Role::Activation;
    return g_.add_tensor(std::move(t));
  }

  void emit(const std::string &op, std::vector<int> in, std::vector<int> out,
            std::map<std::string, Attr> attrs, int block) override {
    CTR_CHECK(find_op(op) != nullptr);
    Node n;
    n.op = op;
    n.name = op + "." + std::to_string(g_.nodes.size());
    n.inputs = std::move(in);
    n.outputs = std::move(out);
    n.attrs = std::move(attrs);
    n.block = block;
    n.backward = true;
    g_.add_node(std::move(n));
  }

  void set_block(int b) { current_block_ = b; }
  void seed(int loss, int g) { grad_[loss] = g; }

 private:
  Graph &g_;
  std::vector<int> grad_;
  std::vector<bool> needs_;
  int counter_ = 0;
  int current_block_ = -1;
};

// The declarative rule (OpDef::bwd): one backward op whose inputs are picked
// from the forward node and whose outputs are the gradients of its inputs.
void emit_backward_op(Builder &b, const OpDef &def, const Node &n) {
  const int ngrads = def.bwd.grads > 0 ? std::min<int>(def.bwd.grads, static_cast<int>(n.inputs.size()))
                                       : static_cast<int>(n.inputs.size());
  bool any = false;
  for (int i = 0; i < ngrads; ++i) any |= b.needs(n.inputs[i]);
  if (!any) return;
  std::vector<int> in;
  for (const BwdSlot &s : def.bwd.inputs) {
    switch (s.kind) {
      case BwdSlot::Grad: {
        int gy = b.grad(n.outputs[s.index]);
        if (gy < 0) return;  // the gradient this op's backward needs never arrives
        in.push_back(gy);
        break;
      }
      case BwdSlot::Input: in.push_back(n.inputs[s.index]); break;
      case BwdSlot::Output: in.push_back(n.outputs[s.index]); break;
    }
  }
  std::vector<int> out;
  for (int i = 0; i < ngrads; ++i) out.push_back(b.new_grad_tensor(n.inputs[i], "grad"));
  b.emit(def.bwd.op, std::move(in), out, n.attrs, n.block);
  for (int i = 0; i < ngrads; ++i)
    if (b.needs(n.inputs[i])) b.accumulate(n.inputs[i], out[i]);
}

}  // namespace

void pass_autodiff(Graph &g) {
  CTR_REQUIRE(g.num_forward < 0, CTR_STATUS_INVALID_STATE, "autodiff already ran on this graph");
  const int nforward = static_cast<int>(g.nodes.size());
  g.num_forward = nforward;

  Builder b(g);
  if (g.loss >= 0) {
    Tensor seed;
    seed.name = "loss.grad";
    seed.role = Role::Const;
    seed.dtype = CTR_DTYPE_F32;
    seed.has_shape = true;
    seed.shape = g.tensors[g.loss].shape;
    seed.init.kind = InitKind::Data;
    float one = 1.0f;
    seed.data.assign(reinterpret_cast<uint8_t *>(&one), reinterpret_cast<uint8_t *>(&one) + 4);
    // Named for dumps only; the step finds it by index, so a file tensor that
    // happens to have the same name cannot be mistaken for it.
    int seed_id = g.add_tensor(std::move(seed));
    g.loss_seed = seed_id;
    b.seed(g.loss, seed_id);
  }
  // A pipeline stage's activations read by later stages: their gradients
  // arrive from there.
  for (const auto &[t, in] : g.grad_seeds) {
    if (b.grad(t) < 0)
      b.seed(t, in);
    else
      b.accumulate(t, in);
  }
  for (int ni = nforward - 1; ni >= 0; --ni) {
    // Copy: emitting nodes may reallocate g.nodes.
    Node n = g.nodes[ni];
    const OpDef *def = find_op(n.op);
    CTR_CHECK(def != nullptr);
    bool has_grad = false;
    for (int o : n.outputs) has_grad |= b.grad(o) >= 0;
    bool wants = false;
    for (int in : n.inputs) wants |= b.needs(in);
    if (!has_grad || !wants) continue;
    if (!def->vjp && def->bwd.op.empty())
      fail(CTR_STATUS_UNSUPPORTED,
           strformat("node '%s': op '%s' has no gradient rule", n.name.c_str(), n.op.c_str()));
    b.set_block(n.block);
    if (def->vjp)
      def->vjp(b, n);
    else
      emit_backward_op(b, *def, n);
  }
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    if (g.tensors[i].role != Role::Param) continue;
    int gt = b.grad(static_cast<int>(i));
    if (gt < 0) continue;
    // A gradient tensor shared with another tensor's gradient (add passes its
    // output gradient straight through) gets its own copy so that each parameter
    // owns its gradient buffer.
    if (g.tensors[gt].grad_of >= 0 || g.tensors[gt].role != Role::Activation) {
      int c = b.new_grad_tensor(static_cast<int>(i), "grad_copy");
      b.emit("reshape", {gt}, {c}, {{"shape", Attr::of_ints(g.tensors[i].shape)}}, -1);
      gt = c;
    }
    g.tensors[gt].grad_of = static_cast<int>(i);
  }
  // The gradients of a pipeline stage's received activations, read after the
  // backward to go back to the stages that sent them.
  g.input_grads.clear();
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    if (!g.tensors[i].wants_grad) continue;
    const int gt = b.grad(static_cast<int>(i));
    if (gt >= 0) g.tensors[static_cast<size_t>(gt)].keep = true;
    g.input_grads.push_back({static_cast<int>(i), gt});
  }
}

}  // namespace ctr
