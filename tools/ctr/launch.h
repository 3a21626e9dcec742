// `ctr launch`: the one-machine launcher (see launch.cc).
#pragma once

#include <string>
#include <vector>

namespace ctr_tool {

struct LaunchOptions {
  int nprocs = 1;
  int port = 0;           // 0: pick a free port on 127.0.0.1
  int grace_ms = 5000;    // SIGTERM -> SIGKILL delay when stopping ranks
  int max_restarts = 0;   // restarts after a retryable failure
  int stopped_ms = 60000; // a rank stopped (SIGSTOP, SIGTSTP) this long fails the job
  std::vector<std::string> command;
};

// Runs the job; returns the process exit status for the launcher.
int launch(const LaunchOptions &opt);

}  // namespace ctr_tool
