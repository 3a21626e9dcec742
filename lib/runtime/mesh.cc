// The mesh: axis arithmetic and the communicators of every axis (see mesh.h).

#include "runtime/mesh.h"

#include <algorithm>
#include <cstring>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {

Mesh::~Mesh() {
  // Destructors are noexcept: a failure while tearing a communicator down (a
  // peer already gone) must not end the host process.
  auto destroy = [](Comm &c) {
    if (!c) return;
    try {
      c.iface->destroy(c.ctx);
    } catch (...) {
    }
    c = Comm{};
  };
  if (failed_ && store) store->abandon();
  for (auto &kv : axis_comm) destroy(kv.second);
  destroy(world_comm);
}

int Mesh::axis_size(const std::string &name) const {
  for (const auto &a : axes)
    if (a.first == name) return a.second;
  return 1;
}

int Mesh::axis_index(const std::string &name) const {
  int stride = 1;
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
    if (it->first == name) return (rank / stride) % it->second;
    stride *= it->second;
  }
  return 0;
}

std::vector<int> Mesh::axis_group(const std::string &name) const {
  int stride = 1, size = 1;
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
    if (it->first == name) {
      size = it->second;
      break;
    }
    stride *= it->second;
  }
  int base = rank - axis_index(name) * stride;
  std::vector<int> out;
  for (int i = 0; i < size; ++i) out.push_back(base + i * stride);
  return out;
}

const Comm &Mesh::comm(const std::string &axis) const {
  auto it = axis_comm.find(axis);
  CTR_REQUIRE(it != axis_comm.end() && it->second, CTR_STATUS_INVALID_STATE,
              "the mesh has no communicator for axis '%s'", axis.c_str());
  return it->second;
}

MeshPlacement Mesh::placement() const {
  MeshPlacement p;
  for (const auto &a : axes) p.axes.push_back({a.first, a.second, axis_index(a.first)});
  return p;
}

bool Mesh::any_rank(bool flag) const {
  if (world <= 1) return flag;
  int32_t v = flag ? 1 : 0;
  comm_wait(world_comm, world_comm.iface->all_reduce(world_comm.ctx, &v, &v, 1, CTR_DTYPE_I32, ReduceOp::Max),
            timeout_ms);
  return v != 0;
}

std::string Mesh::first_error(const std::string &err) const {
  if (world <= 1) return err;
  int32_t who = err.empty() ? world : rank;
  comm_wait(world_comm,
            world_comm.iface->all_reduce(world_comm.ctx, &who, &who, 1, CTR_DTYPE_I32, ReduceOp::Min),
            timeout_ms);
  if (who >= world) return "";
  // The message, cut to a bound every rank knows, from the rank that failed.
  constexpr size_t kMaxMessage = 4096;
  std::vector<char> buf(4 + kMaxMessage, '\0');
  if (who == rank) {
    const auto n = static_cast<uint32_t>(std::min(err.size(), kMaxMessage));
    std::memcpy(buf.data(), &n, 4);
    std::memcpy(buf.data() + 4, err.data(), n);
  }
  comm_wait(world_comm, world_comm.iface->broadcast(world_comm.ctx, buf.data(), buf.size(), who),
            timeout_ms);
  uint32_t n = 0;
  std::memcpy(&n, buf.data(), 4);
  std::string msg(buf.data() + 4, std::min<size_t>(n, kMaxMessage));
  return who == rank ? msg : strformat("rank %d: %s", who, msg.c_str());
}

void Mesh::connect(const RendezvousConfig &rc) {
  store = store_join(rc);
  world_comm = comm_create(transport, *store, rank, world, timeout_ms);
  for (const auto &a : axes) axis_comm[a.first] = world_comm.iface->split(world_comm.ctx, axis_group(a.first));
}

}  // namespace ctr
