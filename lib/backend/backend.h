// The device interface every backend implements.
//
// A backend is {iface, ctx}: a table of functions with named slots and an opaque
// context (the ggml-backend / NCCL transport pattern). The executor only talks to
// this table, so the CPU backend built in here and a CUDA backend loaded from
// libctr-cuda.so with dlopen plug into the same step.
//
// Streams are ordered queues of work; events order work across streams. The CPU
// backend has one stream that executes synchronously, so its events are always
// complete; the slots exist so the comm stream and device backends need no
// change in the executor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "graph/ir.h"

namespace ctr {

// What a kernel sees: the graph (shapes, attributes), its node and the address of
// every tensor (indexed by tensor id) for the current micro-batch.
struct KernelCtx {
  const Graph *graph;
  const Node *node;
  void *const *ptr;
  template <typename T>
  T *in(int i) const { return static_cast<T *>(ptr[node->inputs[i]]); }
  template <typename T>
  T *out(int i) const { return static_cast<T *>(ptr[node->outputs[i]]); }
  const std::vector<int64_t> &in_shape(int i) const { return graph->tensors[node->inputs[i]].shape; }
  const std::vector<int64_t> &out_shape(int i) const { return graph->tensors[node->outputs[i]].shape; }
};

using KernelFn = void (*)(const KernelCtx &);

struct BackendIface {
  const char *name;

  // Memory. alloc returns zeroed, 64-byte aligned memory or nullptr.
  void *(*alloc)(void *ctx, size_t bytes);
  void (*free)(void *ctx, void *p);
  void (*copy_h2d)(void *ctx, void *dst, const void *src, size_t bytes, int stream);
  void (*copy_d2h)(void *ctx, void *dst, const void *src, size_t bytes, int stream);
  void (*copy_d2d)(void *ctx, void *dst, const void *src, size_t bytes, int stream);

  // Streams and events (optional: null when the backend is synchronous).
  int (*create_stream)(void *ctx);
  void (*record_event)(void *ctx, int event, int stream);
  void (*wait_event)(void *ctx, int event, int stream);
  void (*synchronize)(void *ctx, int stream);

  // Kernels of the op set: the kernel for op, or null when the backend lacks it.
  KernelFn (*kernel)(void *ctx, const std::string &op);
  void (*launch)(void *ctx, KernelFn fn, const KernelCtx &kc, int stream);
  std::vector<std::string> (*ops)(void *ctx);

  // Optimizer-side primitives on device buffers.
  double (*sum_squares)(void *ctx, const float *x, int64_t n);
  void (*add_into)(void *ctx, float *acc, const float *x, int64_t n);  // acc += x
  void (*adamw)(void *ctx, float *param, const float *grad, float *m, float *v, int64_t n,
                float lr, float beta1, float beta2, float eps, float weight_decay, int64_t t,
                float grad_scale);
};

struct Backend {
  const BackendIface *iface = nullptr;
  void *ctx = nullptr;
};

// The built-in CPU backend (fp32, OpenBLAS, the process thread pool).
Backend cpu_backend();

}  // namespace ctr
