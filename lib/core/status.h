// Errors inside libctr and their trip across the C boundary.
//
// Internally a failure is a thrown ctr::Error carrying a ctr_status and a message
// that names what is wrong and where. Every extern "C" entry point wraps its body
// in CTR_API_BEGIN / CTR_API_END, which turns an Error (or any other exception,
// as CTR_STATUS_INTERNAL) into a status code plus the thread's last-error text,
// so no exception ever reaches the host.
#pragma once

#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <utility>

#include "ctr/ctr.h"

namespace ctr {

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
std::string strformat(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void fail(ctr_status code, const std::string &msg);

// Records the message returned by ctr_last_error() on this thread.
void set_last_error(const std::string &msg);
void clear_last_error();

// Converts the exception in flight into a status (used by CTR_API_END).
ctr_status status_from_current_exception();

}  // namespace ctr

// Fails with `code` and a formatted message when cond is false.
#define CTR_REQUIRE(cond, code, ...)                            \
  do {                                                          \
    if (!(cond)) ::ctr::fail((code), ::ctr::strformat(__VA_ARGS__)); \
  } while (0)

// An internal invariant; a failure is a libctr bug and says where it happened.
#define CTR_CHECK(cond)                                                              \
  do {                                                                               \
    if (!(cond))                                                                     \
      ::ctr::fail(CTR_STATUS_INTERNAL,                                               \
                  ::ctr::strformat("internal check failed: %s (%s:%d)", #cond, __FILE__, \
                                   __LINE__));                                       \
  } while (0)

#define CTR_API_BEGIN \
  try {               \
    ::ctr::clear_last_error();
#define CTR_API_END                                  \
  }                                                  \
  catch (...) {                                      \
    return ::ctr::status_from_current_exception();   \
  }                                                  \
  return CTR_STATUS_OK;
