// The structs behind the public opaque handles.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "graph/ir.h"

struct ctr_mesh {
  int rank = 0;
  int world = 1;
  std::vector<std::pair<std::string, int>> axes;  // in mesh order, product == world
  std::string device = "cpu";
  int64_t timeout_ms = 60000;

  // Multi-rank only: the rendezvous store, the world communicator and one
  // communicator per mesh axis (ranks that differ only in that axis's index).
  std::unique_ptr<ctr::Store> store;
  ctr::Comm world_comm;
  std::map<std::string, ctr::Comm> axis_comm;

  int axis_size(const std::string &name) const {
    for (const auto &a : axes)
      if (a.first == name) return a.second;
    return 1;
  }
  // This rank's index along the named axis (the last axis varies fastest).
  int axis_index(const std::string &name) const {
    int stride = 1;
    for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
      if (it->first == name) return (rank / stride) % it->second;
      stride *= it->second;
    }
    return 0;
  }
  // Global ranks of this rank's group along the named axis, in axis order.
  std::vector<int> axis_group(const std::string &name) const {
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
  ~ctr_mesh() {
    // Destructors are noexcept: a failure while tearing a communicator down
    // (a peer already gone) must not end the host process.
    auto destroy = [](ctr::Comm &c) {
      if (!c) return;
      try {
        c.iface->destroy(c.ctx);
      } catch (...) {
      }
    };
    for (auto &kv : axis_comm) destroy(kv.second);
    destroy(world_comm);
  }
};

struct ctr_graph {
  ctr::Graph graph;  // verified, nodes in topological order
  std::vector<int> inputs;
  std::vector<int> params;
};

namespace ctr {
class Step;
namespace data {
class Loader;
}  // namespace data
}  // namespace ctr

struct ctr_loader {
  std::unique_ptr<ctr::data::Loader> loader;  // owns its token sources
  int64_t seq = 0;
  ~ctr_loader();
};

struct ctr_step {
  std::unique_ptr<ctr::Step> impl;
  // Handed out by ctr_step_save_checkpoint and ctr_step_resume; valid until the
  // step's next call.
  std::string checkpoint_path, checkpoint_skipped;
};
