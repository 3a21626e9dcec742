// The general math ops a PyTorch exporter emits for ordinary model code traced
// at the ATen level, with PyTorch's semantics (f32 only):
//
//   add, sub, mul, div (a, b)      NumPy broadcasting; output the broadcast shape
//   masked_fill(x, mask) value     mask (f32, != 0 selects) broadcast to x's shape
//   expand(x) shape                torch.Tensor.expand, materialised
//   sum, mean, amax, var (x)       dims, keepdim; var also correction
//   softmax, log_softmax (x) dim   default -1
//   gelu(x) approximate            "tanh" (default) or "none" (exact, erf)
//   geglu(gate, up) approximate    gelu(gate) * up, same-shaped operands (GeGLU)
//
// Gradients of broadcast operands are reduced over the broadcast dims by the
// internal op reduce_to (sum down to the shape of the forward tensor the
// gradient is for), or by reduce_rows when the operand's shape is a trailing
// part of the output's: that is the bias / positional-table case that add and
// mul served before they broadcast in general, and it keeps its kernels and
// bits (mul's gradient there is still the one mul_bwd).

#include <cmath>
#include <set>

#include "common/op_params.h"
#include "core/status.h"
#include "graph/ops_internal.h"

namespace ctr {
namespace {

using namespace opdef;
using Shape = std::vector<int64_t>;

constexpr size_t kMaxDims = 8;  // CTR_MAX_DIMS, the limit of kernel arguments (backend/plugin.h)

std::string describe_input(const Graph &g, const Node &n, int i) {
  return strformat("input %d %s of shape %s", i, g.describe_tensor(n.inputs[i]).c_str(),
                   shape_string(S(g, n, i)).c_str());
}

void need_rank_at_most(const Graph &g, const Node &n, int i, size_t r) {
  if (S(g, n, i).size() > r)
    bad_node(g, n, strformat("%s has more than %zu dims", describe_input(g, n, i).c_str(), r));
}

// ---------------------------------------------------------------------------
// Broadcasting

// The broadcast of a and b (trailing dims aligned, size 1 stretches); false
// when some dim pair differs with neither 1.
bool broadcast_shape(const Shape &a, const Shape &b, Shape &out) {
  const size_t r = std::max(a.size(), b.size());
  out.assign(r, 1);
  for (size_t i = 0; i < r; ++i) {
    const int64_t da = i + a.size() >= r ? a[i + a.size() - r] : 1;
    const int64_t db = i + b.size() >= r ? b[i + b.size() - r] : 1;
    if (da != db && da != 1 && db != 1) return false;
    out[i] = da == 1 ? db : da;
  }
  return true;
}

// x pairs with `out` as a trailing part (a bias, a table) or a single element:
// the layouts the row kernels (add_fwd, mul_fwd, reduce_rows) serve.
bool trailing(const Shape &out, const Shape &x) {
  if (numel(x) == 1) return true;
  return x.size() <= out.size() && std::equal(x.begin(), x.end(), out.end() - static_cast<long>(x.size()));
}

void binary_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  Shape o;
  if (!broadcast_shape(S(g, n, 0), S(g, n, 1), o))
    bad_node(g, n, strformat("shape mismatch: %s and %s do not broadcast", describe_input(g, n, 0).c_str(),
                             describe_input(g, n, 1).c_str()));
  if (o.size() > kMaxDims)
    bad_node(g, n, strformat("broadcasting %s and %s needs %zu dims; at most %zu are supported",
                             describe_input(g, n, 0).c_str(), describe_input(g, n, 1).c_str(), o.size(),
                             kMaxDims));
  out = {f32(o)};
}

double binary_flops(const Graph &g, const Node &n) {
  Shape o;
  broadcast_shape(S(g, n, 0), S(g, n, 1), o);
  return static_cast<double>(numel(o));
}

// The gradient `full` (shaped like n's output) reduced to forward tensor t's shape.
int reduced(VjpBuilder &b, const Node &n, int t, int full) {
  const Shape ts = b.graph().tensors[t].shape, os = b.graph().tensors[n.outputs[0]].shape;
  if (ts == os) return full;
  const int r = b.new_grad_tensor(t, "grad");
  b.emit(trailing(os, ts) ? "reduce_rows" : "reduce_to", {full}, {r}, {}, n.block);
  return r;
}

// A new gradient tensor shaped like n's output, computed by op(inputs).
int full_grad(VjpBuilder &b, const Node &n, const char *op, std::vector<int> inputs) {
  const int t = b.new_grad_tensor(n.outputs[0], "grad");
  b.emit(op, std::move(inputs), {t}, {}, n.block);
  return t;
}

void add_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  for (int t : {n.inputs[0], n.inputs[1]})
    if (b.needs(t)) b.accumulate(t, reduced(b, n, t, gy));
}

void sub_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  const int a = n.inputs[0], bb = n.inputs[1];
  if (b.needs(a)) b.accumulate(a, reduced(b, n, a, gy));
  if (b.needs(bb)) {
    const int r = reduced(b, n, bb, gy);  // negate after the reduction: fewer elements
    const int gb = b.new_grad_tensor(bb, "grad");
    b.emit("neg", {r}, {gb}, {}, n.block);
    b.accumulate(bb, gb);
  }
}

void mul_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  const int a = n.inputs[0], bb = n.inputs[1];
  const Graph &g = b.graph();
  if (g.tensors[n.outputs[0]].shape == g.tensors[a].shape && trailing(g.tensors[a].shape, g.tensors[bb].shape)) {
    // The row layout: one mul_bwd gives both gradients.
    const int ga = b.new_grad_tensor(a, "grad"), gb = b.new_grad_tensor(bb, "grad");
    b.emit("mul_bwd", {gy, a, bb}, {ga, gb}, {}, n.block);
    if (b.needs(a)) b.accumulate(a, ga);
    if (b.needs(bb)) b.accumulate(bb, gb);
    return;
  }
  if (b.needs(a)) b.accumulate(a, reduced(b, n, a, full_grad(b, n, "mul", {gy, bb})));
  if (b.needs(bb)) b.accumulate(bb, reduced(b, n, bb, full_grad(b, n, "mul", {gy, a})));
}

// da = g / b ; db = -g a / b^2, as PyTorch computes it: -(g * (y / b)).
void div_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  const int a = n.inputs[0], bb = n.inputs[1];
  if (b.needs(a)) b.accumulate(a, reduced(b, n, a, full_grad(b, n, "div", {gy, bb})));
  if (b.needs(bb)) b.accumulate(bb, reduced(b, n, bb, full_grad(b, n, "div_bwd_b", {gy, n.outputs[0], bb})));
}

// ---------------------------------------------------------------------------
// masked_fill(x, mask) attr value ; expand(x) attr shape

void masked_fill_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_dtype(g, n, 1, CTR_DTYPE_F32);
  if (!n.has_attr("value")) bad_node(g, n, "missing attribute 'value' (a float)");
  n.attr_float("value", 0.0);  // throws naming the node unless a number
  need_rank_at_most(g, n, 0, kMaxDims);
  Shape o;
  if (!broadcast_shape(S(g, n, 0), S(g, n, 1), o) || o != S(g, n, 0))
    bad_node(g, n, strformat("shape mismatch: the mask, %s, does not broadcast to %s",
                             describe_input(g, n, 1).c_str(), describe_input(g, n, 0).c_str()));
  out = {f32(S(g, n, 0))};
}

void masked_fill_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_masked_fill_params *>(out)->value = static_cast<float>(n.attr_float("value", 0.0));
}

// The gradient is the output gradient with the masked positions zeroed: a
// masked_fill with value 0. The mask gets none.
void masked_fill_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  const int gx = b.new_grad_tensor(n.inputs[0], "grad");
  b.emit("masked_fill", {gy, n.inputs[1]}, {gx}, {{"value", Attr::of_float(0.0)}}, n.block);
  b.accumulate(n.inputs[0], gx);
}

void expand_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  if (!n.has_attr("shape")) bad_node(g, n, "missing attribute 'shape'");
  const Shape &x = S(g, n, 0);
  Shape s = n.attr_ints("shape");
  if (s.size() < x.size() || s.size() > kMaxDims)
    bad_node(g, n, strformat("attribute shape=%s must have between %zu (the rank of %s) and %zu dims",
                             shape_string(s).c_str(), x.size(), describe_input(g, n, 0).c_str(), kMaxDims));
  const size_t lead = s.size() - x.size();
  for (size_t i = 0; i < s.size(); ++i) {
    if (i < lead) {
      if (s[i] < 0)
        bad_node(g, n, strformat("attribute shape=%s: new leading dim %zu must have a size (not %lld)",
                                 shape_string(s).c_str(), i, static_cast<long long>(s[i])));
      continue;
    }
    const int64_t d = x[i - lead];
    if (s[i] == -1) s[i] = d;
    if (s[i] != d && (d != 1 || s[i] < 0))
      bad_node(g, n, strformat("attribute shape=%s: dim %zu of %s can only stay %lld%s",
                               shape_string(n.attr_ints("shape")).c_str(), i,
                               describe_input(g, n, 0).c_str(), static_cast<long long>(d),
                               d == 1 ? " or grow" : " (or be -1)"));
  }
  out = {f32(s)};
}

double out_flops(const Graph &g, const Node &n) {
  return static_cast<double>(numel(g.tensors[n.outputs[0]].shape));
}

void expand_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0 || !b.needs(n.inputs[0])) return;
  b.accumulate(n.inputs[0], reduced(b, n, n.inputs[0], gy));
}

// ---------------------------------------------------------------------------
// sum, mean, amax, var (x) attrs dims (required), keepdim (0), correction (var, 1)
// -> y (x's shape without the dims, or with them as 1 when keepdim); var also
// saves the mean (y's shape).

// The reduced dims of a rank-r input, validated.
std::vector<bool> reduced_dims(const Graph &g, const Node &n, size_t r) {
  if (!n.has_attr("dims")) bad_node(g, n, "missing attribute 'dims' (a list of dims)");
  const Shape dims = n.attr_ints("dims");
  if (dims.empty()) bad_node(g, n, "attribute 'dims' is empty");
  std::vector<bool> red(r, false);
  for (int64_t d : dims) {
    const int64_t k = d < 0 ? d + static_cast<int64_t>(r) : d;
    if (k < 0 || k >= static_cast<int64_t>(r))
      bad_node(g, n, strformat("attribute dims=%s: %lld is not a dim of %s", shape_string(dims).c_str(),
                               static_cast<long long>(d), describe_input(g, n, 0).c_str()));
    if (red[k])
      bad_node(g, n, strformat("attribute dims=%s names dim %lld twice", shape_string(dims).c_str(),
                               static_cast<long long>(k)));
    red[k] = true;
  }
  return red;
}

void reduce_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_dtype(g, n, 0, CTR_DTYPE_F32);
  need_rank_at_least(g, n, 0, 1);
  need_rank_at_most(g, n, 0, kMaxDims);
  const Shape &x = S(g, n, 0);
  const auto red = reduced_dims(g, n, x.size());
  const int64_t keep = n.attr_int("keepdim", 0);
  if (keep != 0 && keep != 1)
    bad_node(g, n, strformat("attribute keepdim=%lld must be 0 or 1", static_cast<long long>(keep)));
  if (n.op == "var" && n.attr_int("correction", 1) < 0)
    bad_node(g, n, strformat("attribute correction=%lld must not be negative",
                             static_cast<long long>(n.attr_int("correction", 1))));
  Shape s;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!red[i])
      s.push_back(x[i]);
    else if (keep)
      s.push_back(1);
  }
  out = {f32(s)};
  if (n.op == "var") out.push_back(f32(s));
}

void reduce_decode(const Graph &, const Node &n, void *out) {
  auto *p = static_cast<ctr_reduce_params *>(out);
  const Shape dims = n.attr_ints("dims");
  p->ndims = static_cast<int32_t>(std::min<size_t>(dims.size(), kMaxDims));
  for (int32_t i = 0; i < p->ndims; ++i) p->dims[i] = static_cast<int32_t>(dims[i]);
  p->keepdim = static_cast<int32_t>(n.attr_int("keepdim", 0));
  p->correction = static_cast<int32_t>(n.attr_int("correction", 1));
}

// ---------------------------------------------------------------------------
// softmax, log_softmax (x) attr dim ; gelu(x) attr approximate

void softmax_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_rank_at_least(g, n, 0, 1);
  const int64_t r = static_cast<int64_t>(S(g, n, 0).size()), d = n.attr_int("dim", -1);
  if (d < -r || d >= r)
    bad_node(g, n, strformat("attribute dim=%lld is not a dim of %s", static_cast<long long>(d),
                             describe_input(g, n, 0).c_str()));
  infer_same_f32(g, n, out);
}

void softmax_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_softmax_params *>(out)->dim = static_cast<int32_t>(n.attr_int("dim", -1));
}

void gelu_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const std::string a = n.attr_string("approximate", "tanh");
  if (a != "tanh" && a != "none")
    bad_node(g, n, strformat("attribute approximate='%s' is not 'tanh' or 'none'", a.c_str()));
  infer_same_f32(g, n, out);
}

void gelu_decode(const Graph &, const Node &n, void *out) {
  static_cast<ctr_gelu_params *>(out)->exact = n.attr_string("approximate", "tanh") == "none";
}

double reduce_flops(const Graph &g, const Node &n) {
  return (n.op == "var" ? 3.0 : 1.0) * elementwise_flops(g, n);
}

double softmax_flops(const Graph &g, const Node &n) { return 5.0 * elementwise_flops(g, n); }

}  // namespace

void append_math_ops(std::vector<OpDef> &v) {
  std::vector<OpDef> f;  // forward ops: cheap to recompute, all of them
  auto with_vjp = [](OpDef d, void (*vjp)(VjpBuilder &, const Node &)) {
    d.vjp = vjp;
    return d;
  };
  f.push_back(with_vjp(fwd("add", 2, 2, binary_infer, binary_flops), add_vjp));
  f.push_back(with_vjp(fwd("sub", 2, 2, binary_infer, binary_flops), sub_vjp));
  f.push_back(with_vjp(fwd("mul", 2, 2, binary_infer, binary_flops), mul_vjp));
  f.push_back(with_vjp(fwd("div", 2, 2, binary_infer, binary_flops), div_vjp));
  f.push_back(with_params<ctr_masked_fill_params>(
      with_vjp(fwd("masked_fill", 2, 2, masked_fill_infer, elementwise_flops), masked_fill_vjp),
      masked_fill_decode));
  f.push_back(with_vjp(fwd("expand", 1, 1, expand_infer, out_flops), expand_vjp));
  for (const char *op : {"sum", "mean"})
    f.push_back(with_params<ctr_reduce_params>(
        with_bwd(fwd(op, 1, 1, reduce_infer, reduce_flops), op == std::string("sum") ? "sum_bwd" : "mean_bwd",
                 {G(0)}),
        reduce_decode));
  f.push_back(with_params<ctr_reduce_params>(
      with_bwd(fwd("amax", 1, 1, reduce_infer, reduce_flops), "amax_bwd", {G(0), In(0), Out(0)}), reduce_decode));
  OpDef var = with_bwd(fwd("var", 1, 1, reduce_infer, reduce_flops), "var_bwd", {G(0), In(0), Out(1)});
  var.saved = {"mean"};
  f.push_back(with_params<ctr_reduce_params>(var, reduce_decode));
  f.push_back(with_params<ctr_softmax_params>(
      with_bwd(fwd("softmax", 1, 1, softmax_infer, softmax_flops), "softmax_bwd", {G(0), Out(0)}), softmax_decode));
  f.push_back(with_params<ctr_softmax_params>(
      with_bwd(fwd("log_softmax", 1, 1, softmax_infer, softmax_flops), "log_softmax_bwd", {G(0), Out(0)}),
      softmax_decode));
  f.push_back(with_params<ctr_gelu_params>(
      with_bwd(fwd("gelu", 1, 1, gelu_infer, elementwise_flops), "gelu_bwd", {G(0), In(0)}), gelu_decode));
  f.push_back(with_params<ctr_gelu_params>(
      with_bwd(fwd("geglu", 2, 2, gelu_infer, elementwise_flops), "geglu_bwd", {G(0), In(0), In(1)}), gelu_decode));
  for (OpDef &d : f) {
    d.cheap_to_recompute = true;
    v.push_back(std::move(d));
  }

  // Internal ops emitted by the gradients above. reduce_to and reduce_rows sum
  // a gradient down to the shape of the forward tensor their output mirrors.
  v.push_back(internal("reduce_to", 1, 1));
  v.push_back(internal("reduce_rows", 1, 1));
  v.push_back(internal("mul_bwd", 3, 2));
  v.push_back(internal("div_bwd_b", 3, 1));
  for (const char *op : {"sum_bwd", "mean_bwd"})
    v.push_back(with_params<ctr_reduce_params>(internal(op, 1, 1), reduce_decode));
  v.push_back(with_params<ctr_reduce_params>(internal("amax_bwd", 3, 1), reduce_decode));
  v.push_back(with_params<ctr_reduce_params>(internal("var_bwd", 3, 1), reduce_decode));
  v.push_back(with_params<ctr_softmax_params>(internal("softmax_bwd", 2, 1), softmax_decode));
  v.push_back(with_params<ctr_softmax_params>(internal("log_softmax_bwd", 2, 1), softmax_decode));
  v.push_back(with_params<ctr_gelu_params>(internal("gelu_bwd", 2, 1), gelu_decode));
  v.push_back(with_params<ctr_gelu_params>(internal("geglu_bwd", 3, 2), gelu_decode));
}

}  // namespace ctr
