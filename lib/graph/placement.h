// Placements: how a tensor is laid out over the device mesh, as data.
//
// For every mesh axis a tensor is Replicate (the axis is not named), Shard(dim)
// (each rank along the axis holds one block of dim) or Partial (each rank holds
// a summand of the whole). A tensor's `shape` is always its local block; a
// sharded tensor also records the whole tensor's shape. Shards are padded to
// equal sizes (the block is ceil(global / ranks) long), so collectives move equal
// blocks and sizes need not divide; elements past the global extent are padding,
// start at zero and stay zero. When several axes shard one dim, they nest in
// list order: the first named axis is the outermost (its index picks the larger
// block), as when the fsdp ranks of one ep group split that group's experts;
// each level pads its own blocks, so padding sits at the end of every block of
// a level, inside the whole extent when an outer block is split unevenly.
//
// Every view of a tensor that crosses a rank boundary — the gradient norm, the
// writer of each checkpoint row, get/set of parameters, safetensors — is derived
// from these functions, never from the names of passes or axes.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ctr {

struct Tensor;

// Where this rank sits on the mesh: every axis in mesh order with its size and
// this rank's index along it.
struct MeshPlacement {
  struct Axis {
    std::string name;
    int64_t size = 1, index = 0;
  };
  std::vector<Axis> axes;
  int64_t size(const std::string &axis) const;
  int64_t index(const std::string &axis) const;
};

struct AxisPlacement {
  enum Kind : uint8_t { Shard = 1, Partial = 2 };
  std::string axis;
  Kind kind = Shard;
  int dim = 0;  // Shard: the dimension split over the axis

  static AxisPlacement shard(std::string axis, int dim) { return {std::move(axis), Shard, dim}; }
  static AxisPlacement partial(std::string axis) { return {std::move(axis), Partial, 0}; }
  bool operator==(const AxisPlacement &o) const { return axis == o.axis && kind == o.kind && dim == o.dim; }
};

struct Placement {
  std::vector<AxisPlacement> axes;    // the axes that do not replicate the tensor
  std::vector<int64_t> global_shape;  // the whole tensor's shape when some axis shards it

  bool sharded() const;
  // The entry for an axis, or null when the axis replicates the tensor.
  const AxisPlacement *on(const std::string &axis) const;
  // The axes that shard the tensor, in list order (outermost first).
  std::vector<std::string> shard_axes() const;
  // Adds Shard(dim) on an axis inside the existing ones; global is the whole
  // tensor's shape, needed on the first shard.
  void add_shard(const std::string &axis, int dim, const std::vector<int64_t> &global);
};

// This rank's block of a tensor within the whole: per dim, the first global
// index it holds and how many of its elements lie inside the whole (the rest
// of the local extent is padding).
struct LocalBlock {
  std::vector<int64_t> first, valid;
};
LocalBlock local_block(const Tensor &t, const MeshPlacement &mesh);

// The valid part of a block as contiguous runs along the last dim: calls
// run(local_offset, global_offset, count) in element units, local offsets into
// the padded local block (shape local), global offsets into the whole tensor.
void for_each_run(const std::vector<int64_t> &local, const std::vector<int64_t> &global, const LocalBlock &b,
                  const std::function<void(int64_t, int64_t, int64_t)> &run);

// The whole tensor's shape (the local shape when nothing shards it).
std::vector<int64_t> global_shape(const Tensor &t);
int64_t global_numel(const Tensor &t);

// Whether this rank holds the first replica of its block: index 0 along every
// mesh axis of size > 1 that replicates the tensor. Exactly one rank per
// distinct block answers true (the one that writes it to a checkpoint).
bool first_replica(const Tensor &t, const MeshPlacement &mesh);

// "fsdp:S(0), ep:S(0)" ("replicated" when no axis is named).
std::string placement_string(const Placement &p);

}  // namespace ctr
