// Last-error bookkeeping and status names (see status.h).

#include "core/status.h"

#include <cstdarg>
#include <vector>

namespace ctr {
namespace {
thread_local std::string t_last_error;
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

void set_last_error(const std::string &msg) { t_last_error = msg; }
void clear_last_error() { t_last_error.clear(); }
const std::string &last_error() { return t_last_error; }

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
