// Pass 2, infer_shapes: bind the symbolic dims and give every tensor a concrete
// shape. Host inputs take their shape from the file with "batch" and "seq" bound
// from the step options; every node output's shape comes from its op's rule and,
// where the file declared a shape, must agree with it — a disagreement is the
// "shape mismatch" a user most often makes by hand-editing a graph.

#include "core/status.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {

void pass_infer_shapes(Graph &g, const CompileOptions &opt) {
  int64_t seq = opt.seq;
  if (seq <= 0) {
    std::string m = g.meta("max_seq");
    if (!m.empty()) seq = std::atoll(m.c_str());
  }
  // Sizes a fuzzed or hand-edited file can ask for must not overflow int64 byte
  // counts further down: cap every tensor at 2^40 elements.
  auto check_size = [&](const Tensor &t, const std::vector<int64_t> &s) {
    __int128 n = 1;
    for (int64_t d : s) {
      if (d < 0)
        fail(CTR_STATUS_INVALID_GRAPH, strformat("tensor '%s' has a negative dim in %s", t.name.c_str(),
                                                 shape_string(s).c_str()));
      n *= d;
      if (n > (static_cast<__int128>(1) << 40))
        fail(CTR_STATUS_INVALID_GRAPH,
             strformat("tensor '%s' of shape %s is too large (more than 2^40 elements)", t.name.c_str(),
                       shape_string(s).c_str()));
    }
  };
  auto bind = [&](const Tensor &t) {
    std::vector<int64_t> s;
    for (const Dim &d : t.dims) {
      if (d.symbol.empty()) {
        s.push_back(d.size);
      } else if (d.symbol == "batch") {
        s.push_back(opt.batch);
      } else if (d.symbol == "seq") {
        if (seq <= 0)
          fail(CTR_STATUS_INVALID_OPTION,
               strformat("tensor '%s' has a 'seq' dim: set option 'seq' (the graph records no "
                         "max_seq)",
                         t.name.c_str()));
        s.push_back(seq);
      } else {
        fail(CTR_STATUS_INVALID_GRAPH,
             strformat("tensor '%s' has unknown symbolic dim '%s' (known: batch, seq)",
                       t.name.c_str(), d.symbol.c_str()));
      }
    }
    return s;
  };
  // Size expressions in attributes ("batch*seq") see the same values; "seq" is
  // absent when neither the option nor the graph gives it.
  g.symbols.clear();
  g.symbols["batch"] = opt.batch;
  if (seq > 0) g.symbols["seq"] = seq;
  for (Tensor &t : g.tensors) {
    t.has_shape = false;
    if (t.role != Role::Activation) {
      t.shape = bind(t);
      check_size(t, t.shape);
      t.has_shape = true;
    }
  }
  for (size_t ni = 0; ni < g.nodes.size(); ++ni) {
    Node &n = g.nodes[ni];
    const OpDef *def = find_op(n.op);
    CTR_CHECK(def != nullptr);
    for (int in : n.inputs)
      if (!g.tensors[in].has_shape)
        fail(CTR_STATUS_INVALID_GRAPH,
             strformat("node '%s' (%s) reads %s before it is computed", n.name.c_str(),
                       n.op.c_str(), g.describe_tensor(in).c_str()));
    std::vector<OutInfo> out;
    def->infer(g, n, out);
    CTR_CHECK(out.size() == static_cast<size_t>(def->num_outputs) + def->saved.size());
    // Saved outputs are appended once; inspect may run this pass on a graph that
    // already has them.
    if (n.outputs.size() == static_cast<size_t>(def->num_outputs)) {
      for (const std::string &suffix : def->saved) {
        Tensor t;
        t.name = g.tensors[n.outputs[0]].name + "." + suffix;
        t.role = Role::Activation;
        n.outputs.push_back(g.add_tensor(std::move(t)));
      }
    }
    for (size_t i = 0; i < out.size(); ++i) {
      Tensor &t = g.tensors[n.outputs[i]];
      if (i < static_cast<size_t>(def->num_outputs) && !t.dims.empty()) {
        std::vector<int64_t> declared = bind(t);
        if (declared != out[i].shape)
          fail(CTR_STATUS_INVALID_GRAPH,
               strformat("node '%s' (%s): shape mismatch: output %s is declared %s but the op "
                         "computes %s",
                         n.name.c_str(), n.op.c_str(), g.describe_tensor(n.outputs[i]).c_str(),
                         shape_string(declared).c_str(), shape_string(out[i].shape).c_str()));
      }
      if (i < static_cast<size_t>(def->num_outputs) && !t.dims.empty() && t.dtype != out[i].dtype)
        fail(CTR_STATUS_INVALID_GRAPH,
             strformat("node '%s' (%s): output %s is declared %s but the op computes %s",
                       n.name.c_str(), n.op.c_str(), g.describe_tensor(n.outputs[i]).c_str(),
                       dtype_name(t.dtype), dtype_name(out[i].dtype)));
      check_size(t, out[i].shape);
      t.dtype = out[i].dtype;
      t.shape = out[i].shape;
      t.has_shape = true;
    }
  }
  const Tensor &loss = g.tensors[g.loss];
  if (loss.numel() != 1 || loss.dtype != CTR_DTYPE_F32)
    fail(CTR_STATUS_INVALID_GRAPH,
         strformat("loss tensor %s must be an f32 scalar, is %s%s",
                   g.describe_tensor(g.loss).c_str(), dtype_name(loss.dtype),
                   shape_string(loss.shape).c_str()));
}

}  // namespace ctr
