#include "graph/placement.h"

#include <algorithm>

#include "core/status.h"
#include "graph/ir.h"

namespace ctr {

int64_t MeshPlacement::size(const std::string &axis) const {
  for (const Axis &a : axes)
    if (a.name == axis) return a.size;
  return 1;
}

int64_t MeshPlacement::index(const std::string &axis) const {
  for (const Axis &a : axes)
    if (a.name == axis) return a.index;
  return 0;
}

bool Placement::sharded() const {
  for (const AxisPlacement &a : axes)
    if (a.kind == AxisPlacement::Shard) return true;
  return false;
}

const AxisPlacement *Placement::on(const std::string &axis) const {
  for (const AxisPlacement &a : axes)
    if (a.axis == axis) return &a;
  return nullptr;
}

std::vector<std::string> Placement::shard_axes() const {
  std::vector<std::string> out;
  for (const AxisPlacement &a : axes)
    if (a.kind == AxisPlacement::Shard) out.push_back(a.axis);
  return out;
}

void Placement::add_shard(const std::string &axis, int dim, const std::vector<int64_t> &global) {
  CTR_CHECK(on(axis) == nullptr);
  if (!sharded()) global_shape = global;
  CTR_CHECK(dim >= 0 && static_cast<size_t>(dim) < global_shape.size());
  axes.push_back(AxisPlacement::shard(axis, dim));
}

std::vector<int64_t> global_shape(const Tensor &t) {
  return t.placement.sharded() ? t.placement.global_shape : t.shape;
}

int64_t global_numel(const Tensor &t) {
  int64_t n = 1;
  for (int64_t d : global_shape(t)) n *= d;
  return n;
}

LocalBlock local_block(const Tensor &t, const MeshPlacement &mesh) {
  LocalBlock b;
  const std::vector<int64_t> whole = global_shape(t);
  b.first.assign(t.shape.size(), 0);
  b.valid = t.shape;
  for (size_t d = 0; d < t.shape.size(); ++d) {
    // Level by level, outermost axis first: each level splits its parent's
    // block (extent, of which `valid` are real) into equal padded chunks.
    int64_t extent = whole[d], valid = whole[d], first = 0;
    for (const AxisPlacement &a : t.placement.axes) {
      if (a.kind != AxisPlacement::Shard || static_cast<size_t>(a.dim) != d) continue;
      const int64_t n = mesh.size(a.axis), chunk = (extent + n - 1) / n, skip = mesh.index(a.axis) * chunk;
      first += skip;
      valid = std::max<int64_t>(0, std::min(chunk, valid - skip));
      extent = chunk;
    }
    b.first[d] = first;
    b.valid[d] = std::min(valid, t.shape[d]);
  }
  return b;
}

void for_each_run(const std::vector<int64_t> &local, const std::vector<int64_t> &global, const LocalBlock &b,
                  const std::function<void(int64_t, int64_t, int64_t)> &run) {
  const size_t nd = local.size();
  if (nd == 0) {
    run(0, 0, 1);
    return;
  }
  for (size_t d = 0; d < nd; ++d)
    if (b.valid[d] <= 0) return;
  // Row-major strides of both layouts; an odometer over the leading dims.
  std::vector<int64_t> ls(nd, 1), gs(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) {
    ls[d - 1] = ls[d] * local[d];
    gs[d - 1] = gs[d] * global[d];
  }
  std::vector<int64_t> i(nd, 0);
  for (;;) {
    int64_t lo = 0, go = 0;
    for (size_t d = 0; d < nd; ++d) {
      lo += i[d] * ls[d];
      go += (b.first[d] + i[d]) * gs[d];
    }
    run(lo, go, b.valid[nd - 1]);
    size_t d = nd - 1;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++i[d] < b.valid[d]) break;
      i[d] = 0;
    }
  }
}

bool first_replica(const Tensor &t, const MeshPlacement &mesh) {
  // (Pipeline stages hold different parameters, not copies: pp is no replica axis.)
  for (const MeshPlacement::Axis &a : mesh.axes)
    if (a.size > 1 && a.index != 0 && a.name != "pp" && t.placement.on(a.name) == nullptr) return false;
  return true;
}

std::string placement_string(const Placement &p) {
  if (p.axes.empty()) return "replicated";
  std::string s;
  for (const AxisPlacement &a : p.axes) {
    if (!s.empty()) s += ", ";
    s += a.axis + (a.kind == AxisPlacement::Shard ? ":S(" + std::to_string(a.dim) + ")" : std::string(":P(sum)"));
  }
  return s;
}

}  // namespace ctr
