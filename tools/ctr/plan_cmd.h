// `ctr plan`: the planner's ranked table of layouts for a graph on a cluster
// (see plan_cmd.cc). A host of the public C ABI only (ctr_plan).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "ctr/ctr.h"

namespace CLI {
class App;
}

namespace ctr_tool {

// The plan `ctr run --mesh auto` runs: the first feasible one of ctr_plan's
// ranking for this job's world.
struct ChosenPlan {
  std::string mesh;  // mesh option ("dp=1" for a single device)
  std::string schedule, recompute, cp_mode;
  std::string precision;  // what the plan was compiled in (the profile's device.precision)
  int64_t batch = 1, micro_batches = 1;
  double step_ms = 0;        // predicted
  int64_t memory_bytes = 0;  // predicted per device
  std::string report;        // what was chosen and why, for the job's log
};

// Plans graph for the job this process belongs to (its launcher's world) with
// global_batch sequences of seq positions on the cluster profile (a path).
// Throws ctr_tool::Error (naming the reasons) when no plan is feasible.
ChosenPlan choose_plan(ctr_graph *graph, const std::string &cluster, int64_t global_batch, int64_t seq);

class PlanCommand {
 public:
  // Adds `plan` to app, which must outlive this object.
  explicit PlanCommand(CLI::App &app);
  ~PlanCommand();
  PlanCommand(const PlanCommand &) = delete;
  PlanCommand &operator=(const PlanCommand &) = delete;

  bool parsed() const;
  // Plans and prints; returns the exit status (1 with one "ctr: error:" line).
  int run() const;

 private:
  struct Args;
  std::unique_ptr<Args> args_;
};

}  // namespace ctr_tool
