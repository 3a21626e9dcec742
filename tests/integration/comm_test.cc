// One rank of the communicator test; run_comm.py starts N of them.
//
// Every rank derives every other rank's input from (rank, index, salt), so each
// can compute the serial reference of a collective by itself and compare its own
// result exactly. Integer-valued inputs keep float sums exact whatever the order
// of reduction, so float results are compared bit for bit as well; a second
// all_reduce on non-integer floats checks that all ranks got the same bits, by
// all-gathering a hash of the result.
//
//   comm_test            every collective, dtype (bf16 too) and size; send/recv; splits; late and
//                        out-of-order waits; many small ones
//   comm_test shared     only the checks on shared host allocations
//   comm_test token      the last rank presents a wrong job token: it is refused,
//                        the others time out naming it
//   comm_test missing    world 3 with ranks 0 and 1 started: the join times out
//                        naming rank 2
//   comm_test dead       the last rank exits after joining; the next collective
//                        of the others fails naming it, within the timeout
//   comm_test dead-mid   the last rank exits in the middle of a large all_reduce;
//                        the others' fails naming it, within the timeout
//   comm_test dead-mid-shared  the same on shared host allocations (read in place)
//   comm_test hang       the last rank lives but skips a barrier: the others
//                        time out naming it; everyone then shuts down promptly
//   comm_test p2p-hang   rank 0 waits on a recv the last rank never sends: it
//                        times out naming that rank
//   comm_test server-dead  rank 0 (the store) exits after the join: the others'
//                        store requests fail at once instead of waiting
//
// Configuration comes from CTR_RANK, CTR_WORLD_SIZE, CTR_MASTER_ADDR,
// CTR_MASTER_PORT, CTR_JOB_TOKEN and CTR_TIMEOUT_MS. CTR_TEST_PATH=shm or ucx
// says which data path the communicators of several local ranks must take
// (the shared-memory segment, or UCX alone under CTR_SHM=0); it is checked,
// and so is whether large collectives on shared host allocations read them in
// place (not where some rank has CTR_SHM_DIRECT=0: CTR_TEST_DIRECT=0 tells
// the others).
// Exit status 0 means every check passed (for the failure modes: the expected
// failure was seen).

#include "comm/comm.h"
#include "comm/shared_host.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace {

using ctr::Comm;
using ctr::CommWork;
using ctr::ReduceOp;

int g_rank = -1;
bool g_expect_shm = false;  // CTR_TEST_PATH=shm

[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "comm_test: rank %d: FAIL: ", g_rank);
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n");
  va_end(ap);
  std::fflush(stderr);
  std::_Exit(1);
}

#define CHECK(cond, ...)           \
  do {                             \
    if (!(cond)) die(__VA_ARGS__); \
  } while (0)

// Where the checks' data buffers live: ordinary memory, or shared host
// allocations (comm/shared_host.h), which the shared-memory path reads in
// place. kSharedMixed: shared on rank 0 only, so that a group never finds all
// of its buffers shared and every collective must take the segment.
enum class Buffers { kPlain, kShared, kSharedMixed };
Buffers g_buffers = Buffers::kPlain;

template <typename T>
struct TestAlloc {
  using value_type = T;
  TestAlloc() = default;
  template <typename U>
  TestAlloc(const TestAlloc<U> &) {}
  T *allocate(size_t n) {
    const bool shared = g_buffers == Buffers::kShared ||
                        (g_buffers == Buffers::kSharedMixed && g_rank == 0);
    void *p = shared ? ctr::shared_host_alloc(n * sizeof(T)) : std::malloc(n * sizeof(T));
    CHECK(p, "could not allocate %zu bytes%s", n * sizeof(T), shared ? " of shared host memory" : "");
    return static_cast<T *>(p);
  }
  void deallocate(T *p, size_t) {
    if (!ctr::shared_host_free(p)) std::free(p);
  }
  bool operator==(const TestAlloc &) const { return true; }
};
// A data buffer of the checks.
template <typename T>
using Buf = std::vector<T, TestAlloc<T>>;

struct Env {
  int rank = 0, world = 1, port = 29500;
  std::string addr = "127.0.0.1", token;
  int64_t timeout_ms = 30000;
};

Env read_env() {
  Env e;
  auto get = [](const char *name) -> const char * {
    const char *v = std::getenv(name);
    return v && *v ? v : nullptr;
  };
  if (auto v = get("CTR_RANK")) e.rank = std::atoi(v);
  if (auto v = get("CTR_WORLD_SIZE")) e.world = std::atoi(v);
  if (auto v = get("CTR_MASTER_ADDR")) e.addr = v;
  if (auto v = get("CTR_MASTER_PORT")) e.port = std::atoi(v);
  if (auto v = get("CTR_JOB_TOKEN")) e.token = v;
  if (auto v = get("CTR_TIMEOUT_MS")) e.timeout_ms = std::atoll(v);
  return e;
}

ctr::RendezvousConfig rendezvous(const Env &e) {
  ctr::RendezvousConfig cfg;
  cfg.rank = e.rank;
  cfg.world = e.world;
  cfg.addr = e.addr;
  cfg.port = e.port;
  cfg.token = e.token;
  cfg.timeout_ms = e.timeout_ms;
  return cfg;
}

double elapsed_s(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs fn, which must throw ctr::Error with `code` and a message containing
// every one of `needles`; returns the message.
template <typename F>
std::string expect_error(const char *what, ctr_status code, std::vector<std::string> needles,
                         F fn) {
  try {
    fn();
  } catch (const ctr::Error &e) {
    CHECK(e.code() == code, "%s: expected status %d, got %d: %s", what, code, e.code(), e.what());
    for (auto &n : needles)
      CHECK(e.message().find(n) != std::string::npos, "%s: message lacks '%s': %s", what, n.c_str(),
            e.what());
    return e.message();
  }
  die("%s: expected an error, got success", what);
}

uint64_t fnv1a(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<const uint8_t *>(p)[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Small integers: sums of a few ranks stay exact in every dtype.
template <typename T>
T input(int rank, size_t i, uint32_t salt) {
  uint64_t h = mix((uint64_t{static_cast<uint32_t>(rank)} << 40) ^ (uint64_t{salt} << 32) ^ i);
  return static_cast<T>(static_cast<int>(h % 201) - 100);
}

uint8_t byte_at(int rank, size_t i, uint32_t salt) {
  return static_cast<uint8_t>(
      mix((uint64_t{static_cast<uint32_t>(rank)} << 40) ^ (uint64_t{salt} << 32) ^ i));
}

template <typename T>
T combine(ReduceOp op, T a, T b) {
  switch (op) {
    case ReduceOp::Max:
      return std::max(a, b);
    case ReduceOp::Min:
      return std::min(a, b);
    default:
      return static_cast<T>(a + b);
  }
}

// The serial reference: element i reduced over the ranks listed, in rank order.
template <typename T>
T reference(ReduceOp op, const std::vector<int> &ranks, size_t i, uint32_t salt) {
  T acc = input<T>(ranks[0], i, salt);
  for (size_t k = 1; k < ranks.size(); ++k) acc = combine(op, acc, input<T>(ranks[k], i, salt));
  if (op == ReduceOp::Avg) acc = static_cast<T>(acc / static_cast<T>(ranks.size()));
  return acc;
}

const char *op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

template <typename T>
const char *type_name();
template <>
const char *type_name<float>() {
  return "f32";
}
template <>
const char *type_name<double>() {
  return "f64";
}
template <>
const char *type_name<int32_t>() {
  return "i32";
}
template <>
const char *type_name<int64_t>() {
  return "i64";
}

const std::vector<size_t> kCounts = {0, 1, 7, 1000, 100003};
// Past the shared-memory path's slot (4 buffers of 512 KiB per member) and no
// multiple of its chunk, so that rounds wrap around the buffers.
const std::vector<size_t> kLargeCounts = {700001};
const ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min};

std::vector<int> members_of(const Comm &c) {
  std::vector<int> m(c.iface->size(c.ctx));
  for (size_t i = 0; i < m.size(); ++i) m[i] = c.iface->global_rank(c.ctx, static_cast<int>(i));
  return m;
}

// ------------------------------------------------------------------------------------------
// Checks, one collective kind each

template <typename T>
void check_reductions(const Comm &c, ctr_dtype dt, const std::vector<size_t> &counts = kCounts) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  const int gme = ranks[me];
  uint32_t salt = 1;
  for (size_t count : counts) {
    for (ReduceOp op : kOps) {
      ++salt;
      Buf<T> send(count), recv(count, T(-7));
      for (size_t i = 0; i < count; ++i) send[i] = input<T>(gme, i, salt);
      ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send.data(), recv.data(), count, dt, op));
      for (size_t i = 0; i < count; ++i) {
        T want = reference<T>(op, ranks, i, salt);
        CHECK(std::memcmp(&recv[i], &want, sizeof(T)) == 0,
              "all_reduce %s %s count %zu: element %zu is %g, want %g", type_name<T>(), op_name(op),
              count, i, static_cast<double>(recv[i]), static_cast<double>(want));
      }
      // In place.
      Buf<T> inplace = send;
      ctr::comm_wait(c, c.iface->all_reduce(c.ctx, inplace.data(), inplace.data(), count, dt, op));
      CHECK(inplace == recv, "in-place all_reduce %s %s count %zu differs from out-of-place",
            type_name<T>(), op_name(op), count);

      // reduce_scatter: block b of every rank's send reduces into rank b's recv.
      Buf<T> rs_send(count * n), rs_recv(count, T(-7));
      for (size_t i = 0; i < rs_send.size(); ++i) rs_send[i] = input<T>(gme, i, salt);
      ctr::comm_wait(c,
                     c.iface->reduce_scatter(c.ctx, rs_send.data(), rs_recv.data(), count, dt, op));
      for (size_t i = 0; i < count; ++i) {
        T want = reference<T>(op, ranks, me * count + i, salt);
        CHECK(std::memcmp(&rs_recv[i], &want, sizeof(T)) == 0,
              "reduce_scatter %s %s count %zu: element %zu is %g, want %g", type_name<T>(),
              op_name(op), count, i, static_cast<double>(rs_recv[i]), static_cast<double>(want));
      }
      // In place: the result lands on this rank's own block of the input.
      Buf<T> rs_inplace(count * n);
      for (size_t i = 0; i < rs_inplace.size(); ++i) rs_inplace[i] = input<T>(gme, i, salt);
      ctr::comm_wait(c, c.iface->reduce_scatter(c.ctx, rs_inplace.data(),
                                                rs_inplace.data() + me * count, count, dt, op));
      CHECK(std::equal(rs_recv.begin(), rs_recv.end(), rs_inplace.begin() + me * count),
            "in-place reduce_scatter %s %s count %zu differs from out-of-place", type_name<T>(),
            op_name(op), count);
    }
  }
}

// bf16 (the activations of tp, sp and cp under precision bf16): inputs are
// integers in [-31, 31], so every partial sum of up to 8 members is exact in
// bf16's 8 significant bits and the result equals the serial reference (summed
// in f32, divided for avg, rounded to nearest even once) bit for bit.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
float bf16_input(int rank, size_t i, uint32_t salt) { return static_cast<float>(input<int>(rank, i, salt) % 32); }

void check_reductions_bf16(const Comm &c, const std::vector<size_t> &counts = kCounts) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  uint32_t salt = 500;
  auto want_at = [&](ReduceOp op, size_t i, uint32_t s) {
    float acc = bf16_input(ranks[0], i, s);
    for (size_t k = 1; k < ranks.size(); ++k) acc = combine(op, acc, bf16_input(ranks[k], i, s));
    if (op == ReduceOp::Avg) acc = acc / static_cast<float>(ranks.size());
    return to_bf16(acc);
  };
  for (size_t count : counts) {
    for (ReduceOp op : kOps) {
      ++salt;
      Buf<uint16_t> send(count), recv(count, 0xdead);
      for (size_t i = 0; i < count; ++i) send[i] = to_bf16(bf16_input(ranks[me], i, salt));
      ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send.data(), recv.data(), count, CTR_DTYPE_BF16, op));
      for (size_t i = 0; i < count; ++i)
        CHECK(recv[i] == want_at(op, i, salt), "all_reduce bf16 %s count %zu: element %zu is %g, want %g",
              op_name(op), count, i, static_cast<double>(from_bf16(recv[i])),
              static_cast<double>(from_bf16(want_at(op, i, salt))));
      Buf<uint16_t> inplace = send;
      ctr::comm_wait(c, c.iface->all_reduce(c.ctx, inplace.data(), inplace.data(), count, CTR_DTYPE_BF16, op));
      CHECK(inplace == recv, "in-place all_reduce bf16 %s count %zu differs from out-of-place", op_name(op), count);
      Buf<uint16_t> rs_send(count * n), rs_recv(count, 0xdead);
      for (size_t i = 0; i < rs_send.size(); ++i) rs_send[i] = to_bf16(bf16_input(ranks[me], i, salt));
      ctr::comm_wait(c, c.iface->reduce_scatter(c.ctx, rs_send.data(), rs_recv.data(), count, CTR_DTYPE_BF16, op));
      for (size_t i = 0; i < count; ++i)
        CHECK(rs_recv[i] == want_at(op, me * count + i, salt),
              "reduce_scatter bf16 %s count %zu: element %zu is %g, want %g", op_name(op), count, i,
              static_cast<double>(from_bf16(rs_recv[i])),
              static_cast<double>(from_bf16(want_at(op, me * count + i, salt))));
    }
  }
}

void check_all_gather(const Comm &c, const std::vector<size_t> &counts = kCounts) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  uint32_t salt = 100;
  for (size_t count : counts) {
    for (size_t esz : {1, 4, 8}) {
      const size_t bytes = count * esz;
      ++salt;
      Buf<uint8_t> send(bytes), recv(bytes * n, 0xee);
      for (size_t i = 0; i < bytes; ++i) send[i] = byte_at(ranks[me], i, salt);
      ctr::comm_wait(c, c.iface->all_gather(c.ctx, send.data(), recv.data(), bytes));
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < bytes; ++i)
          CHECK(recv[r * bytes + i] == byte_at(ranks[r], i, salt),
                "all_gather %zu bytes: byte %zu of member %d is wrong", bytes, i, r);
      // In place: this rank's block already sits in recv.
      Buf<uint8_t> inplace(bytes * n, 0xee);
      std::copy(send.begin(), send.end(), inplace.begin() + me * bytes);
      ctr::comm_wait(
          c, c.iface->all_gather(c.ctx, inplace.data() + me * bytes, inplace.data(), bytes));
      CHECK(inplace == recv, "in-place all_gather of %zu bytes differs", bytes);
    }
  }
}

// A batch gives each entry exactly what its own collective gives: gathers,
// reduce-scatters and all-reduces of odd and zero sizes, in one round.
void check_batch(const Comm &c) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const size_t sizes[] = {0, 1, 7, 1000, (size_t{1} << 18) + 3, 600001};
  std::vector<Buf<float>> send, got, want;
  std::vector<ctr::CollDesc> d;
  uint32_t salt = 900;
  for (size_t count : sizes) {
    for (ctr::CollDesc::Kind kind : {ctr::CollDesc::AllGather, ctr::CollDesc::ReduceScatter,
                                     ctr::CollDesc::AllReduce}) {
      ++salt;
      const size_t in = kind == ctr::CollDesc::ReduceScatter ? count * n : count;
      const size_t out = kind == ctr::CollDesc::AllGather ? count * n : count;
      Buf<float> s(in);
      for (size_t i = 0; i < in; ++i) s[i] = static_cast<float>(byte_at(me, i, salt) % 97) - 48.0f;
      send.push_back(s);
      got.emplace_back(out, -1.0f);
      want.emplace_back(out, -2.0f);
      ctr::CollDesc e;
      e.kind = kind;
      e.count = kind == ctr::CollDesc::AllGather ? count * sizeof(float) : count;
      d.push_back(e);
    }
  }
  for (size_t i = 0; i < d.size(); ++i) {
    d[i].send = send[i].data();
    d[i].recv = got[i].data();
  }
  ctr::comm_wait(c, c.iface->batch(c.ctx, d.data(), d.size(), CTR_DTYPE_F32, ctr::ReduceOp::Avg));
  for (size_t i = 0; i < d.size(); ++i) {
    switch (d[i].kind) {
      case ctr::CollDesc::AllGather:
        ctr::comm_wait(c, c.iface->all_gather(c.ctx, send[i].data(), want[i].data(), d[i].count));
        break;
      case ctr::CollDesc::ReduceScatter:
        ctr::comm_wait(c, c.iface->reduce_scatter(c.ctx, send[i].data(), want[i].data(), d[i].count,
                                                  CTR_DTYPE_F32, ctr::ReduceOp::Avg));
        break;
      case ctr::CollDesc::AllReduce:
        ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send[i].data(), want[i].data(), d[i].count,
                                              CTR_DTYPE_F32, ctr::ReduceOp::Avg));
        break;
    }
    CHECK(got[i] == want[i], "batch entry %zu (kind %d, count %zu) differs from its own collective", i,
          static_cast<int>(d[i].kind), d[i].count);
  }
}

void check_broadcast(const Comm &c) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  uint32_t salt = 200;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{7}, size_t{4000}, size_t{3} << 20 | 5,
                       size_t{9} << 20 | 1}) {
    for (int root = 0; root < n; ++root) {
      ++salt;
      Buf<uint8_t> buf(bytes, 0xee);
      if (me == root)
        for (size_t i = 0; i < bytes; ++i) buf[i] = byte_at(ranks[root], i, salt);
      ctr::comm_wait(c, c.iface->broadcast(c.ctx, buf.data(), bytes, root));
      for (size_t i = 0; i < bytes; ++i)
        CHECK(buf[i] == byte_at(ranks[root], i, salt),
              "broadcast of %zu bytes from %d: byte %zu wrong", bytes, root, i);
    }
  }
}

// Element counts from member i to member j; many are zero.
size_t a2a_count(int i, int j, size_t scale, uint32_t salt) {
  uint64_t h = mix((uint64_t{static_cast<uint32_t>(i)} << 32) ^
                   (uint64_t{static_cast<uint32_t>(j)} << 16) ^ salt);
  return h % 3 == 0 ? 0 : static_cast<size_t>(h % (scale + 1));
}

void check_all_to_all(const Comm &c) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  uint32_t salt = 300;
  for (size_t scale :
       {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{100003}, size_t{700001}}) {
    ++salt;
    const size_t esz = 8;
    std::vector<size_t> sc(n), sd(n), rc(n), rd(n);
    size_t stot = 0, rtot = 0;
    for (int j = 0; j < n; ++j) {
      sc[j] = a2a_count(me, j, scale, salt);
      rc[j] = a2a_count(j, me, scale, salt);
    }
    rc[me] = sc[me];
    // Displacements with gaps, in reverse order, to catch any assumption of packing.
    for (int j = n - 1; j >= 0; --j) {
      sd[j] = stot;
      stot += sc[j] + 3;
      rd[j] = rtot;
      rtot += rc[j] + 1;
    }
    Buf<int64_t> send(stot, -1), recv(rtot, -1);
    // Element k to member j carries (sender, j, k) in one integer.
    for (int j = 0; j < n; ++j)
      for (size_t k = 0; k < sc[j]; ++k)
        send[sd[j] + k] =
            (int64_t{ranks[me]} << 48) | (int64_t{ranks[j]} << 32) | static_cast<int64_t>(k);
    ctr::comm_wait(c, c.iface->all_to_all_v(c.ctx, send.data(), sc.data(), sd.data(), recv.data(),
                                            rc.data(), rd.data(), esz));
    for (int j = 0; j < n; ++j)
      for (size_t k = 0; k < rc[j]; ++k) {
        int64_t want =
            (int64_t{ranks[j]} << 48) | (int64_t{ranks[me]} << 32) | static_cast<int64_t>(k);
        CHECK(recv[rd[j] + k] == want,
              "all_to_all_v scale %zu: element %zu from member %d is wrong", scale, k, j);
      }
  }
}

// Non-integer floats: results must be the same bits on every rank, and close to
// the serial sum.
void check_identical(const Comm &c) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  for (size_t count : {size_t{7}, size_t{100003}, size_t{1} << 20 | 3}) {
    auto value = [](int r, size_t i) {
      return static_cast<float>(
          static_cast<double>(mix((uint64_t(r) << 40) ^ i) >> 11) * 0x1p-53 * 2.0 - 1.0);
    };
    Buf<float> send(count), recv(count);
    for (size_t i = 0; i < count; ++i) send[i] = value(ranks[me], i);
    ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send.data(), recv.data(), count, CTR_DTYPE_F32,
                                          ReduceOp::Sum));
    for (size_t i = 0; i < count; ++i) {
      double want = 0;
      for (int r : ranks) want += value(r, i);
      CHECK(std::fabs(recv[i] - want) <= 1e-5 * n,
            "float all_reduce count %zu: element %zu is %.9g, want %.9g", count, i, recv[i], want);
    }
    // The same input gives the same bits again.
    Buf<float> again(count);
    ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send.data(), again.data(), count, CTR_DTYPE_F32,
                                          ReduceOp::Sum));
    CHECK(std::memcmp(again.data(), recv.data(), count * sizeof(float)) == 0,
          "float all_reduce count %zu: a second run gave other bits", count);
    // The shared-memory path adds in member order: exactly the serial float sum.
    if (g_expect_shm && n > 1)
      for (size_t i = 0; i < count; ++i) {
        float want = value(ranks[0], i);
        for (int r = 1; r < n; ++r) want += value(ranks[r], i);
        CHECK(std::memcmp(&recv[i], &want, sizeof want) == 0,
              "float all_reduce count %zu: element %zu is %.9g, the sum in member order %.9g",
              count, i, recv[i], want);
      }
    uint64_t h = fnv1a(recv.data(), count * sizeof(float));
    std::vector<uint64_t> all(n);
    ctr::comm_wait(c, c.iface->all_gather(c.ctx, &h, all.data(), sizeof h));
    for (int r = 0; r < n; ++r)
      CHECK(all[r] == h, "all_reduce of %zu floats: member %d got different bits than member %d",
            count, r, me);
  }
}

void check_barrier_and_test(const Comm &c) {
  for (int i = 0; i < 5; ++i) ctr::comm_wait(c, c.iface->barrier(c.ctx));
  ctr::comm_wait(c, c.iface->barrier(c.ctx), INT64_MAX);  // "forever" must not overflow
  CommWork *w = c.iface->barrier(c.ctx);
  // test() may say either before the wait; after it the handle is gone, so
  // only check it does not crash on a live handle.
  if (c.iface->test) (void)c.iface->test(c.ctx, w);
  ctr::comm_wait(c, w);
}

// Many small collectives in flight at once on one communicator.
void check_many_small(const Comm &c) {
  const int me = c.iface->rank(c.ctx);
  const std::vector<int> ranks = members_of(c);
  constexpr int kN = 500;
  std::vector<int64_t> in(kN), out(kN, -1);
  std::vector<CommWork *> works;
  for (int k = 0; k < kN; ++k) {
    in[k] = ranks[me] * 1000 + k;
    works.push_back(c.iface->all_reduce(c.ctx, &in[k], &out[k], 1, CTR_DTYPE_I64, ReduceOp::Sum));
  }
  for (CommWork *w : works) ctr::comm_wait(c, w);
  for (int k = 0; k < kN; ++k) {
    int64_t want = 0;
    for (int r : ranks) want += r * 1000 + k;
    CHECK(out[k] == want, "small all_reduce %d: got %lld, want %lld", k,
          static_cast<long long>(out[k]), static_cast<long long>(want));
  }
  // And strictly one after another.
  for (int k = 0; k < 200; ++k) {
    int64_t v = ranks[me] + k, r = 0;
    ctr::comm_wait(c, c.iface->all_reduce(c.ctx, &v, &r, 1, CTR_DTYPE_I64, ReduceOp::Max));
    CHECK(r == *std::max_element(ranks.begin(), ranks.end()) + k,
          "back-to-back all_reduce %d wrong", k);
  }
}

// The last collective's path in the flight recorder.
std::string last_path(const Comm &c) {
  const std::string json = c.iface->flight(c.ctx);
  const std::string key = "\"path\":\"";
  const size_t at = json.rfind(key);
  CHECK(at != std::string::npos, "the flight recorder has no path: %s", json.c_str());
  return json.substr(at + key.size(), json.find('"', at + key.size()) - at - key.size());
}

// A large all_reduce on the current buffers takes the path expected of them:
// on the shared-memory path, read in place ("shm direct") exactly when every
// rank's buffers are shared host allocations and CTR_SHM_DIRECT is not 0.
void check_direct_path(const Comm &c) {
  const int n = c.iface->size(c.ctx);
  Buf<float> send(1 << 18, 1.0f), recv(1 << 18);
  ctr::comm_wait(c, c.iface->all_reduce(c.ctx, send.data(), recv.data(), send.size(),
                                        CTR_DTYPE_F32, ReduceOp::Sum));
  CHECK(recv[12345] == static_cast<float>(n), "all_reduce of ones gave %g", recv[12345]);
  auto zero = [](const char *name) {
    const char *v = std::getenv(name);
    return v && std::strcmp(v, "0") == 0;
  };
  const bool direct =
      g_buffers == Buffers::kShared && !zero("CTR_SHM_DIRECT") && !zero("CTR_TEST_DIRECT");
  const std::string want = !g_expect_shm || n == 1 ? "ucx" : direct ? "shm direct" : "shm";
  const std::string got = last_path(c);
  CHECK(got == want, "an all_reduce of 1 MiB took path '%s', expected '%s'", got.c_str(),
        want.c_str());
}

// The checks again on shared host allocations, which large collectives read
// in place; then with them on one rank only, which sends every collective
// through the segment.
void check_shared(const Comm &c) {
  g_buffers = Buffers::kShared;
  check_reductions<float>(c, CTR_DTYPE_F32, kLargeCounts);
  check_reductions<int64_t>(c, CTR_DTYPE_I64, kLargeCounts);
  check_reductions_bf16(c, kLargeCounts);
  check_all_gather(c, kLargeCounts);
  check_batch(c);
  check_broadcast(c);
  check_all_to_all(c);
  check_identical(c);
  check_direct_path(c);
  g_buffers = Buffers::kSharedMixed;
  check_reductions<float>(c, CTR_DTYPE_F32, kLargeCounts);
  check_all_gather(c, kLargeCounts);
  check_all_to_all(c);
  check_direct_path(c);
  g_buffers = Buffers::kPlain;
}

void check_all(const Comm &c) {
  check_reductions<float>(c, CTR_DTYPE_F32);
  check_reductions<double>(c, CTR_DTYPE_F64);
  check_reductions<int32_t>(c, CTR_DTYPE_I32);
  check_reductions<int64_t>(c, CTR_DTYPE_I64);
  check_reductions<float>(c, CTR_DTYPE_F32, kLargeCounts);
  check_reductions<double>(c, CTR_DTYPE_F64, kLargeCounts);
  check_reductions<int32_t>(c, CTR_DTYPE_I32, kLargeCounts);
  check_reductions<int64_t>(c, CTR_DTYPE_I64, kLargeCounts);
  check_reductions_bf16(c);
  check_reductions_bf16(c, kLargeCounts);
  check_all_gather(c);
  check_all_gather(c, kLargeCounts);
  check_batch(c);
  check_broadcast(c);
  check_all_to_all(c);
  check_identical(c);
  check_barrier_and_test(c);
}

// Point to point. Every rank sends a run of messages of several sizes to the
// next rank and receives the previous rank's, with a world all_reduce in flight
// between them and the receives waited in reverse order: the k-th send of a
// pair must land in the k-th recv whatever else is in flight. Then ranks 0 and
// 1 alone exchange a few more while the others go straight on to a barrier, so
// that sends and recvs must not take the collectives' sequence numbers.
void check_point_to_point(const Comm &c) {
  const int n = c.iface->size(c.ctx), me = c.iface->rank(c.ctx);
  if (n < 2) return;
  const int to = (me + 1) % n, from = (me + n - 1) % n;
  const std::vector<size_t> sizes = {0, 1, 4097, size_t{3} << 20, 17};
  std::vector<Buf<uint8_t>> out(sizes.size()), in(sizes.size());
  std::vector<CommWork *> sends, recvs;
  Buf<float> sum(1000), mine(1000);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = input<float>(me, i, 77);
  CommWork *ar = nullptr;
  for (size_t k = 0; k < sizes.size(); ++k) {
    out[k].resize(sizes[k]);
    in[k].assign(sizes[k], 0);
    for (size_t i = 0; i < sizes[k]; ++i) out[k][i] = byte_at(me, i, static_cast<uint32_t>(k));
    recvs.push_back(c.iface->recv(c.ctx, in[k].data(), sizes[k], from));
    sends.push_back(c.iface->send(c.ctx, out[k].data(), sizes[k], to));
    if (k == 1) ar = c.iface->all_reduce(c.ctx, mine.data(), sum.data(), mine.size(), CTR_DTYPE_F32, ReduceOp::Sum);
  }
  for (size_t k = sizes.size(); k-- > 0;) ctr::comm_wait(c, recvs[k]);
  for (CommWork *w : sends) ctr::comm_wait(c, w);
  ctr::comm_wait(c, ar);
  for (size_t k = 0; k < sizes.size(); ++k)
    for (size_t i = 0; i < sizes[k]; ++i)
      CHECK(in[k][i] == byte_at(from, i, static_cast<uint32_t>(k)),
            "recv %zu of %zu bytes from rank %d: byte %zu differs", k, sizes[k], from, i);
  for (size_t i = 0; i < sum.size(); ++i) {
    float want = 0;
    for (int r = 0; r < n; ++r) want += input<float>(r, i, 77);
    CHECK(sum[i] == want, "all_reduce between sends and recvs: element %zu is %g, want %g", i, sum[i], want);
  }
  if (me < 2) {
    const int other = 1 - me;
    for (uint32_t k = 0; k < 3; ++k) {
      Buf<uint8_t> a(100 + k), b(100 + k, 0);
      for (size_t i = 0; i < a.size(); ++i) a[i] = byte_at(me, i, 100 + k);
      // Rank 0 sends first and rank 1 receives first: either order pairs up.
      CommWork *s = nullptr, *r = nullptr;
      if (me == 0) s = c.iface->send(c.ctx, a.data(), a.size(), other);
      r = c.iface->recv(c.ctx, b.data(), b.size(), other);
      if (me == 1) s = c.iface->send(c.ctx, a.data(), a.size(), other);
      ctr::comm_wait(c, r);
      ctr::comm_wait(c, s);
      for (size_t i = 0; i < b.size(); ++i)
        CHECK(b[i] == byte_at(other, i, 100 + k), "pair exchange %u: byte %zu differs", k, i);
    }
  }
  ctr::comm_wait(c, c.iface->barrier(c.ctx));
  uint8_t byte = 0;
  expect_error("send to itself", CTR_STATUS_INVALID_ARGUMENT, {"send", "addresses itself"},
               [&] { c.iface->send(c.ctx, &byte, 1, me); });
  expect_error("recv from out of range", CTR_STATUS_INVALID_ARGUMENT, {"recv", "peer"},
               [&] { c.iface->recv(c.ctx, &byte, 1, n); });
}

// Pairs {0,1}, {2,3}, ... (a lone last rank forms a group of one), with
// collectives on the pair and on the world in flight at the same time.
void check_splits(const Comm &world) {
  const int n = world.iface->size(world.ctx), me = world.iface->rank(world.ctx);
  std::vector<int> pair = {me - me % 2};
  if (pair[0] + 1 < n) pair.push_back(pair[0] + 1);
  Comm sub = world.iface->split(world.ctx, pair);
  CHECK(sub.iface->size(sub.ctx) == static_cast<int>(pair.size()), "pair size is wrong");
  CHECK(sub.iface->global_rank(sub.ctx, sub.iface->rank(sub.ctx)) == me, "pair rank is wrong");

  // The world in reverse: member i is global rank n - 1 - i.
  std::vector<int> rev(n);
  for (int i = 0; i < n; ++i) rev[i] = n - 1 - i;
  Comm back = world.iface->split(world.ctx, rev);
  CHECK(back.iface->rank(back.ctx) == n - 1 - me, "reversed rank is wrong");

  constexpr size_t kCount = 100003;
  constexpr int kRounds = 4;
  std::vector<std::vector<double>> ps(kRounds), pr(kRounds), ws(kRounds), wr(kRounds);
  std::vector<uint64_t> gathered(n), mine = {static_cast<uint64_t>(me) * 77 + 5};
  std::vector<CommWork *> works;
  for (int k = 0; k < kRounds; ++k) {
    ps[k].assign(kCount, 0);
    ws[k].assign(kCount, 0);
    pr[k].assign(kCount, -1);
    wr[k].assign(kCount, -1);
    for (size_t i = 0; i < kCount; ++i) {
      ps[k][i] = input<double>(me, i, 900 + k);
      ws[k][i] = input<double>(me, i, 950 + k);
    }
    works.push_back(sub.iface->all_reduce(sub.ctx, ps[k].data(), pr[k].data(), kCount,
                                          CTR_DTYPE_F64, ReduceOp::Sum));
    works.push_back(world.iface->all_reduce(world.ctx, ws[k].data(), wr[k].data(), kCount,
                                            CTR_DTYPE_F64, ReduceOp::Sum));
  }
  CommWork *g = back.iface->all_gather(back.ctx, mine.data(), gathered.data(), sizeof(uint64_t));
  // Wait in an order unrelated to issue order.
  ctr::comm_wait(back, g);
  for (int k = kRounds - 1; k >= 0; --k) {
    ctr::comm_wait(world, works[2 * k + 1]);
    ctr::comm_wait(sub, works[2 * k]);
  }
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  for (int k = 0; k < kRounds; ++k)
    for (size_t i = 0; i < kCount; ++i) {
      CHECK(pr[k][i] == reference<double>(ReduceOp::Sum, pair, i, 900 + k),
            "pair all_reduce %d wrong at %zu", k, i);
      CHECK(wr[k][i] == reference<double>(ReduceOp::Sum, all, i, 950 + k),
            "world all_reduce %d wrong at %zu", k, i);
    }
  for (int i = 0; i < n; ++i)
    CHECK(gathered[i] == static_cast<uint64_t>(n - 1 - i) * 77 + 5,
          "reversed all_gather slot %d wrong", i);

  // The sub-communicators run the full suite too (a pair of the same two
  // ranks as part of the world).
  check_all(sub);
  check_all_gather(back);
  check_reductions<float>(back, CTR_DTYPE_F32);

  // A split of a split.
  Comm solo = sub.iface->split(sub.ctx, {sub.iface->rank(sub.ctx)});
  check_reductions<int32_t>(solo, CTR_DTYPE_I32);
  solo.iface->destroy(solo.ctx);
  back.iface->destroy(back.ctx);
  sub.iface->destroy(sub.ctx);
}

// Many collectives of several kinds and sizes in flight on two communicators at
// once (the world and a pair), waited for in an order unrelated to issue.
void check_concurrent(const Comm &world) {
  const int n = world.iface->size(world.ctx), me = world.iface->rank(world.ctx);
  std::vector<int> pair = {me - me % 2};
  if (pair[0] + 1 < n) pair.push_back(pair[0] + 1);
  Comm sub = world.iface->split(world.ctx, pair);
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  struct Pending {
    const Comm *c;
    CommWork *w;
    std::vector<int64_t> in, out;
    std::vector<uint8_t> gin, gout;
    ReduceOp op;
    uint32_t salt;
  };
  constexpr int kRounds = 40;
  std::vector<std::unique_ptr<Pending>> ps;
  for (int k = 0; k < kRounds; ++k) {
    const size_t count = k % 4 == 0 ? 200003 : k % 4 == 1 ? 1 : 1000 + k;
    for (const Comm *c : {&world, static_cast<const Comm *>(&sub)}) {
      const std::vector<int> &ranks = c == &world ? all : pair;
      const uint32_t salt = 5000 + 2 * k + (c == &sub);
      auto p = std::make_unique<Pending>();
      p->c = c;
      p->salt = salt;
      p->op = k % 3 == 0 ? ReduceOp::Max : ReduceOp::Sum;
      p->in.resize(count);
      p->out.assign(count, -1);
      for (size_t i = 0; i < count; ++i) p->in[i] = input<int64_t>(me, i, p->salt);
      p->w = c->iface->all_reduce(c->ctx, p->in.data(), p->out.data(), count, CTR_DTYPE_I64, p->op);
      ps.push_back(std::move(p));
      // An all_gather right behind it on the same communicator.
      auto q = std::make_unique<Pending>();
      q->c = c;
      q->salt = salt + 100000;
      q->gin.resize(count);
      q->gout.assign(count * ranks.size(), 0xee);
      for (size_t i = 0; i < count; ++i) q->gin[i] = byte_at(me, i, q->salt);
      q->w = c->iface->all_gather(c->ctx, q->gin.data(), q->gout.data(), count);
      ps.push_back(std::move(q));
    }
  }
  for (size_t j = ps.size(); j-- > 0;) {
    Pending &p = *ps[(j * 7) % ps.size()];  // 7 is coprime to 4 * kRounds: each once
    ctr::comm_wait(*p.c, p.w);
  }
  for (auto &pp : ps) {
    Pending &p = *pp;
    const std::vector<int> &ranks = p.c == &world ? all : pair;
    for (size_t i = 0; i < p.in.size(); ++i)
      CHECK(p.out[i] == reference<int64_t>(p.op, ranks, i, p.salt),
            "concurrent all_reduce (salt %u) wrong at %zu", p.salt, i);
    for (size_t r = 0; r < ranks.size() && !p.gin.empty(); ++r)
      for (size_t i = 0; i < p.gin.size(); ++i)
        CHECK(p.gout[r * p.gin.size() + i] == byte_at(ranks[r], i, p.salt),
              "concurrent all_gather (salt %u) wrong at member %zu byte %zu", p.salt, r, i);
  }
  sub.iface->destroy(sub.ctx);
}

// Collectives whose waits come late, from another thread, or in another order
// than the peers': on the shared-memory path the waiting thread usually runs a
// collective itself, so one that nobody on this rank waits for yet must still
// progress while the peers wait for it.
void check_late_waits(const Comm &world) {
  const int n = world.iface->size(world.ctx), me = world.iface->rank(world.ctx);
  std::vector<int> all(n);
  for (int i = 0; i < n; ++i) all[i] = i;
  std::vector<int> pair = {me - me % 2};
  if (pair[0] + 1 < n) pair.push_back(pair[0] + 1);
  Comm sub = world.iface->split(world.ctx, pair);
  const size_t big = 300007;  // several rounds of the segment's buffers
  auto fill = [&](std::vector<int64_t> &v, uint32_t salt) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = input<int64_t>(me, i, salt);
  };
  auto verify = [&](const std::vector<int64_t> &out, const std::vector<int> &ranks, uint32_t salt,
                    const char *what) {
    for (size_t i = 0; i < out.size(); ++i)
      CHECK(out[i] == reference<int64_t>(ReduceOp::Sum, ranks, i, salt), "%s wrong at %zu", what,
            i);
  };
  // Issued on this thread; the last rank waits for it from another thread
  // 100 ms later, the others at once.
  for (size_t count : {size_t{1}, big}) {
    std::vector<int64_t> in(count), out(count, -1);
    fill(in, 7000);
    CommWork *w = world.iface->all_reduce(world.ctx, in.data(), out.data(), count, CTR_DTYPE_I64,
                                          ReduceOp::Sum);
    if (me == n - 1) {
      std::thread late([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        ctr::comm_wait(world, w);
      });
      late.join();
    } else {
      ctr::comm_wait(world, w);
    }
    verify(out, all, 7000, "late-waited all_reduce");
  }
  // One collective on each of two communicators; even ranks wait for the
  // world's first, odd ranks for the pair's first.
  std::vector<int64_t> in_w(big), out_w(big, -1), in_p(big), out_p(big, -1);
  fill(in_w, 7100);
  fill(in_p, 7200);
  CommWork *ww = world.iface->all_reduce(world.ctx, in_w.data(), out_w.data(), big, CTR_DTYPE_I64,
                                         ReduceOp::Sum);
  CommWork *wp = sub.iface->all_reduce(sub.ctx, in_p.data(), out_p.data(), big, CTR_DTYPE_I64,
                                       ReduceOp::Sum);
  if (me % 2 == 0) {
    ctr::comm_wait(world, ww);
    ctr::comm_wait(sub, wp);
  } else {
    ctr::comm_wait(sub, wp);
    ctr::comm_wait(world, ww);
  }
  verify(out_w, all, 7100, "world all_reduce waited out of order");
  verify(out_p, pair, 7200, "pair all_reduce waited out of order");
  sub.iface->destroy(sub.ctx);
}

// The data path matches CTR_TEST_PATH: a shared-memory segment is mapped
// exactly when the world has several (local) ranks and shm is expected.
void check_path(const Env &e) {
  const char *want = std::getenv("CTR_TEST_PATH");
  if (!want) return;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int segments = 0;
  while (std::getline(maps, line)) {
    if (line.find("ctr-shm") == std::string::npos) continue;
    ++segments;
    // Only this user may open it: mode 0600 (where map_files may be looked at).
    struct stat st {};
    const std::string range = line.substr(0, line.find(' '));
    if (::stat(("/proc/self/map_files/" + range).c_str(), &st) != 0) continue;
    CHECK(st.st_uid == ::geteuid() && (st.st_mode & 077) == 0,
          "the shared-memory segment %s is not private to this user", range.c_str());
  }
  const bool shm = g_expect_shm && e.world > 1;
  CHECK((segments > 0) == shm, "CTR_TEST_PATH=%s but %d shared-memory segments are mapped", want,
        segments);
  // Once mapped, no descriptor of it stays open.
  for (int fd = 0; fd < 1024; ++fd) {
    char target[256] = {};
    if (::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof target - 1) > 0)
      CHECK(std::strstr(target, "ctr-shm") == nullptr, "descriptor %d of a segment is open", fd);
  }
}

void check_store(ctr::Store &store, const Env &e) {
  store.set("test/key/" + std::to_string(e.rank), "value of " + std::to_string(e.rank));
  std::string binary("a\0b\xff", 4);
  if (e.rank == 0) store.set("test/binary", binary);
  for (int r = 0; r < e.world; ++r)
    CHECK(store.get("test/key/" + std::to_string(r)) == "value of " + std::to_string(r),
          "store get wrong");
  CHECK(store.get("test/binary") == binary, "binary value mangled");
  CHECK(store.get("test/binary", INT64_MAX) == binary, "get with an endless timeout failed");
  int64_t v = store.add("test/counter", e.rank + 1);
  CHECK(v >= e.rank + 1, "store add returned %lld", static_cast<long long>(v));
  store.barrier("test/after-add");
  CHECK(store.add("test/counter", 0) == int64_t{e.world} * (e.world + 1) / 2,
        "store add total wrong");
  store.barrier("test/after-add");  // a name can be reused once a barrier completed
  expect_error("get of a missing key", CTR_STATUS_TIMEOUT, {"test/never", "0.2 s"},
               [&] { store.get("test/never", 200); });
}

// ------------------------------------------------------------------------------------------
// Modes

int run_all(const Env &e) {
  auto t0 = std::chrono::steady_clock::now();
  auto store = ctr::store_join(rendezvous(e));
  check_store(*store, e);
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  CHECK(world.iface->size(world.ctx) == e.world && world.iface->rank(world.ctx) == e.rank,
        "world rank/size wrong");
  check_path(e);
  check_all(world);
  check_direct_path(world);
  // Two ranks take the one-stage direct all_reduce, three the two-stage one;
  // four add nothing but time (under the sanitizers, minutes).
  if (g_expect_shm && e.world <= 3) check_shared(world);
  check_point_to_point(world);
  check_splits(world);
  check_concurrent(world);
  check_late_waits(world);
  check_many_small(world);
  // Argument errors are reported, not crashed on.
  expect_error("bad dtype", CTR_STATUS_UNSUPPORTED, {"dtype"}, [&] {
    world.iface->all_reduce(world.ctx, nullptr, nullptr, 0, CTR_DTYPE_F16, ReduceOp::Sum);
  });
  expect_error("bad root", CTR_STATUS_INVALID_ARGUMENT, {"root"},
               [&] { world.iface->broadcast(world.ctx, nullptr, 0, e.world); });
  expect_error("bad split", CTR_STATUS_INVALID_ARGUMENT, {"split"},
               [&] { world.iface->split(world.ctx, {e.world}); });
  world.iface->destroy(world.ctx);
  std::printf("comm_test: rank %d of %d: PASS (%.2f s)\n", e.rank, e.world, elapsed_s(t0));
  return 0;
}

// Only the checks on shared host allocations.
int run_shared(const Env &e) {
  auto store = ctr::store_join(rendezvous(e));
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  check_path(e);
  check_shared(world);
  world.iface->destroy(world.ctx);
  std::printf("comm_test: rank %d of %d: PASS shared\n", e.rank, e.world);
  return 0;
}

int run_token(Env e) {
  const int bad = e.world - 1;
  if (e.rank == bad) {
    e.token += "-wrong";
    std::string msg =
        expect_error("join with a wrong token", CTR_STATUS_COMM_ERROR,
                     {"does not hold this job's token", "CTR_JOB_TOKEN differs between ranks"},
                     [&] { ctr::store_join(rendezvous(e)); });
    std::fprintf(stderr, "comm_test: rank %d: refused as expected: %s\n", e.rank, msg.c_str());
  } else {
    std::string who =
        "rank " + std::to_string(bad) + " of " + std::to_string(e.world) + " did not join";
    std::string msg = expect_error("join while a rank is refused", CTR_STATUS_TIMEOUT, {who},
                                   [&] { ctr::store_join(rendezvous(e)); });
    std::fprintf(stderr, "comm_test: rank %d: timed out as expected: %s\n", e.rank, msg.c_str());
  }
  std::printf("comm_test: rank %d of %d: PASS token\n", e.rank, e.world);
  return 0;
}

// Started as world 3 with only ranks 0 and 1.
int run_missing(const Env &e) {
  auto t0 = std::chrono::steady_clock::now();
  std::string msg =
      expect_error("join with a rank missing", CTR_STATUS_TIMEOUT,
                   {"rank 2 of 3 did not join within"}, [&] { ctr::store_join(rendezvous(e)); });
  double took = elapsed_s(t0);
  CHECK(took < e.timeout_ms / 1000.0 + 3.0, "the failed join took %.1f s", took);
  std::fprintf(stderr, "comm_test: rank %d: timed out as expected after %.1f s: %s\n", e.rank, took,
               msg.c_str());
  std::printf("comm_test: rank %d of %d: PASS missing\n", e.rank, e.world);
  return 0;
}

// The last rank leaves right after joining; the others' next collective must
// fail naming it, well within the timeout plus a small grace.
int run_dead(const Env &e) {
  auto store = ctr::store_join(rendezvous(e));
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  ctr::comm_wait(world, world.iface->barrier(world.ctx));
  const int dead = e.world - 1;
  if (e.rank == dead) {
    std::printf("comm_test: rank %d of %d: exiting without a word\n", e.rank, e.world);
    std::fflush(stdout);
    std::_Exit(0);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::vector<float> buf(100000, 1.0f);
  std::string msg;
  try {
    ctr::comm_wait(world, world.iface->all_reduce(world.ctx, buf.data(), buf.data(), buf.size(),
                                                  CTR_DTYPE_F32, ReduceOp::Sum));
    die("all_reduce with a dead rank succeeded");
  } catch (const ctr::Error &err) {
    msg = err.message();
    CHECK(err.code() == CTR_STATUS_COMM_ERROR || err.code() == CTR_STATUS_TIMEOUT,
          "unexpected status %d: %s", err.code(), err.what());
    CHECK(msg.find("rank " + std::to_string(dead)) != std::string::npos,
          "the error does not name rank %d: %s", dead, err.what());
  }
  double took = elapsed_s(t0);
  CHECK(took < e.timeout_ms / 1000.0 + 3.0, "the failure took %.1f s", took);
  auto t1 = std::chrono::steady_clock::now();
  world.iface->destroy(world.ctx);
  double destroy = elapsed_s(t1);
  CHECK(destroy < 10.0, "destroy with a dead peer took %.1f s", destroy);
  std::fprintf(stderr, "comm_test: rank %d: failed as expected after %.2f s (destroy %.2f s): %s\n",
               e.rank, took, destroy, msg.c_str());
  std::printf("comm_test: rank %d of %d: PASS dead\n", e.rank, e.world);
  return 0;
}

// The last rank exits while a large all_reduce is under way (issued, then gone
// a few milliseconds later); the others' all_reduce fails naming it, within
// the timeout plus a small grace.
// shared: the buffer is a shared host allocation, which the others read in place.
int run_dead_mid(const Env &e, bool shared) {
  auto store = ctr::store_join(rendezvous(e));
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  check_path(e);
  g_buffers = shared ? Buffers::kShared : Buffers::kPlain;
  Buf<float> buf(size_t{16} << 20, 1.0f);  // 64 MiB: many rounds of the segment
  auto all_reduce = [&] {
    return world.iface->all_reduce(world.ctx, buf.data(), buf.data(), buf.size(), CTR_DTYPE_F32,
                                   ReduceOp::Max);
  };
  constexpr int kBefore = 2;
  for (int i = 0; i < kBefore; ++i) ctr::comm_wait(world, all_reduce());
  const int dead = e.world - 1;
  if (e.rank == dead) {
    (void)all_reduce();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::printf("comm_test: rank %d of %d: exiting without a word\n", e.rank, e.world);
    std::fflush(stdout);
    std::_Exit(0);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    for (int i = 0; i < 3; ++i) ctr::comm_wait(world, all_reduce());
    die("all_reduce with a rank gone mid-collective succeeded");
  } catch (const ctr::Error &err) {
    msg = err.message();
    CHECK(err.code() == CTR_STATUS_COMM_ERROR || err.code() == CTR_STATUS_TIMEOUT,
          "unexpected status %d: %s", err.code(), err.what());
    CHECK(msg.find("all_reduce") != std::string::npos &&
              msg.find("rank " + std::to_string(dead)) != std::string::npos,
          "the error does not name the all_reduce and rank %d: %s", dead, err.what());
  }
  double took = elapsed_s(t0);
  CHECK(took < e.timeout_ms / 1000.0 + 3.0, "the failure took %.1f s", took);
  auto t1 = std::chrono::steady_clock::now();
  world.iface->destroy(world.ctx);
  double destroy = elapsed_s(t1);
  CHECK(destroy < 10.0, "destroy with a dead peer took %.1f s", destroy);
  std::fprintf(stderr, "comm_test: rank %d: failed as expected after %.2f s (destroy %.2f s): %s\n",
               e.rank, took, destroy, msg.c_str());
  std::printf("comm_test: rank %d of %d: PASS dead-mid\n", e.rank, e.world);
  return 0;
}

// The last rank stays alive but never enters the barrier the others are in:
// they time out naming it, within the timeout they gave; then all shut down.
int run_hang(const Env &e) {
  auto store = ctr::store_join(rendezvous(e));
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  ctr::comm_wait(world, world.iface->barrier(world.ctx));
  const int hung = e.world - 1;
  if (e.rank == hung) {
    // Busy elsewhere until rank 0 has seen the timeout.
    store->get("hang/release", 4 * e.timeout_ms);
  } else {
    auto t0 = std::chrono::steady_clock::now();
    const int64_t wait_ms = 2000;
    std::string msg =
        expect_error("barrier with a hung rank", CTR_STATUS_TIMEOUT,
                     {"barrier (world, " + std::to_string(e.world) + " ranks)",
                      "timed out after 2.0 s waiting for rank " + std::to_string(hung)},
                     [&] { ctr::comm_wait(world, world.iface->barrier(world.ctx), wait_ms); });
    double took = elapsed_s(t0);
    CHECK(took >= 1.9 && took < 2.0 + 3.0, "the timeout took %.1f s", took);
    std::fprintf(stderr, "comm_test: rank %d: timed out as expected after %.2f s: %s\n", e.rank,
                 took, msg.c_str());
    if (e.rank == 0) store->set("hang/release", "1");
  }
  auto t1 = std::chrono::steady_clock::now();
  world.iface->destroy(world.ctx);
  double destroy = elapsed_s(t1);
  CHECK(destroy < 10.0, "destroy after a timeout took %.1f s", destroy);
  std::printf("comm_test: rank %d of %d: PASS hang (destroy %.2f s)\n", e.rank, e.world, destroy);
  return 0;
}

// Rank 0 waits for a message the last rank never sends: its recv times out
// naming that rank, and the ranks not involved are not disturbed.
int run_p2p_hang(const Env &e) {
  auto store = ctr::store_join(rendezvous(e));
  Comm world = ctr::ucx_comm_create(*store, e.rank, e.world, e.timeout_ms);
  ctr::comm_wait(world, world.iface->barrier(world.ctx));
  const int hung = e.world - 1;
  if (e.rank == 0) {
    auto t0 = std::chrono::steady_clock::now();
    uint8_t buf[64];
    std::string msg = expect_error(
        "recv from a rank that never sends", CTR_STATUS_TIMEOUT,
        {"recv from rank " + std::to_string(hung) + " (world, " + std::to_string(e.world) + " ranks)",
         "timed out after 2.0 s waiting for rank " + std::to_string(hung)},
        [&] { ctr::comm_wait(world, world.iface->recv(world.ctx, buf, sizeof buf, hung), 2000); });
    double took = elapsed_s(t0);
    CHECK(took >= 1.9 && took < 2.0 + 3.0, "the timeout took %.1f s", took);
    std::fprintf(stderr, "comm_test: rank %d: timed out as expected after %.2f s: %s\n", e.rank,
                 took, msg.c_str());
    store->set("p2p-hang/release", "1");
  } else {
    store->get("p2p-hang/release", 4 * e.timeout_ms);
  }
  world.iface->destroy(world.ctx);
  std::printf("comm_test: rank %d of %d: PASS p2p-hang\n", e.rank, e.world);
  return 0;
}

// Rank 0, which serves the store, exits right after the join; the others'
// next store request fails with CTR_STATUS_COMM_ERROR instead of waiting.
int run_server_dead(const Env &e) {
  auto store = ctr::store_join(rendezvous(e));
  // Rank 0 leaves once every other rank has shown it is past the join.
  if (e.rank != 0) store->set("server-dead/ready/" + std::to_string(e.rank), "1");
  if (e.rank == 0) {
    for (int r = 1; r < e.world; ++r) store->get("server-dead/ready/" + std::to_string(r));
    std::printf("comm_test: rank 0 of %d: exiting without a word\n", e.world);
    std::fflush(stdout);
    std::_Exit(0);
  }
  auto t0 = std::chrono::steady_clock::now();
  std::string msg = expect_error("get after the store died", CTR_STATUS_COMM_ERROR,
                                 {"lost the connection to the store"},
                                 [&] { store->get("server-dead/never", 4 * e.timeout_ms); });
  double took = elapsed_s(t0);
  CHECK(took < 5.0, "noticing the dead store took %.1f s", took);
  expect_error("set after the store died", CTR_STATUS_COMM_ERROR, {"rendezvous"},
               [&] { store->set("server-dead/key", "v"); });
  std::fprintf(stderr, "comm_test: rank %d: failed as expected after %.2f s: %s\n", e.rank, took,
               msg.c_str());
  std::printf("comm_test: rank %d of %d: PASS server-dead\n", e.rank, e.world);
  return 0;
}

}  // namespace

int main(int argc, char **argv) {
  Env e = read_env();
  g_rank = e.rank;
  const char *path = std::getenv("CTR_TEST_PATH");
  g_expect_shm = path && std::strcmp(path, "shm") == 0;
  std::string mode = argc > 1 ? argv[1] : "all";
  try {
    if (mode == "all") return run_all(e);
    if (mode == "shared") return run_shared(e);
    if (mode == "token") return run_token(e);
    if (mode == "missing") return run_missing(e);
    if (mode == "dead") return run_dead(e);
    if (mode == "dead-mid") return run_dead_mid(e, false);
    if (mode == "dead-mid-shared") return run_dead_mid(e, true);
    if (mode == "hang") return run_hang(e);
    if (mode == "p2p-hang") return run_p2p_hang(e);
    if (mode == "server-dead") return run_server_dead(e);
  } catch (const ctr::Error &err) {
    die("unexpected error (status %d): %s", err.code(), err.what());
  }
  die("unknown mode '%s'", mode.c_str());
}
