// The device side of the emulated CUDA execution model (tests/cuda_emu): what
// nvcc and the toolkit give a kernel, as host C++.
//
// A launch runs its grid on the launching thread, one block after another;
// the threads of a block are fibers (exec.cc) that switch only where CUDA
// threads wait for each other: __syncthreads, and the warp operations, which
// are barriers of the lanes they name with an exchange of values. So shared
// memory (`__shared__` is `static`: one block runs at a time in the process),
// block reductions, shuffles, votes and __match_any_sync behave as on a GPU
// whatever the order the fibers run in. threadIdx, blockIdx, blockDim and
// gridDim read the running fiber's and block's records.
//
// Kernels launch through CTR_LAUNCH (kernels/cuda/check.cuh), defined here as
// a call of the kernel by name inside a generic lambda, so that template
// arguments are deduced from the launch's arguments as nvcc deduces them; the
// arguments are copied once at the launch (a captured graph replays them).
#pragma once

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ctr_emu/types.h"

// ---------------------------------------------------------------------------
// Keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __shared__ static
constexpr int warpSize = 32;

namespace ctr_emu {

// The running thread's record (the first member of exec.cc's fiber) and the
// running block's; set by the executor, read through the built-in names.
struct ThreadRecord {
  uint3 idx;
};
extern ThreadRecord *g_thread;
extern uint3 g_block_idx;
extern dim3 g_block_dim, g_grid_dim;

// This block's dynamic shared memory (the launch's size, guarded at its end).
void *dynamic_shared();

// ---------------------------------------------------------------------------
// Barriers and warp exchanges (exec.cc)

// __syncthreads and its counting forms: returns how many threads of the
// block passed a nonzero predicate.
int sync_block(int predicate);

enum class WarpOp : int { Sync, Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All, MatchAny, MatchAll };

// A warp operation of the lanes in `mask`: waits until every lane of the mask
// that has not exited arrives with the same operation and mask, then returns
// this lane's result (a value read from another lane, or a lane mask).
// `pred` receives __match_all_sync's predicate.
uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t value, int arg, int width, int *pred = nullptr);
// The lanes of the running thread's warp that have not exited.
unsigned live_lanes();

template <class T>
uint64_t to_bits(const T &v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a warp exchange moves up to 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  return b;
}
template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// ---------------------------------------------------------------------------
// Launches

// One launch as written: the kernel's name and site, its address when the
// name is one function (for cudaFuncSetAttribute), and its configuration.
struct LaunchSite {
  const char *name;
  const char *file;
  int line;
  const void *func;
  dim3 grid, block;
  size_t shared;
  cudaStream_t stream;
  int kernel = -1;  // the kernel instantiation (register_kernel)
};

// Every kernel instantiation a library holds registers itself when it loads
// (type: the launch's call, which names the instantiating function); the
// executor counts each one's launches, and CTR_EMU_COVERAGE=FILE appends the
// counts to FILE at exit, so a suite can show which kernels it never ran.
int register_kernel(const char *type);
template <class F>
const char *type_label() {
  return __PRETTY_FUNCTION__;  // "... [with F = <the launch's call>]", readable
}
template <class F>
struct KernelId {
  static inline const int id = register_kernel(type_label<F>());
};

// Runs one thread of a launch (the kernel with the launch's arguments).
struct KernelBody {
  virtual ~KernelBody() = default;
  virtual void run() const = 0;
};

// Checks the configuration, then runs the grid on the stream (or records it
// into the stream's graph capture). The outcome is the thread's last error.
void launch(const LaunchSite &site, std::shared_ptr<const KernelBody> body);

template <class F>
struct KernelCall final : KernelBody {
  F f;
  explicit KernelCall(F fn) : f(std::move(fn)) {}
  void run() const override { f(); }
};

template <class F>
struct Launcher {
  LaunchSite site;
  F call;
  template <class... A>
  void operator()(A &&...args) const {
    LaunchSite s = site;
    s.kernel = KernelId<F>::id;
    auto bound = [call = call, tup = std::tuple<std::decay_t<A>...>(std::forward<A>(args)...)] { std::apply(call, tup); };
    launch(s, std::make_shared<const KernelCall<decltype(bound)>>(std::move(bound)));
  }
};

template <class F>
Launcher<F> launcher(const char *name, const char *file, int line, const void *func, dim3 grid, dim3 block,
                     size_t shared, cudaStream_t stream, F call) {
  return Launcher<F>{LaunchSite{name, file, line, func, grid, block, shared, stream}, std::move(call)};
}

// The kernel's address where its name denotes one function (a function, a
// template-id, a pointer); null for a template whose arguments the launch
// deduces. The probe makes the name's use dependent, so an overload set fails
// the requirement instead of the compile.
struct AddressProbe {
  template <class T>
  friend constexpr T operator,(AddressProbe, T t) {
    return t;
  }
};
template <class K>
const void *address_of(K *k) {
  return reinterpret_cast<const void *>(k);
}

}  // namespace ctr_emu

#define CTR_EMU_KERNEL_ADDRESS(kernel)                                                           \
  ([&]<class ctr_emu_P = ::ctr_emu::AddressProbe>() -> const void * {                            \
    if constexpr (requires { ::ctr_emu::address_of((ctr_emu_P{}, kernel)); })                    \
      return ::ctr_emu::address_of((ctr_emu_P{}, kernel));                                       \
    else                                                                                         \
      return nullptr;                                                                            \
  }())

#define CTR_LAUNCH(kernel, grid, block, shared, stream)                                                   \
  ::ctr::cuda::LaunchCheck{#kernel, __FILE__, __LINE__},                                                  \
      ::ctr_emu::launcher(#kernel, __FILE__, __LINE__, CTR_EMU_KERNEL_ADDRESS(kernel), grid, block, shared, \
                          stream, [=](const auto &...ctr_emu_args) { kernel(ctr_emu_args...); })

// Dynamic shared memory (kernels/cuda/common.cuh): the launch's buffer.
#define CTR_DYNAMIC_SHARED(T, name) T *name = static_cast<T *>(::ctr_emu::dynamic_shared())

// ---------------------------------------------------------------------------
// Built-in variables

#define threadIdx (static_cast<const uint3 &>(::ctr_emu::g_thread->idx))
#define blockIdx (static_cast<const uint3 &>(::ctr_emu::g_block_idx))
#define blockDim (static_cast<const dim3 &>(::ctr_emu::g_block_dim))
#define gridDim (static_cast<const dim3 &>(::ctr_emu::g_grid_dim))

// ---------------------------------------------------------------------------
// Synchronisation, shuffles and votes

inline void __syncthreads() { ::ctr_emu::sync_block(0); }
inline int __syncthreads_count(int predicate) { return ::ctr_emu::sync_block(predicate != 0); }
inline int __syncthreads_and(int predicate) {
  return ::ctr_emu::sync_block(predicate != 0) == static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}
inline int __syncthreads_or(int predicate) { return ::ctr_emu::sync_block(predicate != 0) != 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::ctr_emu::warp_exchange(::ctr_emu::WarpOp::Sync, mask, 0, 0, 32);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned __activemask() { return ::ctr_emu::live_lanes(); }

template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  using namespace ::ctr_emu;
  return from_bits<T>(warp_exchange(WarpOp::Shfl, mask, to_bits(var), src_lane, width));
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ::ctr_emu;
  return from_bits<T>(warp_exchange(WarpOp::ShflUp, mask, to_bits(var), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace ::ctr_emu;
  return from_bits<T>(warp_exchange(WarpOp::ShflDown, mask, to_bits(var), static_cast<int>(delta), width));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  using namespace ::ctr_emu;
  return from_bits<T>(warp_exchange(WarpOp::ShflXor, mask, to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(::ctr_emu::warp_exchange(::ctr_emu::WarpOp::Ballot, mask, predicate != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(::ctr_emu::warp_exchange(::ctr_emu::WarpOp::Any, mask, predicate != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(::ctr_emu::warp_exchange(::ctr_emu::WarpOp::All, mask, predicate != 0, 0, 32));
}
template <class T>
inline unsigned __match_any_sync(unsigned mask, T value) {
  return static_cast<unsigned>(
      ::ctr_emu::warp_exchange(::ctr_emu::WarpOp::MatchAny, mask, ::ctr_emu::to_bits(value), 0, 32));
}
template <class T>
inline unsigned __match_all_sync(unsigned mask, T value, int *pred) {
  return static_cast<unsigned>(
      ::ctr_emu::warp_exchange(::ctr_emu::WarpOp::MatchAll, mask, ::ctr_emu::to_bits(value), 0, 32, pred));
}

// ---------------------------------------------------------------------------
// Atomics: one grid runs at a time, but host threads may touch the memory
// too, so they are atomic operations of the host.

template <class T>
inline T atomicAdd(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <class T>
inline T atomicSub(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).fetch_sub(v);
}
template <class T>
inline T atomicExch(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
template <class T>
inline T atomicCAS(T *p, std::type_identity_t<T> compare, std::type_identity_t<T> v) {
  std::atomic_ref<T>(*p).compare_exchange_strong(compare, v);
  return compare;
}
template <class T>
inline T atomicMax(T *p, std::type_identity_t<T> v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
inline T atomicMin(T *p, std::type_identity_t<T> v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
inline T atomicAnd(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).fetch_and(v);
}
template <class T>
inline T atomicOr(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).fetch_or(v);
}
template <class T>
inline T atomicXor(T *p, std::type_identity_t<T> v) {
  return std::atomic_ref<T>(*p).fetch_xor(v);
}

// ---------------------------------------------------------------------------
// Integer and bit intrinsics

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __popcll(unsigned long long x) { return std::popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return std::countl_zero(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return std::countl_zero(static_cast<unsigned long long>(x)); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
template <class T>
inline T __ldg(const T *p) {
  return *p;
}

// min and max of CUDA's math headers, for any two arithmetic types.
template <class A, class B>
  requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
  requires std::is_arithmetic_v<A> && std::is_arithmetic_v<B>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// ---------------------------------------------------------------------------
// Fast-math intrinsics: the host's functions (a GPU's differ by a few ulps).

inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
