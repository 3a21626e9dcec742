// An op added from outside the library, by the recipe in docs/architecture.md:
// its definition (registered with register_op), one CPU kernel per direction
// (register_cpu_kernel), and this test. No library file knows the op.
//
// poly(x) = x + alpha * x^3, attribute alpha (default 0.5), element-wise. Its
// gradient is declarative: one backward op poly_bwd(dy, x) -> dx with
// dx = dy * (1 + 3 alpha x^2), which receives the forward node's attributes.
// A small model uses it (embedding -> poly -> linear -> cross_entropy); the
// test checks that an unregistered op is refused, that the gradient through it
// matches central differences, and that the model trains.

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "api/handles.h"
#include "backend/backend.h"
#include "core/status.h"
#include "ctr/ctr.h"
#include "graph/ir.h"
#include "graph/ops.h"
#include "runtime/step.h"

namespace {

using ctr::Graph;

struct PolyParams {
  float alpha;
};

void poly_decode(const Graph &, const ctr::Node &n, void *out) {
  static_cast<PolyParams *>(out)->alpha = static_cast<float>(n.attr_float("alpha", 0.5));
}

void poly_infer(const Graph &g, const ctr::Node &n, std::vector<ctr::OutInfo> &out) {
  const ctr::Tensor &x = g.tensors[static_cast<size_t>(n.inputs[0])];
  if (x.dtype != CTR_DTYPE_F32) ctr::fail(CTR_STATUS_INVALID_GRAPH, "poly: input must be f32");
  out = {ctr::OutInfo{CTR_DTYPE_F32, x.shape}};
}

double poly_flops(const Graph &g, const ctr::Node &n) {
  return 4.0 * static_cast<double>(g.tensors[static_cast<size_t>(n.inputs[0])].numel());
}

void poly_kernel(const ctr_kernel_args *a, void *) {
  const float alpha = static_cast<const PolyParams *>(a->params)->alpha;
  const float *x = static_cast<const float *>(a->inputs[0].data);
  float *y = static_cast<float *>(a->outputs[0].data);
  for (int64_t i = 0; i < a->inputs[0].numel; ++i) y[i] = x[i] + alpha * x[i] * x[i] * x[i];
}

void poly_bwd_kernel(const ctr_kernel_args *a, void *) {
  const float alpha = static_cast<const PolyParams *>(a->params)->alpha;
  const float *dy = static_cast<const float *>(a->inputs[0].data);
  const float *x = static_cast<const float *>(a->inputs[1].data);
  float *dx = static_cast<float *>(a->outputs[0].data);
  for (int64_t i = 0; i < a->inputs[1].numel; ++i) dx[i] = dy[i] * (1.0f + 3.0f * alpha * x[i] * x[i]);
}

void register_poly() {
  ctr::OpDef bwd;
  bwd.name = "poly_bwd";
  bwd.min_inputs = bwd.max_inputs = 2;
  bwd.internal = true;
  bwd.params_size = sizeof(PolyParams);
  bwd.decode = poly_decode;
  ctr::register_op(bwd);

  ctr::OpDef def;
  def.name = "poly";
  def.min_inputs = def.max_inputs = 1;
  def.infer = poly_infer;
  def.flops = poly_flops;
  def.params_size = sizeof(PolyParams);
  def.decode = poly_decode;
  def.bwd.op = "poly_bwd";
  def.bwd.inputs = {{ctr::BwdSlot::Grad, 0}, {ctr::BwdSlot::Input, 0}};
  ctr::register_op(def);

  ctr::register_cpu_kernel("poly", poly_kernel);
  ctr::register_cpu_kernel("poly_bwd", poly_bwd_kernel);
}

constexpr int64_t B = 2, T = 5, V = 7, C = 6;

ctr::Tensor tensor(const char *name, ctr_dtype dt, std::vector<int64_t> shape, ctr::Role role) {
  ctr::Tensor t;
  t.name = name;
  t.dtype = dt;
  t.role = role;
  for (int64_t d : shape) t.dims.push_back(ctr::Dim{d, ""});
  if (role == ctr::Role::Param) {
    t.init.kind = ctr::InitKind::Normal;
    t.init.std = 0.5f;
  }
  return t;
}

// embedding -> poly(alpha 0.3) -> linear -> cross_entropy
Graph poly_model() {
  Graph g;
  g.name = "poly_model";
  int tokens = g.add_tensor(tensor("tokens", CTR_DTYPE_I32, {B, T}, ctr::Role::Input));
  int targets = g.add_tensor(tensor("targets", CTR_DTYPE_I32, {B, T}, ctr::Role::Input));
  int wte = g.add_tensor(tensor("wte", CTR_DTYPE_F32, {V, C}, ctr::Role::Param));
  int head = g.add_tensor(tensor("head", CTR_DTYPE_F32, {V, C}, ctr::Role::Param));
  int h = g.add_tensor(tensor("h", CTR_DTYPE_F32, {}, ctr::Role::Activation));
  int p = g.add_tensor(tensor("p", CTR_DTYPE_F32, {}, ctr::Role::Activation));
  int logits = g.add_tensor(tensor("logits", CTR_DTYPE_F32, {}, ctr::Role::Activation));
  int loss = g.add_tensor(tensor("loss", CTR_DTYPE_F32, {}, ctr::Role::Activation));
  auto node = [&](const char *op, std::vector<int> in, int out, std::map<std::string, ctr::Attr> attrs = {}) {
    ctr::Node n;
    n.op = op;
    n.name = std::string(op) + "0";
    n.inputs = std::move(in);
    n.outputs = {out};
    n.attrs = std::move(attrs);
    g.add_node(std::move(n));
  };
  node("embedding", {wte, tokens}, h);
  node("poly", {h}, p, {{"alpha", ctr::Attr::of_float(0.3)}});
  node("linear", {p, head}, logits);
  node("cross_entropy", {logits, targets}, loss);
  g.loss = loss;
  return g;
}

std::vector<int32_t> ids(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(static_cast<size_t>(B * T));
  for (auto &x : v) x = static_cast<int32_t>(rng() % V);
  return v;
}

struct Fixture {
  ctr_mesh *mesh = nullptr;
  ctr_graph *graph = nullptr;
  ctr_options *opts = nullptr;
  ctr_step *step = nullptr;
  Fixture() {
    EXPECT_EQ(ctr_mesh_create(nullptr, &mesh), CTR_STATUS_OK);
    std::vector<uint8_t> buf = ctr::save_graph_buffer(poly_model());
    EXPECT_EQ(ctr_graph_load_buffer(buf.data(), buf.size(), &graph), CTR_STATUS_OK) << ctr_last_error();
    EXPECT_EQ(ctr_options_create(&opts), CTR_STATUS_OK);
    ctr_options_set_int(opts, "batch", B);
    ctr_options_set_float(opts, "lr", 0.05);
    ctr_options_set_float(opts, "weight_decay", 0.0);
    EXPECT_EQ(ctr_step_create(mesh, graph, opts, &step), CTR_STATUS_OK) << ctr_last_error();
    auto tok = ids(1), tgt = ids(2);
    EXPECT_EQ(ctr_step_set_input(step, "tokens", tok.data(), tok.size() * 4), CTR_STATUS_OK);
    EXPECT_EQ(ctr_step_set_input(step, "targets", tgt.data(), tgt.size() * 4), CTR_STATUS_OK);
  }
  ~Fixture() {
    ctr_step_free(step);
    ctr_options_free(opts);
    ctr_graph_free(graph);
    ctr_mesh_free(mesh);
  }
};

TEST(ExtraOp, UnregisteredOpIsRefusedByName) {
  // Runs first (registration below happens in main after this suite).
  std::vector<uint8_t> buf = ctr::save_graph_buffer(poly_model());
  ctr_graph *g = nullptr;
  EXPECT_EQ(ctr_graph_load_buffer(buf.data(), buf.size(), &g), CTR_STATUS_INVALID_GRAPH);
  EXPECT_NE(std::string(ctr_last_error()).find("unknown op 'poly'"), std::string::npos) << ctr_last_error();
  EXPECT_EQ(g, nullptr);
}

class Registered : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    static bool once = [] {
      register_poly();
      return true;
    }();
    (void)once;
  }
};

TEST_F(Registered, DuplicateRegistrationIsRefused) {
  ctr::OpDef d;
  d.name = "poly";
  d.infer = poly_infer;
  EXPECT_THROW(ctr::register_op(d), ctr::Error);
}

TEST_F(Registered, AutodiffEmitsTheDeclaredBackwardOp) {
  Fixture f;
  const Graph &g = f.step->impl->graph();
  int found = 0;
  for (const ctr::Node &n : g.nodes)
    if (n.op == "poly_bwd") {
      ++found;
      EXPECT_DOUBLE_EQ(n.attr_float("alpha", 0), 0.3);  // the forward node's attributes
    }
  EXPECT_EQ(found, 1);
}

TEST_F(Registered, GradientMatchesFiniteDifferences) {
  Fixture f;
  ctr::Step &st = *f.step->impl;
  st.forward_backward();
  std::vector<float> grad(static_cast<size_t>(V * C)), w(grad.size());
  st.read_grad("wte", grad.data(), grad.size());
  ASSERT_EQ(ctr_step_get_param(f.step, "wte", w.data(), w.size()), CTR_STATUS_OK);
  const float h = 1e-2f;
  int checked = 0;
  double worst = 0;
  for (size_t k = 0; k < w.size(); ++k) {
    std::vector<float> wp = w;
    wp[k] = w[k] + h;
    ASSERT_EQ(ctr_step_set_param(f.step, "wte", wp.data(), wp.size()), CTR_STATUS_OK);
    double lp = 0, lm = 0;
    ASSERT_EQ(ctr_step_evaluate(f.step, &lp), CTR_STATUS_OK);
    wp[k] = w[k] - h;
    ASSERT_EQ(ctr_step_set_param(f.step, "wte", wp.data(), wp.size()), CTR_STATUS_OK);
    ASSERT_EQ(ctr_step_evaluate(f.step, &lm), CTR_STATUS_OK);
    const double fd = (lp - lm) / (2.0 * h);
    EXPECT_NEAR(grad[k], fd, 2e-3 + 3e-2 * std::fabs(grad[k])) << "wte[" << k << "]";
    worst = std::max(worst, std::fabs(grad[k] - fd));
    checked += grad[k] != 0.0f;
  }
  ASSERT_EQ(ctr_step_set_param(f.step, "wte", w.data(), w.size()), CTR_STATUS_OK);
  EXPECT_GT(checked, 10) << "the tokens reach too few rows of wte to test anything";
}

TEST_F(Registered, ModelWithTheOpTrains) {
  Fixture f;
  ctr_step_metrics m{};
  m.size = sizeof m;
  ASSERT_EQ(ctr_step_run(f.step, &m), CTR_STATUS_OK) << ctr_last_error();
  const double first = m.loss;
  for (int i = 0; i < 60; ++i) ASSERT_EQ(ctr_step_run(f.step, &m), CTR_STATUS_OK) << ctr_last_error();
  EXPECT_TRUE(std::isfinite(m.loss));
  EXPECT_LT(m.loss, 0.5 * first) << "first " << first << " last " << m.loss;
}

}  // namespace
