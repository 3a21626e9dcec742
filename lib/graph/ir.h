// The in-memory graph IR that every compiler pass reads and rewrites.
//
// A Graph is the file's content in plain C++ types: tensors addressed by index,
// nodes in any order (verify establishes a topological order), attributes by
// name. Passes append tensors and nodes (autodiff adds the backward graph, later
// the shard pass adds collectives) and annotate tensors (concrete shapes, the
// memory plan's offsets) rather than building a new structure per stage, so one
// dump routine prints the graph after any pass.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ctr/ctr.h"
#include "graph/placement.h"

namespace ctr {

enum class Role : uint8_t { Activation = 0, Input = 1, Param = 2, Const = 3 };
enum class InitKind : uint8_t { Zeros = 0, Ones = 1, Normal = 2, Uniform = 3, Data = 4 };

struct Dim {
  int64_t size = 0;    // fixed size when symbol is empty
  std::string symbol;  // "batch", "seq", ...
};

struct InitSpec {
  InitKind kind = InitKind::Zeros;
  float mean = 0, std = 0, low = 0, high = 0;
};

struct Attr {
  enum Type : uint8_t { Int = 0, Float = 1, String = 2, Ints = 3, Floats = 4 } type = Int;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  static Attr of_int(int64_t v) {
    Attr a;
    a.type = Int;
    a.i = v;
    return a;
  }
  static Attr of_float(double v) {
    Attr a;
    a.type = Float;
    a.f = v;
    return a;
  }
  static Attr of_string(std::string v) {
    Attr a;
    a.type = String;
    a.s = std::move(v);
    return a;
  }
  static Attr of_ints(std::vector<int64_t> v) {
    Attr a;
    a.type = Ints;
    a.ints = std::move(v);
    return a;
  }
};

// Where a tensor's bytes live once the memory plan is made.
enum class Storage : uint8_t { None = 0, Arena, Param, Grad, Input, Const };

struct Tensor {
  std::string name;
  ctr_dtype dtype = CTR_DTYPE_F32;
  std::vector<Dim> dims;  // as declared in the file (possibly symbolic)
  Role role = Role::Activation;
  InitSpec init;
  std::vector<uint8_t> data;  // InitKind::Data payload
  std::string shard_axis;
  int shard_dim = 0;
  bool no_decay = false;

  // Filled by passes.
  std::vector<int64_t> shape;  // concrete, after infer_shapes
  bool has_shape = false;
  int grad_of = -1;            // autodiff: this tensor is d(loss)/d(tensor grad_of)
  Storage storage = Storage::None;
  int64_t offset = 0;          // plan_memory: byte offset within its storage
  int64_t alloc_bytes = 0;     // bytes to reserve when more than bytes() (padded collectives)
  bool keep = false;           // stays readable after the step (step option "keep")
  // An input of a pipeline stage that another stage computes (pass stages):
  // autodiff gives it a gradient, which goes back to that stage.
  bool wants_grad = false;
  // How the tensor is laid out over the mesh (graph/placement.h); shape is the
  // local block. Set by the placement passes (shard, expert).
  Placement placement;

  int64_t numel() const;
  int64_t bytes() const;
  int64_t alloc_size() const { return bytes() > alloc_bytes ? bytes() : alloc_bytes; }
};

struct Node {
  std::string op;
  std::string name;
  std::vector<int> inputs;
  std::vector<int> outputs;
  std::map<std::string, Attr> attrs;
  int block = -1;
  bool backward = false;  // created by autodiff

  static Node make(std::string op, std::string name, std::vector<int> inputs, std::vector<int> outputs, int block,
                   std::map<std::string, Attr> attrs = {}) {
    Node n;
    n.op = std::move(op);
    n.name = std::move(name);
    n.inputs = std::move(inputs);
    n.outputs = std::move(outputs);
    n.attrs = std::move(attrs);
    n.block = block;
    return n;
  }

  bool has_attr(const std::string &k) const { return attrs.count(k) != 0; }
  int64_t attr_int(const std::string &k, int64_t def) const;
  double attr_float(const std::string &k, double def) const;
  std::vector<int64_t> attr_ints(const std::string &k) const;
  std::string attr_string(const std::string &k, const std::string &def) const;
};

struct Graph {
  uint32_t format_version = 1;
  std::string name;
  std::vector<Tensor> tensors;
  std::vector<Node> nodes;
  int loss = -1;
  std::vector<std::pair<std::string, std::string>> metadata;

  // Forward nodes are nodes[0, num_forward) once autodiff has run.
  int num_forward = -1;
  // With a split backward (pass split_backward): nodes[num_forward,
  // num_input_grad) compute the input gradients, the rest the weight
  // gradients; -1 otherwise.
  int num_input_grad = -1;
  // The Const tensor holding d(loss)/d(loss), made by autodiff (-1 on a
  // pipeline stage without the loss).
  int loss_seed = -1;
  // Pipeline stages (pass stages): (activation sent to a later stage, the
  // input that receives its gradient from there), which autodiff seeds with;
  // and, filled by autodiff, (received input, its gradient, -1 if none).
  std::vector<std::pair<int, int>> grad_seeds;
  std::vector<std::pair<int, int>> input_grads;
  // Values of the symbolic dims ("batch", "seq"), bound by infer_shapes before
  // any shape rule runs; size expressions in attributes read them (eval_size).
  std::map<std::string, int64_t> symbols;

  int find_tensor(const std::string &name) const;  // -1 if absent
  int add_tensor(Tensor t);
  int add_node(Node n);
  std::string describe_tensor(int id) const;  // "'name' (#id)" for messages
  std::string meta(const std::string &key, const std::string &def = "") const;
};

const char *dtype_name(ctr_dtype d);
size_t dtype_size(ctr_dtype d);
std::string shape_string(const std::vector<int64_t> &s);
std::string dims_string(const std::vector<Dim> &d);

// Human-readable dump of the graph in its current state (used by `graph inspect`).
std::string dump_graph(const Graph &g);

// Graph file I/O (load.cc, save.cc). Loading runs the FlatBuffers verifier and
// the structural checks that need the raw file (ids in range, identifier,
// version); semantic checks are the verify pass.
Graph load_graph_buffer(const void *data, size_t size, const std::string &source);
Graph load_graph_file(const std::string &path);
std::vector<uint8_t> save_graph_buffer(const Graph &g);
void save_graph_file(const Graph &g, const std::string &path);

constexpr uint32_t kFormatVersion = 1;

}  // namespace ctr
