// A host worker stream: one thread draining a queue of tasks in order, used
// by backends for every stream that carries host work (collectives). Header
// only, so that backend plugins, which do not link libctr, use it too.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace ctr {

class HostWorker {
 public:
  // on_start runs first on the worker's thread (priority, device selection);
  // run(task) runs each task (the fenced CPU backend wraps tasks in its fence).
  HostWorker(std::function<void()> on_start, std::function<void(std::function<void()> &)> run)
      : on_start_(std::move(on_start)), run_(std::move(run)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~HostWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  HostWorker(const HostWorker &) = delete;
  HostWorker &operator=(const HostWorker &) = delete;

  void push(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(fn));
      ++pushed_;
    }
    cv_.notify_all();
  }
  // Returns once every task pushed before the call has run.
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    const uint64_t want = pushed_;
    cv_.wait(lock, [&] { return finished_ >= want; });
  }

 private:
  void loop() {
    if (on_start_) on_start_();
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      run_(fn);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++finished_;
      }
      cv_.notify_all();
    }
  }

  std::function<void()> on_start_;
  std::function<void(std::function<void()> &)> run_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t pushed_ = 0, finished_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ctr
