// Who may take part in a job: the job token's message authentication, and the
// checks that stand in for a token on loopback.
//
// A job token is a shared secret; it never crosses the wire. Rank 0's store and
// each rank prove to each other that they hold it by exchanging nonces and
// HMAC-SHA256 tags (see store.cc), and whatever a rank publishes for the others
// to act on without further checks (its transport address) is tagged with it,
// so a stranger can neither join nor feed a rank data it would act on.
//
// A job without a token is allowed only on loopback, where the kernel can say
// which user owns the other end of a connection: then only processes of the
// same user are accepted (they could read this process's memory anyway).
#pragma once

#include <sys/socket.h>

#include <string>
#include <string_view>

namespace ctr {

constexpr size_t kMacBytes = 32;    // HMAC-SHA256
constexpr size_t kNonceBytes = 16;

// n bytes from the kernel's random source.
std::string random_bytes(size_t n);

// HMAC-SHA256 keyed by token over label, then each part with its length, so
// that different splits of the same bytes give different tags.
std::string job_mac(const std::string &token, std::string_view label, std::string_view a,
                    std::string_view b = {}, std::string_view c = {});

// SHA-256 of data (an integrity check where there is no token).
std::string sha256(std::string_view data);

// Compares without an early exit, so the time taken says nothing about how much
// of a guessed value was right.
bool equal_secret(std::string_view a, std::string_view b);

// A value a rank publishes for others to act on, sealed: magic, length, the
// value, and a tag over label and value (HMAC with the token, or SHA-256 for a
// tokenless job, which then guards against damage only). label binds the
// record to its purpose and owner (for example "ucx address, rank 3").
std::string seal_record(const std::string &token, std::string_view label, std::string_view value);

// The value of a sealed record, or nothing with the reason in *why: too short,
// not a record, a length that disagrees with its size, or a tag that does not
// match (another job's, tampered with, or damaged).
bool open_record(const std::string &token, std::string_view label, std::string_view record,
                 std::string *value, std::string *why);

// Whether an address is a loopback address (127.0.0.0/8, ::1, or ::ffff:127.x).
bool is_loopback(const sockaddr_storage &addr);

// The user id owning the other end of a connected TCP socket whose both ends
// are on this host (found through /proc/net/tcp and tcp6); -1 when it cannot be
// told.
long loopback_peer_uid(int fd);

}  // namespace ctr
