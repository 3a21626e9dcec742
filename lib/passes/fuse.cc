// Pass fuse: primitive patterns of exported model code rewritten to the
// library's fused ops (see passes.h).
//
// A PyTorch model traced at the ATen level arrives as general ops: attention
// as matmul + mask + softmax + matmul between head transposes, RMSNorm as five
// element-wise ops, and so on. This pass finds those patterns in the forward
// graph before autodiff and puts the fused op in their place, so the fused
// kernels and their gradients run instead:
//
//   rope       x*cos + cat(-x2, x1)*sin with constant tables   -> rope(x) heads, theta
//              complex form: (re + i im)(cos + i sin), re/im the -> rope(x) heads, theta, interleaved=1
//              even/odd lanes of x, cat(re', im') on a last dim
//   attention  softmax(mask(q k^T * scale)) v, causal mask     -> attention(q, k, v) causal=1
//   rmsnorm    x * rsqrt(mean(x^2, -1, keepdim) + eps) * w      -> rmsnorm(x, w) eps
//   swiglu     silu(a) * b                                     -> swiglu(a, b)
//   gelu       0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  -> gelu(x) approximate=tanh
//
// Every rewrite is exact up to float round-off: constants are compared with
// the fused op's (masks and rotary tables over the whole stored constant, not
// only the rows the current sequence length cuts), and a pattern is fused only
// when each of its intermediate tensors is read inside the pattern alone. The
// fused op writes the pattern's output tensor, so readers are unchanged; the
// reshapes and transposes that hand it [B, T, H*D] tensors are inserted where
// needed, and nodes left without readers are dropped. Rope runs first, so the
// attention after it sees the head transposes it expects.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <set>

#include "core/options.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

using Shape = std::vector<int64_t>;

// ---------------------------------------------------------------------------
// The graph as the matchers see it: producers, readers, rewrites.

class Fuser {
 public:
  explicit Fuser(Graph &g) : g_(g) { index(); }

  Graph &g() { return g_; }
  const Graph &g() const { return g_; }
  const Tensor &T(int t) const { return g_.tensors[static_cast<size_t>(t)]; }
  const Shape &S(int t) const { return T(t).shape; }

  // The node writing t, or null (an input, param, const, or a node already replaced).
  // Tensors made since the last index() (a reshape the rewrite inserted) have no
  // producer or reader among the indexed nodes.
  const Node *prod(int t) const {
    const int i = producer_of(t);
    return i < 0 ? nullptr : &g_.nodes[static_cast<size_t>(i)];
  }
  const Node *prod(int t, const char *op) const {
    const Node *n = prod(t);
    return n && n->op == op ? n : nullptr;
  }
  int index_of(const Node *n) const { return static_cast<int>(n - g_.nodes.data()); }
  // The one node reading t, or null when t has another number of reads.
  const Node *sole_reader(int t) const {
    const auto &r = readers_of(t);
    if (r.size() != 1 || external(t)) return nullptr;
    return &g_.nodes[static_cast<size_t>(r[0])];
  }
  // The nodes reading t (a node reading it twice is listed twice).
  std::vector<const Node *> readers(int t) const {
    std::vector<const Node *> out;
    for (int r : readers_of(t)) out.push_back(&g_.nodes[static_cast<size_t>(r)]);
    return out;
  }
  // Read by the host (the loss, a kept tensor): never an intermediate.
  bool external(int t) const { return t == g_.loss || T(t).keep; }
  bool used(const Node *n) const { return touched_.count(index_of(n)) != 0; }

  // Whether every read of every output of `nodes` other than the root's output
  // happens inside `nodes`; otherwise names the first tensor read elsewhere.
  bool self_contained(const std::vector<const Node *> &nodes, int root_out, std::string &why) const {
    std::set<int> inside;
    for (const Node *n : nodes) inside.insert(index_of(n));
    for (const Node *n : nodes)
      for (int o : n->outputs) {
        if (o == root_out) continue;
        bool ok = !external(o);
        for (int r : readers_of(o)) ok &= inside.count(r) != 0;
        if (!ok) {
          why = strformat("%s is also read outside the pattern", g_.describe_tensor(o).c_str());
          return false;
        }
      }
    for (const Node *n : nodes)
      if (used(n)) {
        why = strformat("node '%s' is part of another fused pattern", n->name.c_str());
        return false;
      }
    return true;
  }

  // A scalar Const (one element): its value.
  bool scalar(int t, double &v) const {
    const Tensor &x = T(t);
    if (x.role != Role::Const || x.dtype != CTR_DTYPE_F32 || x.numel() != 1 || x.data.size() != 4) return false;
    float f;
    std::memcpy(&f, x.data.data(), 4);
    v = f;
    return true;
  }
  // The f32 values of a Const.
  std::vector<float> values(int t) const {
    const Tensor &x = T(t);
    std::vector<float> v(x.data.size() / 4);
    if (!v.empty()) std::memcpy(v.data(), x.data.data(), v.size() * 4);
    return v;
  }

  // A new activation of the given shape, named after `hint` (made unique).
  int tensor(const std::string &hint, Shape shape) {
    name_all();
    Tensor t;
    t.name = hint;
    for (int k = 2; names_.count(t.name); ++k) t.name = hint + "." + std::to_string(k);
    names_.insert(t.name);
    t.shape = std::move(shape);
    t.has_shape = true;
    return g_.add_tensor(std::move(t));
  }
  // A node name not taken yet: hint, hint_1, hint_2, ...
  std::string node_name(const std::string &hint) {
    name_all();
    std::string name = hint;
    for (int k = 1; node_names_.count(name); ++k) name = hint + "_" + std::to_string(k);
    node_names_.insert(name);
    return name;
  }
  // Appends a node to run right before node `at` (the pattern's root).
  void emit(int at, const std::string &op, const std::string &name, std::vector<int> in, std::vector<int> out,
            int block, std::map<std::string, Attr> attrs = {}) {
    before_[at].push_back(Node::make(op, name, std::move(in), std::move(out), block, std::move(attrs)));
  }
  // Marks the pattern's nodes as replaced (the new nodes go before `root`).
  void replace(const std::vector<const Node *> &nodes) {
    for (const Node *n : nodes) {
      touched_.insert(index_of(n));
      dead_.insert(index_of(n));
    }
  }

  // x viewed as [B, T, C] (row-major, so any reshape of x holds the same
  // values): the earliest tensor of x's chain of reshapes that still starts
  // with [B, T], reshaped when its shape is not [B, T, C] already.
  int flat(int x, int at, int block, int64_t C) {
    const int64_t B = S(x)[0], Tn = S(x)[1];
    int src = x;
    for (const Node *r = prod(src, "reshape"); r; r = prod(src, "reshape")) {
      const Shape &s = S(r->inputs[0]);
      if (s.size() < 2 || s[0] != B || s[1] != Tn) break;
      src = r->inputs[0];
    }
    if (S(src) == Shape{B, Tn, C}) return src;
    const int out = tensor(T(x).name + ".flat", {B, Tn, C});
    emit(at, "reshape", T(x).name + ".flat", {src}, {out}, block, {{"shape", Attr::of_ints({0, 0, -1})}});
    return out;
  }

  // Applies the rewrites recorded so far: new nodes in place, replaced nodes
  // gone, and then every node left without a reader by that (the mask and
  // table slices, the reshapes before a head transpose), transitively.
  void commit() {
    if (dead_.empty() && before_.empty()) {  // nothing rewritten since the last commit
      touched_.clear();
      return;
    }
    const size_t nn = g_.nodes.size();
    std::vector<int> reads(g_.tensors.size(), 0);
    auto count = [&](const Node &n, int d) {
      for (int t : n.inputs) reads[static_cast<size_t>(t)] += d;
    };
    for (size_t i = 0; i < nn; ++i)
      if (!dead_.count(static_cast<int>(i))) count(g_.nodes[i], 1);
    for (const auto &[i, list] : before_)
      for (const Node &n : list) count(n, 1);
    std::vector<int> work;
    for (int i : dead_)
      for (int t : g_.nodes[static_cast<size_t>(i)].inputs) work.push_back(t);
    while (!work.empty()) {
      const int t = work.back();
      work.pop_back();
      const int p = producer_of(t);
      if (p < 0 || dead_.count(p)) continue;
      const Node &n = g_.nodes[static_cast<size_t>(p)];
      bool idle = true;
      for (int o : n.outputs) idle &= reads[static_cast<size_t>(o)] == 0 && !external(o);
      if (!idle) continue;
      dead_.insert(p);
      count(n, -1);
      for (int in : n.inputs) work.push_back(in);
    }
    std::vector<Node> nodes;
    for (size_t i = 0; i < nn; ++i) {
      if (auto b = before_.find(static_cast<int>(i)); b != before_.end())
        for (Node &n : b->second) nodes.push_back(std::move(n));
      if (!dead_.count(static_cast<int>(i))) nodes.push_back(std::move(g_.nodes[i]));
    }
    removed_ += static_cast<int>(dead_.size());
    g_.nodes = std::move(nodes);
    dead_.clear();
    touched_.clear();
    before_.clear();
    index();
  }

  int removed() const { return removed_; }

 private:
  int producer_of(int t) const {
    return t >= 0 && static_cast<size_t>(t) < producer_.size() ? producer_[static_cast<size_t>(t)] : -1;
  }
  const std::vector<int> &readers_of(int t) const {
    static const std::vector<int> none;
    return t >= 0 && static_cast<size_t>(t) < readers_.size() ? readers_[static_cast<size_t>(t)] : none;
  }

  // The names taken, collected when the first new one is made.
  void name_all() {
    if (named_) return;
    named_ = true;
    for (const Tensor &t : g_.tensors) names_.insert(t.name);
    for (const Node &n : g_.nodes) node_names_.insert(n.name);
  }

  void index() {
    producer_.assign(g_.tensors.size(), -1);
    readers_.assign(g_.tensors.size(), {});
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      for (int o : g_.nodes[i].outputs) producer_[static_cast<size_t>(o)] = static_cast<int>(i);
      for (int t : g_.nodes[i].inputs) readers_[static_cast<size_t>(t)].push_back(static_cast<int>(i));
    }
  }

  Graph &g_;
  bool named_ = false;
  std::set<std::string> names_, node_names_;
  std::vector<int> producer_;
  std::vector<std::vector<int>> readers_;
  std::set<int> touched_, dead_;
  std::map<int, std::vector<Node>> before_;
  int removed_ = 0;
};

// The scope of a node name: "h.0.attn.bmm" -> "h.0.attn".
std::string scope(const std::string &name) {
  const size_t dot = name.rfind('.');
  return dot == std::string::npos ? name : name.substr(0, dot);
}

bool near(double v, double ref, double rel) { return std::fabs(v - ref) <= rel * std::fabs(ref); }

// Binary node n with operands (a, b) in either order such that pred(a, b).
bool either(const Node *n, const std::function<bool(int, int)> &pred) {
  if (!n || n->inputs.size() != 2) return false;
  return pred(n->inputs[0], n->inputs[1]) || pred(n->inputs[1], n->inputs[0]);
}

bool is_perm(const Node *n, std::vector<int64_t> perm) { return n && n->attr_ints("perm") == perm; }

// The last dim: attribute value v on a tensor of rank r.
bool is_last(int64_t v, size_t r) { return v == -1 || v == static_cast<int64_t>(r) - 1; }

struct Report {
  std::vector<std::string> fused, left;
  std::map<std::string, int> counts;
  // The fused node `name` (in `block`) replaces `nodes`.
  void done(const std::string &pattern, const std::string &name, int block, const std::vector<const Node *> &nodes) {
    ++counts[pattern];
    std::string list;
    for (const Node *n : nodes) list += (list.empty() ? "" : ", ") + n->name;
    fused.push_back(strformat("%s in block %d fused: '%s' replaces %zu nodes (%s)", pattern.c_str(), block,
                              name.c_str(), nodes.size(), list.c_str()));
  }
  void skip(const std::string &pattern, const Node &at, const std::string &why) {
    left.push_back(strformat("%s in block %d not fused: %s (at node '%s')", pattern.c_str(), at.block, why.c_str(),
                             at.name.c_str()));
  }
};

// A constant cut by prefix slices (start 0, step 1) and reshapes that only
// add or drop size-1 dims: the Const, or -1 when t is something else.
int const_prefix(const Fuser &f, int t, std::string &why) {
  for (;;) {
    const Tensor &x = f.T(t);
    if (x.role == Role::Const) {
      if (x.dtype != CTR_DTYPE_F32) {
        why = strformat("%s is not f32", f.g().describe_tensor(t).c_str());
        return -1;
      }
      return t;
    }
    const Node *n = f.prod(t);
    if (n && n->op == "slice" && n->attr_int("start", 0) == 0 && n->attr_int("step", 1) == 1) {
      t = n->inputs[0];
      continue;
    }
    if (n && n->op == "reshape") {
      auto big = [](const Shape &s) {
        Shape o;
        for (int64_t d : s)
          if (d != 1) o.push_back(d);
        return o;
      };
      if (big(f.S(n->inputs[0])) == big(f.S(t))) {
        t = n->inputs[0];
        continue;
      }
    }
    why = strformat("%s is not a constant (or a prefix slice of one)", f.g().describe_tensor(t).c_str());
    return -1;
  }
}

// ---------------------------------------------------------------------------
// RoPE, rotate-half form:
//   add(mul(x, cos), mul(cat(neg(slice(x, D/2..D)), slice(x, 0..D/2), -1), sin))
// with x [B,H,T,D] or [B,T,H,D] and cos/sin tables [max, D] (cat(f, f)) cut to T.

// theta with table(t, j) = cos/sin(t theta^(-2i/D)), i = j mod D/2, over every
// stored row of `cols` columns (D: both halves, as rotate-half tables are; D/2:
// one column per pair, as the complex form's are), or a reason. Within 1e-5 plus
// 2^-22 |angle|: torch builds the angles in float32, whose round-off grows with
// the position (about 1.5e-4 at row 4096), which a fixed bound would refuse.
bool rope_theta(const Fuser &f, int cos_c, int sin_c, int64_t D, int64_t cols, double &theta, std::string &why) {
  const std::vector<float> c = f.values(cos_c), s = f.values(sin_c);
  if (c.size() != s.size() || c.size() % static_cast<size_t>(cols) != 0 ||
      c.size() < 2 * static_cast<size_t>(cols)) {
    why = "the cos and sin tables differ in shape";
    return false;
  }
  const int64_t rows = static_cast<int64_t>(c.size()) / cols, half = D / 2;
  theta = 10000.0;  // any value serves when D == 2: the one frequency is 1
  if (half > 1) {
    // The slowest frequency theta^(-2(h-1)/D), read at the last row whose angle
    // is still below pi/2 (atan2 unambiguous, most digits).
    const int64_t i = half - 1;
    double freq = std::atan2(static_cast<double>(s[cols + i]), static_cast<double>(c[cols + i]));
    for (int64_t t = rows - 1; t > 1; --t)
      if (t * freq < 1.5) {
        freq = std::atan2(static_cast<double>(s[t * cols + i]), static_cast<double>(c[t * cols + i])) / t;
        break;
      }
    if (!(freq > 0 && freq < 1)) {
      why = "the tables are not rotary angles";
      return false;
    }
    theta = std::exp(-std::log(freq) * static_cast<double>(D) / (2.0 * static_cast<double>(i)));
    if (std::fabs(theta - std::round(theta)) < 1e-3 * theta) theta = std::round(theta);
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < cols; ++j) {
      const double ang = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(j % half) / D);
      const double tol = 1e-5 + std::ldexp(ang, -22);
      if (std::fabs(c[t * cols + j] - std::cos(ang)) > tol || std::fabs(s[t * cols + j] - std::sin(ang)) > tol) {
        why = strformat("the rotary tables differ from theta=%g at row %lld, column %lld", theta,
                        static_cast<long long>(t), static_cast<long long>(j));
        return false;
      }
    }
  return true;
}

// The table tensor tab broadcast against x [a0, a1, a2, D]: the axis (1 or 2)
// holding T, with every other axis but the last of size 1; -1 when not.
int table_axis(const Shape &x, const Shape &tab) {
  if (tab.size() > 4 || tab.empty() || tab.back() != x[3]) return -1;
  Shape p(4 - tab.size(), 1);
  p.insert(p.end(), tab.begin(), tab.end());
  int axis = -1;
  for (int a = 0; a < 3; ++a) {
    if (p[a] == 1) continue;
    if (axis >= 0 || a == 0 || p[a] != x[a]) return -1;
    axis = a;
  }
  return axis;
}

// The axis (1 or 2) of x [a0, a1, a2, w] along which table tab runs over the
// positions. One position (T = 1) leaves the cut table no positions axis; the
// stored one's, where the cut kept the rank, says which axis it is.
int positions_axis(const Fuser &f, const Shape &xs, int tab) {
  int a = table_axis(xs, f.S(tab));
  std::string w;
  const int c = a < 0 ? const_prefix(f, tab, w) : -1;
  if (c >= 0 && f.S(c).size() == f.S(tab).size()) {
    const Shape &k = f.S(c);
    const int b = table_axis({xs[0], k.size() > 2 ? k[k.size() - 3] : 1, k.size() > 1 ? k[k.size() - 2] : 1, xs[3]}, k);
    if (b > 0 && xs[b] == 1) a = b;
  }
  return a;
}

// The rope node in place of a matched pattern: rope(x) on x as [B, T, H*D],
// its result handed to `out` ([B,T,H,D], [B,H,T,D] when head_major, or
// [B,T,H,D/2,2] when interleaved) through reshapes and a transpose. Returns the
// rope node's name.
std::string emit_rope(Fuser &f, int x, int out, const Node &root, bool head_major, bool interleaved, int64_t B, int64_t Tn,
               int64_t H, int64_t D, double theta) {
  const int at = f.index_of(&root), block = root.block;
  const std::string base = f.node_name(scope(root.name) + ".rope");
  int xt = x;  // x with positions before heads
  if (head_major) {
    const Node *tr = f.prod(x, "transpose");
    if (tr && is_perm(tr, {0, 2, 1, 3})) {
      xt = tr->inputs[0];
    } else {
      xt = f.tensor(base + ".in", {B, Tn, H, D});
      f.emit(at, "transpose", base + ".in", {x}, {xt}, block, {{"perm", Attr::of_ints({0, 2, 1, 3})}});
    }
  }
  const int xr = f.flat(xt, at, block, H * D);
  const int r = f.tensor(base, {B, Tn, H * D});
  std::map<std::string, Attr> attrs = {{"heads", Attr::of_int(H)}, {"theta", Attr::of_float(theta)}};
  if (interleaved) attrs["interleaved"] = Attr::of_int(1);
  f.emit(at, "rope", base, {xr}, {r}, block, std::move(attrs));
  const Attr split = Attr::of_ints(interleaved ? Shape{0, 0, H, D / 2, 2} : Shape{0, 0, H, D});
  if (head_major) {
    const int r4 = f.tensor(base + ".heads", {B, Tn, H, D});
    f.emit(at, "reshape", base + ".heads", {r}, {r4}, block, {{"shape", split}});
    f.emit(at, "transpose", base + ".out", {r4}, {out}, block, {{"perm", Attr::of_ints({0, 2, 1, 3})}});
  } else {
    f.emit(at, "reshape", base + ".out", {r}, {out}, block, {{"shape", split}});
  }
  return base;
}

// ---------------------------------------------------------------------------
// RoPE, complex form (Meta's Llama: view_as_complex, multiply by polar(1, angles),
// view_as_real), which rotates interleaved pairs (2i, 2i+1). As ctr_export writes it:
//   X5 = reshape(x) [B,T,H,D/2,2]; re, im = reshape(slice(X5, last dim, 0..1 | 1..2)) [B,T,H,D/2]
//   cat(reshape(re*c - im*s), reshape(re*s + im*c), -1) [B,T,H,D/2,2]
// with c, s the table's real and imaginary parts, [max, D/2] constants cut to T
// -> rope(x) heads=H theta interleaved=1. Returns false when cat does not
// start the pattern at all; a candidate that fails a check is reported.

bool fuse_complex_rope(Fuser &f, Report &rep, const Node &cat) {
  const Shape &cs = f.S(cat.outputs[0]);
  if (cat.inputs.size() != 2 || cs.size() != 5 || cs[4] != 2 || !is_last(cat.attr_int("dim", 0), 5)) return false;
  const Shape xs = {cs[0], cs[1], cs[2], cs[3]}, piece = {cs[0], cs[1], cs[2], cs[3], 1};
  const Node *r_re = f.prod(cat.inputs[0], "reshape"), *r_im = f.prod(cat.inputs[1], "reshape");
  const Node *sub = r_re ? f.prod(r_re->inputs[0], "sub") : nullptr;
  const Node *add = r_im ? f.prod(r_im->inputs[0], "add") : nullptr;
  if (!sub || !add) return false;
  // lane(t): t = reshape(slice(X5, last dim, k..k+1)) [B,T,H,D/2] of X5 [B,T,H,D/2,2]; sets X5 and k.
  std::vector<const Node *> nodes = {&cat, r_re, r_im, sub, add};
  auto lane = [&](int t, int &x5, int &k) {
    const Node *r = f.prod(t, "reshape");
    const Node *sl = r ? f.prod(r->inputs[0], "slice") : nullptr;
    if (!sl || f.S(t) != xs || f.S(sl->inputs[0]) != cs || !is_last(sl->attr_int("dim", 0), 5)) return false;
    if (sl->attr_int("step", 1) != 1 || (sl->has_attr("end") && sl->attrs.at("end").type != Attr::Int)) return false;
    int64_t start = sl->attr_int("start", 0), end = sl->attr_int("end", 2);
    start = start < 0 ? start + 2 : start;
    end = end < 0 ? end + 2 : std::min<int64_t>(end, 2);
    if (end != start + 1 || (start != 0 && start != 1)) return false;
    x5 = sl->inputs[0];
    k = static_cast<int>(start);
    nodes.insert(nodes.end(), {sl, r});
    return true;
  };
  // m = mul(lane k of X5, table): the table, or -1.
  int x5 = -1;
  auto term = [&](int t, int k) {
    const Node *m = f.prod(t, "mul");
    int tab = -1;
    either(m, [&](int a, int b) {
      int xa = -1, ka = -1;
      const size_t mark = nodes.size();
      if (!lane(a, xa, ka) || ka != k || (x5 >= 0 && xa != x5)) {
        nodes.resize(mark);
        return false;
      }
      x5 = xa;
      tab = b;
      return true;
    });
    if (tab >= 0) nodes.push_back(m);
    return tab;
  };
  // re*c - im*s, and re*s + im*c in either order.
  const int c1 = term(sub->inputs[0], 0), s1 = c1 < 0 ? -1 : term(sub->inputs[1], 1);
  int s2 = -1, c2 = -1;
  if (s1 >= 0) {
    const size_t mark = nodes.size();
    for (int o = 0; o < 2 && c2 < 0; ++o) {
      nodes.resize(mark);
      s2 = term(add->inputs[o], 0);
      c2 = s2 < 0 ? -1 : term(add->inputs[1 - o], 1);
    }
  }
  if (c2 < 0) return false;
  // Each lane is read by two products: list its nodes once.
  std::vector<const Node *> once;
  for (const Node *n : nodes)
    if (std::find(once.begin(), once.end(), n) == once.end()) once.push_back(n);
  nodes = std::move(once);
  // The candidate: from here on, a failure is reported.
  std::string why;
  const int64_t B = cs[0], Tn = cs[1], H = cs[2], h = cs[3], D = 2 * h;
  int cc = -1, sc = -1;
  double theta = 0;
  auto same_table = [&](int a, int b, int &c) {
    std::string w;
    c = const_prefix(f, a, why);
    return c >= 0 && const_prefix(f, b, w) == c && f.S(a) == f.S(b);
  };
  for (const Node *n : {r_re, r_im})
    if (why.empty() && f.S(n->inputs[0]) != xs) why = "the real and imaginary parts are not [B, T, H, D/2]";
  if (why.empty() && (f.S(cat.inputs[0]) != piece || f.S(cat.inputs[1]) != piece))
    why = "the real and imaginary parts are not each put as one lane of the last dim";
  if (why.empty() && (!same_table(c1, c2, cc) || !same_table(s1, s2, sc)) && why.empty())
    why = "the real part's table (or the imaginary part's) differs between the products";
  if (why.empty()) {
    const int axis = positions_axis(f, xs, c1);
    if (axis != 1 || positions_axis(f, xs, s1) != 1)
      why = "the tables do not broadcast as [T, D/2] over the positions of [B, T, H, D/2]";
  }
  if (why.empty()) {
    Shape big;
    for (int64_t d : f.S(cc))
      if (d != 1) big.push_back(d);
    if (big.size() != 2 || big[1] != h) why = "the stored tables are not [max_seq, head_dim/2]";
  }
  if (why.empty()) rope_theta(f, cc, sc, D, h, theta, why);
  if (why.empty()) f.self_contained(nodes, cat.outputs[0], why);
  if (!why.empty()) {
    rep.skip("rope", cat, why);
    return true;
  }
  rep.done("rope", emit_rope(f, x5, cat.outputs[0], cat, false, true, B, Tn, H, D, theta), cat.block, nodes);
  f.replace(nodes);
  return true;
}

void fuse_rope(Fuser &f, Report &rep) {
  const size_t nn = f.g().nodes.size();
  for (size_t ni = 0; ni < nn; ++ni) {
    const Node &cat = f.g().nodes[ni];
    if (cat.op != "cat" || cat.inputs.size() != 2) continue;
    if (fuse_complex_rope(f, rep, cat)) continue;
    const Shape &cs = f.S(cat.outputs[0]);
    if (cs.size() != 4 || !is_last(cat.attr_int("dim", 0), 4) || cs[3] % 2 != 0) continue;
    const int64_t D = cs[3], half = D / 2;
    const Node *neg = f.prod(cat.inputs[0], "neg");
    const Node *s2 = neg ? f.prod(neg->inputs[0], "slice") : nullptr;
    const Node *s1 = f.prod(cat.inputs[1], "slice");
    if (!s1 || !s2 || s1->inputs[0] != s2->inputs[0]) continue;
    const int x = s1->inputs[0];
    // s takes columns [a, b) of x's last dim (an end past D means to the end).
    auto cut = [&](const Node *s, int64_t a, int64_t b) {
      int64_t end = D;
      if (s->has_attr("end")) {
        if (s->attrs.at("end").type != Attr::Int) return false;
        end = s->attr_int("end", D);
        end = end < 0 ? end + D : std::min(end, D);
      }
      int64_t start = s->attr_int("start", 0);
      start = start < 0 ? start + D : start;
      return is_last(s->attr_int("dim", 0), 4) && start == a && s->attr_int("step", 1) == 1 && end == b;
    };
    if (f.S(x) != cs || !cut(s1, 0, half) || !cut(s2, half, D)) continue;
    // The candidate: from here on, a failure is reported.
    const Node *m2 = f.sole_reader(cat.outputs[0]);
    int sin_t = -1, cos_t = -1;
    const Node *add = nullptr, *m1 = nullptr;
    std::string why;
    if (m2 && m2->op == "mul") {
      sin_t = m2->inputs[0] == cat.outputs[0] ? m2->inputs[1] : m2->inputs[0];
      add = f.sole_reader(m2->outputs[0]);
      if (add && add->op == "add")
        either(add, [&](int a, int b) {
          const Node *m = f.prod(a, "mul");
          if (b != m2->outputs[0] || !m) return false;
          return either(m, [&](int xx, int c) {
            if (xx != x) return false;
            m1 = m;
            cos_t = c;
            return true;
          });
        });
    }
    if (!m1) {
      rep.skip("rope", cat, "the rotated half is not combined as x*cos + rotate_half(x)*sin");
      continue;
    }
    const int axis = positions_axis(f, cs, cos_t);
    if (axis < 0 || positions_axis(f, cs, sin_t) != axis || f.S(add->outputs[0]) != cs) {
      rep.skip("rope", cat, "the cos/sin tables do not broadcast as [T, D] over the positions");
      continue;
    }
    const int cc = const_prefix(f, cos_t, why), sc = cc < 0 ? -1 : const_prefix(f, sin_t, why);
    double theta = 0;
    std::vector<const Node *> nodes = {s1, s2, neg, &cat, m2, m1, add};
    if (sc < 0 || !rope_theta(f, cc, sc, D, D, theta, why) || !f.self_contained(nodes, add->outputs[0], why)) {
      rep.skip("rope", cat, why);
      continue;
    }
    // The stored tables must be [max, D] (size-1 dims aside) so that row t of
    // the cut table is row t of the constant.
    Shape big;
    for (int64_t d : f.S(cc)) if (d != 1) big.push_back(d);
    if (big.size() != 2 || big[1] != D) {
      rep.skip("rope", cat, "the stored tables are not [max_seq, head_dim]");
      continue;
    }
    // x is [B,H,T,D] when the table's positions run along axis 2, else [B,T,H,D].
    const bool head_major = axis == 2;
    const int64_t B = cs[0], Tn = cs[axis], H = cs[head_major ? 1 : 2];
    rep.done("rope", emit_rope(f, x, add->outputs[0], *add, head_major, false, B, Tn, H, D, theta), add->block,
             nodes);
    f.replace(nodes);
  }
  f.commit();
}

// ---------------------------------------------------------------------------
// Causal attention:
//   q4 = transpose(Xq, 0,2,1,3)                    [B,H,T,D] from [B,T,H,D]
//   kT = transpose(k4, 0,1,3,2) or transpose(Xk, 0,2,3,1)
//   s = matmul(q4, kT) [* c | / c]; masked_fill(s, M, -inf) or s + M; softmax(-1)
//   out = reshape(transpose(matmul(p, v4), 0,2,1,3), [B,T,H*D])
// k4/v4 may repeat kv heads (repeat_kv / repeat_interleave: reshape, expand, reshape).

// Where a [B,h,T,D] operand comes from: base holds its values as [B,T,heads,D]
// (or as [B,heads,T,D] when head_major: a transpose is still needed).
struct Heads {
  int base = -1;
  bool head_major = false;
  int64_t heads = 0;
  std::vector<const Node *> nodes;  // consumed on the way
};

Heads token_major(const Fuser &f, int y);

// t is [B, h, T, D].
Heads head_major(const Fuser &f, int t) {
  const Shape &s = f.S(t);
  if (const Node *tr = f.prod(t, "transpose"); tr && is_perm(tr, {0, 2, 1, 3})) {
    Heads h = token_major(f, tr->inputs[0]);
    h.nodes.push_back(tr);
    return h;
  }
  // repeat_interleave over heads: U [B,k,T,D] -> [B,k,1,T,D] -> expand [B,k,r,T,D] -> [B,k*r,T,D].
  if (const Node *r2 = f.prod(t, "reshape")) {
    const Node *ex = f.prod(r2->inputs[0], "expand");
    const Node *r1 = ex ? f.prod(ex->inputs[0], "reshape") : nullptr;
    if (r1) {
      const Shape &u = f.S(r1->inputs[0]), &e = f.S(ex->outputs[0]);
      const int64_t k = u.size() == 4 ? u[1] : 0;
      if (k > 0 && f.S(r1->outputs[0]) == Shape{s[0], k, 1, s[2], s[3]} && e.size() == 5 &&
          e == Shape{s[0], k, e[2], s[2], s[3]} && k * e[2] == s[1] && u == Shape{s[0], k, s[2], s[3]}) {
        Heads h = head_major(f, r1->inputs[0]);
        if (h.heads == k) {
          h.nodes.insert(h.nodes.end(), {r1, ex, r2});
          return h;
        }
      }
    }
  }
  return Heads{t, true, s[1], {}};
}

// y is [B, T, h, D].
Heads token_major(const Fuser &f, int y) {
  const Shape &s = f.S(y);
  // repeat_kv: X [B,T,k,D] -> [B,T,k,1,D] -> expand [B,T,k,r,D] -> [B,T,k*r,D].
  if (const Node *r2 = f.prod(y, "reshape")) {
    const Node *ex = f.prod(r2->inputs[0], "expand");
    const Node *r1 = ex ? f.prod(ex->inputs[0], "reshape") : nullptr;
    if (r1) {
      const Shape &x = f.S(r1->inputs[0]), &e = f.S(ex->outputs[0]);
      const int64_t k = x.size() == 4 ? x[2] : 0;
      if (k > 0 && x == Shape{s[0], s[1], k, s[3]} && f.S(r1->outputs[0]) == Shape{s[0], s[1], k, 1, s[3]} &&
          e.size() == 5 && e == Shape{s[0], s[1], k, e[3], s[3]} && k * e[3] == s[2])
        return Heads{r1->inputs[0], false, k, {r1, ex, r2}};
    }
  }
  return Heads{y, false, s[2], {}};
}

// M (through prefix slices of a Const) is causal for T: checked over the
// whole stored constant. additive: 0 on and below the diagonal, -inf (or
// <= -1e30) above; else nonzero exactly above the diagonal. Or a causal sliding
// window: row i sees keys i - W < j <= i only (masked left of them as above it);
// W, read off the last stored row, is set in *window (0: plain causal, also when
// the window covers every stored row).
bool causal_mask(const Fuser &f, int m, int64_t Tn, bool additive, int64_t *window, std::string &why) {
  const Shape &ms = f.S(m);
  if (ms.size() < 2 || ms[ms.size() - 1] != Tn || ms[ms.size() - 2] != Tn) {
    why = strformat("the mask has shape %s, not [..., T, T]", shape_string(ms).c_str());
    return false;
  }
  for (size_t a = 0; a + 2 < ms.size(); ++a)
    if (ms[a] != 1) {
      why = "the mask differs between batch entries or heads";
      return false;
    }
  const int c = const_prefix(f, m, why);
  if (c < 0) return false;
  const Shape &cs = f.S(c);
  if (cs.size() < 2) {
    why = "the mask constant has fewer than 2 dims";
    return false;
  }
  const int64_t R = cs[cs.size() - 2], C = cs.back();
  if (R * C != f.T(c).numel()) {
    why = "the mask constant holds more than one [T, T] plane";
    return false;
  }
  const std::vector<float> v = f.values(c);
  auto masked = [&](int64_t i, int64_t j, bool &ok) {
    const float x = v[static_cast<size_t>(i * C + j)];
    ok = additive ? (x == 0.0f || x <= -1e30f) : true;
    return additive ? x <= -1e30f : x != 0.0f;
  };
  int64_t W = 0;
  if (R > 0 && R <= C) {
    bool ok = true;
    int64_t j0 = 0;
    while (j0 < R - 1 && masked(R - 1, j0, ok)) ++j0;
    if (j0 > 0) W = R - j0;
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) {
      bool ok = true;
      const bool hidden = j > i || (W > 0 && i - j >= W);
      if (masked(i, j, ok) != hidden || !ok) {
        const float x = v[static_cast<size_t>(i * C + j)];
        why = strformat("the mask is not causal%s (%s[%lld, %lld] = %g)",
                        W > 0 ? strformat(" with a sliding window of %lld", static_cast<long long>(W)).c_str() : "",
                        f.T(c).name.c_str(), static_cast<long long>(i), static_cast<long long>(j),
                        static_cast<double>(x));
        return false;
      }
    }
  *window = W;
  return true;
}

// torch.nn's multi_head_attention_forward: the heads folded into the batch dim
// and the tokens time-major, x* being [T, B, E] (E = H*D):
//   q = transpose(reshape(xq, [T, B*H, D]), 1,0,2)          (times a constant scale)
//   s = matmul(q, transpose(reshape(xk, [T, B*H, D]), 1,2,0))
//   o = matmul(softmax(s + mask), transpose(reshape(xv, [T, B*H, D]), 1,0,2))
//   out = reshape(transpose(o, 1,0,2), [T*B, E])
// becomes the fused attention on [B, T, E] views of xq, xk and xv (transposes
// of the time-major tensors) and its output transposed back to time-major. The
// mask, soft-capping and score scale were read by fuse_attention already.
void fold_heads(Fuser &f, Report &rep, const Node &sm, const Node *qk, const Node *pv, int64_t Tn, double scale,
                double softcap, int m, bool additive, std::string why, std::vector<const Node *> nodes) {
  const Shape &ps = f.S(sm.outputs[0]);
  int64_t B = 0, H = 0, D = 0;
  // t = transpose(reshape(x [T, B, E], [T, B*H, D])): x, or -1.
  auto unfold = [&](const Node *tr, std::vector<int64_t> perm, const char *what) -> int {
    if (!why.empty()) return -1;
    const Node *r = tr && is_perm(tr, std::move(perm)) ? f.prod(tr->inputs[0], "reshape") : nullptr;
    const Shape *xs = r ? &f.S(r->inputs[0]) : nullptr, *rs = r ? &f.S(r->outputs[0]) : nullptr;
    if (!r || xs->size() != 3 || rs->size() != 3 || (*xs)[0] != Tn || (*rs)[0] != Tn || (*rs)[2] <= 0 ||
        (*xs)[2] % (*rs)[2] != 0 || (*xs)[1] * ((*xs)[2] / (*rs)[2]) != (*rs)[1]) {
      why = strformat("the %s are not the heads of a [T, B, H*D] tensor folded into the batch dim (reshape to "
                      "[T, B*H, D], then transpose)",
                      what);
      return -1;
    }
    const int64_t b = (*xs)[1], h = (*xs)[2] / (*rs)[2], d = (*rs)[2];
    if (B == 0) {
      B = b, H = h, D = d;
    } else if (b != B || h != H || d != D) {
      why = "queries, keys and values differ in batch, heads or head size";
      return -1;
    }
    nodes.insert(nodes.end(), {tr, r});
    return r->inputs[0];
  };
  // A constant scale on the queries (torch.nn scales q before the product).
  int qt = qk->inputs[0];
  if (const Node *mq = f.prod(qt, "mul"); mq && scale == 1.0) {
    double c = 0;
    int y = -1;
    either(mq, [&](int a, int b) { return f.scalar(b, c) && (y = a, true); });
    if (y >= 0 && c != 0) {
      scale = c;
      nodes.push_back(mq);
      qt = y;
    }
  }
  const int xq = unfold(f.prod(qt, "transpose"), {1, 0, 2}, "queries");
  const int xk = unfold(f.prod(qk->inputs[1], "transpose"), {1, 2, 0}, "keys");
  const int xv = unfold(f.prod(pv->inputs[1], "transpose"), {1, 0, 2}, "values");
  const Node *ot = f.sole_reader(pv->outputs[0]);
  const Node *out = ot && ot->op == "transpose" && is_perm(ot, {1, 0, 2}) ? f.sole_reader(ot->outputs[0]) : nullptr;
  const int64_t E = H * D;
  if (why.empty() && ps[0] != B * H) why = "the scores' batch dim is not the batch times the heads";
  if (why.empty() &&
      (!out || out->op != "reshape" || f.T(out->outputs[0]).numel() != Tn * B * E || f.S(out->outputs[0]).back() != E ||
       (f.S(out->outputs[0]).size() != 2 && f.S(out->outputs[0]) != Shape{Tn, B, E})))
    why = "the output is not put back as [T*B, H*D] or [T, B, H*D] by transpose + reshape";
  if (why.empty()) nodes.insert(nodes.end(), {ot, out});
  int64_t window = 0;
  if (why.empty()) causal_mask(f, m, Tn, additive, &window, why);
  if (why.empty()) f.self_contained(nodes, out->outputs[0], why);
  if (!why.empty()) {
    rep.skip("attention", sm, why);
    return;
  }
  const int at = f.index_of(out), block = sm.block;
  const std::string base = f.node_name(scope(qk->name) + ".attention");
  auto swap = [&](int x, const std::string &what, Shape shape) {
    const int y = f.tensor(base + "." + what, std::move(shape));
    f.emit(at, "transpose", base + "." + what, {x}, {y}, block, {{"perm", Attr::of_ints({1, 0, 2})}});
    return y;
  };
  const int qi = swap(xq, "q", {B, Tn, E}), ki = swap(xk, "k", {B, Tn, E}), vi = swap(xv, "v", {B, Tn, E});
  const int o = f.tensor(base + ".out", {B, Tn, E});
  std::map<std::string, Attr> attrs = {{"heads", Attr::of_int(H)},
                                       {"kv_heads", Attr::of_int(H)},
                                       {"causal", Attr::of_int(1)},
                                       {"scale", Attr::of_float(scale)}};
  if (window > 0) attrs["window"] = Attr::of_int(window);
  if (softcap > 0) attrs["softcap"] = Attr::of_float(softcap);
  f.emit(at, "attention", base, {qi, ki, vi}, {o}, block, std::move(attrs));
  const int tm = swap(o, "time_major", {Tn, B, E});
  f.emit(at, "reshape", base + ".rows", {tm}, {out->outputs[0]}, block, out->attrs);
  rep.done("attention", base, block, nodes);
  f.replace(nodes);
}

void fuse_attention(Fuser &f, Report &rep) {
  const size_t nn = f.g().nodes.size();
  for (size_t ni = 0; ni < nn; ++ni) {
    const Node &sm = f.g().nodes[ni];
    if (sm.op != "softmax" || !is_last(sm.attr_int("dim", -1), f.S(sm.outputs[0]).size())) continue;
    const Shape &ps = f.S(sm.outputs[0]);
    // Attention-like: probabilities over the last dim multiplied by something. Each of
    // these the pass leaves gets a reason in the report.
    const Node *reader = f.sole_reader(sm.outputs[0]);
    const bool like = reader && reader->op == "matmul" && reader->inputs[0] == sm.outputs[0];
    // Heads folded into the batch dim, tokens time-major: torch.nn's
    // multi_head_attention_forward (see fold_heads).
    const bool folded = ps.size() == 3;
    if (ps.size() != 4 && !(folded && like)) {
      if (like) rep.skip("attention", sm, strformat("the scores are %s, not [B, H, T, T]", shape_string(ps).c_str()));
      continue;
    }
    const int64_t Tn = ps[ps.size() - 2];
    int64_t B = folded ? 0 : ps[0], H = folded ? 0 : ps[1];
    // Walk back from the softmax: mask, scale, scores.
    std::vector<const Node *> nodes = {&sm};
    const Node *mask = f.prod(sm.inputs[0]);
    int scores = -1, m = -1;
    bool additive = false;
    std::string why;
    if (mask && mask->op == "masked_fill") {
      const double v = mask->attr_float("value", 0);
      if (!(v <= -1e30)) why = strformat("the masked value is %g, not -inf or <= -1e30", v);
      scores = mask->inputs[0];
      m = mask->inputs[1];
    } else if (mask && mask->op == "add") {
      additive = true;
      either(mask, [&](int a, int b) {
        std::string w;
        if (const_prefix(f, b, w) < 0) return false;
        scores = a;
        m = b;
        return true;
      });
    }
    if (scores < 0) {
      if (like)
        rep.skip("attention", sm,
                 mask ? strformat("the scores reach the softmax through %s, not a mask (masked_fill or the add of "
                                  "a constant)", mask->op.c_str())
                      : std::string("the scores are not masked: the fused attention is causal"));
      continue;
    }
    nodes.push_back(mask);
    // Logit soft-capping (Gemma-2's): mul(tanh(s / c), c), the division by c also as a
    // product with 1/c (within 1e-6 relative), becomes the fused op's softcap = c.
    double softcap = 0.0;
    if (const Node *cm = f.prod(scores); cm && cm->op == "mul") {
      double c = 0, inv = 0;
      int th = -1, x = -1;
      either(cm, [&](int a, int b) { return f.scalar(b, c) && (th = a, true); });
      const Node *tn = th >= 0 ? f.prod(th, "tanh") : nullptr;
      const Node *dv = tn ? f.prod(tn->inputs[0]) : nullptr;
      if (dv && dv->op == "div" && f.scalar(dv->inputs[1], inv) && inv != 0) {
        inv = 1.0 / inv;
        x = dv->inputs[0];
      } else if (dv && dv->op == "mul") {
        either(dv, [&](int a, int b) { return f.scalar(b, inv) && (x = a, true); });
      }
      if (x >= 0 && c > 0 && near(inv * c, 1.0, 1e-6)) {
        softcap = c;
        nodes.insert(nodes.end(), {cm, tn, dv});
        scores = x;
      }
    }
    double scale = 1.0;
    const Node *sc = f.prod(scores);
    if (sc && (sc->op == "mul" || sc->op == "div")) {
      double c = 0;
      int y = -1;
      if (sc->op == "div" && f.scalar(sc->inputs[1], c)) y = sc->inputs[0];
      if (sc->op == "mul") either(sc, [&](int a, int b) { return f.scalar(b, c) && (y = a, true); });
      if (y >= 0 && c != 0) {
        scale = sc->op == "mul" ? c : 1.0 / c;
        nodes.push_back(sc);
        scores = y;
      }
    }
    const Node *qk = f.prod(scores, "matmul");
    const Node *pv = f.sole_reader(sm.outputs[0]);
    if (!qk || f.S(qk->inputs[0]).size() != ps.size() || f.S(qk->outputs[0]) != ps) {
      if (!like) continue;
      const Node *p = f.prod(scores);
      const Node *p2 = p && p->op == "mul" ? f.prod(p->inputs[0]) : p;
      if (p2 && p2->op == "tanh")
        rep.skip("attention", sm,
                 strformat("the scores pass through tanh (node '%s') otherwise than as logit soft-capping "
                           "c*tanh(s/c) with one constant c",
                           p2->name.c_str()));
      else
        rep.skip("attention", sm,
                 strformat("the masked scores come from %s, not from the product of queries and keys "
                           "(optionally scaled by a constant)",
                           p ? ("'" + p->name + "' (" + p->op + ")").c_str() : "a graph input"));
      continue;
    }
    if (!pv || pv->op != "matmul" || pv->inputs[0] != sm.outputs[0] || f.S(pv->inputs[1]).size() != ps.size()) {
      rep.skip("attention", sm, "the probabilities are not multiplied by the values alone");
      continue;
    }
    nodes.insert(nodes.end(), {qk, pv});
    if (folded) {
      fold_heads(f, rep, sm, qk, pv, Tn, scale, softcap, m, additive, std::move(why), std::move(nodes));
      continue;
    }
    const int64_t D = f.S(qk->inputs[0])[3];
    const Node *ot = f.sole_reader(pv->outputs[0]);
    const Node *out = ot && ot->op == "transpose" && is_perm(ot, {0, 2, 1, 3}) ? f.sole_reader(ot->outputs[0]) : nullptr;
    if (!out || out->op != "reshape" || f.S(out->outputs[0]) != Shape{B, Tn, H * D}) {
      rep.skip("attention", sm, "the output is not put back as [B, T, H*D] by transpose + reshape");
      continue;
    }
    nodes.insert(nodes.end(), {ot, out});
    // The operands.
    Heads q = head_major(f, qk->inputs[0]), k;
    const Node *kt = f.prod(qk->inputs[1], "transpose");
    if (kt && is_perm(kt, {0, 1, 3, 2}))
      k = head_major(f, kt->inputs[0]);
    else if (kt && is_perm(kt, {0, 2, 3, 1}))
      k = token_major(f, kt->inputs[0]);
    else
      kt = nullptr;
    if (!kt) {
      rep.skip("attention", sm, "the keys are not transposed for the product");
      continue;
    }
    nodes.push_back(kt);
    Heads v = head_major(f, pv->inputs[1]);
    for (const Heads *h : {&q, &k, &v}) nodes.insert(nodes.end(), h->nodes.begin(), h->nodes.end());
    if (why.empty() && (q.heads != H || k.heads != v.heads || H % k.heads != 0))
      why = strformat("query heads %lld, key heads %lld and value heads %lld do not group", static_cast<long long>(q.heads),
                      static_cast<long long>(k.heads), static_cast<long long>(v.heads));
    if (why.empty() && (f.S(pv->inputs[1]) != Shape{B, H, Tn, D} || f.S(qk->inputs[0]) != Shape{B, H, Tn, D}))
      why = "queries, keys and values differ in batch, length or head size";
    int64_t window = 0;
    if (why.empty()) causal_mask(f, m, Tn, additive, &window, why);
    if (why.empty()) f.self_contained(nodes, out->outputs[0], why);
    if (!why.empty()) {
      rep.skip("attention", sm, why);
      continue;
    }
    const int at = f.index_of(out), block = sm.block;
    const std::string base = f.node_name(scope(qk->name) + ".attention");
    auto operand = [&](const Heads &h, const char *what) {
      int x = h.base;
      if (h.head_major) {
        x = f.tensor(base + "." + what, {B, Tn, h.heads, D});
        f.emit(at, "transpose", base + "." + what, {h.base}, {x}, block, {{"perm", Attr::of_ints({0, 2, 1, 3})}});
      }
      return f.flat(x, at, block, h.heads * D);
    };
    const int qi = operand(q, "q"), ki = operand(k, "k"), vi = operand(v, "v");
    std::map<std::string, Attr> attrs = {{"heads", Attr::of_int(H)},
                                         {"kv_heads", Attr::of_int(k.heads)},
                                         {"causal", Attr::of_int(1)},
                                         {"scale", Attr::of_float(scale)}};
    if (window > 0) attrs["window"] = Attr::of_int(window);
    if (softcap > 0) attrs["softcap"] = Attr::of_float(softcap);
    f.emit(at, "attention", base, {qi, ki, vi}, {out->outputs[0]}, block, std::move(attrs));
    rep.done("attention", base, block, nodes);
    f.replace(nodes);
  }
  f.commit();
}

// ---------------------------------------------------------------------------
// RMSNorm: mul(mul(x, rsqrt(add(mean(pow(x, 2) | mul(x, x), -1, keepdim), eps))), w)

void fuse_rmsnorm(Fuser &f, Report &rep) {
  const size_t nn = f.g().nodes.size();
  for (size_t ni = 0; ni < nn; ++ni) {
    const Node &rs = f.g().nodes[ni];
    if (rs.op != "rsqrt") continue;
    const Node *add = f.prod(rs.inputs[0], "add");
    const Node *mean = nullptr;
    double eps = 0;
    either(add, [&](int a, int b) {
      mean = f.prod(a, "mean");
      return mean && f.scalar(b, eps);
    });
    if (!mean || !add) continue;
    const Node *sq = f.prod(mean->inputs[0]);
    int x = -1;
    if (sq && sq->op == "pow" && sq->attr_float("exponent", 0) == 2.0) x = sq->inputs[0];
    if (sq && sq->op == "mul" && sq->inputs[0] == sq->inputs[1]) x = sq->inputs[0];
    if (x < 0) continue;
    const Shape &xs = f.S(x);
    if (xs.empty()) continue;
    const auto dims = mean->attr_ints("dims");
    if (dims.size() != 1 || !is_last(dims[0], xs.size()) || mean->attr_int("keepdim", 0) != 1) continue;
    // The candidate.
    const Node *n1 = f.sole_reader(rs.outputs[0]);
    const Node *n2 = nullptr;
    int w = -1;
    if (n1 && n1->op == "mul" && (n1->inputs[0] == x || n1->inputs[1] == x) && f.S(n1->outputs[0]) == xs) {
      n2 = f.sole_reader(n1->outputs[0]);
      if (!n2 || n2->op != "mul")
        n2 = nullptr;
      else
        w = n2->inputs[0] == n1->outputs[0] ? n2->inputs[1] : n2->inputs[0];
    }
    std::string why;
    if (!n2)
      why = "the normalised x is not scaled by a weight";
    else if (f.S(w) != Shape{xs.back()} || f.S(n2->outputs[0]) != xs)
      why = strformat("the weight %s is not [%lld]", f.g().describe_tensor(w).c_str(),
                      static_cast<long long>(xs.back()));
    std::vector<const Node *> nodes = {sq, mean, add, &rs, n1, n2};
    if (why.empty()) f.self_contained(nodes, n2->outputs[0], why);
    if (!why.empty()) {
      rep.skip("rmsnorm", rs, why);
      continue;
    }
    const std::string name = f.node_name(scope(n2->name) + ".rmsnorm");
    f.emit(f.index_of(n2), "rmsnorm", name, {x, w}, {n2->outputs[0]}, n2->block, {{"eps", Attr::of_float(eps)}});
    rep.done("rmsnorm", name, n2->block, nodes);
    f.replace(nodes);
  }
  f.commit();
}

// ---------------------------------------------------------------------------
// SwiGLU: mul(silu(a), b) -> swiglu(a, b) = silu(a) * b

// Gated units: act(a) * b with a and b of one shape, act silu (SwiGLU -> swiglu) or
// gelu (GeGLU -> geglu, keeping the gelu's approximate attribute). GeGLU runs after
// fuse_gelu, so a GELU written out by hand is one op by then.
void fuse_gated(Fuser &f, Report &rep, const char *act, const char *fused) {
  const size_t nn = f.g().nodes.size();
  for (size_t ni = 0; ni < nn; ++ni) {
    const Node &si = f.g().nodes[ni];
    if (si.op != act) continue;
    // The product (the silu may be read elsewhere too: then reported).
    const Node *mul = nullptr;
    for (const Node *r : f.readers(si.outputs[0]))
      if (r->op == "mul" && !mul) mul = r;
    if (!mul) continue;
    const int a = si.inputs[0];
    const int b = mul->inputs[0] == si.outputs[0] ? mul->inputs[1] : mul->inputs[0];
    std::string why;
    if (b == si.outputs[0])
      why = strformat("%s(a) is multiplied by itself", act);
    else if (f.S(b) != f.S(a))
      why = strformat("the operands' shapes %s and %s differ", shape_string(f.S(a)).c_str(),
                      shape_string(f.S(b)).c_str());
    std::vector<const Node *> nodes = {&si, mul};
    if (why.empty()) f.self_contained(nodes, mul->outputs[0], why);
    if (!why.empty()) {
      rep.skip(fused, si, why);
      continue;
    }
    const std::string name = f.node_name(scope(mul->name) + "." + fused);
    std::map<std::string, Attr> attrs;
    if (auto it = si.attrs.find("approximate"); it != si.attrs.end()) attrs["approximate"] = it->second;
    f.emit(f.index_of(mul), fused, name, {a, b}, {mul->outputs[0]}, mul->block, std::move(attrs));
    rep.done(fused, name, mul->block, nodes);
    f.replace(nodes);
  }
  f.commit();
}

// ---------------------------------------------------------------------------
// GELU, tanh form written out (GPT-2's gelu_new):
//   0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))

void fuse_gelu(Fuser &f, Report &rep) {
  const double kC = 0.7978845608028654, kA = 0.044715, kRel = 1e-6;
  const size_t nn = f.g().nodes.size();
  for (size_t ni = 0; ni < nn; ++ni) {
    const Node &th = f.g().nodes[ni];
    if (th.op != "tanh") continue;
    std::vector<const Node *> nodes = {&th};
    std::string why;
    // Each step: a mul/add of a tensor and a scalar Const; the constant is
    // checked afterwards, so a near miss is reported rather than skipped.
    auto with_const = [&](const Node *n, const char *op, int &other, double &c) {
      if (!n || n->op != op) return false;
      return either(n, [&](int a, int b) { return f.scalar(b, c) && (other = a, true); });
    };
    auto check = [&](double c, double ref, const char *what) {
      if (why.empty() && !near(c, ref, kRel)) why = strformat("the constant %s is %.9g, not %.9g", what, c, ref);
    };
    int v = -1;
    double c1 = 0;
    const Node *u = f.prod(th.inputs[0]);
    if (!with_const(u, "mul", v, c1)) continue;
    // v = x + 0.044715 x^3
    const Node *vn = f.prod(v, "add");
    int x = -1;
    double c2 = 0;
    const Node *wn = nullptr, *cube = nullptr, *sq = nullptr;
    either(vn, [&](int a, int b) {
      const Node *m = f.prod(b);
      int cub = -1;
      if (!with_const(m, "mul", cub, c2)) return false;
      const Node *p = f.prod(cub);
      if (p && p->op == "pow" && p->inputs[0] == a && p->attr_float("exponent", 0) == 3.0) {
        cube = p;
      } else if (p && p->op == "mul") {
        // x*x*x in either grouping
        const bool ok = either(p, [&](int l, int r) {
          const Node *s = f.prod(l, "mul");
          if (r != a || !s || s->inputs[0] != a || s->inputs[1] != a) return false;
          sq = s;
          return true;
        });
        if (!ok) return false;
        cube = p;
      } else {
        return false;
      }
      x = a;
      wn = m;
      return true;
    });
    if (x < 0) continue;
    nodes.insert(nodes.end(), {u, vn, wn, cube});
    if (sq) nodes.push_back(sq);
    // (1 + tanh) * (0.5 x), or ((1 + tanh) * x) * 0.5
    const Node *one = f.sole_reader(th.outputs[0]);
    int tt = -1;
    double c3 = 0, c4 = 0;
    if (!with_const(one, "add", tt, c3)) {
      rep.skip("gelu", th, "tanh(...) is not incremented by 1");
      continue;
    }
    nodes.push_back(one);
    const Node *prod = f.sole_reader(one->outputs[0]), *root = nullptr;
    if (prod && prod->op == "mul") {
      const int other = prod->inputs[0] == one->outputs[0] ? prod->inputs[1] : prod->inputs[0];
      int hx = -1;
      const Node *half = f.prod(other);
      if (other == x) {
        const Node *fin = f.sole_reader(prod->outputs[0]);
        if (with_const(fin, "mul", hx, c4)) {
          nodes.insert(nodes.end(), {prod, fin});
          root = fin;
        }
      } else if (with_const(half, "mul", hx, c4) && hx == x) {
        nodes.insert(nodes.end(), {half, prod});
        root = prod;
      }
    }
    if (!root) {
      rep.skip("gelu", th, "the result is not multiplied by 0.5 x");
      continue;
    }
    check(c1, kC, "sqrt(2/pi)");
    check(c2, kA, "0.044715");
    check(c3, 1.0, "1");
    check(c4, 0.5, "0.5");
    if (why.empty() && f.S(root->outputs[0]) != f.S(x)) why = "the result broadcasts beyond x's shape";
    if (why.empty()) f.self_contained(nodes, root->outputs[0], why);
    if (!why.empty()) {
      rep.skip("gelu", th, why);
      continue;
    }
    const std::string name = f.node_name(scope(root->name) + ".gelu");
    f.emit(f.index_of(root), "gelu", name, {x}, {root->outputs[0]}, root->block,
           {{"approximate", Attr::of_string("tanh")}});
    rep.done("gelu", name, root->block, nodes);
    f.replace(nodes);
  }
  f.commit();
}

// A transpose of a transpose that puts every dim back where it was (the fused
// rope's head-major output, read by the fused attention through the transpose
// an exported SDPA call keeps): the outer one becomes a reshape of the inner
// one's input to the same shape, a view that plan_memory aliases and the
// executor drops, and the inner one, left without a reader, goes.
void cancel_transposes(Fuser &f, Report &rep) {
  const size_t nn = f.g().nodes.size();
  for (size_t i = 0; i < nn; ++i) {
    const Node &n = f.g().nodes[i];
    if (n.op != "transpose" || f.used(&n) || n.inputs.size() != 1 || n.outputs.size() != 1) continue;
    const Node *p = f.prod(n.inputs[0], "transpose");
    if (!p) continue;
    const std::vector<int64_t> inner = p->attr_ints("perm"), outer = n.attr_ints("perm");
    bool identity = !inner.empty() && inner.size() == outer.size();
    for (size_t k = 0; identity && k < outer.size(); ++k)
      identity = outer[k] >= 0 && static_cast<size_t>(outer[k]) < inner.size() &&
                 inner[static_cast<size_t>(outer[k])] == static_cast<int64_t>(k);
    if (!identity || f.S(p->inputs[0]) != f.S(n.outputs[0])) continue;
    const std::string name = f.node_name(n.name + ".view");
    f.emit(f.index_of(&n), "reshape", name, {p->inputs[0]}, {n.outputs[0]}, n.block,
           {{"shape", Attr::of_ints(std::vector<int64_t>(outer.size(), 0))}});
    if (f.sole_reader(n.inputs[0]) == &n)
      rep.done("transpose pair", name, n.block, {p, &n});
    else  // (the inner one stays for its other readers)
      rep.done("transpose pair", name, n.block, {&n});
    f.replace({&n});
  }
  f.commit();
}

}  // namespace

void read_fuse_options(OptionReader &r, CompileOptions &opt) { opt.fuse = r.get_int("fuse", 1, 0, 1) != 0; }

std::string pass_fuse(Graph &g, const CompileOptions &opt) {
  CTR_CHECK(g.num_forward < 0);
  if (!opt.fuse) return "fuse: off (option fuse=0)\n";
  Fuser f(g);
  Report rep;
  fuse_rope(f, rep);
  fuse_attention(f, rep);
  fuse_rmsnorm(f, rep);
  fuse_gated(f, rep, "silu", "swiglu");
  fuse_gelu(f, rep);
  fuse_gated(f, rep, "gelu", "geglu");
  cancel_transposes(f, rep);
  // The fused ops' saved outputs (attention's probabilities, rmsnorm's rstd)
  // are appended here, and every rewrite is checked by the shape rules.
  pass_infer_shapes(g, opt);
  std::string out = "fuse:";
  if (rep.counts.empty()) out += " nothing fused";
  for (const auto &[pattern, n] : rep.counts) out += strformat(" %d %s,", n, pattern.c_str());
  if (out.back() == ',') out.pop_back();
  out += strformat(" (%d nodes removed)\n", f.removed());
  for (const std::string &s : rep.fused) out += "  " + s + "\n";
  for (const std::string &s : rep.left) out += "  " + s + "\n";
  return out;
}

}  // namespace ctr
