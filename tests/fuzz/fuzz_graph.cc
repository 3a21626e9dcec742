// libFuzzer target: arbitrary bytes as a graph file. Loading must either succeed
// or fail with CTR_STATUS_INVALID_GRAPH; a loaded graph must compile into a step
// (or fail with a status) and, when it compiles, survive one training step on
// token ids that are valid for it. Any crash, hang or sanitizer report is a bug.
//
//   CC=clang CXX=clang++ meson setup build-fuzz -Dfuzz=true -Dtests=false
//   ninja -C build-fuzz && build-fuzz/tests/fuzz/fuzz_graph -max_total_time=60 CORPUS_DIR

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "ctr/ctr.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ctr_graph *g = nullptr;
  ctr_status st = ctr_graph_load_buffer(data, size, &g);
  if (st != CTR_STATUS_OK) {
    if (st != CTR_STATUS_INVALID_GRAPH) std::abort();
    return 0;
  }
  static ctr_mesh *mesh = [] {
    ctr_mesh *m = nullptr;
    if (ctr_mesh_create(nullptr, &m) != CTR_STATUS_OK) std::abort();
    return m;
  }();
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  ctr_options_set_int(o, "batch", 1);
  ctr_options_set_int(o, "seq", 4);
  ctr_options_set_int(o, "memory_limit", int64_t{1} << 28);
  ctr_step *s = nullptr;
  if (ctr_step_create(mesh, g, o, &s) == CTR_STATUS_OK) {
    // Feed zeros (a valid id for every embedding and target) and run one step.
    for (size_t i = 0; i < ctr_graph_num_inputs(g); ++i) {
      const char *name = nullptr;
      ctr_graph_input_name(g, i, &name);
      for (size_t bytes = 4; bytes <= (size_t{1} << 20); bytes *= 2) {
        std::vector<uint8_t> zeros(bytes, 0);
        if (ctr_step_set_input(s, name, zeros.data(), bytes) == CTR_STATUS_OK) break;
      }
    }
    ctr_step_metrics m;
    m.size = sizeof m;
    ctr_step_run(s, &m);
    ctr_step_free(s);
  }
  ctr_options_free(o);
  ctr_graph_free(g);
  return 0;
}
