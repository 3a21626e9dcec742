// Which launcher started this process, and what it says about the job: rank,
// world size, local rank and where rank 0 serves the rendezvous store.
//
// One table maps each launcher's environment to these (ctr launch, torchrun,
// Slurm's srun, Open MPI's mpirun), so every reader of the environment agrees,
// and a launcher whose variables are only partly there is an error that names
// the missing one rather than a silent single-rank run.
#pragma once

#include <string>

namespace ctr {

struct LaunchEnv {
  const char *launcher = nullptr;  // "ctr launch", "torchrun", "Slurm", "Open MPI"; null: none
  int rank = 0;
  int world = 1;
  int local_rank = 0;
  std::string addr = "127.0.0.1";  // rank 0's store
  int port = 29500;
};

// Reads the environment. The first launcher whose rank variable is set wins
// (in the order above); CTR_MASTER_ADDR and CTR_MASTER_PORT override the
// address and port of any of them. Fails with CTR_STATUS_INVALID_OPTION naming
// the variable when one is missing or malformed.
LaunchEnv read_launch_env();

}  // namespace ctr
