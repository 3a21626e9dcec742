// The CUDA runtime of the emulated device: errors, the one device and its
// properties, memory, streams, events and graphs.
//
// Device memory is mapped per allocation with an inaccessible page on either
// side and the allocation's end against the one after it, so a kernel or a
// copy that runs past a buffer faults at once. Copies and fills check their
// ranges against the allocations and their direction against the memory
// kinds, and refuse what a GPU would corrupt silently. Streams run their work
// when it is queued (emu.h); events are therefore complete when recorded.
// Capture records work and graph launches replay it, so a captured phase is
// replayed with the arguments it was captured with, as on a GPU.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "emu.h"

struct CUstream_st {
  unsigned flags = 0;
  bool capturing = false;
  bool invalidated = false;  // an illegal call during capture
  std::vector<ctr_emu::Work> captured;
};
struct CUevent_st {
  unsigned flags = 0;
};
struct CUgraph_st {
  std::vector<ctr_emu::Work> nodes;
};
struct CUgraphExec_st {
  std::shared_ptr<const std::vector<ctr_emu::Work>> nodes;
};

namespace ctr_emu {
namespace {

// ---------------------------------------------------------------------------
// Errors

thread_local cudaError_t tl_last = cudaSuccess;
std::atomic<int> g_sticky{cudaSuccess};
std::mutex g_fault_mu;
std::string g_fault_text;  // set once, with g_sticky

const char *error_text(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unrecognized error code";
}

const char *error_name(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "cudaErrorUnrecognized";
}

// ---------------------------------------------------------------------------
// The device

constexpr int kDeviceCount = 1;
constexpr int kSmCount = 132;
constexpr size_t kDefaultShared = size_t{48} << 10;
constexpr size_t kOptinShared = 232448;  // 227 KiB, sm_90
constexpr size_t kMemoryBytes = size_t{80} << 30;

thread_local int tl_device = 0;

// ---------------------------------------------------------------------------
// Memory registry

struct Allocation {
  char *map = nullptr;  // the whole mapping, guard pages included
  size_t map_bytes = 0;
  size_t bytes = 0;     // as asked for
};

std::mutex g_mem_mu;
std::map<uintptr_t, Allocation> g_device;  // by the pointer handed out
std::set<uintptr_t> g_pinned;
size_t g_device_bytes = 0;

size_t page() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// The allocation holding p (under g_mem_mu), or end.
std::map<uintptr_t, Allocation>::const_iterator find_allocation(uintptr_t p) {
  auto it = g_device.upper_bound(p);
  if (it == g_device.begin()) return g_device.end();
  --it;
  return p < it->first + it->second.bytes ? it : g_device.end();
}

// ---------------------------------------------------------------------------
// Handles

std::mutex g_handle_mu;  // the sets below and every stream's capture state
std::set<const CUstream_st *> g_streams;
std::set<const CUevent_st *> g_events;

bool valid_stream(cudaStream_t s) { return !s || g_streams.count(s) > 0; }

std::string hex(const void *p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

// Refuses a copy or fill whose device ranges are not inside one allocation or
// whose host ranges are device memory.
cudaError_t check_range(const char *call, const char *what, const void *p, size_t bytes, bool device) {
  if (!bytes) return cudaSuccess;
  if (device && !in_device_memory(p, bytes))
    return report(cudaErrorInvalidValue, std::string(call) + ": the " + what + " [" + hex(p) + ", +" +
                                             std::to_string(bytes) + ") is not inside one device allocation");
  if (!device && is_device_pointer(p))
    return report(cudaErrorInvalidValue,
                  std::string(call) + ": the " + what + " " + hex(p) + " is device memory, but the copy's kind says host");
  return cudaSuccess;
}

cudaError_t check_copy(const char *call, void *dst, const void *src, size_t dst_extent, size_t src_extent,
                       cudaMemcpyKind kind) {
  if (kind == cudaMemcpyDefault) return cudaSuccess;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault)
    return report(cudaErrorInvalidMemcpyDirection, std::string(call) + ": kind " + std::to_string(kind));
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (cudaError_t e = check_range(call, "destination", dst, dst_extent, dst_dev)) return e;
  if (cudaError_t e = check_range(call, "source", src, src_extent, src_dev)) return e;
  const auto d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (dst_extent && src_extent && d < s + src_extent && s < d + dst_extent)
    return report(cudaErrorInvalidValue, std::string(call) + ": source and destination overlap");
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------
// emu.h

cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) tl_last = e;
  return e;
}

cudaError_t report(cudaError_t e, const std::string &detail) {
  std::fprintf(stderr, "ctr emu: %s: %s\n", error_text(e), detail.c_str());
  return set_error(e);
}

cudaError_t set_fault(cudaError_t e, const std::string &detail) {
  {
    std::lock_guard<std::mutex> lock(g_fault_mu);
    if (g_sticky.load() == cudaSuccess) {
      g_fault_text = std::string(error_text(e)) + " (" + detail + ")";
      g_sticky.store(e);
      std::fprintf(stderr, "ctr emu: device fault: %s\n", g_fault_text.c_str());
    }
  }
  return set_error(static_cast<cudaError_t>(g_sticky.load()));
}

cudaError_t sticky_error() { return static_cast<cudaError_t>(g_sticky.load(std::memory_order_relaxed)); }

cudaError_t enqueue(cudaStream_t s, Work w) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  {
    std::lock_guard<std::mutex> lock(g_handle_mu);
    if (!valid_stream(s)) return report(cudaErrorInvalidResourceHandle, "work queued on a stream that does not exist");
    if (s && s->capturing) {
      s->captured.push_back(std::move(w));
      return cudaSuccess;
    }
  }
  static std::mutex device;
  std::lock_guard<std::mutex> lock(device);
  return set_error(w());
}

bool in_device_memory(const void *p, size_t bytes) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  auto it = find_allocation(a);
  if (it == g_device.end()) return false;
  return bytes <= it->first + it->second.bytes - a;
}

bool is_device_pointer(const void *p) {
  std::lock_guard<std::mutex> lock(g_mem_mu);
  return find_allocation(reinterpret_cast<uintptr_t>(p)) != g_device.end();
}

std::string describe_device_address(const void *p) {
  std::unique_lock<std::mutex> lock(g_mem_mu, std::try_to_lock);
  if (!lock.owns_lock()) return "";
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const auto &[user, al] : g_device) {
    const auto map = reinterpret_cast<uintptr_t>(al.map);
    if (a < map || a >= map + al.map_bytes) continue;
    char b[160];
    if (a >= user + al.bytes)
      std::snprintf(b, sizeof b, "%zu bytes past the end of the device allocation of %zu bytes at %p",
                    static_cast<size_t>(a - user - al.bytes), al.bytes, reinterpret_cast<void *>(user));
    else if (a < user)
      std::snprintf(b, sizeof b, "%zu bytes before the device allocation of %zu bytes at %p",
                    static_cast<size_t>(user - a), al.bytes, reinterpret_cast<void *>(user));
    else
      std::snprintf(b, sizeof b, "inside the device allocation of %zu bytes at %p", al.bytes,
                    reinterpret_cast<void *>(user));
    return b;
  }
  return "";
}

size_t shared_per_block() { return kDefaultShared; }

size_t shared_per_block_optin() {
  static const size_t v = [] {
    const char *e = std::getenv("CTR_EMU_SHARED_OPTIN");
    const long long x = e && *e ? std::atoll(e) : 0;
    return x > 0 ? static_cast<size_t>(x) : kOptinShared;
  }();
  return v;
}

namespace {
std::mutex g_attr_mu;
std::map<const void *, size_t> g_kernel_shared;
}  // namespace

size_t kernel_shared_limit(const void *func) {
  std::lock_guard<std::mutex> lock(g_attr_mu);
  auto it = func ? g_kernel_shared.find(func) : g_kernel_shared.end();
  return it == g_kernel_shared.end() ? kDefaultShared : it->second;
}

}  // namespace ctr_emu

using namespace ctr_emu;

// ---------------------------------------------------------------------------
// Errors

extern "C" cudaError_t cudaGetLastError(void) {
  if (cudaError_t s = sticky_error()) return s;
  const cudaError_t e = tl_last;
  tl_last = cudaSuccess;
  return e;
}

extern "C" cudaError_t cudaPeekAtLastError(void) {
  if (cudaError_t s = sticky_error()) return s;
  return tl_last;
}

extern "C" const char *cudaGetErrorString(cudaError_t e) {
  if (e != cudaSuccess && e == sticky_error()) {
    std::lock_guard<std::mutex> lock(g_fault_mu);
    return g_fault_text.c_str();  // written once, before the code became sticky
  }
  return error_text(e);
}

extern "C" const char *cudaGetErrorName(cudaError_t e) { return error_name(e); }

// ---------------------------------------------------------------------------
// The device

extern "C" cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return set_error(cudaErrorInvalidValue);
  *count = kDeviceCount;
  return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= kDeviceCount) return set_error(cudaErrorInvalidDevice);
  tl_device = device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int *device) {
  if (!device) return set_error(cudaErrorInvalidValue);
  *device = tl_device;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
  if (!p) return set_error(cudaErrorInvalidValue);
  if (device < 0 || device >= kDeviceCount) return set_error(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof *p);
  std::snprintf(p->name, sizeof p->name, "ctr emulated CUDA device (sm_90)");
  p->totalGlobalMem = kMemoryBytes;
  p->sharedMemPerBlock = kDefaultShared;
  p->regsPerBlock = 65536;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024;
  p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647;
  p->maxGridSize[1] = 65535;
  p->maxGridSize[2] = 65535;
  p->major = 9;
  p->minor = 0;
  p->multiProcessorCount = kSmCount;
  p->sharedMemPerBlockOptin = shared_per_block_optin();
  p->sharedMemPerMultiprocessor = 233472;
  p->maxThreadsPerMultiProcessor = 2048;
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
  if (!value) return set_error(cudaErrorInvalidValue);
  if (device < 0 || device >= kDeviceCount) return set_error(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 2147483647; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(kDefaultShared); break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = kSmCount; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 233472; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(shared_per_block_optin()); break;
    default: return report(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute " + std::to_string(attr) +
                                                      " is not emulated");
  }
  return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceSynchronize(void) { return set_error(sticky_error()); }

extern "C" cudaError_t ctr_emu_func_set_attribute(const void *func, cudaFuncAttribute attr, int value) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!func) return set_error(cudaErrorInvalidValue);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > shared_per_block_optin())
      return report(cudaErrorInvalidValue, "cudaFuncSetAttribute: " + std::to_string(value) +
                                               " bytes of dynamic shared memory; the device allows " +
                                               std::to_string(shared_per_block_optin()));
    std::lock_guard<std::mutex> lock(g_attr_mu);
    g_kernel_shared[func] = static_cast<size_t>(value);
  }
  return cudaSuccess;
}

// ---------------------------------------------------------------------------
// Memory

extern "C" cudaError_t cudaMalloc(void **ptr, size_t size) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!ptr) return set_error(cudaErrorInvalidValue);
  if (size == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  const size_t pg = page(), user = (size + 255) / 256 * 256, body = (user + pg - 1) / pg * pg;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    if (size > kMemoryBytes - g_device_bytes) return set_error(cudaErrorMemoryAllocation);
  }
  void *map = mmap(nullptr, body + 2 * pg, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) return set_error(cudaErrorMemoryAllocation);
  char *base = static_cast<char *>(map);
  if (mprotect(base + pg, body, PROT_READ | PROT_WRITE) != 0) {
    munmap(map, body + 2 * pg);
    return set_error(cudaErrorMemoryAllocation);
  }
  // The end of the request (rounded to 256 bytes, cudaMalloc's alignment)
  // meets the guard page after it.
  char *p = base + pg + body - user;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    g_device[reinterpret_cast<uintptr_t>(p)] = Allocation{base, body + 2 * pg, size};
    g_device_bytes += size;
  }
  *ptr = p;
  return cudaSuccess;
}

extern "C" cudaError_t cudaFree(void *ptr) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!ptr) return cudaSuccess;
  Allocation a;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    auto it = g_device.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == g_device.end())
      return report(cudaErrorInvalidValue, "cudaFree(" + hex(ptr) + "): not a pointer cudaMalloc returned");
    a = it->second;
    g_device_bytes -= a.bytes;
    g_device.erase(it);
  }
  munmap(a.map, a.map_bytes);
  return cudaSuccess;
}

extern "C" cudaError_t cudaMallocHost(void **ptr, size_t size) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!ptr) return set_error(cudaErrorInvalidValue);
  void *p = std::aligned_alloc(256, (std::max<size_t>(size, 1) + 255) / 256 * 256);
  if (!p) return set_error(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  g_pinned.insert(reinterpret_cast<uintptr_t>(p));
  *ptr = p;
  return cudaSuccess;
}

extern "C" cudaError_t cudaFreeHost(void *ptr) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!ptr) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lock(g_mem_mu);
    if (!g_pinned.erase(reinterpret_cast<uintptr_t>(ptr)))
      return report(cudaErrorInvalidValue, "cudaFreeHost(" + hex(ptr) + "): not a pointer cudaMallocHost returned");
  }
  std::free(ptr);
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemGetInfo(size_t *free, size_t *total) {
  if (!free || !total) return set_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_mem_mu);
  *free = kMemoryBytes - g_device_bytes;
  *total = kMemoryBytes;
  return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
                                       cudaStream_t stream) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (cudaError_t e = check_copy("cudaMemcpyAsync", dst, src, count, count, kind)) return e;
  if (!count) return cudaSuccess;
  return enqueue(stream, [=] {
    std::memcpy(dst, src, count);
    return cudaSuccess;
  });
}

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
  return cudaMemcpyAsync(dst, src, count, kind, nullptr);
}

extern "C" cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                                         size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (width > dpitch || width > spitch)
    return report(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width " + std::to_string(width) +
                                             " is wider than a pitch (" + std::to_string(dpitch) + ", " +
                                             std::to_string(spitch) + ")");
  if (!width || !height) return cudaSuccess;
  const size_t dext = (height - 1) * dpitch + width, sext = (height - 1) * spitch + width;
  if (cudaError_t e = check_copy("cudaMemcpy2DAsync", dst, src, dext, sext, kind)) return e;
  return enqueue(stream, [=] {
    for (size_t r = 0; r < height; ++r)
      std::memcpy(static_cast<char *>(dst) + r * dpitch, static_cast<const char *>(src) + r * spitch, width);
    return cudaSuccess;
  });
}

extern "C" cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (cudaError_t e = check_range("cudaMemsetAsync", "range", ptr, count, true)) return e;
  if (!count) return cudaSuccess;
  return enqueue(stream, [=] {
    std::memset(ptr, value, count);
    return cudaSuccess;
  });
}

extern "C" cudaError_t cudaMemset(void *ptr, int value, size_t count) {
  return cudaMemsetAsync(ptr, value, count, nullptr);
}

// ---------------------------------------------------------------------------
// Streams and events

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!stream) return set_error(cudaErrorInvalidValue);
  auto *s = new CUstream_st;
  s->flags = flags;
  std::lock_guard<std::mutex> lock(g_handle_mu);
  g_streams.insert(s);
  *stream = s;
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

extern "C" cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!stream || !g_streams.erase(stream))
    return report(cudaErrorInvalidResourceHandle, "cudaStreamDestroy of a stream that does not exist");
  delete stream;
  return set_error(sticky_error());
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!valid_stream(stream))
    return report(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize of a stream that does not exist");
  if (stream && stream->capturing) {
    stream->invalidated = true;
    return report(cudaErrorStreamCaptureUnsupported, "cudaStreamSynchronize of a stream under capture");
  }
  return set_error(sticky_error());
}

extern "C" cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!event) return set_error(cudaErrorInvalidValue);
  auto *e = new CUevent_st;
  e->flags = flags;
  std::lock_guard<std::mutex> lock(g_handle_mu);
  g_events.insert(e);
  *event = e;
  return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

extern "C" cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!event || !g_events.erase(event))
    return report(cudaErrorInvalidResourceHandle, "cudaEventDestroy of an event that does not exist");
  delete event;
  return set_error(sticky_error());
}

extern "C" cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> lock(g_handle_mu);
    if (!g_events.count(event) || !valid_stream(stream))
      return report(cudaErrorInvalidResourceHandle, "cudaEventRecord with an event or stream that does not exist");
  }
  // Streams are synchronous: the record is complete at once (or, captured, a no-op node).
  return enqueue(stream, [] { return cudaSuccess; });
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!g_events.count(event))
    return report(cudaErrorInvalidResourceHandle, "cudaEventSynchronize of an event that does not exist");
  return set_error(sticky_error());
}

extern "C" cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }

extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  {
    std::lock_guard<std::mutex> lock(g_handle_mu);
    if (!g_events.count(event) || !valid_stream(stream))
      return report(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent with an event or stream that does not exist");
  }
  return enqueue(stream, [] { return cudaSuccess; });
}

// ---------------------------------------------------------------------------
// Graphs

extern "C" cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!stream) return report(cudaErrorStreamCaptureUnsupported, "the legacy default stream cannot be captured");
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  if (stream->capturing) return report(cudaErrorIllegalState, "cudaStreamBeginCapture: the stream is being captured");
  stream->capturing = true;
  stream->invalidated = false;
  stream->captured.clear();
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph) {
  if (!graph) return set_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!stream || !valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  if (!stream->capturing) return set_error(cudaErrorStreamCaptureUnmatched);
  stream->capturing = false;
  std::vector<Work> nodes;
  nodes.swap(stream->captured);
  if (stream->invalidated) {
    *graph = nullptr;
    return set_error(cudaErrorStreamCaptureInvalidated);
  }
  if (cudaError_t e = sticky_error()) return set_error(e);
  *graph = new CUgraph_st{std::move(nodes)};
  return cudaSuccess;
}

extern "C" cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status) {
  if (!status) return set_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_handle_mu);
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  *status = !stream || !stream->capturing  ? cudaStreamCaptureStatusNone
            : stream->invalidated          ? cudaStreamCaptureStatusInvalidated
                                           : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph, unsigned long long) {
  if (cudaError_t e = sticky_error()) return set_error(e);
  if (!exec || !graph) return set_error(cudaErrorInvalidValue);
  *exec = new CUgraphExec_st{std::make_shared<const std::vector<Work>>(graph->nodes)};
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (!exec) return set_error(cudaErrorInvalidResourceHandle);
  auto nodes = exec->nodes;
  return enqueue(stream, [nodes] {
    for (const Work &w : *nodes)
      if (cudaError_t e = w()) return e;
    return cudaSuccess;
  });
}

extern "C" cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

extern "C" cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
