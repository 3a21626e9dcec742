// Shared host allocations (shared_host.h): a registry of memfd mappings, kept
// sorted by address so that a collective finds the allocation holding its
// buffer in one lookup.

#include "comm/shared_host.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <iterator>
#include <map>
#include <mutex>

namespace ctr {
namespace {

std::mutex g_mu;
std::atomic<bool> g_wanted{false};
std::map<uintptr_t, SharedHost> &registry() {
  static auto *r = new std::map<uintptr_t, SharedHost>;  // outlives every static destructor
  return *r;
}

}  // namespace

void *map_sealed_memfd(const char *name, size_t bytes, int *fd) {
  *fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (*fd < 0) return nullptr;
  void *p = MAP_FAILED;
  if (::fchmod(*fd, 0600) == 0 && ::ftruncate(*fd, static_cast<off_t>(bytes)) == 0 &&
      ::fcntl(*fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0)
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, *fd, 0);
  if (p == MAP_FAILED) {
    ::close(*fd);
    *fd = -1;
    return nullptr;
  }
  return p;
}

void *shared_host_alloc(size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t n = (bytes + page - 1) / page * page;
  if (n == 0) return nullptr;
  int fd = -1;
  void *p = map_sealed_memfd("ctr-host", n, &fd);
  if (!p) return nullptr;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::munmap(p, n);
    ::close(fd);
    return nullptr;
  }
  SharedHost s;
  s.base = reinterpret_cast<uintptr_t>(p);
  s.bytes = n;
  s.fd = fd;
  s.ino = static_cast<uint64_t>(st.st_ino);
  std::lock_guard<std::mutex> lock(g_mu);
  registry()[s.base] = s;
  return p;
}

bool shared_host_free(void *p) {
  SharedHost s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = registry().find(reinterpret_cast<uintptr_t>(p));
    if (it == registry().end()) return false;
    s = it->second;
    registry().erase(it);
  }
  ::munmap(p, s.bytes);
  ::close(s.fd);
  return true;
}

bool shared_host_wanted() { return g_wanted.load(std::memory_order_relaxed); }
void shared_host_set_wanted() { g_wanted.store(true, std::memory_order_relaxed); }

bool shared_host_find(const void *p, size_t bytes, SharedHost *out) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mu);
  auto &r = registry();
  auto it = r.upper_bound(a);
  if (it == r.begin()) return false;
  const SharedHost &s = std::prev(it)->second;
  if (a - s.base > s.bytes || bytes > s.bytes - (a - s.base)) return false;
  *out = s;
  return true;
}

}  // namespace ctr
