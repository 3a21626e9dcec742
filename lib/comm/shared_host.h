// Host memory that the other processes of this host's communicators can read
// in place. A collective whose buffers all lie in such memory, on every member
// of a shared-memory group, moves each byte once, straight from a member's
// buffer into another's (lib/comm/shm.cc); other buffers go through the
// group's segment, in two copies.
//
// Each allocation is its own memfd of mode 0600, sealed at its size, mapped
// shared. Its descriptor stays open while it lives, so that the group's other
// members can map it (read only) through /proc/PID/fd, as they map the segment.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ctr {

// A shared allocation: where it is in this process and how a peer finds it.
struct SharedHost {
  uintptr_t base = 0;
  size_t bytes = 0;
  int fd = -1;       // open while the allocation lives
  uint64_t ino = 0;  // the memfd's inode: names it among the process's files
};

// A new memfd named `name` of mode 0600 and `bytes` (a multiple of the page
// size), sealed against growing and shrinking (no process can truncate it
// under another that maps it), mapped read-write, shared and populated; its
// descriptor in *fd. Null (and nothing left open) on failure. Also maps the
// shared-memory segments (shm_segment.cc).
void *map_sealed_memfd(const char *name, size_t bytes, int *fd);

// Zeroed memory of `bytes` (rounded up to pages), page-aligned, or null when
// the system refuses (no memfd, out of descriptors or memory): the caller then
// allocates ordinary memory.
void *shared_host_alloc(size_t bytes);
// Frees what shared_host_alloc returned; false (and nothing done) for any other pointer.
bool shared_host_free(void *p);
// The shared allocation holding [p, p + bytes), if there is one.
bool shared_host_find(const void *p, size_t bytes, SharedHost *out);

// Whether a communicator of this process reads shared host allocations in
// place: set once one attaches that way. Until then an allocator gains
// nothing from them (their first touch costs more than private memory's).
bool shared_host_wanted();
void shared_host_set_wanted();

}  // namespace ctr
