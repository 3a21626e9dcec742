// The compiler pipeline that turns a graph file into a runnable step.
//
// Each pass is one file: a function over a PassContext, the options it reads,
// and how its result is printed. The pass manager (manager.cc) holds the one
// ordered list of passes; ctr_step_create, `ctr graph inspect --after PASS` and
// every list of pass names read it, so a pass is added in exactly one place.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "graph/ir.h"
#include "graph/ops.h"
#include "passes/schedule.h"

namespace ctr {

class OptionReader;

struct CompileOptions {
  int64_t batch = 1;          // binds the "batch" symbol (one micro-batch)
  int64_t seq = 0;            // binds "seq"; 0 = the graph's maximum
  int64_t micro_batches = 1;  // gradient accumulation steps
  bool fuse = true;           // fuse: exported primitive patterns -> fused ops
  bool epilogues = true;      // epilogues: GEMM epilogues fused where the backend has the kernels
  // shard: 0 keeps every gathered parameter from forward to backward; 1 frees them
  // after forward except those of the last block and the head, which backward
  // reads first; 2 frees every one and gathers it again for backward.
  int reshard_after_forward = 1;
  int64_t prefetch = 1;         // reorder: all-gathers issued this many segments ahead
  bool defer_reduce = true;     // reorder: reduce-scatters behind the next segment's compute
  int64_t memory_budget = 0;    // reorder: bound on the planned arena in bytes (0 = none)
  bool overlap = true;          // lower: false waits for every collective at its issue
  std::string recompute = "none";  // recompute: none, all or selective
  std::string precision = "auto";  // precision: auto, fp32 or bf16 (activation storage)
  std::string bucket = "block";    // bucket: block, bytes or none
  int64_t bucket_bytes = 0;        // bucket: byte budget per bucket in "bytes" mode (0 = none)
  bool sequence_parallel = false;  // place: activations between tp regions split by tokens over tp
  std::string cp_mode = "gather";  // place: attention over cp by gathered keys (gather) or heads (ulysses)
  ScheduleKind pp_schedule = ScheduleKind::OneFOneB;  // schedule: the pipeline schedule
  std::vector<int64_t> pp_stages;  // schedule: blocks per stage (empty: balanced by FLOPs)
  int pp_virtual = 1;              // schedule: virtual stages per rank (interleaved: default 2)
  MeshPlacement mesh;
};

struct MemoryPlan {
  int64_t arena_bytes = 0;   // peak of the activation arena
  // With several micro-batches in flight (plan_memory's split): the arena's
  // first held_bytes hold what lives from one task to another (saved
  // activations, kept tensors), of which each micro-batch in flight needs a
  // copy; the rest lives within one task and is shared. Else arena_bytes.
  int64_t held_bytes = 0;
  // Bytes of an arena for `slots` micro-batches in flight.
  int64_t arena_for(int64_t slots) const { return held_bytes * slots + (arena_bytes - held_bytes); }
  // Bytes a step holds on its device (Step::peak_bytes, and what the planner
  // predicts): the arena for `slots`, parameters and their gradients, host
  // inputs, constants and the optimizer's state.
  int64_t step_bytes(int64_t slots, int64_t optimizer_bytes) const {
    return arena_for(slots) + 2 * param_bytes + input_bytes + const_bytes + optimizer_bytes;
  }
  int64_t param_bytes = 0;   // parameters (fp32); gradients use the same layout
  int64_t input_bytes = 0;   // host inputs for all micro-batches
  int64_t const_bytes = 0;
  int64_t naive_bytes = 0;   // sum of arena tensors without reuse, for reporting
  // Per param tensor id: the gradient tensor id (-1 when none reaches it).
  std::vector<int> param_grad;
};

// One unit of work for the executor on one stream.
struct Instr {
  enum Kind : uint8_t {
    Kernel,      // run node's kernel
    Collective,  // run node's collective (all_gather, reduce_scatter, all_reduce)
    Fill,        // zero bytes [offset, offset + bytes) of tensor's allocation
    Record,      // record event
    Wait,        // wait for event
  };
  Kind kind = Kernel;
  int stream = 0;
  int node = -1;
  int event = -1;
  int tensor = -1;
  int64_t offset = 0, bytes = 0;
};

struct Program {
  std::vector<Instr> forward;   // forward nodes, in order
  std::vector<Instr> backward;  // backward nodes, in order (with a split backward: the input gradients')
  std::vector<Instr> weight;    // with a split backward: the weight gradients' nodes; else empty
  int num_streams = 1;          // stream 0 computes, stream 1 communicates
  int num_events = 0;
  // Per node: for a collective, the node position at which stream 0 has waited
  // for it (its buffers are busy until then); -1 for other nodes.
  std::vector<int> complete_at;
  // Interleaved (a rank running several chunks as separate tasks): per node
  // its chunk (node_chunks), and per phase (forward, backward, weight) and
  // chunk the range [first, second) of that phase's instructions; each range
  // waits for all it issued. Empty otherwise.
  std::vector<int> node_chunk;
  std::vector<std::pair<size_t, size_t>> chunk_range[3];
  int chunks() const { return static_cast<int>(chunk_range[0].size()); }
};

// What passes read and write.
struct PassContext {
  PassContext(Graph &g, CompileOptions o, std::function<bool(OpId)> kernel_check)
      : graph(g), opt(std::move(o)), has_kernel(std::move(kernel_check)) {}
  Graph &graph;
  CompileOptions opt;
  // Whether the step's backend has a kernel for an op (lower checks every node).
  std::function<bool(OpId)> has_kernel;
  Program program;
  MemoryPlan plan;
  std::vector<std::string> ran;  // names of the passes run, in order
  std::string schedule;          // what reorder chose
  std::string fused;             // what fuse rewrote and what it left
  std::string placed;            // what place split over tp and what it left
  std::string precision;         // what precision chose
  std::string epilogues;         // what epilogues fused
  std::string split;             // what split_backward split
  Schedule pipeline;             // schedule: per stage, its tasks in run order
  StageCut stage_cut;            // stages: this rank's stage and what crosses to the others
  uint32_t backend_flags = 0;    // the step's backend's CTR_BACKEND_* flags
};

struct PassDef {
  const char *name;
  const char *summary;
  // Runs when the graph is loaded (ctr_graph_load_*), not at step creation.
  bool at_load;
  // Reads this pass's options (may be null).
  void (*read_options)(OptionReader &r, CompileOptions &opt);
  void (*run)(PassContext &ctx);
  // What `graph inspect --after` prints (null: the graph).
  std::string (*dump)(const PassContext &ctx);
};

// The pipeline, in order.
const std::vector<PassDef> &pass_list();
std::vector<std::string> pass_names();
// The pass named `name`; fails with CTR_STATUS_INVALID_ARGUMENT listing the passes.
const PassDef &find_pass(const std::string &name);

// Every pass's options (batch, seq, micro_batches, ...), read from r.
CompileOptions read_compile_options(OptionReader &r);

// Runs the step-creation passes (those not at_load) in order, up to and including
// `until` (empty: all of them).
void run_passes(PassContext &ctx, const std::string &until = "");

// ---------------------------------------------------------------------------
// The passes, one file each.

// verify.cc: semantic checks on a freshly loaded graph and a topological sort of
// its nodes. Fails with CTR_STATUS_INVALID_GRAPH naming the node or tensor at fault.
void pass_verify(Graph &g);

// infer_shapes.cc: binds symbolic dims, computes every tensor's concrete shape,
// appends the saved outputs of ops that have them, and checks declared shapes
// against inferred ones.
void pass_infer_shapes(Graph &g, const CompileOptions &opt);

// autodiff.cc: appends the backward graph (reverse-mode, from the registry's
// gradient rules), seeded with d(loss)/d(loss) held in the Const tensor
// "loss.grad". Afterwards each param with a gradient has tensors[grad].grad_of == param.
void pass_autodiff(Graph &g);

// fuse.cc: patterns of primitive ops that exported model code is made of,
// rewritten to the library's fused ops before autodiff: causal attention
// (matmul, scale, causal mask, softmax, matmul between head transposes; grouped
// kv heads through repeat_kv / repeat_interleave), RMSNorm, SwiGLU, the tanh
// GELU written out, and RoPE with constant tables (rotate-half, and the complex
// form on interleaved pairs). Each rewrite is
// exact up to round-off and happens only when the pattern's intermediates are
// read inside it alone. Returns what was fused and what was left, and why.
// Option fuse (1; 0 turns the pass off).
std::string pass_fuse(Graph &g, const CompileOptions &opt);
void read_fuse_options(OptionReader &r, CompileOptions &opt);

// Mixture-of-experts layers placed on the mesh (expert.cc): with an ep axis,
// the token exchanges around each layer's experts and this rank's block of
// expert weights; with more than one rank, load-balancing statistics summed
// over the world. Runs before autodiff.
void pass_expert(Graph &g, const CompileOptions &opt);

// place.cc: activations placed over the tensor-parallel axis `tp`, before
// autodiff: column-parallel linears (weights split on their output dim) feeding
// ops that run on split heads or features, closed by row-parallel linears
// (weights split on their input dim) whose partial sums an all-reduce makes
// whole; a `fanout` where a replicated activation enters (its gradient is
// all-reduced). Regions come from the ops' sharding rules alone. Returns what
// was placed and what was left replicated, and why. No-op without tp.
std::string pass_place(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel);
// context.cc, part of place: with a `cp` axis, every activation split by its
// sequence dim, each rank holding two mirrored chunks of each sequence (see
// ctr_cp_position): inputs chunked where they are read, keys and values of
// each attention all-gathered over cp (cp_attention masks by global
// positions), rope and position tables at global positions; a node that could
// mix positions otherwise is refused. Returns what was split. "" without cp.
std::string place_context(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel);
// Output shapes again, in order, from the inputs' local shapes (place.cc).
void infer_local_shapes(Graph &g);

// recompute.cc: activation checkpointing per block: the block's forward nodes
// copied into backward (all of them, or with selective only the cheap ones),
// backward reading the copies, so the originals die after forward. Whatever the
// mode, sequence parallelism's gathers and the cp ring's shifts of keys and
// values are done again in backward rather than their results kept.
void pass_recompute(Graph &g, const CompileOptions &opt);
void read_recompute_options(OptionReader &r, CompileOptions &opt);

// precision.cc: with "bf16", activations stored as bf16 (statistics, the loss and
// parameter gradients stay f32) and bf16 copies of the f32 parameters and
// constants that bf16 nodes read (`cast` nodes). resolve_precision turns
// "auto" into "bf16" where the backend has bf16 kernels and does not ask for
// them to be opted into (CTR_BACKEND_BF16_OPT_IN: the CPU backend) and the
// graph has no mixture-of-experts, tensor- or context-parallel ops (whose
// kernels the CUDA backend has in f32 only), else "fp32".
// Returns a one-line summary of what it did.
// bf16_moe: the backend's mixture-of-experts kernels take bf16 data (else a
// graph with experts is refused in bf16). cut: this rank's pipeline stage, whose
// received activations and gradients cross in bf16 like the activations sent.
std::string pass_precision(Graph &g, const std::string &precision, bool bf16_moe = false,
                           const StageCut *cut = nullptr);
void read_precision_options(OptionReader &r, CompileOptions &opt);
std::string resolve_precision(const Graph &g, const std::string &option,
                              const std::function<bool(OpId)> &has_kernel, uint32_t backend_flags);

// shard.cc: places parameters on the mesh: each param is cut on dim 0 into `fsdp`
// shards of equal (padded) row count and this rank keeps its shard. An
// all_gather node rebuilds the full param before its first forward use and, when
// reshard_after_forward frees it after forward, again before its first backward use. The full gradient
// is reduce-scattered back to the shard (averaged over fsdp) and all-reduced over
// dp. Collectives are ordinary nodes with attribute "axis". No-op on one rank.
void pass_shard(Graph &g, const CompileOptions &opt);

// True for a collective node (its op's CollKind is not None).
inline bool is_collective(const Node &n) { return collective_kind(n) != CollKind::None; }
// The expert exchanges (all-to-all of tokens), a kind of collective that
// compute reads at once: never bucketed or moved.
inline bool is_exchange(const Node &n) { return is_exchange_kind(collective_kind(n)); }
// A collective whose output compute of the same phase reads at once: the
// expert exchanges, sums of statistics and partial activations (attribute
// "reduce") and the activation gathers and scatters of the place pass
// (attribute "activation"). Bucket leaves them alone; reorder keeps each right
// behind what produces its input.
inline bool is_immediate(const Node &n) {
  return is_exchange(n) || (is_collective(n) && (n.has_attr("reduce") || n.attr_int("activation", 0) != 0));
}

// segments.cc: the compute nodes of a phase [begin, end) cut into segments,
// maximal runs of nodes of one block; bucket and reorder place collectives by
// segment.
struct PhaseSegments {
  std::vector<int> compute;       // compute node indices, in order
  std::vector<int> start;         // per segment: its first position in compute
  std::vector<int> seg_of;        // per graph node: its segment (-1: a collective or another phase)
  std::map<int, int> first_reader;  // tensor -> first compute node of the phase reading it
  std::map<int, int> producer;      // tensor -> last compute node of the phase writing it
  int count() const { return static_cast<int>(start.size()); }
  // The block of segment s (of its first node; -1 outside every block).
  int block(const Graph &g, int s) const {
    return g.nodes[static_cast<size_t>(compute[static_cast<size_t>(start[static_cast<size_t>(s)])])]
        .block;
  }
};
PhaseSegments segment_phase(const Graph &g, int begin, int end);

// bucket.cc: the all-gathers whose first reader is in one segment (block), and
// separately the reduce-scatters / all-reduces of gradients produced in one,
// merged into one collective over many tensors (run as one batch, no copies);
// or by a byte budget; or none.
void pass_bucket(Graph &g, const CompileOptions &opt);
void read_bucket_options(OptionReader &r, CompileOptions &opt);

// reorder.cc: all-gathers issued `prefetch` segments (blocks) before their first
// reader, reduce-scatters deferred behind the next segment's compute; with a
// memory_budget, the deepest such schedule whose planned arena fits. Changes only
// the order of nodes, never the arithmetic. Returns a line saying what it chose.
std::string pass_reorder(Graph &g, const CompileOptions &opt);
void read_reorder_options(OptionReader &r, CompileOptions &opt);

// lower.cc: instruction lists per phase: kernels on stream 0, collectives on
// stream 1, and the events between them. A collective waits (on stream 1) for
// the compute issued before it; stream 0 waits for a collective at the first
// node that reads its result, or, for a collective nothing on stream 0 reads,
// two segments (blocks) later or at the end of the phase. With opt.overlap
// false, stream 0 waits for each collective right after issuing it. Fails with
// CTR_STATUS_UNSUPPORTED naming a node whose op the backend lacks.
// epilogues.cc: after reorder, element-wise work a GEMM library applies as it
// stores the product moves into the GEMM's node where the backend has the
// fused kernel: linear_bwd_w + linear_bwd_b of one dy -> linear_bwd_wb,
// linear + gelu (tanh) -> linear_gelu, linear_bwd_x + gelu_bwd -> linear_bwd_x_dgelu.
// Returns what it fused, for `inspect --after epilogues`.
void read_epilogue_options(OptionReader &r, CompileOptions &opt);
std::string pass_epilogues(Graph &g, const CompileOptions &opt, const std::function<bool(OpId)> &has_kernel);

// split_backward.cc: for the zero-bubble schedule, the backward ordered as the
// nodes the input gradients need, then the others (Graph::num_input_grad);
// gradients written in the first part go through arena tensors copied in the
// second. Returns what it split, for `inspect --after split_backward`.
std::string pass_split_backward(Graph &g, const CompileOptions &opt);

Program pass_lower(const Graph &g, const std::function<bool(OpId)> &has_kernel, bool overlap = true,
                   std::vector<int> node_chunk = {}, int chunks = 1);
// Before lowering: tensors whose layout the backend decides (CTR_BACKEND_* flags):
// attention's saved output becomes f32 [B, H, T] on a backend that keeps the
// log-sum-exp there.
void apply_backend_layouts(Graph &g, uint32_t backend_flags);

// plan_memory.cc: liveness over the lowered schedule (a collective's buffers live
// until stream 0 has waited for it) and a static arena; parameters, gradients,
// inputs and constants in their own regions.
// slots: the micro-batches in flight on this stage; with several, the arena is
// split in two parts (MemoryPlan::held_bytes) where that needs fewer bytes.
MemoryPlan pass_plan_memory(Graph &g, const CompileOptions &opt, const Program &prog, int64_t slots = 1);

// schedule.cc: the step's pipeline schedule over the mesh's pp axis (one stage
// without one) and option micro_batches, and with several stages (or option
// pp_stages) the graph's blocks cut into them; refuses what cannot run.
Schedule pass_schedule(const Graph &g, const CompileOptions &opt);
// stages.cc: with several pipeline stages, the forward graph cut down to this
// rank's stage (its pp index): the nodes of its blocks (the embedding on the
// first stage, the head and loss on the last), the parameters they read, the
// activations other stages compute as inputs received from them, those later
// stages read kept to be sent. Runs after place, before autodiff. No-op with one stage.
StageCut pass_stages(Graph &g, const CompileOptions &opt, const Schedule &s);
// With chunks (interleaved): per node of the compiled graph, the chunk whose
// task runs it: its block's; a collective or a node outside every block, the
// chunk of the nearest compute node of a block before it in its phase (after
// it for the nodes before the first). Refuses (CTR_STATUS_UNSUPPORTED) a phase whose chunks are out of
// order (forward ascending, backward descending). Without chunks, empty.
std::vector<int> node_chunks(const Graph &g, const StageCut &cut);

// Dump of a program's instruction lists.
std::string dump_program(const Graph &g, const Program &p);

}  // namespace ctr
