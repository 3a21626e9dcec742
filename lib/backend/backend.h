// Backends as the runtime sees them: a {iface, ctx} pair over the C boundary of
// backend/plugin.h, created by a factory keyed by device name.
//
// "cpu" is built in (fp32 and bf16 on oneDNN, OpenBLAS and the process thread
// pool): stream 0 runs work on the calling thread as it is launched, every
// further stream is a worker thread with a queue, so a collective queued on the
// comm stream is progressed while the caller computes. Any other device is a plugin,
// libctr-DEVICE.so, found with dlopen on the library search path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/plugin.h"

namespace ctr {

using KernelFn = ctr_kernel_fn;

struct Backend {
  const ctr_backend_iface *iface = nullptr;
  void *ctx = nullptr;
  // The plugin's ctr_device_comm_plugin_init, or null when it has no device
  // communicators (comm/device_comm.h).
  ctr_device_comm_plugin_init_fn device_comm_init = nullptr;
  explicit operator bool() const { return iface != nullptr; }
};

// Owns a backend instance and destroys it with the last reference.
using BackendHandle = std::shared_ptr<Backend>;

// The backend for `device` ("cpu", or a plugin's name such as "cuda"). Fails with
// CTR_STATUS_UNSUPPORTED naming the device and the library it needs.
BackendHandle create_backend(const std::string &device);

// Throws CTR_STATUS_DEVICE_ERROR when the backend reports its sticky error
// (the status slot), saying what was being done (`when`: "reading the loss").
void check_backend(const Backend &be, const char *when);

// Whether a backend has a kernel for an op (what the lower pass asks).
bool backend_has_kernel(const Backend &be, int32_t op);

// Registers the CPU kernel of an op by name (a library op, or a host's own op
// registered with register_op). Thread-safe; replaces an earlier registration.
void register_cpu_kernel(const std::string &op, KernelFn fn);

// The built-in CPU backend. fenced: device memory is mapped inaccessible to the
// host outside backend calls, so a host dereference of step memory faults (a
// test backend: environment variable CTR_FENCE_MEMORY=1 selects it for "cpu").
Backend cpu_backend_create(bool fenced);

}  // namespace ctr
