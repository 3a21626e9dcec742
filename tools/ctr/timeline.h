// `ctr plot --timeline`: the trace of `ctr run --trace` as a Gantt chart, and the
// pipeline bubble measured from it (timeline.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ctr_tool {

struct TimelineBar {
  int rank = 0;
  int64_t step = 0;
  std::string name, cat;      // "F0", "recv B1", "W2", "optimizer"; forward, backward, weight, recv, optimizer
  double start = 0, dur = 0;  // microseconds
};

struct TimelineStats {
  int ranks = 0;
  int64_t steps = 0;           // steps with tasks in the trace
  int64_t measured_steps = 0;  // of them, those the figures below are over (all but the first)
  double step_us = 0;          // mean span of a step's tasks over every rank
  double bubble = 0;           // mean share of that span a rank is not in its own tasks
};

// Reads a trace; fails (CTR_STATUS_INVALID_ARGUMENT or IO_ERROR) naming the file
// and what is wrong with it.
TimelineStats read_timeline(const std::string &path, std::vector<TimelineBar> *bars = nullptr);
// Draws the trace's last step, one row per rank, and prints the figures.
void write_timeline_svg(const std::string &trace, const std::string &output, const std::string &title, int width);

}  // namespace ctr_tool
