/*
 * A backend plugin that fails the way a GPU fails, for device "faultdev".
 *
 * It wraps a working backend that its host program hands it (the plugin test
 * exports ctr_test_inner_backend, the built-in CPU backend) and forwards every
 * slot, until the kernel named by CTR_FAULTDEV_KERNEL is launched. That launch
 * "faults": from then on no kernel runs, copies and fills do nothing,
 * sum_squares returns the last value it computed (a stale number, as a
 * faulted device leaves in a pinned result buffer), and the status slot
 * reports the fault. With CTR_FAULTDEV_ASYNC=1 the fault stays hidden until
 * the next call that waits for the device (a copy to the host, synchronize,
 * sum_squares), as an asynchronous kernel fault does. CTR_FAULTDEV_SUMSQ=1
 * makes sum_squares itself fail instead.
 *
 * Built with CTR_TEST_GRAPHS it serves device "graphdev" instead, which
 * forwards everything and captures graphs as CUDA does: between capture_begin
 * and capture_end, launches, fills and device copies on stream 0 are recorded
 * (their tensor addresses copied, as a CUDA graph bakes them in) instead of
 * run, and graph_launch replays them. The counts of captures, replays and
 * launches made outside a replay are read by the test through
 * ctr_graphdev_counts.
 *
 * Written against lib/backend/plugin.h alone, in C.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/plugin.h"

typedef const ctr_backend_iface *(*inner_fn)(void **ctx);

#define MAX_KERNELS 512

#define MAX_RECORDED 4096
#define MAX_GRAPHS 8

/* One recorded operation of a graph. */
typedef struct recorded {
  int kind; /* 0 launch, 1 fill, 2 copy_d2d */
  ctr_kernel_fn fn;
  ctr_kernel_args args;
  ctr_tensor_ref *refs; /* inputs then outputs, as they were at capture */
  void *dst;
  const void *src;
  int byte;
  size_t bytes;
} recorded;

typedef struct graph {
  recorded *ops;
  int n, cap;
  int used;
} graph;

static long long n_captures, n_replays, n_launches;

/* For the test: what the last graphdev backend did. */
__attribute__((visibility("default"))) void ctr_graphdev_counts(long long *captures, long long *replays,
                                                                long long *launches) {
  *captures = n_captures;
  *replays = n_replays;
  *launches = n_launches;
}

typedef struct fault_ctx {
  const ctr_backend_iface *in;
  void *in_ctx;
  char target[64];   /* kernel whose launch faults */
  int async;         /* fault seen only at the next wait */
  int sumsq;         /* sum_squares fails */
  int faulted;       /* kernels no longer run */
  int visible;       /* the status slot reports it */
  char msg[256];
  double last_sum;
  struct {
    ctr_kernel_fn fn;
    char name[64];
  } kernels[MAX_KERNELS];
  int num_kernels;
  int capturing;       /* recording into graphs[capture] */
  int capture;
  graph graphs[MAX_GRAPHS];
} fault_ctx;

static recorded *record(fault_ctx *f, int kind) {
  graph *g = &f->graphs[f->capture];
  if (g->n == g->cap) {
    g->cap = g->cap ? 2 * g->cap : 64;
    if (g->cap > MAX_RECORDED) abort();
    g->ops = (recorded *)realloc(g->ops, (size_t)g->cap * sizeof *g->ops);
    if (!g->ops) abort();
  }
  recorded *r = &g->ops[g->n++];
  memset(r, 0, sizeof *r);
  r->kind = kind;
  return r;
}

static fault_ctx *F(void *ctx) { return (fault_ctx *)ctx; }

/* A pending fault becomes visible where the host waits for the device. */
static void waited(fault_ctx *f) {
  if (f->faulted) f->visible = 1;
}

static void *f_alloc(void *ctx, size_t bytes) { return F(ctx)->in->alloc(F(ctx)->in_ctx, bytes); }
static void f_free(void *ctx, void *p) { F(ctx)->in->free(F(ctx)->in_ctx, p); }
static void f_copy_h2d(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  fault_ctx *f = F(ctx);
  if (!f->faulted) f->in->copy_h2d(f->in_ctx, dst, src, bytes, stream);
}
static void f_copy_d2h(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  fault_ctx *f = F(ctx);
  if (!f->faulted) f->in->copy_d2h(f->in_ctx, dst, src, bytes, stream);
  if (stream == 0 || stream == CTR_STREAM_SYNC) waited(f);
}
static void f_copy_d2d(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  fault_ctx *f = F(ctx);
  if (f->capturing && stream == 0) {
    recorded *r = record(f, 2);
    r->dst = dst;
    r->src = src;
    r->bytes = bytes;
    return;
  }
  if (!f->faulted) f->in->copy_d2d(f->in_ctx, dst, src, bytes, stream);
}
static void f_fill(void *ctx, void *dst, int byte, size_t bytes, int stream) {
  fault_ctx *f = F(ctx);
  if (f->capturing && stream == 0) {
    recorded *r = record(f, 1);
    r->dst = dst;
    r->byte = byte;
    r->bytes = bytes;
    return;
  }
  if (!f->faulted) f->in->fill(f->in_ctx, dst, byte, bytes, stream);
}
static int f_create_stream(void *ctx) { return F(ctx)->in->create_stream(F(ctx)->in_ctx); }
static int f_create_event(void *ctx) { return F(ctx)->in->create_event(F(ctx)->in_ctx); }
static void f_record_event(void *ctx, int event, int stream) {
  F(ctx)->in->record_event(F(ctx)->in_ctx, event, stream);
}
static void f_wait_event(void *ctx, int event, int stream) {
  F(ctx)->in->wait_event(F(ctx)->in_ctx, event, stream);
  if (stream == 0) waited(F(ctx));
}
static void f_host_fn(void *ctx, int stream, ctr_host_fn fn, void *user) {
  F(ctx)->in->host_fn(F(ctx)->in_ctx, stream, fn, user);
}
static void f_synchronize(void *ctx, int stream) {
  F(ctx)->in->synchronize(F(ctx)->in_ctx, stream);
  waited(F(ctx));
}
static ctr_kernel_fn f_kernel(void *ctx, int32_t op, const char *name) {
  fault_ctx *f = F(ctx);
  ctr_kernel_fn fn = f->in->kernel(f->in_ctx, op, name);
  if (fn && name && f->num_kernels < MAX_KERNELS) {
    f->kernels[f->num_kernels].fn = fn;
    snprintf(f->kernels[f->num_kernels].name, sizeof f->kernels[0].name, "%s", name);
    ++f->num_kernels;
  }
  return fn;
}
static const char *kernel_name(const fault_ctx *f, ctr_kernel_fn fn) {
  for (int i = 0; i < f->num_kernels; ++i)
    if (f->kernels[i].fn == fn) return f->kernels[i].name;
  return "?";
}
static void f_launch(void *ctx, ctr_kernel_fn fn, const ctr_kernel_args *args, int stream) {
  fault_ctx *f = F(ctx);
  if (f->capturing && stream == 0) {
    recorded *r = record(f, 0);
    const int n = args->num_inputs + args->num_outputs;
    r->fn = fn;
    r->args = *args;
    r->refs = (ctr_tensor_ref *)malloc((size_t)(n > 0 ? n : 1) * sizeof *r->refs);
    if (!r->refs) abort();
    memcpy(r->refs, args->inputs, (size_t)args->num_inputs * sizeof *r->refs);
    memcpy(r->refs + args->num_inputs, args->outputs, (size_t)args->num_outputs * sizeof *r->refs);
    r->args.inputs = r->refs;
    r->args.outputs = r->refs + args->num_inputs;
    return;
  }
  ++n_launches;
  if (f->faulted) return;
  if (f->target[0] && strcmp(kernel_name(f, fn), f->target) == 0) {
    f->faulted = 1;
    snprintf(f->msg, sizeof f->msg, "kernel '%s' failed at %s:%d: an illegal memory access was encountered",
             f->target, "fault_backend.c", __LINE__);
    if (!f->async) f->visible = 1;
    return;
  }
  f->in->launch(f->in_ctx, fn, args, stream);
}
static double f_sum_squares(void *ctx, const float *x, int64_t n, int stream) {
  fault_ctx *f = F(ctx);
  if (f->sumsq && !f->faulted) {
    f->faulted = f->visible = 1;
    snprintf(f->msg, sizeof f->msg, "sum_squares failed at %s:%d: an illegal memory access was encountered",
             "fault_backend.c", __LINE__);
  }
  waited(f);
  if (f->faulted) return f->last_sum;
  f->last_sum = f->in->sum_squares(f->in_ctx, x, n, stream);
  return f->last_sum;
}
static void f_add_into(void *ctx, float *acc, const float *x, int64_t n, int stream) {
  fault_ctx *f = F(ctx);
  if (!f->faulted) f->in->add_into(f->in_ctx, acc, x, n, stream);
}
static void f_adamw(void *ctx, const ctr_adamw_args *a, int stream) {
  fault_ctx *f = F(ctx);
  if (!f->faulted) f->in->adamw(f->in_ctx, a, stream);
}
static void free_graph(graph *g) {
  for (int i = 0; i < g->n; ++i) free(g->ops[i].refs);
  free(g->ops);
  memset(g, 0, sizeof *g);
}
static void f_destroy(void *ctx) {
  fault_ctx *f = F(ctx);
  for (int i = 0; i < MAX_GRAPHS; ++i) free_graph(&f->graphs[i]);
  f->in->destroy(f->in_ctx);
  free(f);
}
#ifdef CTR_TEST_GRAPHS
static int f_capture_begin(void *ctx, int stream) {
  fault_ctx *f = F(ctx);
  if (stream != 0 || f->capturing) return -1;
  for (int i = 0; i < MAX_GRAPHS; ++i)
    if (!f->graphs[i].used) {
      f->capture = i;
      f->graphs[i].used = 1;
      f->capturing = 1;
      return 0;
    }
  return -1;
}
static int f_capture_end(void *ctx, int stream) {
  fault_ctx *f = F(ctx);
  if (stream != 0 || !f->capturing) return -1;
  f->capturing = 0;
  ++n_captures;
  return f->capture;
}
static void f_graph_launch(void *ctx, int id, int stream) {
  fault_ctx *f = F(ctx);
  const graph *g = &f->graphs[id];
  ++n_replays;
  for (int i = 0; i < g->n && !f->faulted; ++i) {
    const recorded *r = &g->ops[i];
    if (r->kind == 0)
      f->in->launch(f->in_ctx, r->fn, &r->args, stream);
    else if (r->kind == 1)
      f->in->fill(f->in_ctx, r->dst, r->byte, r->bytes, stream);
    else
      f->in->copy_d2d(f->in_ctx, r->dst, r->src, r->bytes, stream);
  }
}
static void f_graph_destroy(void *ctx, int id) {
  if (id >= 0 && id < MAX_GRAPHS) free_graph(&F(ctx)->graphs[id]);
}
#endif
static int f_status(void *ctx, char *buf, size_t size) {
  fault_ctx *f = F(ctx);
  if (!f->visible) return 0;
  if (buf && size) snprintf(buf, size, "%s", f->msg);
  return 1;
}

#ifdef CTR_TEST_GRAPHS
#define DEVICE "graphdev"
#define CAPTURE f_capture_begin, f_capture_end, f_graph_launch, f_graph_destroy
#else
#define DEVICE "faultdev"
#define CAPTURE NULL, NULL, NULL, NULL
#endif

static ctr_backend_iface iface = {
    sizeof(ctr_backend_iface),
    CTR_BACKEND_ABI,
    DEVICE,
    f_alloc,
    f_free,
    f_copy_h2d,
    f_copy_d2h,
    f_copy_d2d,
    f_fill,
    f_create_stream,
    f_create_event,
    f_record_event,
    f_wait_event,
    f_host_fn,
    f_synchronize,
    f_kernel,
    f_launch,
    f_sum_squares,
    f_add_into,
    f_adamw,
    f_destroy,
    0,
    CAPTURE,
    f_status,
    NULL,
    NULL,
};

const ctr_backend_iface *ctr_backend_plugin_init(uint32_t abi, const char *device, void **ctx, char *err,
                                                 size_t err_size) {
  if (abi != CTR_BACKEND_ABI) {
    snprintf(err, err_size, "unexpected backend ABI %u", abi);
    return NULL;
  }
  if (strcmp(device, DEVICE) != 0) {
    snprintf(err, err_size, "this plugin serves only '" DEVICE "'");
    return NULL;
  }
  inner_fn inner = (inner_fn)dlsym(RTLD_DEFAULT, "ctr_test_inner_backend");
  if (!inner) {
    snprintf(err, err_size, "faultdev wraps the backend its host exports as ctr_test_inner_backend, and this "
                            "host has none");
    return NULL;
  }
  fault_ctx *f = (fault_ctx *)calloc(1, sizeof *f);
  if (!f) {
    snprintf(err, err_size, "out of memory");
    return NULL;
  }
  f->in = inner(&f->in_ctx);
  const char *k = getenv("CTR_FAULTDEV_KERNEL");
  snprintf(f->target, sizeof f->target, "%s", k ? k : "");
  f->async = getenv("CTR_FAULTDEV_ASYNC") && strcmp(getenv("CTR_FAULTDEV_ASYNC"), "1") == 0;
  f->sumsq = getenv("CTR_FAULTDEV_SUMSQ") && strcmp(getenv("CTR_FAULTDEV_SUMSQ"), "1") == 0;
  iface.flags = f->in->flags;
  n_captures = n_replays = n_launches = 0;
  *ctx = f;
  return &iface;
}
