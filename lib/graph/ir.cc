// Graph IR helpers and the textual dump printed by `ctr graph inspect`.

#include "graph/ir.h"

#include <sstream>

#include "core/status.h"

namespace ctr {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Tensor::bytes() const { return numel() * static_cast<int64_t>(dtype_size(dtype)); }

int64_t Node::attr_int(const std::string &k, int64_t def) const {
  auto it = attrs.find(k);
  if (it == attrs.end()) return def;
  if (it->second.type == Attr::Int) return it->second.i;
  if (it->second.type == Attr::Float) return static_cast<int64_t>(it->second.f);
  fail(CTR_STATUS_INVALID_GRAPH,
       strformat("node '%s' (%s): attribute '%s' must be an integer", name.c_str(), op.c_str(),
                 k.c_str()));
}

double Node::attr_float(const std::string &k, double def) const {
  auto it = attrs.find(k);
  if (it == attrs.end()) return def;
  if (it->second.type == Attr::Float) return it->second.f;
  if (it->second.type == Attr::Int) return static_cast<double>(it->second.i);
  fail(CTR_STATUS_INVALID_GRAPH,
       strformat("node '%s' (%s): attribute '%s' must be a number", name.c_str(), op.c_str(),
                 k.c_str()));
}

std::vector<int64_t> Node::attr_ints(const std::string &k) const {
  auto it = attrs.find(k);
  if (it == attrs.end()) return {};
  if (it->second.type == Attr::Ints) return it->second.ints;
  fail(CTR_STATUS_INVALID_GRAPH,
       strformat("node '%s' (%s): attribute '%s' must be a list of integers", name.c_str(),
                 op.c_str(), k.c_str()));
}

std::string Node::attr_string(const std::string &k, const std::string &def) const {
  auto it = attrs.find(k);
  if (it == attrs.end()) return def;
  if (it->second.type == Attr::String) return it->second.s;
  fail(CTR_STATUS_INVALID_GRAPH,
       strformat("node '%s' (%s): attribute '%s' must be a string", name.c_str(), op.c_str(),
                 k.c_str()));
}

int Graph::find_tensor(const std::string &n) const {
  for (size_t i = 0; i < tensors.size(); ++i)
    if (tensors[i].name == n) return static_cast<int>(i);
  return -1;
}

int Graph::add_tensor(Tensor t) {
  tensors.push_back(std::move(t));
  return static_cast<int>(tensors.size() - 1);
}

int Graph::add_node(Node n) {
  nodes.push_back(std::move(n));
  return static_cast<int>(nodes.size() - 1);
}

std::string Graph::describe_tensor(int id) const {
  if (id < 0 || id >= static_cast<int>(tensors.size())) return strformat("#%d", id);
  return strformat("'%s' (#%d)", tensors[id].name.c_str(), id);
}

std::string Graph::meta(const std::string &key, const std::string &def) const {
  for (const auto &kv : metadata)
    if (kv.first == key) return kv.second;
  return def;
}

const char *dtype_name(ctr_dtype d) {
  switch (d) {
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

size_t dtype_size(ctr_dtype d) {
  switch (d) {
    case CTR_DTYPE_F32: return 4;
    case CTR_DTYPE_F16: return 2;
    case CTR_DTYPE_BF16: return 2;
    case CTR_DTYPE_I32: return 4;
    case CTR_DTYPE_I64: return 8;
    case CTR_DTYPE_U16: return 2;
    case CTR_DTYPE_U32: return 4;
    case CTR_DTYPE_U8: return 1;
    case CTR_DTYPE_F64: return 8;
  }
  return 0;
}

std::string shape_string(const std::vector<int64_t> &s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i)
    out += (i ? "," : "") + std::to_string(s[i]);
  return out + "]";
}

std::string dims_string(const std::vector<Dim> &d) {
  std::string out = "[";
  for (size_t i = 0; i < d.size(); ++i)
    out += (i ? "," : "") + (d[i].symbol.empty() ? std::to_string(d[i].size) : d[i].symbol);
  return out + "]";
}

namespace {
const char *role_name(Role r) {
  switch (r) {
    case Role::Activation: return "act";
    case Role::Input: return "input";
    case Role::Param: return "param";
    case Role::Const: return "const";
  }
  return "?";
}
const char *storage_name(Storage s) {
  switch (s) {
    case Storage::None: return "";
    case Storage::Arena: return "arena";
    case Storage::Param: return "param";
    case Storage::Grad: return "grad";
    case Storage::Input: return "input";
    case Storage::Const: return "const";
  }
  return "?";
}
}  // namespace

std::string dump_graph(const Graph &g) {
  std::ostringstream os;
  os << "graph '" << g.name << "' format " << g.format_version << ": " << g.tensors.size()
     << " tensors, " << g.nodes.size() << " nodes";
  if (g.num_forward >= 0) os << " (" << g.num_forward << " forward)";
  os << ", loss " << g.describe_tensor(g.loss) << "\n";
  for (const auto &kv : g.metadata) os << "  meta " << kv.first << " = " << kv.second << "\n";
  auto tensor_str = [&](int id) {
    const Tensor &t = g.tensors[id];
    std::string s = "%" + std::to_string(id) + " " + t.name + ":" + dtype_name(t.dtype) +
                    (t.has_shape ? shape_string(t.shape) : dims_string(t.dims));
    return s;
  };
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const Tensor &t = g.tensors[i];
    if (t.role == Role::Activation) continue;
    os << "  " << role_name(t.role) << " " << tensor_str(static_cast<int>(i));
    if (t.no_decay) os << " no_decay";
    if (!t.placement.axes.empty()) {
      os << " placed " << placement_string(t.placement);
      if (t.placement.sharded()) os << " of " << shape_string(t.placement.global_shape);
    }
    if (t.storage != Storage::None) os << " @" << storage_name(t.storage) << "+" << t.offset;
    os << "\n";
  }
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node &nd = g.nodes[n];
    if (g.num_forward >= 0 && static_cast<int>(n) == g.num_forward)
      os << (g.num_input_grad >= 0 ? "  -- backward: input gradients --\n" : "  -- backward --\n");
    if (g.num_input_grad >= 0 && static_cast<int>(n) == g.num_input_grad) os << "  -- backward: weight gradients --\n";
    os << "  [" << n << "] ";
    for (size_t i = 0; i < nd.outputs.size(); ++i) os << (i ? ", " : "") << tensor_str(nd.outputs[i]);
    os << " = " << nd.op << "(";
    for (size_t i = 0; i < nd.inputs.size(); ++i) os << (i ? ", " : "") << "%" << nd.inputs[i];
    os << ")";
    for (const auto &kv : nd.attrs) {
      os << " " << kv.first << "=";
      const Attr &a = kv.second;
      switch (a.type) {
        case Attr::Int: os << a.i; break;
        case Attr::Float: os << a.f; break;
        case Attr::String: os << '"' << a.s << '"'; break;
        case Attr::Ints: os << shape_string(a.ints); break;
        case Attr::Floats:
          os << "[";
          for (size_t j = 0; j < a.floats.size(); ++j) os << (j ? "," : "") << a.floats[j];
          os << "]";
          break;
      }
    }
    if (nd.block >= 0) os << " block=" << nd.block;
    bool any_storage = false;
    for (int o : nd.outputs) any_storage |= g.tensors[o].storage != Storage::None;
    if (any_storage) {
      os << "  ->";
      for (int o : nd.outputs)
        os << " " << storage_name(g.tensors[o].storage) << "+" << g.tensors[o].offset;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace ctr
