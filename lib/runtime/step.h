// The compiled training step: the pipeline's output plus everything that persists
// across steps (parameters, optimizer state, schedule position).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "api/handles.h"
#include "backend/backend.h"
#include "passes/passes.h"

namespace ctr {

struct PendingSave;

struct OptimizerConfig {
  double lr = 3e-4, min_lr = 0;
  int64_t warmup_steps = 0, decay_steps = 0;
  std::string schedule = "cosine";
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double grad_clip = 1.0;
  bool check_finite = true;
  bool lr_override = false;
  double lr_fixed = 0;
};

// The learning rate of optimizer step `step` (0-based).
double schedule_lr(const OptimizerConfig &c, int64_t step);

class Step {
 public:
  Step(const ctr_mesh &mesh, const ctr_graph &graph, const ctr_options *options);
  ~Step();
  Step(const Step &) = delete;
  Step &operator=(const Step &) = delete;

  void set_input(const std::string &name, const void *data, size_t bytes);
  void run(ctr_step_metrics *metrics);
  double evaluate();
  void get_param(const std::string &name, float *out, size_t count);
  void set_param(const std::string &name, const float *data, size_t count);
  void set_lr(double lr);
  int64_t count() const { return step_; }
  const MemoryPlan &plan() const { return plan_; }
  int64_t optimizer_bytes() const { return opt_bytes_; }
  int64_t peak_bytes() const;

  // Checkpoints (lib/ckpt/checkpoint.cc) and safetensors (lib/ckpt/safetensors.cc).
  // async: snapshot now, write in the background; the save is published (a
  // collective) by finish_save(), which the next run/save/load calls.
  void save(const std::string &dir, bool async = false);
  void finish_save();
  void maybe_finish_save();  // publish once the lag has passed (in run)
  void abandon_save();
  bool async_save() const { return async_save_; }
  void load(const std::string &dir);
  void export_safetensors(const std::string &path);
  void import_safetensors(const std::string &path, bool allow_extra);
  void attach_loader(ctr_loader *loader) { loader_ = loader; }
  void get_output(const std::string &name, float *out, size_t count);

  // For gradient checks: forward and backward on the current inputs without an
  // optimizer update (returns the loss), then the gradient of a parameter. The
  // gradients share arena bytes with forward activations: read them before the
  // next evaluate() or run().
  double forward_backward();
  void read_grad(const std::string &name, float *out, size_t count);
  const Graph &graph() const { return g_; }

 private:
  struct ParamSlot {
    int tensor;
    int grad;  // gradient tensor, -1 when no gradient reaches the param
    int64_t n;
    float *m, *v, *acc;
    bool decay;
  };
  struct InputSlot {
    int tensor;
    int64_t bytes;  // per micro-batch
    int64_t lo, hi; // valid id range [lo, hi) for int32 inputs; lo > hi = unchecked
    bool set = false;
  };

  void init_params(uint64_t seed);
  void run_collective(const Node &n);
  const ctr::Comm &axis_comm(const std::string &axis) const;
  int64_t full_numel(int t) const;
  void bind_micro_batch(int64_t mb);
  void run_list(const std::vector<Instr> &list);
  float *param_ptr(int t) const { return static_cast<float *>(ptr_[t]); }
  int find_param(const std::string &name, size_t count) const;
  void check_inputs_set(const char *what) const;

  const ctr_mesh &mesh_;
  Graph g_;
  CompileOptions copt_;
  OptimizerConfig oc_;
  MemoryPlan plan_;
  Program prog_;
  Backend be_;
  void *arena_ = nullptr, *params_ = nullptr, *inputs_ = nullptr, *consts_ = nullptr;
  float *state_ = nullptr;  // m, v and gradient accumulators, one allocation
  int64_t opt_bytes_ = 0;
  std::vector<void *> ptr_;
  std::vector<KernelFn> kernels_;  // per node; null for collectives
  std::vector<ParamSlot> slots_;
  std::vector<InputSlot> inputs_slots_;
  int64_t step_ = 0;
  int64_t tokens_per_micro_ = 0;
  ctr_loader *loader_ = nullptr;
  bool ran_forward_ = false;
  std::unique_ptr<PendingSave> pending_save_;
  double save_wait_ms_ = 0;
  bool async_save_ = false;
  int64_t async_save_lag_ = 2;
  // Fault injection for the failure tests (CTR_FAULT_INJECT, see step.cc).
  int64_t fault_step_ = -1;
  bool fault_hang_ = false;
  std::string options_json_;  // the options the step was created with, for checkpoints
  std::vector<int> kept_;     // tensors named in option "keep"

  // Agreement across ranks: true if any rank passes true.
  bool any_rank(bool flag);
  void world_barrier();
  // A param slot's placement: rows held locally, its first global row, the full
  // row count and the elements per row.
  struct Placement {
    int64_t rows, first_row, full_rows, row_elems, valid_rows;
  };
  Placement placement(const ParamSlot &s) const;
};

}  // namespace ctr
