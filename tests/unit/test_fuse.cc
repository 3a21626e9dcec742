// The fuse pass: each pattern of primitive ops that exported model code is made
// of becomes its fused op, trains as before (losses and gradients of fuse=1 and
// fuse=0 within 1e-5 relative), and near misses — a mask that is not causal over
// the whole stored constant, an intermediate read elsewhere, wrong constants —
// are left alone and reported by `inspect --after fuse`.
//
// Graphs are built in C++: ids[batch, seq] -> embedding -> the pattern -> a
// linear head -> cross-entropy, with max_seq 8 and steps at seq 5, so masks and
// rotary tables are cut from larger constants as the exporter writes them.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "abi_helpers.h"
#include "api/handles.h"
#include "api/internal.h"
#include "core/status.h"
#include "ctr/ctr.h"
#include "graph/ir.h"
#include "passes/passes.h"
#include "runtime/step.h"

namespace {

using ctr::Attr;
using ctr::Graph;

constexpr int64_t kMax = 8, kSeq = 5, kBatch = 2, kVocab = 11;

using ctr_test::Mesh;
using ctr_test::Opts;

Attr ai(int64_t v) { return Attr::of_int(v); }
Attr af(double v) { return Attr::of_float(v); }
Attr astr(const char *v) { return Attr::of_string(v); }
Attr aints(std::vector<int64_t> v) { return Attr::of_ints(std::move(v)); }

// A graph built op by op, names as an exporter writes them ("blk.op_3").
struct Builder {
  Graph g;
  int ids = -1, x = -1;
  int64_t C = 0;

  // ids[batch, seq] -> embedding [batch, seq, C]
  explicit Builder(int64_t width) : C(width) {
    g.name = "fuse_test";
    g.metadata.push_back({"max_seq", std::to_string(kMax)});
    ctr::Tensor t;
    t.name = "ids";
    t.role = ctr::Role::Input;
    t.dtype = CTR_DTYPE_I32;
    t.dims = {ctr::Dim{0, "batch"}, ctr::Dim{0, "seq"}};
    ids = g.add_tensor(t);
    x = op("embedding", {param("table", {kVocab, C}), ids});
  }
  int param(const std::string &name, std::vector<int64_t> shape, float std = 0.5f) {
    ctr::Tensor t;
    t.name = name;
    t.role = ctr::Role::Param;
    for (int64_t d : shape) t.dims.push_back(ctr::Dim{d, ""});
    t.init.kind = ctr::InitKind::Normal;
    t.init.std = std;
    return g.add_tensor(t);
  }
  int constant(const std::string &name, std::vector<int64_t> shape, const std::vector<float> &v) {
    ctr::Tensor t;
    t.name = name;
    t.role = ctr::Role::Const;
    for (int64_t d : shape) t.dims.push_back(ctr::Dim{d, ""});
    t.init.kind = ctr::InitKind::Data;
    t.data.assign(reinterpret_cast<const uint8_t *>(v.data()), reinterpret_cast<const uint8_t *>(v.data() + v.size()));
    return g.add_tensor(t);
  }
  int scalar(float v) { return constant("const." + std::to_string(g.tensors.size()), {}, {v}); }
  int op(const std::string &o, std::vector<int> in, std::map<std::string, Attr> attrs = {}) {
    ctr::Tensor t;
    t.name = "blk." + o + "_" + std::to_string(g.nodes.size());
    const int id = g.add_tensor(t);
    ctr::Node n;
    n.op = o;
    n.name = t.name;
    n.inputs = std::move(in);
    n.outputs = {id};
    n.attrs = std::move(attrs);
    n.block = 0;
    g.add_node(n);
    return id;
  }
  int linear(int in, int64_t in_width, int64_t out, const std::string &name) {
    return op("linear", {in, param(name, {out, in_width})});
  }
  // h [batch, seq, width] -> logits -> cross-entropy over ids shifted by nothing
  void finish(int h, int64_t width) {
    const int logits = op("linear", {h, param("head", {kVocab, width})});
    ctr::Tensor t;
    t.name = "targets";
    t.role = ctr::Role::Input;
    t.dtype = CTR_DTYPE_I32;
    t.dims = {ctr::Dim{0, "batch"}, ctr::Dim{0, "seq"}};
    const int targets = g.add_tensor(t);
    g.loss = op("cross_entropy", {logits, targets});
  }
  ctr_graph *load() {
    std::vector<uint8_t> buf = ctr::save_graph_buffer(g);
    ctr_graph *out = nullptr;
    EXPECT_EQ(ctr_graph_load_buffer(buf.data(), buf.size(), &out), CTR_STATUS_OK) << ctr_last_error();
    return out;
  }
};

// A [kMax, kMax] mask: fill (nonzero above the diagonal) or additive (-inf above, 0 below);
// with window > 0 also masked left of the window (row i sees i - window < j <= i).
std::vector<float> causal(bool additive, int64_t window = 0) {
  std::vector<float> m(kMax * kMax, 0.0f);
  for (int64_t i = 0; i < kMax; ++i)
    for (int64_t j = 0; j < kMax; ++j)
      if (j > i || (window > 0 && i - j >= window)) m[i * kMax + j] = additive ? -INFINITY : 1.0f;
  return m;
}

// Rotate-half tables [rows, D]: cos/sin(t theta^(-2 (i mod D/2) / D)), as float32 like torch.
std::vector<float> rope_table(int64_t D, double theta, bool sine, int64_t rows = kMax) {
  std::vector<float> v(rows * D);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < D; ++i) {
      const float f = static_cast<float>(1.0 / std::pow(theta, static_cast<double>(2 * (i % (D / 2))) / D));
      const float ang = static_cast<float>(t) * f;
      v[t * D + i] = sine ? std::sin(ang) : std::cos(ang);
    }
  return v;
}

struct StepOut {
  double loss = 0;
  std::map<std::string, std::vector<float>> grads;
  std::map<std::string, int> forward_ops;  // op -> count after the passes
};

StepOut run_step(ctr_graph *graph, int fuse, int64_t seq = kSeq) {
  Mesh m;
  Opts o;
  o.i("batch", kBatch).i("seq", seq).i("seed", 3).i("fuse", fuse);
  ctr_step *s = nullptr;
  StepOut out;
  EXPECT_EQ(ctr_step_create(m.m, graph, o.o, &s), CTR_STATUS_OK) << ctr_last_error();
  if (!s) return out;
  std::mt19937 rng(7);
  std::vector<int32_t> ids(static_cast<size_t>(kBatch * seq)), targets(ids.size());
  for (auto &v : ids) v = static_cast<int32_t>(rng() % kVocab);
  for (auto &v : targets) v = static_cast<int32_t>(rng() % kVocab);
  EXPECT_EQ(ctr_step_set_input(s, "ids", ids.data(), ids.size() * 4), CTR_STATUS_OK);
  EXPECT_EQ(ctr_step_set_input(s, "targets", targets.data(), targets.size() * 4), CTR_STATUS_OK);
  ctr::Step &st = *s->impl;
  out.loss = st.forward_backward();
  const Graph &g = st.graph();
  for (const ctr::Tensor &t : g.tensors)
    if (t.role == ctr::Role::Param) {
      auto &v = out.grads[t.name];
      v.resize(static_cast<size_t>(t.numel()));
      st.read_grad(t.name, v.data(), v.size());
    }
  for (int i = 0; i < g.num_forward; ++i) ++out.forward_ops[g.nodes[static_cast<size_t>(i)].op];
  ctr_step_free(s);
  return out;
}

std::string inspect(ctr_graph *graph) {
  Opts o;
  o.i("batch", kBatch).i("seq", kSeq);
  return ctr::inspect_graph(graph, o.o, "fuse");
}

// Fused and unfused steps agree: the loss and every gradient within 1e-5
// relative (gradients relative to the parameter's largest entry).
void expect_same_training(const StepOut &a, const StepOut &b) {
  EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (const auto &[name, gb] : b.grads) {
    const std::vector<float> &ga = a.grads.at(name);
    double big = 0, diff = 0;
    for (size_t i = 0; i < gb.size(); ++i) {
      big = std::max(big, std::fabs(static_cast<double>(gb[i])));
      diff = std::max(diff, std::fabs(static_cast<double>(ga[i]) - gb[i]));
    }
    EXPECT_GT(big, 0.0) << name << ": no gradient, the check proves nothing";
    EXPECT_LE(diff, 1e-5 * big) << name;
  }
}

int count(const StepOut &s, const std::string &op) {
  auto it = s.forward_ops.find(op);
  return it == s.forward_ops.end() ? 0 : it->second;
}

// ---------------------------------------------------------------------------
// Attention

struct AttnCase {
  std::string label;
  bool additive = false;    // s + M instead of masked_fill(s, M, value)
  int kv_heads = 4;         // 2: grouped through repeat_kv / repeat_interleave
  bool interleave = false;  // repeat_interleave on [B, Hkv, T, D] (else repeat_kv on [B, T, Hkv, D])
  bool keys_direct = false; // kT = transpose(k [B,T,H,D], 0,2,3,1)
  int scale = 1;            // 0 none, 1 mul by 0.5, 2 div by 2
  float fill = -INFINITY;   // the masked value
  bool mask_broken_past_seq = false;  // a row past seq is not causal
  bool probs_read_elsewhere = false;
  bool fused = true;
  const char *why = "";     // expected in the report when not fused
  int64_t window = 0;       // a sliding window in the mask (the fused op's attribute)
  float softcap = 0;        // logits capped to c * tanh(s / c) before the mask
  float softcap_mul = 0;    // the division by c written as a product with this
};

constexpr int64_t kH = 4, kD = 4;

// [B, T, h, D] -> [B, T, H, D] by repeat_kv, or [B, h, T, D] -> [B, H, T, D] by repeat_interleave.
int repeat(Builder &b, int x, int64_t h, bool head_major) {
  const int64_t r = kH / h;
  if (head_major) {
    const int x5 = b.op("reshape", {x}, {{"dims", astr(("batch," + std::to_string(h) + ",1,seq,4").c_str())}});
    const int e = b.op("expand", {x5}, {{"shape", aints({-1, -1, r, -1, -1})}});
    return b.op("reshape", {e}, {{"dims", astr("batch,4,seq,4")}});
  }
  const int x5 = b.op("reshape", {x}, {{"dims", astr(("batch,seq," + std::to_string(h) + ",1,4").c_str())}});
  const int e = b.op("expand", {x5}, {{"shape", aints({-1, -1, -1, r, -1})}});
  return b.op("reshape", {e}, {{"dims", astr("batch,seq,4,4")}});
}

void build_attention(Builder &b, const AttnCase &c) {
  const int64_t hk = c.kv_heads;
  const std::string kvdims = "batch,seq," + std::to_string(hk) + ",4";
  const int q = b.op("reshape", {b.linear(b.x, 16, kH * kD, "wq")}, {{"dims", astr("batch,seq,4,4")}});
  const int q4 = b.op("transpose", {q}, {{"perm", aints({0, 2, 1, 3})}});
  // k and v as [B, T, H, D] (token-major) or [B, H, T, D] (head-major)
  auto heads = [&](const char *w, bool want_token_major) {
    int t = b.op("reshape", {b.linear(b.x, 16, hk * kD, w)}, {{"dims", astr(kvdims.c_str())}});
    if (hk != kH && !c.interleave) t = repeat(b, t, hk, false);
    if (want_token_major) return t;
    t = b.op("transpose", {t}, {{"perm", aints({0, 2, 1, 3})}});
    if (hk != kH && c.interleave) t = repeat(b, t, hk, true);
    return t;
  };
  const int kt = c.keys_direct ? b.op("transpose", {heads("wk", true)}, {{"perm", aints({0, 2, 3, 1})}})
                               : b.op("transpose", {heads("wk", false)}, {{"perm", aints({0, 1, 3, 2})}});
  const int v4 = heads("wv", false);
  int s = b.op("matmul", {q4, kt});
  if (c.scale == 1) s = b.op("mul", {s, b.scalar(0.5f)});
  if (c.scale == 2) s = b.op("div", {s, b.scalar(2.0f)});
  if (c.softcap > 0) {
    const int d = c.softcap_mul != 0 ? b.op("mul", {s, b.scalar(c.softcap_mul)}) : b.op("div", {s, b.scalar(c.softcap)});
    s = b.op("mul", {b.op("tanh", {d}), b.scalar(c.softcap)});
  }
  std::vector<float> m = causal(c.additive, c.window);
  if (c.mask_broken_past_seq) m[7 * kMax + 6] = c.additive ? -INFINITY : 1.0f;
  int mask = b.constant("mask", {1, 1, kMax, kMax}, m);
  mask = b.op("slice", {mask}, {{"dim", ai(2)}, {"end", astr("seq")}});
  mask = b.op("slice", {mask}, {{"dim", ai(3)}, {"end", astr("seq")}});
  s = c.additive ? b.op("add", {s, mask}) : b.op("masked_fill", {s, mask}, {{"value", af(c.fill)}});
  const int p = b.op("softmax", {s}, {{"dim", ai(-1)}});
  const int o = b.op("matmul", {p, v4});
  const int ot = b.op("transpose", {o}, {{"perm", aints({0, 2, 1, 3})}});
  int h = b.op("linear", {b.op("reshape", {ot}, {{"dims", astr("batch,seq,16")}}), b.param("wo", {16, 16})});
  if (c.probs_read_elsewhere) {
    // attention weights summed over heads and keys, added to every channel
    const int sum = b.op("sum", {p}, {{"dims", aints({1, 3})}});
    h = b.op("add", {h, b.op("reshape", {sum}, {{"dims", astr("batch,seq,1")}})});
  }
  b.finish(h, 16);
}

class FuseAttention : public ::testing::TestWithParam<AttnCase> {};

TEST_P(FuseAttention, FusedWhenExactAndTrainsAlike) {
  const AttnCase &c = GetParam();
  Builder b(16);
  build_attention(b, c);
  ctr_graph *g = b.load();
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(plain, "attention"), 0);
  EXPECT_EQ(count(plain, "softmax"), 1);
  const std::string report = inspect(g);
  if (c.fused) {
    EXPECT_EQ(count(fused, "attention"), 1) << report;
    // Nothing of the pattern is left: no softmax, products, head transposes,
    // mask slices or kv-head repeats.
    for (const char *op : {"softmax", "matmul", "transpose", "slice", "expand", "masked_fill", "mul", "div"})
      EXPECT_EQ(count(fused, op), 0) << op << "\n" << report;
    EXPECT_NE(report.find("attention in block 0 fused"), std::string::npos) << report;
    const std::string attr = "window=" + std::to_string(c.window);
    EXPECT_EQ(report.find(attr) != std::string::npos, c.window > 0) << report;
    EXPECT_EQ(report.find("softcap=") != std::string::npos, c.softcap > 0) << report;
  } else {
    EXPECT_EQ(count(fused, "attention"), 0) << report;
    EXPECT_NE(report.find("attention in block 0 not fused: " + std::string(c.why)), std::string::npos) << report;
  }
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FuseAttention,
    ::testing::Values(AttnCase{"fill_mul"}, AttnCase{"additive_div", true, 4, false, false, 2},
                      AttnCase{"no_scale_finfo_min", false, 4, false, false, 0, -3.4028234663852886e38f},
                      AttnCase{"keys_direct", false, 4, false, true},
                      AttnCase{"gqa_repeat_kv", true, 2, false, false, 2},
                      AttnCase{"gqa_repeat_kv_keys_direct", false, 2, false, true},
                      AttnCase{"gqa_repeat_interleave", false, 2, true, false, 2},
                      AttnCase{"mask_not_causal_past_seq", false, 4, false, false, 1, -INFINITY, true, false, false,
                               "the mask is not causal"},
                      AttnCase{"additive_mask_not_causal_past_seq", true, 4, false, false, 1, -INFINITY, true, false,
                               false, "the mask is not causal"},
                      AttnCase{"fill_value_too_small", false, 4, false, false, 1, -1e4f, false, false, false,
                               "the masked value is -10000"},
                      AttnCase{"probs_read_elsewhere", false, 4, false, false, 1, -INFINITY, false, true, false,
                               "the probabilities are not multiplied by the values alone"},
                      // Sliding windows of 3 positions (shorter than seq = 5): the window attribute.
                      AttnCase{"window_fill", false, 4, false, false, 1, -INFINITY, false, false, true, "", 3},
                      AttnCase{"window_additive_gqa", true, 2, false, false, 2, -INFINITY, false, false, true, "", 3},
                      AttnCase{"window_broken_past_seq", false, 4, false, false, 1, -INFINITY, true, false, false,
                               "the mask is not causal with a sliding window of 3", 3},
                      // Logit soft-capping (a cap the scores reach, so tanh bends them), by div or mul.
                      AttnCase{"softcap_window", true, 2, false, false, 1, -INFINITY, false, false, true, "", 3, 0.3f},
                      AttnCase{"softcap_mul", false, 4, false, false, 2, -INFINITY, false, false, true, "", 0, 0.3f,
                               1.0f / 0.3f},
                      AttnCase{"softcap_two_constants", false, 4, false, false, 1, -INFINITY, false, false, false,
                               "the scores pass through tanh", 0, 0.3f, 2.0f}),
    [](const ::testing::TestParamInfo<AttnCase> &i) { return i.param.label; });

TEST(Fuse, AttentionIntermediateReadElsewhereIsLeft) {
  // The scaled scores also feed the output: the scale mul is an intermediate
  // read outside the pattern.
  Builder b(16);
  const int q = b.op("transpose", {b.op("reshape", {b.linear(b.x, 16, 16, "wq")}, {{"dims", astr("batch,seq,4,4")}})},
                     {{"perm", aints({0, 2, 1, 3})}});
  const int k = b.op("transpose", {b.op("reshape", {b.linear(b.x, 16, 16, "wk")}, {{"dims", astr("batch,seq,4,4")}})},
                     {{"perm", aints({0, 2, 3, 1})}});
  const int v = b.op("transpose", {b.op("reshape", {b.linear(b.x, 16, 16, "wv")}, {{"dims", astr("batch,seq,4,4")}})},
                     {{"perm", aints({0, 2, 1, 3})}});
  const int s = b.op("mul", {b.op("matmul", {q, k}), b.scalar(0.5f)});
  int mask = b.op("slice", {b.constant("mask", {kMax, kMax}, causal(false))}, {{"dim", ai(0)}, {"end", astr("seq")}});
  mask = b.op("slice", {mask}, {{"dim", ai(1)}, {"end", astr("seq")}});
  const int p = b.op("softmax", {b.op("masked_fill", {s, mask}, {{"value", af(-INFINITY)}})});
  const int o = b.op("transpose", {b.op("matmul", {p, v})}, {{"perm", aints({0, 2, 1, 3})}});
  const int leak = b.op("reshape", {b.op("mean", {s}, {{"dims", aints({1, 3})}})}, {{"dims", astr("batch,seq,1")}});
  b.finish(b.op("add", {b.op("reshape", {o}, {{"dims", astr("batch,seq,16")}}), leak}), 16);
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  EXPECT_NE(report.find("not fused: 'blk.mul_"), std::string::npos) << report;
  EXPECT_NE(report.find("is also read outside the pattern"), std::string::npos) << report;
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "attention"), 0);
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

// ---------------------------------------------------------------------------
// RMSNorm, SwiGLU, GELU

TEST(Fuse, RmsNormEitherFormAndOrder) {
  for (int form = 0; form < 4; ++form) {
    SCOPED_TRACE("form " + std::to_string(form));
    Builder b(8);
    const int x = b.x;
    const int sq = form % 2 ? b.op("mul", {x, x}) : b.op("pow", {x}, {{"exponent", af(2.0)}});
    const int ms = b.op("mean", {sq}, {{"dims", aints({form < 2 ? -1 : 2})}, {"keepdim", ai(1)}});
    const int eps = b.scalar(1e-5f);
    const int r = b.op("rsqrt", {form < 2 ? b.op("add", {ms, eps}) : b.op("add", {eps, ms})});
    const int n = form < 2 ? b.op("mul", {x, r}) : b.op("mul", {r, x});
    const int w = b.param("norm.weight", {8});
    b.finish(form < 2 ? b.op("mul", {n, w}) : b.op("mul", {w, n}), 8);
    ctr_graph *g = b.load();
    const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
    EXPECT_EQ(count(fused, "rmsnorm"), 1) << inspect(g);
    for (const char *op : {"pow", "mean", "rsqrt", "mul", "add"}) EXPECT_EQ(count(fused, op), 0) << op;
    expect_same_training(fused, plain);
    ctr_graph_free(g);
  }
}

TEST(Fuse, RmsNormIntermediateReadElsewhereIsLeft) {
  Builder b(8);
  const int x = b.x;
  const int ms = b.op("mean", {b.op("pow", {x}, {{"exponent", af(2.0)}})}, {{"dims", aints({-1})}, {"keepdim", ai(1)}});
  const int r = b.op("rsqrt", {b.op("add", {ms, b.scalar(1e-5f)})});
  const int y = b.op("mul", {b.op("mul", {x, r}), b.param("norm.weight", {8})});
  b.finish(b.op("add", {y, r}), 8);  // rstd read again
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  EXPECT_NE(report.find("rmsnorm in block 0 not fused"), std::string::npos) << report;
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "rmsnorm"), 0);
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

TEST(Fuse, SwiGluEitherOrder) {
  for (int order = 0; order < 2; ++order) {
    Builder b(8);
    const int a = b.linear(b.x, 8, 12, "w1"), u = b.linear(b.x, 8, 12, "w3");
    const int s = b.op("silu", {a});
    const int y = order ? b.op("mul", {u, s}) : b.op("mul", {s, u});
    b.finish(b.linear(y, 12, 8, "w2"), 8);
    ctr_graph *g = b.load();
    const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
    EXPECT_EQ(count(fused, "swiglu"), 1) << inspect(g);
    EXPECT_EQ(count(fused, "silu"), 0);
    EXPECT_EQ(count(fused, "mul"), 0);
    expect_same_training(fused, plain);
    ctr_graph_free(g);
  }
}

TEST(Fuse, SwiGluSiluReadElsewhereIsLeft) {
  Builder b(8);
  const int a = b.linear(b.x, 8, 8, "w1"), u = b.linear(b.x, 8, 8, "w3");
  const int s = b.op("silu", {a});
  b.finish(b.op("add", {b.op("mul", {s, u}), s}), 8);
  ctr_graph *g = b.load();
  EXPECT_NE(inspect(g).find("swiglu in block 0 not fused"), std::string::npos) << inspect(g);
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "swiglu"), 0);
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

// gelu_new as GPT-2 writes it; cube: x^3 as pow (0) or x*x*x (1).
int hand_gelu(Builder &b, int x, float a, int cube, bool half_last) {
  const int x3 = cube ? b.op("mul", {b.op("mul", {x, x}), x}) : b.op("pow", {x}, {{"exponent", af(3.0)}});
  const int inner = b.op("add", {x, b.op("mul", {x3, b.scalar(a)})});
  const int t = b.op("tanh", {b.op("mul", {inner, b.scalar(0.7978845608028654f)})});
  const int one = b.op("add", {t, b.scalar(1.0f)});
  if (half_last) return b.op("mul", {b.op("mul", {one, x}), b.scalar(0.5f)});
  return b.op("mul", {b.op("mul", {x, b.scalar(0.5f)}), one});
}

TEST(Fuse, HandWrittenGelu) {
  for (int v = 0; v < 3; ++v) {
    SCOPED_TRACE("variant " + std::to_string(v));
    Builder b(8);
    const int y = hand_gelu(b, b.linear(b.x, 8, 12, "fc"), 0.044715f, v == 1, v == 2);
    b.finish(b.linear(y, 12, 8, "proj"), 8);
    ctr_graph *g = b.load();
    const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
    EXPECT_EQ(count(fused, "gelu"), 1) << inspect(g);
    for (const char *op : {"tanh", "pow", "mul", "add"}) EXPECT_EQ(count(fused, op), 0) << op;
    expect_same_training(fused, plain);
    ctr_graph_free(g);
  }
}

// GeGLU (Gemma's MLP): gelu(gate) * up, the gelu an op (tanh or exact) or written out by
// hand (fused to gelu first, then to geglu).
TEST(Fuse, GeGlu) {
  for (int v = 0; v < 3; ++v) {
    SCOPED_TRACE("variant " + std::to_string(v));
    Builder b(8);
    const int a = b.linear(b.x, 8, 12, "w1"), u = b.linear(b.x, 8, 12, "w3");
    const int ge = v == 2 ? hand_gelu(b, a, 0.044715f, 0, false)
                          : b.op("gelu", {a}, {{"approximate", astr(v == 0 ? "tanh" : "none")}});
    b.finish(b.linear(b.op("mul", {u, ge}), 12, 8, "w2"), 8);
    ctr_graph *g = b.load();
    const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
    const std::string report = inspect(g);
    EXPECT_EQ(count(fused, "geglu"), 1) << report;
    EXPECT_EQ(count(fused, "gelu"), 0) << report;
    EXPECT_EQ(count(fused, "mul"), 0) << report;
    EXPECT_EQ(report.find("approximate=\"none\"") != std::string::npos, v == 1) << report;
    expect_same_training(fused, plain);
    ctr_graph_free(g);
  }
}

TEST(Fuse, GeGluOfDifferentShapesIsLeft) {
  Builder b(8);
  const int a = b.linear(b.x, 8, 12, "w1");
  const int ge = b.op("gelu", {a});
  b.finish(b.linear(b.op("mul", {ge, b.param("gain", {12})}), 12, 8, "w2"), 8);
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  EXPECT_NE(report.find("geglu in block 0 not fused: the operands' shapes"), std::string::npos) << report;
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "geglu"), 0);
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

TEST(Fuse, GeluWithWrongConstantIsLeft) {
  Builder b(8);
  const int y = hand_gelu(b, b.linear(b.x, 8, 12, "fc"), 0.0447f, 0, false);
  b.finish(b.linear(y, 12, 8, "proj"), 8);
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  EXPECT_NE(report.find("gelu in block 0 not fused: the constant 0.044715 is 0.0447"), std::string::npos) << report;
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "gelu"), 0);
  expect_same_training(fused, plain);
  ctr_graph_free(g);
}

// ---------------------------------------------------------------------------
// RoPE, rotate-half form

// x4 * cos + cat(-x2, x1) * sin.
int rotate(Builder &b, int x4, int cos, int sin, int64_t D) {
  const int x1 = b.op("slice", {x4}, {{"dim", ai(-1)}, {"end", ai(D / 2)}});
  const int x2 = b.op("slice", {x4}, {{"dim", ai(-1)}, {"start", ai(D / 2)}, {"end", ai(INT64_MAX)}});
  const int rot = b.op("cat", {b.op("neg", {x2}), x1}, {{"dim", ai(-1)}});
  return b.op("add", {b.op("mul", {x4, cos}), b.op("mul", {rot, sin})});
}

struct RopeCase {
  std::string label;
  bool head_major = true;
  double sin_theta = 10000;  // != 10000: the tables disagree
  bool fused = true;
};

class FuseRope : public ::testing::TestWithParam<RopeCase> {};

TEST_P(FuseRope, FusedWhenTablesMatch) {
  const RopeCase &c = GetParam();
  const int64_t H = 2, D = 8;
  Builder b(16);
  const int q = b.op("reshape", {b.linear(b.x, 16, H * D, "wq")}, {{"dims", astr("batch,seq,2,8")}});
  int y;
  if (c.head_major) {
    // x [B, H, T, D], tables [1, 1, max, D] cut on dim 2
    const int cos = b.op("slice", {b.constant("cos", {1, 1, kMax, D}, rope_table(D, 10000, false))},
                         {{"dim", ai(2)}, {"end", astr("seq")}});
    const int sin = b.op("slice", {b.constant("sin", {1, 1, kMax, D}, rope_table(D, c.sin_theta, true))},
                         {{"dim", ai(2)}, {"end", astr("seq")}});
    const int x4 = b.op("transpose", {q}, {{"perm", aints({0, 2, 1, 3})}});
    y = b.op("transpose", {rotate(b, x4, cos, sin, D)}, {{"perm", aints({0, 2, 1, 3})}});
  } else {
    // x [B, T, H, D], tables [max, 1, D] cut on dim 0
    const int cos = b.op("slice", {b.constant("cos", {kMax, 1, D}, rope_table(D, 10000, false))},
                         {{"dim", ai(0)}, {"end", astr("seq")}});
    const int sin = b.op("slice", {b.constant("sin", {kMax, 1, D}, rope_table(D, c.sin_theta, true))},
                         {{"dim", ai(0)}, {"end", astr("seq")}});
    y = rotate(b, q, cos, sin, D);
  }
  b.finish(b.op("reshape", {y}, {{"dims", astr("batch,seq,16")}}), 16);
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "rope"), c.fused ? 1 : 0) << report;
  if (c.fused) {
    EXPECT_NE(report.find("rope(%"), std::string::npos);
    EXPECT_NE(report.find("theta=10000"), std::string::npos) << report;
    for (const char *op : {"cat", "neg", "slice", "mul", "add"}) EXPECT_EQ(count(fused, op), 0) << op;
    // Head-major: the fused rope's transpose back to [B,H,T,D] and the graph's
    // transpose to [B,T,H,D] after it cancel out (a view is left).
    EXPECT_EQ(count(fused, "transpose"), 0) << report;
    if (c.head_major) {
      EXPECT_NE(report.find("transpose pair in block 0 fused"), std::string::npos) << report;
    }
  } else {
    EXPECT_NE(report.find("rope in block 0 not fused: the rotary tables differ"), std::string::npos) << report;
    EXPECT_EQ(count(fused, "transpose"), c.head_major ? 2 : 0) << report;
  }
  expect_same_training(fused, plain);
  // One position: the cut tables have no positions axis, the stored ones tell.
  const StepOut one = run_step(g, 1, 1);
  EXPECT_EQ(count(one, "rope"), c.fused ? 1 : 0);
  expect_same_training(one, run_step(g, 0, 1));
  ctr_graph_free(g);
}

INSTANTIATE_TEST_SUITE_P(Cases, FuseRope,
                         ::testing::Values(RopeCase{"head_major"}, RopeCase{"token_major", false},
                                           RopeCase{"other_theta", true, 500000, false}),
                         [](const ::testing::TestParamInfo<RopeCase> &i) { return i.param.label; });

// ---------------------------------------------------------------------------
// RoPE, complex form (Meta's Llama), as ctr_export writes view_as_complex,
// the product with polar(1, angles) and view_as_real

// The real (cos) or imaginary (sin) part of the polar table [rows, D/2].
std::vector<float> polar_table(int64_t D, double theta, bool sine, int64_t rows = kMax) {
  const std::vector<float> full = rope_table(D, theta, sine, rows);
  std::vector<float> v;
  for (int64_t t = 0; t < rows; ++t) v.insert(v.end(), full.begin() + t * D, full.begin() + t * D + D / 2);
  return v;
}

struct ComplexCase {
  std::string label;
  bool freqs_first = false;     // freqs * x: tables as the left operands, add's products swapped
  double sin_theta = 10000;     // != 10000: the tables disagree
  bool lane_read_elsewhere = false;
  bool fused = true;
  const char *why = "";         // expected in the report when not fused ("": not even a candidate)
  bool lanes_swapped = false;   // re from the odd lanes, im from the even: another rotation
  int64_t rows = kMax;          // stored table rows (float32 angles drift past 1e-5 by 4096)
};

class FuseComplexRope : public ::testing::TestWithParam<ComplexCase> {};

TEST_P(FuseComplexRope, FusedWhenTablesMatch) {
  const ComplexCase &c = GetParam();
  const int64_t H = 2, D = 8, h = D / 2;
  Builder b(16);
  // x [B, T, H, D/2, 2]: lanes 0 and 1 are the real and imaginary parts.
  const int x5 = b.op("reshape", {b.linear(b.x, 16, H * D, "wq")}, {{"dims", astr("batch,seq,2,4,2")}});
  auto lane = [&](int64_t k) {
    const int s = b.op("slice", {x5}, {{"dim", ai(4)}, {"start", ai(k)}, {"end", ai(k + 1)}});
    return b.op("reshape", {s}, {{"dims", astr("batch,seq,2,4")}});
  };
  const int re = lane(c.lanes_swapped ? 1 : 0), im = lane(c.lanes_swapped ? 0 : 1);
  // Tables [1, max, 1, D/2] cut on dim 1, as reshape_for_broadcast views them.
  const std::vector<float> re_tab = polar_table(D, 10000, false, c.rows);
  const int cos = b.op("slice", {b.constant("freqs.re", {1, c.rows, 1, h}, re_tab)},
                       {{"dim", ai(1)}, {"end", astr("seq")}});
  const int sin = b.op("slice", {b.constant("freqs.im", {1, c.rows, 1, h}, polar_table(D, c.sin_theta, true, c.rows))},
                       {{"dim", ai(1)}, {"end", astr("seq")}});
  if (c.rows > kMax) {
    // The float32 table is more than 1e-5 off somewhere: a fixed bound would refuse it.
    double worst = 0;
    for (int64_t t = 0; t < c.rows; ++t)
      for (int64_t i = 0; i < h; ++i)
        worst = std::max(worst, std::fabs(re_tab[t * h + i] - std::cos(t * std::pow(10000.0, -2.0 * i / D))));
    EXPECT_GT(worst, 1e-5);
  }
  auto mul = [&](int x, int t) { return c.freqs_first ? b.op("mul", {t, x}) : b.op("mul", {x, t}); };
  const int rr = b.op("sub", {mul(re, cos), mul(im, sin)});
  const int ri = c.freqs_first ? b.op("add", {mul(im, cos), mul(re, sin)}) : b.op("add", {mul(re, sin), mul(im, cos)});
  const int out = b.op("cat", {b.op("reshape", {rr}, {{"dims", astr("batch,seq,2,4,1")}}),
                               b.op("reshape", {ri}, {{"dims", astr("batch,seq,2,4,1")}})},
                       {{"dim", ai(4)}});
  int y = b.op("reshape", {out}, {{"dims", astr("batch,seq,16")}});
  if (c.lane_read_elsewhere) {
    const int twice = b.op("reshape", {b.op("cat", {re, re}, {{"dim", ai(-1)}})}, {{"dims", astr("batch,seq,16")}});
    y = b.op("add", {y, twice});
  }
  b.finish(y, 16);
  ctr_graph *g = b.load();
  const std::string report = inspect(g);
  const StepOut fused = run_step(g, 1), plain = run_step(g, 0);
  EXPECT_EQ(count(fused, "rope"), c.fused ? 1 : 0) << report;
  if (c.fused) {
    EXPECT_NE(report.find("fuse: 1 rope"), std::string::npos) << report;
    EXPECT_NE(report.find("= rope(%"), std::string::npos) << report;
    EXPECT_NE(report.find("heads=2 interleaved=1 theta=10000"), std::string::npos) << report;
    for (const char *op : {"cat", "slice", "mul", "sub", "add"}) EXPECT_EQ(count(fused, op), 0) << op;
  } else if (*c.why) {
    EXPECT_NE(report.find("rope in block 0 not fused: "), std::string::npos) << report;
    EXPECT_NE(report.find(c.why), std::string::npos) << report;
  } else {
    EXPECT_EQ(report.find("rope in block"), std::string::npos) << report;
  }
  expect_same_training(fused, plain);
  // One position: the cut tables have no positions axis, the stored ones tell.
  const StepOut one = run_step(g, 1, 1);
  EXPECT_EQ(count(one, "rope"), c.fused ? 1 : 0);
  expect_same_training(one, run_step(g, 0, 1));
  ctr_graph_free(g);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, FuseComplexRope,
    ::testing::Values(ComplexCase{"x_times_freqs"}, ComplexCase{"freqs_times_x", true},
                      ComplexCase{"other_theta", false, 500000, false, false, "the rotary tables differ"},
                      ComplexCase{"lane_read_elsewhere", false, 10000, true, false,
                                  "'blk.reshape_4' (#7) is also read outside the pattern"},
                      ComplexCase{"lanes_swapped", false, 10000, false, false, "", true},
                      ComplexCase{"long_table", false, 10000, false, true, "", false, 4096}),
    [](const ::testing::TestParamInfo<ComplexCase> &i) { return i.param.label; });

// ---------------------------------------------------------------------------
// The option and the pass list

TEST(Fuse, OptionOffLeavesTheGraphAndInspectSaysSo) {
  Builder b(16);
  build_attention(b, AttnCase{"fill_mul"});
  ctr_graph *g = b.load();
  Opts o;
  o.i("batch", kBatch).i("seq", kSeq).i("fuse", 0);
  const std::string off = ctr::inspect_graph(g, o.o, "fuse");
  EXPECT_NE(off.find("fuse: off"), std::string::npos) << off;
  EXPECT_EQ(off.find("= attention("), std::string::npos) << off;
  const std::string on = inspect(g);
  EXPECT_NE(on.find("fuse: 1 attention"), std::string::npos) << on;
  EXPECT_NE(on.find("= attention("), std::string::npos) << on;
  const std::vector<std::string> names = ctr::pass_names();
  const auto at = [&](const char *p) { return std::find(names.begin(), names.end(), p) - names.begin(); };
  // After shapes are known (and the pipeline schedule read the mesh), before
  // the expert pass rewrites anything.
  EXPECT_GT(at("fuse"), at("infer_shapes"));
  EXPECT_EQ(at("fuse"), at("schedule") + 1);
  EXPECT_EQ(at("expert"), at("fuse") + 1);
  ctr_graph_free(g);
}

}  // namespace
