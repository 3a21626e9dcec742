// The structs behind the public opaque handles.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/mesh.h"
#include "graph/ir.h"

// The mesh lives in the runtime (runtime/mesh.h); the handle is that object.
struct ctr_mesh : ctr::Mesh {};

struct ctr_graph {
  ctr::Graph graph;  // verified, nodes in topological order
  std::vector<int> inputs;
  std::vector<int> params;
};

namespace ctr {
class Step;
namespace data {
class Loader;
class TokenSource;
class TokenWriter;
}  // namespace data
}  // namespace ctr

struct ctr_tokens {
  std::unique_ptr<ctr::data::TokenSource> source;
  ~ctr_tokens();
};

struct ctr_token_writer {
  std::unique_ptr<ctr::data::TokenWriter> writer;
  ~ctr_token_writer();
};

struct ctr_loader {
  std::unique_ptr<ctr::data::Loader> loader;  // owns its token sources
  int64_t seq = 0;
  ~ctr_loader();
};

struct ctr_step {
  std::unique_ptr<ctr::Step> impl;
  // Calls in progress: a ctr_step is used by one thread at a time, and a second
  // concurrent call is refused rather than left to corrupt the step.
  mutable std::atomic<int> users{0};
  // Handed out by ctr_step_save_checkpoint and ctr_step_resume; valid until the
  // step's next call.
  std::string checkpoint_path, checkpoint_skipped;
};
