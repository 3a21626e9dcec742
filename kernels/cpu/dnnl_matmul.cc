// oneDNN matmul primitives for gemm.cc, cached per thread and product shape.
//
// Each thread keeps its own primitives, memory objects (re-pointed per call)
// and scratchpad, so no two threads share a primitive's memory and a call
// allocates nothing once its shape has been seen. A shape is compiled once per
// thread (oneDNN's own primitive cache makes the second thread's copy cheap).

#include "cpu/dnnl_matmul.h"

#if CTR_HAVE_DNNL
#include <omp.h>

#include <dnnl.hpp>
#include <map>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>
#endif

#include "core/status.h"
#include "cpu/kernels.h"

namespace ctr::cpu::dnnl_mm {

#if CTR_HAVE_DNNL
namespace {

using Key = std::tuple<Type, Type, bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float,
                       bool>;

// A thread keeps at most this many shapes; past it the cache starts over (a
// process that walks through many models must not grow without bound).
constexpr size_t kMaxShapes = 4096;

struct Prim {
  bool declined = false;
  dnnl::matmul mm;
  dnnl::memory a, b, c, bias, scratch;
  std::unordered_map<int, dnnl::memory> args;
  size_t scratch_bytes = 0;
};

dnnl::engine &engine() {
  // The CPU feature mask must reach oneDNN before its first primitive.
  static dnnl::engine e = [] {
    (void)cpu_features();
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return e;
}

struct ThreadState {
  std::map<Key, Prim> prims;
  std::vector<char> scratch;
  dnnl::stream stream{engine()};
  ThreadState() { omp_set_num_threads(1); }
};

ThreadState &thread_state() {
  thread_local ThreadState t;
  return t;
}

dnnl::memory::data_type dtype(Type t) {
  return t == Type::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
}

Prim make(const Product &p) {
  using dims = dnnl::memory::dims;
  dnnl::memory::desc a({p.M, p.K}, dtype(p.in), p.ta ? dims{1, p.lda} : dims{p.lda, 1});
  dnnl::memory::desc b({p.K, p.N}, dtype(p.in), p.tb ? dims{1, p.ldb} : dims{p.ldb, 1});
  dnnl::memory::desc c({p.M, p.N}, dtype(p.out), dims{p.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (p.alpha != 1.0f) attr.set_output_scales(0, {p.alpha});
  if (p.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(p.beta);
    attr.set_post_ops(ops);
  }
  Prim r;
  dnnl::memory::desc bias;
  if (p.bias) bias = dnnl::memory::desc({1, p.N}, dtype(p.out), dims{p.N, 1});
  auto pd = p.bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, bias, c), attr, engine())
                   : dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine());
  if (std::string_view(pd.impl_info_str()).substr(0, 3) == "ref") {
    r.declined = true;
    return r;
  }
  r.mm = dnnl::matmul(pd);
  dnnl::engine &e = engine();
  r.a = dnnl::memory(a, e, nullptr);
  r.b = dnnl::memory(b, e, nullptr);
  r.c = dnnl::memory(c, e, nullptr);
  r.scratch = dnnl::memory(pd.scratchpad_desc(), e, nullptr);
  r.scratch_bytes = pd.scratchpad_desc().get_size();
  r.args = {{DNNL_ARG_SRC, r.a}, {DNNL_ARG_WEIGHTS, r.b}, {DNNL_ARG_DST, r.c}, {DNNL_ARG_SCRATCHPAD, r.scratch}};
  if (p.bias) {
    r.bias = dnnl::memory(bias, e, nullptr);
    r.args.emplace(DNNL_ARG_BIAS, r.bias);
  }
  return r;
}

Outcome run_or_throw(const Product &p) {
  ThreadState &t = thread_state();
  const Key k{p.in, p.out, p.ta, p.tb, p.M, p.N, p.K, p.lda, p.ldb, p.ldc, p.alpha, p.beta, p.bias != nullptr};
  auto it = t.prims.find(k);
  if (it == t.prims.end()) {
    if (t.prims.size() >= kMaxShapes) t.prims.clear();
    it = t.prims.emplace(k, make(p)).first;
  }
  Prim &m = it->second;
  if (m.declined) return Outcome::declined;
  if (t.scratch.size() < m.scratch_bytes) t.scratch.resize(m.scratch_bytes);
  m.a.set_data_handle(const_cast<void *>(p.A));
  m.b.set_data_handle(const_cast<void *>(p.B));
  m.c.set_data_handle(p.C);
  m.scratch.set_data_handle(t.scratch.data());
  if (p.bias) m.bias.set_data_handle(const_cast<void *>(p.bias));
  m.mm.execute(t.stream, m.args);
  t.stream.wait();
  return Outcome::done;
}

}  // namespace

Outcome run(const Product &p, std::string *error) {
  const char *kind = p.in == Type::bf16 ? "bf16" : "f32";
  try {
    return run_or_throw(p);
  } catch (const dnnl::error &e) {
    *error = strformat("oneDNN %s matmul %lldx%lldx%lld: %s (status %d)", kind, static_cast<long long>(p.M),
                       static_cast<long long>(p.N), static_cast<long long>(p.K), e.what(), static_cast<int>(e.status));
  } catch (const std::exception &e) {
    *error = strformat("oneDNN %s matmul %lldx%lldx%lld: %s", kind, static_cast<long long>(p.M),
                       static_cast<long long>(p.N), static_cast<long long>(p.K), e.what());
  }
  return Outcome::failed;
}

#else

Outcome run(const Product &, std::string *) { return Outcome::declined; }

#endif

}  // namespace ctr::cpu::dnnl_mm
