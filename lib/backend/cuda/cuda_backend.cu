// The CUDA backend, libctr-cuda.so: a plugin behind lib/backend/plugin.h.
//
// Device. "cuda" picks GPU CTR_CUDA_DEVICE if set, else CTR_LOCAL_RANK modulo
// the number of visible GPUs, else 0; it needs compute capability 8.0 or later
// (bf16). Without a driver or a GPU, init fails with the CUDA runtime's reason,
// which the factory reports as CTR_STATUS_UNSUPPORTED.
//
// Streams. Stream 0 is a CUDA stream: kernels, copies and fills are queued on
// it and run asynchronously. Every further stream is a host worker thread with
// a queue, as on the CPU backend: it carries communication (host functions
// that issue and wait for collectives), which must be free to block and to call
// the CUDA runtime, neither of which a CUDA host callback may do. Work the
// executor puts on a worker (copies, fills, kernels) runs on the worker's own
// CUDA stream, synchronized before the next item.
//
// Events. An event recorded on stream 0 is a CUDA event (from a small ring per
// event id, so that a worker waiting on one record is not moved on by the
// next); one recorded on a worker is a generation counter. Stream 0 waits for
// a CUDA record with cudaStreamWaitEvent and for a worker's record by blocking
// the calling thread (the kernels queued after it are queued after the wait, so
// the order holds); a worker waits for either by blocking.
//
// Copies between host and device on stream 0 are synchronous (the step hands
// over temporary host buffers); device copies and fills are asynchronous.
// CTR_STREAM_SYNC copies and fills run on a stream of the calling thread's own
// and return once that stream has finished them: host work on a worker (a
// collective) stages device memory that way, through pinned buffers from
// host_alloc. Nothing here uses the legacy default stream, which the
// non-blocking streams do not wait for.
//
// Errors. Every CUDA runtime and cuBLASLt call and every kernel launch is
// checked (kernels/cuda/check.cuh); the first failure is the backend's sticky
// error, which the status slot reports and after which sum_squares returns
// NaN, never a stale value.
//
// Attention. Stream 0 offers the attention forward to cuDNN's fused SDPA
// (cudnn_sdpa.cu, in builds with cuDNN's headers) unless CTR_CUDNN=0; any
// other value than 0 or 1 is refused at creation.

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/host_worker.h"
#include "backend/plugin.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#if defined(CTR_HAVE_CUDNN)
#include "backend/cuda/cudnn_load.h"
#include "backend/cuda/cudnn_sdpa.h"
#endif

namespace ctr::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLASLt workspace per stream
constexpr int kEventRing = 8;

// Sets the calling thread's current device once per thread and backend device.
thread_local int tl_device = -1;
void use_device(int dev) {
  if (tl_device != dev) {
    if (CTR_CUDA_CHECK(cudaSetDevice(dev))) tl_device = dev;
  }
}

void free_stream(StreamCtx &s);

// A host worker stream (streams >= 1) with its own CUDA stream for the copies
// and kernels it runs.
struct Worker {
  explicit Worker(int device)
      : queue([device] { use_device(device); }, [](std::function<void()> &fn) { fn(); }) {}
  ~Worker() {
    queue.drain();
    free_stream(ctx);
  }
  void push(std::function<void()> fn) { queue.push(std::move(fn)); }
  void drain() { queue.drain(); }
  HostWorker queue;
  StreamCtx ctx;
};

struct Event {
  cudaEvent_t ring[kEventRing] = {};
  int next = 0;          // ring slot of the next CUDA record
  bool on_gpu = false;   // the latest record was on stream 0
  uint64_t target = 0;   // generation of the latest worker record
  uint64_t done = 0;     // generation the worker has reached
};

struct Cuda {
  int device = 0;
  StreamCtx s0;
  std::vector<std::unique_ptr<Worker>> workers;  // stream s >= 1 is workers[s - 1]
  std::mutex mu;                                 // events
  std::condition_variable cv;
  std::deque<Event> events;
  std::unordered_map<std::string, ctr_kernel_fn> kernels;
  std::vector<cudaGraphExec_t> graphs;  // by graph id; null: destroyed (under mu)
  double *sum_scratch = nullptr;  // device: partial sums, then the result
  double *sum_host = nullptr;     // pinned
  ctr_adamw_segment *segments = nullptr;  // device copy of the AdamW segment table
  int64_t segments_cap = 0;
  std::mutex adamw_mu;
  cudaStream_t comm_stream = nullptr;  // device communicators' stream (backend_comm_stream)
  std::mutex comm_mu;
  std::mutex sync_mu;
  std::unordered_map<std::thread::id, cudaStream_t> sync_streams;  // under sync_mu

  // Runs fn on stream s: queued on the CUDA stream for 0 (fn enqueues), on the
  // worker otherwise (fn enqueues on the worker's stream, then waits for it).
  void submit(int s, std::function<void(StreamCtx &)> fn) {
    use_device(device);
    if (s == 0) {
      fn(s0);
      return;
    }
    Worker *w = workers[static_cast<size_t>(s - 1)].get();
    w->push([w, fn = std::move(fn)] {
      fn(w->ctx);
      CTR_CUDA_CHECK(cudaStreamSynchronize(w->ctx.stream));
    });
  }
  // The calling thread's stream for CTR_STREAM_SYNC copies and fills.
  cudaStream_t sync_stream() {
    std::lock_guard<std::mutex> lock(sync_mu);
    cudaStream_t &st = sync_streams[std::this_thread::get_id()];
    if (!st && !CTR_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking))) st = nullptr;
    return st;
  }
  void complete(int e, uint64_t gen) {
    {
      std::lock_guard<std::mutex> lock(mu);
      Event &ev = events[static_cast<size_t>(e)];
      ev.done = std::max(ev.done, gen);
    }
    cv.notify_all();
  }
  void block_until(int e, uint64_t gen) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return events[static_cast<size_t>(e)].done >= gen; });
  }
};

Cuda &C(void *ctx) { return *static_cast<Cuda *>(ctx); }

bool init_stream(StreamCtx &s) {
  if (!CTR_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking))) return false;
  if (!CTR_CUBLAS_CHECK(cublasLtCreate(&s.lt))) return false;
  if (!CTR_CUDA_CHECK(cudaMalloc(&s.workspace, kWorkspaceBytes))) return false;
  s.workspace_bytes = kWorkspaceBytes;
  s.gemm = gemm_cache_create();  // per stream: plans carry per-call pointers
  return true;
}

void free_stream(StreamCtx &s) {
  if (s.stream) CTR_CUDA_CHECK(cudaStreamSynchronize(s.stream));
#if defined(CTR_HAVE_CUDNN)
  cudnn_attention_destroy(s.attn);
#endif
  gemm_cache_destroy(s.gemm);
  if (s.workspace) CTR_CUDA_CHECK(cudaFree(s.workspace));
  if (s.lt) CTR_CUBLAS_CHECK(cublasLtDestroy(s.lt));
  if (s.stream) CTR_CUDA_CHECK(cudaStreamDestroy(s.stream));
  s = StreamCtx{};
}

// ---------------------------------------------------------------------------
// Interface slots

void *cu_alloc(void *ctx, size_t bytes) {
  Cuda &c = C(ctx);
  use_device(c.device);
  void *p = nullptr;
  const size_t n = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  if (cudaMalloc(&p, n) != cudaSuccess) {
    // Out of memory is the caller's to report (with the sizes it asked for);
    // it is no fault of the device, so it must not linger as the last error.
    (void)cudaGetLastError();
    return nullptr;
  }
  // Zeroed on stream 0 and waited for: the memory's first users are ordered
  // after stream 0 (workers wait for its events), never before this memset.
  if (!CTR_CUDA_CHECK(cudaMemsetAsync(p, 0, n, c.s0.stream)) ||
      !CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream))) {
    cudaFree(p);
    return nullptr;
  }
  return p;
}
void cu_free(void *ctx, void *p) {
  if (!p) return;
  Cuda &c = C(ctx);
  use_device(c.device);
  CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
  CTR_CUDA_CHECK(cudaFree(p));
}
void *cu_host_alloc(void *ctx, size_t bytes) {
  use_device(C(ctx).device);
  void *p = nullptr;
  if (cudaMallocHost(&p, std::max<size_t>(bytes, 1)) != cudaSuccess) {
    (void)cudaGetLastError();  // the caller falls back to ordinary memory
    return nullptr;
  }
  return p;
}
void cu_host_free(void *ctx, void *p) {
  if (!p) return;
  use_device(C(ctx).device);
  CTR_CUDA_CHECK(cudaFreeHost(p));
}
int cu_status(void *, char *buf, size_t size) { return error_message(buf, size); }
void copy_on(Cuda &c, void *dst, const void *src, size_t bytes, int stream, cudaMemcpyKind kind) {
  if (!bytes) return;
  if (stream == CTR_STREAM_SYNC) {
    // On the calling thread, outside every stream: the caller ordered it. A
    // plain cudaMemcpy from pageable memory may return before the data has
    // landed; a copy on a stream that is then synchronized may not.
    use_device(c.device);
    cudaStream_t st = c.sync_stream();
    if (st && CTR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, st))) CTR_CUDA_CHECK(cudaStreamSynchronize(st));
    return;
  }
  if (stream == 0) {
    use_device(c.device);
    if (CTR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, c.s0.stream)) && kind != cudaMemcpyDeviceToDevice)
      CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
    return;
  }
  c.submit(stream, [=](StreamCtx &s) { CTR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, s.stream)); });
}
void cu_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  copy_on(C(ctx), dst, src, bytes, stream, cudaMemcpyHostToDevice);
}
void cu_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  copy_on(C(ctx), dst, src, bytes, stream, cudaMemcpyDeviceToHost);
}
void cu_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  copy_on(C(ctx), dst, src, bytes, stream, cudaMemcpyDeviceToDevice);
}
void cu_fill(void *ctx, void *dst, int byte, size_t bytes, int stream) {
  if (!bytes) return;
  Cuda &c = C(ctx);
  if (stream == CTR_STREAM_SYNC) {
    use_device(c.device);
    cudaStream_t st = c.sync_stream();
    if (st && CTR_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, st))) CTR_CUDA_CHECK(cudaStreamSynchronize(st));
    return;
  }
  c.submit(stream, [=](StreamCtx &s) { CTR_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, s.stream)); });
}
int cu_create_stream(void *ctx) {
  Cuda &c = C(ctx);
  use_device(c.device);
  auto w = std::make_unique<Worker>(c.device);
  if (!init_stream(w->ctx)) {
    free_stream(w->ctx);
    return -1;
  }
  w->ctx.sm_count = c.s0.sm_count;
  w->ctx.tf32 = c.s0.tf32;
  c.workers.push_back(std::move(w));
  return static_cast<int>(c.workers.size());
}
int cu_create_event(void *ctx) {
  Cuda &c = C(ctx);
  use_device(c.device);
  Event ev;
  for (auto &e : ev.ring)
    if (!CTR_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming))) return -1;
  std::lock_guard<std::mutex> lock(c.mu);
  c.events.push_back(ev);
  return static_cast<int>(c.events.size() - 1);
}
void cu_record_event(void *ctx, int e, int stream) {
  Cuda &c = C(ctx);
  if (stream == 0) {
    use_device(c.device);
    std::lock_guard<std::mutex> lock(c.mu);
    Event &ev = c.events[static_cast<size_t>(e)];
    ev.next = (ev.next + 1) % kEventRing;
    CTR_CUDA_CHECK(cudaEventRecord(ev.ring[ev.next], c.s0.stream));
    ev.on_gpu = true;
    return;
  }
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    Event &ev = c.events[static_cast<size_t>(e)];
    gen = ++ev.target;
    ev.on_gpu = false;
  }
  Cuda *cp = &c;
  c.workers[static_cast<size_t>(stream - 1)]->push([cp, e, gen] { cp->complete(e, gen); });
}
void cu_wait_event(void *ctx, int e, int stream) {
  Cuda &c = C(ctx);
  bool on_gpu;
  cudaEvent_t ce;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    Event &ev = c.events[static_cast<size_t>(e)];
    on_gpu = ev.on_gpu;
    ce = ev.ring[ev.next];
    gen = ev.target;
  }
  if (stream == 0) {
    use_device(c.device);
    if (on_gpu)
      CTR_CUDA_CHECK(cudaStreamWaitEvent(c.s0.stream, ce, 0));
    else
      c.block_until(e, gen);
    return;
  }
  Cuda *cp = &c;
  if (on_gpu)
    c.workers[static_cast<size_t>(stream - 1)]->push([ce] { CTR_CUDA_CHECK(cudaEventSynchronize(ce)); });
  else
    c.workers[static_cast<size_t>(stream - 1)]->push([cp, e, gen] { cp->block_until(e, gen); });
}
void cu_host_fn(void *ctx, int stream, ctr_host_fn fn, void *user) {
  Cuda &c = C(ctx);
  if (stream == 0) {
    // Host work on stream 0 runs in order with its kernels: wait for them.
    use_device(c.device);
    CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
    fn(user);
    return;
  }
  c.workers[static_cast<size_t>(stream - 1)]->push([fn, user] { fn(user); });
}
void cu_synchronize(void *ctx, int stream) {
  Cuda &c = C(ctx);
  if (stream == 0) {
    use_device(c.device);
    CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
    return;
  }
  c.workers[static_cast<size_t>(stream - 1)]->drain();
}
ctr_kernel_fn cu_kernel(void *ctx, int32_t, const char *name) {
  Cuda &c = C(ctx);
  auto it = c.kernels.find(name ? name : "");
  return it == c.kernels.end() ? nullptr : it->second;
}
void cu_launch(void *ctx, ctr_kernel_fn fn, const ctr_kernel_args *args, int stream) {
  Cuda &c = C(ctx);
  if (stream == 0) {
    use_device(c.device);
    fn(args, &c.s0);
    return;
  }
  c.submit(stream, [fn, args](StreamCtx &s) { fn(args, &s); });
}
double cu_sum_squares(void *ctx, const float *x, int64_t n, int stream) {
  Cuda &c = C(ctx);
  cu_synchronize(ctx, stream);
  use_device(c.device);
  if (n <= 0) return has_error() ? std::nan("") : 0.0;
  const int64_t len = sum_squares_scratch_len();
  sum_squares(x, n, c.sum_scratch + len, c.sum_scratch, len, c.s0.stream);
  if (CTR_CUDA_CHECK(cudaMemcpyAsync(c.sum_host, c.sum_scratch + len, sizeof(double), cudaMemcpyDeviceToHost,
                                     c.s0.stream)))
    CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
  // After a failure the pinned result may be an earlier step's: never return it.
  return has_error() ? std::nan("") : *c.sum_host;
}
void cu_add_into(void *ctx, float *acc, const float *x, int64_t n, int stream) {
  C(ctx).submit(stream, [=](StreamCtx &s) { add_into(acc, x, n, s.stream); });
}
void cu_adamw(void *ctx, const ctr_adamw_args *a, int stream) {
  Cuda &c = C(ctx);
  use_device(c.device);
  std::lock_guard<std::mutex> lock(c.adamw_mu);
  if (a->num_segments > c.segments_cap) {
    CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
    CTR_CUDA_CHECK(cudaFree(c.segments));
    c.segments = nullptr;
    c.segments_cap = 0;
    if (!CTR_CUDA_CHECK(cudaMalloc(&c.segments, static_cast<size_t>(a->num_segments) * sizeof(ctr_adamw_segment))))
      return;  // the sticky error: the step fails at its next check
    c.segments_cap = a->num_segments;
  }
  ctr_adamw_args copy = *a;
  // The table may change between steps: copied in order on the stream (a
  // synchronous copy from pageable memory, so the host table may go at once).
  c.submit(stream, [&c, copy](StreamCtx &s) {
    if (!CTR_CUDA_CHECK(cudaMemcpyAsync(c.segments, copy.segments,
                                        static_cast<size_t>(copy.num_segments) * sizeof(ctr_adamw_segment),
                                        cudaMemcpyHostToDevice, s.stream)) ||
        !CTR_CUDA_CHECK(cudaStreamSynchronize(s.stream)))
      return;
    adamw(copy, c.segments, s.stream);
  });
}
// CUDA graphs of stream 0's work (the executor captures a phase once and
// replays it every step).
int cu_capture_begin(void *ctx, int stream) {
  Cuda &c = C(ctx);
  if (stream != 0) return -1;
  use_device(c.device);
  return cudaStreamBeginCapture(c.s0.stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess ? 0 : -1;
}
int cu_capture_end(void *ctx, int stream) {
  Cuda &c = C(ctx);
  if (stream != 0) return -1;
  use_device(c.device);
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(c.s0.stream, &graph) != cudaSuccess || !graph) {
    cudaGetLastError();  // a failed capture leaves its error behind
    return -1;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  std::lock_guard<std::mutex> lock(c.mu);
  for (size_t i = 0; i < c.graphs.size(); ++i)
    if (!c.graphs[i]) {
      c.graphs[i] = exec;
      return static_cast<int>(i);
    }
  c.graphs.push_back(exec);
  return static_cast<int>(c.graphs.size() - 1);
}
void cu_graph_launch(void *ctx, int graph, int stream) {
  Cuda &c = C(ctx);
  use_device(c.device);
  cudaGraphExec_t exec;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    exec = c.graphs[static_cast<size_t>(graph)];
  }
  if (stream == 0) {
    CTR_CUDA_CHECK(cudaGraphLaunch(exec, c.s0.stream));
    return;
  }
  c.submit(stream, [exec](StreamCtx &s) { CTR_CUDA_CHECK(cudaGraphLaunch(exec, s.stream)); });
}
void cu_graph_destroy(void *ctx, int graph) {
  Cuda &c = C(ctx);
  use_device(c.device);
  CTR_CUDA_CHECK(cudaStreamSynchronize(c.s0.stream));
  std::lock_guard<std::mutex> lock(c.mu);
  if (graph >= 0 && static_cast<size_t>(graph) < c.graphs.size() && c.graphs[static_cast<size_t>(graph)]) {
    CTR_CUDA_CHECK(cudaGraphExecDestroy(c.graphs[static_cast<size_t>(graph)]));
    c.graphs[static_cast<size_t>(graph)] = nullptr;
  }
}

void cu_destroy(void *ctx) {
  Cuda *c = static_cast<Cuda *>(ctx);
  use_device(c->device);
  c->workers.clear();
  for (cudaGraphExec_t g : c->graphs)
    if (g) cudaGraphExecDestroy(g);
  for (Event &ev : c->events)
    for (auto &e : ev.ring)
      if (e) cudaEventDestroy(e);
  if (c->comm_stream) {
    CTR_CUDA_CHECK(cudaStreamSynchronize(c->comm_stream));
    CTR_CUDA_CHECK(cudaStreamDestroy(c->comm_stream));
  }
  for (auto &[id, st] : c->sync_streams)
    if (st) CTR_CUDA_CHECK(cudaStreamDestroy(st));
  free_stream(c->s0);
  CTR_CUDA_CHECK(cudaFree(c->sum_scratch));
  CTR_CUDA_CHECK(cudaFree(c->segments));
  CTR_CUDA_CHECK(cudaFreeHost(c->sum_host));
  delete c;
}

const ctr_backend_iface kIface = {
    sizeof(ctr_backend_iface),
    CTR_BACKEND_ABI,
    "cuda",
    cu_alloc,
    cu_free,
    cu_copy_h2d,
    cu_copy_d2h,
    cu_copy_d2d,
    cu_fill,
    cu_create_stream,
    cu_create_event,
    cu_record_event,
    cu_wait_event,
    cu_host_fn,
    cu_synchronize,
    cu_kernel,
    cu_launch,
    cu_sum_squares,
    cu_add_into,
    cu_adamw,
    cu_destroy,
    CTR_BACKEND_DEVICE_MEMORY | CTR_BACKEND_ATTENTION_LSE,
    cu_capture_begin,
    cu_capture_end,
    cu_graph_launch,
    cu_graph_destroy,
    cu_status,
    cu_host_alloc,
    cu_host_free,
};

void say(char *err, size_t size, const std::string &msg) {
  if (err && size) std::snprintf(err, size, "%s", msg.c_str());
}

int env_int(const char *name, int fallback) {
  const char *v = std::getenv(name);
  if (!v || !*v) return fallback;
  char *end = nullptr;
  long x = std::strtol(v, &end, 10);
  return (*end || x < 0 || x > 1 << 20) ? -1 : static_cast<int>(x);
}

}  // namespace

int backend_device(void *backend_ctx) { return C(backend_ctx).device; }
cudaStream_t backend_stream0(void *backend_ctx) { return C(backend_ctx).s0.stream; }
cudaStream_t backend_comm_stream(void *backend_ctx) {
  Cuda &c = C(backend_ctx);
  std::lock_guard<std::mutex> lock(c.comm_mu);
  if (!c.comm_stream) {
    use_device(c.device);
    if (!CTR_CUDA_CHECK(cudaStreamCreateWithFlags(&c.comm_stream, cudaStreamNonBlocking))) c.comm_stream = nullptr;
  }
  return c.comm_stream;
}

}  // namespace ctr::cuda

extern "C" __attribute__((visibility("default"))) const ctr_backend_iface *ctr_backend_plugin_init(
    uint32_t abi, const char *device, void **ctx, char *err, size_t err_size) {
  using namespace ctr::cuda;
  if (abi != CTR_BACKEND_ABI) {
    say(err, err_size, "libctr-cuda.so speaks backend ABI " + std::to_string(CTR_BACKEND_ABI) + ", the caller " +
                           std::to_string(abi));
    return nullptr;
  }
  if (!device || std::strcmp(device, "cuda") != 0) {
    say(err, err_size, std::string("libctr-cuda.so serves device 'cuda', not '") + (device ? device : "") + "'");
    return nullptr;
  }
#if !defined(CTR_CUDA_EMU)  // the emulated device (tests/cuda_emu) has no driver
  // Without the driver library the runtime only says its version is too new.
  if (void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL)) {
    dlclose(driver);
  } else {
    say(err, err_size,
        "no usable GPU: the NVIDIA driver library libcuda.so.1 cannot be loaded (the CUDA backend needs an NVIDIA "
        "GPU of compute capability 8.0 or later and its driver)");
    return nullptr;
  }
#endif
  int count = 0;
  if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0) {
    say(err, err_size,
        std::string("no usable GPU: ") +
            (e != cudaSuccess ? cudaGetErrorString(e) : "the CUDA driver sees no device") +
            " (the CUDA backend needs an NVIDIA GPU of compute capability 8.0 or later and its driver)");
    return nullptr;
  }
  const int explicit_dev = env_int("CTR_CUDA_DEVICE", -2);
  const int local = env_int("CTR_LOCAL_RANK", 0);
  if (explicit_dev == -1 || local < 0) {
    say(err, err_size, "CTR_CUDA_DEVICE / CTR_LOCAL_RANK must be a non-negative integer");
    return nullptr;
  }
  // f32 GEMMs on TF32 tensor cores unless CTR_CUDA_TF32=0 (exact f32 products).
  const int tf32 = env_int("CTR_CUDA_TF32", 1);
  if (tf32 != 0 && tf32 != 1) {
    say(err, err_size, "CTR_CUDA_TF32 must be 0 (exact f32 GEMMs) or 1 (TF32 tensor cores, the default)");
    return nullptr;
  }
#if defined(CTR_HAVE_CUDNN)
  // Attention through cuDNN where it loads unless CTR_CUDNN=0.
  const int cudnn = cudnn_knob();
  if (cudnn < 0) {
    say(err, err_size, "CTR_CUDNN must be 0 (attention on the own kernels) or 1 (cuDNN's fused attention where it "
                       "loads, the default)");
    return nullptr;
  }
#endif
  const int dev = explicit_dev >= 0 ? explicit_dev : local % count;
  if (dev >= count) {
    say(err, err_size, "CTR_CUDA_DEVICE=" + std::to_string(dev) + " but only " + std::to_string(count) +
                           " GPU(s) are visible");
    return nullptr;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess || prop.major < 8) {
    say(err, err_size, std::string("GPU ") + std::to_string(dev) + " (" + prop.name + ") has compute capability " +
                           std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                           "; the CUDA backend needs 8.0 or later");
    return nullptr;
  }
  auto c = std::make_unique<Cuda>();
  c->device = dev;
  tl_device = -1;
  use_device(dev);
  c->s0.sm_count = prop.multiProcessorCount;
  c->s0.tf32 = tf32 == 1;
  const int64_t len = sum_squares_scratch_len();
  if (!init_stream(c->s0) || cudaMalloc(&c->sum_scratch, static_cast<size_t>(len + 1) * sizeof(double)) !=
                                          cudaSuccess ||
      cudaMallocHost(&c->sum_host, sizeof(double)) != cudaSuccess) {
    say(err, err_size, std::string("cannot set up GPU ") + std::to_string(dev) + ": " +
                           cudaGetErrorString(cudaGetLastError()));
    free_stream(c->s0);
    return nullptr;
  }
#if defined(CTR_HAVE_CUDNN)
  c->s0.attn = cudnn_attention_create(c->s0.stream, cudnn);
#endif
  auto add = [&](const KernelEntry *t, size_t n) {
    for (size_t i = 0; i < n; ++i) c->kernels[t[i].name] = t[i].fn;
  };
  add(kElementwiseKernels, kElementwiseKernelCount);
  add(kGemmKernels, kGemmKernelCount);
  add(kLayoutKernels, kLayoutKernelCount);
  add(kNormKernels, kNormKernelCount);
  add(kRowKernels, kRowKernelCount);
  add(kLossKernels, kLossKernelCount);
  add(kAttentionKernels, kAttentionKernelCount);
  add(kMoeKernels, kMoeKernelCount);
  *ctx = c.release();
  return &kIface;
}
