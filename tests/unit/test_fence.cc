// The fenced CPU backend (CTR_FENCE_MEMORY=1) keeps step memory inaccessible to
// the host outside backend calls. These tests prove the fence holds — a host
// read of a parameter's device address faults — and that a step trains on it,
// bit for bit as on the ordinary CPU backend, so the suites run with the fence
// on are exercising every host access of the runtime.

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "api/handles.h"
#include "ctr/ctr.h"
#include "runtime/step.h"

// GCC defines __SANITIZE_ADDRESS__ under -fsanitize=address; clang 14 only
// answers __has_feature(address_sanitizer).
#if defined(__SANITIZE_ADDRESS__)
#define CTR_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CTR_TEST_ASAN 1
#endif
#endif
#ifndef CTR_TEST_ASAN
#define CTR_TEST_ASAN 0
#endif

namespace {

struct StepRun {
  ctr_mesh *mesh = nullptr;
  ctr_graph *graph = nullptr;
  ctr_options *opts = nullptr;
  ctr_step *step = nullptr;
  explicit StepRun(bool fenced) {
    if (fenced)
      setenv("CTR_FENCE_MEMORY", "1", 1);
    else
      unsetenv("CTR_FENCE_MEMORY");
    ctr_options *g = nullptr;
    ctr_options_create(&g);
    ctr_options_set_int(g, "layers", 2);
    ctr_options_set_int(g, "dim", 32);
    ctr_options_set_int(g, "heads", 2);
    ctr_options_set_int(g, "vocab", 32);
    ctr_options_set_int(g, "seq", 8);
    EXPECT_EQ(ctr_graph_create_preset("gpt", g, &graph), CTR_STATUS_OK);
    ctr_options_free(g);
    EXPECT_EQ(ctr_mesh_create(nullptr, &mesh), CTR_STATUS_OK);
    ctr_options_create(&opts);
    ctr_options_set_int(opts, "batch", 2);
    ctr_options_set_int(opts, "micro_batches", 2);
    ctr_options_set_string(opts, "keep", "logits");
    EXPECT_EQ(ctr_step_create(mesh, graph, opts, &step), CTR_STATUS_OK) << ctr_last_error();
    unsetenv("CTR_FENCE_MEMORY");
  }
  ~StepRun() {
    ctr_step_free(step);
    ctr_options_free(opts);
    ctr_graph_free(graph);
    ctr_mesh_free(mesh);
  }
  std::vector<double> train(int steps) {
    std::mt19937 rng(3);
    std::vector<int32_t> tok(2 * 2 * 8), tgt(tok.size());
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      for (auto &x : tok) x = static_cast<int32_t>(rng() % 32);
      for (auto &x : tgt) x = static_cast<int32_t>(rng() % 32);
      EXPECT_EQ(ctr_step_set_input(step, "tokens", tok.data(), tok.size() * 4), CTR_STATUS_OK);
      EXPECT_EQ(ctr_step_set_input(step, "targets", tgt.data(), tgt.size() * 4), CTR_STATUS_OK);
      ctr_step_metrics m{};
      m.size = sizeof m;
      EXPECT_EQ(ctr_step_run(step, &m), CTR_STATUS_OK) << ctr_last_error();
      losses.push_back(m.loss);
    }
    return losses;
  }
  int param_tensor() const {
    const ctr::Graph &g = step->impl->graph();
    for (size_t i = 0; i < g.tensors.size(); ++i)
      if (g.tensors[i].role == ctr::Role::Param) return static_cast<int>(i);
    return -1;
  }
};

TEST(Fence, HostReadOfStepMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        StepRun r(true);
        r.train(1);
        volatile float v = *static_cast<const float *>(r.step->impl->device_address(r.param_tensor()));
        (void)v;
        std::exit(0);  // reached only if the read did not fault
      },
#if CTR_TEST_ASAN
      // AddressSanitizer takes the fault and reports it before the process ends
      // (with abort_on_error=1, by SIGABRT rather than SIGSEGV).
      [](int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }, "SEGV");
#else
      ::testing::KilledBySignal(SIGSEGV), "");
#endif
}

TEST(Fence, UnfencedHostReadIsFine) {
  // Without the fence the host reads step memory directly, and what it reads is
  // the parameter itself: the same values the ABI's copy returns.
  StepRun r(false);
  r.train(1);
  const int t = r.param_tensor();
  ASSERT_GE(t, 0);
  const ctr::Tensor &info = r.step->impl->graph().tensors[static_cast<size_t>(t)];
  ASSERT_EQ(info.dtype, CTR_DTYPE_F32);
  const size_t n = static_cast<size_t>(info.numel());
  std::vector<float> via_abi(n);
  ASSERT_EQ(ctr_step_get_param(r.step, info.name.c_str(), via_abi.data(), n), CTR_STATUS_OK) << ctr_last_error();
  const float *direct = static_cast<const float *>(r.step->impl->device_address(t));
  ASSERT_NE(direct, nullptr);
  EXPECT_EQ(std::memcmp(direct, via_abi.data(), n * sizeof(float)), 0) << info.name;
}

TEST(Fence, TrainingIsBitwiseTheSameBehindTheFence) {
  std::vector<double> plain = StepRun(false).train(4);
  StepRun fenced(true);
  std::vector<double> behind = fenced.train(4);
  ASSERT_EQ(plain.size(), behind.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(plain[i], behind[i]) << "step " << i;
  // Reads through the ABI go through backend copies and work behind the fence.
  std::vector<float> logits(2 * 8 * 32);
  EXPECT_EQ(ctr_step_get_output(fenced.step, "logits", logits.data(), logits.size()), CTR_STATUS_OK);
  std::vector<float> w(32 * 32);
  EXPECT_EQ(ctr_step_get_param(fenced.step, "wte", w.data(), w.size()), CTR_STATUS_OK) << ctr_last_error();
}

}  // namespace
