// `ctr check`: before a long job, do the mesh's communicators give exact results,
// how fast are they, and is one rank holding the others up?
//
//   ctr launch -n 4 -- ctr check --mesh dp=2,fsdp=2 --bytes 4M --iters 20
//
// The ranks join the mesh as `ctr run` does (ctr_mesh_create_from_env), then work
// on its host collectives (ctr_mesh_all_reduce, ...), over the world and each
// axis, in three parts:
//
// Correctness. Every collective the runtime uses runs at a few sizes on data
// every rank can compute for every other (small integers from rank, index and a
// salt, so float sums are exact in any order), and each rank compares its result
// element by element. For a wrong reduction the group then gathers its inputs to
// tell a bad contribution from a bad reduction. The findings of all ranks are
// gathered on the world and rank 0 names the collective, communicator, sizes,
// the ranks that got wrong data and the ranks whose data was wrong.
//
// Speed. Each collective runs back to back at --bytes after a warm-up; the time
// per operation of the slowest group gives algorithm and bus bandwidth by the
// nccl-tests definitions, and a 4-byte all_reduce gives the latency.
//
// Skew. Rounds of a barrier followed by a small world all_reduce: each rank times
// how long it waited inside the all_reduce. The rank the others wait for waits
// least; when its wait is far below the median of the others', it is named as slow.
//
// CTR_CHECK_INJECT makes the checks fail on purpose, for the tests only:
// "slow:R:MS" sleeps MS ms on rank R before each timed collective, and
// "corrupt:R[:COLLECTIVE]" changes one value of rank R's input to each checked
// collective (or to that one only).

#include "check_cmd.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctr/ctr.h"
#include "tool_error.h"

namespace ctr_tool {

using ctr_tool::fail;

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

std::string rank_list(const std::set<int> &ranks) {
  std::string s;
  for (const int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return s;
}

// ------------------------------------------------------------------------------------------
// Sizes

constexpr size_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
// Checked at these sizes below --bytes, and at --bytes.
constexpr size_t kCheckSizes[] = {4 * kKiB, 256 * kKiB};
// The all_reduce of the skew rounds.
constexpr size_t kSkewBytes = 4 * kKiB;

// "4096", "256K", "4M", "1GiB" (K, M, G: powers of 1024).
std::optional<size_t> parse_bytes(const std::string &text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (...) {
    return std::nullopt;
  }
  std::string unit;
  for (size_t i = used; i < text.size(); ++i)
    unit += static_cast<char>(std::tolower(static_cast<unsigned char>(text[i])));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  if (unit == "k" || unit == "kb" || unit == "kib") scale = kKiB;
  if (unit == "m" || unit == "mb" || unit == "mib") scale = kMiB;
  if (unit == "g" || unit == "gb" || unit == "gib") scale = kGiB;
  if (scale == 0 || !(v > 0) || v * scale > static_cast<double>(kGiB)) return std::nullopt;
  return static_cast<size_t>(std::llround(v * scale));
}

std::string bytes_text(size_t b) {
  if (b >= kMiB && b % kMiB == 0) return ctr_tool::format("%zu MiB", b / kMiB);
  if (b >= kKiB && b % kKiB == 0) return ctr_tool::format("%zu KiB", b / kKiB);
  if (b >= kMiB) return ctr_tool::format("%.1f MiB", static_cast<double>(b) / kMiB);
  if (b >= kKiB) return ctr_tool::format("%.1f KiB", static_cast<double>(b) / kKiB);
  return ctr_tool::format("%zu B", b);
}

std::string time_text(double ms) {
  if (ms < 1) return ctr_tool::format("%.1f us", ms * 1000);
  if (ms < 1000) return ctr_tool::format("%.2f ms", ms);
  return ctr_tool::format("%.2f s", ms / 1000);
}

// ------------------------------------------------------------------------------------------
// Collectives

enum Coll : int { AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Barrier };
constexpr int kChecked = Barrier;  // the collectives with data to check
const char *const kCollName[] = {"all_reduce", "all_gather", "reduce_scatter",
                                 "all_to_all", "broadcast",  "barrier"};

bool is_reduction(Coll c) { return c == AllReduce || c == ReduceScatter; }

// Bus bandwidth per algorithm bandwidth: nccl-tests' factors, the share of the
// data each rank's link carries in an optimal algorithm.
double bus_factor(Coll c, int n) {
  switch (c) {
    case AllReduce: return 2.0 * (n - 1) / n;
    case AllGather:
    case ReduceScatter:
    case AllToAll: return static_cast<double>(n - 1) / n;
    default: return 1;
  }
}

// Throws the failure of a library call, with the library's message.
void check(ctr_status s) {
  if (s != CTR_STATUS_OK) throw ctr_tool::Error(s, ctr_last_error());
}

// One communicator under test: the world's or an axis's (this rank's group).
struct Group {
  std::string axis;  // "world" or the axis name
  ctr_mesh *mesh = nullptr;
  int me = 0, size = 1;
  std::vector<int> members;  // global ranks, in group order
  int groups = 1;            // groups of this axis in the world

  std::string describe() const {
    if (axis == "world") return ctr_tool::format("the world (%d ranks)", size);
    return groups == 1 ? ctr_tool::format("axis %s (%d ranks)", axis.c_str(), size)
                       : ctr_tool::format("axis %s (%d groups of %d ranks)", axis.c_str(), groups, size);
  }
};

// A collective's buffers. count is the elements per member's block for the
// gathers, scatters and exchanges, and the elements in all otherwise.
struct Op {
  Coll coll = Barrier;
  int n = 1, root = 0;
  size_t count = 0;
  std::vector<float> send, recv;
  std::vector<size_t> counts, displs;

  Op(Coll c, size_t bytes, int members) : coll(c), n(members) {
    const size_t elems = std::max<size_t>(1, bytes / sizeof(float));
    const auto un = static_cast<size_t>(n);
    switch (c) {
      case AllReduce:
        count = elems;
        send.resize(count);
        recv.resize(count);
        break;
      case Broadcast:
        count = elems;
        recv.resize(count);
        break;
      case AllGather:
        count = std::max<size_t>(1, elems / un);
        send.resize(count);
        recv.resize(count * un);
        break;
      case ReduceScatter:
        count = std::max<size_t>(1, elems / un);
        send.resize(count * un);
        recv.resize(count);
        break;
      case AllToAll:
        count = std::max<size_t>(1, elems / un);
        send.resize(count * un);
        recv.resize(count * un);
        counts.assign(un, count);
        for (size_t j = 0; j < un; ++j) displs.push_back(j * count);
        break;
      case Barrier:
        break;
    }
  }

  // The size as nccl-tests counts it: the whole buffer of the gathered,
  // scattered or exchanged data, else the reduced or broadcast buffer.
  size_t bytes() const {
    if (coll == Barrier) return 0;
    const size_t blocks = coll == AllReduce || coll == Broadcast ? 1 : static_cast<size_t>(n);
    return count * blocks * sizeof(float);
  }

  // Runs the collective on the group to completion.
  void run(const Group &g) {
    ctr_mesh *m = g.mesh;
    const char *axis = g.axis.c_str();
    switch (coll) {
      case AllReduce:
        check(ctr_mesh_all_reduce(m, axis, send.data(), recv.data(), count, CTR_DTYPE_F32, CTR_REDUCE_SUM));
        break;
      case AllGather: check(ctr_mesh_all_gather(m, axis, send.data(), recv.data(), count * sizeof(float))); break;
      case ReduceScatter:
        check(ctr_mesh_reduce_scatter(m, axis, send.data(), recv.data(), count, CTR_DTYPE_F32, CTR_REDUCE_SUM));
        break;
      case AllToAll:
        check(ctr_mesh_all_to_all_v(m, axis, send.data(), counts.data(), displs.data(), recv.data(), counts.data(),
                                    displs.data(), sizeof(float)));
        break;
      case Broadcast: check(ctr_mesh_broadcast(m, axis, recv.data(), count * sizeof(float), root)); break;
      case Barrier: check(ctr_mesh_barrier(m, axis)); break;
    }
  }
};

// ------------------------------------------------------------------------------------------
// Fault injection for the tests (CTR_CHECK_INJECT)

struct Inject {
  int slow_rank = -1, slow_ms = 0;
  int corrupt_rank = -1, corrupt_coll = -1;  // -1: every checked collective

  void before_timed(int rank) const {
    if (rank == slow_rank) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms));
  }
  bool corrupts(int rank, Coll c) const {
    return rank == corrupt_rank && (corrupt_coll < 0 || corrupt_coll == c);
  }
};

Inject read_inject(int world) {
  Inject in;
  const char *env = std::getenv("CTR_CHECK_INJECT");
  if (!env || !*env) return in;
  const std::string spec = env;
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t colon = spec.find(':', at);
    parts.push_back(spec.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  const auto number = [&](const std::string &s, int lo, int hi) {
    char *end = nullptr;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || v < lo || v > hi)
      fail(CTR_STATUS_INVALID_OPTION,
           ctr_tool::format("CTR_CHECK_INJECT='%s': '%s' is not a number in [%d, %d]", env, s.c_str(),
                     lo, hi));
    return static_cast<int>(v);
  };
  if (parts[0] == "slow" && parts.size() == 3) {
    in.slow_rank = number(parts[1], 0, world - 1);
    in.slow_ms = number(parts[2], 0, 3600 * 1000);
  } else if (parts[0] == "corrupt" && (parts.size() == 2 || parts.size() == 3)) {
    in.corrupt_rank = number(parts[1], 0, world - 1);
    if (parts.size() == 3) {
      for (int c = 0; c < kChecked; ++c)
        if (parts[2] == kCollName[c]) in.corrupt_coll = c;
      if (in.corrupt_coll < 0)
        fail(CTR_STATUS_INVALID_OPTION,
             ctr_tool::format("CTR_CHECK_INJECT='%s': no checked collective '%s'", env, parts[2].c_str()));
    }
  } else {
    fail(CTR_STATUS_INVALID_OPTION,
         ctr_tool::format("CTR_CHECK_INJECT='%s': expected slow:RANK:MS or corrupt:RANK[:COLLECTIVE]",
                   env));
  }
  return in;
}

// ------------------------------------------------------------------------------------------
// Correctness

// A small integer from (source rank, index, salt): every rank can compute any
// rank's data, and sums of thousands of them are exact in float.
float value(int src, size_t i, uint32_t salt) {
  uint64_t x = (uint64_t{static_cast<uint32_t>(src)} << 40) ^ (uint64_t{salt} << 20) ^ i;
  x += 0x9e3779b97f4a7c15ull;  // splitmix64
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<int>(x % 2001) - 1000);
}

// What one rank found in one collective at one size; gathered as bytes.
struct Finding {
  int64_t wrong = 0;     // elements of this rank's result that were wrong
  int64_t elements = 0;  // elements checked
  int64_t first = -1;    // the first wrong one
  float got = 0, expected = 0;
  int32_t from = -1;       // the rank that element came from (-1: a reduction)
  int32_t culprits = 0;    // ranks whose data was wrong
  int32_t culprit[4] = {-1, -1, -1, -1};  // the first of them
  int32_t diagnosed = 0;   // a reduction's inputs were gathered and compared

  void note(int64_t k, float g, float e, int src) {
    if (wrong++ == 0) first = k, got = g, expected = e, from = src;
  }
  void blame(int rank) {
    for (int i = 0; i < culprits && i < 4; ++i)
      if (culprit[i] == rank) return;
    if (culprits < 4) culprit[culprits] = rank;
    ++culprits;
  }
};
static_assert(std::is_trivially_copyable_v<Finding>);

// Runs collective c at `bytes` on the group and checks this rank's result.
Finding verify(const Group &g, Coll c, size_t bytes, uint32_t salt, const Inject &inj, int rank) {
  const int n = g.size;
  Op op(c, bytes, n);
  const size_t cnt = op.count;
  Finding f;
  f.elements = static_cast<int64_t>(op.recv.size());

  if (c == Broadcast) {  // from every member in turn; the root's data is the culprit
    f.elements *= n;
    for (int root = 0; root < n; ++root) {
      const uint32_t s = salt + 0x1000u * static_cast<uint32_t>(root + 1);
      op.root = root;
      for (size_t i = 0; i < cnt; ++i)
        op.recv[i] = g.me == root ? value(g.members[root], i, s) : -1e9f;
      if (g.me == root && inj.corrupts(rank, c)) op.recv[cnt / 2] += 1;
      op.run(g);
      const int64_t before = f.wrong;
      for (size_t i = 0; i < cnt; ++i) {
        const float want = value(g.members[root], i, s);
        if (op.recv[i] != want)
          f.note(static_cast<int64_t>(root * cnt + i), op.recv[i], want, g.members[root]);
      }
      if (f.wrong > before) f.blame(g.members[root]);
    }
    return f;
  }

  for (size_t j = 0; j < op.send.size(); ++j) op.send[j] = value(rank, j, salt);
  if (inj.corrupts(rank, c)) op.send[op.send.size() / 2] += 1;
  op.run(g);

  for (size_t k = 0; k < op.recv.size(); ++k) {
    float want = 0;
    int src = -1;
    switch (c) {
      case AllReduce:
        for (int m = 0; m < n; ++m) want += value(g.members[m], k, salt);
        break;
      case ReduceScatter:
        for (int m = 0; m < n; ++m) want += value(g.members[m], g.me * cnt + k, salt);
        break;
      case AllGather:
        src = g.members[k / cnt];
        want = value(src, k % cnt, salt);
        break;
      case AllToAll:
        src = g.members[k / cnt];
        want = value(src, g.me * cnt + k % cnt, salt);
        break;
      default: break;
    }
    if (op.recv[k] != want) {
      f.note(static_cast<int64_t>(k), op.recv[k], want, src);
      if (src >= 0) f.blame(src);
    }
  }
  if (!is_reduction(c)) return f;

  // A wrong sum does not say whose input was wrong: when any member's result
  // is wrong, the group gathers every input and compares it with what it should be.
  int32_t any = f.wrong > 0;
  check(ctr_mesh_all_reduce(g.mesh, g.axis.c_str(), &any, &any, 1, CTR_DTYPE_I32, CTR_REDUCE_MAX));
  if (!any) return f;
  f.diagnosed = 1;
  std::vector<float> inputs(op.send.size() * static_cast<size_t>(n));
  check(ctr_mesh_all_gather(g.mesh, g.axis.c_str(), op.send.data(), inputs.data(), op.send.size() * sizeof(float)));
  for (int m = 0; m < n; ++m)
    for (size_t j = 0; j < op.send.size(); ++j)
      if (inputs[m * op.send.size() + j] != value(g.members[m], j, salt)) {
        f.blame(g.members[m]);
        break;
      }
  return f;
}

// One error line per collective and communicator that went wrong anywhere,
// from every rank's findings (all[rank * per_rank + k]); returns how many.
int report_wrong(const std::vector<Finding> &all, size_t per_rank, int world,
                 const std::vector<Group> &groups, const std::vector<size_t> &sizes) {
  int failed = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi)
    for (int c = 0; c < kChecked; ++c) {
      std::set<int> wrong_ranks, culprits;
      std::vector<std::string> at_sizes;
      std::string example;
      bool diagnosed = false, unnamed = false;
      for (size_t si = 0; si < sizes.size(); ++si) {
        const size_t k = (gi * sizes.size() + si) * kChecked + static_cast<size_t>(c);
        bool bad_here = false;
        for (int r = 0; r < world; ++r) {
          const Finding &f = all[static_cast<size_t>(r) * per_rank + k];
          diagnosed |= f.diagnosed != 0;
          for (int i = 0; i < f.culprits && i < 4; ++i) culprits.insert(f.culprit[i]);
          unnamed |= f.culprits > 4;
          if (f.wrong == 0) continue;
          bad_here = true;
          wrong_ranks.insert(r);
          if (example.empty())
            example = ctr_tool::format(
                "rank %d: element %lld%s is %g, expected %g; %lld of %lld elements wrong", r,
                static_cast<long long>(f.first),
                f.from >= 0 ? ctr_tool::format(" (from rank %d)", f.from).c_str() : "",
                static_cast<double>(f.got), static_cast<double>(f.expected),
                static_cast<long long>(f.wrong), static_cast<long long>(f.elements));
        }
        if (bad_here) at_sizes.push_back(bytes_text(sizes[si]));
      }
      if (wrong_ranks.empty()) continue;
      ++failed;
      std::string sizes_text;
      for (const auto &s : at_sizes) sizes_text += (sizes_text.empty() ? "" : ", ") + s;
      std::string whose;
      if (!culprits.empty())
        whose = ctr_tool::format("; the data from rank%s %s%s was wrong", culprits.size() == 1 ? "" : "s",
                          rank_list(culprits).c_str(), unnamed ? " and others" : "");
      else if (diagnosed)
        whose = "; every rank's input arrived intact in an all_gather: the reduction itself "
                "is wrong";
      std::fprintf(stderr, "ctr: error: %s: %s on %s at %s: wrong result on rank%s %s (%s)%s\n",
                   ctr_status_string(CTR_STATUS_COMM_ERROR), kCollName[c],
                   groups[gi].describe().c_str(), sizes_text.c_str(),
                   wrong_ranks.size() == 1 ? "" : "s", rank_list(wrong_ranks).c_str(),
                   example.c_str(), whose.c_str());
    }
  return failed;
}

// ------------------------------------------------------------------------------------------
// Speed and skew

// Milliseconds per operation of c at `bytes` on this rank's group, back to back.
double time_collective(const Group &g, Coll c, size_t bytes, int iters, int warmup,
                       const Inject &inj, int rank, size_t *nccl_bytes) {
  Op op(c, bytes, g.size);
  *nccl_bytes = op.bytes();
  std::fill(op.send.begin(), op.send.end(), 1.0f);
  std::fill(op.recv.begin(), op.recv.end(), 1.0f);
  for (int i = 0; i < warmup; ++i) op.run(g);
  Op(Barrier, 0, g.size).run(g);
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    inj.before_timed(rank);
    op.run(g);
  }
  return ms_since(t0) / iters;
}

// The mesh as ctr_mesh_describe gives it.
struct MeshInfo {
  ctr_mesh *mesh = nullptr;
  int rank = 0, world = 1;
  std::vector<std::pair<std::string, int>> axes;
  std::string transport;
  double timeout_s = 0;
};

MeshInfo mesh_info(ctr_mesh *mesh) {
  const char *text = nullptr;
  check(ctr_mesh_describe(mesh, &text));
  const nlohmann::json j = nlohmann::json::parse(text);
  MeshInfo m;
  m.mesh = mesh;
  m.rank = j.at("rank").get<int>();
  m.world = j.at("world").get<int>();
  for (const auto &a : j.at("axes")) m.axes.push_back({a.at("name").get<std::string>(), a.at("size").get<int>()});
  m.transport = j.at("transport").get<std::string>();
  m.timeout_s = j.at("timeout_s").get<double>();
  return m;
}

double world_max(const MeshInfo &mesh, double v) {
  check(ctr_mesh_all_reduce(mesh.mesh, "world", &v, &v, 1, CTR_DTYPE_F64, CTR_REDUCE_MAX));
  return v;
}

// Times every collective on the group (all groups of an axis at once, as in
// training) and, on rank 0, prints the slowest group's times as a table.
void time_group(const MeshInfo &mesh, const Group &g, size_t bytes, int iters, int warmup,
                const Inject &inj) {
  struct Row {
    Coll coll;
    size_t bytes;
    double ms;
  };
  std::vector<Row> rows;
  const auto add = [&](Coll c, size_t b) {
    size_t nb = 0;
    const double ms = time_collective(g, c, b, iters, warmup, inj, mesh.rank, &nb);
    rows.push_back({c, nb, world_max(mesh, ms)});
  };
  add(AllReduce, sizeof(float));  // the latency
  for (int c = 0; c <= Barrier; ++c) add(static_cast<Coll>(c), bytes);
  if (mesh.rank != 0) return;

  std::printf("\n%s%s\n", g.describe().c_str(), g.groups > 1 ? ", the slowest group's times" : "");
  std::printf("  %-15s %10s %11s %11s %11s\n", "collective", "bytes", "time/op", "algbw GB/s",
              "busbw GB/s");
  for (const Row &r : rows) {
    if (r.coll == Barrier) {
      std::printf("  %-15s %10s %11s %11s %11s\n", kCollName[r.coll], "-",
                  time_text(r.ms).c_str(), "-", "-");
      continue;
    }
    const double algbw = static_cast<double>(r.bytes) / (r.ms * 1e-3) / 1e9;
    const double busbw = algbw * bus_factor(r.coll, g.size);
    std::printf("  %-15s %10s %11s %11.3f %11.3f%s\n", kCollName[r.coll],
                bytes_text(r.bytes).c_str(), time_text(r.ms).c_str(), algbw, busbw,
                r.bytes <= sizeof(float) ? "  (latency)" : "");
  }
}

// Who the others wait for. Each round is a world barrier, then a small world
// all_reduce; every rank takes the median over the rounds of its time from the
// barrier to the all_reduce (arrive) and inside it (wait), and the world
// gathers them. The rank that waits least is the one the others wait for.
struct Skew {
  int rank = 0;           // the rank that waits least
  double wait = 0;        // its wait, ms
  double arrive = 0;      // its time from the barrier to the collective, ms
  double others = 0;      // the median wait of the other ranks, ms
};

Skew measure_skew(const MeshInfo &mesh, const Group &world, int rounds, const Inject &inj) {
  Op op(AllReduce, kSkewBytes, world.size);
  Op barrier(Barrier, 0, world.size);
  op.run(world);
  std::vector<double> arrive, wait;
  for (int i = 0; i < rounds; ++i) {
    barrier.run(world);
    const auto t0 = Clock::now();
    inj.before_timed(mesh.rank);
    const auto t1 = Clock::now();
    op.run(world);
    arrive.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    wait.push_back(ms_since(t1));
  }
  double mine[2] = {median(arrive), median(wait)};
  std::vector<double> all(2 * static_cast<size_t>(world.size));
  check(ctr_mesh_all_gather(world.mesh, "world", mine, all.data(), sizeof mine));

  Skew s;
  std::vector<double> others;
  for (int r = 0; r < world.size; ++r)
    if (all[2 * r + 1] < all[2 * s.rank + 1]) s.rank = r;
  for (int r = 0; r < world.size; ++r)
    if (r != s.rank) others.push_back(all[2 * r + 1]);
  s.arrive = all[2 * s.rank];
  s.wait = all[2 * s.rank + 1];
  s.others = median(others);
  return s;
}

// The groups to check: the world's, then each axis of more than one rank.
std::vector<Group> mesh_groups(const MeshInfo &mesh) {
  std::vector<Group> groups;
  const auto add = [&](const std::string &axis, int count) {
    Group g;
    g.axis = axis;
    g.mesh = mesh.mesh;
    check(ctr_mesh_group(mesh.mesh, axis.c_str(), &g.me, &g.size));
    for (int i = 0; i < g.size; ++i) {
      int r = 0;
      check(ctr_mesh_group_member(mesh.mesh, axis.c_str(), i, &r));
      g.members.push_back(r);
    }
    g.groups = count;
    groups.push_back(std::move(g));
  };
  add("world", 1);
  for (const auto &[name, size] : mesh.axes)
    if (size > 1) add(name, mesh.world / size);
  return groups;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// The command

struct CheckCommand::Args {
  CLI::App *cmd = nullptr;
  CLI::Option *mesh_opt = nullptr, *timeout_opt = nullptr;
  std::string mesh, bytes = "4M";
  int iters = 20, warmup = 2;
  double timeout = 60, slow_factor = 2, slow_ms = 1;
};

CheckCommand::CheckCommand(CLI::App &app) : args_(std::make_unique<Args>()) {
  Args &a = *args_;
  a.cmd = app.add_subcommand(
      "check", "Check every communicator of the mesh: exact results, bandwidth, slow ranks "
               "(run on every rank: ctr launch -n N -- ctr check)");
  a.mesh_opt = a.cmd->add_option("--mesh", a.mesh, "Mesh axes, e.g. dp=2,fsdp=4");
  a.cmd->add_option("--bytes", a.bytes, "Size to time the collectives at (K, M, G: KiB, MiB, GiB)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string &text) -> std::string {
            return parse_bytes(text) ? "" : "expected a size from 1 byte to 1G, such as 256K or 4M";
          },
          "SIZE"));
  a.cmd->add_option("--iters", a.iters, "Timed iterations of each collective")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  a.cmd->add_option("--warmup", a.warmup, "Untimed iterations before them")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  a.timeout_opt = a.cmd->add_option("--timeout", a.timeout,
                                    "Seconds a rank waits for its peers before the check fails "
                                    "naming the missing rank (60)")
                      ->check(CLI::PositiveNumber);
  a.cmd->add_option("--slow-factor", a.slow_factor,
                    "A rank is slow when the others wait a median of this many times longer "
                    "for it than it waits itself")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 1e6));
  a.cmd->add_option("--slow-ms", a.slow_ms,
                    "... and at least this many milliseconds longer per collective")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
}

CheckCommand::~CheckCommand() = default;

bool CheckCommand::parsed() const { return args_->cmd->parsed(); }

int CheckCommand::run() const {
  const Args &a = *args_;
  const size_t bytes = *parse_bytes(a.bytes);

  // The mesh, as `ctr run` makes it; the check works on its communicators.
  ctr_options *opts = nullptr;
  check(ctr_options_create(&opts));
  std::unique_ptr<ctr_options, void (*)(ctr_options *)> opts_owner(opts, ctr_options_free);
  if (a.mesh_opt->count() > 0) check(ctr_options_set_string(opts, "mesh", a.mesh.c_str()));
  if (a.timeout_opt->count() > 0) check(ctr_options_set_float(opts, "timeout", a.timeout));
  ctr_mesh *raw = nullptr;
  check(ctr_mesh_create_from_env(opts, &raw));
  std::unique_ptr<ctr_mesh, void (*)(ctr_mesh *)> mesh_owner(raw, ctr_mesh_free);
  const MeshInfo mesh = mesh_info(raw);
  auto body = [&]() -> int {
    const int rank = mesh.rank, world = mesh.world;
    const bool lead = rank == 0;

    if (world == 1) {
      std::printf("ctr check: one rank, no communicator to check (start the ranks with ctr "
                  "launch -n N, torchrun or srun)\n");
      return 0;
    }
    const Inject inj = read_inject(world);
    const std::vector<Group> groups = mesh_groups(mesh);
    std::vector<size_t> sizes;
    for (const size_t s : kCheckSizes)
      if (s < bytes) sizes.push_back(s);
    sizes.push_back(bytes);

    if (lead) {
      std::string axes, sizes_text;
      for (const auto &[name, size] : mesh.axes)
        axes += (axes.empty() ? "" : ",") + ctr_tool::format("%s=%d", name.c_str(), size);
      for (const size_t s : sizes) sizes_text += (sizes_text.empty() ? "" : ", ") + bytes_text(s);
      std::printf("ctr check: %d ranks, mesh %s, transport %s, timeout %g s\n", world, axes.c_str(),
                  mesh.transport.c_str(), mesh.timeout_s);
      std::printf("checking all_reduce, all_gather, reduce_scatter, all_to_all and broadcast at "
                  "%s on %zu communicators\n",
                  sizes_text.c_str(), groups.size());
      std::fflush(stdout);
    }

    // Correctness: every rank's findings, in one order on every rank, then gathered.
    std::vector<Finding> mine;
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (size_t si = 0; si < sizes.size(); ++si)
        for (int c = 0; c < kChecked; ++c) {
          const auto salt = static_cast<uint32_t>((gi * 16 + si) * 16 + static_cast<size_t>(c));
          mine.push_back(verify(groups[gi], static_cast<Coll>(c), sizes[si], salt, inj, rank));
        }
    std::vector<Finding> all(mine.size() * static_cast<size_t>(world));
    check(ctr_mesh_all_gather(mesh.mesh, "world", mine.data(), all.data(), mine.size() * sizeof(Finding)));
    int wrong = 0;
    for (const Finding &f : all) wrong += f.wrong > 0;
    if (lead)
      std::printf(wrong == 0 ? "results: all exact\n"
                             : "results: WRONG (%d rank results; see the errors)\n",
                  wrong);

    for (const Group &g : groups) time_group(mesh, g, bytes, a.iters, a.warmup, inj);

    const Skew skew = measure_skew(mesh, groups[0], a.iters, inj);
    const bool slow =
        skew.others >= a.slow_factor * skew.wait && skew.others - skew.wait >= a.slow_ms;
    if (lead) {
      std::printf("\nskew: a %s world all_reduce after a barrier, %d rounds: rank %d waits least "
                  "inside it, %s; the others a median %s%s\n",
                  bytes_text(kSkewBytes).c_str(), a.iters, skew.rank, time_text(skew.wait).c_str(),
                  time_text(skew.others).c_str(), slow ? "" : ": no slow rank");
      if (slow)
        std::fprintf(stderr,
                     "ctr: check: rank %d is slow: the others wait for it in every collective (a "
                     "median %s per all_reduce, %.1fx its own wait of %s; it reached each one %s "
                     "after the barrier)\n",
                     skew.rank, time_text(skew.others).c_str(),
                     skew.wait > 0 ? skew.others / skew.wait : INFINITY,
                     time_text(skew.wait).c_str(), time_text(skew.arrive).c_str());
      if (wrong > 0) report_wrong(all, mine.size(), world, groups, sizes);
      std::fflush(stdout);
      std::fflush(stderr);
    }
    // Every rank stays until rank 0 has printed, so that a launcher that ends the
    // job when the first rank exits does not cut the report short.
    Op(Barrier, 0, world).run(groups[0]);
    if (wrong > 0) return 1;
    return slow ? kExitSlowRank : 0;
  };
  // (A peer that died or stopped answering fails a host collective, which
  // notes it on the mesh: its teardown does not wait for that peer.)
  return body();
}

}  // namespace ctr_tool
