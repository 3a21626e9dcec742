// The communicator interface and the rendezvous that bootstraps it.
//
// A communicator is {iface, ctx}: a table of asynchronous collectives over a
// fixed, ordered group of ranks. Every collective returns a work handle at once;
// the caller keeps its buffers alive and later waits on the handle (the executor
// treats that as an event on the comm stream), so communication overlaps compute.
// Every rank of a group must issue the same collectives in the same order;
// point-to-point send/recv only pair the two members they name.
//
// Failures never hang: each wait has a deadline, and a timeout or a dead peer is
// a ctr::Error (CTR_STATUS_TIMEOUT / CTR_STATUS_COMM_ERROR) whose message names
// the collective, the group and the peer rank (as a global rank) at fault.
//
// Implementations: lib/comm/ucx.cc moves host memory over UCP (TCP across
// machines), and through a shared-memory segment (lib/comm/shm.cc) for a group
// whose members all run on one host; lib/comm/device_comm.cc wraps a backend
// plugin's device communicators (NCCL, device memory) in the same table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ctr/ctr.h"

namespace ctr {

enum class ReduceOp : uint8_t { Sum = 0, Avg = 1, Max = 2, Min = 3 };

// An in-flight collective. Owned by the communicator; released by wait().
struct CommWork;

struct Comm;

// One collective of a batch (CommIface::batch).
struct CollDesc {
  enum Kind : uint8_t { AllGather, ReduceScatter, AllReduce } kind = AllGather;
  const void *send = nullptr;
  void *recv = nullptr;
  // AllGather: bytes per member. ReduceScatter: elements of the result (send
  // holds size * count). AllReduce: elements.
  size_t count = 0;
};

struct CommIface {
  const char *name;

  // This rank's index within the group and the group's size.
  int (*rank)(void *ctx);
  int (*size)(void *ctx);
  // Global rank (in the world communicator) of group member i; for messages.
  int (*global_rank)(void *ctx, int i);

  // recv[size * bytes] receives every member's `bytes` from send, in rank order.
  CommWork *(*all_gather)(void *ctx, const void *send, void *recv, size_t bytes);
  // send holds size * count elements; this rank receives the reduction of block
  // `rank` into recv[count]. dtype: F32, F64, I32, I64, BF16 (combined in f32,
  // rounded once per pair). Avg of integers
  // truncates toward zero (C division).
  CommWork *(*reduce_scatter)(void *ctx, const void *send, void *recv, size_t count,
                              ctr_dtype dtype, ReduceOp op);
  // recv[count] = reduction of every member's send[count]; send == recv allowed.
  CommWork *(*all_reduce)(void *ctx, const void *send, void *recv, size_t count,
                          ctr_dtype dtype, ReduceOp op);
  // Personalised exchange: to member j goes send_counts[j] elements of elem_size
  // bytes from send + send_displs[j] elements; from member j arrive
  // recv_counts[j] elements at recv + recv_displs[j]. Zero counts are allowed;
  // send and recv must not overlap.
  CommWork *(*all_to_all_v)(void *ctx, const void *send, const size_t *send_counts,
                            const size_t *send_displs, void *recv, const size_t *recv_counts,
                            const size_t *recv_displs, size_t elem_size);
  // buf[bytes] of member `root` is copied to every member.
  CommWork *(*broadcast)(void *ctx, void *buf, size_t bytes, int root);
  CommWork *(*barrier)(void *ctx);
  // Several collectives as one: every rank passes the same list; they progress
  // together and complete as one work handle. Reductions use dtype and op.
  // Each buffer pair follows the rules of its kind; buffers of different
  // entries must not overlap. (A bucket of parameters gathered, or gradients
  // reduced, in one round, each into its own tensor: no copy into a flat buffer.)
  CommWork *(*batch)(void *ctx, const CollDesc *descs, size_t n, ctr_dtype dtype, ReduceOp op);

  // Blocks until the work is complete or timeout_ms passes (< 0: the
  // communicator's default timeout). Releases the handle either way; throws
  // ctr::Error on timeout or failure. After a timeout or a failed peer the
  // communicator is broken: destroy it, do not issue more work on it.
  void (*wait)(void *ctx, CommWork *work, int64_t timeout_ms);
  // True once the work is complete (it must still be waited on). Optional.
  bool (*test)(void *ctx, CommWork *work);

  // A communicator over the members listed (indices into this group, in the new
  // group's order; must include the caller). Blocks until every listed member
  // has called it with the same list; members not listed take no part. The new
  // communicator shares this one's transport.
  Comm (*split)(void *ctx, const std::vector<int> &members);
  void (*destroy)(void *ctx);
  // The flight recorder of the process's transport (shared by every
  // communicator split from the same world), as JSON: the last collectives
  // issued, oldest first, each {"comm", "seq", "what", "bytes", "path" ("ucx",
  // "shm" or "shm direct"), "issued_ms", "done_ms" (-1 while in flight),
  // "state" ("in flight", "done", "failed")}.
  // Optional (null when the transport keeps none).
  std::string (*flight)(void *ctx);

  // Point to point: bytes from buf go to member `peer`, which posts a recv of
  // the same size from this rank; recv takes them into buf. Between two
  // members, the k-th send one issues to the other matches the k-th recv the
  // other issues from it; members not named take no part, and unlike the
  // collectives the two sides need no common order with other traffic. The
  // wait of either side has the communicator's deadline and names the peer on
  // timeout or failure. A member may not address itself. A transport without
  // them (the device communicators today) fails with CTR_STATUS_UNSUPPORTED.
  CommWork *(*send)(void *ctx, const void *buf, size_t bytes, int peer);
  CommWork *(*recv)(void *ctx, void *buf, size_t bytes, int peer);
};

struct Comm {
  const CommIface *iface = nullptr;
  void *ctx = nullptr;
  explicit operator bool() const { return iface != nullptr; }
};

// Names the collectives this thread issues while it is in scope, for the
// flight recorder ("all_gather 'bucket.layers.0'"); nests.
class CollectiveName {
 public:
  explicit CollectiveName(std::string name);
  ~CollectiveName();
  CollectiveName(const CollectiveName &) = delete;
  CollectiveName &operator=(const CollectiveName &) = delete;
  // The innermost name in scope on this thread, or "".
  static const std::string &current();

 private:
  std::string name_;
  const std::string *outer_;
};

// Convenience: issue and wait.
inline void comm_wait(const Comm &c, CommWork *w, int64_t timeout_ms = -1) {
  c.iface->wait(c.ctx, w, timeout_ms);
}

// ---------------------------------------------------------------------------
// Rendezvous: a small TCP key-value store served by rank 0.

struct RendezvousConfig {
  int rank = 0;
  int world = 1;
  std::string addr = "127.0.0.1";  // rank 0's address
  int port = 29500;
  std::string token;               // CTR_JOB_TOKEN; peers with another token are refused
  int64_t timeout_ms = 60000;      // join and default get timeout
  // Without a token a job may only use a loopback address, where only processes
  // of the same user are let in; this allows a tokenless job on any address
  // (anyone who reaches it can join: for trusted, isolated networks only).
  bool allow_no_token = false;
};

class Store {
 public:
  virtual ~Store() = default;
  // Stores value under key (overwrites).
  virtual void set(const std::string &key, const std::string &value) = 0;
  // Waits until key exists, then returns its value. Throws CTR_STATUS_TIMEOUT
  // naming the key after timeout_ms (< 0: the config's timeout).
  virtual std::string get(const std::string &key, int64_t timeout_ms = -1) = 0;
  // Atomically adds delta to the integer at key (missing = 0); returns the result.
  virtual int64_t add(const std::string &key, int64_t delta) = 0;
  // All ranks of the world meet here; throws naming the ranks that did not arrive.
  virtual void barrier(const std::string &name, int64_t timeout_ms = -1) = 0;
  // The job token every member proved it holds (empty for a tokenless job):
  // the key for tagging what a rank publishes through the store.
  virtual const std::string &job_token() const = 0;
  // The job has failed: rank 0 stops serving at once instead of waiting for the
  // other ranks to leave (some may be stopped or hung). No-op elsewhere.
  virtual void abandon() = 0;
  // Liveness: tells rank 0 this rank is alive and returns the job's failure as
  // rank 0 knows it ("" while there is none). Once a rank has sent one, rank 0
  // declares it failed when it sends none for the job timeout (a stopped, hung
  // or cut-off process). Cheap; never waits on other ranks.
  virtual std::string heartbeat() = 0;
  // Records a failure this rank saw (the first one reported is the job's).
  virtual void report_failure(const std::string &message) = 0;
};

// Joins the job: rank 0 serves the store on exactly cfg.addr and every rank
// connects to it; rank 0 and each rank prove to each other that they hold the
// job token (see auth.h). Returns once all `world` ranks have joined; throws
// CTR_STATUS_TIMEOUT naming the ranks still missing after timeout_ms,
// CTR_STATUS_COMM_ERROR when the server refuses this rank (wrong token,
// duplicate rank), cannot be reached or is not this job's, and
// CTR_STATUS_INVALID_OPTION for a tokenless job on a non-loopback address.
std::unique_ptr<Store> store_join(const RendezvousConfig &cfg);

// Whether this build has the UCX communicator (libucx at build time).
bool ucx_available();

// The communicator factory: the world communicator of `transport` ("ucx"), with
// addresses exchanged through the store. Fails with CTR_STATUS_UNSUPPORTED
// naming a transport this build lacks.
Comm comm_create(const std::string &transport, Store &store, int rank, int world, int64_t timeout_ms);

// Transports this build can create ("nccl" where a device backend provides it).
std::vector<std::string> comm_transports();

// Checks a mesh's transport against its device: "nccl" needs device "cuda"
// (CTR_STATUS_INVALID_OPTION naming both), a name this build lacks fails with
// CTR_STATUS_UNSUPPORTED listing the available ones.
void check_transport(const std::string &transport, const std::string &device);

// The host transport of a mesh whose option is `transport`: device transports
// ("nccl") keep UCX for the mesh's own communicators.
std::string host_transport(const std::string &transport);

// The world communicator over UCX; addresses are exchanged through the store.
// timeout_ms is the default deadline of every wait.
Comm ucx_comm_create(Store &store, int rank, int world, int64_t timeout_ms);

}  // namespace ctr
