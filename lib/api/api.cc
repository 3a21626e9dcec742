// The public C ABI (include/ctr/ctr.h).
//
// Entry points stay thin: check arguments, hand the request to the subsystem, and
// translate any failure into a status plus the thread's last-error message. Out
// parameters are written only after everything that can fail has succeeded.

#include <cmath>
#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "api/handles.h"
#include "api/internal.h"
#include "backend/backend.h"
#include "cpu/kernels.h"
#include "ckpt/directory.h"
#include "ckpt/safetensors.h"
#include "comm/comm.h"
#include "comm/launch_env.h"
#include "core/files.h"
#include "core/options.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "data/data.h"
#include "graph/ops.h"
#include "graph/presets.h"
#include "passes/passes.h"
#include "plan/plan.h"
#include "runtime/mesh.h"
#include "runtime/step.h"

namespace ctr {
const char *last_error();
}

using ctr::fail;
using ctr::strformat;

#define REQUIRE_ARG(cond, ...) CTR_REQUIRE(cond, CTR_STATUS_INVALID_ARGUMENT, __VA_ARGS__)

// ---------------------------------------------------------------------------
// Version, status, dtypes

extern "C" const char *ctr_version(void) {
#define CTR_STR2(x) #x
#define CTR_STR(x) CTR_STR2(x)
  return CTR_STR(CTR_VERSION_MAJOR) "." CTR_STR(CTR_VERSION_MINOR) "." CTR_STR(CTR_VERSION_PATCH);
}

extern "C" int ctr_abi_version(void) { return CTR_ABI_VERSION; }

extern "C" const char *ctr_status_string(ctr_status status) {
  // Any int may arrive from C; read it as one (in C++ an enum object holds only
  // the values of its enumerators, so switching on it directly is undefined).
  int code = 0;
  static_assert(sizeof code == sizeof status);
  std::memcpy(&code, &status, sizeof code);
  switch (code) {
    case CTR_STATUS_OK: return "ok";
    case CTR_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case CTR_STATUS_INVALID_OPTION: return "invalid option";
    case CTR_STATUS_INVALID_GRAPH: return "invalid graph";
    case CTR_STATUS_IO_ERROR: return "i/o error";
    case CTR_STATUS_NOT_FOUND: return "not found";
    case CTR_STATUS_OUT_OF_MEMORY: return "out of memory";
    case CTR_STATUS_UNSUPPORTED: return "unsupported";
    case CTR_STATUS_INVALID_STATE: return "invalid state";
    case CTR_STATUS_DATA_ERROR: return "data error";
    case CTR_STATUS_TIMEOUT: return "timeout";
    case CTR_STATUS_COMM_ERROR: return "communication error";
    case CTR_STATUS_NUMERIC_ERROR: return "numeric error";
    case CTR_STATUS_INTERNAL: return "internal error";
    case CTR_STATUS_CHECKPOINT_ERROR: return "checkpoint error";
    case CTR_STATUS_DEVICE_ERROR: return "device error";
  }
  return "unknown status";
}

extern "C" const char *ctr_last_error(void) { return ctr::last_error(); }

extern "C" size_t ctr_dtype_size(ctr_dtype dtype) {
  int code = 0;  // as ctr_status_string: any int may arrive from C
  static_assert(sizeof code == sizeof dtype);
  std::memcpy(&code, &dtype, sizeof code);
  return code >= 0 && code <= CTR_DTYPE_F64 ? ctr::dtype_size(static_cast<ctr_dtype>(code)) : 0;
}

// ---------------------------------------------------------------------------
// Options

extern "C" ctr_status ctr_options_create(ctr_options **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(out != nullptr, "ctr_options_create: out is NULL");
  *out = new ctr_options();
  CTR_API_END
}

extern "C" void ctr_options_free(ctr_options *options) {
  // Handles own threads, files and endpoints; nothing may escape to the host.
  try {
    delete options;
  } catch (...) {
  }
}

namespace {
void check_key(ctr_options *o, const char *key, const char *fn) {
  REQUIRE_ARG(o != nullptr, "%s: options is NULL", fn);
  REQUIRE_ARG(key != nullptr && key[0] != '\0', "%s: key is NULL or empty", fn);
}
}  // namespace

extern "C" ctr_status ctr_options_set_int(ctr_options *o, const char *key, int64_t value) {
  CTR_API_BEGIN
  check_key(o, key, "ctr_options_set_int");
  ctr_options::Value v;
  v.kind = ctr_options::Value::Int;
  v.i = value;
  o->values[key] = v;
  CTR_API_END
}

extern "C" ctr_status ctr_options_set_float(ctr_options *o, const char *key, double value) {
  CTR_API_BEGIN
  check_key(o, key, "ctr_options_set_float");
  ctr_options::Value v;
  v.kind = ctr_options::Value::Float;
  v.f = value;
  o->values[key] = v;
  CTR_API_END
}

extern "C" ctr_status ctr_options_set_string(ctr_options *o, const char *key, const char *value) {
  CTR_API_BEGIN
  check_key(o, key, "ctr_options_set_string");
  REQUIRE_ARG(value != nullptr, "ctr_options_set_string: value of '%s' is NULL", key);
  ctr_options::Value v;
  v.kind = ctr_options::Value::String;
  v.s = value;
  o->values[key] = v;
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Mesh

namespace {

std::vector<std::pair<std::string, int>> parse_axes(const std::string &spec, int world) {
  std::vector<std::pair<std::string, int>> axes;
  if (spec.empty()) return {{"fsdp", world}};
  size_t pos = 0;
  constexpr int64_t kProductCap = int64_t{1} << 40;
  int64_t product = 1;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    std::string part = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    size_t eq = part.find('=');
    if (eq == std::string::npos || eq == 0)
      fail(CTR_STATUS_INVALID_OPTION,
           strformat("mesh option 'mesh': '%s' is not of the form axis=size", part.c_str()));
    std::string name = part.substr(0, eq);
    if (name != "dp" && name != "fsdp" && name != "ep" && name != "cp" && name != "tp" && name != "pp")
      fail(CTR_STATUS_INVALID_OPTION,
           strformat("mesh option 'mesh': unknown axis '%s' (known: dp, fsdp, ep, cp, tp, pp)", name.c_str()));
    for (auto &a : axes)
      if (a.first == name)
        fail(CTR_STATUS_INVALID_OPTION, strformat("mesh option 'mesh': axis '%s' given twice", name.c_str()));
    char *end = nullptr;
    long size = std::strtol(part.c_str() + eq + 1, &end, 10);
    if (*end != '\0' || size < 1 || size > (1 << 20))
      fail(CTR_STATUS_INVALID_OPTION,
           strformat("mesh option 'mesh': axis '%s' has invalid size '%s'", name.c_str(),
                     part.c_str() + eq + 1));
    axes.emplace_back(name, static_cast<int>(size));
    // Sizes are at most 2^20, so the product stays exact up to 2^60; past
    // 2^40 it stops growing, which no number of axes can overflow.
    if (product <= kProductCap) product *= size;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (product != world)
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("mesh option 'mesh': axes '%s' multiply to %s%lld, but the world has %d ranks",
                   spec.c_str(), product > kProductCap ? "more than " : "",
                   static_cast<long long>(product > kProductCap ? kProductCap : product), world));
  return axes;
}

ctr_status mesh_create(const ctr_options *options, ctr_mesh **out, bool from_env) {
  CTR_API_BEGIN
  REQUIRE_ARG(out != nullptr, "ctr_mesh_create: out is NULL");
  // Without from_env the environment plays no part: the defaults are a
  // LaunchEnv of no launcher.
  const ctr::LaunchEnv env = from_env ? ctr::read_launch_env() : ctr::LaunchEnv{};
  ctr::OptionReader r(options, from_env ? "ctr_mesh_create_from_env" : "ctr_mesh_create");
  auto m = std::make_unique<ctr_mesh>();
  m->world = static_cast<int>(r.get_int("world", env.world, 1, 1 << 20));
  m->rank = static_cast<int>(r.get_int("rank", env.rank, 0, m->world - 1));
  m->axes = parse_axes(r.get_string("mesh", ""), m->world);
  int64_t threads = r.get_int("threads", 0, 0, 4096);
  const bool has_comm_nice = r.has("comm_nice");
  const int64_t comm_nice = r.get_int("comm_nice", -10, -20, 19);
  auto env_str = [&](std::initializer_list<const char *> names, const char *def) {
    if (!from_env) return std::string(def);
    for (const char *n : names)
      if (const char *v = std::getenv(n); v && *v) return std::string(v);
    return std::string(def);
  };
  ctr::RendezvousConfig rc;
  m->device = r.get_string("device", env_str({"CTR_DEVICE"}, "cpu"));
  m->transport = r.get_string("transport", "ucx");
  rc.addr = r.get_string("master_addr", env.addr);
  rc.port = static_cast<int>(r.get_int("master_port", env.port, 1, 65535));
  rc.token = r.get_string("job_token", env_str({"CTR_JOB_TOKEN"}, ""));
  rc.allow_no_token = r.get_int("allow_no_token", env_str({"CTR_ALLOW_NO_TOKEN"}, "0") == "1", 0, 1) != 0;
  double timeout_s = r.get_float("timeout", 60.0, 0.01, 1e6);
  r.finish();
  m->timeout_ms = static_cast<int64_t>(timeout_s * 1000.0);
  CTR_REQUIRE(m->rank < m->world, CTR_STATUS_INVALID_OPTION, "mesh: rank %d is not below world %d",
              m->rank, m->world);
  // Set before any communication thread starts (a process-wide setting).
  if (has_comm_nice) ctr::set_comm_nice(static_cast<int>(comm_nice));
  // The transport and the device's backend are checked first: a missing plugin
  // fails before any rendezvous. Each step makes its own backend instance.
  ctr::check_transport(m->transport, m->device);
  ctr::create_backend(m->device);
  if (m->world > 1) {
    rc.rank = m->rank;
    rc.world = m->world;
    rc.timeout_ms = m->timeout_ms;
    m->connect(rc);
  }
  if (threads > 0) ctr::set_num_threads(static_cast<int>(threads));
  *out = m.release();
  CTR_API_END
}

}  // namespace

extern "C" ctr_status ctr_mesh_create(const ctr_options *options, ctr_mesh **out) {
  return mesh_create(options, out, false);
}

extern "C" ctr_status ctr_mesh_create_from_env(const ctr_options *options, ctr_mesh **out) {
  return mesh_create(options, out, true);
}

extern "C" void ctr_mesh_free(ctr_mesh *mesh) {
  // Handles own threads, files and endpoints; nothing may escape to the host.
  try {
    delete mesh;
  } catch (...) {
  }
}
extern "C" int ctr_mesh_rank(const ctr_mesh *mesh) { return mesh ? mesh->rank : 0; }
extern "C" int ctr_mesh_world_size(const ctr_mesh *mesh) { return mesh ? mesh->world : 0; }
extern "C" int ctr_mesh_axis_size(const ctr_mesh *mesh, const char *axis) {
  if (!mesh || !axis) return 0;
  return mesh->axis_size(axis);
}
extern "C" int ctr_mesh_data_rank(const ctr_mesh *mesh) { return mesh ? mesh->data_rank() : 0; }
extern "C" int ctr_mesh_data_size(const ctr_mesh *mesh) {
  return mesh ? mesh->data_size() : 0;
}
extern "C" const char *ctr_mesh_device(const ctr_mesh *mesh) {
  return mesh ? mesh->device.c_str() : "";
}

extern "C" ctr_status ctr_mesh_peak_flops(const ctr_mesh *mesh, double *flops) {
  CTR_API_BEGIN
  REQUIRE_ARG(mesh != nullptr && flops != nullptr, "ctr_mesh_peak_flops: mesh and flops must not be NULL");
  CTR_REQUIRE(mesh->device == "cpu", CTR_STATUS_UNSUPPORTED,
              "ctr_mesh_peak_flops: the peak of device '%s' is not measured; give the data-sheet figure "
              "(ctr run --peak-flops)",
              mesh->device.c_str());
  *flops = ctr::cpu::fma_peak_flops();
  return CTR_STATUS_OK;
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_peak_flops_v2(const ctr_mesh *mesh, const char *precision, double *flops) {
  CTR_API_BEGIN
  REQUIRE_ARG(mesh != nullptr && precision != nullptr && flops != nullptr,
              "ctr_mesh_peak_flops_v2: mesh, precision and flops must not be NULL");
  const std::string p = precision;
  REQUIRE_ARG(p == "fp32" || p == "bf16", "ctr_mesh_peak_flops_v2: precision '%s' is not fp32 or bf16", precision);
  CTR_REQUIRE(mesh->device == "cpu", CTR_STATUS_UNSUPPORTED,
              "ctr_mesh_peak_flops_v2: the peak of device '%s' is not measured; give the data-sheet figure "
              "(ctr run --peak-flops)",
              mesh->device.c_str());
  if (p == "fp32") {
    *flops = ctr::cpu::fma_peak_flops();
    return CTR_STATUS_OK;
  }
  const std::string why = ctr::cpu::bf16_unavailable();
  CTR_REQUIRE(why.empty(), CTR_STATUS_UNSUPPORTED, "ctr_mesh_peak_flops_v2: bf16: %s", why.c_str());
  *flops = ctr::cpu::bf16_peak_flops();
  return CTR_STATUS_OK;
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_async_error(const ctr_mesh *mesh, const char **message) {
  CTR_API_BEGIN
  REQUIRE_ARG(mesh != nullptr, "ctr_mesh_async_error: mesh is NULL");
  thread_local std::string text;
  const ctr_status st = mesh->async_error(&text);
  if (message) *message = text.c_str();
  return st;
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Host collectives over the mesh

namespace {

// The group of an axis ("world" or NULL: every rank); nullopt-like (no
// communicator) when it has one member.
struct HostGroup {
  const ctr::Comm *comm = nullptr;  // null: a group of one
  std::string axis;
  int rank = 0, size = 1;
};

HostGroup host_group(const ctr_mesh *mesh, const char *axis, const char *fn) {
  REQUIRE_ARG(mesh != nullptr, "%s: mesh is NULL", fn);
  HostGroup g;
  g.axis = axis && *axis ? axis : "world";
  if (g.axis != "world") {
    bool known = false;
    for (const auto &[name, size] : mesh->axes) known |= name == g.axis;
    std::string axes;
    for (const auto &[name, size] : mesh->axes) axes += (axes.empty() ? "" : ", ") + name;
    REQUIRE_ARG(known, "%s: the mesh has no axis '%s' (its axes: %s; or \"world\")", fn, g.axis.c_str(),
                axes.empty() ? "none" : axes.c_str());
  }
  const int size = g.axis == "world" ? mesh->world : mesh->axis_size(g.axis);
  if (mesh->world <= 1 || size <= 1) return g;
  g.comm = &mesh->comm(g.axis);
  g.rank = g.comm->iface->rank(g.comm->ctx);
  g.size = g.comm->iface->size(g.comm->ctx);
  return g;
}

ctr::ReduceOp reduce_op(ctr_reduce_op op, const char *fn) {
  int code = 0;
  std::memcpy(&code, &op, sizeof code);
  REQUIRE_ARG(code >= 0 && code <= 3, "%s: op %d is not a ctr_reduce_op", fn, code);
  return static_cast<ctr::ReduceOp>(code);
}

void check_reduce_dtype(ctr_dtype dtype, const char *fn) {
  CTR_REQUIRE(dtype == CTR_DTYPE_F32 || dtype == CTR_DTYPE_F64 || dtype == CTR_DTYPE_I32 || dtype == CTR_DTYPE_I64 ||
                  dtype == CTR_DTYPE_BF16,
              CTR_STATUS_UNSUPPORTED, "%s: dtype %s cannot be reduced (f32, f64, i32, i64 or bf16)", fn,
              ctr::dtype_name(dtype));
}

// Runs one collective of the group to completion with the mesh's deadline; a
// failure is the job's (the mesh's teardown then does not wait for peers).
template <typename Issue>
void host_collective(const ctr_mesh *mesh, const HostGroup &g, const char *what, Issue issue) {
  const std::lock_guard<std::mutex> one_at_a_time(mesh->host_collective_mu);
  const ctr::CollectiveName name(strformat("host %s over '%s'", what, g.axis.c_str()));
  try {
    ctr::comm_wait(*g.comm, issue(*g.comm->iface, g.comm->ctx), mesh->timeout_ms);
  } catch (const ctr::Error &e) {
    mesh->note_failure(e.code());
    throw;
  }
}

}  // namespace

extern "C" ctr_status ctr_mesh_group(const ctr_mesh *mesh, const char *axis, int *rank, int *size) {
  CTR_API_BEGIN
  const HostGroup g = host_group(mesh, axis, "ctr_mesh_group");
  if (rank) *rank = g.rank;
  if (size) *size = g.size;
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_group_member(const ctr_mesh *mesh, const char *axis, int i, int *world_rank) {
  CTR_API_BEGIN
  const HostGroup g = host_group(mesh, axis, "ctr_mesh_group_member");
  REQUIRE_ARG(world_rank != nullptr, "ctr_mesh_group_member: world_rank is NULL");
  REQUIRE_ARG(i >= 0 && i < g.size, "ctr_mesh_group_member: member %d of a group of %d", i, g.size);
  *world_rank = g.comm ? g.comm->iface->global_rank(g.comm->ctx, i) : mesh->rank;
  CTR_API_END
}

namespace {

// A reduction over the group: on a group of one, recv = send.
template <typename Issue>
void host_reduction(ctr_mesh *mesh, const char *axis, const void *send, void *recv, size_t count, ctr_dtype dtype,
                    ctr_reduce_op op, const char *fn, const char *what, Issue issue) {
  const HostGroup g = host_group(mesh, axis, fn);
  REQUIRE_ARG(count == 0 || (send && recv), "%s: send or recv is NULL", fn);
  check_reduce_dtype(dtype, fn);
  const ctr::ReduceOp r = reduce_op(op, fn);
  if (!g.comm) {
    if (count && send != recv) std::memmove(recv, send, count * ctr_dtype_size(dtype));
  } else if (count) {
    host_collective(mesh, g, what, [&](const ctr::CommIface &f, void *ctx) { return issue(f, ctx, r); });
  }
}

}  // namespace

extern "C" ctr_status ctr_mesh_all_reduce(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                          size_t count, ctr_dtype dtype, ctr_reduce_op op) {
  CTR_API_BEGIN
  host_reduction(mesh, axis, send, recv, count, dtype, op, "ctr_mesh_all_reduce", "all_reduce",
                 [&](const ctr::CommIface &f, void *ctx, ctr::ReduceOp r) {
                   return f.all_reduce(ctx, send, recv, count, dtype, r);
                 });
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_reduce_scatter(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                              size_t count, ctr_dtype dtype, ctr_reduce_op op) {
  CTR_API_BEGIN
  host_reduction(mesh, axis, send, recv, count, dtype, op, "ctr_mesh_reduce_scatter", "reduce_scatter",
                 [&](const ctr::CommIface &f, void *ctx, ctr::ReduceOp r) {
                   return f.reduce_scatter(ctx, send, recv, count, dtype, r);
                 });
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_all_gather(ctr_mesh *mesh, const char *axis, const void *send, void *recv,
                                          size_t bytes) {
  CTR_API_BEGIN
  const char *fn = "ctr_mesh_all_gather";
  const HostGroup g = host_group(mesh, axis, fn);
  REQUIRE_ARG(bytes == 0 || (send && recv), "%s: send or recv is NULL", fn);
  if (!g.comm) {
    if (bytes && send != recv) std::memmove(recv, send, bytes);
  } else if (bytes) {
    host_collective(mesh, g, "all_gather", [&](const ctr::CommIface &f, void *ctx) {
      return f.all_gather(ctx, send, recv, bytes);
    });
  }
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_all_to_all_v(ctr_mesh *mesh, const char *axis, const void *send,
                                            const size_t *send_counts, const size_t *send_displs, void *recv,
                                            const size_t *recv_counts, const size_t *recv_displs,
                                            size_t elem_size) {
  CTR_API_BEGIN
  const char *fn = "ctr_mesh_all_to_all_v";
  const HostGroup g = host_group(mesh, axis, fn);
  REQUIRE_ARG(send_counts && send_displs && recv_counts && recv_displs,
              "%s: the counts and displacements must not be NULL", fn);
  REQUIRE_ARG(elem_size > 0, "%s: elem_size is 0", fn);
  size_t sent = 0, got = 0;
  for (int j = 0; j < g.size; ++j) {
    sent += send_counts[j];
    got += recv_counts[j];
  }
  REQUIRE_ARG((sent == 0 || send) && (got == 0 || recv), "%s: send or recv is NULL", fn);
  if (!g.comm) {
    REQUIRE_ARG(send_counts[0] == recv_counts[0], "%s: %zu elements sent to this rank and %zu received", fn,
                send_counts[0], recv_counts[0]);
    if (send_counts[0])
      std::memmove(static_cast<char *>(recv) + recv_displs[0] * elem_size,
                   static_cast<const char *>(send) + send_displs[0] * elem_size, send_counts[0] * elem_size);
  } else {
    host_collective(mesh, g, "all_to_all", [&](const ctr::CommIface &f, void *ctx) {
      return f.all_to_all_v(ctx, send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size);
    });
  }
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_broadcast(ctr_mesh *mesh, const char *axis, void *buf, size_t bytes, int root) {
  CTR_API_BEGIN
  const char *fn = "ctr_mesh_broadcast";
  const HostGroup g = host_group(mesh, axis, fn);
  REQUIRE_ARG(bytes == 0 || buf, "%s: buf is NULL", fn);
  REQUIRE_ARG(root >= 0 && root < g.size, "%s: root %d of a group of %d", fn, root, g.size);
  if (g.comm && bytes)
    host_collective(mesh, g, "broadcast",
                    [&](const ctr::CommIface &f, void *ctx) { return f.broadcast(ctx, buf, bytes, root); });
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_barrier(ctr_mesh *mesh, const char *axis) {
  CTR_API_BEGIN
  const HostGroup g = host_group(mesh, axis, "ctr_mesh_barrier");
  if (g.comm)
    host_collective(mesh, g, "barrier", [&](const ctr::CommIface &f, void *ctx) { return f.barrier(ctx); });
  CTR_API_END
}

extern "C" ctr_status ctr_mesh_describe(const ctr_mesh *mesh, const char **json) {
  CTR_API_BEGIN
  REQUIRE_ARG(mesh != nullptr && json != nullptr, "ctr_mesh_describe: mesh and json must not be NULL");
  nlohmann::json axes = nlohmann::json::array();
  for (const auto &[name, size] : mesh->axes) axes.push_back({{"name", name}, {"size", size}});
  thread_local std::string text;
  text = nlohmann::json{{"rank", mesh->rank},
                        {"world", mesh->world},
                        {"axes", axes},
                        {"device", mesh->device},
                        {"transport", mesh->world > 1 ? mesh->transport : std::string("none")},
                        {"timeout_s", static_cast<double>(mesh->timeout_ms) / 1000.0}}
             .dump();
  *json = text.c_str();
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Graph

namespace {

ctr_graph *wrap_graph(ctr::Graph g) {
  ctr::pass_verify(g);
  auto h = std::make_unique<ctr_graph>();
  h->graph = std::move(g);
  for (size_t i = 0; i < h->graph.tensors.size(); ++i) {
    if (h->graph.tensors[i].role == ctr::Role::Input) h->inputs.push_back(static_cast<int>(i));
    if (h->graph.tensors[i].role == ctr::Role::Param) h->params.push_back(static_cast<int>(i));
  }
  return h.release();
}

void check_graph(const ctr_graph *g, const char *fn) {
  REQUIRE_ARG(g != nullptr, "%s: graph is NULL", fn);
}

}  // namespace

extern "C" ctr_status ctr_graph_load_file(const char *path, ctr_graph **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(path != nullptr, "ctr_graph_load_file: path is NULL");
  REQUIRE_ARG(out != nullptr, "ctr_graph_load_file: out is NULL");
  ctr_graph *g = wrap_graph(ctr::load_graph_file(path));
  *out = g;
  CTR_API_END
}

extern "C" ctr_status ctr_graph_load_buffer(const void *data, size_t size, ctr_graph **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(data != nullptr, "ctr_graph_load_buffer: data is NULL");
  REQUIRE_ARG(out != nullptr, "ctr_graph_load_buffer: out is NULL");
  ctr_graph *g = wrap_graph(ctr::load_graph_buffer(data, size, "<buffer>"));
  *out = g;
  CTR_API_END
}

extern "C" ctr_status ctr_graph_create_preset(const char *preset, const ctr_options *options,
                                              ctr_graph **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(preset != nullptr, "ctr_graph_create_preset: preset is NULL");
  REQUIRE_ARG(out != nullptr, "ctr_graph_create_preset: out is NULL");
  ctr::OptionReader r(options, "ctr_graph_create_preset");
  ctr::PresetConfig c;
  c.layers = r.get_int("layers", c.layers, 1, 1024);
  c.dim = r.get_int("dim", c.dim, 1, 1 << 16);
  c.heads = r.get_int("heads", c.heads, 1, 1 << 12);
  c.kv_heads = r.get_int("kv_heads", 0, 0, 1 << 12);
  c.vocab = r.get_int("vocab", c.vocab, 2, int64_t{1} << 31);
  c.seq = r.get_int("seq", c.seq, 1, 1 << 20);
  c.ffn_dim = r.get_int("ffn_dim", 0, 0, 1 << 20);
  c.tied = r.has("tied") ? static_cast<int>(r.get_int("tied", 0, 0, 1)) : -1;
  c.rope_theta = r.get_float("rope_theta", c.rope_theta, 1e-3, 1e12);
  c.norm_eps = r.get_float("norm_eps", c.norm_eps, 0, 1);
  c.init_std = r.get_float("init_std", c.init_std, 0, 10);
  if (std::string(preset) != "moe")
    for (const char *key : {"experts", "top_k", "shared_ffn_dim", "router_score", "router_renorm", "aux_loss", "z_loss"})
      if (r.has(key))
        fail(CTR_STATUS_INVALID_OPTION,
             strformat("ctr_graph_create_preset: option '%s' is for the moe preset, not '%s'", key, preset));
  c.experts = r.get_int("experts", c.experts, 1, 4096);
  c.top_k = r.get_int("top_k", c.top_k, 1, 4096);
  c.shared_ffn_dim = r.get_int("shared_ffn_dim", 0, 0, 1 << 20);
  c.router_score = r.get_string("router_score", c.router_score, {"softmax", "sigmoid"});
  c.router_renorm = r.has("router_renorm") ? static_cast<int>(r.get_int("router_renorm", 0, 0, 1)) : -1;
  c.aux_loss = r.get_float("aux_loss", c.aux_loss, 0, 1e3);
  c.z_loss = r.get_float("z_loss", c.z_loss, 0, 1e3);
  r.finish();
  ctr_graph *g = wrap_graph(ctr::build_preset(preset, c));
  *out = g;
  CTR_API_END
}

extern "C" ctr_status ctr_graph_save_file(const ctr_graph *graph, const char *path) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_save_file");
  REQUIRE_ARG(path != nullptr, "ctr_graph_save_file: path is NULL");
  ctr::save_graph_file(graph->graph, path);
  CTR_API_END
}

extern "C" void ctr_graph_free(ctr_graph *graph) {
  // Handles own threads, files and endpoints; nothing may escape to the host.
  try {
    delete graph;
  } catch (...) {
  }
}

extern "C" size_t ctr_graph_num_inputs(const ctr_graph *graph) {
  return graph ? graph->inputs.size() : 0;
}

extern "C" size_t ctr_graph_num_params(const ctr_graph *graph) {
  return graph ? graph->params.size() : 0;
}

extern "C" ctr_status ctr_graph_input_name(const ctr_graph *graph, size_t i, const char **name) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_input_name");
  REQUIRE_ARG(name != nullptr, "ctr_graph_input_name: name is NULL");
  REQUIRE_ARG(i < graph->inputs.size(), "ctr_graph_input_name: index %zu out of range (%zu inputs)",
              i, graph->inputs.size());
  *name = graph->graph.tensors[graph->inputs[i]].name.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_graph_param_name(const ctr_graph *graph, size_t i, const char **name) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_param_name");
  REQUIRE_ARG(name != nullptr, "ctr_graph_param_name: name is NULL");
  REQUIRE_ARG(i < graph->params.size(), "ctr_graph_param_name: index %zu out of range (%zu params)",
              i, graph->params.size());
  *name = graph->graph.tensors[graph->params[i]].name.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_graph_tensor_info(const ctr_graph *graph, const char *name,
                                            ctr_dtype *dtype, int64_t *dims, size_t max_dims,
                                            size_t *ndim) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_tensor_info");
  REQUIRE_ARG(name != nullptr, "ctr_graph_tensor_info: name is NULL");
  int id = graph->graph.find_tensor(name);
  CTR_REQUIRE(id >= 0, CTR_STATUS_NOT_FOUND, "ctr_graph_tensor_info: graph has no tensor '%s'", name);
  const ctr::Tensor &t = graph->graph.tensors[id];
  REQUIRE_ARG(t.dims.size() <= max_dims || (dims == nullptr && max_dims == 0),
              "ctr_graph_tensor_info: tensor '%s' has %zu dims, max_dims is %zu", name,
              t.dims.size(), max_dims);
  REQUIRE_ARG(dims != nullptr || max_dims == 0, "ctr_graph_tensor_info: dims is NULL");
  if (dims)
    for (size_t i = 0; i < t.dims.size(); ++i) dims[i] = t.dims[i].symbol.empty() ? t.dims[i].size : -1;
  if (dtype) *dtype = t.dtype;
  if (ndim) *ndim = t.dims.size();
  CTR_API_END
}

extern "C" ctr_status ctr_graph_metadata(const ctr_graph *graph, const char *key, const char **value) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_metadata");
  REQUIRE_ARG(key != nullptr, "ctr_graph_metadata: key is NULL");
  REQUIRE_ARG(value != nullptr, "ctr_graph_metadata: value is NULL");
  for (const auto &[k, v] : graph->graph.metadata) {
    if (k == key) {
      *value = v.c_str();
      return CTR_STATUS_OK;
    }
  }
  fail(CTR_STATUS_NOT_FOUND, strformat("ctr_graph_metadata: the graph has no metadata entry '%s'", key));
  CTR_API_END
}

extern "C" ctr_status ctr_graph_param_count(const ctr_graph *graph, int64_t *count) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_param_count");
  REQUIRE_ARG(count != nullptr, "ctr_graph_param_count: count is NULL");
  int64_t n = 0;
  for (int p : graph->params) {
    int64_t e = 1;
    for (const auto &d : graph->graph.tensors[p].dims) e *= d.size;
    n += e;
  }
  *count = n;
  CTR_API_END
}

extern "C" ctr_status ctr_plan(const ctr_graph *graph, const ctr_options *options, const char **json) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_plan");
  REQUIRE_ARG(json != nullptr, "ctr_plan: json is NULL");
  ctr::OptionReader r(options, "ctr_plan");
  for (const char *key : {"global_batch", "cluster"})
    CTR_REQUIRE(r.has(key), CTR_STATUS_INVALID_OPTION, "ctr_plan: option '%s' is required", key);
  ctr::PlanRequest req;
  // Without "world": the job this process belongs to, as its launcher says.
  req.world = r.has("world") ? r.get_int("world", 0, 1, 1 << 20) : ctr::read_launch_env().world;
  req.global_batch = r.get_int("global_batch", 0, 1, int64_t{1} << 40);
  req.seq = r.get_int("seq", 0, 0, 1 << 24);
  req.top = r.get_int("top", 0, 0, 1 << 20);
  req.prune = r.get_int("prune", 1, 0, 1) != 0;
  const std::string recompute = r.get_string("recompute", "none,all");
  const std::string cluster = r.get_string("cluster", "");
  r.finish();
  req.recompute.clear();
  for (size_t pos = 0; pos <= recompute.size();) {
    const size_t comma = std::min(recompute.find(',', pos), recompute.size());
    const std::string one = recompute.substr(pos, comma - pos);
    CTR_REQUIRE(one == "none" || one == "all" || one == "selective", CTR_STATUS_INVALID_OPTION,
                "ctr_plan: option 'recompute': '%s' is not a policy (none, all, selective)", one.c_str());
    req.recompute.push_back(one);
    pos = comma + 1;
  }
  std::string text = cluster, what = "ctr_plan: the cluster profile";
  if (cluster.find('{') == std::string::npos) {
    text = ctr::read_regular_file(cluster, "cluster profile", CTR_STATUS_INVALID_ARGUMENT, size_t{1} << 20);
    what = "ctr_plan: cluster profile '" + cluster + "'";
  }
  const ctr::ClusterProfile c = ctr::parse_cluster_profile(text, what);
  thread_local std::string result;  // the graph stays read-only (shared between threads)
  result = ctr::plan_json(graph->graph, req, c);
  *json = result.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_graph_flops_per_token(const ctr_graph *graph, int64_t seq, double *flops) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_flops_per_token");
  REQUIRE_ARG(flops != nullptr, "ctr_graph_flops_per_token: flops is NULL");
  REQUIRE_ARG(seq >= 0, "ctr_graph_flops_per_token: seq must be >= 0");
  ctr::Graph g = graph->graph;
  ctr::CompileOptions o;
  o.batch = 1;
  o.seq = seq;
  ctr::pass_infer_shapes(g, o);
  int64_t tokens = 0;
  for (const auto &t : g.tensors)
    if (t.role == ctr::Role::Input && t.name == "tokens") tokens = t.numel();
  if (tokens == 0)
    for (const auto &t : g.tensors)
      if (t.role == ctr::Role::Input) tokens = std::max(tokens, t.numel());
  CTR_REQUIRE(tokens > 0, CTR_STATUS_INVALID_GRAPH, "ctr_graph_flops_per_token: graph has no inputs");
  double f = 0;
  for (const auto &n : g.nodes)
    if (const ctr::OpDef *d = ctr::find_op(n.op); d->flops) f += d->flops(g, n);
  // Backward costs twice the forward (input and weight gradients).
  *flops = 3.0 * f / static_cast<double>(tokens);
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Step

extern "C" ctr_status ctr_step_create(const ctr_mesh *mesh, const ctr_graph *graph,
                                      const ctr_options *options, ctr_step **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(mesh != nullptr, "ctr_step_create: mesh is NULL");
  check_graph(graph, "ctr_step_create");
  REQUIRE_ARG(out != nullptr, "ctr_step_create: out is NULL");
  auto s = std::make_unique<ctr_step>();
  s->impl = std::make_unique<ctr::Step>(*mesh, graph->graph, options);
  *out = s.release();
  CTR_API_END
}

extern "C" void ctr_step_free(ctr_step *step) {
  // Handles own threads, files and endpoints; nothing may escape to the host.
  try {
    delete step;
  } catch (...) {
  }
}

// Holds the step for one call; a call made while another thread is inside one
// fails with CTR_STATUS_INVALID_STATE and changes nothing.
class StepUse {
 public:
  StepUse(const ctr_step *step, const char *fn) : step_(step) {
    if (step_->users.fetch_add(1) != 0) {
      step_->users.fetch_sub(1);
      fail(CTR_STATUS_INVALID_STATE,
           strformat("%s: the step is in use by another thread (a ctr_step is used by one thread at a time)", fn));
    }
  }
  ~StepUse() { step_->users.fetch_sub(1); }
  StepUse(const StepUse &) = delete;
  StepUse &operator=(const StepUse &) = delete;

 private:
  const ctr_step *step_;
};

#define STEP_ARG(fn)                                                   \
  REQUIRE_ARG(step != nullptr && step->impl, fn ": step is NULL");     \
  StepUse step_use_(step, fn)

extern "C" ctr_status ctr_step_set_input(ctr_step *step, const char *name, const void *data,
                                         size_t bytes) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_set_input");
  REQUIRE_ARG(name != nullptr, "ctr_step_set_input: name is NULL");
  step->impl->set_input(name, data, bytes);
  CTR_API_END
}

extern "C" ctr_status ctr_step_run(ctr_step *step, ctr_step_metrics *metrics) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_run");
  try {
    step->impl->run(metrics);
  } catch (const ctr::Error &e) {
    const ctr::Mesh &mesh = step->impl->mesh();
    mesh.note_failure(e.code());
    if (e.code() != CTR_STATUS_COMM_ERROR && e.code() != CTR_STATUS_TIMEOUT) throw;
    // What the ranks' flight recorders say goes with the error.
    const std::string found = mesh.forensics(e.message());
    if (found.empty()) throw;
    throw ctr::Error(e.code(), e.message() + "; flight recorder: " + found);
  }
  CTR_API_END
}

extern "C" ctr_status ctr_step_evaluate(ctr_step *step, double *loss) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_evaluate");
  REQUIRE_ARG(loss != nullptr, "ctr_step_evaluate: loss is NULL");
  double l = step->impl->evaluate();
  *loss = l;
  CTR_API_END
}

extern "C" ctr_status ctr_step_get_param(ctr_step *step, const char *name, float *out, size_t count) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_get_param");
  REQUIRE_ARG(name != nullptr, "ctr_step_get_param: name is NULL");
  step->impl->get_param(name, out, count);
  CTR_API_END
}

extern "C" ctr_status ctr_step_set_param(ctr_step *step, const char *name, const float *data,
                                         size_t count) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_set_param");
  REQUIRE_ARG(name != nullptr, "ctr_step_set_param: name is NULL");
  step->impl->set_param(name, data, count);
  CTR_API_END
}

extern "C" ctr_status ctr_step_set_lr(ctr_step *step, double lr) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_set_lr");
  step->impl->set_lr(lr);
  CTR_API_END
}

extern "C" ctr_status ctr_step_memory(const ctr_step *step, int64_t *arena_bytes,
                                      int64_t *param_bytes, int64_t *optimizer_bytes) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_memory");
  const auto &p = step->impl->plan();
  if (arena_bytes) *arena_bytes = step->impl->arena_bytes();
  if (param_bytes) *param_bytes = p.param_bytes;
  if (optimizer_bytes) *optimizer_bytes = step->impl->optimizer_bytes();
  CTR_API_END
}

extern "C" ctr_status ctr_step_get_output(ctr_step *step, const char *name, float *out, size_t count) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_get_output");
  REQUIRE_ARG(name != nullptr, "ctr_step_get_output: name is NULL");
  step->impl->get_output(name, out, count);
  CTR_API_END
}

extern "C" ctr_status ctr_step_comm_metrics(ctr_step *step, const char **json) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_comm_metrics");
  REQUIRE_ARG(json != nullptr, "ctr_step_comm_metrics: json is NULL");
  *json = step->impl->comm_metrics().c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_step_timeline(ctr_step *step, const char **json) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_timeline");
  REQUIRE_ARG(json != nullptr, "ctr_step_timeline: json is NULL");
  *json = step->impl->timeline().c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_step_kernel_profile(ctr_step *step, const char **json) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_kernel_profile");
  REQUIRE_ARG(json != nullptr, "ctr_step_kernel_profile: json is NULL");
  *json = step->impl->kernel_profile().c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_step_moe_metrics(ctr_step *step, const char **json) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_moe_metrics");
  REQUIRE_ARG(json != nullptr, "ctr_step_moe_metrics: json is NULL");
  const std::string &s = step->impl->moe_metrics();
  *json = s.empty() ? "[]" : s.c_str();
  CTR_API_END
}

extern "C" size_t ctr_step_moe_layers(const ctr_step *step) {
  return step && step->impl ? step->impl->moe_layer_count() : 0;
}

extern "C" ctr_status ctr_step_moe_layer(ctr_step *step, size_t i, ctr_moe_layer_metrics *out) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_moe_layer");
  REQUIRE_ARG(out != nullptr, "ctr_step_moe_layer: out is NULL");
  REQUIRE_ARG(out->size >= sizeof(size_t) && out->size <= (1 << 16),
              "ctr_step_moe_layer: out->size must be set to sizeof(ctr_moe_layer_metrics)");
  const size_t n = step->impl->moe_layer_count();
  REQUIRE_ARG(i < n, "ctr_step_moe_layer: layer %zu of %zu", i, n);
  const auto &l = step->impl->moe_layer(i);
  ctr_moe_layer_metrics m{};
  m.size = out->size;
  m.layer = l.name.c_str();
  m.experts = l.experts;
  m.tokens_per_expert = l.tokens.data();
  m.aux_loss = l.aux_name.empty() ? std::nan("") : l.aux_loss;
  m.z_loss = l.z_name.empty() ? std::nan("") : l.z_loss;
  std::memcpy(out, &m, std::min(out->size, sizeof m));
  CTR_API_END
}

extern "C" ctr_status ctr_step_save(ctr_step *step, const char *dir) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_save");
  REQUIRE_ARG(dir != nullptr, "ctr_step_save: dir is NULL");
  step->impl->save(dir, step->impl->async_save());
  CTR_API_END
}

extern "C" ctr_status ctr_step_wait_save(ctr_step *step) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_wait_save");
  step->impl->finish_save();
  CTR_API_END
}

extern "C" ctr_status ctr_step_load(ctr_step *step, const char *dir) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_load");
  REQUIRE_ARG(dir != nullptr, "ctr_step_load: dir is NULL");
  step->impl->load(dir);
  CTR_API_END
}

extern "C" ctr_status ctr_step_save_checkpoint(ctr_step *step, const char *root,
                                               const ctr_options *options, const char **path) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_save_checkpoint");
  REQUIRE_ARG(root != nullptr && *root, "ctr_step_save_checkpoint: root is NULL or empty");
  ctr::OptionReader r(options, "ctr_step_save_checkpoint");
  const int64_t keep = r.get_int("keep", 3, 0);
  r.finish();
  std::string dir = ctr::save_checkpoint(*step->impl, root, keep);
  step->checkpoint_path = std::move(dir);
  if (path) *path = step->checkpoint_path.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_step_resume(ctr_step *step, const char *root, const char *which,
                                      const char **path, const char **skipped) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_resume");
  REQUIRE_ARG(root != nullptr && *root, "ctr_step_resume: root is NULL or empty");
  REQUIRE_ARG(which == nullptr || *which, "ctr_step_resume: which is empty (NULL means \"latest\")");
  ctr::Resumed r = ctr::resume_checkpoint(*step->impl, root, which ? which : "");
  step->checkpoint_path = std::move(r.path);
  step->checkpoint_skipped = std::move(r.skipped);
  if (path) *path = step->checkpoint_path.c_str();
  if (skipped) *skipped = step->checkpoint_skipped.empty() ? nullptr : step->checkpoint_skipped.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_step_export_safetensors(ctr_step *step, const char *path) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_export_safetensors");
  REQUIRE_ARG(path != nullptr, "ctr_step_export_safetensors: path is NULL");
  ctr::export_safetensors(*step->impl, path);
  CTR_API_END
}

extern "C" ctr_status ctr_step_import_safetensors(ctr_step *step, const char *path,
                                                  const ctr_options *options) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_import_safetensors");
  REQUIRE_ARG(path != nullptr, "ctr_step_import_safetensors: path is NULL");
  ctr::OptionReader r(options, "ctr_step_import_safetensors");
  bool allow_extra = r.get_int("allow_extra", 0, 0, 1) != 0;
  r.finish();
  ctr::import_safetensors(*step->impl, path, allow_extra);
  CTR_API_END
}

extern "C" ctr_status ctr_step_attach_loader(ctr_step *step, ctr_loader *loader) {
  CTR_API_BEGIN
  STEP_ARG("ctr_step_attach_loader");
  step->impl->attach_loader(loader ? loader->loader.get() : nullptr, loader ? loader->seq : 0);
  CTR_API_END
}

extern "C" int64_t ctr_step_count(const ctr_step *step) {
  return step && step->impl ? step->impl->count() : 0;
}

// ---------------------------------------------------------------------------
// Data loader

ctr_loader::~ctr_loader() = default;

extern "C" ctr_status ctr_loader_create(const char *path, const ctr_options *options, ctr_loader **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(out != nullptr, "ctr_loader_create: out is NULL");
  REQUIRE_ARG(path == nullptr || path[0] != '\0',
              "ctr_loader_create: path is empty (NULL selects the built-in corpus)");
  ctr::OptionReader r(options, "ctr_loader_create");
  CTR_REQUIRE(r.has("seq"), CTR_STATUS_INVALID_OPTION, "ctr_loader_create: option 'seq' is required");
  ctr::data::OpenOptions o;
  o.seq = r.get_int("seq", 0, 1, 1 << 24);
  o.seed = static_cast<uint64_t>(r.get_int("seed", 0, 0));
  o.corpus_bytes = r.get_int("corpus_bytes", ctr::data::kSyntheticDefaultBytes, 1, int64_t{1} << 34);
  o.corpus_seed = static_cast<uint64_t>(r.get_int("corpus_seed", 0, 0));
  if (r.has("format"))
    o.format = ctr::data::format_from_name(
        r.get_string("format", "auto", {"auto", "llmc", "npy", "u16", "u32", "bytes"}));
  if (r.has("mode"))
    o.mode = r.get_string("mode", "windows", {"windows", "documents"}) == "documents"
                 ? ctr::data::Mode::Documents
                 : ctr::data::Mode::Windows;
  if (r.has("eot")) o.eot = r.get_int("eot", 0, 0, UINT32_MAX);
  r.finish();
  auto l = std::make_unique<ctr_loader>();
  l->seq = o.seq;
  // The loader owns its sources (one file, a manifest's files, or the corpus).
  l->loader = ctr::data::open_loader(path ? path : "", o);
  *out = l.release();
  CTR_API_END
}

extern "C" void ctr_loader_free(ctr_loader *loader) {
  // Handles own threads, files and endpoints; nothing may escape to the host.
  try {
    delete loader;
  } catch (...) {
  }
}

extern "C" ctr_status ctr_loader_next(ctr_loader *loader, int64_t rows, int32_t *tokens, int32_t *targets) {
  CTR_API_BEGIN
  REQUIRE_ARG(loader != nullptr, "ctr_loader_next: loader is NULL");
  REQUIRE_ARG(rows >= 0, "ctr_loader_next: rows must be >= 0");
  REQUIRE_ARG(tokens != nullptr && targets != nullptr, "ctr_loader_next: tokens or targets is NULL");
  loader->loader->next_slice(rows, 0, rows, tokens, targets);
  CTR_API_END
}

extern "C" ctr_status ctr_loader_next_slice(ctr_loader *loader, int64_t global_rows, int64_t first_row,
                                            int64_t rows, int32_t *tokens, int32_t *targets) {
  CTR_API_BEGIN
  REQUIRE_ARG(loader != nullptr, "ctr_loader_next_slice: loader is NULL");
  REQUIRE_ARG(global_rows >= 0, "ctr_loader_next_slice: global_rows must be >= 0, got %lld",
              static_cast<long long>(global_rows));
  REQUIRE_ARG(first_row >= 0 && rows >= 0 && first_row <= global_rows - rows,
              "ctr_loader_next_slice: rows [%lld, %lld + %lld) are not inside the global batch of "
              "%lld rows",
              static_cast<long long>(first_row), static_cast<long long>(first_row),
              static_cast<long long>(rows), static_cast<long long>(global_rows));
  REQUIRE_ARG(rows == 0 || (tokens != nullptr && targets != nullptr),
              "ctr_loader_next_slice: tokens or targets is NULL");
  loader->loader->next_slice(global_rows, first_row, rows, tokens, targets);
  CTR_API_END
}

extern "C" ctr_status ctr_loader_info(const ctr_loader *loader, int64_t *tokens, int64_t *max_token) {
  CTR_API_BEGIN
  REQUIRE_ARG(loader != nullptr, "ctr_loader_info: loader is NULL");
  const int64_t n = loader->loader->tokens();
  const int64_t m = loader->loader->max_token();
  if (tokens) *tokens = n;
  if (max_token) *max_token = m;
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Token files

namespace {

ctr::data::Format format_named(const char *name, const char *fn, bool for_writing) {
  const std::string n = name && *name ? name : "auto";
  const std::optional<ctr::data::Format> f = ctr::data::format_from_name(n);
  CTR_REQUIRE(f.has_value(), CTR_STATUS_INVALID_ARGUMENT, "%s: unknown format '%s' (known: %s)", fn, n.c_str(),
              ctr::data::format_names().c_str());
  if (for_writing)
    CTR_REQUIRE(*f == ctr::data::Format::Llmc || *f == ctr::data::Format::Npy || *f == ctr::data::Format::U16 ||
                    *f == ctr::data::Format::U32,
                CTR_STATUS_INVALID_ARGUMENT, "%s: cannot write format '%s' (llmc, npy, u16 or u32)", fn, n.c_str());
  return *f;
}

}  // namespace

ctr_tokens::~ctr_tokens() = default;
ctr_token_writer::~ctr_token_writer() = default;

extern "C" ctr_status ctr_tokens_open(const char *path, const ctr_options *options, ctr_tokens **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(path != nullptr && path[0] != '\0' && out != nullptr, "ctr_tokens_open: path or out is NULL");
  ctr::OptionReader r(options, "ctr_tokens_open");
  const std::string format = r.get_string("format", "auto");
  const bool has_dataset = r.has("dataset");
  const int64_t dataset = r.get_int("dataset", 0, 0, 1 << 20);
  r.finish();
  const ctr::data::Format f = format_named(format.c_str(), "ctr_tokens_open", false);
  auto t = std::make_unique<ctr_tokens>();
  if (f == ctr::data::Format::Auto && ctr::data::is_manifest(path)) {
    const ctr::data::Manifest m = ctr::data::read_manifest(path);
    REQUIRE_ARG(has_dataset, "ctr_tokens_open: '%s' is a manifest of %zu datasets: open one (option 'dataset')",
                path, m.datasets.size());
    REQUIRE_ARG(static_cast<size_t>(dataset) < m.datasets.size(),
                "ctr_tokens_open: dataset %lld of manifest '%s', which has %zu", static_cast<long long>(dataset), path,
                m.datasets.size());
    const ctr::data::DatasetSpec &d = m.datasets[static_cast<size_t>(dataset)];
    t->source = ctr::data::TokenSource::open(d.files, d.format);
  } else {
    REQUIRE_ARG(!has_dataset, "ctr_tokens_open: option 'dataset' applies to a manifest, and '%s' is not one", path);
    t->source = ctr::data::TokenSource::open(path, f);
  }
  *out = t.release();
  CTR_API_END
}

extern "C" void ctr_tokens_free(ctr_tokens *tokens) {
  try {
    delete tokens;
  } catch (...) {
  }
}

extern "C" ctr_status ctr_tokens_info(const ctr_tokens *tokens, const char **json) {
  CTR_API_BEGIN
  REQUIRE_ARG(tokens != nullptr && json != nullptr, "ctr_tokens_info: tokens and json must not be NULL");
  const ctr::data::TokenSource &src = *tokens->source;
  nlohmann::json files = nlohmann::json::array();
  for (const auto &f : src.files())
    files.push_back({{"path", f.path}, {"kind", f.kind}, {"tokens", f.tokens}, {"width", f.width},
                     {"header_bytes", f.header_bytes}});
  thread_local std::string text;
  text = nlohmann::json{{"name", src.name()},
                        {"kind", src.kind()},
                        {"tokens", src.size()},
                        {"max_id", src.size() > 0 ? static_cast<int64_t>(src.max_token()) : 0},
                        {"files", files}}
             .dump();
  *json = text.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_tokens_read(const ctr_tokens *tokens, int64_t start, int64_t count, uint32_t *out) {
  CTR_API_BEGIN
  REQUIRE_ARG(tokens != nullptr && (count == 0 || out != nullptr), "ctr_tokens_read: tokens or out is NULL");
  const int64_t n = tokens->source->size();
  REQUIRE_ARG(start >= 0 && count >= 0 && start <= n && count <= n - start,
              "ctr_tokens_read: tokens [%lld, %lld) of %lld", static_cast<long long>(start),
              static_cast<long long>(start + count), static_cast<long long>(n));
  if (count) tokens->source->read(start, count, out);
  CTR_API_END
}

extern "C" ctr_status ctr_tokens_samples(const ctr_tokens *tokens, int64_t seq, const char *mode, int64_t eot,
                                         int64_t *samples) {
  CTR_API_BEGIN
  REQUIRE_ARG(tokens != nullptr && samples != nullptr, "ctr_tokens_samples: tokens or samples is NULL");
  REQUIRE_ARG(seq >= 1, "ctr_tokens_samples: seq %lld (at least 1)", static_cast<long long>(seq));
  const std::string m = mode ? mode : "windows";
  REQUIRE_ARG(m == "windows" || m == "documents", "ctr_tokens_samples: mode '%s' (windows or documents)", m.c_str());
  ctr::data::Loader loader(*tokens->source,
                           ctr::data::LoaderConfig{seq, 0,
                                                   m == "documents" ? ctr::data::Mode::Documents
                                                                    : ctr::data::Mode::Windows,
                                                   eot},
                           1);
  *samples = loader.samples();
  CTR_API_END
}

extern "C" ctr_status ctr_manifest_info(const char *path, const char **json) {
  CTR_API_BEGIN
  REQUIRE_ARG(path != nullptr && json != nullptr, "ctr_manifest_info: path and json must not be NULL");
  const ctr::data::Manifest m = ctr::data::read_manifest(path);
  nlohmann::json ds = nlohmann::json::array();
  for (const auto &d : m.datasets)
    ds.push_back({{"name", d.name}, {"weight", d.weight}, {"files", d.files},
                  {"format", ctr::data::format_name(d.format)}});
  thread_local std::string text;
  text = nlohmann::json{{"path", m.path},
                        {"mode", m.mode ? nlohmann::json(*m.mode) : nlohmann::json()},
                        {"eot", m.eot ? nlohmann::json(*m.eot) : nlohmann::json()},
                        {"datasets", ds}}
             .dump();
  *json = text.c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_token_writer_create(const char *path, const char *format, int width, int64_t count,
                                              ctr_token_writer **out) {
  CTR_API_BEGIN
  REQUIRE_ARG(path != nullptr && path[0] != '\0' && out != nullptr,
              "ctr_token_writer_create: path or out is NULL");
  const ctr::data::Format f = format_named(format, "ctr_token_writer_create", true);
  REQUIRE_ARG(width == 2 || width == 4, "ctr_token_writer_create: width %d (2 or 4 bytes per token)", width);
  REQUIRE_ARG(count >= 0, "ctr_token_writer_create: count %lld", static_cast<long long>(count));
  auto w = std::make_unique<ctr_token_writer>();
  w->writer = std::make_unique<ctr::data::TokenWriter>(path, f, width, count);
  *out = w.release();
  CTR_API_END
}

extern "C" ctr_status ctr_token_writer_write(ctr_token_writer *writer, const uint32_t *tokens, int64_t count) {
  CTR_API_BEGIN
  REQUIRE_ARG(writer != nullptr && writer->writer && (count == 0 || tokens != nullptr),
              "ctr_token_writer_write: writer or tokens is NULL (or the writer is finished)");
  REQUIRE_ARG(count >= 0, "ctr_token_writer_write: count %lld", static_cast<long long>(count));
  writer->writer->write(tokens, count);
  CTR_API_END
}

extern "C" ctr_status ctr_token_writer_finish(ctr_token_writer *writer) {
  CTR_API_BEGIN
  REQUIRE_ARG(writer != nullptr && writer->writer, "ctr_token_writer_finish: writer is NULL or finished");
  writer->writer->finish();
  writer->writer.reset();
  CTR_API_END
}

extern "C" void ctr_token_writer_free(ctr_token_writer *writer) {
  try {
    delete writer;  // an unfinished file's path.tmp is removed
  } catch (...) {
  }
}

extern "C" ctr_status ctr_data_describe(const char *path, const char **name, const char **kind) {
  CTR_API_BEGIN
  REQUIRE_ARG(path != nullptr && path[0] != '\0', "ctr_data_describe: path is NULL or empty");
  std::unique_ptr<ctr::data::TokenSource> src = ctr::data::TokenSource::open_spec(path);
  thread_local std::string name_text, kind_text;
  name_text = src->name();
  kind_text = src->kind();
  if (name) *name = name_text.c_str();
  if (kind) *kind = kind_text.c_str();
  CTR_API_END
}

// ---------------------------------------------------------------------------
// The compiler's passes, for inspection

extern "C" ctr_status ctr_pass_name(size_t i, const char **name) {
  CTR_API_BEGIN
  REQUIRE_ARG(name != nullptr, "ctr_pass_name: name is NULL");
  static const std::vector<std::string> names = ctr::pass_names();
  CTR_REQUIRE(i < names.size(), CTR_STATUS_INVALID_ARGUMENT, "ctr_pass_name: pass %zu of %zu", i, names.size());
  *name = names[i].c_str();
  CTR_API_END
}

extern "C" ctr_status ctr_graph_inspect(const ctr_graph *graph, const ctr_options *options, const char *after,
                                        const char **text) {
  CTR_API_BEGIN
  check_graph(graph, "ctr_graph_inspect");
  REQUIRE_ARG(after != nullptr && text != nullptr, "ctr_graph_inspect: after and text must not be NULL");
  thread_local std::string result;
  result = ctr::inspect_graph(graph, options, after);
  *text = result.c_str();
  CTR_API_END
}

// ---------------------------------------------------------------------------
// Graph inspection

namespace ctr {

std::string inspect_graph(const ctr_graph *graph, const ctr_options *options, const std::string &after) {
  REQUIRE_ARG(graph != nullptr, "inspect: graph is NULL");
  const PassDef &until = find_pass(after);
  OptionReader r(options, "graph inspect");
  CompileOptions o = read_compile_options(r);
  // The placement of one rank of a mesh, to see what the shard pass makes of it.
  const int64_t fsdp = r.get_int("fsdp", 1, 1, 1 << 20);
  const int64_t dp = r.get_int("dp", 1, 1, 1 << 20);
  const int64_t ep = r.get_int("ep", 1, 1, 1 << 20);
  const int64_t cp = r.get_int("cp", 1, 1, 1 << 20);
  const int64_t tp = r.get_int("tp", 1, 1, 1 << 20);
  const int64_t pp = r.get_int("pp", 1, 1, 1 << 16);
  const int64_t rank = r.get_int("rank", 0, 0, pp * fsdp * dp * ep * cp * tp - 1);
  r.finish();
  // Axes in the order pp, dp, ep, fsdp, cp, tp (tp innermost), as "pp=..,dp=..,ep=..,fsdp=..,cp=..,tp=..".
  o.mesh.axes = {{"pp", pp, rank / (dp * fsdp * ep * cp * tp)},
                 {"dp", dp, (rank / (fsdp * ep * cp * tp)) % dp},
                 {"ep", ep, (rank / (fsdp * cp * tp)) % ep},
                 {"fsdp", fsdp, (rank / (cp * tp)) % fsdp},
                 {"cp", cp, (rank / tp) % cp},
                 {"tp", tp, rank % tp}};
  Graph g = graph->graph;  // loaded and verified
  if (until.at_load) return dump_graph(g);
  Backend be = cpu_backend_create(false);
  std::shared_ptr<Backend> owner(new Backend(be), [](Backend *b) {
    b->iface->destroy(b->ctx);
    delete b;
  });
  PassContext ctx(g, o, [&](OpId op) { return backend_has_kernel(be, op); });
  ctx.backend_flags = be.iface->flags;  // as a step on this backend sees them (precision auto, layouts)
  run_passes(ctx, after);
  return until.dump ? until.dump(ctx) : dump_graph(g);
}

}  // namespace ctr
