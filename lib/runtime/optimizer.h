// The optimizer over flat buffers: AdamW with decoupled weight decay,
// global-norm clipping and the learning-rate schedule.
//
// Parameters, their gradients and both moments share one layout (the memory
// plan gives a gradient the offset of its parameter), so a step is one sum of
// squares over the gradient buffer (then one all-reduce of a double when the
// gradients are sharded) and one fused AdamW pass over segments of the four
// buffers: one segment per parameter that received a gradient, carrying its
// weight decay. Gradient accumulation over micro-batches is one copy or one
// add over the whole buffer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace ctr {

class OptionReader;

struct OptimizerConfig {
  double lr = 3e-4, min_lr = 0;
  int64_t warmup_steps = 0, decay_steps = 0;
  std::string schedule = "cosine";
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double grad_clip = 1.0;
  bool check_finite = true;
  bool skip_nonfinite = false;  // on_nonfinite "skip": no update instead of a failure
  bool lr_override = false;
  double lr_fixed = 0;
};

// Reads the optimizer's step options (lr, schedule, betas, ...).
OptimizerConfig read_optimizer_options(OptionReader &r);

// The learning rate of optimizer step `step` (0-based).
double schedule_lr(const OptimizerConfig &c, int64_t step);

// AdamW's state for `floats` parameters: two moments, and the gradient
// accumulator when micro-batches are accumulated.
inline int64_t adamw_state_bytes(int64_t floats, bool accumulate) { return floats * 4 * (accumulate ? 3 : 2); }

class FlatOptimizer {
 public:
  struct Segment {
    int64_t offset;  // in floats, into the flat buffers
    int64_t count;
    bool decay;
  };
  // params, grads: flat device buffers of `floats` elements. accumulate: keep a
  // gradient accumulator (micro-batches > 1). Allocates m, v (and the
  // accumulator) on the backend; fails with CTR_STATUS_OUT_OF_MEMORY.
  FlatOptimizer(Backend be, float *params, float *grads, int64_t floats, std::vector<Segment> segments,
                bool accumulate);
  ~FlatOptimizer();
  FlatOptimizer(const FlatOptimizer &) = delete;
  FlatOptimizer &operator=(const FlatOptimizer &) = delete;

  float *m() const { return m_; }
  float *v() const { return v_; }
  int64_t state_bytes() const;
  // The gradient the update reads: the accumulator when there is one.
  const float *grads() const { return acc_ ? acc_ : grads_; }

  // After micro-batch mb's backward: acc = grads (mb 0) or acc += grads.
  void accumulate(int64_t mb);
  // The same over some elements only, [offset, offset + count) each: the
  // gradients one chunk's backward wrote (interleaved schedule).
  void accumulate(int64_t mb, const std::vector<std::pair<int64_t, int64_t>> &ranges);
  // This rank's sum of squares of the gradient.
  double sum_squares() const;
  // One AdamW step (t is 1-based) with the clipping scale applied to gradients.
  void update(const OptimizerConfig &c, double lr, double grad_scale, int64_t t);

 private:
  Backend be_;
  float *params_, *grads_;
  int64_t floats_;
  std::vector<Segment> segments_;
  float *m_ = nullptr, *v_ = nullptr, *acc_ = nullptr;
};

}  // namespace ctr
