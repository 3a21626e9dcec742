// A fixed pool of worker threads for the CPU backend's data-parallel loops.
//
// Kernels split their outer loop with parallel_for; the calling thread takes part
// in the work, so a pool of N threads uses N cores with N-1 workers. The pool is
// process-wide and created on first use; its size comes from CTR_NUM_THREADS or
// the number of online cores. Nested parallel_for calls run serially in the caller,
// which keeps kernels free to call helpers that are themselves parallel.
#pragma once

#include <cstdint>
#include <functional>

namespace ctr {

// Number of threads (including the caller) that parallel_for spreads work over.
int num_threads();

// Sets the number of threads; takes effect for later parallel_for calls.
// n <= 0 selects the default (CTR_NUM_THREADS or the core count).
void set_num_threads(int n);

// Runs fn(begin, end) over disjoint chunks covering [0, n). Chunks hold at
// least `grain` items, so small loops stay on the calling thread. Returns when
// every chunk has finished. fn must not throw.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)> &fn);

// How compute and communication share the cores: threads that move data (the
// communicator's progress thread, the backend's comm stream) run at this nice
// value relative to compute, so a message that arrives is handled at once
// instead of after a compute time slice. Default -10, or CTR_COMM_NICE; 0 turns
// it off. Raising priority needs CAP_SYS_NICE; without it threads stay as they are.
void set_comm_nice(int nice);
// Applies the setting to the calling thread (the comm threads call it at start).
void apply_comm_nice();

}  // namespace ctr
