#include "comm/auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/status.h"

namespace ctr {

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::getrandom(out.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    CTR_REQUIRE(r > 0, CTR_STATUS_INTERNAL, "getrandom: %s", std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  return out;
}

namespace {

void append_part(std::string &msg, std::string_view part) {
  const auto n = static_cast<uint64_t>(part.size());
  for (int i = 0; i < 8; ++i) msg.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  msg.append(part);
}

}  // namespace

std::string job_mac(const std::string &token, std::string_view label, std::string_view a,
                    std::string_view b, std::string_view c) {
  std::string msg;
  for (std::string_view part : {label, a, b, c}) append_part(msg, part);
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  char digest[] = "SHA256";
  const unsigned char *key = reinterpret_cast<const unsigned char *>(token.data());
  CTR_REQUIRE(EVP_Q_mac(nullptr, "HMAC", nullptr, digest, nullptr, key, token.size(),
                        reinterpret_cast<const unsigned char *>(msg.data()), msg.size(), out,
                        sizeof out, &len) != nullptr &&
                  len == kMacBytes,
              CTR_STATUS_INTERNAL, "HMAC-SHA256 is not available from libcrypto");
  return std::string(reinterpret_cast<const char *>(out), len);
}

std::string sha256(std::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  CTR_REQUIRE(EVP_Digest(data.data(), data.size(), out, &len, EVP_sha256(), nullptr) == 1,
              CTR_STATUS_INTERNAL, "SHA-256 is not available from libcrypto");
  return std::string(reinterpret_cast<const char *>(out), len);
}

bool equal_secret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

namespace {

constexpr char kSealMagic[8] = {'c', 't', 'r', 's', 'e', 'a', 'l', '1'};

std::string seal_tag(const std::string &token, std::string_view label, std::string_view value) {
  if (!token.empty()) return job_mac(token, "ctr sealed record", label, value);
  std::string msg;
  append_part(msg, label);
  append_part(msg, value);
  return sha256(msg);
}

}  // namespace

std::string seal_record(const std::string &token, std::string_view label, std::string_view value) {
  std::string out(kSealMagic, sizeof kSealMagic);
  append_part(out, value);
  out += seal_tag(token, label, value);
  return out;
}

bool open_record(const std::string &token, std::string_view label, std::string_view record,
                 std::string *value, std::string *why) {
  constexpr size_t kHead = sizeof kSealMagic + 8;
  if (record.size() < kHead + kMacBytes) {
    *why = strformat("a record of %zu bytes is too short", record.size());
    return false;
  }
  if (record.compare(0, sizeof kSealMagic, std::string_view(kSealMagic, sizeof kSealMagic)) != 0) {
    *why = "not a sealed record";
    return false;
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<uint8_t>(record[sizeof kSealMagic + i])) << (8 * i);
  if (n != record.size() - kHead - kMacBytes) {
    *why = strformat("the record says %llu bytes but holds %zu", static_cast<unsigned long long>(n),
                     record.size() - kHead - kMacBytes);
    return false;
  }
  std::string_view v = record.substr(kHead, n);
  if (!equal_secret(record.substr(kHead + n), seal_tag(token, label, v))) {
    *why = token.empty() ? "its checksum does not match (damaged)"
                         : "its tag does not match this job's token (another job's, or tampered "
                           "with)";
    return false;
  }
  value->assign(v);
  return true;
}

bool is_loopback(const sockaddr_storage &addr) {
  if (addr.ss_family == AF_INET) {
    const auto *a = reinterpret_cast<const sockaddr_in *>(&addr);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (addr.ss_family == AF_INET6) {
    const in6_addr &a = reinterpret_cast<const sockaddr_in6 *>(&addr)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a)) return true;
    return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
  }
  return false;
}

namespace {

// How /proc/net/tcp{,6} spells an endpoint: the address as the kernel's 32-bit
// words in host order, then the port, all in upper-case hex.
std::string proc_endpoint(const sockaddr_storage &ss) {
  char buf[64];
  if (ss.ss_family == AF_INET) {
    const auto *a = reinterpret_cast<const sockaddr_in *>(&ss);
    std::snprintf(buf, sizeof buf, "%08X:%04X", a->sin_addr.s_addr, ntohs(a->sin_port));
    return buf;
  }
  const auto *a = reinterpret_cast<const sockaddr_in6 *>(&ss);
  uint32_t w[4];
  std::memcpy(w, &a->sin6_addr, sizeof w);
  std::snprintf(buf, sizeof buf, "%08X%08X%08X%08X:%04X", w[0], w[1], w[2], w[3],
                ntohs(a->sin6_port));
  return buf;
}

}  // namespace

long loopback_peer_uid(int fd) {
  sockaddr_storage mine{}, peer{};
  socklen_t ml = sizeof mine, pl = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr *>(&mine), &ml) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &pl) != 0)
    return -1;
  if (mine.ss_family != peer.ss_family || !is_loopback(peer)) return -1;
  // The other end's socket: its local endpoint is our peer and its remote one is us.
  const std::string want_local = proc_endpoint(peer), want_remote = proc_endpoint(mine);
  std::ifstream f(mine.ss_family == AF_INET ? "/proc/net/tcp" : "/proc/net/tcp6");
  std::string line;
  std::getline(f, line);  // the column header
  while (std::getline(f, line)) {
    std::istringstream in(line);
    std::string slot, local, remote, state, queues, timer, retransmits;
    long uid = -1;
    if (!(in >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid)) continue;
    if (local == want_local && remote == want_remote) return uid;
  }
  return -1;
}

}  // namespace ctr
