// Process-wide worker pool behind parallel_for (see thread_pool.h).
//
// Work is published as one job: a function and a range cut into equal chunks.
// Workers and the caller claim chunks with an atomic counter, and the caller waits
// on a counter of finished chunks. One job runs at a time; a caller that arrives
// while another job is in flight (another thread driving a different ctr_step)
// runs its loop serially rather than queueing, which keeps latency predictable.

#include "core/thread_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace ctr {
namespace {

thread_local bool t_in_parallel = false;

// One parallel loop in flight. It lives on the caller's stack; the caller does
// not return until every worker that picked it up has let go of it.
struct Job {
  const std::function<void(int64_t, int64_t)> *fn;
  int64_t n, chunk, nchunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int holders = 0;  // workers currently inside claim(); guarded by Pool::mu_
};

class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return size_; }

  void resize(int n) {
    stop();
    size_ = std::max(1, n);
    quit_ = false;
    for (int i = 1; i < size_; ++i) workers_.emplace_back([this] { worker(); });
  }

  bool try_run(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)> *fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    Job job;
    job.fn = fn;
    job.n = n;
    job.chunk = chunk;
    job.nchunks = (n + chunk - 1) / chunk;
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &job;
      ++generation_;
    }
    cv_.notify_all();
    t_in_parallel = true;
    claim(job);
    t_in_parallel = false;
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return job.done.load() == job.nchunks && job.holders == 0; });
    job_ = nullptr;
    return true;
  }

 private:
  static void claim(Job &job) {
    for (;;) {
      int64_t c = job.next.fetch_add(1);
      if (c >= job.nchunks) return;
      int64_t b = c * job.chunk, e = std::min(job.n, b + job.chunk);
      (*job.fn)(b, e);
      job.done.fetch_add(1);
    }
  }

  void worker() {
    uint64_t seen = 0;
    for (;;) {
      Job *job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
        job = job_;
        if (!job) continue;
        ++job->holders;
      }
      t_in_parallel = true;
      claim(*job);
      t_in_parallel = false;
      {
        std::lock_guard<std::mutex> lk(mu_);
        --job->holders;
      }
      done_cv_.notify_all();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto &t : workers_) t.join();
    workers_.clear();
  }

  int size_ = 1;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  bool quit_ = false;
  uint64_t generation_ = 0;
  Job *job_ = nullptr;
};

int default_threads() {
  if (const char *s = std::getenv("CTR_NUM_THREADS")) {
    int v = std::atoi(s);
    if (v > 0) return v;
  }
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

std::mutex g_pool_mu;
Pool *g_pool = nullptr;

Pool &pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  // Deliberately leaked: workers must outlive static destructors of callers.
  if (!g_pool) g_pool = new Pool(default_threads());
  return *g_pool;
}

}  // namespace

int num_threads() { return pool().size(); }

void set_num_threads(int n) {
  Pool &p = pool();
  std::lock_guard<std::mutex> lk(g_pool_mu);
  p.resize(n > 0 ? n : default_threads());
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)> &fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (n <= grain) {
    fn(0, n);
    return;
  }
  Pool &p = pool();
  const int threads = p.size();
  // A few chunks per thread balance uneven rows without much claiming overhead.
  const int64_t chunk = std::max(grain, (n + 4 * threads - 1) / (4 * threads));
  // Whether the loop runs on the pool or on this thread alone (nested, single
  // thread, or the pool busy with another step's loop), it is cut into the same
  // chunks: a kernel whose chunks are separate library calls (GEMM blocks) then
  // computes the same bits however busy the pool is.
  auto serial = [&] {
    for (int64_t b = 0; b < n; b += chunk) fn(b, std::min(n, b + chunk));
  };
  if (t_in_parallel || threads == 1 || !p.try_run(n, chunk, &fn)) serial();
}

// ---------------------------------------------------------------------------
// Communication threads' priority

namespace {

std::atomic<int> &comm_nice_value() {
  static std::atomic<int> v{[] {
    if (const char *e = std::getenv("CTR_COMM_NICE"); e && *e) return std::atoi(e);
    return -10;
  }()};
  return v;
}

}  // namespace

void set_comm_nice(int nice) { comm_nice_value() = nice; }

void apply_comm_nice() {
  const int nice = comm_nice_value().load();
  if (nice == 0) return;
  // Per thread on Linux: setpriority on the thread id.
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
}

}  // namespace ctr
