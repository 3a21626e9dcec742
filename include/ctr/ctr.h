/*
 * libctr — a training runtime with the shape of an inference runtime.
 *
 * This header is the whole public interface. A host program creates a mesh (who
 * and where it runs), loads a graph (what to train), compiles the two into a step
 * (gradients, memory plan, optimizer state) and calls ctr_step_run in a loop.
 *
 * Conventions, for every declaration below:
 * - Fallible calls return ctr_status (CTR_STATUS_OK == 0) and write results
 *   through out-pointers. On failure the out-pointers are left untouched, nothing
 *   needs cleaning up, and ctr_last_error() describes what was wrong and where.
 * - Handles are opaque. Every _free accepts NULL and returns nothing.
 * - Buffers passed in are borrowed for the duration of the call. Strings and
 *   buffers handed out belong to the handle that produced them and stay valid
 *   until that handle is freed or, for a ctr_step, until its next mutating call,
 *   unless a comment says otherwise.
 * - Threads: distinct handles are independent. A ctr_step and a ctr_options are
 *   used by one thread at a time; a ctr_step call made while another thread is
 *   inside one on the same step fails with CTR_STATUS_INVALID_STATE and changes
 *   nothing (since 0.2). ctr_graph and ctr_mesh are read-only after creation
 *   and may be shared between threads and steps.
 * - No call aborts the process or lets an exception escape on bad input.
 *
 * Options are typed key/value pairs (ctr_options_set_*); unknown keys are an error
 * at the call that consumes them, never silently ignored. The keys each call
 * accepts are listed at that call.
 *
 * Since 0.1 unless marked otherwise.
 */
#ifndef CTR_CTR_H
#define CTR_CTR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(CTR_BUILDING_LIBRARY) && defined(__GNUC__)
#define CTR_API __attribute__((visibility("default")))
#else
#define CTR_API
#endif

/* ------------------------------------------------------------------------ */
/* Version                                                                   */

#define CTR_VERSION_MAJOR 0
#define CTR_VERSION_MINOR 5
#define CTR_VERSION_PATCH 0

/* The ABI version: bumped only when a shipped declaration changes meaning. It is
 * the shared library's soversion. Bindings compare ctr_abi_version() with the
 * value they were written for and refuse a mismatch. */
#define CTR_ABI_VERSION 1

/* "MAJOR.MINOR.PATCH" of the loaded library; a static string. */
CTR_API const char *ctr_version(void);

/* CTR_ABI_VERSION of the loaded library. */
CTR_API int ctr_abi_version(void);

/* ------------------------------------------------------------------------ */
/* Status and errors                                                         */

/* The numbers never change; new codes are appended. */
typedef enum ctr_status {
  CTR_STATUS_OK = 0,
  CTR_STATUS_INVALID_ARGUMENT = 1, /* a NULL pointer, bad size, bad value */
  CTR_STATUS_INVALID_OPTION = 2,   /* unknown option key, wrong type or value */
  CTR_STATUS_INVALID_GRAPH = 3,    /* malformed or inconsistent graph file */
  CTR_STATUS_IO_ERROR = 4,         /* a file could not be read or written */
  CTR_STATUS_NOT_FOUND = 5,        /* no tensor, input or parameter of that name */
  CTR_STATUS_OUT_OF_MEMORY = 6,
  CTR_STATUS_UNSUPPORTED = 7,      /* valid request this build or device cannot do */
  CTR_STATUS_INVALID_STATE = 8,    /* call out of order (e.g. run before inputs set) */
  CTR_STATUS_DATA_ERROR = 9,       /* bad data: token id out of range, bad data file */
  CTR_STATUS_TIMEOUT = 10,         /* a peer did not answer in time */
  CTR_STATUS_COMM_ERROR = 11,      /* a collective or the rendezvous failed */
  CTR_STATUS_NUMERIC_ERROR = 12,   /* non-finite loss or gradient */
  CTR_STATUS_INTERNAL = 13,        /* a bug in libctr; please report it */
  CTR_STATUS_CHECKPOINT_ERROR = 14, /* a checkpoint is corrupt, incomplete or mismatched */
  CTR_STATUS_DEVICE_ERROR = 15      /* the device failed (a kernel faulted, a device library call
                                       failed); the step cannot go on (since 0.6) */
} ctr_status;

/* A static, human-readable name of a status code ("invalid graph"). Never NULL. */
CTR_API const char *ctr_status_string(ctr_status status);

/* The message of the most recent failed call on this thread, naming the file,
 * tensor, op, option or rank at fault; "" if no call has failed. Valid until the
 * next libctr call on this thread. */
CTR_API const char *ctr_last_error(void);

/* ------------------------------------------------------------------------ */
/* Data types                                                                */

/* Same numbers as the graph file's DType. */
typedef enum ctr_dtype {
  CTR_DTYPE_F32 = 0,
  CTR_DTYPE_F16 = 1,
  CTR_DTYPE_BF16 = 2,
  CTR_DTYPE_I32 = 3,
  CTR_DTYPE_I64 = 4,
  CTR_DTYPE_U16 = 5,
  CTR_DTYPE_U32 = 6,
  CTR_DTYPE_U8 = 7,
  CTR_DTYPE_F64 = 8
} ctr_dtype;

/* Bytes per element of dtype; 0 for an unknown value. */
CTR_API size_t ctr_dtype_size(ctr_dtype dtype);

/* ------------------------------------------------------------------------ */
/* Options                                                                   */

typedef struct ctr_options ctr_options;

/* Creates an empty option set. out: receives the handle, owned by the caller. */
CTR_API ctr_status ctr_options_create(ctr_options **out);
CTR_API void ctr_options_free(ctr_options *options);

/* Sets key to a value, replacing any earlier value of that key. key and value
 * are copied. Keys are checked by the call that consumes the options. */
CTR_API ctr_status ctr_options_set_int(ctr_options *options, const char *key, int64_t value);
CTR_API ctr_status ctr_options_set_float(ctr_options *options, const char *key, double value);
CTR_API ctr_status ctr_options_set_string(ctr_options *options, const char *key,
                                          const char *value);

/* ------------------------------------------------------------------------ */
/* Mesh: who and where                                                       */

typedef struct ctr_mesh ctr_mesh;

/* Creates a mesh. options may be NULL (one CPU rank). Keys:
 *   "device"  string  "cpu" (default; CTR_DEVICE with _from_env), or the name D
 *                     of a backend plugin libctr-D.so (e.g. "cuda"), loaded with
 *                     dlopen from CTR_PLUGIN_PATH or the library search path
 *   "transport" string  communicator between ranks: "ucx" (default). A group of
 *                     ranks on one host, in one network namespace, moves data
 *                     through a shared-memory segment; CTR_SHM=0 keeps it on UCX.
 *                     "nccl" (device "cuda" only, else CTR_STATUS_INVALID_OPTION):
 *                     steps run graph collectives with NCCL on device memory
 *                     (one GPU per rank; libnccl.so.2 loaded at the first step,
 *                     CTR_NCCL_PATH names its directory), the mesh keeps UCX for
 *                     host-side work and expert exchanges. An unknown name fails
 *                     with CTR_STATUS_UNSUPPORTED listing the available ones
 *   "rank"    int     this process's rank (default 0)
 *   "world"   int     number of ranks (default 1)
 *   "mesh"    string  axes as "dp=2,fsdp=4" (axes dp, fsdp, ep, tp, pp); product
 *                     must equal world (default "fsdp=<world>"). Every axis gets
 *                     its communicator; a step refuses an axis of size > 1 that
 *                     its graph cannot use (ep without experts, tp, pp)
 *   "threads" int     CPU worker threads of the process (a process-wide setting;
 *                     default: CTR_NUM_THREADS or all cores)
 *   "comm_nice" int   nice value of the threads that move data (communicator
 *                     progress, comm stream) relative to compute, so arriving
 *                     messages are handled at once (-10, or CTR_COMM_NICE; 0 off;
 *                     raising priority needs CAP_SYS_NICE, else it is left as is)
 *   "master_addr" string, "master_port" int   rank 0's rendezvous address
 *                     (default 127.0.0.1:29500, or the environment, see below)
 *   "job_token" string  the job's shared secret, the same on every rank (default
 *                     CTR_JOB_TOKEN). Rank 0 and each rank prove to each other
 *                     that they hold it without sending it. Without a token the
 *                     master address must be a loopback address, and only
 *                     processes of the same user are let in
 *   "allow_no_token" int  1: allow a tokenless job on a non-loopback address,
 *                     which any process that reaches it can join (default 0, or
 *                     CTR_ALLOW_NO_TOKEN=1); for trusted isolated networks only
 *   "timeout" float   seconds to wait for the rendezvous and for any collective
 *                     before failing with CTR_STATUS_TIMEOUT naming the rank (60)
 * With more than one rank, creation joins the rendezvous served by rank 0 and
 * connects the communicator; it is collective. A device whose plugin is missing
 * or of another backend ABI fails with CTR_STATUS_UNSUPPORTED naming the library,
 * before any rendezvous. */
CTR_API ctr_status ctr_mesh_create(const ctr_options *options, ctr_mesh **out);

/* As ctr_mesh_create, with rank, world and the store's address read from the
 * environment of the launcher that started the process, the first whose rank
 * variable is set:
 *   ctr launch  CTR_RANK, CTR_WORLD_SIZE, CTR_MASTER_ADDR, CTR_MASTER_PORT
 *   torchrun    RANK, WORLD_SIZE, MASTER_ADDR; the store listens on MASTER_PORT + 1
 *               (torchrun's own store holds MASTER_PORT)
 *   Slurm       SLURM_PROCID, SLURM_NTASKS; loopback on one node, else the first
 *               node of SLURM_STEP_NODELIST; the port 20000 + a number made from
 *               SLURM_JOB_ID and SLURM_STEP_ID mod 10000
 *   Open MPI    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE; loopback on one node
 *               (across nodes CTR_MASTER_ADDR is required); the port 20000 +
 *               OMPI_MCA_ess_base_jobid mod 10000
 * CTR_MASTER_ADDR and CTR_MASTER_PORT override any launcher's address and port
 * (MASTER_ADDR/MASTER_PORT, where set, those of Slurm and Open MPI). A launcher
 * whose variables are incomplete or malformed fails with
 * CTR_STATUS_INVALID_OPTION naming the variable. Keys in options override the
 * environment. Since 0.1; the launcher table since 0.5. */
CTR_API ctr_status ctr_mesh_create_from_env(const ctr_options *options, ctr_mesh **out);
CTR_API void ctr_mesh_free(ctr_mesh *mesh);

CTR_API int ctr_mesh_rank(const ctr_mesh *mesh);
CTR_API int ctr_mesh_world_size(const ctr_mesh *mesh);
/* Size of the named axis ("dp", "fsdp", "ep"); 1 for an axis the mesh lacks, 0 if
 * mesh or axis is NULL. */
CTR_API int ctr_mesh_axis_size(const ctr_mesh *mesh, const char *axis);
/* This rank's share of the data. The ranks of one tensor-parallel group (mesh
 * axis "tp") compute on the same rows, and those of one context-parallel group
 * (axis "cp") on the same whole sequences (each step keeps its own chunks of
 * them), so a host that feeds each rank its own rows splits the global batch
 * into ctr_mesh_data_size parts and gives this rank part ctr_mesh_data_rank (the
 * rank's index over every axis but tp and cp, in mesh order). Without tp and cp
 * they are the rank and the world size; 0 if mesh is NULL. */
CTR_API int ctr_mesh_data_rank(const ctr_mesh *mesh);
CTR_API int ctr_mesh_data_size(const ctr_mesh *mesh);
/* "cpu" or "cuda"; owned by the mesh. */
CTR_API const char *ctr_mesh_device(const ctr_mesh *mesh);
/* The peak fp32 rate of one rank's device in FLOP/s, what MFU is reported
 * against (*flops, out). On device "cpu": the fused multiply-adds per second of
 * a register-only loop in the widest vectors the CPU has, on every thread of the
 * process at once (CTR_NUM_THREADS), measured once per process (about 0.15 s, at
 * the first call; later calls return the same figure). No training step can
 * exceed it, so an MFU over it stays below 1. Other devices: not measured,
 * CTR_STATUS_UNSUPPORTED (a host passes the data-sheet figure itself). Fails
 * with CTR_STATUS_INVALID_ARGUMENT on NULL, *flops untouched. Thread-safe.
 * (since 0.6) */
CTR_API ctr_status ctr_mesh_peak_flops(const ctr_mesh *mesh, double *flops);
/* The peak rate of one rank's device for a precision (in, "fp32" or "bf16";
 * borrowed for the call), as ctr_mesh_peak_flops measures it (*flops, out):
 * "fp32" is that figure; "bf16" on device "cpu" is a register-only loop of the
 * instructions the bf16 GEMMs run on (AMX tile products where the CPU has AMX
 * and libctr was built with oneDNN, else vdpbf16ps), measured once per process.
 * CTR_STATUS_UNSUPPORTED where the device cannot run the precision (naming
 * why) or its peak is not measured; CTR_STATUS_INVALID_ARGUMENT on NULL or
 * another precision; *flops untouched on failure. Thread-safe. (since 0.6) */
CTR_API ctr_status ctr_mesh_peak_flops_v2(const ctr_mesh *mesh, const char *precision, double *flops);

/* Since 0.3. The job's failure as far as this rank knows it, learnt in the
 * background while a call on this mesh's steps may be blocked (the manner of
 * ncclCommGetAsyncError): CTR_STATUS_OK while there is none; otherwise
 * CTR_STATUS_COMM_ERROR with *message (may be NULL) naming it, for example
 * "rank 3 sent no heartbeat for 60.0 s (stopped, hung or cut off)", valid
 * until this thread's next call. Every rank of a multi-rank mesh sends rank 0 a
 * heartbeat eight times per mesh timeout; a rank silent for the timeout is the
 * job's failure, as is the first failure any rank reports. Safe to call from
 * any thread, concurrently with other calls. */
CTR_API ctr_status ctr_mesh_async_error(const ctr_mesh *mesh, const char **message);

/* Host collectives over the mesh (since 0.6): what the runtime's steps use,
 * for the host's own numbers (metrics, timings, a health check). axis names the
 * group: "world" (or NULL) for every rank, else a mesh axis ("dp", "fsdp", "tp",
 * ...), whose group is this rank's (the ranks differing from it in that axis
 * only). Every member of the group calls the same collective with the same
 * sizes in the same order. The buffers are host memory, borrowed for the call;
 * each call blocks until it is complete, with the mesh's deadline (option
 * "timeout"): a member that dies or hangs fails the call on the others with
 * CTR_STATUS_COMM_ERROR naming it, within that time. CTR_STATUS_INVALID_ARGUMENT
 * on NULL buffers (with a non-zero size), an axis the mesh lacks or a root out
 * of range; CTR_STATUS_UNSUPPORTED for a dtype the reduction does not take.
 * Calls from several threads run one at a time (in an order the other ranks
 * must match); none may run while a step of this mesh runs on another thread,
 * whose collectives use the same communicators. */
typedef enum ctr_reduce_op {
  CTR_REDUCE_SUM = 0,
  CTR_REDUCE_AVG = 1,
  CTR_REDUCE_MAX = 2,
  CTR_REDUCE_MIN = 3
} ctr_reduce_op;
/* This rank's index in the group (*rank) and the group's size (*size); either
 * may be NULL. */
CTR_API ctr_status ctr_mesh_group(const ctr_mesh *mesh, const char *axis, int *rank, int *size);
/* The world rank of member i of this rank's group (*world_rank). */
CTR_API ctr_status ctr_mesh_group_member(const ctr_mesh *mesh, const char *axis, int i, int *world_rank);
/* recv[count] = the reduction of every member's send[count] (send == recv
 * allowed). dtype: F32, F64, I32, I64 or BF16 (combined in f32, rounded once). */
CTR_API ctr_status ctr_mesh_all_reduce(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                       size_t count, ctr_dtype dtype, ctr_reduce_op op);
/* recv[size * bytes] receives every member's `bytes` from send, in member order. */
CTR_API ctr_status ctr_mesh_all_gather(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                       size_t bytes);
/* send holds size * count elements; this member receives the reduction of
 * block `rank` into recv[count]. */
CTR_API ctr_status ctr_mesh_reduce_scatter(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                           size_t count, ctr_dtype dtype, ctr_reduce_op op);
/* To member j go send_counts[j] elements of elem_size bytes from send +
 * send_displs[j] elements; from member j arrive recv_counts[j] elements at
 * recv + recv_displs[j] (arrays of the group's size). */
CTR_API ctr_status ctr_mesh_all_to_all_v(ctr_mesh *mesh, const char *axis, const void *send,
                                         const size_t *send_counts, const size_t *send_displs, void *recv,
                                         const size_t *recv_counts, const size_t *recv_displs,
                                         size_t elem_size);
/* buf[bytes] of member root is copied into every member's buf. */
CTR_API ctr_status ctr_mesh_broadcast(ctr_mesh *mesh, const char *axis, void *buf, size_t bytes, int root);
/* Returns once every member of the group has called it. */
CTR_API ctr_status ctr_mesh_barrier(ctr_mesh *mesh, const char *axis);
/* The mesh as JSON (*json, valid until this thread's next call; since 0.6):
 * {"rank", "world", "axes": [{"name", "size"}, ...] in mesh order, "device",
 * "transport" ("ucx", "shm", "nccl"; "none" on one rank), "timeout_s"}. */
CTR_API ctr_status ctr_mesh_describe(const ctr_mesh *mesh, const char **json);

/* ------------------------------------------------------------------------ */
/* Graph: what to train                                                      */

typedef struct ctr_graph ctr_graph;

/* Loads and verifies a graph file (.ctrg). A malformed file fails with
 * CTR_STATUS_INVALID_GRAPH and a message naming the problem (identifier, version,
 * tensor, node, op). out: receives the graph, owned by the caller. */
CTR_API ctr_status ctr_graph_load_file(const char *path, ctr_graph **out);

/* As ctr_graph_load_file from bytes in memory; data is copied. */
CTR_API ctr_status ctr_graph_load_buffer(const void *data, size_t size, ctr_graph **out);

/* Builds a model preset: preset is "gpt", "llama" or "moe" (another name fails
 * with CTR_STATUS_INVALID_OPTION). options may be NULL. Keys:
 *   "layers", "dim", "heads", "kv_heads", "vocab", "seq" (max positions),
 *   "ffn_dim" (0 = preset default; moe: each expert's width), "tied" (int 0/1),
 *   "rope_theta" (float), "norm_eps" (float), "init_std" (float); for moe only
 *   (since 0.4): "experts", "top_k", "shared_ffn_dim" (0 = no shared expert),
 *   "router_score" ("softmax" or "sigmoid"), "router_renorm" (int 0/1; default 1
 *   when top_k > 1), "aux_loss" and "z_loss" (float coefficients, 0 = none). */
CTR_API ctr_status ctr_graph_create_preset(const char *preset, const ctr_options *options,
                                           ctr_graph **out);

/* Writes the graph as a .ctrg file. */
CTR_API ctr_status ctr_graph_save_file(const ctr_graph *graph, const char *path);
CTR_API void ctr_graph_free(ctr_graph *graph);

/* Host inputs ("tokens", "targets"), in file order. */
CTR_API size_t ctr_graph_num_inputs(const ctr_graph *graph);
/* Trained parameters, in file order. */
CTR_API size_t ctr_graph_num_params(const ctr_graph *graph);

/* Name of input / parameter i; the string is owned by the graph. */
CTR_API ctr_status ctr_graph_input_name(const ctr_graph *graph, size_t i, const char **name);
CTR_API ctr_status ctr_graph_param_name(const ctr_graph *graph, size_t i, const char **name);

/* dtype and shape of the named tensor. dims (capacity max_dims) receives the
 * sizes, -1 for a symbolic dim; *ndim the rank. Pass dims NULL and max_dims 0 to
 * ask only for dtype and rank. Fails with CTR_STATUS_INVALID_ARGUMENT, leaving
 * dims untouched, if max_dims is non-zero and too small. */
CTR_API ctr_status ctr_graph_tensor_info(const ctr_graph *graph, const char *name,
                                         ctr_dtype *dtype, int64_t *dims, size_t max_dims,
                                         size_t *ndim);

/* Since 0.5. The value of metadata entry `key` (the file's key/value strings:
 * "max_seq", "vocab", "exporter", ...) in *value, owned by the graph; fails with
 * CTR_STATUS_NOT_FOUND when the graph has no such entry. */
CTR_API ctr_status ctr_graph_metadata(const ctr_graph *graph, const char *key, const char **value);

/* The compiler's passes in the order step creation runs them (since 0.6):
 * pass i's name (*name, static), CTR_STATUS_INVALID_ARGUMENT past the last. */
CTR_API ctr_status ctr_pass_name(size_t i, const char **name);
/* What step creation makes of graph up to and including pass `after` (a name of
 * ctr_pass_name), as readable text (*text, valid until this thread's next
 * call; since 0.6): the IR at that point, or the pass's own report (the
 * schedule's task orders, the stage cut, the memory plan, the instruction
 * lists). options are ctr_step_create's compile options (batch, seq,
 * micro_batches, precision, pp_schedule, ...) plus the mesh of the rank to
 * show: "pp", "dp", "ep", "fsdp", "cp", "tp" (sizes, 1 by default) and "rank"
 * (0), compiled for the CPU backend. Fails as step creation would (naming the
 * option, the pass or the mesh size the graph cannot take); an unknown pass
 * fails with CTR_STATUS_INVALID_ARGUMENT listing them. */
CTR_API ctr_status ctr_graph_inspect(const ctr_graph *graph, const ctr_options *options, const char *after,
                                     const char **text);

/* Total number of trained parameter elements. */
CTR_API ctr_status ctr_graph_param_count(const ctr_graph *graph, int64_t *count);

/* Training FLOPs per token (forward + backward, 6 per weight multiply-add plus
 * attention) at sequence length seq (0 = the graph's maximum). */
CTR_API ctr_status ctr_graph_flops_per_token(const ctr_graph *graph, int64_t seq,
                                             double *flops);

/* Since 0.7. Plans the graph's training step on a cluster: every mesh of the
 * world over pp, dp, ep (graphs with experts), fsdp, cp and tp, with
 * micro-batch counts, pipeline schedules and recompute policies, each compiled
 * by the passes a step runs (once per pipeline stage) and priced from the
 * cluster profile: its instruction lists played on the compute and comm
 * streams, its schedule played with those task times, its memory exactly as
 * step creation plans it. Options:
 *   "world" int                     devices (default: the world size of the job
 *                                   this process was launched in, read from the
 *                                   launcher's environment as
 *                                   ctr_mesh_create_from_env reads it; 1 alone)
 *   "global_batch" int (required)   sequences per step (all data ranks and
 *                                   micro-batches)
 *   "seq" int                       sequence length (default: graph max)
 *   "cluster" string (required)     the cluster profile: JSON text, or the path
 *                                   of a file holding it ({"name",
 *                                   "devices_per_host", "device": {"name",
 *                                   "memory_bytes", "flops", "bytes_per_s",
 *                                   "launch_us"}, "links": {"host", "network":
 *                                   {"latency_us", "bytes_per_s"}}, "sources"})
 *   "recompute" string              policies tried, comma-separated ("none,all")
 *   "top" int                       plans listed (0 = all, the default)
 *   "prune" int                     1 (default): refuse without compiling a
 *                                   mesh whose share of the parameters,
 *                                   gradients and optimizer state (16 bytes per
 *                                   parameter over tp, pp, fsdp, and ep for the
 *                                   experts) exceeds the device, and fewer
 *                                   micro-batches than a layout that already
 *                                   does not fit, and layouts that cannot be
 *                                   faster than one already priced ("pruned":
 *                                   true, with the bound); 0: compile every
 *                                   candidate
 * *json (owned by the library, valid until this thread's next ctr_plan; the
 * graph is only read, so threads may plan one graph at once) gets
 * {"world", "global_batch", "seq", "cluster", "device", "sources",
 * "candidates", "compiled", "feasible", "search_s", "plans": [...]}, each plan {"mesh",
 * "schedule", "micro_batches", "batch", "recompute", "cp_mode" (with cp:
 * "gather", "ulysses" or "ring", the step option), "feasible", "why" (when
 * not), "step_ms", "tokens_per_s", "mfu", "memory_bytes" (per device, the
 * largest stage's), "bubble", "comm_ms" (per axis), "exposed_comm_ms",
 * "stages": [{"forward_ms", "backward_ms", "weight_ms", "memory_bytes"}]},
 * ranked by predicted step time, infeasible plans last with the reason (a mesh
 * the model cannot take, or more memory than the device has). The ranking is
 * deterministic. Predictions come from the profile: as good as its numbers,
 * whose sources it names. CTR_STATUS_INVALID_OPTION / INVALID_ARGUMENT naming
 * a bad option or profile field. */
CTR_API ctr_status ctr_plan(const ctr_graph *graph, const ctr_options *options, const char **json);

/* ------------------------------------------------------------------------ */
/* Step: the compiled, runnable training step and its state                  */

typedef struct ctr_step ctr_step;

/* Compiles graph for mesh: verify, shape inference, autodiff, memory plan,
 * lowering; initialises parameters (counter-based RNG keyed by seed, tensor name
 * and element index) and optimizer state. mesh and graph must outlive the step.
 * options may be NULL. Keys:
 *   "batch" int (required)   micro-batch size bound to the "batch" symbol
 *   "seq" int                sequence length bound to "seq" (default: graph max)
 *   "micro_batches" int      gradient accumulation steps per ctr_step_run (1)
 *   "pp_schedule" string     order of the micro-batches' forwards and backwards
 *                            over the mesh's pp axis: "1f1b" (default; needs at
 *                            least as many micro-batches as pp stages), "gpipe"
 *                            (every forward, then every backward), or "zb" (zero
 *                            bubble: each backward split into its input- and its
 *                            weight-gradient part, the latter filling the
 *                            pipeline's idle time; up to pp + 1 micro-batches'
 *                            activations held per stage), or "interleaved"
 *                            (1f1b over pp_virtual chunks of the model per
 *                            rank; micro_batches a multiple of pp)
 *   "pp_virtual" int         with pp_schedule "interleaved": chunks (virtual
 *                            stages) per rank (2); the graph needs a block per
 *                            virtual stage
 *   "profile_kernels" int    1: time each kernel on its own (ctr_step_kernel_profile)
 *   "sequence_parallel" int  1: with tp, the activations between tensor-parallel
 *                            regions split by tokens over tp (0)
 *   "cp_mode" string         attention over the mesh's cp axis: "gather" (default;
 *                            every rank's keys and values all-gathered),
 *                            "ulysses" (heads exchanged for positions all-to-all;
 *                            cp must divide the heads and kv heads) or "ring"
 *                            (keys and values passed from rank to rank, one block
 *                            of attention per rank's keys under the next pass)
 *   "pp_stages" string       blocks per pipeline stage, in stage order ("2,3,3";
 *                            default: balanced by the blocks' forward FLOPs);
 *                            interleaved: per virtual stage (chunk * pp + stage)
 *   "seed" int               parameter init seed (0)
 *   "lr" float               peak learning rate (3e-4)
 *   "min_lr" float           final learning rate of the decay (0)
 *   "warmup_steps" int       linear warm-up from 0 (0)
 *   "decay_steps" int        steps of the decay after warm-up (0 = constant)
 *   "schedule" string        "cosine" (default), "linear" or "constant"
 *   "beta1", "beta2", "eps", "weight_decay" float   AdamW (0.9, 0.95, 1e-8, 0.1)
 *   "grad_clip" float        global-norm clip, 0 disables (1.0)
 *   "check_finite" int       fail a step whose loss or gradient norm is not finite
 *                            with CTR_STATUS_NUMERIC_ERROR, leaving the
 *                            parameters unchanged (1)
 *   "on_nonfinite" string    with check_finite: "fail" (default, as above) or
 *                            "skip": the step counts (the schedule moves on) but
 *                            the parameters and optimizer state are not updated;
 *                            metrics.skipped_steps counts such steps
 *   "reshard_after_forward" int  free gathered parameters after forward and gather
 *                            them again for backward: 1 (default) every block's but
 *                            the last one's and the head's, which backward reads
 *                            first; 2 every one; 0 none (all stay gathered)
 *   "keep" string            comma-separated forward tensors to keep readable with
 *                            ctr_step_get_output (e.g. "logits")
 *   "async_save" int         ctr_step_save writes in the background (0)
 *   "async_save_lag" int     runs after which a background save is published (2)
 *   "recompute" string       activation checkpointing per block: "none" (default),
 *                            "all", or "selective" (GEMM and attention outputs kept)
 *   "bucket" string          merge collectives: "block" (default: one per block and
 *                            kind), "bytes" (up to "bucket_bytes" each) or "none"
 *   "bucket_bytes" int       byte budget of a bucket with bucket "bytes" (0: none)
 *   "prefetch" int           issue each all-gather this many blocks before the
 *                            block that reads it (1); 0 keeps it right before its use
 *   "defer_reduce" int       issue gradient reduce-scatters behind the next block's
 *                            compute (1)
 *   "memory_budget" int      bytes of activation arena the collective schedule may
 *                            plan; prefetch and deferral shrink until it fits (0: none)
 *   "overlap" int            0 waits for every collective at its issue (1)
 *                            (neither the schedule nor recompute changes results:
 *                            losses are bitwise the same for every setting of these)
 *   "memory_limit" int       bytes the plan may use; a larger plan fails with
 *                            CTR_STATUS_OUT_OF_MEMORY before allocating (default:
 *                            the machine's physical memory)
 */
CTR_API ctr_status ctr_step_create(const ctr_mesh *mesh, const ctr_graph *graph,
                                   const ctr_options *options, ctr_step **out);
CTR_API void ctr_step_free(ctr_step *step);

/* Copies host data into the named input for the next run. data holds
 * micro_batches * (the input's element count) elements of the input's dtype
 * (for token inputs, int32 ids in [0, vocab); a target may be -1 to be ignored).
 * bytes must match exactly. Ids are checked here: an out-of-range id fails with
 * CTR_STATUS_DATA_ERROR naming the input and position. */
CTR_API ctr_status ctr_step_set_input(ctr_step *step, const char *name, const void *data,
                                      size_t bytes);

/* What one step did. Grows only at the end; set size = sizeof(ctr_step_metrics)
 * before passing it, so an older caller's smaller struct is filled only as far as
 * its size. */
typedef struct ctr_step_metrics {
  size_t size;
  int64_t step;            /* optimizer steps taken, including this one */
  double loss;             /* mean loss over the micro-batches */
  double grad_norm;        /* global gradient norm before clipping */
  double lr;               /* learning rate used by this step */
  double step_ms;          /* wall time of the whole step */
  double forward_ms;       /* forward kernels */
  double backward_ms;      /* backward kernels */
  double optimizer_ms;     /* clipping and AdamW */
  double tokens_per_s;     /* tokens of this step / step time */
  int64_t tokens;          /* tokens in this step, over every data share of the mesh */
  int64_t peak_bytes;      /* planned activation arena + parameter state */
  double save_wait_ms;     /* time this step waited to publish a background save */
  /* Since 0.2: */
  double compute_ms;       /* forward and backward, less exposed_comm_ms */
  double comm_ms;          /* time collectives were in flight on the comm stream */
  double exposed_comm_ms;  /* time compute waited for communication (not hidden) */
  /* Since 0.3: */
  int64_t skipped_steps;   /* steps so far whose update was skipped for a non-finite
                              loss or gradient (step option on_nonfinite "skip") */
} ctr_step_metrics;

/* Runs forward, backward and the optimizer update on the inputs last set (all
 * inputs must have been set once). metrics may be NULL. */
CTR_API ctr_status ctr_step_run(ctr_step *step, ctr_step_metrics *metrics);

/* Forward only, no update, on the inputs last set: mean loss over the
 * micro-batches. */
CTR_API ctr_status ctr_step_evaluate(ctr_step *step, double *loss);

/* Copies the named parameter out to / in from host fp32 memory. count is its
 * element count (see ctr_graph_tensor_info). With a sharded mesh these are
 * collective: every rank calls them for the same parameter. */
CTR_API ctr_status ctr_step_get_param(ctr_step *step, const char *name, float *out,
                                      size_t count);
CTR_API ctr_status ctr_step_set_param(ctr_step *step, const char *name, const float *data,
                                      size_t count);

/* Copies out a forward activation named in the step option "keep" (for example
 * the logits), as computed by the last ctr_step_run or ctr_step_evaluate (the
 * last micro-batch). count is its element count for one micro-batch: the
 * tensor's declared shape (ctr_graph_tensor_info) with "batch" and "seq" bound
 * to the step's values; the presets declare "logits" as [batch, seq, vocab]. */
CTR_API ctr_status ctr_step_get_output(ctr_step *step, const char *name, float *out,
                                       size_t count);

/* Since 0.4. The mixture-of-experts layers of the last ctr_step_run, as a JSON
 * array with one object per layer in graph order:
 *   {"layer": "layers.0.moe", "tokens_per_expert": [n0, n1, ...],
 *    "aux_loss": x, "z_loss": y}
 * tokens_per_expert counts the tokens routed to each expert (a token counts once
 * per expert it chose), summed over the micro-batches and every rank of the mesh;
 * the losses are each layer's load-balancing and router z-loss terms (present when
 * the layer has them), averaged like the step's loss. "[]" for a graph without
 * experts or before the first run. *json belongs to the step and stays valid until
 * its next mutating call. With more than one rank ctr_step_run is where the
 * counts are summed, so this call itself communicates nothing. */
CTR_API ctr_status ctr_step_moe_metrics(ctr_step *step, const char **json);

/* The same per layer as a struct (since 0.6), for hosts that parse no JSON.
 * ctr_step_moe_layers: how many layers the last ctr_step_run reported (0 before
 * the first run, for a graph without experts, or a NULL step).
 * ctr_step_moe_layer: layer i's (graph order) into *out, whose size the caller
 * sets to sizeof(ctr_moe_layer_metrics) (a smaller size from an older header
 * gets the fields it has). layer and tokens_per_expert belong to the step and
 * stay valid until its next mutating call; a loss the layer lacks is NaN.
 * CTR_STATUS_INVALID_ARGUMENT for i past the last layer or a bad size. */
typedef struct ctr_moe_layer_metrics {
  size_t size;
  const char *layer;                /* "layers.0.moe" */
  int64_t experts;
  const int64_t *tokens_per_expert; /* [experts]: summed over micro-batches and ranks */
  double aux_loss;                  /* load-balancing term, averaged like the loss */
  double z_loss;                    /* router z-loss term */
} ctr_moe_layer_metrics;
CTR_API size_t ctr_step_moe_layers(const ctr_step *step);
CTR_API ctr_status ctr_step_moe_layer(ctr_step *step, size_t i, ctr_moe_layer_metrics *out);

/* Since 0.5. Communication of the last ctr_step_run per mesh axis, as a JSON
 * object {"tp": ms, "fsdp": ms, ...}: for each axis the step's collectives run
 * over, the milliseconds they were in flight on the communication stream (of
 * this rank; overlapped with compute or not, as comm_ms in ctr_step_metrics,
 * whose sum it splits). "{}" for a step without collectives or before the first
 * run. *json belongs to the step and stays valid until its next mutating call. */
CTR_API ctr_status ctr_step_comm_metrics(ctr_step *step, const char **json);

/* Since 0.5. The tasks of the last ctr_step_run on this rank, as a JSON array in
 * the order they ran: each {"name", "cat", "stage", "micro_batch", "start_us",
 * "dur_us"}, where cat is "forward" or "backward" (a pipeline task, named "F3" or
 * "B0", its own work and its sends), "weight" (the weight-gradient half of a
 * split backward, pp_schedule "zb", named "W0"), "recv" (the wait for what the task receives
 * from another pipeline stage, named "recv F3"; "pipeline drain" for the step's
 * last sends and the gradients of parameters several stages share) or
 * "optimizer" (micro_batch -1); start_us counts microseconds of the system clock
 * since the Unix epoch, so the timelines of the ranks of one host line up. "[]"
 * before the first run. *json belongs to the step and stays valid until its next
 * mutating call. */
CTR_API ctr_status ctr_step_timeline(ctr_step *step, const char **json);

/* Since 0.7. With step option "profile_kernels" 1 (each kernel timed on its own,
 * stream 0 synchronised around it: slower steps, for calibration), the kernels
 * of this rank's program as a JSON array: each {"node", "op", "phase" (forward,
 * backward, weight), "flops", "bytes" (read and written), "runs", "us" (mean
 * microseconds per run)} over every run so far but each phase's first. *json belongs to the step and
 * stays valid until its next mutating call. CTR_STATUS_INVALID_STATE without
 * the option. */
CTR_API ctr_status ctr_step_kernel_profile(ctr_step *step, const char **json);

/* Replaces the learning-rate schedule by a constant lr from the next run on
 * (lr >= 0 and finite). */
CTR_API ctr_status ctr_step_set_lr(ctr_step *step, double lr);

/* Bytes of the planned memory: activation arena (one copy per micro-batch the
 * pipeline schedule keeps in flight on this rank's stage), parameters, gradients
 * and optimizer state. Known after ctr_step_create, before the first run. Any
 * pointer may be NULL. */
CTR_API ctr_status ctr_step_memory(const ctr_step *step, int64_t *arena_bytes,
                                   int64_t *param_bytes, int64_t *optimizer_bytes);

/* Optimizer steps taken so far. */
CTR_API int64_t ctr_step_count(const ctr_step *step);

/* ------------------------------------------------------------------------ */
/* Checkpoints and weights                                                   */

/* Saves the step's whole state to directory dir: parameters, optimizer state,
 * step count and schedule position, the attached loader's state (if any), the
 * mesh and options, with a checksum per tensor. Written to "dir.tmp", fsynced and
 * renamed, so a crash never leaves a partial checkpoint under dir. Collective:
 * every rank of the mesh calls it with the same dir (each rank writes its own
 * shard file). An existing dir is replaced. With the step option "async_save"
 * set, the call only snapshots the state to host memory and a background thread
 * writes it while training continues; the checkpoint is published (a collective)
 * by the ctr_step_run that comes "async_save_lag" runs later, or by the next
 * ctr_step_save / ctr_step_load / ctr_step_wait_save, whichever is first; that
 * call reports any write error. A step freed before that publishes nothing. */
CTR_API ctr_status ctr_step_save(ctr_step *step, const char *dir);

/* Waits for a background save and publishes it (no-op without one).
 * Collective. */
CTR_API ctr_status ctr_step_wait_save(ctr_step *step);

/* Restores a checkpoint written by ctr_step_save for the same graph, on any mesh
 * (parameters and optimizer state are resharded). Verifies every checksum; a
 * corrupt, incomplete or mismatched checkpoint fails with
 * CTR_STATUS_CHECKPOINT_ERROR naming the file and tensor, leaving the step
 * unchanged. Collective. */
CTR_API ctr_status ctr_step_load(ctr_step *step, const char *dir);

/* Checkpoint directories (since 0.2). One root directory holds numbered
 * checkpoints and a file naming the newest complete one:
 *   root/step_00000100/  root/step_00000200/  root/latest ("step_00000200\n")
 * The two calls below keep that layout, so every host and binding shares one
 * policy. The ranks of a mesh must see the same root (a shared file system). */

/* Since 0.2. Saves the step's state, as ctr_step_save does, into
 * root/step_%08lld of the current step count (ctr_step_count), creating root
 * if it does not exist; a checkpoint of that name is replaced. With the step
 * option "async_save" set the checkpoint is written in the background and
 * published later, exactly as for ctr_step_save (by the ctr_step_run
 * "async_save_lag" runs later, or by the next save, load, resume or
 * ctr_step_wait_save); without it, before this call returns. When the
 * checkpoint is published, rank 0 replaces root/latest atomically (written
 * aside, synced, renamed) so that it names the new checkpoint, and then
 * removes older step_* directories beyond the "keep" newest (the new one
 * included). step_* directories numbered after the new one, left by a run
 * that resumed from an older checkpoint, are not touched. So `latest` never
 * names a partial checkpoint: a crash at any point leaves it as it was or
 * naming the new checkpoint. A failure writing `latest` or pruning fails the
 * publishing call on every rank with CTR_STATUS_IO_ERROR (the checkpoint
 * itself is then complete).
 *   step     in: the step whose state is saved.
 *   root     in, borrowed for the call: the checkpoint directory's parent.
 *   options  in, borrowed, may be NULL. Keys:
 *              "keep" int   checkpoints to keep, >= 0 (3); 0 keeps all
 *            An unknown key fails with CTR_STATUS_INVALID_OPTION.
 *   path     out, may be NULL: the checkpoint's directory, root/step_NNNNNNNN
 *            (root without trailing '/'; for a background save, where it
 *            will be once published).
 *            Owned by the step, valid until its next call.
 * Collective: every rank calls it with the same root and options. Like every
 * call on a ctr_step, one thread at a time. */
CTR_API ctr_status ctr_step_save_checkpoint(ctr_step *step, const char *root,
                                            const ctr_options *options, const char **path);

/* Since 0.2. Restores a checkpoint from a directory laid out by
 * ctr_step_save_checkpoint, as ctr_step_load does (any mesh, every checksum
 * verified).
 *   step     in/out: restored on success, unchanged on failure.
 *   root     in, borrowed for the call: the checkpoints' directory.
 *   which    in, borrowed, may be NULL. NULL or "latest": the checkpoint
 *            root/latest names (without a usable `latest`, the newest
 *            root/step_*); when its load fails with
 *            CTR_STATUS_CHECKPOINT_ERROR (corrupt, incomplete, mismatched),
 *            the next older step_* directory is tried, and so on. Other
 *            failures (CTR_STATUS_IO_ERROR, CTR_STATUS_TIMEOUT, ...) end the
 *            call at once. No checkpoint at all (root missing or empty) fails
 *            with CTR_STATUS_NOT_FOUND naming root; every candidate damaged
 *            fails with CTR_STATUS_CHECKPOINT_ERROR naming each with its
 *            fault. Any other which is one checkpoint, loaded without
 *            fallback: root/which when which holds no '/' and that directory
 *            exists, else the path which.
 *   path     out, may be NULL: the directory loaded.
 *   skipped  out, may be NULL: NULL when nothing was passed over, else one
 *            line "DIR: reason" per damaged checkpoint passed over, in the
 *            order tried, separated by '\n' (no trailing newline).
 * path and skipped are owned by the step and valid until its next call; on
 * failure neither is written. Collective: every rank calls it with the same
 * arguments. Like every call on a ctr_step, one thread at a time. */
CTR_API ctr_status ctr_step_resume(ctr_step *step, const char *root, const char *which,
                                   const char **path, const char **skipped);

/* Writes the parameters, under their graph names, as a safetensors file (an
 * 8-byte little-endian header length, a JSON header, raw little-endian F32 data).
 * Collective; rank 0 writes the file. */
CTR_API ctr_status ctr_step_export_safetensors(ctr_step *step, const char *path);

/* Sets parameters from a safetensors file (F32, or F16/BF16 widened). Every
 * parameter of the graph must be present with its shape; names in the file that
 * the graph lacks are an error unless "allow_extra" is set in options (may be
 * NULL). Collective. */
CTR_API ctr_status ctr_step_import_safetensors(ctr_step *step, const char *path,
                                               const ctr_options *options);

/* ------------------------------------------------------------------------ */
/* Data                                                                      */

typedef struct ctr_loader ctr_loader;

/* Opens token sources and a loader over them. path (copied; the files are
 * mapped until ctr_loader_free) is one of:
 * - a token file: an llm.c .bin file (uint16 or uint32, with its header), a
 *   1-D .npy array (little-endian uint16, uint32 or int32), raw uint16/uint32
 *   tokens (with "format"), or any other file read as bytes;
 * - a manifest, a .json file of weighted sub-datasets, each one or more files
 *   read as one sequence (relative paths are relative to the manifest):
 *     {"datasets": [{"files": ["a.bin", "b.bin"], "weight": 0.7},
 *                   {"files": ["c.npy"], "weight": 0.3}],
 *      "format": "auto", "mode": "windows", "eot": 50256}
 *   (a dataset may also give its own "format" and a "name"; weights default
 *   to 1 and only their ratios matter);
 * - NULL for the built-in synthetic corpus.
 * Keys of options:
 *   "seq" int (required)     tokens per sample
 *   "seed" int               data order (0)
 *   "format" string          "auto" (default: llm.c and .npy by their header,
 *                            a .json name is a manifest, else bytes), "llmc",
 *                            "npy", "u16", "u32" or "bytes"
 *   "mode" string            "windows" (default): fixed windows of seq + 1
 *                            tokens; "documents": windows that never cross an
 *                            end-of-text token, a document's last sample padded
 *                            with token eot and target -1
 *   "eot" int                the end-of-text token id (required by documents)
 *   "corpus_bytes" int       size of the built-in corpus
 *   "corpus_seed" int        which built-in corpus: another seed gives other text
 *                            (0; e.g. held-out text for evaluation)
 * "mode" and "eot" override the manifest's. Each sub-dataset's order is a
 * seeded permutation of its samples per epoch, and sub-datasets are
 * interleaved by a deterministic schedule that follows the weights; the
 * loader's state is a few integers per sub-dataset, saved by ctr_step_save when
 * the loader is attached to the step and valid for any number of ranks. A bad
 * file or manifest fails with CTR_STATUS_DATA_ERROR naming it and the fault. */
CTR_API ctr_status ctr_loader_create(const char *path, const ctr_options *options,
                                     ctr_loader **out);
CTR_API void ctr_loader_free(ctr_loader *loader);

/* Fills the next `rows` windows of the global order: tokens and targets are
 * [rows, seq] int32 (targets shifted by one). Data-parallel ranks all draw the
 * same global batch and each feeds its own slice of rows. */
CTR_API ctr_status ctr_loader_next(ctr_loader *loader, int64_t rows, int32_t *tokens,
                                   int32_t *targets);

/* Tokens in the source (all sub-datasets of a manifest) and the largest token id
 * (any pointer may be NULL). */
CTR_API ctr_status ctr_loader_info(const ctr_loader *loader, int64_t *tokens,
                                   int64_t *max_token);
/* What a data path (a token file or a manifest, as ctr_loader_create takes
 * it) holds, for messages (since 0.6): its name (*name: the file, or
 * "manifest NAME") and kind (*kind: "llm.c u16 tokens", "manifest of 2
 * datasets in 3 files", ...); either may be NULL; valid until this thread's
 * next call. Fails as ctr_loader_create would on a missing or malformed file
 * (CTR_STATUS_IO_ERROR, CTR_STATUS_DATA_ERROR). */
CTR_API ctr_status ctr_data_describe(const char *path, const char **name, const char **kind);

/* Makes ctr_step_save / ctr_step_load include this loader's position. The
 * loader must outlive the step or be detached with loader NULL. */
CTR_API ctr_status ctr_step_attach_loader(ctr_step *step, ctr_loader *loader);

/* One rank's share of a global batch: advances the loader by global_rows samples,
 * exactly as ctr_loader_next(loader, global_rows, ...) would, but reads only the
 * rows samples starting at row first_row of that batch (the others touch no
 * token data) into tokens and targets, [rows, seq] int32 each (caller-owned, may
 * be NULL when rows is 0). Every rank calls it with the same global_rows and
 * its own first_row, so the loader state stays identical on all ranks and
 * independent of how the batch is split: a job restored with another world size
 * continues the same sequence of samples. Requires 0 <= first_row and
 * first_row + rows <= global_rows (else CTR_STATUS_INVALID_ARGUMENT, loader
 * unchanged). One thread at a time per loader. */
CTR_API ctr_status ctr_loader_next_slice(ctr_loader *loader, int64_t global_rows,
                                         int64_t first_row, int64_t rows, int32_t *tokens,
                                         int32_t *targets);

/* Token files, read and written as the loader reads them (since 0.6), so that a
 * file a host writes is one the loader accepts and a file it inspects is read by
 * the loader's own code. Formats by name: "auto" (or NULL: by content and
 * extension), "llmc" (llm.c's 256-int32 header, u16 or u32 tokens), "npy" (a
 * one-dimensional uint16, uint32 or int32 array), "u16", "u32" (raw
 * little-endian), "bytes" (a byte per token). */
typedef struct ctr_tokens ctr_tokens;
/* Opens a token file read-only (mapped until ctr_tokens_free). options may be
 * NULL; keys: "format" string (auto), "dataset" int: with a manifest (a .json
 * under auto, see ctr_loader_create), its sub-dataset of that index, its files
 * read as one sequence (without it a manifest is refused: open its datasets).
 * Missing or malformed files fail with CTR_STATUS_IO_ERROR or
 * CTR_STATUS_DATA_ERROR naming the file. */
CTR_API ctr_status ctr_tokens_open(const char *path, const ctr_options *options, ctr_tokens **out);
CTR_API void ctr_tokens_free(ctr_tokens *tokens);
/* What it holds, as JSON (*json, valid until this thread's next call): {"name",
 * "kind", "tokens", "max_id", "files": [{"path", "kind", "tokens", "width"
 * (bytes per token), "header_bytes"}]}. */
CTR_API ctr_status ctr_tokens_info(const ctr_tokens *tokens, const char **json);
/* out[count] = tokens [start, start + count) (an int32 .npy's tokens as their
 * bits). CTR_STATUS_INVALID_ARGUMENT past the end. */
CTR_API ctr_status ctr_tokens_read(const ctr_tokens *tokens, int64_t start, int64_t count, uint32_t *out);
/* How many samples of seq inputs the loader cuts from it (*samples): mode
 * "windows" or "documents" (split at each end-of-text id eot; eot < 0 in windows
 * mode). CTR_STATUS_DATA_ERROR when not one sample fits, naming the file. */
CTR_API ctr_status ctr_tokens_samples(const ctr_tokens *tokens, int64_t seq, const char *mode, int64_t eot,
                                      int64_t *samples);
/* A manifest's sub-datasets as JSON (*json, valid until this thread's next
 * call): {"path", "mode" (or null), "eot" (or null), "datasets": [{"name",
 * "weight", "files": [...], "format"}]}. Fails with CTR_STATUS_DATA_ERROR
 * naming the key at fault. */
CTR_API ctr_status ctr_manifest_info(const char *path, const char **json);
/* Writes count tokens into path: created as path.tmp and renamed by
 * ctr_token_writer_finish, so a reader never sees half a file. format "llmc",
 * "npy", "u16", "u32"; width 2 or 4 bytes per token ("u16", "u32": their own).
 * An id that does not fit the width, or more or fewer than count tokens, fails
 * with CTR_STATUS_DATA_ERROR naming the id and its position. Freeing a writer
 * not finished removes path.tmp. */
typedef struct ctr_token_writer ctr_token_writer;
CTR_API ctr_status ctr_token_writer_create(const char *path, const char *format, int width, int64_t count,
                                           ctr_token_writer **out);
CTR_API ctr_status ctr_token_writer_write(ctr_token_writer *writer, const uint32_t *tokens, int64_t count);
CTR_API ctr_status ctr_token_writer_finish(ctr_token_writer *writer);
CTR_API void ctr_token_writer_free(ctr_token_writer *writer);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* CTR_CTR_H */
