// cuDNN for the CUDA backend, loaded with dlopen, never linked: libctr-cuda.so
// loads on machines without cuDNN and attention then takes the own kernels
// (kernels/cuda/attention.cu). Only the backend (graph) API is used: the
// library loaded is libcudnn.so.9, which opens cuDNN's graph, heuristic and
// engine libraries by name; cudnn_graph.h supplies the types.
//
// Where it is looked for: CTR_CUDNN_PATH alone when set (a directory such as a
// Python wheel's nvidia/cudnn/lib, or the library file; a path that does not
// work is reported, never passed over), else beside this plugin, the library
// search path, $CUDA_HOME/lib64 and lib, /usr/local/cuda/lib64 and lib.
// CTR_CUDNN=0 turns it off (the own kernels everywhere); 1, or unset, uses it
// where it loads. This file is plain host C++ so that the unit suite can test
// the loader on a machine without a GPU (tests/unit/test_cudnn.cc).
#pragma once

#include <cudnn_graph.h>

#include <string>

namespace ctr::cuda {

struct CudnnApi {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_descriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_descriptor = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendSetAttribute) set_attribute = nullptr;
  decltype(&cudnnBackendGetAttribute) get_attribute = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;
  size_t version = 0;  // cudnnGetVersion(): 91900 for 9.19.0
  std::string path;    // the file that was loaded
};

// The oldest cuDNN accepted: 9.0 (the fused flash attention of the backend
// API in its 9 form; cuDNN 8 names its libraries differently).
constexpr size_t kCudnnMinVersion = 90000;

// CTR_CUDNN: 1 (use cuDNN where it loads; also when unset), 0 (never), or -1
// for any other value, which backend creation refuses.
int cudnn_knob();

// Loads cuDNN afresh (no caching): "" with *api filled, or why not, in words
// that name the path, the missing symbols or the version. The library stays
// loaded on success; on failure nothing stays loaded.
std::string cudnn_load(CudnnApi *api);

// The process's cuDNN, loaded once (CTR_CUDNN_PATH is read the first time; the
// knob is the caller's, read per backend): the table, or nullptr with the
// reason in *why.
const CudnnApi *cudnn_api(std::string *why);

// "9.19.0" for 91900 ("8.9.7" for cuDNN 8's 8907).
std::string cudnn_version_string(size_t version);

}  // namespace ctr::cuda
