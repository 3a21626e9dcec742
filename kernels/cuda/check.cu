// The CUDA backend's sticky error: the first failed CUDA, cuBLASLt or launch
// status of the process (kernels/cuda/check.cuh).

#include <atomic>
#include <cstdio>
#include <mutex>
#include <string>

#include "cuda/check.cuh"

namespace ctr::cuda {
namespace {

std::mutex g_mu;
std::atomic<bool> g_failed{false};
std::string g_first;   // under g_mu
long g_later = 0;      // failures after the first (under g_mu)

const char *base_name(const char *file) {
  const char *b = file;
  for (const char *p = file; *p; ++p)
    if (*p == '/') b = p + 1;
  return b;
}

}  // namespace

void note_error(const char *what, const char *file, int line, const char *detail) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_failed.load(std::memory_order_relaxed)) {
    ++g_later;
    return;
  }
  char buf[768];
  std::snprintf(buf, sizeof buf, "%s failed at %s:%d: %s", what, base_name(file), line, detail ? detail : "");
  g_first = buf;
  g_failed.store(true, std::memory_order_release);
}

bool has_error() { return g_failed.load(std::memory_order_acquire); }

int error_message(char *buf, size_t size) {
  if (!has_error()) return 0;
  std::lock_guard<std::mutex> lock(g_mu);
  std::string msg = g_first;
  if (g_later) msg += " (and " + std::to_string(g_later) + " later CUDA failure" + (g_later > 1 ? "s" : "") + ")";
  if (buf && size) std::snprintf(buf, size, "%s", msg.c_str());
  return 1;
}

void clear_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_first.clear();
  g_later = 0;
  g_failed.store(false, std::memory_order_release);
}

bool check_cublas(cublasStatus_t s, const char *what, const char *file, int line) {
  if (s == CUBLAS_STATUS_SUCCESS) return true;
  char detail[160];
  std::snprintf(detail, sizeof detail, "%s (cuBLAS status %d)", cublasLtGetStatusString(s), static_cast<int>(s));
  note_error(what, file, line, detail);
  return false;
}

}  // namespace ctr::cuda
