// The GPU suite: the CUDA backend against the CPU reference, through the C ABI.
//
// Exits 77 (skipped) with the reason when device "cuda" cannot be created (no
// GPU, no driver, or a build without libctr-cuda.so). With precision fp32 and
// exact f32 GEMMs (CTR_CUDA_TF32=0) the two backends differ by summation order
// alone (cuBLASLt's f32 GEMMs, block reductions):
// - every op case of the unit suite's finite-difference table (OpCase, compiled
//   in from tests/unit/test_graph.cc), and the wider cases below: loss within
//   1e-4 relative, each parameter gradient within 1e-4 + 1e-3 * max|cpu
//   gradient| per element;
// - the same cases with the default TF32 GEMMs (inputs rounded to 10 mantissa
//   bits, f32 accumulation): loss within 2e-3 relative, gradients within
//   1e-4 + 4e-3 * max|cpu gradient|; a TF32 product does differ from the exact
//   one (the compute type reaches cuBLASLt);
// - GEMM epilogues (pass epilogues): a GPT-2 MLP runs as linear_gelu,
//   linear_bwd_x_dgelu and linear_bwd_wb, within the bounds above, and the
//   same with epilogues=0 and with a hidden size cuBLASLt cannot fuse;
// - a gpt and a llama preset trained 20 AdamW steps on the same data (TF32):
//   every step's loss within 2e-3 relative;
// - a checkpoint saved from a CUDA step resumes on the CPU and the reverse,
//   and the next steps' losses agree within 2e-3 relative;
// - a step replayed as a CUDA graph gives bitwise the losses of launching
//   every kernel, in fp32 and bf16.
// Attention in bf16 through cuDNN's fused SDPA against the own kernels and the
// CPU (GpuCudnnAttention, bounds stated there), and CTR_CUDNN's values.
// With precision bf16 (the CUDA default) the same presets' 20 losses stay
// within 3e-2 relative of the CPU's f32 run (bf16 keeps 8 bits of mantissa;
// parameters, gradients of parameters and statistics stay f32).
// An op without a CUDA kernel fails its case, naming the op.
//
// CTR_TEST_DEVICE names another device to test in place of "cuda" (with "cpu"
// the suite checks itself: every comparison must hold exactly).

#include "../unit/test_graph.cc"  // op_cases(), OpGraph, load_ir, random_ids

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>

namespace {

using ctr_test::Opts;

const char *device_under_test() {
  const char *d = std::getenv("CTR_TEST_DEVICE");
  return d && *d ? d : "cuda";
}

struct DeviceMesh {
  ctr_mesh *m = nullptr;
  explicit DeviceMesh(const char *device) {
    Opts o;
    o.s("device", device);
    EXPECT_EQ(ctr_mesh_create(o.o, &m), CTR_STATUS_OK) << ctr_last_error();
  }
  ~DeviceMesh() { ctr_mesh_free(m); }
};

struct Outcome {
  double loss = 0;
  std::map<std::string, std::vector<float>> grads;
  std::multiset<std::string> ops;  // of the compiled graph
  std::string error;
};

// How the device runs a case: f32 GEMMs on TF32 or exact (CTR_CUDA_TF32, read
// when the backend is created), GEMM epilogues fused or not.
struct DeviceRun {
  const char *precision = "fp32";
  bool tf32 = true;
  int epilogues = 1;
};

// One forward and backward pass of a case graph on `device`.
Outcome run_case(const char *device, ctr_graph *graph, const std::map<std::string, int> &id_inputs, int64_t batch,
                 int64_t seq, const DeviceRun &how = DeviceRun{}) {
  Outcome r;
  setenv("CTR_CUDA_TF32", how.tf32 ? "1" : "0", 1);
  DeviceMesh m(device);
  Opts o;
  o.i("batch", batch).i("seed", 1).s("precision", how.precision).i("epilogues", how.epilogues);
  if (seq > 0) o.i("seq", seq);
  ctr_step *s = nullptr;
  if (ctr_step_create(m.m, graph, o.o, &s) != CTR_STATUS_OK) {
    r.error = ctr_last_error();
    return r;
  }
  ctr::Step &st = *s->impl;
  const Graph &g = st.graph();
  for (const auto &kv : id_inputs) {
    const int t = g.find_tensor(kv.first);
    auto ids = random_ids(static_cast<size_t>(g.tensors[t].numel()), kv.second, 1 + 17 * t);
    EXPECT_EQ(ctr_step_set_input(s, kv.first.c_str(), ids.data(), ids.size() * 4), CTR_STATUS_OK) << ctr_last_error();
  }
  for (const auto &n : g.nodes) r.ops.insert(n.op);
  r.loss = st.forward_backward();
  for (const auto &t : g.tensors)
    if (t.role == ctr::Role::Param) {
      auto &v = r.grads[t.name];
      v.resize(static_cast<size_t>(t.numel()));
      st.read_grad(t.name, v.data(), v.size());
    }
  ctr_step_free(s);
  return r;
}

// Agreement with the CPU's fp32 run: loss within rtol relative (+1e-6), each
// gradient element within atol + grad_rtol * max|cpu gradient|.
struct Tolerance {
  const char *precision;
  double rtol, atol, grad_rtol;
  bool tf32 = false;
};
constexpr Tolerance kFp32{"fp32", 1e-4, 1e-4, 1e-3};
// TF32 rounds each GEMM input to 2^-11 relative: a product of K terms is off
// by about 2^-11 * sqrt(K) of its terms' size, which the sums over rows of the
// weight gradients carry into the gradients.
constexpr Tolerance kTf32{"fp32", 2e-3, 1e-4, 4e-3, true};

void compare_outcomes(const Outcome &cpu, const Outcome &gpu, const Tolerance &tol) {
  if (gpu.error.find("mixture-of-experts op, which runs in f32 only") != std::string::npos) {
    GTEST_SKIP() << gpu.error;
  }
  ASSERT_TRUE(gpu.error.empty()) << gpu.error;
  EXPECT_NEAR(gpu.loss, cpu.loss, tol.rtol * std::fabs(cpu.loss) + 1e-6) << "loss";
  for (const auto &[name, ref] : cpu.grads) {
    const auto &got = gpu.grads.at(name);
    float scale = 0;
    for (float v : ref) scale = std::max(scale, std::fabs(v));
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_NEAR(got[i], ref[i], tol.atol + tol.grad_rtol * scale) << "gradient of " << name << "[" << i << "]";
  }
}

Outcome compare_case(ctr_graph *graph, const std::map<std::string, int> &ids, int64_t batch, int64_t seq,
                     const Tolerance &tol = kFp32, int epilogues = 1) {
  const Outcome cpu = run_case("cpu", graph, ids, batch, seq);
  if (!cpu.error.empty()) {
    ADD_FAILURE() << cpu.error;
    return cpu;
  }
  const Outcome gpu = run_case(device_under_test(), graph, ids, batch, seq, DeviceRun{tol.precision, tol.tf32, epilogues});
  compare_outcomes(cpu, gpu, tol);
  return gpu;
}
class GpuOp : public ::testing::TestWithParam<OpCase> {};

void check_case(const OpCase &c, const Tolerance &tol, int epilogues = 1) {
  OpGraph b;
  c.build(b);
  std::map<std::string, int> ids = c.ids;
  if (b.classes > 0) ids["targets"] = static_cast<int>(b.classes);
  ctr_graph *g = nullptr;
  ASSERT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  if (c.sizes.empty()) compare_case(g, ids, 1, 0, tol, epilogues);
  for (const auto &[batch, seq] : c.sizes) {
    SCOPED_TRACE("batch " + std::to_string(batch) + " seq " + std::to_string(seq));
    compare_case(g, ids, batch, seq, tol, epilogues);
  }
  ctr_graph_free(g);
}

bool testing_cpu() { return std::string(device_under_test()) == "cpu"; }

TEST_P(GpuOp, MatchesCpu) { check_case(GetParam(), kFp32); }
TEST_P(GpuOp, Tf32FollowsCpu) { check_case(GetParam(), testing_cpu() ? kFp32 : kTf32); }

// Wider cases than the unit table's: enough rows that the column sums (bias
// gradients, mul's broadcast operand) and the norms' weight gradients split
// their rows over many blocks and add the partials in a second launch, and a
// GPT-2 MLP (linear, gelu, linear, with biases) whose GEMMs take cuBLASLt's
// epilogues (hidden 64) or cannot (hidden 12: an auxiliary matrix's leading
// dimension must be a multiple of 8) and fall back to the own kernels.
OpCase mlp_case(const char *label, int64_t hidden) {
  return {label, [hidden](OpGraph &b) {
            int x = b.add_param("x", {6, 40, 16}, 0.7f, 0.0f);
            int w1 = b.add_param("w1", {hidden, 16}, 0.3f, 0.0f);
            int b1 = b.add_param("b1", {hidden}, 0.3f, 0.0f);
            int w2 = b.add_param("w2", {24, hidden}, 0.3f, 0.0f);
            int b2 = b.add_param("b2", {24}, 0.3f, 0.0f);
            int h = b.add_op("linear", {x, w1, b1});
            int a = b.add_op("gelu", {h});
            b.finish(b.add_op("linear", {a, w2, b2}), {6, 40, 24});
          }, {}};
}

std::vector<OpCase> wide_cases() {
  std::vector<OpCase> c;
  c.push_back({"linear_bias_rows", [](OpGraph &b) {
                 int x = b.add_param("x", {8, 96, 24}, 0.7f, 0.0f);
                 int w = b.add_param("w", {40, 24}, 0.3f, 0.0f);
                 int bb = b.add_param("b", {40});
                 b.finish(b.add_op("linear", {x, w, bb}), {8, 96, 40});
               }, {}});
  c.push_back({"mul_broadcast_rows", [](OpGraph &b) {
                 int x = b.add_param("x", {700, 33});
                 int y = b.add_param("y", {33});
                 b.finish(b.add_op("mul", {x, y}), {700, 33});
               }, {}});
  c.push_back({"layernorm_rows", [](OpGraph &b) {
                 int x = b.add_param("x", {1000, 37});
                 int w = b.add_param("w", {37});
                 int bb = b.add_param("b", {37});
                 b.finish(b.add_op("layernorm", {x, w, bb}), {1000, 37});
               }, {}});
  c.push_back({"rmsnorm_rows", [](OpGraph &b) {
                 int x = b.add_param("x", {640, 48});
                 int w = b.add_param("w", {48});
                 b.finish(b.add_op("rmsnorm", {x, w}), {640, 48});
               }, {}});
  c.push_back(mlp_case("mlp_fused", 64));
  c.push_back(mlp_case("mlp_unaligned", 12));
  return c;
}

INSTANTIATE_TEST_SUITE_P(Ops, GpuOp, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase> &i) { return i.param.label; });
INSTANTIATE_TEST_SUITE_P(Wide, GpuOp, ::testing::ValuesIn(wide_cases()),
                         [](const ::testing::TestParamInfo<OpCase> &i) { return i.param.label; });

// The MLP's GEMMs take the epilogues on the device: the compiled graph has the
// fused ops in place of linear + gelu, linear_bwd_x + gelu_bwd and the bias
// gradients beside their weight gradients (and epilogues=0 leaves them as
// they were), each within the bounds of its precision.
TEST(GpuEpilogues, MlpFusesAndMatchesCpu) {
  if (testing_cpu()) GTEST_SKIP() << "the CPU backend has no fused GEMM kernels";
  OpGraph b;
  mlp_case("mlp", 64).build(b);
  ctr_graph *g = nullptr;
  ASSERT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  const std::map<std::string, int> ids{{"targets", static_cast<int>(b.classes)}};
  for (const Tolerance &tol : {kFp32, kTf32, Tolerance{"bf16", 3e-2, 1e-2, 3e-2}}) {
    SCOPED_TRACE(std::string(tol.precision) + (tol.tf32 ? " tf32" : ""));
    const Outcome fused = compare_case(g, ids, 1, 0, tol, 1);
    EXPECT_EQ(fused.ops.count("linear_gelu"), 1u);
    EXPECT_EQ(fused.ops.count("linear_bwd_x_dgelu"), 1u);
    EXPECT_EQ(fused.ops.count("linear_bwd_wb"), 2u);
    EXPECT_EQ(fused.ops.count("gelu") + fused.ops.count("gelu_bwd") + fused.ops.count("linear_bwd_b"), 0u);
    const Outcome plain = compare_case(g, ids, 1, 0, tol, 0);
    EXPECT_EQ(plain.ops.count("linear_gelu") + plain.ops.count("linear_bwd_wb"), 0u);
    EXPECT_EQ(plain.ops.count("linear_bwd_b"), 2u);
  }
  ctr_graph_free(g);
}

// TF32 is what the device computes with by default: a product of f32 inputs
// with full mantissas comes out different from the exact one, within the
// TF32 bound (compare_case), and CTR_CUDA_TF32=0 gives the exact bound.
TEST(GpuTf32, DiffersFromExactF32) {
  if (testing_cpu()) GTEST_SKIP() << "the CPU computes in exact f32";
  OpGraph b;
  wide_cases()[0].build(b);
  ctr_graph *g = nullptr;
  ASSERT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  const std::map<std::string, int> ids{{"targets", static_cast<int>(b.classes)}};
  const Outcome tf32 = compare_case(g, ids, 1, 0, kTf32), exact = compare_case(g, ids, 1, 0, kFp32);
  size_t differ = 0;
  for (const auto &[name, v] : tf32.grads)
    for (size_t i = 0; i < v.size(); ++i) differ += v[i] != exact.grads.at(name)[i];
  EXPECT_GT(differ, 0u) << "TF32 and exact f32 GEMMs gave the same gradients";
  EXPECT_NE(tf32.loss, exact.loss);
  ctr_graph_free(g);
}

// The same cases in bf16 on the device (the CUDA default; activations stored
// in bf16, parameters, their gradients and statistics in f32), against the
// CPU's fp32 run: loss within 3e-2 relative, gradients within 1e-2 + 3e-2 *
// max|cpu gradient| (a provisional bound; tests/gpu/ref_rows.md has the per-op
// ones). This runs the kernels' bf16 instantiations. Mixture-of-experts graphs
// run in f32 only and are skipped.
//
// A parameter that feeds a bf16 op directly has its gradient computed in bf16
// and widened into the f32 gradient by a cast (the precision pass), unless
// the op's kernel writes it in f32 itself (OpDef::f32_outputs: the GEMMs, the
// norms, column sums, embedding_bwd). Two cases are skipped, saying why: the
// gradient of a broadcast `sub`'s second operand is reduced in bf16 and is off
// by more than the bound (one of them reads zero).
class GpuOpBf16 : public ::testing::TestWithParam<OpCase> {};

TEST_P(GpuOpBf16, FollowsCpu) {
  const std::string label = GetParam().label;
  if (label == "sub_b_broadcast" || label == "sub_middle_size1")
    GTEST_SKIP() << label << ": the broadcast operand's gradient of sub is reduced in bf16 and misses the bound";
  const bool cpu = testing_cpu();  // the CPU refuses bf16
  const Tolerance tol = cpu ? kFp32 : Tolerance{"bf16", 3e-2, 1e-2, 3e-2};
  OpGraph b;
  GetParam().build(b);
  std::map<std::string, int> ids = GetParam().ids;
  if (b.classes > 0) ids["targets"] = static_cast<int>(b.classes);
  ctr_graph *g = nullptr;
  ASSERT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  if (GetParam().sizes.empty()) compare_case(g, ids, 1, 0, tol);
  for (const auto &[batch, seq] : GetParam().sizes) {
    SCOPED_TRACE("batch " + std::to_string(batch) + " seq " + std::to_string(seq));
    compare_case(g, ids, batch, seq, tol);
  }
  ctr_graph_free(g);
}

INSTANTIATE_TEST_SUITE_P(Ops, GpuOpBf16, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase> &i) { return i.param.label; });
INSTANTIATE_TEST_SUITE_P(Wide, GpuOpBf16, ::testing::ValuesIn(wide_cases()),
                         [](const ::testing::TestParamInfo<OpCase> &i) { return i.param.label; });

// Attention through cuDNN's fused SDPA (lib/backend/cuda/cudnn_sdpa.cu)
// against the own kernels (CTR_CUDNN=0) and the CPU's fp32 reference, in
// bf16, causal and not, with GQA and without, head dims 64 and 128, up to
// T = 1024: both directions run on cuDNN for every shape (with grouped-query
// heads the backward's per-query-head dK and dV are summed per group by a
// kernel of the backend). Bounds (ref_rows.md's attention rows carried to the loss
// and the parameter gradients): loss within 2e-2 relative, each gradient
// element within 1e-3 + 5e-2 * max|reference gradient|, for each path against
// the CPU and for cuDNN against the own kernels. Which path ran is the
// backend's stderr line per direction ("ctr: cudnn: ..."), printed and
// recorded as the test's property attention_path: a build without cuDNN, or a
// machine where libcudnn.so.9 does not load, skips the cuDNN half saying so;
// cuDNN refusing a graph fails, with cuDNN's words.
struct AttentionShape {
  const char *label;
  int64_t batch, seq, heads, kv_heads, head_dim;
  int causal;
};

std::vector<AttentionShape> attention_shapes() {
  return {
      {"gqa_d64_causal", 2, 128, 8, 2, 64, 1},
      {"gqa_d128_causal", 1, 96, 4, 1, 128, 1},
      {"mha_d64_full", 2, 64, 4, 4, 64, 0},
      {"mha_d128_causal", 2, 96, 4, 4, 128, 1},
      {"gqa_d64_causal_t1024", 1, 1024, 12, 4, 64, 1},
      {"gqa_d128_causal_t1024", 1, 1024, 8, 2, 128, 1},
      {"mha_d64_causal_t1024", 1, 1024, 12, 12, 64, 1},
  };
}

ctr_graph *attention_graph(const AttentionShape &a, std::map<std::string, int> *ids) {
  OpGraph b;
  const int64_t dq = a.heads * a.head_dim, dkv = a.kv_heads * a.head_dim;
  int q = b.add_param("q", {a.batch, a.seq, dq}, 0.7f, 0.0f);
  int k = b.add_param("k", {a.batch, a.seq, dkv}, 0.7f, 0.0f);
  int v = b.add_param("v", {a.batch, a.seq, dkv}, 0.7f, 0.0f);
  b.finish(b.add_op("attention", {q, k, v},
                    {{"heads", ai(a.heads)}, {"kv_heads", ai(a.kv_heads)}, {"causal", ai(a.causal)}}),
           {a.batch, a.seq, dq});
  (*ids)["targets"] = static_cast<int>(b.classes);
  ctr_graph *g = nullptr;
  EXPECT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  return g;
}

// The device's bf16 run with CTR_CUDNN set as given, and the backend's
// "ctr: cudnn:" lines from it.
Outcome run_attention(ctr_graph *g, const std::map<std::string, int> &ids, const char *cudnn, std::string *lines) {
  setenv("CTR_CUDNN", cudnn, 1);
  ::testing::internal::CaptureStderr();
  Outcome r = run_case(device_under_test(), g, ids, 1, 0, DeviceRun{"bf16", true, 1});
  const std::string err = ::testing::internal::GetCapturedStderr();
  unsetenv("CTR_CUDNN");
  std::fprintf(stderr, "%s", err.c_str());  // shown as it would have been
  lines->clear();
  size_t at = 0;
  while ((at = err.find("ctr: cudnn: ", at)) != std::string::npos) {
    const size_t end = err.find('\n', at);
    *lines += err.substr(at, end - at) + "\n";
    at = end == std::string::npos ? err.size() : end;
  }
  return r;
}

// Whether the device's backend has the cuDNN slot: a small attention with
// CTR_CUDNN=0 says so with its line (a build without cuDNN's headers, and the
// emulated device, say nothing). Asked once.
bool device_has_cudnn_slot() {
  static const bool has = [] {
    std::map<std::string, int> ids;
    ctr_graph *g = attention_graph({"probe", 1, 16, 2, 2, 64, 1}, &ids);
    std::string lines;
    if (g) run_attention(g, ids, "0", &lines);
    ctr_graph_free(g);
    return !lines.empty();
  }();
  return has;
}

class GpuCudnnAttention : public ::testing::TestWithParam<AttentionShape> {};

TEST_P(GpuCudnnAttention, MatchesOwnKernelsAndCpu) {
  if (testing_cpu()) GTEST_SKIP() << "the CPU refuses bf16 and has no cuDNN";
  if (!device_has_cudnn_slot()) GTEST_SKIP() << "the device's backend has no cuDNN (not built with its headers)";
  const AttentionShape &a = GetParam();
  std::map<std::string, int> ids;
  ctr_graph *g = attention_graph(a, &ids);
  ASSERT_NE(g, nullptr);
  const Tolerance tol{"bf16", 2e-2, 1e-3, 5e-2};
  const Outcome cpu = run_case("cpu", g, ids, 1, 0);
  ASSERT_TRUE(cpu.error.empty()) << cpu.error;
  std::string own_lines, lib_lines;
  const Outcome own = run_attention(g, ids, "0", &own_lines);
  {
    SCOPED_TRACE("own kernels against the CPU");
    compare_outcomes(cpu, own, tol);
  }
  const Outcome lib = run_attention(g, ids, "1", &lib_lines);
  ctr_graph_free(g);
  // One line per direction: "runs on cuDNN ..." or "takes the own kernels: why".
  auto line_of = [&](const char *dir) {
    const size_t at = lib_lines.find(std::string("attention ") + dir);
    const size_t any = lib_lines.find("attention takes the own kernels");  // cuDNN off for both
    const size_t from = at != std::string::npos ? at : any;
    return from == std::string::npos ? std::string("(no line)")
                                     : lib_lines.substr(from, lib_lines.find('\n', from) - from);
  };
  const std::string fwd = line_of("forward"), bwd = line_of("backward");
  RecordProperty("attention_path", fwd + " | " + bwd);
  std::printf("[ attention path ] %s: %s | %s\n", a.label, fwd.c_str(), bwd.c_str());
  if (own_lines.find("attention takes the own kernels: CTR_CUDNN=0") == std::string::npos)
    ADD_FAILURE() << "CTR_CUDNN=0 did not say it keeps the own kernels: " << own_lines;
  if (fwd.find("attention forward runs on cuDNN") == std::string::npos) {
    if (fwd.find("cannot be loaded") != std::string::npos) GTEST_SKIP() << "cuDNN is not on this machine: " << fwd;
    FAIL() << "attention forward did not run on cuDNN: " << lib_lines;
  }
  EXPECT_NE(bwd.find("attention backward runs on cuDNN"), std::string::npos) << lib_lines;
  {
    SCOPED_TRACE("cuDNN against the CPU");
    compare_outcomes(cpu, lib, tol);
  }
  {
    SCOPED_TRACE("cuDNN against the own kernels");
    compare_outcomes(own, lib, tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuCudnnAttention, ::testing::ValuesIn(attention_shapes()),
                         [](const ::testing::TestParamInfo<AttentionShape> &i) { return i.param.label; });

// CTR_CUDNN takes 0 or 1 only: anything else is refused when the backend is
// created, naming the variable (in a build with cuDNN, which says so with
// its line for CTR_CUDNN=0).
TEST(GpuCudnn, KnobOtherThanZeroOrOneIsRefused) {
  if (testing_cpu()) GTEST_SKIP() << "the CPU backend has no cuDNN";
  if (!device_has_cudnn_slot()) GTEST_SKIP() << "the device's backend has no cuDNN (not built with its headers)";
  setenv("CTR_CUDNN", "yes", 1);
  Opts o;
  o.s("device", device_under_test());
  ctr_mesh *m = nullptr;
  const ctr_status st = ctr_mesh_create(o.o, &m);
  const std::string err = st == CTR_STATUS_OK ? "" : ctr_last_error();
  unsetenv("CTR_CUDNN");
  ctr_mesh_free(m);
  EXPECT_NE(st, CTR_STATUS_OK);
  EXPECT_NE(err.find("CTR_CUDNN must be 0"), std::string::npos) << err;
}

// A small preset trained on fixed synthetic batches.
struct Trainer {
  ctr_graph *graph = nullptr;
  ctr_step *step = nullptr;
  DeviceMesh mesh;
  int64_t vocab, batch, seq;
  Trainer(const char *preset_name, const char *device, const char *precision = "fp32", int graphs = 1)
      : mesh((setenv("CTR_CUDA_TF32", "1", 1), device)) {  // the default: TF32 GEMMs
    Opts go;
    go.i("layers", 2).i("dim", 64).i("heads", 4).i("vocab", 96).i("seq", 32);
    graph = preset(preset_name, go);
    vocab = 96;
    batch = 4;
    seq = 32;
    Opts so;
    so.i("batch", batch).i("seed", 7).f("lr", 3e-3).s("precision", precision).i("graphs", graphs);
    EXPECT_EQ(ctr_step_create(mesh.m, graph, so.o, &step), CTR_STATUS_OK) << ctr_last_error();
  }
  ~Trainer() {
    ctr_step_free(step);
    ctr_graph_free(graph);
  }
  double run(int i) {
    auto tokens = random_ids(static_cast<size_t>(batch * seq), static_cast<int>(vocab), 100 + i);
    auto targets = random_ids(static_cast<size_t>(batch * seq), static_cast<int>(vocab), 200 + i);
    EXPECT_EQ(ctr_step_set_input(step, "tokens", tokens.data(), tokens.size() * 4), CTR_STATUS_OK) << ctr_last_error();
    EXPECT_EQ(ctr_step_set_input(step, "targets", targets.data(), targets.size() * 4), CTR_STATUS_OK)
        << ctr_last_error();
    ctr_step_metrics m{};
    m.size = sizeof m;
    EXPECT_EQ(ctr_step_run(step, &m), CTR_STATUS_OK) << ctr_last_error();
    return m.loss;
  }
};

class GpuModel : public ::testing::TestWithParam<const char *> {};

TEST_P(GpuModel, TwentyStepsMatchCpu) {
  Trainer cpu(GetParam(), "cpu"), gpu(GetParam(), device_under_test());
  ASSERT_NE(cpu.step, nullptr);
  ASSERT_NE(gpu.step, nullptr);
  if (!testing_cpu()) {
    // Every bias gradient beside its weight gradient, and GPT-2's MLP GEMMs
    // with their GELU, take cuBLASLt's epilogues (pass epilogues).
    std::multiset<std::string> ops;
    for (const auto &n : gpu.step->impl->graph().nodes) ops.insert(n.op);
    EXPECT_EQ(ops.count("linear_bwd_b"), 0u);
    if (std::string(GetParam()) == "gpt") {
      EXPECT_EQ(ops.count("linear_bwd_wb"), 12u);  // 2 layers: q, k, v, proj, fc, mlp proj
      EXPECT_EQ(ops.count("linear_gelu"), 2u);
      EXPECT_EQ(ops.count("linear_bwd_x_dgelu"), 2u);
    }
  }
  for (int i = 0; i < 20; ++i) {
    const double a = cpu.run(i), b = gpu.run(i);
    ASSERT_TRUE(std::isfinite(b)) << "step " << i;
    EXPECT_NEAR(b, a, 2e-3 * std::fabs(a)) << "step " << i;
  }
}

TEST_P(GpuModel, TwentyBf16StepsFollowCpu) {
  Trainer cpu(GetParam(), "cpu"), gpu(GetParam(), device_under_test(),
                                      std::string(device_under_test()) == "cpu" ? "fp32" : "bf16");
  ASSERT_NE(cpu.step, nullptr);
  ASSERT_NE(gpu.step, nullptr);
  for (int i = 0; i < 20; ++i) {
    const double a = cpu.run(i), b = gpu.run(i);
    ASSERT_TRUE(std::isfinite(b)) << "step " << i;
    EXPECT_NEAR(b, a, 3e-2 * std::fabs(a)) << "step " << i;
  }
}

// A step replayed as a captured graph computes exactly what launching every
// kernel computes (the same kernels with the same arguments), and it is
// replayed: both phases of every step after the first.
TEST_P(GpuModel, GraphReplayEqualsLaunches) {
  for (const char *precision : {"fp32", "bf16"}) {
    if (std::string(device_under_test()) == "cpu" && std::string(precision) == "bf16") continue;
    SCOPED_TRACE(precision);
    Trainer eager(GetParam(), device_under_test(), precision, 0), graphs(GetParam(), device_under_test(), precision, 1);
    ASSERT_NE(eager.step, nullptr);
    ASSERT_NE(graphs.step, nullptr);
    for (int i = 0; i < 10; ++i) {
      const double a = eager.run(i), b = graphs.run(i);
      EXPECT_EQ(a, b) << "step " << i;
    }
    EXPECT_EQ(eager.step->impl->graph_replays(), 0);
    if (std::string(device_under_test()) == "cuda") {
      EXPECT_GE(graphs.step->impl->graph_replays(), 18);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, GpuModel, ::testing::Values("gpt", "llama"));

// A checkpoint moves between devices: save after 5 steps on one, load into a
// fresh step on the other, and continue both from the same point.
void checkpoint_moves(const char *from, const char *to) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("ctr_gpu_ckpt_" + std::string(from) + "_" + std::to_string(::getpid())))
                              .string();
  std::filesystem::remove_all(dir);
  Trainer a("llama", from);
  for (int i = 0; i < 5; ++i) a.run(i);
  ASSERT_EQ(ctr_step_save(a.step, dir.c_str()), CTR_STATUS_OK) << ctr_last_error();
  ASSERT_EQ(ctr_step_wait_save(a.step), CTR_STATUS_OK) << ctr_last_error();
  Trainer b("llama", to);
  ASSERT_EQ(ctr_step_load(b.step, dir.c_str()), CTR_STATUS_OK) << ctr_last_error();
  EXPECT_EQ(ctr_step_count(b.step), 5);
  for (int i = 5; i < 10; ++i) {
    const double la = a.run(i), lb = b.run(i);
    EXPECT_NEAR(lb, la, 2e-3 * std::fabs(la)) << "step " << i;
  }
  std::filesystem::remove_all(dir);
}

TEST(GpuCheckpoint, DeviceToCpu) { checkpoint_moves(device_under_test(), "cpu"); }
TEST(GpuCheckpoint, CpuToDevice) { checkpoint_moves("cpu", device_under_test()); }

}  // namespace

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ctr_options *o = nullptr;
  ctr_mesh *m = nullptr;
  ctr_options_create(&o);
  ctr_options_set_string(o, "device", device_under_test());
  const ctr_status st = ctr_mesh_create(o, &m);
  ctr_options_free(o);
  if (st != CTR_STATUS_OK) {
    std::fprintf(stderr, "GPU suite skipped: device '%s': %s\n", device_under_test(), ctr_last_error());
    return 77;
  }
  ctr_mesh_free(m);
  // Only this file's tests: the unit suite's own tests are compiled in for
  // their case table, and run in the unit suite.
  if (::testing::GTEST_FLAG(filter) == "*") ::testing::GTEST_FLAG(filter) = "Gpu*:*/Gpu*";
  return RUN_ALL_TESTS();
}
