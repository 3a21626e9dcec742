// ctr — the command-line face of libctr: build and inspect graph files, train.
//
//   ctr graph build --preset gpt --layers 4 --dim 256 -o tiny.ctrg
//   ctr graph inspect tiny.ctrg --after autodiff
//   ctr run tiny.ctrg --data corpus.bin --steps 1000 --batch 8
//   ctr data tokenize notes.txt -o corpus.bin
//   ctr plot m.jsonl -o m.svg
//   ctr launch -n 4 -- ctr check --mesh dp=2,fsdp=2
//   ctr version
//
// Everything goes through the public C ABI only, exactly as any host program
// would (the tool is built with include/ and libctr.so alone), so it doubles as
// the reference user of include/ctr/ctr.h: `graph inspect` through
// ctr_graph_inspect, `check` and the straggler report through the host
// collectives (ctr_mesh_all_reduce, ...), `data` through the token files
// (ctr_tokens_open, ctr_token_writer_*). Every failure is one line on stderr,
// "ctr: error: <status>: <message>", and exit status 1, or 75 for a failure of
// the job's machinery (exit_status below); bad usage exits 2, and `check` exits
// 3 for a slow rank.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ctr/ctr.h"
#include "text.h"
#include "tool_error.h"
#include "check_cmd.h"
#include "data_cmd.h"
#include "launch.h"
#include "calibrate_cmd.h"
#include "plan_cmd.h"
#include "plot_cmd.h"

namespace {

// ------------------------------------------------------------------------------------------
// Errors and handles

// A failure with an optional second line of advice (what to do about it).
class ToolError : public ctr_tool::Error {
 public:
  ToolError(ctr_status code, std::string msg, std::string note)
      : ctr_tool::Error(code, std::move(msg)), note_(std::move(note)) {}
  const std::string &note() const { return note_; }

 private:
  std::string note_;
};

// Exit statuses: 0 done, 1 a failure that a retry would meet again (bad input,
// data, checkpoint, options), 2 a usage error, kExitRetry a failure of the job's
// machinery that a restart from the last checkpoint may get past (a rank that
// died, hung or could not be reached). Launchers and schedulers read it:
// `ctr launch --max-restarts` restarts only on kExitRetry or a rank killed by a
// signal.
constexpr int kExitRetry = 75;

int exit_status(ctr_status code) {
  return code == CTR_STATUS_COMM_ERROR || code == CTR_STATUS_TIMEOUT ? kExitRetry : 1;
}

// A failure already printed (while the mesh was still up, so that it is seen at
// once rather than after the communicator's teardown); carries the exit status.
struct Reported {
  int status;
};

void print_error(const ctr_tool::Error &e) {
  std::fprintf(stderr, "ctr: error: %s: %s\n", ctr_status_string(e.code()), e.message().c_str());
}

// Turns a failed C call into an exception carrying its status and message. The
// message is copied at once: ctr_last_error() is only valid until the next call.
void check(ctr_status status) {
  if (status != CTR_STATUS_OK) throw ctr_tool::Error(status, ctr_last_error());
}

struct OptionsFree {
  void operator()(ctr_options *o) const { ctr_options_free(o); }
};
struct GraphFree {
  void operator()(ctr_graph *g) const { ctr_graph_free(g); }
};
struct MeshFree {
  void operator()(ctr_mesh *m) const { ctr_mesh_free(m); }
};
struct StepFree {
  void operator()(ctr_step *s) const { ctr_step_free(s); }
};
using Options = std::unique_ptr<ctr_options, OptionsFree>;
using Graph = std::unique_ptr<ctr_graph, GraphFree>;
using Mesh = std::unique_ptr<ctr_mesh, MeshFree>;
using Step = std::unique_ptr<ctr_step, StepFree>;

Options new_options() {
  ctr_options *o = nullptr;
  check(ctr_options_create(&o));
  return Options(o);
}

Graph load_graph(const std::string &path) {
  ctr_graph *g = nullptr;
  check(ctr_graph_load_file(path.c_str(), &g));
  return Graph(g);
}

void set_int(ctr_options *o, const char *key, int64_t v) { check(ctr_options_set_int(o, key, v)); }
void set_float(ctr_options *o, const char *key, double v) {
  check(ctr_options_set_float(o, key, v));
}
void set_string(ctr_options *o, const char *key, const std::string &v) {
  check(ctr_options_set_string(o, key, v.c_str()));
}

// ------------------------------------------------------------------------------------------
// Formatting

// 3412224 -> "3.41M"; keeps three significant digits, as people read sizes.
std::string human(double v) {
  static const char *const kSuffix[] = {"", "k", "M", "G", "T", "P"};
  int i = 0;
  while (std::fabs(v) >= 999.5 && i < 5) {
    v /= 1000;
    ++i;
  }
  const char *fmt = std::fabs(v) >= 99.95 ? "%.0f%s" : std::fabs(v) >= 9.995 ? "%.1f%s" : "%.2f%s";
  if (i == 0 && v == std::floor(v)) fmt = "%.0f%s";
  return ctr_tool::format(fmt, v, kSuffix[i]);
}

using ctr_tool::grouped;
using ctr_tool::ChosenPlan;
using ctr_tool::choose_plan;

// Seconds -> "m:ss" or "h:mm:ss".
std::string clock_time(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) seconds = 0;
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600)
    return ctr_tool::format("%" PRId64 ":%02" PRId64 ":%02" PRId64, s / 3600, s / 60 % 60, s % 60);
  return ctr_tool::format("%" PRId64 ":%02" PRId64, s / 60, s % 60);
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

const char *dtype_name(ctr_dtype t) {
  switch (t) {
    case CTR_DTYPE_F32: return "f32";
    case CTR_DTYPE_F16: return "f16";
    case CTR_DTYPE_BF16: return "bf16";
    case CTR_DTYPE_I32: return "i32";
    case CTR_DTYPE_I64: return "i64";
    case CTR_DTYPE_U16: return "u16";
    case CTR_DTYPE_U32: return "u32";
    case CTR_DTYPE_U8: return "u8";
    case CTR_DTYPE_F64: return "f64";
  }
  return "?";
}

struct TensorInfo {
  ctr_dtype dtype = CTR_DTYPE_F32;
  std::vector<int64_t> dims;  // -1 for a symbolic dim

  int64_t elements() const {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
  }
  std::string shape() const {
    std::string s = "[";
    for (size_t i = 0; i < dims.size(); ++i) {
      if (i > 0) s += ", ";
      s += dims[i] < 0 ? std::string("?") : std::to_string(dims[i]);
    }
    return s + "]";
  }
};

TensorInfo tensor_info(const ctr_graph *g, const char *name) {
  TensorInfo info;
  int64_t dims[16];
  size_t ndim = 0;
  check(ctr_graph_tensor_info(g, name, &info.dtype, dims, 16, &ndim));
  info.dims.assign(dims, dims + ndim);
  return info;
}

int64_t param_count(const ctr_graph *g) {
  int64_t n = 0;
  check(ctr_graph_param_count(g, &n));
  return n;
}

double flops_per_token(const ctr_graph *g, int64_t seq) {
  double f = 0;
  check(ctr_graph_flops_per_token(g, seq, &f));
  return f;
}

// ------------------------------------------------------------------------------------------
// ctr graph build

struct BuildArgs {
  std::string preset, out;
  int64_t layers = 0, dim = 0, heads = 0, kv_heads = 0, vocab = 0, seq = 0, ffn_dim = 0;
  bool tied = false;
  double rope_theta = 0, norm_eps = 0, init_std = 0;
  int64_t experts = 0, top_k = 0, shared_ffn_dim = 0, router_renorm = 0;
  double aux_loss = 0, z_loss = 0;
  std::string router_score;
  CLI::Option *router_score_opt = nullptr;
  // The options the user actually gave; the rest keep the preset's defaults.
  std::vector<std::pair<const char *, CLI::Option *>> given_int, given_float;
  CLI::Option *tied_opt = nullptr;
};

int cmd_graph_build(const BuildArgs &a) {
  Options opts = new_options();
  for (const auto &[key, opt] : a.given_int) {
    if (opt->count() == 0) continue;
    set_int(opts.get(), key, opt->as<int64_t>());
  }
  for (const auto &[key, opt] : a.given_float) {
    if (opt->count() == 0) continue;
    set_float(opts.get(), key, opt->as<double>());
  }
  if (a.tied_opt->count() > 0) set_int(opts.get(), "tied", a.tied ? 1 : 0);
  if (a.router_score_opt->count() > 0) check(ctr_options_set_string(opts.get(), "router_score", a.router_score.c_str()));

  ctr_graph *raw = nullptr;
  check(ctr_graph_create_preset(a.preset.c_str(), opts.get(), &raw));
  Graph graph(raw);
  check(ctr_graph_save_file(graph.get(), a.out.c_str()));

  const int64_t params = param_count(graph.get());
  std::printf("wrote %s: %s preset, %s parameters (%s), %s FLOPs/token (training, max seq)\n",
              a.out.c_str(), a.preset.c_str(), grouped(params).c_str(),
              human(static_cast<double>(params)).c_str(),
              human(flops_per_token(graph.get(), 0)).c_str());
  return 0;
}

// ------------------------------------------------------------------------------------------
// ctr graph inspect

// How the step is scheduled (the recompute, reorder and lower passes' options),
// for `graph inspect` and `run` alike.
struct ScheduleArgs {
  int64_t prefetch = 1, memory_budget = 0;
  bool no_defer = false, no_overlap = false, no_fuse = false, no_epilogues = false, sequence_parallel = false;
  std::string recompute = "none", bucket = "block", precision = "auto", reshard = "default";
  std::string pp_schedule = "1f1b", pp_stages, cp_mode = "gather";
  int64_t pp_virtual = 0;
  int64_t bucket_bytes = 0;

  void add_flags(CLI::App *cmd) {
    cmd->add_option("--prefetch", prefetch,
                    "Issue each all-gather this many blocks before the block that reads it (0: "
                    "right before its first use)")
        ->capture_default_str()
        ->check(CLI::Range(0, 64));
    cmd->add_flag("--no-defer-reduce", no_defer,
                  "Issue each gradient reduce-scatter right after its gradient, instead of behind "
                  "the next block's compute");
    cmd->add_option("--memory-budget", memory_budget,
                    "Bytes of activation memory the schedule may plan: prefetch and deferral "
                    "are reduced until the plan fits (0: no bound)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--bucket", bucket,
                    "Merge collectives: block (one per block and kind), bytes (up to "
                    "--bucket-bytes each) or none (one per tensor)")
        ->capture_default_str()
        ->check(CLI::IsMember({"block", "bytes", "none"}));
    cmd->add_option("--bucket-bytes", bucket_bytes, "Byte budget of a bucket with --bucket bytes (0: no bound)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    cmd->add_option("--recompute", recompute,
                    "Activation checkpointing per block: none, all (recompute every activation "
                    "backward reads) or selective (keep GEMM and attention outputs)")
        ->capture_default_str()
        ->check(CLI::IsMember({"none", "all", "selective"}));
    cmd->add_option("--reshard", reshard,
                    "Free gathered parameters after forward and gather them again for backward: "
                    "default (every block but the last, whose parameters backward reads first), "
                    "always, or never (keep every gathered parameter until backward)")
        ->capture_default_str()
        ->check(CLI::IsMember({"default", "always", "never"}));
    cmd->add_flag("--no-overlap", no_overlap,
                  "Wait for every collective as soon as it is issued (the baseline overlap is "
                  "measured against)");
    cmd->add_option("--precision", precision,
                    "Activation storage: bf16 (parameters, optimizer state, statistics and gradients "
                    "of parameters stay f32), fp32, or auto (bf16 where the device has bf16 kernels: "
                    "cuda; fp32 on the CPU)")
        ->capture_default_str()
        ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
    cmd->add_flag("--no-fuse", no_fuse,
                  "Keep exported primitive patterns as they are instead of rewriting them to fused ops "
                  "(attention, rmsnorm, swiglu, gelu, geglu, rope)");
    cmd->add_flag("--no-epilogues", no_epilogues,
                  "Keep bias gradients and GELU apart from their GEMMs instead of fusing them into "
                  "cuBLASLt's epilogues (cuda)");
    cmd->add_option("--pp-schedule", pp_schedule,
                    "Pipeline schedule over the pp axis: 1f1b (one forward and one backward in turn after a "
                    "warm-up; needs at least as many micro-batches as stages), gpipe (every forward, then "
                    "every backward) or zb (zero bubble: each backward split into its input- and its weight-"
                    "gradient part, the weight gradients filling the idle time) or interleaved (1f1b over "
                    "several chunks of the model per rank, --pp-virtual; micro-batches a multiple of the stages)")
        ->capture_default_str()
        ->check(CLI::IsMember({"1f1b", "gpipe", "zb", "interleaved"}));
    cmd->add_option("--pp-virtual", pp_virtual,
                    "With --pp-schedule interleaved: chunks of the model (virtual stages) per rank (default 2)")
        ->check(CLI::Range(1, 1024));
    cmd->add_option("--pp-stages", pp_stages,
                    "Blocks per pipeline stage, in stage order (\"2,3,3\"; default: balanced by forward FLOPs)");
    cmd->add_flag("--sequence-parallel", sequence_parallel,
                  "With a tp axis: split the activations between the tensor-parallel regions (norms, "
                  "residuals) by tokens over tp, with all-gathers and reduce-scatters in place of all-reduces");
    cmd->add_option("--cp-mode", cp_mode,
                    "Attention over a cp axis: gather (every rank's keys and values all-gathered), ulysses "
                    "(heads exchanged for positions all-to-all; cp must divide the heads and kv heads) or ring "
                    "(keys and values passed around the ranks, one block of attention per rank's keys)")
        ->capture_default_str()
        ->check(CLI::IsMember({"gather", "ulysses", "ring"}));
  }
  void set(ctr_options *o) const {
    set_int(o, "prefetch", prefetch);
    set_int(o, "defer_reduce", no_defer ? 0 : 1);
    set_int(o, "memory_budget", memory_budget);
    set_int(o, "overlap", no_overlap ? 0 : 1);
    set_int(o, "fuse", no_fuse ? 0 : 1);
    set_int(o, "epilogues", no_epilogues ? 0 : 1);
    set_int(o, "reshard_after_forward", reshard == "never" ? 0 : reshard == "always" ? 2 : 1);
    set_string(o, "recompute", recompute);
    set_string(o, "bucket", bucket);
    set_string(o, "precision", precision);
    set_string(o, "pp_schedule", pp_schedule);
    if (!pp_stages.empty()) set_string(o, "pp_stages", pp_stages);
    if (pp_virtual > 0) set_int(o, "pp_virtual", pp_virtual);
    if (bucket_bytes > 0) set_int(o, "bucket_bytes", bucket_bytes);
    if (sequence_parallel) set_int(o, "sequence_parallel", 1);
    set_string(o, "cp_mode", cp_mode);
  }
};

struct InspectArgs {
  std::string file, after = "verify";
  int64_t batch = 1, seq = 0, fsdp = 1, dp = 1, ep = 1, cp = 1, tp = 1, pp = 1, rank = 0, micro_batches = 1;
  ScheduleArgs schedule;
  CLI::Option *after_opt = nullptr, *seq_opt = nullptr;
};

void print_summary(const ctr_graph *g, const std::string &file) {
  const auto names = [g](size_t n, ctr_status (*get)(const ctr_graph *, size_t, const char **)) {
    std::vector<std::string> out;
    for (size_t i = 0; i < n; ++i) {
      const char *name = nullptr;
      check(get(g, i, &name));
      out.emplace_back(name);
    }
    return out;
  };
  const std::vector<std::string> inputs = names(ctr_graph_num_inputs(g), ctr_graph_input_name);
  const std::vector<std::string> params = names(ctr_graph_num_params(g), ctr_graph_param_name);
  int width = 8;
  for (const auto *list : {&inputs, &params})
    for (const auto &n : *list) width = std::max(width, static_cast<int>(n.size()));

  std::printf("\ngraph %s\n", file.c_str());
  std::printf("inputs (? = a symbolic dim, bound by the step's batch and seq):\n");
  for (const auto &name : inputs) {
    const TensorInfo t = tensor_info(g, name.c_str());
    std::printf("  %-*s  %-5s %s\n", width, name.c_str(), dtype_name(t.dtype), t.shape().c_str());
  }
  std::printf("params (%zu tensors):\n", params.size());
  for (const auto &name : params) {
    const TensorInfo t = tensor_info(g, name.c_str());
    std::printf("  %-*s  %-5s %-14s %12s\n", width, name.c_str(), dtype_name(t.dtype),
                t.shape().c_str(), grouped(t.elements()).c_str());
  }
  const int64_t count = param_count(g);
  std::printf("parameters: %s (%s)\n", grouped(count).c_str(),
              human(static_cast<double>(count)).c_str());
  std::printf("training FLOPs/token at max seq: %s\n", human(flops_per_token(g, 0)).c_str());
}

int cmd_graph_inspect(const InspectArgs &a) {
  Graph graph = load_graph(a.file);
  Options opts = new_options();
  set_int(opts.get(), "batch", a.batch);
  if (a.seq_opt->count() > 0) set_int(opts.get(), "seq", a.seq);
  set_int(opts.get(), "fsdp", a.fsdp);
  set_int(opts.get(), "dp", a.dp);
  set_int(opts.get(), "ep", a.ep);
  set_int(opts.get(), "cp", a.cp);
  set_int(opts.get(), "tp", a.tp);
  set_int(opts.get(), "pp", a.pp);
  set_int(opts.get(), "micro_batches", a.micro_batches);
  set_int(opts.get(), "rank", a.rank);
  a.schedule.set(opts.get());
  const char *text = nullptr;
  check(ctr_graph_inspect(graph.get(), opts.get(), a.after.c_str(), &text));
  const std::string dump = text;
  std::fputs(dump.c_str(), stdout);
  if (!dump.empty() && dump.back() != '\n') std::fputc('\n', stdout);
  if (a.after_opt->count() == 0) print_summary(graph.get(), a.file);
  return 0;
}

// ------------------------------------------------------------------------------------------
// ctr run

struct RunArgs {
  std::string graph, data, schedule = "cosine", metrics, device, mesh, transport, trace;
  std::string save_dir = "checkpoints", resume, export_safetensors, init_safetensors;
  std::string cluster;       // --mesh auto: the cluster profile
  int64_t global_batch = 0;  // --mesh auto: sequences per step over the job
  int64_t save_every = 0, keep = 3, stop_after = 0, memory_limit = 0;
  bool async_save = false;
  int64_t steps = 0, batch = 8, seq = 0, micro_batches = 1, warmup = 0, seed = 0, data_seed = 0;
  int64_t log_every = 10, eval_every = 0, eval_batches = 4, threads = 0;
  double lr = 3e-4, min_lr = 0, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, grad_clip = 1.0;
  CLI::Option *seq_opt = nullptr, *min_lr_opt = nullptr, *beta1_opt = nullptr,
              *beta2_opt = nullptr, *threads_opt = nullptr, *device_opt = nullptr,
              *mesh_opt = nullptr, *timeout_opt = nullptr, *transport_opt = nullptr;
  double timeout = 60;
  std::string on_nonfinite = "stop";
  bool no_graphs = false;
  int64_t straggler_every = 50;     // steps between straggler checks (0: none)
  double straggler_factor = 1.5;    // slower than the median by this: named
  int64_t idle_expert_steps = 100;  // an expert without tokens this many steps in a row: warned (0: never)
  double peak_flops = 0;  // per rank; 0: measured
  ScheduleArgs collectives;
};

// Stragglers: every rank's own time per step (compute, data and optimizer; not
// the time it waited for others) gathered on every rank; a rank slower than the
// median by `factor` is named. Collective over the world.
struct StragglerReport {
  std::vector<int> ranks;  // the slow ones
  std::string text;        // "rank 1: 45.1 ms/step (median 20.3 ms)" per slow rank
};

constexpr double kStragglerMinGapMs = 5.0;

// Per-step phase times of one rank, in ms: its own work (compute, data, optimizer)
// and the time it waited for communication.
struct PhaseTimes {
  double compute = 0, data = 0, optimizer = 0, exposed = 0;
  double own() const { return compute + data + optimizer; }
};

// `ctr run --trace FILE`: every rank's task events (ctr_step_timeline of each
// step) gathered on rank 0 and written as Chrome trace-event JSON, one process
// per rank, tasks and the optimizer on thread 0, waits for other pipeline stages
// on thread 1. Collective.
void write_trace(ctr_mesh *mesh, const nlohmann::json &events, const std::string &path) {
  const int world = ctr_mesh_world_size(mesh);
  std::string mine = events.dump();
  std::vector<std::string> texts{mine};
  if (world > 1) {
    const int64_t len = static_cast<int64_t>(mine.size());
    std::vector<int64_t> lens(static_cast<size_t>(world));
    check(ctr_mesh_all_gather(mesh, "world", &len, lens.data(), sizeof len));
    const int64_t most = *std::max_element(lens.begin(), lens.end());
    mine.resize(static_cast<size_t>(most), ' ');
    std::string all(static_cast<size_t>(most) * static_cast<size_t>(world), ' ');
    check(ctr_mesh_all_gather(mesh, "world", mine.data(), all.data(), static_cast<size_t>(most)));
    texts.clear();
    for (int r = 0; r < world; ++r)
      texts.push_back(all.substr(static_cast<size_t>(r) * static_cast<size_t>(most),
                                 static_cast<size_t>(lens[static_cast<size_t>(r)])));
  }
  if (ctr_mesh_rank(mesh) != 0) return;
  nlohmann::json out = nlohmann::json::array();
  for (size_t r = 0; r < texts.size(); ++r) {
    const int pid = static_cast<int>(r);
    int stage = 0;
    for (const auto &e : nlohmann::json::parse(texts[r])) {
      stage = e.value("stage", 0);
      const bool wait = e.value("cat", "") == "recv";
      out.push_back({{"name", e.at("name")}, {"cat", e.at("cat")}, {"ph", "X"}, {"ts", e.at("start_us")},
                     {"dur", e.at("dur_us")}, {"pid", pid}, {"tid", wait ? 1 : 0},
                     {"args", {{"step", e.value("step", 0)}, {"stage", stage}, {"micro_batch", e.value("micro_batch", -1)}}}});
    }
    out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
                   {"args", {{"name", ctr_tool::format("rank %d (stage %d)", pid, stage)}}}});
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0}, {"args", {{"name", "tasks"}}}});
    out.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 1},
                   {"args", {{"name", "waiting for other stages"}}}});
  }
  std::ofstream f(path, std::ios::out | std::ios::trunc);
  f << nlohmann::json{{"traceEvents", out}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  f.close();
  if (!f) throw ctr_tool::Error(CTR_STATUS_IO_ERROR, ctr_tool::format("cannot write trace file '%s'", path.c_str()));
}

StragglerReport find_stragglers(ctr_mesh *mesh, const PhaseTimes &mine, double factor) {
  StragglerReport out;
  const int world = ctr_mesh_world_size(mesh);
  if (world <= 1) return out;
  std::vector<PhaseTimes> ranks(static_cast<size_t>(world));
  check(ctr_mesh_all_gather(mesh, "world", &mine, ranks.data(), sizeof(PhaseTimes)));
  std::vector<double> all;
  for (const PhaseTimes &p : ranks) all.push_back(p.own());
  std::vector<double> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
  for (int r = 0; r < world; ++r) {
    // Both relative and absolute: a few milliseconds of jitter on a short step
    // is not a straggler.
    const double t = all[static_cast<size_t>(r)];
    if (median <= 0 || t <= factor * median || t - median < kStragglerMinGapMs) continue;
    out.ranks.push_back(r);
    const PhaseTimes &p = ranks[static_cast<size_t>(r)];
    out.text += ctr_tool::format("%srank %d: %.1f ms/step of its own work (median %.1f ms): compute "
                               "%.1f, data %.1f, optimizer %.1f; waiting for communication %.1f",
                               out.text.empty() ? "" : "; ", r, t, median, p.compute, p.data,
                               p.optimizer, p.exposed);
  }
  return out;
}


// Without --data, `ctr run` trains on the built-in corpus of seed 0 (the loader's
// default), the same text everywhere; --data-seed changes only the order.
// Steps a background checkpoint write gets before the step publishes it.
constexpr int64_t kAsyncSaveLag = 2;
// Evaluation without a file of its own reads text the model never trains on.
constexpr uint64_t kEvalCorpusSeed = 1;
constexpr int64_t kEvalCorpusBytes = int64_t{1} << 20;

// The sequence length when --seq is not given: dim 1 of the "tokens" input when
// it is fixed, else the graph's own "max_seq" (presets and exported models
// record it). A graph without it: a common size, 256, but no more than the rows
// of a learned position table ("wpe"), the one hard limit its parameters reveal.
int64_t default_seq(const ctr_graph *g) {
  const TensorInfo t = tensor_info(g, "tokens");
  if (t.dims.size() >= 2 && t.dims[1] > 0) return t.dims[1];
  const char *max_seq = nullptr;
  if (ctr_graph_metadata(g, "max_seq", &max_seq) == CTR_STATUS_OK) {
    const long long v = std::atoll(max_seq);
    if (v > 0) return v;
  }
  int64_t seq = 256;
  ctr_dtype dtype;
  int64_t dims[8];
  size_t ndim = 0;
  if (ctr_graph_tensor_info(g, "wpe", &dtype, dims, 8, &ndim) == CTR_STATUS_OK && ndim == 2 &&
      dims[0] > 0)
    seq = std::min(seq, dims[0]);
  return seq;
}

// The data shares of a mesh (ranks, or tensor-parallel groups) each train on
// their own share of one global batch. Every rank runs the same loader (same
// seed, same state), advances it by the whole global batch and reads only rows
// [share * local, (share + 1) * local), so the data order and the loader state do
// not depend on the number of ranks, and no share touches another's data.
class Batches {
 public:
  Batches(ctr_loader *loader, int64_t seq, int64_t local_rows, int rank, int world)
      : loader_(loader),
        global_rows_(local_rows * world),
        first_row_(rank * local_rows),
        rows_(local_rows),
        tokens_(static_cast<size_t>(local_rows * seq)),
        targets_(tokens_.size()) {}

  void next() {
    check(ctr_loader_next_slice(loader_, global_rows_, first_row_, rows_, tokens_.data(),
                                targets_.data()));
  }
  const int32_t *tokens() const { return tokens_.data(); }
  const int32_t *targets() const { return targets_.data(); }
  size_t bytes() const { return tokens_.size() * sizeof(int32_t); }

 private:
  ctr_loader *loader_;
  int64_t global_rows_, first_row_, rows_;
  std::vector<int32_t> tokens_, targets_;
};

struct LoaderDeleter {
  void operator()(ctr_loader *l) const { ctr_loader_free(l); }
};
using Loader = std::unique_ptr<ctr_loader, LoaderDeleter>;

Loader open_loader(const std::string &path, int64_t seq, uint64_t seed, int64_t corpus_bytes = 0,
                   uint64_t corpus_seed = 0) {
  Options o = new_options();
  set_int(o.get(), "seq", seq);
  set_int(o.get(), "seed", static_cast<int64_t>(seed));
  if (corpus_bytes > 0) set_int(o.get(), "corpus_bytes", corpus_bytes);
  if (corpus_seed > 0) set_int(o.get(), "corpus_seed", static_cast<int64_t>(corpus_seed));
  ctr_loader *l = nullptr;
  check(ctr_loader_create(path.empty() ? nullptr : path.c_str(), o.get(), &l));
  return Loader(l);
}

// ------------------------------------------------------------------------------------------
// Checkpoint directories (SAVE_DIR/step_00000100, ..., SAVE_DIR/latest) are the library's:
// ctr_step_save_checkpoint and ctr_step_resume. The tool only reports what they did.

// One warning per damaged checkpoint that ctr_step_resume passed over (its `skipped`
// lines, "DIR: reason"), each naming the one tried next.
void warn_skipped(const std::string &save_dir, const char *skipped, const char *loaded) {
  std::string root = save_dir;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  std::vector<std::pair<std::string, std::string>> passed;
  const std::string text = skipped;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    // DIR is SAVE_DIR/NAME and a name holds no ": ", so the reason starts at the first one after SAVE_DIR.
    const size_t colon = line.find(": ", line.rfind(root, 0) == 0 ? root.size() : 0);
    if (colon == std::string::npos)
      passed.emplace_back(line, "");
    else
      passed.emplace_back(line.substr(0, colon), line.substr(colon + 2));
    at = end + 1;
  }
  for (size_t k = 0; k < passed.size(); ++k)
    std::fprintf(stderr, "ctr: warning: %s is unusable (%s); trying %s\n", passed[k].first.c_str(),
                 passed[k].second.c_str(), k + 1 < passed.size() ? passed[k + 1].first.c_str() : loaded);
}

// Sets both inputs; an id outside the graph's vocabulary gets a hint that
// names the data (`what`) and its largest id, since the library can only name
// the position of the first bad id.
void set_inputs(ctr_step *step, const Batches &b, ctr_loader *loader, const std::string &what) {
  for (const auto &[name, data] :
       {std::pair{"tokens", b.tokens()}, std::pair{"targets", b.targets()}}) {
    const ctr_status s = ctr_step_set_input(step, name, data, b.bytes());
    if (s == CTR_STATUS_OK) continue;
    std::string msg = ctr_last_error();
    if (s != CTR_STATUS_DATA_ERROR) throw ctr_tool::Error(s, msg);
    int64_t max_token = 0;
    check(ctr_loader_info(loader, nullptr, &max_token));
    if (max_token > INT32_MAX)
      throw ToolError(s, msg,
                      ctr_tool::format("the data (%s) holds ids up to %lld, more than any int32 "
                                     "token id: it is damaged or was written with another dtype",
                                     what.c_str(), static_cast<long long>(max_token)));
    throw ToolError(
        s, msg,
        ctr_tool::format("the data (%s) holds token ids up to %lld; the graph's vocabulary "
                       "must be larger than that: build the graph with --vocab %lld or more, "
                       "or use data tokenized for this graph",
                       what.c_str(), static_cast<long long>(max_token),
                       static_cast<long long>(max_token + 1)));
  }
}

int cmd_run(const RunArgs &given) {
  using Clock = std::chrono::steady_clock;

  RunArgs a = given;  // --mesh auto fills in the plan's layout
  Graph graph = load_graph(a.graph);
  const int64_t seq = a.seq_opt->count() > 0 ? a.seq : default_seq(graph.get());

  // --mesh auto: every rank plans the same graph for the same job and gets the
  // same plan (the ranking is deterministic), before the mesh exists.
  std::optional<ChosenPlan> chosen;
  if (a.mesh == "auto") {
    if (a.cluster.empty())
      throw ctr_tool::Error(CTR_STATUS_INVALID_OPTION,
                       "--mesh auto needs --cluster FILE: the cluster profile the layouts are priced on "
                       "(profiles/ holds this machine's and H100/H200 nodes'; ctr calibrate writes one)");
    if (a.global_batch <= 0)
      throw ctr_tool::Error(CTR_STATUS_INVALID_OPTION,
                       "--mesh auto needs --global-batch N: the sequences per step over the whole job (the plan "
                       "chooses how they split over ranks and micro-batches, so --batch and --micro-batches are "
                       "its to choose)");
    chosen = choose_plan(graph.get(), a.cluster, a.global_batch, seq);
    a.mesh = chosen->mesh;
    a.batch = chosen->batch;
    a.micro_batches = chosen->micro_batches;
    a.collectives.pp_schedule = chosen->schedule;
    a.collectives.recompute = chosen->recompute;
    a.collectives.cp_mode = chosen->cp_mode;
    // The plan's memory and time are those of its precision: run in it.
    if (a.collectives.precision == "auto") {
      a.collectives.precision = chosen->precision;
    } else if (a.collectives.precision != chosen->precision) {
      throw ctr_tool::Error(CTR_STATUS_INVALID_OPTION,
                       ctr_tool::format("--mesh auto: --precision %s, but the cluster profile's device computes in %s "
                                      "(device.precision), which the plan was made for; leave --precision out or "
                                      "use a profile for %s",
                                      a.collectives.precision.c_str(), chosen->precision.c_str(),
                                      a.collectives.precision.c_str()));
    }
  } else if (!a.cluster.empty() || a.global_batch > 0) {
    throw ctr_tool::Error(CTR_STATUS_INVALID_OPTION,
                     "--cluster and --global-batch choose a plan: they go with --mesh auto (with a mesh given, "
                     "--batch is each data rank's micro-batch)");
  }

  // What the data is, for messages. The loader below owns the data; a file is
  // only mapped here to name its format (the built-in corpus is not built twice).
  std::string data_name = "synthetic corpus (seed 0)", data_kind;
  if (!a.data.empty()) {
    const char *name = nullptr, *kind = nullptr;
    check(ctr_data_describe(a.data.c_str(), &name, &kind));
    data_name = name;
    data_kind = kind;
  }
  const std::string data_what = data_kind.empty() ? data_name : data_name + ", " + data_kind;

  Options mesh_opts = new_options();
  if (a.threads_opt->count() > 0) set_int(mesh_opts.get(), "threads", a.threads);
  if (a.device_opt->count() > 0) set_string(mesh_opts.get(), "device", a.device);
  if (a.mesh_opt->count() > 0) set_string(mesh_opts.get(), "mesh", a.mesh);
  if (a.transport_opt->count() > 0) set_string(mesh_opts.get(), "transport", a.transport);
  if (a.timeout_opt->count() > 0) set_float(mesh_opts.get(), "timeout", a.timeout);
  ctr_mesh *raw_mesh = nullptr;
  check(ctr_mesh_create_from_env(mesh_opts.get(), &raw_mesh));
  Mesh mesh(raw_mesh);
  // Errors are printed here, before the mesh is torn down (which after a failure
  // may take a few seconds): the peer that failed is named at once.
  auto train = [&]() -> int {
    const int rank = ctr_mesh_rank(mesh.get());
    const int world = ctr_mesh_world_size(mesh.get());
    // The ranks of a tensor-parallel group read the same rows.
    const int data_rank = ctr_mesh_data_rank(mesh.get()), data_size = ctr_mesh_data_size(mesh.get());
    const bool lead = rank == 0;  // one rank speaks for the job

    // Opened before the (possibly slow) compile so that a bad path fails at once.
    // Only rank 0 writes: the ranks of a job may share one file system.
    std::ofstream metrics;
    if (lead && !a.metrics.empty()) {
      metrics.open(a.metrics, std::ios::out | std::ios::app);  // trimmed once the start is known
      if (!metrics)
        throw ctr_tool::Error(CTR_STATUS_IO_ERROR,
                         ctr_tool::format("cannot open metrics file '%s': %s", a.metrics.c_str(),
                                        std::strerror(errno)));
    }

    Options step_opts = new_options();
    set_int(step_opts.get(), "batch", a.batch);
    set_int(step_opts.get(), "seq", seq);
    set_int(step_opts.get(), "micro_batches", a.micro_batches);
    set_int(step_opts.get(), "seed", a.seed);
    set_float(step_opts.get(), "lr", a.lr);
    if (a.min_lr_opt->count() > 0) set_float(step_opts.get(), "min_lr", a.min_lr);
    set_int(step_opts.get(), "warmup_steps", a.warmup);
    set_int(step_opts.get(), "decay_steps", std::max<int64_t>(0, a.steps - a.warmup));
    set_string(step_opts.get(), "schedule", a.schedule);
  if (a.on_nonfinite == "skip") set_string(step_opts.get(), "on_nonfinite", "skip");
    if (a.no_graphs) set_int(step_opts.get(), "graphs", 0);
    if (a.memory_limit > 0) set_int(step_opts.get(), "memory_limit", a.memory_limit);
    set_float(step_opts.get(), "weight_decay", a.weight_decay);
    if (a.beta1_opt->count() > 0) set_float(step_opts.get(), "beta1", a.beta1);
    if (a.beta2_opt->count() > 0) set_float(step_opts.get(), "beta2", a.beta2);
    set_float(step_opts.get(), "grad_clip", a.grad_clip);
    a.collectives.set(step_opts.get());
    if (a.async_save) {
      set_int(step_opts.get(), "async_save", 1);
      set_int(step_opts.get(), "async_save_lag", kAsyncSaveLag);
    }
    ctr_step *raw_step = nullptr;
    check(ctr_step_create(mesh.get(), graph.get(), step_opts.get(), &raw_step));
    Step step(raw_step);

    const int64_t local_rows = a.batch * a.micro_batches;
    Loader train_loader = open_loader(a.data, seq, static_cast<uint64_t>(a.data_seed));
    Batches batches(train_loader.get(), seq, local_rows, data_rank, data_size);
    // The loader's position goes into checkpoints with the step.
    check(ctr_step_attach_loader(step.get(), train_loader.get()));

    if (!a.init_safetensors.empty()) {
      check(ctr_step_import_safetensors(step.get(), a.init_safetensors.c_str(), nullptr));
      if (lead) std::printf("parameters from %s\n", a.init_safetensors.c_str());
    }
    int64_t first_step = 1;
    if (!a.resume.empty()) {
      // "latest" falls back past damaged checkpoints to older ones; a path loads just that.
      const char *loaded = nullptr, *skipped = nullptr;
      const ctr_status st =
          ctr_step_resume(step.get(), a.save_dir.c_str(), a.resume.c_str(), &loaded, &skipped);
      // Nothing to resume from is a fresh start, so one command serves the first
      // attempt of a job and every restart.
      if (st == CTR_STATUS_NOT_FOUND && a.resume == "latest") {
        if (lead)
          std::printf("no checkpoint in %s yet: starting from step 0\n", a.save_dir.c_str());
      } else {
        check(st);
        if (lead) {
          if (skipped) warn_skipped(a.save_dir, skipped, loaded);
          std::printf("resumed from %s at step %" PRId64 "\n", loaded, ctr_step_count(step.get()));
        }
      }
      first_step = ctr_step_count(step.get()) + 1;
    }
    // A resumed (or rewound) run continues the metrics file of the run it
    // resumes: its lines before step `from` stay, later ones (written after that
    // checkpoint by a run that then failed or rewound) are replaced.
    auto restart_metrics_at = [&](int64_t from) {
      if (!metrics.is_open()) return;
      metrics.close();
      std::vector<std::string> kept;
      if (from > 1) {
        std::ifstream old(a.metrics);
        for (std::string line; std::getline(old, line);) {
          const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
          if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
              j["step"].get<int64_t>() < from)
            kept.push_back(line);
        }
      }
      metrics.open(a.metrics, std::ios::out | std::ios::trunc);
      for (const std::string &line : kept) metrics << line << '\n';
      metrics.flush();
    };
    restart_metrics_at(first_step);
    Options save_opts = new_options();
    set_int(save_opts.get(), "keep", a.keep);
    // A background save in flight: the library publishes it (and moves `latest`)
    // kAsyncSaveLag runs later or at the final wait; the tool only says so.
    std::string pending_save;
    int64_t pending_runs = 0;
    auto save = [&]() {
      const auto t0 = Clock::now();
      const char *path = nullptr;
      check(ctr_step_save_checkpoint(step.get(), a.save_dir.c_str(), save_opts.get(), &path));
      const std::string saved = path;
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
      if (a.async_save) {
        pending_save = saved;
        pending_runs = 0;
        if (lead) {
          std::printf("saving %s in the background (stall %.1f ms)\n", saved.c_str(), ms);
          std::fflush(stdout);
        }
        return;
      }
      if (lead) {
        std::printf("saved %s (%.0f ms)\n", saved.c_str(), ms);
        std::fflush(stdout);
      }
    };

    // Evaluation batches are the same every time, so successive eval losses are
    // comparable: a fresh loader with a fixed seed over held-out text (the
    // built-in corpus of another seed) or, for a file, over the training data.
    const std::string eval_what = a.data.empty() ? "batches of held-out synthetic text"
                                                 : "batches of the training data (no held-out file)";

    int64_t arena = 0, param_bytes = 0, opt_bytes = 0;
    check(ctr_step_memory(step.get(), &arena, &param_bytes, &opt_bytes));
    const int64_t params = param_count(graph.get());
    const double flops = flops_per_token(graph.get(), seq);
    // The peak MFU is reported against: given, or the device's peak for the
    // step's precision as the library measures it (0: unknown, no MFU). Only an
    // explicit bf16 computes in bf16 on the CPU; "auto" there is fp32.
    const bool bf16 = a.collectives.precision == "bf16";
    double peak = a.peak_flops;
    if (peak <= 0 && ctr_mesh_peak_flops_v2(mesh.get(), bf16 ? "bf16" : "fp32", &peak) != CTR_STATUS_OK) peak = 0;
    // Model FLOPs per second of one rank over its peak.
    auto mfu = [&](const ctr_step_metrics &m) {
      return m.step_ms > 0 && peak > 0
                 ? flops * static_cast<double>(m.tokens) / world / (m.step_ms / 1000.0) / peak
                 : 0.0;
    };

    if (lead) {
      if (chosen) std::printf("%s\n", chosen->report.c_str());
      int64_t data_tokens = 0;
      check(ctr_loader_info(train_loader.get(), &data_tokens, nullptr));
      const std::string kind = data_kind.empty() ? "" : data_kind + ", ";
      std::string shape = ctr_tool::format("batch %" PRId64 " x seq %" PRId64, a.batch, seq);
      if (a.micro_batches > 1) shape += ctr_tool::format(" x %" PRId64 " micro", a.micro_batches);
      if (world > 1) shape += ctr_tool::format(" x %d ranks", world);
      const std::string recompute =
          a.collectives.recompute == "none" ? "" : ", recompute " + a.collectives.recompute;
      std::printf("%s: %s params | data %s: %s%s tokens | %s | memory%s %.1f MiB (arena %.1f%s, "
                  "params %.1f, gradients %.1f, optimizer %.1f)\n",
                  a.graph.c_str(), human(static_cast<double>(params)).c_str(),
                  data_name.c_str(), kind.c_str(), human(static_cast<double>(data_tokens)).c_str(),
                  shape.c_str(), world > 1 ? " per rank" : "", mib(arena + 2 * param_bytes + opt_bytes),
                  mib(arena), recompute.c_str(), mib(param_bytes), mib(param_bytes), mib(opt_bytes));
      if (peak > 0)
        std::printf("MFU against %s FLOP/s per rank (%s)\n", human(peak).c_str(),
                    a.peak_flops > 0 ? "--peak-flops"
                    : bf16           ? "the measured bf16 peak of this process's threads"
                                     : "the measured fp32 FMA peak of this process's threads");
      else
        std::printf("MFU not shown: the peak of device '%s' is not measured (give --peak-flops)\n",
                    ctr_mesh_device(mesh.get()));
      std::fflush(stdout);
    }

    auto evaluate = [&](int64_t at) -> double {
      Loader eval_loader = a.data.empty() ? open_loader("", seq, 0, kEvalCorpusBytes, kEvalCorpusSeed)
                                          : open_loader(a.data, seq, 0);
      Batches eval(eval_loader.get(), seq, local_rows, data_rank, data_size);
      double sum = 0;
      for (int64_t i = 0; i < a.eval_batches; ++i) {
        eval.next();
        set_inputs(step.get(), eval, eval_loader.get(), data_what);
        double loss = 0;
        check(ctr_step_evaluate(step.get(), &loss));
        sum += loss;
      }
      const double mean = sum / static_cast<double>(a.eval_batches);
      if (lead) {
        std::printf("eval %*" PRId64 "/%" PRId64 " | loss %.4f | %" PRId64 " %s\n",
                    static_cast<int>(std::to_string(a.steps).size()), at, a.steps, mean,
                    a.eval_batches, eval_what.c_str());
        std::fflush(stdout);
      }
      return mean;
    };

    const int width = static_cast<int>(std::to_string(a.steps).size());
    double last_loss = NAN;
    double total_ms = 0, total_tokens = 0;
    double total_compute_ms = 0, total_comm_ms = 0, total_exposed_ms = 0;
    int64_t total_steps = 0;
    // Figures since the previous progress line, so each line describes the
    // recent rate rather than a whole-run average dominated by the first steps.
    double window_ms = 0, window_tokens = 0, window_wall = 0;
    double window_comm_ms = 0, window_exposed_ms = 0;
    std::vector<std::pair<std::string, double>> window_axes;  // comm ms per mesh axis
    int64_t window_steps = 0;
    const auto run_start = Clock::now();

    // --on-nonfinite rewind: steps whose batch is passed over once the run has
    // gone back to the checkpoint before them; a bound on how often.
    std::set<int64_t> skip_batch_at;
    int rewinds = 0;
    constexpr int kMaxRewinds = 8;
    nlohmann::json trace_events = nlohmann::json::array();  // --trace: this rank's task events
    constexpr size_t kMaxTraceEvents = 1 << 20;
    PhaseTimes own;  // this rank's phase times since the last straggler check (sums)
    int64_t own_steps = 0;
    bool first_step_seen = false;
    std::vector<int> stragglers;
    std::map<std::string, std::vector<int64_t>> idle_steps;  // per moe layer: steps each expert has had no token
    for (int64_t i = first_step; i <= a.steps; ++i) {
      const auto t0 = Clock::now();
      batches.next();
      if (skip_batch_at.count(i)) {
        batches.next();  // the batch that made step i non-finite, passed over
        if (lead) std::printf("step %" PRId64 ": passing over the batch that was not finite\n", i);
      }
      set_inputs(step.get(), batches, train_loader.get(), data_what);
      ctr_step_metrics m;
      std::memset(&m, 0, sizeof m);
      m.size = sizeof m;
      const ctr_status run_status = ctr_step_run(step.get(), &m);
      if (run_status == CTR_STATUS_NUMERIC_ERROR && a.on_nonfinite == "rewind") {
        const std::string why = ctr_last_error();
        if (++rewinds > kMaxRewinds || skip_batch_at.count(i))
          throw ctr_tool::Error(run_status, why + ctr_tool::format(" (after %d rewinds)", rewinds - 1));
        const char *loaded = nullptr, *skipped_dirs = nullptr;
        const ctr_status st =
            ctr_step_resume(step.get(), a.save_dir.c_str(), "latest", &loaded, &skipped_dirs);
        if (st == CTR_STATUS_NOT_FOUND)
          throw ToolError(run_status, why,
                          ctr_tool::format("--on-nonfinite rewind needs a checkpoint in '%s' "
                                         "(--save-every)", a.save_dir.c_str()));
        check(st);
        const int64_t at = ctr_step_count(step.get());
        skip_batch_at.insert(i);
        if (lead) {
          if (skipped_dirs) warn_skipped(a.save_dir, skipped_dirs, loaded);
          std::printf("step %" PRId64 ": not finite; rewound to %s (step %" PRId64 "), its batch "
                      "will be passed over\n", i, loaded, at);
          std::fflush(stdout);
        }
        restart_metrics_at(at + 1);
        i = at;  // the loop goes on with step at + 1
        continue;
      }
      check(run_status);
      if (!pending_save.empty() && ++pending_runs >= kAsyncSaveLag) {
        // This run published the background save (the step option's lag).
        if (lead) {
          std::printf("saved %s (the step waited %.1f ms for the writer)\n", pending_save.c_str(),
                      m.save_wait_ms);
          std::fflush(stdout);
        }
        pending_save.clear();
      }
      const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
      // Own work: the step less the time it waited for others, plus the data.
      // The run's first step is warm-up (kernels built, memory touched), which
      // no rank's times are compared by.
      if (!first_step_seen) {
        first_step_seen = true;
      } else {
        own.data += std::max(0.0, wall * 1000.0 - m.step_ms);
        own.compute += m.compute_ms;
        own.optimizer += m.optimizer_ms;
        own.exposed += m.exposed_comm_ms;
        ++own_steps;
      }
      if (a.straggler_every > 0 && i % a.straggler_every == 0) {
        const double n = static_cast<double>(std::max<int64_t>(own_steps, 1));
        const PhaseTimes mean{own.compute / n, own.data / n, own.optimizer / n, own.exposed / n};
        const StragglerReport rep = find_stragglers(mesh.get(), mean, a.straggler_factor);
        stragglers = rep.ranks;
        if (lead && !rep.ranks.empty()) {
          std::fprintf(stderr, "ctr: warning: straggler at step %" PRId64 ": %s\n", i, rep.text.c_str());
          std::fflush(stderr);
        }
        own = PhaseTimes{};
        own_steps = 0;
      }

      last_loss = m.loss;
      total_ms += m.step_ms;
      total_tokens += static_cast<double>(m.tokens);
      total_compute_ms += m.compute_ms;
      total_comm_ms += m.comm_ms;
      total_exposed_ms += m.exposed_comm_ms;
      ++total_steps;
      window_ms += m.step_ms;
      window_tokens += static_cast<double>(m.tokens);
      window_wall += wall;
      window_comm_ms += m.comm_ms;
      window_exposed_ms += m.exposed_comm_ms;
      ++window_steps;
      nlohmann::json comm_axes = nlohmann::json::object();
      {
        const char *text = nullptr;
        check(ctr_step_comm_metrics(step.get(), &text));
        comm_axes = nlohmann::json::parse(text);
        for (auto it = comm_axes.begin(); it != comm_axes.end(); ++it) {
          auto w = std::find_if(window_axes.begin(), window_axes.end(),
                                [&](const auto &p) { return p.first == it.key(); });
          if (w == window_axes.end()) w = window_axes.insert(window_axes.end(), {it.key(), 0.0});
          w->second += it.value().get<double>();
        }
      }

      if (!a.trace.empty() && trace_events.size() < kMaxTraceEvents) {
        const char *text = nullptr;
        check(ctr_step_timeline(step.get(), &text));
        for (auto &e : nlohmann::json::parse(text)) {
          e["step"] = i;
          trace_events.push_back(std::move(e));
        }
      }

      const bool log = a.log_every > 0 && (i == 1 || i % a.log_every == 0 || i == a.steps);
      if (lead && log) {
        const double n = static_cast<double>(window_steps);
        const double ms = window_ms / n;
        const double tok_s = window_ms > 0 ? window_tokens / (window_ms / 1000.0) : 0;
        const double eta = window_wall / n * static_cast<double>(a.steps - i);
        // One rank has no collectives: its communication figures are zero.
        // Per axis when the step communicates over more than one.
        std::string by_axis;
        if (window_axes.size() > 1)
          for (const auto &[axis, total] : window_axes)
            by_axis += ctr_tool::format("%s %s %.1f", by_axis.empty() ? ":" : ",", axis.c_str(), total / n);
        const std::string comm =
            world > 1 ? ctr_tool::format(" | comm %.1f ms%s (exposed %.1f)", window_comm_ms / n, by_axis.c_str(),
                                       window_exposed_ms / n)
                      : std::string();
        const double window_mfu = ms > 0 && peak > 0 ? flops * tok_s / world / peak : 0;
        const std::string skipped =
            m.skipped_steps > 0 ? ctr_tool::format(" | %" PRId64 " skipped (non-finite)", m.skipped_steps)
                                : std::string();
        std::printf("step %*" PRId64 "/%" PRId64 " | loss %.4f | grad %.3f | lr %.2e | %s tok/s | "
                    "MFU %.1f%% | %.0f ms/step | ETA %s%s%s\n",
                    width, i, a.steps, m.loss, m.grad_norm, m.lr, human(tok_s).c_str(),
                    100.0 * window_mfu, ms, clock_time(eta).c_str(), comm.c_str(), skipped.c_str());
        std::fflush(stdout);
        window_ms = window_tokens = window_wall = 0;
        window_comm_ms = window_exposed_ms = 0;
        for (auto &w : window_axes) w.second = 0;
        window_steps = 0;
      }

      // Mixture-of-experts layers: their load (tokens per expert) and auxiliary
      // losses, and a warning for an expert that has received nothing for a while.
      nlohmann::json moe = nlohmann::json::array();
      {
        const char *text = nullptr;
        check(ctr_step_moe_metrics(step.get(), &text));
        moe = nlohmann::json::parse(text);
        for (const auto &layer : moe) {
          const auto &tokens = layer.at("tokens_per_expert");
          std::vector<int64_t> &idle = idle_steps[layer.at("layer").get<std::string>()];
          idle.resize(tokens.size(), 0);
          for (size_t e = 0; e < tokens.size(); ++e) {
            idle[e] = tokens[e].get<int64_t>() == 0 ? idle[e] + 1 : 0;
            if (lead && a.idle_expert_steps > 0 && idle[e] == a.idle_expert_steps)
              std::fprintf(stderr,
                           "ctr: warning: step %" PRId64 ": expert %zu of %s has received no token for %" PRId64
                           " steps (its router never picks it: consider a larger aux-loss coefficient)\n",
                           i, e, layer.at("layer").get<std::string>().c_str(), a.idle_expert_steps);
          }
        }
      }

      std::optional<double> eval_loss;
      if (a.eval_every > 0 && (i % a.eval_every == 0 || i == a.steps)) eval_loss = evaluate(i);

      if (metrics.is_open()) {
        nlohmann::json j = {
            {"step", m.step},
            {"loss", m.loss},
            {"grad_norm", m.grad_norm},
            {"lr", m.lr},
            {"step_ms", m.step_ms},
            {"forward_ms", m.forward_ms},
            {"backward_ms", m.backward_ms},
            {"optimizer_ms", m.optimizer_ms},
            {"tokens_per_s", m.tokens_per_s},
            {"peak_bytes", m.peak_bytes},
            {"flops_per_token", flops},
            {"mfu", mfu(m)},
            {"peak_flops", peak},
            {"stragglers", stragglers},
            {"skipped_steps", m.skipped_steps},
            {"tokens", m.tokens},
            {"save_wait_ms", m.save_wait_ms},
            {"compute_ms", m.compute_ms},
            {"comm_ms", m.comm_ms},
            {"exposed_comm_ms", m.exposed_comm_ms},
            {"comm_ms_by_axis", comm_axes},
        };
        if (eval_loss) j["eval_loss"] = *eval_loss;
        if (!moe.empty()) j["moe"] = moe;
        if (chosen) {
          // What the plan predicted, beside what was measured, so every planned run checks the model.
          j["predicted_step_ms"] = chosen->step_ms;
          j["predicted_memory_bytes"] = chosen->memory_bytes;
        }
        metrics << j.dump() << '\n';
        metrics.flush();
        if (!metrics)
          throw ctr_tool::Error(CTR_STATUS_IO_ERROR,
                           ctr_tool::format("cannot write metrics file '%s'", a.metrics.c_str()));
      }
      const bool stopping = a.stop_after > 0 && i - first_step + 1 >= a.stop_after;
      if (a.save_every > 0 && (i % a.save_every == 0 || i == a.steps || stopping)) save();
      if (stopping) break;
    }
    if (!pending_save.empty()) {
      const auto tw = Clock::now();
      check(ctr_step_wait_save(step.get()));
      if (lead)
        std::printf("saved %s (waited %.0f ms at the end)\n", pending_save.c_str(),
                    std::chrono::duration<double, std::milli>(Clock::now() - tw).count());
      pending_save.clear();
    }
    if (!a.trace.empty()) {
      write_trace(mesh.get(), trace_events, a.trace);
      if (lead) std::printf("wrote %s (%zu task events of rank 0)\n", a.trace.c_str(), trace_events.size());
    }
    if (!a.export_safetensors.empty()) {
      check(ctr_step_export_safetensors(step.get(), a.export_safetensors.c_str()));
      if (lead) std::printf("wrote %s\n", a.export_safetensors.c_str());
    }

    if (lead) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
      // Means over the steps this invocation ran (not those before a resume).
      const double n = static_cast<double>(std::max<int64_t>(1, total_steps));
      std::string per_step = ctr_tool::format(" | compute %.1f ms", total_compute_ms / n);
      if (world > 1)
        per_step += ctr_tool::format(", comm %.1f ms (exposed %.1f)", total_comm_ms / n,
                                   total_exposed_ms / n);
      std::printf("done: %" PRId64 " steps in %s | final loss %.4f | mean %s tok/s%s per step\n",
                  a.steps, clock_time(elapsed).c_str(), last_loss,
                  human(total_ms > 0 ? total_tokens / (total_ms / 1000.0) : 0).c_str(),
                  per_step.c_str());
    }
    return 0;
  };
  try {
    return train();
  } catch (const ToolError &e) {
    print_error(e);
    if (!e.note().empty()) std::fprintf(stderr, "ctr: note: %s\n", e.note().c_str());
    throw Reported{exit_status(e.code())};
  } catch (const ctr_tool::Error &e) {
    print_error(e);
    throw Reported{exit_status(e.code())};
  }
}

// ------------------------------------------------------------------------------------------
// ctr export: a checkpoint's parameters as safetensors, under the graph's names.

struct ExportArgs {
  std::string graph, checkpoint, safetensors;
};

int cmd_export(const ExportArgs &a) {
  Graph graph = load_graph(a.graph);
  Options mesh_opts = new_options();
  ctr_mesh *raw_mesh = nullptr;
  check(ctr_mesh_create_from_env(mesh_opts.get(), &raw_mesh));
  Mesh mesh(raw_mesh);
  Options step_opts = new_options();
  set_int(step_opts.get(), "batch", 1);
  set_int(step_opts.get(), "seq", 1);
  ctr_step *raw_step = nullptr;
  check(ctr_step_create(mesh.get(), graph.get(), step_opts.get(), &raw_step));
  Step step(raw_step);
  if (!a.checkpoint.empty()) check(ctr_step_load(step.get(), a.checkpoint.c_str()));
  check(ctr_step_export_safetensors(step.get(), a.safetensors.c_str()));
  if (ctr_mesh_rank(mesh.get()) == 0)
    std::printf("wrote %s (%s at step %" PRId64 ")\n", a.safetensors.c_str(),
                a.checkpoint.empty() ? "initial parameters" : a.checkpoint.c_str(),
                ctr_step_count(step.get()));
  return 0;
}

// ------------------------------------------------------------------------------------------
// ctr version

int cmd_version() {
  std::printf("ctr %s (ABI %d)\n", ctr_version(), ctr_abi_version());
  return 0;
}

// ------------------------------------------------------------------------------------------
// Command line

// A numeric lower bound with a plain message ("must be >= 1, got 0"), where
// CLI11's Range would print the whole double range.
CLI::Validator at_least(double min, const std::string &name) {
  return CLI::Validator(
      [min](std::string &text) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "not a number: " + text;
        if (v < min) return ctr_tool::format("must be >= %g, got %s", min, text.c_str());
        return "";
      },
      name);
}
const CLI::Validator kPositive = at_least(1, "POSITIVE");
const CLI::Validator kNonNegative = at_least(0, "NONNEGATIVE");


int run_main(int argc, char **argv) {
  CLI::App app{"ctr: build, inspect and train libctr graphs"};
  app.require_subcommand(1);
  app.fallthrough(false);

  // graph build / inspect ------------------------------------------------------------------
  CLI::App *graph = app.add_subcommand("graph", "Build or inspect a graph file (.ctrg)");
  graph->require_subcommand(1);

  BuildArgs build;
  CLI::App *build_cmd = graph->add_subcommand("build", "Build a model preset and save it");
  build_cmd->add_option("--preset", build.preset, "Model family")
      ->required()
      ->check(CLI::IsMember({"gpt", "llama", "moe"}));
  build_cmd->add_option("-o,--output", build.out, "Graph file to write")->required();
  const auto int_opt = [&](const char *flag, const char *key, int64_t &var, const char *help) {
    build.given_int.emplace_back(
        key, build_cmd->add_option(flag, var, help)->check(kNonNegative));
  };
  int_opt("--layers", "layers", build.layers, "Transformer blocks");
  int_opt("--dim", "dim", build.dim, "Model width");
  int_opt("--heads", "heads", build.heads, "Attention heads");
  int_opt("--kv-heads", "kv_heads", build.kv_heads, "Key/value heads (llama)");
  int_opt("--vocab", "vocab", build.vocab, "Vocabulary size");
  int_opt("--seq", "seq", build.seq, "Longest sequence (positions)");
  int_opt("--ffn-dim", "ffn_dim", build.ffn_dim, "MLP hidden width (0 = preset default; moe: each expert's)");
  int_opt("--experts", "experts", build.experts, "Experts per MoE layer (moe, default 8)");
  int_opt("--top-k", "top_k", build.top_k, "Experts per token (moe, default 2)");
  int_opt("--shared-ffn-dim", "shared_ffn_dim", build.shared_ffn_dim,
          "Width of the shared expert every token also goes through (moe, default 0 = none)");
  int_opt("--router-renorm", "router_renorm", build.router_renorm,
          "1: the top-k weights are divided by their sum (moe, default 1 when top-k > 1)");
  const auto float_opt = [&](const char *flag, const char *key, double &var, const char *help) {
    build.given_float.emplace_back(key, build_cmd->add_option(flag, var, help));
  };
  float_opt("--rope-theta", "rope_theta", build.rope_theta, "Rotary base (llama)");
  float_opt("--norm-eps", "norm_eps", build.norm_eps, "Normalisation epsilon");
  float_opt("--init-std", "init_std", build.init_std, "Std of the normal weight init");
  float_opt("--aux-loss", "aux_loss", build.aux_loss, "Load-balancing loss coefficient (moe, default 0.01)");
  float_opt("--z-loss", "z_loss", build.z_loss, "Router z-loss coefficient (moe, default 0.001)");
  build.router_score_opt = build_cmd->add_option("--router-score", build.router_score,
                                                 "Router scores: softmax (default) or sigmoid (moe)")
                               ->check(CLI::IsMember({"softmax", "sigmoid"}));
  build.tied_opt = build_cmd->add_flag("--tied,!--untied", build.tied,
                                       "Share the input embedding with the output layer");

  InspectArgs inspect;
  std::vector<std::string> passes;
  for (const char *name = nullptr; ctr_pass_name(passes.size(), &name) == CTR_STATUS_OK;) passes.push_back(name);
  std::string pass_list;
  for (const auto &p : passes) pass_list += (pass_list.empty() ? "" : ", ") + p;
  CLI::App *inspect_cmd = graph->add_subcommand(
      "inspect", "Print a graph after a compiler pass (and, by default, a summary)");
  inspect_cmd->add_option("file", inspect.file, "Graph file")->required();
  inspect.after_opt =
      inspect_cmd
          ->add_option("--after", inspect.after,
                       "Stop after this pass and print the IR (default: verify, plus a "
                       "summary). Passes: " + pass_list)
          ->check(CLI::IsMember(passes));
  inspect_cmd->add_option("--batch", inspect.batch, "Batch size bound to the graph")
      ->check(kPositive);
  inspect.seq_opt =
      inspect_cmd->add_option("--seq", inspect.seq, "Sequence length (default: graph max)")
          ->check(kPositive);
  inspect_cmd->add_option("--fsdp", inspect.fsdp, "Shard over this many ranks (shard pass)")
      ->check(kPositive);
  inspect_cmd->add_option("--dp", inspect.dp, "Replicate over this many ranks (shard pass)")
      ->check(kPositive);
  inspect_cmd->add_option("--ep", inspect.ep, "Split experts over this many ranks (expert pass; mesh dp,ep,fsdp,cp,tp)")
      ->check(kPositive);
  inspect_cmd->add_option("--cp", inspect.cp, "Split sequences over this many ranks (place pass)")
      ->check(kPositive);
  inspect_cmd->add_option("--tp", inspect.tp, "Split heads and features over this many ranks (place pass)")
      ->check(kPositive);
  inspect_cmd->add_option("--pp", inspect.pp, "Pipeline stages (schedule pass; mesh pp,dp,ep,fsdp,cp,tp)")
      ->check(kPositive);
  inspect_cmd->add_option("--micro-batches", inspect.micro_batches, "Micro-batches per step (schedule pass)")
      ->check(kPositive);
  inspect_cmd->add_option("--rank", inspect.rank, "Which rank's placement to show")
      ->check(kNonNegative);
  inspect.schedule.add_flags(inspect_cmd);

  // run -------------------------------------------------------------------------------------
  RunArgs run;
  CLI::App *run_cmd = app.add_subcommand("run", "Train a graph");
  run_cmd->add_option("graph", run.graph, "Graph file")->required();
  run_cmd->add_option("--data", run.data,
                      "Token file (llm.c .bin, .npy) or any file read as bytes, or a manifest "
                      "of weighted datasets (.json) (default: the built-in synthetic English "
                      "corpus)");
  run_cmd->add_option("--steps", run.steps, "Optimizer steps")
      ->required()
      ->check(kPositive);
  run_cmd->add_option("--batch", run.batch, "Sequences per micro-batch (per rank)")
      ->capture_default_str()
      ->check(kPositive);
  run.seq_opt = run_cmd
                    ->add_option("--seq", run.seq,
                                 "Sequence length (default: the graph's, else 256)")
                    ->check(kPositive);
  run_cmd->add_option("--micro-batches", run.micro_batches,
                      "Gradient accumulation steps per optimizer step")->capture_default_str()
      ->check(kPositive);
  run_cmd->add_option("--lr", run.lr, "Peak learning rate")->capture_default_str()->check(kNonNegative);
  run.min_lr_opt = run_cmd->add_option("--min-lr", run.min_lr, "Final learning rate (0)")
                       ->check(kNonNegative);
  run_cmd->add_option("--warmup", run.warmup, "Linear warm-up steps")->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--schedule", run.schedule, "Decay after warm-up, over the rest")->capture_default_str()
      ->check(CLI::IsMember({"cosine", "linear", "constant"}));
  run_cmd->add_option("--weight-decay", run.weight_decay, "AdamW decoupled decay")->capture_default_str()
      ->check(kNonNegative);
  run.beta1_opt = run_cmd->add_option("--beta1", run.beta1, "AdamW beta1 (0.9)");
  run.beta2_opt = run_cmd->add_option("--beta2", run.beta2, "AdamW beta2 (0.95)");
  run_cmd->add_option("--grad-clip", run.grad_clip, "Global-norm clip, 0 = off")->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--seed", run.seed, "Parameter init seed")->capture_default_str();
  run_cmd->add_option("--data-seed", run.data_seed, "Data order seed")->capture_default_str();
  run_cmd->add_option("--metrics", run.metrics, "Write one JSON object per step to this file");
  run_cmd->add_option("--trace", run.trace,
                      "Write every rank's tasks (pipeline forwards and backwards, waits for other stages, the "
                      "optimizer) to this file as Chrome trace-event JSON (Perfetto opens it; ctr plot --timeline "
                      "draws it)");
  run_cmd->add_option("--log-every", run.log_every, "Steps between progress lines (0 = none)")->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--eval-every", run.eval_every, "Steps between evaluations (0 = none)")->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--eval-batches", run.eval_batches, "Batches per evaluation")->capture_default_str()
      ->check(kPositive);
  run.threads_opt = run_cmd->add_option("--threads", run.threads, "CPU worker threads")
                        ->check(kPositive);
  run.device_opt = run_cmd->add_option("--device", run.device, "cpu (default), or a backend plugin's device such as cuda (libctr-DEVICE.so)");
  run.mesh_opt = run_cmd->add_option(
      "--mesh", run.mesh,
      "Mesh axes, e.g. dp=2,fsdp=4 or fsdp=2,cp=2; or auto: the fastest feasible layout that ctr plan finds for "
      "this job's world on --cluster with --global-batch (mesh, micro-batches, schedule, recompute), printed and run");
  run_cmd->add_option("--cluster", run.cluster,
                      "With --mesh auto: the cluster profile the layouts are priced on (a JSON file; profiles/ has "
                      "this machine's and H100/H200 nodes')");
  run_cmd->add_option("--global-batch", run.global_batch,
                      "With --mesh auto: sequences per step over the whole job (the plan splits them over data "
                      "ranks and micro-batches)")
      ->check(CLI::PositiveNumber);
  run.transport_opt = run_cmd->add_option(
      "--transport", run.transport,
      "Communicator between ranks: ucx (default), or nccl with --device cuda (collectives on device memory)");
  run_cmd->add_flag("--no-graphs", run.no_graphs,
                    "Launch every kernel each step instead of replaying the step as a captured graph "
                    "(CUDA graphs; the CPU backend always launches)");
  run_cmd->add_option("--on-nonfinite", run.on_nonfinite,
                      "A step whose loss or gradient is not finite: stop (the run fails), skip "
                      "(no update; the run goes on), or rewind (back to the latest checkpoint, "
                      "passing over that batch)")
      ->capture_default_str()
      ->check(CLI::IsMember({"stop", "skip", "rewind"}));
  run_cmd->add_option("--idle-expert-steps", run.idle_expert_steps,
                      "Warn when an expert of a mixture-of-experts layer receives no token for this many steps "
                      "in a row (0: never)")
      ->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--straggler-every", run.straggler_every,
                      "Steps between checks for a rank slower than the others (0: none)")
      ->capture_default_str()
      ->check(kNonNegative);
  run_cmd->add_option("--straggler-factor", run.straggler_factor,
                      "A rank whose own time per step exceeds the median by this factor is named")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1000.0));
  run_cmd->add_option("--peak-flops", run.peak_flops,
                      "Peak FLOP/s of one rank that MFU is reported against (default on the CPU: "
                      "the fp32 FMA peak of this process's threads, measured once)")
      ->check(CLI::PositiveNumber);
  run_cmd->add_option("--memory-limit", run.memory_limit,
                      "Bytes of device memory a rank may plan for; step creation refuses a plan that needs more "
                      "(default: the machine's memory on the CPU)")
      ->check(CLI::PositiveNumber);
  run.timeout_opt = run_cmd->add_option("--timeout", run.timeout,
                                        "Seconds a rank waits for its peers before the job "
                                        "fails naming the missing rank (60)")
                        ->check(CLI::PositiveNumber);
  run_cmd->add_option("--save-every", run.save_every, "Save a checkpoint every N steps (and at the end)")
      ->check(kNonNegative);
  run_cmd->add_option("--save-dir", run.save_dir, "Directory of checkpoints")->capture_default_str();
  run_cmd->add_option("--keep", run.keep, "Checkpoints to keep")->capture_default_str()->check(kPositive);
  run_cmd->add_option("--resume", run.resume,
                      "Resume from a checkpoint directory, or 'latest' in --save-dir (falling back "
                      "to older ones if the newest is damaged)");
  run.collectives.add_flags(run_cmd);
  run_cmd->add_flag("--async-save", run.async_save,
                    "Snapshot checkpoints to memory and write them while training continues");
  run_cmd->add_option("--stop-after", run.stop_after,
                      "Stop after this many steps of this invocation (the schedule still spans "
                      "--steps; resume later with --resume)")
      ->check(kNonNegative);
  run_cmd->add_option("--init-safetensors", run.init_safetensors,
                      "Start from the parameters in this safetensors file (names as in the graph)");
  run_cmd->add_option("--export-safetensors", run.export_safetensors,
                      "Write the trained parameters as a safetensors file at the end");

  // launch ----------------------------------------------------------------------------------
  ctr_tool::LaunchOptions launch;
  CLI::App *launch_cmd = app.add_subcommand(
      "launch", "Start N local ranks of a job: ctr launch -n N [--port P] -- COMMAND ...");
  launch_cmd->add_option("-n,--nprocs", launch.nprocs, "Number of ranks")->required()->check(kPositive);
  launch_cmd->add_option("--port", launch.port, "Rendezvous port on 127.0.0.1 (default: a free one)")
      ->check(CLI::Range(1, 65535));
  launch_cmd->add_option("--grace-ms", launch.grace_ms,
                         "After a rank fails, time the others get to exit before SIGKILL")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd->add_option("--max-restarts", launch.max_restarts,
                         "Restart the job up to this many times after a failure a restart may "
                         "get past (a rank exiting with status 75 or killed by a signal); the "
                         "command resumes itself, e.g. ctr run ... --resume latest --save-dir D")
      ->capture_default_str()
      ->check(kNonNegative);
  launch_cmd->add_option("--stopped-ms", launch.stopped_ms,
                         "A rank stopped by a signal (SIGSTOP) this long fails the job")
      ->capture_default_str()
      ->check(kPositive);
  launch_cmd->add_option("command", launch.command, "The command each rank runs (after --)")
      ->required();
  launch_cmd->positionals_at_end(true);

  ExportArgs exp;
  CLI::App *export_cmd = app.add_subcommand(
      "export", "Write a graph's parameters (from a checkpoint) as a safetensors file");
  export_cmd->add_option("graph", exp.graph, "Graph file")->required();
  export_cmd->add_option("--checkpoint", exp.checkpoint,
                         "Checkpoint directory to read the parameters from (default: the "
                         "graph's initial parameters)");
  export_cmd->add_option("--safetensors", exp.safetensors, "Output file")->required();

  // data ------------------------------------------------------------------------------------
  ctr_tool::DataCommand data_cmd(app);

  // plot, check -----------------------------------------------------------------------------
  ctr_tool::PlotCommand plot_cmd(app);
  ctr_tool::PlanCommand plan_cmd(app);
  ctr_tool::CalibrateCommand calibrate_cmd(app);
  ctr_tool::CheckCommand check_cmd(app);

  CLI::App *version_cmd = app.add_subcommand("version", "Print the library and ABI version");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError &e) {
    // --help is a "parse error" that exits 0; real usage errors exit 2, the
    // convention of getopt-based tools, rather than CLI11's own codes.
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  if (build_cmd->parsed()) return cmd_graph_build(build);
  if (inspect_cmd->parsed()) return cmd_graph_inspect(inspect);
  if (run_cmd->parsed()) return cmd_run(run);
  if (version_cmd->parsed()) return cmd_version();
  if (launch_cmd->parsed()) return ctr_tool::launch(launch);
  if (data_cmd.parsed()) return data_cmd.run();
  if (plot_cmd.parsed()) return plot_cmd.run();
  if (plan_cmd.parsed()) return plan_cmd.run();
  if (calibrate_cmd.parsed()) return calibrate_cmd.run();
  if (check_cmd.parsed()) return check_cmd.run();
  if (export_cmd->parsed()) return cmd_export(exp);
  return 2;
}

}  // namespace

int main(int argc, char **argv) {
  try {
    return run_main(argc, argv);
  } catch (const Reported &r) {
    return r.status;
  } catch (const ToolError &e) {
    print_error(e);
    if (!e.note().empty()) std::fprintf(stderr, "ctr: note: %s\n", e.note().c_str());
    return exit_status(e.code());
  } catch (const ctr_tool::Error &e) {
    print_error(e);
    return exit_status(e.code());
  } catch (const std::bad_alloc &) {
    std::fprintf(stderr, "ctr: error: %s: out of memory\n",
                 ctr_status_string(CTR_STATUS_OUT_OF_MEMORY));
  } catch (const std::exception &e) {
    std::fprintf(stderr, "ctr: error: %s: %s\n", ctr_status_string(CTR_STATUS_INTERNAL),
                 e.what());
  }
  return 1;
}
