// Last-error bookkeeping and status names (see status.h).

#include "core/status.h"

#include <cstdarg>
#include <cstring>
#include <vector>

namespace ctr {
namespace {
// A fixed buffer, not a std::string: it has no destructor, so a ctr_* call made
// from a host's static destructor at exit (after this thread's thread_local
// objects with destructors are gone) still finds it intact. Longer messages
// are cut, marked as such.
constexpr size_t kLastErrorCap = 16384;
thread_local char t_last_error[kLastErrorCap];
}

std::string strformat(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out;
  if (n > 0) {
    out.resize(static_cast<size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), fmt, ap2);
    out.resize(static_cast<size_t>(n));
  }
  va_end(ap2);
  return out;
}

void fail(ctr_status code, const std::string &msg) { throw Error(code, msg); }

void set_last_error(const std::string &msg) {
  static constexpr char kCut[] = " ... (message cut)";
  size_t n = msg.size();
  if (n < kLastErrorCap) {
    std::memcpy(t_last_error, msg.data(), n);
  } else {
    n = kLastErrorCap - sizeof(kCut);
    std::memcpy(t_last_error, msg.data(), n);
    std::memcpy(t_last_error + n, kCut, sizeof(kCut) - 1);
    n += sizeof(kCut) - 1;
  }
  t_last_error[n] = '\0';
}
void clear_last_error() { t_last_error[0] = '\0'; }
const char *last_error() { return t_last_error; }

ctr_status status_from_current_exception() {
  try {
    throw;
  } catch (const Error &e) {
    set_last_error(e.message());
    return e.code();
  } catch (const std::bad_alloc &) {
    set_last_error("out of memory");
    return CTR_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception &e) {
    set_last_error(std::string("internal error: ") + e.what());
    return CTR_STATUS_INTERNAL;
  } catch (...) {
    set_last_error("internal error: unknown exception");
    return CTR_STATUS_INTERNAL;
  }
}

}  // namespace ctr
