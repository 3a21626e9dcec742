// `ctr data`: make, inspect and convert token files (see data_cmd.cc).
//
// The command registers itself on the tool's command line so that main.cc only
// has to construct it and, when it was chosen, run it.
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace ctr_tool {

class DataCommand {
 public:
  // Adds `data` and its subcommands (tokenize, inspect, convert) to app, which
  // must outlive this object.
  explicit DataCommand(CLI::App &app);
  ~DataCommand();
  DataCommand(const DataCommand &) = delete;
  DataCommand &operator=(const DataCommand &) = delete;

  // True if the parsed command line chose `ctr data ...`.
  bool parsed() const;
  // Runs the chosen subcommand and returns the exit status. Failures are thrown
  // as ctr::Error, which the tool prints as one "ctr: error:" line, exit 1.
  int run() const;

 private:
  struct Args;
  std::unique_ptr<Args> args_;
};

}  // namespace ctr_tool
