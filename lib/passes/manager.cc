// The pass manager: the one ordered list of compiler passes.
//
// Step creation, `ctr graph inspect --after PASS` and the pass names in help
// texts and error messages all read this list. Each entry names its pass, says
// which options it reads and how its result is printed; the pass itself lives in
// its own file.

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "backend/plugin.h"
#include "core/options.h"
#include "core/status.h"
#include "passes/passes.h"

namespace ctr {
namespace {

void read_shapes(OptionReader &r, CompileOptions &o) {
  o.batch = r.get_int("batch", 1, 1, 1 << 20);
  o.seq = r.get_int("seq", 0, 0, 1 << 24);
}

void read_shard(OptionReader &r, CompileOptions &o) {
  o.reshard_after_forward = static_cast<int>(r.get_int("reshard_after_forward", 1, 0, 2));
}

void read_lower(OptionReader &r, CompileOptions &o) { o.overlap = r.get_int("overlap", 1, 0, 1) != 0; }

void read_plan(OptionReader &r, CompileOptions &o) { o.micro_batches = r.get_int("micro_batches", 1, 1, 1 << 16); }

void read_schedule(OptionReader &r, CompileOptions &o) {
  o.pp_schedule = schedule_kind_from_name(r.get_string("pp_schedule", "1f1b"));
  o.pp_virtual = static_cast<int>(
      r.get_int("pp_virtual", o.pp_schedule == ScheduleKind::Interleaved ? 2 : 1, 1, 1 << 10));
  // "2,3,3": blocks per stage, in stage order.
  const std::string list = r.get_string("pp_stages", "");
  o.pp_stages.clear();
  size_t pos = 0;
  while (!list.empty() && pos <= list.size()) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    const std::string item = list.substr(pos, comma - pos);
    char *end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    CTR_REQUIRE(!item.empty() && *end == '\0' && v >= 0 && v <= (1 << 20), CTR_STATUS_INVALID_OPTION,
                "option 'pp_stages': '%s' is not a count of blocks (expected a list such as \"2,3,3\")",
                item.c_str());
    o.pp_stages.push_back(v);
    pos = comma + 1;
  }
}

void read_place(OptionReader &r, CompileOptions &o) {
  o.sequence_parallel = r.get_int("sequence_parallel", 0, 0, 1) != 0;
  o.cp_mode = r.get_string("cp_mode", "gather", {"gather", "ulysses", "ring"});
}

void run_nothing(PassContext &) {}
void run_verify(PassContext &c) { pass_verify(c.graph); }
void run_infer_shapes(PassContext &c) { pass_infer_shapes(c.graph, c.opt); }
void run_fuse(PassContext &c) { c.fused = pass_fuse(c.graph, c.opt); }
void run_expert(PassContext &c) { pass_expert(c.graph, c.opt); }
void run_place(PassContext &c) { c.placed = pass_place(c.graph, c.opt, c.has_kernel); }
void run_stages(PassContext &c) { c.stage_cut = pass_stages(c.graph, c.opt, c.pipeline); }
void run_autodiff(PassContext &c) {
  // The backend's layouts of saved outputs, before anything sizes them (the
  // reorder pass's memory-budget trials, recompute, the plan): after expert,
  // whose shape inference would undo them.
  apply_backend_layouts(c.graph, c.backend_flags);
  pass_autodiff(c.graph);
}
void run_recompute(PassContext &c) { pass_recompute(c.graph, c.opt); }
void run_precision(PassContext &c) {
  c.opt.precision = resolve_precision(c.graph, c.opt.precision, c.has_kernel, c.backend_flags);
  // The CPU backend (bf16 by opt-in) runs every kernel on widened bf16 data.
  c.precision =
      pass_precision(c.graph, c.opt.precision, (c.backend_flags & CTR_BACKEND_BF16_OPT_IN) != 0, &c.stage_cut);
}
void run_shard(PassContext &c) { pass_shard(c.graph, c.opt); }
void run_bucket(PassContext &c) { pass_bucket(c.graph, c.opt); }
void run_reorder(PassContext &c) { c.schedule = pass_reorder(c.graph, c.opt); }
void run_epilogues(PassContext &c) { c.epilogues = pass_epilogues(c.graph, c.opt, c.has_kernel); }
void run_split_backward(PassContext &c) { c.split = pass_split_backward(c.graph, c.opt); }
void run_lower(PassContext &c) {
  c.program = pass_lower(c.graph, c.has_kernel, c.opt.overlap, node_chunks(c.graph, c.stage_cut), c.stage_cut.chunks);
}
void run_plan(PassContext &c) {
  const auto &in_flight = c.pipeline.in_flight;
  const size_t stage = static_cast<size_t>(c.stage_cut.stage);
  c.plan = pass_plan_memory(c.graph, c.opt, c.program, stage < in_flight.size() ? in_flight[stage] : 1);
}
void run_schedule(PassContext &c) { c.pipeline = pass_schedule(c.graph, c.opt); }

std::string dump_place(const PassContext &c) { return c.placed + dump_graph(c.graph); }
std::string dump_lower(const PassContext &c) { return dump_program(c.graph, c.program); }

std::string dump_fuse(const PassContext &c) { return c.fused + dump_graph(c.graph); }

std::string dump_precision(const PassContext &c) { return c.precision + "\n" + dump_graph(c.graph); }

std::string dump_reorder(const PassContext &c) { return c.schedule + "\n" + dump_graph(c.graph); }

std::string dump_epilogues(const PassContext &c) { return c.epilogues + dump_graph(c.graph); }

std::string dump_split_backward(const PassContext &c) {
  return (c.split.empty() ? std::string("backward not split (only the zb schedule splits it)\n") : c.split) +
         dump_graph(c.graph);
}

std::string dump_schedule(const PassContext &c) {
  const Schedule &s = c.pipeline;
  return strformat("pipeline schedule %s: %d stage(s), %lld micro-batch(es)%s; each stage's tasks in order "
                   "(F forward, B backward (with zb: its input gradients), W its weight gradients, by micro-batch%s)\n",
                   schedule_kind_name(s.kind), s.stages, static_cast<long long>(s.micro_batches),
                   s.virtual_stages > 1 ? strformat(", %d virtual stages per rank", s.virtual_stages).c_str() : "",
                   s.virtual_stages > 1 ? "; cK: on the rank's chunk K, virtual stage K * stages + stage" : "") +
         schedule_text(s) +
         strformat("bubble %.1f%% with tasks timed forward 1, backward 2 (split: B 1 and W 1; on stage 0, "
                   "which has no input gradient, B 0 and W 2)\n",
                   100.0 * schedule_bubble(s)) +
         "\n" + dump_graph(c.graph);
}

std::string dump_stages(const PassContext &c) {
  const StageCut &s = c.stage_cut;
  if (s.stages <= 1) return "pipeline stages: one (the whole graph)\n" + dump_graph(c.graph);
  std::string out = strformat("pipeline stages: this rank runs stage %d of %d", s.stage, s.stages);
  if (s.chunks > 1) {
    out += strformat(", %d chunks (virtual stages", s.chunks);
    for (int k = 0; k < s.chunks; ++k) out += strformat("%s %d", k ? "," : "", k * s.stages + s.stage);
    out += ")";
  }
  out += "\n";
  auto chunk = [&](const StageCut::Boundary &b) {
    return s.chunks > 1 ? strformat(" (chunk %d)", b.chunk) : std::string();
  };
  for (const StageCut::Boundary &b : s.recv)
    out += strformat("  receives %s from stage %d%s%s\n", c.graph.describe_tensor(b.tensor).c_str(), b.peer,
                     chunk(b).c_str(), b.grad ? " (its gradient goes back)" : "");
  for (const StageCut::Boundary &b : s.send)
    out += strformat("  sends %s to stage %d%s%s\n", c.graph.describe_tensor(b.tensor).c_str(), b.peer,
                     chunk(b).c_str(), b.grad ? " (its gradient comes back)" : "");
  for (const auto &[name, bytes] : s.elsewhere_inputs) out += "  input '" + name + "' is read on other stages\n";
  for (const StageCut::Home &h : s.params) {
    if (h.stages.size() < 2) continue;
    std::string on;
    for (int st : h.stages) on += (on.empty() ? "" : ", ") + std::to_string(st);
    out += "  parameter '" + h.name + "' is read on stages " + on + " (its gradient is summed over them)\n";
  }
  return out + dump_graph(c.graph);
}

std::string dump_plan(const PassContext &c) {
  const MemoryPlan &p = c.plan;
  std::string held;
  const auto &in_flight = c.pipeline.in_flight;
  const size_t stage = static_cast<size_t>(c.stage_cut.stage);
  if (p.held_bytes < p.arena_bytes && stage < in_flight.size())
    held = strformat("; %lld bytes of it held from task to task, a copy per micro-batch in flight: %lld bytes for "
                     "%lld in flight",
                     static_cast<long long>(p.held_bytes), static_cast<long long>(p.arena_for(in_flight[stage])),
                     static_cast<long long>(in_flight[stage]));
  return strformat(
             "memory plan: arena %lld bytes (%.2f MiB; %.2f MiB without reuse%s), params %lld bytes "
             "(and as many for gradients), inputs %lld bytes\n",
             static_cast<long long>(p.arena_bytes), p.arena_bytes / 1048576.0, p.naive_bytes / 1048576.0,
             held.c_str(), static_cast<long long>(p.param_bytes), static_cast<long long>(p.input_bytes)) +
         dump_graph(c.graph);
}

}  // namespace

const std::vector<PassDef> &pass_list() {
  static const std::vector<PassDef> passes = {
      {"load", "the graph file as read", true, nullptr, run_nothing, nullptr},
      {"verify", "semantic checks and a topological order", true, nullptr, run_verify, nullptr},
      {"infer_shapes", "symbolic dims bound, every shape known", false, read_shapes, run_infer_shapes, nullptr},
      {"schedule", "the step as pipeline tasks per stage over pp (options pp_schedule: gpipe, 1f1b or zb, micro_batches)",
       false, read_schedule, run_schedule, dump_schedule},
      {"fuse", "exported primitive patterns rewritten to fused ops (attention, rmsnorm, swiglu, gelu, geglu, rope)", false,
       read_fuse_options, run_fuse, dump_fuse},
      {"expert", "experts split over ep, token exchanges and global load balance inserted", false, nullptr,
       run_expert, nullptr},
      {"place", "activations placed over tp and cp: column- and row-parallel regions, heads split, all-reduces "
                "inserted; sequences split over cp, keys and values gathered or heads exchanged (cp_mode)",
       false, read_place, run_place, dump_place},
      {"stages", "the forward graph cut to this rank's pipeline stage, activations crossing stages as inputs and "
                 "kept outputs",
       false, nullptr, run_stages, dump_stages},
      {"autodiff", "the backward graph appended", false, nullptr, run_autodiff, nullptr},
      {"recompute", "activation checkpointing: block forwards copied into backward", false,
       read_recompute_options, run_recompute, nullptr},
      {"precision", "activations stored as bf16 where the backend computes in bf16 (option precision)", false,
       read_precision_options, run_precision, dump_precision},
      {"shard", "parameters placed on the mesh, collectives inserted", false, read_shard, run_shard, nullptr},
      {"bucket", "collectives of a block merged into one (many tensors, no copies)", false, read_bucket_options,
       run_bucket, nullptr},
      {"reorder", "collectives moved under compute (prefetch, deferred reductions)", false, read_reorder_options,
       run_reorder, dump_reorder},
      {"epilogues", "GEMM epilogues fused where the backend has the kernels (bias gradient, GELU)", false,
       read_epilogue_options, run_epilogues, dump_epilogues},
      {"split_backward", "with the zb schedule: the backward ordered as input-gradient nodes (B), then "
                         "weight-gradient nodes (W)",
       false, nullptr, run_split_backward, dump_split_backward},
      {"lower", "instruction lists per stream, with events", false, read_lower, run_lower, dump_lower},
      {"plan_memory", "lifetimes over the schedule and a static arena", false, read_plan, run_plan, dump_plan},
  };
  return passes;
}

std::vector<std::string> pass_names() {
  std::vector<std::string> out;
  for (const PassDef &p : pass_list()) out.push_back(p.name);
  return out;
}

const PassDef &find_pass(const std::string &name) {
  for (const PassDef &p : pass_list())
    if (name == p.name) return p;
  std::string list;
  for (const PassDef &p : pass_list()) list += (list.empty() ? "" : ", ") + std::string(p.name);
  fail(CTR_STATUS_INVALID_ARGUMENT, strformat("unknown pass '%s' (passes: %s)", name.c_str(), list.c_str()));
}

CompileOptions read_compile_options(OptionReader &r) {
  CompileOptions o;
  for (const PassDef &p : pass_list())
    if (p.read_options) p.read_options(r, o);
  return o;
}

void run_passes(PassContext &ctx, const std::string &until) {
  if (!until.empty()) find_pass(until);  // an unknown name fails before any work
  for (const PassDef &p : pass_list()) {
    if (!p.at_load) {
      p.run(ctx);
      ctx.ran.push_back(p.name);
    }
    if (until == p.name) return;
  }
}

}  // namespace ctr
