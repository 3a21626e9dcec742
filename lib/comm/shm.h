// Collectives over a shared-memory segment, for a communicator whose members all
// run on one host (lib/comm/shm.cc). The UCX communicator attaches one to each
// such communicator when it is created and routes its collectives through it;
// the UCX rings remain for groups that span hosts.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace ctr {

// One collective for the shared-memory engine. The caller's buffers must stay
// alive until done() has run.
struct ShmColl {
  enum Kind : uint8_t { kBatch, kAllToAllV, kBroadcast, kBarrier };
  Kind kind = kBatch;
  std::string label;  // "all_reduce (world, 2 ranks)": the start of every message
  // kBatch: all_gather, reduce_scatter and all_reduce are batches of one entry.
  std::vector<CollDesc> descs;
  ctr_dtype dtype = CTR_DTYPE_F32;
  ReduceOp op = ReduceOp::Sum;
  // kAllToAllV: counts and displacements in elements of elem_size, per member.
  const void *send = nullptr;
  void *recv = nullptr;
  std::vector<size_t> send_counts, send_displs, recv_counts, recv_displs;
  size_t elem_size = 0;
  // kBroadcast: buf[bytes] of member root (a group index).
  void *buf = nullptr;
  size_t bytes = 0;
  int root = 0;
  // Runs once, on the thread that ran the collective, when it has completed or
  // failed; the engine touches none of its buffers afterwards.
  std::function<void(ctr_status code, const std::string &error)> done;
  // How it moved its bytes, set before done() runs: "shm" (through the
  // segment) or "shm direct" (some part read in place from shared buffers).
  const char *path = "shm";
  // A waiter whose deadline passed stores its timeout (ms) here and calls
  // ShmComm::wake(): the engine fails the collective naming the peer it waits for.
  std::atomic<int64_t> abandoned_ms{-1};
};

// What the engine needs from the communicator that sets it up.
struct ShmSetup {
  std::vector<int> members;  // global ranks, in group order
  int me = 0;
  // All-gathers `bytes` from every member over the group's other transport
  // (blocking; throws on failure). Used twice while attaching.
  std::function<void(const void *mine, void *all, size_t bytes)> all_gather;
  // Why the process of global rank r failed, or "" while it lives. Thread-safe.
  std::function<std::string(int rank)> peer_failed;
  // A collective failed; silent_rank is the global rank of a peer that stopped
  // answering (timed out waiting for it), or -1.
  std::function<void(int silent_rank)> on_failure;
};

class ShmComm {
 public:
  virtual ~ShmComm() = default;
  // Queues a collective; collectives run in issue order, on the thread that
  // waits for them (help) or else on the engine's own thread.
  virtual void issue(std::shared_ptr<ShmColl> c) = 0;
  // The caller is about to wait for c: unless another thread is running this
  // communicator's collectives, or c is large enough to be left to the engine
  // thread, runs them on the calling thread, in issue order, up to and
  // including c (which then has completed or failed). A thread that waits
  // right after issuing (the executor's comm stream) so moves the bytes
  // itself, with no handoff to the engine thread and back. Fails what it
  // runs, naming the peer it waits for, once deadline passes.
  virtual void help(const ShmColl &c, std::chrono::steady_clock::time_point deadline,
                    int64_t timeout_ms) = 0;
  // Makes the engine look at abandoned collectives now.
  virtual void wake() = 0;
  // Bytes this member sends for c (for the flight recorder).
  virtual size_t bytes_out(const ShmColl &c) const = 0;

};

// Maps one segment shared by the group's members. Every member must call it at
// the same point (it all-gathers twice); it returns null on every member when any
// member cannot map the segment or has CTR_SHM=0, so that all fall back together.
std::unique_ptr<ShmComm> shm_attach(const ShmSetup &setup);

}  // namespace ctr
