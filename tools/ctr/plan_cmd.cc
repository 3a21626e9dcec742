// `ctr plan GRAPH --cluster FILE --world N --global-batch B [--seq T]`: every
// layout of the graph's step on N devices of the cluster, compiled and priced
// by ctr_plan, printed as a table ranked by predicted step time (infeasible
// layouts last, with the reason); --json prints ctr_plan's JSON as it is, and
// --explain K the K-th plan's breakdown (per stage task times and memory,
// communication per axis). Uses the public C ABI alone.

#include "plan_cmd.h"
#include "tool_error.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>

#include "ctr/ctr.h"

namespace ctr_tool {

struct PlanCommand::Args {
  CLI::App *cmd = nullptr;
  std::string graph, cluster, recompute = "none,all";
  int64_t world = 0, global_batch = 0, seq = 0, top = 20, explain = 0;
  bool json = false, no_prune = false;
};

PlanCommand::PlanCommand(CLI::App &app) : args_(std::make_unique<Args>()) {
  Args &a = *args_;
  a.cmd = app.add_subcommand("plan",
                             "Rank the layouts of a graph's training step on a cluster (mesh, pipeline schedule, "
                             "micro-batches, recompute), each compiled and priced from the cluster profile");
  a.cmd->add_option("graph", a.graph, "Graph file (.ctrg)")->required();
  a.cmd->add_option("--cluster", a.cluster,
                    "Cluster profile (JSON: devices per host, the device's FLOP/s, memory and bandwidth, the links "
                    "within a host and between hosts; profiles/ has this machine's and H100/H200 nodes')")
      ->required();
  a.cmd->add_option("--world", a.world, "Devices")->required()->check(CLI::PositiveNumber);
  a.cmd->add_option("--global-batch", a.global_batch, "Sequences per step over every data rank and micro-batch")
      ->required()
      ->check(CLI::PositiveNumber);
  a.cmd->add_option("--seq", a.seq, "Sequence length (default: the graph's maximum)")->check(CLI::NonNegativeNumber);
  a.cmd->add_option("--recompute", a.recompute, "Recompute policies to try, comma-separated")->capture_default_str();
  a.cmd->add_option("--top", a.top, "Plans to list (0: all)")->capture_default_str()->check(CLI::NonNegativeNumber);
  a.cmd->add_option("--explain", a.explain, "Print the breakdown of the K-th plan of the table (1 = the first)")
      ->check(CLI::PositiveNumber);
  a.cmd->add_flag("--json", a.json, "Print the planner's JSON instead of the table");
  a.cmd->add_flag("--no-prune", a.no_prune,
                  "Compile every candidate, even those the memory bounds already refuse (slower; the same plans)");
}

PlanCommand::~PlanCommand() = default;

bool PlanCommand::parsed() const { return args_->cmd->parsed(); }

namespace {

int failed(const char *what) {
  std::fprintf(stderr, "ctr: error: %s: %s\n", what, ctr_last_error());
  return 1;
}

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", bytes / 1073741824.0);
  return b;
}

}  // namespace

int PlanCommand::run() const {
  const Args &a = *args_;
  ctr_graph *graph = nullptr;
  if (ctr_graph_load_file(a.graph.c_str(), &graph) != CTR_STATUS_OK) return failed("loading the graph");
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  ctr_options_set_int(o, "world", a.world);
  ctr_options_set_int(o, "global_batch", a.global_batch);
  ctr_options_set_int(o, "seq", a.seq);
  ctr_options_set_string(o, "cluster", a.cluster.c_str());
  ctr_options_set_string(o, "recompute", a.recompute.c_str());
  if (a.no_prune) ctr_options_set_int(o, "prune", 0);
  const char *text = nullptr;
  const ctr_status st = ctr_plan(graph, o, &text);
  ctr_options_free(o);
  if (st != CTR_STATUS_OK) {
    const int rc = failed("plan");
    ctr_graph_free(graph);
    return rc;
  }
  const nlohmann::json r = nlohmann::json::parse(text);
  ctr_graph_free(graph);
  if (a.json) {
    std::printf("%s\n", r.dump(1).c_str());
    return 0;
  }
  const auto &plans = r["plans"];
  std::printf("%s: %lld devices (%s, %s), global batch %lld x seq %lld; %lld candidates (%lld compiled), %lld "
              "feasible, searched in %.2f s\n",
              r["cluster"].get<std::string>().c_str(), static_cast<long long>(r["world"].get<int64_t>()),
              r["device"].get<std::string>().c_str(), r["precision"].get<std::string>().c_str(), static_cast<long long>(r["global_batch"].get<int64_t>()),
              static_cast<long long>(r["seq"].get<int64_t>()), static_cast<long long>(r["candidates"].get<int64_t>()),
              static_cast<long long>(r["compiled"].get<int64_t>()), static_cast<long long>(r["feasible"].get<int64_t>()),
              r["search_s"].get<double>());
  std::printf("%4s  %-28s %-8s %6s %6s %-9s %10s %12s %7s %9s %7s %10s\n", "rank", "mesh", "schedule", "micro",
              "batch", "recompute", "step ms", "tokens/s", "MFU", "GiB/dev", "bubble", "exposed ms");
  int64_t k = 0;
  for (const auto &p : plans) {
    ++k;
    if (a.top > 0 && k > a.top) break;
    if (!p["feasible"].get<bool>() && !p.contains("step_ms")) {
      std::printf("%4lld  %-28s %s: %s\n", static_cast<long long>(k), p["mesh"].get<std::string>().c_str(),
                  p.value("pruned", false) ? "pruned" : "infeasible", p["why"].get<std::string>().c_str());
      continue;
    }
    std::printf("%4lld  %-28s %-8s %6lld %6lld %-9s %10.2f %12.0f %6.1f%% %9s %6.1f%% %10.2f%s%s\n",
                static_cast<long long>(k), p["mesh"].get<std::string>().c_str(),
                p["schedule"].get<std::string>().c_str(), static_cast<long long>(p["micro_batches"].get<int64_t>()),
                static_cast<long long>(p["batch"].get<int64_t>()), p["recompute"].get<std::string>().c_str(),
                p["step_ms"].get<double>(), p["tokens_per_s"].get<double>(), 100.0 * p["mfu"].get<double>(),
                gib(p["memory_bytes"].get<double>()).c_str(), 100.0 * p["bubble"].get<double>(),
                p["exposed_comm_ms"].get<double>(), p["feasible"].get<bool>() ? "" : "  infeasible: ",
                p["feasible"].get<bool>() ? "" : p["why"].get<std::string>().c_str());
  }
  if (a.explain > 0) {
    if (a.explain > static_cast<int64_t>(plans.size())) {
      std::fprintf(stderr, "ctr: error: --explain %lld: the table has %zu plans\n",
                   static_cast<long long>(a.explain), plans.size());
      return 1;
    }
    const auto &p = plans[static_cast<size_t>(a.explain - 1)];
    std::printf("\nplan %lld: %s\n", static_cast<long long>(a.explain), p.dump(1).c_str());
  }
  if (!r["sources"].empty()) {
    std::printf("\nprofile sources:\n");
    for (const auto &[k2, v] : r["sources"].items()) std::printf("  %s: %s\n", k2.c_str(), v.get<std::string>().c_str());
  }
  return 0;
}

ChosenPlan choose_plan(ctr_graph *graph, const std::string &cluster, int64_t global_batch, int64_t seq) {
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  ctr_options_set_int(o, "global_batch", global_batch);
  ctr_options_set_int(o, "seq", seq);
  ctr_options_set_string(o, "cluster", cluster.c_str());
  const char *text = nullptr;
  const ctr_status st = ctr_plan(graph, o, &text);
  ctr_options_free(o);
  if (st != CTR_STATUS_OK) throw ctr_tool::Error(st, std::string("--mesh auto: ") + ctr_last_error());
  const nlohmann::json r = nlohmann::json::parse(text);
  const auto &plans = r["plans"];
  const int64_t world = r["world"].get<int64_t>();
  std::vector<const nlohmann::json *> ok;
  for (const auto &p : plans)
    if (p["feasible"].get<bool>()) ok.push_back(&p);
  if (ok.empty()) {
    std::string why;
    for (size_t k = 0; k < plans.size() && k < 4; ++k)
      why += ctr_tool::format("\n  %s: %s", plans[k]["mesh"].get<std::string>().c_str(),
                            plans[k]["why"].get<std::string>().c_str());
    throw ctr_tool::Error(CTR_STATUS_UNSUPPORTED,
                     ctr_tool::format("--mesh auto: none of the %lld layouts of this graph on %lld devices of %s "
                                    "(global batch %lld) is feasible; the first:%s",
                                    static_cast<long long>(r["candidates"].get<int64_t>()),
                                    static_cast<long long>(world), r["cluster"].get<std::string>().c_str(),
                                    static_cast<long long>(global_batch), why.c_str()));
  }
  const nlohmann::json &p = *ok.front();
  ChosenPlan c;
  c.mesh = p["mesh"].get<std::string>() == "single" ? "dp=1" : p["mesh"].get<std::string>();
  c.schedule = p["schedule"].get<std::string>();
  c.recompute = p["recompute"].get<std::string>();
  c.cp_mode = p.value("cp_mode", std::string("gather"));
  c.precision = r.value("precision", std::string("fp32"));
  c.batch = p["batch"].get<int64_t>();
  c.micro_batches = p["micro_batches"].get<int64_t>();
  c.step_ms = p["step_ms"].get<double>();
  c.memory_bytes = p["memory_bytes"].get<int64_t>();
  auto describe = [](const nlohmann::json &q) {
    std::string d = ctr_tool::format("%s, %lld micro-batch%s of %lld", q["mesh"].get<std::string>().c_str(),
                                   static_cast<long long>(q["micro_batches"].get<int64_t>()),
                                   q["micro_batches"].get<int64_t>() > 1 ? "es" : "",
                                   static_cast<long long>(q["batch"].get<int64_t>()));
    if (q["mesh"].get<std::string>().find("pp=") != std::string::npos)
      d += ", schedule " + q["schedule"].get<std::string>();
    if (q.contains("cp_mode")) d += ", cp_mode " + q["cp_mode"].get<std::string>();
    if (q["recompute"].get<std::string>() != "none") d += ", recompute " + q["recompute"].get<std::string>();
    return d;
  };
  c.report = ctr_tool::format("plan: %s: predicted %.1f ms per step, %s GiB per device (%s, %s); the fastest of "
                            "%lld feasible layouts of %lld on %lld devices of %s, searched in %.2f s",
                            describe(p).c_str(), c.step_ms, gib(static_cast<double>(c.memory_bytes)).c_str(),
                            r["device"].get<std::string>().c_str(), c.precision.c_str(),
                            static_cast<long long>(r["feasible"].get<int64_t>()),
                            static_cast<long long>(r["candidates"].get<int64_t>()), static_cast<long long>(world),
                            r["cluster"].get<std::string>().c_str(), r["search_s"].get<double>());
  if (ok.size() > 1)
    c.report += ctr_tool::format("\nplan: next: %s at %.1f ms", describe(*ok[1]).c_str(),
                               (*ok[1])["step_ms"].get<double>());
  return c;
}

}  // namespace ctr_tool
