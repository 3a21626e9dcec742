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
  struct Entry {
    std::string tensor;
    const char *kind;
    int64_t offset, bytes, row0, row1, block_rows, row_bytes;
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

// Hands an on_publish to the save that Step::save starts on this thread while
// the hook is in scope (a ctr_step is used by one thread at a time, so the
// thread identifies the call). Step's interface stays as it is: the
// checkpoint-directory policy (directory.cc) sets the hook around its save.
class PublishHook {
 public:
  explicit PublishHook(std::function<void()> fn) { slot() = std::move(fn); }
  ~PublishHook() { slot() = nullptr; }
  PublishHook(const PublishHook &) = delete;
  PublishHook &operator=(const PublishHook &) = delete;
  // The hook in scope, at most once; empty when there is none.
  static std::function<void()> take() { return std::exchange(slot(), nullptr); }

 private:
  static std::function<void()> &slot() {
    thread_local std::function<void()> fn;
    return fn;
  }
};

}  // namespace ctr
