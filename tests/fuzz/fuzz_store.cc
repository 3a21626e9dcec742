// libFuzzer target: bytes sent to the rendezvous store by a peer, before and
// after admission.
//
// Every input meets a fresh store of a three-rank job: rank 0 runs through
// ctr::store_join on a thread, as any rank 0 does, and serves a free local port.
// The first byte of the input picks who sends the rest:
//
//   even  a stranger, on a new connection that has not been admitted (frames of
//         any length, HELLOs of any protocol, PROOFs out of turn, ...);
//   odd   rank 1 itself, over a connection the harness has taken through the
//         whole admission (HELLO with a nonce, rank 0's tag checked, PROOF with
//         the job token's tag), so the bytes reach the requests only admitted
//         ranks may make (JOIN, SET, GET, ADD, BARRIER, HEARTBEAT, FAILURE).
//
// Then the store must still be serving: a HELLO of another protocol version is
// refused with a reply (the server reads its connections in the order they were
// opened, so once that refusal arrives the input has been handled), rank 1 is
// admitted by the harness if the input was a stranger's, and rank 2 joins
// through ctr::store_join, which ends rank 0's join. Any other outcome within
// kAnswerMs is a finding. The three-rank world keeps the store listening while
// the input and the probe run (it stops listening once every rank has joined).
//
// The wire format is in lib/comm/store.cc; tests/fuzz/make_corpus.py writes seed
// inputs. All socket calls have deadlines: no input can hang the harness itself.
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
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>

#include "comm/auth.h"
#include "comm/comm.h"
#include "fuzz_common.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char *kToken = "fuzz-token";
constexpr const char *kProtocol = "ctr-rendezvous/3";  // as lib/comm/store.cc speaks
constexpr int kWorld = 3;
// How long the store may take to answer the harness at any point before it
// counts as stuck; below libFuzzer's -timeout, so that the finding names itself.
constexpr int kAnswerMs = 5000;

int free_port() {
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

ctr::RendezvousConfig config(int rank, int port) {
  ctr::RendezvousConfig cfg;
  cfg.rank = rank;
  cfg.world = kWorld;
  cfg.addr = "127.0.0.1";
  cfg.port = port;
  cfg.token = kToken;
  cfg.timeout_ms = kAnswerMs;
  return cfg;
}

// ------------------------------------------------------------------------------------------
// Frames

void put_u32(std::string &s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_i64(std::string &s, int64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
}
void put_str(std::string &s, const std::string &v) {
  put_u32(s, static_cast<uint32_t>(v.size()));
  s += v;
}
std::string frame(const std::string &body) {
  std::string f;
  put_u32(f, static_cast<uint32_t>(body.size()));
  return f + body;
}

std::string hello(const std::string &protocol, int rank, const std::string &nonce) {
  std::string body(1, '\x01');  // HELLO
  put_str(body, protocol);
  put_i64(body, rank);
  put_i64(body, kWorld);
  put_str(body, nonce);
  return frame(body);
}

// ------------------------------------------------------------------------------------------
// Client side, every call bounded

class Socket {
 public:
  Socket() = default;
  Socket(const Socket &) = delete;
  Socket &operator=(const Socket &) = delete;
  ~Socket() { close(); }

  void close() {
    if (fd_ < 0) return;
    // Reset rather than close gracefully: no TIME_WAIT pile-up over many
    // thousands of connections.
    linger l{1, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd_);
    fd_ = -1;
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
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Sends what the server takes; a server that closed or stopped reading ends it.
  void send_all(const std::string &s) { send_all(reinterpret_cast<const uint8_t *>(s.data()), s.size()); }
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

  // One whole reply frame (its body), or nothing by the deadline.
  bool read_frame(std::string *body, Clock::time_point deadline) {
    const std::string head = read_some(4, deadline);
    if (head.size() != 4) return false;
    uint32_t n = 0;
    for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(head[i])) << (8 * i);
    if (n == 0 || n > (1u << 20)) return false;
    *body = read_some(n, deadline);
    return body->size() == n;
  }

 private:
  int fd_ = -1;
};

// Reads a string field of a reply at *pos.
bool take_str(const std::string &b, size_t *pos, std::string *out) {
  if (b.size() - *pos < 4) return false;
  uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<uint32_t>(static_cast<uint8_t>(b[*pos + i])) << (8 * i);
  *pos += 4;
  if (b.size() - *pos < n) return false;
  *out = b.substr(*pos, n);
  *pos += n;
  return true;
}

// Takes `s` through admission as `rank`, as a real rank does; a store that does
// not admit it is a finding.
void admit(Socket &s, int rank, Clock::time_point deadline) {
  const std::string nonce_c = ctr::random_bytes(ctr::kNonceBytes);
  s.send_all(hello(kProtocol, rank, nonce_c));
  std::string reply, nonce_s, tag;
  size_t pos = 1;
  if (!s.read_frame(&reply, deadline) || reply[0] != CTR_STATUS_OK || !take_str(reply, &pos, &nonce_s) ||
      !take_str(reply, &pos, &tag))
    fuzz::fail("the rendezvous store did not answer rank " + std::to_string(rank) + "'s HELLO");
  if (!ctr::equal_secret(tag, ctr::job_mac(kToken, "ctr store: rank 0", nonce_c, nonce_s, std::to_string(rank))))
    fuzz::fail("rank 0's tag in its answer to HELLO does not prove the job token");
  std::string proof(1, '\x07');  // PROOF
  put_str(proof, ctr::job_mac(kToken, "ctr store: rank", nonce_s, nonce_c, std::to_string(rank)));
  s.send_all(frame(proof));
  if (!s.read_frame(&reply, deadline) || reply[0] != CTR_STATUS_OK)
    fuzz::fail("the rendezvous store refused rank " + std::to_string(rank) + "'s PROOF");
}

// A HELLO the store must refuse with a reply: another protocol version.
void expect_refusal(int port, Clock::time_point deadline) {
  Socket check;
  if (!check.connect_to(port, deadline))
    fuzz::fail("the rendezvous store on port " + std::to_string(port) + " stopped accepting connections");
  check.send_all(hello("ctr-rendezvous/0", 2, std::string(ctr::kNonceBytes, 'n')));
  std::string reply;
  if (!check.read_frame(&reply, deadline))
    fuzz::fail("the rendezvous store did not answer within " + std::to_string(kAnswerMs) + " ms");
  if (static_cast<uint8_t>(reply[0]) != CTR_STATUS_COMM_ERROR)
    fuzz::fail("the rendezvous store answered a HELLO of another protocol with status " +
               std::to_string(static_cast<uint8_t>(reply[0])));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const bool as_rank = data[0] & 1;
  ++data;
  --size;
  const int port = free_port();
  const auto deadline = Clock::now() + std::chrono::milliseconds(kAnswerMs);

  std::unique_ptr<ctr::Store> rank0;
  std::string rank0_error;
  std::thread server([&] {
    try {
      rank0 = ctr::store_join(config(0, port));
    } catch (const std::exception &e) {
      rank0_error = e.what();
    }
  });

  Socket rank1;
  if (!rank1.connect_to(port, deadline)) fuzz::fail("the rendezvous store does not accept connections");
  Socket stranger;
  if (as_rank) {
    admit(rank1, 1, deadline);
    rank1.send_all(data, size);
  } else {
    if (!stranger.connect_to(port, deadline)) fuzz::fail("the rendezvous store does not accept connections");
    stranger.send_all(data, size);
  }
  expect_refusal(port, deadline);
  if (!as_rank) admit(rank1, 1, deadline);

  std::string rank2_error;
  try {
    auto rank2 = ctr::store_join(config(2, port));
  } catch (const std::exception &e) {
    rank2_error = e.what();
  }
  rank1.close();
  stranger.close();
  server.join();
  if (!rank2_error.empty()) fuzz::fail("rank 2 could not join after the input: " + rank2_error);
  if (!rank0_error.empty()) fuzz::fail("rank 0's join failed after the input: " + rank0_error);
  rank0.reset();
  return 0;
}
