// The backend factory: a device name becomes a backend instance.
//
// "cpu" is built in. Any other name is a plugin: libctr-NAME.so, looked for in
// the directory named by CTR_PLUGIN_PATH, then beside the binary that holds
// libctr (libctr.so, or a program linking libctr statically) and in ../lib from
// there (an installed bin/ and lib/), then on the ordinary library search path;
// it is asked through its C entry point
// ctr_backend_plugin_init for an interface table. A plugin whose table is of
// another CTR_BACKEND_ABI, or smaller than this build's, is refused: the table
// layout is the whole contract between the two sides.

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "backend/backend.h"
#include "core/status.h"
#include "graph/ops.h"

namespace ctr {
namespace {

bool env_flag(const char *name) {
  const char *v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}

BackendHandle own(Backend b, void *lib) {
  return BackendHandle(new Backend(b), [lib](Backend *p) {
    if (p->iface && p->iface->destroy) p->iface->destroy(p->ctx);
    delete p;
    // The plugin stays loaded: kernels and tables it handed out may still be
    // referenced by static objects until exit.
    (void)lib;
  });
}

// The directory of the binary this code was linked into ("" if unknown).
std::string own_directory() {
  Dl_info info{};
  if (!::dladdr(reinterpret_cast<void *>(&create_backend), &info) || !info.dli_fname) return "";
  std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

BackendHandle load_plugin(const std::string &device) {
  const std::string file = "libctr-" + device + ".so";
  std::string tried;
  void *lib = nullptr;
  auto try_dir = [&](const std::string &dir) {
    if (lib || dir.empty()) return;
    const std::string path = dir + "/" + file;
    if (::access(path.c_str(), F_OK) != 0) return;
    lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) tried += (tried.empty() ? "" : "; ") + std::string(::dlerror());
  };
  if (const char *dir = std::getenv("CTR_PLUGIN_PATH"); dir && *dir) try_dir(dir);
  const std::string here = own_directory();
  try_dir(here);
  if (!here.empty()) try_dir(here + "/../lib");
  if (!lib) {
    lib = ::dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) tried += (tried.empty() ? "" : "; ") + std::string(::dlerror());
  }
  if (!lib)
    fail(CTR_STATUS_UNSUPPORTED,
         strformat("device '%s' needs the backend plugin %s, which cannot be loaded (%s)", device.c_str(),
                   file.c_str(), tried.c_str()));
  auto init = reinterpret_cast<ctr_backend_plugin_init_fn>(::dlsym(lib, "ctr_backend_plugin_init"));
  if (!init) {
    ::dlclose(lib);
    fail(CTR_STATUS_UNSUPPORTED,
         strformat("%s is not a libctr backend plugin: it has no ctr_backend_plugin_init", file.c_str()));
  }
  char err[512] = {0};
  void *ctx = nullptr;
  const ctr_backend_iface *iface = init(CTR_BACKEND_ABI, device.c_str(), &ctx, err, sizeof err);
  if (!iface)
    fail(CTR_STATUS_UNSUPPORTED,
         strformat("backend plugin %s cannot serve device '%s': %s", file.c_str(), device.c_str(),
                   err[0] ? err : "no reason given"));
  if (iface->abi != CTR_BACKEND_ABI || iface->size < sizeof(ctr_backend_iface)) {
    if (iface->destroy) iface->destroy(ctx);
    fail(CTR_STATUS_UNSUPPORTED,
         strformat("backend plugin %s speaks backend ABI %u (table of %u bytes); this libctr needs ABI %d "
                   "(%zu bytes)",
                   file.c_str(), iface->abi, iface->size, CTR_BACKEND_ABI, sizeof(ctr_backend_iface)));
  }
  // Optional: device communicators (plugin.h), asked for when a mesh's
  // transport needs them.
  auto comm_init =
      reinterpret_cast<ctr_device_comm_plugin_init_fn>(::dlsym(lib, "ctr_device_comm_plugin_init"));
  return own(Backend{iface, ctx, comm_init}, lib);
}

}  // namespace

void check_backend(const Backend &be, const char *when) {
  if (!be.iface->status) return;
  char msg[1024] = {0};
  if (be.iface->status(be.ctx, msg, sizeof msg) == 0) return;
  fail(CTR_STATUS_DEVICE_ERROR, strformat("device '%s' failed: %s (found %s)", be.iface->name, msg, when));
}

bool backend_has_kernel(const Backend &be, int32_t op) {
  const OpDef *d = op_by_id(op);
  return d && be.iface->kernel(be.ctx, op, d->name.c_str()) != nullptr;
}

BackendHandle create_backend(const std::string &device) {
  CTR_REQUIRE(!device.empty() && device.find('/') == std::string::npos, CTR_STATUS_INVALID_OPTION,
              "device '%s' is not a device name", device.c_str());
  if (device == "cpu") return own(cpu_backend_create(env_flag("CTR_FENCE_MEMORY")), nullptr);
  return load_plugin(device);
}

}  // namespace ctr
