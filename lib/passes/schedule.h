// Pipeline schedules as data: per stage, the order of its tasks.
//
// A task is one phase of one micro-batch on one stage: forward, backward, or,
// in the zero-bubble schedule, the backward split in two — the input-gradient
// part (B: what the previous stage waits for) and the weight-gradient part (W:
// what only the optimizer waits for), which fills the pipeline's bubbles.
// A schedule is built from its kind and the numbers of stages and micro-batches,
// then checked by playing it: a forward needs the previous stage's forward of
// the same micro-batch (its activations arrive by recv), a backward needs the
// stage's own forward and the next stage's backward (its gradient arrives by
// recv), a weight-gradient task needs the stage's own backward, and sends
// never block. A schedule that cannot run to the end is
// refused when it is built, naming the stages and the tasks they would wait in,
// instead of hanging at run time. Playing it also gives each stage's peak
// number of micro-batches in flight (forwards whose backward — or, split,
// whose weight-gradient task — has not run), the activations the memory plan
// must hold.
//
// The graph is cut into stages at block boundaries (cut_stages): each stage a
// run of whole blocks, the nodes before the first block (the embedding) on the
// first stage and those after the last (the head and the loss) on the last;
// balanced by the op registry's forward FLOPs, or as an explicit list of
// blocks per stage.
//
// The step runs one stage's list (Step::run) on the graph pass_stages cut
// for it; with one stage, 1F1B is forward then backward per micro-batch, the
// step's order before schedules.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace ctr {

struct Graph;

enum class ScheduleKind : uint8_t {
  GPipe,     // every forward, then every backward (in micro-batch order)
  OneFOneB,  // warm-up forwards, then one forward and one backward in turn
  // Zero bubble (ZB-H1 style): the backward split into B and W; each stage
  // runs, whenever it is free, a ready B first, else a forward (at most as
  // many ahead as 1F1B's stage 0, p, without a B, and p + 1 without their W),
  // else the oldest pending W. Built by playing the pipeline with the task
  // times of task_time, so the order is fixed; its bubble there is near
  // (p - 1) / (3m + p - 1) against 1F1B's (p - 1) / (m + p - 1).
  ZeroBubble,
};

enum class TaskPhase : uint8_t { Forward, Backward, Weight };

struct Task {
  int stage = 0;
  int64_t micro_batch = 0;
  TaskPhase phase = TaskPhase::Forward;
  bool operator==(const Task &o) const {
    return stage == o.stage && micro_batch == o.micro_batch && phase == o.phase;
  }
};

// One pipeline stage's part of the forward graph.
struct StageSpan {
  int first_block = 0, last_block = -1;  // blocks [first_block, last_block]
  double flops = 0;                      // forward FLOPs of its nodes (one micro-batch)
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::OneFOneB;
  int stages = 1;
  int64_t micro_batches = 1;
  std::vector<std::vector<Task>> order;  // [stage] -> tasks in run order
  std::vector<int64_t> in_flight;        // [stage] -> peak micro-batches in flight
  std::vector<StageSpan> spans;          // [stage] -> its blocks (empty until cut_stages)
  // Whether the backward is split into B (Backward) and W (Weight) tasks.
  bool split_backward() const { return kind == ScheduleKind::ZeroBubble; }
};

// "gpipe", "1f1b" or "zb"; anything else fails with CTR_STATUS_INVALID_OPTION listing them.
ScheduleKind schedule_kind_from_name(const std::string &name);
const char *schedule_kind_name(ScheduleKind kind);

// Builds and checks a schedule. Refuses (CTR_STATUS_INVALID_OPTION, naming the
// numbers) stages or micro-batches below 1, and 1F1B with fewer micro-batches
// than stages (its warm-up would not fill the pipeline).
Schedule build_schedule(ScheduleKind kind, int stages, int64_t micro_batches);

// A task's time in the schedule's arithmetic: a forward 1, a backward 2; split,
// B and W 1 each, except on stage 0, whose inputs are the data: B 0 and W 2.
int64_t task_time(const Schedule &s, int stage, TaskPhase phase);

// Plays s (proved runnable by check_schedule): each stage starts its next task
// when it is free and the task's inputs are there, a task taking time(stage,
// phase), an activation or gradient from another stage arriving `transfer`
// after its sender's task ends. Returns the makespan and the stages' summed
// busy time.
struct SchedulePlay {
  double span = 0, busy = 0;
};
SchedulePlay play_schedule(const Schedule &s, const std::function<double(int, TaskPhase)> &time,
                           double transfer = 0);

// The bubble of s when tasks take task_time: the idle fraction of the stages'
// time from the first forward to the last task.
double schedule_bubble(const Schedule &s);
// Plays s as described above; fills s.in_flight, or fails with
// CTR_STATUS_INVALID_OPTION naming each stage that cannot go on and its task.
void check_schedule(Schedule &s);

// Cuts g's forward graph (shapes known) into `stages` runs of whole blocks:
// balanced (the largest stage's FLOPs as small as contiguous runs allow) when
// blocks_per_stage is empty, else blocks_per_stage[s] blocks on stage s.
// Refuses (CTR_STATUS_INVALID_OPTION, naming the numbers) a graph with fewer
// blocks than stages, and a list whose length is not the stage count, with an
// entry below 1, or whose sum is not the block count.
std::vector<StageSpan> cut_stages(const Graph &g, int stages, const std::vector<int64_t> &blocks_per_stage);

// This rank's stage of a pipeline, as pass_stages cut it out of the graph.
struct StageCut {
  int stage = 0, stages = 1;
  // An activation crossing stages: received before this stage's forward (and
  // its gradient sent back after the backward), or sent after the forward (and
  // its gradient received before the backward).
  struct Boundary {
    int tensor = -1;       // in the cut graph: the received input, or the sent activation
    int peer = 0;          // the other stage
    bool grad = false;     // a gradient goes back (the activation depends on a parameter)
    int grad_tensor = -1;  // sent: the input receiving its gradient; received: its gradient (after autodiff)
  };
  std::vector<Boundary> recv, send;
  // Graph inputs that only other stages read: name and bytes per micro-batch.
  std::vector<std::pair<std::string, int64_t>> elsewhere_inputs;
  // Every parameter of the whole graph, in graph order: its full shape and the
  // stages whose nodes read it (a tied embedding: the first and the last).
  struct Home {
    std::string name;
    std::vector<int64_t> full_shape;
    std::vector<int> stages;
  };
  std::vector<Home> params;
  // The stage computing each activation named in the step option "keep".
  std::map<std::string, int> kept_on;
};

// "F3", "B0" or "W1": a task as the schedule printouts write it.
std::string task_text(const Task &t);
// One line per stage: "stage 1: F0 F1 B0 B1 (2 in flight)", and with spans a
// line per stage of its blocks and FLOPs.
std::string schedule_text(const Schedule &s);

}  // namespace ctr
