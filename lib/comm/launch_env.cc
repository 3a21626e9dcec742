// The launchers' environments, one entry each. The store's port is the one
// place they differ in kind:
//   ctr launch  CTR_MASTER_PORT, a free port it picked;
//   torchrun    MASTER_PORT + 1: torchrun's own agent serves its TCPStore on
//               MASTER_PORT for the whole job, so libctr takes the next one;
//   Slurm       derived from the job and step ids, so that the ranks of one
//               step agree without talking and consecutive steps differ;
//   Open MPI    derived from the job id, likewise.
// A derived port is 20000 + id mod 10000, below Linux's ephemeral range.
// Rank 0's address is MASTER_ADDR where the launcher sets it, else loopback
// when every rank is on one node; across nodes Slurm's first node is used and
// Open MPI, which names no node, needs CTR_MASTER_ADDR.

#include "comm/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/status.h"

namespace ctr {
namespace {

const char *get(const char *name) {
  const char *v = std::getenv(name);
  return v && *v ? v : nullptr;
}

long parse_long(const char *name, const char *text, long lo, long hi, const char *launcher) {
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi)
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s environment: %s='%s' is not an integer in [%ld, %ld]", launcher, name, text, lo, hi));
  return v;
}

long required(const char *name, long lo, long hi, const char *launcher) {
  const char *v = get(name);
  if (!v)
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s environment is incomplete: %s is not set", launcher, name));
  return parse_long(name, v, lo, hi, launcher);
}

long optional(const char *name, long def, long lo, long hi, const char *launcher) {
  const char *v = get(name);
  return v ? parse_long(name, v, lo, hi, launcher) : def;
}

int derived_port(unsigned long id) { return 20000 + static_cast<int>(id % 10000); }

// The first host of a Slurm node list: "n1", "n[3-5,9]", "n1,n2" or "a[01-02]b".
std::string first_slurm_host(const std::string &list) {
  std::string host;
  bool in_range = false, range_done = false;
  for (char c : list) {
    if (!in_range && c == ',') break;
    if (c == '[') {
      in_range = true;
      continue;
    }
    if (in_range) {
      if (c == ']') in_range = false;
      else if (c == ',' || c == '-') range_done = true;
      else if (!range_done) host += c;
      if (!in_range) range_done = false;
      continue;
    }
    host += c;
  }
  return host;
}

constexpr long kMaxWorld = 1 << 20;

// The launcher's name, world size, rank and local rank (defaulting to the rank)
// from its three variables.
void read_ranks(LaunchEnv &e, const char *launcher, const char *world, const char *rank, const char *local) {
  e.launcher = launcher;
  e.world = static_cast<int>(required(world, 1, kMaxWorld, launcher));
  e.rank = static_cast<int>(required(rank, 0, e.world - 1, launcher));
  e.local_rank = static_cast<int>(optional(local, e.rank, 0, kMaxWorld, launcher));
}

}  // namespace

LaunchEnv read_launch_env() {
  LaunchEnv e;
  if (get("CTR_RANK")) {
    read_ranks(e, "ctr launch", "CTR_WORLD_SIZE", "CTR_RANK", "CTR_LOCAL_RANK");
    if (const char *a = get("MASTER_ADDR")) e.addr = a;
    e.port = static_cast<int>(optional("MASTER_PORT", e.port, 1, 65535, e.launcher));
  } else if (get("RANK")) {
    read_ranks(e, "torchrun", "WORLD_SIZE", "RANK", "LOCAL_RANK");
    if (!get("CTR_MASTER_ADDR")) {
      if (!get("MASTER_ADDR"))
        fail(CTR_STATUS_INVALID_OPTION, "torchrun environment is incomplete: MASTER_ADDR is not set");
      e.addr = get("MASTER_ADDR");
    }
    if (!get("CTR_MASTER_PORT")) e.port = static_cast<int>(required("MASTER_PORT", 1, 65534, e.launcher)) + 1;
  } else if (get("SLURM_PROCID")) {
    read_ranks(e, "Slurm", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID");
    if (const char *a = get("MASTER_ADDR")) {
      e.addr = a;
    } else if (!get("CTR_MASTER_ADDR") && optional("SLURM_NNODES", 1, 1, kMaxWorld, e.launcher) > 1) {
      const char *nodes = get("SLURM_STEP_NODELIST") ? get("SLURM_STEP_NODELIST") : get("SLURM_JOB_NODELIST");
      if (!nodes)
        fail(CTR_STATUS_INVALID_OPTION,
             "Slurm environment is incomplete: a job on several nodes without SLURM_STEP_NODELIST or "
             "SLURM_JOB_NODELIST; set CTR_MASTER_ADDR to rank 0's node");
      e.addr = first_slurm_host(nodes);
    }
    if (const char *p = get("MASTER_PORT")) {
      e.port = static_cast<int>(parse_long("MASTER_PORT", p, 1, 65535, e.launcher));
    } else if (!get("CTR_MASTER_PORT")) {
      const long job = required("SLURM_JOB_ID", 0, 1L << 40, e.launcher);
      const long step = optional("SLURM_STEP_ID", 0, 0, 1L << 40, e.launcher);
      e.port = derived_port(static_cast<unsigned long>(job * 131 + step));
    }
  } else if (get("OMPI_COMM_WORLD_RANK")) {
    read_ranks(e, "Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK");
    if (const char *a = get("MASTER_ADDR")) {
      e.addr = a;
    } else if (!get("CTR_MASTER_ADDR") &&
               required("OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxWorld, e.launcher) != e.world) {
      fail(CTR_STATUS_INVALID_OPTION,
           "Open MPI environment: the ranks span several nodes and Open MPI does not say which is rank 0's; "
           "pass its address with mpirun -x CTR_MASTER_ADDR=HOST");
    }
    if (const char *p = get("MASTER_PORT")) {
      e.port = static_cast<int>(parse_long("MASTER_PORT", p, 1, 65535, e.launcher));
    } else if (!get("CTR_MASTER_PORT")) {
      e.port = derived_port(static_cast<unsigned long>(
          required("OMPI_MCA_ess_base_jobid", 0, 1L << 40, e.launcher)));
    }
  }
  if (const char *a = get("CTR_MASTER_ADDR")) e.addr = a;
  if (const char *p = get("CTR_MASTER_PORT"))
    e.port = static_cast<int>(parse_long("CTR_MASTER_PORT", p, 1, 65535, e.launcher ? e.launcher : "ctr"));
  return e;
}

}  // namespace ctr
