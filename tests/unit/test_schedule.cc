// Pipeline schedules (lib/runtime/schedule.cc): each kind's task order, the
// activations it keeps in flight, and the refusals that replace a hang.

#include "passes/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/status.h"
#include "graph/presets.h"
#include "passes/passes.h"

namespace {

using ctr::Schedule;
using ctr::ScheduleKind;

std::string order(const Schedule &s, int stage) {
  std::string out;
  for (const auto &t : s.order[static_cast<size_t>(stage)]) out += (out.empty() ? "" : " ") + ctr::task_text(t);
  return out;
}

// Runs fn, which must fail with `code` and a message holding every needle.
template <typename F>
void expect_refusal(F fn, ctr_status code, std::initializer_list<const char *> needles) {
  try {
    fn();
  } catch (const ctr::Error &e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char *n : needles) EXPECT_NE(e.message().find(n), std::string::npos) << "lacks '" << n << "': " << e.what();
    return;
  }
  ADD_FAILURE() << "no refusal";
}

TEST(Schedule, OneStageOneFOneBIsForwardThenBackwardPerMicroBatch) {
  Schedule s = ctr::build_schedule(ScheduleKind::OneFOneB, 1, 3);
  EXPECT_EQ(order(s, 0), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(s.in_flight[0], 1);
}

TEST(Schedule, GPipe) {
  Schedule s = ctr::build_schedule(ScheduleKind::GPipe, 2, 4);
  EXPECT_EQ(order(s, 0), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(order(s, 1), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(s.in_flight[0], 4);
  EXPECT_EQ(s.in_flight[1], 4);
}

TEST(Schedule, OneFOneBWarmsUpByStage) {
  Schedule s = ctr::build_schedule(ScheduleKind::OneFOneB, 4, 4);
  EXPECT_EQ(order(s, 0), "F0 F1 F2 F3 B0 B1 B2 B3");
  EXPECT_EQ(order(s, 1), "F0 F1 F2 B0 F3 B1 B2 B3");
  EXPECT_EQ(order(s, 2), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(order(s, 3), "F0 B0 F1 B1 F2 B2 F3 B3");
  // Stage s keeps p - s micro-batches in flight, whatever the micro-batch count.
  Schedule big = ctr::build_schedule(ScheduleKind::OneFOneB, 4, 16);
  for (int st = 0; st < 4; ++st) EXPECT_EQ(big.in_flight[static_cast<size_t>(st)], 4 - st) << "stage " << st;
  EXPECT_EQ(ctr::schedule_text(s).substr(0, 42), "stage 0: F0 F1 F2 F3 B0 B1 B2 B3 (4 in fli");
}

TEST(Schedule, EveryKindAndSizeRunsToTheEnd) {
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble})
    for (int p = 1; p <= 8; ++p)
      for (int64_t m = kind == ScheduleKind::OneFOneB ? p : 1; m <= 3 * p; ++m) {
        Schedule s = ctr::build_schedule(kind, p, m);
        ASSERT_EQ(static_cast<int>(s.order.size()), p);
      }
}

TEST(Schedule, OneFOneBBubbleIsItsArithmetic) {
  for (int p = 1; p <= 8; ++p)
    for (int64_t m = p; m <= 4 * p; ++m) {
      const double want = static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
      EXPECT_NEAR(ctr::schedule_bubble(ctr::build_schedule(ScheduleKind::OneFOneB, p, m)), want, 1e-12) << p << " " << m;
    }
}

// The backward split in two: stage 0 (no input gradient: B is empty, W the
// whole backward) defers its Ws into the time it would wait for the later
// stage's backwards.
TEST(Schedule, ZeroBubbleSplitsEachBackwardAndFillsTheBubble) {
  Schedule s = ctr::build_schedule(ScheduleKind::ZeroBubble, 2, 4);
  EXPECT_EQ(order(s, 0), "F0 F1 B0 F2 W0 B1 F3 B2 W1 W2 B3 W3");
  EXPECT_EQ(order(s, 1), "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3");
  for (int p = 1; p <= 8; ++p)
    for (int64_t m = 1; m <= 4 * p; ++m) {
      Schedule z = ctr::build_schedule(ScheduleKind::ZeroBubble, p, m);
      for (int st = 0; st < p; ++st) {
        const auto &list = z.order[static_cast<size_t>(st)];
        ASSERT_EQ(static_cast<int64_t>(list.size()), 3 * m);
        // Each phase in micro-batch order; at most p + 1 micro-batches held.
        int64_t next[3] = {0, 0, 0};
        for (const auto &t : list) EXPECT_EQ(t.micro_batch, next[static_cast<int>(t.phase)]++) << ctr::task_text(t);
        EXPECT_LE(z.in_flight[static_cast<size_t>(st)], p + 1);
      }
      if (m < p) continue;
      // Never worse than 1F1B, and near (p - 1) / (3m + p - 1) (the bubble with
      // every idle slot filled) once the micro-batches fill the pipeline.
      const double zb = ctr::schedule_bubble(z);
      const double one_f_one_b = ctr::schedule_bubble(ctr::build_schedule(ScheduleKind::OneFOneB, p, m));
      EXPECT_LE(zb, one_f_one_b + 1e-12) << p << " " << m;
      if (m >= 2 * p) {
        EXPECT_LE(zb, 1.5 * (p - 1) / static_cast<double>(3 * m + p - 1) + 1e-12) << p << " " << m;
      }
    }
  expect_refusal(
      [] {
        Schedule z = ctr::build_schedule(ScheduleKind::ZeroBubble, 2, 2);
        std::swap(z.order[1][2], z.order[1][3]);  // "F0 B0 W0 F1 ..." with a W before its B
        for (auto &t : z.order[1]) t.phase = t.phase == ctr::TaskPhase::Backward ? ctr::TaskPhase::Weight
                                              : t.phase == ctr::TaskPhase::Weight ? ctr::TaskPhase::Backward
                                                                                  : t.phase;
        ctr::check_schedule(z);
      },
      CTR_STATUS_INVALID_OPTION, {"zb", "waits in W"});
}

// Interleaved: v chunks per rank, micro-batches in groups of p. Every size
// runs to the end, each chunk's forwards and backwards in micro-batch order
// (its gradients accumulate as the one-stage step's), and the bubble is the
// schedule's arithmetic, (p - 1) / (v m + p - 1): 1F1B's with v times the tasks.
TEST(Schedule, InterleavedRunsChunksInGroupsAndShrinksTheBubble) {
  Schedule s = ctr::build_schedule(ScheduleKind::Interleaved, 2, 4, 2);
  EXPECT_EQ(ctr::schedule_text(s).substr(0, 36), "stage 0: F0c0 F1c0 F0c1 F1c1 F2c0 B0");
  for (int p = 2; p <= 8; ++p)
    for (int v = 2; v <= 4; ++v)
      for (int64_t m = p; m <= 4 * p; m += p) {
        Schedule z = ctr::build_schedule(ScheduleKind::Interleaved, p, m, v);
        for (int st = 0; st < p; ++st) {
          const auto &list = z.order[static_cast<size_t>(st)];
          ASSERT_EQ(static_cast<int64_t>(list.size()), 2 * m * v);
          std::vector<int64_t> next(static_cast<size_t>(2 * v), 0);
          for (const auto &t : list)
            EXPECT_EQ(t.micro_batch, next[static_cast<size_t>(2 * t.chunk + static_cast<int>(t.phase))]++)
                << ctr::task_text(t, true);
          EXPECT_LE(z.in_flight[static_cast<size_t>(st)], m) << p << " " << v << " " << m;
        }
        const double want = static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1);
        EXPECT_NEAR(ctr::schedule_bubble(z), want, 1e-12) << p << " " << v << " " << m;
      }
}

TEST(Schedule, Refusals) {
  expect_refusal([] { ctr::build_schedule(ScheduleKind::OneFOneB, 4, 2); }, CTR_STATUS_INVALID_OPTION,
                 {"1f1b", "2 micro-batch(es) for 4 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::GPipe, 0, 2); }, CTR_STATUS_INVALID_OPTION, {"0 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::GPipe, 2, 0); }, CTR_STATUS_INVALID_OPTION,
                 {"0 micro-batches"});
  expect_refusal([] { ctr::schedule_kind_from_name("zbv"); }, CTR_STATUS_INVALID_OPTION,
                 {"'zbv'", "gpipe, 1f1b, zb, interleaved"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::Interleaved, 4, 6, 2); }, CTR_STATUS_INVALID_OPTION,
                 {"interleaved", "6 micro-batch(es) is not a multiple of 4 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::Interleaved, 1, 2, 2); }, CTR_STATUS_INVALID_OPTION,
                 {"at least 2 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::Interleaved, 2, 2, 1); }, CTR_STATUS_INVALID_OPTION,
                 {"at least 2 virtual stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::OneFOneB, 2, 2, 2); }, CTR_STATUS_INVALID_OPTION,
                 {"'pp_virtual'", "need pp_schedule interleaved"});
  EXPECT_EQ(ctr::schedule_kind_from_name("interleaved"), ScheduleKind::Interleaved);
  EXPECT_EQ(ctr::schedule_kind_from_name("zb"), ScheduleKind::ZeroBubble);
  EXPECT_EQ(ctr::schedule_kind_from_name("gpipe"), ScheduleKind::GPipe);
  EXPECT_EQ(ctr::schedule_kind_from_name("1f1b"), ScheduleKind::OneFOneB);
}

// A hand-made order in which the last stage runs a backward before the first
// stage's forward it depends on can ever arrive: refused, naming both stages.
TEST(Schedule, AnOrderThatWouldHangIsRefused) {
  Schedule s = ctr::build_schedule(ScheduleKind::GPipe, 2, 2);
  // Backwards in reverse order on both stages: runs.
  for (int st = 0; st < 2; ++st)
    s.order[static_cast<size_t>(st)] = {{st, 0, ctr::TaskPhase::Forward}, {st, 1, ctr::TaskPhase::Forward},
                                        {st, 1, ctr::TaskPhase::Backward}, {st, 0, ctr::TaskPhase::Backward}};
  ctr::check_schedule(s);
  // Stage 0 waits for B0 of stage 1 before it sends F1; stage 1 needs F1 before B0.
  s.order[1] = {{1, 1, ctr::TaskPhase::Forward}, {1, 0, ctr::TaskPhase::Forward},
                {1, 0, ctr::TaskPhase::Backward}, {1, 1, ctr::TaskPhase::Backward}};
  s.order[0] = {{0, 0, ctr::TaskPhase::Forward}, {0, 0, ctr::TaskPhase::Backward},
                {0, 1, ctr::TaskPhase::Forward}, {0, 1, ctr::TaskPhase::Backward}};
  expect_refusal([&] { ctr::check_schedule(s); }, CTR_STATUS_INVALID_OPTION,
                 {"cannot run to the end", "stage 0 waits in B0 for stage 1", "stage 1 waits in F1 for stage 0"});
  s.order[1][0] = {1, 0, ctr::TaskPhase::Forward};
  expect_refusal([&] { ctr::check_schedule(s); }, CTR_STATUS_INVALID_OPTION, {"lists F0 twice"});
}

}  // namespace

namespace {

ctr::Graph shaped_gpt(int64_t layers) {
  ctr::PresetConfig cfg;
  cfg.layers = layers;
  cfg.dim = 32;
  cfg.heads = 2;
  cfg.vocab = 512;
  cfg.seq = 16;
  ctr::Graph g = ctr::build_preset("gpt", cfg);
  ctr::CompileOptions o;
  o.batch = 2;
  ctr::pass_verify(g);
  ctr::pass_infer_shapes(g, o);
  return g;
}

// The largest stage cost of every contiguous cut, by brute force over two or three stages.
double best_worst(const ctr::Graph &g, int stages, int blocks) {
  double best = 1e300;
  auto try_counts = [&](const std::vector<int64_t> &c) {
    double worst = 0;
    for (const auto &sp : ctr::cut_stages(g, stages, c)) worst = std::max(worst, sp.flops);
    best = std::min(best, worst);
  };
  for (int a = 1; a < blocks; ++a) {
    if (stages == 2) try_counts({a, blocks - a});
    for (int b = 1; stages == 3 && a + b < blocks; ++b) try_counts({a, b, blocks - a - b});
  }
  return best;
}

TEST(StageCut, BalancedByFlopsWithEmbeddingFirstAndHeadLast) {
  ctr::Graph g = shaped_gpt(6);
  for (int stages : {2, 3}) {
    auto spans = ctr::cut_stages(g, stages, {});
    ASSERT_EQ(static_cast<int>(spans.size()), stages);
    EXPECT_EQ(spans.front().first_block, 0);
    EXPECT_EQ(spans.back().last_block, 5);
    double worst = 0, total = 0;
    for (size_t s = 0; s < spans.size(); ++s) {
      EXPECT_LE(spans[s].first_block, spans[s].last_block) << "stage " << s;
      if (s) {
        EXPECT_EQ(spans[s].first_block, spans[s - 1].last_block + 1);
      }
      worst = std::max(worst, spans[s].flops);
      total += spans[s].flops;
    }
    EXPECT_EQ(worst, best_worst(g, stages, 6)) << stages << " stages";
    EXPECT_GT(total, 0);
  }
  // The head over 512 words outweighs a block of width 32: the last stage takes fewer blocks.
  auto two = ctr::cut_stages(g, 2, {});
  EXPECT_GT(two[0].last_block - two[0].first_block, two[1].last_block - two[1].first_block);
}

TEST(StageCut, ExplicitListAndRefusals) {
  ctr::Graph g = shaped_gpt(4);
  auto spans = ctr::cut_stages(g, 2, {1, 3});
  EXPECT_EQ(spans[0].last_block, 0);
  EXPECT_EQ(spans[1].first_block, 1);
  EXPECT_EQ(spans[1].last_block, 3);
  expect_refusal([&] { ctr::cut_stages(g, 8, {}); }, CTR_STATUS_INVALID_OPTION,
                 {"8 stages need at least one block each", "has 4 block(s)"});
  expect_refusal([&] { ctr::cut_stages(g, 2, {1, 2}); }, CTR_STATUS_INVALID_OPTION,
                 {"the stages hold 3 blocks in all", "has 4"});
  expect_refusal([&] { ctr::cut_stages(g, 2, {4}); }, CTR_STATUS_INVALID_OPTION, {"1 entries for 2 stages"});
  expect_refusal([&] { ctr::cut_stages(g, 2, {0, 4}); }, CTR_STATUS_INVALID_OPTION, {"stage 0 gets 0 blocks"});
}

}  // namespace
