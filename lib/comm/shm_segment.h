// The layout of a communicator's shared-memory segment, and the mapping of it:
// shared by the engine (shm.cc) and the code that creates and maps segments
// (shm_segment.cc). Internal to lib/comm.
//
// A header page, one control block per member, then kBuffers data buffers of
// kBufBytes per member. Only counters and lengths are ever read from a peer's
// part, and each is checked before use; every offset is computed locally from
// these constants.
#pragma once

#include <sys/mman.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/shm.h"

namespace ctr::shm {

// Four buffers of 512 KiB per member: large enough that a round's fixed cost
// (two counter publications, a wakeup at worst) is small against its copy,
// small enough that a member's buffers stay in the cache between the writer
// and the readers.
constexpr uint32_t kBuffers = 4;
constexpr size_t kBufBytes = size_t{512} << 10;
// Larger groups on one host use the UCX path (the heads carry one length per member).
constexpr int kMaxMembers = 64;
constexpr uint64_t kMagic = 0x326d68732d727463ull;  // "ctr-shm2"
constexpr size_t kPage = 4096;

struct SegHeader {
  uint64_t magic;
  uint8_t key[16];
  uint32_t members, buffers;
  uint64_t buf_bytes, seg_bytes;
  alignas(64) uint32_t gen;       // futex word: bumped after every publication
  alignas(64) uint32_t sleepers;  // engines asleep on gen
};
static_assert(sizeof(SegHeader) <= kPage);

// Written by the buffer's owner before it publishes the round.
struct BufHead {
  uint32_t rounds;  // how many rounds the writer's collective needs
  uint32_t unused;
  uint64_t shape;   // the writer's collective: kind and size, compared by readers
  uint64_t len[kMaxMembers];  // bytes of each piece
};

struct MemberCtl {
  alignas(64) uint32_t posted;  // rounds this member has written
  alignas(64) uint32_t done;    // rounds this member has read
  alignas(64) BufHead head[kBuffers];
  // A large collective's buffers (shm.cc, run_direct): the shared host
  // allocations (shared_host.h) holding its send and out buffers, ino 0 for
  // neither, and the buffers' addresses in this member's address space: send
  // and out, or one send address per peer (all_to_all_v). Written when the
  // collective starts, once every member is done with every earlier round.
  struct Region {
    uint64_t ino, base, bytes;
    int64_t fd;
  };
  alignas(64) Region region[2];
  alignas(64) uint64_t addr[kMaxMembers];
};

constexpr size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }
constexpr size_t kCtlStride = align_up(sizeof(MemberCtl), kPage);

inline size_t segment_bytes(int n) {
  return kPage + n * kCtlStride + static_cast<size_t>(n) * kBuffers * kBufBytes;
}

// A mapped segment, unmapped when it goes.
struct Mapping {
  char *base = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping &) = delete;
  Mapping &operator=(const Mapping &) = delete;
  Mapping(Mapping &&o) noexcept : base(std::exchange(o.base, nullptr)), bytes(o.bytes) {}
  Mapping &operator=(Mapping &&o) noexcept {
    if (this != &o) {
      if (base) ::munmap(base, bytes);
      base = std::exchange(o.base, nullptr);
      bytes = o.bytes;
    }
    return *this;
  }
  ~Mapping() {
    if (base) ::munmap(base, bytes);
  }
};

// Maps another process's memfd through /proc/PID/fd/FD_NUM (the segment, or a
// shared host allocation) after checking that it is a regular file of this
// user, mode 0600, sealed against shrinking and growing, of exactly `bytes`,
// and of inode `ino` unless that is 0; writable maps it read-write and
// populated. Returns "" or why it could not.
std::string map_peer_file(long pid, long fd_num, size_t bytes, uint64_t ino, bool writable,
                          Mapping *map);

// The engine over a mapped segment; starts its thread. pids: each member's
// process; direct: every member allows large collectives to read shared host
// allocations in place.
std::unique_ptr<ShmComm> make_engine(const ShmSetup &s, Mapping map, std::vector<pid_t> pids,
                                     bool direct);

}  // namespace ctr::shm
