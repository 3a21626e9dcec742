// The communicator factory: a transport name becomes a world communicator.
//
// "ucx" moves host memory (shared memory on one machine, TCP or RDMA across
// machines). A device backend's own transport (NCCL) registers here under its
// name; a mesh picks one with its "transport" option.

#include "comm/comm.h"
#include "core/status.h"

namespace ctr {

namespace {
thread_local const std::string *t_collective_name = nullptr;
const std::string kNoName;
}  // namespace

CollectiveName::CollectiveName(std::string name) : name_(std::move(name)), outer_(t_collective_name) {
  t_collective_name = &name_;
}
CollectiveName::~CollectiveName() { t_collective_name = outer_; }
const std::string &CollectiveName::current() {
  return t_collective_name ? *t_collective_name : kNoName;
}

std::vector<std::string> comm_transports() {
  std::vector<std::string> out;
  if (ucx_available()) out.push_back("ucx");
  return out;
}

Comm comm_create(const std::string &transport, Store &store, int rank, int world, int64_t timeout_ms) {
  if (transport == "ucx") {
    CTR_REQUIRE(ucx_available(), CTR_STATUS_UNSUPPORTED,
                "mesh: %d ranks need the UCX communicator, and this libctr was built without UCX "
                "(install libucx-dev and rebuild with -Ducx=enabled)",
                world);
    return ucx_comm_create(store, rank, world, timeout_ms);
  }
  std::string list;
  for (const auto &t : comm_transports()) list += (list.empty() ? "" : ", ") + t;
  fail(CTR_STATUS_UNSUPPORTED, strformat("mesh: transport '%s' is not available in this build (available: %s)",
                                         transport.c_str(), list.empty() ? "none" : list.c_str()));
}

}  // namespace ctr
