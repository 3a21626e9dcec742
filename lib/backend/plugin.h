/*
 * The backend boundary, in C types only.
 *
 * A backend is a table of functions (ctr_backend_iface) plus an opaque context.
 * The CPU backend is compiled into libctr; any other (a CUDA backend in
 * libctr-cuda.so) is a shared library loaded with dlopen that exports
 *
 *   const ctr_backend_iface *ctr_backend_plugin_init(uint32_t abi, const char *device,
 *                                                    void **ctx, char *err, size_t err_size);
 *
 * returning NULL (with a message in err) when it cannot serve `device`. Nothing
 * of C++ crosses this line: no exception, no STL type, no class. A call that can
 * fail returns non-zero and leaves a message for last_error.
 *
 * Work is queued on streams (stream 0 exists from creation; more come from
 * create_stream) and ordered across streams by events: record_event marks a
 * point in a stream's queue, wait_event makes a stream (or, for a synchronous
 * stream, the calling thread) wait until that point is reached. An event may be
 * recorded again after it has been waited on; a wait refers to its most recent
 * record.
 *
 * Kernels are looked up once per op by registry id and name, and launched with
 * the tensors they read and write already resolved to device addresses and
 * shapes, and the op's attributes already decoded into its parameter struct
 * (kernels/common/op_params.h).
 */
#ifndef CTR_BACKEND_PLUGIN_H
#define CTR_BACKEND_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever ctr_backend_iface or ctr_kernel_args change layout or meaning
 * (3: the status, host_alloc and host_free slots; 4: attention's parameters window
 * and softcap, which a kernel must honour, and the op geglu). */
#define CTR_BACKEND_ABI 4

/* The stream argument of a copy or fill that runs at once on the calling
 * thread and returns when done, ordered after nothing queued on any stream (the
 * caller has ordered it: host work on a stream stages its data this way). */
#define CTR_STREAM_SYNC (-1)

/* ctr_backend_iface.flags */
/* Memory from alloc is not host-addressable: host code reaches it through
 * copies only (a GPU, or the fenced CPU test backend). Collectives over host
 * memory are then staged through host buffers. */
#define CTR_BACKEND_DEVICE_MEMORY 1u
/* The attention kernels keep the log-sum-exp of each score row, f32
 * [B, H, T], as the op's saved output instead of the probabilities
 * [B, H, T, T] (flash-style attention): the memory plan sizes it so. */
#define CTR_BACKEND_ATTENTION_LSE 2u
/* The backend has bf16 kernels (a `cast` kernel) but computes in fp32 unless
 * precision bf16 is asked for: precision "auto" means fp32 on it (the CPU
 * backend, the reference every test compares against). */
#define CTR_BACKEND_BF16_OPT_IN 4u
#define CTR_MAX_DIMS 8

typedef struct ctr_tensor_ref {
  void *data;      /* device address */
  int64_t numel;
  int64_t bytes;   /* numel * dtype size */
  int32_t dtype;   /* ctr_dtype */
  int32_t ndim;
  int64_t shape[CTR_MAX_DIMS];
} ctr_tensor_ref;

typedef struct ctr_kernel_args {
  int32_t op;                    /* registry id of the op */
  int32_t num_inputs, num_outputs;
  const void *params;            /* the op's parameter struct, or NULL */
  const ctr_tensor_ref *inputs;
  const ctr_tensor_ref *outputs;
} ctr_kernel_args;

/* A kernel: runs the op on the stream it is launched on. Never fails: shapes,
 * dtypes and ids were checked before anything ran. */
typedef void (*ctr_kernel_fn)(const ctr_kernel_args *args, void *stream_handle);

/* Host work queued on a stream (for a CPU backend, a collective over host memory).
 * It must not throw; it reports failure through its own user data. */
typedef void (*ctr_host_fn)(void *user);

/* One range of the flat parameter buffer for the fused AdamW update. */
typedef struct ctr_adamw_segment {
  int64_t offset;        /* first element */
  int64_t count;
  float weight_decay;
} ctr_adamw_segment;

typedef struct ctr_adamw_args {
  float *param;          /* flat buffers, indexed by the segments' offsets */
  const float *grad;
  float *m, *v;
  const ctr_adamw_segment *segments;
  int64_t num_segments;
  float lr, beta1, beta2, eps;
  float grad_scale;      /* applied to the gradient first (clipping) */
  int64_t t;             /* 1-based step count for bias correction */
} ctr_adamw_args;

typedef struct ctr_backend_iface {
  uint32_t size;         /* sizeof(ctr_backend_iface) of the plugin */
  uint32_t abi;          /* CTR_BACKEND_ABI of the plugin */
  const char *name;

  /* Memory: zeroed, 64-byte aligned device memory, or NULL. */
  void *(*alloc)(void *ctx, size_t bytes);
  void (*free)(void *ctx, void *p);
  /* Copies and fills, ordered on `stream`. A host pointer given to an
   * asynchronous stream must stay valid until the stream is synchronized.
   * stream CTR_STREAM_SYNC: at once, on the calling thread. */
  void (*copy_h2d)(void *ctx, void *dst, const void *src, size_t bytes, int stream);
  void (*copy_d2h)(void *ctx, void *dst, const void *src, size_t bytes, int stream);
  void (*copy_d2d)(void *ctx, void *dst, const void *src, size_t bytes, int stream);
  void (*fill)(void *ctx, void *dst, int byte, size_t bytes, int stream);

  /* Streams and events. create_stream / create_event return an id >= 0, or -1. */
  int (*create_stream)(void *ctx);
  int (*create_event)(void *ctx);
  void (*record_event)(void *ctx, int event, int stream);
  void (*wait_event)(void *ctx, int event, int stream);
  void (*host_fn)(void *ctx, int stream, ctr_host_fn fn, void *user);
  /* Waits until everything queued on `stream` has run. */
  void (*synchronize)(void *ctx, int stream);

  /* The kernel of op `op` (registry id; name for plugins keyed by name), or NULL
   * when the backend lacks it. */
  ctr_kernel_fn (*kernel)(void *ctx, int32_t op, const char *name);
  void (*launch)(void *ctx, ctr_kernel_fn fn, const ctr_kernel_args *args, int stream);

  /* Optimizer primitives over flat device buffers. sum_squares synchronizes
   * `stream` and returns the result in double. */
  double (*sum_squares)(void *ctx, const float *x, int64_t n, int stream);
  void (*add_into)(void *ctx, float *acc, const float *x, int64_t n, int stream); /* acc += x */
  void (*adamw)(void *ctx, const ctr_adamw_args *args, int stream);

  void (*destroy)(void *ctx);

  uint32_t flags;        /* CTR_BACKEND_* flags */

  /* Graph capture, optional (all four NULL where the backend has none).
   * capture_begin makes what is queued on `stream` be recorded instead of run
   * (0 on success); capture_end stops and returns a graph id >= 0, or -1 when
   * the recording cannot be replayed (nothing recorded has run then either);
   * graph_launch queues one replay on `stream`; graph_destroy frees a graph.
   * A replay runs the recorded launches with the arguments they had. */
  int (*capture_begin)(void *ctx, int stream);
  int (*capture_end)(void *ctx, int stream);
  void (*graph_launch)(void *ctx, int graph, int stream);
  void (*graph_destroy)(void *ctx, int graph);

  /* The backend's sticky error, optional (NULL: the backend cannot fail once
   * created). Returns 0 while every call, library call and kernel so far has
   * succeeded; otherwise non-zero, with a message in buf (NUL-terminated, cut
   * to size) naming what failed first: the call or kernel, its file:line and
   * the library's words. Once non-zero it stays so: nothing the device
   * computes after a fault can be trusted (a CUDA context is lost with it).
   * Kernels and copies never fail visibly, so the caller reads this after
   * launches and wherever it waits for the device, and turns it into an error
   * rather than read a stale or wrong result. Cheap: any thread, any time. */
  int (*status)(void *ctx, char *buf, size_t size);

  /* Host memory the device copies to and from at full speed (pinned), for
   * staging collectives of device memory; optional (both NULL: ordinary host
   * memory is used). host_alloc returns NULL when it cannot. */
  void *(*host_alloc)(void *ctx, size_t bytes);
  void (*host_free)(void *ctx, void *p);
} ctr_backend_iface;

typedef const ctr_backend_iface *(*ctr_backend_plugin_init_fn)(uint32_t abi, const char *device,
                                                               void **ctx, char *err,
                                                               size_t err_size);

/* ------------------------------------------------------------------------
 * Device communicators (optional): collectives between ranks over the
 * backend's own memory (NCCL for the CUDA backend), so a collective needs no
 * copy through the host.
 *
 * A plugin that has them exports a second entry point
 *
 *   const ctr_device_comm_iface *ctr_device_comm_plugin_init(uint32_t abi, char *err,
 *                                                            size_t err_size);
 *
 * returning NULL (with a message in err) when it cannot make them here (the
 * communication library does not load). A second entry point rather than new
 * slots in ctr_backend_iface: the backend table, its ABI and every plugin
 * written against it stay as they are, a plugin without device communicators
 * simply lacks the symbol, and the two tables version independently
 * (CTR_DEVICE_COMM_ABI). Every function takes the backend context the backend
 * plugin's init returned (a communicator orders its work after that backend's
 * stream 0), so both tables must come from the same library.
 *
 * Creation: member 0 of a group makes an id (unique_id) that the caller carries
 * to every member (libctr: through the rendezvous store); each member then calls
 * comm_create with it, its rank in the group and the group's size.
 *
 * Ops take device addresses of the backend's memory and return a work handle
 * at once, or NULL with a message in err. The work is ordered after everything
 * queued on the backend's stream 0 when the op is called; the caller must not
 * reuse the buffers before the work is waited on. Ops on one communicator are
 * issued in the same order on every member. A work handle is released by wait,
 * whatever its outcome. Ops and wait may be called from different threads;
 * one communicator serializes its own calls.
 *
 * Failures: wait has a deadline. On timeout, or when the library reports an
 * asynchronous error (a peer failed), the communicator is aborted and wait
 * returns CTR_DEVICE_COMM_TIMEOUT or CTR_DEVICE_COMM_FAILED with a message
 * naming the collective and the library's error; every later op fails at once.
 */

/* Bumped whenever ctr_device_comm_iface or ctr_device_coll change layout or meaning. */
#define CTR_DEVICE_COMM_ABI 1
/* Upper bound of a unique id's size in bytes. */
#define CTR_DEVICE_COMM_ID_MAX 512

/* Results of wait (and comm_create). */
#define CTR_DEVICE_COMM_OK 0
#define CTR_DEVICE_COMM_FAILED (-1)
#define CTR_DEVICE_COMM_TIMEOUT (-2)

/* Reductions (the values of libctr's ReduceOp). */
#define CTR_DEVICE_REDUCE_SUM 0
#define CTR_DEVICE_REDUCE_AVG 1
#define CTR_DEVICE_REDUCE_MAX 2
#define CTR_DEVICE_REDUCE_MIN 3

/* Kinds of ctr_device_coll. */
#define CTR_DEVICE_COLL_ALL_GATHER 0
#define CTR_DEVICE_COLL_REDUCE_SCATTER 1
#define CTR_DEVICE_COLL_ALL_REDUCE 2

typedef struct ctr_device_comm ctr_device_comm;
typedef struct ctr_device_work ctr_device_work;

/* One collective of a batch. count: all_gather, bytes per member;
 * reduce_scatter, elements of the result (send holds nranks * count);
 * all_reduce, elements. */
typedef struct ctr_device_coll {
  int32_t kind;          /* CTR_DEVICE_COLL_* */
  const void *send;
  void *recv;
  size_t count;
} ctr_device_coll;

typedef struct ctr_device_comm_iface {
  uint32_t size;         /* sizeof(ctr_device_comm_iface) of the plugin */
  uint32_t abi;          /* CTR_DEVICE_COMM_ABI of the plugin */
  const char *name;      /* the transport's name ("nccl") */

  /* Writes a new unique id into buf (capacity *len on entry, its size on
   * return). 0 on success. */
  int (*unique_id)(void *backend_ctx, char *buf, size_t *len, char *err, size_t err_size);
  /* Joins the communicator of `id` as member `rank` of `nranks`, waiting at
   * most timeout_ms for the others. CTR_DEVICE_COMM_OK with *comm set, or
   * CTR_DEVICE_COMM_FAILED / _TIMEOUT with *comm untouched. */
  int (*comm_create)(void *backend_ctx, const char *id, size_t len, int rank, int nranks,
                     int64_t timeout_ms, ctr_device_comm **comm, char *err, size_t err_size);

  /* recv[nranks * bytes] receives every member's send[bytes], in rank order. */
  ctr_device_work *(*all_gather)(ctr_device_comm *comm, const void *send, void *recv, size_t bytes,
                                 char *err, size_t err_size);
  /* dtype: CTR_DTYPE_F32, F64, I32, I64 or BF16 (ctr.h); op: CTR_DEVICE_REDUCE_*.
   * send holds nranks * count elements; recv[count] gets block `rank` reduced. */
  ctr_device_work *(*reduce_scatter)(ctr_device_comm *comm, const void *send, void *recv, size_t count,
                                     int32_t dtype, int32_t op, char *err, size_t err_size);
  /* recv[count] = reduction of every member's send[count]; send == recv allowed. */
  ctr_device_work *(*all_reduce)(ctr_device_comm *comm, const void *send, void *recv, size_t count,
                                 int32_t dtype, int32_t op, char *err, size_t err_size);
  /* To member j: send_counts[j] elements of elem_size bytes at send +
   * send_displs[j] elements; from member j: recv_counts[j] at recv +
   * recv_displs[j]. Grouped point-to-point sends and receives. */
  ctr_device_work *(*all_to_all_v)(ctr_device_comm *comm, const void *send, const size_t *send_counts,
                                   const size_t *send_displs, void *recv, const size_t *recv_counts,
                                   const size_t *recv_displs, size_t elem_size, char *err, size_t err_size);
  /* buf[bytes] of member root to every member. */
  ctr_device_work *(*broadcast)(ctr_device_comm *comm, void *buf, size_t bytes, int root, char *err,
                                size_t err_size);
  /* Several collectives as one work (one group); reductions use dtype and op. */
  ctr_device_work *(*batch)(ctr_device_comm *comm, const ctr_device_coll *colls, size_t n, int32_t dtype,
                            int32_t op, char *err, size_t err_size);

  /* 1 once the work is complete (it must still be waited on), else 0. */
  int (*test)(ctr_device_comm *comm, ctr_device_work *work);
  /* Waits at most timeout_ms (< 0: the timeout given to comm_create) and
   * releases the work. CTR_DEVICE_COMM_OK, _FAILED or _TIMEOUT (see above). */
  int (*wait)(ctr_device_comm *comm, ctr_device_work *work, int64_t timeout_ms, char *err, size_t err_size);
  /* Ends the communicator (aborting it if it is broken or does not finish in
   * its timeout); accepts NULL. No work of it may still be unwaited. */
  void (*destroy)(ctr_device_comm *comm);
} ctr_device_comm_iface;

typedef const ctr_device_comm_iface *(*ctr_device_comm_plugin_init_fn)(uint32_t abi, char *err,
                                                                       size_t err_size);

#ifdef __cplusplus
}
#endif

#endif /* CTR_BACKEND_PLUGIN_H */
