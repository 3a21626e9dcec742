// The CUDA backend's cuDNN parts that need no GPU. The loader
// (lib/backend/cuda/cudnn_load.cc): the fallback reasons when the library is
// missing, lacks symbols or is too old, the CTR_CUDNN knob, and the real
// library where the CUDA installation has one (loading needs no GPU); the
// backend turns each reason into its one log line and takes the own attention
// kernels. The attention graph (cudnn_sdpa_graph.cc): planned by the
// installed cuDNN for described GPUs (below).

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cuda/cudnn_load.h"
#include "backend/cuda/cudnn_sdpa_graph.h"

namespace {

using ctr::cuda::CudnnApi;
using ctr::cuda::cudnn_load;

// Sets an environment variable for one scope.
struct Env {
  std::string name;
  Env(const char *n, const char *v) : name(n) {
    if (v) setenv(n, v, 1);
    else unsetenv(n);
  }
  ~Env() { unsetenv(name.c_str()); }
};

std::string build_dir() {
  const char *d = std::getenv("CTR_TEST_FAKE_CUDNN_DIR");
  return d ? d : ".";
}

TEST(CudnnLoad, KnobReadsZeroOneAndRefusesOthers) {
  {
    Env e("CTR_CUDNN", nullptr);
    EXPECT_EQ(ctr::cuda::cudnn_knob(), 1);
  }
  {
    Env e("CTR_CUDNN", "1");
    EXPECT_EQ(ctr::cuda::cudnn_knob(), 1);
  }
  {
    Env e("CTR_CUDNN", "0");
    EXPECT_EQ(ctr::cuda::cudnn_knob(), 0);
  }
  for (const char *bad : {"yes", "2", "01", " 1"}) {
    Env e("CTR_CUDNN", bad);
    EXPECT_EQ(ctr::cuda::cudnn_knob(), -1) << bad;
  }
}

TEST(CudnnLoad, MissingPathIsNamedAndNotPassedOver) {
  Env e("CTR_CUDNN_PATH", "/nonexistent/cudnn/lib");
  CudnnApi api;
  const std::string why = cudnn_load(&api);
  EXPECT_NE(why.find("libcudnn.so.9 cannot be loaded"), std::string::npos) << why;
  EXPECT_NE(why.find("/nonexistent/cudnn/lib/libcudnn.so.9: no such file"), std::string::npos) << why;
  EXPECT_NE(why.find("CTR_CUDNN_PATH=/nonexistent/cudnn/lib"), std::string::npos) << why;
  EXPECT_EQ(api.execute, nullptr);
}

TEST(CudnnLoad, MissingSymbolsAreListed) {
  const std::string file = build_dir() + "/libfake_cudnn_version_only.so";
  ASSERT_EQ(access(file.c_str(), F_OK), 0) << file;
  Env e("CTR_CUDNN_PATH", file.c_str());
  CudnnApi api;
  const std::string why = cudnn_load(&api);
  EXPECT_NE(why.find("lacks cudnnGetErrorString"), std::string::npos) << why;
  EXPECT_NE(why.find("cudnnBackendExecute"), std::string::npos) << why;
  EXPECT_EQ(why.find("cudnnGetVersion,"), std::string::npos) << why;  // it has that one
  EXPECT_NE(why.find(file), std::string::npos) << why;
  EXPECT_EQ(api.get_version, nullptr);
}

TEST(CudnnLoad, OldVersionIsRefused) {
  const std::string file = build_dir() + "/libfake_cudnn_old.so";
  ASSERT_EQ(access(file.c_str(), F_OK), 0) << file;
  Env e("CTR_CUDNN_PATH", file.c_str());
  CudnnApi api;
  const std::string why = cudnn_load(&api);
  EXPECT_NE(why.find("is version 8.9.7; 9.0 or later is needed"), std::string::npos) << why;
  EXPECT_EQ(api.create, nullptr);
}

TEST(CudnnLoad, VersionString) {
  EXPECT_EQ(ctr::cuda::cudnn_version_string(91900), "9.19.0");
  EXPECT_EQ(ctr::cuda::cudnn_version_string(90102), "9.1.2");
  EXPECT_EQ(ctr::cuda::cudnn_version_string(8907), "8.9.7");  // cuDNN 8 counted in thousands
}

// The CUDA installation's cuDNN, where it has one: every symbol, version 9 or
// later, and where it was found. Loading it needs no GPU.
TEST(CudnnLoad, InstalledLibraryLoads) {
  Env e("CTR_CUDNN_PATH", nullptr);
  CudnnApi api;
  const std::string why = cudnn_load(&api);
  if (why.find("cannot be loaded") != std::string::npos) GTEST_SKIP() << "no cuDNN here: " << why;
  ASSERT_EQ(why, "");
  EXPECT_GE(api.version, ctr::cuda::kCudnnMinVersion);
  EXPECT_NE(api.execute, nullptr);
  EXPECT_NE(api.path.find("libcudnn.so.9"), std::string::npos) << api.path;
  std::printf("cuDNN %s from %s\n", ctr::cuda::cudnn_version_string(api.version).c_str(), api.path.c_str());
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------
// The attention graph (lib/backend/cuda/cudnn_sdpa_graph.cc), planned by the
// installed cuDNN for a described GPU: a DEVICEPROP descriptor read from JSON
// (cuDNN 9.8 or later plans without the device). This is cuDNN's own
// acceptance of the graph the CUDA backend runs, which otherwise only a GPU
// would show: the pattern its fused engines take, and their support checks
// for the shape. cuDNN's runtime-compiled engines need the CUDA driver library
// before they look at a graph; without a driver the toolkit's stub
// (stubs/libcuda.so, soname libcuda.so.1) stands in, and the engines then get
// as far as compiling their kernel and fail only to load it (the stub's
// CUDA_ERROR_STUB_LIBRARY, 34, through cuLibraryLoadData): a graph that gets
// there is one cuDNN takes. A graph it does not take never gets there.

struct Device {
  const char *name;
  const char *json;
};

// Properties as cudaGetDeviceProperties gives them for these GPUs; deviceVer
// is the compute capability times 100.
const Device kDevices[] = {
    {"H100", R"({"deviceName":"NVIDIA H100 80GB HBM3","deviceVer":900,"driverVer":13000,)"
             R"("maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"regsPerBlock":65536,)"
             R"("multiProcessorCount":132,"warpSize":32,"maxSharedMemoryPerBlock":49152,)"
             R"("maxSharedMemoryPerBlockOptin":232448,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,)"
             R"("maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,"pciDeviceId":9008,)"
             R"("isTccDriver":0,"supportCoopLaunch":1,"totalGlobalMem":85520809984,"smClockRateKHz":1980000,)"
             R"("memClockRateKHz":2619000,"l2CacheSize":52428800,"cudaDeviceId":0})"},
    {"A100", R"({"deviceName":"NVIDIA A100-SXM4-80GB","deviceVer":800,"driverVer":13000,)"
             R"("maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"regsPerBlock":65536,)"
             R"("multiProcessorCount":108,"warpSize":32,"maxSharedMemoryPerBlock":49152,)"
             R"("maxSharedMemoryPerBlockOptin":166912,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,)"
             R"("maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,"pciDeviceId":8370,)"
             R"("isTccDriver":0,"supportCoopLaunch":1,"totalGlobalMem":85198045184,"smClockRateKHz":1410000,)"
             R"("memClockRateKHz":1593000,"l2CacheSize":41943040,"cudaDeviceId":0})"},
};

// The installed cuDNN with a driver library in the process (the real one, or
// the stub): the table, or why not (the test is then skipped).
const CudnnApi *planning_cudnn(std::string *why, bool *stub) {
  static CudnnApi api;
  static std::string error;
  static bool with_stub = false;
  static bool once = [] {
    if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL)) {
      std::vector<std::string> stubs;
      if (const char *home = std::getenv("CUDA_HOME"); home && *home)
        stubs.push_back(std::string(home) + "/lib64/stubs/libcuda.so");
      stubs.push_back("/usr/local/cuda/lib64/stubs/libcuda.so");
      for (const std::string &s : stubs)
        if (access(s.c_str(), F_OK) == 0 && dlopen(s.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
          with_stub = true;
          break;
        }
      if (!with_stub) {
        error = "no CUDA driver library and no toolkit stub (stubs/libcuda.so)";
        return true;
      }
    }
    unsetenv("CTR_CUDNN_PATH");
    error = cudnn_load(&api);
    if (error.empty() && api.version < 90800)
      error = "cuDNN " + ctr::cuda::cudnn_version_string(api.version) + " plans only on a device (9.8 or later "
              "plans for a described one)";
    return true;
  }();
  (void)once;
  *why = error;
  *stub = with_stub;
  return error.empty() ? &api : nullptr;
}

// The plan of `s` for `device` (backward: the backward graph): "" when cuDNN
// built it or, with the stub, some engine got as far as loading its compiled
// kernel; else cuDNN's reason. *engine: the configuration taken or that got
// there.
std::string plan_for(const CudnnApi &api, const Device &device, const ctr::cuda::SdpaShape &s, bool backward,
                     bool stub, std::string *engine) {
  cudnnBackendDescriptor_t prop = nullptr;
  if (api.create_descriptor(CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR, &prop) != CUDNN_STATUS_SUCCESS)
    return "cannot create a DEVICEPROP descriptor";
  cudnnStatus_t st = api.set_attribute(prop, CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                       static_cast<int64_t>(std::strlen(device.json) + 1), device.json);
  if (st == CUDNN_STATUS_SUCCESS) st = api.finalize(prop);
  if (st != CUDNN_STATUS_SUCCESS) {
    const std::string why = "the device description: " + ctr::cuda::cudnn_words(api, st);
    api.destroy_descriptor(prop);
    return why;
  }
  auto plan = backward ? ctr::cuda::sdpa_backward_plan(api, nullptr, prop, s)
                       : ctr::cuda::sdpa_forward_plan(api, nullptr, prop, s);
  api.destroy_descriptor(prop);
  *engine = plan->engine;
  if (plan->why.empty()) return "";
  // The answers are "...; <list>, choice <i> (engine <n>): <status>...": the
  // first that is the stub's refusal to load a compiled kernel.
  const std::string stub_error = "CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER";
  const size_t at = plan->why.find(stub_error);
  if (stub && at != std::string::npos) {
    const size_t colon = plan->why.rfind(':', at);
    size_t start = plan->why.rfind("; ", colon);
    start = start == std::string::npos ? plan->why.find('(') + 1 : start + 2;
    *engine = plan->why.substr(start, colon - start) + ", compiled";
    return "";
  }
  return plan->why;
}

struct PlanCase {
  const char *label;
  ctr::cuda::SdpaShape shape;
};

// The shapes of the GPU suite's GpuCudnnAttention and of GPT-2 small and
// Llama-style models (B 8, T 1024; 12 heads of 64; 32 query heads of 64 over
// 8 kv heads; 16 of 128 over 8; 16 of 128).
const PlanCase kPlanCases[] = {
    {"gqa_d64_causal", {2, 128, 8, 2, 64, true, 0.125f}},
    {"gqa_d128_causal", {1, 96, 4, 1, 128, true, 0.08838835f}},
    {"mha_d64_full", {2, 64, 4, 4, 64, false, 0.125f}},
    {"gpt2_small", {8, 1024, 12, 12, 64, true, 0.125f}},
    {"llama_1b_d64", {8, 1024, 32, 8, 64, true, 0.125f}},
    {"llama_d128", {8, 1024, 16, 8, 128, true, 0.08838835f}},
    {"mha_d128", {8, 1024, 16, 16, 128, true, 0.08838835f}},
};

// Each plan compiles its kernels (a few seconds on the CPU): by default the
// GPU suite's shapes and GPT-2 small on the H100 and one shape on the A100;
// CTR_TEST_CUDNN_ALL=1 plans every shape on both.
bool planned(size_t device, size_t shape) {
  static const bool all = std::getenv("CTR_TEST_CUDNN_ALL") && std::string(std::getenv("CTR_TEST_CUDNN_ALL")) == "1";
  return all || (device == 0 ? shape < 4 : shape == 0);
}

TEST(CudnnSdpaPlan, FusedEnginesTakeTheForwardGraph) {
  std::string why;
  bool stub = false;
  const CudnnApi *api = planning_cudnn(&why, &stub);
  if (!api) GTEST_SKIP() << why;
  for (size_t di = 0; di < std::size(kDevices); ++di)
    for (size_t ci = 0; ci < std::size(kPlanCases); ++ci) {
      if (!planned(di, ci)) continue;
      const Device &d = kDevices[di];
      const PlanCase &c = kPlanCases[ci];
      std::string engine;
      const std::string refused = plan_for(*api, d, c.shape, false, stub, &engine);
      EXPECT_EQ(refused, "") << d.name << " " << c.label;
      if (refused.empty()) std::printf("forward %s %s: %s\n", d.name, c.label, engine.c_str());
    }
}

// The backward graph, for every shape (with grouped-query heads dK and dV
// come out per query head).
TEST(CudnnSdpaPlan, FusedEnginesTakeTheBackwardGraph) {
  std::string why;
  bool stub = false;
  const CudnnApi *api = planning_cudnn(&why, &stub);
  if (!api) GTEST_SKIP() << why;
  for (size_t di = 0; di < std::size(kDevices); ++di)
    for (size_t ci = 0; ci < std::size(kPlanCases); ++ci) {
      if (!planned(di, ci)) continue;
      const Device &d = kDevices[di];
      const PlanCase &c = kPlanCases[ci];
      std::string engine;
      const std::string refused = plan_for(*api, d, c.shape, true, stub, &engine);
      EXPECT_EQ(refused, "") << d.name << " " << c.label;
      if (refused.empty()) std::printf("backward %s %s: %s\n", d.name, c.label, engine.c_str());
    }
}

// The checks above can fail: a head dim that is not a multiple of 8 (which
// the backend never offers to cuDNN) is refused before any kernel is compiled.
TEST(CudnnSdpaPlan, UnalignedHeadDimIsRefused) {
  std::string why;
  bool stub = false;
  const CudnnApi *api = planning_cudnn(&why, &stub);
  if (!api) GTEST_SKIP() << why;
  std::string engine;
  for (bool backward : {false, true}) {
    const std::string refused = plan_for(*api, kDevices[0], {1, 128, 4, 4, 60, true, 0.125f}, backward, stub, &engine);
    EXPECT_NE(refused.find("no engine"), std::string::npos) << refused;
    EXPECT_EQ(refused.find("CUDNN_STATUS_EXECUTION_FAILED_CUDA_DRIVER"), std::string::npos) << refused;
  }
}

}  // namespace
