// Rendezvous: the small TCP key-value store that rank 0 serves and every rank joins.
//
// Rank 0 runs the server on one thread with poll(): a job has at most a few
// thousand ranks, each holding one connection, and every request is a short
// message, so one event loop is simpler and cheaper than a thread per client.
// Requests that wait (join, get of a missing key, barrier) are parked on the
// server and answered when they can be, or with an error at their deadline; a
// client therefore blocks in one read with its own deadline instead of polling,
// and the server, which knows who is missing, writes the error message.
//
// Every rank, rank 0 included, is a client over TCP, so there is one code path
// and rank 0's requests are ordered with everyone else's. A client also keeps a
// deadline a little past the server's, so a server that died or hangs turns into
// CTR_STATUS_COMM_ERROR or CTR_STATUS_TIMEOUT rather than a hang.
//
// Wire format: frames of a little-endian u32 length followed by that many bytes.
// A request is a u8 kind and its fields; a reply is a u8 ctr_status followed by
// the result (OK) or a message (anything else). Integers are little-endian i64,
// strings a u32 length and bytes.
//
// Admission: a connection first sends HELLO(protocol, rank, world, its nonce);
// rank 0 answers with its own nonce and a tag proving it holds the job token
// (empty for a tokenless job); the client checks that tag, so a process that
// merely listens on the port learns nothing and cannot pose as rank 0, and
// answers PROOF(its tag over both nonces). Only then is the rank joined; a peer
// that fails is answered with the reason and disconnected. A tokenless job is
// confined to loopback, where each side checks that the other end belongs to
// the same user (auth.h). Connections that have not been admitted are few
// (capped, the oldest dropped first) and short-lived (a deadline to finish),
// so strangers cannot exhaust rank 0's descriptors or memory; once every rank
// has joined, the store stops listening altogether.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/resource.h>

#include "comm/auth.h"
#include "comm/comm.h"
#include "core/status.h"

namespace ctr {
namespace {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

// How long a client waits beyond the deadline it gave the server before it
// concludes the server itself is stuck; covers scheduling and network delay.
constexpr int64_t kReplyGraceMs = 2000;
// How long rank 0's Store, when destroyed, keeps serving the ranks still
// connected. Ranks finish at slightly different times and the last of them may
// still be reading a key or leaving a barrier; capped so that a rank that hangs
// cannot keep rank 0 from exiting.
constexpr int64_t kServerLingerMs = 5000;
// A peer that has not been admitted cannot make the server buffer more than
// this, hold a connection longer than the admission deadline (the job timeout
// within these bounds), or hold more than kMaxPending (plus the world size)
// connections at once.
constexpr uint32_t kMaxFrameBeforeHello = 64 * 1024;
constexpr int64_t kMinAdmitMs = 1000;
constexpr int64_t kMaxAdmitMs = 10000;
constexpr size_t kMaxPending = 64;
// Refusals printed to stderr before the rest are only counted.
constexpr int kRefusalsShown = 10;
// The admission protocol; a peer speaking another is refused by name.
constexpr char kProtocol[] = "ctr-rendezvous/3";
constexpr uint32_t kMaxFrame = 256u << 20;
// Longer timeouts mean "forever"; capped so that now + timeout cannot overflow.
constexpr int64_t kMaxTimeoutMs = int64_t{1} << 40;

int64_t capped(int64_t ms) { return std::clamp<int64_t>(ms, 0, kMaxTimeoutMs); }

enum class Req : uint8_t {
  Hello = 1, Join = 2, Set = 3, Get = 4, Add = 5, Barrier = 6, Proof = 7, Heartbeat = 8, Failure = 9
};

std::string seconds(int64_t ms) { return strformat("%.1f s", static_cast<double>(ms) / 1000.0); }

int64_t ms_until(TimePoint deadline) {
  auto d = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return d < 0 ? 0 : static_cast<int64_t>(d);
}

// poll() takes an int; round up so that a deadline is never reported early.
int poll_timeout(TimePoint deadline) {
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now()).count();
  if (us <= 0) return 0;
  return static_cast<int>(std::min<int64_t>((us + 999) / 1000, 1 << 30));
}

// "rank 2", "ranks 2, 3", or the first few and a count for long lists.
std::string rank_list(const std::vector<int> &ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  if (ranks.size() > kShown) s += strformat(" and %zu more", ranks.size() - kShown);
  return s;
}

std::string errno_text(int err) { return std::strerror(err); }

std::string sockaddr_text(const sockaddr_storage &ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto *a = reinterpret_cast<const sockaddr_in *>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
    return strformat("%s:%d", host, port);
  }
  if (ss.ss_family == AF_INET6) {
    auto *a = reinterpret_cast<const sockaddr_in6 *>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
    return strformat("[%s]:%d", host, port);
  }
  return "?";
}

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd &&o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd &operator=(Fd &&o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd &) = delete;
  Fd &operator=(const Fd &) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// ------------------------------------------------------------------------------------------
// Encoding

class Writer {
 public:
  explicit Writer(uint8_t head) {
    buf_.assign(4, '\0');  // the length, patched in by take()
    u8(head);
  }
  Writer &u8(uint8_t v) {
    buf_.push_back(static_cast<char>(v));
    return *this;
  }
  Writer &i64(int64_t v) {
    auto u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    return *this;
  }
  Writer &str(const std::string &s) {
    auto n = static_cast<uint32_t>(s.size());
    for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
    buf_ += s;
    return *this;
  }
  // The frame: length prefix patched in front of the body.
  std::string take() {
    auto n = static_cast<uint32_t>(buf_.size() - 4);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(buf_);
  }

 private:
  std::string buf_;
};

uint32_t read_u32(const char *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// Reads fields from one frame body; any overrun clears ok() instead of throwing,
// so the server can treat a malformed frame as a protocol error of that peer.
class Reader {
 public:
  Reader(const char *p, size_t n) : p_(p), end_(p + n) {}
  bool ok() const { return ok_; }
  bool done() const { return p_ == end_; }
  uint8_t u8() {
    if (!need(1)) return 0;
    return static_cast<uint8_t>(*p_++);
  }
  int64_t i64() {
    if (!need(8)) return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    p_ += 8;
    return static_cast<int64_t>(v);
  }
  std::string str() {
    if (!need(4)) return {};
    uint32_t n = read_u32(p_);
    p_ += 4;
    if (!need(n)) return {};
    std::string s(p_, n);
    p_ += n;
    return s;
  }

 private:
  bool need(size_t n) {
    if (!ok_ || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return false;
    }
    return true;
  }
  const char *p_;
  const char *end_;
  bool ok_ = true;
};

std::string ok_reply() { return Writer(CTR_STATUS_OK).take(); }
std::string error_reply(ctr_status code, const std::string &msg) {
  return Writer(static_cast<uint8_t>(code)).str(msg).take();
}

// The tags of the admission exchange: rank 0's over the client's nonce first,
// the client's over rank 0's first, both bound to the claimed rank.
std::string server_tag(const std::string &token, const std::string &nonce_c,
                       const std::string &nonce_s, int rank) {
  return job_mac(token, "ctr store: rank 0", nonce_c, nonce_s, std::to_string(rank));
}
std::string client_tag(const std::string &token, const std::string &nonce_c,
                       const std::string &nonce_s, int rank) {
  return job_mac(token, "ctr store: rank", nonce_s, nonce_c, std::to_string(rank));
}

// ------------------------------------------------------------------------------------------
// Addresses

struct Resolved {
  sockaddr_storage addr{};
  socklen_t len = 0;
};

// Resolves host:port to its first address (IPv4 or IPv6); empty on failure with
// the resolver's message in err.
bool resolve(const std::string &host, int port, bool passive, Resolved *out, std::string *err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo *res = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || !res) {
    *err = rc == EAI_SYSTEM ? errno_text(errno) : ::gai_strerror(rc);
    return false;
  }
  std::memcpy(&out->addr, res->ai_addr, res->ai_addrlen);
  out->len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return true;
}

// ------------------------------------------------------------------------------------------
// Server (rank 0)

class StoreServer {
 public:
  // Binds and listens (errors are thrown here, on the caller's thread), then
  // starts the event loop.
  explicit StoreServer(const RendezvousConfig &cfg) : cfg_(cfg), joined_from_(cfg.world) {
    admit_ms_ = std::clamp<int64_t>(cfg.timeout_ms, kMinAdmitMs, kMaxAdmitMs);
    // One descriptor per rank: take the whole allowance the hard limit gives.
    rlimit lim{};
    if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
      lim.rlim_cur = lim.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &lim);
    }
    // Exactly the address asked for: listening on every interface because the
    // address is not this host's would expose the store where nobody meant it.
    std::string err;
    Resolved local;
    CTR_REQUIRE(resolve(cfg.addr, cfg.port, true, &local, &err), CTR_STATUS_COMM_ERROR,
                "rendezvous: rank 0 cannot resolve its own address '%s': %s", cfg.addr.c_str(),
                err.c_str());
    if (int fd = inherited_listener(local); fd >= 0) {
      listen_fd_ = Fd(fd);
    } else {
      bind_and_listen(cfg, local);
    }
    spare_fd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    loopback_ = is_loopback(local.addr);
    set_nonblocking(listen_fd_.get());
    connect_host_ = cfg.addr;
    wake_fd_ = Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    CTR_REQUIRE(wake_fd_.get() >= 0, CTR_STATUS_COMM_ERROR, "rendezvous: eventfd: %s",
                errno_text(errno).c_str());
    thread_ = std::thread([this] { run(); });
  }

  ~StoreServer() { stop(kServerLingerMs); }

  // Where rank 0's own client connects.
  const std::string &connect_host() const { return connect_host_; }

 private:
  // `ctr launch` binds and listens on the store's port itself and hands the
  // socket to rank 0 (CTR_MASTER_LISTEN_FD), so that no other process can take
  // the port between the launcher choosing it and rank 0 starting. Taken once
  // per process, and only when it is a listening socket on the very address
  // asked for; anything else is ignored and rank 0 binds as usual.
  static int inherited_listener(const Resolved &local) {
    static std::atomic<bool> taken{false};
    const char *v = std::getenv("CTR_MASTER_LISTEN_FD");
    if (!v || !*v || taken.load()) return -1;
    int fd = -1;
    auto [end, ec] = std::from_chars(v, v + std::strlen(v), fd);
    if (ec != std::errc() || *end != '\0' || fd < 3) return -1;
    int listening = 0;
    socklen_t n = sizeof listening;
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0 || !listening) return -1;
    sockaddr_storage have{};
    socklen_t len = sizeof have;
    if (::getsockname(fd, reinterpret_cast<sockaddr *>(&have), &len) != 0 || len != local.len ||
        std::memcmp(&have, &local.addr, len) != 0)
      return -1;
    if (taken.exchange(true)) return -1;
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    return fd;
  }

  void bind_and_listen(const RendezvousConfig &cfg, Resolved local) {
    listen_fd_ = Fd(::socket(local.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    CTR_REQUIRE(listen_fd_.get() >= 0, CTR_STATUS_COMM_ERROR, "rendezvous: socket: %s",
                errno_text(errno).c_str());
    int one = 1;
    ::setsockopt(listen_fd_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(listen_fd_.get(), reinterpret_cast<sockaddr *>(&local.addr), local.len) != 0) {
      const int e = errno;
      fail(CTR_STATUS_COMM_ERROR,
           strformat("rendezvous: rank 0 cannot listen on %s: %s%s",
                     sockaddr_text(local.addr).c_str(), errno_text(e).c_str(),
                     e == EADDRNOTAVAIL
                         ? " (the master address must be an address of rank 0's own host)"
                     : e == EADDRINUSE ? " (another job or process holds the port: choose "
                                         "another master port)"
                                       : ""));
    }
    CTR_REQUIRE(::listen(listen_fd_.get(), 1024) == 0, CTR_STATUS_COMM_ERROR,
                "rendezvous: rank 0 cannot listen on port %d: %s", cfg.port,
                errno_text(errno).c_str());
  }

 public:

  // Keeps serving until every client has disconnected or linger_ms pass.
  void stop(int64_t linger_ms) {
    if (!thread_.joinable()) return;
    stop_deadline_ = Clock::now() + std::chrono::milliseconds(linger_ms);
    stopping_.store(true);
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_.get(), &one, sizeof one);
    thread_.join();
  }

 private:
  struct Conn {
    uint64_t id = 0;
    Fd fd;
    std::string peer;
    int rank = -1;  // set once admitted
    TimePoint since{};  // accepted at
    // Admission in progress: the rank claimed by HELLO and both nonces.
    int claimed = -1;
    std::string nonce_c, nonce_s;
    std::string in;
    std::string out;
    size_t out_off = 0;
    bool closing = false;  // refused: flush the reply, then close
    bool dead = false;     // to be dropped by the event loop
  };
  struct Waiter {
    uint64_t conn;
    TimePoint deadline;
    int64_t timeout_ms;
  };
  struct BarrierState {
    std::vector<char> arrived;
    std::vector<Waiter> waiters;
  };

  void run() {
    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    for (;;) {
      TimePoint now = Clock::now();
      if (stopping_.load() && (conns_.empty() || now >= stop_deadline_)) break;
      TimePoint next = now + std::chrono::hours(24);
      if (stopping_.load()) next = std::min(next, stop_deadline_);
      for (auto &w : join_waiters_) next = std::min(next, w.deadline);
      for (auto &[k, ws] : get_waiters_)
        for (auto &w : ws) next = std::min(next, w.deadline);
      for (auto &[k, b] : barriers_)
        for (auto &w : b.waiters) next = std::min(next, w.deadline);
      for (auto &[id, c] : conns_)
        if (c.rank < 0 && !c.closing) next = std::min(next, c.since + admit_window());
      if (failure_.empty())
        for (auto &[rank, at] : last_beat_)
          next = std::min(next, at + std::chrono::milliseconds(cfg_.timeout_ms));

      fds.clear();
      ids.clear();
      fds.push_back({wake_fd_.get(), POLLIN, 0});
      fds.push_back({listen_fd_.get(), POLLIN, 0});
      for (auto &[id, c] : conns_) {
        short ev = c.closing ? 0 : POLLIN;
        if (c.out_off < c.out.size()) ev |= POLLOUT;
        fds.push_back({c.fd.get(), ev, 0});
        ids.push_back(id);
      }
      int n = ::poll(fds.data(), fds.size(), poll_timeout(next));
      if (n < 0 && errno != EINTR) {
        std::fprintf(stderr, "ctr: rendezvous: server poll failed: %s\n",
                     errno_text(errno).c_str());
        break;
      }
      if (n > 0) {
        if (fds[0].revents) {
          uint64_t v;
          [[maybe_unused]] ssize_t r = ::read(wake_fd_.get(), &v, sizeof v);
        }
        if (fds[1].revents & POLLIN) accept_all();
        for (size_t i = 0; i < ids.size(); ++i) {
          short re = fds[i + 2].revents;
          auto it = conns_.find(ids[i]);  // accepting may have dropped it for room
          if (!re || it == conns_.end() || it->second.dead) continue;
          Conn &c = it->second;
          if (re & (POLLIN | POLLHUP | POLLERR)) read_from(c);
          if (!c.dead) flush(c);
        }
      }
      expire(Clock::now());
      // Connections are only dropped here, so that handlers may hold references.
      for (auto it = conns_.begin(); it != conns_.end();) {
        uint64_t id = it->first;
        ++it;
        if (conns_.at(id).dead) drop(id);
      }
    }
    conns_.clear();
  }

  std::chrono::milliseconds admit_window() const { return std::chrono::milliseconds(admit_ms_); }

  void accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      int fd = ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr *>(&ss), &len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
        // Out of descriptors: the oldest connection not yet admitted makes room
        // for the new one (a real rank connecting during a flood still gets
        // in). Without one, the spare descriptor makes room to take the new
        // connection off the queue and close it, so the listening socket does
        // not stay readable and keep the loop spinning.
        if (drop_oldest_pending()) continue;
        spare_fd_.reset();
        fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) ::close(fd);
        spare_fd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        note_refusal("out of file descriptors: a connection was closed unread");
        if (fd < 0) return;
        continue;
      }
      if (fd < 0) return;  // EAGAIN, or a connection that vanished meanwhile
      set_nodelay(fd);
      Conn c;
      c.fd = Fd(fd);
      c.peer = sockaddr_text(ss);
      c.id = next_id_++;
      c.since = Clock::now();
      conns_.emplace(c.id, std::move(c));
      evict_pending();
    }
  }

  // Keeps unadmitted connections under their cap by dropping the oldest: a
  // real rank sends HELLO at once and is through admission long before a
  // flood of newer connections reaches it.
  void evict_pending() {
    const size_t cap = kMaxPending + static_cast<size_t>(cfg_.world);
    size_t pending = 0;
    for (auto &[id, c] : conns_) pending += c.rank < 0 && !c.dead;
    for (auto it = conns_.begin(); pending > cap && it != conns_.end(); ++it) {
      Conn &c = it->second;
      if (c.rank >= 0 || c.dead) continue;
      note_refusal(strformat("%s: dropped, more than %zu connections waiting for admission",
                             c.peer.c_str(), cap));
      c.dead = true;
      --pending;
    }
  }

  // Every rank is in: nobody else may join, so the store stops listening and
  // closes what is still waiting for admission before any rank goes on (their
  // descriptors are free for the communicator the ranks create next).
  void close_admission() {
    listen_fd_.reset();
    for (auto &[id, c] : conns_) {
      if (c.rank >= 0 || c.dead) continue;
      c.fd.reset();
      c.dead = true;
    }
  }

  bool drop_oldest_pending() {
    for (auto &[id, c] : conns_) {
      if (c.rank >= 0) continue;
      note_refusal(strformat("%s: dropped to make room, out of file descriptors", c.peer.c_str()));
      drop(id);  // at once: its descriptor is what the new connection needs
      return true;
    }
    return false;
  }

  // Prints the first few refusals; the rest are counted, so that a flood does
  // not flood the log too.
  void note_refusal(const std::string &what) {
    ++refusals_;
    if (refusals_ <= kRefusalsShown)
      std::fprintf(stderr, "ctr: rendezvous: refused connection: %s\n", what.c_str());
    if (refusals_ == kRefusalsShown)
      std::fprintf(stderr, "ctr: rendezvous: further refusals are not shown\n");
  }

  void read_from(Conn &c) {
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n < 0 && errno == EINTR) continue;
      c.dead = true;  // EOF or a reset: the client is gone
      return;
    }
    size_t off = 0;
    while (c.in.size() - off >= 4 && !c.closing) {
      uint32_t len = read_u32(c.in.data() + off);
      uint32_t limit = c.rank < 0 ? kMaxFrameBeforeHello : kMaxFrame;
      if (len > limit) {
        refuse(c, strformat("message of %u bytes from %s exceeds the limit", len, c.peer.c_str()));
        break;
      }
      if (c.in.size() - off - 4 < len) break;
      handle(c, c.in.data() + off + 4, len);
      off += 4 + size_t{len};
    }
    c.in.erase(0, off);
  }

  // Queues a frame and writes what the socket takes now, so that a requester
  // gets its reply before the waiters its request wakes get theirs.
  void send(Conn &c, const std::string &frame) {
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
    }
    c.out += frame;
    flush(c);
  }

  void flush(Conn &c) {
    while (c.out_off < c.out.size()) {
      ssize_t n =
          ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_off += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      c.dead = true;
      return;
    }
    if (c.closing) c.dead = true;
  }

  void reply(uint64_t id, const std::string &frame) {
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second.dead) return;
    send(it->second, frame);
  }

  void refuse(Conn &c, const std::string &reason) {
    note_refusal(reason);
    c.closing = true;  // dropped as soon as the reply is out
    send(c, error_reply(CTR_STATUS_COMM_ERROR, "rendezvous: rank 0 refused this rank: " + reason));
  }

  // Forgets a connection and anything it was waiting for. Its rank stays
  // joined: a rank that left cannot come back under the same number.
  void drop(uint64_t id) {
    auto purge = [id](std::vector<Waiter> &ws) {
      ws.erase(std::remove_if(ws.begin(), ws.end(), [id](const Waiter &w) { return w.conn == id; }),
               ws.end());
    };
    purge(join_waiters_);
    for (auto &[k, ws] : get_waiters_) purge(ws);
    // A rank that closed its connection has left (a dead one is the
    // communicator's to report): its silence is no failure.
    if (auto it = conns_.find(id); it != conns_.end() && it->second.rank >= 0)
      last_beat_.erase(it->second.rank);
    for (auto &[k, b] : barriers_) purge(b.waiters);
    conns_.erase(id);
  }

  void handle(Conn &c, const char *p, size_t n) {
    uint64_t id = c.id;
    Reader r(p, n);
    auto kind = static_cast<Req>(r.u8());
    if (c.rank < 0 && kind != Req::Hello && kind != Req::Proof) {
      refuse(c, strformat("%s sent a request before being admitted (not a libctr rank?)",
                          c.peer.c_str()));
      return;
    }
    switch (kind) {
      case Req::Hello: {
        std::string protocol = r.str();
        int64_t rank = r.i64();
        int64_t world = r.i64();
        std::string nonce_c = r.str();
        if (!r.ok() || !r.done() || c.rank >= 0 || c.claimed >= 0) {
          refuse(c, strformat("malformed HELLO from %s", c.peer.c_str()));
        } else if (protocol != kProtocol) {
          refuse(c, strformat("%s speaks another rendezvous protocol (a different libctr "
                              "version?)",
                              c.peer.c_str()));
        } else if (world != cfg_.world) {
          refuse(c, strformat("world size mismatch from %s: it has %lld ranks, rank 0 has %d",
                              c.peer.c_str(), static_cast<long long>(world), cfg_.world));
        } else if (rank < 0 || rank >= cfg_.world) {
          refuse(c, strformat("rank %lld from %s is out of range for %d ranks",
                              static_cast<long long>(rank), c.peer.c_str(), cfg_.world));
        } else if (nonce_c.size() != kNonceBytes) {
          refuse(c, strformat("malformed HELLO from %s", c.peer.c_str()));
        } else if (!joined_from_[rank].empty()) {
          refuse(c, strformat("rank %lld from %s already joined from %s",
                              static_cast<long long>(rank), c.peer.c_str(),
                              joined_from_[rank].c_str()));
        } else if (std::string why; cfg_.token.empty() && loopback_ && !same_user(c, &why)) {
          refuse(c, why);
        } else {
          c.claimed = static_cast<int>(rank);
          c.nonce_c = std::move(nonce_c);
          c.nonce_s = random_bytes(kNonceBytes);
          std::string tag;
          if (!cfg_.token.empty()) tag = server_tag(cfg_.token, c.nonce_c, c.nonce_s, c.claimed);
          send(c, Writer(CTR_STATUS_OK).str(c.nonce_s).str(tag).take());
        }
        return;
      }
      case Req::Proof: {
        std::string tag = r.str();
        if (!r.ok() || !r.done() || c.rank >= 0 || c.claimed < 0) {
          refuse(c, strformat("malformed PROOF from %s", c.peer.c_str()));
          return;
        }
        const int rank = c.claimed;
        const bool ok = cfg_.token.empty()
                            ? tag.empty()
                            : equal_secret(tag, client_tag(cfg_.token, c.nonce_c, c.nonce_s, rank));
        if (!ok) {
          refuse(c, strformat("job token mismatch from %s (claiming rank %d)", c.peer.c_str(),
                              rank));
        } else if (!joined_from_[rank].empty()) {
          refuse(c, strformat("rank %d from %s already joined from %s", rank, c.peer.c_str(),
                              joined_from_[rank].c_str()));
        } else {
          c.rank = rank;
          joined_from_[rank] = c.peer;
          ++joined_;
          if (joined_ == cfg_.world) close_admission();
          send(c, ok_reply());
          if (joined_ == cfg_.world) {
            for (auto &w : join_waiters_) reply(w.conn, ok_reply());
            join_waiters_.clear();
          }
        }
        return;
      }
      case Req::Heartbeat: {
        if (!check(c, r)) return;
        last_beat_[c.rank] = Clock::now();
        send(c, Writer(CTR_STATUS_OK).str(failure_).take());
        return;
      }
      case Req::Failure: {
        std::string what = r.str();
        if (!check(c, r)) return;
        if (failure_.empty()) failure_ = strformat("rank %d: %s", c.rank, what.c_str());
        send(c, ok_reply());
        return;
      }
      case Req::Join: {
        // The time left to the rank, and its whole join timeout (what the
        // message names: connecting and admission took the difference).
        int64_t timeout = r.i64();
        int64_t whole = r.i64();
        if (!check(c, r)) return;
        if (joined_ == cfg_.world) {
          send(c, ok_reply());
        } else {
          join_waiters_.push_back({id, deadline_in(timeout), std::max(timeout, whole)});
        }
        return;
      }
      case Req::Set: {
        std::string key = r.str();
        std::string value = r.str();
        if (!check(c, r)) return;
        kv_[key] = std::move(value);
        send(c, ok_reply());
        wake_getters(key);
        return;
      }
      case Req::Get: {
        std::string key = r.str();
        int64_t timeout = r.i64();
        if (!check(c, r)) return;
        auto it = kv_.find(key);
        if (it != kv_.end()) {
          send(c, Writer(CTR_STATUS_OK).str(it->second).take());
        } else {
          get_waiters_[key].push_back({id, deadline_in(timeout), timeout});
        }
        return;
      }
      case Req::Add: {
        std::string key = r.str();
        int64_t delta = r.i64();
        if (!check(c, r)) return;
        int64_t value = 0;
        auto it = kv_.find(key);
        if (it != kv_.end()) {
          const std::string &s = it->second;
          auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
          if (ec != std::errc() || ptr != s.data() + s.size()) {
            send(c, error_reply(
                        CTR_STATUS_INVALID_ARGUMENT,
                        strformat("rendezvous: add to key '%s', which holds a non-integer value",
                                  key.c_str())));
            return;
          }
        }
        // Wraps like the two's-complement counter it is rather than trapping.
        value = static_cast<int64_t>(static_cast<uint64_t>(value) + static_cast<uint64_t>(delta));
        kv_[key] = std::to_string(value);
        send(c, Writer(CTR_STATUS_OK).i64(value).take());
        wake_getters(key);
        return;
      }
      case Req::Barrier: {
        std::string name = r.str();
        int64_t timeout = r.i64();
        if (!check(c, r)) return;
        BarrierState &b = barriers_[name];
        if (b.arrived.empty()) b.arrived.assign(cfg_.world, 0);
        if (b.arrived[c.rank]) {
          send(c, error_reply(CTR_STATUS_INVALID_STATE,
                              strformat("rendezvous: rank %d entered store barrier '%s' twice",
                                        c.rank, name.c_str())));
          return;
        }
        b.arrived[c.rank] = 1;
        b.waiters.push_back({id, deadline_in(timeout), timeout});
        if (std::count(b.arrived.begin(), b.arrived.end(), 1) == cfg_.world) {
          std::vector<Waiter> ws = std::move(b.waiters);
          barriers_.erase(name);
          for (auto &w : ws) reply(w.conn, ok_reply());
        }
        return;
      }
    }
    refuse(c, strformat("unknown request %d from %s", static_cast<int>(kind), c.peer.c_str()));
  }

  bool check(Conn &c, const Reader &r) {
    if (r.ok() && r.done()) return true;
    refuse(c, strformat("malformed request from %s (rank %d)", c.peer.c_str(), c.rank));
    return false;
  }

  TimePoint deadline_in(int64_t ms) { return Clock::now() + std::chrono::milliseconds(capped(ms)); }

  // A tokenless job admits only processes of the user running rank 0.
  static bool same_user(const Conn &c, std::string *why) {
    const long uid = loopback_peer_uid(c.fd.get());
    if (uid == static_cast<long>(::getuid())) return true;
    *why = uid < 0 ? strformat("cannot tell which user %s belongs to, and this job has no token "
                               "(set CTR_JOB_TOKEN on every rank)",
                               c.peer.c_str())
                   : strformat("%s belongs to user id %ld, not to this job's user, and this job "
                               "has no token",
                               c.peer.c_str(), uid);
    return false;
  }

  void wake_getters(const std::string &key) {
    auto it = get_waiters_.find(key);
    if (it == get_waiters_.end()) return;
    std::vector<Waiter> ws = std::move(it->second);
    get_waiters_.erase(it);
    std::string frame = Writer(CTR_STATUS_OK).str(kv_[key]).take();
    for (auto &w : ws) reply(w.conn, frame);
  }

  // Answers every wait whose deadline has passed with a message naming what is
  // missing.
  void expire(TimePoint now) {
    // A rank that has been sending heartbeats and stops is the job's failure.
    for (auto &[rank, at] : last_beat_) {
      if (!failure_.empty() || now < at + std::chrono::milliseconds(cfg_.timeout_ms)) continue;
      failure_ = strformat("rank %d sent no heartbeat for %s (stopped, hung or cut off)", rank,
                           seconds(cfg_.timeout_ms).c_str());
    }
    for (auto &[id, c] : conns_)
      if (c.rank < 0 && !c.closing && !c.dead && now >= c.since + admit_window())
        refuse(c, strformat("%s was not admitted within %s", c.peer.c_str(),
                            seconds(admit_ms_).c_str()));
    auto due = [now](const Waiter &w) { return w.deadline <= now; };
    if (std::any_of(join_waiters_.begin(), join_waiters_.end(), due)) {
      std::vector<int> missing;
      for (int i = 0; i < cfg_.world; ++i)
        if (joined_from_[i].empty()) missing.push_back(i);
      std::vector<Waiter> keep;
      for (auto &w : join_waiters_) {
        if (!due(w)) {
          keep.push_back(w);
          continue;
        }
        reply(w.conn, error_reply(CTR_STATUS_TIMEOUT,
                                  strformat("rendezvous: %s of %d did not join within %s",
                                            rank_list(missing).c_str(), cfg_.world,
                                            seconds(w.timeout_ms).c_str())));
      }
      join_waiters_ = std::move(keep);
    }
    for (auto it = get_waiters_.begin(); it != get_waiters_.end();) {
      std::vector<Waiter> keep;
      for (auto &w : it->second) {
        if (!due(w)) {
          keep.push_back(w);
          continue;
        }
        reply(w.conn, error_reply(CTR_STATUS_TIMEOUT,
                                  strformat("rendezvous: key '%s' was not set within %s",
                                            it->first.c_str(), seconds(w.timeout_ms).c_str())));
      }
      it->second = std::move(keep);
      it = it->second.empty() ? get_waiters_.erase(it) : std::next(it);
    }
    for (auto it = barriers_.begin(); it != barriers_.end();) {
      BarrierState &b = it->second;
      std::vector<Waiter> keep;
      for (auto &w : b.waiters) {
        if (!due(w)) {
          keep.push_back(w);
          continue;
        }
        std::vector<int> missing;
        for (int i = 0; i < cfg_.world; ++i)
          if (!b.arrived[i]) missing.push_back(i);
        auto c = conns_.find(w.conn);
        if (c != conns_.end() && c->second.rank >= 0) b.arrived[c->second.rank] = 0;
        reply(w.conn,
              error_reply(CTR_STATUS_TIMEOUT,
                          strformat("rendezvous: store barrier '%s': %s of %d did not arrive "
                                    "within %s",
                                    it->first.c_str(), rank_list(missing).c_str(), cfg_.world,
                                    seconds(w.timeout_ms).c_str())));
      }
      b.waiters = std::move(keep);
      it = b.waiters.empty() ? barriers_.erase(it) : std::next(it);
    }
  }

  RendezvousConfig cfg_;
  int64_t admit_ms_ = kMaxAdmitMs;
  bool loopback_ = false;  // listening on loopback: a tokenless job admits only its user
  Fd listen_fd_;
  Fd spare_fd_;  // given up to accept (and close) a connection when out of descriptors
  Fd wake_fd_;
  std::string connect_host_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  TimePoint stop_deadline_{};

  // Owned by the server thread.
  std::map<uint64_t, Conn> conns_;
  uint64_t next_id_ = 1;
  std::vector<std::string> joined_from_;  // peer address per joined rank, empty if not joined
  int joined_ = 0;
  int refusals_ = 0;
  std::map<int, TimePoint> last_beat_;  // ranks that send heartbeats: the last one
  std::string failure_;                 // the job's first failure, once known
  std::vector<Waiter> join_waiters_;
  std::unordered_map<std::string, std::string> kv_;
  std::unordered_map<std::string, std::vector<Waiter>> get_waiters_;
  std::unordered_map<std::string, BarrierState> barriers_;
};

// ------------------------------------------------------------------------------------------
// Client (every rank)

class TcpStore final : public Store {
 public:
  TcpStore(const RendezvousConfig &cfg, std::unique_ptr<StoreServer> server)
      : cfg_(cfg), server_(std::move(server)) {
    cfg_.timeout_ms = capped(cfg_.timeout_ms);
  }

  ~TcpStore() override {
    // Our own connection closes first, so rank 0's server waits only for the
    // other ranks.
    fd_.reset();
    server_.reset();
  }

  void join() {
    TimePoint deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
    std::string host = server_ ? server_->connect_host() : cfg_.addr;
    where_ = strformat("%s:%d", cfg_.addr.c_str(), cfg_.port);
    std::lock_guard<std::mutex> lock(mu_);
    // Rank 0 drops the oldest unadmitted connection when strangers flood it, and
    // that may be this rank's before it has proved itself: a connection lost
    // during admission is made again while time is left. Refusals (a wrong
    // token, another protocol) are final.
    int64_t backoff_ms = 10;
    for (;;) {
      connect_until(host, deadline);
      lost_ = false;
      broken_ = false;
      try {
        admit(deadline);
        break;
      } catch (const Error &) {
        if (!lost_ || Clock::now() >= deadline) throw;
      }
      fd_.reset();
      ::poll(nullptr, 0, static_cast<int>(std::min<int64_t>(backoff_ms, ms_until(deadline))));
      backoff_ms = std::min<int64_t>(backoff_ms * 2, 250);
    }
    int64_t left = ms_until(deadline);
    request(Writer(static_cast<uint8_t>(Req::Join)).i64(left).i64(cfg_.timeout_ms).take(),
            Clock::now() + std::chrono::milliseconds(left + kReplyGraceMs), "join");
  }

  // HELLO and PROOF: this rank and rank 0 prove to each other that they hold
  // the job's token (or, tokenless, that they are the same user on loopback).
  void admit(TimePoint deadline) {
    const auto reply_by = [&] {
      return Clock::now() + std::chrono::milliseconds(ms_until(deadline) + kReplyGraceMs);
    };
    const std::string nonce_c = random_bytes(kNonceBytes);
    std::string body = request(Writer(static_cast<uint8_t>(Req::Hello))
                                   .str(kProtocol)
                                   .i64(cfg_.rank)
                                   .i64(cfg_.world)
                                   .str(nonce_c)
                                   .take(),
                               reply_by(), "HELLO");
    Reader r(body.data(), body.size());
    const std::string nonce_s = r.str();
    const std::string tag = r.str();
    protocol_check(r, "HELLO");
    std::string proof;
    if (!cfg_.token.empty()) {
      CTR_REQUIRE(!tag.empty(), CTR_STATUS_COMM_ERROR,
                  "rendezvous: rank 0 at %s runs without a job token but this rank has one "
                  "(CTR_JOB_TOKEN must be the same on every rank)",
                  where_.c_str());
      CTR_REQUIRE(equal_secret(tag, server_tag(cfg_.token, nonce_c, nonce_s, cfg_.rank)),
                  CTR_STATUS_COMM_ERROR,
                  "rendezvous: the store at %s does not hold this job's token: it is not this "
                  "job's rank 0, or CTR_JOB_TOKEN differs between ranks",
                  where_.c_str());
      proof = client_tag(cfg_.token, nonce_c, nonce_s, cfg_.rank);
    } else {
      CTR_REQUIRE(tag.empty(), CTR_STATUS_COMM_ERROR,
                  "rendezvous: rank 0 at %s requires a job token: set CTR_JOB_TOKEN to the "
                  "job's token on this rank",
                  where_.c_str());
      if (!cfg_.allow_no_token || loopback_) {
        const long uid = loopback_peer_uid(fd_.get());
        CTR_REQUIRE(uid == static_cast<long>(::getuid()), CTR_STATUS_COMM_ERROR,
                    "rendezvous: the store at %s %s, and this job has no token to prove it is "
                    "this job's rank 0 (set CTR_JOB_TOKEN on every rank)",
                    where_.c_str(),
                    uid < 0 ? "cannot be told apart from another user's"
                            : strformat("belongs to another user (id %ld)", uid).c_str());
      }
    }
    request(Writer(static_cast<uint8_t>(Req::Proof)).str(proof).take(), reply_by(), "PROOF");
  }

  void set(const std::string &key, const std::string &value) override {
    std::lock_guard<std::mutex> lock(mu_);
    request(Writer(static_cast<uint8_t>(Req::Set)).str(key).str(value).take(),
            Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms), "set");
  }

  std::string get(const std::string &key, int64_t timeout_ms) override {
    timeout_ms = timeout_ms < 0 ? cfg_.timeout_ms : capped(timeout_ms);
    std::lock_guard<std::mutex> lock(mu_);
    std::string body =
        request(Writer(static_cast<uint8_t>(Req::Get)).str(key).i64(timeout_ms).take(),
                Clock::now() + std::chrono::milliseconds(timeout_ms + kReplyGraceMs), "get");
    Reader r(body.data(), body.size());
    std::string value = r.str();
    protocol_check(r, "get");
    return value;
  }

  int64_t add(const std::string &key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::string body = request(Writer(static_cast<uint8_t>(Req::Add)).str(key).i64(delta).take(),
                               Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms), "add");
    Reader r(body.data(), body.size());
    int64_t v = r.i64();
    protocol_check(r, "add");
    return v;
  }

  const std::string &job_token() const override { return cfg_.token; }

  void abandon() override {
    if (server_) server_->stop(0);
  }

  std::string heartbeat() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::string body = request(Writer(static_cast<uint8_t>(Req::Heartbeat)).take(),
                               Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms), "heartbeat");
    Reader r(body.data(), body.size());
    std::string failure = r.str();
    protocol_check(r, "heartbeat");
    return failure;
  }

  void report_failure(const std::string &message) override {
    std::lock_guard<std::mutex> lock(mu_);
    request(Writer(static_cast<uint8_t>(Req::Failure)).str(message).take(),
            Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms), "failure report");
  }

  void barrier(const std::string &name, int64_t timeout_ms) override {
    timeout_ms = timeout_ms < 0 ? cfg_.timeout_ms : capped(timeout_ms);
    std::lock_guard<std::mutex> lock(mu_);
    request(Writer(static_cast<uint8_t>(Req::Barrier)).str(name).i64(timeout_ms).take(),
            Clock::now() + std::chrono::milliseconds(timeout_ms + kReplyGraceMs), "barrier");
  }

 private:
  // Connects, retrying until the deadline: rank 0 may start after the others.
  void connect_until(const std::string &host, TimePoint deadline) {
    Resolved to;
    std::string err;
    CTR_REQUIRE(resolve(host, cfg_.port, false, &to, &err), CTR_STATUS_COMM_ERROR,
                "rendezvous: cannot resolve rank 0's address '%s': %s", host.c_str(), err.c_str());
    int64_t backoff_ms = 10;
    for (;;) {
      Fd fd(::socket(to.addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      CTR_REQUIRE(fd.get() >= 0, CTR_STATUS_COMM_ERROR, "rendezvous: socket: %s",
                  errno_text(errno).c_str());
      int rc = ::connect(fd.get(), reinterpret_cast<sockaddr *>(&to.addr), to.len);
      int e = rc == 0 ? 0 : errno;
      if (e == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        int n = ::poll(&p, 1, poll_timeout(deadline));
        socklen_t len = sizeof e;
        if (n == 1) {
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &e, &len);
        } else {
          e = ETIMEDOUT;
        }
      }
      if (e == 0) {
        set_nodelay(fd.get());
        fd_ = std::move(fd);
        loopback_ = is_loopback(to.addr);
        return;
      }
      err = errno_text(e);
      if (Clock::now() >= deadline) break;
      // Nothing signals that rank 0 has started listening, so back off and retry.
      ::poll(nullptr, 0, static_cast<int>(std::min<int64_t>(backoff_ms, ms_until(deadline))));
      backoff_ms = std::min<int64_t>(backoff_ms * 2, 250);
    }
    fail(CTR_STATUS_TIMEOUT,
         strformat("rendezvous: rank 0 (the store at %s) could not be reached within %s: %s",
                   where_.c_str(), seconds(cfg_.timeout_ms).c_str(), err.c_str()));
  }

  // Sends one request and returns the body of an OK reply; a server-side error
  // is thrown with the server's message. Holds mu_.
  std::string request(const std::string &frame, TimePoint deadline, const char *what) {
    CTR_REQUIRE(fd_.get() >= 0 && !broken_, CTR_STATUS_COMM_ERROR,
                "rendezvous: %s: the connection to the store at %s was lost earlier", what,
                where_.c_str());
    // Until a whole reply is read the stream position is unknown, so any exit
    // through an exception leaves the connection unusable.
    broken_ = true;
    size_t off = 0;
    while (off < frame.size()) {
      ssize_t n = ::send(fd_.get(), frame.data() + off, frame.size() - off, MSG_NOSIGNAL);
      if (n > 0) {
        off += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        wait_fd(POLLOUT, deadline, what);
        continue;
      }
      lost(what, n < 0 ? errno_text(errno) : "connection closed");
    }
    char head[4];
    read_exact(head, 4, deadline, what);
    uint32_t len = read_u32(head);
    CTR_REQUIRE(len >= 1 && len <= kMaxFrame, CTR_STATUS_COMM_ERROR,
                "rendezvous: %s: malformed reply from the store at %s", what, where_.c_str());
    std::string body(len, '\0');
    read_exact(body.data(), len, deadline, what);
    broken_ = false;
    auto status = static_cast<ctr_status>(static_cast<uint8_t>(body[0]));
    if (status != CTR_STATUS_OK) {
      Reader r(body.data() + 1, body.size() - 1);
      std::string msg = r.str();
      if (!r.ok())
        msg = strformat("rendezvous: %s failed (status %d)", what, static_cast<int>(status));
      fail(status, msg);
    }
    return body.substr(1);
  }

  void read_exact(char *p, size_t n, TimePoint deadline, const char *what) {
    size_t got = 0;
    while (got < n) {
      ssize_t r = ::recv(fd_.get(), p + got, n - got, 0);
      if (r > 0) {
        got += static_cast<size_t>(r);
        continue;
      }
      if (r == 0) lost(what, "connection closed by rank 0");
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) lost(what, errno_text(errno));
      wait_fd(POLLIN, deadline, what);
    }
  }

  void wait_fd(short events, TimePoint deadline, const char *what) {
    for (;;) {
      pollfd p{fd_.get(), events, 0};
      int n = ::poll(&p, 1, poll_timeout(deadline));
      if (n > 0) return;  // ready, or an error the next send/recv reports
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) lost(what, errno_text(errno));
      fail(CTR_STATUS_TIMEOUT, strformat("rendezvous: %s: the store at %s (rank 0) did not answer",
                                         what, where_.c_str()));
    }
  }

  [[noreturn]] void lost(const char *what, const std::string &why) {
    lost_ = true;
    fail(CTR_STATUS_COMM_ERROR, strformat("rendezvous: %s: lost the connection to the store at %s "
                                          "(rank 0): %s",
                                          what, where_.c_str(), why.c_str()));
  }

  void protocol_check(const Reader &r, const char *what) {
    CTR_REQUIRE(r.ok() && r.done(), CTR_STATUS_COMM_ERROR,
                "rendezvous: %s: malformed reply from the store at %s", what, where_.c_str());
  }

  RendezvousConfig cfg_;
  std::unique_ptr<StoreServer> server_;
  std::string where_;
  std::mutex mu_;  // one request in flight per connection
  Fd fd_;
  bool loopback_ = false;
  bool broken_ = false;
  bool lost_ = false;  // the last failure was the connection's loss, not a refusal
};

}  // namespace

// ------------------------------------------------------------------------------------------

std::unique_ptr<Store> store_join(const RendezvousConfig &cfg) {
  CTR_REQUIRE(cfg.world >= 1, CTR_STATUS_INVALID_ARGUMENT, "rendezvous: world size %d must be >= 1",
              cfg.world);
  CTR_REQUIRE(cfg.rank >= 0 && cfg.rank < cfg.world, CTR_STATUS_INVALID_ARGUMENT,
              "rendezvous: rank %d is out of range for %d ranks", cfg.rank, cfg.world);
  CTR_REQUIRE(cfg.port > 0 && cfg.port < 65536, CTR_STATUS_INVALID_ARGUMENT,
              "rendezvous: port %d is out of range", cfg.port);
  CTR_REQUIRE(cfg.timeout_ms >= 0, CTR_STATUS_INVALID_ARGUMENT,
              "rendezvous: negative timeout %lld ms", static_cast<long long>(cfg.timeout_ms));
  {
    Resolved to;
    std::string err;
    CTR_REQUIRE(resolve(cfg.addr, cfg.port, false, &to, &err), CTR_STATUS_INVALID_OPTION,
                "rendezvous: cannot resolve rank 0's address '%s': %s", cfg.addr.c_str(),
                err.c_str());
    CTR_REQUIRE(!cfg.token.empty() || cfg.allow_no_token || is_loopback(to.addr),
                CTR_STATUS_INVALID_OPTION,
                "rendezvous: rank 0's address %s is not a loopback address and the job has no "
                "token, so any process that reaches it could join: set CTR_JOB_TOKEN to the same "
                "secret on every rank (for example `export CTR_JOB_TOKEN=$(od -An -tx1 -N16 "
                "/dev/urandom | tr -d ' \\n')` before srun or torchrun), start the job with "
                "`ctr launch`, which sets one, or on a trusted isolated network set "
                "CTR_ALLOW_NO_TOKEN=1",
                sockaddr_text(to.addr).c_str());
  }
  std::unique_ptr<StoreServer> server;
  if (cfg.rank == 0) server = std::make_unique<StoreServer>(cfg);
  auto store = std::make_unique<TcpStore>(cfg, std::move(server));
  store->join();
  return store;
}

}  // namespace ctr
