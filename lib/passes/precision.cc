// The precision pass: bf16 storage for activations, f32 for everything that
// accumulates.
//
// With precision "bf16" every f32 activation becomes bf16 except
//   - the loss and the seed of its gradient, and every single number (the
//     terms summed into the loss and their gradients),
//   - the saved statistics of forward ops (the outputs infer_shapes appends:
//     normalisation means and reciprocal deviations, attention's log-sum-exp,
//     cross-entropy's), which backends keep in f32,
//   - parameter gradients, and the partial gradients summed into them, which
//     are reduced across ranks and read by the optimizer in f32.
// Parameters stay f32 (master weights) and so do constants; a node that reads
// one while its other float tensors are bf16 reads a bf16 copy made by a `cast`
// node placed before the copy's first reader (one per tensor and phase: the
// forward's readers share one, the backward's another, so none is held from
// the forward to the backward). Kernels therefore see one storage type for data and f32
// for statistics and parameter gradients.
//
// "auto" (the default) means bf16 where the backend has bf16 kernels (it has a
// kernel for `cast`) and f32 otherwise, and f32 for graphs with
// mixture-of-experts layers, tensor-parallel regions or context-parallel
// attention (the CUDA backend's kernels for those are f32 only); a backend
// flagged CTR_BACKEND_BF16_OPT_IN (the CPU) gets f32 under "auto".
// The gathers of parameters and the reductions of their gradients (shard,
// after this pass) move f32: the gathers feed the casts. The activation
// collectives of tp, sp and cp (in the graph before this pass) move the dtype
// of what they carry, bf16 (reductions combine pairs in f32 and round once),
// except the vocabulary-parallel head's row statistics, kept f32. Between
// pipeline stages activations and their gradients cross in bf16.
// Mixture-of-experts layers exchange their rows in bf16 too and sum their
// load-balancing statistics over the world in f32. The experts run in bf16
// where the backend's expert kernels take it (the CPU's, which widen every
// bf16 operand; the CUDA backend's expert kernels are f32 only, so it refuses).

#include <functional>
#include <map>

#include "backend/plugin.h"
#include "core/options.h"
#include "core/status.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {
namespace {

// Whether node n reads or writes bf16 data.
bool on_bf16(const Graph &g, const Node &n) {
  for (int t : n.inputs)
    if (g.tensors[static_cast<size_t>(t)].dtype == CTR_DTYPE_BF16) return true;
  for (int t : n.outputs)
    if (g.tensors[static_cast<size_t>(t)].dtype == CTR_DTYPE_BF16) return true;
  return false;
}

// A new bf16 activation shaped like tensor t, named NAME.bf16, and a cast node
// `from` -> `to` named NAME + suffix in the block and phase of `at`. Returns
// the new tensor; the node goes to *cast.
int bf16_like(Graph &g, int t, const Node &at, bool widen, Node *cast, const char *suffix = ".bf16") {
  const std::string name = g.tensors[static_cast<size_t>(t)].name;  // add_tensor may move the tensors
  Tensor h;
  h.name = name + suffix;
  h.dtype = CTR_DTYPE_BF16;
  h.role = Role::Activation;
  h.shape = g.tensors[static_cast<size_t>(t)].shape;
  h.has_shape = true;
  for (int64_t d : h.shape) h.dims.push_back(Dim{d, ""});
  const int ht = g.add_tensor(std::move(h));
  *cast = widen ? Node::make("cast", name + ".widen", {ht}, {t}, at.block, {{"dtype", Attr::of_string("f32")}})
                : Node::make("cast", name + ".cast", {t}, {ht}, at.block, {{"dtype", Attr::of_string("bf16")}});
  cast->backward = at.backward;
  return ht;
}

}  // namespace

std::string resolve_precision(const Graph &g, const std::string &option,
                              const std::function<bool(OpId)> &has_kernel, uint32_t backend_flags) {
  if (option != "auto") return option;
  if (backend_flags & CTR_BACKEND_BF16_OPT_IN) return "fp32";
  // Tensor- and context-parallel regions have f32 kernels only on the CUDA
  // backend (the vocabulary-parallel head, cp attention): bf16 there is asked
  // for by name.
  for (const Node &n : g.nodes)
    if (n.op.rfind("moe_", 0) == 0 || n.op == "fanout" || n.op == "cp_attention") return "fp32";
  const OpDef *cast = find_op("cast");
  return cast && has_kernel && has_kernel(cast->id) ? "bf16" : "fp32";
}

std::string pass_precision(Graph &g, const std::string &precision, bool bf16_moe, const StageCut *cut) {
  CTR_CHECK(g.num_forward >= 0);
  if (precision != "bf16") return "precision: fp32 (every activation f32)";
  const size_t nt = g.tensors.size();
  for (const Node &n : g.nodes) {
    CTR_REQUIRE(bf16_moe || n.op.rfind("moe_", 0) != 0, CTR_STATUS_UNSUPPORTED,
                "precision bf16: node '%s' (%s) is a mixture-of-experts op, which runs in f32 only on this "
                "backend; use precision fp32 for this graph",
                n.name.c_str(), n.op.c_str());
  }

  // What stays f32.
  std::vector<bool> f32(nt, false);
  if (g.loss >= 0) f32[static_cast<size_t>(g.loss)] = true;
  if (g.loss_seed >= 0) f32[static_cast<size_t>(g.loss_seed)] = true;
  // Single numbers (terms of the loss: cross-entropy and auxiliary losses
  // summed into it, and their gradients): rounding one to bf16 saves nothing
  // and would move the loss by a bf16 unit of its size.
  for (size_t t = 0; t < nt; ++t)
    if (g.tensors[t].has_shape && g.tensors[t].numel() <= 1) f32[t] = true;
  // (Every node's: recompute's copies of forward nodes in the backward save
  // the same statistics.)
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    const Node &n = g.nodes[ni];
    const OpDef *d = find_op(n.op);
    if (!d) continue;
    for (size_t k = static_cast<size_t>(d->num_outputs); k < n.outputs.size(); ++k)
      f32[static_cast<size_t>(n.outputs[k])] = true;
  }
  // Parameter gradients and, backwards through add_same, their partial sums.
  std::map<int, int> producer;
  for (size_t ni = 0; ni < g.nodes.size(); ++ni)
    for (int o : g.nodes[ni].outputs) producer[o] = static_cast<int>(ni);
  std::vector<int> work;
  for (size_t t = 0; t < nt; ++t) {
    const int of = g.tensors[t].grad_of;
    if (of >= 0 && g.tensors[static_cast<size_t>(of)].role == Role::Param) work.push_back(static_cast<int>(t));
  }
  while (!work.empty()) {
    const int t = work.back();
    work.pop_back();
    if (f32[static_cast<size_t>(t)] && g.tensors[static_cast<size_t>(t)].grad_of < 0) continue;
    f32[static_cast<size_t>(t)] = true;
    auto it = producer.find(t);
    if (it == producer.end()) continue;
    const Node &n = g.nodes[static_cast<size_t>(it->second)];
    if (n.op == "add_same")
      for (int in : n.inputs)
        if (!f32[static_cast<size_t>(in)]) work.push_back(in);
  }

  // Statistics summed or gathered over ranks stay f32: the vocabulary-parallel
  // head's row statistics (max, sum of exponentials, target logit), the
  // all-gather that brings every rank's, and the log-sum-exp the loss saves for
  // its gradient; the experts' load-balancing counts and sums over the world.
  for (const Node &n : g.nodes)
    if (n.op == "vocab_ce_stats" || n.op == "vocab_ce_loss" || n.op == "moe_aux_stats")
      for (size_t k = n.op == "vocab_ce_loss" ? 1 : 0; k < n.outputs.size(); ++k)
        f32[static_cast<size_t>(n.outputs[k])] = true;
  for (const Node &n : g.nodes)
    if (find_op(n.op) && find_op(n.op)->collective != CollKind::None)
      for (size_t k = 0; k < n.inputs.size() && k < n.outputs.size(); ++k)
        if (f32[static_cast<size_t>(n.inputs[k])]) f32[static_cast<size_t>(n.outputs[k])] = true;

  // Activations to bf16.
  for (size_t t = 0; t < nt; ++t) {
    Tensor &x = g.tensors[t];
    if (x.role == Role::Activation && x.dtype == CTR_DTYPE_F32 && !f32[t] && producer.count(static_cast<int>(t)))
      x.dtype = CTR_DTYPE_BF16;
  }
  // Pipeline stages: what crosses is bf16 on both sides (every rank runs this
  // pass on the same graph, so the sender's activation is bf16 exactly where
  // the receiver's input is): activations received, the gradients received
  // for the activations sent, and the gradients sent back.
  if (cut && cut->stages > 1) {
    auto narrow = [&](int t) {
      Tensor &x = g.tensors[static_cast<size_t>(t)];
      if (x.dtype == CTR_DTYPE_F32) x.dtype = CTR_DTYPE_BF16;
    };
    for (const StageCut::Boundary &b : cut->recv) {
      const ctr_dtype d = g.tensors[static_cast<size_t>(b.tensor)].dtype;
      if (d != CTR_DTYPE_F32) continue;  // ids cross as they are
      narrow(b.tensor);
      for (const auto &[in, grad] : g.input_grads)
        if (in == b.tensor) narrow(grad);
    }
    for (const StageCut::Boundary &b : cut->send) {
      const Tensor &x = g.tensors[static_cast<size_t>(b.tensor)];
      CTR_REQUIRE(x.dtype != CTR_DTYPE_F32, CTR_STATUS_UNSUPPORTED,
                  "precision bf16: %s is sent to stage %d in f32; use precision fp32 with pp",
                  g.describe_tensor(b.tensor).c_str(), b.peer);
      if (b.grad_tensor >= 0 && x.dtype == CTR_DTYPE_BF16) narrow(b.grad_tensor);
    }
  }

  // A gradient kept f32 whose node computes in bf16 and cannot write that
  // output in f32 (OpDef::f32_outputs): the node writes a bf16 gradient, and a
  // cast right after it widens it into the f32 tensor. (Writing f32 bits through
  // a bf16 kernel would be silently wrong.)
  std::vector<std::vector<Node>> widen(g.nodes.size());
  int widened = 0;
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    Node &n = g.nodes[ni];
    const OpDef *d = find_op(n.op);
    if (!d || n.op == "cast" || !on_bf16(g, n)) continue;
    for (size_t k = 0; k < n.outputs.size(); ++k) {
      const int t = n.outputs[k];
      const Tensor &x = g.tensors[static_cast<size_t>(t)];
      if (x.dtype != CTR_DTYPE_F32 || x.role != Role::Activation || !f32[static_cast<size_t>(t)]) continue;
      if (t == g.loss || (k < 32 && (d->f32_outputs >> k) & 1u)) continue;
      // Forward nodes, and their copies recompute put in the backward, write
      // their statistics (the outputs past the op's own) in f32.
      if (static_cast<int>(ni) < g.num_forward || static_cast<int>(k) >= d->num_outputs) continue;
      Node cn;
      n.outputs[k] = bf16_like(g, t, n, true, &cn);
      widen[ni].push_back(std::move(cn));
      ++widened;
    }
  }

  // bf16 copies of the f32 parameters and constants read by bf16 nodes: one
  // for the forward's readers and one for the backward's, so no copy lives
  // from the forward to the backward (under fsdp the backward's is cast from
  // the weight gathered again, and neither outlives its phase's last reader).
  const OpDef *cast_def = find_op("cast");
  CTR_CHECK(cast_def != nullptr);
  std::map<std::pair<int, bool>, int> copy_of;
  std::vector<Node> out;
  out.reserve(g.nodes.size() * 2);
  int num_forward = g.num_forward;
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    Node n = g.nodes[ni];
    if (on_bf16(g, n)) {
      for (int &in : n.inputs) {
        const Tensor &src = g.tensors[static_cast<size_t>(in)];
        if (src.dtype != CTR_DTYPE_F32 || (src.role != Role::Param && src.role != Role::Const) || in == g.loss_seed)
          continue;
        const bool fwd = static_cast<int>(ni) < g.num_forward;
        auto it = copy_of.find({in, fwd});
        if (it == copy_of.end()) {
          Node cn;
          const int ct = bf16_like(g, in, n, false, &cn, fwd ? ".bf16" : ".bf16_bwd");
          if (!fwd) cn.name += "_bwd";
          out.push_back(std::move(cn));
          if (fwd) ++num_forward;
          it = copy_of.emplace(std::make_pair(in, fwd), ct).first;
        }
        in = it->second;
      }
    }
    out.push_back(std::move(n));
    for (Node &w : widen[ni]) out.push_back(std::move(w));
  }
  g.nodes = std::move(out);
  g.num_forward = num_forward;
  int64_t half = 0, whole = 0;
  for (const Tensor &t : g.tensors) {
    if (t.role != Role::Activation || !t.has_shape) continue;
    if (t.dtype == CTR_DTYPE_BF16) ++half;
    if (t.dtype == CTR_DTYPE_F32) ++whole;
  }
  return strformat("precision: bf16 (%lld activations bf16, %lld kept f32, %zu bf16 copies of parameters and "
                   "constants, %d gradients widened from bf16)",
                   static_cast<long long>(half), static_cast<long long>(whole), copy_of.size(), widened);
}

void read_precision_options(OptionReader &r, CompileOptions &o) {
  o.precision = r.get_string("precision", "auto", {"auto", "fp32", "bf16"});
}

}  // namespace ctr
