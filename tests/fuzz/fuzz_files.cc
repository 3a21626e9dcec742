// libFuzzer target: arbitrary bytes as the other files libctr reads — token files
// (.bin, .npy), data manifests (.json) and safetensors weights. The first byte
// picks the format. Each must load or fail with a status; nothing may crash.
//
//   build-fuzz/tests/fuzz/fuzz_files -max_total_time=60 CORPUS_DIR

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ctr/ctr.h"

namespace {

std::string write_temp(const char *suffix, const uint8_t *data, size_t size) {
  static const std::string dir = [] {
    char tmpl[] = "/tmp/ctr_fuzz_XXXXXX";
    const char *d = mkdtemp(tmpl);
    if (!d) std::abort();
    return std::string(d);
  }();
  std::string path = dir + "/input" + suffix;
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size) std::fwrite(data, 1, size, f);
  std::fclose(f);
  return path;
}

// One small step for the safetensors target, freed at exit so that leak checking
// sees only what the inputs leak.
struct SmallStep {
  ctr_mesh *mesh = nullptr;
  ctr_graph *graph = nullptr;
  ctr_step *step = nullptr;
  SmallStep() {
    ctr_options *go = nullptr, *so = nullptr;
    ctr_options_create(&go);
    ctr_options_set_int(go, "layers", 1);
    ctr_options_set_int(go, "dim", 8);
    ctr_options_set_int(go, "heads", 2);
    ctr_options_set_int(go, "vocab", 16);
    ctr_options_set_int(go, "seq", 4);
    ctr_options_create(&so);
    ctr_options_set_int(so, "batch", 1);
    if (ctr_mesh_create(nullptr, &mesh) != CTR_STATUS_OK ||
        ctr_graph_create_preset("gpt", go, &graph) != CTR_STATUS_OK ||
        ctr_step_create(mesh, graph, so, &step) != CTR_STATUS_OK)
      std::abort();
    ctr_options_free(go);
    ctr_options_free(so);
  }
  ~SmallStep() {
    ctr_step_free(step);
    ctr_graph_free(graph);
    ctr_mesh_free(mesh);
  }
};

ctr_step *small_step() {
  static SmallStep s;
  return s.step;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const int which = data[0] % 4;
  ++data;
  --size;
  static const char *suffix[4] = {".bin", ".npy", ".json", ".safetensors"};
  std::string path = write_temp(suffix[which], data, size);
  if (which < 3) {
    ctr_options *o = nullptr;
    ctr_options_create(&o);
    ctr_options_set_int(o, "seq", 4);
    ctr_loader *l = nullptr;
    if (ctr_loader_create(path.c_str(), o, &l) == CTR_STATUS_OK) {
      int32_t tok[3 * 4], tgt[3 * 4];
      for (int i = 0; i < 3; ++i) ctr_loader_next(l, 3, tok, tgt);
      int64_t n = 0, mx = 0;
      ctr_loader_info(l, &n, &mx);
      ctr_loader_free(l);
    }
    ctr_options_free(o);
  } else {
    ctr_step_import_safetensors(small_step(), path.c_str(), nullptr);
  }
  return 0;
}
