// The mesh: axis arithmetic and the communicators of every axis (see mesh.h).

#include "runtime/mesh.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "passes/passes.h"

namespace ctr {

namespace {
int64_t heartbeat_ms(int64_t timeout_ms) { return std::clamp<int64_t>(timeout_ms / 8, 50, 5000); }
}  // namespace

Mesh::~Mesh() {
  if (heartbeat_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(hb_mu_);
      hb_stop_ = true;
    }
    hb_cv_.notify_all();
    heartbeat_.join();
  }
  // Destructors are noexcept: a failure while tearing a communicator down (a
  // peer already gone) must not end the host process.
  auto destroy = [](Comm &c) {
    if (!c) return;
    try {
      c.iface->destroy(c.ctx);
    } catch (...) {
    }
    c = Comm{};
  };
  if (failed_ && store) store->abandon();
  // A job that ends well leaves its record too, for a person to see what its
  // collectives did (which path, how long).
  bool published;
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    published = published_;
  }
  if (!published && !flight_path().empty() && world_comm && world_comm.iface->flight) {
    try {
      write_flight(world_comm.iface->flight(world_comm.ctx));
    } catch (...) {
    }
  }
  for (auto &kv : axis_comm) destroy(kv.second);
  destroy(world_comm);
}

int Mesh::axis_size(const std::string &name) const {
  for (const auto &a : axes)
    if (a.first == name) return a.second;
  return 1;
}

int Mesh::axis_index(const std::string &name) const { return rank_index(rank, name); }

int Mesh::rank_index(int r, const std::string &name) const {
  int stride = 1;
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
    if (it->first == name) return (r / stride) % it->second;
    stride *= it->second;
  }
  return 0;
}

int Mesh::data_rank() const {
  int r = 0;
  for (const auto &a : axes)
    if (a.first != "tp" && a.first != "cp" && a.first != "pp") r = r * a.second + axis_index(a.first);
  return r;
}

int Mesh::data_size() const { return world / (axis_size("tp") * axis_size("cp") * axis_size("pp")); }

std::vector<int> Mesh::axis_group(const std::string &name) const {
  int stride = 1, size = 1;
  for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
    if (it->first == name) {
      size = it->second;
      break;
    }
    stride *= it->second;
  }
  int base = rank - axis_index(name) * stride;
  std::vector<int> out;
  for (int i = 0; i < size; ++i) out.push_back(base + i * stride);
  return out;
}

const Comm &Mesh::comm(const std::string &axis) const {
  if (axis == "world") return world_comm;
  auto it = axis_comm.find(axis);
  CTR_REQUIRE(it != axis_comm.end() && it->second, CTR_STATUS_INVALID_STATE,
              "the mesh has no communicator for axis '%s'", axis.c_str());
  return it->second;
}

MeshPlacement Mesh::placement() const {
  MeshPlacement p;
  for (const auto &a : axes) p.axes.push_back({a.first, a.second, axis_index(a.first)});
  return p;
}

bool Mesh::any_rank(bool flag) const {
  if (world <= 1) return flag;
  int32_t v = flag ? 1 : 0;
  comm_wait(world_comm, world_comm.iface->all_reduce(world_comm.ctx, &v, &v, 1, CTR_DTYPE_I32, ReduceOp::Max),
            timeout_ms);
  return v != 0;
}

std::string Mesh::first_error(const std::string &err) const {
  if (world <= 1) return err;
  int32_t who = err.empty() ? world : rank;
  comm_wait(world_comm,
            world_comm.iface->all_reduce(world_comm.ctx, &who, &who, 1, CTR_DTYPE_I32, ReduceOp::Min),
            timeout_ms);
  if (who >= world) return "";
  // The message, cut to a bound every rank knows, from the rank that failed.
  constexpr size_t kMaxMessage = 4096;
  std::vector<char> buf(4 + kMaxMessage, '\0');
  if (who == rank) {
    const auto n = static_cast<uint32_t>(std::min(err.size(), kMaxMessage));
    std::memcpy(buf.data(), &n, 4);
    std::memcpy(buf.data() + 4, err.data(), n);
  }
  comm_wait(world_comm, world_comm.iface->broadcast(world_comm.ctx, buf.data(), buf.size(), who),
            timeout_ms);
  uint32_t n = 0;
  std::memcpy(&n, buf.data(), 4);
  std::string msg(buf.data() + 4, std::min<size_t>(n, kMaxMessage));
  return who == rank ? msg : strformat("rank %d: %s", who, msg.c_str());
}

void Mesh::connect(const RendezvousConfig &rc) {
  store = store_join(rc);
  world_comm = comm_create(host_transport(transport), *store, rank, world, timeout_ms);
  for (const auto &a : axes) axis_comm[a.first] = world_comm.iface->split(world_comm.ctx, axis_group(a.first));
  // The ranks of this rank's pipeline stage: every rank with its pp index.
  if (axis_size("pp") > 1 && world > axis_size("pp")) {
    std::vector<int> stage;
    for (int r = 0; r < world; ++r)
      if (rank_index(r, "pp") == axis_index("pp")) stage.push_back(r);
    axis_comm["stage"] = world_comm.iface->split(world_comm.ctx, stage);
  }
  // The first heartbeat goes before the mesh is handed out, so rank 0 watches this
  // rank from the moment its host can use the mesh.
  async_error_ = store->heartbeat();
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

std::unique_ptr<CommSet> Mesh::device_comms(const Backend &be) const {
  if (transport != "nccl" || world <= 1) return nullptr;
  // Every rank learns whether all can: one rank without NCCL must not leave
  // the others waiting for it in the store.
  std::string why;
  const ctr_device_comm_iface *di = nullptr;
  try {
    di = device_comm_iface(be, transport);
  } catch (const Error &e) {
    why = e.message();
  }
  why = first_error(why);
  CTR_REQUIRE(why.empty(), CTR_STATUS_UNSUPPORTED, "mesh transport 'nccl': %s", why.c_str());
  // Steps are created in the same order on every rank, so the count names
  // this creation alike everywhere.
  const uint64_t generation = device_generation_++;
  auto set = std::make_unique<CommSet>();
  for (const auto &a : axes) {
    const std::vector<int> group = axis_group(a.first);
    std::string members;
    for (int r : group) members += (members.empty() ? "" : ",") + std::to_string(r);
    const std::string key =
        strformat("%s/%llu/%s/%s", transport.c_str(), static_cast<unsigned long long>(generation), a.first.c_str(),
                  members.c_str());
    set->add(a.first, device_comm_create(di, be, *store, key, group, rank, timeout_ms));
  }
  return set;
}

// Liveness: a heartbeat to rank 0 eight times per timeout. The reply carries the
// job's failure once rank 0 knows one; this rank then keeps it for
// async_error() and publishes its flight recorder for rank 0's forensics.
void Mesh::heartbeat_loop() {
  const auto interval = std::chrono::milliseconds(heartbeat_ms(timeout_ms));
  std::unique_lock<std::mutex> lock(hb_mu_);
  if (!async_error_.empty()) return;
  hb_cv_.wait_for(lock, interval, [this] { return hb_stop_; });
  while (!hb_stop_) {
    lock.unlock();
    std::string failure;
    try {
      failure = store->heartbeat();
    } catch (const Error &e) {
      failure = "the rendezvous store (rank 0) cannot be reached: " + e.message();
    }
    if (!failure.empty()) {
      try {
        publish_flight();
      } catch (const Error &) {
      }
    }
    lock.lock();
    if (!failure.empty() && async_error_.empty()) async_error_ = failure;
    if (!failure.empty()) break;  // nothing more to learn; the job is ending
    hb_cv_.wait_for(lock, interval, [this] { return hb_stop_; });
  }
}

ctr_status Mesh::async_error(std::string *message) const {
  std::lock_guard<std::mutex> lock(hb_mu_);
  if (message) *message = async_error_;
  return async_error_.empty() ? CTR_STATUS_OK : CTR_STATUS_COMM_ERROR;
}

void Mesh::publish_flight() const {
  {
    std::lock_guard<std::mutex> lock(hb_mu_);
    if (published_) return;
    published_ = true;
  }
  const std::string record =
      world_comm.iface->flight ? world_comm.iface->flight(world_comm.ctx) : std::string("[]");
  write_flight(record);
  store->set(strformat("ctr/flight/%d", rank), record);
}

// The whole record, for a person: CTR_FLIGHT_DIR/flight-rank<R>.json ("" when
// CTR_FLIGHT_DIR is unset).
std::string Mesh::flight_path() const {
  const char *dir = std::getenv("CTR_FLIGHT_DIR");
  return dir && *dir ? strformat("%s/flight-rank%05d.json", dir, rank) : std::string();
}

void Mesh::write_flight(const std::string &record) const {
  const std::string path = flight_path();
  if (path.empty()) return;
  if (std::FILE *f = std::fopen(path.c_str(), "w")) {
    std::fwrite(record.data(), 1, record.size(), f);
    std::fclose(f);
  }
}

namespace {

// What the ranks' flight records say together. For every communicator, the
// newest collective any member issued; a member whose last one on it is older
// never issued it, and one whose last is still in flight never finished it.
std::string compare_records(const std::map<int, nlohmann::json> &records, int world) {
  using nlohmann::json;
  struct Last {
    uint32_t seq = 0;
    std::string what, state;
  };
  std::map<std::string, std::map<int, Last>> last;  // comm -> rank -> its newest entry
  std::map<std::string, std::map<uint32_t, std::string>> named;  // comm -> seq -> what
  for (const auto &[r, rec] : records) {
    if (!rec.is_array()) continue;
    for (const json &e : rec) {
      if (!e.is_object() || !e.contains("comm") || !e.contains("seq")) continue;
      const std::string comm = e["comm"].get<std::string>();
      Last &l = last[comm][r];
      const auto seq = e["seq"].get<uint32_t>();
      named[comm][seq] = e.value("what", "");
      if (seq >= l.seq) l = {seq, e.value("what", ""), e.value("state", "")};
    }
  }
  std::string out;
  auto add = [&out](const std::string &s) { out += (out.empty() ? "" : "; ") + s; };
  for (const auto &[comm, ranks] : last) {
    const Last *newest = nullptr;
    for (const auto &[r, l] : ranks)
      if (!newest || l.seq > newest->seq) newest = &l;
    for (const auto &[r, l] : ranks) {
      if (l.seq < newest->seq) {
        // The first collective it did not issue, as the others recorded it.
        const auto it = named[comm].find(l.seq + 1);
        const uint32_t seq = it != named[comm].end() ? l.seq + 1 : newest->seq;
        const std::string &what = it != named[comm].end() ? it->second : newest->what;
        add(strformat("rank %d never issued #%u %s on %s (its last there: #%u %s)", r, seq,
                      what.c_str(), comm.c_str(), l.seq, l.what.c_str()));
      }
      else if (l.state != "done")
        add(strformat("rank %d was waiting in #%u %s on %s", r, l.seq, l.what.c_str(), comm.c_str()));
    }
  }
  std::vector<int> silent;
  for (int r = 0; r < world; ++r)
    if (!records.count(r)) silent.push_back(r);
  if (!silent.empty()) {
    std::string list;
    for (int r : silent) list += (list.empty() ? "" : ", ") + std::to_string(r);
    add(strformat("no record from rank%s %s (dead, stopped or hung)", silent.size() > 1 ? "s" : "",
                  list.c_str()));
  }
  return out;
}

}  // namespace

std::string Mesh::forensics(const std::string &failure) const {
  if (world <= 1 || !store) return "";
  try {
    store->report_failure(failure);
    publish_flight();
  } catch (const Error &) {
    return "";  // rank 0's store is gone: nothing to compare with
  }
  // The others publish theirs when their heartbeat brings them the failure,
  // within an interval; a rank that sends none by then is named as such.
  const int64_t budget = heartbeat_ms(timeout_ms) + std::clamp<int64_t>(timeout_ms / 16, 50, 500);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(budget);
  std::map<int, nlohmann::json> records;
  for (int r = 0; r < world; ++r) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    try {
      records[r] = nlohmann::json::parse(store->get(strformat("ctr/flight/%d", r), std::max<int64_t>(left, 1)));
    } catch (const std::exception &) {
    }
  }
  return compare_records(records, world);
}

}  // namespace ctr
