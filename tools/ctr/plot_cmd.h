// `ctr plot`: training curves from `ctr run --metrics` files as an SVG (see plot_cmd.cc).
//
// The command registers itself on the tool's command line so that main.cc only
// has to construct it and, when it was chosen, run it.
#pragma once

#include <memory>

namespace CLI {
class App;
}

namespace ctr_tool {

class PlotCommand {
 public:
  // Adds `plot` to app, which must outlive this object.
  explicit PlotCommand(CLI::App &app);
  ~PlotCommand();
  PlotCommand(const PlotCommand &) = delete;
  PlotCommand &operator=(const PlotCommand &) = delete;

  // True if the parsed command line chose `ctr plot`.
  bool parsed() const;
  // Reads the metrics files and writes the chart; returns the exit status.
  // Failures are thrown as ctr_tool::Error (one "ctr: error:" line, exit 1).
  int run() const;

 private:
  struct Args;
  std::unique_ptr<Args> args_;
};

}  // namespace ctr_tool
