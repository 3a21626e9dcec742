// A failed launch on the emulated CUDA device, through the C ABI: the step
// fails with CTR_STATUS_DEVICE_ERROR naming the op and the kernel's launch
// site, stays failed, and never reports a number computed after the fault.
// The emulator makes a named launch fault (CTR_EMU_FAIL_LAUNCH, sticky, as an
// illegal address) or be refused (CTR_EMU_FAIL_CONFIG, an invalid
// configuration). A device fault lasts for the process, so each case runs in
// a child process of its own.
//
// Run with CTR_PLUGIN_PATH naming the emulated plugin's directory (suite emu);
// exits 77 (skipped) where device "cuda" cannot be created.

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ctr/ctr.h"

namespace {

// What a child found wrong, printed before it exits 1.
struct Findings {
  std::vector<std::string> wrong;
  void expect(bool ok, const std::string &what) {
    if (!ok) wrong.push_back(what);
  }
  void contains(const std::string &s, const char *part) { expect(s.find(part) != std::string::npos, "'" + s + "' lacks '" + part + "'"); }
  [[noreturn]] void exit() {
    for (const auto &w : wrong) std::fprintf(stderr, "wrong: %s\n", w.c_str());
    std::exit(wrong.empty() ? 0 : 1);
  }
};

struct StepRun {
  ctr_status create = CTR_STATUS_OK, first = CTR_STATUS_OK, second = CTR_STATUS_OK, param = CTR_STATUS_OK;
  std::string create_msg, first_msg, second_msg, param_msg;
  double loss = -1;
};

// A small gpt on device "cuda", run twice; graphs as asked.
StepRun run_gpt(int graphs) {
  StepRun r;
  ctr_options *mo = nullptr;
  ctr_options_create(&mo);
  ctr_options_set_string(mo, "device", "cuda");
  ctr_mesh *mesh = nullptr;
  if (ctr_mesh_create(mo, &mesh) != CTR_STATUS_OK) {
    std::fprintf(stderr, "no mesh: %s\n", ctr_last_error());
    std::exit(3);
  }
  ctr_options *go = nullptr;
  ctr_options_create(&go);
  ctr_options_set_int(go, "layers", 1);
  ctr_options_set_int(go, "dim", 16);
  ctr_options_set_int(go, "heads", 2);
  ctr_options_set_int(go, "vocab", 16);
  ctr_options_set_int(go, "seq", 4);
  ctr_graph *g = nullptr;
  ctr_graph_create_preset("gpt", go, &g);
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 2);
  ctr_options_set_string(so, "precision", "fp32");
  ctr_options_set_int(so, "graphs", graphs);
  ctr_step *s = nullptr;
  r.create = ctr_step_create(mesh, g, so, &s);
  r.create_msg = ctr_last_error();
  if (r.create == CTR_STATUS_OK) {
    const int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8}, targets[8] = {2, 3, 4, 5, 6, 7, 8, 9};
    ctr_step_set_input(s, "tokens", tokens, sizeof tokens);
    ctr_step_set_input(s, "targets", targets, sizeof targets);
    ctr_step_metrics m{};
    m.size = sizeof m;
    r.first = ctr_step_run(s, &m);
    r.first_msg = ctr_last_error();
    r.loss = m.loss;
    ctr_step_metrics m2{};
    m2.size = sizeof m2;
    r.second = ctr_step_run(s, &m2);
    r.second_msg = ctr_last_error();
    float w[16 * 16];
    r.param = ctr_step_get_param(s, "wte", w, 16 * 16);
    r.param_msg = ctr_last_error();
  }
  // Shown when the case fails (a death test keeps its child's stderr).
  std::fprintf(stderr, "create: %s\nfirst: %s\nsecond: %s\nparam: %s\n", r.create_msg.c_str(), r.first_msg.c_str(),
               r.second_msg.c_str(), r.param_msg.c_str());
  ctr_step_free(s);
  ctr_options_free(so);
  ctr_options_free(go);
  ctr_options_free(mo);
  ctr_graph_free(g);
  ctr_mesh_free(mesh);
  return r;
}

class EmuDeviceError : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(EmuDeviceError, WithoutAFaultTheStepTrains) {
  auto child = [] {
    Findings f;
    const StepRun r = run_gpt(1);
    f.expect(r.create == CTR_STATUS_OK, r.create_msg);
    f.expect(r.first == CTR_STATUS_OK, r.first_msg);
    f.expect(r.second == CTR_STATUS_OK, r.second_msg);
    f.expect(r.param == CTR_STATUS_OK, r.param_msg);
    f.expect(r.loss > 1.0, "loss " + std::to_string(r.loss));
    f.exit();
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

TEST_F(EmuDeviceError, AKernelFaultInForwardNamesTheOpAndTheKernel) {
  auto child = [] {
    setenv("CTR_EMU_FAIL_LAUNCH", "layernorm_fwd_kernel", 1);
    Findings f;
    const StepRun r = run_gpt(0);
    f.expect(r.create == CTR_STATUS_OK, r.create_msg);
    f.expect(r.first == CTR_STATUS_DEVICE_ERROR, "first run: " + r.first_msg);
    f.contains(r.first_msg, "device 'cuda' failed launching op layernorm '");
    f.contains(r.first_msg, "(forward)");
    f.contains(r.first_msg, "layernorm_fwd_kernel failed at norm.cu:");
    f.contains(r.first_msg, "an illegal memory access was encountered");
    f.expect(r.loss == 0.0, "a failed step wrote its metrics");
    // Sticky: the step never runs on, and nothing is read back.
    f.expect(r.second == CTR_STATUS_DEVICE_ERROR, "second run: " + r.second_msg);
    f.contains(r.second_msg, "a failed device stays failed");
    f.expect(r.param == CTR_STATUS_DEVICE_ERROR, "parameter: " + r.param_msg);
    f.contains(r.param_msg, "(found reading a parameter)");
    f.exit();
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "device fault");
}

TEST_F(EmuDeviceError, ARefusedLaunchInBackwardFailsTheStep) {
  auto child = [] {
    setenv("CTR_EMU_FAIL_CONFIG", "xent_bwd_kernel", 1);
    Findings f;
    const StepRun r = run_gpt(0);
    f.expect(r.first == CTR_STATUS_DEVICE_ERROR, "first run: " + r.first_msg);
    f.contains(r.first_msg, "failed launching op cross_entropy_bwd '");
    f.contains(r.first_msg, "(backward)");
    f.contains(r.first_msg, "xent_bwd_kernel failed at loss.cu:");
    f.contains(r.first_msg, "invalid configuration argument");
    f.expect(r.second == CTR_STATUS_DEVICE_ERROR, "second run: " + r.second_msg);
    f.exit();
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "refused by CTR_EMU_FAIL_CONFIG");
}

TEST_F(EmuDeviceError, AFaultInAReplayedGraphIsFound) {
  auto child = [] {
    // The first run is the warm-up; the second captures its phases and
    // replays them: the loss kernel's second launch is inside that replay.
    setenv("CTR_EMU_FAIL_LAUNCH", "xent_lse_kernel:2", 1);
    Findings f;
    const StepRun r = run_gpt(1);
    f.expect(r.first == CTR_STATUS_OK, "first run: " + r.first_msg);
    f.expect(r.second == CTR_STATUS_DEVICE_ERROR, "second run: " + r.second_msg);
    f.contains(r.second_msg, "cudaGraphLaunch");
    f.contains(r.second_msg, "an illegal memory access was encountered (kernel xent_lse_kernel");
    f.contains(r.second_msg, "(found after replaying the forward phase as a captured graph");
    f.expect(r.param == CTR_STATUS_DEVICE_ERROR, "parameter: " + r.param_msg);
    f.exit();
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "made to fail by CTR_EMU_FAIL_LAUNCH");
}

TEST_F(EmuDeviceError, AFaultInTheGradientNormNeverUpdatesTheParameters) {
  auto child = [] {
    setenv("CTR_EMU_FAIL_LAUNCH", "sum_squares_partial", 1);
    Findings f;
    const StepRun r = run_gpt(0);
    f.expect(r.first == CTR_STATUS_DEVICE_ERROR, "first run: " + r.first_msg);
    f.contains(r.first_msg, "sum_squares_partial failed at optim.cu:");
    f.contains(r.first_msg, "(found computing the gradient norm)");
    f.expect(r.second == CTR_STATUS_DEVICE_ERROR, "second run: " + r.second_msg);
    f.exit();
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

}  // namespace

int main(int argc, char **argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ctr_options *o = nullptr;
  ctr_mesh *m = nullptr;
  ctr_options_create(&o);
  ctr_options_set_string(o, "device", "cuda");
  const ctr_status st = ctr_mesh_create(o, &m);
  ctr_options_free(o);
  if (st != CTR_STATUS_OK) {
    std::fprintf(stderr, "emulated device errors skipped: device 'cuda': %s\n", ctr_last_error());
    return 77;
  }
  ctr_mesh_free(m);
  return RUN_ALL_TESTS();
}
