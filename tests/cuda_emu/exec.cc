// The grid executor of the emulated CUDA device: blocks one after another,
// the threads of a block as fibers.
//
// A fiber runs until it waits: at __syncthreads, until every thread of the
// block that has not exited arrives; in a warp operation, until every lane of
// its mask that has not exited arrives with the same operation and mask. The
// last to arrive completes the barrier (for a warp operation it also computes
// every lane's result from the values deposited) and runs on; the waiters are
// queued again in order. If nothing is left to run while threads wait, the
// block deadlocked (a barrier in divergent code): the launch fails, as do
// divergent warp operations, a lane outside its own mask, and a bad shuffle
// width. Each of those is undefined behaviour on a GPU and is reported as a
// sticky launch failure naming the kernel, block and thread.
//
// Fibers switch through a few instructions of assembly on x86-64 (callee-saved
// registers and the stack pointer; no signal mask, unlike swapcontext) and
// through ucontext elsewhere (or with -DCTR_EMU_UCONTEXT). Their stacks have guard pages, and so does the
// block's dynamic shared memory (its end meets one), which is also filled with
// NaN bytes before each block so that reads of unwritten shared memory show.
// A fault inside a kernel is reported with the kernel, block and thread and
// then handed on, so the process still dies of it.

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__) || defined(CTR_EMU_UCONTEXT)
#define CTR_EMU_SWAPCONTEXT 1
#include <ucontext.h>
#endif

#include "emu.h"

namespace ctr_emu {

ThreadRecord *g_thread = nullptr;
uint3 g_block_idx{0, 0, 0};
dim3 g_block_dim, g_grid_dim;

namespace {

constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = size_t{64} << 10;

// ---------------------------------------------------------------------------
// Contexts

#if !defined(CTR_EMU_SWAPCONTEXT)

extern "C" void ctr_emu_switch(void **save_sp, void *load_sp);
extern "C" void ctr_emu_fiber_start();

// ctr_emu_switch saves the callee-saved registers on the current stack,
// stores the stack pointer, loads the other one and restores the registers
// from it. The floating-point control state (MXCSR, the x87 control word) is
// the thread's and no kernel changes it, so it is not switched. A new fiber's
// stack is laid out so that the restore "returns" into ctr_emu_fiber_start,
// which calls r13(r12).
asm(R"(
  .text
  .p2align 4
  .globl ctr_emu_switch
  .hidden ctr_emu_switch
  .type ctr_emu_switch, @function
ctr_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ctr_emu_switch, .-ctr_emu_switch

  .p2align 4
  .globl ctr_emu_fiber_start
  .hidden ctr_emu_fiber_start
  .type ctr_emu_fiber_start, @function
ctr_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size ctr_emu_fiber_start, .-ctr_emu_fiber_start
)");

struct Context {
  void *sp = nullptr;
};

void prepare(Context &c, char *stack, size_t bytes, void (*fn)(void *), void *arg) {
  auto *top = reinterpret_cast<uint64_t *>(reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15});
  uint64_t *sp = top - 9;
  sp[0] = 0;                                    // r15
  sp[1] = 0;                                    // r14
  sp[2] = reinterpret_cast<uint64_t>(fn);       // r13
  sp[3] = reinterpret_cast<uint64_t>(arg);      // r12
  sp[4] = 0;                                    // rbx
  sp[5] = 0;                                    // rbp
  sp[6] = reinterpret_cast<uint64_t>(&ctr_emu_fiber_start);
  sp[7] = sp[8] = 0;  // after the return the stack is 16-byte aligned, as at a call
  c.sp = sp;
}

inline void jump(Context &from, Context &to) { ctr_emu_switch(&from.sp, to.sp); }

#else

struct Context {
  ucontext_t uc;
};

// Every fiber starts the same function, which finds its record in g_thread.
void (*g_entry)(void *) = nullptr;
void ucontext_entry() { g_entry(nullptr); }

void prepare(Context &c, char *stack, size_t bytes, void (*fn)(void *), void *) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  g_entry = fn;
  makecontext(&c.uc, ucontext_entry, 0);
}

inline void jump(Context &from, Context &to) { swapcontext(&from.uc, &to.uc); }

#endif

// ---------------------------------------------------------------------------
// Threads, warps and the running block

enum class State : unsigned char { Ready, Running, AtSyncthreads, InWarpOp, Done };

struct Fiber : ThreadRecord {
  Context ctx;
  int index = 0, lane = 0, warp = 0;
  State state = State::Ready;
};

struct Warp {
  unsigned live = 0;     // lanes not exited
  unsigned arrived = 0;  // lanes waiting in a warp operation
  WarpOp op[32];
  unsigned mask[32];
  uint64_t in[32];
  int arg[32];
  int width[32];
  uint64_t out[32];
  int pred[32];
};

struct Block {
  int n = 0, live = 0;
  int bar_arrived = 0, bar_count = 0, bar_result = 0;
  Fiber *fibers = nullptr;  // kMaxThreads, with their stacks
  char *stacks = nullptr;   // kMaxThreads * (guard page + kStackBytes)
  size_t stack_stride = 0;
  Warp warps[kMaxThreads / 32];
  int queue[kMaxThreads];
  int qhead = 0, qsize = 0;
  Context main;
  const KernelBody *body = nullptr;
  const LaunchSite *site = nullptr;
  bool failed = false;
  std::string why;
  char *shared_area = nullptr;  // the optin limit, then a guard page
  size_t shared_area_bytes = 0;
  char *shared = nullptr;       // this launch's dynamic shared memory
};

Block g_b;
std::atomic<bool> g_in_kernel{false};
pthread_t g_kernel_thread;

size_t page() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

void push(int i) {
  g_b.queue[(g_b.qhead + g_b.qsize) % kMaxThreads] = i;
  ++g_b.qsize;
}
int pop() {
  if (!g_b.qsize) return -1;
  const int i = g_b.queue[g_b.qhead];
  g_b.qhead = (g_b.qhead + 1) % kMaxThreads;
  --g_b.qsize;
  return i;
}

Fiber *current() { return static_cast<Fiber *>(g_thread); }

std::string coords(const char *what, uint3 v) {
  return std::string(what) + " (" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")";
}

const char *op_name(WarpOp op) {
  switch (op) {
    case WarpOp::Sync: return "__syncwarp";
    case WarpOp::Shfl: return "__shfl_sync";
    case WarpOp::ShflUp: return "__shfl_up_sync";
    case WarpOp::ShflDown: return "__shfl_down_sync";
    case WarpOp::ShflXor: return "__shfl_xor_sync";
    case WarpOp::Ballot: return "__ballot_sync";
    case WarpOp::Any: return "__any_sync";
    case WarpOp::All: return "__all_sync";
    case WarpOp::MatchAny: return "__match_any_sync";
    case WarpOp::MatchAll: return "__match_all_sync";
  }
  return "a warp operation";
}

std::string hexmask(unsigned m) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", m);
  return b;
}

// Ends the block with a launch failure; the running fiber is abandoned.
[[noreturn]] void fail(const std::string &what) {
  Fiber *f = current();
  g_b.failed = true;
  g_b.why = what + " in " + coords("block", g_block_idx) + " " + coords("thread", f->idx);
  jump(f->ctx, g_b.main);
  __builtin_unreachable();
}

// Why nothing can run while threads wait.
std::string deadlock() {
  int at_sync = 0;
  std::string warps;
  for (int i = 0; i < g_b.n; ++i)
    if (g_b.fibers[i].state == State::AtSyncthreads) ++at_sync;
  for (int w = 0; w < (g_b.n + 31) / 32; ++w) {
    const Warp &wp = g_b.warps[w];
    if (!wp.arrived) continue;
    const int l = __builtin_ctz(wp.arrived);
    warps += "; lanes " + hexmask(wp.arrived) + " of warp " + std::to_string(w) + " wait in " + op_name(wp.op[l]) +
             "(" + hexmask(wp.mask[l]) + ") for lanes that are elsewhere";
  }
  return "deadlock: " + std::to_string(at_sync) + " threads wait at __syncthreads" + warps;
}

// The running fiber f waits (or has exited): run the next queued one.
void leave(Fiber *f) {
  const int next = pop();
  if (next < 0) {
    if (g_b.live > 0) fail(deadlock());
    jump(f->ctx, g_b.main);  // the block is done
    return;
  }
  Fiber *to = &g_b.fibers[next];
  to->state = State::Running;
  g_thread = to;
  jump(f->ctx, to->ctx);
}

void release_block(Fiber *self) {
  g_b.bar_result = g_b.bar_count;
  g_b.bar_arrived = 0;
  g_b.bar_count = 0;
  for (int i = 0; i < g_b.n; ++i)
    if (g_b.fibers[i].state == State::AtSyncthreads) {
      g_b.fibers[i].state = State::Ready;
      if (&g_b.fibers[i] != self) push(i);
    }
}

uint64_t poison(uint64_t) { return ~uint64_t{0}; }

// Lane l's result of the completed operation of `group`.
void compute(Warp &w, unsigned group) {
  const int first = __builtin_ctz(group);
  const WarpOp op = w.op[first];
  auto read = [&](int l, int src) { return (src >= 0 && src < 32 && (group >> src & 1u)) ? w.in[src] : poison(w.in[l]); };
  unsigned ballot = 0;
  for (unsigned g = group; g; g &= g - 1) {
    const int l = __builtin_ctz(g);
    if (w.in[l] != 0) ballot |= 1u << l;
  }
  for (unsigned g = group; g; g &= g - 1) {
    const int l = __builtin_ctz(g);
    const int width = w.width[l], base = l & ~(width - 1);
    switch (op) {
      case WarpOp::Sync: w.out[l] = 0; break;
      case WarpOp::Shfl: w.out[l] = read(l, base + (w.arg[l] & (width - 1))); break;
      case WarpOp::ShflUp: {
        const int src = l - w.arg[l];
        w.out[l] = src < base ? w.in[l] : read(l, src);
        break;
      }
      case WarpOp::ShflDown: {
        const int src = l + w.arg[l];
        w.out[l] = src >= base + width ? w.in[l] : read(l, src);
        break;
      }
      case WarpOp::ShflXor: {
        const int src = l ^ (w.arg[l] & 31);
        w.out[l] = src >= base + width ? w.in[l] : read(l, src);
        break;
      }
      case WarpOp::Ballot: w.out[l] = ballot; break;
      case WarpOp::Any: w.out[l] = ballot != 0; break;
      case WarpOp::All: w.out[l] = ballot == group; break;
      case WarpOp::MatchAny: {
        unsigned same = 0;
        for (unsigned h = group; h; h &= h - 1)
          if (w.in[__builtin_ctz(h)] == w.in[l]) same |= 1u << __builtin_ctz(h);
        w.out[l] = same;
        break;
      }
      case WarpOp::MatchAll: {
        bool all = true;
        for (unsigned h = group; h; h &= h - 1) all = all && w.in[__builtin_ctz(h)] == w.in[first];
        w.out[l] = all ? group : 0;
        w.pred[l] = all;
        break;
      }
    }
  }
}

// Completes the operation of the lanes in `mask` if every live one arrived.
bool try_complete(int warp, unsigned mask, Fiber *self) {
  Warp &w = g_b.warps[warp];
  const unsigned group = mask & w.live;
  if (!group || (w.arrived & group) != group) return false;
  const int first = __builtin_ctz(group);
  for (unsigned g = group; g; g &= g - 1) {
    const int l = __builtin_ctz(g);
    if (w.op[l] != w.op[first] || w.mask[l] != w.mask[first])
      fail(std::string("divergent warp operations in warp ") + std::to_string(warp) + ": lane " +
           std::to_string(first) + " is in " + op_name(w.op[first]) + "(" + hexmask(w.mask[first]) + "), lane " +
           std::to_string(l) + " in " + op_name(w.op[l]) + "(" + hexmask(w.mask[l]) + ")");
  }
  compute(w, group);
  w.arrived &= ~group;
  for (unsigned g = group; g; g &= g - 1) {
    Fiber &t = g_b.fibers[warp * 32 + __builtin_ctz(g)];
    if (&t == self) continue;
    t.state = State::Ready;
    push(t.index);
  }
  return true;
}

// After a lane exits, the operations that waited only for it complete.
void complete_waiting(int warp) {
  Warp &w = g_b.warps[warp];
  for (bool again = true; again;) {
    again = false;
    for (unsigned a = w.arrived; a; a &= a - 1)
      if (try_complete(warp, w.mask[__builtin_ctz(a)], nullptr)) {
        again = true;
        break;
      }
  }
}

void fiber_main(void *) {
  Fiber *f = current();  // set by whoever switched here first
  g_b.body->run();
  f->state = State::Done;
  --g_b.live;
  g_b.warps[f->warp].live &= ~(1u << f->lane);
  if (g_b.bar_arrived > 0 && g_b.bar_arrived == g_b.live) release_block(nullptr);
  if (g_b.warps[f->warp].arrived) complete_waiting(f->warp);
  leave(f);
  __builtin_unreachable();  // nothing resumes a finished fiber
}

// ---------------------------------------------------------------------------
// Setup: fiber stacks, dynamic shared memory, the fault report

void setup_once() {
  static bool done = false;
  if (done) return;
  done = true;
  const size_t pg = page();
  g_b.stack_stride = pg + kStackBytes;
  const size_t stack_total = g_b.stack_stride * kMaxThreads;
  void *s = mmap(nullptr, stack_total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (s == MAP_FAILED) {
    std::perror("ctr emu: fiber stacks");
    std::abort();
  }
  g_b.stacks = static_cast<char *>(s);
  for (int i = 0; i < kMaxThreads; ++i) mprotect(g_b.stacks + i * g_b.stack_stride, pg, PROT_NONE);
  g_b.fibers = new Fiber[kMaxThreads];
  for (int i = 0; i < kMaxThreads; ++i) g_b.fibers[i].index = i;
  const size_t area = (shared_per_block_optin() + pg - 1) / pg * pg;
  void *sh = mmap(nullptr, area + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (sh == MAP_FAILED) {
    std::perror("ctr emu: shared memory");
    std::abort();
  }
  g_b.shared_area = static_cast<char *>(sh);
  g_b.shared_area_bytes = area;
  mprotect(g_b.shared_area + area, pg, PROT_NONE);
}

struct sigaction g_prev_segv, g_prev_bus;

void on_fault(int sig, siginfo_t *si, void *) {
  if (g_in_kernel.load() && pthread_equal(g_kernel_thread, pthread_self()) && g_b.site) {
    const auto a = reinterpret_cast<uintptr_t>(si->si_addr);
    std::string where = describe_device_address(si->si_addr);
    const auto shared_end = reinterpret_cast<uintptr_t>(g_b.shared_area + g_b.shared_area_bytes);
    if (a >= shared_end && a < shared_end + page())
      where = "past the end of the block's " + std::to_string(g_b.site->shared) + " bytes of dynamic shared memory";
    const auto stacks = reinterpret_cast<uintptr_t>(g_b.stacks);
    if (a >= stacks && a < stacks + g_b.stack_stride * kMaxThreads && (a - stacks) % g_b.stack_stride < page())
      where = "a thread's stack (" + std::to_string(kStackBytes >> 10) + " KiB in the emulator) overflowed";
    Fiber *f = current();
    char msg[1024];
    const int len = std::snprintf(
        msg, sizeof msg, "ctr emu: kernel %s (launched at %s:%d) faulted: %s at address %p%s%s in block (%u,%u,%u)%s\n",
        g_b.site->name, g_b.site->file, g_b.site->line, sig == SIGSEGV ? "SIGSEGV" : "SIGBUS", si->si_addr,
        where.empty() ? "" : ", ", where.c_str(), g_block_idx.x, g_block_idx.y, g_block_idx.z,
        f ? (" thread (" + std::to_string(f->idx.x) + "," + std::to_string(f->idx.y) + "," + std::to_string(f->idx.z) + ")").c_str() : "");
    if (len > 0) (void)!write(2, msg, static_cast<size_t>(len < static_cast<int>(sizeof msg) ? len : sizeof msg - 1));
  }
  // Hand the fault on: the instruction runs again under the previous action.
  sigaction(sig, sig == SIGSEGV ? &g_prev_segv : &g_prev_bus, nullptr);
}

void install_fault_report() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
  });
  // A stack overflow in a fiber is reported from an alternate stack, one per
  // thread that runs kernels.
  struct AltStack {
    void *mem = nullptr;
    AltStack() {
      const size_t bytes = 64 << 10;
      mem = std::malloc(bytes);
      stack_t st{};
      st.ss_sp = mem;
      st.ss_size = bytes;
      sigaltstack(&st, nullptr);
    }
    ~AltStack() {
      stack_t st{};
      st.ss_flags = SS_DISABLE;
      sigaltstack(&st, nullptr);
      std::free(mem);
    }
  };
  thread_local AltStack alt;
  (void)alt;
}

// ---------------------------------------------------------------------------
// Injected failures (CTR_EMU_FAIL_LAUNCH, CTR_EMU_FAIL_CONFIG): "NAME[:N]"
// picks the Nth launch (from 1) whose name as written contains NAME.

struct Injection {
  std::mutex mu;
  std::string spec;
  long seen = 0;
};

bool injected(Injection &inj, const char *env, const char *name) {
  const char *v = std::getenv(env);
  if (!v || !*v) return false;
  std::lock_guard<std::mutex> lock(inj.mu);
  if (inj.spec != v) {
    inj.spec = v;
    inj.seen = 0;
  }
  std::string pat = inj.spec;
  long nth = 1;
  if (const size_t colon = pat.rfind(':'); colon != std::string::npos) {
    nth = std::atol(pat.c_str() + colon + 1);
    pat.resize(colon);
  }
  if (std::strstr(name, pat.c_str()) == nullptr) return false;
  return ++inj.seen == nth;
}

Injection g_fail_launch, g_fail_config;

// ---------------------------------------------------------------------------
// Kernel instantiations and their launch counts (CTR_EMU_COVERAGE)

struct Kernels {
  std::mutex mu;
  std::vector<std::string> types;
  std::vector<long> runs;
  ~Kernels() {
    const char *path = std::getenv("CTR_EMU_COVERAGE");
    if (!path || !*path) return;
    FILE *f = std::fopen(path, "a");
    if (!f) return;
    for (size_t i = 0; i < types.size(); ++i) {
      std::string t = types[i];
      if (const size_t at = t.find("[with F = "); at != std::string::npos) t = t.substr(at + 10, t.size() - at - 11);
      std::fprintf(f, "%ld\t%s\n", runs[i], t.c_str());
    }
    std::fclose(f);
  }
};

Kernels &kernels() {
  static Kernels k;
  return k;
}

std::string site_text(const LaunchSite &s) {
  return std::string("kernel ") + s.name + " (launched at " + s.file + ":" + std::to_string(s.line) + ")";
}

// Runs the grid (under the device lock).
cudaError_t run_grid(const LaunchSite &s, const KernelBody &body) {
  if (s.kernel >= 0) {
    Kernels &k = kernels();
    std::lock_guard<std::mutex> lock(k.mu);
    ++k.runs[static_cast<size_t>(s.kernel)];
  }
  if (injected(g_fail_launch, "CTR_EMU_FAIL_LAUNCH", s.name))
    return set_fault(cudaErrorIllegalAddress, site_text(s) + " made to fail by CTR_EMU_FAIL_LAUNCH");
  setup_once();
  install_fault_report();
  g_grid_dim = s.grid;
  g_block_dim = s.block;
  g_b.body = &body;
  g_b.site = &s;
  g_b.shared = g_b.shared_area + g_b.shared_area_bytes - (s.shared + 15) / 16 * 16;
  g_kernel_thread = pthread_self();
  g_in_kernel.store(true);
  const int n = static_cast<int>(s.block.x * s.block.y * s.block.z);
  const int nwarps = (n + 31) / 32;
  bool ok = true;
  for (unsigned z = 0; ok && z < s.grid.z; ++z)
    for (unsigned y = 0; ok && y < s.grid.y; ++y)
      for (unsigned x = 0; ok && x < s.grid.x; ++x) {
        g_block_idx = uint3{x, y, z};
        g_b.n = g_b.live = n;
        g_b.bar_arrived = g_b.bar_count = g_b.bar_result = 0;
        g_b.failed = false;
        for (int w = 0; w < nwarps; ++w) {
          const int lanes = n - 32 * w >= 32 ? 32 : n - 32 * w;
          g_b.warps[w].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
          g_b.warps[w].arrived = 0;
        }
        g_b.qhead = 0;
        g_b.qsize = 0;
        for (int i = 0; i < n; ++i) {
          Fiber &f = g_b.fibers[i];
          f.idx = uint3{static_cast<unsigned>(i) % s.block.x, static_cast<unsigned>(i) / s.block.x % s.block.y,
                        static_cast<unsigned>(i) / (s.block.x * s.block.y)};
          f.lane = i & 31;
          f.warp = i >> 5;
          f.state = State::Ready;
          prepare(f.ctx, g_b.stacks + i * g_b.stack_stride + page(), kStackBytes, fiber_main, &f);
          push(i);
        }
        if (s.shared) std::memset(g_b.shared, 0xff, (s.shared + 15) / 16 * 16);
        Fiber *first = &g_b.fibers[pop()];
        first->state = State::Running;
        g_thread = first;
        jump(g_b.main, first->ctx);
        ok = !g_b.failed;
      }
  g_in_kernel.store(false);
  g_thread = nullptr;
  g_b.body = nullptr;
  if (!ok) return set_fault(cudaErrorLaunchFailure, site_text(s) + ": " + g_b.why);
  return cudaSuccess;
}

// The configuration checks of a launch, with CUDA's codes.
cudaError_t check_config(const LaunchSite &s) {
  const dim3 b = s.block, g = s.grid;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  if (!b.x || !b.y || !b.z || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024)
    return report(cudaErrorInvalidConfiguration, site_text(s) + ": block (" + std::to_string(b.x) + "," +
                                                     std::to_string(b.y) + "," + std::to_string(b.z) +
                                                     ") (at most 1024 threads, 1024 x 1024 x 64)");
  if (!g.x || !g.y || !g.z || g.x > 2147483647u || g.y > 65535 || g.z > 65535)
    return report(cudaErrorInvalidConfiguration, site_text(s) + ": grid (" + std::to_string(g.x) + "," +
                                                     std::to_string(g.y) + "," + std::to_string(g.z) +
                                                     ") (at most 2^31-1 x 65535 x 65535, none 0)");
  const size_t limit = kernel_shared_limit(s.func);
  if (s.shared > limit)
    return report(cudaErrorInvalidValue,
                  site_text(s) + ": " + std::to_string(s.shared) + " bytes of dynamic shared memory, the kernel's limit is " +
                      std::to_string(limit) + (s.func ? "" : " (a template launched by deduction: no attribute applies)") +
                      " (cudaFuncSetAttribute raises it up to " + std::to_string(shared_per_block_optin()) + ")");
  return cudaSuccess;
}

}  // namespace

// ---------------------------------------------------------------------------
// device.h

void *dynamic_shared() { return g_b.shared; }

int register_kernel(const char *type) {
  Kernels &k = kernels();
  std::lock_guard<std::mutex> lock(k.mu);
  k.types.emplace_back(type);
  k.runs.push_back(0);
  return static_cast<int>(k.types.size() - 1);
}

int sync_block(int predicate) {
  Fiber *f = current();
  ++g_b.bar_arrived;
  g_b.bar_count += predicate;
  if (g_b.bar_arrived == g_b.live) {
    release_block(f);
  } else {
    f->state = State::AtSyncthreads;
    leave(f);
  }
  return g_b.bar_result;
}

uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t value, int arg, int width, int *pred) {
  Fiber *f = current();
  const int l = f->lane;
  if (!(mask >> l & 1u))
    fail(std::string(op_name(op)) + "(" + hexmask(mask) + ") by lane " + std::to_string(l) + ", which its mask leaves out");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(std::string(op_name(op)) + " with width " + std::to_string(width) + " (a power of 2 up to 32)");
  Warp &w = g_b.warps[f->warp];
  w.op[l] = op;
  w.mask[l] = mask;
  w.in[l] = value;
  w.arg[l] = arg;
  w.width[l] = width;
  w.arrived |= 1u << l;
  if (!try_complete(f->warp, mask, f)) {
    f->state = State::InWarpOp;
    leave(f);
  }
  if (pred) *pred = w.pred[l];
  return w.out[l];
}

unsigned live_lanes() { return g_b.warps[current()->warp].live; }

void launch(const LaunchSite &site, std::shared_ptr<const KernelBody> body) {
  if (cudaError_t e = sticky_error()) {
    set_error(e);
    return;
  }
  if (check_config(site) != cudaSuccess) return;
  if (injected(g_fail_config, "CTR_EMU_FAIL_CONFIG", site.name)) {
    report(cudaErrorInvalidConfiguration, site_text(site) + " refused by CTR_EMU_FAIL_CONFIG");
    return;
  }
  const LaunchSite s = site;
  enqueue(site.stream, [s, body] { return run_grid(s, *body); });
}

}  // namespace ctr_emu
