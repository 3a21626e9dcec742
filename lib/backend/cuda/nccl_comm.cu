// NCCL device communicators of the CUDA backend: plugin.h's
// ctr_device_comm_iface over NCCL, exported as ctr_device_comm_plugin_init.
//
// NCCL is loaded with dlopen at the first ctr_device_comm_plugin_init, never
// linked, so libctr-cuda.so loads on machines without it and takes it from
// wherever the target has one: CTR_NCCL_PATH (a directory such as a Python
// wheel's nvidia/nccl/lib, or the library file), beside this plugin, the
// library search path, then the CUDA installation. nccl.h supplies types only.
//
// Nothing here may hang or end the host process. Communicators are
// non-blocking (ncclConfig_t.blocking = 0): creation and every enqueue return
// at once and are polled against a deadline with ncclCommGetAsyncError. Work
// is a CUDA event recorded after the op on the backend's communication stream,
// which first waits for an event recorded on stream 0 (so the op reads what
// stream 0's kernels wrote). wait polls the event and the communicator's
// asynchronous error; a timeout or an error aborts the communicator
// (ncclCommAbort) and names the collective and NCCL's error.

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/plugin.h"
#include "ctr/ctr.h"
#include "cuda/check.cuh"

namespace ctr::cuda {
namespace {

void say(char *err, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void say(char *err, size_t size, const char *fmt, ...) {
  if (!err || !size) return;
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(err, size, fmt, ap);
  va_end(ap);
}

// ---------------------------------------------------------------------------
// The library, loaded once

struct Nccl {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommFinalize) finalize = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
};

Nccl g_nccl;
std::mutex g_load_mu;
bool g_loaded = false;
std::string g_load_error;

std::string plugin_directory() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void *>(&plugin_directory), &info) || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

// Loads libnccl.so.2 and its symbols; "" on success, else why not.
std::string load_nccl() {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_loaded) return g_load_error;
  g_loaded = true;
  const char *kFile = "libnccl.so.2";
  std::vector<std::string> candidates;
  if (const char *p = std::getenv("CTR_NCCL_PATH"); p && *p) {
    const std::string s = p;
    const bool file = s.size() > 3 && s.find(".so") != std::string::npos && s.back() != '/';
    candidates.push_back(file ? s : s + "/" + kFile);
  }
  if (const std::string here = plugin_directory(); !here.empty()) candidates.push_back(here + "/" + kFile);
  candidates.push_back(kFile);
  if (const char *home = std::getenv("CUDA_HOME"); home && *home)
    candidates.push_back(std::string(home) + "/lib64/" + kFile);
  candidates.push_back(std::string("/usr/local/cuda/lib64/") + kFile);
  void *lib = nullptr;
  std::string tried;
  for (const std::string &c : candidates) {
    // A path is only tried where a file is: dlerror for a missing one adds nothing.
    if (c.find('/') != std::string::npos && access(c.c_str(), F_OK) != 0) continue;
    lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
    tried += (tried.empty() ? "" : "; ") + std::string(dlerror());
  }
  if (!lib) {
    g_load_error = std::string("transport 'nccl': libnccl.so.2 cannot be loaded (") +
                   (tried.empty() ? "not found" : tried) +
                   "); install NCCL for this CUDA version or set CTR_NCCL_PATH to the directory that holds it "
                   "(for a Python wheel: .../nvidia/nccl/lib)";
    return g_load_error;
  }
  Nccl n;
  std::string missing;
  auto sym = [&](auto &fn, const char *name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (!fn) missing += (missing.empty() ? "" : ", ") + std::string(name);
  };
  sym(n.get_version, "ncclGetVersion");
  sym(n.get_unique_id, "ncclGetUniqueId");
  sym(n.init_rank_config, "ncclCommInitRankConfig");
  sym(n.get_async_error, "ncclCommGetAsyncError");
  sym(n.finalize, "ncclCommFinalize");
  sym(n.destroy, "ncclCommDestroy");
  sym(n.abort, "ncclCommAbort");
  sym(n.error_string, "ncclGetErrorString");
  sym(n.last_error, "ncclGetLastError");
  sym(n.all_gather, "ncclAllGather");
  sym(n.reduce_scatter, "ncclReduceScatter");
  sym(n.all_reduce, "ncclAllReduce");
  sym(n.broadcast, "ncclBroadcast");
  sym(n.send, "ncclSend");
  sym(n.recv, "ncclRecv");
  sym(n.group_start, "ncclGroupStart");
  sym(n.group_end, "ncclGroupEnd");
  if (!missing.empty()) {
    dlclose(lib);
    g_load_error = "transport 'nccl': the libnccl.so.2 found lacks " + missing +
                   " (libctr-cuda.so needs NCCL 2.19 or later)";
    return g_load_error;
  }
  int version = 0;
  if (n.get_version(&version) != ncclSuccess || version < 21900) {
    dlclose(lib);
    g_load_error = "transport 'nccl': libnccl.so.2 is version " + std::to_string(version) +
                   "; libctr-cuda.so needs NCCL 2.19 or later";
    return g_load_error;
  }
  g_nccl = n;  // the library stays loaded until exit
  return "";
}

const Nccl &N() { return g_nccl; }

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = N().error_string(r);
  const char *last = comm ? N().last_error(comm) : nullptr;
  if (last && *last) s += std::string(": ") + last;
  return s;
}

bool to_nccl_type(int32_t dtype, ncclDataType_t *t, size_t *size) {
  switch (dtype) {
    case CTR_DTYPE_F32: *t = ncclFloat32; *size = 4; return true;
    case CTR_DTYPE_F64: *t = ncclFloat64; *size = 8; return true;
    case CTR_DTYPE_I32: *t = ncclInt32; *size = 4; return true;
    case CTR_DTYPE_I64: *t = ncclInt64; *size = 8; return true;
    case CTR_DTYPE_BF16: *t = ncclBfloat16; *size = 2; return true;
    default: return false;
  }
}

bool to_nccl_op(int32_t op, ncclRedOp_t *o) {
  switch (op) {
    case CTR_DEVICE_REDUCE_SUM: *o = ncclSum; return true;
    case CTR_DEVICE_REDUCE_AVG: *o = ncclAvg; return true;
    case CTR_DEVICE_REDUCE_MAX: *o = ncclMax; return true;
    case CTR_DEVICE_REDUCE_MIN: *o = ncclMin; return true;
    default: return false;
  }
}

using Clock = std::chrono::steady_clock;

// Sleeps a little longer each round: a collective that completes soon is seen
// soon, a long one costs little CPU.
struct Backoff {
  int round = 0;
  void pause() {
    if (round < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(20 << std::min((round - 64) / 16, 6), 1000)));
    }
    ++round;
  }
};

}  // namespace
}  // namespace ctr::cuda

// ---------------------------------------------------------------------------
// Communicators and work

struct ctr_device_comm {
  void *backend = nullptr;
  int device = 0;
  cudaStream_t s0 = nullptr, stream = nullptr;
  ncclComm_t comm = nullptr;
  int rank = 0, nranks = 1;
  int64_t timeout_ms = 60000;
  cudaEvent_t order = nullptr;  // recorded on stream 0 before each op
  std::mutex mu;                // issue, pool, abort
  std::vector<cudaEvent_t> pool;
  std::string broken;           // why the communicator was aborted ("": healthy)
};

struct ctr_device_work {
  cudaEvent_t done = nullptr;
  std::string what;  // "all_gather of 4096 bytes", for messages
};

namespace ctr::cuda {
namespace {

// Aborts the communicator once; later ops fail with `why`. Called with mu held.
void abort_locked(ctr_device_comm *c, const std::string &why) {
  if (c->broken.empty()) c->broken = why;
  if (c->comm) {
    N().abort(c->comm);
    c->comm = nullptr;
  }
}

// After an enqueue or group end on a non-blocking communicator: waits (bounded)
// until NCCL has queued the work on the stream. "" or the failure.
std::string settle_locked(ctr_device_comm *c, ncclResult_t r, const char *what) {
  if (r == ncclSuccess) return "";
  if (r != ncclInProgress) {
    const std::string msg = std::string(what) + ": " + nccl_error(r, c->comm);
    abort_locked(c, msg);
    return msg;
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(c->timeout_ms);
  Backoff b;
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = N().get_async_error(c->comm, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess) return "";
    if (state != ncclInProgress) {
      const std::string msg = std::string(what) + ": " + nccl_error(state, c->comm);
      abort_locked(c, msg);
      return msg;
    }
    if (Clock::now() > deadline) {
      const std::string msg = std::string(what) + ": NCCL did not queue it within " +
                              std::to_string(c->timeout_ms) + " ms (a peer is missing); the communicator was aborted";
      abort_locked(c, msg);
      return msg;
    }
    b.pause();
  }
}

// Runs `enqueue` (NCCL calls, inside a group when grouped) on the comm stream
// after stream 0's queued work, and returns the work that marks its end.
template <typename F>
ctr_device_work *issue(ctr_device_comm *c, const std::string &what, bool grouped, char *err, size_t err_size,
                       F &&enqueue) try {
  std::lock_guard<std::mutex> lock(c->mu);
  if (!c->broken.empty()) {
    say(err, err_size, "%s: the NCCL communicator was aborted earlier (%s)", what.c_str(), c->broken.c_str());
    return nullptr;
  }
  CTR_CUDA_CHECK(cudaSetDevice(c->device));
  cudaError_t ce = cudaEventRecord(c->order, c->s0);
  if (ce == cudaSuccess) ce = cudaStreamWaitEvent(c->stream, c->order, 0);
  if (ce != cudaSuccess) {
    say(err, err_size, "%s: ordering after stream 0 failed: %s", what.c_str(), cudaGetErrorString(ce));
    return nullptr;
  }
  ncclResult_t r = ncclSuccess;
  if (grouped) {
    r = N().group_start();
    if (r == ncclSuccess) {
      const ncclResult_t inner = enqueue();
      r = N().group_end();  // a group once started is always ended
      if (inner != ncclSuccess && inner != ncclInProgress) r = inner;
    }
  } else {
    r = enqueue();
  }
  if (std::string msg = settle_locked(c, r, what.c_str()); !msg.empty()) {
    say(err, err_size, "%s", msg.c_str());
    return nullptr;
  }
  cudaEvent_t ev = nullptr;
  if (!c->pool.empty()) {
    ev = c->pool.back();
    c->pool.pop_back();
  } else if ((ce = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) != cudaSuccess) {
    // The op is queued and cannot be taken back: the communicator is unusable.
    const std::string msg = what + ": cannot create a CUDA event: " + cudaGetErrorString(ce);
    abort_locked(c, msg);
    say(err, err_size, "%s", msg.c_str());
    return nullptr;
  }
  if ((ce = cudaEventRecord(ev, c->stream)) != cudaSuccess) {
    const std::string msg = what + ": cannot record its CUDA event: " + cudaGetErrorString(ce);
    cudaEventDestroy(ev);
    abort_locked(c, msg);
    say(err, err_size, "%s", msg.c_str());
    return nullptr;
  }
  auto *w = new ctr_device_work;
  w->done = ev;
  w->what = what;
  return w;
} catch (const std::exception &e) {
  say(err, err_size, "%s: %s", what.c_str(), e.what());
  return nullptr;
}

std::string describe(const char *op, size_t count, const char *unit) {
  return std::string(op) + " of " + std::to_string(count) + " " + unit;
}

// ---------------------------------------------------------------------------
// Table slots

int dc_unique_id(void *backend_ctx, char *buf, size_t *len, char *err, size_t err_size) {
  (void)backend_ctx;
  if (!buf || !len || *len < sizeof(ncclUniqueId)) {
    say(err, err_size, "transport 'nccl': a unique id needs %zu bytes", sizeof(ncclUniqueId));
    return CTR_DEVICE_COMM_FAILED;
  }
  ncclUniqueId id;
  const ncclResult_t r = N().get_unique_id(&id);
  if (r != ncclSuccess) {
    say(err, err_size, "transport 'nccl': ncclGetUniqueId: %s", nccl_error(r, nullptr).c_str());
    return CTR_DEVICE_COMM_FAILED;
  }
  std::memcpy(buf, &id, sizeof id);
  *len = sizeof id;
  return CTR_DEVICE_COMM_OK;
}

int dc_comm_create(void *backend_ctx, const char *id, size_t len, int rank, int nranks, int64_t timeout_ms,
                   ctr_device_comm **out, char *err, size_t err_size) try {
  if (!backend_ctx || !id || len != sizeof(ncclUniqueId) || nranks < 1 || rank < 0 || rank >= nranks || !out) {
    say(err, err_size, "transport 'nccl': bad arguments to comm_create (id of %zu bytes, rank %d of %d)", len, rank,
        nranks);
    return CTR_DEVICE_COMM_FAILED;
  }
  auto c = std::make_unique<ctr_device_comm>();
  c->backend = backend_ctx;
  c->device = backend_device(backend_ctx);
  c->s0 = backend_stream0(backend_ctx);
  c->stream = backend_comm_stream(backend_ctx);
  c->rank = rank;
  c->nranks = nranks;
  c->timeout_ms = timeout_ms > 0 ? timeout_ms : 60000;
  CTR_CUDA_CHECK(cudaSetDevice(c->device));
  if (!c->stream) {
    say(err, err_size, "transport 'nccl': cannot create the communication stream: %s",
        cudaGetErrorString(cudaGetLastError()));
    return CTR_DEVICE_COMM_FAILED;
  }
  if (cudaError_t ce = cudaEventCreateWithFlags(&c->order, cudaEventDisableTiming); ce != cudaSuccess) {
    say(err, err_size, "transport 'nccl': cannot create a CUDA event: %s", cudaGetErrorString(ce));
    return CTR_DEVICE_COMM_FAILED;
  }
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = N().init_rank_config(&comm, nranks, uid, rank, &config);
  const auto deadline = Clock::now() + std::chrono::milliseconds(c->timeout_ms);
  Backoff b;
  while (r == ncclInProgress && comm) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = N().get_async_error(comm, &state);
    r = q != ncclSuccess ? q : state;
    if (r != ncclInProgress) break;
    if (Clock::now() > deadline) {
      N().abort(comm);
      cudaEventDestroy(c->order);
      say(err, err_size,
          "transport 'nccl': creating the communicator (rank %d of %d) did not finish within %lld ms (a member "
          "did not join); aborted",
          rank, nranks, static_cast<long long>(c->timeout_ms));
      return CTR_DEVICE_COMM_TIMEOUT;
    }
    b.pause();
  }
  if (r != ncclSuccess) {
    say(err, err_size, "transport 'nccl': creating the communicator (rank %d of %d): %s", rank, nranks,
        nccl_error(r, comm).c_str());
    if (comm) N().abort(comm);
    cudaEventDestroy(c->order);
    return CTR_DEVICE_COMM_FAILED;
  }
  c->comm = comm;
  *out = c.release();
  return CTR_DEVICE_COMM_OK;
} catch (const std::exception &e) {
  say(err, err_size, "transport 'nccl': creating the communicator: %s", e.what());
  return CTR_DEVICE_COMM_FAILED;
}

ctr_device_work *dc_all_gather(ctr_device_comm *c, const void *send, void *recv, size_t bytes, char *err,
                               size_t err_size) {
  return issue(c, describe("all_gather", bytes, "bytes"), false, err, err_size,
               [&] { return N().all_gather(send, recv, bytes, ncclUint8, c->comm, c->stream); });
}

ctr_device_work *reduction(const char *name, ctr_device_comm *c, const void *send, void *recv, size_t count,
                           int32_t dtype, int32_t op, bool scatter, char *err, size_t err_size) {
  ncclDataType_t t;
  ncclRedOp_t o;
  size_t size = 0;
  if (!to_nccl_type(dtype, &t, &size) || !to_nccl_op(op, &o)) {
    say(err, err_size, "%s: dtype %d or reduction %d is not supported over NCCL", name, dtype, op);
    return nullptr;
  }
  return issue(c, describe(name, count, "elements"), false, err, err_size, [&] {
    return scatter ? N().reduce_scatter(send, recv, count, t, o, c->comm, c->stream)
                   : N().all_reduce(send, recv, count, t, o, c->comm, c->stream);
  });
}

ctr_device_work *dc_reduce_scatter(ctr_device_comm *c, const void *send, void *recv, size_t count, int32_t dtype,
                                   int32_t op, char *err, size_t err_size) {
  return reduction("reduce_scatter", c, send, recv, count, dtype, op, true, err, err_size);
}

ctr_device_work *dc_all_reduce(ctr_device_comm *c, const void *send, void *recv, size_t count, int32_t dtype,
                               int32_t op, char *err, size_t err_size) {
  return reduction("all_reduce", c, send, recv, count, dtype, op, false, err, err_size);
}

ctr_device_work *dc_all_to_all_v(ctr_device_comm *c, const void *send, const size_t *send_counts,
                                 const size_t *send_displs, void *recv, const size_t *recv_counts,
                                 const size_t *recv_displs, size_t elem_size, char *err, size_t err_size) {
  size_t total = 0;
  for (int j = 0; j < c->nranks; ++j) total += send_counts[j] * elem_size;
  const auto *s = static_cast<const char *>(send);
  auto *r = static_cast<char *>(recv);
  // Zero counts are skipped on both sides alike: a member's receive count
  // from j is j's send count to it.
  return issue(c, describe("all_to_all_v", total, "bytes sent"), true, err, err_size, [&] {
    for (int j = 0; j < c->nranks; ++j) {
      if (send_counts[j])
        if (ncclResult_t e = N().send(s + send_displs[j] * elem_size, send_counts[j] * elem_size, ncclUint8, j,
                                      c->comm, c->stream);
            e != ncclSuccess && e != ncclInProgress)
          return e;
      if (recv_counts[j])
        if (ncclResult_t e = N().recv(r + recv_displs[j] * elem_size, recv_counts[j] * elem_size, ncclUint8, j,
                                      c->comm, c->stream);
            e != ncclSuccess && e != ncclInProgress)
          return e;
    }
    return ncclSuccess;
  });
}

ctr_device_work *dc_broadcast(ctr_device_comm *c, void *buf, size_t bytes, int root, char *err, size_t err_size) {
  if (root < 0 || root >= c->nranks) {
    say(err, err_size, "broadcast: root %d is not a member (of %d)", root, c->nranks);
    return nullptr;
  }
  return issue(c, describe("broadcast", bytes, "bytes"), false, err, err_size,
               [&] { return N().broadcast(buf, buf, bytes, ncclUint8, root, c->comm, c->stream); });
}

ctr_device_work *dc_batch(ctr_device_comm *c, const ctr_device_coll *colls, size_t n, int32_t dtype, int32_t op,
                          char *err, size_t err_size) {
  ncclDataType_t t;
  ncclRedOp_t o;
  size_t size = 0;
  if (!to_nccl_type(dtype, &t, &size) || !to_nccl_op(op, &o)) {
    say(err, err_size, "batch: dtype %d or reduction %d is not supported over NCCL", dtype, op);
    return nullptr;
  }
  for (size_t i = 0; i < n; ++i)
    if (colls[i].kind < CTR_DEVICE_COLL_ALL_GATHER || colls[i].kind > CTR_DEVICE_COLL_ALL_REDUCE) {
      say(err, err_size, "batch: entry %zu has unknown kind %d", i, colls[i].kind);
      return nullptr;
    }
  return issue(c, describe("batch", n, "collectives"), true, err, err_size, [&] {
    for (size_t i = 0; i < n; ++i) {
      const ctr_device_coll &d = colls[i];
      ncclResult_t e = ncclSuccess;
      switch (d.kind) {
        case CTR_DEVICE_COLL_ALL_GATHER:
          e = N().all_gather(d.send, d.recv, d.count, ncclUint8, c->comm, c->stream);
          break;
        case CTR_DEVICE_COLL_REDUCE_SCATTER:
          e = N().reduce_scatter(d.send, d.recv, d.count, t, o, c->comm, c->stream);
          break;
        default: e = N().all_reduce(d.send, d.recv, d.count, t, o, c->comm, c->stream); break;
      }
      if (e != ncclSuccess && e != ncclInProgress) return e;
    }
    return ncclSuccess;
  });
}

int dc_test(ctr_device_comm *c, ctr_device_work *w) {
  (void)c;
  return w && cudaEventQuery(w->done) == cudaSuccess ? 1 : 0;
}

int dc_wait(ctr_device_comm *c, ctr_device_work *w, int64_t timeout_ms, char *err, size_t err_size) try {
  if (!w) return CTR_DEVICE_COMM_OK;
  const int64_t limit = timeout_ms < 0 ? c->timeout_ms : timeout_ms;
  const auto deadline = Clock::now() + std::chrono::milliseconds(limit);
  int result = CTR_DEVICE_COMM_OK;
  Backoff b;
  for (;;) {
    const cudaError_t q = cudaEventQuery(w->done);
    if (q == cudaSuccess) break;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      std::string msg;
      if (q != cudaErrorNotReady) {
        // A fault on the device, not of NCCL: the backend's sticky error too.
        ctr::cuda::note_error("cudaEventQuery (the collective's completion)", __FILE__, __LINE__,
                              cudaGetErrorString(q));
        msg = w->what + ": CUDA error " + cudaGetErrorString(q);
        result = CTR_DEVICE_COMM_FAILED;
      } else if (!c->comm) {
        msg = w->what + ": the NCCL communicator was aborted (" + c->broken + ")";
        result = CTR_DEVICE_COMM_FAILED;
      } else {
        ncclResult_t state = ncclSuccess;
        const ncclResult_t r = N().get_async_error(c->comm, &state);
        if (r != ncclSuccess) state = r;
        if (state != ncclSuccess && state != ncclInProgress) {
          msg = w->what + ": NCCL error: " + nccl_error(state, c->comm) +
                " (a peer failed or left); the communicator was aborted";
          result = CTR_DEVICE_COMM_FAILED;
        } else if (Clock::now() > deadline) {
          msg = w->what + ": not complete after " + std::to_string(limit) +
                " ms (a peer is missing or hung); the communicator was aborted";
          result = CTR_DEVICE_COMM_TIMEOUT;
        }
      }
      if (result != CTR_DEVICE_COMM_OK) {
        abort_locked(c, msg);
        say(err, err_size, "%s", msg.c_str());
        break;
      }
    }
    b.pause();
  }
  {
    std::lock_guard<std::mutex> lock(c->mu);
    // An event still pending on an aborted communicator is not reused.
    if (result == CTR_DEVICE_COMM_OK) c->pool.push_back(w->done);
    else cudaEventDestroy(w->done);
  }
  delete w;
  return result;
} catch (const std::exception &e) {
  say(err, err_size, "wait: %s", e.what());
  return CTR_DEVICE_COMM_FAILED;
}

void dc_destroy(ctr_device_comm *c) {
  if (!c) return;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    cudaSetDevice(c->device);
    if (c->comm) {
      // Finalize flushes outstanding work; a communicator that does not finish
      // within its timeout is aborted instead.
      ncclResult_t r = N().finalize(c->comm);
      const auto deadline = Clock::now() + std::chrono::milliseconds(c->timeout_ms);
      Backoff b;
      while (r == ncclInProgress && Clock::now() < deadline) {
        ncclResult_t state = ncclSuccess;
        const ncclResult_t q = N().get_async_error(c->comm, &state);
        r = q != ncclSuccess ? q : state;
        if (r == ncclInProgress) b.pause();
      }
      if (r == ncclSuccess) N().destroy(c->comm);
      else N().abort(c->comm);
      c->comm = nullptr;
    }
    for (cudaEvent_t e : c->pool) cudaEventDestroy(e);
    c->pool.clear();
    if (c->order) cudaEventDestroy(c->order);
  }
  delete c;
}

const ctr_device_comm_iface kDeviceCommIface = {
    sizeof(ctr_device_comm_iface),
    CTR_DEVICE_COMM_ABI,
    "nccl",
    dc_unique_id,
    dc_comm_create,
    dc_all_gather,
    dc_reduce_scatter,
    dc_all_reduce,
    dc_all_to_all_v,
    dc_broadcast,
    dc_batch,
    dc_test,
    dc_wait,
    dc_destroy,
};

}  // namespace
}  // namespace ctr::cuda

extern "C" __attribute__((visibility("default"))) const ctr_device_comm_iface *ctr_device_comm_plugin_init(
    uint32_t abi, char *err, size_t err_size) {
  using namespace ctr::cuda;
  try {
    if (abi != CTR_DEVICE_COMM_ABI) {
      say(err, err_size, "libctr-cuda.so speaks device communicator ABI %d, the caller %u", CTR_DEVICE_COMM_ABI,
          abi);
      return nullptr;
    }
    if (const std::string why = load_nccl(); !why.empty()) {
      say(err, err_size, "%s", why.c_str());
      return nullptr;
    }
    return &kDeviceCommIface;
  } catch (...) {
    say(err, err_size, "transport 'nccl': out of memory while loading NCCL");
    return nullptr;
  }
}
