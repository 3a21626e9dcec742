// The CPU backend: the reference every other backend is tested against.
//
// It binds each op of the graph op set to its kernel in kernels/cpu, decoding
// shapes and attributes from the node (a handful of map look-ups per call, noise
// next to the kernels). It has one stream that runs work synchronously on the
// calling thread, which spreads each kernel over the process thread pool.

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "backend/backend.h"
#include "core/status.h"
#include "cpu/kernels.h"

namespace ctr {
namespace {

int64_t numel(const std::vector<int64_t> &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// ---------------------------------------------------------------------------
// Kernel bindings

void k_embedding(const KernelCtx &c) {
  const auto &t = c.in_shape(0);
  cpu::embedding_fwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[0], t[1]);
}
void k_embedding_bwd(const KernelCtx &c) {
  const auto &t = c.out_shape(0);
  cpu::embedding_bwd(c.in<int32_t>(1), c.in<float>(0), c.out<float>(0), numel(c.in_shape(1)), t[0], t[1], false);
}
void k_linear(const KernelCtx &c) {
  const auto &w = c.in_shape(1);
  int64_t M = numel(c.in_shape(0)) / w[1];
  cpu::linear_fwd(c.in<float>(0), c.in<float>(1), c.node->inputs.size() > 2 ? c.in<float>(2) : nullptr,
                  c.out<float>(0), M, w[1], w[0]);
}
void k_linear_bwd_x(const KernelCtx &c) {
  const auto &w = c.in_shape(1);
  int64_t M = numel(c.in_shape(0)) / w[0];
  cpu::linear_bwd_x(c.in<float>(0), c.in<float>(1), c.out<float>(0), M, w[1], w[0]);
}
void k_linear_bwd_w(const KernelCtx &c) {
  const auto &w = c.out_shape(0);
  int64_t M = numel(c.in_shape(1)) / w[1];
  cpu::linear_bwd_w(c.in<float>(0), c.in<float>(1), c.out<float>(0), M, w[1], w[0], false);
}
void k_linear_bwd_b(const KernelCtx &c) {
  int64_t N = c.out_shape(0)[0];
  cpu::linear_bwd_b(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)) / N, N, false);
}
struct MatmulDims { int64_t batch, M, K, N; bool shared; };
MatmulDims matmul_dims(const std::vector<int64_t> &a, const std::vector<int64_t> &b) {
  MatmulDims d;
  d.M = a[a.size() - 2];
  d.K = a.back();
  d.N = b.back();
  d.batch = numel(a) / (d.M * d.K);
  d.shared = b.size() == 2;
  return d;
}
void k_matmul(const KernelCtx &c) {
  auto d = matmul_dims(c.in_shape(0), c.in_shape(1));
  cpu::matmul_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), d.batch, d.M, d.K, d.N, d.shared);
}
void k_matmul_bwd(const KernelCtx &c) {
  auto d = matmul_dims(c.in_shape(1), c.in_shape(2));
  cpu::matmul_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                  d.batch, d.M, d.K, d.N, d.shared);
}
void k_add(const KernelCtx &c) {
  cpu::add_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)), numel(c.in_shape(1)));
}
void k_reduce_rows(const KernelCtx &c) {
  cpu::reduce_rows(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0)), numel(c.out_shape(0)), false);
}
void k_mul(const KernelCtx &c) {
  cpu::mul_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)), numel(c.in_shape(1)));
}
void k_mul_bwd(const KernelCtx &c) {
  cpu::mul_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
               numel(c.in_shape(1)), numel(c.in_shape(2)), false);
}
void k_add_same(const KernelCtx &c) {
  cpu::add_same(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
float eps_of(const KernelCtx &c) { return static_cast<float>(c.node->attr_float("eps", 1e-5)); }
void k_layernorm(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  int64_t C = x.back();
  cpu::layernorm_fwd(c.in<float>(0), c.in<float>(1), c.node->inputs.size() > 2 ? c.in<float>(2) : nullptr,
                     c.out<float>(0), c.out<float>(1), c.out<float>(2), numel(x) / C, C, eps_of(c));
}
void k_layernorm_bwd(const KernelCtx &c) {
  const auto &x = c.in_shape(1);
  int64_t C = x.back();
  cpu::layernorm_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                     c.out<float>(0), c.out<float>(1), c.node->outputs.size() > 2 ? c.out<float>(2) : nullptr,
                     numel(x) / C, C, false);
}
void k_rmsnorm(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  int64_t C = x.back();
  cpu::rmsnorm_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), c.out<float>(1), numel(x) / C, C, eps_of(c));
}
void k_rmsnorm_bwd(const KernelCtx &c) {
  const auto &x = c.in_shape(1);
  int64_t C = x.back();
  cpu::rmsnorm_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.out<float>(0),
                   c.out<float>(1), numel(x) / C, C, false);
}
void k_gelu(const KernelCtx &c) { cpu::gelu_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0))); }
void k_gelu_bwd(const KernelCtx &c) {
  cpu::gelu_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_silu(const KernelCtx &c) { cpu::silu_fwd(c.in<float>(0), c.out<float>(0), numel(c.in_shape(0))); }
void k_silu_bwd(const KernelCtx &c) {
  cpu::silu_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_swiglu(const KernelCtx &c) {
  cpu::swiglu_fwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(c.in_shape(0)));
}
void k_swiglu_bwd(const KernelCtx &c) {
  cpu::swiglu_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                  numel(c.in_shape(0)));
}
void k_softmax(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  cpu::softmax_fwd(c.in<float>(0), c.out<float>(0), numel(x) / x.back(), x.back());
}
void k_softmax_bwd(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  cpu::softmax_bwd(c.in<float>(0), c.in<float>(1), c.out<float>(0), numel(x) / x.back(), x.back());
}
struct RopeDims { int64_t B, T, H, D; float theta; };
RopeDims rope_dims(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  RopeDims d;
  d.B = x[0];
  d.T = x[1];
  d.H = c.node->attr_int("heads", 1);
  d.D = x[2] / d.H;
  d.theta = static_cast<float>(c.node->attr_float("theta", 10000.0));
  return d;
}
void k_rope(const KernelCtx &c) {
  auto d = rope_dims(c);
  cpu::rope_fwd(c.in<float>(0), c.out<float>(0), d.B, d.T, d.H, d.D, d.theta);
}
void k_rope_bwd(const KernelCtx &c) {
  auto d = rope_dims(c);
  cpu::rope_bwd(c.in<float>(0), c.out<float>(0), d.B, d.T, d.H, d.D, d.theta);
}
struct AttnDims { int64_t B, T, Hq, Hkv, D; float scale; bool causal; };
AttnDims attn_dims(const KernelCtx &c, int q_input) {
  const auto &q = c.in_shape(q_input);
  AttnDims d;
  d.B = q[0];
  d.T = q[1];
  d.Hq = c.node->attr_int("heads", 1);
  d.Hkv = c.node->attr_int("kv_heads", d.Hq);
  d.D = q[2] / d.Hq;
  d.scale = static_cast<float>(c.node->attr_float("scale", 1.0 / std::sqrt(static_cast<double>(d.D))));
  d.causal = c.node->attr_int("causal", 1) != 0;
  return d;
}
void k_attention(const KernelCtx &c) {
  auto d = attn_dims(c, 0);
  cpu::attention_fwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.out<float>(0), c.out<float>(1),
                     d.B, d.T, d.Hq, d.Hkv, d.D, d.scale, d.causal);
}
void k_attention_bwd(const KernelCtx &c) {
  auto d = attn_dims(c, 1);
  cpu::attention_bwd(c.in<float>(0), c.in<float>(1), c.in<float>(2), c.in<float>(3), c.in<float>(4),
                     c.out<float>(0), c.out<float>(1), c.out<float>(2), d.B, d.T, d.Hq, d.Hkv, d.D,
                     d.scale, d.causal);
}
void k_cross_entropy(const KernelCtx &c) {
  const auto &l = c.in_shape(0);
  int64_t V = l.back();
  cpu::cross_entropy_fwd(c.in<float>(0), c.in<int32_t>(1), c.out<float>(0), c.out<float>(1),
                         c.out<int64_t>(2), numel(l) / V, V);
}
void k_cross_entropy_bwd(const KernelCtx &c) {
  const auto &l = c.in_shape(1);
  int64_t V = l.back();
  cpu::cross_entropy_bwd(c.in<float>(1), c.in<int32_t>(2), c.in<float>(3), *c.in<float>(0),
                         *c.in<int64_t>(4), c.out<float>(0), numel(l) / V, V);
}
void k_reshape(const KernelCtx &c) {
  const Tensor &t = c.graph->tensors[c.node->inputs[0]];
  cpu::copy(c.in<void>(0), c.out<void>(0), t.bytes());
}
void k_transpose(const KernelCtx &c) {
  const auto &x = c.in_shape(0);
  auto p = c.node->attr_ints("perm");
  int perm[6];
  for (size_t i = 0; i < p.size(); ++i) perm[i] = static_cast<int>(p[i]);
  cpu::transpose(c.in<float>(0), c.out<float>(0), x.data(), perm, static_cast<int>(x.size()));
}
void k_take_rows(const KernelCtx &c) {
  const Tensor &t = c.graph->tensors[c.node->outputs[0]];
  cpu::copy(c.in<void>(0), c.out<void>(0), t.bytes());
}
void k_take_rows_bwd(const KernelCtx &c) {
  int64_t n = numel(c.in_shape(0)), total = numel(c.out_shape(0));
  cpu::copy(c.in<void>(0), c.out<void>(0), n * 4);
  cpu::fill(c.out<float>(0) + n, 0.0f, total - n);
}

const std::unordered_map<std::string, KernelFn> &kernels() {
  static const std::unordered_map<std::string, KernelFn> k = {
      {"embedding", k_embedding},         {"embedding_bwd", k_embedding_bwd},
      {"linear", k_linear},               {"linear_bwd_x", k_linear_bwd_x},
      {"linear_bwd_w", k_linear_bwd_w},   {"linear_bwd_b", k_linear_bwd_b},
      {"matmul", k_matmul},               {"matmul_bwd", k_matmul_bwd},
      {"add", k_add},                     {"reduce_rows", k_reduce_rows},
      {"mul", k_mul},                     {"mul_bwd", k_mul_bwd},
      {"add_same", k_add_same},           {"layernorm", k_layernorm},
      {"layernorm_bwd", k_layernorm_bwd}, {"rmsnorm", k_rmsnorm},
      {"rmsnorm_bwd", k_rmsnorm_bwd},     {"gelu", k_gelu},
      {"gelu_bwd", k_gelu_bwd},           {"silu", k_silu},
      {"silu_bwd", k_silu_bwd},           {"swiglu", k_swiglu},
      {"swiglu_bwd", k_swiglu_bwd},       {"softmax", k_softmax},
      {"softmax_bwd", k_softmax_bwd},     {"rope", k_rope},
      {"rope_bwd", k_rope_bwd},           {"attention", k_attention},
      {"attention_bwd", k_attention_bwd}, {"cross_entropy", k_cross_entropy},
      {"cross_entropy_bwd", k_cross_entropy_bwd},
      {"reshape", k_reshape},             {"transpose", k_transpose},
      {"take_rows", k_take_rows},         {"take_rows_bwd", k_take_rows_bwd},
  };
  return k;
}

// ---------------------------------------------------------------------------
// Interface slots

void *cpu_alloc(void *, size_t bytes) {
  size_t n = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
  void *p = std::aligned_alloc(64, n);
  if (p) std::memset(p, 0, n);
  return p;
}
void cpu_free(void *, void *p) { std::free(p); }
void cpu_copy(void *, void *dst, const void *src, size_t bytes, int) {
  if (bytes) cpu::copy(src, dst, static_cast<int64_t>(bytes));
}
KernelFn cpu_kernel(void *, const std::string &op) {
  auto it = kernels().find(op);
  return it == kernels().end() ? nullptr : it->second;
}
void cpu_launch(void *, KernelFn fn, const KernelCtx &kc, int) { fn(kc); }
std::vector<std::string> cpu_ops(void *) {
  std::vector<std::string> out;
  for (const auto &kv : kernels()) out.push_back(kv.first);
  return out;
}
double cpu_sum_squares(void *, const float *x, int64_t n) { return cpu::sum_squares(x, n); }
void cpu_add_into(void *, float *acc, const float *x, int64_t n) { cpu::add_same(acc, x, acc, n); }
void cpu_adamw(void *, float *param, const float *grad, float *m, float *v, int64_t n, float lr,
               float beta1, float beta2, float eps, float wd, int64_t t, float grad_scale) {
  cpu::adamw_update(param, grad, m, v, n, lr, beta1, beta2, eps, wd, t, grad_scale);
}

const BackendIface kCpuIface = {
    "cpu",
    cpu_alloc,
    cpu_free,
    cpu_copy,
    cpu_copy,
    cpu_copy,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    cpu_kernel,
    cpu_launch,
    cpu_ops,
    cpu_sum_squares,
    cpu_add_into,
    cpu_adamw,
};

}  // namespace

Backend cpu_backend() { return Backend{&kCpuIface, nullptr}; }

}  // namespace ctr
