// `ctr plan`: the planner's ranked table of layouts for a graph on a cluster
// (see plan_cmd.cc). A host of the public C ABI only (ctr_plan).
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace ctr_tool {

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
