// Device communicators: a backend plugin's ctr_device_comm_iface (plugin.h)
// as a CommIface named after its transport ("nccl"), so the executor runs
// collectives straight on device memory.
//
// The mesh's own communicators stay on a host transport (UCX): they carry the
// host-side work (failure agreement, checkpoints, gradient-norm scalars) and
// bootstrap these. A step creates one device communicator per mesh axis from
// its backend (Mesh::device_comms); member 0 of each group makes the unique id
// and passes it to the others through the rendezvous store, hex-encoded, under
// a key unique to the group and to that creation.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"

namespace ctr {

// The backend plugin's device communicator table for `transport`. Fails with
// CTR_STATUS_UNSUPPORTED naming why: the backend has none (the CPU backend, a
// plugin built without NCCL), or the plugin cannot load the library.
const ctr_device_comm_iface *device_comm_iface(const Backend &be, const std::string &transport);

// The communicator of one group: `members` are global ranks in group order,
// `global_rank` this process's (one of them); `key` names the group and this
// creation uniquely within the job (every member passes the same). Member 0
// makes the id and sets it in the store; the others wait for it at most
// timeout_ms, which is also the default deadline of every wait. Fails with
// CTR_STATUS_COMM_ERROR or CTR_STATUS_TIMEOUT naming the group.
Comm device_comm_create(const ctr_device_comm_iface *di, const Backend &be, Store &store, const std::string &key,
                        const std::vector<int> &members, int global_rank, int64_t timeout_ms);

// Communicators by axis name, destroyed with the set (never throws).
class CommSet {
 public:
  CommSet() = default;
  ~CommSet();
  CommSet(const CommSet &) = delete;
  CommSet &operator=(const CommSet &) = delete;
  void add(const std::string &axis, Comm c) { comms_[axis] = c; }
  // The communicator of an axis, or null.
  const Comm *find(const std::string &axis) const;
  bool empty() const { return comms_.empty(); }

 private:
  std::map<std::string, Comm> comms_;
};

}  // namespace ctr
