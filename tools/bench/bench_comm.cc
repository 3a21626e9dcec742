// One rank of the communicator benchmark; bench_comm.py starts two and sets the scene.
//
// Measures all_reduce (f32 sum), all_gather, reduce_scatter (f32 sum) and all_to_all_v
// bandwidth of the UCX communicator (on one machine: its shared-memory path, unless
// CTR_SHM=0) from 4 KiB to 64 MiB, memcpy bandwidth at the same sizes (the ceiling for any
// transfer through memory on this machine), and the CPU time the process burns
// while the communicator sits idle (the progress thread must sleep, not spin).
// With --shared every buffer is a shared host allocation (comm/shared_host.h),
// which the shared-memory path reads in place; the lines then say coll_shared.
// Rank 0 prints one line per figure in a fixed, parseable format:
//
//   coll all_reduce 4096 iters 2000 us 12.3 algbw_gbs 0.33 busbw_gbs 0.33
//   memcpy 4096 gbs 25.1
//   idle_cpu rank 0 pct 0.4
//
// Sizes follow NCCL's convention: all_reduce counts the array, all_gather the
// gathered output, reduce_scatter each rank's input (every block), all_to_all_v
// each rank's send buffer (an equal share of it to every rank, itself included:
// with two ranks, half to the peer, the MoE token exchange's shape under even
// routing); bus bandwidth scales algorithm bandwidth by 2(n-1)/n for all_reduce
// and (n-1)/n for the others, so it compares directly with a point-to-point link.

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "comm/shared_host.h"
#include "core/status.h"

namespace {

using Clock = std::chrono::steady_clock;

int env_int(const char *name, int fallback) {
  const char *v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

double cpu_seconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

// Enough repetitions to move about 1 GiB, so small sizes are not all noise;
// a pure function of the size, so every rank runs the same count.
int iterations(size_t bytes) {
  return static_cast<int>(std::clamp<size_t>((size_t{1} << 30) / bytes, 5, 2000));
}

double memcpy_gbs(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  int iters = iterations(bytes);
  std::memcpy(b.data(), a.data(), bytes);
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    a[i % bytes] = static_cast<char>(i);  // keeps the copies from being merged
    std::memcpy(b.data(), a.data(), bytes);
  }
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (b[0] == 42) std::printf(" ");
  return static_cast<double>(bytes) * iters / s / 1e9;
}

}  // namespace

// A benchmark buffer of floats, all 1: ordinary memory, or a shared host
// allocation that the peers read in place.
class Floats {
 public:
  Floats(size_t n, bool shared) : n_(n) {
    const size_t bytes = std::max<size_t>(n, 1) * 4;
    p_ = static_cast<float *>(shared ? ctr::shared_host_alloc(bytes) : std::malloc(bytes));
    if (!p_) {
      std::fprintf(stderr, "bench_comm: could not allocate %zu bytes%s\n", bytes,
                   shared ? " of shared host memory" : "");
      std::exit(1);
    }
    std::fill(p_, p_ + n, 1.0f);
  }
  ~Floats() {
    if (!ctr::shared_host_free(p_)) std::free(p_);
  }
  Floats(const Floats &) = delete;
  Floats &operator=(const Floats &) = delete;
  float *data() const { return p_; }
  size_t size() const { return n_; }

 private:
  size_t n_;
  float *p_ = nullptr;
};

int main(int argc, char **argv) {
  // --shared: every buffer is a shared host allocation (read in place).
  const bool shared = argc > 1 && std::strcmp(argv[1], "--shared") == 0;
  const int rank = env_int("CTR_RANK", 0), world = env_int("CTR_WORLD_SIZE", 1);
  ctr::RendezvousConfig cfg;
  cfg.rank = rank;
  cfg.world = world;
  cfg.port = env_int("CTR_MASTER_PORT", 29500);
  if (const char *a = std::getenv("CTR_MASTER_ADDR")) cfg.addr = a;
  if (const char *t = std::getenv("CTR_JOB_TOKEN")) cfg.token = t;
  try {
    auto store = ctr::store_join(cfg);
    ctr::Comm c = ctr::ucx_comm_create(*store, rank, world, 120000);
    const double n = world;
    std::vector<size_t> sizes;
    for (size_t s = size_t{4} << 10; s <= size_t{64} << 20; s *= 4) sizes.push_back(s);

    for (const char *op : {"all_reduce", "all_gather", "reduce_scatter", "all_to_all_v"}) {
      const bool ar = std::strcmp(op, "all_reduce") == 0;
      const bool a2a = std::strcmp(op, "all_to_all_v") == 0;
      const bool rs = std::strcmp(op, "reduce_scatter") == 0;
      for (size_t bytes : sizes) {
        Floats send(ar || a2a || rs ? bytes / 4 : bytes / 4 / world, shared),
            recv(rs ? bytes / 4 / world : bytes / 4, shared);
        // all_to_all_v: block j of the send buffer to rank j, block j of the
        // receive buffer from rank j.
        const size_t block = bytes / 4 / world;
        std::vector<size_t> counts(world, block), displs(world);
        for (int j = 0; j < world; ++j) displs[j] = j * block;
        auto issue = [&] {
          if (a2a)
            return c.iface->all_to_all_v(c.ctx, send.data(), counts.data(), displs.data(),
                                         recv.data(), counts.data(), displs.data(), 4);
          if (rs)
            return c.iface->reduce_scatter(c.ctx, send.data(), recv.data(), recv.size(),
                                           CTR_DTYPE_F32, ctr::ReduceOp::Sum);
          return ar ? c.iface->all_reduce(c.ctx, send.data(), recv.data(), send.size(),
                                          CTR_DTYPE_F32, ctr::ReduceOp::Sum)
                    : c.iface->all_gather(c.ctx, send.data(), recv.data(), send.size() * 4);
        };
        for (int i = 0; i < 3; ++i) ctr::comm_wait(c, issue());
        ctr::comm_wait(c, c.iface->barrier(c.ctx));
        const int iters = iterations(bytes);
        auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) ctr::comm_wait(c, issue());
        double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
        double algbw = static_cast<double>(bytes) / us / 1e3;
        double busbw = algbw * (ar ? 2 * (n - 1) / n : (n - 1) / n);
        if (rank == 0)
          std::printf("%s %s %zu iters %d us %.1f algbw_gbs %.3f busbw_gbs %.3f\n",
                      shared ? "coll_shared" : "coll", op, bytes,
                      iters, us, algbw, busbw);
      }
    }
    if (rank == 0)
      for (size_t bytes : sizes) std::printf("memcpy %zu gbs %.2f\n", bytes, memcpy_gbs(bytes));

    // Idle: nothing in flight, this thread asleep; what remains is the
    // progress thread (and UCX's own) waiting for events.
    ctr::comm_wait(c, c.iface->barrier(c.ctx));
    double cpu0 = cpu_seconds();
    auto t0 = Clock::now();
    std::this_thread::sleep_for(std::chrono::seconds(3));
    double pct =
        100.0 * (cpu_seconds() - cpu0) / std::chrono::duration<double>(Clock::now() - t0).count();
    std::vector<double> all(world);
    ctr::comm_wait(c, c.iface->all_gather(c.ctx, &pct, all.data(), sizeof pct));
    if (rank == 0)
      for (int r = 0; r < world; ++r) std::printf("idle_cpu rank %d pct %.2f\n", r, all[r]);
    std::fflush(stdout);
    c.iface->destroy(c.ctx);
  } catch (const ctr::Error &e) {
    std::fprintf(stderr, "bench_comm: rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
