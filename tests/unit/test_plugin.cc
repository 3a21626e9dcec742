// Backend plugins through the C boundary: tests/plugin/test_backend.c is built
// as libctr-testdev.so and libctr-badabi.so next to this test, which finds them
// through CTR_PLUGIN_PATH.

#include <gtest/gtest.h>

#include <string>

#include "ctr/ctr.h"

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

TEST(Plugin, LoadsAndRefusesAStepNamingTheFirstMissingKernel) {
  ctr_mesh *m = nullptr;
  ASSERT_EQ(mesh_on("testdev", &m), CTR_STATUS_OK) << ctr_last_error();
  EXPECT_STREQ(ctr_mesh_device(m), "testdev");
  ctr_options *go = nullptr;
  ctr_options_create(&go);
  ctr_options_set_int(go, "layers", 1);
  ctr_options_set_int(go, "dim", 16);
  ctr_options_set_int(go, "heads", 2);
  ctr_options_set_int(go, "vocab", 16);
  ctr_options_set_int(go, "seq", 4);
  ctr_graph *g = nullptr;
  ASSERT_EQ(ctr_graph_create_preset("gpt", go, &g), CTR_STATUS_OK);
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 1);
  ctr_step *s = nullptr;
  EXPECT_EQ(ctr_step_create(m, g, so, &s), CTR_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(ctr_last_error()).find("the backend has no kernel for op 'embedding'"), std::string::npos)
      << ctr_last_error();
  EXPECT_EQ(s, nullptr);
  ctr_options_free(so);
  ctr_options_free(go);
  ctr_graph_free(g);
  ctr_mesh_free(m);
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

}  // namespace
