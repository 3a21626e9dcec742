// libFuzzer target: arbitrary bytes as the other files libctr reads — token files
// (.bin, .npy), data manifests (.json) and safetensors weights. The first byte
// picks the format. Each must load or fail with a status; nothing may crash.
//
// A manifest names its token files relative to itself; the scratch directory
// holds a fixed data.txt (read as bytes) for the seed manifests to name, so that
// a manifest input reaches the loader's reading of its files.
//
//   FUZZ_TARGETS=files FUZZ_SECONDS=600 tools/sanitize.sh fuzz  (README: Hardening)

#include <cstdint>
#include <string>

#include "ctr/ctr.h"
#include "fuzz_common.h"

namespace {

void write_companions() {
  static const bool done = [] {
    std::string text;
    for (int i = 0; i < 16; ++i) text += "a small file of tokens for the manifest fuzzer\n";
    fuzz::write_file(fuzz::scratch_dir() + "/data.txt", text.data(), text.size());
    return true;
  }();
  (void)done;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  write_companions();
  const int which = data[0] % 4;
  ++data;
  --size;
  static const char *suffix[4] = {".bin", ".npy", ".json", ".safetensors"};
  const std::string path = fuzz::scratch_dir() + "/input" + suffix[which];
  fuzz::write_file(path, data, size);
  if (which < 3) {
    ctr_options *o = nullptr;
    ctr_options_create(&o);
    ctr_options_set_int(o, "seq", 4);
    ctr_loader *l = nullptr;
    ctr_status st = ctr_loader_create(path.c_str(), o, &l);
    fuzz::check_status(st, "ctr_loader_create");
    if (st == CTR_STATUS_OK) {
      int32_t tok[3 * 4], tgt[3 * 4];
      for (int i = 0; i < 3; ++i) fuzz::check_status(ctr_loader_next(l, 3, tok, tgt), "ctr_loader_next");
      int64_t n = 0, mx = 0;
      ctr_loader_info(l, &n, &mx);
      ctr_loader_free(l);
    }
    ctr_options_free(o);
  } else {
    fuzz::check_status(ctr_step_import_safetensors(fuzz::small_model().step, path.c_str(), nullptr),
                       "ctr_step_import_safetensors");
  }
  return 0;
}
