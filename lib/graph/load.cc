// Reading a .ctrg file into the IR.
//
// Order of checks: size, file identifier, FlatBuffers verifier (so no accessor
// below can read out of bounds), format version, then every index the file
// holds. Each failure names the file and the field at fault. Semantic rules
// (ops, dtypes, shapes, cycles) are the verify pass's job.

#include <cstring>
#include <fstream>
#include <sstream>

#include "core/files.h"
#include "core/status.h"
#include "ctr_graph_generated.h"
#include "graph/ir.h"

namespace ctr {
namespace {

[[noreturn]] void bad(const std::string &src, const std::string &what) {
  fail(CTR_STATUS_INVALID_GRAPH, src + ": " + what);
}

}  // namespace

Graph load_graph_buffer(const void *data, size_t size, const std::string &src) {
  CTR_REQUIRE(data != nullptr || size == 0, CTR_STATUS_INVALID_ARGUMENT, "%s: data is NULL",
              src.c_str());
  // A file is a size-prefixed FlatBuffer: 4 bytes of length, then the buffer
  // whose bytes 4..8 are the identifier. The prefix makes truncation exact.
  if (size < 12)
    bad(src, strformat("file is truncated (%zu bytes; a graph file has at least 12)", size));
  const auto *bytes = static_cast<const uint8_t *>(data);
  if (!flatbuffers::BufferHasIdentifier(bytes, fb::GraphIdentifier(), true)) {
    char id[5] = {0};
    std::memcpy(id, bytes + 8, 4);
    for (char &c : id)
      if (c && (c < 32 || c > 126)) c = '?';
    bad(src, strformat("wrong file identifier '%s' (expected '%s'): not a libctr graph file", id,
                       fb::GraphIdentifier()));
  }
  uint32_t body = flatbuffers::ReadScalar<uint32_t>(bytes);
  if (static_cast<uint64_t>(body) + 4 > size)
    bad(src, strformat("file is truncated (%zu bytes, its header says %llu)", size,
                       static_cast<unsigned long long>(body) + 4));
  if (static_cast<uint64_t>(body) + 4 < size)
    bad(src, strformat("file has %llu unexpected bytes after the graph",
                       static_cast<unsigned long long>(size - body - 4)));
  // The verifier needs the buffer aligned; copy when the caller's is not.
  std::vector<uint8_t> aligned;
  if (reinterpret_cast<uintptr_t>(bytes) % 8 != 0) {
    aligned.assign(bytes, bytes + size);
    bytes = aligned.data();
  }
  flatbuffers::Verifier verifier(bytes, size, 64, 10000000);
  if (!fb::VerifySizePrefixedGraphBuffer(verifier))
    bad(src, "file is corrupt (FlatBuffers verification failed)");
  const fb::Graph *fg = fb::GetSizePrefixedGraph(bytes);
  if (fg->format_version() == 0 || fg->format_version() > kFormatVersion)
    bad(src, strformat("unsupported format version %u (this library reads versions 1..%u)",
                       fg->format_version(), kFormatVersion));

  Graph g;
  g.format_version = fg->format_version();
  if (fg->name()) g.name = fg->name()->str();
  const int ntensors = fg->tensors() ? static_cast<int>(fg->tensors()->size()) : 0;
  if (fg->tensors()) {
    for (int i = 0; i < ntensors; ++i) {
      const fb::Tensor *ft = fg->tensors()->Get(i);
      Tensor t;
      t.name = ft->name()->str();
      int dt = static_cast<int>(ft->dtype());
      if (dt < 0 || dt > static_cast<int>(CTR_DTYPE_F64))
        bad(src, strformat("tensor '%s' has unknown dtype %d", t.name.c_str(), dt));
      t.dtype = static_cast<ctr_dtype>(dt);
      int role = static_cast<int>(ft->role());
      if (role < 0 || role > 3)
        bad(src, strformat("tensor '%s' has unknown role %d", t.name.c_str(), role));
      t.role = static_cast<Role>(role);
      if (ft->shape()) {
        for (const fb::Dim *d : *ft->shape()) {
          Dim dim;
          dim.size = d->size();
          if (d->symbol()) dim.symbol = d->symbol()->str();
          t.dims.push_back(dim);
        }
      }
      if (const fb::Init *fi = ft->init()) {
        int k = static_cast<int>(fi->kind());
        if (k < 0 || k > 4)
          bad(src, strformat("tensor '%s' has unknown init kind %d", t.name.c_str(), k));
        t.init.kind = static_cast<InitKind>(k);
        t.init.mean = fi->mean();
        t.init.std = fi->std();
        t.init.low = fi->low();
        t.init.high = fi->high();
      }
      if (ft->data()) t.data.assign(ft->data()->begin(), ft->data()->end());
      if (const fb::ShardHint *sh = ft->shard()) {
        if (sh->axis()) t.shard_axis = sh->axis()->str();
        t.shard_dim = sh->dim();
      }
      t.no_decay = ft->no_decay();
      g.tensors.push_back(std::move(t));
    }
  }
  if (fg->nodes()) {
    int idx = 0;
    for (const fb::Node *fn : *fg->nodes()) {
      Node n;
      n.op = fn->op()->str();
      n.name = fn->name() ? fn->name()->str() : strformat("node%d", idx);
      n.block = fn->block();
      auto ids = [&](const flatbuffers::Vector<uint32_t> *v, std::vector<int> &out,
                     const char *what) {
        if (!v) return;
        for (uint32_t id : *v) {
          if (id >= static_cast<uint32_t>(ntensors))
            bad(src, strformat("node '%s' (%s): %s tensor id %u does not exist (file has %d "
                               "tensors)",
                               n.name.c_str(), n.op.c_str(), what, id, ntensors));
          out.push_back(static_cast<int>(id));
        }
      };
      ids(fn->inputs(), n.inputs, "input");
      ids(fn->outputs(), n.outputs, "output");
      if (fn->attrs()) {
        for (const fb::Attr *fa : *fn->attrs()) {
          Attr a;
          int ty = static_cast<int>(fa->type());
          if (ty < 0 || ty > 4)
            bad(src, strformat("node '%s': attribute '%s' has unknown type %d", n.name.c_str(),
                               fa->name()->c_str(), ty));
          a.type = static_cast<Attr::Type>(ty);
          a.i = fa->i();
          a.f = fa->f();
          if (fa->s()) a.s = fa->s()->str();
          // The verifier checks a vector's length field, not that its 8-byte
          // elements are 8-byte aligned (a crafted file may misplace them):
          // copy the bytes rather than load them as int64/double.
          if (fa->ints() && fa->ints()->size() > 0) {
            a.ints.resize(fa->ints()->size());
            std::memcpy(a.ints.data(), fa->ints()->Data(), a.ints.size() * sizeof(int64_t));
          }
          if (fa->floats() && fa->floats()->size() > 0) {
            a.floats.resize(fa->floats()->size());
            std::memcpy(a.floats.data(), fa->floats()->Data(), a.floats.size() * sizeof(double));
          }
          n.attrs[fa->name()->str()] = std::move(a);
        }
      }
      g.nodes.push_back(std::move(n));
      ++idx;
    }
  }
  if (fg->loss() >= static_cast<uint32_t>(ntensors))
    bad(src, strformat("loss tensor id %u does not exist (file has %d tensors)", fg->loss(),
                       ntensors));
  g.loss = static_cast<int>(fg->loss());
  if (fg->metadata())
    for (const fb::KeyValue *kv : *fg->metadata())
      g.metadata.emplace_back(kv->key()->str(), kv->value() ? kv->value()->str() : "");
  return g;
}

Graph load_graph_file(const std::string &path) {
  const std::string s = read_regular_file(path, "graph file", CTR_STATUS_IO_ERROR);
  std::vector<uint8_t> buf(s.begin(), s.end());
  return load_graph_buffer(buf.data(), buf.size(), path);
}

}  // namespace ctr
