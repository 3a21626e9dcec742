// The UCX communicator: asynchronous collectives on host memory over UCP tag messages.
//
// Shape. One ucp_context and one ucp_worker per process, an endpoint to every
// peer, and one progress thread that owns the worker. A collective is compiled,
// on the issuing thread, into a list of small operations (tagged send, tagged
// receive, local copy or reduction) with dependencies between them; the progress
// thread posts each operation once its dependencies are done and advances the
// list as UCP completes requests. Issuing therefore returns at once, every
// collective of every communicator progresses concurrently, and the caller only
// blocks in wait(). Keeping UCP calls on that one thread means the worker needs
// no locks (thread mode serialized): other threads only hand work over through a
// mutex-protected queue and an eventfd.
//
// Algorithms. all_gather and the two halves of all_reduce are rings; data is cut
// into segments so that a ring step forwards segment k while segment k + 1 is
// still arriving. reduce_scatter reduces each block along the ring in a fixed
// order, and all_reduce is reduce_scatter followed by all_gather of the reduced
// blocks, so every rank receives the owner's bits: results are deterministic and
// bitwise identical on all ranks. all_to_all_v posts every pairwise exchange at
// once, broadcast is a segmented chain from the root, barrier is the
// dissemination algorithm (log2 n rounds).
//
// Tags. UCP matches a receive by tag only, so a tag names the communicator (24
// bits), the collective's sequence number on it (24 bits) and the sender's
// index (16 bits); point-to-point messages set the sequence's top bit and count
// per direction and pair of members. Between two endpoints UCP delivers messages with the same tag
// in order, and the progress thread posts the sends to a peer, and the receives
// from a peer, in list order, so the k-th message of a collective on a channel
// always lands in the k-th receive. Communicator ids are agreed by the members
// when splitting (the largest of their next free ids), so two communicators that
// share a member never share an id.
//
// Failure. Endpoints use UCP_ERR_HANDLING_MODE_PEER; the error callback marks
// the peer failed. Peers on the same host are also watched through pidfds,
// because UCP's keepalive over shared memory checks a pid, which an exited but
// unreaped process still has. A collective of a group with a failed member
// fails with CTR_STATUS_COMM_ERROR naming it: at once when a receive from it
// fails, otherwise unless it completes within a short grace (the member may
// have done its part before it went). wait() has a deadline; on timeout the
// collective fails with a message naming the peer it still waits for. A failed
// collective's requests are cancelled; one that cannot be (a send the peer
// never takes) gets a short grace and then its endpoint is closed by force, so
// that no UCP operation touches the caller's buffers once wait() has returned.
// destroy() ends with a barrier, so that no rank closes its endpoints while
// another still receives from it.
//
// Transport. UCX_TLS defaults to self,sm,tcp, with TCP kept on loopback when
// all ranks share one host; every default yields to the user's UCX_* variables.
// In UCX 1.13 an endpoint with peer error handling and wakeup cannot use CMA
// (single-copy) for large messages, so those go through the shared-memory FIFO
// in two copies; that is the price of failure detection.
//
// Shared memory. A communicator whose members all run on this host, in one
// network namespace (members publish boot id, hostname, namespace and pid at
// init), gets a shared-memory engine when it is created (lib/comm/shm.cc; two
// all-gathers over UCX set it up), and its collectives bypass the operation
// lists: one copy into a segment every member maps, then copies and reductions
// straight out of it: below 1 MiB usually on the thread that waits for the
// collective (Transport::wait has the engine run it there), else on the
// engine's own thread. It fails like the UCX path (a dead peer through the
// pidfd watch, a timeout naming the peer waited for) and leaves a peer it timed
// out on to be closed by force in destroy().
// CTR_SHM=0 keeps every communicator on UCX; groups that span hosts or network
// namespaces always use it. The flight recorder lists both kinds alike.

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/auth.h"
#include "comm/comm.h"
#include "comm/reduce.h"
#include "comm/shm.h"
#include "core/status.h"
#include "core/thread_pool.h"

namespace ctr {
namespace {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

constexpr uint32_t kCommIdBits = 24;
constexpr uint32_t kSeqMask = (1u << 24) - 1;
// The top bit of the sequence field marks a point-to-point message; its other
// 23 bits count the messages of one direction between two members, so sends
// and receives never take a collective's sequence number and need no order
// shared with the rest of the group. Collectives count in the lower 23 bits.
constexpr uint32_t kP2pSeqBit = 1u << 23;
constexpr uint32_t kCollSeqMask = kP2pSeqBit - 1;
constexpr uint32_t kMaxMembers = 1u << 16;
// Reserved communicator ids: split agreement and the final barrier of destroy().
constexpr uint32_t kSplitCommId = (1u << kCommIdBits) - 1;
constexpr uint32_t kTeardownCommId = kSplitCommId - 1;

// Ring and chain messages are cut into segments of this size, so that a rank
// reduces or forwards segment k while segment k + 1 is still arriving. Between
// 256 KiB and 2 MiB the bandwidth of two local ranks hardly changes (measured
// with tools/bench/bench_comm.py); smaller costs per-message overhead, larger
// loses the overlap.
constexpr size_t kSegmentBytes = size_t{512} << 10;
// After a collective fails, how long its sends may still wait for a peer
// before that peer's endpoint is closed by force.
constexpr int64_t kFailGraceMs = 1000;
// How long destroy() waits for endpoints to flush and close.
constexpr int64_t kCloseTimeoutMs = 3000;
// The progress thread sleeps on the worker's event fd at most this long, so
// that UCP's keepalive (which runs inside ucp_worker_progress) still checks
// peers on an idle worker.
constexpr int kIdlePollMs = 100;
// How often a busy progress thread looks at the local peers' pidfds (an idle
// one watches them in its poll()).
constexpr int64_t kWatchIntervalMs = 10;
// While collectives are in flight the progress thread keeps polling this long
// after the last event before it sleeps: the next message usually follows
// within microseconds, and a sleep plus wakeup costs more than that.
constexpr int64_t kSpinUs = 50;
// Longer timeouts mean "forever"; capped so that now + timeout cannot overflow.
constexpr int64_t kMaxTimeoutMs = int64_t{1} << 40;

std::string seconds(int64_t ms) { return strformat("%.1f s", static_cast<double>(ms) / 1000.0); }

// ------------------------------------------------------------------------------------------
// Groups, operations, collectives

// An ordered set of world ranks with an id agreed by its members.
struct Group {
  std::vector<int> members;  // global ranks, in group order
  int me = 0;                // this process's index
  uint32_t id = 0;
  std::string name;  // "world" or "group {0, 2}"
  int size() const { return static_cast<int>(members.size()); }
};

std::string group_name(const std::vector<int> &members) {
  std::string s = "group {";
  constexpr size_t kShown = 8;
  for (size_t i = 0; i < members.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += std::to_string(members[i]);
  }
  if (members.size() > kShown) s += ", ...";
  return s + "}";
}

struct Coll;
class Transport;

// Staging buffers for reductions, kept between collectives: a fresh buffer of
// many megabytes costs a page fault per page on first touch, which at these
// sizes takes longer than the transfer. Shared by the communicators of one
// transport; holds at most kPoolBytes while idle.
class ScratchPool {
 public:
  struct Buf {
    std::unique_ptr<char[]> p;
    size_t size = 0;
  };
  Buf take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->size >= bytes && (best == free_.end() || it->size < best->size)) best = it;
      if (best != free_.end()) {
        Buf b = std::move(*best);
        free_.erase(best);
        held_ -= b.size;
        return b;
      }
    }
    Buf b;
    b.size = std::max<size_t>(bytes, 1);
    b.p.reset(new char[b.size]);
    return b;
  }
  void give(Buf b) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ += b.size;
    free_.push_back(std::move(b));
    // Drop the smallest first: the large ones are the expensive ones to fault in.
    while (held_ > kPoolBytes && !free_.empty()) {
      auto it = std::min_element(free_.begin(), free_.end(),
                                 [](const Buf &x, const Buf &y) { return x.size < y.size; });
      held_ -= it->size;
      free_.erase(it);
    }
  }

 private:
  static constexpr size_t kPoolBytes = size_t{256} << 20;
  std::mutex mu_;
  std::vector<Buf> free_;
  size_t held_ = 0;
};

struct Op {
  enum Kind : uint8_t { kSend, kRecv, kCopy, kReduce };
  enum State : uint8_t { kWaiting, kPosted, kDone, kSkipped };
  Kind kind;
  State state = kWaiting;
  int peer = -1;               // group index (send, recv)
  int dep[2] = {-1, -1};       // operations that must be done first
  void *dst = nullptr;         // recv buffer, copy/reduce destination
  const void *src = nullptr;   // send buffer, copy source, reduce's first operand
  const void *src2 = nullptr;  // reduce's second operand
  size_t bytes = 0;            // send/recv/copy bytes; reduce element count
  int64_t divisor = 0;         // reduce: divide the result (Avg on the last step)
  void *req = nullptr;         // UCP request while posted
  Coll *coll = nullptr;
};

// One collective in flight. Shared by the waiting thread and the progress
// thread, each holding one reference.
struct Coll {
  std::atomic<int> refs{2};
  Transport *t = nullptr;
  const char *what = "";
  std::shared_ptr<const Group> group;
  uint64_t tag = 0;  // communicator id and sequence number; the sender's index is or-ed in
  ctr_dtype dtype = CTR_DTYPE_F32;
  ReduceOp op = ReduceOp::Sum;
  std::vector<Op> ops;
  std::shared_ptr<ScratchPool> pool;
  ScratchPool::Buf scratch;
  bool network = false;     // has sends or receives
  bool global_src = false;  // tags carry world ranks, not group indices (split agreement)
  bool tolerant = false;    // operations with failed peers are skipped, not fatal (destroy)
  uint64_t flight_id = 0;   // its entry in the flight recorder (issue order, from 1)
  // Run by the communicator's shared-memory engine instead of the operation list.
  std::shared_ptr<ShmColl> shm;
  ShmComm *shm_comm = nullptr;
  size_t shm_bytes = 0;  // what this rank sends through shared memory (flight recorder)
  const char *path = "ucx";  // the flight recorder's "path"
  int p2p_peer = -1;  // a send or recv: the one member it involves (group index)

  // Progress thread only.
  size_t scan_from = 0;     // first operation that may still be waiting
  size_t first_undone = 0;  // every operation before it is done
  int n_posted = 0;
  bool failing = false;
  bool dirty = false;
  int lost = -1;  // a member found failed while this was in flight (world rank)
  TimePoint lost_at{};
  bool retired = false;  // finished; the progress thread lets go at the end of its pass
  // Retired with transfers UCP still holds (their peer's process exited
  // mid-transfer): the progress thread keeps its reference until the worker
  // is destroyed.
  bool orphaned = false;
  ctr_status pending_code = CTR_STATUS_OK;  // a failure seen in a UCP callback, acted on later
  std::string pending_error;
  TimePoint fail_at{};
  std::vector<uint8_t> blocked;  // advance(): channels that must keep their order, by peer
  std::vector<size_t> touched;   // advance(): which of them are set

  // The outcome, published under mu.
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  ctr_status code = CTR_STATUS_OK;
  std::string error;

  std::string label() const {
    if (p2p_peer >= 0)
      return strformat("%s %s rank %d (%s, %d ranks)", what, ops[0].kind == Op::kSend ? "to" : "from",
                       group->members[p2p_peer], group->name.c_str(), group->size());
    return strformat("%s (%s, %d ranks)", what, group->name.c_str(), group->size());
  }
  // Whether a failure of global rank g concerns this collective.
  bool involves(int g) const {
    if (p2p_peer >= 0) return group->members[p2p_peer] == g;
    return std::find(group->members.begin(), group->members.end(), g) != group->members.end();
  }
  ~Coll() {
    if (scratch.p) pool->give(std::move(scratch));
  }
};

void release(Coll *c) {
  if (c->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete c;
}

CommWork *to_handle(Coll *c) { return reinterpret_cast<CommWork *>(c); }
Coll *from_handle(CommWork *w) { return reinterpret_cast<Coll *>(w); }

// Builds a collective's operation list.
class Builder {
 public:
  explicit Builder(Coll &c) : c_(c) {}
  int send(int peer, const void *buf, size_t bytes, int dep0 = -1, int dep1 = -1) {
    Op op{Op::kSend};
    op.peer = peer;
    op.src = buf;
    op.bytes = bytes;
    c_.network = true;
    return add(op, dep0, dep1);
  }
  int recv(int peer, void *buf, size_t bytes, int dep0 = -1, int dep1 = -1) {
    Op op{Op::kRecv};
    op.peer = peer;
    op.dst = buf;
    op.bytes = bytes;
    c_.network = true;
    return add(op, dep0, dep1);
  }
  int copy(void *dst, const void *src, size_t bytes, int dep0 = -1) {
    Op op{Op::kCopy};
    op.dst = dst;
    op.src = src;
    op.bytes = bytes;
    return add(op, dep0, -1);
  }
  int reduce(void *dst, const void *a, const void *b, size_t count, int64_t divisor, int dep0) {
    Op op{Op::kReduce};
    op.dst = dst;
    op.src = a;
    op.src2 = b;
    op.bytes = count;
    op.divisor = divisor;
    return add(op, dep0, -1);
  }

 private:
  int add(Op op, int dep0, int dep1) {
    op.coll = &c_;
    op.dep[0] = dep0;
    op.dep[1] = dep1;
    c_.ops.push_back(op);
    return static_cast<int>(c_.ops.size() - 1);
  }
  Coll &c_;
};

size_t n_segments(size_t bytes) {
  return bytes == 0 ? 1 : (bytes + kSegmentBytes - 1) / kSegmentBytes;
}
size_t segment_len(size_t bytes, size_t k) {
  size_t start = k * kSegmentBytes;
  return start >= bytes ? 0 : std::min(kSegmentBytes, bytes - start);
}

// Operations indexed by [block][segment], or by [segment].
using OpTable = std::vector<std::vector<int>>;

// Ring all-gather in place on out: block i is out[off[i], off[i] + len[i]).
// This rank's block is sent first from own (which may be out + off[me]) and
// copied into place unless it is already there. When the gather follows a
// reduce-scatter, own_ready[k] is the operation that finished segment k of this
// rank's block and block_free[j][k] the last one to read segment k of block j
// of the input (which the gather overwrites when the reduction ran in place).
void build_ring_all_gather(Builder &b, const Group &g, char *out, const std::vector<size_t> &off,
                           const std::vector<size_t> &len, const char *own,
                           const std::vector<int> *own_ready = nullptr,
                           const OpTable *block_free = nullptr) {
  const int n = g.size(), r = g.me;
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  if (own != out + off[r] && len[r] > 0) b.copy(out + off[r], own, len[r]);
  if (n == 1) return;
  // Receives land in distinct places, so all are posted at once, in step order.
  OpTable recvd(n - 1);
  for (int s = 0; s < n - 1; ++s) {
    int blk = (r - s - 1 + 2 * n) % n;
    for (size_t k = 0; k < n_segments(len[blk]); ++k)
      recvd[s].push_back(b.recv(left, out + off[blk] + k * kSegmentBytes, segment_len(len[blk], k),
                                block_free ? (*block_free)[blk][k] : -1));
  }
  for (int s = 0; s < n - 1; ++s) {
    int blk = (r - s + n) % n;
    const char *base = s == 0 ? own : out + off[blk];
    for (size_t k = 0; k < n_segments(len[blk]); ++k) {
      int dep = s > 0 ? recvd[s - 1][k] : -1;
      if (s == 0 && own_ready) dep = (*own_ready)[k];
      b.send(right, base + k * kSegmentBytes, segment_len(len[blk], k), dep);
    }
  }
}

// Ring reduce-scatter: block i of send is elements [off[i], off[i] + cnt[i]);
// this rank's reduced block goes to out. Block j is reduced along the ring
// starting at rank j + 1 and ending at j, always in that order. Fills done[k],
// the operation completing segment k of out, and readers[j][k], the one that
// reads segment k of send's block j (each is read exactly once).
// Scratch a ring reduce-scatter over blocks of cnt elements needs (two staging
// buffers of the largest block).
size_t reduce_scatter_scratch(const Group &g, const std::vector<size_t> &cnt, size_t esz) {
  if (g.size() == 1) return 0;
  size_t max_bytes = 0;
  for (size_t c : cnt) max_bytes = std::max(max_bytes, c * esz);
  return 2 * max_bytes;
}

void build_ring_reduce_scatter(Builder &b, Coll &c, const Group &g, const char *send, char *out,
                               const std::vector<size_t> &off, const std::vector<size_t> &cnt,
                               size_t esz, int64_t divisor, std::vector<int> *done = nullptr,
                               OpTable *readers = nullptr, char *scratch = nullptr) {
  const int n = g.size(), r = g.me;
  if (n == 1) {
    // One member: the reduction of one block is the block (Avg divides by 1).
    if (send + off[0] * esz != out) b.copy(out, send + off[0] * esz, cnt[0] * esz);
    return;
  }
  const int left = (r - 1 + n) % n, right = (r + 1) % n;
  size_t max_bytes = 0;
  for (int i = 0; i < n; ++i) max_bytes = std::max(max_bytes, cnt[i] * esz);
  // Two staging buffers: step s receives into tmp[s % 2] while step s's send
  // still reads the partial sum of step s - 1 from the other. A batch hands in
  // its slice of the collective's scratch.
  if (!scratch) {
    c.scratch = c.pool->take(2 * max_bytes);
    scratch = c.scratch.p.get();
  }
  char *tmp[2] = {scratch, scratch + max_bytes};
  if (readers) readers->assign(n, {});
  std::vector<int> prev_send, prev_reduce;
  for (int s = 0; s < n - 1; ++s) {
    const int sb = (r - s - 1 + 2 * n) % n;  // block sent at step s
    const int rb = (r - s - 2 + 2 * n) % n;  // block received (and reduced) at step s
    const size_t sbytes = cnt[sb] * esz, rbytes = cnt[rb] * esz;
    std::vector<int> sends, reduces;
    for (size_t k = 0; k < n_segments(sbytes); ++k) {
      const char *src = s == 0 ? send + off[sb] * esz : tmp[(s - 1) % 2];
      sends.push_back(b.send(right, src + k * kSegmentBytes, segment_len(sbytes, k),
                             s == 0 ? -1 : prev_reduce[k]));
      if (s == 0 && readers) (*readers)[sb].push_back(sends.back());
    }
    const bool last = s == n - 2;
    for (size_t k = 0; k < n_segments(rbytes); ++k) {
      char *buf = tmp[s % 2] + k * kSegmentBytes;
      size_t len = segment_len(rbytes, k);
      // The same bytes of this buffer were last sent at step s - 1.
      int dep = (s >= 2 && k < prev_send.size()) ? prev_send[k] : -1;
      int rv = b.recv(left, buf, len, dep);
      char *dst = last ? out + k * kSegmentBytes : buf;
      reduces.push_back(b.reduce(dst, buf, send + off[rb] * esz + k * kSegmentBytes, len / esz,
                                 last ? divisor : 0, rv));
      if (readers) (*readers)[rb].push_back(reduces.back());
    }
    if (last && done) *done = reduces;
    prev_send = std::move(sends);
    prev_reduce = std::move(reduces);
  }
}

// Splits count elements into n nearly equal blocks (the first count % n get one more).
void partition(size_t count, int n, std::vector<size_t> *off, std::vector<size_t> *cnt) {
  off->resize(n);
  cnt->resize(n);
  size_t base = count / n, extra = count % n, at = 0;
  for (int i = 0; i < n; ++i) {
    (*off)[i] = at;
    (*cnt)[i] = base + (static_cast<size_t>(i) < extra ? 1 : 0);
    at += (*cnt)[i];
  }
}

// Dissemination barrier: in round i each rank signals rank + 2^i and waits for
// rank - 2^i; after ceil(log2 n) rounds every rank has heard from every other.
// With announce_only a rank sends all its signals at once and waits for none:
// it lets the others pass without being held up itself.
void build_barrier(Builder &b, const Group &g, bool announce_only = false) {
  const int n = g.size(), r = g.me;
  int prev = -1;
  for (int d = 1; d < n; d *= 2) {
    b.send((r + d) % n, nullptr, 0, prev);
    if (!announce_only) prev = b.recv((r - d + n) % n, nullptr, 0);
  }
}

// ------------------------------------------------------------------------------------------
// Transport: context, worker, endpoints and the progress thread

struct Peer {
  ucp_ep_h ep = nullptr;
  ucs_status_t failed = UCS_OK;  // set once: error callback, process exit, forced close
  std::string why;
  Transport *t = nullptr;
  int rank = -1;
  int pidfd = -1;  // a peer on this host: readable once its process has exited
  bool exited = false;  // its pidfd said so: nothing more can come from it
  bool silent = false;  // a collective timed out waiting for it (stopped or hung)
};

class Transport {
 public:
  Transport(int rank, int world, int64_t timeout_ms)
      : rank_(rank), world_(world), timeout_ms_(timeout_ms), peers_(world),
        same_node_(world, 0), down_(world), shm_silent_(world, 0) {}
  ~Transport() { shutdown(); }

  int rank() const { return rank_; }
  int world() const { return world_; }
  int64_t timeout_ms() const { return timeout_ms_; }
  std::mutex &split_mu() { return split_mu_; }
  const std::shared_ptr<ScratchPool> &pool() const { return pool_; }
  uint32_t &next_comm_id() { return next_comm_id_; }

  void init(Store &store);

  // Hands a built collective to the progress thread (or runs it here if it
  // needs no peer) and returns its handle.
  CommWork *issue(Coll *c);
  void wait(Coll *c, int64_t timeout_ms);
  // Hands a collective to a communicator's shared-memory engine.
  CommWork *issue_shm(Coll *c);

  // Whether world rank r runs on this host, in this network namespace: a
  // group of such ranks may use a shared-memory segment.
  bool same_node(int r) const { return same_node_[r]; }
  // Why world rank r failed ("" while it is not known to have). Thread-safe.
  std::string peer_down(int r);
  // A shared-memory collective failed, with the world rank that stopped
  // answering, or -1: destroy() then treats it as the UCX path would.
  void shm_failed(int silent_rank);

 private:
  void shutdown();
  void run();
  void loop();
  void start(Coll *c);
  bool advance(Coll *c);
  void post(Coll *c, Op &op);
  void complete(Op &op, ucs_status_t st, size_t recv_len);
  void timed_out(Coll *c, int64_t timeout_ms);
  void fail(Coll *c, ctr_status code, const std::string &msg);
  void finish(Coll *c);
  void handle_failed_peers();
  void member_lost(Coll *c, int g);
  void watch_peers(int timeout_ms);
  void enforce_deadlines(TimePoint now);
  void mark_dirty(Coll *c) {
    if (!c->dirty && !c->retired) {
      c->dirty = true;
      dirty_.push_back(c);
    }
  }
  void peer_failed(int rank, ucs_status_t st, const std::string &why);
  void close_ep(int rank, bool force);
  void wake();
  std::string peer_reason(int rank) const {
    return strformat("rank %d failed: %s", rank, peers_[rank].why.c_str());
  }

  static void on_send(void *req, ucs_status_t st, void *user);
  static void on_recv(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user);
  static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st);

  const int rank_, world_;
  const int64_t timeout_ms_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  std::vector<Peer> peers_;
  std::thread thread_;

  std::mutex split_mu_;
  uint32_t next_comm_id_ = 1;  // 0 is the world
  std::shared_ptr<ScratchPool> pool_ = std::make_shared<ScratchPool>();

  // Handed from other threads to the progress thread.
  std::mutex mu_;
  std::vector<Coll *> incoming_;
  std::vector<std::pair<Coll *, int64_t>> abandoned_;  // timed out in wait(), with the timeout
  bool stop_ = false;
  bool broken_ = false;  // the progress thread died
  std::atomic<bool> any_failure_{false};
  std::atomic<bool> any_silent_{false};  // some peer stopped answering
  std::vector<char> same_node_;
  // Failed peers, for other threads: the shared-memory engines poll it.
  std::mutex down_mu_;
  std::vector<std::string> down_;   // by world rank: why it failed
  std::vector<char> shm_silent_;    // by world rank: a shared-memory collective timed out on it
  std::atomic<bool> any_down_{false};
  void mark_down(int rank, const std::string &why) {
    std::lock_guard<std::mutex> lock(down_mu_);
    if (down_[rank].empty()) down_[rank] = why;
    any_down_ = true;
  }

 public:
  // The flight recorder: the last kFlightEntries collectives this process
  // issued, kept whatever their outcome, for the forensics of a failure.
  struct FlightEntry {
    uint64_t id = 0;
    std::string comm, what;
    uint32_t seq = 0;
    size_t bytes = 0;
    const char *path = "ucx";  // how it moves: "ucx", "shm" or "shm direct"
    TimePoint issued{}, done{};
    int state = 0;  // 0 in flight, 1 done, 2 failed
  };
  static constexpr size_t kFlightEntries = 256;
  void flight_issue(Coll *c);
  void flight_end(const Coll *c, bool ok);
  std::string flight_json();

 private:
  std::mutex flight_mu_;
  std::vector<FlightEntry> flight_ = std::vector<FlightEntry>(kFlightEntries);
  uint64_t flight_next_ = 1;
  TimePoint flight_epoch_ = Clock::now();

  // Progress thread only.
  std::vector<Coll *> active_;
  std::vector<Coll *> dirty_;
  std::vector<Coll *> retired_;
  std::vector<Coll *> orphans_;  // retired with requests UCP still holds; freed after the worker
  std::vector<int> newly_failed_;
  std::vector<void *> closing_;  // ep close requests of forced closes
};

// Configuration defaults: on one machine TCP stays on loopback; shared memory
// with error handling; keepalive often enough to notice a dead peer within a
// typical timeout. Every default yields to the user's own UCX_* variable.
void configure(ucp_config_t *cfg, bool single_host) {
  auto def = [cfg](const char *name, const char *value) {
    std::string env = std::string("UCX_") + name;
    if (!std::getenv(env.c_str())) ucp_config_modify(cfg, name, value);
  };
  def("TLS", "self,sm,tcp");
  // Shared-memory transports support UCP_ERR_HANDLING_MODE_PEER only when asked;
  // without it UCP would move every local message over TCP. (Only when they may
  // be used: UCX warns about settings no transport takes.)
  const char *tls = std::getenv("UCX_TLS");
  const bool shm = !tls || std::strstr(tls, "all") || std::strstr(tls, "sm") ||
                   std::strstr(tls, "mm") || std::strstr(tls, "posix") || std::strstr(tls, "sysv");
  if (shm && !std::getenv("UCX_POSIX_ERROR_HANDLING") && !std::getenv("UCX_SYSV_ERROR_HANDLING"))
    ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y");
  def("KEEPALIVE_INTERVAL", "1s");
  if (single_host) def("NET_DEVICES", "lo");
}

// This host's identity: the kernel's boot id tells two machines (or VMs) with
// the same hostname apart; the hostname tells containers sharing a kernel apart.
std::string host_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string id = host;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (f >> boot) id += "/" + boot;
  return id;
}

// This process's network namespace ("net:[4026531840]"), or "". Ranks in
// different namespaces of one kernel stand for different hosts (the tests and
// benchmarks that emulate a slow link between hosts do that), so they do not
// share memory segments.
std::string net_namespace() {
  char buf[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/net", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// A process's start time in clock ticks since boot (field 22 of /proc/PID/stat),
// or 0. With the pid it names one process, even after the pid is reused.
unsigned long long process_start(long pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  size_t p = stat.rfind(')');  // the command name may contain spaces and parentheses
  if (p == std::string::npos) return 0;
  std::vector<std::string> fields;
  std::string cur;
  for (size_t i = p + 2; i < stat.size(); ++i) {
    if (stat[i] == ' ') {
      fields.push_back(cur);
      cur.clear();
    } else {
      cur += stat[i];
    }
  }
  // fields[0] is field 3 (state); the start time is field 22.
  return fields.size() > 19 ? std::strtoull(fields[19].c_str(), nullptr, 10) : 0;
}

// Opens a descriptor that becomes readable when the process exits (as a
// zombie already, before anyone reaps it), or returns -1.
int watch_process(long pid, unsigned long long start) {
#ifdef SYS_pidfd_open
  if (start == 0 || process_start(pid) != start) return -1;  // not the peer: another pid namespace
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  // Checked again after opening: the peer may have exited and its pid been reused.
  if (fd >= 0 && process_start(pid) != start) {
    ::close(fd);
    return -1;
  }
  return fd;
#else
  (void)pid;
  (void)start;
  return -1;
#endif
}

std::string ucs_text(ucs_status_t st) { return ucs_status_string(st); }

// Published worker addresses: the UCX library version, then the address.
constexpr size_t kMaxAddressBytes = 64 * 1024;
constexpr size_t kAddressPadding = 4096;

std::string address_label(const std::string &ns, int rank) {
  return strformat("%saddress of rank %d", ns.c_str(), rank);
}

uint32_t ucx_version() {
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major << 24 | minor << 16 | (release & 0xffff);
}

std::string version_text(uint32_t v) {
  return strformat("%u.%u.%u", v >> 24, (v >> 16) & 0xff, v & 0xffff);
}

std::string pack_address(const std::string &addr) {
  const uint32_t v = ucx_version();
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  return out + addr;
}

// A peer's packed address is usable by this rank's UCX: the same library
// version, a sane size, and the same address format (the version in the low
// bits of the first byte, which UCX asserts on).
bool check_address(const std::string &packed, const std::string &own, std::string *why) {
  if (packed.size() < 5 || packed.size() - 4 > kMaxAddressBytes) {
    *why = strformat("an address of %zu bytes", packed.size() < 4 ? 0 : packed.size() - 4);
    return false;
  }
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(packed[i])) << (8 * i);
  if (v != ucx_version()) {
    *why = strformat("it comes from UCX %s and this rank runs UCX %s: every rank needs the same "
                     "UCX version",
                     version_text(v).c_str(), version_text(ucx_version()).c_str());
    return false;
  }
  if (own.empty() || (packed[4] & 0x0f) != (own[0] & 0x0f)) {
    *why = "its address format differs from this rank's (UCX_ADDRESS_VERSION must be the same on "
           "every rank)";
    return false;
  }
  return true;
}

void Transport::init(Store &store) {
  if (world_ == 1) return;  // no peers: every collective is a local copy
  // Keys are namespaced by how many worlds this process created, so a second
  // communicator over the same store (all ranks create them in the same order)
  // does not read the first one's addresses.
  static std::atomic<int> generation{0};
  const std::string ns = strformat("ucx/%d/", generation.fetch_add(1));

  // Which peers share this host, and their processes. UCP's keepalive over
  // shared memory tells a dead peer only by its pid, which an exited but not
  // yet reaped process keeps, and not at all while a send to it is stuck; so
  // local peers are watched through pidfds as well (remote ones through UCP's
  // TCP or RDMA endpoints, which see a connection drop).
  // The network namespace goes last: it decides only whether a group may
  // share memory segments (same_node_).
  const std::string me = host_identity(), netns = net_namespace();
  const long pid = ::getpid();
  store.set(ns + "host/" + std::to_string(rank_),
            strformat("%s\n%ld\n%llu\n%s", me.c_str(), pid, process_start(pid), netns.c_str()));
  bool single_host = true;
  for (int i = 0; i < world_; ++i) {
    peers_[i].t = this;
    peers_[i].rank = i;
    if (i == rank_) continue;
    std::string rec = store.get(ns + "host/" + std::to_string(i));
    size_t a = rec.find('\n'), b = rec.find('\n', a == std::string::npos ? a : a + 1);
    if (a == std::string::npos || b == std::string::npos || rec.substr(0, a) != me) {
      single_host = false;
      continue;
    }
    size_t c = rec.find('\n', b + 1);
    same_node_[i] = !netns.empty() && c != std::string::npos && rec.substr(c + 1) == netns;
    peers_[i].pidfd = watch_process(std::strtol(rec.c_str() + a + 1, nullptr, 10),
                                    std::strtoull(rec.c_str() + b + 1, nullptr, 10));
  }

  if (!std::getenv("UCX_LOG_LEVEL")) ucs_global_opts_set_value("LOG_LEVEL", "error");
  ucp_config_t *cfg = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &cfg);
  CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR, "ucx: reading the UCX configuration: %s",
              ucs_text(st).c_str());
  configure(cfg, single_host);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = "libctr";
  st = ucp_init(&params, cfg, &context_);
  ucp_config_release(cfg);
  CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR, "ucx: ucp_init: %s", ucs_text(st).c_str());

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(context_, &wp, &worker_);
  CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR, "ucx: ucp_worker_create: %s",
              ucs_text(st).c_str());
  st = ucp_worker_get_efd(worker_, &worker_fd_);
  CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR, "ucx: ucp_worker_get_efd: %s",
              ucs_text(st).c_str());
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  CTR_REQUIRE(wake_fd_ >= 0, CTR_STATUS_COMM_ERROR, "ucx: eventfd: %s", std::strerror(errno));

  ucp_address_t *addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker_, &addr, &addr_len);
  CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR, "ucx: ucp_worker_get_address: %s",
              ucs_text(st).c_str());
  const std::string own(reinterpret_cast<const char *>(addr), addr_len);
  ucp_worker_release_address(worker_, addr);
  store.set(ns + "addr/" + std::to_string(rank_),
            seal_record(store.job_token(), address_label(ns, rank_), pack_address(own)));

  for (int i = 0; i < world_; ++i) {
    Peer &p = peers_[i];
    if (i == rank_) continue;
    // UCX parses an address without bounds and aborts or hangs on a forged one,
    // so nothing reaches it that is not sealed with the job's token by the rank
    // it claims to come from, of this UCX version and address format; and it is
    // read from a zero-padded copy.
    std::string remote;
    std::string why;
    std::string rec = store.get(ns + "addr/" + std::to_string(i));
    CTR_REQUIRE(open_record(store.job_token(), address_label(ns, i), rec, &remote, &why) &&
                    check_address(remote, own, &why),
                CTR_STATUS_COMM_ERROR, "ucx: refusing the transport address published as rank %d: %s",
                i, why.c_str());
    remote.erase(0, 4);
    remote.append(kAddressPadding, '\0');
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t *>(remote.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &Transport::on_ep_error;
    ep.err_handler.arg = &p;
    st = ucp_ep_create(worker_, &ep, &p.ep);
    CTR_REQUIRE(st == UCS_OK, CTR_STATUS_COMM_ERROR,
                "ucx: cannot create an endpoint to rank %d: %s (check UCX_TLS / UCX_NET_DEVICES)",
                i, ucs_text(st).c_str());
  }
  thread_ = std::thread([this] { run(); });
}

std::string Transport::peer_down(int r) {
  if (!any_down_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lock(down_mu_);
  return down_[r];
}

void Transport::shm_failed(int silent_rank) {
  any_failure_ = true;
  if (silent_rank < 0) return;
  {
    std::lock_guard<std::mutex> lock(down_mu_);
    shm_silent_[silent_rank] = 1;
  }
  any_silent_ = true;
}

void Transport::wake() {
  uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
}

void Transport::flight_issue(Coll *c) {
  std::lock_guard<std::mutex> lock(flight_mu_);
  c->flight_id = flight_next_++;
  FlightEntry &e = flight_[c->flight_id % kFlightEntries];
  e.id = c->flight_id;
  e.comm = c->group->name;
  const std::string &name = CollectiveName::current();
  e.what = name.empty() ? c->what : name + ": " + c->what;
  e.seq = static_cast<uint32_t>((c->tag >> 16) & 0xffffff);
  e.bytes = c->shm_bytes;
  e.path = c->path;
  for (const Op &op : c->ops)
    if (op.kind == Op::kSend) e.bytes += op.bytes;
  e.issued = Clock::now();
  e.done = TimePoint{};
  e.state = 0;
}

void Transport::flight_end(const Coll *c, bool ok) {
  std::lock_guard<std::mutex> lock(flight_mu_);
  FlightEntry &e = flight_[c->flight_id % kFlightEntries];
  if (e.id != c->flight_id || e.state != 0) return;  // overwritten by newer entries, or ended
  e.done = Clock::now();
  e.state = ok ? 1 : 2;
  e.path = c->path;
}

std::string Transport::flight_json() {
  std::lock_guard<std::mutex> lock(flight_mu_);
  auto ms = [this](TimePoint t) {
    return std::chrono::duration<double, std::milli>(t - flight_epoch_).count();
  };
  std::string out = "[";
  const uint64_t first = flight_next_ > kFlightEntries ? flight_next_ - kFlightEntries : 1;
  for (uint64_t id = first; id < flight_next_; ++id) {
    const FlightEntry &e = flight_[id % kFlightEntries];
    if (e.id != id) continue;
    std::string what;
    for (char ch : e.what) {
      if (ch == '"' || ch == '\\') what += '\\';
      if (static_cast<unsigned char>(ch) >= 0x20) what += ch;
    }
    out += strformat("%s{\"comm\":\"%s\",\"seq\":%u,\"what\":\"%s\",\"bytes\":%zu,"
                     "\"path\":\"%s\",\"issued_ms\":%.3f,\"done_ms\":%.3f,\"state\":\"%s\"}",
                     out.size() > 1 ? "," : "", e.comm.c_str(), e.seq, what.c_str(), e.bytes, e.path,
                     ms(e.issued), e.state == 0 ? -1.0 : ms(e.done),
                     e.state == 0 ? "in flight" : e.state == 1 ? "done" : "failed");
  }
  return out + "]";
}

CommWork *Transport::issue(Coll *c) {
  if (c->group->id != kTeardownCommId) flight_issue(c);
  if (!c->network) {
    // A group of one, or nothing to move: run it here, synchronously.
    for (Op &op : c->ops) {
      if (op.kind == Op::kCopy) std::memmove(op.dst, op.src, op.bytes);
      if (op.kind == Op::kReduce) {
        if (op.bytes) reduce(op.dst, op.src, op.src2, op.bytes, c->dtype, c->op, op.divisor);
      }
      op.state = Op::kDone;
    }
    c->finished = true;
    flight_end(c, true);
    release(c);  // the progress thread's reference
    return to_handle(c);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || broken_) {
      std::string what = c->what;
      delete c;
      ctr::fail(broken_ ? CTR_STATUS_INTERNAL : CTR_STATUS_INVALID_STATE,
                "ucx: " + what +
                    (broken_ ? " issued after the progress thread failed"
                             : " issued on a destroyed communicator"));
    }
    incoming_.push_back(c);
  }
  wake();
  return to_handle(c);
}

CommWork *Transport::issue_shm(Coll *c) {
  flight_issue(c);
  c->shm->done = [this, c](ctr_status code, const std::string &error) {
    {
      std::lock_guard<std::mutex> lock(c->mu);
      c->code = code;
      c->error = error;
      c->finished = true;
      c->path = c->shm->path;
      flight_end(c, code == CTR_STATUS_OK);
    }
    c->cv.notify_all();
    release(c);  // the engine's reference
  };
  c->shm_comm->issue(c->shm);
  return to_handle(c);
}

void Transport::wait(Coll *c, int64_t timeout_ms) {
  timeout_ms = std::min(timeout_ms < 0 ? timeout_ms_ : timeout_ms, kMaxTimeoutMs);
  std::unique_lock<std::mutex> lock(c->mu);
  if (c->shm && !c->finished) {
    // Usually run right here, on this thread, unless another already runs the
    // communicator's queue.
    lock.unlock();
    c->shm_comm->help(*c->shm, Clock::now() + std::chrono::milliseconds(timeout_ms), timeout_ms);
    lock.lock();
  }
  bool done =
      c->cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), [c] { return c->finished; });
  if (!done && c->shm) {
    // The engine fails it within a few milliseconds, naming the peer it waits for.
    c->shm->abandoned_ms.store(timeout_ms, std::memory_order_release);
    c->shm_comm->wake();
    done = c->cv.wait_for(lock, std::chrono::milliseconds(kFailGraceMs + 2000),
                          [c] { return c->finished; });
    if (!done) {
      std::string msg = strformat("%s: timed out after %s, and the engine could not be stopped",
                                  c->label().c_str(), seconds(timeout_ms).c_str());
      lock.unlock();
      release(c);
      ctr::fail(CTR_STATUS_TIMEOUT, msg);
    }
  }
  if (!done && !c->shm) {
    lock.unlock();
    {
      // The queue holds a reference: the collective may finish, and this
      // thread let go of it, before the progress thread gets to the entry.
      c->refs.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> g(mu_);
      abandoned_.emplace_back(c, timeout_ms);
    }
    wake();
    lock.lock();
    // The progress thread fails it now, cancels what it can and closes the
    // endpoints of what it cannot within kFailGraceMs.
    done = c->cv.wait_for(lock, std::chrono::milliseconds(kFailGraceMs + 2000),
                          [c] { return c->finished; });
    if (!done) {
      // The progress thread itself is stuck; the collective keeps its own
      // reference and buffers may still be touched. Report it rather than hang.
      std::string msg = strformat("%s: timed out after %s, and its transfers could not be stopped",
                                  c->label().c_str(), seconds(timeout_ms).c_str());
      lock.unlock();
      release(c);
      ctr::fail(CTR_STATUS_TIMEOUT, msg);
    }
  }
  ctr_status code = c->code;
  std::string msg = c->error;
  lock.unlock();
  release(c);
  if (code != CTR_STATUS_OK) ctr::fail(code, msg);
}

// ---- progress thread: UCP callbacks only record; the loop acts afterwards, so
// that nothing re-enters UCP from inside ucp_worker_progress.

void Transport::on_send(void *req, ucs_status_t st, void *user) {
  auto *op = static_cast<Op *>(user);
  op->req = nullptr;
  ucp_request_free(req);
  op->coll->t->complete(*op, st, op->bytes);
}

void Transport::on_recv(void *req, ucs_status_t st, const ucp_tag_recv_info_t *info, void *user) {
  auto *op = static_cast<Op *>(user);
  op->req = nullptr;
  ucp_request_free(req);
  op->coll->t->complete(*op, st, st == UCS_OK ? info->length : op->bytes);
}

void Transport::on_ep_error(void *arg, ucp_ep_h, ucs_status_t st) {
  auto *p = static_cast<Peer *>(arg);
  if (p->failed != UCS_OK) return;
  p->failed = st;
  p->why = ucs_text(st);
  p->t->newly_failed_.push_back(p->rank);
  p->t->mark_down(p->rank, p->why);
}

void Transport::complete(Op &op, ucs_status_t st, size_t recv_len) {
  Coll *c = op.coll;
  op.state = Op::kDone;
  --c->n_posted;
  if (!c->failing && !c->tolerant && c->pending_code == CTR_STATUS_OK) {
    const int g = c->group->members[op.peer];
    const bool is_send = op.kind == Op::kSend;
    if (st != UCS_OK && is_send && peers_[g].failed != UCS_OK) {
      // A send to a peer found failed meanwhile (its endpoint was closed): dropped.
    } else if (st != UCS_OK) {
      c->pending_code = CTR_STATUS_COMM_ERROR;
      c->pending_error =
          peers_[g].failed != UCS_OK
              ? c->label() + ": " + peer_reason(g)
              : strformat("%s: %s rank %d failed: %s", c->label().c_str(),
                          is_send ? "sending to" : "receiving from", g, ucs_text(st).c_str());
    } else if (!is_send && recv_len != op.bytes) {
      c->pending_code = CTR_STATUS_COMM_ERROR;
      c->pending_error = strformat(
          "%s: rank %d sent %zu bytes where %zu were expected (do all ranks issue the same "
          "collectives with the same sizes?)",
          c->label().c_str(), g, recv_len, op.bytes);
    }
  }
  mark_dirty(c);
}

// The progress thread. An exception here (out of memory) cannot reach any
// caller, so it ends the thread and every waiter gets the error instead.
void Transport::run() {
  apply_comm_nice();
  try {
    loop();
  } catch (const std::exception &e) {
    std::string msg = std::string("ucx: the progress thread failed: ") + e.what();
    std::vector<Coll *> all = active_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      all.insert(all.end(), incoming_.begin(), incoming_.end());
      incoming_.clear();
      broken_ = true;
    }
    for (Coll *c : all) {
      {
        std::lock_guard<std::mutex> lock(c->mu);
        if (c->code == CTR_STATUS_OK) {
          c->code = CTR_STATUS_INTERNAL;
          c->error = msg;
        }
        c->finished = true;
        flight_end(c, false);
      }
      c->cv.notify_all();
      // Not released: UCP may still hold requests that point into it.
    }
  }
}

void Transport::loop() {
  TimePoint last_event = Clock::now(), next_watch = last_event;
  for (;;) {
    std::vector<Coll *> in;
    std::vector<std::pair<Coll *, int64_t>> timeouts;
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      in.swap(incoming_);
      timeouts.swap(abandoned_);
      stopping = stop_;
    }
    bool worked = !in.empty() || !timeouts.empty();
    for (Coll *c : in) start(c);
    for (auto &[c, ms] : timeouts) {
      timed_out(c, ms);
      release(c);
    }
    while (ucp_worker_progress(worker_) != 0) worked = true;
    handle_failed_peers();
    while (!dirty_.empty()) {
      std::vector<Coll *> d;
      d.swap(dirty_);
      for (Coll *c : d) {
        c->dirty = false;
        if (!c->retired && advance(c)) worked = true;
      }
      handle_failed_peers();
    }
    TimePoint now = Clock::now();
    enforce_deadlines(now);
    for (Coll *c : retired_) {
      {
        std::lock_guard<std::mutex> lock(c->mu);
        c->finished = true;
        flight_end(c, c->code == CTR_STATUS_OK);
      }
      c->cv.notify_all();
      if (c->orphaned)
        orphans_.push_back(c);
      else
        release(c);
    }
    retired_.clear();
    if (stopping) {
      for (Coll *c : active_)
        if (!c->failing)
          fail(c, CTR_STATUS_INVALID_STATE,
               c->label() + ": the communicator was destroyed while it was in flight");
      if (active_.empty()) break;
    }

    if (now >= next_watch) {
      watch_peers(0);
      next_watch = now + std::chrono::milliseconds(kWatchIntervalMs);
    }
    if (worked) {
      last_event = now;
      continue;
    }
    // Unproductive passes yield the core: with more busy threads than cores
    // (ranks, their progress threads, compute) a spinning thread would
    // otherwise hold the core for a whole time slice while the peer that would
    // drain its FIFO waits for it.
    if (!active_.empty() && now - last_event < std::chrono::microseconds(kSpinUs)) {
      std::this_thread::yield();
      continue;
    }
    // Sleep until UCP has an event, another thread hands over work, or the
    // timer lets keepalive and failure deadlines run.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
      // UCP cannot sleep: a send waits for room at a peer, and only polling
      // notices when there is some.
      std::this_thread::yield();
      continue;
    }
    int timeout = kIdlePollMs;
    for (Coll *c : active_) {
      if (!c->failing && c->lost < 0) continue;
      TimePoint due =
          (c->failing ? c->fail_at : c->lost_at) + std::chrono::milliseconds(kFailGraceMs);
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(due - now).count();
      timeout = static_cast<int>(std::clamp<int64_t>(left + 1, 0, timeout));
    }
    watch_peers(timeout);
    last_event = Clock::now();
  }
}

// Waits up to timeout_ms for the worker's event fd, the wakeup eventfd or a
// local peer's pidfd; with timeout_ms 0 (a busy thread's periodic check) looks
// at the pidfds only, so that a wakeup for work queued meanwhile is not
// consumed. A peer whose process exited is failed.
void Transport::watch_peers(int timeout_ms) {
  std::vector<pollfd> fds;
  if (timeout_ms != 0) fds = {{worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  const size_t first = fds.size();
  std::vector<int> ranks;
  for (const Peer &p : peers_) {
    if (p.pidfd < 0) continue;
    fds.push_back({p.pidfd, POLLIN, 0});
    ranks.push_back(p.rank);
  }
  if (fds.empty() || ::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
  if (first && fds[1].revents) {
    uint64_t v;
    [[maybe_unused]] ssize_t n = ::read(wake_fd_, &v, sizeof v);
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!fds[first + i].revents) continue;
    Peer &p = peers_[ranks[i]];
    ::close(p.pidfd);
    p.pidfd = -1;
    if (p.failed != UCS_OK) continue;
    p.failed = UCS_ERR_CONNECTION_RESET;
    p.why = "its process exited";
    p.exited = true;
    newly_failed_.push_back(p.rank);
    mark_down(p.rank, p.why);
  }
}

void Transport::start(Coll *c) {
  active_.push_back(c);
  for (int g : c->group->members)
    if (peers_[g].failed != UCS_OK && c->involves(g)) member_lost(c, g);
  mark_dirty(c);
}

// A member of c's group has failed. c cannot complete if it still needs data
// that member has not sent, directly or through another member; but the
// member may have done its part before it went (a rank that finished a barrier
// and exited), and messages it sent may be waiting here. So c gets
// kFailGraceMs to complete, and then fails naming the member. A receive from
// it that fails outright fails c at once (complete()).
void Transport::member_lost(Coll *c, int g) {
  if (c->failing || c->tolerant || c->lost >= 0) return;
  c->lost = g;
  c->lost_at = Clock::now();
  mark_dirty(c);
}

// Posts and runs every operation whose turn has come; returns whether anything
// happened.
bool Transport::advance(Coll *c) {
  bool any = false;
  if (!c->failing && c->pending_code != CTR_STATUS_OK) fail(c, c->pending_code, c->pending_error);
  std::vector<Op> &ops = c->ops;
  const size_t n = c->group->members.size();
  while (!c->failing) {
    while (c->first_undone < ops.size() && ops[c->first_undone].state == Op::kDone)
      ++c->first_undone;
    if (c->first_undone == ops.size()) {
      finish(c);
      return true;
    }
    // Sends to one peer, and receives from one peer, are posted in list order:
    // once one of them must wait, the later ones on its channel wait too.
    if (c->blocked.size() != 2 * n) c->blocked.assign(2 * n, 0);
    std::vector<size_t> &touched = c->touched;
    bool again = false;
    size_t first_waiting = ops.size();
    for (size_t i = c->scan_from; i < ops.size() && !c->failing; ++i) {
      Op &op = ops[i];
      if (op.state != Op::kWaiting) continue;
      const bool net = op.kind == Op::kSend || op.kind == Op::kRecv;
      const size_t ch = net ? (op.kind == Op::kSend ? 0 : n) + op.peer : 0;
      bool ready = !(net && c->blocked[ch]);
      for (int d : op.dep) ready = ready && (d < 0 || ops[d].state == Op::kDone);
      if (!ready) {
        if (net && !c->blocked[ch]) {
          c->blocked[ch] = 1;
          touched.push_back(ch);
        }
        first_waiting = std::min(first_waiting, i);
        continue;
      }
      switch (op.kind) {
        case Op::kSend:
        case Op::kRecv:
          post(c, op);
          break;
        case Op::kCopy:
          std::memmove(op.dst, op.src, op.bytes);
          op.state = Op::kDone;
          break;
        case Op::kReduce:
          if (op.bytes) reduce(op.dst, op.src, op.src2, op.bytes, c->dtype, c->op, op.divisor);
          op.state = Op::kDone;
          break;
      }
      if (op.state == Op::kWaiting) first_waiting = std::min(first_waiting, i);
      again = any = true;
    }
    for (size_t ch : touched) c->blocked[ch] = 0;
    touched.clear();
    c->scan_from = first_waiting;
    if (!c->failing && c->pending_code != CTR_STATUS_OK) fail(c, c->pending_code, c->pending_error);
    if (!again) break;
  }
  if (c->failing && c->n_posted == 0) finish(c);
  return any;
}

void Transport::post(Coll *c, Op &op) {
  const int g = c->group->members[op.peer];
  Peer &p = peers_[g];
  if (op.kind == Op::kSend && (p.failed != UCS_OK || !p.ep)) {
    // This rank's result never depends on its sends, and a failed peer needs
    // nothing any more: drop it. Whether the collective can still complete
    // is decided by its receives and member_lost().
    op.state = Op::kDone;
    return;
  }
  // A zero-length message still needs a valid address.
  static char empty;
  ucp_request_param_t prm{};
  prm.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  prm.memory_type = UCS_MEMORY_TYPE_HOST;
  prm.user_data = &op;
  // Counted as posted before the call: a receive's callback can run inside it.
  op.state = Op::kPosted;
  ++c->n_posted;
  ucs_status_ptr_t r;
  if (op.kind == Op::kSend) {
    prm.cb.send = &Transport::on_send;
    const int me = c->global_src ? c->group->members[c->group->me] : c->group->me;
    r = ucp_tag_send_nbx(p.ep, op.bytes ? op.src : &empty, op.bytes,
                         c->tag | static_cast<uint64_t>(me), &prm);
  } else {
    // Receives always complete through the callback: UCX 1.13 does not fill
    // in recv_info when a receive completes in place, and the length must be
    // checked against what this rank expects.
    prm.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    prm.cb.recv = &Transport::on_recv;
    const int from = c->global_src ? g : op.peer;
    r = ucp_tag_recv_nbx(worker_, op.bytes ? op.dst : &empty, op.bytes,
                         c->tag | static_cast<uint64_t>(from), ~ucp_tag_t{0}, &prm);
  }
  if (UCS_PTR_IS_ERR(r)) {
    op.state = Op::kDone;
    --c->n_posted;
    fail(c, CTR_STATUS_COMM_ERROR,
         strformat("%s: %s rank %d failed: %s", c->label().c_str(),
                   op.kind == Op::kSend ? "sending to" : "receiving from", g,
                   ucs_text(UCS_PTR_STATUS(r)).c_str()));
    return;
  }
  if (r == nullptr) {
    complete(op, UCS_OK, op.bytes);  // a send done in place; no callback follows
    return;
  }
  // Unless the callback already ran (and freed the request), keep it for cancel.
  if (op.state == Op::kPosted) op.req = r;
}

void Transport::timed_out(Coll *c, int64_t timeout_ms) {
  if (c->retired || c->failing) return;  // finished meanwhile, or failed for its own reason
  // Name the peer whose message is missing; failing that, the one not taking ours.
  int owed = -1;
  for (int want : {static_cast<int>(Op::kRecv), static_cast<int>(Op::kSend)}) {
    for (const Op &op : c->ops) {
      if (op.kind == want && (op.state == Op::kPosted || op.state == Op::kWaiting)) {
        owed = c->group->members[op.peer];
        break;
      }
    }
    if (owed >= 0) break;
  }
  std::string msg =
      strformat("%s: timed out after %s", c->label().c_str(), seconds(timeout_ms).c_str());
  if (owed >= 0) {
    msg += strformat(" waiting for rank %d", owed);
    peers_[owed].silent = true;
    any_silent_ = true;
  }
  if (c->lost >= 0) msg += " (" + peer_reason(c->lost) + ")";
  fail(c, CTR_STATUS_TIMEOUT, msg);
}

void Transport::fail(Coll *c, ctr_status code, const std::string &msg) {
  if (c->failing) return;
  c->failing = true;
  c->fail_at = Clock::now();
  any_failure_ = true;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->code = code;
    c->error = msg;
  }
  for (Op &op : c->ops) {
    if (op.state == Op::kWaiting) op.state = Op::kSkipped;
  }
  // Cancelling completes unmatched receives (their callbacks may run right
  // here); sends cannot be cancelled and either finish or meet enforce_deadlines().
  for (Op &op : c->ops) {
    if (op.state == Op::kPosted && op.req && op.kind == Op::kRecv)
      ucp_request_cancel(worker_, op.req);
  }
  mark_dirty(c);
}

void Transport::finish(Coll *c) {
  c->retired = true;
  active_.erase(std::find(active_.begin(), active_.end(), c));
  retired_.push_back(c);
}

void Transport::handle_failed_peers() {
  while (!newly_failed_.empty()) {
    std::vector<int> failed;
    failed.swap(newly_failed_);
    for (int g : failed) {
      close_ep(g, true);
      for (Coll *c : active_) {
        if (c->involves(g)) member_lost(c, g);
      }
    }
  }
}

// Fails the collectives that lost a member and did not complete within the
// grace period. Then, for a failed collective whose sends are still pending
// after the grace period, closes those peers' endpoints by force, which
// completes the sends, so that the caller's buffers are free when wait()
// returns.
void Transport::enforce_deadlines(TimePoint now) {
  for (Coll *c : active_) {
    if (!c->failing && c->lost >= 0 && now >= c->lost_at + std::chrono::milliseconds(kFailGraceMs))
      fail(c, CTR_STATUS_COMM_ERROR, c->label() + ": " + peer_reason(c->lost));
  }
  for (Coll *c : active_) {
    if (!c->failing || c->n_posted == 0 ||
        now < c->fail_at + std::chrono::milliseconds(kFailGraceMs))
      continue;
    for (Op &op : c->ops) {
      if (op.state != Op::kPosted) continue;
      Peer &p = peers_[c->group->members[op.peer]];
      if (p.failed != UCS_OK) continue;
      p.failed = UCS_ERR_CANCELED;
      p.why = strformat("its endpoint was closed after %s failed", c->what);
      newly_failed_.push_back(p.rank);
    }
  }
  handle_failed_peers();
  // A transfer with a peer whose process exited in the middle of it (a receive
  // it had begun to send, a send to it) is neither completed nor cancelled by
  // UCP, even once the endpoint is closed by force. After the grace that
  // follows the failure and the forced closes, nothing more moves for it: the
  // collective is handed back to its waiter with its error, and the Coll is
  // kept until the worker is destroyed, since UCP still holds those requests.
  std::vector<Coll *> stuck;
  for (Coll *c : active_) {
    if (!c->failing || now < c->fail_at + std::chrono::milliseconds(2 * kFailGraceMs)) continue;
    bool any = false, only_dead = true;
    for (const Op &op : c->ops) {
      if (op.state != Op::kPosted) continue;
      any = true;
      if (!peers_[c->group->members[op.peer]].exited) only_dead = false;
    }
    if (any && only_dead) stuck.push_back(c);
  }
  for (Coll *c : stuck) {
    c->orphaned = true;
    finish(c);
  }
}

void Transport::close_ep(int rank, bool force) {
  Peer &p = peers_[rank];
  if (!p.ep) return;
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  prm.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &prm);
  p.ep = nullptr;
  if (UCS_PTR_IS_PTR(r)) closing_.push_back(r);
}

void Transport::shutdown() {
  if (thread_.joinable()) {
    // A last barrier, so that no rank closes its endpoints while another still
    // receives from it (the peer would see a failure). After a failure this
    // rank only announces that it leaves: the job is ending, a dead peer would
    // make it wait for nothing, and a live one that still enters the barrier
    // should not wait for this rank either.
    // A peer that stopped answering would not take even an announcement: skip
    // the barrier and close its endpoint by force, so that the error reaches the
    // caller without waiting on it again.
    if (!any_silent_) {
      const bool announce_only = any_failure_;
      auto g = std::make_shared<Group>();
      for (int i = 0; i < world_; ++i) g->members.push_back(i);
      g->me = rank_;
      g->id = kTeardownCommId;
      g->name = "world";
      Coll *c = new Coll;
      c->t = this;
      c->what = "destroy";
      c->group = g;
      c->tag = uint64_t{kTeardownCommId} << 40;
      c->tolerant = announce_only;
      Builder b(*c);
      build_barrier(b, *g, announce_only);
      try {
        wait(from_handle(issue(c)), announce_only ? kCloseTimeoutMs : timeout_ms_);
      } catch (const std::exception &) {
        // Best effort: the endpoints are closed either way.
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake();
    thread_.join();
  }
  if (worker_) {
    for (int i = 0; i < world_; ++i)
      close_ep(i, peers_[i].failed != UCS_OK || peers_[i].silent || shm_silent_[i]);
    TimePoint deadline = Clock::now() + std::chrono::milliseconds(kCloseTimeoutMs);
    while (!closing_.empty() && Clock::now() < deadline) {
      ucp_worker_progress(worker_);
      for (size_t i = 0; i < closing_.size();) {
        if (ucp_request_check_status(closing_[i]) != UCS_INPROGRESS) {
          ucp_request_free(closing_[i]);
          closing_[i] = closing_.back();
          closing_.pop_back();
        } else {
          ++i;
        }
      }
    }
    // Whatever did not close in time is released with the worker.
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }
  // UCP holds nothing of them any more.
  for (Coll *c : orphans_) release(c);
  orphans_.clear();
  for (Peer &p : peers_) {
    if (p.pidfd >= 0) ::close(p.pidfd);
    p.pidfd = -1;
  }
  if (context_) ucp_cleanup(context_);
  context_ = nullptr;
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
}

// ------------------------------------------------------------------------------------------
// The communicator table

struct CommCtx {
  std::shared_ptr<Transport> t;
  std::shared_ptr<const Group> g;
  std::atomic<uint32_t> seq{0};
  // Point-to-point messages sent to, and received from, each member so far.
  std::mutex p2p_mu;
  std::vector<uint32_t> sent, received;
  // Set when every member runs on this host: collectives go through a shared
  // segment. Declared last so that it stops before the transport can go.
  std::unique_ptr<ShmComm> shm;
};

CommCtx *ctx_of(void *ctx) { return static_cast<CommCtx *>(ctx); }

// A new operation on this communicator, not yet tagged.
std::unique_ptr<Coll> new_work(CommCtx *cc, const char *what) {
  auto c = std::make_unique<Coll>();
  c->t = cc->t.get();
  c->pool = cc->t->pool();
  c->what = what;
  c->group = cc->g;
  return c;
}

// A new collective on this communicator, with the next sequence number.
std::unique_ptr<Coll> new_coll(CommCtx *cc, const char *what) {
  auto c = new_work(cc, what);
  uint32_t s = cc->seq.fetch_add(1, std::memory_order_relaxed) & kCollSeqMask;
  c->tag = (uint64_t{cc->g->id} << 40) | (uint64_t{s} << 16);
  return c;
}

// Hands c to the communicator's shared-memory engine.
CommWork *issue_shm(CommCtx *cc, std::unique_ptr<Coll> c, std::shared_ptr<ShmColl> s) {
  s->label = c->label();
  c->shm_bytes = cc->shm->bytes_out(*s);
  c->path = "shm";
  c->shm = std::move(s);
  c->shm_comm = cc->shm.get();
  return cc->t->issue_shm(c.release());
}

CommWork *issue_shm_batch(CommCtx *cc, std::unique_ptr<Coll> c, std::vector<CollDesc> descs,
                          ctr_dtype dtype, ReduceOp op) {
  auto s = std::make_shared<ShmColl>();
  s->kind = ShmColl::kBatch;
  s->descs = std::move(descs);
  s->dtype = dtype;
  s->op = op;
  return issue_shm(cc, std::move(c), std::move(s));
}

void check_reduction(const char *what, ctr_dtype dt, ReduceOp op) {
  CTR_REQUIRE(dtype_bytes(dt) != 0, CTR_STATUS_UNSUPPORTED,
              "ucx: %s: dtype %d is not supported (F32, F64, I32, I64 and BF16 are)", what,
              static_cast<int>(dt));
  CTR_REQUIRE(static_cast<int>(op) <= static_cast<int>(ReduceOp::Min), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: %s: unknown reduce op %d", what, static_cast<int>(op));
}

int c_rank(void *ctx) { return ctx_of(ctx)->g->me; }
int c_size(void *ctx) { return ctx_of(ctx)->g->size(); }
int c_global_rank(void *ctx, int i) {
  const Group &g = *ctx_of(ctx)->g;
  CTR_REQUIRE(i >= 0 && i < g.size(), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: member %d is out of range for %s of %d ranks", i, g.name.c_str(), g.size());
  return g.members[i];
}

CommWork *c_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  CommCtx *cc = ctx_of(ctx);
  CTR_REQUIRE(bytes == 0 || (send && recv), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: all_gather: null buffer for %zu bytes", bytes);
  auto c = new_coll(cc, "all_gather");
  if (cc->shm) {
    CollDesc d{CollDesc::AllGather, send, recv, bytes};
    return issue_shm_batch(cc, std::move(c), {d}, CTR_DTYPE_F32, ReduceOp::Sum);
  }
  const Group &g = *cc->g;
  std::vector<size_t> off(g.size()), len(g.size(), bytes);
  for (int i = 0; i < g.size(); ++i) off[i] = i * bytes;
  Builder b(*c);
  build_ring_all_gather(b, g, static_cast<char *>(recv), off, len, static_cast<const char *>(send));
  return cc->t->issue(c.release());
}

CommWork *c_reduce_scatter(void *ctx, const void *send, void *recv, size_t count, ctr_dtype dtype,
                           ReduceOp op) {
  CommCtx *cc = ctx_of(ctx);
  check_reduction("reduce_scatter", dtype, op);
  CTR_REQUIRE(count == 0 || (send && recv), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: reduce_scatter: null buffer for %zu elements", count);
  auto c = new_coll(cc, "reduce_scatter");
  c->dtype = dtype;
  c->op = op;
  if (cc->shm) {
    CollDesc d{CollDesc::ReduceScatter, send, recv, count};
    return issue_shm_batch(cc, std::move(c), {d}, dtype, op);
  }
  const Group &g = *cc->g;
  std::vector<size_t> off(g.size()), cnt(g.size(), count);
  for (int i = 0; i < g.size(); ++i) off[i] = i * count;
  Builder b(*c);
  build_ring_reduce_scatter(b, *c, g, static_cast<const char *>(send), static_cast<char *>(recv),
                            off, cnt, dtype_bytes(dtype), op == ReduceOp::Avg ? g.size() : 0);
  return cc->t->issue(c.release());
}

CommWork *c_all_reduce(void *ctx, const void *send, void *recv, size_t count, ctr_dtype dtype,
                       ReduceOp op) {
  CommCtx *cc = ctx_of(ctx);
  check_reduction("all_reduce", dtype, op);
  CTR_REQUIRE(count == 0 || (send && recv), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: all_reduce: null buffer for %zu elements", count);
  auto c = new_coll(cc, "all_reduce");
  c->dtype = dtype;
  c->op = op;
  if (cc->shm) {
    CollDesc d{CollDesc::AllReduce, send, recv, count};
    return issue_shm_batch(cc, std::move(c), {d}, dtype, op);
  }
  const Group &g = *cc->g;
  const size_t esz = dtype_bytes(dtype);
  std::vector<size_t> off, cnt;
  partition(count, g.size(), &off, &cnt);
  char *out = static_cast<char *>(recv);
  Builder b(*c);
  std::vector<int> done;
  OpTable readers;
  build_ring_reduce_scatter(b, *c, g, static_cast<const char *>(send), out + off[g.me] * esz, off,
                            cnt, esz, op == ReduceOp::Avg ? g.size() : 0, &done, &readers);
  if (g.size() > 1) {
    // Each segment of this rank's result goes round as soon as it is reduced;
    // a gathered segment may land only once the reduction has read that part
    // of the input (send == recv is allowed).
    std::vector<size_t> boff(g.size()), blen(g.size());
    for (int i = 0; i < g.size(); ++i) boff[i] = off[i] * esz, blen[i] = cnt[i] * esz;
    build_ring_all_gather(b, g, out, boff, blen, out + boff[g.me], &done, &readers);
  }
  return cc->t->issue(c.release());
}

CommWork *c_batch(void *ctx, const CollDesc *d, size_t n, ctr_dtype dtype, ReduceOp op) {
  CommCtx *cc = ctx_of(ctx);
  CTR_REQUIRE(n == 0 || d, CTR_STATUS_INVALID_ARGUMENT, "ucx: batch: null list of %zu collectives", n);
  bool reduces = false;
  for (size_t i = 0; i < n; ++i) {
    CTR_REQUIRE(d[i].count == 0 || (d[i].send && d[i].recv), CTR_STATUS_INVALID_ARGUMENT,
                "ucx: batch: collective %zu has a null buffer", i);
    reduces |= d[i].kind != CollDesc::AllGather;
  }
  if (reduces) check_reduction("batch", dtype, op);
  auto c = new_coll(cc, "batch");
  c->dtype = dtype;
  c->op = op;
  if (cc->shm) return issue_shm_batch(cc, std::move(c), std::vector<CollDesc>(d, d + n), dtype, op);
  const Group &g = *cc->g;
  const size_t esz = dtype_bytes(dtype);
  const int64_t divisor = op == ReduceOp::Avg ? g.size() : 0;
  // Block layout of each entry, and one scratch for every reduction's staging.
  std::vector<std::vector<size_t>> offs(n), cnts(n);
  std::vector<size_t> scratch_at(n, 0);
  size_t scratch = 0;
  for (size_t i = 0; i < n; ++i) {
    if (d[i].kind == CollDesc::AllReduce) {
      partition(d[i].count, g.size(), &offs[i], &cnts[i]);
    } else {
      offs[i].resize(g.size());
      cnts[i].assign(g.size(), d[i].count);
      for (int m = 0; m < g.size(); ++m) offs[i][m] = m * d[i].count;
    }
    if (d[i].kind != CollDesc::AllGather) {
      scratch_at[i] = scratch;
      scratch += reduce_scatter_scratch(g, cnts[i], esz);
    }
  }
  if (scratch > 0) c->scratch = c->pool->take(scratch);
  Builder b(*c);
  for (size_t i = 0; i < n; ++i) {
    const char *send = static_cast<const char *>(d[i].send);
    char *recv = static_cast<char *>(d[i].recv);
    char *tmp = c->scratch.p ? c->scratch.p.get() + scratch_at[i] : nullptr;
    switch (d[i].kind) {
      case CollDesc::AllGather: {
        std::vector<size_t> off(g.size()), len(g.size(), d[i].count);
        for (int m = 0; m < g.size(); ++m) off[m] = m * d[i].count;
        build_ring_all_gather(b, g, recv, off, len, send);
        break;
      }
      case CollDesc::ReduceScatter:
        build_ring_reduce_scatter(b, *c, g, send, recv, offs[i], cnts[i], esz, divisor, nullptr, nullptr, tmp);
        break;
      case CollDesc::AllReduce: {
        std::vector<int> done;
        OpTable readers;
        build_ring_reduce_scatter(b, *c, g, send, recv + offs[i][g.me] * esz, offs[i], cnts[i], esz, divisor,
                                  &done, &readers, tmp);
        if (g.size() > 1) {
          std::vector<size_t> boff(g.size()), blen(g.size());
          for (int m = 0; m < g.size(); ++m) boff[m] = offs[i][m] * esz, blen[m] = cnts[i][m] * esz;
          build_ring_all_gather(b, g, recv, boff, blen, recv + boff[g.me], &done, &readers);
        }
        break;
      }
    }
  }
  return cc->t->issue(c.release());
}

CommWork *c_all_to_all_v(void *ctx, const void *send, const size_t *send_counts,
                         const size_t *send_displs, void *recv, const size_t *recv_counts,
                         const size_t *recv_displs, size_t elem_size) {
  CommCtx *cc = ctx_of(ctx);
  CTR_REQUIRE(send_counts && send_displs && recv_counts && recv_displs, CTR_STATUS_INVALID_ARGUMENT,
              "ucx: all_to_all_v: null count or displacement array");
  const Group &g = *cc->g;
  const int n = g.size(), r = g.me;
  for (int j = 0; j < n; ++j) {
    CTR_REQUIRE((send_counts[j] == 0 || send) && (recv_counts[j] == 0 || recv),
                CTR_STATUS_INVALID_ARGUMENT, "ucx: all_to_all_v: null buffer with a nonzero count");
  }
  CTR_REQUIRE(send_counts[r] == recv_counts[r], CTR_STATUS_INVALID_ARGUMENT,
              "ucx: all_to_all_v: rank %d sends itself %zu elements but expects %zu", g.members[r],
              send_counts[r], recv_counts[r]);
  auto c = new_coll(cc, "all_to_all_v");
  if (cc->shm) {
    auto sc = std::make_shared<ShmColl>();
    sc->kind = ShmColl::kAllToAllV;
    sc->send = send;
    sc->recv = recv;
    sc->send_counts.assign(send_counts, send_counts + n);
    sc->send_displs.assign(send_displs, send_displs + n);
    sc->recv_counts.assign(recv_counts, recv_counts + n);
    sc->recv_displs.assign(recv_displs, recv_displs + n);
    sc->elem_size = elem_size;
    return issue_shm(cc, std::move(c), std::move(sc));
  }
  const char *s = static_cast<const char *>(send);
  char *d = static_cast<char *>(recv);
  Builder b(*c);
  if (send_counts[r])
    b.copy(d + recv_displs[r] * elem_size, s + send_displs[r] * elem_size,
           send_counts[r] * elem_size);
  // Step k pairs this rank with r + k and r - k, so at every step each rank
  // sends to one peer and receives from another; UCP runs all steps at once.
  for (int k = 1; k < n; ++k) {
    int from = (r - k + n) % n, to = (r + k) % n;
    b.recv(from, d + recv_displs[from] * elem_size, recv_counts[from] * elem_size);
    b.send(to, s + send_displs[to] * elem_size, send_counts[to] * elem_size);
  }
  return cc->t->issue(c.release());
}

CommWork *c_broadcast(void *ctx, void *buf, size_t bytes, int root) {
  CommCtx *cc = ctx_of(ctx);
  const Group &g = *cc->g;
  const int n = g.size(), r = g.me;
  CTR_REQUIRE(root >= 0 && root < n, CTR_STATUS_INVALID_ARGUMENT,
              "ucx: broadcast: root %d is out of range for %s of %d ranks", root, g.name.c_str(),
              n);
  CTR_REQUIRE(bytes == 0 || buf, CTR_STATUS_INVALID_ARGUMENT, "ucx: broadcast: null buffer");
  auto c = new_coll(cc, "broadcast");
  if (cc->shm) {
    auto s = std::make_shared<ShmColl>();
    s->kind = ShmColl::kBroadcast;
    s->buf = buf;
    s->bytes = bytes;
    s->root = root;
    return issue_shm(cc, std::move(c), std::move(s));
  }
  Builder b(*c);
  if (n > 1) {
    // A chain root -> root + 1 -> ... : each rank forwards segment k as soon as
    // it has it, so large messages take about one transfer time in total.
    char *p = static_cast<char *>(buf);
    const int prev = (r - 1 + n) % n, next = (r + 1) % n;
    for (size_t k = 0; k < n_segments(bytes); ++k) {
      char *seg = p + k * kSegmentBytes;
      size_t len = segment_len(bytes, k);
      int got = r == root ? -1 : b.recv(prev, seg, len);
      if (next != root) b.send(next, seg, len, got);
    }
  }
  return cc->t->issue(c.release());
}

CommWork *c_barrier(void *ctx) {
  CommCtx *cc = ctx_of(ctx);
  auto c = new_coll(cc, "barrier");
  if (cc->shm) {
    auto s = std::make_shared<ShmColl>();
    s->kind = ShmColl::kBarrier;
    return issue_shm(cc, std::move(c), std::move(s));
  }
  Builder b(*c);
  build_barrier(b, *cc->g);
  return cc->t->issue(c.release());
}

// Sends and receives always take the UCP path, also for a communicator with a
// shared-memory engine: that engine runs whole-group collectives in one issue
// order, which a pair of members cannot share with the rest. On one host UCP
// moves them through its own shared-memory transport.
CommWork *point_to_point(CommCtx *cc, bool is_send, void *buf, size_t bytes, int peer) {
  const Group &g = *cc->g;
  const char *what = is_send ? "send" : "recv";
  CTR_REQUIRE(peer >= 0 && peer < g.size(), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: %s: peer %d is out of range for %s of %d ranks", what, peer, g.name.c_str(),
              g.size());
  CTR_REQUIRE(peer != g.me, CTR_STATUS_INVALID_ARGUMENT, "ucx: %s: rank %d addresses itself in %s",
              what, g.members[g.me], g.name.c_str());
  CTR_REQUIRE(bytes == 0 || buf, CTR_STATUS_INVALID_ARGUMENT, "ucx: %s: null buffer", what);
  uint32_t n = 0;
  {
    std::lock_guard<std::mutex> lock(cc->p2p_mu);
    auto &count = is_send ? cc->sent : cc->received;
    if (count.empty()) count.assign(static_cast<size_t>(g.size()), 0);
    n = count[static_cast<size_t>(peer)]++;
  }
  auto c = new_work(cc, what);
  c->tag = (uint64_t{g.id} << 40) | (uint64_t{kP2pSeqBit | (n & kCollSeqMask)} << 16);
  c->p2p_peer = peer;
  Builder b(*c);
  if (is_send)
    b.send(peer, buf, bytes);
  else
    b.recv(peer, buf, bytes);
  return cc->t->issue(c.release());
}

CommWork *c_send(void *ctx, const void *buf, size_t bytes, int peer) {
  return point_to_point(ctx_of(ctx), true, const_cast<void *>(buf), bytes, peer);
}

CommWork *c_recv(void *ctx, void *buf, size_t bytes, int peer) {
  return point_to_point(ctx_of(ctx), false, buf, bytes, peer);
}

void c_wait(void *ctx, CommWork *work, int64_t timeout_ms) {
  CTR_REQUIRE(work, CTR_STATUS_INVALID_ARGUMENT, "ucx: wait on a null work handle");
  ctx_of(ctx)->t->wait(from_handle(work), timeout_ms);
}

bool c_test(void *, CommWork *work) {
  if (!work) return false;
  Coll *c = from_handle(work);
  std::lock_guard<std::mutex> lock(c->mu);
  return c->finished;
}

void c_destroy(void *ctx) { delete ctx_of(ctx); }

uint64_t hash_members(const std::vector<int> &m) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int v : m) {
    for (int i = 0; i < 4; ++i) {
      h ^= (static_cast<uint32_t>(v) >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h ^ m.size();
}

Comm c_split(void *ctx, const std::vector<int> &members);

std::string c_flight(void *ctx) { return ctx_of(ctx)->t->flight_json(); }

const CommIface kIface = {
    "ucx",        c_rank,         c_size,      c_global_rank, c_all_gather, c_reduce_scatter,
    c_all_reduce, c_all_to_all_v, c_broadcast, c_barrier,     c_batch,      c_wait,
    c_test,       c_split,      c_destroy,    c_flight,     c_send,        c_recv,
};

// Gives a communicator whose members all run on this host, in one network
// namespace, a shared-memory engine. Every member decides alike (same_node is
// symmetric), so either all of them attach, all-gathering twice over UCX as
// they do, or none does.
void attach_shm(CommCtx *cc) {
  const Group &g = *cc->g;
  Transport *t = cc->t.get();
  if (g.size() < 2) return;
  for (int m : g.members)
    if (m != t->rank() && !t->same_node(m)) return;
  ShmSetup s;
  s.members = g.members;
  s.me = g.me;
  s.all_gather = [cc](const void *mine, void *all, size_t bytes) {
    c_wait(cc, c_all_gather(cc, mine, all, bytes), -1);
  };
  s.peer_failed = [t](int r) { return t->peer_down(r); };
  s.on_failure = [t](int r) { t->shm_failed(r); };
  cc->shm = shm_attach(s);
}

Comm c_split(void *ctx, const std::vector<int> &members) {
  CommCtx *cc = ctx_of(ctx);
  const Group &parent = *cc->g;
  Transport &t = *cc->t;
  CTR_REQUIRE(!members.empty(), CTR_STATUS_INVALID_ARGUMENT, "ucx: split of %s: empty member list",
              parent.name.c_str());
  auto g = std::make_shared<Group>();
  std::vector<char> seen(parent.size(), 0);
  g->me = -1;
  for (size_t i = 0; i < members.size(); ++i) {
    int m = members[i];
    CTR_REQUIRE(m >= 0 && m < parent.size(), CTR_STATUS_INVALID_ARGUMENT,
                "ucx: split of %s: member %d is out of range for %d ranks", parent.name.c_str(), m,
                parent.size());
    CTR_REQUIRE(!seen[m], CTR_STATUS_INVALID_ARGUMENT, "ucx: split of %s: member %d listed twice",
                parent.name.c_str(), m);
    seen[m] = 1;
    g->members.push_back(parent.members[m]);
    if (m == parent.me) g->me = static_cast<int>(i);
  }
  CTR_REQUIRE(g->me >= 0, CTR_STATUS_INVALID_ARGUMENT,
              "ucx: split of %s: the member list does not include the calling rank %d",
              parent.name.c_str(), parent.members[parent.me]);
  g->name = group_name(g->members);

  // The members agree on an id no communicator of any of them has used: the
  // largest of their next free ids. Serialised per process, so that two splits
  // on different threads cannot both take the same id.
  std::unique_lock<std::mutex> lock(t.split_mu());
  uint32_t &next = t.next_comm_id();
  if (g->size() > 1) {
    struct Offer {
      uint64_t next_id;
      uint64_t hash;
    };
    Offer mine{next, hash_members(g->members)};
    std::vector<Offer> all(g->size());
    auto tmp = std::make_shared<Group>(*g);
    tmp->id = kSplitCommId;
    auto c = std::make_unique<Coll>();
    c->t = &t;
    c->what = "split";
    c->group = tmp;
    // Members of one split may be in other splits with other lists at the same
    // time, where their group indices mean other ranks: so the agreement's tags
    // name senders by world rank, and the parent's id takes the sequence field.
    // Two ranks in two splits together take them in the same order, so their
    // messages pair up in order; if they do not, the hashes below differ.
    c->global_src = true;
    c->tag = (uint64_t{kSplitCommId} << 40) | (uint64_t{parent.id & kSeqMask} << 16);
    std::vector<size_t> off(g->size()), len(g->size(), sizeof(Offer));
    for (int i = 0; i < g->size(); ++i) off[i] = i * sizeof(Offer);
    Builder b(*c);
    build_ring_all_gather(b, *tmp, reinterpret_cast<char *>(all.data()), off, len,
                          reinterpret_cast<const char *>(&mine));
    t.wait(from_handle(t.issue(c.release())), -1);
    uint64_t id = 0;
    for (int i = 0; i < g->size(); ++i) {
      CTR_REQUIRE(all[i].hash == mine.hash, CTR_STATUS_INVALID_ARGUMENT,
                  "ucx: split of %s: rank %d passed a different member list than rank %d",
                  parent.name.c_str(), g->members[i], g->members[g->me]);
      id = std::max(id, all[i].next_id);
    }
    CTR_REQUIRE(id < kTeardownCommId, CTR_STATUS_UNSUPPORTED,
                "ucx: split of %s: communicator ids are exhausted", parent.name.c_str());
    g->id = static_cast<uint32_t>(id);
    next = g->id + 1;
  } else {
    g->id = next;  // a group of one sends nothing; any id will do
  }
  auto child = std::make_unique<CommCtx>();
  child->t = cc->t;
  child->g = std::move(g);
  lock.unlock();
  attach_shm(child.get());
  return Comm{&kIface, child.release()};
}

}  // namespace

Comm ucx_comm_create(Store &store, int rank, int world, int64_t timeout_ms) {
  CTR_REQUIRE(world >= 1 && world <= static_cast<int>(kMaxMembers), CTR_STATUS_INVALID_ARGUMENT,
              "ucx: world size %d is out of range", world);
  CTR_REQUIRE(rank >= 0 && rank < world, CTR_STATUS_INVALID_ARGUMENT,
              "ucx: rank %d is out of range for %d ranks", rank, world);
  CTR_REQUIRE(timeout_ms >= 0, CTR_STATUS_INVALID_ARGUMENT, "ucx: negative timeout");
  auto t = std::make_shared<Transport>(rank, world, timeout_ms);
  t->init(store);
  auto g = std::make_shared<Group>();
  for (int i = 0; i < world; ++i) g->members.push_back(i);
  g->me = rank;
  g->id = 0;
  g->name = "world";
  auto cc = std::make_unique<CommCtx>();
  cc->t = std::move(t);
  cc->g = std::move(g);
  attach_shm(cc.get());
  return Comm{&kIface, cc.release()};
}

bool ucx_available() { return true; }

}  // namespace ctr
