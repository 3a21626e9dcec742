// The training step: compile once, then run the lowered program every step.
//
// Creation reads the options (each pass reads its own, the optimizer its own),
// runs the pass manager's pipeline, makes the few allocations the plan asks for
// on the step's backend (arena, parameters, gradients laid out like the
// parameters, inputs, constants, optimizer state) and hands every tensor's
// address to the executor, which resolves each instruction once. A step then
// only rebinds the inputs of each micro-batch.
//
// A step: for each micro-batch, forward then backward (the loss gradient seed is
// 1/micro_batches, so gradients come out averaged) and, with several
// micro-batches, one accumulation over the flat gradient buffer; then one
// global norm, clipping, and one fused AdamW pass.

#include "runtime/step.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <set>
#include <thread>
#include <nlohmann/json.hpp>

#include "core/options.h"
#include "core/rng.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "cpu/kernels.h"
#include "graph/ops.h"
#include "plan/plan.h"
#include "runtime/executor.h"
#include "runtime/mesh.h"

namespace ctr {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void *must_alloc(const Backend &be, int64_t bytes, const char *what) {
  void *p = be.iface->alloc(be.ctx, static_cast<size_t>(bytes));
  if (!p)
    fail(CTR_STATUS_OUT_OF_MEMORY,
         strformat("cannot allocate %lld bytes for %s", static_cast<long long>(bytes), what));
  return p;
}

std::string options_json(const ctr_options *options) {
  if (!options) return "";
  nlohmann::json js = nlohmann::json::object();
  for (const auto &kv : options->values) {
    if (kv.second.kind == ctr_options::Value::Int) js[kv.first] = kv.second.i;
    else if (kv.second.kind == ctr_options::Value::Float) js[kv.first] = kv.second.f;
    else js[kv.first] = kv.second.s;
  }
  return js.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The ids tensor t may hold: the intersection of the ranges [lo, hi) that its
// readers accept (each op's id rule), followed through the ops that only move
// values (slice, cat, reshape, transpose), so ids cut or joined before an
// embedding are checked as if it read them directly. Leaves lo > hi when no
// reader has a rule.
void id_range_of(const Graph &g, int t, int64_t *lo, int64_t *hi) {
  std::vector<bool> holds(g.tensors.size(), false);
  holds[static_cast<size_t>(t)] = true;
  for (int ni = 0; ni < g.num_forward; ++ni) {
    const Node &n = g.nodes[static_cast<size_t>(ni)];
    const OpDef *def = find_op(n.op);
    bool reads = false;
    for (size_t k = 0; k < n.inputs.size(); ++k) {
      if (!holds[static_cast<size_t>(n.inputs[k])]) continue;
      reads = true;
      int64_t l = 0, h = 0;
      if (!def->id_range || !def->id_range(g, n, static_cast<int>(k), &l, &h)) continue;
      if (*lo > *hi) {
        *lo = l;
        *hi = h;
      } else {
        *lo = std::max(*lo, l);
        *hi = std::min(*hi, h);
      }
    }
    if (reads && def->moves_values)
      for (int o : n.outputs) holds[static_cast<size_t>(o)] = true;
  }
}

}  // namespace

Step::Step(const Mesh &mesh, const Graph &graph, const ctr_options *options) : mesh_(mesh), g_(graph) {
  OptionReader r(options, "ctr_step_create");
  CTR_REQUIRE(r.has("batch"), CTR_STATUS_INVALID_OPTION,
              "ctr_step_create: option 'batch' is required (the micro-batch size)");
  copt_ = read_compile_options(r);
  copt_.mesh = mesh.placement();
  oc_ = read_optimizer_options(r);
  const uint64_t seed = static_cast<uint64_t>(r.get_int("seed", 0, 0));
  const std::string keep = r.get_string("keep", "");
  async_save_ = r.get_int("async_save", 0, 0, 1) != 0;
  async_save_lag_ = r.get_int("async_save_lag", 2, 1, 1 << 20);
  // Replay phases as captured graphs where the backend can (CUDA graphs).
  const bool graphs = r.get_int("graphs", 1, 0, 1) != 0;
  profile_kernels_ = r.get_int("profile_kernels", 0, 0, 1) != 0;
  // Refuse a plan larger than the machine before touching any of it: allocation
  // may succeed lazily and the first write would then end the process.
  const int64_t phys = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  const int64_t memory_limit = r.get_int("memory_limit", phys > 0 ? phys : (int64_t{1} << 40), 1);
  r.finish();
  options_json_ = options_json(options);

  // CTR_FAULT_INJECT="exit_at_step:N:rank:R" or "hang_at_step:N:rank:R" makes
  // rank R exit (or block forever) when it starts step N; "kill_at_step:..."
  // kills it with SIGKILL; "nan_at_step:..." makes step N's loss NaN (once per
  // process), for the non-finite handling; "exitcomm_at_step:..."
  // makes it exit in step N with a collective in flight. The failure tests use
  // them to check that the other ranks end the job naming that rank. Only the
  // first attempt of a job is affected (CTR_RESTART_COUNT unset or 0), so that a
  // restarted job runs through.
  const char *restart = std::getenv("CTR_RESTART_COUNT");
  const bool first_attempt = restart == nullptr || std::strcmp(restart, "0") == 0;
  if (const char *f = std::getenv("CTR_FAULT_INJECT"); f && first_attempt) {
    // "slow:MS:rank:R": rank R spends MS more milliseconds of compute in every
    // step (a straggler, for the tests that must name it).
    long long ms = 0, sr = 0;
    if (std::sscanf(f, "slow:%lld:rank:%lld", &ms, &sr) == 2 && sr == mesh.rank && ms > 0) fault_slow_ms_ = ms;
    long long n = 0, fr = 0;
    char kind[16] = {0};
    if (std::sscanf(f, "%15[a-z]_at_step:%lld:rank:%lld", kind, &n, &fr) == 3 && fr == mesh.rank &&
        (std::strcmp(kind, "exit") == 0 || std::strcmp(kind, "hang") == 0 ||
         std::strcmp(kind, "exitcomm") == 0 || std::strcmp(kind, "kill") == 0 ||
         std::strcmp(kind, "nan") == 0)) {
      fault_step_ = n;
      fault_hang_ = std::strcmp(kind, "hang") == 0;
      fault_in_comm_ = std::strcmp(kind, "exitcomm") == 0;
      fault_kill_ = std::strcmp(kind, "kill") == 0;
      fault_nan_ = std::strcmp(kind, "nan") == 0;
    }
  }
  std::vector<std::string> keep_names;
  for (size_t pos = 0; pos < keep.size();) {
    size_t comma = keep.find(',', pos);
    std::string name = keep.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? keep.size() : comma + 1;
    if (name.empty()) continue;
    int t = g_.find_tensor(name);
    CTR_REQUIRE(t >= 0 && g_.tensors[t].role == Role::Activation && g_.tensors[t].dtype == CTR_DTYPE_F32,
                CTR_STATUS_INVALID_OPTION,
                "ctr_step_create: option 'keep': '%s' is not an f32 activation of the graph", name.c_str());
    g_.tensors[t].keep = true;
    kept_.push_back(t);
    keep_names.push_back(name);
  }

  find_moe_layers();
  backend_ = create_backend(mesh.device);
  be_ = *backend_;
  // Graph collectives then run on device memory, without staging.
  device_comms_ = mesh.device_comms(be_);
  {
    const OpDef *cast = find_op("cast");
    if (copt_.precision == "bf16" && !(cast && backend_has_kernel(be_, cast->id))) {
      // The CPU backend says why (the CPU's features); any other lacks bf16 kernels.
      const std::string why = std::strcmp(be_.iface->name, "cpu") == 0
                                  ? cpu::bf16_unavailable()
                                  : strformat("the %s backend computes in fp32 only", be_.iface->name);
      fail(CTR_STATUS_UNSUPPORTED, strformat("ctr_step_create: option 'precision' bf16: %s (use precision fp32 or "
                                             "auto)",
                                             why.c_str()));
    }
    PassContext ctx(g_, copt_, [this](OpId op) { return backend_has_kernel(be_, op); });
    ctx.backend_flags = be_.iface->flags;
    run_passes(ctx);
    prog_ = std::move(ctx.program);
    plan_ = std::move(ctx.plan);
    pipeline_ = std::move(ctx.pipeline);
    stage_ = static_cast<int>(copt_.mesh.index("pp"));
    cut_ = std::move(ctx.stage_cut);
    place_moe_layers();
    // Each micro-batch in flight on this stage (forward run, its last task not
    // yet) keeps its own copy of the arena's held part (MemoryPlan::held_bytes).
    slots_in_flight_ = std::max<int64_t>(1, pipeline_.in_flight[static_cast<size_t>(stage_)]);
    if (cut_.stages > 1) {
      // The stage cut renumbered the tensors: each kept one is found again by
      // name among this stage's activations; one computed on another stage is
      // read on a rank of that stage.
      std::vector<int> here;
      for (const std::string &name : keep_names) {
        const int t = g_.find_tensor(name);
        if (t >= 0 && g_.tensors[t].role == Role::Activation) {
          here.push_back(t);
          continue;
        }
        auto on = cut_.kept_on.find(name);
        kept_elsewhere_[name] = on == cut_.kept_on.end() ? -1 : on->second;
      }
      kept_ = std::move(here);
    }
    passes_run_ = std::move(ctx.ran);
  }

  // Seed of the backward pass: averaged over micro-batches.
  // (A pipeline stage before the last has no loss: its seeds are the
  // gradients later stages send, averaged there.)
  const int seed_t = g_.loss_seed;
  CTR_CHECK(seed_t >= 0 || cut_.stages > 1);
  if (seed_t >= 0) {
    CTR_CHECK(g_.tensors[seed_t].data.size() == 4);
    const float inv = 1.0f / static_cast<float>(copt_.micro_batches);
    std::memcpy(g_.tensors[seed_t].data.data(), &inv, 4);
  }

  {
    const int64_t opt = plan_.param_bytes * (copt_.micro_batches > 1 ? 3 : 2);
    const int64_t arena = plan_.arena_for(slots_in_flight_);
    const int64_t total = arena + 2 * plan_.param_bytes + plan_.input_bytes + plan_.const_bytes + opt;
    CTR_REQUIRE(total <= memory_limit, CTR_STATUS_OUT_OF_MEMORY,
                "ctr_step_create: the plan needs %.2f GiB (activations %.2f, parameters %.2f and as much for "
                "gradients, optimizer %.2f), more than the memory limit of %.2f GiB (option 'memory_limit')",
                total / 1073741824.0, arena / 1073741824.0, plan_.param_bytes / 1073741824.0,
                opt / 1073741824.0, memory_limit / 1073741824.0);
  }
  // A failure from here to the end of the constructor frees what was allocated
  // (the destructor does not run for an object never constructed).
  struct FreeOnThrow {
    Step *s;
    bool armed = true;
    ~FreeOnThrow() {
      if (armed) s->free_buffers();
    }
  } free_on_throw{this};
  arena_ = must_alloc(be_, plan_.arena_for(slots_in_flight_), "the activation arena");
  params_ = must_alloc(be_, plan_.param_bytes, "parameters");
  grads_ = must_alloc(be_, plan_.param_bytes, "gradients");
  inputs_ = must_alloc(be_, plan_.input_bytes, "inputs");
  consts_ = must_alloc(be_, plan_.const_bytes, "constants");

  std::vector<void *> addr(g_.tensors.size(), nullptr);
  for (size_t i = 0; i < g_.tensors.size(); ++i) {
    const Tensor &t = g_.tensors[i];
    switch (t.storage) {
      case Storage::Arena:
        // [held copy 0 | ... | held copy k-1 | scratch]: the scratch part follows every held copy.
        addr[i] = static_cast<char *>(arena_) + t.offset +
                  (t.offset >= plan_.held_bytes ? (slots_in_flight_ - 1) * plan_.held_bytes : 0);
        break;
      case Storage::Param: addr[i] = static_cast<char *>(params_) + t.offset; break;
      case Storage::Grad: addr[i] = static_cast<char *>(grads_) + t.offset; break;
      case Storage::Input: addr[i] = static_cast<char *>(inputs_) + t.offset; break;
      case Storage::Const:
        addr[i] = static_cast<char *>(consts_) + t.offset;
        // (an activation here is a reshape placed on a constant: its bytes are the constant's)
        if (t.role == Role::Const) be_.iface->copy_h2d(be_.ctx, addr[i], t.data.data(), t.data.size(), 0);
        break;
      default: break;
    }
  }

  // Parameters and their segments of the flat buffers.
  std::vector<FlatOptimizer::Segment> segments;
  for (size_t i = 0; i < g_.tensors.size(); ++i) {
    const Tensor &t = g_.tensors[i];
    if (t.role != Role::Param) continue;
    ParamSlot s{};
    s.tensor = static_cast<int>(i);
    s.grad = plan_.param_grad[i];
    s.n = t.numel();
    s.decay = !t.no_decay;
    if (const StageCut::Home *h = pp_home(t.name)) s.norm_once_elsewhere = h->stages.front() != stage_;
    slots_.push_back(s);
    // As torch: a parameter no gradient reaches is not stepped.
    if (s.grad >= 0) segments.push_back({t.offset / 4, s.n, s.decay});
  }
  opt_ = std::make_unique<FlatOptimizer>(be_, static_cast<float *>(params_), static_cast<float *>(grads_),
                                         plan_.param_bytes / 4, std::move(segments), copt_.micro_batches > 1);
  for (ParamSlot &s : slots_) {
    s.m = opt_->m() + g_.tensors[s.tensor].offset / 4;
    s.v = opt_->v() + g_.tensors[s.tensor].offset / 4;
  }
  if (prog_.chunks() > 0) {
    // Interleaved: each chunk's backward task writes its parameters' gradients
    // (accumulated after it); a gradient written in two chunks' tasks would
    // be overwritten by another micro-batch in between.
    chunk_grads_.assign(static_cast<size_t>(prog_.chunks()), {});
    for (const ParamSlot &s : slots_) {
      if (s.grad < 0) continue;
      std::set<int> chunks;
      for (size_t n = 0; n < g_.nodes.size(); ++n)
        for (int o : g_.nodes[n].outputs)
          if (o == s.grad) chunks.insert(prog_.node_chunk[n]);
      CTR_REQUIRE(chunks.size() == 1, CTR_STATUS_UNSUPPORTED,
                  "pipeline schedule interleaved: the gradient of parameter '%s' is written by %zu chunks' tasks of "
                  "stage %d (one is needed)",
                  g_.tensors[s.tensor].name.c_str(), chunks.size(), stage_);
      chunk_grads_[static_cast<size_t>(*chunks.begin())].push_back({g_.tensors[s.tensor].offset / 4, s.n});
    }
  }
  pp_train_expect_ = pp_expected(pipeline_.order);
  if (cut_.stages > 1) {
    eval_order_.assign(static_cast<size_t>(cut_.stages), {});
    for (int st = 0; st < cut_.stages; ++st)
      for (int64_t mb = 0; mb < copt_.micro_batches; ++mb)
        for (int c = 0; c < cut_.chunks; ++c)
          eval_order_[static_cast<size_t>(st)].push_back({st, mb, TaskPhase::Forward, c});
    pp_eval_expect_ = pp_expected(eval_order_);
  }

  // The gradient norm's groups: parameters by the mesh axes (of size > 1) that
  // shard them; group 0 holds the most elements.
  {
    std::vector<int64_t> elems;
    for (const ParamSlot &s : slots_) {
      std::vector<std::string> axes;
      for (const std::string &a : g_.tensors[s.tensor].placement.shard_axes())
        if (copt_.mesh.size(a) > 1) axes.push_back(a);
      // Pipeline stages hold different parameters: every norm sums over pp.
      if (cut_.stages > 1) axes.push_back("pp");
      size_t k = 0;
      while (k < norm_groups_.size() && norm_groups_[k] != axes) ++k;
      if (k == norm_groups_.size()) {
        norm_groups_.push_back(axes);
        elems.push_back(0);
      }
      elems[k] += s.n;
      norm_group_of_.push_back(static_cast<int>(k));
    }
    if (norm_groups_.empty()) {
      norm_groups_.emplace_back();
      elems.push_back(0);
    }
    const size_t big = static_cast<size_t>(std::max_element(elems.begin(), elems.end()) - elems.begin());
    std::swap(norm_groups_[0], norm_groups_[big]);
    for (int &k : norm_group_of_)
      if (k == 0 || k == static_cast<int>(big)) k = k == 0 ? static_cast<int>(big) : 0;
  }

  // Inputs and the id ranges their consumers accept (each op's id rule);
  // constant ids are checked here, once.
  for (size_t i = 0; i < g_.tensors.size(); ++i) {
    const Tensor &t = g_.tensors[i];
    if (t.role == Role::Const && t.dtype == CTR_DTYPE_I32) {
      int64_t lo = 1, hi = 0;
      id_range_of(g_, static_cast<int>(i), &lo, &hi);
      for (size_t k = 0; lo <= hi && k < t.data.size() / 4; ++k) {
        int32_t id = 0;
        std::memcpy(&id, t.data.data() + 4 * k, 4);
        if (id < lo || id >= hi)
          fail(CTR_STATUS_INVALID_GRAPH,
               strformat("constant %s holds id %d at position %zu, outside the valid range [%lld, %lld) of "
                         "the ops that read it",
                         g_.describe_tensor(static_cast<int>(i)).c_str(), id, k, static_cast<long long>(lo),
                         static_cast<long long>(hi)));
      }
    }
    if (t.role != Role::Input) continue;
    InputSlot s;
    s.tensor = static_cast<int>(i);
    s.bytes = t.bytes();
    s.lo = 1;
    s.hi = 0;
    id_range_of(g_, s.tensor, &s.lo, &s.hi);
    for (const StageCut::Boundary &b : cut_.recv) s.internal |= b.tensor == s.tensor;
    for (const StageCut::Boundary &b : cut_.send) s.internal |= b.grad_tensor == s.tensor;
    inputs_slots_.push_back(s);
    if (t.name == "tokens") tokens_per_micro_ = t.numel();
  }
  for (const auto &[name, bytes] : cut_.elsewhere_inputs)
    if (name == "tokens") tokens_per_micro_ = bytes / 4;
  for (const InputSlot &s : inputs_slots_)
    if (tokens_per_micro_ == 0 && !s.internal) tokens_per_micro_ = g_.tensors[s.tensor].numel();
  // A captured graph bakes in its addresses: with several micro-batches the
  // inputs stay at one place, and each micro-batch is copied there (a device
  // copy ordered on stream 0) instead of moving the tensors to it.
  if (graphs && be_.iface->capture_begin && copt_.micro_batches > 1 && !inputs_slots_.empty() &&
      slots_in_flight_ == 1) {
    int64_t cur = 0;
    for (InputSlot &s : inputs_slots_) {
      s.cur = cur;
      cur += (s.bytes + 255) / 256 * 256;
    }
    inputs_cur_ = must_alloc(be_, cur, "the current micro-batch's inputs");
    for (const InputSlot &s : inputs_slots_) addr[s.tensor] = static_cast<char *>(inputs_cur_) + s.cur;
  }

  for (int64_t k = 1; k < slots_in_flight_; ++k) {
    // The same program over the k-th copy of the arena.
    std::vector<void *> a = addr;
    for (size_t i = 0; i < g_.tensors.size(); ++i)
      if (g_.tensors[i].storage == Storage::Arena && g_.tensors[i].offset < plan_.held_bytes)
        a[i] = static_cast<char *>(a[i]) + k * plan_.held_bytes;
    more_exec_.push_back(std::make_unique<Executor>(g_, prog_, mesh_, be_, std::move(a), device_comms_.get()));
    more_exec_.back()->enable_graphs(graphs);
    more_exec_.back()->profile_kernels(profile_kernels_);
  }
  exec_ = std::make_unique<Executor>(g_, prog_, mesh_, be_, std::move(addr), device_comms_.get());
  exec_->enable_graphs(graphs);
  exec_->profile_kernels(profile_kernels_);
  ckpt_ = std::make_unique<Checkpointer>(mesh_, async_save_lag_);
  init_params(seed);
  free_on_throw.armed = false;
}

void Step::free_buffers() {
  ckpt_.reset();  // a background write ends; nothing is published
  // Sends still in flight (a step that failed) finish or fail before their bytes go.
  for (PendingSend &p : sends_) {
    try {
      comm_wait(mesh_.comm("pp"), p.work, mesh_.timeout_ms);
    } catch (const Error &) {
    }
  }
  sends_.clear();
  more_exec_.clear();
  exec_.reset();
  device_comms_.reset();  // nothing of theirs is in flight once the executor is gone
  opt_.reset();
  for (void **p : {&arena_, &params_, &grads_, &inputs_, &consts_, &inputs_cur_}) {
    if (*p) be_.iface->free(be_.ctx, *p);
    *p = nullptr;
  }
}

Step::~Step() { free_buffers(); }

float *Step::param_ptr(int t) const { return static_cast<float *>(exec_->addr(t)); }

void *Step::device_address(int t) const { return exec_->addr(t); }

int64_t Step::graph_replays() const { return exec_->graph_replays(); }

void Step::write_param(int t, const float *full) {
  const Tensor &x = g_.tensors[t];
  const int64_t n = x.numel();
  std::vector<float> host(static_cast<size_t>(n), 0.0f);
  for_each_run(x.shape, global_shape(x), local_block(x, copt_.mesh), [&](int64_t lo, int64_t go, int64_t count) {
    std::memcpy(host.data() + lo, full + go, static_cast<size_t>(count) * 4);
  });
  be_.iface->copy_h2d(be_.ctx, param_ptr(t), host.data(), static_cast<size_t>(n) * 4, 0);
  check_backend(be_, "writing a parameter");
}

void Step::init_params(uint64_t seed) {
  std::vector<float> host;
  for (const ParamSlot &s : slots_) {
    const Tensor &t = g_.tensors[s.tensor];
    const uint64_t stream = rng::hash_name(t.name);
    const InitSpec &in = t.init;
    // Local element lo + i is global element go + i; padding stays zero.
    host.assign(static_cast<size_t>(s.n), 0.0f);
    float *p = host.data();
    for_each_run(t.shape, global_shape(t), local_block(t, copt_.mesh), [&](int64_t lo, int64_t go, int64_t count) {
      float *q = p + lo;
      switch (in.kind) {
        case InitKind::Zeros: break;
        case InitKind::Ones: std::fill(q, q + count, 1.0f); break;
        case InitKind::Data: std::memcpy(q, t.data.data() + go * 4, static_cast<size_t>(count) * 4); break;
        case InitKind::Normal:
          parallel_for(count, 4096, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i)
              q[i] = static_cast<float>(in.mean + in.std * rng::normal(seed, stream, static_cast<uint64_t>(go + i)));
          });
          break;
        case InitKind::Uniform:
          parallel_for(count, 4096, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i)
              q[i] = static_cast<float>(in.low + (in.high - in.low) *
                                                     rng::uniform(seed, stream, static_cast<uint64_t>(go + i)));
          });
          break;
      }
    });
    be_.iface->copy_h2d(be_.ctx, param_ptr(s.tensor), p, static_cast<size_t>(s.n) * 4, 0);
  }
}

int64_t Step::optimizer_bytes() const { return opt_->state_bytes(); }

int64_t Step::peak_bytes() const {
  return plan_.step_bytes(slots_in_flight_, optimizer_bytes());
}

void Step::set_input(const std::string &name, const void *data, size_t bytes) {
  InputSlot *slot = nullptr;
  for (auto &s : inputs_slots_)
    if (g_.tensors[s.tensor].name == name) slot = &s;
  // An input that only other pipeline stages read: theirs to check and use.
  for (const auto &[other, per_micro] : cut_.elsewhere_inputs) {
    if (other != name) continue;
    const size_t want = static_cast<size_t>(per_micro * copt_.micro_batches);
    CTR_REQUIRE(data != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_set_input: data is NULL");
    CTR_REQUIRE(bytes == want, CTR_STATUS_INVALID_ARGUMENT,
                "ctr_step_set_input: input '%s' takes %zu bytes (%lld micro-batch(es)), got %zu", name.c_str(), want,
                static_cast<long long>(copt_.micro_batches), bytes);
    return;
  }
  CTR_REQUIRE(!slot || !slot->internal, CTR_STATUS_INVALID_ARGUMENT,
              "ctr_step_set_input: '%s' is an activation pipeline stage %d receives from another stage, not an "
              "input of the graph",
              name.c_str(), stage_);
  if (!slot) {
    std::string list;
    for (auto &s : inputs_slots_)
      if (!s.internal) list += (list.empty() ? "" : ", ") + g_.tensors[s.tensor].name;
    for (const auto &e : cut_.elsewhere_inputs) list += (list.empty() ? "" : ", ") + e.first;
    fail(CTR_STATUS_NOT_FOUND,
         strformat("ctr_step_set_input: graph has no input '%s' (inputs: %s)", name.c_str(), list.c_str()));
  }
  const Tensor &t = g_.tensors[slot->tensor];
  size_t want = static_cast<size_t>(slot->bytes * copt_.micro_batches);
  CTR_REQUIRE(data != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_set_input: data is NULL");
  CTR_REQUIRE(bytes == want, CTR_STATUS_INVALID_ARGUMENT,
              "ctr_step_set_input: input '%s' takes %zu bytes (%lld micro-batch(es) of %s %s), "
              "got %zu",
              name.c_str(), want, static_cast<long long>(copt_.micro_batches),
              dtype_name(t.dtype), shape_string(t.shape).c_str(), bytes);
  if (t.dtype == CTR_DTYPE_I32 && slot->lo <= slot->hi) {
    const int32_t *ids = static_cast<const int32_t *>(data);
    size_t n = bytes / 4;
    for (size_t i = 0; i < n; ++i)
      if (ids[i] < slot->lo || ids[i] >= slot->hi)
        fail(CTR_STATUS_DATA_ERROR,
             strformat("ctr_step_set_input: input '%s' has id %d at position %zu, outside the "
                       "valid range [%lld, %lld) (vocab size %lld)",
                       name.c_str(), ids[i], i, static_cast<long long>(slot->lo),
                       static_cast<long long>(slot->hi), static_cast<long long>(slot->hi)));
  }
  be_.iface->copy_h2d(be_.ctx, static_cast<char *>(inputs_) + t.offset, data, bytes, 0);
  slot->set = true;
}

void Step::check_inputs_set(const char *what) const {
  for (const auto &s : inputs_slots_)
    CTR_REQUIRE(s.set || s.internal, CTR_STATUS_INVALID_STATE, "%s: input '%s' has not been set", what,
                g_.tensors[s.tensor].name.c_str());
}

void Step::bind_micro_batch(int64_t mb) {
  Executor &ex = exec_for(mb);
  for (const auto &s : inputs_slots_) {
    char *from = static_cast<char *>(inputs_) + g_.tensors[s.tensor].offset + mb * s.bytes;
    if (inputs_cur_)
      be_.iface->copy_d2d(be_.ctx, static_cast<char *>(inputs_cur_) + s.cur, from, static_cast<size_t>(s.bytes), 0);
    else
      ex.rebind(s.tensor, from);
  }
}

const std::string &Step::kernel_profile() {
  CTR_REQUIRE(profile_kernels_, CTR_STATUS_INVALID_STATE,
              "ctr_step_kernel_profile: the step was created without option profile_kernels 1");
  nlohmann::json out = nlohmann::json::array();
  std::vector<const Executor *> all{exec_.get()};
  for (const auto &e : more_exec_) all.push_back(e.get());
  const int ni = g_.num_input_grad >= 0 ? g_.num_input_grad : static_cast<int>(g_.nodes.size());
  for (size_t n = 0; n < g_.nodes.size(); ++n) {
    double us = 0;
    int64_t runs = 0;
    for (const Executor *e : all) {
      if (e->kernel_runs().empty()) continue;
      us += e->kernel_us()[n];
      runs += e->kernel_runs()[n];
    }
    if (runs == 0) continue;
    const Node &nd = g_.nodes[n];
    const int pos = static_cast<int>(n);
    out.push_back({{"node", nd.name},
                   {"op", nd.op},
                   {"phase", pos < g_.num_forward ? "forward" : pos < ni ? "backward" : "weight"},
                   {"flops", kernel_flops(g_, nd)},
                   {"bytes", kernel_bytes(g_, nd)},
                   {"runs", runs},
                   {"us", us / static_cast<double>(runs)}});
  }
  kernel_profile_json_ = out.dump();
  return kernel_profile_json_;
}

Executor &Step::exec_for(int64_t mb) const {
  const int64_t k = mb % slots_in_flight_;
  return k == 0 ? *exec_ : *more_exec_[static_cast<size_t>(k - 1)];
}

// ---------------------------------------------------------------------------
// Pipeline stages: activations and gradients between stages, over the pp
// communicator (member i is stage i), through host buffers.

std::map<int, std::vector<Step::PpMessage>> Step::pp_expected(const std::vector<std::vector<Task>> &order) const {
  std::map<int, std::vector<PpMessage>> out;
  if (cut_.stages <= 1) return out;
  const int p = cut_.stages;
  for (int from = 0; from < p; ++from) {
    if (from == stage_) continue;
    std::vector<PpMessage> &list = out[from];
    // What stage `from` sends this rank, in its task order and, within a
    // task, in crossing order (as pp_send sends).
    for (const Task &t : order[static_cast<size_t>(from)]) {
      const int vs = t.chunk * p + from;
      for (size_t k = 0; k < cut_.crossings.size(); ++k) {
        const StageCut::Crossing &x = cut_.crossings[k];
        if (t.phase == TaskPhase::Forward && x.from == vs && x.to % p == stage_)
          list.push_back({static_cast<int>(k), t.micro_batch, false});
        if (t.phase == TaskPhase::Backward && x.grad && x.to == vs && x.from % p == stage_)
          list.push_back({static_cast<int>(k), t.micro_batch, true});
      }
    }
  }
  return out;
}

void Step::pp_begin(const std::map<int, std::vector<PpMessage>> &expect) {
  // Receives a failed run left posted may yet be written into: their buffers stay.
  for (auto &[key, posted] : pp_posted_) orphans_.push_back(std::move(posted.buf));
  pp_posted_.clear();
  pp_expect_ = &expect;
  pp_posted_count_.clear();
}

bool Step::pp_receive(const Task &task) {
  if (cut_.stages <= 1) return false;
  const Comm &c = mesh_.comm("pp");
  const bool grads = task.phase == TaskPhase::Backward;
  const int64_t mb = task.micro_batch;
  // (boundary, tensor receiving it) per message of this task
  std::vector<std::pair<const StageCut::Boundary *, int>> want;
  if (task.phase == TaskPhase::Forward) {
    for (const StageCut::Boundary &b : cut_.recv)
      if (b.chunk == task.chunk) want.push_back({&b, b.tensor});
  } else if (grads) {
    for (const StageCut::Boundary &b : cut_.send)
      if (b.grad && b.chunk == task.chunk) want.push_back({&b, b.grad_tensor});
  }
  // The tensor each message to this rank fills.
  auto tensor_of = [&](const PpMessage &m) -> const Tensor & {
    for (const StageCut::Boundary &b : m.grad ? cut_.send : cut_.recv)
      if (b.crossing == m.crossing) return g_.tensors[static_cast<size_t>(m.grad ? b.grad_tensor : b.tensor)];
    CTR_CHECK(false);
    return g_.tensors[0];
  };
  try {
    for (const auto &[b, tensor] : want) {
      const auto key = std::make_tuple(b->crossing, mb, grads);
      // Between two members the k-th send matches the k-th recv: receives
      // are posted in the order the peer sends, up to the one this task needs.
      const std::vector<PpMessage> &from = pp_expect_->at(b->peer);
      size_t &next = pp_posted_count_[b->peer];
      while (!pp_posted_.count(key)) {
        CTR_CHECK(next < from.size());
        const PpMessage &m = from[next++];
        // (named by the task of this rank that takes it)
        const StageCut::Crossing &x = cut_.crossings[static_cast<size_t>(m.crossing)];
        const Task taker{stage_, m.mb, m.grad ? TaskPhase::Backward : TaskPhase::Forward,
                         (m.grad ? x.from : x.to) / cut_.stages};
        const Tensor &into = tensor_of(m);
        const CollectiveName what(strformat("stage %d task %s: recv '%s' from stage %d", stage_,
                                            task_text(taker, cut_.chunks > 1).c_str(), into.name.c_str(), b->peer));
        PpPosted posted{nullptr, std::vector<char>(static_cast<size_t>(into.bytes()))};
        posted.work = c.iface->recv(c.ctx, posted.buf.data(), posted.buf.size(), b->peer);
        pp_posted_.emplace(std::make_tuple(m.crossing, m.mb, m.grad), std::move(posted));
      }
      auto it = pp_posted_.find(key);
      CommWork *work = it->second.work;
      it->second.work = nullptr;
      comm_wait(c, work, mesh_.timeout_ms);
      const Tensor &t = g_.tensors[tensor];
      CTR_CHECK(it->second.buf.size() == static_cast<size_t>(t.bytes()));
      be_.iface->copy_h2d(be_.ctx, static_cast<char *>(inputs_) + t.offset + mb * t.bytes(), it->second.buf.data(),
                          it->second.buf.size(), 0);
      pp_posted_.erase(it);
    }
  } catch (...) {
    // The receives still posted may yet be written into: their buffers stay.
    for (auto &[key, posted] : pp_posted_) orphans_.push_back(std::move(posted.buf));
    pp_posted_.clear();
    throw;
  }
  return !want.empty();
}

void Step::pp_send(const Task &task) {
  if (cut_.stages <= 1) return;
  const Comm &c = mesh_.comm("pp");
  const int64_t mb = task.micro_batch;
  Executor &ex = exec_for(mb);
  const std::string name = task_text(task, cut_.chunks > 1);
  auto send = [&](int tensor, int like, int peer, bool grad) {
    PendingSend p;
    p.bytes.assign(static_cast<size_t>(g_.tensors[like].bytes()), 0);
    if (tensor >= 0) be_.iface->copy_d2h(be_.ctx, p.bytes.data(), ex.addr(tensor), p.bytes.size(), 0);
    const CollectiveName what(strformat("stage %d task %s: send '%s'%s to stage %d", stage_, name.c_str(),
                                        g_.tensors[like].name.c_str(), grad ? "'s gradient" : "", peer));
    p.work = c.iface->send(c.ctx, p.bytes.data(), p.bytes.size(), peer);
    sends_.push_back(std::move(p));
  };
  if (task.phase == TaskPhase::Forward) {
    for (const StageCut::Boundary &b : cut_.send)
      if (b.chunk == task.chunk) send(b.tensor, b.tensor, b.peer, false);
  } else if (task.phase == TaskPhase::Backward) {
    for (const StageCut::Boundary &b : cut_.recv) {
      if (!b.grad || b.chunk != task.chunk) continue;
      int gt = -1;  // no gradient reaches it: zeros go back
      for (const auto &[t, grad] : g_.input_grads)
        if (t == b.tensor) gt = grad;
      send(gt, b.tensor, b.peer, true);
    }
  }
  check_backend(be_, "reading activations to send to another pipeline stage");
}

void Step::finish_sends() {
  if (sends_.empty()) return;
  const Comm &c = mesh_.comm("pp");
  // A wait consumes its work, failed or not; the sends not yet waited for stay
  // (with their bytes) for free_buffers.
  size_t i = 0;
  try {
    for (; i < sends_.size(); ++i) comm_wait(c, sends_[i].work, mesh_.timeout_ms);
  } catch (...) {
    sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(i + 1));
    throw;
  }
  sends_.clear();
}

const StageCut::Home *Step::pp_home(const std::string &name) const {
  for (const StageCut::Home &h : cut_.params)
    if (h.name == name) return &h;
  return nullptr;
}

void Step::pp_sum_shared_grads() {
  if (cut_.stages <= 1) return;
  const Comm &c = mesh_.comm("pp");
  float *grads = const_cast<float *>(opt_->grads());
  for (const StageCut::Home &h : cut_.params) {
    if (h.stages.size() < 2 || std::find(h.stages.begin(), h.stages.end(), stage_) == h.stages.end()) continue;
    const ParamSlot *slot = nullptr;
    for (const ParamSlot &s : slots_)
      if (g_.tensors[s.tensor].name == h.name) slot = &s;
    CTR_CHECK(slot != nullptr);
    if (slot->grad < 0) continue;
    float *dev = grads + g_.tensors[slot->tensor].offset / 4;
    const size_t n = static_cast<size_t>(slot->n);
    // Every holder sends its sum to the others and adds theirs in stage order,
    // so each ends with the same bits.
    std::vector<std::vector<float>> parts(h.stages.size(), std::vector<float>(n));
    size_t mine = 0;
    for (size_t i = 0; i < h.stages.size(); ++i)
      if (h.stages[i] == stage_) mine = i;
    be_.iface->copy_d2h(be_.ctx, parts[mine].data(), dev, n * 4, 0);
    check_backend(be_, "reading a gradient to sum over pipeline stages");
    const CollectiveName what(strformat("gradient of '%s' over pipeline stages", h.name.c_str()));
    std::vector<CommWork *> works;
    for (size_t i = 0; i < h.stages.size(); ++i) {
      if (i == mine) continue;
      works.push_back(c.iface->send(c.ctx, parts[mine].data(), n * 4, h.stages[i]));
      works.push_back(c.iface->recv(c.ctx, parts[i].data(), n * 4, h.stages[i]));
    }
    try {
      for (CommWork *w : works) comm_wait(c, w, mesh_.timeout_ms);
    } catch (...) {
      // Transfers a failure left posted may still touch these buffers: they stay.
      for (std::vector<float> &part : parts) orphan_floats_.push_back(std::move(part));
      throw;
    }
    std::vector<float> sum = parts[0];
    for (size_t i = 1; i < parts.size(); ++i)
      for (size_t j = 0; j < n; ++j) sum[j] += parts[i][j];
    be_.iface->copy_h2d(be_.ctx, dev, sum.data(), n * 4, 0);
  }
}

// The moe layers of the graph as built (before the passes): each moe_permute
// node, and the auxiliary losses that read the same router logits. Their
// tensors are kept past the step so that they can be read after it.
void Step::find_moe_layers() {
  for (const Node &n : g_.nodes) {
    if (n.op != "moe_permute") continue;
    MoeLayer l;
    l.name = n.name.substr(0, n.name.rfind('.') == std::string::npos ? n.name.size() : n.name.rfind('.'));
    l.counts = n.outputs[1];
    l.experts = n.attr_int("experts", 0);
    // The router's logits: what the router producing the permute's expert ids read.
    int logits = -1;
    for (const Node &m : g_.nodes)
      if (m.op == "moe_router" && m.outputs.size() > 1 && m.outputs[1] == n.inputs[1]) logits = m.inputs[0];
    for (const Node &m : g_.nodes) {
      if (m.inputs.empty() || m.inputs[0] != logits) continue;
      if (m.op == "moe_aux_loss") l.aux = m.outputs[0];
      if (m.op == "moe_z_loss") l.z = m.outputs[0];
    }
    for (int t : {l.counts, l.aux, l.z})
      if (t >= 0) g_.tensors[t].keep = true;
    auto name = [&](int t) { return t >= 0 ? g_.tensors[static_cast<size_t>(t)].name : std::string(); };
    l.counts_name = name(l.counts);
    l.aux_name = name(l.aux);
    l.z_name = name(l.z);
    moe_.push_back(std::move(l));
  }
}

void Step::place_moe_layers() {
  if (cut_.stages <= 1) return;
  auto find = [&](const std::string &name) { return name.empty() ? -1 : g_.find_tensor(name); };
  for (MoeLayer &l : moe_) {
    l.counts = find(l.counts_name);
    l.aux = find(l.aux_name);
    l.z = find(l.z_name);
    l.here = l.counts >= 0;
  }
}

void Step::read_moe(int64_t mb) {
  Executor &ex = exec_for(mb);
  for (MoeLayer &l : moe_) {
    if (mb == 0) {
      l.tokens.assign(static_cast<size_t>(l.experts), 0);
      l.aux_loss = l.z_loss = 0;
    }
    if (!l.here) continue;  // another pipeline stage's layer: it counts there
    std::vector<int32_t> c(static_cast<size_t>(l.experts));
    be_.iface->copy_d2h(be_.ctx, c.data(), ex.addr(l.counts), c.size() * 4, 0);
    for (size_t e = 0; e < c.size(); ++e) l.tokens[e] += c[e];
    float v = 0;
    if (l.aux >= 0) {
      be_.iface->copy_d2h(be_.ctx, &v, ex.addr(l.aux), 4, 0);
      l.aux_loss += v;
    }
    if (l.z >= 0) {
      be_.iface->copy_d2h(be_.ctx, &v, ex.addr(l.z), 4, 0);
      l.z_loss += v;
    }
  }
  if (!moe_.empty()) check_backend(be_, "reading the expert counts");
}

void Step::reduce_moe() {
  if (moe_.empty()) return;
  // Token counts sum over the ranks (each routed its own tokens); the losses
  // are means over micro-batches and the ranks of the layer's pipeline stage,
  // as the step's loss is (the other stages count 0).
  const double k = static_cast<double>(copt_.micro_batches),
               w = static_cast<double>(mesh_.world / std::max(1, cut_.stages));
  std::vector<double> v;
  for (const MoeLayer &l : moe_) {
    for (int64_t t : l.tokens) v.push_back(static_cast<double>(t));
    v.push_back(l.aux_loss / k / w);
    v.push_back(l.z_loss / k / w);
  }
  if (mesh_.world > 1) {
    const Comm &wc = mesh_.world_comm;
    comm_wait(wc, wc.iface->all_reduce(wc.ctx, v.data(), v.data(), v.size(), CTR_DTYPE_F64, ReduceOp::Sum),
              mesh_.timeout_ms);
  }
  nlohmann::json layers = nlohmann::json::array();
  size_t i = 0;
  for (MoeLayer &l : moe_) {
    for (int64_t &t : l.tokens) t = static_cast<int64_t>(v[i++]);
    l.aux_loss = v[i++];
    l.z_loss = v[i++];
    nlohmann::json j = {{"layer", l.name}, {"tokens_per_expert", l.tokens}};
    if (!l.aux_name.empty()) j["aux_loss"] = l.aux_loss;  // (the graph's, wherever its stage is)
    if (!l.z_name.empty()) j["z_loss"] = l.z_loss;
    layers.push_back(std::move(j));
  }
  moe_json_ = layers.dump();
}

double Step::read_loss(int64_t mb) const {
  float loss = 0;
  if (g_.loss < 0) return 0;  // a pipeline stage before the last
  be_.iface->copy_d2h(be_.ctx, &loss, exec_for(mb).addr(g_.loss), 4, 0);
  check_backend(be_, "reading the loss");
  return loss;
}

int64_t Step::full_numel(int t) const { return global_numel(g_.tensors[t]); }

void Step::run(ctr_step_metrics *metrics) {
  check_inputs_set("ctr_step_run");
  check_backend(be_, "before the step ran: a failed device stays failed");
  if (fault_step_ == step_ + 1 && !fault_nan_) {
    if (fault_in_comm_) {
      exec_->exit_after_collectives(3);
    } else {
      if (fault_kill_) ::raise(SIGKILL);
      if (!fault_hang_) _exit(87);
      for (;;) pause();
    }
  }
  {
    // A background save is published here, after the same number of steps on
    // every rank (a collective), giving the writer that many steps of time.
    auto ts = Clock::now();
    ckpt_->tick();
    save_wait_ms_ = ms_since(ts);
  }
  if (metrics)
    CTR_REQUIRE(metrics->size >= sizeof(size_t) && metrics->size <= (1 << 16), CTR_STATUS_INVALID_ARGUMENT,
                "ctr_step_run: metrics->size must be set to sizeof(ctr_step_metrics)");
  auto t0 = Clock::now();
  double fwd_ms = 0, bwd_ms = 0, loss_sum = 0;
  for (int64_t e = 0; e < slots_in_flight_; ++e) {
    // collectives outside the step (get_param, ...) do not count
    exec_for(e).take_comm_ms();
    exec_for(e).take_comm_ms_by_axis();
    exec_for(e).take_exposed_ms();
  }
  const int64_t k = copt_.micro_batches;
  // The timeline: each task's wait for what it receives and its own work, in
  // microseconds of the system clock (comparable across the ranks of a host).
  nlohmann::json timeline = nlohmann::json::array();
  auto now_us = [] {
    return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  auto event = [&](const std::string &name, const char *cat, int64_t mb, int64_t start, int64_t end) {
    timeline.push_back({{"name", name}, {"cat", cat}, {"stage", stage_}, {"micro_batch", mb}, {"start_us", start},
                        {"dur_us", std::max<int64_t>(0, end - start)}});
  };
  // This stage's tasks in schedule order; gradients accumulate in micro-batch order.
  pp_begin(pp_train_expect_);
  const int last_chunk = std::max(1, prog_.chunks()) - 1;
  auto accumulate = [&](const Task &task) {
    if (prog_.chunks() == 0) {
      opt_->accumulate(task.micro_batch);
    } else {
      // The first accumulation (of micro-batch 0) takes the whole buffer, so
      // that gradients no chunk writes read as zeros; then each chunk's own.
      if (task.micro_batch == 0 && task.chunk == last_chunk)
        opt_->accumulate(0);
      else
        opt_->accumulate(task.micro_batch, chunk_grads_[static_cast<size_t>(task.chunk)]);
    }
  };
  for (const Task &task : pipeline_.order[static_cast<size_t>(stage_)]) {
    const int64_t mb = task.micro_batch;
    Executor &ex = exec_for(mb);
    const std::string name = task_text(task, cut_.chunks > 1);
    const int chunk = prog_.chunks() > 0 ? task.chunk : -1;
    const int64_t t_wait = now_us();
    if (task.phase == TaskPhase::Forward) {
      const bool received = pp_receive(task);
      const int64_t t_work = now_us();
      if (received) event("recv " + name, "recv", mb, t_wait, t_work);
      bind_micro_batch(mb);
      auto tf = Clock::now();
      if (fault_slow_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(fault_slow_ms_));
      ex.run(Executor::Phase::Forward, chunk);
      ran_forward_ = true;
      fwd_ms += ms_since(tf);
      if (task.chunk == last_chunk) {  // (the loss and every expert layer of the micro-batch computed)
        loss_sum += read_loss(mb);
        read_moe(mb);
      }
      pp_send(task);
      event(name, "forward", mb, t_work, now_us());
    } else if (task.phase == TaskPhase::Backward) {
      const bool received = pp_receive(task);
      const int64_t t_work = now_us();
      if (received) event("recv " + name, "recv", mb, t_wait, t_work);
      bind_micro_batch(mb);
      auto tb = Clock::now();
      ex.run(Executor::Phase::Backward, chunk);
      // A split backward's gradients are whole after its W task.
      if (!pipeline_.split_backward()) accumulate(task);
      bwd_ms += ms_since(tb);
      pp_send(task);
      event(name, "backward", mb, t_work, now_us());
    } else {
      bind_micro_batch(mb);
      auto tb = Clock::now();
      ex.run(Executor::Phase::Weight, chunk);
      accumulate(task);
      bwd_ms += ms_since(tb);
      event(name, "weight", mb, t_wait, now_us());
    }
  }
  {
    const int64_t t_wait = now_us();
    finish_sends();
    pp_sum_shared_grads();
    if (cut_.stages > 1) event("pipeline drain", "recv", -1, t_wait, now_us());
  }
  const int64_t t_opt = now_us();
  double loss = loss_sum / static_cast<double>(k);
  if (fault_nan_ && fault_step_ == step_ + 1) {
    loss = NAN;  // on one rank: the all-reduce carries it to every rank
    fault_step_ = -1;  // once: a rewound run gets past it
  }
  reduce_moe();
  if (mesh_.world > 1) {
    // Every rank reports (and checks) the same global mean loss.
    // (Only the last pipeline stage has a loss; the others count 0.)
    const Comm &wc = mesh_.world_comm;
    comm_wait(wc, wc.iface->all_reduce(wc.ctx, &loss, &loss, 1, CTR_DTYPE_F64, ReduceOp::Avg), mesh_.timeout_ms);
    loss *= cut_.stages;
  }

  auto to = Clock::now();
  // Each gradient's squares sum over the mesh axes that shard it (a
  // replicating axis holds copies, which count once): one partial sum per
  // distinct set of shard axes (norm_groups_), each all-reduced over its axes.
  // The largest group's sum is the total less the others', so the common
  // layouts (all parameters alike) need one backend reduction.
  std::vector<double> sums(norm_groups_.size(), 0.0);
  {
    double others = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const ParamSlot &s = slots_[i];
      if (s.grad < 0 || (norm_group_of_[i] == 0 && !s.norm_once_elsewhere)) continue;
      const double v =
          be_.iface->sum_squares(be_.ctx, opt_->grads() + g_.tensors[s.tensor].offset / 4, s.n, 0);
      if (!s.norm_once_elsewhere) sums[static_cast<size_t>(norm_group_of_[i])] += v;
      others += v;
    }
    sums[0] = opt_->sum_squares() - others;
  }
  // A device fault leaves stale or NaN sums: never clip or update from them.
  check_backend(be_, "computing the gradient norm");
  for (const MeshPlacement::Axis &a : copt_.mesh.axes) {
    std::vector<size_t> which;
    for (size_t k = 0; k < norm_groups_.size(); ++k)
      for (const std::string &x : norm_groups_[k])
        if (x == a.name) which.push_back(k);
    if (which.empty()) continue;
    std::vector<double> v;
    for (size_t k : which) v.push_back(sums[k]);
    const Comm &c = mesh_.comm(a.name);
    comm_wait(c, c.iface->all_reduce(c.ctx, v.data(), v.data(), v.size(), CTR_DTYPE_F64, ReduceOp::Sum),
              mesh_.timeout_ms);
    for (size_t j = 0; j < which.size(); ++j) sums[which[j]] = v[j];
  }
  double sq = 0;
  for (double v : sums) sq += v;
  double norm = std::sqrt(sq);
  const bool nonfinite = oc_.check_finite && (!std::isfinite(loss) || !std::isfinite(norm));
  if (nonfinite && !oc_.skip_nonfinite)
    fail(CTR_STATUS_NUMERIC_ERROR,
         strformat("ctr_step_run: step %lld: loss %g, gradient norm %g is not finite; "
                   "parameters were not updated",
                   static_cast<long long>(step_ + 1), loss, norm));
  double scale = 1.0;
  if (oc_.grad_clip > 0 && norm > oc_.grad_clip) scale = oc_.grad_clip / (norm + 1e-6);
  double lr = schedule_lr(oc_, step_);
  int64_t t = step_ + 1;
  // Every rank sees the same all-reduced loss and norm, so all skip together.
  if (nonfinite)
    ++skipped_steps_;
  else
    opt_->update(oc_, lr, scale, t);
  be_.iface->synchronize(be_.ctx, 0);
  check_backend(be_, "updating the parameters");
  double opt_ms = ms_since(to);
  step_ = t;
  double total_ms = ms_since(t0);

  if (metrics) {
    ctr_step_metrics m;
    std::memset(&m, 0, sizeof m);
    m.size = metrics->size;
    m.step = step_;
    m.loss = loss;
    m.grad_norm = norm;
    m.lr = lr;
    m.step_ms = total_ms;
    m.forward_ms = fwd_ms;
    m.backward_ms = bwd_ms;
    m.optimizer_ms = opt_ms;
    m.tokens = tokens_per_micro_ * k * mesh_.data_size();  // a tp or cp group shares its rows
    m.tokens_per_s = total_ms > 0 ? static_cast<double>(m.tokens) * 1000.0 / total_ms : 0;
    m.peak_bytes = peak_bytes();
    m.save_wait_ms = save_wait_ms_;
    for (int64_t e = 0; e < slots_in_flight_; ++e) {
      m.exposed_comm_ms += exec_for(e).take_exposed_ms();
      m.comm_ms += exec_for(e).take_comm_ms();
    }
    m.compute_ms = std::max(0.0, fwd_ms + bwd_ms - m.exposed_comm_ms);
    m.skipped_steps = skipped_steps_;
    std::memcpy(metrics, &m, std::min(sizeof m, metrics->size));
  }
  {
    nlohmann::json axes = nlohmann::json::object();
    for (const auto &[axis, ms] : exec_->take_comm_ms_by_axis()) axes[axis] = ms;
    for (const auto &e : more_exec_)
      for (const auto &[axis, ms] : e->take_comm_ms_by_axis()) axes[axis] = axes.value(axis, 0.0) + ms;
    comm_json_ = axes.dump();
  }
  event("optimizer", "optimizer", -1, t_opt, now_us());
  timeline_json_ = timeline.dump();
}

double Step::evaluate() {
  check_inputs_set("ctr_step_evaluate");
  double sum = 0;
  if (cut_.stages <= 1) {
    for (int64_t mb = 0; mb < copt_.micro_batches; ++mb) {
      bind_micro_batch(mb);
      exec_for(mb).run(Executor::Phase::Forward);
      ran_forward_ = true;
      sum += read_loss(mb);
    }
    return sum / static_cast<double>(copt_.micro_batches);
  }
  pp_begin(pp_eval_expect_);
  for (const Task &task : eval_order_[static_cast<size_t>(stage_)]) {
    pp_receive(task);
    bind_micro_batch(task.micro_batch);
    exec_for(task.micro_batch).run(Executor::Phase::Forward, prog_.chunks() > 0 ? task.chunk : -1);
    ran_forward_ = true;
    if (task.chunk == cut_.chunks - 1) sum += read_loss(task.micro_batch);
    pp_send(task);
  }
  finish_sends();
  if (cut_.stages > 1) {
    // The last stage's loss, on every stage.
    const Comm &c = mesh_.comm("pp");
    comm_wait(c, c.iface->all_reduce(c.ctx, &sum, &sum, 1, CTR_DTYPE_F64, ReduceOp::Sum), mesh_.timeout_ms);
  }
  return sum / static_cast<double>(copt_.micro_batches);
}

// ---------------------------------------------------------------------------
// Checkpoints: the Checkpointer does the work, through CheckpointState.

CheckpointInfo Step::checkpoint_info() const {
  CheckpointInfo i;
  i.graph_name = g_.name;
  i.options_json = options_json_;
  i.loader = loader_;
  i.loader_seq = loader_seq_;
  i.writer = false;
  for (const ShardView &v : checkpoint_shards()) i.writer |= v.write;
  if (cut_.stages > 1)  // each stage holds its own parameters: the graph has them all
    for (const StageCut::Home &h : cut_.params) i.graph_params.push_back({h.name, h.full_shape});
  return i;
}

void Step::save(const std::string &dir, bool async, std::function<void()> on_publish) {
  ckpt_->save(*this, checkpoint_info(), dir, async, std::move(on_publish));
}

void Step::finish_save() { ckpt_->finish(); }

void Step::load(const std::string &dir) {
 ckpt_->load(*this, checkpoint_info(), dir); }

std::vector<ShardView> Step::checkpoint_shards() const {
  std::vector<ShardView> out;
  for (const ParamSlot &s : slots_) {
    const Tensor &t = g_.tensors[s.tensor];
    ShardView v;
    v.name = t.name;
    v.full_shape = global_shape(t);
    v.n = s.n;
    const LocalBlock b = local_block(t, copt_.mesh);
    v.local_shape = t.shape;
    v.first = b.first;
    v.valid = b.valid;
    if (t.shape.empty()) {
      v.local_shape = {1};
      v.first = {0};
      v.valid = {1};
    }
    // One copy of each block is written, by its first replica (of a
    // parameter several pipeline stages hold, on the first of them).
    v.write = first_replica(t, copt_.mesh);
    if (const StageCut::Home *h = pp_home(t.name)) v.write = v.write && h->stages.front() == stage_;
    v.buffers[0] = param_ptr(s.tensor);
    v.buffers[1] = s.m;
    v.buffers[2] = s.v;
    out.push_back(std::move(v));
  }
  return out;
}

void Step::checkpoint_read(void *host, const void *device, size_t bytes) const {
  be_.iface->copy_d2h(be_.ctx, host, device, bytes, 0);
  check_backend(be_, "reading the step's state for a checkpoint");
}

void Step::checkpoint_write(void *device, const void *host, size_t bytes) {
  be_.iface->copy_h2d(be_.ctx, device, host, bytes, 0);
  check_backend(be_, "restoring the step's state from a checkpoint");
}

std::vector<Step::ParamInfo> Step::params() const {
  std::vector<ParamInfo> out;
  if (cut_.stages > 1) {  // every stage's, in graph order
    for (const StageCut::Home &h : cut_.params) out.push_back({h.name, h.full_shape});
    return out;
  }
  for (const ShardView &v : checkpoint_shards()) out.push_back({v.name, v.full_shape});
  return out;
}

double Step::forward_backward() {
  check_inputs_set("forward_backward");
  CTR_REQUIRE(copt_.micro_batches == 1, CTR_STATUS_UNSUPPORTED,
              "forward_backward: gradient inspection needs micro_batches = 1");
  CTR_REQUIRE(cut_.stages == 1, CTR_STATUS_UNSUPPORTED, "forward_backward: gradient inspection needs pp = 1");
  bind_micro_batch(0);
  exec_->run(Executor::Phase::Forward);
  ran_forward_ = true;
  exec_->run(Executor::Phase::Backward);
  if (!prog_.weight.empty()) exec_->run(Executor::Phase::Weight);
  return read_loss(0);
}

void Step::read_grad(const std::string &name, float *out, size_t count) {
  int t = find_param(name, count);
  CTR_REQUIRE(!g_.tensors[t].placement.sharded(), CTR_STATUS_UNSUPPORTED,
              "read_grad: parameter '%s' is sharded", name.c_str());
  int gt = plan_.param_grad[t];
  if (gt < 0) {
    std::fill(out, out + count, 0.0f);
    return;
  }
  be_.iface->copy_d2h(be_.ctx, out, exec_->addr(gt), count * 4, 0);
  check_backend(be_, "reading a gradient");
}

int Step::find_param(const std::string &name, size_t count) const {
  for (const ParamSlot &s : slots_) {
    if (g_.tensors[s.tensor].name != name) continue;
    int64_t full = full_numel(s.tensor);
    CTR_REQUIRE(static_cast<int64_t>(count) == full, CTR_STATUS_INVALID_ARGUMENT,
                "parameter '%s' has %lld elements, count is %zu", name.c_str(),
                static_cast<long long>(full), count);
    return s.tensor;
  }
  fail(CTR_STATUS_NOT_FOUND, strformat("graph has no parameter '%s'", name.c_str()));
}

void Step::get_param(const std::string &name, float *out, size_t count) {
  if (cut_.stages <= 1) return get_param_local(name, out, count);
  // Pipeline stages: the first stage that holds it reads it (gathering its
  // shards there) and broadcasts it over pp.
  const StageCut::Home *h = pp_home(name);
  CTR_REQUIRE(h != nullptr, CTR_STATUS_NOT_FOUND, "graph has no parameter '%s'", name.c_str());
  int64_t full = 1;
  for (int64_t d : h->full_shape) full *= d;
  CTR_REQUIRE(static_cast<int64_t>(count) == full, CTR_STATUS_INVALID_ARGUMENT,
              "parameter '%s' has %lld elements, count is %zu", name.c_str(), static_cast<long long>(full), count);
  CTR_REQUIRE(out != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_get_param: out is NULL");
  const int owner = h->stages.front();
  if (owner == stage_) get_param_local(name, out, count);
  const Comm &c = mesh_.comm("pp");
  comm_wait(c, c.iface->broadcast(c.ctx, out, count * 4, owner), mesh_.timeout_ms);
}

void Step::get_param_local(const std::string &name, float *out, size_t count) {
  int t = find_param(name, count);
  CTR_REQUIRE(out != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_get_param: out is NULL");
  const Tensor &x = g_.tensors[t];
  if (!x.placement.sharded()) {
    be_.iface->copy_d2h(be_.ctx, out, param_ptr(t), count * 4, 0);
    check_backend(be_, "reading a parameter");
    return;
  }
  // Sharded: this rank's block to the host, then the blocks of every rank of
  // its shard axes gathered, innermost axis first (collective calls over host
  // memory), so block j of the result is the block of the j-th index tuple
  // (outermost axis slowest); each is put in place from its own local block.
  std::vector<float> part(static_cast<size_t>(x.numel()));
  be_.iface->copy_d2h(be_.ctx, part.data(), param_ptr(t), static_cast<size_t>(x.bytes()), 0);
  check_backend(be_, "reading a parameter");
  std::vector<std::string> axes;
  for (const std::string &a : x.placement.shard_axes())
    if (copt_.mesh.size(a) > 1) axes.push_back(a);
  for (size_t i = axes.size(); i-- > 0;) {
    const Comm &c = mesh_.comm(axes[i]);
    std::vector<float> whole(part.size() * static_cast<size_t>(copt_.mesh.size(axes[i])));
    comm_wait(c, c.iface->all_gather(c.ctx, part.data(), whole.data(), part.size() * sizeof(float)),
              mesh_.timeout_ms);
    part = std::move(whole);
  }
  MeshPlacement at = copt_.mesh;
  const std::vector<int64_t> whole = global_shape(x);
  const size_t blocks = part.size() / static_cast<size_t>(x.numel());
  for (size_t j = 0; j < blocks; ++j) {
    size_t rest = j;
    for (size_t i = axes.size(); i-- > 0;)
      for (MeshPlacement::Axis &a : at.axes)
        if (a.name == axes[i]) {
          a.index = static_cast<int64_t>(rest % static_cast<size_t>(a.size));
          rest /= static_cast<size_t>(a.size);
        }
    const float *src = part.data() + j * static_cast<size_t>(x.numel());
    for_each_run(x.shape, whole, local_block(x, at), [&](int64_t lo, int64_t go, int64_t n) {
      std::memcpy(out + go, src + lo, static_cast<size_t>(n) * 4);
    });
  }
}

void Step::set_param(const std::string &name, const float *data, size_t count) {
  if (cut_.stages > 1) {
    // Every stage is given every parameter; those its nodes read are its.
    const StageCut::Home *h = pp_home(name);
    CTR_REQUIRE(h != nullptr, CTR_STATUS_NOT_FOUND, "graph has no parameter '%s'", name.c_str());
    if (std::find(h->stages.begin(), h->stages.end(), stage_) == h->stages.end()) {
      int64_t full = 1;
      for (int64_t d : h->full_shape) full *= d;
      CTR_REQUIRE(static_cast<int64_t>(count) == full, CTR_STATUS_INVALID_ARGUMENT,
                  "parameter '%s' has %lld elements, count is %zu", name.c_str(), static_cast<long long>(full),
                  count);
      CTR_REQUIRE(data != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_set_param: data is NULL");
      return;
    }
  }
  int t = find_param(name, count);
  CTR_REQUIRE(data != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_set_param: data is NULL");
  for (size_t i = 0; i < count; ++i)
    CTR_REQUIRE(std::isfinite(data[i]), CTR_STATUS_INVALID_ARGUMENT,
                "ctr_step_set_param: parameter '%s' element %zu is not finite", name.c_str(), i);
  write_param(t, data);
}

void Step::get_output(const std::string &name, float *out, size_t count) {
  if (auto it = kept_elsewhere_.find(name); it != kept_elsewhere_.end())
    fail(CTR_STATUS_NOT_FOUND,
         it->second >= 0
             ? strformat("ctr_step_get_output: '%s' is computed on pipeline stage %d, not this rank's stage %d: read "
                         "it on a rank of that stage",
                         name.c_str(), it->second, stage_)
             : strformat("ctr_step_get_output: '%s' is computed on another pipeline stage than this rank's (stage "
                         "%d): read it on a rank of the stage that computes it",
                         name.c_str(), stage_));
  int t = -1;
  for (int k : kept_)
    if (g_.tensors[k].name == name) t = k;
  CTR_REQUIRE(t >= 0, CTR_STATUS_NOT_FOUND,
              "ctr_step_get_output: '%s' was not named in the step option 'keep'", name.c_str());
  CTR_REQUIRE(out != nullptr, CTR_STATUS_INVALID_ARGUMENT, "ctr_step_get_output: out is NULL");
  CTR_REQUIRE(static_cast<int64_t>(count) == g_.tensors[t].numel(), CTR_STATUS_INVALID_ARGUMENT,
              "ctr_step_get_output: '%s' has %lld elements, count is %zu", name.c_str(),
              static_cast<long long>(g_.tensors[t].numel()), count);
  CTR_REQUIRE(ran_forward_, CTR_STATUS_INVALID_STATE,
              "ctr_step_get_output: no step or evaluation has run yet");
  // The last micro-batch's: its slot of the micro-batches in flight.
  const Executor &last = exec_for(copt_.micro_batches - 1);
  if (g_.tensors[t].dtype == CTR_DTYPE_BF16) {
    // bf16 storage (precision pass): widened on the host, exactly.
    std::vector<uint16_t> half(count);
    be_.iface->copy_d2h(be_.ctx, half.data(), last.addr(t), count * 2, 0);
    check_backend(be_, "reading an output");
    for (size_t i = 0; i < count; ++i) {
      const uint32_t bits = static_cast<uint32_t>(half[i]) << 16;
      std::memcpy(out + i, &bits, 4);
    }
    return;
  }
  be_.iface->copy_d2h(be_.ctx, out, last.addr(t), count * 4, 0);
  check_backend(be_, "reading an output");
}

void Step::set_lr(double lr) {
  CTR_REQUIRE(std::isfinite(lr) && lr >= 0, CTR_STATUS_INVALID_ARGUMENT,
              "ctr_step_set_lr: learning rate %g must be finite and >= 0", lr);
  oc_.lr_override = true;
  oc_.lr_fixed = lr;
}

}  // namespace ctr
