// bf16 mixed precision on the CPU backend, through the C ABI, against the same
// backend's fp32 run.
//
// - Every op case of the unit suite's finite-difference table (OpCase, compiled
//   in from test_graph.cc), forward and backward in bf16: loss within 3e-2
//   relative, each parameter gradient within 1e-2 + 3e-2 * max|fp32 gradient|
//   (bf16 keeps 8 bits of mantissa: each stored activation is off by up to
//   2^-9 relative, and a chain of a few ops compounds that). The same bounds
//   hold for every op: kernels without bf16 code of their own reduce in f32
//   and round only what they store.
// - The gpt, llama and moe presets (small) trained 200 AdamW steps on a
//   learnable synthetic task: the bf16 loss of the last step within 2% of the
//   fp32 one, and both well below the first.
// - Checkpoints move between precisions: saved from a bf16 step, resumed by an
//   fp32 one, and the reverse; the next steps' losses agree within 3e-2.
// - With CTR_CPU_FEATURES=-avx512_bf16 (test cpu_bf16_refused) a bf16 step is
//   refused naming the missing feature, and fp32 still runs.
// On a CPU without AVX512_BF16 the bf16 tests skip, saying so.

#include "test_graph.cc"  // op_cases(), OpGraph, load_ir, random_ids, preset

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "cpu/kernels.h"

namespace {

using ctr_test::Opts;

#define SKIP_WITHOUT_BF16()                                                       \
  do {                                                                            \
    if (!ctr::cpu::bf16_unavailable().empty()) GTEST_SKIP() << ctr::cpu::bf16_unavailable(); \
  } while (0)

struct Result {
  double loss = 0;
  std::map<std::string, std::vector<float>> grads;
  std::string error;
};

Result run_case(ctr_graph *graph, const std::map<std::string, int> &id_inputs, int64_t batch, int64_t seq,
                const char *precision) {
  Result r;
  Mesh m;
  Opts o;
  o.i("batch", batch).i("seed", 1).s("precision", precision);
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

class CpuBf16Op : public ::testing::TestWithParam<OpCase> {};

TEST_P(CpuBf16Op, FollowsFp32) {
  SKIP_WITHOUT_BF16();
  OpGraph b;
  GetParam().build(b);
  std::map<std::string, int> ids = GetParam().ids;
  if (b.classes > 0) ids["targets"] = static_cast<int>(b.classes);
  ctr_graph *g = nullptr;
  ASSERT_EQ(load_ir(b.g, &g), CTR_STATUS_OK) << ctr_last_error();
  std::vector<std::pair<int64_t, int64_t>> sizes = GetParam().sizes;
  if (sizes.empty()) sizes.push_back({1, 0});
  for (const auto &[batch, seq] : sizes) {
    SCOPED_TRACE("batch " + std::to_string(batch) + " seq " + std::to_string(seq));
    const Result f32 = run_case(g, ids, batch, seq, "fp32");
    ASSERT_TRUE(f32.error.empty()) << f32.error;
    const Result h = run_case(g, ids, batch, seq, "bf16");
    ASSERT_TRUE(h.error.empty()) << h.error;
    EXPECT_NEAR(h.loss, f32.loss, 3e-2 * std::fabs(f32.loss) + 1e-6) << "loss";
    for (const auto &[name, ref] : f32.grads) {
      const auto &got = h.grads.at(name);
      float scale = 0;
      for (float v : ref) scale = std::max(scale, std::fabs(v));
      for (size_t i = 0; i < ref.size(); ++i)
        ASSERT_NEAR(got[i], ref[i], 1e-2 + 3e-2 * scale) << "gradient of " << name << "[" << i << "]";
    }
  }
  ctr_graph_free(g);
}

INSTANTIATE_TEST_SUITE_P(Ops, CpuBf16Op, ::testing::ValuesIn(op_cases()),
                         [](const ::testing::TestParamInfo<OpCase> &i) { return i.param.label; });

// A small preset trained on a learnable task: each target is its token plus
// 0..3 (mod the vocabulary), so the loss falls from log(V) towards log(4).
struct Trainer {
  ctr_graph *graph = nullptr;
  ctr_step *step = nullptr;
  Mesh mesh;
  static constexpr int64_t kVocab = 64, kBatch = 4, kSeq = 32;
  Trainer(const char *name, const char *precision) {
    Opts go;
    go.i("layers", 2).i("dim", 64).i("heads", 4).i("vocab", kVocab).i("seq", kSeq);
    if (std::string(name) == "llama" || std::string(name) == "moe") go.i("kv_heads", 2);
    if (std::string(name) == "moe") go.i("experts", 4).i("top_k", 2).i("ffn_dim", 64);
    graph = preset(name, go);
    Opts so;
    so.i("batch", kBatch).i("seed", 7).f("lr", 3e-3).s("precision", precision);
    EXPECT_EQ(ctr_step_create(mesh.m, graph, so.o, &step), CTR_STATUS_OK) << ctr_last_error();
  }
  ~Trainer() {
    ctr_step_free(step);
    ctr_graph_free(graph);
  }
  double run(int i) {
    auto tokens = random_ids(static_cast<size_t>(kBatch * kSeq), static_cast<int>(kVocab), 100 + i);
    auto noise = random_ids(tokens.size(), 4, 300 + i);
    std::vector<int32_t> targets(tokens.size());
    for (size_t k = 0; k < tokens.size(); ++k) targets[k] = (tokens[k] + noise[k]) % static_cast<int32_t>(kVocab);
    EXPECT_EQ(ctr_step_set_input(step, "tokens", tokens.data(), tokens.size() * 4), CTR_STATUS_OK) << ctr_last_error();
    EXPECT_EQ(ctr_step_set_input(step, "targets", targets.data(), targets.size() * 4), CTR_STATUS_OK)
        << ctr_last_error();
    ctr_step_metrics m{};
    m.size = sizeof m;
    EXPECT_EQ(ctr_step_run(step, &m), CTR_STATUS_OK) << ctr_last_error();
    return m.loss;
  }
};

class CpuBf16Model : public ::testing::TestWithParam<const char *> {};

TEST_P(CpuBf16Model, TwoHundredStepsEndWithinTwoPercent) {
  SKIP_WITHOUT_BF16();
  Trainer f32(GetParam(), "fp32"), h(GetParam(), "bf16");
  ASSERT_NE(f32.step, nullptr);
  ASSERT_NE(h.step, nullptr);
  // The bf16 step stores its activations in bf16 and multiplies bf16 operands.
  int bf16 = 0;
  for (const auto &t : h.step->impl->graph().tensors) bf16 += t.dtype == CTR_DTYPE_BF16;
  EXPECT_GT(bf16, 0);
  double first = 0, a = 0, b = 0;
  for (int i = 0; i < 200; ++i) {
    a = f32.run(i);
    b = h.run(i);
    ASSERT_TRUE(std::isfinite(b)) << "step " << i;
    if (i == 0) first = a;
  }
  EXPECT_LT(a, 0.6 * first) << "fp32 did not learn";
  EXPECT_NEAR(b, a, 0.02 * a) << "last step's loss";
}

INSTANTIATE_TEST_SUITE_P(Presets, CpuBf16Model, ::testing::Values("gpt", "llama", "moe"));

void checkpoint_moves(const char *from, const char *to) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("ctr_bf16_ckpt_" + std::string(from) + "_" + std::to_string(::getpid())))
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
    EXPECT_NEAR(lb, la, 3e-2 * std::fabs(la)) << "step " << i;
  }
  std::filesystem::remove_all(dir);
}

TEST(CpuBf16Checkpoint, Bf16ToFp32) {
  SKIP_WITHOUT_BF16();
  checkpoint_moves("bf16", "fp32");
}
TEST(CpuBf16Checkpoint, Fp32ToBf16) {
  SKIP_WITHOUT_BF16();
  checkpoint_moves("fp32", "bf16");
}

// The kernels that read and write bf16 rows themselves compute what their f32
// kernels compute on widened copies, rounded once: norms, rope, the
// cross-entropy and the embedding lookup the same bits
// as the widened path they replace; attention the same arithmetic on each
// head's rows made contiguous, whose GEMMs may block (and so round) differently
// from the strided ones: probabilities within 1e-6 and every bf16 output within
// one bf16 step (2^-8 relative) of the widened path's, on odd widths and a
// grouped-query, causal, windowed and soft-capped attention.
std::vector<uint16_t> bf16_values(size_t n, uint32_t seed, float scale) {
  std::vector<float> f(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  for (float &x : f) x = d(rng);
  std::vector<uint16_t> h(n);
  ctr::cpu::f32_to_bf16(f.data(), h.data(), static_cast<int64_t>(n));
  return h;
}
std::vector<float> widened_copy(const std::vector<uint16_t> &h) {
  std::vector<float> f(h.size());
  ctr::cpu::bf16_to_f32(h.data(), f.data(), static_cast<int64_t>(h.size()));
  return f;
}
// Where two bf16 tensors differ by more than one bf16 step: "" or the first place.
std::string beyond_one_step(const std::vector<uint16_t> &a, const std::vector<uint16_t> &b) {
  if (a.size() != b.size()) return "sizes differ";
  const std::vector<float> fa = widened_copy(a), fb = widened_copy(b);
  for (size_t i = 0; i < fa.size(); ++i)
    if (!(std::fabs(fa[i] - fb[i]) <= std::ldexp(std::max(std::fabs(fa[i]), std::fabs(fb[i])), -7) + 1e-30f))
      return "element " + std::to_string(i) + ": " + std::to_string(fa[i]) + " vs " + std::to_string(fb[i]);
  return "";
}
std::vector<uint16_t> narrowed(const std::vector<float> &f) {
  std::vector<uint16_t> h(f.size());
  ctr::cpu::f32_to_bf16(f.data(), h.data(), static_cast<int64_t>(f.size()));
  return h;
}

TEST(CpuBf16Rows, NormsMatchTheWidenedKernelsBitForBit) {
  namespace cpu = ctr::cpu;
  for (const int64_t C : {7, 64, 300}) {
    SCOPED_TRACE(C);
    const int64_t R = 37;
    const auto x = bf16_values(R * C, 1, 2.0f), dy = bf16_values(R * C, 2, 1.0f);
    const auto xf = widened_copy(x), dyf = widened_copy(dy);
    std::vector<float> w(C), b(C);
    for (int64_t j = 0; j < C; ++j) {
      w[j] = 0.5f + 0.01f * static_cast<float>(j);
      b[j] = 0.1f - 0.002f * static_cast<float>(j);
    }
    std::vector<float> y32(R * C), mean32(R), rstd32(R), mean(R), rstd(R);
    std::vector<uint16_t> y(R * C);
    cpu::layernorm_fwd(xf.data(), w.data(), b.data(), y32.data(), mean32.data(), rstd32.data(), R, C, 1e-5f);
    cpu::layernorm_fwd_bf16(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), R, C, 1e-5f);
    EXPECT_EQ(y, narrowed(y32));
    EXPECT_EQ(mean, mean32);
    EXPECT_EQ(rstd, rstd32);
    std::vector<float> dx32(R * C), dw32(C), db32(C), dw(C), db(C);
    std::vector<uint16_t> dx(R * C);
    cpu::layernorm_bwd(dyf.data(), xf.data(), w.data(), mean.data(), rstd.data(), dx32.data(), dw32.data(),
                       db32.data(), R, C, false);
    cpu::layernorm_bwd_bf16(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), dx.data(), dw.data(),
                            db.data(), R, C, false);
    EXPECT_EQ(dx, narrowed(dx32));
    EXPECT_EQ(dw, dw32);
    EXPECT_EQ(db, db32);
    cpu::rmsnorm_fwd(xf.data(), w.data(), y32.data(), rstd32.data(), R, C, 1e-6f);
    cpu::rmsnorm_fwd_bf16(x.data(), w.data(), y.data(), rstd.data(), R, C, 1e-6f);
    EXPECT_EQ(y, narrowed(y32));
    EXPECT_EQ(rstd, rstd32);
    cpu::rmsnorm_bwd(dyf.data(), xf.data(), w.data(), rstd.data(), dx32.data(), dw32.data(), R, C, false);
    cpu::rmsnorm_bwd_bf16(dy.data(), x.data(), w.data(), rstd.data(), dx.data(), dw.data(), R, C, false);
    EXPECT_EQ(dx, narrowed(dx32));
    EXPECT_EQ(dw, dw32);
  }
}

TEST(CpuBf16Rows, CrossEntropyAndEmbeddingMatchTheWidenedKernelsBitForBit) {
  namespace cpu = ctr::cpu;
  const int64_t R = 29, V = 1003, C = 48;
  const auto logits = bf16_values(R * V, 7, 3.0f);
  const auto lf = widened_copy(logits);
  std::vector<int32_t> targets(R);
  for (int64_t r = 0; r < R; ++r) targets[r] = r % 5 == 3 ? -1 : static_cast<int32_t>((r * 37) % V);
  float loss32 = 0, loss = 0;
  int64_t count32 = 0, count = 0;
  std::vector<float> lse32(R), lse(R);
  cpu::cross_entropy_fwd(lf.data(), targets.data(), &loss32, lse32.data(), &count32, R, V);
  cpu::cross_entropy_fwd_bf16(logits.data(), targets.data(), &loss, lse.data(), &count, R, V);
  EXPECT_EQ(loss, loss32);
  EXPECT_EQ(lse, lse32);
  EXPECT_EQ(count, count32);
  std::vector<float> d32(R * V);
  std::vector<uint16_t> d(R * V);
  cpu::cross_entropy_bwd(lf.data(), targets.data(), lse.data(), 1.5f, count, d32.data(), R, V);
  cpu::cross_entropy_bwd_bf16(logits.data(), targets.data(), lse.data(), 1.5f, count, d.data(), R, V);
  EXPECT_EQ(d, narrowed(d32));
  const auto table = bf16_values(V * C, 8, 1.0f);
  const auto tf = widened_copy(table);
  std::vector<float> e32(R * C);
  std::vector<uint16_t> e(R * C);
  std::vector<int32_t> ids(R);
  for (int64_t r = 0; r < R; ++r) ids[r] = static_cast<int32_t>((r * 53) % V);
  cpu::embedding_fwd(ids.data(), tf.data(), e32.data(), R, V, C);
  cpu::embedding_fwd_bf16(ids.data(), table.data(), e.data(), R, C);
  EXPECT_EQ(e, narrowed(e32));
}

TEST(CpuBf16Rows, AttentionWithinOneStepAndRopeBitForBit) {
  namespace cpu = ctr::cpu;
  struct Case {
    int64_t B, T, Hq, Hkv, D;
    bool causal;
    int64_t window;
    float softcap;
  };
  for (const Case &k : {Case{2, 70, 4, 2, 16, true, 0, 0.0f}, Case{1, 96, 3, 3, 8, false, 0, 0.0f},
                        Case{2, 130, 4, 1, 16, true, 40, 30.0f}}) {
    SCOPED_TRACE(k.T);
    const int64_t nq = k.B * k.T * k.Hq * k.D, nk = k.B * k.T * k.Hkv * k.D, np = k.B * k.Hq * k.T * k.T;
    const float scale = 1.0f / std::sqrt(static_cast<float>(k.D));
    const auto q = bf16_values(nq, 3, 1.0f), kk = bf16_values(nk, 4, 1.0f), v = bf16_values(nk, 5, 1.0f);
    const auto dout = bf16_values(nq, 6, 1.0f);
    const auto qf = widened_copy(q), kf = widened_copy(kk), vf = widened_copy(v), gf = widened_copy(dout);
    std::vector<float> out32(nq), p32(np), p(np);
    std::vector<uint16_t> out(nq);
    cpu::attention_fwd(qf.data(), kf.data(), vf.data(), out32.data(), p32.data(), k.B, k.T, k.Hq, k.Hkv, k.D, scale,
                       k.causal, k.window, k.softcap);
    cpu::attention_fwd_bf16(q.data(), kk.data(), v.data(), out.data(), p.data(), k.B, k.T, k.Hq, k.Hkv, k.D, scale,
                            k.causal, k.window, k.softcap);
    EXPECT_EQ(beyond_one_step(out, narrowed(out32)), "");
    float worst = 0.0f;
    for (int64_t i = 0; i < np; ++i) worst = std::max(worst, std::fabs(p[i] - p32[i]));
    EXPECT_LE(worst, 1e-6f);
    std::vector<float> dq32(nq), dk32(nk), dv32(nk);
    std::vector<uint16_t> dq(nq), dk(nk), dv(nk);
    cpu::attention_bwd(gf.data(), qf.data(), kf.data(), vf.data(), p.data(), dq32.data(), dk32.data(), dv32.data(),
                       k.B, k.T, k.Hq, k.Hkv, k.D, scale, k.causal, k.window, k.softcap);
    cpu::attention_bwd_bf16(dout.data(), q.data(), kk.data(), v.data(), p.data(), dq.data(), dk.data(), dv.data(),
                            k.B, k.T, k.Hq, k.Hkv, k.D, scale, k.causal, k.window, k.softcap);
    EXPECT_EQ(beyond_one_step(dq, narrowed(dq32)), "");
    EXPECT_EQ(beyond_one_step(dk, narrowed(dk32)), "");
    EXPECT_EQ(beyond_one_step(dv, narrowed(dv32)), "");
    for (const bool interleaved : {false, true}) {
      std::vector<float> r32(nq);
      std::vector<uint16_t> r(nq);
      cpu::rope_fwd(qf.data(), r32.data(), k.B, k.T, k.Hq, k.D, 10000.0f, interleaved, 1, 0);
      cpu::rope_fwd_bf16(q.data(), r.data(), k.B, k.T, k.Hq, k.D, 10000.0f, interleaved, 1, 0);
      EXPECT_EQ(r, narrowed(r32));
      cpu::rope_bwd(gf.data(), r32.data(), k.B, k.T, k.Hq, k.D, 10000.0f, interleaved, 2, 1);
      std::vector<uint16_t> g = dout;  // in place, as the step may run it
      cpu::rope_bwd_bf16(g.data(), g.data(), k.B, k.T, k.Hq, k.D, 10000.0f, interleaved, 2, 1);
      EXPECT_EQ(g, narrowed(r32));
    }
  }
}

// Run with CTR_CPU_FEATURES=-avx512_bf16 (test cpu_bf16_refused): the CPU
// seems to lack the feature, and bf16 is refused, never run as fp32.
TEST(CpuBf16Refused, NamesTheMissingFeature) {
  const char *env = std::getenv("CTR_CPU_FEATURES");
  if (!env || std::string(env).find("-avx512_bf16") == std::string::npos)
    GTEST_SKIP() << "run with CTR_CPU_FEATURES=-avx512_bf16";
  EXPECT_FALSE(ctr::cpu::cpu_features().avx512_bf16);
  Opts go;
  go.i("layers", 1).i("dim", 16).i("heads", 2).i("vocab", 11).i("seq", 6);
  ctr_graph *graph = preset("gpt", go);
  Mesh m;
  for (const char *precision : {"bf16", "fp32", "auto"}) {
    SCOPED_TRACE(precision);
    Opts so;
    so.s("precision", precision).i("batch", 1);
    ctr_step *s = nullptr;
    const ctr_status st = ctr_step_create(m.m, graph, so.o, &s);
    if (std::string(precision) == "bf16") {
      EXPECT_EQ(st, CTR_STATUS_UNSUPPORTED);
      EXPECT_NE(std::string(ctr_last_error()).find("'precision' bf16: this CPU's AVX512_BF16 is turned off"),
                std::string::npos)
          << ctr_last_error();
      EXPECT_EQ(s, nullptr);
    } else {
      ASSERT_EQ(st, CTR_STATUS_OK) << ctr_last_error();
      for (const auto &t : s->impl->graph().tensors) EXPECT_NE(t.dtype, CTR_DTYPE_BF16) << t.name;
    }
    ctr_step_free(s);
  }
  ctr_graph_free(graph);
}

}  // namespace

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Only this file's tests: the unit suite's are compiled in for their cases.
  if (::testing::GTEST_FLAG(filter) == "*") ::testing::GTEST_FLAG(filter) = "CpuBf16*:*/CpuBf16*";
  return RUN_ALL_TESTS();
}
