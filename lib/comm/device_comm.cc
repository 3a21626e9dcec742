// Device communicators over a backend plugin's C table (see device_comm.h).
//
// The table's work handles become CommWork handles as they are; every failure
// of the table (a NULL work, a non-zero result) becomes a ctr::Error carrying
// the plugin's message, which names the collective and the library's error.

#include "comm/device_comm.h"

#include <mutex>

#include "core/status.h"

namespace ctr {
namespace {

constexpr size_t kErrSize = 1024;

struct DeviceComm {
  const ctr_device_comm_iface *di = nullptr;
  Backend be;
  ctr_device_comm *dc = nullptr;
  Store *store = nullptr;
  std::string key;
  std::vector<int> members;  // global ranks, in group order
  int rank = 0;              // index of this process in members
  int64_t timeout_ms = 60000;
  void *scratch = nullptr;   // device word for barrier
  std::mutex mu;
  std::map<std::vector<int>, int> splits;  // member list -> splits made of it
};

DeviceComm &D(void *ctx) { return *static_cast<DeviceComm *>(ctx); }

std::string group_text(const std::vector<int> &members) {
  std::string s;
  for (int r : members) s += (s.empty() ? "" : ",") + std::to_string(r);
  return s;
}

[[noreturn]] void fail_comm(const DeviceComm &d, int rc, const char *err) {
  fail(rc == CTR_DEVICE_COMM_TIMEOUT ? CTR_STATUS_TIMEOUT : CTR_STATUS_COMM_ERROR,
       strformat("%s (%s communicator of global ranks %s)", err[0] ? err : "failed", d.di->name,
                 group_text(d.members).c_str()));
}

CommWork *checked(const DeviceComm &d, ctr_device_work *w, const char *err) {
  if (!w) fail_comm(d, CTR_DEVICE_COMM_FAILED, err);
  return reinterpret_cast<CommWork *>(w);
}

std::string hex(const char *p, size_t n) {
  static const char *digits = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[(static_cast<unsigned char>(p[i]) >> 4) & 15];
    s += digits[static_cast<unsigned char>(p[i]) & 15];
  }
  return s;
}

bool unhex(const std::string &s, std::vector<char> *out) {
  if (s.size() % 2) return false;
  auto val = [](char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
  };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = val(s[i]), lo = val(s[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<char>(hi * 16 + lo));
  }
  return true;
}

int dc_rank(void *ctx) { return D(ctx).rank; }
int dc_size(void *ctx) { return static_cast<int>(D(ctx).members.size()); }
int dc_global_rank(void *ctx, int i) { return D(ctx).members[static_cast<size_t>(i)]; }

CommWork *dc_all_gather(void *ctx, const void *send, void *recv, size_t bytes) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d, d.di->all_gather(d.dc, send, recv, bytes, err, sizeof err), err);
}

CommWork *dc_reduce_scatter(void *ctx, const void *send, void *recv, size_t count, ctr_dtype dtype, ReduceOp op) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d, d.di->reduce_scatter(d.dc, send, recv, count, dtype, static_cast<int32_t>(op), err, sizeof err),
                 err);
}

CommWork *dc_all_reduce(void *ctx, const void *send, void *recv, size_t count, ctr_dtype dtype, ReduceOp op) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d, d.di->all_reduce(d.dc, send, recv, count, dtype, static_cast<int32_t>(op), err, sizeof err),
                 err);
}

CommWork *dc_all_to_all_v(void *ctx, const void *send, const size_t *send_counts, const size_t *send_displs,
                          void *recv, const size_t *recv_counts, const size_t *recv_displs, size_t elem_size) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d,
                 d.di->all_to_all_v(d.dc, send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_size,
                                    err, sizeof err),
                 err);
}

CommWork *dc_broadcast(void *ctx, void *buf, size_t bytes, int root) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d, d.di->broadcast(d.dc, buf, bytes, root, err, sizeof err), err);
}

CommWork *dc_barrier(void *ctx) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  return checked(d, d.di->all_reduce(d.dc, d.scratch, d.scratch, 1, CTR_DTYPE_I32, CTR_DEVICE_REDUCE_SUM, err,
                                     sizeof err),
                 err);
}

CommWork *dc_batch(void *ctx, const CollDesc *descs, size_t n, ctr_dtype dtype, ReduceOp op) {
  DeviceComm &d = D(ctx);
  std::vector<ctr_device_coll> colls(n);
  for (size_t i = 0; i < n; ++i) {
    colls[i].kind = descs[i].kind == CollDesc::AllGather       ? CTR_DEVICE_COLL_ALL_GATHER
                    : descs[i].kind == CollDesc::ReduceScatter ? CTR_DEVICE_COLL_REDUCE_SCATTER
                                                               : CTR_DEVICE_COLL_ALL_REDUCE;
    colls[i].send = descs[i].send;
    colls[i].recv = descs[i].recv;
    colls[i].count = descs[i].count;
  }
  char err[kErrSize] = {0};
  return checked(d, d.di->batch(d.dc, colls.data(), n, dtype, static_cast<int32_t>(op), err, sizeof err), err);
}

void dc_wait(void *ctx, CommWork *work, int64_t timeout_ms) {
  DeviceComm &d = D(ctx);
  char err[kErrSize] = {0};
  const int rc = d.di->wait(d.dc, reinterpret_cast<ctr_device_work *>(work),
                            timeout_ms < 0 ? d.timeout_ms : timeout_ms, err, sizeof err);
  if (rc != CTR_DEVICE_COMM_OK) fail_comm(d, rc, err);
}

bool dc_test(void *ctx, CommWork *work) {
  DeviceComm &d = D(ctx);
  return d.di->test(d.dc, reinterpret_cast<ctr_device_work *>(work)) == 1;
}

Comm dc_split(void *ctx, const std::vector<int> &members) {
  DeviceComm &d = D(ctx);
  std::vector<int> globals;
  for (int i : members) {
    CTR_REQUIRE(i >= 0 && static_cast<size_t>(i) < d.members.size(), CTR_STATUS_INVALID_ARGUMENT,
                "%s split: member %d is not in the group of %zu", d.di->name, i, d.members.size());
    globals.push_back(d.members[static_cast<size_t>(i)]);
  }
  int nth = 0;
  {
    // Every listed member has made the same splits of this list before, so the
    // count names this one alike on all of them.
    std::lock_guard<std::mutex> lock(d.mu);
    nth = d.splits[members]++;
  }
  const std::string key = strformat("%s/split%d/%s", d.key.c_str(), nth, group_text(globals).c_str());
  return device_comm_create(d.di, d.be, *d.store, key, globals, d.members[static_cast<size_t>(d.rank)],
                            d.timeout_ms);
}

void dc_destroy(void *ctx) {
  auto *d = static_cast<DeviceComm *>(ctx);
  d->di->destroy(d->dc);
  if (d->scratch) d->be.iface->free(d->be.ctx, d->scratch);
  delete d;
}

// The plugin's device communicator ABI has no point-to-point operations yet.
[[noreturn]] void dc_no_point_to_point(const DeviceComm &d, const char *what) {
  fail(CTR_STATUS_UNSUPPORTED,
       strformat("%s: %s between two ranks is not available on device communicators yet", d.di->name, what));
}

CommWork *dc_send(void *ctx, const void *, size_t, int) { dc_no_point_to_point(D(ctx), "send"); }
CommWork *dc_recv(void *ctx, void *, size_t, int) { dc_no_point_to_point(D(ctx), "recv"); }

const CommIface kDeviceIface = {
    "nccl",         dc_rank,  dc_size, dc_global_rank, dc_all_gather, dc_reduce_scatter, dc_all_reduce,
    dc_all_to_all_v, dc_broadcast, dc_barrier, dc_batch, dc_wait,        dc_test,           dc_split,
    dc_destroy,     nullptr,  dc_send, dc_recv,
};

}  // namespace

const ctr_device_comm_iface *device_comm_iface(const Backend &be, const std::string &transport) {
  CTR_REQUIRE(be.device_comm_init != nullptr, CTR_STATUS_UNSUPPORTED,
              "transport '%s': the %s backend has no device communicators (the CUDA backend built with "
              "-Dnccl=enabled has them)",
              transport.c_str(), be.iface->name);
  char err[kErrSize] = {0};
  const ctr_device_comm_iface *di = be.device_comm_init(CTR_DEVICE_COMM_ABI, err, sizeof err);
  CTR_REQUIRE(di != nullptr, CTR_STATUS_UNSUPPORTED, "%s", err[0] ? err : "the plugin gave no reason");
  CTR_REQUIRE(di->abi == CTR_DEVICE_COMM_ABI && di->size >= sizeof(ctr_device_comm_iface), CTR_STATUS_UNSUPPORTED,
              "transport '%s': the %s plugin speaks device communicator ABI %u (table of %u bytes); this libctr "
              "needs ABI %d (%zu bytes)",
              transport.c_str(), be.iface->name, di->abi, di->size, CTR_DEVICE_COMM_ABI,
              sizeof(ctr_device_comm_iface));
  CTR_REQUIRE(transport == di->name, CTR_STATUS_UNSUPPORTED,
              "transport '%s': the %s backend's device communicators are '%s'", transport.c_str(), be.iface->name,
              di->name);
  return di;
}

Comm device_comm_create(const ctr_device_comm_iface *di, const Backend &be, Store &store, const std::string &key,
                        const std::vector<int> &members, int global_rank, int64_t timeout_ms) {
  int rank = -1;
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i] == global_rank) rank = static_cast<int>(i);
  CTR_CHECK(rank >= 0);
  const std::string group = group_text(members);
  char err[kErrSize] = {0};
  std::vector<char> id;
  if (rank == 0) {
    // A failure is published too, so the other members fail with its reason
    // at once instead of waiting out the timeout.
    char buf[CTR_DEVICE_COMM_ID_MAX];
    size_t len = sizeof buf;
    if (di->unique_id(be.ctx, buf, &len, err, sizeof err) != CTR_DEVICE_COMM_OK) {
      store.set(key, std::string("!") + err);
      fail(CTR_STATUS_COMM_ERROR, strformat("%s communicator of global ranks %s: %s", di->name, group.c_str(), err));
    }
    id.assign(buf, buf + len);
    store.set(key, hex(buf, len));
  } else {
    const std::string v = store.get(key, timeout_ms);
    CTR_REQUIRE(v.empty() || v[0] != '!', CTR_STATUS_COMM_ERROR, "%s communicator of global ranks %s: rank %d: %s",
                di->name, group.c_str(), members[0], v.c_str() + 1);
    CTR_REQUIRE(unhex(v, &id) && id.size() <= CTR_DEVICE_COMM_ID_MAX, CTR_STATUS_COMM_ERROR,
                "%s communicator of global ranks %s: the id under '%s' is malformed", di->name, group.c_str(),
                key.c_str());
  }
  auto d = std::make_unique<DeviceComm>();
  d->di = di;
  d->be = be;
  d->store = &store;
  d->key = key;
  d->members = members;
  d->rank = rank;
  d->timeout_ms = timeout_ms;
  d->scratch = be.iface->alloc(be.ctx, sizeof(int32_t));
  CTR_REQUIRE(d->scratch != nullptr, CTR_STATUS_OUT_OF_MEMORY, "%s communicator: no device memory for its barrier",
              di->name);
  const int rc = di->comm_create(be.ctx, id.data(), id.size(), rank, static_cast<int>(members.size()), timeout_ms,
                                 &d->dc, err, sizeof err);
  if (rc != CTR_DEVICE_COMM_OK) {
    be.iface->free(be.ctx, d->scratch);
    fail(rc == CTR_DEVICE_COMM_TIMEOUT ? CTR_STATUS_TIMEOUT : CTR_STATUS_COMM_ERROR,
         strformat("%s communicator of global ranks %s: %s", di->name, group.c_str(), err));
  }
  return Comm{&kDeviceIface, d.release()};
}

CommSet::~CommSet() {
  for (auto &kv : comms_) {
    try {
      kv.second.iface->destroy(kv.second.ctx);
    } catch (...) {
    }
  }
}

const Comm *CommSet::find(const std::string &axis) const {
  auto it = comms_.find(axis);
  return it == comms_.end() ? nullptr : &it->second;
}

}  // namespace ctr
