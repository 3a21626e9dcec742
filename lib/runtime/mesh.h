// Who and where a step runs: this rank, the mesh axes, the device (each step
// creates its own backend instance for it) and one communicator per axis.
//
// Axes are generic: any axis the mesh option names (dp, fsdp, ep, tp, ...) gets a
// communicator over the ranks that differ only in that axis's index, so a pass
// that places work on a new axis finds its communicator here without a change to
// the mesh. The last axis varies fastest across ranks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/device_comm.h"

namespace ctr {

struct MeshPlacement;

class Mesh {
 public:
  Mesh() = default;
  ~Mesh();
  Mesh(const Mesh &) = delete;
  Mesh &operator=(const Mesh &) = delete;

  int rank = 0;
  int world = 1;
  std::vector<std::pair<std::string, int>> axes;  // in mesh order, product == world
  std::string device = "cpu";
  std::string transport = "ucx";
  int64_t timeout_ms = 60000;

  // Multi-rank only: the rendezvous store, the world communicator and one
  // communicator per axis.
  std::unique_ptr<Store> store;
  Comm world_comm;
  std::map<std::string, Comm> axis_comm;
  // Host collectives (ctr_mesh_all_reduce, ...) from several threads run one at a time.
  mutable std::mutex host_collective_mu;

  int axis_size(const std::string &name) const;
  // This rank's index along the named axis, and rank r's.
  int axis_index(const std::string &name) const;
  int rank_index(int r, const std::string &name) const;
  // This rank's index over every axis but tp and cp (the ranks that read
  // distinct data: a tp group shares its rows, a cp group its sequences).
  int data_rank() const;
  // How many distinct data shares the mesh has: world / (tp * cp).
  int data_size() const;
  // Global ranks of this rank's group along the named axis, in axis order.
  std::vector<int> axis_group(const std::string &name) const;
  // The communicator of an axis ("world": every rank; "stage", with pp > 1 and
  // other axes beside it: the ranks of this rank's pipeline stage); fails naming the axis when the
  // mesh has none.
  const Comm &comm(const std::string &axis) const;
  MeshPlacement placement() const;
  // Agreement across the world: true on every rank if any rank passes true
  // (collective; the flag itself on one rank).
  bool any_rank(bool flag) const;
  // Agreement on failure: every rank passes its error ("" for none) and gets the
  // lowest failing rank's message, prefixed "rank R: " where R is another rank,
  // or "" when no rank failed. Collective. Lets every rank report what went
  // wrong rather than that something did elsewhere.
  std::string first_error(const std::string &err) const;

  // A step on this mesh failed for a reason of the job (a peer died or stopped
  // answering, status COMM_ERROR or TIMEOUT): the mesh's teardown then does not
  // wait for peers (rank 0's store stops serving at once).
  void note_failure(ctr_status code) const {
    if (code == CTR_STATUS_COMM_ERROR || code == CTR_STATUS_TIMEOUT) failed_ = true;
  }

  // The job's failure as rank 0 knows it, learnt by this rank's heartbeat
  // thread while the caller may be blocked in a step (in the manner of
  // ncclCommGetAsyncError): CTR_STATUS_OK and "" while there is none.
  // Thread-safe.
  ctr_status async_error(std::string *message) const;

  // Forensics of a failure this rank saw (a collective that failed or timed
  // out): reports it to rank 0, publishes this rank's flight recorder, and
  // returns what the ranks' recorders say together: which rank is behind and
  // the collective it never issued or never finished, and which ranks sent no
  // record. Waits a bounded time for the others' records. "" on one rank.
  std::string forensics(const std::string &failure) const;

  // Connects a multi-rank mesh: joins the rendezvous, creates the world
  // communicator with the transport's factory and splits one per axis. With
  // transport "nccl" these are UCX communicators (host_transport).
  void connect(const RendezvousConfig &rc);

  // Transport "nccl" on several ranks: one device communicator per axis from
  // the step's backend (comm/device_comm.h). Collective: every rank's step
  // calls it in the same order. Fails on every rank with
  // CTR_STATUS_UNSUPPORTED when any rank's backend has no device communicators
  // or cannot load NCCL, naming why. Null for other transports and one rank.
  std::unique_ptr<CommSet> device_comms(const Backend &be) const;

 private:
  void heartbeat_loop();
  void publish_flight() const;
  std::string flight_path() const;
  void write_flight(const std::string &record) const;

  mutable std::atomic<bool> failed_{false};
  mutable uint64_t device_generation_ = 0;  // device_comms calls so far (store keys)
  // The heartbeat thread (multi-rank meshes) and what it learnt.
  std::thread heartbeat_;
  mutable std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  bool hb_stop_ = false;
  std::string async_error_;
  mutable bool published_ = false;
};

}  // namespace ctr
