// The planner (see plan.h): candidates, each compiled by the step's passes
// and priced by playing its programs and its schedule.

#include "plan/plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <tuple>

#include "backend/backend.h"
#include "core/status.h"
#include "graph/ir.h"
#include "graph/ops.h"
#include "passes/passes.h"
#include "runtime/optimizer.h"

namespace ctr {
namespace {

using nlohmann::json;

const char *const kAxes[] = {"pp", "dp", "ep", "fsdp", "cp", "tp"};  // the mesh order, tp innermost
// The ring's program holds an attention block, a merge and a shift per source
// rank in every layer, so its compile time grows with cp; beyond this the
// search tries only the gathered and head-exchanging modes.
constexpr int64_t kMaxRing = 16;

double num(const json &j, const char *key, const std::string &what, bool positive = true) {
  CTR_REQUIRE(j.is_object() && j.contains(key) && j[key].is_number(), CTR_STATUS_INVALID_ARGUMENT,
              "%s: field '%s' (a number) is missing", what.c_str(), key);
  const double v = j[key].get<double>();
  CTR_REQUIRE(std::isfinite(v) && (positive ? v > 0 : v >= 0), CTR_STATUS_INVALID_ARGUMENT,
              "%s: field '%s' is %g (%s)", what.c_str(), key, v, positive ? "must be > 0" : "must be >= 0");
  return v;
}

// ------------------------------------------------------------------------------------------
// Pricing one compiled stage

struct Priced {
  double ms = 0, comm_ms = 0, exposed_ms = 0;
  std::map<std::string, double> comm_by_axis;
};

int64_t numel_of(const Graph &g, int t) {
  int64_t n = 1;
  for (int64_t d : g.tensors[static_cast<size_t>(t)].shape) n *= d;
  return n;
}

const std::vector<int64_t> &shape_of(const Graph &g, const Node &n, size_t input) {
  return g.tensors[static_cast<size_t>(n.inputs[input])].shape;
}

// FLOPs of a kernel: the registry's, and for the backward ops it leaves out,
// from their shapes (a GEMM's backward: two GEMMs; attention's: 2.5 forwards).
double flops_of(const Graph &g, const Node &n) {
  const OpDef *def = find_op(n.op);
  if (def && def->flops) return def->flops(g, n);
  const std::string &op = n.op;
  auto last = [](const std::vector<int64_t> &s) { return s.empty() ? 1.0 : static_cast<double>(s.back()); };
  if ((op == "linear_bwd_x" || op == "linear_bwd_x_dgelu") && !n.outputs.empty())
    return 2.0 * static_cast<double>(numel_of(g, n.outputs[0])) * last(shape_of(g, n, 0));
  if ((op == "linear_bwd_w" || op == "linear_bwd_wb") && !n.outputs.empty()) {
    const double rows = static_cast<double>(numel_of(g, n.inputs[0])) / last(shape_of(g, n, 0));
    return 2.0 * static_cast<double>(numel_of(g, n.outputs[0])) * rows;
  }
  if (op == "matmul_bwd" && n.inputs.size() >= 3)
    return 4.0 * static_cast<double>(numel_of(g, n.inputs[1])) * last(shape_of(g, n, 2));
  if (op == "moe_grouped_linear_bwd" && n.inputs.size() >= 3) {
    const auto &w = shape_of(g, n, 2);
    return 4.0 * static_cast<double>(numel_of(g, n.inputs[1])) * (w.size() > 1 ? static_cast<double>(w[1]) : 1.0);
  }
  if ((op == "attention_bwd" || op == "cp_attention_bwd") && n.inputs.size() >= 3) {
    const auto &q = shape_of(g, n, 1), &k = shape_of(g, n, 2);
    if (q.size() >= 3 && k.size() >= 2)
      return 2.5 * 4.0 * static_cast<double>(q[0]) * static_cast<double>(q[1]) * static_cast<double>(k[1]) *
             static_cast<double>(q[2]);
  }
  return 0;
}

double bytes_of(const Graph &g, const Node &n) {
  double b = 0;
  for (int t : n.inputs) b += static_cast<double>(g.tensors[static_cast<size_t>(t)].bytes());
  for (int t : n.outputs) b += static_cast<double>(g.tensors[static_cast<size_t>(t)].bytes());
  return b;
}

struct Layout {
  MeshPlacement mesh;
  int64_t world = 1;
};

// Ranks of the axis's group of rank 0 and whether they span hosts.
std::pair<int64_t, bool> axis_reach(const Layout &l, const std::string &axis, int64_t per_host) {
  if (axis == "world") return {l.world, l.world > per_host};
  if (axis == "stage") {
    const int64_t n = l.world / l.mesh.size("pp");
    return {n, n > per_host};
  }
  int64_t stride = 1, size = 1;
  bool found = false;
  for (auto it = l.mesh.axes.rbegin(); it != l.mesh.axes.rend(); ++it) {
    if (it->name == axis) {
      size = it->size;
      found = true;
      break;
    }
    stride *= it->size;
  }
  if (!found) return {1, false};
  return {size, (size - 1) * stride >= per_host};
}

double collective_ms(const Graph &g, const Node &n, const Layout &l, const ClusterProfile &c, std::string *axis_out) {
  const std::string axis = n.attr_string("axis", "");
  *axis_out = axis;
  const auto [ranks, across] = axis_reach(l, axis, c.devices_per_host);
  if (ranks <= 1) return 0;
  const ClusterProfile::Link &link = across ? c.network : c.host;
  double bytes = 0;
  const CollKind kind = collective_kind(n);
  if (kind == CollKind::AllGather) {
    for (int t : n.outputs) bytes += static_cast<double>(g.tensors[static_cast<size_t>(t)].bytes());
  } else {
    for (int t : n.inputs) bytes += static_cast<double>(g.tensors[static_cast<size_t>(t)].bytes());
  }
  // A ring shift moves the whole tensor to one neighbour.
  if (kind == CollKind::Shift) return link.latency_us * 1e-3 + bytes / link.bytes_per_s * 1e3;
  const double share = static_cast<double>(ranks - 1) / static_cast<double>(ranks);
  const double wire = bytes * share * (kind == CollKind::AllReduce ? 2.0 : 1.0);
  return (static_cast<double>(ranks - 1) * link.latency_us * 1e-3) + wire / link.bytes_per_s * 1e3;
}

Priced price_phase(const Graph &g, std::span<const Instr> list, const Layout &l, const ClusterProfile &c) {
  Priced p;
  double t0 = 0, t1 = 0;  // compute stream, comm stream (ms)
  std::map<int, double> ev;
  for (const Instr &in : list) {
    double &ts = in.stream == 0 ? t0 : t1;
    switch (in.kind) {
      case Instr::Kernel: {
        const Node &n = g.nodes[static_cast<size_t>(in.node)];
        if ((n.op == "reshape" || n.op == "fanout") && n.outputs.size() == 1 &&
            g.tensors[static_cast<size_t>(n.outputs[0])].offset == g.tensors[static_cast<size_t>(n.inputs[0])].offset &&
            g.tensors[static_cast<size_t>(n.outputs[0])].storage == g.tensors[static_cast<size_t>(n.inputs[0])].storage)
          break;  // a view: the executor drops it
        if (auto it = c.ops.find(n.op); it != c.ops.end()) {
          const ClusterProfile::OpRate &r = it->second;
          ts += r.launch_us * 1e-3 + (r.flops > 0 ? flops_of(g, n) / r.flops : bytes_of(g, n) / r.bytes_per_s) * 1e3;
        } else {
          ts += c.launch_us * 1e-3 +
                std::max(flops_of(g, n) / c.flops, bytes_of(g, n) / c.bytes_per_s) * 1e3;
        }
        break;
      }
      case Instr::Collective: {
        std::string axis;
        const double ms = collective_ms(g, g.nodes[static_cast<size_t>(in.node)], l, c, &axis);
        ts += ms;
        p.comm_ms += ms;
        p.comm_by_axis[axis] += ms;
        break;
      }
      case Instr::Fill: ts += static_cast<double>(in.bytes) / c.bytes_per_s * 1e3; break;
      case Instr::Record: ev[in.event] = ts; break;
      case Instr::Wait: {
        const double at = ev.count(in.event) ? ev[in.event] : 0.0;
        if (in.stream == 0 && at > t0) p.exposed_ms += at - t0;
        ts = std::max(ts, at);
        break;
      }
    }
  }
  if (t1 > t0) p.exposed_ms += t1 - t0;
  p.ms = std::max(t0, t1);
  return p;
}

// ------------------------------------------------------------------------------------------
// Candidates

struct Candidate {
  std::map<std::string, int64_t> axes;
  int64_t micro_batches = 1, batch = 1;
  ScheduleKind schedule = ScheduleKind::OneFOneB;  // interleaved: 2 chunks per rank (pp_virtual's default)
  std::string recompute = "none";
  std::string cp_mode = "gather";  // with cp: gathered keys and values, or heads exchanged (ulysses)
  std::string mesh_text() const {
    std::string s;
    for (const char *a : kAxes)
      if (axes.at(a) > 1) s += (s.empty() ? "" : ",") + std::string(a) + "=" + std::to_string(axes.at(a));
    return s.empty() ? "single" : s;
  }
};

struct StageCost {
  double f = 0, b = 0, w = 0;  // per micro-batch (ms)
  std::vector<double> chunk_f, chunk_b;  // interleaved: per chunk
  double comm_ms = 0, exposed_ms = 0;
  std::map<std::string, double> comm_by_axis;
  int64_t memory = 0, param_bytes = 0;
  double send_bytes = 0;  // activations sent forward per micro-batch
};

void factorizations(int64_t n, size_t axis, std::map<std::string, int64_t> &cur, bool moe,
                    std::vector<std::map<std::string, int64_t>> &out) {
  if (axis == std::size(kAxes)) {
    if (n == 1) out.push_back(cur);
    return;
  }
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    if (std::string(kAxes[axis]) == "ep" && d > 1 && !moe) continue;
    cur[kAxes[axis]] = d;
    factorizations(n / d, axis + 1, cur, moe, out);
  }
}

}  // namespace

double kernel_flops(const Graph &g, const Node &n) { return flops_of(g, n); }
double kernel_bytes(const Graph &g, const Node &n) { return bytes_of(g, n); }

ClusterProfile parse_cluster_profile(const std::string &text, const std::string &what) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception &e) {
    fail(CTR_STATUS_INVALID_ARGUMENT, strformat("%s: not JSON: %s", what.c_str(), e.what()));
  }
  CTR_REQUIRE(j.is_object(), CTR_STATUS_INVALID_ARGUMENT, "%s: not a JSON object", what.c_str());
  ClusterProfile c;
  c.name = j.value("name", std::string("unnamed"));
  c.devices_per_host = static_cast<int64_t>(num(j, "devices_per_host", what));
  CTR_REQUIRE(j.contains("device") && j["device"].is_object(), CTR_STATUS_INVALID_ARGUMENT,
              "%s: field 'device' (an object) is missing", what.c_str());
  const json &d = j["device"];
  const std::string dw = what + ": device";
  c.device_name = d.value("name", std::string("device"));
  if (d.contains("precision")) {
    CTR_REQUIRE(d["precision"].is_string() &&
                    (d["precision"].get<std::string>() == "fp32" || d["precision"].get<std::string>() == "bf16"),
                CTR_STATUS_INVALID_ARGUMENT, "%s: field 'precision' must be \"fp32\" or \"bf16\", got %s",
                dw.c_str(), d["precision"].dump().c_str());
    c.precision = d["precision"].get<std::string>();
  }
  if (d.contains("attention")) {
    const std::string a = d["attention"].is_string() ? d["attention"].get<std::string>() : "";
    CTR_REQUIRE(a == "probabilities" || a == "lse", CTR_STATUS_INVALID_ARGUMENT,
                "%s: field 'attention' must be \"probabilities\" or \"lse\", got %s", dw.c_str(),
                d["attention"].dump().c_str());
    c.attention_lse = a == "lse";
  }
  c.memory_bytes = static_cast<int64_t>(num(d, "memory_bytes", dw));
  c.flops = num(d, "flops", dw);
  c.bytes_per_s = num(d, "bytes_per_s", dw);
  c.launch_us = num(d, "launch_us", dw, false);
  CTR_REQUIRE(j.contains("links") && j["links"].is_object(), CTR_STATUS_INVALID_ARGUMENT,
              "%s: field 'links' (an object with 'host' and 'network') is missing", what.c_str());
  for (const char *level : {"host", "network"}) {
    const std::string lw = what + ": links." + level;
    CTR_REQUIRE(j["links"].contains(level), CTR_STATUS_INVALID_ARGUMENT, "%s is missing", lw.c_str());
    ClusterProfile::Link &l = std::string(level) == "host" ? c.host : c.network;
    l.latency_us = num(j["links"][level], "latency_us", lw, false);
    l.bytes_per_s = num(j["links"][level], "bytes_per_s", lw);
  }
  if (j.contains("ops")) {
    CTR_REQUIRE(j["ops"].is_object(), CTR_STATUS_INVALID_ARGUMENT, "%s: field 'ops' is not an object", what.c_str());
    for (const auto &[op, v] : j["ops"].items()) {
      const std::string ow = what + ": ops." + op;
      ClusterProfile::OpRate r;
      r.launch_us = num(v, "launch_us", ow, false);
      if (v.contains("flops")) {
        r.flops = num(v, "flops", ow);
      } else {
        r.bytes_per_s = num(v, "bytes_per_s", ow);
      }
      c.ops[op] = r;
    }
  }
  if (j.contains("sources") && j["sources"].is_object())
    for (const auto &[k, v] : j["sources"].items())
      if (v.is_string()) c.sources[k] = v.get<std::string>();
  return c;
}

std::string plan_json(const Graph &graph, const PlanRequest &req, const ClusterProfile &c) {
  const auto t_start = std::chrono::steady_clock::now();
  CTR_REQUIRE(req.world >= 1 && req.world <= (1 << 20), CTR_STATUS_INVALID_OPTION, "plan: world %lld",
              static_cast<long long>(req.world));
  CTR_REQUIRE(req.global_batch >= 1, CTR_STATUS_INVALID_OPTION, "plan: global_batch %lld (at least 1)",
              static_cast<long long>(req.global_batch));
  bool moe = false;
  for (const Node &n : graph.nodes) moe |= n.op.rfind("moe_", 0) == 0;
  std::vector<std::map<std::string, int64_t>> meshes;
  std::map<std::string, int64_t> cur;
  factorizations(req.world, 0, cur, moe, meshes);

  Backend be = cpu_backend_create(false);
  std::unique_ptr<Backend, void (*)(Backend *)> owner(new Backend(be), [](Backend *b) {
    b->iface->destroy(b->ctx);
    delete b;
  });

  // Model FLOPs per step for the MFU: the forward's registry FLOPs, times 3.
  double model_flops = 0;
  int64_t seq_used = req.seq;
  {
    Graph g = graph;
    CompileOptions o;
    o.batch = 1;
    o.seq = req.seq;
    pass_infer_shapes(g, o);
    for (const Node &n : g.nodes)
      if (const OpDef *d = find_op(n.op); d && d->flops) model_flops += d->flops(g, n);
    model_flops *= 3.0 * static_cast<double>(req.global_batch);
    if (seq_used == 0 && g.symbols.count("seq")) seq_used = g.symbols.at("seq");
  }

  // What every layout must hold whatever its batch: parameters, gradients and
  // AdamW's two moments, 16 bytes per fp32 parameter, the experts' split over
  // ep too. A mesh whose share of them alone exceeds the device is refused
  // without compiling (a lower bound: tp leaves some tensors whole, fsdp pads).
  double dense_params = 0, expert_params = 0;
  {
    std::vector<bool> expert(graph.tensors.size(), false);
    for (const Node &n : graph.nodes)
      if (n.op.rfind("moe_", 0) == 0)
        for (int t : n.inputs)
          if (t >= 0) expert[static_cast<size_t>(t)] = true;
    for (size_t t = 0; t < graph.tensors.size(); ++t) {
      const Tensor &x = graph.tensors[t];
      if (x.role != Role::Param) continue;
      double numel = 1;
      for (const Dim &d : x.dims) numel *= static_cast<double>(d.symbol.empty() ? d.size : 1);
      (expert[t] ? expert_params : dense_params) += numel;
    }
  }

  json plans = json::array();
  int64_t candidates = 0, feasible = 0, compiled = 0;

  // Compiles and prices one candidate: its table row.
  // Compiles stage s of a candidate (the rank of that stage, every other
  // index 0) and prices its phases per micro-batch.
  auto compile_stage = [&](const Candidate &cd, int64_t s, Layout &layout, Schedule *sched) {
    CompileOptions o;
    o.batch = cd.batch;
    o.seq = req.seq;
    o.micro_batches = cd.micro_batches;
    o.pp_schedule = cd.schedule;
    o.pp_virtual = cd.schedule == ScheduleKind::Interleaved ? 2 : 1;
    o.recompute = cd.recompute;
    o.cp_mode = cd.cp_mode;
    o.precision = c.precision;
    for (const char *a : kAxes) o.mesh.axes.push_back({a, cd.axes.at(a), std::string(a) == "pp" ? s : 0});
    layout.mesh = o.mesh;
    Graph g = graph;
    PassContext ctx(g, o, [&](OpId op) { return backend_has_kernel(be, op); });
    ctx.backend_flags = be.iface->flags | (c.attention_lse ? CTR_BACKEND_ATTENTION_LSE : 0u);
    run_passes(ctx);
    StageCost sc;
    const Program &prog = ctx.program;
    std::vector<Priced> parts;  // forward, backward, weight; interleaved: each chunk's forward and backward
    if (prog.chunks() > 0) {
      // Each chunk's part of a phase is a task of its own, priced alone; the
      // phase is the sum of its chunks.
      Priced f, b;
      for (int k = 0; k < prog.chunks(); ++k) {
        for (int ph = 0; ph < 2; ++ph) {
          const std::vector<Instr> &list = ph == 0 ? prog.forward : prog.backward;
          const auto [first, end] = prog.chunk_range[ph][static_cast<size_t>(k)];
          const Priced part = price_phase(g, std::span<const Instr>(list).subspan(first, end - first), layout, c);
          (ph == 0 ? sc.chunk_f : sc.chunk_b).push_back(part.ms);
          (ph == 0 ? f : b).ms += part.ms;
          parts.push_back(part);
        }
      }
      sc.f = f.ms;
      sc.b = b.ms;
      const Priced w = price_phase(g, prog.weight, layout, c);
      sc.w = w.ms;
      parts.push_back(w);
    } else {
      for (const std::vector<Instr> *list : {&prog.forward, &prog.backward, &prog.weight})
        parts.push_back(price_phase(g, *list, layout, c));
      sc.f = parts[0].ms;
      sc.b = parts[1].ms;
      sc.w = parts[2].ms;
    }
    for (const Priced &ph : parts) {
      sc.comm_ms += ph.comm_ms;
      sc.exposed_ms += ph.exposed_ms;
      for (const auto &[axis, ms] : ph.comm_by_axis) sc.comm_by_axis[axis] += ms;
    }
    const size_t st = static_cast<size_t>(s);
    const int64_t slots = std::max<int64_t>(1, ctx.pipeline.in_flight[st]);
    const MemoryPlan &mp = ctx.plan;
    sc.param_bytes = mp.param_bytes;
    // As step creation sizes it (Step::peak_bytes; the optimizer's state over
    // the parameters' bytes).
    sc.memory = mp.step_bytes(slots, adamw_state_bytes(mp.param_bytes / 4, cd.micro_batches > 1));
    // What one task sends (interleaved: the chunk sending most).
    std::vector<double> sent(static_cast<size_t>(std::max(1, ctx.stage_cut.chunks)), 0.0);
    for (const StageCut::Boundary &bd : ctx.stage_cut.send)
      sent[static_cast<size_t>(bd.chunk)] += static_cast<double>(g.tensors[static_cast<size_t>(bd.tensor)].bytes());
    sc.send_bytes = *std::max_element(sent.begin(), sent.end());
    if (sched) *sched = ctx.pipeline;
    return sc;
  };

  // Compiles and prices one candidate: its table row. `stage0`: its first
  // stage, when that was compiled already (pipelines only: the schedule and
  // layout come from the other stages).
  auto evaluate = [&](const Candidate &cd, const StageCost *stage0 = nullptr) {
    const int64_t pp = cd.axes.at("pp");
    json row = {{"mesh", cd.mesh_text()},
                {"schedule", schedule_kind_name(cd.schedule)},
                {"micro_batches", cd.micro_batches},
                {"batch", cd.batch},
                {"recompute", cd.recompute}};
    if (cd.axes.at("cp") > 1) row["cp_mode"] = cd.cp_mode;
    if (cd.schedule == ScheduleKind::Interleaved) row["virtual_stages"] = 2;
    std::vector<StageCost> stages;
    Schedule sched;
    std::string why;
    Layout layout;
    layout.world = req.world;
    try {
      for (int64_t s = 0; s < pp; ++s)
        stages.push_back(s == 0 && stage0 && pp > 1 ? *stage0 : compile_stage(cd, s, layout, &sched));
    } catch (const Error &e) {
      why = e.message();
    }
    if (!why.empty()) {
      row["feasible"] = false;
      row["why"] = why.substr(0, why.find('\n'));
      return row;
    }
    int64_t memory = 0;
    for (const StageCost &sc : stages) memory = std::max(memory, sc.memory);
    double send = 0;
    for (const StageCost &sc : stages) send = std::max(send, sc.send_bytes);
    const auto [pp_ranks, pp_across] = axis_reach(layout, "pp", c.devices_per_host);
    const ClusterProfile::Link &pl = pp_across ? c.network : c.host;
    const double transfer = pp_ranks > 1 ? pl.latency_us * 1e-3 + send / pl.bytes_per_s * 1e3 : 0.0;
    const SchedulePlay played = play_schedule(
        sched,
        [&](const Task &t) {
          const StageCost &sc = stages[static_cast<size_t>(t.stage)];
          if (!sc.chunk_f.empty() && t.phase != TaskPhase::Weight)
            return (t.phase == TaskPhase::Forward ? sc.chunk_f : sc.chunk_b)[static_cast<size_t>(t.chunk)];
          return t.phase == TaskPhase::Forward ? sc.f : t.phase == TaskPhase::Backward ? sc.b : sc.w;
        },
        transfer);
    const double span = played.span;
    const double bubble = span > 0 ? 1.0 - played.busy / (span * static_cast<double>(pp)) : 0.0;
    // Gradient accumulation (a copy or an add per micro-batch) and AdamW
    // (reads parameters, gradients and two moments, writes three), memory-bound.
    double tail = 0;
    for (const StageCost &sc : stages) {
      const double pb = static_cast<double>(sc.param_bytes);
      const double acc = cd.micro_batches > 1 ? static_cast<double>(cd.micro_batches) * 3.0 * pb : 0.0;
      tail = std::max(tail, (acc + 7.0 * pb) / c.bytes_per_s * 1e3);
    }
    const double step_ms = span + tail;
    json comm = json::object();
    double comm_total = 0, exposed = 0;
    for (const StageCost &sc : stages) {
      for (const auto &[axis, ms] : sc.comm_by_axis)
        comm[axis] = std::max(comm.value(axis, 0.0), ms * static_cast<double>(cd.micro_batches));
      comm_total = std::max(comm_total, sc.comm_ms * static_cast<double>(cd.micro_batches));
      exposed = std::max(exposed, sc.exposed_ms * static_cast<double>(cd.micro_batches));
    }
    json st = json::array();
    for (const StageCost &sc : stages)
      st.push_back({{"forward_ms", sc.f}, {"backward_ms", sc.b}, {"weight_ms", sc.w}, {"memory_bytes", sc.memory}});
    row["memory_bytes"] = memory;
    row["stages"] = st;
    row["step_ms"] = step_ms;
    row["bubble"] = pp > 1 ? bubble : 0.0;
    row["comm_ms"] = comm;
    row["exposed_comm_ms"] = exposed;
    row["tokens_per_s"] = static_cast<double>(req.global_batch * seq_used) / (step_ms * 1e-3);
    row["mfu"] = model_flops / (step_ms * 1e-3) / (c.flops * static_cast<double>(req.world));
    if (memory > c.memory_bytes) {
      row["feasible"] = false;
      row["why"] = strformat("needs %.3f GiB per device, more than the %.3f GiB of %s", memory / 1073741824.0,
                             c.memory_bytes / 1073741824.0, c.device_name.c_str());
    } else {
      row["feasible"] = true;
    }
    return row;
  };

  // Each mesh's candidates, planned on their own: the meshes are shared out
  // among the machine's cores and their rows gathered in mesh order, so the
  // result does not depend on the number of threads.
  struct MeshResult {
    json rows = json::array();
    int64_t candidates = 0, compiled = 0, feasible = 0;
    std::string error;  // an unexpected failure, rethrown on the caller's thread
  };
  double beat_ms = std::numeric_limits<double>::infinity();
  auto plan_mesh = [&](const std::map<std::string, int64_t> &axes, MeshResult &out) {
    const int64_t data = axes.at("dp") * axes.at("fsdp") * axes.at("ep");
    const int64_t pp = axes.at("pp");
    std::vector<Candidate> cands;
    const double state_bytes =
        16.0 * (dense_params / static_cast<double>(axes.at("tp") * pp * axes.at("fsdp")) +
                expert_params / static_cast<double>(axes.at("tp") * pp * axes.at("fsdp") * axes.at("ep")));
    if (req.global_batch % data == 0) {
      const int64_t rows = req.global_batch / data;
      std::vector<int64_t> micro;
      for (int64_t m = 1; m <= rows; m *= 2)
        if (rows % m == 0) micro.push_back(m);
      for (int64_t m : {pp, 2 * pp})
        if (rows % m == 0 && std::find(micro.begin(), micro.end(), m) == micro.end()) micro.push_back(m);
      std::sort(micro.begin(), micro.end());
      // Micro-batch counts: powers of two (fewer rows per micro-batch: less
      // activation memory), and with stages at least one per stage, the
      // pipeline depth and its double among them.
      std::vector<int64_t> keep;
      for (int64_t m : micro)
        if (m >= pp) keep.push_back(m);
      for (int64_t m : keep)
        for (ScheduleKind k : pp > 1 ? std::vector<ScheduleKind>{ScheduleKind::OneFOneB, ScheduleKind::ZeroBubble,
                                                                 ScheduleKind::Interleaved}
                                     : std::vector<ScheduleKind>{ScheduleKind::OneFOneB})
          for (const std::string &rc : req.recompute) {
            // Interleaved with p and 2p micro-batches, where 1F1B's bubble is
            // largest (1/2 to 1/3 of the step on many stages) and where
            // splitting it pays; with more, 1F1B and zb leave little to win.
            if (k == ScheduleKind::Interleaved && m != pp && m != 2 * pp) continue;
            for (const char *cp_mode : axes.at("cp") > kMaxRing ? std::vector<const char *>{"gather", "ulysses"}
                                       : axes.at("cp") > 1         ? std::vector<const char *>{"gather", "ulysses", "ring"}
                                                                   : std::vector<const char *>{"gather"}) {
              Candidate cd;
              cd.axes = axes;
              cd.micro_batches = m;
              cd.batch = rows / m;
              cd.schedule = k;
              cd.recompute = rc;
              cd.cp_mode = cp_mode;
              cands.push_back(cd);
            }
          }
    } else {
      Candidate cd;
      cd.axes = axes;
      json row = {{"mesh", cd.mesh_text()}, {"feasible", false},
                  {"why", strformat("the global batch of %lld does not split over %lld data ranks",
                                    static_cast<long long>(req.global_batch), static_cast<long long>(data))}};
      out.rows.push_back(row);
      ++out.candidates;
    }
    // A candidate refused without compiling: its row with the reason.
    auto refuse = [&](const Candidate &cd, const std::string &why) {
      json row = {{"mesh", cd.mesh_text()}, {"schedule", schedule_kind_name(cd.schedule)},
                  {"micro_batches", cd.micro_batches}, {"batch", cd.batch}, {"recompute", cd.recompute},
                  {"feasible", false}, {"why", why}};
      if (cd.axes.at("cp") > 1) row["cp_mode"] = cd.cp_mode;
      out.rows.push_back(row);
      ++out.candidates;
    };
    if (req.prune && state_bytes > static_cast<double>(c.memory_bytes)) {
      const std::string why = strformat(
          "parameters, gradients and optimizer state alone need at least %.3f GiB per device, more than the "
          "%.3f GiB of %s",
          state_bytes / 1073741824.0, c.memory_bytes / 1073741824.0, c.device_name.c_str());
      for (const Candidate &cd : cands) refuse(cd, why);
      return;
    }
    // Candidates that differ only in their micro-batch count form a group.
    // With at least one micro-batch per stage the micro-batches in flight are
    // fixed, and fewer rows per micro-batch need no more memory: a binary
    // search over the counts finds the fewest that fit, and those below it are
    // refused without compiling. With one stage, more micro-batches than that
    // are never faster (each kernel's time is affine in its rows with a
    // non-negative constant, the weights are read and gathered once per
    // micro-batch, and a program's span grows with its tasks' times), so they
    // are pruned; with stages they shorten the bubble and are all priced.
    std::stable_sort(cands.begin(), cands.end(), [](const Candidate &x, const Candidate &y) {
      return std::tie(x.schedule, x.recompute, x.cp_mode, x.micro_batches) <
             std::tie(y.schedule, y.recompute, y.cp_mode, y.micro_batches);
    });
    for (size_t g0 = 0; g0 < cands.size();) {
      size_t g1 = g0;
      while (g1 < cands.size() && cands[g1].schedule == cands[g0].schedule &&
             cands[g1].recompute == cands[g0].recompute && cands[g1].cp_mode == cands[g0].cp_mode)
        ++g1;
      std::vector<std::optional<json>> priced(g1 - g0);
      std::optional<StageCost> first_stage;  // the first candidate's stage 0, once the bound below compiled it
      auto price = [&](size_t i) -> const json & {
        if (!priced[i]) {
          ++out.compiled;
          priced[i] = evaluate(cands[g0 + i], i == 0 && first_stage ? &*first_stage : nullptr);
        }
        return *priced[i];
      };
      auto too_big = [&](const json &row) {
        return !row["feasible"].get<bool>() && row.contains("memory_bytes") &&
               row["memory_bytes"].get<int64_t>() > c.memory_bytes;
      };
      size_t fit = g1 - g0;  // the first that fits; all of the group when not searching
      // (Interleaved holds more micro-batches in flight as there are more, up
      // to its warm-up's: its memory is not monotone in the count, and every
      // count is compiled.)
      const bool monotone = cands[g0].schedule != ScheduleKind::Interleaved;
      bool searched = req.prune && monotone;
      std::string group_error;
      // With stages, a group is no faster than its first stage is busy: with
      // the fewest micro-batches (more take no less, as above) that stage alone
      // is compiled, and the group is pruned when it is busy for longer than
      // the fastest one-stage plan takes.
      if (req.prune && pp > 1 && std::isfinite(beat_ms)) {
        double busy = 0;
        try {
          Layout layout;
          layout.world = req.world;
          first_stage = compile_stage(cands[g0], 0, layout, nullptr);
          busy = static_cast<double>(cands[g0].micro_batches) * (first_stage->f + first_stage->b + first_stage->w);
        } catch (const Error &) {
          busy = 0;  // priced (and refused with its reason) as usual
        }
        if (busy > beat_ms) {
          for (size_t i = g0; i < g1; ++i) {
            refuse(cands[i], strformat("at least %.2f ms: its first stage alone is busy that long with %lld "
                                       "micro-batches (more take no less), longer than the fastest one-stage "
                                       "plan's %.2f ms",
                                       busy, static_cast<long long>(cands[g0].micro_batches), beat_ms));
            out.rows.back()["pruned"] = true;
          }
          g0 = g1;
          continue;
        }
      }
      if (req.prune && monotone) {
        // The most micro-batches first: when even they do not fit, nothing does.
        size_t lo = 0, hi = g1 - g0 - 1;
        const json &last = price(hi);
        if (!last["feasible"].get<bool>()) {
          lo = too_big(last) ? g1 - g0 : 0;
          searched = too_big(last);
          hi = lo;
          // A layout the model cannot take fails the same way for every count
          // (the placement and stage passes see the mesh, not the rows): when
          // the fewest micro-batches fail as the most do, so do the others.
          if (!searched && g1 - g0 > 1) {
            const json &first = price(0);
            if (!first["feasible"].get<bool>() && !too_big(first) && first["why"] == last["why"])
              group_error = last["why"].get<std::string>();
          }
        }
        while (lo < hi) {
          const size_t mid = lo + (hi - lo) / 2;
          const json &row = price(mid);
          if (row["feasible"].get<bool>()) {
            hi = mid;
          } else if (too_big(row)) {
            lo = mid + 1;
          } else {  // it does not compile: price the whole group
            searched = false;
            break;
          }
        }
        if (searched) fit = lo;
      }
      for (size_t i = 0; i < g1 - g0; ++i) {
        const Candidate &cd = cands[g0 + i];
        if (!group_error.empty() && !priced[i]) {
          refuse(cd, group_error);
          continue;
        }
        if (searched && i < fit && !priced[i]) {
          size_t q = i;  // the binary search priced the one just below the fit
          while (!priced[q]) ++q;
          refuse(cd, strformat("needs at least the %.3f GiB per device of the same layout with %lld micro-batches, "
                               "more than the %.3f GiB of %s",
                               (*priced[q])["memory_bytes"].get<int64_t>() / 1073741824.0,
                               static_cast<long long>(cands[g0 + q].micro_batches), c.memory_bytes / 1073741824.0,
                               c.device_name.c_str()));
          continue;
        }
        if (searched && i > fit && pp == 1 && !priced[i]) {
          refuse(cd, strformat("no faster than the same layout with %lld micro-batches, which fits (with one stage "
                               "more micro-batches only add launches, weight reads and collectives)",
                               static_cast<long long>(cands[g0 + fit].micro_batches)));
          out.rows.back()["pruned"] = true;
          continue;
        }
        const json &row = price(i);
        ++out.candidates;
        if (row["feasible"].get<bool>()) ++out.feasible;
        out.rows.push_back(row);
      }
      g0 = g1;
    }
  };
  // Two rounds: the one-stage meshes, then, with the fastest of their plans
  // as the time to beat (pruning on), the meshes with stages.
  std::vector<MeshResult> results(meshes.size());
  auto run_round = [&](bool staged) {
    std::vector<size_t> todo;
    for (size_t i = 0; i < meshes.size(); ++i)
      if ((meshes[i].at("pp") > 1) == staged) todo.push_back(i);
    std::atomic<size_t> next{0};
    auto worker = [&] {
      for (size_t k; (k = next.fetch_add(1)) < todo.size();) {
        try {
          plan_mesh(meshes[todo[k]], results[todo[k]]);
        } catch (const std::exception &e) {
          results[todo[k]].error = e.what();
        }
      }
    };
    const size_t threads =
        std::min<size_t>(todo.size(), std::max(1u, std::min(std::thread::hardware_concurrency(), 16u)));
    std::vector<std::thread> pool;
    for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (std::thread &t : pool) t.join();
  };
  run_round(false);
  if (req.prune)
    for (const MeshResult &r : results)
      for (const json &row : r.rows)
        if (row["feasible"].get<bool>()) beat_ms = std::min(beat_ms, row["step_ms"].get<double>());
  run_round(true);
  for (MeshResult &r : results) {
    CTR_REQUIRE(r.error.empty(), CTR_STATUS_INTERNAL, "plan: %s", r.error.c_str());
    for (json &row : r.rows) plans.push_back(std::move(row));
    candidates += r.candidates;
    compiled += r.compiled;
    feasible += r.feasible;
  }

  std::vector<json> rows(plans.begin(), plans.end());
  std::stable_sort(rows.begin(), rows.end(), [](const json &a, const json &b) {
    const bool fa = a["feasible"].get<bool>(), fb = b["feasible"].get<bool>();
    if (fa != fb) return fa;
    const double sa = a.value("step_ms", std::numeric_limits<double>::infinity()),
                 sb = b.value("step_ms", std::numeric_limits<double>::infinity());
    if (sa != sb) return sa < sb;
    return a["mesh"].get<std::string>() < b["mesh"].get<std::string>();
  });
  if (req.top > 0 && static_cast<int64_t>(rows.size()) > req.top) rows.resize(static_cast<size_t>(req.top));
  json out = {{"world", req.world},
              {"global_batch", req.global_batch},
              {"seq", seq_used},
              {"cluster", c.name},
              {"device", c.device_name},
              {"precision", c.precision},
              {"attention", c.attention_lse ? "lse" : "probabilities"},
              {"sources", c.sources},
              {"candidates", candidates},
              {"compiled", compiled},
              {"feasible", feasible},
              {"plans", rows}};
  out["search_s"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  return out.dump();
}

}  // namespace ctr
