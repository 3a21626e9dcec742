// The op registry: one definition per op, read by every pass and backend.
//
// A definition holds everything the compiler and the runtime need to know about
// an op: its arity, its attributes decoded once (with their defaults) into a
// parameter struct that kernels read, its shape rule, its gradient (either the
// layout of the one backward op it emits, or a VJP function for ops that emit
// something else), its FLOP count and, for token-id inputs, the range of ids it
// accepts. Backends register kernels against the op's id; nothing on the hot
// path compares names. The recipe for adding an op is in docs/architecture.md.
//
// Forward ops may appear in graph files. Backward ops (suffix _bwd and the
// helpers autodiff emits) are internal: a file that names one is refused as an
// unknown op. An op's saved outputs — statistics that its backward reuses, such
// as layernorm's mean/rstd or attention's probabilities — are not declared in
// the file: infer_shapes appends them to the node as extra outputs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "graph/ir.h"

namespace ctr {

using OpId = int32_t;

struct OutInfo {
  ctr_dtype dtype = CTR_DTYPE_F32;
  std::vector<int64_t> shape;
};

// Collects gradients while autodiff walks the forward graph backwards.
class VjpBuilder {
 public:
  virtual ~VjpBuilder() = default;
  virtual Graph &graph() = 0;
  // Gradient of forward tensor t, or -1 when no gradient reaches it.
  virtual int grad(int t) = 0;
  // Whether forward tensor t needs a gradient (it depends on a parameter).
  virtual bool needs(int t) = 0;
  // Adds g to the gradient of forward tensor t.
  virtual void accumulate(int t, int g) = 0;
  // A new backward tensor shaped like forward tensor `like`, named after it.
  virtual int new_grad_tensor(int like, const std::string &suffix) = 0;
  // Appends a backward node.
  virtual void emit(const std::string &op, std::vector<int> in, std::vector<int> out,
                    std::map<std::string, Attr> attrs, int block) = 0;
};

// One input of a backward op, taken from its forward node.
struct BwdSlot {
  enum Kind : uint8_t { Grad, Input, Output } kind;  // d(output i), input i, output i
  int index;
};

// The backward op an op emits when its gradient is one op: its inputs, and that
// its outputs are the gradients of the forward inputs in order (all of them, or
// the first `grads` when grads > 0). The forward node's attributes are passed on.
struct BwdSpec {
  std::string op;               // empty: the op uses a vjp function (or has no gradient)
  std::vector<BwdSlot> inputs;
  int grads = 0;                // 0 = one gradient per forward input
};

// What a collective op does across the ranks of its axis. Passes, lower and
// the executor recognise collectives by this kind, never by their op names.
enum class CollKind : uint8_t {
  None = 0,
  AllGather,      // every member's block, concatenated in rank order
  ReduceScatter,  // the reduction, this member's block of it
  AllReduce,      // the reduction, whole
  Dispatch,       // expert exchange: tokens to the ranks holding their experts
  Combine,        // expert exchange: expert outputs back to the tokens' ranks
  DispatchRows,   // expert exchange: gradient rows along a dispatch's routes
  AllToAll,       // dim-0 block j to member j; block i of the output from member i
  Shift,          // the whole tensor to member (r + shift) mod n, from member (r - shift) mod n
};

// One tensor's placement along one mesh axis, as sharding rules see it.
struct AxisState {
  enum Kind : uint8_t { Replicate = 0, Shard = 1, Partial = 2 };
  Kind kind = Replicate;
  int dim = 0;  // Shard: the split dimension

  static AxisState replicate() { return {}; }
  static AxisState shard(int d) { return {Shard, d}; }
  static AxisState partial() { return {Partial, 0}; }
  bool operator==(const AxisState &o) const { return kind == o.kind && (kind != Shard || dim == o.dim); }
  bool operator!=(const AxisState &o) const { return !(*this == o); }
};
std::string axis_state_string(const AxisState &s);  // "R", "S(2)", "P"

// A sharding rule: how an op runs on the local blocks of its inputs when they
// are placed along one mesh axis of `ranks` ranks as `in` says (one entry per
// input). On success it fills `out` (one entry per output, saved outputs
// included), rewrites in *n the attributes that count a split dimension (the
// heads of attention on a tensor split by heads) and returns "". Otherwise it
// returns why the op cannot run on those placements; the placement pass then
// leaves the inputs whole, or refuses naming the reason. An op without a rule
// runs on replicated inputs only.
// The refusal says why; `misfit` marks a size the axis does not divide (a head
// count), which the placement pass reports as the mesh not fitting the model
// rather than as a reason to leave the tensors whole.
struct ShardRefusal {
  std::string why;
  bool misfit = false;
  ShardRefusal() = default;
  ShardRefusal(std::string w, bool m = false) : why(std::move(w)), misfit(m) {}  // NOLINT: implicit
  ShardRefusal(const char *w) : why(w) {}                                         // NOLINT: implicit
  bool empty() const { return why.empty(); }
  operator std::string() const { return why; }  // NOLINT: implicit
};
using ShardRule = ShardRefusal (*)(const Graph &g, Node *n, const std::vector<AxisState> &in, int64_t ranks,
                                   std::vector<AxisState> &out);

struct OpDef {
  std::string name;
  int min_inputs = 1, max_inputs = 1;
  int num_outputs = 1;              // declared in the file (backward ops: produced)
  std::vector<std::string> saved;   // suffixes of the saved outputs appended by infer_shapes
  bool internal = false;            // backward / helper op: not allowed in files
  // Selective recompute recomputes this op's outputs instead of keeping them
  // (element-wise and normalisation ops; not GEMMs or attention).
  bool cheap_to_recompute = false;
  // The outputs hold values of the inputs, only rearranged (layout ops): an id
  // range that a reader of an output asks for applies to the inputs as well.
  bool moves_values = false;

  // Output dtypes and shapes from input shapes and attributes; throws
  // CTR_STATUS_INVALID_GRAPH naming the node on a mismatch. Internal ops have
  // none: their outputs mirror the forward tensors they are gradients of.
  void (*infer)(const Graph &g, const Node &n, std::vector<OutInfo> &out) = nullptr;

  // The gradient: bwd (declarative) or vjp (a function), or neither.
  BwdSpec bwd;
  void (*vjp)(VjpBuilder &b, const Node &n) = nullptr;

  // Forward FLOPs of node n with concrete shapes; null counts 0.
  double (*flops)(const Graph &g, const Node &n) = nullptr;

  // Attributes decoded once into a parameter struct of params_size bytes (a
  // struct of kernels/common/op_params.h, or the op's own), defaults applied.
  // Null when kernels need no attributes.
  size_t params_size = 0;
  void (*decode)(const Graph &g, const Node &n, void *params) = nullptr;

  // For an int32 input holding ids: the valid range [lo, hi) given the node's
  // shapes. Returns false when input i is not an id input of this op.
  bool (*id_range)(const Graph &g, const Node &n, int input, int64_t *lo, int64_t *hi) = nullptr;

  // A collective (run by the executor on the comm stream, no kernel), or None.
  CollKind collective = CollKind::None;

  // How the op runs on sharded inputs (see ShardRule); null: replicated only.
  ShardRule shard_rule = nullptr;

  // Outputs (bit k: output k) that a kernel writes in f32 when the op's data is
  // bf16: parameter gradients the GEMMs, column sums, norms and embedding
  // accumulate in f32. Any other f32 output of a node on bf16 data is computed
  // in bf16 and widened by a cast (the precision pass).
  uint32_t f32_outputs = 0;

  OpId id = -1;  // assigned by the registry
};

// The collective kind of a node's op (None for compute and unknown ops).
CollKind collective_kind(const Node &n);
// An expert exchange: a collective that compute reads at once.
inline bool is_exchange_kind(CollKind k) {
  return k == CollKind::Dispatch || k == CollKind::Combine || k == CollKind::DispatchRows;
}

// Registers an op (a library op at start-up, or a host's own op before the step
// that uses it is created). Fails with CTR_STATUS_INVALID_ARGUMENT when the
// name is taken or the definition is inconsistent. Thread-safe.
OpId register_op(OpDef def);

// nullptr when the op is unknown. Definitions never move once registered.
const OpDef *find_op(const std::string &name);
const OpDef *op_by_id(OpId id);

// Names of all ops that files may use.
std::vector<std::string> file_op_names();

// Evaluates a size expression of node n's attribute `attr`: a product of terms
// separated by '*', each a non-negative integer or a symbol bound in g.symbols
// ("seq", "batch*seq", "4*seq"). Throws INVALID_GRAPH naming the node, the
// attribute and the expression for an unknown symbol, an empty or malformed
// term, a negative number or an overflow of int64.
int64_t eval_size(const Graph &g, const Node &n, const std::string &attr, const std::string &expr);

// A node's decoded parameters (empty when its op has none).
std::vector<uint8_t> decode_params(const Graph &g, const Node &n);

}  // namespace ctr
