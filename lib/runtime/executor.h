// The executor: runs a lowered program's instruction lists on the backend's
// streams.
//
// Everything an instruction needs is resolved once, when the executor is made:
// each kernel's function and its argument block (tensor addresses, shapes, the
// op's decoded parameters), each collective's communicator and buffers, the
// backend's events. Running a phase is then a walk over an array of
// instructions: kernels launch on stream 0, collectives are queued on the comm
// stream as host work (issue, then wait with the mesh's deadline), events order
// the two. A collective on a device communicator (NCCL) is issued from the
// calling thread at its place in the list, which orders it after the kernels
// queued before it on the device itself; only its wait goes to the comm stream. A collective's failure (a dead or hung peer) is kept and raised on
// the calling thread at the next wait on stream 0 or at the end of the phase,
// naming the collective and the peer; collectives queued after it are skipped.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/comm.h"
#include "comm/device_comm.h"
#include "passes/passes.h"

namespace ctr {

class Mesh;

class Executor {
 public:
  // addr: the device address of every tensor (by id), null for tensors without
  // storage. device: communicators over the backend's memory by axis (transport
  // "nccl"), or null; graph collectives on those axes run there, unstaged. The
  // executor keeps references to g, prog, mesh and device.
  Executor(const Graph &g, const Program &prog, const Mesh &mesh, Backend be, std::vector<void *> addr,
           const CommSet *device = nullptr);
  ~Executor();
  Executor(const Executor &) = delete;
  Executor &operator=(const Executor &) = delete;

  // Points tensor t at another address (an input's current micro-batch).
  void rebind(int t, void *addr);
  void *addr(int t) const { return addr_[static_cast<size_t>(t)]; }

  // Weight: the weight-gradient part of a split backward (Program::weight).
  enum class Phase { Forward, Backward, Weight };
  static const char *phase_name(Phase phase);
  // Runs one phase; returns once stream 0's work is issued and the comm stream
  // is drained. Throws the first collective failure. With chunks
  // (Program::chunk_range), chunk names the part of the phase to run (a task
  // of the interleaved schedule), launched as it is (not captured).
  void run(Phase phase, int chunk = -1);

  // Time the comm stream spent in collectives (issue to completion) since the
  // last call, in ms.
  double take_comm_ms();
  // Per mesh axis with collectives in this step's program: the time they were
  // in flight since the last call (milliseconds), in order of first use; reset.
  std::vector<std::pair<std::string, double>> take_comm_ms_by_axis();
  // Time stream 0 spent waiting for the comm stream (its waits on collectives'
  // events and the end-of-phase drain) since the last call, in ms: the
  // communication that compute did not hide.
  double take_exposed_ms();

  // Replay each phase as a captured graph where the backend can capture and the
  // phase is stream-0 work alone (no collectives): launched as it is at its
  // first run (the warm-up), captured at its second, replayed after; captured
  // again when an address it baked in changes (given up after a few times:
  // addresses that move every run). A phase that cannot be captured says why
  // once, on stderr. Off by default.
  void enable_graphs(bool on) { graphs_on_ = on; }
  // Graph replays and captures so far (for tests and metrics).
  int64_t graph_replays() const { return graph_replays_; }
  int64_t graph_captures() const { return captures_; }

  // Time each kernel on its own (stream 0 synchronised after each launch; no
  // captured graphs), for calibration: per node, the runs and the total
  // microseconds, leaving out each phase's first run. Off by default.
  void profile_kernels(bool on) { profile_ = on; }
  const std::vector<double> &kernel_us() const { return kernel_us_; }
  const std::vector<int64_t> &kernel_runs() const { return kernel_runs_; }

  // Fault injection for the failure tests: the process exits (status 87) right
  // after issuing its n-th collective from now, leaving it in flight.
  void exit_after_collectives(int n) { exit_countdown_ = n; }

 private:
  struct Call;        // a kernel launch, resolved
  struct HostBuffer;  // a staging buffer in host memory
  struct Collective;  // a collective, resolved
  static CommWork *issue_one(Collective &c, const void *send, void *recv);
  static void run_collective(void *user);
  void issue_device(Collective &c);
  static void wait_device(void *user);
  void note_failure(const Collective &c, ctr_status code, const std::string &msg);
  void issue(std::span<const Instr> list, Phase phase);
  // Runs the phase as a captured graph when graphs are on and it can; false
  // when it is to be launched as it is.
  bool run_captured(Phase phase, std::span<const Instr> list);
  void run_exchange(Collective &c);
  void exchange_rows(Collective &c, const std::vector<ctr_tensor_ref> &ins, const std::vector<ctr_tensor_ref> &outs);
  void raise_if_failed();
  // Throws CTR_STATUS_DEVICE_ERROR when the backend reports its sticky error,
  // naming the op just launched (node >= 0) or the last one launched.
  // replay: found right after a captured graph's replay.
  void check_device(int node, Phase phase, bool replay = false) const;
  int last_node_ = -1;  // the last kernel launched

  const Graph &g_;
  const Program &prog_;
  const Mesh &mesh_;
  Backend be_;
  bool staged_ = false;  // the backend's memory is not host memory: collectives stage it
  bool graphs_on_ = false;
  int graph_[3] = {-1, -1, -1};    // captured graph per phase, -1: none
  bool capturable_[3] = {false, false, false};
  std::string why_not_[3];           // why a phase cannot be captured ("": it can)
  bool said_[3] = {false, false, false};  // why_not_ printed
  int64_t runs_[3] = {0, 0, 0};
  std::vector<int64_t> chunk_runs_;  // interleaved: runs per (phase, chunk)
  int64_t captures_ = 0;
  int recaptures_ = 0;
  int64_t graph_replays_ = 0;
  void drop_graphs();
  std::vector<void *> addr_;
  std::vector<std::unique_ptr<Call>> calls_;        // by node, null for non-kernels
  std::vector<std::unique_ptr<Collective>> colls_;  // by node, null for non-collectives
  std::vector<int> events_;                         // program event -> backend event
  std::vector<int> streams_;                        // program stream -> backend stream
  // Tensor id -> the argument slots that point at it (for rebind).
  std::vector<std::vector<ctr_tensor_ref *>> refs_of_;

  std::atomic<bool> failed_{false};
  std::mutex err_mu_;
  ctr_status err_code_ = CTR_STATUS_OK;
  std::string err_msg_;
  std::atomic<int64_t> comm_ns_{0};
  // Per mesh axis the collectives run over: its name and their time in flight.
  std::vector<std::string> axis_names_;
  std::unique_ptr<std::atomic<int64_t>[]> axis_ns_;
  int64_t exposed_ns_ = 0;
  bool profile_ = false, counting_ = false;
  std::vector<double> kernel_us_;
  std::vector<int64_t> kernel_runs_;
  std::atomic<int> exit_countdown_{0};
};

}  // namespace ctr
