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
  // Interleaved 1F1B: each rank holds `virtual_stages` chunks of the model
  // (virtual stage k = chunk * p + rank, so activations go round the ranks v
  // times); micro-batches go through in groups of p, each rank running a
  // group's forwards on chunk 0, then on chunk 1, ..., after a warm-up of
  // (p - 1 - rank) * 2 + (v - 1) * p forwards, then one forward and one
  // backward in turn. Its bubble is near (p - 1) / (v * m + p - 1).
  Interleaved,
};

enum class TaskPhase : uint8_t { Forward, Backward, Weight };

struct Task {
  int stage = 0;  // the rank's index on pp
  int64_t micro_batch = 0;
  TaskPhase phase = TaskPhase::Forward;
  int chunk = 0;  // interleaved: which of the rank's virtual stages (else 0)
  bool operator==(const Task &o) const {
    return stage == o.stage && micro_batch == o.micro_batch && phase == o.phase && chunk == o.chunk;
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
  int virtual_stages = 1;                // chunks per rank (interleaved; else 1)
  std::vector<std::vector<Task>> order;  // [stage] -> tasks in run order
  // [stage] -> peak micro-batches in flight: the widest run of micro-batches
  // from the oldest whose last task on the stage has not run to the newest
  // whose first has (each needs its own copy of what tasks hold).
  std::vector<int64_t> in_flight;
  // [virtual stage] -> its blocks (empty until cut_stages); virtual stage
  // k = chunk * stages + stage, so without chunks [stage].
  std::vector<StageSpan> spans;
  int virtual_count() const { return stages * virtual_stages; }
  // Whether the backward is split into B (Backward) and W (Weight) tasks.
  bool split_backward() const { return kind == ScheduleKind::ZeroBubble; }
};

// "gpipe", "1f1b", "zb" or "interleaved"; anything else fails with CTR_STATUS_INVALID_OPTION listing them.
ScheduleKind schedule_kind_from_name(const std::string &name);
const char *schedule_kind_name(ScheduleKind kind);

// Builds and checks a schedule. Refuses (CTR_STATUS_INVALID_OPTION, naming the
// numbers) stages or micro-batches below 1, 1F1B with fewer micro-batches
// than stages (its warm-up would not fill the pipeline), virtual stages other
// than 1 except with interleaved, and interleaved on one stage, with fewer
// than 2 virtual stages, or with micro-batches that are not a multiple of the
// stages (they go through in groups of one per stage).
Schedule build_schedule(ScheduleKind kind, int stages, int64_t micro_batches, int virtual_stages = 1);

// A task's time in the schedule's arithmetic: a forward 1, a backward 2; split,
// B and W 1 each, except on stage 0, whose inputs are the data: B 0 and W 2
// (interleaved: per chunk, each a 1/v of the stage's work, the same ratios).
int64_t task_time(const Schedule &s, int stage, TaskPhase phase);

// Plays s (proved runnable by check_schedule): each stage starts its next task
// when it is free and the task's inputs are there, a task taking time(task), an activation or gradient from another stage arriving `transfer`
// after its sender's task ends. Returns the makespan and the stages' summed
// busy time.
struct SchedulePlay {
  double span = 0, busy = 0;
};
SchedulePlay play_schedule(const Schedule &s, const std::function<double(const Task &)> &time,
                           double transfer = 0);

// The bubble of s when tasks take task_time: the idle fraction of the stages'
// time from the first forward to the last task.
double schedule_bubble(const Schedule &s);
// Plays s as described above; fills s.in_flight, or fails with
// CTR_STATUS_INVALID_OPTION naming each stage that cannot go on and its task.
void check_schedule(Schedule &s);

// Cuts g's forward graph (shapes known) into `stages` runs of whole blocks
// (interleaved: one per virtual stage, per_rank of them on each rank):
// balanced (the largest stage's FLOPs as small as contiguous runs allow) when
// blocks_per_stage is empty, else blocks_per_stage[s] blocks on stage s.
// Refuses (CTR_STATUS_INVALID_OPTION, naming the numbers) a graph with fewer
// blocks than stages, and a list whose length is not the stage count, with an
// entry below 1, or whose sum is not the block count.
std::vector<StageSpan> cut_stages(const Graph &g, int stages, const std::vector<int64_t> &blocks_per_stage,
                                  int per_rank = 1);

// This rank's stage of a pipeline, as pass_stages cut it out of the graph.
struct StageCut {
  int stage = 0, stages = 1;
  int chunks = 1;  // virtual stages on this rank (interleaved)
  // Every activation crossing virtual stages, the same list on every rank:
  // computed on virtual stage `from`, read on `to` (rank = virtual stage %
  // stages, chunk = virtual stage / stages), its gradient going back when
  // `grad`. The order in which ranks send is the schedule's task order and,
  // within a task, this list's.
  struct Crossing {
    int from = 0, to = 0;
    bool grad = false;
    std::string name;  // the tensor's
  };
  std::vector<Crossing> crossings;
  // Per block of the whole graph on this rank: its chunk (-1: another rank's).
  std::vector<int> block_chunk;
  // An activation crossing stages: received before this stage's forward (and
  // its gradient sent back after the backward), or sent after the forward (and
  // its gradient received before the backward).
  struct Boundary {
    int tensor = -1;       // in the cut graph: the received input, or the sent activation
    int peer = 0;          // the other stage
    bool grad = false;     // a gradient goes back (the activation depends on a parameter)
    int grad_tensor = -1;  // sent: the input receiving its gradient; received: its gradient (after autodiff)
    int crossing = -1;     // in crossings
    int chunk = 0;         // this rank's chunk sending or receiving it
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

// "F3", "B0" or "W1": a task as the schedule printouts write it; with
// chunks, "F3c1" (micro-batch 3 on the rank's chunk 1).
std::string task_text(const Task &t, bool chunks = false);
// One line per stage: "stage 1: F0 F1 B0 B1 (2 in flight)", and with spans a
// line per stage of its blocks and FLOPs.
std::string schedule_text(const Schedule &s);

}  // namespace ctr
