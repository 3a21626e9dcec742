// `ctr check`: a pre-flight check of a job's communicators (see check_cmd.cc).
//
// The command registers itself on the tool's command line so that main.cc only
// has to construct it and, when it was chosen, run it.
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace ctr_tool {

// Exit status of a check that found every result right but one rank far slower
// than the others (1 is any error, wrong results included; 2 is bad usage).
constexpr int kExitSlowRank = 3;

class CheckCommand {
 public:
  // Adds `check` to app, which must outlive this object.
  explicit CheckCommand(CLI::App &app);
  ~CheckCommand();
  CheckCommand(const CheckCommand &) = delete;
  CheckCommand &operator=(const CheckCommand &) = delete;

  // True if the parsed command line chose `ctr check`.
  bool parsed() const;
  // Joins the mesh, checks and times its communicators; returns the exit
  // status (0, 1 or kExitSlowRank). Failures of the mesh itself (a peer that
  // never joins or dies) are thrown as ctr::Error.
  int run() const;

 private:
  struct Args;
  std::unique_ptr<Args> args_;
};

}  // namespace ctr_tool
