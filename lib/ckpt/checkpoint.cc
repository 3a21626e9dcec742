// Distributed checkpoints: save on one mesh, load on any other.
//
// A checkpoint is a directory:
//   meta.json          format, step, the graph's parameters (full shapes), mesh,
//                      options, loader state, and for every tensor (param, Adam m,
//                      Adam v) which rows each shard file holds at which offset,
//                      with an xxh3 checksum per block of rows; and a checksum of
//                      all of that (xxh3 of its compact JSON without the key)
//   rank00000.bin ...  one file per writing rank: its rows of every tensor
//
// Only the first replica of each shard writes its rows (dp index 0; for the
// replicated parts of an expert-parallel mesh, one rank of each group), so no
// row is written twice. Checksums cover blocks of about 1 MiB of rows, so a rank that
// loads a different slice (another fsdp degree) reads only the blocks it
// overlaps and still verifies everything it reads.
//
// Saving goes to DIR.tmp; every file is fsynced; rank 0 writes meta.json last,
// then swaps DIR.tmp into place with renames and fsyncs the parent. A crash at
// any point leaves either the old DIR or the new one, never a partial one.
// Loading reads and verifies everything into staging buffers first and commits
// only when every rank succeeded, so a failed load changes nothing. Nothing in
// the metadata is trusted before it is checked: its checksum first, then every
// row range, offset and block size against the graph and the shard files' real
// sizes, so damage is a CTR_STATUS_CHECKPOINT_ERROR naming it (and a resume
// falls back to an older checkpoint) rather than an absurd allocation.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/files.h"
#include "core/status.h"
#include "data/data.h"
#include "ckpt/pending_save.h"
#include "ckpt/checkpoint.h"
#include "graph/ir.h"
#include "runtime/mesh.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ctr {
namespace {

// Version 2 added the metadata checksum; version 1 checkpoints still load.
// Version 3: shard entries are boxes ("box", per dim [lo, hi)); versions 1
// and 2 wrote row ranges ("rows"), read as boxes whole in every other dim.
constexpr int kCheckpointVersion = 3;
constexpr int64_t kBlockBytes = 1 << 20;
// Larger checksum blocks than any writer makes are refused before a buffer is
// sized from them.
constexpr int64_t kMaxBlockBytes = int64_t{64} << 20;
// A step count past this is damage, not a long run.
constexpr int64_t kMaxStep = int64_t{1} << 40;
const char *kKinds[3] = {"param", "adam_m", "adam_v"};

[[noreturn]] void ckpt_fail(const std::string &msg) { fail(CTR_STATUS_CHECKPOINT_ERROR, msg); }

void fsync_path(const std::string &path, bool dir) {
  int fd = ::open(path.c_str(), (dir ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot open to sync: %s", path.c_str(), std::strerror(errno)));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail(CTR_STATUS_IO_ERROR, strformat("%s: fsync failed: %s", path.c_str(), std::strerror(errno)));
}

void write_all(int fd, const void *data, size_t n, const std::string &path) {
  const char *p = static_cast<const char *>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(CTR_STATUS_IO_ERROR, strformat("%s: write failed: %s", path.c_str(), std::strerror(errno)));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void write_file(const std::string &path, const std::string &text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot create: %s", path.c_str(), std::strerror(errno)));
  write_all(fd, text.data(), text.size(), path);
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail(CTR_STATUS_IO_ERROR, strformat("%s: fsync failed: %s", path.c_str(), std::strerror(errno)));
  }
  ::close(fd);
}

std::string hex64(uint64_t v) { return strformat("%016llx", static_cast<unsigned long long>(v)); }

std::string rank_file(int rank) { return strformat("rank%05d.bin", rank); }

// The metadata's own checksum: xxh3 of its compact JSON without the "checksum" key.
std::string meta_checksum(json meta) {
  meta.erase("checksum");
  const std::string text = meta.dump();
  return hex64(XXH3_64bits(text.data(), text.size()));
}

int64_t volume(const std::vector<int64_t> &lo, const std::vector<int64_t> &hi) {
  int64_t n = 1;
  for (size_t d = 0; d < lo.size(); ++d) n *= std::max<int64_t>(0, hi[d] - lo[d]);
  return n;
}

// Copies the box [a, b) (coordinates in the whole tensor) from a row-major
// array of extents src_ext whose first element is the whole's src_org, into
// one of extents dst_ext at dst_org.
void copy_box(const uint8_t *src, const std::vector<int64_t> &src_org, const std::vector<int64_t> &src_ext,
              uint8_t *dst, const std::vector<int64_t> &dst_org, const std::vector<int64_t> &dst_ext,
              const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
  const size_t nd = a.size();
  for (size_t d = 0; d < nd; ++d)
    if (a[d] >= b[d]) return;
  std::vector<int64_t> ss(nd, 1), ds(nd, 1);
  for (size_t d = nd - 1; d > 0; --d) {
    ss[d - 1] = ss[d] * src_ext[d];
    ds[d - 1] = ds[d] * dst_ext[d];
  }
  const size_t run = static_cast<size_t>(b[nd - 1] - a[nd - 1]) * 4;
  std::vector<int64_t> i(a);  // an odometer over the leading dims
  for (;;) {
    int64_t so = 0, dof = 0;
    for (size_t d = 0; d < nd; ++d) {
      so += (i[d] - src_org[d]) * ss[d];
      dof += (i[d] - dst_org[d]) * ds[d];
    }
    std::memcpy(dst + dof * 4, src + so * 4, run);
    size_t d = nd - 1;
    for (;;) {
      if (d == 0) return;
      --d;
      if (++i[d] < b[d]) break;
      i[d] = a[d];
    }
  }
}

// The whole tensor's extents as checkpoints cut it (a scalar is one element).
std::vector<int64_t> full_extents(const ShardView &v) {
  return v.full_shape.empty() ? std::vector<int64_t>{1} : v.full_shape;
}

// A fingerprint of what a checkpoint must match: parameter names and full shapes.
json graph_params(const std::vector<ShardView> &shards, const CheckpointInfo &info) {
  json out = json::array();
  if (!info.graph_params.empty()) {
    for (const auto &[name, shape] : info.graph_params) out.push_back({{"name", name}, {"shape", shape}});
    return out;
  }
  for (const ShardView &v : shards) out.push_back({{"name", v.name}, {"shape", v.full_shape}});
  return out;
}

}  // namespace

Checkpointer::Checkpointer(const Mesh &mesh, int64_t publish_lag) : mesh_(mesh), lag_(publish_lag) {}

Checkpointer::~Checkpointer() {
  try {
    abandon();
  } catch (...) {
    // noexcept destructor: a failing background write is simply not published
  }
}

// ---------------------------------------------------------------------------
// Save

namespace {

// Writes this rank's shard file and index into the temporary directory.
void write_shard(PendingSave &p, int rank) {
  try {
    std::string path = p.tmp + "/" + rank_file(rank);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot create: %s", path.c_str(), std::strerror(errno)));
    json index = json::array();
    for (const auto &e : p.entries) {
      json hashes = json::array();
      const int64_t rows = e.hi[0] - e.lo[0];
      for (int64_t r = 0; r < rows; r += e.block_rows) {
        int64_t n = std::min(e.block_rows, rows - r) * e.row_bytes;
        hashes.push_back(hex64(XXH3_64bits(p.bytes.data() + e.offset + r * e.row_bytes, static_cast<size_t>(n))));
      }
      json box = json::array();
      for (size_t d = 0; d < e.lo.size(); ++d) box.push_back({e.lo[d], e.hi[d]});
      index.push_back({{"tensor", e.tensor}, {"kind", e.kind}, {"file", rank_file(rank)}, {"offset", e.offset},
                       {"box", box}, {"block_rows", e.block_rows}, {"xxh3", hashes}});
    }
    try {
      write_all(fd, p.bytes.data(), p.bytes.size(), path);
      if (::fsync(fd) != 0) fail(CTR_STATUS_IO_ERROR, strformat("%s: fsync failed: %s", path.c_str(), std::strerror(errno)));
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    write_file(p.tmp + "/" + strformat("rank%05d.json", rank), index.dump());
    // Fault injection for the crash-safety test: die after the shard files are
    // written but before the checkpoint is published.
    if (const char *f = std::getenv("CTR_FAULT_INJECT"); f && std::strcmp(f, "save_before_publish") == 0) _exit(86);
  } catch (const Error &e) {
    p.err = e.message();
  } catch (const std::exception &e) {
    p.err = strformat("%s: %s", p.tmp.c_str(), e.what());
  }
}

}  // namespace

void Checkpointer::save(const CheckpointState &s, const CheckpointInfo &info, const std::string &dir_in, bool async,
                        std::function<void()> on_publish) {
  CTR_REQUIRE(!dir_in.empty(), CTR_STATUS_INVALID_ARGUMENT, "ctr_step_save: empty directory name");
  finish();
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  auto p = std::make_unique<PendingSave>();
  p->dir = dir;
  p->tmp = dir + ".tmp";
  p->writer = info.writer;
  p->on_publish = std::move(on_publish);
  const int rank = mesh_.rank;

  // Rank 0 prepares the temporary directory.
  std::string err;
  if (rank == 0) {
    try {
      std::error_code ec;
      fs::remove_all(p->tmp, ec);
      fs::path parent = fs::path(dir).parent_path();
      if (!parent.empty()) fs::create_directories(parent, ec);
      if (!fs::create_directory(p->tmp, ec))
        fail(CTR_STATUS_IO_ERROR, strformat("%s: cannot create checkpoint directory: %s", p->tmp.c_str(),
                                            ec.message().c_str()));
    } catch (const Error &e) {
      err = e.message();
    }
  }
  if (std::string agreed = mesh_.first_error(err); !agreed.empty()) fail(CTR_STATUS_IO_ERROR, agreed);

  // Snapshot: this rank's blocks of params and optimizer state (the valid
  // box of each, compacted), and the metadata.
  const std::vector<ShardView> shards = s.checkpoint_shards();
  if (p->writer) {
    int64_t total = 0;
    for (const ShardView &v : shards)
      if (v.write) total += 3 * volume(std::vector<int64_t>(v.valid.size(), 0), v.valid) * 4;
    p->bytes.resize(static_cast<size_t>(total));
    int64_t offset = 0;
    std::vector<uint8_t> local;
    for (const ShardView &v : shards) {
      const std::vector<int64_t> zero(v.valid.size(), 0);
      const int64_t bytes = volume(zero, v.valid) * 4;
      if (bytes <= 0 || !v.write) continue;
      std::vector<int64_t> hi(v.first);
      for (size_t d = 0; d < hi.size(); ++d) hi[d] += v.valid[d];
      const int64_t row_bytes = bytes / v.valid[0];
      // Whole in every dim but the first: the valid box is a prefix of the block.
      bool prefix = true;
      for (size_t d = 1; d < v.valid.size(); ++d) prefix &= v.valid[d] == v.local_shape[d];
      for (int k = 0; k < 3; ++k) {
        if (prefix) {
          s.checkpoint_read(p->bytes.data() + offset, v.buffers[k], static_cast<size_t>(bytes));
        } else {
          local.resize(static_cast<size_t>(v.n) * 4);
          s.checkpoint_read(local.data(), v.buffers[k], local.size());
          copy_box(local.data(), v.first, v.local_shape, p->bytes.data() + offset, v.first, v.valid, v.first, hi);
        }
        p->entries.push_back({v.name, kKinds[k], offset, bytes, v.first, hi,
                              std::max<int64_t>(1, kBlockBytes / std::max<int64_t>(row_bytes, 1)), row_bytes});
        offset += bytes;
      }
    }
  }
  if (rank == 0) {
    json &meta = p->meta;
    meta["format"] = "ctr-checkpoint";
    meta["version"] = kCheckpointVersion;
    meta["step"] = s.checkpoint_step();
    meta["graph"] = info.graph_name;
    meta["params"] = graph_params(shards, info);
    json mesh = json::array();
    for (const auto &a : mesh_.axes) mesh.push_back({a.first, a.second});
    meta["mesh"] = {{"world", mesh_.world}, {"axes", mesh}};
    meta["options"] = json::parse(info.options_json.empty() ? "{}" : info.options_json);
    // The loader's own JSON: a few integers per sub-dataset plus what it must
    // match (seq, sub-dataset sizes and weights) to be restored.
    if (info.loader) meta["loader"] = info.loader->state_json();
  }
  PendingSave *raw = p.get();
  raw->runs_left = lag_;
  pending_ = std::move(p);
  if (async) {
    if (raw->writer) raw->thread = std::thread([raw, rank] { write_shard(*raw, rank); });
    return;
  }
  if (raw->writer) write_shard(*raw, rank);
  finish();
}

void Checkpointer::tick() {
  if (pending_ && --pending_->runs_left <= 0) finish();
}

void Checkpointer::finish() {
  if (!pending_) return;
  std::unique_ptr<PendingSave> p = std::move(pending_);
  if (p->thread.joinable()) p->thread.join();
  std::string err = p->err;
  if (std::string agreed = mesh_.first_error(err); !agreed.empty()) fail(CTR_STATUS_IO_ERROR, agreed);
  // Rank 0 merges the indexes into meta.json and swaps the directory in.
  if (mesh_.rank == 0) {
    try {
      json shards = json::array();
      for (int r = 0; r < mesh_.world; ++r) {
        std::string ip = p->tmp + "/" + strformat("rank%05d.json", r);
        if (!fs::exists(ip)) continue;  // a dp replica that did not write
        json part = json::parse(read_regular_file(ip, "shard index", CTR_STATUS_IO_ERROR));
        for (auto &e : part) shards.push_back(e);
        fs::remove(ip);
      }
      p->meta["shards"] = shards;
      p->meta["checksum"] = meta_checksum(p->meta);
      write_file(p->tmp + "/meta.json", p->meta.dump(1));
      fsync_path(p->tmp, true);
      std::error_code ec;
      const std::string old = p->dir + ".old";
      fs::remove_all(old, ec);
      if (fs::exists(p->dir)) fs::rename(p->dir, old);
      fs::rename(p->tmp, p->dir);
      fs::path parent = fs::path(p->dir).parent_path();
      fsync_path(parent.empty() ? "." : parent.string(), true);
      fs::remove_all(old, ec);
      if (p->on_publish) p->on_publish();
    } catch (const Error &e) {
      err = e.message();
    } catch (const std::exception &e) {
      err = strformat("ctr_step_save: %s: %s", p->dir.c_str(), e.what());
    }
  }
  if (std::string agreed = mesh_.first_error(err); !agreed.empty()) fail(CTR_STATUS_IO_ERROR, agreed);
}

void Checkpointer::abandon() {
  // The step is going away: let a write in flight end, publish nothing. The
  // previous checkpoint stays the newest complete one.
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
  pending_.reset();
}

// ---------------------------------------------------------------------------
// Load

void Checkpointer::load(CheckpointState &s, const CheckpointInfo &info, const std::string &dir_in) {
  finish();
  const std::vector<ShardView> shards = s.checkpoint_shards();
  data::Loader *const loader = info.loader;
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  std::string err;
  // Staging: per slot, param/m/v of this rank's placement; committed at the end.
  std::vector<std::array<std::vector<float>, 3>> stage(shards.size());
  int64_t step = 0;
  json loader_state;
  json old_loader;
  bool restored_loader = false;
  try {
    const std::string meta_path = dir + "/meta.json";
    if (!fs::exists(meta_path)) ckpt_fail(strformat("%s: missing or unreadable checkpoint metadata", meta_path.c_str()));
    const std::string meta_text = read_regular_file(meta_path, "checkpoint metadata", CTR_STATUS_CHECKPOINT_ERROR);
    json meta;
    try {
      meta = json::parse(meta_text);
    } catch (const std::exception &e) {
      ckpt_fail(strformat("%s: corrupt metadata: %s", meta_path.c_str(), e.what()));
    }
    try {
      if (!meta.is_object() || meta.value("format", "") != "ctr-checkpoint")
        ckpt_fail(strformat("%s: not a libctr checkpoint", meta_path.c_str()));
      const int version = meta.value("version", 0);
      if (version < 1 || version > kCheckpointVersion)
        ckpt_fail(strformat("%s: unsupported checkpoint version %d (this library reads 1 to %d)", meta_path.c_str(),
                            version, kCheckpointVersion));
      if (version >= 2) {
        if (!meta.contains("checksum") || !meta["checksum"].is_string())
          ckpt_fail(strformat("%s: corrupt metadata: no checksum", meta_path.c_str()));
        if (meta["checksum"].get<std::string>() != meta_checksum(meta))
          ckpt_fail(strformat("%s: corrupt metadata: checksum mismatch (the file was damaged or edited)",
                              meta_path.c_str()));
      }
      step = meta.at("step").get<int64_t>();
      if (step < 0 || step > kMaxStep)
        ckpt_fail(strformat("%s: corrupt metadata: step %lld is out of range", meta_path.c_str(),
                            static_cast<long long>(step)));
      // The graph must match: same parameters with the same full shapes.
      std::map<std::string, std::vector<int64_t>> saved;
      for (const auto &p : meta.at("params")) saved[p.at("name").get<std::string>()] = p.at("shape").get<std::vector<int64_t>>();
      std::vector<std::pair<std::string, std::vector<int64_t>>> graph = info.graph_params;
      if (graph.empty())
        for (const ShardView &v : shards) graph.push_back({v.name, v.full_shape});
      for (const auto &[pname, shape] : graph) {
        auto it = saved.find(pname);
        if (it == saved.end())
          ckpt_fail(strformat("%s: mismatched graph: the checkpoint has no parameter '%s'", dir.c_str(), pname.c_str()));
        if (it->second != shape)
          ckpt_fail(strformat("%s: mismatched graph: parameter '%s' is %s in the checkpoint, %s in the graph",
                              dir.c_str(), pname.c_str(), shape_string(it->second).c_str(), shape_string(shape).c_str()));
        saved.erase(it);
      }
      if (!saved.empty())
        ckpt_fail(strformat("%s: mismatched graph: the checkpoint has parameter '%s' that the graph lacks",
                            dir.c_str(), saved.begin()->first.c_str()));
      if (meta.contains("loader")) loader_state = meta["loader"];

      // Index the shard entries by (tensor, kind).
      std::map<std::pair<std::string, std::string>, std::vector<const json *>> entries;
      for (const auto &e : meta.at("shards")) entries[{e.at("tensor").get<std::string>(), e.at("kind").get<std::string>()}].push_back(&e);

      std::map<std::string, int> fds;
      struct Closer {
        std::map<std::string, int> &m;
        ~Closer() {
          for (auto &kv : m) ::close(kv.second);
        }
      } closer{fds};
      for (size_t si = 0; si < shards.size(); ++si) {
        const ShardView &pl = shards[si];
        const std::string &name = pl.name;
        const std::vector<int64_t> full = full_extents(pl);
        const size_t nd = full.size();
        // The box this rank wants: its valid block.
        std::vector<int64_t> want_lo(pl.first), want_hi(pl.first);
        for (size_t d = 0; d < nd; ++d) want_hi[d] += pl.valid[d];
        for (int k = 0; k < 3; ++k) {
          std::vector<float> &buf = stage[si][k];
          buf.assign(static_cast<size_t>(pl.n), 0.0f);
          uint8_t *dst = reinterpret_cast<uint8_t *>(buf.data());
          int64_t covered = 0;
          for (const json *ep : entries[{name, kKinds[k]}]) {
            const json &e = *ep;
            // The entry's box: "box" (version 3) or "rows" of dim 0, whole in the others.
            std::vector<int64_t> lo(nd, 0), hi(full);
            // A number that sizes or places a read: an integer, never a float cast.
            auto integer = [&](const json &v, const char *what) -> int64_t {
              if (!v.is_number_integer())
                ckpt_fail(strformat("%s: corrupt metadata for tensor '%s' (%s): %s is not an integer", dir.c_str(),
                                    name.c_str(), kKinds[k], what));
              return v.get<int64_t>();
            };
            if (e.contains("box")) {
              const json &box = e.at("box");
              if (!box.is_array() || box.size() != nd)
                ckpt_fail(strformat("%s: corrupt metadata for tensor '%s' (%s): a box of %zu dims for a tensor of %zu",
                                    dir.c_str(), name.c_str(), kKinds[k], box.is_array() ? box.size() : size_t{0}, nd));
              for (size_t d = 0; d < nd; ++d) {
                lo[d] = integer(box.at(d).at(0), "a box bound");
                hi[d] = integer(box.at(d).at(1), "a box bound");
              }
            } else {
              lo[0] = integer(e.at("rows").at(0), "rows");
              hi[0] = integer(e.at("rows").at(1), "rows");
            }
            const std::string file = e.at("file").get<std::string>();
            if (file.find('/') != std::string::npos || file.empty())
              ckpt_fail(strformat("%s: corrupt metadata: bad shard file name '%s'", dir.c_str(), file.c_str()));
            const int64_t block_rows = integer(e.at("block_rows"), "block_rows");
            const auto &hashes = e.at("xxh3");
            const int64_t offset = integer(e.at("offset"), "offset");
            // Every number is checked before it sizes or places a read.
            bool bad = block_rows < 1 || offset < 0 || !hashes.is_array();
            for (size_t d = 0; d < nd; ++d) bad |= lo[d] < 0 || hi[d] <= lo[d] || hi[d] > full[d];
            if (bad)
              ckpt_fail(strformat("%s: corrupt metadata for tensor '%s' (%s): rows %lld..%lld of %lld (or a box outside "
                                  "%s), offset %lld, block of %lld rows",
                                  dir.c_str(), name.c_str(), kKinds[k], static_cast<long long>(lo[0]),
                                  static_cast<long long>(hi[0]), static_cast<long long>(full[0]),
                                  shape_string(full).c_str(), static_cast<long long>(offset),
                                  static_cast<long long>(block_rows)));
            std::vector<int64_t> a(nd), b(nd);
            bool overlap = true;
            for (size_t d = 0; d < nd; ++d) {
              a[d] = std::max(lo[d], want_lo[d]);
              b[d] = std::min(hi[d], want_hi[d]);
              overlap &= a[d] < b[d];
            }
            if (!overlap) continue;
            const std::string path = dir + "/" + file;
            if (!fds.count(path)) {
              struct stat st {};
              if (::stat(path.c_str(), &st) != 0)
                ckpt_fail(strformat("%s: missing shard file (tensor '%s'): %s", path.c_str(), name.c_str(), std::strerror(errno)));
              fds[path] = open_regular_file(path, "checkpoint shard file", CTR_STATUS_CHECKPOINT_ERROR);
            }
            int fd = fds[path];
            const int64_t rows = hi[0] - lo[0];
            const int64_t row_bytes = volume(lo, hi) / rows * 4;
            if (block_rows > std::max<int64_t>(1, kMaxBlockBytes / row_bytes))
              ckpt_fail(strformat("%s: corrupt metadata for tensor '%s' (%s): checksum blocks of %lld rows",
                                  dir.c_str(), name.c_str(), kKinds[k], static_cast<long long>(block_rows)));
            if (static_cast<int64_t>(hashes.size()) != (rows + block_rows - 1) / block_rows)
              ckpt_fail(strformat("%s: corrupt metadata for tensor '%s' (%s): %zu checksums for %lld blocks",
                                  dir.c_str(), name.c_str(), kKinds[k], hashes.size(),
                                  static_cast<long long>((rows + block_rows - 1) / block_rows)));
            struct stat fst {};
            if (::fstat(fd, &fst) != 0 || offset > fst.st_size || rows * row_bytes > static_cast<int64_t>(fst.st_size) - offset)
              ckpt_fail(strformat("%s: truncated or corrupt: tensor '%s' (%s) rows %lld..%lld at offset %lld need "
                                  "%lld bytes, the file has %lld",
                                  path.c_str(), name.c_str(), kKinds[k], static_cast<long long>(lo[0]),
                                  static_cast<long long>(hi[0]), static_cast<long long>(offset),
                                  static_cast<long long>(offset + rows * row_bytes),
                                  static_cast<long long>(fst.st_size)));
            // Read the checksum blocks (rows of the box) that overlap [a0, b0),
            // verify each, copy the part of the wanted box it holds.
            const int64_t b0 = (a[0] - lo[0]) / block_rows, b1 = (b[0] - lo[0] + block_rows - 1) / block_rows;
            std::vector<uint8_t> block;
            std::vector<int64_t> ext(nd), org(lo);
            for (size_t d = 0; d < nd; ++d) ext[d] = hi[d] - lo[d];
            for (int64_t bi = b0; bi < b1; ++bi) {
              int64_t r0 = lo[0] + bi * block_rows, r1 = std::min(hi[0], r0 + block_rows);
              int64_t n = (r1 - r0) * row_bytes;
              block.resize(static_cast<size_t>(n));
              int64_t at = offset + (r0 - lo[0]) * row_bytes;
              ssize_t got = ::pread(fd, block.data(), static_cast<size_t>(n), at);
              if (got != n)
                ckpt_fail(strformat("%s: truncated shard file: tensor '%s' (%s) rows %lld..%lld end past the file",
                                    path.c_str(), name.c_str(), kKinds[k], static_cast<long long>(r0), static_cast<long long>(r1)));
              if (static_cast<size_t>(bi) >= hashes.size() ||
                  hashes[static_cast<size_t>(bi)].get<std::string>() != hex64(XXH3_64bits(block.data(), block.size())))
                ckpt_fail(strformat("%s: checksum mismatch in tensor '%s' (%s), rows %lld..%lld: the file is corrupt",
                                    path.c_str(), name.c_str(), kKinds[k], static_cast<long long>(r0), static_cast<long long>(r1)));
              org[0] = r0;
              ext[0] = r1 - r0;
              std::vector<int64_t> ca(a), cb(b);
              ca[0] = std::max(r0, a[0]);
              cb[0] = std::min(r1, b[0]);
              copy_box(block.data(), org, ext, dst, pl.first, pl.local_shape, ca, cb);
            }
            covered += volume(a, b);
          }
          if (covered != volume(want_lo, want_hi))
            ckpt_fail(strformat("%s: incomplete checkpoint: elements of tensor '%s' (%s) in %s..%s are in no shard file",
                                dir.c_str(), name.c_str(), kKinds[k], shape_string(want_lo).c_str(),
                                shape_string(want_hi).c_str()));
        }
      }
      if (loader && !loader_state.is_null()) {
        if (loader_state.value("seq", int64_t{0}) != info.loader_seq)
          ckpt_fail(strformat("%s: the checkpoint's data loader used seq %lld, this one uses %lld", dir.c_str(),
                              static_cast<long long>(loader_state.value("seq", int64_t{0})),
                              static_cast<long long>(info.loader_seq)));
        old_loader = loader->state_json();
        restored_loader = true;
        try {
          loader->restore_json(loader_state);
        } catch (const Error &e) {
          ckpt_fail(strformat("%s: %s", dir.c_str(), e.message().c_str()));
        }
      }
    } catch (const json::exception &e) {
      ckpt_fail(strformat("%s: corrupt metadata: %s", (dir + "/meta.json").c_str(), e.what()));
    }
  } catch (const Error &e) {
    err = e.message();
  } catch (const std::bad_alloc &) {
    err = strformat("%s: out of memory while loading this checkpoint", dir.c_str());
  }
  if (std::string agreed = mesh_.first_error(err); !agreed.empty()) {
    if (restored_loader) loader->restore_json(old_loader);
    fail(CTR_STATUS_CHECKPOINT_ERROR, agreed);
  }

  // Commit.
  for (size_t si = 0; si < shards.size(); ++si)
    for (int k = 0; k < 3; ++k)
      s.checkpoint_write(shards[si].buffers[k], stage[si][k].data(), static_cast<size_t>(shards[si].n) * 4);
  s.checkpoint_set_step(step);
}

}  // namespace ctr
