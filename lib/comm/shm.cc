// Collectives through one shared-memory segment per communicator, for groups
// whose members all run on this host (same boot id, hostname and network
// namespace; decided in ucx.cc).
//
// Why. Between local ranks the UCX path moves large messages through UCX's
// shared-memory FIFO in two copies plus per-message overhead (UCX 1.13 with peer
// error handling cannot use CMA). Here each member copies its data once into
// its own slot of a segment every member has mapped, and every member reads or
// reduces straight from the slots into its output. Large collectives whose
// buffers are shared host allocations on every member skip the segment and
// read each other's buffers in place (run_direct): one copy.
//
// Segment. A memfd of mode 0600 that member 0 creates and the others map
// through /proc/PID/fd (shm_segment.cc); a slot of kBuffers buffers per member
// (shm_segment.h). Only counters and lengths are read from a peer's part, and
// each is checked before use.
//
// Protocol. A collective is a sequence of rounds, numbered per communicator. In
// round R every member writes its piece into its buffer R % kBuffers, fills in
// the buffer's head (lengths, the number of rounds it needs, the collective's
// shape) and publishes posted = R + 1 (release). Once every member has posted
// R, each reads what it needs from every buffer (acquire) and publishes
// done = R + 1. A buffer is written again only after every member is done with
// the round that used it last, so a member may run kBuffers rounds ahead of the
// slowest reader: large messages are pipelined. Reductions add the members'
// pieces in member order (0 + 1 + 2 ...), so every rank computes identical bits.
//
// Threads. A communicator's collectives run in issue order, one thread at a
// time: usually the thread that waits for one runs the queue up to it itself
// (help), as the caller of a blocking collective would, so that a collective
// costs no thread handoff and no wakeup. Each communicator also has an engine
// thread that takes what no waiter runs within kHandOffUs (a collective waited
// for later, from another thread, or never while peers wait for it), so that
// every communicator progresses on its own, and at once the collectives of
// kEngineBytes or more, for which it was measured faster than a waiter (see
// there). For the others the engine is not woken per issue: while they come
// it looks at its queue every kPollUs, and it sleeps until the next issue only
// after a look that found nothing new (each wakeup would preempt a copying
// thread on a host of few cores). A blocked runner spins briefly and then
// sleeps on a futex word in the segment that every publication bumps, waking
// at least every kSleepMs to check for dead peers (the transport's pidfd
// watch) and abandoned waits.

#include "comm/shm.h"

#include <linux/futex.h>
#include <sys/syscall.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/reduce.h"
#include "comm/shared_host.h"
#include "comm/shm_segment.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ctr {
namespace shm {
namespace {

using Clock = std::chrono::steady_clock;

// A blocked engine polls this long before it sleeps: a peer's next round
// usually follows within microseconds, and a futex sleep and wakeup costs more.
constexpr int64_t kSpinUs = 100;
// Longest futex sleep: how soon a dead peer or an abandoned wait is noticed.
constexpr int kSleepMs = 5;
// A blocked collective whose group lost a member other than the one it waits
// for fails after this grace (the lost member may have done its part).
constexpr int64_t kLostGraceMs = 1000;
// A queued collective that no thread runs is taken by the engine thread once
// it has waited this long: its waiter comes later, or waits for a peer's
// collective that only this one unblocks. Until then it is left to its waiter.
constexpr int64_t kHandOffUs = 500;
// How often an active engine thread looks at its queue. It is not woken on
// every issue (each wakeup preempts a thread that copies, on a host of few
// cores); after a poll that found no new collective it sleeps until the next
// issue wakes it.
constexpr int64_t kPollUs = 1000;
// A collective that writes at least this many bytes is left to the engine
// thread, woken at its issue, as before waiters ran collectives: on a loaded
// 2-core host long copies and reductions ran faster there (its raised
// priority keeps its core, where the caller's thread loses it mid-collective),
// and its two thread handoffs are small against them. At 1 MiB they were not
// (a direct all_reduce: 21 GB/s on the waiter, 11-12 on the engine thread).
constexpr size_t kEngineBytes = size_t{4} << 20;
// Collectives of at least this many bytes (per member for all_gather, the
// array for all_reduce, one block for reduce_scatter) and every all_to_all_v
// read the members' buffers in place where they are shared (run_direct).
// Below it the handshake round costs more than the copy it saves.
constexpr size_t kDirectBytes = size_t{64} << 10;
// Direct reductions run in chunks of this size, in the cache (reduce_block).
constexpr size_t kDirectChunk = size_t{32} << 10;
// Other members' shared allocations kept mapped per communicator.
constexpr size_t kPeerMaps = 64;

uint32_t load(const uint32_t &w) {
  return std::atomic_ref<uint32_t>(const_cast<uint32_t &>(w)).load(std::memory_order_acquire);
}
void store(uint32_t &w, uint32_t v) {
  std::atomic_ref<uint32_t>(w).store(v, std::memory_order_seq_cst);
}
uint64_t load64(const uint64_t &w) {
  return std::atomic_ref<uint64_t>(const_cast<uint64_t &>(w)).load(std::memory_order_relaxed);
}
void store64(uint64_t &w, uint64_t v) {
  std::atomic_ref<uint64_t>(w).store(v, std::memory_order_relaxed);
}
// Whether counter c has reached target (counters wrap; members are never more
// than a few rounds apart).
bool reached(uint32_t c, uint32_t target) { return static_cast<int32_t>(c - target) >= 0; }

// One step of a short busy wait: it yields the core. Two ranks and their
// threads share few cores; a pure spin (pause) measured 3-10x slower here,
// as it keeps out the very thread it waits for.
void relax() { std::this_thread::yield(); }

long futex(uint32_t *addr, int op, uint32_t val, const timespec *ts) {
  return ::syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

std::string seconds(int64_t ms) { return strformat("%.1f s", static_cast<double>(ms) / 1000.0); }

// An engine's failure: ends the collective (and the communicator).
struct Abort {
  ctr_status code;
  std::string msg;
  int silent = -1;  // global rank of the peer that stopped answering
};

// One pass over the rounds of a single collective (a batch has one per entry).
struct Phase {
  enum Kind : uint8_t { kGather, kAllReduce, kReduceScatter, kAllToAll, kBroadcast, kBarrier };
  Kind kind = kBarrier;
  const char *send = nullptr;
  char *out = nullptr;
  size_t bytes = 0;  // gather: per member; all_reduce: the array; reduce_scatter: one block
  size_t esz = 1;
  size_t chunk = kBufBytes;  // bytes of one piece per round
  uint32_t rounds = 1;       // this member's
  bool agree = true;         // every member must need the same rounds and shape
  uint64_t shape = 0;
  const ShmColl *coll = nullptr;
  int root = 0;
  bool alias = false;  // reduce_scatter: recv overlaps this member's block of send
  bool direct = false;  // read in place from the members' buffers (run_direct)
};

size_t piece(size_t total, uint32_t r, size_t chunk) {
  size_t start = static_cast<size_t>(r) * chunk;
  return start >= total ? 0 : std::min(chunk, total - start);
}
uint32_t rounds_for(size_t bytes, size_t chunk) {
  return static_cast<uint32_t>(std::max<size_t>(1, (bytes + chunk - 1) / chunk));
}

class Engine final : public ShmComm {
 public:
  Engine(const ShmSetup &s, Mapping m, std::vector<pid_t> pids, bool direct)
      : members_(s.members), me_(s.me), n_(static_cast<int>(s.members.size())),
        peer_failed_(s.peer_failed), on_failure_(s.on_failure), map_(std::move(m)),
        pids_(std::move(pids)), direct_(direct) {
    hdr_ = reinterpret_cast<SegHeader *>(map_.base);
    thread_ = std::thread([this] { run(); });
  }
  ~Engine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    stopping_ = true;
    cv_.notify_all();
    wake();
    thread_.join();
  }

  void issue(std::shared_ptr<ShmColl> c) override {
    const bool engine = bytes_out(*c) >= kEngineBytes;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(c), Clock::now(), engine});
      ++issued_;
      urgent_ += engine;
      wake = std::exchange(asleep_, false) || engine;
    }
    if (wake) cv_.notify_one();
  }

  void wake() override {
    std::atomic_ref<uint32_t>(hdr_->gen).fetch_add(1, std::memory_order_seq_cst);
    futex(&hdr_->gen, FUTEX_WAKE, INT_MAX, nullptr);
  }

  size_t bytes_out(const ShmColl &c) const override;
  void help(const ShmColl &target, Clock::time_point deadline, int64_t timeout_ms) override;

 private:
  MemberCtl &ctl(int m) const {
    return *reinterpret_cast<MemberCtl *>(map_.base + kPage + m * kCtlStride);
  }
  char *data(int m, uint32_t round) const {
    return map_.base + kPage + n_ * kCtlStride +
           (static_cast<size_t>(m) * kBuffers + round % kBuffers) * kBufBytes;
  }
  // Index of member `to` among member `from`'s pieces (from skips itself).
  static int slot_of(int from, int to) { return to < from ? to : to - 1; }

  void publish(uint32_t &counter, uint32_t v) {
    store(counter, v);
    std::atomic_ref<uint32_t>(hdr_->gen).fetch_add(1, std::memory_order_seq_cst);
    if (std::atomic_ref<uint32_t>(hdr_->sleepers).load(std::memory_order_seq_cst) > 0)
      futex(&hdr_->gen, FUTEX_WAKE, INT_MAX, nullptr);
  }

  void run();
  bool run_head();
  void execute(ShmColl &c);
  std::vector<Phase> plan(const ShmColl &c) const;
  void run_phase(ShmColl &c, Phase &p);
  void put(const Phase &p, uint32_t r, char *buf, BufHead &h);
  void take(ShmColl &c, const Phase &p, uint32_t r, uint32_t round);
  bool run_direct(ShmColl &c, const Phase &p);
  void wait_all(ShmColl &c, uint32_t MemberCtl::*counter, uint32_t target);
  const char *peer_view(const ShmColl &c, int m, int i, uint64_t addr, size_t bytes);
  void reduce_block(const ShmColl &c, const Phase &p, size_t bytes, char *dst,
                    const char *const *src, bool stage);
  [[noreturn]] void different(const ShmColl &c, int m);
  void block(ShmColl &c, int waiting_for, Clock::time_point idle_since, uint32_t seen_gen);
  void check_abandoned(ShmColl &c, int waiting_for);
  [[noreturn]] void mismatch(const ShmColl &c, int m, const char *what, uint64_t got,
                             uint64_t want);

  const std::vector<int> members_;
  const int me_, n_;
  std::function<std::string(int)> peer_failed_;
  std::function<void(int)> on_failure_;
  Mapping map_;
  const std::vector<pid_t> pids_;  // each member's process
  const bool direct_;              // every member may read every other's memory
  SegHeader *hdr_ = nullptr;
  uint32_t round_ = 0;  // the next round of this communicator (engine thread only)
  std::vector<char> scratch_;
  Clock::time_point lost_since_{};  // when a blocked phase first saw a lost member
  // The first failure: the members' rounds no longer line up, so every later
  // collective fails at once with it.
  ctr_status broken_code_ = CTR_STATUS_OK;
  std::string broken_;

  struct Queued {
    std::shared_ptr<ShmColl> c;
    Clock::time_point at;  // when it was issued
    bool engine;           // for the engine thread, at once (kEngineBytes)
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  uint64_t issued_ = 0;  // collectives ever issued (under mu_)
  size_t urgent_ = 0;    // queued collectives for the engine thread (under mu_)
  bool stop_ = false;
  // Which thread runs the queue's head (under mu_): none, the engine's, or a
  // waiter's (help). The runner alone touches the segment and the state below.
  enum Runner : uint8_t { kNone, kEngine, kHelper } runner_ = kNone;
  bool asleep_ = false;  // the engine thread sleeps until issue() wakes it (under mu_)
  // A helping waiter's target and deadline (runner only): past the deadline,
  // what it runs fails with the target's timeout.
  const ShmColl *help_target_ = nullptr;
  Clock::time_point help_deadline_ = Clock::time_point::max();
  int64_t help_timeout_ms_ = 0;
  std::atomic<bool> stopping_{false};  // stop_, for a blocked collective to see
  std::vector<const char *> src_;      // take(): each member's piece
  // Other members' shared host allocations mapped here (run_direct), the
  // oldest dropped first beyond kPeerMaps.
  struct PeerMap {
    int member = 0;
    int64_t fd = -1;
    uint64_t ino = 0;
    Mapping map;
  };
  std::deque<PeerMap> peer_maps_;
  std::thread thread_;
};

void Engine::run() {
  apply_comm_nice();
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t seen = issued_;
  for (;;) {
    if (stop_) {
      // Destroyed: fail what is queued, once a helping waiter has let go.
      cv_.wait(lock, [this] { return runner_ == kNone; });
      runner_ = kEngine;
      lock.unlock();
      while (run_head()) {
      }
      return;
    }
    const auto now = Clock::now();
    if (runner_ == kNone && !queue_.empty() &&
        (urgent_ > 0 || now - queue_.front().at >= std::chrono::microseconds(kHandOffUs))) {
      // Nobody came for it: run the queue here until it is empty.
      runner_ = kEngine;
      lock.unlock();
      while (run_head()) {
      }
      lock.lock();
      runner_ = kNone;
      cv_.notify_all();  // a destructor may wait for the runner
      seen = issued_;
      continue;
    }
    if (queue_.empty() && issued_ == seen) {
      // Nothing issued since the last look: sleep until the next issue.
      asleep_ = true;
      cv_.wait(lock, [this] { return stop_ || !asleep_; });
      asleep_ = false;
      seen = issued_;
      continue;
    }
    seen = issued_;
    auto until = now + std::chrono::microseconds(kPollUs);
    if (runner_ == kNone && !queue_.empty())
      until = std::min(until, queue_.front().at + std::chrono::microseconds(kHandOffUs));
    cv_.wait_until(lock, until, [this] { return stop_ || (urgent_ > 0 && runner_ == kNone); });
  }
}

// Runs (or, once the communicator is stopping, fails) the collective at the
// head of the queue; false when the queue is empty. Runner only.
bool Engine::run_head() {
  std::shared_ptr<ShmColl> c;
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty()) return false;
    c = queue_.front().c;
    stopping = stop_;
  }
  if (stopping) {
    // Destroyed with collectives in flight: fail them, touching no buffer.
    c->done(CTR_STATUS_INVALID_STATE,
            c->label + ": the communicator was destroyed while it was in flight");
  } else {
    execute(*c);
  }
  std::lock_guard<std::mutex> lock(mu_);
  urgent_ -= queue_.front().engine;
  queue_.pop_front();
  return true;
}

void Engine::help(const ShmColl &target, Clock::time_point deadline, int64_t timeout_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (runner_ != kNone || stop_) return;  // its runner completes target
    auto it = std::find_if(queue_.begin(), queue_.end(),
                           [&](const Queued &q) { return q.c.get() == &target; });
    if (it == queue_.end() || it->engine) return;
    runner_ = kHelper;
  }
  help_target_ = &target;
  help_deadline_ = deadline;
  help_timeout_ms_ = timeout_ms;
  for (;;) {
    const ShmColl *head;
    {
      std::lock_guard<std::mutex> lock(mu_);
      head = queue_.front().c.get();
    }
    run_head();
    if (head == &target) break;
  }
  help_target_ = nullptr;
  help_deadline_ = Clock::time_point::max();
  std::lock_guard<std::mutex> lock(mu_);
  runner_ = kNone;
  // The engine thread finds what is left on its next look; only a destructor
  // waiting for this runner, or collectives left to the engine, wake it now
  // (under the lock: a destructor frees the engine once it sees kNone).
  if (stop_ || urgent_ > 0) cv_.notify_all();
}

void Engine::execute(ShmColl &c) {
  ctr_status code = CTR_STATUS_OK;
  std::string msg;
  try {
    if (broken_code_ != CTR_STATUS_OK)
      throw Abort{broken_code_, c.label + ": the communicator failed before: " + broken_};
    std::vector<Phase> phases = plan(c);
    for (Phase &p : phases) run_phase(c, p);
  } catch (const Abort &a) {
    code = a.code;
    msg = a.msg;
    if (broken_code_ == CTR_STATUS_OK) {
      broken_code_ = a.code;
      broken_ = a.msg;
      on_failure_(a.silent);
    }
  } catch (const std::exception &e) {
    code = CTR_STATUS_INTERNAL;
    msg = c.label + ": " + e.what();
    if (broken_code_ == CTR_STATUS_OK) {
      broken_code_ = code;
      broken_ = msg;
      on_failure_(-1);
    }
  }
  c.done(code, msg);
}

uint64_t shape_of(const Phase &p, const ShmColl &c) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over what every member must agree on
  const uint64_t fields[] = {static_cast<uint64_t>(p.kind), p.bytes, p.esz,
                            static_cast<uint64_t>(p.root), static_cast<uint64_t>(c.dtype),
                            static_cast<uint64_t>(c.op), static_cast<uint64_t>(p.direct)};
  for (uint64_t v : fields) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

std::vector<Phase> Engine::plan(const ShmColl &c) const {
  std::vector<Phase> out;
  // Pieces for every other member share a round's buffer.
  const size_t split = (kBufBytes / static_cast<size_t>(n_ - 1)) / 64 * 64;
  auto add = [&](Phase p) {
    p.coll = &c;
    p.direct = direct_ && p.kind != Phase::kBarrier &&
               (p.kind == Phase::kAllToAll || p.bytes >= kDirectBytes);
    p.rounds = rounds_for(p.bytes, p.chunk);
    p.shape = shape_of(p, c);
    out.push_back(p);
  };
  switch (c.kind) {
    case ShmColl::kBarrier: {
      Phase p;
      p.kind = Phase::kBarrier;
      add(p);
      break;
    }
    case ShmColl::kBroadcast: {
      Phase p;
      p.kind = Phase::kBroadcast;
      p.out = static_cast<char *>(c.buf);
      p.send = p.out;
      p.bytes = c.bytes;
      p.root = c.root;
      add(p);
      break;
    }
    case ShmColl::kAllToAllV: {
      Phase p;
      p.kind = Phase::kAllToAll;
      p.send = static_cast<const char *>(c.send);
      p.out = static_cast<char *>(c.recv);
      p.esz = c.elem_size;
      p.chunk = split;
      p.agree = false;
      add(p);
      // Rounds: enough for every message this member sends or receives; the
      // collective takes the largest need of any member (read in round 0).
      uint32_t r = 1;
      for (int j = 0; j < n_; ++j) {
        if (j == me_) continue;
        r = std::max(r, rounds_for(c.send_counts[j] * c.elem_size, split));
        r = std::max(r, rounds_for(c.recv_counts[j] * c.elem_size, split));
      }
      out.back().rounds = r;
      break;
    }
    case ShmColl::kBatch:
      for (const CollDesc &d : c.descs) {
        Phase p;
        p.send = static_cast<const char *>(d.send);
        p.out = static_cast<char *>(d.recv);
        switch (d.kind) {
          case CollDesc::AllGather:
            p.kind = Phase::kGather;
            p.bytes = d.count;
            break;
          case CollDesc::AllReduce:
            p.kind = Phase::kAllReduce;
            p.esz = dtype_bytes(c.dtype);
            p.bytes = d.count * p.esz;
            break;
          case CollDesc::ReduceScatter: {
            p.kind = Phase::kReduceScatter;
            p.esz = dtype_bytes(c.dtype);
            p.bytes = d.count * p.esz;
            p.chunk = split;
            // recv overlapping send: this member's own block is staged before
            // the reduction overwrites it.
            const char *s0 = p.send, *s1 = p.send + n_ * p.bytes;
            p.alias = p.bytes > 0 && p.out < s1 && p.out + p.bytes > s0;
            break;
          }
        }
        add(p);
      }
      break;
  }
  return out;
}

size_t Engine::bytes_out(const ShmColl &c) const {
  switch (c.kind) {
    case ShmColl::kBarrier:
      return 0;
    case ShmColl::kBroadcast:
      return c.root == me_ ? c.bytes : 0;
    case ShmColl::kAllToAllV: {
      size_t b = 0;
      for (int j = 0; j < n_; ++j)
        if (j != me_) b += c.send_counts[j] * c.elem_size;
      return b;
    }
    case ShmColl::kBatch: {
      size_t b = 0;
      for (const CollDesc &d : c.descs) {
        if (d.kind == CollDesc::AllGather) b += d.count;
        if (d.kind == CollDesc::AllReduce) b += d.count * dtype_bytes(c.dtype);
        if (d.kind == CollDesc::ReduceScatter) b += (n_ - 1) * d.count * dtype_bytes(c.dtype);
      }
      return b;
    }
  }
  return 0;
}

void Engine::run_phase(ShmColl &c, Phase &p) {
  lost_since_ = {};
  if (p.direct && run_direct(c, p)) {
    c.path = "shm direct";
    return;
  }
  const uint32_t base = round_;
  uint32_t total = p.agree ? p.rounds : 0;  // 0: not known before round 0 is read
  uint32_t put_n = 0, take_n = 0;
  MemberCtl &mine = ctl(me_);
  auto idle_since = Clock::now();
  lost_since_ = {};
  for (;;) {
    const uint32_t seen = std::atomic_ref<uint32_t>(hdr_->gen).load(std::memory_order_seq_cst);
    bool progress = false;
    int waiting = -1;
    if (put_n < (total ? total : p.rounds)) {
      // The buffer of round R was last used by round R - kBuffers: every member
      // must be done with it.
      const uint32_t r = base + put_n;
      int busy = -1;
      for (int m = 0; m < n_ && busy < 0; ++m)
        if (!reached(load(ctl(m).done), r + 1 - kBuffers)) busy = m;
      if (busy < 0) {
        BufHead &h = mine.head[r % kBuffers];
        put(p, put_n, data(me_, r), h);
        std::atomic_ref<uint32_t>(h.rounds).store(p.rounds, std::memory_order_relaxed);
        store64(h.shape, p.shape);
        publish(mine.posted, r + 1);
        ++put_n;
        progress = true;
      } else {
        waiting = busy;
      }
    }
    if (take_n < put_n) {
      const uint32_t r = base + take_n;
      int missing = -1;
      for (int m = 0; m < n_ && missing < 0; ++m)
        if (!reached(load(ctl(m).posted), r + 1)) missing = m;
      if (missing < 0) {
        if (take_n == 0) {
          for (int m = 0; m < n_; ++m) {
            const BufHead &h = ctl(m).head[r % kBuffers];
            const uint32_t rounds = load(h.rounds);
            if (p.agree && load64(h.shape) != p.shape) different(c, m);
            // A sanity bound: no exchange here needs 2^24 rounds (8 TiB).
            if (!p.agree && (rounds == 0 || rounds > (1u << 24)))
              mismatch(c, m, "rounds", rounds, p.rounds);
            if (!p.agree) total = std::max(total, rounds);
          }
        }
        take(c, p, take_n, r);
        publish(mine.done, r + 1);
        ++take_n;
        progress = true;
        if (take_n == total) {
          round_ = base + total;
          return;
        }
      } else {
        waiting = missing;
      }
    }
    if (progress) {
      idle_since = Clock::now();
      continue;
    }
    block(c, waiting, idle_since, seen);
  }
}

// Direct collectives. A collective of kDirectBytes or more starts with a
// handshake round: every member publishes the addresses of its buffers and the
// shared host allocations (shared_host.h) that hold them. If every buffer that
// another member reads is in one, on every member (each decides from the same
// published facts, so all decide alike), the collective skips the segment:
// each member maps the others' allocations (read only, once, through
// /proc/PID/fd) and copies or reduces straight from their buffers into its
// own, one copy per byte where the segment takes two. Otherwise it continues
// through the segment from the next round.
//
// A direct collective uses one round number per stage: posted = R + 1 says "my
// buffers for stage R are ready", and the stage starts once every member has
// said so. all_reduce has two stages (where some member reduces in place, or
// the group has more than two members): each member reduces its own block of
// the array from every member's input (in member order, so the bits equal the
// segment path's), then copies the others' reduced blocks; otherwise each
// reduces the whole array in one stage. At the end every
// member publishes done and waits until all have: the others read a member's
// buffers until then, so no collective returns while a peer may still read
// from it, and none succeeds unless every member completed its part.
bool Engine::run_direct(ShmColl &c, const Phase &p) {
  const uint32_t base = round_;
  const bool ar = p.kind == Phase::kAllReduce;
  // all_reduce: two stages where some member reduces in place or the group
  // has more than two members, else one (below).
  const bool in_place = p.out < p.send + p.bytes && p.send < p.out + p.bytes;
  const uint32_t want = ar && (n_ > 2 || in_place) ? 2 : 1;
  // Heads and addresses are rewritten only once every member is done with
  // every earlier round (after a direct collective they are already).
  wait_all(c, &MemberCtl::done, base);
  MemberCtl &mine = ctl(me_);
  BufHead &h = mine.head[base % kBuffers];
  // What the others read of this member's send (and, for all_reduce, out).
  size_t extent = p.bytes;
  if (p.kind == Phase::kReduceScatter) extent = n_ * p.bytes;
  if (p.kind == Phase::kAllToAll) {
    extent = 0;
    for (int j = 0; j < n_; ++j) {
      extent = std::max(extent, (c.send_displs[j] + c.send_counts[j]) * p.esz);
      if (j == me_) continue;
      const int s = slot_of(me_, j);
      store64(mine.addr[s], reinterpret_cast<uintptr_t>(p.send + c.send_displs[j] * p.esz));
      store64(h.len[s], c.send_counts[j] * p.esz);
    }
  } else {
    store64(mine.addr[0], reinterpret_cast<uintptr_t>(p.send));
    store64(mine.addr[1], reinterpret_cast<uintptr_t>(p.out));
    store64(h.len[0], p.bytes);
  }
  for (int i = 0; i < (ar ? 2 : 1); ++i) {
    SharedHost sh;
    MemberCtl::Region &r = mine.region[i];
    const bool shared = shared_host_find(i == 0 ? p.send : p.out, extent, &sh);
    store64(r.ino, shared ? sh.ino : 0);
    store64(r.base, sh.base);
    store64(r.bytes, sh.bytes);
    store64(reinterpret_cast<uint64_t &>(r.fd), static_cast<uint64_t>(sh.fd));
  }
  std::atomic_ref<uint32_t>(h.rounds).store(want, std::memory_order_relaxed);
  store64(h.shape, p.shape);
  publish(mine.posted, base + 1);
  // This member's own block needs no peer: it moves while the others publish
  // (and again through the segment if the collective falls back there).
  if (p.kind == Phase::kGather && p.out + me_ * p.bytes != p.send)
    std::memcpy(p.out + me_ * p.bytes, p.send, p.bytes);
  if (p.kind == Phase::kAllToAll && c.send_counts[me_])
    std::memcpy(p.out + c.recv_displs[me_] * p.esz, p.send + c.send_displs[me_] * p.esz,
                c.send_counts[me_] * p.esz);
  wait_all(c, &MemberCtl::posted, base + 1);

  const uint32_t head = base % kBuffers;
  uint32_t stages = 1;
  for (int m = 0; m < n_; ++m) {
    const MemberCtl &x = ctl(m);
    if (m == me_) continue;
    if (load64(x.head[head].shape) != p.shape) different(c, m);
    if (p.kind != Phase::kAllToAll && load64(x.head[head].len[0]) != p.bytes)
      mismatch(c, m, "bytes", load64(x.head[head].len[0]), p.bytes);
    const uint32_t r = load(x.head[head].rounds);
    if (r != 1 && r != (ar ? 2u : 1u)) mismatch(c, m, "stages", r, want);
    stages = std::max({stages, want, r});
  }
  // One stage: every member reads the others' send buffers. Two
  // (all_reduce): their out buffers too.
  bool direct = true;
  for (int m = 0; m < n_; ++m) {
    const MemberCtl &x = ctl(m);
    const bool read = p.kind != Phase::kBroadcast || m == p.root;
    direct = direct && (!read || (load64(x.region[0].ino) != 0 &&
                                  (stages == 1 || load64(x.region[1].ino) != 0)));
  }
  if (!direct) {
    round_ = base + 1;
    return false;
  }

  // Member m's buffer at addr (in its address space), bytes of it, region i.
  auto peer = [&](int m, int i, uint64_t addr, size_t bytes) {
    return peer_view(c, m, i, addr, bytes);
  };
  auto addr = [&](int m, int s) { return load64(ctl(m).addr[s]); };
  switch (p.kind) {
    case Phase::kGather:
      for (int m = 0; m < n_; ++m)
        if (m != me_) std::memcpy(p.out + m * p.bytes, peer(m, 0, addr(m, 0), p.bytes), p.bytes);
      break;
    case Phase::kBroadcast:
      if (me_ != p.root) std::memcpy(p.out, peer(p.root, 0, addr(p.root, 0), p.bytes), p.bytes);
      break;
    case Phase::kReduceScatter: {
      std::vector<const char *> &src = src_;
      src.resize(n_);
      for (int m = 0; m < n_; ++m)
        src[m] = m == me_ ? p.send + me_ * p.bytes
                          : peer(m, 0, addr(m, 0) + me_ * p.bytes, p.bytes);
      reduce_block(c, p, p.bytes, p.out, src.data(), false);
      break;
    }
    case Phase::kAllReduce: {
      std::vector<const char *> &src = src_;
      src.resize(n_);
      if (stages == 1) {
        // Two members, neither in place: each reduces the whole array from
        // both inputs, which no one writes, into its own out, which no one
        // reads. One stage less than below and no reads of freshly written
        // lines: measured faster for two members.
        for (int m = 0; m < n_; ++m)
          src[m] = m == me_ ? p.send : peer(m, 0, addr(m, 0), p.bytes);
        reduce_block(c, p, p.bytes, p.out, src.data(), false);
        break;
      }
      // Member b's block: elements [count * b / n, count * (b + 1) / n).
      const size_t count = p.bytes / p.esz;
      auto lo = [&](int b) { return count * b / n_ * p.esz; };
      const size_t at = lo(me_), len = lo(me_ + 1) - lo(me_);
      for (int m = 0; m < n_; ++m)
        src[m] = m == me_ ? p.send + at : peer(m, 0, addr(m, 0) + at, len);
      reduce_block(c, p, len, p.out + at, src.data(), true);
      publish(mine.posted, base + 2);
      wait_all(c, &MemberCtl::posted, base + 2);
      for (int m = 0; m < n_; ++m) {
        if (m == me_) continue;
        const size_t bytes = lo(m + 1) - lo(m);
        std::memcpy(p.out + lo(m), peer(m, 1, addr(m, 1) + lo(m), bytes), bytes);
      }
      break;
    }
    case Phase::kAllToAll:
      for (int m = 0; m < n_; ++m) {
        if (m == me_) continue;
        const int s = slot_of(m, me_);
        const size_t want = c.recv_counts[m] * p.esz;
        const uint64_t len = load64(ctl(m).head[head].len[s]);
        if (len != want) mismatch(c, m, "bytes", len, want);
        if (want) std::memcpy(p.out + c.recv_displs[m] * p.esz, peer(m, 0, addr(m, s), want), want);
      }
      break;
    case Phase::kBarrier:
      break;
  }
  publish(mine.done, base + stages);
  wait_all(c, &MemberCtl::done, base + stages);
  round_ = base + stages;
  return true;
}

// dst[bytes] = the reduction, in member order, of src[m][bytes] (this member's
// own input among them), in chunks. With `stage`, each chunk is reduced in
// scratch and copied out: where a peer reads dst next (all_reduce), its lines
// sit in that peer's cache, and vector stores into them (each a read for
// ownership) measured 5x slower here than a reduction in the cache and one
// memcpy. Without it, this member's own input is staged where dst overlaps it
// and the sum would overwrite it before adding it (after the first two terms).
void Engine::reduce_block(const ShmColl &c, const Phase &p, size_t bytes, char *dst,
                          const char *const *src, bool stage) {
  scratch_.resize(2 * kDirectChunk);
  char *acc = scratch_.data(), *own_buf = acc + kDirectChunk;
  const int64_t divisor = c.op == ReduceOp::Avg ? n_ : 0;
  for (size_t at = 0; at < bytes; at += kDirectChunk) {
    const size_t len = std::min(kDirectChunk, bytes - at);
    char *d = stage ? acc : dst + at;
    const char *own = src[me_] + at;
    if (!stage && d < own + len && own < d + len && (me_ >= 2 || d != own)) {
      std::memcpy(own_buf, own, len);
      own = own_buf;
    }
    auto term = [&](int m) { return m == me_ ? own : src[m] + at; };
    const size_t count = len / p.esz;
    reduce(d, term(0), term(1), count, c.dtype, c.op, n_ == 2 ? divisor : 0);
    for (int m = 2; m < n_; ++m)
      reduce(d, d, term(m), count, c.dtype, c.op, m == n_ - 1 ? divisor : 0);
    if (stage) std::memcpy(dst + at, acc, len);
  }
}

// Where [addr, addr + bytes) of member m, published in its region i, is
// mapped here (mapping the region the first time).
const char *Engine::peer_view(const ShmColl &c, int m, int i, uint64_t addr, size_t bytes) {
  const MemberCtl::Region &r = ctl(m).region[i];
  const uint64_t ino = load64(r.ino), base = load64(r.base), size = load64(r.bytes);
  const auto fd = static_cast<int64_t>(load64(reinterpret_cast<const uint64_t &>(r.fd)));
  if (addr < base || addr - base > size || bytes > size - (addr - base))
    throw Abort{CTR_STATUS_COMM_ERROR,
                strformat("%s: rank %d published a buffer outside its shared allocation",
                          c.label.c_str(), members_[m])};
  for (const PeerMap &pm : peer_maps_)
    if (pm.member == m && pm.ino == ino && pm.map.bytes == size)
      return pm.map.base + (addr - base);
  auto fail = [&](const char *why) {
    return Abort{CTR_STATUS_COMM_ERROR,
                 strformat("%s: could not map rank %d's shared buffer: %s", c.label.c_str(),
                           members_[m], why)};
  };
  if (fd < 0 || fd > INT_MAX) throw fail("bad descriptor");
  Mapping map;
  const std::string why = ino == 0 ? std::string("no allocation was announced")
                                   : map_peer_file(static_cast<long>(pids_[m]),
                                                   static_cast<long>(fd), size, ino, false, &map);
  if (!why.empty()) throw fail(why.c_str());
  // A mapping of another file under the same descriptor is of an allocation
  // the peer has freed since: let it go now rather than hold its memory.
  std::erase_if(peer_maps_, [&](const PeerMap &x) { return x.member == m && x.fd == fd; });
  if (peer_maps_.size() == kPeerMaps) peer_maps_.pop_front();
  PeerMap pm;
  pm.member = m;
  pm.fd = fd;
  pm.ino = ino;
  pm.map = std::move(map);
  peer_maps_.push_back(std::move(pm));
  return peer_maps_.back().map.base + (addr - base);
}

// Waits until every member's counter has reached target.
void Engine::wait_all(ShmColl &c, uint32_t MemberCtl::*counter, uint32_t target) {
  const auto idle_since = Clock::now();
  for (;;) {
    const uint32_t seen = std::atomic_ref<uint32_t>(hdr_->gen).load(std::memory_order_seq_cst);
    int missing = -1;
    for (int m = 0; m < n_ && missing < 0; ++m)
      if (!reached(load(ctl(m).*counter), target)) missing = m;
    if (missing < 0) return;
    block(c, missing, idle_since, seen);
  }
}

void Engine::put(const Phase &p, uint32_t r, char *buf, BufHead &h) {
  auto copy = [](char *dst, const char *src, size_t n) {
    if (n) std::memcpy(dst, src, n);
  };
  const size_t at = static_cast<size_t>(r) * p.chunk;
  switch (p.kind) {
    case Phase::kGather:
    case Phase::kAllReduce: {
      const size_t len = piece(p.bytes, r, p.chunk);
      copy(buf, p.send + at, len);
      store64(h.len[0], len);
      break;
    }
    case Phase::kBroadcast: {
      const size_t len = me_ == p.root ? piece(p.bytes, r, p.chunk) : 0;
      copy(buf, p.send + at, len);
      store64(h.len[0], len);
      break;
    }
    case Phase::kReduceScatter:
      for (int j = 0; j < n_; ++j) {
        if (j == me_) continue;
        const size_t len = piece(p.bytes, r, p.chunk);
        const int s = slot_of(me_, j);
        copy(buf + s * p.chunk, p.send + j * p.bytes + at, len);
        store64(h.len[s], len);
      }
      break;
    case Phase::kAllToAll: {
      const ShmColl &c = *p.coll;
      if (r == 0 && c.send_counts[me_])
        copy(p.out + c.recv_displs[me_] * p.esz, p.send + c.send_displs[me_] * p.esz,
             c.send_counts[me_] * p.esz);
      for (int j = 0; j < n_; ++j) {
        if (j == me_) continue;
        const size_t len = piece(c.send_counts[j] * p.esz, r, p.chunk);
        const int s = slot_of(me_, j);
        copy(buf + s * p.chunk, p.send + c.send_displs[j] * p.esz + at, len);
        store64(h.len[s], len);
      }
      break;
    }
    case Phase::kBarrier:
      store64(h.len[0], 0);
      break;
  }
}

void Engine::different(const ShmColl &c, int m) {
  throw Abort{CTR_STATUS_COMM_ERROR,
              strformat("%s: rank %d issued a different collective or size (do all ranks issue "
                        "the same collectives with the same sizes?)",
                        c.label.c_str(), members_[m])};
}

void Engine::mismatch(const ShmColl &c, int m, const char *what, uint64_t got, uint64_t want) {
  throw Abort{CTR_STATUS_COMM_ERROR,
              strformat("%s: rank %d sent %llu %s where %llu were expected (do all ranks issue "
                        "the same collectives with the same sizes?)",
                        c.label.c_str(), members_[m], static_cast<unsigned long long>(got), what,
                        static_cast<unsigned long long>(want))};
}

void Engine::take(ShmColl &c, const Phase &p, uint32_t r, uint32_t round) {
  const size_t at = static_cast<size_t>(r) * p.chunk;
  auto len_of = [&](int m, int s) { return load64(ctl(m).head[round % kBuffers].len[s]); };
  switch (p.kind) {
    case Phase::kGather: {
      const size_t want = piece(p.bytes, r, p.chunk);
      for (int m = 0; m < n_; ++m) {
        char *dst = p.out + m * p.bytes + at;
        if (m == me_) {
          if (want && dst != p.send + at) std::memcpy(dst, p.send + at, want);
          continue;
        }
        if (len_of(m, 0) != want) mismatch(c, m, "bytes", len_of(m, 0), want);
        if (want) std::memcpy(dst, data(m, round), want);
      }
      break;
    }
    case Phase::kAllReduce:
    case Phase::kReduceScatter: {
      const size_t want = piece(p.bytes, r, p.chunk);
      const bool rs = p.kind == Phase::kReduceScatter;
      std::vector<const char *> &src = src_;
      src.resize(n_);
      for (int m = 0; m < n_; ++m) {
        if (m == me_) {
          // all_reduce reads its own piece from its buffer too: the output may be the input.
          src[m] = rs ? p.send + me_ * p.bytes + at : data(m, round);
          continue;
        }
        const int s = rs ? slot_of(m, me_) : 0;
        if (len_of(m, s) != want) mismatch(c, m, "bytes", len_of(m, s), want);
        src[m] = data(m, round) + s * p.chunk;
      }
      if (p.alias && want) {
        scratch_.resize(p.chunk);
        std::memcpy(scratch_.data(), src[me_], want);
        src[me_] = scratch_.data();
      }
      const size_t count = want / p.esz;
      if (count == 0) break;
      const int64_t divisor = c.op == ReduceOp::Avg ? n_ : 0;
      char *dst = p.out + at;
      // Member order, whatever this member's index: identical bits everywhere.
      reduce(dst, src[0], src[1], count, c.dtype, c.op, n_ == 2 ? divisor : 0);
      for (int m = 2; m < n_; ++m)
        reduce(dst, dst, src[m], count, c.dtype, c.op, m == n_ - 1 ? divisor : 0);
      break;
    }
    case Phase::kAllToAll:
      for (int m = 0; m < n_; ++m) {
        if (m == me_) continue;
        const size_t want = piece(c.recv_counts[m] * p.esz, r, p.chunk);
        const int s = slot_of(m, me_);
        if (len_of(m, s) != want) mismatch(c, m, "bytes", len_of(m, s), want);
        if (want)
          std::memcpy(p.out + c.recv_displs[m] * p.esz + at, data(m, round) + s * p.chunk, want);
      }
      break;
    case Phase::kBroadcast:
      if (me_ != p.root) {
        const size_t want = piece(p.bytes, r, p.chunk);
        if (len_of(p.root, 0) != want) mismatch(c, p.root, "bytes", len_of(p.root, 0), want);
        if (want) std::memcpy(p.out + at, data(p.root, round), want);
      }
      break;
    case Phase::kBarrier:
      break;
  }
}

// The current collective waits for member `waiting_for` (a group index, or -1).
void Engine::check_abandoned(ShmColl &c, int waiting_for) {
  auto timeout = [&](const ShmColl &x, int64_t ms) {
    Abort a{CTR_STATUS_TIMEOUT, strformat("%s: timed out after %s", x.label.c_str(),
                                          seconds(ms).c_str())};
    if (waiting_for >= 0) {
      a.silent = members_[waiting_for];
      a.msg += strformat(" waiting for rank %d", a.silent);
    }
    if (&x != &c) a.msg = c.label + ": abandoned: " + a.msg;
    return a;
  };
  const int64_t ms = c.abandoned_ms.load(std::memory_order_acquire);
  if (ms >= 0) throw timeout(c, ms);
  // A helping waiter's deadline passed: it gives up on its collective, and on
  // those ahead of it that it runs.
  if (help_target_ && Clock::now() >= help_deadline_) throw timeout(*help_target_, help_timeout_ms_);
  // A later collective's waiter gave up: it waits behind this one.
  std::lock_guard<std::mutex> lock(mu_);
  for (const Queued &q : queue_) {
    const int64_t qms = q.c->abandoned_ms.load(std::memory_order_acquire);
    if (qms >= 0) throw timeout(*q.c, qms);
  }
}

void Engine::block(ShmColl &c, int waiting_for, Clock::time_point idle_since, uint32_t seen_gen) {
  if (stopping_.load(std::memory_order_relaxed))
    throw Abort{CTR_STATUS_INVALID_STATE,
                c.label + ": the communicator was destroyed while it was in flight"};
  if (c.abandoned_ms.load(std::memory_order_relaxed) >= 0) check_abandoned(c, waiting_for);
  if (help_target_ && Clock::now() >= help_deadline_) check_abandoned(c, waiting_for);
  if (waiting_for >= 0) {
    const int g = members_[waiting_for];
    std::string why = peer_failed_(g);
    if (!why.empty())
      throw Abort{CTR_STATUS_COMM_ERROR,
                  strformat("%s: rank %d failed: ", c.label.c_str(), g) + why};
  }
  const auto now = Clock::now();
  if (now - idle_since < std::chrono::microseconds(kSpinUs)) {
    relax();
    return;
  }
  check_abandoned(c, waiting_for);
  // Another member is gone: this collective may still complete if that member
  // did its part before it went, so it gets a grace period.
  for (int m = 0; m < n_; ++m) {
    if (m == me_) continue;
    std::string why = peer_failed_(members_[m]);
    if (why.empty()) continue;
    if (lost_since_ == Clock::time_point{}) lost_since_ = now;
    if (now - lost_since_ >= std::chrono::milliseconds(kLostGraceMs))
      throw Abort{CTR_STATUS_COMM_ERROR,
                  strformat("%s: rank %d failed: ", c.label.c_str(), members_[m]) + why};
  }
  std::atomic_ref<uint32_t> sleepers(hdr_->sleepers);
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  const timespec ts{0, kSleepMs * 1000000L};
  futex(&hdr_->gen, FUTEX_WAIT, seen_gen, &ts);
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace

std::unique_ptr<ShmComm> make_engine(const ShmSetup &s, Mapping map, std::vector<pid_t> pids,
                                     bool direct) {
  return std::make_unique<Engine>(s, std::move(map), std::move(pids), direct);
}

}  // namespace shm
}  // namespace ctr
