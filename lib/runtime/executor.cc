// The executor (see executor.h).

#include "runtime/executor.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/status.h"
#include "graph/ops.h"
#include "runtime/mesh.h"

namespace ctr {

struct Executor::Call {
  KernelFn fn = nullptr;
  bool skip = false;  // a reshape or fanout placed on its input (plan_memory): nothing to move
  std::vector<uint8_t> params;
  std::vector<ctr_tensor_ref> in, out;
  ctr_kernel_args args{};
};

using Clock = std::chrono::steady_clock;

// A staging buffer that grows to the largest size asked of it and is freed
// with the executor.
struct Executor::HostBuffer {
  const Backend *be = nullptr;
  void *data = nullptr;
  size_t cap = 0;
  bool pinned = false;
  HostBuffer() = default;
  HostBuffer(const HostBuffer &) = delete;
  HostBuffer &operator=(const HostBuffer &) = delete;
  HostBuffer(HostBuffer &&o) noexcept { *this = std::move(o); }
  HostBuffer &operator=(HostBuffer &&o) noexcept {
    std::swap(be, o.be);
    std::swap(data, o.data);
    std::swap(cap, o.cap);
    std::swap(pinned, o.pinned);
    return *this;
  }
  ~HostBuffer() { release(); }
  void release() {
    if (!data) return;
    if (pinned)
      be->iface->host_free(be->ctx, data);
    else
      std::free(data);
    data = nullptr;
    cap = 0;
  }
  // At least `bytes` of host memory, pinned if the backend can give it.
  void *get(const Backend &backend, size_t bytes) {
    if (bytes <= cap && data) return data;
    release();
    be = &backend;
    const size_t n = std::max<size_t>(bytes, 64);
    if (be->iface->host_alloc && be->iface->host_free) {
      data = be->iface->host_alloc(be->ctx, n);
      pinned = data != nullptr;
    }
    if (!data) {
      data = std::malloc(n);
      pinned = false;
    }
    CTR_REQUIRE(data != nullptr, CTR_STATUS_OUT_OF_MEMORY, "cannot allocate %zu bytes of host staging memory", n);
    cap = n;
    return data;
  }
};

// A collective node: one entry per (input, output) pair; a bucket has several,
// issued as one batch.
struct Executor::Collective {
  Executor *ex = nullptr;
  const Node *node = nullptr;
  Comm comm;
  CollDesc::Kind kind = CollDesc::AllGather;
  bool to_all = false;                   // an all_to_all (kind unused): equal blocks per member
  int64_t shift = 0;                     // a ring_shift (kind unused): members on to send to
  std::vector<ctr_tensor_ref> src, dst;  // sized once: rebind points into them
  std::vector<size_t> count;             // all_gather: bytes per member; all_to_all: bytes; else elements
  ReduceOp reduce = ReduceOp::Avg;       // reductions: gradients are averaged
  ctr_dtype dtype = CTR_DTYPE_F32;       // reductions: the element type (every pair's)
  size_t esz = 4;                        // its bytes
  // Expert exchanges (moe_dispatch, moe_combine, moe_dispatch_rows): every
  // input and output of the node, in order.
  enum class Exchange { None, Dispatch, Combine, DispatchRows } exchange = Exchange::None;
  std::vector<ctr_tensor_ref> ins, outs;
  int64_t timeout_ms = -1;
  // On a device communicator: issued on the calling thread, waited for on the
  // comm stream (work: the issue in flight, null when none or it failed).
  bool device = false;
  CommWork *work = nullptr;
  Clock::time_point issued{};
  int axis_slot = -1;  // index into Executor::axis_ns_
  // Host copies of the buffers when the backend's memory is not host memory
  // (pinned where the backend has host_alloc).
  std::vector<HostBuffer> host_in, host_out;
};


namespace {

int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

ctr_tensor_ref make_ref(const Tensor &t, void *addr) {
  ctr_tensor_ref r{};
  r.data = addr;
  r.numel = t.numel();
  r.bytes = t.bytes();
  r.dtype = t.dtype;
  CTR_CHECK(t.shape.size() <= CTR_MAX_DIMS);
  r.ndim = static_cast<int32_t>(t.shape.size());
  for (size_t i = 0; i < t.shape.size(); ++i) r.shape[i] = t.shape[i];
  return r;
}

}  // namespace

Executor::Executor(const Graph &g, const Program &prog, const Mesh &mesh, Backend be, std::vector<void *> addr,
                   const CommSet *device)
    : g_(g), prog_(prog), mesh_(mesh), be_(be), addr_(std::move(addr)) {
  staged_ = (be_.iface->flags & CTR_BACKEND_DEVICE_MEMORY) != 0;
  const size_t nn = g.nodes.size();
  calls_.resize(nn);
  // The mesh axes of the collectives, in node order, for per-axis timing.
  for (const Node &n : g.nodes) {
    if (collective_kind(n) == CollKind::None) continue;
    const std::string axis = n.attr_string("axis", "");
    if (std::find(axis_names_.begin(), axis_names_.end(), axis) == axis_names_.end()) axis_names_.push_back(axis);
  }
  axis_ns_ = std::make_unique<std::atomic<int64_t>[]>(axis_names_.size());
  for (size_t i = 0; i < axis_names_.size(); ++i) axis_ns_[i] = 0;
  colls_.resize(nn);
  refs_of_.resize(g.tensors.size());
  auto resolve = [&](const Instr &in) {
    const size_t ni = static_cast<size_t>(in.node);
    if (in.kind == Instr::Kernel && !calls_[ni]) {
      const Node &n = g.nodes[ni];
      const OpDef *def = find_op(n.op);
      CTR_CHECK(def != nullptr);
      auto c = std::make_unique<Call>();
      c->fn = be_.iface->kernel(be_.ctx, def->id, def->name.c_str());
      CTR_CHECK(c->fn != nullptr);
      c->params = decode_params(g, n);
      for (int t : n.inputs) c->in.push_back(make_ref(g.tensors[static_cast<size_t>(t)], addr_[static_cast<size_t>(t)]));
      for (int t : n.outputs) c->out.push_back(make_ref(g.tensors[static_cast<size_t>(t)], addr_[static_cast<size_t>(t)]));
      for (size_t i = 0; i < n.inputs.size(); ++i) refs_of_[static_cast<size_t>(n.inputs[i])].push_back(&c->in[i]);
      for (size_t i = 0; i < n.outputs.size(); ++i) refs_of_[static_cast<size_t>(n.outputs[i])].push_back(&c->out[i]);
      c->args.op = def->id;
      c->args.num_inputs = static_cast<int32_t>(c->in.size());
      c->args.num_outputs = static_cast<int32_t>(c->out.size());
      c->args.params = c->params.empty() ? nullptr : c->params.data();
      c->args.inputs = c->in.data();
      c->args.outputs = c->out.data();
      c->skip = (n.op == "reshape" || n.op == "fanout") && addr_[static_cast<size_t>(n.inputs[0])] == addr_[static_cast<size_t>(n.outputs[0])];
      calls_[ni] = std::move(c);
    } else if (in.kind == Instr::Collective && !colls_[ni]) {
      const Node &n = g.nodes[ni];
      auto c = std::make_unique<Collective>();
      c->ex = this;
      c->node = &n;
      c->comm = mesh_.comm(n.attr_string("axis", ""));
      c->axis_slot = static_cast<int>(
          std::find(axis_names_.begin(), axis_names_.end(), n.attr_string("axis", "")) - axis_names_.begin());
      c->timeout_ms = mesh_.timeout_ms;
      const CollKind kind = collective_kind(n);
      if (is_exchange_kind(kind)) {
        c->exchange = kind == CollKind::Dispatch  ? Collective::Exchange::Dispatch
                      : kind == CollKind::Combine ? Collective::Exchange::Combine
                                                  : Collective::Exchange::DispatchRows;
        for (int t : n.inputs) c->ins.push_back(make_ref(g.tensors[static_cast<size_t>(t)], addr_[static_cast<size_t>(t)]));
        for (int t : n.outputs) c->outs.push_back(make_ref(g.tensors[static_cast<size_t>(t)], addr_[static_cast<size_t>(t)]));
        for (size_t i = 0; i < n.inputs.size(); ++i) refs_of_[static_cast<size_t>(n.inputs[i])].push_back(&c->ins[i]);
        for (size_t i = 0; i < n.outputs.size(); ++i) refs_of_[static_cast<size_t>(n.outputs[i])].push_back(&c->outs[i]);
        colls_[ni] = std::move(c);
        return;
      }
      // Expert exchanges (above) read row counts on the host, so they stay on
      // the mesh's host communicator, staged; the rest go to a device
      // communicator where the axis has one.
      if (const Comm *dc = device ? device->find(n.attr_string("axis", "")) : nullptr) {
        c->comm = *dc;
        c->device = true;
      }
      if (n.attr_string("reduce", "avg") == "sum") c->reduce = ReduceOp::Sum;
      CTR_CHECK(!n.inputs.empty() && n.inputs.size() == n.outputs.size());
      switch (kind) {
        case CollKind::AllGather: c->kind = CollDesc::AllGather; break;
        case CollKind::ReduceScatter: c->kind = CollDesc::ReduceScatter; break;
        case CollKind::AllToAll: c->to_all = true; break;
        case CollKind::Shift: c->shift = std::max<int64_t>(1, n.attr_int("shift", 1)); break;
        default: CTR_CHECK(kind == CollKind::AllReduce); c->kind = CollDesc::AllReduce; break;
      }
      CTR_CHECK((!c->to_all && c->shift == 0) || n.inputs.size() == 1);
      const size_t k = n.inputs.size();
      c->src.resize(k);
      c->dst.resize(k);
      for (size_t j = 0; j < k; ++j) {
        const int in = n.inputs[j], out = n.outputs[j];
        const Tensor &src = g.tensors[static_cast<size_t>(in)];
        const Tensor &dst = g.tensors[static_cast<size_t>(out)];
        c->src[j] = make_ref(src, addr_[static_cast<size_t>(in)]);
        c->dst[j] = make_ref(dst, addr_[static_cast<size_t>(out)]);
        refs_of_[static_cast<size_t>(in)].push_back(&c->src[j]);
        refs_of_[static_cast<size_t>(out)].push_back(&c->dst[j]);
        c->count.push_back(c->kind == CollDesc::AllGather || c->to_all || c->shift ? static_cast<size_t>(src.bytes())
                                                                       : static_cast<size_t>(dst.numel()));
        // Reductions combine elements of one type: f32 gradients, or the bf16
        // activations of tp and sp under precision bf16. (Gathers move bytes: a
        // bucket may mix f32 weights and bf16 copies.)
        if (j == 0) c->dtype = dst.dtype;
        CTR_CHECK(src.dtype == dst.dtype && (c->kind == CollDesc::AllGather || c->to_all || c->shift ||
                                             dst.dtype == c->dtype));
      }
      c->esz = dtype_size(c->dtype);
      colls_[ni] = std::move(c);
    }
  };
  for (const Instr &in : prog.forward) resolve(in);
  for (const Instr &in : prog.backward) resolve(in);
  for (const Instr &in : prog.weight) resolve(in);

  streams_.assign(static_cast<size_t>(prog.num_streams), 0);
  for (int s = 1; s < prog.num_streams; ++s) {
    streams_[static_cast<size_t>(s)] = be_.iface->create_stream(be_.ctx);
    CTR_REQUIRE(streams_[static_cast<size_t>(s)] >= 0, CTR_STATUS_INTERNAL,
                "backend '%s' cannot create a stream", be_.iface->name);
  }
  // A phase can be captured as one graph when it is stream-0 kernels and fills;
  // otherwise why not, said once when graphs are on.
  auto why_not = [&](const std::vector<Instr> &list) -> std::string {
    for (const Instr &in : list) {
      if (in.kind == Instr::Collective) {
        const Collective &c = *colls_[static_cast<size_t>(in.node)];
        return strformat("it has collectives (%s '%s' first) that run as host work on the comm stream%s",
                         c.node->op.c_str(), c.node->name.c_str(),
                         c.device ? " to be waited for there" : ", over host memory");
      }
      if (in.stream != 0 || (in.kind != Instr::Kernel && in.kind != Instr::Fill))
        return "it orders work across streams with events";
    }
    return "";
  };
  const bool can_capture = be_.iface->capture_begin && be_.iface->capture_end && be_.iface->graph_launch &&
                           be_.iface->graph_destroy;
  if (can_capture) {
    why_not_[0] = why_not(prog.forward);
    why_not_[1] = why_not(prog.backward);
    why_not_[2] = why_not(prog.weight);
  }
  for (int p = 0; p < 3; ++p) capturable_[p] = can_capture && why_not_[p].empty();
  for (int e = 0; e < prog.num_events; ++e) {
    int id = be_.iface->create_event(be_.ctx);
    CTR_REQUIRE(id >= 0, CTR_STATUS_INTERNAL, "backend '%s' cannot create an event", be_.iface->name);
    events_.push_back(id);
  }
}

Executor::~Executor() {
  // Nothing may still be queued that points into this executor.
  for (size_t s = 1; s < streams_.size(); ++s) be_.iface->synchronize(be_.ctx, streams_[s]);
  drop_graphs();
}

void Executor::drop_graphs() {
  for (int &g : graph_) {
    if (g >= 0) be_.iface->graph_destroy(be_.ctx, g);
    g = -1;
  }
}

void Executor::rebind(int t, void *addr) {
  if (addr_[static_cast<size_t>(t)] == addr) return;
  // A captured graph has the old address baked in.
  if (graph_[0] >= 0 || graph_[1] >= 0 || graph_[2] >= 0) {
    drop_graphs();
    if (++recaptures_ == 4)
      std::fprintf(stderr, "ctr: graphs: no longer captured: the addresses they were captured with keep moving\n");
  }
  addr_[static_cast<size_t>(t)] = addr;
  for (ctr_tensor_ref *r : refs_of_[static_cast<size_t>(t)]) r->data = addr;
}

// A collective of one buffer pair, issued (not waited for).
CommWork *Executor::issue_one(Collective &c, const void *send, void *recv) {
  const CommIface *ci = c.comm.iface;
  if (c.to_all) {
    // Equal blocks of bytes: block j of send to member j, from member i into block i.
    const size_t P = static_cast<size_t>(ci->size(c.comm.ctx)), block = c.count[0] / P;
    std::vector<size_t> counts(P, block), displs(P);
    for (size_t j = 0; j < P; ++j) displs[j] = j * block;
    return ci->all_to_all_v(c.comm.ctx, send, counts.data(), displs.data(), recv, counts.data(), displs.data(), 1);
  }
  if (c.shift) {
    // One block each way: to the member `shift` on, from the one `shift` back.
    const size_t P = static_cast<size_t>(ci->size(c.comm.ctx)), me = static_cast<size_t>(ci->rank(c.comm.ctx));
    const size_t to = (me + static_cast<size_t>(c.shift)) % P, from = (me + P - static_cast<size_t>(c.shift) % P) % P;
    std::vector<size_t> sc(P, 0), rc(P, 0), displs(P, 0);
    sc[to] = c.count[0];
    rc[from] = c.count[0];
    return ci->all_to_all_v(c.comm.ctx, send, sc.data(), displs.data(), recv, rc.data(), displs.data(), 1);
  }
  switch (c.kind) {
    case CollDesc::AllGather: return ci->all_gather(c.comm.ctx, send, recv, c.count[0]);
    case CollDesc::ReduceScatter:
      return ci->reduce_scatter(c.comm.ctx, send, recv, c.count[0], c.dtype, c.reduce);
    case CollDesc::AllReduce: return ci->all_reduce(c.comm.ctx, send, recv, c.count[0], c.dtype, c.reduce);
  }
  return nullptr;
}

void Executor::run_collective(void *user) {
  auto *c = static_cast<Collective *>(user);
  Executor &ex = *c->ex;
  // After a failure the communicator is broken: issue nothing more on it.
  if (ex.failed_.load(std::memory_order_acquire)) return;
  const auto t0 = Clock::now();
  try {
    const CommIface *ci = c->comm.iface;
    const CollectiveName name(strformat("%s '%s'", c->node->op.c_str(), c->node->name.c_str()));
    CommWork *w = nullptr;
    // Device memory is staged through host buffers: copied out before the
    // collective, its results copied in after (the comm stream waited for the
    // kernels that wrote the inputs, and compute waits for this collective).
    const bool staged = ex.staged_ && c->exchange == Collective::Exchange::None;
    const ctr_backend_iface *bi = ex.be_.iface;
    const size_t members = static_cast<size_t>(c->comm.iface->size(c->comm.ctx));
    auto send_bytes = [&](size_t j) {
      return c->kind == CollDesc::AllGather || c->to_all || c->shift ? c->count[j]
             : c->kind == CollDesc::ReduceScatter ? c->count[j] * members * c->esz
                                                  : c->count[j] * c->esz;
    };
    auto recv_bytes = [&](size_t j) {
      return c->to_all || c->shift ? c->count[j]
             : c->kind == CollDesc::AllGather ? c->count[j] * members
                                               : c->count[j] * c->esz;
    };
    std::vector<void *> send(c->src.size()), recv(c->src.size());
    for (size_t j = 0; j < c->src.size(); ++j) {
      send[j] = c->src[j].data;
      recv[j] = c->dst[j].data;
      if (!staged) continue;
      c->host_in.resize(c->src.size());
      c->host_out.resize(c->src.size());
      void *hin = c->host_in[j].get(ex.be_, send_bytes(j));
      recv[j] = c->host_out[j].get(ex.be_, recv_bytes(j));
      bi->copy_d2h(ex.be_.ctx, hin, send[j], send_bytes(j), CTR_STREAM_SYNC);
      send[j] = hin;
    }
    if (c->exchange != Collective::Exchange::None) {
      // Fault injection (exitcomm): an exchange is left by dying before it
      // starts, so the peers are inside theirs when this rank is gone.
      if (ex.exit_countdown_.load() > 0 && --ex.exit_countdown_ == 0) _exit(87);
      ex.run_exchange(*c);
    } else if (c->src.size() > 1) {
      std::vector<CollDesc> d(c->src.size());
      for (size_t j = 0; j < d.size(); ++j) {
        d[j].kind = c->kind;
        d[j].send = send[j];
        d[j].recv = recv[j];
        d[j].count = c->count[j];
      }
      w = ci->batch(c->comm.ctx, d.data(), d.size(), c->dtype, c->reduce);
    } else {
      w = issue_one(*c, send[0], recv[0]);
    }
    if (ex.exit_countdown_.load() > 0 && --ex.exit_countdown_ == 0) _exit(87);
    if (w) ci->wait(c->comm.ctx, w, c->timeout_ms);
    if (staged)
      for (size_t j = 0; j < c->dst.size(); ++j)
        bi->copy_h2d(ex.be_.ctx, c->dst[j].data, recv[j], recv_bytes(j), CTR_STREAM_SYNC);
  } catch (const Error &e) {
    ex.note_failure(*c, e.code(), e.message());
  } catch (const std::exception &e) {
    ex.note_failure(*c, CTR_STATUS_COMM_ERROR, e.what());
  }
  const int64_t ns = ns_since(t0);
  ex.comm_ns_ += ns;
  if (c->axis_slot >= 0) ex.axis_ns_[static_cast<size_t>(c->axis_slot)] += ns;
}

void Executor::note_failure(const Collective &c, ctr_status code, const std::string &msg) {
  std::lock_guard<std::mutex> lock(err_mu_);
  err_code_ = code;
  err_msg_ = strformat("%s '%s': %s", c.node->op.c_str(), c.node->name.c_str(), msg.c_str());
  failed_.store(true, std::memory_order_release);
}

// A collective on a device communicator, issued on the calling thread: the
// communicator orders it after the kernels already queued on stream 0 (which
// wrote its inputs), so nothing is staged and compute goes on meanwhile.
void Executor::issue_device(Collective &c) {
  c.work = nullptr;
  // After a failure the communicator is broken: issue nothing more on it.
  if (failed_.load(std::memory_order_acquire)) return;
  c.issued = Clock::now();
  try {
    const CommIface *ci = c.comm.iface;
    const CollectiveName name(strformat("%s '%s'", c.node->op.c_str(), c.node->name.c_str()));
    if (c.src.size() > 1) {
      std::vector<CollDesc> d(c.src.size());
      for (size_t j = 0; j < d.size(); ++j) {
        d[j].kind = c.kind;
        d[j].send = c.src[j].data;
        d[j].recv = c.dst[j].data;
        d[j].count = c.count[j];
      }
      c.work = ci->batch(c.comm.ctx, d.data(), d.size(), c.dtype, c.reduce);
    } else {
      c.work = issue_one(c, c.src[0].data, c.dst[0].data);
    }
  } catch (const Error &e) {
    note_failure(c, e.code(), e.message());
  } catch (const std::exception &e) {
    note_failure(c, CTR_STATUS_COMM_ERROR, e.what());
  }
  if (exit_countdown_.load() > 0 && --exit_countdown_ == 0) _exit(87);
}

// The comm stream's part of a device collective: wait for it with the mesh's
// deadline, so that a record after it on the comm stream marks its completion.
void Executor::wait_device(void *user) {
  auto *c = static_cast<Collective *>(user);
  Executor &ex = *c->ex;
  CommWork *w = std::exchange(c->work, nullptr);
  if (!w) return;
  try {
    c->comm.iface->wait(c->comm.ctx, w, c->timeout_ms);
  } catch (const Error &e) {
    ex.note_failure(*c, e.code(), e.message());
  } catch (const std::exception &e) {
    ex.note_failure(*c, CTR_STATUS_COMM_ERROR, e.what());
  }
  const int64_t ns = ns_since(c->issued);
  ex.comm_ns_ += ns;
  if (c->axis_slot >= 0) ex.axis_ns_[static_cast<size_t>(c->axis_slot)] += ns;
}

// An expert exchange over the ep group (P ranks, this one q): experts are in P
// blocks of E/P. Row counts are read from the step's buffers (the comm stream
// runs after the kernels that wrote them); a dispatch first learns from every
// rank how many of its rows are coming (an all-to-all of counts), then moves
// the rows. Rows past the counted ones in an output are zeroed.
void Executor::run_exchange(Collective &c) {
  // On device memory every input is copied to the host first and every output
  // back after; the refs below then point at the host copies.
  std::vector<ctr_tensor_ref> ins = c.ins, outs = c.outs;
  if (staged_) {
    c.host_in.resize(ins.size());
    c.host_out.resize(outs.size());
    for (size_t i = 0; i < ins.size(); ++i) {
      void *h = c.host_in[i].get(be_, static_cast<size_t>(ins[i].bytes));
      be_.iface->copy_d2h(be_.ctx, h, ins[i].data, static_cast<size_t>(ins[i].bytes), CTR_STREAM_SYNC);
      ins[i].data = h;
    }
    for (size_t i = 0; i < outs.size(); ++i) {
      outs[i].data = c.host_out[i].get(be_, static_cast<size_t>(outs[i].bytes));
      std::memset(outs[i].data, 0, static_cast<size_t>(outs[i].bytes));
    }
  }
  exchange_rows(c, ins, outs);
  if (staged_)
    for (size_t i = 0; i < outs.size(); ++i)
      be_.iface->copy_h2d(be_.ctx, c.outs[i].data, outs[i].data, static_cast<size_t>(outs[i].bytes),
                          CTR_STREAM_SYNC);
}

void Executor::exchange_rows(Collective &c, const std::vector<ctr_tensor_ref> &ins,
                             const std::vector<ctr_tensor_ref> &outs) {
  const CommIface *ci = c.comm.iface;
  const size_t P = static_cast<size_t>(ci->size(c.comm.ctx));
  const ctr_tensor_ref &x = ins[0], &cnt = ins[1];
  const ctr_tensor_ref &y = outs[0];
  const size_t E = static_cast<size_t>(cnt.numel), El = E / P;
  const size_t row = static_cast<size_t>(x.shape[1]);  // elements per row
  const size_t esz = dtype_size(static_cast<ctr_dtype>(x.dtype));  // f32, or bf16 under precision bf16
  CTR_CHECK(y.dtype == x.dtype && esz > 0);
  const int32_t *counts = static_cast<const int32_t *>(cnt.data);
  const int32_t *seg = nullptr;
  std::vector<size_t> ones(P, El), blocks(P);
  for (size_t j = 0; j < P; ++j) blocks[j] = j * El;
  if (c.exchange == Collective::Exchange::Dispatch) {
    int32_t *received = static_cast<int32_t *>(outs[1].data);
    ci->wait(c.comm.ctx,
             ci->all_to_all_v(c.comm.ctx, counts, ones.data(), blocks.data(), received, ones.data(), blocks.data(), 4),
             c.timeout_ms);
    seg = received;
  } else {
    seg = static_cast<const int32_t *>(ins[2].data);
  }
  // Rows per peer: by destination block of the local counts, and by source of
  // the received segment counts.
  auto block_rows = [&](const int32_t *v, std::vector<size_t> &rows) {
    rows.assign(P, 0);
    for (size_t j = 0; j < P; ++j)
      for (size_t e = 0; e < El; ++e) {
        const int32_t n = v[j * El + e];
        CTR_REQUIRE(n >= 0, CTR_STATUS_COMM_ERROR, "expert exchange: negative row count %d", static_cast<int>(n));
        rows[j] += static_cast<size_t>(n);
      }
  };
  std::vector<size_t> local, remote;
  block_rows(counts, local);
  block_rows(seg, remote);
  const bool to_experts = c.exchange != Collective::Exchange::Combine;
  const std::vector<size_t> &send_rows = to_experts ? local : remote, &recv_rows = to_experts ? remote : local;
  std::vector<size_t> sc(P), sd(P), rc(P), rd(P);
  size_t so = 0, ro = 0;
  for (size_t j = 0; j < P; ++j) {
    sc[j] = send_rows[j] * row;
    sd[j] = so;
    so += sc[j];
    rc[j] = recv_rows[j] * row;
    rd[j] = ro;
    ro += rc[j];
  }
  CTR_REQUIRE(so <= static_cast<size_t>(x.numel) && ro <= static_cast<size_t>(y.numel), CTR_STATUS_COMM_ERROR,
              "expert exchange: row counts (%zu rows out, %zu in) exceed the buffers (%lld, %lld rows)", so / row,
              ro / row, static_cast<long long>(x.numel) / static_cast<long long>(row),
              static_cast<long long>(y.numel) / static_cast<long long>(row));
  ci->wait(c.comm.ctx, ci->all_to_all_v(c.comm.ctx, x.data, sc.data(), sd.data(), y.data, rc.data(), rd.data(), esz),
           c.timeout_ms);
  std::memset(static_cast<char *>(y.data) + ro * esz, 0, (static_cast<size_t>(y.numel) - ro) * esz);
}

void Executor::raise_if_failed() {
  if (!failed_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(err_mu_);
  fail(err_code_, err_msg_);
}

double Executor::take_comm_ms() { return static_cast<double>(comm_ns_.exchange(0)) / 1e6; }

std::vector<std::pair<std::string, double>> Executor::take_comm_ms_by_axis() {
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < axis_names_.size(); ++i)
    out.emplace_back(axis_names_[i], static_cast<double>(axis_ns_[i].exchange(0)) / 1e6);
  return out;
}

double Executor::take_exposed_ms() { return static_cast<double>(std::exchange(exposed_ns_, 0)) / 1e6; }

const char *Executor::phase_name(Phase phase) {
  switch (phase) {
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Weight: return "weight-gradient";
  }
  return "?";
}

void Executor::run(Phase phase, int chunk) {
  const int p = static_cast<int>(phase);
  std::span<const Instr> list = p == 0 ? prog_.forward : p == 1 ? prog_.backward : prog_.weight;
  const ctr_backend_iface *bi = be_.iface;
  void *ctx = be_.ctx;
  if (prog_.chunks() > 0) {
    CTR_CHECK(chunk >= 0 && chunk < prog_.chunks());
    const auto [first, end] = prog_.chunk_range[p][static_cast<size_t>(chunk)];
    list = list.subspan(first, end - first);
    // Each chunk's first run is its warm-up.
    if (chunk_runs_.empty()) chunk_runs_.assign(static_cast<size_t>(3 * prog_.chunks()), 0);
    counting_ = chunk_runs_[static_cast<size_t>(p * prog_.chunks() + chunk)]++ > 0;
  } else if (run_captured(phase, list)) {
    return;
  }
  issue(list, phase);
  const auto t0 = Clock::now();
  for (size_t s = 1; s < streams_.size(); ++s) bi->synchronize(ctx, streams_[s]);
  if (streams_.size() > 1) exposed_ns_ += ns_since(t0);
  check_device(-1, phase);
  raise_if_failed();
}

bool Executor::run_captured(Phase phase, std::span<const Instr> list) {
  const int p = static_cast<int>(phase);
  const ctr_backend_iface *bi = be_.iface;
  void *ctx = be_.ctx;
  const char *name = phase_name(phase);
  constexpr int kMaxRecaptures = 3;
  if (graphs_on_ && !why_not_[p].empty() && !said_[p]) {
    std::fprintf(stderr, "ctr: graphs: the %s phase is not captured: %s\n", name, why_not_[p].c_str());
    said_[p] = true;
  }
  // The first run of a phase is its warm-up, launched as it is: library
  // heuristics, lazy module loading and first-touch allocations happen there,
  // not inside a capture. Capture is from the second run on.
  const bool warm = runs_[p]++ > 0;
  counting_ = warm;  // kernel profiles leave out each phase's first run (first touches, library set-up)
  if (!(graphs_on_ && !profile_ && capturable_[p] && warm && recaptures_ <= kMaxRecaptures)) return false;
  if (graph_[p] < 0 && bi->capture_begin(ctx, 0) == 0) {
    issue(list, phase);
    graph_[p] = bi->capture_end(ctx, 0);
    if (graph_[p] < 0) {
      // Not replayable: nothing recorded ran; run it as it is, and stop trying.
      std::fprintf(stderr, "ctr: graphs: the %s phase is not captured: the backend could not capture it\n", name);
      recaptures_ = kMaxRecaptures + 1;
      issue(list, phase);
      return true;
    }
    ++captures_;
  }
  if (graph_[p] < 0) return false;
  // Launches inside the replay are not seen one by one: a fault found now is
  // named by the phase, not by whatever was launched last outside it.
  last_node_ = -1;
  bi->graph_launch(ctx, graph_[p], 0);
  ++graph_replays_;
  check_device(-1, phase, true);
  return true;
}

void Executor::check_device(int node, Phase phase, bool replay) const {
  if (!be_.iface->status) return;
  char msg[1024] = {0};
  if (be_.iface->status(be_.ctx, msg, sizeof msg) == 0) return;
  const char *ph = phase_name(phase);
  if (node >= 0) {
    const Node &n = g_.nodes[static_cast<size_t>(node)];
    fail(CTR_STATUS_DEVICE_ERROR, strformat("device '%s' failed launching op %s '%s' (%s): %s", be_.iface->name,
                                            n.op.c_str(), n.name.c_str(), ph, msg));
  }
  std::string after;
  if (replay) {
    after = strformat(" (found after replaying the %s phase as a captured graph; without graphs (step option "
                      "'graphs' 0) the op is named)",
                      ph);
  } else if (last_node_ >= 0) {
    const Node &n = g_.nodes[static_cast<size_t>(last_node_)];
    after = strformat(" (found in %s, after op %s '%s', the last one launched; a kernel fault is reported at the "
                      "kernel that caused it with CUDA_LAUNCH_BLOCKING=1)",
                      ph, n.op.c_str(), n.name.c_str());
  }
  fail(CTR_STATUS_DEVICE_ERROR, strformat("device '%s' failed: %s%s", be_.iface->name, msg, after.c_str()));
}

void Executor::issue(std::span<const Instr> list, Phase phase) {
  const ctr_backend_iface *bi = be_.iface;
  void *ctx = be_.ctx;
  const bool checked = bi->status != nullptr;
  for (const Instr &in : list) {
    const int stream = streams_[static_cast<size_t>(in.stream)];
    switch (in.kind) {
      case Instr::Kernel: {
        const Call &c = *calls_[static_cast<size_t>(in.node)];
        if (c.skip) break;
        if (profile_ && counting_) {
          if (kernel_us_.empty()) {
            kernel_us_.assign(g_.nodes.size(), 0.0);
            kernel_runs_.assign(g_.nodes.size(), 0);
          }
          bi->synchronize(ctx, stream);
          const auto t0 = Clock::now();
          bi->launch(ctx, c.fn, &c.args, stream);
          bi->synchronize(ctx, stream);
          kernel_us_[static_cast<size_t>(in.node)] += static_cast<double>(ns_since(t0)) / 1e3;
          ++kernel_runs_[static_cast<size_t>(in.node)];
          last_node_ = in.node;
          if (checked) check_device(in.node, phase);
          break;
        }
        bi->launch(ctx, c.fn, &c.args, stream);
        last_node_ = in.node;
        if (checked) check_device(in.node, phase);
        break;
      }
      case Instr::Collective: {
        Collective *c = colls_[static_cast<size_t>(in.node)].get();
        if (c->device) {
          issue_device(*c);
          bi->host_fn(ctx, stream, wait_device, c);
        } else {
          bi->host_fn(ctx, stream, run_collective, c);
        }
        break;
      }
      case Instr::Fill:
        bi->fill(ctx, static_cast<char *>(addr_[static_cast<size_t>(in.tensor)]) + in.offset, 0,
                 static_cast<size_t>(in.bytes), stream);
        break;
      case Instr::Record: bi->record_event(ctx, events_[static_cast<size_t>(in.event)], stream); break;
      case Instr::Wait:
        if (in.stream == 0) {
          const auto t0 = Clock::now();
          bi->wait_event(ctx, events_[static_cast<size_t>(in.event)], stream);
          exposed_ns_ += ns_since(t0);
          if (checked) check_device(-1, phase);
          raise_if_failed();
        } else {
          bi->wait_event(ctx, events_[static_cast<size_t>(in.event)], stream);
        }
        break;
    }
  }
}

}  // namespace ctr
