// `ctr calibrate`: this machine's device profile for the planner, measured
// (see calibrate_cmd.cc). A host of the public C ABI only.
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace ctr_tool {

class CalibrateCommand {
 public:
  explicit CalibrateCommand(CLI::App &app);
  ~CalibrateCommand();
  CalibrateCommand(const CalibrateCommand &) = delete;
  CalibrateCommand &operator=(const CalibrateCommand &) = delete;

  bool parsed() const;
  // Measures and writes the profile; returns the exit status (1 with one
  // "ctr: error:" line).
  int run() const;

 private:
  struct Args;
  std::unique_ptr<Args> args_;
};

}  // namespace ctr_tool
