// Layout ops that a traced PyTorch model needs besides reshape and transpose:
// slice and cat, with torch's semantics, and the size expressions ("batch*seq")
// through which attributes name sizes that depend on the symbolic dims.
//
// Sizes are resolved once, when shapes are inferred and parameters decoded at
// step creation: kernels see plain row-block copies, never an index per element.
// Values move unchanged, so these ops take f32 and i32 tensors alike (token ids
// cut to the current length); only f32 tensors get gradients.

#include <cctype>
#include <string>

#include "common/op_params.h"
#include "core/status.h"
#include "graph/ops_internal.h"

namespace ctr {

// ---------------------------------------------------------------------------
// Size expressions

int64_t eval_size(const Graph &g, const Node &n, const std::string &attr, const std::string &expr) {
  auto bad = [&](const std::string &why) {
    opdef::bad_node(g, n, strformat("attribute '%s'=\"%s\": %s", attr.c_str(), expr.c_str(), why.c_str()));
  };
  int64_t value = 1;
  size_t pos = 0;
  while (true) {
    const size_t star = expr.find('*', pos);
    std::string term = expr.substr(pos, star == std::string::npos ? std::string::npos : star - pos);
    const size_t b = term.find_first_not_of(" \t"), e = term.find_last_not_of(" \t");
    term = b == std::string::npos ? "" : term.substr(b, e - b + 1);
    int64_t v = 0;
    if (term.empty()) bad("empty term (a size expression is terms joined by '*')");
    if (term[0] == '-') bad(strformat("negative term '%s' (sizes are non-negative)", term.c_str()));
    if (std::isdigit(static_cast<unsigned char>(term[0]))) {
      for (char c : term) {
        if (!std::isdigit(static_cast<unsigned char>(c)))
          bad(strformat("malformed term '%s' (an integer or a symbol name)", term.c_str()));
        if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, c - '0', &v))
          bad(strformat("the number '%s' overflows int64", term.c_str()));
      }
    } else {
      auto it = g.symbols.find(term);
      if (it == g.symbols.end()) {
        std::string known;
        for (const auto &[name, size] : g.symbols) known += (known.empty() ? "" : ", ") + name;
        bad(strformat("unknown symbol '%s' (bound: %s)", term.c_str(), known.empty() ? "none" : known.c_str()));
      }
      v = it->second;
    }
    if (__builtin_mul_overflow(value, v, &value)) bad("the product overflows int64");
    if (star == std::string::npos) break;
    pos = star + 1;
  }
  return value;
}

namespace opdef {
namespace {

// ---------------------------------------------------------------------------
// Helpers

// An Int attribute (floats are refused: torch's sizes are integers, and a
// float such as 1e30 has no int64 value).
int64_t int_attr(const Graph &g, const Node &n, const char *k, int64_t def) {
  auto it = n.attrs.find(k);
  if (it == n.attrs.end()) return def;
  if (it->second.type != Attr::Int) bad_node(g, n, strformat("attribute '%s' must be an integer", k));
  return it->second.i;
}

// Attribute `dim` of an input of rank r, counted from the end when negative.
int norm_dim(const Graph &g, const Node &n, size_t r) {
  if (!n.has_attr("dim")) bad_node(g, n, "missing attribute 'dim'");
  const int64_t d = int_attr(g, n, "dim", 0), rank = static_cast<int64_t>(r);
  if (d < -rank || d >= rank)
    bad_node(g, n, strformat("attribute dim=%lld is not a dim of a rank-%lld input", static_cast<long long>(d),
                             static_cast<long long>(rank)));
  return static_cast<int>(d < 0 ? d + rank : d);
}

void need_f32_or_i32(const Graph &g, const Node &n, int i) {
  if (g.tensors[n.inputs[i]].dtype != CTR_DTYPE_I32) need_dtype(g, n, i, CTR_DTYPE_F32);
}

// [outer, size, inner] around dim d.
void split_at(const std::vector<int64_t> &s, int d, int64_t &outer, int64_t &inner) {
  outer = inner = 1;
  for (int i = 0; i < d; ++i) outer *= s[i];
  for (size_t i = static_cast<size_t>(d) + 1; i < s.size(); ++i) inner *= s[i];
}

// ---------------------------------------------------------------------------
// slice(x) attrs dim, start (default 0), end (an integer or a size expression;
// default the dim's size), step (>= 1, default 1): x[..., start:end:step, ...]
// as torch: negative bounds count from the end, bounds past the size clamp to
// it (9223372036854775807, torch's "to the end", is one such), an empty range
// gives a zero-size dim.

// A bound: an Int attribute, or a String size expression.
int64_t bound_attr(const Graph &g, const Node &n, const char *k, int64_t def) {
  auto it = n.attrs.find(k);
  if (it == n.attrs.end()) return def;
  if (it->second.type == Attr::String) return eval_size(g, n, k, it->second.s);
  if (it->second.type != Attr::Int)
    bad_node(g, n, strformat("attribute '%s' must be an integer or a size expression such as \"seq\"", k));
  return it->second.i;
}

// The slice of a tensor of shape x, bounds resolved (for slice_bwd, x is the
// shape of its output, which mirrors the forward input).
ctr_slice_params slice_of(const Graph &g, const Node &n, const std::vector<int64_t> &x) {
  if (x.empty()) bad_node(g, n, "cannot slice a scalar");
  const int d = norm_dim(g, n, x.size());
  const int64_t size = x[d];
  const int64_t step = int_attr(g, n, "step", 1);
  if (step < 1) bad_node(g, n, strformat("attribute step=%lld must be at least 1", static_cast<long long>(step)));
  auto clamp = [size](int64_t v) {
    if (v < 0) v = v < -size ? 0 : v + size;
    return v > size ? size : v;
  };
  const int64_t start = clamp(bound_attr(g, n, "start", 0));
  const int64_t end = clamp(bound_attr(g, n, "end", size));
  ctr_slice_params p{};
  split_at(x, d, p.outer, p.inner);
  p.size = size;
  p.start = start;
  p.step = step;
  p.len = end > start ? (end - start - 1) / step + 1 : 0;  // no overflow for a huge step
  return p;
}

void slice_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  need_f32_or_i32(g, n, 0);
  const auto &x = S(g, n, 0);
  const ctr_slice_params p = slice_of(g, n, x);
  auto s = x;
  s[norm_dim(g, n, x.size())] = p.len;
  out = {OutInfo{g.tensors[n.inputs[0]].dtype, s}};
}

// slice(x) and slice_bwd(dy) -> dx share the parameters.
void slice_decode(const Graph &g, const Node &n, void *out) {
  const int x = n.op == "slice" ? n.inputs[0] : n.outputs[0];
  *static_cast<ctr_slice_params *>(out) = slice_of(g, n, g.tensors[x].shape);
}

// ---------------------------------------------------------------------------
// cat(x1, ..., xn) attr dim: the inputs joined along dim; every other dim and
// the dtype must agree. The gradient of each input is a slice of the output's.

constexpr int kMaxCatInputs = 1 << 10;

void cat_infer(const Graph &g, const Node &n, std::vector<OutInfo> &out) {
  const auto &x0 = S(g, n, 0);
  if (x0.empty()) bad_node(g, n, "cannot concatenate scalars");
  const int d = norm_dim(g, n, x0.size());
  const ctr_dtype dt = g.tensors[n.inputs[0]].dtype;
  need_f32_or_i32(g, n, 0);
  auto s = x0;
  for (size_t i = 1; i < n.inputs.size(); ++i) {
    const int k = static_cast<int>(i);
    need_dtype(g, n, k, dt);
    const auto &xi = S(g, n, k);
    bool ok = xi.size() == x0.size();
    for (size_t j = 0; ok && j < xi.size(); ++j) ok = static_cast<int>(j) == d || xi[j] == x0[j];
    if (!ok) {
      auto want = x0;
      std::string expect = "[";
      for (size_t j = 0; j < want.size(); ++j)
        expect += (j ? "," : "") + (static_cast<int>(j) == d ? std::string("*") : std::to_string(want[j]));
      shape_mismatch(g, n, k, expect + "] (all dims but dim " + std::to_string(d) + " equal)");
    }
    s[d] += xi[d];
  }
  out = {OutInfo{dt, s}};
}

void cat_decode(const Graph &g, const Node &n, void *out) {
  const auto &y = g.tensors[n.outputs[0]].shape;
  auto *p = static_cast<ctr_cat_params *>(out);
  split_at(y, norm_dim(g, n, y.size()), p->outer, p->inner);
}

void cat_vjp(VjpBuilder &b, const Node &n) {
  const int gy = b.grad(n.outputs[0]);
  if (gy < 0) return;
  const auto &y = b.graph().tensors[n.outputs[0]].shape;
  const int d = norm_dim(b.graph(), n, y.size());
  int64_t offset = 0;
  for (int x : n.inputs) {
    const int64_t size = b.graph().tensors[x].shape[d];
    if (b.needs(x)) {
      const int gx = b.new_grad_tensor(x, "grad");
      b.emit("slice", {gy}, {gx},
             {{"dim", Attr::of_int(d)}, {"start", Attr::of_int(offset)}, {"end", Attr::of_int(offset + size)}},
             n.block);
      b.accumulate(x, gx);
    }
    offset += size;
  }
}

}  // namespace

void append_layout_ops(std::vector<OpDef> &v) {
  OpDef slice = with_bwd(fwd("slice", 1, 1, slice_infer, zero_flops), "slice_bwd", {G(0)});
  slice.moves_values = true;
  v.push_back(with_params<ctr_slice_params>(slice, slice_decode));
  OpDef cat = fwd("cat", 1, kMaxCatInputs, cat_infer, zero_flops);
  cat.vjp = cat_vjp;
  cat.moves_values = true;
  v.push_back(with_params<ctr_cat_params>(cat, cat_decode));
  v.push_back(with_params<ctr_slice_params>(internal("slice_bwd", 1, 1), slice_decode));
}

}  // namespace opdef
}  // namespace ctr
