// The communicator factory: a transport name becomes a world communicator.
//
// "ucx" moves host memory (shared memory on one machine, TCP or RDMA across
// machines). "nccl" moves device memory: its communicators come from the CUDA
// backend's plugin, one per mesh axis for each step (comm/device_comm.h), while
// the mesh itself keeps UCX communicators for host-side work.

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
  out.push_back("nccl");  // device memory; the CUDA backend's plugin provides it (device_comm.h)
  return out;
}

namespace {
[[noreturn]] void unknown_transport(const std::string &transport) {
  std::string list;
  for (const auto &t : comm_transports()) list += (list.empty() ? "" : ", ") + t;
  fail(CTR_STATUS_UNSUPPORTED, strformat("mesh: transport '%s' is not available in this build (available: %s)",
                                         transport.c_str(), list.empty() ? "none" : list.c_str()));
}
}  // namespace

void check_transport(const std::string &transport, const std::string &device) {
  if (transport == "nccl") {
    CTR_REQUIRE(device == "cuda", CTR_STATUS_INVALID_OPTION,
                "mesh: transport 'nccl' moves CUDA device memory and needs device 'cuda', not '%s'",
                device.c_str());
    return;
  }
  if (transport == "ucx") return;  // a single rank needs no communicator; connect checks the build
  unknown_transport(transport);
}

std::string host_transport(const std::string &transport) { return transport == "nccl" ? "ucx" : transport; }

Comm comm_create(const std::string &transport, Store &store, int rank, int world, int64_t timeout_ms) {
  if (transport == "ucx") {
    CTR_REQUIRE(ucx_available(), CTR_STATUS_UNSUPPORTED,
                "mesh: %d ranks need the UCX communicator, and this libctr was built without UCX "
                "(install libucx-dev and rebuild with -Ducx=enabled)",
                world);
    return ucx_comm_create(store, rank, world, timeout_ms);
  }
  unknown_transport(transport);
}

}  // namespace ctr
