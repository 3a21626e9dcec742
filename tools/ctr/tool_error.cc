#include "tool_error.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <vector>

namespace ctr_tool {

std::string format(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  va_list again;
  va_copy(again, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out;
  if (n > 0) {
    std::vector<char> buf(static_cast<size_t>(n) + 1);
    std::vsnprintf(buf.data(), buf.size(), fmt, again);
    out.assign(buf.data(), static_cast<size_t>(n));
  }
  va_end(again);
  return out;
}

void fail(ctr_status code, const std::string &msg) { throw Error(code, msg); }

std::string read_regular_file(const std::string &path, const char *what, ctr_status code, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) fail(code, format("%s: cannot open %s: %s", path.c_str(), what, std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail(code, format("%s: cannot read %s: %s", path.c_str(), what, std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(code, format("%s: %s is not a regular file", path.c_str(), what));
  }
  if (static_cast<unsigned long long>(st.st_size) > max_bytes) {
    ::close(fd);
    fail(code, format("%s: %s is %lld bytes, more than the %zu allowed", path.c_str(), what,
                      static_cast<long long>(st.st_size), max_bytes));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t r = ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const int e = r < 0 ? errno : 0;
      ::close(fd);
      fail(code, r < 0 ? format("%s: cannot read %s: %s", path.c_str(), what, std::strerror(e))
                       : format("%s: %s shrank while it was read", path.c_str(), what));
    }
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  return out;
}

}  // namespace ctr_tool
