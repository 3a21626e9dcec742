// The op set: for every op, its arity, shape rule, FLOP count and VJP rule.
//
// Forward ops may appear in graph files. Backward ops (suffix _bwd and the
// helpers autodiff emits) are internal: a file that names one is refused as an
// unknown op. An op's saved outputs — statistics that its backward reuses, such
// as layernorm's mean/rstd or attention's probabilities — are not declared in
// the file: infer_shapes appends them to the node as extra outputs.
#pragma once

#include <string>
#include <vector>

#include "graph/ir.h"

namespace ctr {

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

struct OpDef {
  const char *name;
  int min_inputs, max_inputs;
  int num_outputs;  // declared in the file
  std::vector<const char *> saved;  // suffixes of the saved outputs appended by infer_shapes
  bool internal;    // backward / helper op: not allowed in files
  // Output dtypes and shapes from input shapes and attributes; throws on mismatch.
  void (*infer)(const Graph &g, const Node &n, std::vector<OutInfo> &out);
  // Emits the backward nodes for node n (forward). Null for non-differentiable ops.
  void (*vjp)(VjpBuilder &b, const Node &n);
  // Forward FLOPs of node n with concrete shapes.
  double (*flops)(const Graph &g, const Node &n);
};

// nullptr when the op is unknown.
const OpDef *find_op(const std::string &name);

// Names of all ops that files may use.
std::vector<std::string> file_op_names();

}  // namespace ctr
