// The planner: candidate layouts of a training step on a cluster, each
// compiled as a step would compile it and priced from profiles.
//
// A candidate is a mesh (pp, dp, ep, fsdp, cp, tp over the world), a
// micro-batch count, a pipeline schedule and a recompute policy. It is compiled
// by the step's own passes, once per pipeline stage (the rank of that stage
// with every other index 0), so what is priced is the program the step would
// run: its instruction lists on the compute and comm streams with their events,
// its memory plan, its schedule of tasks. Pricing:
//   - a kernel takes launch + max(FLOPs / flops, bytes / bytes_per_s): the op
//     registry's FLOPs (backward GEMMs and attention from their shapes), the
//     bytes it reads and writes;
//   - a collective over an axis of n ranks takes (n - 1) latency plus its bytes
//     on the wire ((n - 1)/n of the whole for a gather or a reduce-scatter,
//     twice that for an all-reduce) over the link of the level the axis spans
//     (the ranks of a host, or the network);
//   - each phase is played on the two streams, a wait holding stream 0 until
//     the event's collective is done, so the communication compute hides is
//     not counted twice;
//   - the stages' tasks are played in the schedule's order, a received
//     activation or gradient arriving a transfer after its sender's task ends;
//     then gradient accumulation and the optimizer, memory-bound;
//   - memory per device is exactly what step creation plans: the arena for the
//     micro-batches in flight, parameters, gradients, inputs, constants and
//     optimizer state.
// A candidate that does not compile (a mesh the model cannot take) or does not
// fit the device's memory is listed as infeasible with the reason. Candidates
// that memory bounds rule out (a mesh's share of the parameters' state alone;
// fewer micro-batches than a layout that does not fit), or that cannot be
// faster than another of their mesh or than the fastest one-stage plan, are
// listed without compiling (see PlanRequest::prune and plan.cc). Meshes are planned on several threads; the
// result does not depend on how many.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ctr {

struct Graph;
struct Node;

// A cluster as the planner prices it: the devices, how many per host, and the
// links within a host and between hosts. Each number names its source
// (`sources`: "measured ..." or "specification ..."), carried into the plan.
struct ClusterProfile {
  std::string name;
  int64_t devices_per_host = 1;
  std::string device_name;
  // What the device computes in, as a step there would (device.precision:
  // "fp32" by default, or "bf16"): the precision the candidates are compiled
  // with, so activations, collectives and memory are priced at its width, and
  // the one `flops` is quoted for.
  std::string precision = "fp32";
  // What the device's attention kernels keep for backward (device.attention):
  // "probabilities" (the CPU backend's, [B, H, T, T]) or "lse" (each row's
  // log-sum-exp, flash-style: the CUDA backend's).
  bool attention_lse = false;
  int64_t memory_bytes = 0;  // per device
  double flops = 0;          // sustained FLOP/s of the GEMM-class kernels, per device
  double bytes_per_s = 0;    // device memory bandwidth
  double launch_us = 0;      // per kernel launch
  struct Link {
    double latency_us = 0;
    double bytes_per_s = 0;  // per device, each way
  };
  Link host, network;
  // Measured per op (ctr calibrate): a kernel of the op takes launch_us plus
  // its FLOPs over flops when flops > 0, else its bytes over bytes_per_s. Ops
  // not listed take the device's roofline above.
  struct OpRate {
    double launch_us = 0, flops = 0, bytes_per_s = 0;
  };
  std::map<std::string, OpRate> ops;
  std::map<std::string, std::string> sources;
};

// A kernel's FLOPs (the op registry's; the backward GEMMs and attention, which
// it leaves out, from their shapes) and the bytes it reads and writes.
double kernel_flops(const Graph &g, const Node &n);
double kernel_bytes(const Graph &g, const Node &n);

// Parses a profile (JSON text; `what` names it in errors). Fails with
// CTR_STATUS_INVALID_ARGUMENT naming the missing or bad field.
ClusterProfile parse_cluster_profile(const std::string &json, const std::string &what);

struct PlanRequest {
  int64_t world = 1;
  int64_t global_batch = 1;  // sequences per step, over all data ranks and micro-batches
  int64_t seq = 0;           // 0: the graph's maximum
  std::vector<std::string> recompute = {"none", "all"};
  int64_t top = 0;  // plans listed (feasible first); 0: all
  // Refuse without compiling what cannot fit: a mesh whose share of the
  // parameters, gradients and optimizer state exceeds the device, and fewer
  // micro-batches than a layout that already does not fit. false: compile all.
  bool prune = true;
};

// Plans every candidate of g for req on cluster c and returns the result as JSON:
// {"world", "global_batch", "seq", "cluster", "sources", "candidates", "feasible",
//  "search_s", "plans": [{"mesh", "schedule", "micro_batches", "batch",
//  "recompute", "feasible", "why" (infeasible), "step_ms", "tokens_per_s",
//  "mfu", "memory_bytes", "bubble", "comm_ms" {axis: ms}, "exposed_comm_ms",
//  "stages": [{"forward_ms", "backward_ms", "weight_ms", "memory_bytes"}]}]},
// plans ranked by predicted step time (infeasible last), ties by mesh text.
std::string plan_json(const Graph &g, const PlanRequest &req, const ClusterProfile &c);

}  // namespace ctr
