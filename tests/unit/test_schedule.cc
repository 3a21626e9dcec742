// Pipeline schedules (lib/runtime/schedule.cc): each kind's task order, the
// activations it keeps in flight, and the refusals that replace a hang.

#include "passes/schedule.h"

#include <gtest/gtest.h>

#include <string>

#include "core/status.h"

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
  for (auto kind : {ScheduleKind::GPipe, ScheduleKind::OneFOneB})
    for (int p = 1; p <= 8; ++p)
      for (int64_t m = kind == ScheduleKind::OneFOneB ? p : 1; m <= 3 * p; ++m) {
        Schedule s = ctr::build_schedule(kind, p, m);
        ASSERT_EQ(static_cast<int>(s.order.size()), p);
      }
}

TEST(Schedule, Refusals) {
  expect_refusal([] { ctr::build_schedule(ScheduleKind::OneFOneB, 4, 2); }, CTR_STATUS_INVALID_OPTION,
                 {"1f1b", "2 micro-batch(es) for 4 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::GPipe, 0, 2); }, CTR_STATUS_INVALID_OPTION, {"0 stages"});
  expect_refusal([] { ctr::build_schedule(ScheduleKind::GPipe, 2, 0); }, CTR_STATUS_INVALID_OPTION,
                 {"0 micro-batches"});
  expect_refusal([] { ctr::schedule_kind_from_name("zb"); }, CTR_STATUS_INVALID_OPTION, {"'zb'", "gpipe, 1f1b"});
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
