// Loading cuDNN with dlopen (cudnn_load.h says where from and why).

#include "backend/cuda/cudnn_load.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace ctr::cuda {
namespace {

constexpr const char *kFile = "libcudnn.so.9";

// The libraries cuDNN 9 opens by name when it builds and runs a graph. Opening
// them from the directory the main library came from first makes those
// by-name opens find them (a loaded soname is reused) even where that
// directory is not on the library search path (a Python wheel's).
constexpr const char *kParts[] = {"libcudnn_graph.so.9", "libcudnn_heuristic.so.9",
                                  "libcudnn_engines_precompiled.so.9", "libcudnn_engines_runtime_compiled.so.9"};

std::string plugin_directory() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void *>(&plugin_directory), &info) || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

std::string directory_of(const std::string &file) {
  const size_t slash = file.rfind('/');
  return slash == std::string::npos ? "" : file.substr(0, slash);
}

}  // namespace

int cudnn_knob() {
  const char *v = std::getenv("CTR_CUDNN");
  if (!v || !*v) return 1;
  const std::string s = v;
  if (s == "1") return 1;
  if (s == "0") return 0;
  return -1;
}

std::string cudnn_version_string(size_t v) {
  if (v < 10000)  // cuDNN 8 and older: major * 1000 + minor * 100 + patch
    return std::to_string(v / 1000) + "." + std::to_string(v / 100 % 10) + "." + std::to_string(v % 100);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::string cudnn_load(CudnnApi *api) {
  std::vector<std::string> candidates;
  const char *env = std::getenv("CTR_CUDNN_PATH");
  const bool explicit_path = env && *env;
  if (explicit_path) {
    const std::string s = env;
    const bool file = s.find(".so") != std::string::npos && s.back() != '/';
    candidates.push_back(file ? s : s + "/" + kFile);
  } else {
    if (const std::string here = plugin_directory(); !here.empty()) candidates.push_back(here + "/" + kFile);
    candidates.push_back(kFile);
    if (const char *home = std::getenv("CUDA_HOME"); home && *home) {
      candidates.push_back(std::string(home) + "/lib64/" + kFile);
      candidates.push_back(std::string(home) + "/lib/" + kFile);
    }
    candidates.push_back(std::string("/usr/local/cuda/lib64/") + kFile);
    candidates.push_back(std::string("/usr/local/cuda/lib/") + kFile);
  }
  void *lib = nullptr;
  std::string tried, loaded;
  for (const std::string &c : candidates) {
    if (c.find('/') != std::string::npos && access(c.c_str(), F_OK) != 0) {
      if (explicit_path) tried = c + ": no such file";
      continue;
    }
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      loaded = c;
      break;
    }
    const char *e = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(e ? e : c + ": cannot be opened");
  }
  if (!lib) {
    return std::string(kFile) + " cannot be loaded (" + (tried.empty() ? "not found" : tried) + ")" +
           (explicit_path ? " from CTR_CUDNN_PATH=" + std::string(env)
                          : "; install cuDNN 9 for this CUDA version or set CTR_CUDNN_PATH to the directory "
                            "that holds it (for a Python wheel: .../nvidia/cudnn/lib)");
  }
  CudnnApi a;
  std::string missing;
  auto sym = [&](auto &fn, const char *name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
  sym(a.get_version, "cudnnGetVersion");
  sym(a.error_string, "cudnnGetErrorString");
  sym(a.last_error, "cudnnGetLastErrorString");
  sym(a.create, "cudnnCreate");
  sym(a.destroy, "cudnnDestroy");
  sym(a.set_stream, "cudnnSetStream");
  sym(a.create_descriptor, "cudnnBackendCreateDescriptor");
  sym(a.destroy_descriptor, "cudnnBackendDestroyDescriptor");
  sym(a.finalize, "cudnnBackendFinalize");
  sym(a.set_attribute, "cudnnBackendSetAttribute");
  sym(a.get_attribute, "cudnnBackendGetAttribute");
  sym(a.execute, "cudnnBackendExecute");
  if (!missing.empty()) {
    dlclose(lib);
    return "the " + std::string(kFile) + " found (" + loaded + ") lacks " + missing + " (cuDNN 9 or later is needed)";
  }
  a.version = a.get_version();
  if (a.version < kCudnnMinVersion) {
    dlclose(lib);
    return "the " + std::string(kFile) + " found (" + loaded + ") is version " + cudnn_version_string(a.version) +
           "; 9.0 or later is needed";
  }
  // Where the library really is (a bare name was found on the search path).
  Dl_info info{};
  if (dladdr(reinterpret_cast<void *>(a.get_version), &info) && info.dli_fname) loaded = info.dli_fname;
  a.path = loaded;
  if (const std::string dir = directory_of(loaded); !dir.empty()) {
    for (const char *part : kParts) {
      const std::string p = dir + "/" + part;
      if (access(p.c_str(), F_OK) == 0 && !dlopen(p.c_str(), RTLD_NOW | RTLD_LOCAL)) dlerror();  // kept open
    }
  }
  *api = a;  // the library stays loaded until exit
  return "";
}

const CudnnApi *cudnn_api(std::string *why) {
  static std::once_flag once;
  static CudnnApi api;
  static std::string error;
  std::call_once(once, [] { error = cudnn_load(&api); });
  if (!error.empty()) {
    if (why) *why = error;
    return nullptr;
  }
  return &api;
}

}  // namespace ctr::cuda
