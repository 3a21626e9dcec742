// The checkpointer: saves a step's persistent state into a checkpoint directory
// and loads one back, on any mesh (see checkpoint.cc for the format).
//
// It sees a step only through CheckpointState: the rows of every parameter
// (and of its two AdamW moments) that this rank holds, backend copies to move
// them, and the step count. So it knows nothing of the step's graph, plan or
// executor, and the step knows nothing of files.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ctr {

class Mesh;
struct PendingSave;
namespace data {
class Loader;
}

// One parameter as this rank holds it: a block of the full tensor (a box: per
// dim, elements [first, first + valid) of the whole), stored in each buffer as
// a row-major array of local_shape whose elements past `valid` are padding.
// A scalar is one element: local_shape, first and valid have one dim.
struct ShardView {
  std::string name;
  std::vector<int64_t> full_shape;
  int64_t n = 0;  // floats held locally, padding included
  std::vector<int64_t> local_shape, first, valid;
  void *buffers[3] = {nullptr, nullptr, nullptr};  // param, adam_m, adam_v (device)
  bool write = true;  // this rank saves these rows (false: a replica elsewhere does)
};

class CheckpointState {
 public:
  virtual ~CheckpointState() = default;
  virtual std::vector<ShardView> checkpoint_shards() const = 0;
  // Device <-> host through the backend (the host never reads device memory).
  virtual void checkpoint_read(void *host, const void *device, size_t bytes) const = 0;
  virtual void checkpoint_write(void *device, const void *host, size_t bytes) = 0;
  virtual int64_t checkpoint_step() const = 0;
  virtual void checkpoint_set_step(int64_t step) = 0;
};

// What goes into the metadata besides the tensors.
struct CheckpointInfo {
  std::string graph_name;
  std::string options_json;  // the step's options, for the record
  data::Loader *loader = nullptr;  // its position is saved and restored
  int64_t loader_seq = 0;
  bool writer = true;        // this rank writes a shard file (some of its rows are no replica's)
  // Every parameter of the graph with its full shape, when this rank's shards
  // do not cover them all (pipeline stages); empty: the shards name them.
  std::vector<std::pair<std::string, std::vector<int64_t>>> graph_params;
};

class Checkpointer {
 public:
  // publish_lag: ctr_step_run calls after which a background save is published.
  Checkpointer(const Mesh &mesh, int64_t publish_lag);
  ~Checkpointer();  // abandons a save in flight (the previous checkpoint stays)
  Checkpointer(const Checkpointer &) = delete;
  Checkpointer &operator=(const Checkpointer &) = delete;

  // Snapshot now; write in the background when async, else write and publish.
  // on_publish runs on rank 0 once the directory is in place. Collective.
  void save(const CheckpointState &s, const CheckpointInfo &info, const std::string &dir, bool async,
            std::function<void()> on_publish);
  // Waits for a background save and publishes it (collective; no-op without one).
  void finish();
  // One training step passed: publishes a background save once its lag is over.
  void tick();
  void abandon();
  // Reads, verifies and stages everything, then commits only when every rank
  // succeeded: a failed load changes nothing. Collective.
  void load(CheckpointState &s, const CheckpointInfo &info, const std::string &dir);

 private:
  const Mesh &mesh_;
  int64_t lag_;
  std::unique_ptr<PendingSave> pending_;
};

}  // namespace ctr
