// Writing the IR as a .ctrg file. Only what a file may hold is written: the
// declared tensors and nodes of the forward graph, never pass annotations.

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/status.h"
#include "ctr_graph_generated.h"
#include "graph/ir.h"

namespace ctr {

std::vector<uint8_t> save_graph_buffer(const Graph &g) {
  CTR_REQUIRE(g.num_forward < 0, CTR_STATUS_INVALID_STATE,
              "graph '%s' has been through autodiff; only forward graphs are saved",
              g.name.c_str());
  flatbuffers::FlatBufferBuilder b(1 << 16);
  std::vector<flatbuffers::Offset<fb::Tensor>> tensors;
  for (const Tensor &t : g.tensors) {
    std::vector<flatbuffers::Offset<fb::Dim>> dims;
    for (const Dim &d : t.dims)
      dims.push_back(fb::CreateDim(b, d.size, d.symbol.empty() ? 0 : b.CreateString(d.symbol)));
    auto name = b.CreateString(t.name);
    auto shape = b.CreateVector(dims);
    auto init = fb::CreateInit(b, static_cast<fb::InitKind>(t.init.kind), t.init.mean,
                               t.init.std, t.init.low, t.init.high);
    auto data = t.data.empty() ? 0 : b.CreateVector(t.data);
    auto shard = t.shard_axis.empty()
                     ? 0
                     : fb::CreateShardHint(b, b.CreateString(t.shard_axis), t.shard_dim);
    tensors.push_back(fb::CreateTensor(b, name, static_cast<fb::DType>(t.dtype), shape,
                                       static_cast<fb::Role>(t.role), init, data, shard,
                                       t.no_decay));
  }
  std::vector<flatbuffers::Offset<fb::Node>> nodes;
  for (const Node &n : g.nodes) {
    std::vector<flatbuffers::Offset<fb::Attr>> attrs;
    for (const auto &kv : n.attrs) {
      const Attr &a = kv.second;
      auto an = b.CreateString(kv.first);
      auto as = a.s.empty() ? 0 : b.CreateString(a.s);
      auto ai = a.ints.empty() ? 0 : b.CreateVector(a.ints);
      auto af = a.floats.empty() ? 0 : b.CreateVector(a.floats);
      attrs.push_back(fb::CreateAttr(b, an, static_cast<fb::AttrType>(a.type), a.i, a.f, as, ai, af));
    }
    std::vector<uint32_t> in(n.inputs.begin(), n.inputs.end());
    std::vector<uint32_t> out(n.outputs.begin(), n.outputs.end());
    auto op = b.CreateString(n.op);
    auto name = b.CreateString(n.name);
    auto vin = b.CreateVector(in);
    auto vout = b.CreateVector(out);
    auto vattrs = b.CreateVector(attrs);
    nodes.push_back(fb::CreateNode(b, op, name, vin, vout, vattrs, n.block));
  }
  std::vector<flatbuffers::Offset<fb::KeyValue>> meta;
  for (const auto &kv : g.metadata)
    meta.push_back(fb::CreateKeyValue(b, b.CreateString(kv.first), b.CreateString(kv.second)));
  auto name = b.CreateString(g.name);
  auto vt = b.CreateVector(tensors);
  auto vn = b.CreateVector(nodes);
  auto vm = b.CreateVector(meta);
  auto root = fb::CreateGraph(b, g.format_version, name, vt, vn,
                              static_cast<uint32_t>(g.loss < 0 ? 0 : g.loss), vm);
  fb::FinishSizePrefixedGraphBuffer(b, root);
  return std::vector<uint8_t>(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
}

void save_graph_file(const Graph &g, const std::string &path) {
  std::vector<uint8_t> buf = save_graph_buffer(g);
  std::string tmp = path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    fail(CTR_STATUS_IO_ERROR,
         strformat("%s: cannot write graph file: %s", path.c_str(), std::strerror(errno)));
  size_t n = std::fwrite(buf.data(), 1, buf.size(), f);
  bool ok = n == buf.size() && std::fflush(f) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    fail(CTR_STATUS_IO_ERROR,
         strformat("%s: writing graph file failed: %s", path.c_str(), std::strerror(errno)));
  }
}

}  // namespace ctr
