// The compiled training step: what the pipeline produced plus the state that
// persists across steps.
//
// The step composes the core's units and owns none of their jobs: the pass
// manager compiles (passes/), the executor runs instruction lists on the
// backend's streams (executor.h), the flat optimizer updates (optimizer.h), the
// checkpointer saves and loads (ckpt/). The step allocates the regions of the
// memory plan on its backend and moves data between them and the host, always
// through backend copies: the host never dereferences step memory.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "ckpt/checkpoint.h"
#include "comm/device_comm.h"
#include "passes/passes.h"
#include "runtime/optimizer.h"

struct ctr_options;
struct ctr_step_metrics;

namespace ctr {

class Mesh;
class Executor;
namespace data {
class Loader;
}

class Step : private CheckpointState {
 public:
  Step(const Mesh &mesh, const Graph &graph, const ctr_options *options);
  ~Step();
  Step(const Step &) = delete;
  Step &operator=(const Step &) = delete;

  void set_input(const std::string &name, const void *data, size_t bytes);
  void run(ctr_step_metrics *metrics);
  double evaluate();
  void get_param(const std::string &name, float *out, size_t count);
  void get_param_local(const std::string &name, float *out, size_t count);
  void set_param(const std::string &name, const float *data, size_t count);
  void set_lr(double lr);
  int64_t count() const { return step_; }
  const MemoryPlan &plan() const { return plan_; }
  // The activations allocated: the planned arena, once per micro-batch in flight.
  int64_t arena_bytes() const { return plan_.arena_for(slots_in_flight_); }
  int64_t optimizer_bytes() const;
  int64_t peak_bytes() const;
  // Names of the passes that compiled this step, in order.
  const std::vector<std::string> &passes_run() const { return passes_run_; }

  // Checkpoints, through the step's Checkpointer (lib/ckpt/checkpoint.h).
  // async: snapshot now, write in the background; the save is published (a
  // collective) by finish_save(), which a later run (after the lag), save or
  // load calls. on_publish runs on rank 0 once the checkpoint is in place
  // (directory.cc moves `latest` and prunes there); a throw fails that call.
  void save(const std::string &dir, bool async = false, std::function<void()> on_publish = {});
  void finish_save();
  bool async_save() const { return async_save_; }
  void load(const std::string &dir);
  // Parameters by name with their full (unsharded) shapes, in graph order.
  struct ParamInfo {
    std::string name;
    std::vector<int64_t> full_shape;
  };
  std::vector<ParamInfo> params() const;
  const Mesh &mesh() const { return mesh_; }
  void attach_loader(data::Loader *loader, int64_t seq) {
    loader_ = loader;
    loader_seq_ = seq;
  }
  void get_output(const std::string &name, float *out, size_t count);

  // For gradient checks: forward and backward on the current inputs without an
  // optimizer update (returns the loss), then the gradient of a parameter.
  double forward_backward();
  void read_grad(const std::string &name, float *out, size_t count);
  const Graph &graph() const { return g_; }
  // Device address of a tensor (tests of the memory fence only).
  void *device_address(int t) const;
  // Phases replayed as captured graphs so far (the executor's count).
  int64_t graph_replays() const;

 private:
  struct ParamSlot {
    int tensor;
    int grad;  // gradient tensor, -1 when no gradient reaches the param
    int64_t n;
    float *m, *v;  // this param's moments within the flat buffers
    bool decay;
    bool norm_once_elsewhere = false;  // read by several stages: an earlier one counts it in the norm
  };
  struct InputSlot {
    int tensor;
    int64_t bytes;  // per micro-batch
    int64_t lo, hi; // valid id range [lo, hi) for int32 inputs; lo > hi = unchecked
    int64_t cur = 0; // offset in inputs_cur_
    bool set = false;
    bool internal = false;  // filled by the pipeline from another stage, not by the host
  };

  // CheckpointState
  std::vector<ShardView> checkpoint_shards() const override;
  void checkpoint_read(void *host, const void *device, size_t bytes) const override;
  void checkpoint_write(void *device, const void *host, size_t bytes) override;
  int64_t checkpoint_step() const override { return step_; }
  void checkpoint_set_step(int64_t step) override { step_ = step; }
  CheckpointInfo checkpoint_info() const;

  void init_params(uint64_t seed);
  int64_t full_numel(int t) const;
  void bind_micro_batch(int64_t mb);
  // The executor of micro-batch mb's activations (one per micro-batch in flight).
  Executor &exec_for(int64_t mb) const;
  // Pipeline stages: a message is the activation (or gradient) of a crossing
  // (StageCut::crossings) for one micro-batch.
  struct PpMessage {
    int crossing;
    int64_t mb;
    bool grad;
  };
  // Per other stage: what it sends this rank in a run of `order`, in its order.
  std::map<int, std::vector<PpMessage>> pp_expected(const std::vector<std::vector<Task>> &order) const;
  // Before a run of the schedule (or of the evaluation's order).
  void pp_begin(const std::map<int, std::vector<PpMessage>> &expect);
  // What a task receives into this stage's inputs (receives posted in the
  // order the peer sends, up to the ones it needs; false: it receives
  // nothing), and what it sends from its outputs; sends stay in flight until
  // finish_sends (the end of the step).
  bool pp_receive(const Task &task);
  void pp_send(const Task &task);
  void finish_sends();
  // Gradients of parameters several stages read (a tied embedding), summed
  // over those stages.
  void pp_sum_shared_grads();
  const StageCut::Home *pp_home(const std::string &name) const;
  float *param_ptr(int t) const;
  int find_param(const std::string &name, size_t count) const;
  void check_inputs_set(const char *what) const;
  double read_loss(int64_t mb) const;
 public:
  // The mixture-of-experts metrics of the last run, as JSON (ctr_step_moe_metrics).
  const std::string &moe_metrics() const { return moe_json_; }
  // The layers the last run reported (none before the first), and layer i.
  size_t moe_layer_count() const { return moe_json_.empty() ? 0 : moe_.size(); }
  const auto &moe_layer(size_t i) const { return moe_[i]; }
  // Per mesh axis, the time collectives over it were in flight in the last run
  // (ctr_step_comm_metrics), as a JSON object.
  const std::string &comm_metrics() const { return comm_json_; }
  // The tasks of the last run on this rank, as JSON (ctr_step_timeline).
  const std::string &timeline() const { return timeline_json_; }
  // With step option profile_kernels: per kernel node of this rank's program,
  // its op, phase, FLOPs, bytes, runs and mean microseconds, as JSON.
  const std::string &kernel_profile();

 private:
  // Writes host rows into a param's shard (its padding rows zero).
  void write_param(int t, const float *full);

  const Mesh &mesh_;
  Graph g_;
  CompileOptions copt_;
  OptimizerConfig oc_;
  MemoryPlan plan_;
  Program prog_;
  // The pipeline schedule; this rank runs the task list of its stage.
  Schedule pipeline_;
  int stage_ = 0;
  StageCut cut_;
  // Executors of micro-batches 1.. in flight (exec_ is the first), each over
  // its own copy of the arena.
  std::vector<std::unique_ptr<Executor>> more_exec_;
  int64_t slots_in_flight_ = 1;
  struct PendingSend {
    CommWork *work = nullptr;
    std::vector<char> bytes;
  };
  std::vector<PendingSend> sends_;
  std::map<int, std::vector<PpMessage>> pp_train_expect_, pp_eval_expect_;
  const std::map<int, std::vector<PpMessage>> *pp_expect_ = nullptr;  // this run's
  std::map<int, size_t> pp_posted_count_;                            // per peer: its messages posted
  struct PpPosted {
    CommWork *work = nullptr;
    std::vector<char> buf;
  };
  std::map<std::tuple<int, int64_t, bool>, PpPosted> pp_posted_;  // (crossing, mb, grad): not yet taken
  // The evaluation's order: per stage, every forward (micro-batch, then chunk).
  std::vector<std::vector<Task>> eval_order_;
  // Interleaved: per chunk, the gradient elements its backward writes ([offset, count) of the flat buffer).
  std::vector<std::vector<std::pair<int64_t, int64_t>>> chunk_grads_;
  // Buffers of transfers a failure left posted (kept: they may still be written or read).
  std::vector<std::vector<char>> orphans_;
  std::vector<std::vector<float>> orphan_floats_;
  BackendHandle backend_;
  Backend be_;
  // Transport "nccl": the device communicators of every axis, on be_.
  std::unique_ptr<CommSet> device_comms_;
  void *arena_ = nullptr, *params_ = nullptr, *grads_ = nullptr, *inputs_ = nullptr, *consts_ = nullptr;
  // With captured graphs and several micro-batches: the current micro-batch's
  // inputs at one fixed address, copied in from inputs_ before each forward.
  void *inputs_cur_ = nullptr;
  void free_buffers();  // the executor, optimizer, checkpointer and every allocation
  std::unique_ptr<Executor> exec_;
  std::unique_ptr<FlatOptimizer> opt_;
  std::vector<ParamSlot> slots_;
  // The gradient norm's partial sums: per group the mesh axes its gradients
  // are sharded over, and per slot its group (0: the one computed as the rest).
  std::vector<std::vector<std::string>> norm_groups_;
  std::vector<int> norm_group_of_;
  std::vector<InputSlot> inputs_slots_;
  std::vector<std::string> passes_run_;
  int64_t step_ = 0;
  int64_t tokens_per_micro_ = 0;
  data::Loader *loader_ = nullptr;
  int64_t loader_seq_ = 0;
  bool ran_forward_ = false;
  std::unique_ptr<Checkpointer> ckpt_;
  double save_wait_ms_ = 0;
  bool async_save_ = false;
  int64_t async_save_lag_ = 2;
  // Fault injection for the failure tests (CTR_FAULT_INJECT, see step.cc).
  int64_t fault_step_ = -1;
  bool fault_hang_ = false;
  bool fault_kill_ = false;
  bool fault_nan_ = false;
  int64_t fault_slow_ms_ = 0;
  int64_t skipped_steps_ = 0;  // updates skipped for a non-finite loss or gradient
  bool fault_in_comm_ = false;
  std::string options_json_;  // the options the step was created with, for checkpoints
  std::vector<int> kept_;     // tensors named in option "keep" (on this pipeline stage)
  std::map<std::string, int> kept_elsewhere_;  // named ones computed on another stage: that stage, or -1

  // Mixture-of-experts layers: what each step's metrics report of them.
  struct MoeLayer {
    std::string name;       // "layers.N.moe" (the permute node's name less its last part)
    int counts = -1;        // moe_permute's row counts per expert [E] (i32)
    int aux = -1, z = -1;   // the layer's auxiliary losses (scalars), -1 when absent
    bool here = true;       // on this rank's pipeline stage
    // The tensors' names in the graph as built, to find them again after the
    // stage cut renumbers the tensors ("" for an absent loss).
    std::string counts_name, aux_name, z_name;
    int64_t experts = 0;
    std::vector<int64_t> tokens;  // of the last step, summed over micro-batches and ranks
    double aux_loss = 0, z_loss = 0;
  };
  std::vector<MoeLayer> moe_;
  std::string moe_json_;
  std::string comm_json_ = "{}";
  std::string timeline_json_ = "[]";
  std::string kernel_profile_json_;
  bool profile_kernels_ = false;
  void find_moe_layers();
  // After the stage cut renumbered the tensors: the layers' tensors by name, and
  // whether the layer is on this stage.
  void place_moe_layers();
  void read_moe(int64_t mb);   // after micro-batch mb's forward
  void reduce_moe();           // after the step: over the ranks, into moe_json_

};

}  // namespace ctr
