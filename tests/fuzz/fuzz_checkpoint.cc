// libFuzzer target: arbitrary bytes as one file of a checkpoint directory.
//
// A real checkpoint of the small model (with a data loader attached, so that its
// position is saved too) is written once with ctr_step_save. Each input then
// replaces either meta.json (first byte even) or the shard file rank00000.bin
// (first byte odd) while the other file keeps its saved bytes, and
// ctr_step_load must answer with a status: a corrupt, truncated or mismatched
// checkpoint is CTR_STATUS_CHECKPOINT_ERROR, never a crash, a hang or a read
// outside the file.
//
// meta.json carries "checksum", the xxh3-64 of the compact dump of the object
// without that key, as 16 lowercase hex digits. An input that parses as a JSON
// object gets its checksum recomputed before it is written, so that mutations of
// the metadata reach the code behind the checksum test; inputs that do not parse
// are written as they are.
//
// With CTR_FUZZ_SEEDS=DIR set, the target only writes the checkpoint it saved as
// two seed inputs, DIR/meta and DIR/shard, and exits (make_corpus.py uses this).
//
//   FUZZ_TARGETS=checkpoint FUZZ_SECONDS=600 tools/sanitize.sh fuzz  (README: Hardening)

#include <xxhash.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "ctr/ctr.h"
#include "fuzz_common.h"

namespace {

using nlohmann::json;

struct Fixture {
  fuzz::SmallModel model;
  ctr_loader *loader = nullptr;
  std::string dir;

  Fixture() {
    ctr_options *o = nullptr;
    ctr_options_create(&o);
    ctr_options_set_int(o, "seq", fuzz::SmallModel::kSeq);
    ctr_options_set_int(o, "corpus_bytes", 4096);
    if (ctr_loader_create(nullptr, o, &loader) != CTR_STATUS_OK ||
        ctr_step_attach_loader(model.step, loader) != CTR_STATUS_OK)
      fuzz::fail(std::string("cannot attach a loader: ") + ctr_last_error());
    ctr_options_free(o);
    // Advance the loader so that the saved position is not all zeros.
    int32_t tok[2 * fuzz::SmallModel::kSeq], tgt[2 * fuzz::SmallModel::kSeq];
    ctr_loader_next(loader, 2, tok, tgt);
    dir = fuzz::scratch_dir() + "/ckpt";
    if (ctr_step_save(model.step, dir.c_str()) != CTR_STATUS_OK)
      fuzz::fail(std::string("cannot save the checkpoint: ") + ctr_last_error());
    meta = fuzz::read_file(dir + "/meta.json");
    shard = fuzz::read_file(dir + "/rank00000.bin");
  }
  // Runs at exit, after this thread's thread-local state is gone: only the
  // void _free calls, the step before the loader it holds.
  ~Fixture() {
    ctr_step_free(model.step);
    model.step = nullptr;
    ctr_loader_free(loader);
  }
  Fixture(const Fixture &) = delete;
  Fixture &operator=(const Fixture &) = delete;

  std::string meta;   // as saved
  std::string shard;  // as saved
};

// The metadata as the loader will read it: a JSON object gets its checksum
// recomputed; anything else is kept byte for byte.
std::string with_checksum(const uint8_t *data, size_t size) {
  std::string raw(reinterpret_cast<const char *>(data), size);
  json meta = json::parse(raw, nullptr, /*allow_exceptions=*/false);
  if (!meta.is_object()) return raw;
  try {
    meta.erase("checksum");
    const std::string compact = meta.dump();
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(XXH3_64bits(compact.data(), compact.size())));
    meta["checksum"] = hex;
    return meta.dump(1);
  } catch (const json::exception &) {
    return raw;  // not dumpable (invalid UTF-8 in a string): the bytes as given
  }
}

Fixture &fixture() {
  static Fixture fx;
  return fx;
}

void write_seed(const std::string &path, char head, const std::string &body) {
  const std::string seed = head + body;
  fuzz::write_file(path, seed.data(), seed.size());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  const char *seeds = std::getenv("CTR_FUZZ_SEEDS");
  if (!seeds || !*seeds) return 0;
  write_seed(std::string(seeds) + "/meta", 0, fixture().meta);
  write_seed(std::string(seeds) + "/shard", 1, fixture().shard);
  std::exit(0);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  Fixture &fx = fixture();
  const bool replace_meta = (data[0] & 1) == 0;
  ++data;
  --size;
  if (replace_meta) {
    const std::string meta = with_checksum(data, size);
    fuzz::write_file(fx.dir + "/meta.json", meta.data(), meta.size());
    fuzz::write_file(fx.dir + "/rank00000.bin", fx.shard.data(), fx.shard.size());
  } else {
    fuzz::write_file(fx.dir + "/meta.json", fx.meta.data(), fx.meta.size());
    fuzz::write_file(fx.dir + "/rank00000.bin", data, size);
  }
  fuzz::check_status(ctr_step_load(fx.model.step, fx.dir.c_str()), "ctr_step_load");
  return 0;
}
