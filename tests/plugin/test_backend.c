/*
 * A backend plugin written against lib/backend/plugin.h alone, in C: host
 * memory, one synchronous stream and no kernels. libctr loads it with dlopen
 * for device "testdev" (and, built with CTR_TEST_BAD_ABI, for "badabi", whose
 * table claims another ABI). The plugin tests check that the boundary loads,
 * that a step on it is refused naming the first op it lacks, and that a
 * mismatched or missing plugin is refused with a message naming the library.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/plugin.h"

static void *t_alloc(void *ctx, size_t bytes) {
  (void)ctx;
  return calloc(1, bytes ? bytes : 1);
}
static void t_free(void *ctx, void *p) {
  (void)ctx;
  free(p);
}
static void t_copy(void *ctx, void *dst, const void *src, size_t bytes, int stream) {
  (void)ctx;
  (void)stream;
  memcpy(dst, src, bytes);
}
static void t_fill(void *ctx, void *dst, int byte, size_t bytes, int stream) {
  (void)ctx;
  (void)stream;
  memset(dst, byte, bytes);
}
static int t_create_stream(void *ctx) {
  (void)ctx;
  return -1;
}
static int t_create_event(void *ctx) {
  (void)ctx;
  return 0;
}
static void t_event(void *ctx, int event, int stream) {
  (void)ctx;
  (void)event;
  (void)stream;
}
static void t_host_fn(void *ctx, int stream, ctr_host_fn fn, void *user) {
  (void)ctx;
  (void)stream;
  fn(user);
}
static void t_sync(void *ctx, int stream) {
  (void)ctx;
  (void)stream;
}
static ctr_kernel_fn t_kernel(void *ctx, int32_t op, const char *name) {
  (void)ctx;
  (void)op;
  (void)name;
  return NULL;
}
static void t_launch(void *ctx, ctr_kernel_fn fn, const ctr_kernel_args *args, int stream) {
  (void)ctx;
  (void)stream;
  fn(args, NULL);
}
static double t_sum_squares(void *ctx, const float *x, int64_t n, int stream) {
  double s = 0;
  (void)ctx;
  (void)stream;
  for (int64_t i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return s;
}
static void t_add_into(void *ctx, float *acc, const float *x, int64_t n, int stream) {
  (void)ctx;
  (void)stream;
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}
static void t_adamw(void *ctx, const ctr_adamw_args *a, int stream) {
  (void)ctx;
  (void)a;
  (void)stream;
}
static int destroyed;
static void t_destroy(void *ctx) {
  (void)ctx;
  ++destroyed;
}

static const ctr_backend_iface iface = {
    sizeof(ctr_backend_iface),
#ifdef CTR_TEST_BAD_ABI
    CTR_BACKEND_ABI + 100,
#else
    CTR_BACKEND_ABI,
#endif
    "testdev",  t_alloc,      t_free,          t_copy,       t_copy,   t_copy,
    t_fill,     t_create_stream, t_create_event, t_event,   t_event,  t_host_fn,
    t_sync,     t_kernel,     t_launch,        t_sum_squares, t_add_into, t_adamw,
    t_destroy,  0,          NULL,            NULL,         NULL,     NULL,
    NULL,       NULL,       NULL,
};

const ctr_backend_iface *ctr_backend_plugin_init(uint32_t abi, const char *device, void **ctx, char *err,
                                                 size_t err_size) {
  if (abi != CTR_BACKEND_ABI) {
    strncpy(err, "unexpected backend ABI", err_size - 1);
    return NULL;
  }
  if (strcmp(device, "testdev") != 0 && strcmp(device, "badabi") != 0) {
    strncpy(err, "this plugin serves only 'testdev'", err_size - 1);
    return NULL;
  }
  *ctx = &destroyed;
  return &iface;
}
