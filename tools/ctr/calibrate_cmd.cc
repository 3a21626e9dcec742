// `ctr calibrate --base PROFILE -o OUT`: measures this process's device for the
// planner and writes a cluster profile: the base profile's hosts and links with
// the device's numbers replaced by measured ones.
//
// The gpt and llama presets (2 blocks, heads of 64, T=128) are built at widths
// 128, 256 and 512 and trained for a few steps on one rank with step option
// profile_kernels (each kernel timed on its own); every kernel node gives a
// point (FLOPs, bytes, microseconds) for its op. Per op, two lines are fitted
// by least squares of the relative error, time = launch + FLOPs / rate and
// time = launch + bytes / bandwidth, and the one with the smaller residual is
// kept (GEMMs and attention
// come out compute-bound, the rest bandwidth-bound): the profile's "ops". The
// device's flops is the rate of `linear` (the bulk of a step), its bytes_per_s
// and launch_us the medians over the bandwidth-bound ops. Each number's source
// names the machine, the date and the thread count. Run it as the job's ranks
// run: one thread per rank on a shared CPU (CTR_NUM_THREADS=1).

#include "calibrate_cmd.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "ctr/ctr.h"

namespace ctr_tool {

struct CalibrateCommand::Args {
  CLI::App *cmd = nullptr;
  std::string base, out;
  int64_t steps = 4;
};

CalibrateCommand::CalibrateCommand(CLI::App &app) : args_(std::make_unique<Args>()) {
  Args &a = *args_;
  a.cmd = app.add_subcommand("calibrate",
                             "Measure this machine's kernels (per op: launch time and FLOP/s or bandwidth) into a "
                             "cluster profile for `ctr plan`");
  a.cmd->add_option("--base", a.base, "Profile whose hosts and links to keep (JSON)")->required();
  a.cmd->add_option("-o,--output", a.out, "Profile to write")->required();
  a.cmd->add_option("--steps", a.steps, "Steps per model (the first is left out)")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000));
}

CalibrateCommand::~CalibrateCommand() = default;

bool CalibrateCommand::parsed() const { return args_->cmd->parsed(); }

namespace {

struct Failure {
  std::string what;
};

void check(ctr_status st, const std::string &what) {
  if (st != CTR_STATUS_OK) throw Failure{what + ": " + ctr_last_error()};
}

struct Point {
  double flops, bytes, us;
};

// Least squares of the relative error, y = a + k x weighted by 1 / y^2 (the
// kernels span three orders of magnitude; each should be priced within the
// same share); a and k clamped at 0. Returns (a, k, residual).
std::tuple<double, double, double> fit(const std::vector<Point> &pts, bool by_flops) {
  double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const Point &p : pts) {
    if (p.us <= 0) continue;
    const double w = 1.0 / (p.us * p.us), x = by_flops ? p.flops : p.bytes;
    sw += w;
    sx += w * x;
    sy += w * p.us;
    sxx += w * x * x;
    sxy += w * x * p.us;
  }
  const double den = sw * sxx - sx * sx;
  double k = den > 0 ? (sw * sxy - sx * sy) / den : 0.0;
  double a = sw > 0 ? (sy - k * sx) / sw : 0.0;
  if (a < 0) {  // through the origin
    a = 0;
    k = sxx > 0 ? sxy / sxx : 0.0;
  }
  k = std::max(k, 0.0);
  double res = 0;
  for (const Point &p : pts) {
    if (p.us <= 0) continue;
    const double e = (a + k * (by_flops ? p.flops : p.bytes) - p.us) / p.us;
    res += e * e;
  }
  return {a, k, res};
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One model's kernel profile: steps on one rank with profile_kernels.
nlohmann::json profile_model(const char *preset, int64_t dim, int64_t steps) {
  ctr_options *go = nullptr;
  ctr_options_create(&go);
  ctr_options_set_int(go, "layers", 2);
  ctr_options_set_int(go, "dim", dim);
  ctr_options_set_int(go, "heads", dim / 64);
  ctr_options_set_int(go, "seq", 128);
  ctr_graph *g = nullptr;
  const ctr_status gs = ctr_graph_create_preset(preset, go, &g);
  ctr_options_free(go);
  check(gs, std::string("building the ") + preset + " preset");
  ctr_mesh *mesh = nullptr;
  check(ctr_mesh_create(nullptr, &mesh), "creating a one-rank mesh");
  ctr_options *so = nullptr;
  ctr_options_create(&so);
  ctr_options_set_int(so, "batch", 4);
  ctr_options_set_int(so, "profile_kernels", 1);
  ctr_options_set_string(so, "precision", "fp32");
  ctr_step *step = nullptr;
  const ctr_status ss = ctr_step_create(mesh, g, so, &step);
  ctr_options_free(so);
  nlohmann::json out;
  try {
    check(ss, "creating the step");
    const char *vocab_text = nullptr;
    int64_t vocab = 256;
    if (ctr_graph_metadata(g, "vocab", &vocab_text) == CTR_STATUS_OK) vocab = std::stoll(vocab_text);
    std::mt19937 rng(7);
    std::vector<int32_t> ids(4 * 128);
    for (int64_t s = 0; s < steps; ++s) {
      for (const char *input : {"tokens", "targets"}) {
        for (int32_t &v : ids) v = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
        check(ctr_step_set_input(step, input, ids.data(), ids.size() * sizeof(int32_t)),
              std::string("setting input ") + input);
      }
      check(ctr_step_run(step, nullptr), "running a step");
    }
    const char *text = nullptr;
    check(ctr_step_kernel_profile(step, &text), "reading the kernel profile");
    out = nlohmann::json::parse(text);
  } catch (...) {
    ctr_step_free(step);
    ctr_mesh_free(mesh);
    ctr_graph_free(g);
    throw;
  }
  ctr_step_free(step);
  ctr_mesh_free(mesh);
  ctr_graph_free(g);
  return out;
}

}  // namespace

int CalibrateCommand::run() const {
  const Args &a = *args_;
  try {
    std::ifstream in(a.base);
    if (!in) throw Failure{"cannot open the base profile '" + a.base + "'"};
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json prof;
    try {
      prof = nlohmann::json::parse(ss.str());
    } catch (const std::exception &e) {
      throw Failure{"the base profile '" + a.base + "' is not JSON: " + e.what()};
    }
    if (!prof.is_object() || !prof.contains("device") || !prof["device"].is_object())
      throw Failure{"the base profile '" + a.base + "' has no 'device' object"};
    std::map<std::string, std::vector<Point>> points;
    for (const char *preset : {"gpt", "llama"})
      for (int64_t dim : {128, 256, 512}) {
        std::fprintf(stderr, "ctr calibrate: %s, width %lld\n", preset, static_cast<long long>(dim));
        for (const auto &k : profile_model(preset, dim, a.steps))
          points[k["op"].get<std::string>()].push_back(
              {k["flops"].get<double>(), k["bytes"].get<double>(), k["us"].get<double>()});
      }
    nlohmann::json ops = nlohmann::json::object();
    std::vector<double> launches, bandwidths;
    double linear_flops = 0;
    for (const auto &[op, pts] : points) {
      bool any_flops = false;
      for (const Point &p : pts) any_flops |= p.flops > 0;
      const auto [af, kf, rf] = fit(pts, true);
      const auto [ab, kb, rb] = fit(pts, false);
      const bool by_flops = any_flops && kf > 0 && (rf <= rb || kb <= 0);
      nlohmann::json e;
      if (by_flops) {
        e = {{"launch_us", af}, {"flops", 1e6 / kf}, {"points", pts.size()}};
        if (op == "linear") linear_flops = 1e6 / kf;
      } else if (kb > 0) {
        e = {{"launch_us", ab}, {"bytes_per_s", 1e6 / kb}, {"points", pts.size()}};
        bandwidths.push_back(1e6 / kb);
        launches.push_back(ab);
      } else {
        continue;  // no slope to fit (a constant time): the device's roofline prices it
      }
      ops[op] = e;
    }
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    const char *threads = std::getenv("CTR_NUM_THREADS");
    const std::string how = std::string("measured by ctr calibrate on ") + date + " (" +
                            (threads ? std::string("CTR_NUM_THREADS=") + threads : "all threads") +
                            "; gpt and llama presets, widths 128-512)";
    nlohmann::json &d = prof["device"];
    if (linear_flops > 0) d["flops"] = linear_flops;
    if (!bandwidths.empty()) d["bytes_per_s"] = median(bandwidths);
    if (!launches.empty()) d["launch_us"] = median(launches);
    prof["ops"] = ops;
    if (!prof.contains("sources") || !prof["sources"].is_object()) prof["sources"] = nlohmann::json::object();
    prof["sources"]["device.flops"] = how + ": the fitted rate of linear";
    prof["sources"]["device.bytes_per_s"] = how + ": the median bandwidth of the bandwidth-bound ops";
    prof["sources"]["device.launch_us"] = how + ": the median launch time of the bandwidth-bound ops";
    prof["sources"]["ops"] = how + ": per op, launch time and FLOP/s or bandwidth fitted to each kernel's time";
    std::ofstream o(a.out);
    o << prof.dump(1) << "\n";
    if (!o) throw Failure{"cannot write '" + a.out + "'"};
    std::printf("wrote %s: %zu ops; linear %.1f GFLOP/s, bandwidth %.1f GB/s, launch %.1f us\n", a.out.c_str(),
                ops.size(), d["flops"].get<double>() / 1e9, d["bytes_per_s"].get<double>() / 1e9,
                d["launch_us"].get<double>());
  } catch (const Failure &f) {
    std::fprintf(stderr, "ctr: error: calibrate: %s\n", f.what.c_str());
    return 1;
  }
  return 0;
}

}  // namespace ctr_tool
