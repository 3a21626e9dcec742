// Creating and mapping a communicator's shared-memory segment (layout in
// shm_segment.h, protocol in shm.cc).
//
// Member 0 creates a memfd of mode 0600, sized and then sealed against growing
// and shrinking (no peer can truncate it under the others), and maps it; the
// others open it through /proc/PID/fd, which only the same user may, check its
// owner, mode, seals, size and a random key in its header, and map it. Then
// every descriptor is closed: the memory lives exactly as long as some member
// maps it, and nothing is left behind whatever happens to the processes. Two
// all-gathers over the group's UCX path carry the offer and the outcome, so
// that either every member attaches or none does.
//
// The offers also carry each member's pid, through which the engine maps the
// members' shared host allocations (shared_host.h) for collectives that read
// them in place; the outcome says whether every member allows that
// (CTR_SHM_DIRECT=0 declines).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "comm/shared_host.h"
#include "comm/shm.h"
#include "comm/shm_segment.h"
#include "core/status.h"

namespace ctr {
namespace {

using namespace shm;

// Creates the segment: a sealed memfd of mode 0600. Returns the descriptor
// (kept open until every member has mapped it), or -1.
int create_segment(size_t bytes, int n, const uint8_t key[16], Mapping *map) {
  int fd = -1;
  void *p = map_sealed_memfd("ctr-shm", bytes, &fd);
  if (!p) return -1;
  map->base = static_cast<char *>(p);
  map->bytes = bytes;
  auto *h = reinterpret_cast<SegHeader *>(p);
  h->magic = kMagic;
  std::memcpy(h->key, key, 16);
  h->members = static_cast<uint32_t>(n);
  h->buffers = kBuffers;
  h->buf_bytes = kBufBytes;
  h->seg_bytes = bytes;
  return fd;
}

// Maps member 0's segment through /proc, after checking that it is what member
// 0 announced: a sealed file of this user, mode 0600, of the expected size and
// with the key in its header.
bool open_segment(long pid, int fd_num, size_t bytes, int n, const uint8_t key[16],
                  Mapping *map) {
  if (!map_peer_file(pid, fd_num, bytes, 0, true, map).empty()) return false;
  const auto *h = reinterpret_cast<const SegHeader *>(map->base);
  return h->magic == kMagic && std::memcmp(h->key, key, 16) == 0 &&
         h->members == static_cast<uint32_t>(n) && h->buffers == kBuffers &&
         h->buf_bytes == kBufBytes && h->seg_bytes == bytes;
}

}  // namespace

namespace shm {

std::string map_peer_file(long pid, long fd_num, size_t bytes, uint64_t ino, bool writable,
                          Mapping *map) {
  const int fd = ::open(strformat("/proc/%ld/fd/%ld", pid, fd_num).c_str(),
                        (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return std::strerror(errno);
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() &&
                  (st.st_mode & 077) == 0 && (ino == 0 || static_cast<uint64_t>(st.st_ino) == ino) &&
                  st.st_size == static_cast<off_t>(bytes) && seals >= 0 &&
                  (seals & F_SEAL_SHRINK) && (seals & F_SEAL_SEAL);
  void *p = MAP_FAILED;
  if (ok)
    p = ::mmap(nullptr, bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
               writable ? MAP_SHARED | MAP_POPULATE : MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (!ok) return "it is not the sealed file of this user, mode 0600, that was announced";
  if (p == MAP_FAILED) return std::strerror(err);
  *map = Mapping{};
  map->base = static_cast<char *>(p);
  map->bytes = bytes;
  return "";
}

}  // namespace shm

namespace {

struct Offer {
  uint64_t magic;
  uint32_t willing;
  int32_t fd;
  int64_t pid;
  uint64_t bytes;
  uint8_t key[16];
};

}  // namespace

std::unique_ptr<ShmComm> shm_attach(const ShmSetup &s) {
  const int n = static_cast<int>(s.members.size());
  const char *env = std::getenv("CTR_SHM");
  const bool willing = !(env && std::strcmp(env, "0") == 0) && n >= 2 && n <= kMaxMembers;
  const size_t bytes = segment_bytes(n);
  Mapping map;
  int fd = -1;
  Offer mine{};
  mine.magic = kMagic;
  mine.pid = ::getpid();
  mine.bytes = bytes;
  if (s.me == 0 && willing && ::getrandom(mine.key, sizeof mine.key, 0) == sizeof mine.key)
    fd = create_segment(bytes, n, mine.key, &map);
  mine.willing = willing && (s.me != 0 || fd >= 0);
  mine.fd = fd;
  struct CloseFd {
    int fd;
    ~CloseFd() {
      if (fd >= 0) ::close(fd);
    }
  } close_fd{fd};

  std::vector<Offer> all(n);
  s.all_gather(&mine, all.data(), sizeof(Offer));
  bool go = true;
  for (const Offer &o : all) go = go && o.magic == kMagic && o.willing && o.bytes == bytes;
  uint32_t ok = go;
  if (go && s.me != 0)
    ok = open_segment(static_cast<long>(all[0].pid), all[0].fd, bytes, n, all[0].key, &map);
  // Bit 1: this member allows collectives that read shared host allocations in place.
  const char *direct_env = std::getenv("CTR_SHM_DIRECT");
  ok |= static_cast<uint32_t>(!(direct_env && std::strcmp(direct_env, "0") == 0)) << 1;
  std::vector<uint32_t> oks(n);
  s.all_gather(&ok, oks.data(), sizeof ok);
  bool direct = true;
  for (uint32_t o : oks) {
    if ((o & 1) != 1) return nullptr;
    direct = direct && (o & 2);
  }
  if (direct) shared_host_set_wanted();
  std::vector<pid_t> pids(n);
  for (int m = 0; m < n; ++m) pids[m] = static_cast<pid_t>(all[m].pid);
  return shm::make_engine(s, std::move(map), std::move(pids), direct);
}

}  // namespace ctr
