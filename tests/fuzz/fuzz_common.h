// Pieces shared by the libFuzzer targets: a private scratch directory, file
// writing, the one small model every target that needs a step trains, and the
// rule that turns a status into a finding.
//
// Everything here is built once per process and reused by every input, so an
// execution costs only what the input itself makes the library do.
#pragma once

#include <sanitizer/common_interface_defs.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "ctr/ctr.h"

namespace fuzz {

// A directory of this process's own under $TMPDIR (default /tmp), created on
// first use and removed at a normal exit. Fuzzers run in parallel (-jobs) must
// not share files.
inline const std::string &scratch_dir() {
  struct Dir {
    std::string path;
    Dir() {
      const char *tmp = std::getenv("TMPDIR");
      path = std::string(tmp && *tmp ? tmp : "/tmp") + "/ctr_fuzz_XXXXXX";
      if (!mkdtemp(path.data())) std::abort();
    }
    ~Dir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

// Replaces the file at path with size bytes of data.
inline void write_file(const std::string &path, const void *data, size_t size) {
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  if (std::fclose(f) != 0) std::abort();
}

// The whole file at path; aborts if it cannot be read (a harness fault).
inline std::string read_file(const std::string &path) {
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f) std::abort();
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

// Ends the run with a finding the sanitizers cannot see themselves. The message
// goes to stderr and, as the report's summary line, to wherever the sanitizer
// reports go (libFuzzer keeps those when -close_fd_mask=2 closes stderr).
[[noreturn]] inline void fail(const std::string &msg) {
  std::fprintf(stderr, "fuzz: %s\n", msg.c_str());
  __sanitizer_report_error_summary(("fuzz: " + msg).c_str());
  std::abort();
}

// CTR_STATUS_INTERNAL is by the header's contract a bug in libctr, so a target
// that sees it stops with the library's message; every other status is an
// answer the caller can act on.
inline void check_status(ctr_status st, const char *call) {
  if (st == CTR_STATUS_INTERNAL)
    fail(std::string(call) + " returned CTR_STATUS_INTERNAL: " + ctr_last_error());
}

// The model of the fuzzers that need a step: GPT, 1 layer, width 8, 2 heads,
// vocabulary 16, 4 positions, batch 1. tests/fuzz/make_corpus.py builds its
// seed files from the same dimensions, so keep the two in step.
struct SmallModel {
  static constexpr int64_t kLayers = 1, kDim = 8, kHeads = 2, kVocab = 16, kSeq = 4;

  ctr_mesh *mesh = nullptr;
  ctr_graph *graph = nullptr;
  ctr_step *step = nullptr;

  SmallModel() {
    ctr_options *go = nullptr, *so = nullptr;
    ctr_options_create(&go);
    ctr_options_set_int(go, "layers", kLayers);
    ctr_options_set_int(go, "dim", kDim);
    ctr_options_set_int(go, "heads", kHeads);
    ctr_options_set_int(go, "vocab", kVocab);
    ctr_options_set_int(go, "seq", kSeq);
    ctr_options_create(&so);
    ctr_options_set_int(so, "batch", 1);
    if (ctr_mesh_create(nullptr, &mesh) != CTR_STATUS_OK ||
        ctr_graph_create_preset("gpt", go, &graph) != CTR_STATUS_OK ||
        ctr_step_create(mesh, graph, so, &step) != CTR_STATUS_OK)
      fail(std::string("cannot build the small model: ") + ctr_last_error());
    ctr_options_free(go);
    ctr_options_free(so);
  }
  // Freed at exit, so that leak checking sees only what the inputs leak.
  ~SmallModel() {
    ctr_step_free(step);
    ctr_graph_free(graph);
    ctr_mesh_free(mesh);
  }
  SmallModel(const SmallModel &) = delete;
  SmallModel &operator=(const SmallModel &) = delete;
};

inline SmallModel &small_model() {
  static SmallModel m;
  return m;
}

}  // namespace fuzz
