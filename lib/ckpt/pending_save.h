// A checkpoint between its snapshot and its publication (see checkpoint.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ctr {

// Work of one save between its snapshot and its finalisation.
struct PendingSave {
  std::string dir, tmp;
  bool writer = false;
  std::vector<uint8_t> bytes;  // this rank's rows of every tensor, as written
  // A box of one tensor: per dim, elements [lo, hi) of the whole, stored
  // row-major; checksummed in blocks of block_rows rows (dim 0) of the box.
  struct Entry {
    std::string tensor;
    const char *kind;
    int64_t offset, bytes;
    std::vector<int64_t> lo, hi;
    int64_t block_rows, row_bytes;
  };
  std::vector<Entry> entries;
  nlohmann::json meta;  // everything but the shard list, as of the snapshot
  std::thread thread;
  std::string err;
  int64_t runs_left = 0;  // ctr_step_run calls before the save is published
  // Called on rank 0 once the directory is renamed into place and synced, by
  // whichever call publishes the save; a throw fails that call on every rank.
  std::function<void()> on_publish;
};

}  // namespace ctr
