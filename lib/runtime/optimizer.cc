// The flat optimizer (see optimizer.h).

#include "runtime/optimizer.h"

#include <cmath>

#include "core/options.h"
#include "core/status.h"

namespace ctr {

OptimizerConfig read_optimizer_options(OptionReader &r) {
  OptimizerConfig c;
  c.lr = r.get_float("lr", 3e-4, 0, 10);
  c.min_lr = r.get_float("min_lr", 0, 0, 10);
  c.warmup_steps = r.get_int("warmup_steps", 0, 0);
  c.decay_steps = r.get_int("decay_steps", 0, 0);
  c.schedule = r.get_string("schedule", "cosine", {"cosine", "linear", "constant"});
  c.beta1 = r.get_float("beta1", 0.9, 0, 0.999999);
  c.beta2 = r.get_float("beta2", 0.95, 0, 0.999999);
  c.eps = r.get_float("eps", 1e-8, 0, 1);
  c.weight_decay = r.get_float("weight_decay", 0.1, 0, 10);
  c.grad_clip = r.get_float("grad_clip", 1.0, 0);
  c.check_finite = r.get_int("check_finite", 1, 0, 1) != 0;
  c.skip_nonfinite = r.get_string("on_nonfinite", "fail", {"fail", "skip"}) == "skip";
  return c;
}

double schedule_lr(const OptimizerConfig &c, int64_t step) {
  if (c.lr_override) return c.lr_fixed;
  if (step < c.warmup_steps)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  if (c.schedule == "constant" || c.decay_steps <= 0) return c.lr;
  double p = static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.decay_steps);
  p = std::min(1.0, std::max(0.0, p));
  if (c.schedule == "linear") return c.lr + (c.min_lr - c.lr) * p;
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * p));
}

FlatOptimizer::FlatOptimizer(Backend be, float *params, float *grads, int64_t floats, std::vector<Segment> segments,
                             bool accumulate)
    : be_(be), params_(params), grads_(grads), floats_(floats), segments_(std::move(segments)) {
  const size_t bytes = static_cast<size_t>(floats_) * 4;
  auto alloc = [&](const char *what) {
    void *p = be_.iface->alloc(be_.ctx, bytes);
    if (!p)
      fail(CTR_STATUS_OUT_OF_MEMORY,
           strformat("cannot allocate %zu bytes for the optimizer's %s", bytes, what));
    return static_cast<float *>(p);
  };
  try {
    m_ = alloc("first moments");
    v_ = alloc("second moments");
    if (accumulate) acc_ = alloc("gradient accumulator");
  } catch (...) {
    be_.iface->free(be_.ctx, m_);
    be_.iface->free(be_.ctx, v_);
    throw;
  }
}

FlatOptimizer::~FlatOptimizer() {
  be_.iface->free(be_.ctx, m_);
  be_.iface->free(be_.ctx, v_);
  be_.iface->free(be_.ctx, acc_);
}

int64_t FlatOptimizer::state_bytes() const { return adamw_state_bytes(floats_, acc_ != nullptr); }

void FlatOptimizer::accumulate(int64_t mb) {
  if (!acc_) return;
  if (mb == 0)
    be_.iface->copy_d2d(be_.ctx, acc_, grads_, static_cast<size_t>(floats_) * 4, 0);
  else
    be_.iface->add_into(be_.ctx, acc_, grads_, floats_, 0);
}

void FlatOptimizer::accumulate(int64_t mb, const std::vector<std::pair<int64_t, int64_t>> &ranges) {
  if (!acc_) return;
  for (const auto &[offset, count] : ranges) {
    if (mb == 0)
      be_.iface->copy_d2d(be_.ctx, acc_ + offset, grads_ + offset, static_cast<size_t>(count) * 4, 0);
    else
      be_.iface->add_into(be_.ctx, acc_ + offset, grads_ + offset, count, 0);
  }
}

double FlatOptimizer::sum_squares() const { return be_.iface->sum_squares(be_.ctx, grads(), floats_, 0); }

void FlatOptimizer::update(const OptimizerConfig &c, double lr, double grad_scale, int64_t t) {
  std::vector<ctr_adamw_segment> segs;
  segs.reserve(segments_.size());
  for (const Segment &s : segments_)
    segs.push_back({s.offset, s.count, static_cast<float>(s.decay ? c.weight_decay : 0.0)});
  ctr_adamw_args a{};
  a.param = params_;
  a.grad = grads();
  a.m = m_;
  a.v = v_;
  a.segments = segs.data();
  a.num_segments = static_cast<int64_t>(segs.size());
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(c.beta1);
  a.beta2 = static_cast<float>(c.beta2);
  a.eps = static_cast<float>(c.eps);
  a.grad_scale = static_cast<float>(grad_scale);
  a.t = t;
  be_.iface->adamw(be_.ctx, &a, 0);
}

}  // namespace ctr
