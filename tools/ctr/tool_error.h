// The ctr tool's own failures, formatting and file reading: it is a host of
// the C ABI (include/ctr/ctr.h), so it uses nothing of the library's inside.
#pragma once

#include <cstddef>
#include <exception>
#include <string>

#include "ctr/ctr.h"

namespace ctr_tool {

// A failure carrying the status the tool exits with (see main.cc).
class Error : public std::exception {
 public:
  Error(ctr_status code, std::string msg) : code_(code), msg_(std::move(msg)) {}
  ctr_status code() const { return code_; }
  const char *what() const noexcept override { return msg_.c_str(); }
  const std::string &message() const { return msg_; }

 private:
  ctr_status code_;
  std::string msg_;
};

// printf-style formatting into a std::string.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void fail(ctr_status code, const std::string &msg);

// The whole of a regular file of at most max_bytes bytes; a FIFO, device or
// directory is refused at once (never waited on), naming `what`.
std::string read_regular_file(const std::string &path, const char *what, ctr_status code,
                              size_t max_bytes = size_t{1} << 30);

}  // namespace ctr_tool
