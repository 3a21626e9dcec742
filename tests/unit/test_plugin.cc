// Backend plugins through the C boundary: tests/plugin/test_backend.c is built
// as libctr-testdev.so and libctr-badabi.so, tests/plugin/fault_backend.c as
// libctr-faultdev.so, next to this test, which finds them through
// CTR_PLUGIN_PATH.

#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cstdlib>
#include <vector>
#include <string>

#include "backend/backend.h"
#include "ctr/ctr.h"

// The backend that libctr-faultdev.so wraps: the built-in CPU backend, handed
// over through the C boundary (the plugin finds this symbol in the program).
extern "C" __attribute__((visibility("default"))) const ctr_backend_iface *ctr_test_inner_backend(void **ctx) {
  ctr::Backend be = ctr::cpu_backend_create(false);
  *ctx = be.ctx;
  return be.iface;
}

namespace {

ctr_status mesh_on(const char *device, ctr_mesh **m, const char *transport = nullptr) {
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  ctr_options_set_string(o, "device", device);
  if (transport) ctr_options_set_string(o, "transport", transport);
  ctr_status s = ctr_mesh_create(o, m);
  ctr_options_free(o);
  return s;
}

// A gpt preset small enough for any test device: width 16, 2 heads,
// vocabulary 16, 4 positions.
ctr_graph *tiny_gpt(int layers) {
  ctr_options *go = nullptr;
  ctr_options_create(&go);
  ctr_options_set_int(go, "layers", layers);
  ctr_options_set_int(go, "dim", 16);
  ctr_options_set_int(go, "heads", 2);
  ctr_options_set_int(go, "vocab", 16);
  ctr_options_set_int(go, "seq", 4);
  ctr_graph *g = nullptr;
  EXPECT_EQ(ctr_graph_create_preset("gpt", go, &g), CTR_STATUS_OK) << ctr_last_error();
  ctr_options_free(go);
  return g;
}

TEST(Plugin, LoadsAndRefusesAStepNamingTheFirstMissingKernel) {
  ctr_mesh *m = nullptr;
  ASSERT_EQ(mesh_on("testdev", &m), CTR_STATUS_OK) << ctr_last_error();
  EXPECT_STREQ(ctr_mesh_device(m), "testdev");
  ctr_graph *g = tiny_gpt(1);
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 1);
  ctr_step *s = nullptr;
  EXPECT_EQ(ctr_step_create(m, g, so, &s), CTR_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(ctr_last_error()).find("the backend has no kernel for op 'embedding'"), std::string::npos)
      << ctr_last_error();
  EXPECT_EQ(s, nullptr);
  ctr_options_free(so);
  ctr_graph_free(g);
  ctr_mesh_free(m);
}

// The peak MFU is reported against: measured once on the CPU, refused (not
// guessed) on another device.
TEST(Plugin, PeakFlopsIsMeasuredOnTheCpuOnly) {
  ctr_mesh *cpu = nullptr, *dev = nullptr;
  ASSERT_EQ(mesh_on("cpu", &cpu), CTR_STATUS_OK) << ctr_last_error();
  double a = 0, b = 0;
  ASSERT_EQ(ctr_mesh_peak_flops(cpu, &a), CTR_STATUS_OK) << ctr_last_error();
  EXPECT_GT(a, 1e8);  // any x86-64 core does more than 0.1 GFLOP/s
  EXPECT_EQ(ctr_mesh_peak_flops(cpu, &b), CTR_STATUS_OK);
  EXPECT_EQ(a, b) << "measured once per process";
  EXPECT_EQ(ctr_mesh_peak_flops(cpu, nullptr), CTR_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(ctr_mesh_peak_flops(nullptr, &b), CTR_STATUS_INVALID_ARGUMENT);
  ASSERT_EQ(mesh_on("testdev", &dev), CTR_STATUS_OK) << ctr_last_error();
  double c = -1;
  EXPECT_EQ(ctr_mesh_peak_flops(dev, &c), CTR_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(ctr_last_error()).find("the peak of device 'testdev' is not measured"), std::string::npos)
      << ctr_last_error();
  EXPECT_EQ(c, -1) << "untouched on failure";
  ctr_mesh_free(dev);
  ctr_mesh_free(cpu);
}

TEST(Plugin, MismatchedAbiIsRefused) {
  ctr_mesh *m = nullptr;
  EXPECT_EQ(mesh_on("badabi", &m), CTR_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(ctr_last_error()).find("libctr-badabi.so speaks backend ABI"), std::string::npos)
      << ctr_last_error();
  EXPECT_EQ(m, nullptr);
}

TEST(Plugin, MissingPluginNamesTheLibrary) {
  ctr_mesh *m = nullptr;
  EXPECT_EQ(mesh_on("nosuchdev", &m), CTR_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(ctr_last_error()).find("device 'nosuchdev' needs the backend plugin libctr-nosuchdev.so"),
            std::string::npos)
      << ctr_last_error();
  EXPECT_EQ(mesh_on("../evil", &m), CTR_STATUS_INVALID_OPTION);
  EXPECT_EQ(m, nullptr);
}

// Device "cuda": on a machine with a GPU the mesh is created; without one (or
// without the plugin) the error is CTR_STATUS_UNSUPPORTED and says why. A build
// with the CUDA backend finds libctr-cuda.so beside libctr by itself (this test
// does not point CTR_PLUGIN_PATH at it), so the reason is the driver's.
TEST(Plugin, CudaWithoutGpuSaysWhy) {
  ctr_mesh *m = nullptr;
  const ctr_status st = mesh_on("cuda", &m);
  if (st == CTR_STATUS_OK) {
    EXPECT_STREQ(ctr_mesh_device(m), "cuda");
    ctr_mesh_free(m);
    GTEST_SKIP() << "this machine has a usable GPU";
  }
  EXPECT_EQ(st, CTR_STATUS_UNSUPPORTED) << ctr_last_error();
  const std::string err = ctr_last_error();
#ifdef CTR_TEST_CUDA_PLUGIN
  EXPECT_NE(err.find("backend plugin libctr-cuda.so cannot serve device 'cuda': no usable GPU: "), std::string::npos)
      << err;
  EXPECT_NE(err.find("compute capability 8.0"), std::string::npos) << err;
#else
  EXPECT_NE(err.find("device 'cuda' needs the backend plugin libctr-cuda.so"), std::string::npos) << err;
#endif
  EXPECT_EQ(m, nullptr);
}

// Transport "nccl" moves CUDA device memory: with another device the mesh is
// refused before any backend is loaded, naming both.
TEST(Plugin, NcclNeedsDeviceCuda) {
  ctr_mesh *m = nullptr;
  EXPECT_EQ(mesh_on("cpu", &m, "nccl"), CTR_STATUS_INVALID_OPTION);
  const std::string err = ctr_last_error();
  EXPECT_NE(err.find("transport 'nccl'"), std::string::npos) << err;
  EXPECT_NE(err.find("device 'cuda', not 'cpu'"), std::string::npos) << err;
  EXPECT_EQ(m, nullptr);
}

TEST(Plugin, UnknownTransportListsTheAvailableOnes) {
  ctr_mesh *m = nullptr;
  EXPECT_EQ(mesh_on("cpu", &m, "nosuch"), CTR_STATUS_UNSUPPORTED);
  const std::string err = ctr_last_error();
  EXPECT_NE(err.find("transport 'nosuch' is not available in this build (available: "), std::string::npos) << err;
  EXPECT_NE(err.find("nccl"), std::string::npos) << err;
  EXPECT_EQ(m, nullptr);
}

// "nccl" with device "cuda" gets as far as the backend: without a GPU, the
// plugin's reason (NCCL itself is only loaded when a step needs it).
TEST(Plugin, NcclWithoutGpuSaysWhy) {
  ctr_mesh *m = nullptr;
  const ctr_status st = mesh_on("cuda", &m, "nccl");
  if (st == CTR_STATUS_OK) {
    ctr_mesh_free(m);
    GTEST_SKIP() << "this machine has a usable GPU";
  }
  EXPECT_EQ(st, CTR_STATUS_UNSUPPORTED) << ctr_last_error();
  const std::string err = ctr_last_error();
#ifdef CTR_TEST_CUDA_PLUGIN
  EXPECT_NE(err.find("no usable GPU"), std::string::npos) << err;
#else
  EXPECT_NE(err.find("device 'cuda' needs the backend plugin libctr-cuda.so"), std::string::npos) << err;
#endif
  EXPECT_EQ(m, nullptr);
}


// ---------------------------------------------------------------------------
// A device that faults: the step fails naming the fault and the op, and never
// reports a number computed after it.

struct FaultRun {
  ctr_status create = CTR_STATUS_OK, first = CTR_STATUS_OK, second = CTR_STATUS_OK, param = CTR_STATUS_OK;
  std::string create_msg, first_msg, second_msg, param_msg;
  ctr_step_metrics m{};
};

// Creates a gpt step on faultdev with the given fault settings and runs it twice.
FaultRun run_faulty(const char *kernel, bool async, bool sumsq) {
  if (kernel) setenv("CTR_FAULTDEV_KERNEL", kernel, 1); else unsetenv("CTR_FAULTDEV_KERNEL");
  setenv("CTR_FAULTDEV_ASYNC", async ? "1" : "0", 1);
  setenv("CTR_FAULTDEV_SUMSQ", sumsq ? "1" : "0", 1);
  FaultRun r;
  ctr_mesh *mesh = nullptr;
  EXPECT_EQ(mesh_on("faultdev", &mesh), CTR_STATUS_OK) << ctr_last_error();
  ctr_graph *g = tiny_gpt(1);
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 2);
  ctr_step *s = nullptr;
  r.create = ctr_step_create(mesh, g, so, &s);
  r.create_msg = ctr_last_error();
  if (r.create == CTR_STATUS_OK) {
    const int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8}, targets[8] = {2, 3, 4, 5, 6, 7, 8, 9};
    EXPECT_EQ(ctr_step_set_input(s, "tokens", tokens, sizeof tokens), CTR_STATUS_OK) << ctr_last_error();
    EXPECT_EQ(ctr_step_set_input(s, "targets", targets, sizeof targets), CTR_STATUS_OK) << ctr_last_error();
    r.m.size = sizeof r.m;
    r.first = ctr_step_run(s, &r.m);
    r.first_msg = ctr_last_error();
    ctr_step_metrics m2{};
    m2.size = sizeof m2;
    r.second = ctr_step_run(s, &m2);
    r.second_msg = ctr_last_error();
    float w[16 * 16];
    r.param = ctr_step_get_param(s, "wte", w, 16 * 16);
    r.param_msg = ctr_last_error();
  }
  ctr_step_free(s);
  ctr_options_free(so);
  ctr_graph_free(g);
  ctr_mesh_free(mesh);
  for (const char *v : {"CTR_FAULTDEV_KERNEL", "CTR_FAULTDEV_ASYNC", "CTR_FAULTDEV_SUMSQ"}) unsetenv(v);
  return r;
}

bool has(const std::string &s, const char *part) { return s.find(part) != std::string::npos; }

TEST(DeviceFault, WithoutAFaultTheWrappedBackendTrains) {
  FaultRun r = run_faulty(nullptr, false, false);
  ASSERT_EQ(r.create, CTR_STATUS_OK) << r.create_msg;
  EXPECT_EQ(r.first, CTR_STATUS_OK) << r.first_msg;
  EXPECT_EQ(r.second, CTR_STATUS_OK) << r.second_msg;
  EXPECT_EQ(r.param, CTR_STATUS_OK) << r.param_msg;
  EXPECT_GT(r.m.loss, 1.0);
}

TEST(DeviceFault, AFailedLaunchNamesTheKernelTheOpAndWhere) {
  FaultRun r = run_faulty("linear", false, false);
  ASSERT_EQ(r.create, CTR_STATUS_OK) << r.create_msg;
  EXPECT_EQ(r.first, CTR_STATUS_DEVICE_ERROR) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "device 'faultdev' failed launching op linear '")) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "(forward)")) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "kernel 'linear' failed at fault_backend.c:")) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "illegal memory access")) << r.first_msg;
  // Sticky: the step never runs on, and nothing is read back from the device.
  EXPECT_EQ(r.second, CTR_STATUS_DEVICE_ERROR) << r.second_msg;
  EXPECT_TRUE(has(r.second_msg, "(found before the step ran: a failed device stays failed)")) << r.second_msg;
  EXPECT_EQ(r.param, CTR_STATUS_DEVICE_ERROR) << r.param_msg;
  EXPECT_TRUE(has(r.param_msg, "(found reading a parameter)")) << r.param_msg;
}

TEST(DeviceFault, AnAsynchronousFaultIsFoundWhereTheHostWaitsNotReadAsALoss) {
  // The kernel faults in forward, seen only when the loss is copied back: the
  // stale loss is never returned.
  FaultRun r = run_faulty("cross_entropy", true, false);
  ASSERT_EQ(r.create, CTR_STATUS_OK) << r.create_msg;
  EXPECT_EQ(r.first, CTR_STATUS_DEVICE_ERROR) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "kernel 'cross_entropy' failed at fault_backend.c:")) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "(found reading the loss)")) << r.first_msg;
  EXPECT_EQ(r.m.loss, 0.0) << "metrics written by a failed step";
  // In backward: found by the executor's end-of-phase check or the gradient norm.
  FaultRun b = run_faulty("linear_bwd_w", true, false);
  EXPECT_EQ(b.first, CTR_STATUS_DEVICE_ERROR) << b.first_msg;
  EXPECT_TRUE(has(b.first_msg, "kernel 'linear_bwd_w' failed at fault_backend.c:")) << b.first_msg;
  EXPECT_EQ(b.second, CTR_STATUS_DEVICE_ERROR) << b.second_msg;
}

TEST(DeviceFault, AFailedGradientNormNeverUpdatesTheParameters) {
  FaultRun r = run_faulty(nullptr, false, true);
  ASSERT_EQ(r.create, CTR_STATUS_OK) << r.create_msg;
  EXPECT_EQ(r.first, CTR_STATUS_DEVICE_ERROR) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "sum_squares failed at fault_backend.c:")) << r.first_msg;
  EXPECT_TRUE(has(r.first_msg, "(found computing the gradient norm)")) << r.first_msg;
}

// ---------------------------------------------------------------------------
// Captured graphs (device graphdev records and replays as CUDA graphs do).

struct GraphRun {
  std::vector<double> losses;
  long long captures = -1, replays = -1, launches = -1;
};

GraphRun train_on(const char *device, int graphs, int micro_batches, int steps) {
  GraphRun r;
  ctr_mesh *mesh = nullptr;
  EXPECT_EQ(mesh_on(device, &mesh), CTR_STATUS_OK) << ctr_last_error();
  ctr_graph *g = tiny_gpt(2);
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 2);
  ctr_options_set_int(so, "micro_batches", micro_batches);
  ctr_options_set_int(so, "graphs", graphs);
  ctr_step *s = nullptr;
  EXPECT_EQ(ctr_step_create(mesh, g, so, &s), CTR_STATUS_OK) << ctr_last_error();
  for (int i = 0; s && i < steps; ++i) {
    std::vector<int32_t> tokens(static_cast<size_t>(8 * micro_batches)), targets(tokens.size());
    for (size_t j = 0; j < tokens.size(); ++j) {
      tokens[j] = static_cast<int32_t>((j * 7 + static_cast<size_t>(i) * 3) % 16);
      targets[j] = static_cast<int32_t>((j * 5 + static_cast<size_t>(i)) % 16);
    }
    EXPECT_EQ(ctr_step_set_input(s, "tokens", tokens.data(), tokens.size() * 4), CTR_STATUS_OK) << ctr_last_error();
    EXPECT_EQ(ctr_step_set_input(s, "targets", targets.data(), targets.size() * 4), CTR_STATUS_OK)
        << ctr_last_error();
    ctr_step_metrics m{};
    m.size = sizeof m;
    EXPECT_EQ(ctr_step_run(s, &m), CTR_STATUS_OK) << ctr_last_error();
    r.losses.push_back(m.loss);
  }
  if (std::string(device) == "graphdev") {
    const std::string path = std::string(std::getenv("CTR_PLUGIN_PATH")) + "/libctr-graphdev.so";
    void *lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
    EXPECT_NE(lib, nullptr) << path;
    using counts_fn = void (*)(long long *, long long *, long long *);
    auto counts = lib ? reinterpret_cast<counts_fn>(dlsym(lib, "ctr_graphdev_counts")) : nullptr;
    if (counts) counts(&r.captures, &r.replays, &r.launches);
    if (lib) dlclose(lib);
  }
  ctr_step_free(s);
  ctr_options_free(so);
  ctr_graph_free(g);
  ctr_mesh_free(mesh);
  return r;
}

TEST(Graphs, CapturedAfterAWarmUpOnceAndReplayedBitwise) {
  for (int mb : {1, 3}) {
    const int steps = 4;
    GraphRun cpu = train_on("cpu", 1, mb, steps);
    GraphRun eager = train_on("graphdev", 0, mb, steps);
    GraphRun graphs = train_on("graphdev", 1, mb, steps);
    ASSERT_EQ(cpu.losses.size(), static_cast<size_t>(steps));
    EXPECT_EQ(eager.losses, cpu.losses) << "micro_batches " << mb;
    EXPECT_EQ(graphs.losses, cpu.losses) << "micro_batches " << mb;
    EXPECT_EQ(eager.captures, 0);
    EXPECT_EQ(eager.replays, 0);
    // Each phase runs steps * mb times: the first launched as it is (the
    // warm-up), the second captured, then every run a replay; the
    // micro-batches' inputs are copied to one place, so nothing is captured
    // again.
    EXPECT_EQ(graphs.captures, 2) << "micro_batches " << mb;
    EXPECT_EQ(graphs.replays, 2 * (steps * mb - 1)) << "micro_batches " << mb;
    EXPECT_GT(graphs.launches, 0);
    EXPECT_LT(graphs.launches, eager.launches);
  }
}

}  // namespace
