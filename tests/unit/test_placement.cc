// Placements (graph/placement.h): each rank's block of a sharded tensor, the
// padding of uneven shards, nested shard axes, the first replica of each
// block, and the pass results that set them (shard, expert) as read by
// `graph inspect`.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "graph/ir.h"
#include "graph/placement.h"

namespace ctr {
namespace {

MeshPlacement mesh(std::vector<std::pair<std::string, int64_t>> sizes, std::vector<int64_t> index) {
  MeshPlacement m;
  for (size_t i = 0; i < sizes.size(); ++i) m.axes.push_back({sizes[i].first, sizes[i].second, index[i]});
  return m;
}

// Every rank of the mesh (index tuples, last axis fastest).
std::vector<MeshPlacement> all_ranks(const std::vector<std::pair<std::string, int64_t>> &sizes) {
  std::vector<MeshPlacement> out;
  int64_t world = 1;
  for (const auto &s : sizes) world *= s.second;
  for (int64_t r = 0; r < world; ++r) {
    std::vector<int64_t> idx(sizes.size());
    int64_t rest = r;
    for (size_t i = sizes.size(); i-- > 0;) {
      idx[i] = rest % sizes[i].second;
      rest /= sizes[i].second;
    }
    out.push_back(mesh(sizes, idx));
  }
  return out;
}

Tensor sharded(std::vector<int64_t> global, std::vector<std::pair<std::string, int>> shards,
               const std::vector<std::pair<std::string, int64_t>> &sizes) {
  Tensor t;
  t.shape = global;
  for (const auto &s : shards) {
    t.placement.add_shard(s.first, s.second, global);
    int64_t n = 1;
    for (const auto &a : sizes)
      if (a.first == s.first) n = a.second;
    t.shape[static_cast<size_t>(s.second)] = (t.shape[static_cast<size_t>(s.second)] + n - 1) / n;
  }
  return t;
}

// The blocks of all ranks cover every element of the whole tensor, each
// distinct non-empty block exactly once among the first replicas; local offsets stay
// inside the local block.
void expect_cover(const Tensor &t, const std::vector<std::pair<std::string, int64_t>> &sizes) {
  const std::vector<int64_t> whole = global_shape(t);
  std::vector<int> seen(static_cast<size_t>(global_numel(t)), 0);
  std::set<std::vector<int64_t>> firsts;
  for (const MeshPlacement &m : all_ranks(sizes)) {
    const LocalBlock b = local_block(t, m);
    if (!first_replica(t, m)) continue;
    bool empty = false;
    for (int64_t v : b.valid) empty |= v == 0;
    if (!empty) {
      EXPECT_TRUE(firsts.insert(b.first).second) << "two first replicas of one block";
    }
    for_each_run(t.shape, whole, b, [&](int64_t lo, int64_t go, int64_t n) {
      ASSERT_GE(lo, 0);
      ASSERT_LE(lo + n, t.numel());
      for (int64_t i = 0; i < n; ++i) ++seen[static_cast<size_t>(go + i)];
    });
  }
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << "element " << i;
}

TEST(Placement, UnevenShardsArePaddedAtTheEnd) {
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"fsdp", 4}};
  Tensor t = sharded({10, 3}, {{"fsdp", 0}}, sizes);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(global_numel(t), 30);
  const int64_t want_first[] = {0, 3, 6, 9}, want_valid[] = {3, 3, 3, 1};
  for (int64_t r = 0; r < 4; ++r) {
    const LocalBlock b = local_block(t, mesh(sizes, {r}));
    EXPECT_EQ(b.first[0], want_first[r]);
    EXPECT_EQ(b.valid[0], want_valid[r]);
    EXPECT_EQ(b.first[1], 0);
    EXPECT_EQ(b.valid[1], 3);
  }
  expect_cover(t, sizes);
  // More ranks than rows: the last ranks hold padding only.
  Tensor small = sharded({2, 5}, {{"fsdp", 0}}, sizes);
  EXPECT_EQ(local_block(small, mesh(sizes, {3})).valid[0], 0);
  expect_cover(small, sizes);
}

TEST(Placement, NestedAxesTheFirstIsOutermost) {
  // Experts over ep, each ep block split again over fsdp.
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"ep", 2}, {"fsdp", 2}};
  Tensor t;
  t.shape = {8, 4};
  t.placement.add_shard("ep", 0, t.shape);
  t.shape[0] = 4;
  t.placement.add_shard("fsdp", 0, t.shape);  // the global shape stays [8, 4]
  t.shape[0] = 2;
  EXPECT_EQ(t.placement.global_shape, (std::vector<int64_t>{8, 4}));
  EXPECT_EQ(local_block(t, mesh(sizes, {0, 1})).first[0], 2);
  EXPECT_EQ(local_block(t, mesh(sizes, {1, 0})).first[0], 4);
  EXPECT_EQ(local_block(t, mesh(sizes, {1, 1})).first[0], 6);
  EXPECT_EQ(placement_string(t.placement), "ep:S(0), fsdp:S(0)");
  expect_cover(t, sizes);
}

TEST(Placement, NestedUnevenLevelsPadTheirOwnBlocks) {
  // 8 rows over tp=2 (4 each), each tp block over fsdp=3 (2, 2 and 0 valid).
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"tp", 2}, {"fsdp", 3}};
  Tensor t;
  t.shape = {8, 2};
  t.placement.add_shard("tp", 0, t.shape);
  t.shape[0] = 4;
  t.placement.add_shard("fsdp", 0, t.shape);
  t.shape[0] = 2;
  const LocalBlock b = local_block(t, mesh(sizes, {1, 1}));
  EXPECT_EQ(b.first[0], 6);
  EXPECT_EQ(b.valid[0], 2);
  EXPECT_EQ(local_block(t, mesh(sizes, {1, 2})).valid[0], 0);
  EXPECT_EQ(local_block(t, mesh(sizes, {0, 2})).valid[0], 0);
  expect_cover(t, sizes);
}

TEST(Placement, ShardsOfInnerDimsAndTwoDims) {
  // Columns over tp (uneven), rows over fsdp: runs are pieces of rows.
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"fsdp", 2}, {"tp", 3}};
  Tensor t = sharded({5, 7}, {{"fsdp", 0}, {"tp", 1}}, sizes);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 3}));
  const LocalBlock b = local_block(t, mesh(sizes, {1, 2}));
  EXPECT_EQ(b.first, (std::vector<int64_t>{3, 6}));
  EXPECT_EQ(b.valid, (std::vector<int64_t>{2, 1}));
  std::vector<std::pair<int64_t, int64_t>> runs;
  for_each_run(t.shape, global_shape(t), b, [&](int64_t lo, int64_t go, int64_t n) {
    EXPECT_EQ(n, 1);
    runs.push_back({lo, go});
  });
  EXPECT_EQ(runs, (std::vector<std::pair<int64_t, int64_t>>{{0, 3 * 7 + 6}, {3, 4 * 7 + 6}}));
  expect_cover(t, sizes);
  // A 3-d tensor sharded on its middle dim.
  const std::vector<std::pair<std::string, int64_t>> tp4 = {{"tp", 4}};
  expect_cover(sharded({2, 6, 3}, {{"tp", 1}}, tp4), tp4);
}

TEST(Placement, FirstReplicaOfReplicatedAxes) {
  const std::vector<std::pair<std::string, int64_t>> sizes = {{"dp", 2}, {"fsdp", 2}, {"ep", 2}};
  Tensor t = sharded({6, 2}, {{"fsdp", 0}}, sizes);
  int writers = 0;
  for (const MeshPlacement &m : all_ranks(sizes)) {
    const bool w = first_replica(t, m);
    writers += w;
    EXPECT_EQ(w, m.index("dp") == 0 && m.index("ep") == 0);
  }
  EXPECT_EQ(writers, 2);  // one per fsdp block
  expect_cover(t, sizes);
  Tensor whole;
  whole.shape = {3};
  EXPECT_FALSE(whole.placement.sharded());
  EXPECT_EQ(placement_string(whole.placement), "replicated");
  EXPECT_EQ(global_shape(whole), whole.shape);
  expect_cover(whole, sizes);
  // Partial is not a shard: it names an axis without splitting any dim.
  Tensor part;
  part.shape = {4};
  part.placement.axes.push_back(AxisPlacement::partial("dp"));
  EXPECT_FALSE(part.placement.sharded());
  EXPECT_EQ(placement_string(part.placement), "dp:P(sum)");
}

}  // namespace
}  // namespace ctr
