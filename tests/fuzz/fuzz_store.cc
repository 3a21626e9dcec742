// libFuzzer target: arbitrary bytes sent to the rendezvous store as a peer would.
//
// Rank 0 of a two-rank job runs in a background thread through ctr::store_join,
// as any rank 0 does, and serves the store on a free local port. Each input goes
// out over a fresh TCP connection; the store must keep serving whatever arrives
// (frames of any length, requests before HELLO, wrong tokens, ranks out of range,
// half-written frames, requests that park until a deadline).
//
// To know when the server is done with an input without waiting for a timeout,
// a second connection then sends a HELLO with a wrong job token, which the
// server always refuses with a reply. The server reads its connections in the
// order they were opened, so once that refusal arrives the input has been read
// and handled. A probe that a server on its way out closes unanswered is sent
// again; no refusal within kAnswerMs means nothing serves the port any more,
// which is a finding, and so is any other answer to a wrong token.
//
// A HELLO with the right token takes its rank for the life of the server (a rank
// that left cannot come back under the same number), after which the same input
// would only be refused. So once rank 1 has joined, rank 0 leaves and a new
// server is started before the next input; every input meets a store in which
// only rank 0 has joined.
//
// The wire format is in lib/comm/store.cc; tests/fuzz/make_corpus.py writes seed
// frames. All socket calls have deadlines: no input can hang the harness itself.
//
//   FUZZ_TARGETS=store FUZZ_SECONDS=600 tools/sanitize.sh fuzz  (README: Hardening)

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/comm.h"
#include "fuzz_common.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char *kToken = "fuzz-token";
// How long a server may take to accept a connection and refuse the probe
// (rank 0 restarting included) before it counts as stuck; below libFuzzer's
// -timeout, so that the finding names itself.
constexpr int kAnswerMs = 5000;

// ------------------------------------------------------------------------------------------
// Rank 0

class RankZero {
 public:
  RankZero() : port_(free_port()) {
    // Detached and never destroyed: the server lives until the process exits.
    std::thread([this] { serve(); }).detach();
  }

  int port() const { return port_; }

  // Before an input: if rank 1 joined the current server, has rank 0 leave and
  // start a fresh server, and waits until the old one is gone.
  void ensure_fresh() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!joined_) return;
    restart_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return !restart_; });
  }

 private:
  static int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) != 0)
      std::abort();
    ::close(fd);
    return ntohs(a.sin_port);
  }

  void serve() {
    ctr::RendezvousConfig cfg;
    cfg.rank = 0;
    cfg.world = 2;
    cfg.addr = "127.0.0.1";
    cfg.port = port_;
    cfg.token = kToken;
    cfg.timeout_ms = int64_t{1} << 40;  // wait for rank 1 as long as the run lasts
    for (;;) {
      std::unique_ptr<ctr::Store> store;
      try {
        store = ctr::store_join(cfg);  // returns once an input joined as rank 1
      } catch (const std::exception &) {
        // An input took rank 0 before rank 0 itself said HELLO, and the server
        // is gone already: start over at once.
        continue;
      }
      std::unique_lock<std::mutex> lock(mu_);
      joined_ = true;
      cv_.wait(lock, [this] { return restart_; });
      lock.unlock();
      store.reset();  // closes rank 0's connection and stops the server
      lock.lock();
      joined_ = false;
      restart_ = false;
      cv_.notify_all();
    }
  }

  const int port_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool joined_ = false;
  bool restart_ = false;
};

// ------------------------------------------------------------------------------------------
// Client side, every call bounded

class Socket {
 public:
  Socket() = default;
  Socket(const Socket &) = delete;
  Socket &operator=(const Socket &) = delete;
  ~Socket() {
    if (fd_ < 0) return;
    // Reset rather than close gracefully: no TIME_WAIT pile-up over millions of
    // connections.
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd_);
  }

  // Connects to 127.0.0.1:port, retrying refusals (a server starting) until
  // the deadline.
  bool connect_to(int port, Clock::time_point deadline) {
    for (;;) {
      fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd_ < 0) std::abort();
      int one = 1;
      ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(port));
      if (::connect(fd_, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0) {
        timeval tv{0, 200 * 1000};  // no single send may block longer
        ::setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        return true;
      }
      ::close(fd_);
      fd_ = -1;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  // Sends what the server takes; a server that closed or stopped reading ends it.
  void send_all(const uint8_t *p, size_t n) {
    while (n > 0) {
      ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return;
      p += k;
      n -= static_cast<size_t>(k);
    }
  }

  // Reads until n bytes arrived, the peer closed, or the deadline passed.
  std::string read_some(size_t n, Clock::time_point deadline) {
    std::string out;
    char buf[4096];
    while (out.size() < n) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      ssize_t k = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) break;
      out.append(buf, static_cast<size_t>(k));
    }
    return out;
  }

  // Reads and drops whatever has already arrived.
  void drain() {
    char buf[4096];
    while (::recv(fd_, buf, sizeof buf, MSG_DONTWAIT) > 0) {
    }
  }

 private:
  int fd_ = -1;
};

// A HELLO the server must refuse: a token of the right length but wrong bytes.
std::string refused_hello() {
  std::string body;
  body.push_back(1);  // HELLO
  const std::string token(std::char_traits<char>::length(kToken), 'x');
  for (int i = 0; i < 4; ++i) body.push_back(static_cast<char>((token.size() >> (8 * i)) & 0xff));
  body += token;
  for (int64_t v : {int64_t{1}, int64_t{2}})  // rank, world
    for (int i = 0; i < 8; ++i) body.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  std::string frame;
  for (int i = 0; i < 4; ++i) frame.push_back(static_cast<char>((body.size() >> (8 * i)) & 0xff));
  return frame + body;
}

// Sends the probe until a server refuses it or the deadline passes; whether one
// did. A server that refuses it in any other way is a finding.
bool probe_refused(int port, const std::string &probe, Clock::time_point deadline) {
  while (Clock::now() < deadline) {
    Socket check;
    if (!check.connect_to(port, deadline)) return false;
    check.send_all(reinterpret_cast<const uint8_t *>(probe.data()), probe.size());
    // A refusal: u32 length, status COMM_ERROR, u32 length, message.
    const std::string head = check.read_some(5, deadline);
    if (head.size() == 5) {
      const int status = static_cast<uint8_t>(head[4]);
      if (status == CTR_STATUS_COMM_ERROR) return true;
      fuzz::fail("the rendezvous server answered a HELLO with a wrong job token with status " +
                 std::to_string(status));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static RankZero *rank0 = new RankZero;
  static const std::string probe = refused_hello();
  rank0->ensure_fresh();

  Socket input;
  if (!input.connect_to(rank0->port(), Clock::now() + std::chrono::milliseconds(kAnswerMs)))
    fuzz::fail("the rendezvous server on port " + std::to_string(rank0->port()) +
               " does not accept connections");
  input.send_all(data, size);
  if (!probe_refused(rank0->port(), probe, Clock::now() + std::chrono::milliseconds(kAnswerMs)))
    fuzz::fail("the rendezvous server did not answer within " + std::to_string(kAnswerMs) + " ms");
  input.drain();
  return 0;
}
