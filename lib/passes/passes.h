// The compiler pipeline that turns a graph file into a runnable step.
//
// Each pass is one file and one function over the IR; ctr_step_create runs them
// in the order of pass_names(), and `ctr graph inspect --after PASS` prints the IR
// after any of them. Later passes (shard, bucket, reorder, recompute) slot in
// between autodiff and plan_memory without changing the others.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/ir.h"

namespace ctr {

struct CompileOptions {
  int64_t batch = 1;          // binds the "batch" symbol (one micro-batch)
  int64_t seq = 0;            // binds "seq"; 0 = the graph's maximum
  int64_t micro_batches = 1;  // gradient accumulation steps
  // Mesh placement of this rank (shard pass).
  int64_t fsdp = 1, fsdp_index = 0;
  int64_t dp = 1, dp_index = 0;
  bool reshard_after_forward = true;
};

// Semantic checks on a freshly loaded graph and a topological sort of its nodes.
// Fails with CTR_STATUS_INVALID_GRAPH naming the node or tensor at fault.
void pass_verify(Graph &g);

// Binds symbolic dims, computes every tensor's concrete shape, appends the saved
// outputs of ops that have them, and checks declared shapes against inferred ones.
void pass_infer_shapes(Graph &g, const CompileOptions &opt);

// Appends the backward graph (reverse-mode, from per-op VJP rules), seeded with
// d(loss)/d(loss) held in the Const tensor "loss.grad". Afterwards each param
// with a gradient has tensors[grad].grad_of == param.
void pass_autodiff(Graph &g);

// Places parameters on the mesh: each param is cut on dim 0 into `fsdp` shards of
// equal (padded) row count and this rank keeps shard fsdp_index. An all_gather
// node rebuilds the full param before its first forward use and, with
// reshard_after_forward, again before its first backward use, so the full copy
// is not held from forward to backward. The full gradient is reduce-scattered
// back to the shard (averaged over fsdp) and all-reduced over dp. Collectives
// are ordinary nodes (ops all_gather, reduce_scatter, all_reduce with attribute
// "axis"), visible in `graph inspect --after shard`. No-op on a single rank.
void pass_shard(Graph &g, const CompileOptions &opt);

// True for the collective ops the shard pass inserts.
bool is_collective(const std::string &op);

struct MemoryPlan {
  int64_t arena_bytes = 0;   // peak of the activation arena
  int64_t param_bytes = 0;   // parameters (fp32)
  int64_t input_bytes = 0;   // host inputs for all micro-batches
  int64_t const_bytes = 0;
  int64_t naive_bytes = 0;   // sum of arena tensors without reuse, for reporting
  // Per param tensor id: the gradient tensor id (-1 when none reaches it).
  std::vector<int> param_grad;
};

// Liveness analysis over the node order and a static arena: every activation gets
// a byte offset, tensors whose lifetimes do not overlap share bytes. Parameters,
// inputs and constants get offsets in their own regions.
MemoryPlan pass_plan_memory(Graph &g, const CompileOptions &opt);

// One step of work for an executor: run the kernel of node `node` on `stream`,
// after waiting for the listed events, then record the listed events.
struct Instr {
  int node = -1;
  int stream = 0;
  std::vector<int> wait_events;
  std::vector<int> record_events;
};

struct Program {
  std::vector<Instr> forward;   // forward nodes, in order
  std::vector<Instr> backward;  // backward nodes, in order
  int num_streams = 1;
  int num_events = 0;
};

// Lowers the planned graph to instruction lists per phase. Checks that the
// backend has a kernel for every op.
Program pass_lower(const Graph &g, const std::vector<std::string> &backend_ops);

// 1-based position of a pass in pass_names(), 0 if unknown.
int pass_index(const std::string &name);

// Dump of a program's instruction lists.
std::string dump_program(const Graph &g, const Program &p);

}  // namespace ctr
