// Pipeline schedules: building each stage's task order, and playing the whole
// schedule once to prove that it runs to the end (see schedule.h).

#include "passes/schedule.h"

#include <algorithm>
#include <limits>

#include "core/status.h"
#include "graph/ir.h"
#include "graph/ops.h"
#include "passes/passes.h"

namespace ctr {

ScheduleKind schedule_kind_from_name(const std::string &name) {
  if (name == "gpipe") return ScheduleKind::GPipe;
  if (name == "1f1b") return ScheduleKind::OneFOneB;
  if (name == "zb") return ScheduleKind::ZeroBubble;
  if (name == "interleaved") return ScheduleKind::Interleaved;
  fail(CTR_STATUS_INVALID_OPTION,
       strformat("option 'pp_schedule': unknown schedule '%s' (known: gpipe, 1f1b, zb, interleaved)", name.c_str()));
}

const char *schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::GPipe: return "gpipe";
    case ScheduleKind::OneFOneB: return "1f1b";
    case ScheduleKind::ZeroBubble: return "zb";
    case ScheduleKind::Interleaved: return "interleaved";
  }
  return "?";
}

std::string task_text(const Task &t, bool chunks) {
  const char c = t.phase == TaskPhase::Forward ? 'F' : t.phase == TaskPhase::Backward ? 'B' : 'W';
  if (chunks) return strformat("%c%lldc%d", c, static_cast<long long>(t.micro_batch), t.chunk);
  return strformat("%c%lld", c, static_cast<long long>(t.micro_batch));
}

std::string schedule_text(const Schedule &s) {
  std::string out;
  for (size_t st = 0; st < s.order.size(); ++st) {
    out += strformat("stage %zu:", st);
    for (const Task &t : s.order[st]) out += " " + task_text(t, s.virtual_stages > 1);
    if (st < s.in_flight.size())
      out += strformat(" (%lld in flight)", static_cast<long long>(s.in_flight[st]));
    out += "\n";
  }
  for (size_t vs = 0; vs < s.spans.size(); ++vs) {
    const StageSpan &sp = s.spans[vs];
    const std::string who =
        s.virtual_stages > 1
            ? strformat("virtual stage %zu (stage %zu, chunk %zu)", vs, vs % static_cast<size_t>(s.stages),
                        vs / static_cast<size_t>(s.stages))
            : strformat("stage %zu", vs);
    out += strformat("%s holds blocks %d-%d%s%s, %.4g forward FLOPs per micro-batch\n", who.c_str(), sp.first_block,
                     sp.last_block, vs == 0 ? " and what comes before them (embedding)" : "",
                     vs + 1 == s.spans.size() ? " and what comes after them (head, loss)" : "", sp.flops);
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Cutting the graph into stages

std::vector<StageSpan> cut_stages(const Graph &g, int stages, const std::vector<int64_t> &blocks_per_stage,
                                  int per_rank) {
  const std::string what = per_rank > 1 ? strformat("%d virtual stages (%d per rank)", stages, per_rank)
                                        : strformat("%d stages", stages);
  // Forward FLOPs per block, and of the nodes before the first and after the last.
  int nblocks = 0;
  for (const Node &n : g.nodes)
    if (!n.backward) nblocks = std::max(nblocks, n.block + 1);
  std::vector<double> block_flops(static_cast<size_t>(nblocks), 0.0);
  double before = 0, after = 0;
  bool seen_block = false;
  for (const Node &n : g.nodes) {
    if (n.backward) continue;
    const OpDef *def = find_op(n.op);
    const double f = def && def->flops ? def->flops(g, n) : 0.0;
    if (n.block >= 0) {
      block_flops[static_cast<size_t>(n.block)] += f;
      seen_block = true;
    } else {
      (seen_block ? after : before) += f;
    }
  }
  CTR_REQUIRE(nblocks >= stages, CTR_STATUS_INVALID_OPTION,
              "pipeline: %s need at least one block each, and graph '%s' has %d block(s)", what.c_str(),
              g.name.c_str(), nblocks);
  std::vector<int64_t> counts = blocks_per_stage;
  if (!counts.empty()) {
    CTR_REQUIRE(static_cast<int>(counts.size()) == stages, CTR_STATUS_INVALID_OPTION,
                "option 'pp_stages': %zu entries for %s (one count of blocks each)", counts.size(), what.c_str());
    int64_t sum = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      CTR_REQUIRE(counts[i] >= 1, CTR_STATUS_INVALID_OPTION,
                  "option 'pp_stages': stage %zu gets %lld blocks (at least 1 is needed)", i,
                  static_cast<long long>(counts[i]));
      sum += counts[i];
    }
    CTR_REQUIRE(sum == nblocks, CTR_STATUS_INVALID_OPTION,
                "option 'pp_stages': the stages hold %lld blocks in all, and graph '%s' has %d", static_cast<long long>(sum),
                g.name.c_str(), nblocks);
  } else {
    // Contiguous runs minimising the largest stage's cost: best[s][b] is that
    // cost for blocks [0, b) on stages [0, s), the embedding on stage 0 and
    // the head on the last.
    const size_t B = static_cast<size_t>(nblocks), S = static_cast<size_t>(stages);
    std::vector<double> prefix(B + 1, 0.0);
    for (size_t b = 0; b < B; ++b) prefix[b + 1] = prefix[b] + block_flops[b];
    const double inf = std::numeric_limits<double>::infinity();
    std::vector<std::vector<double>> best(S + 1, std::vector<double>(B + 1, inf));
    std::vector<std::vector<size_t>> from(S + 1, std::vector<size_t>(B + 1, 0));
    best[0][0] = 0;
    for (size_t s = 1; s <= S; ++s)
      for (size_t b = s; b <= B; ++b)
        for (size_t a = s - 1; a < b; ++a) {
          if (best[s - 1][a] == inf) continue;
          const double cost = prefix[b] - prefix[a] + (s == 1 ? before : 0) + (s == S && b == B ? after : 0);
          const double worst = std::max(best[s - 1][a], cost);
          if (worst < best[s][b]) {  // ties keep the earliest cut: later stages take the rest
            best[s][b] = worst;
            from[s][b] = a;
          }
        }
    counts.assign(S, 0);
    for (size_t s = S, b = B; s > 0; --s) {
      counts[s - 1] = static_cast<int64_t>(b - from[s][b]);
      b = from[s][b];
    }
  }
  std::vector<StageSpan> spans(static_cast<size_t>(stages));
  int next = 0;
  for (int s = 0; s < stages; ++s) {
    StageSpan &sp = spans[static_cast<size_t>(s)];
    sp.first_block = next;
    sp.last_block = next + static_cast<int>(counts[static_cast<size_t>(s)]) - 1;
    for (int b = sp.first_block; b <= sp.last_block; ++b) sp.flops += block_flops[static_cast<size_t>(b)];
    if (s == 0) sp.flops += before;
    if (s == stages - 1) sp.flops += after;
    next = sp.last_block + 1;
  }
  return spans;
}

// ------------------------------------------------------------------------------------------
// Building

namespace {

Task fwd(int stage, int64_t mb) { return {stage, mb, TaskPhase::Forward}; }
Task bwd(int stage, int64_t mb) { return {stage, mb, TaskPhase::Backward}; }

// Backwards run in micro-batch order: the gradient accumulates in that order on
// every stage, so any schedule sums a parameter's gradient in the same order
// as the one-stage step does.
std::vector<Task> gpipe_order(int stage, int64_t m) {
  std::vector<Task> out;
  for (int64_t i = 0; i < m; ++i) out.push_back(fwd(stage, i));
  for (int64_t i = 0; i < m; ++i) out.push_back(bwd(stage, i));
  return out;
}

// Stage s runs p - 1 - s forwards ahead (the later stages need them to start),
// then alternates one forward and one backward, then drains the backwards.
std::vector<Task> one_f_one_b_order(int stage, int stages, int64_t m) {
  std::vector<Task> out;
  const int64_t warm = std::min<int64_t>(stages - 1 - stage, m);
  int64_t next_f = 0, next_b = 0;
  for (; next_f < warm; ++next_f) out.push_back(fwd(stage, next_f));
  while (next_f < m) {
    out.push_back(fwd(stage, next_f++));
    out.push_back(bwd(stage, next_b++));
  }
  while (next_b < m) out.push_back(bwd(stage, next_b++));
  return out;
}

// Interleaved 1F1B on rank r of p with v chunks: the k-th forward is chunk
// (k / p) % v of micro-batch (k / (p v)) p + k % p, the k-th backward the same
// with the chunks counted down; (p - 1 - r) * 2 + (v - 1) * p forwards first,
// then one forward and one backward in turn, then the remaining backwards.
std::vector<Task> interleaved_order(int stage, int stages, int64_t m, int v) {
  const int64_t p = stages, total = m * v;
  auto nth = [&](int64_t k, bool forward) {
    const int64_t within = k % (p * v);
    const int chunk = static_cast<int>(within / p);
    Task t{stage, (k / (p * v)) * p + within % p, forward ? TaskPhase::Forward : TaskPhase::Backward,
           forward ? chunk : v - 1 - chunk};
    return t;
  };
  std::vector<Task> out;
  const int64_t warm = std::min<int64_t>((p - 1 - stage) * 2 + (v - 1) * p, total);
  int64_t next_f = 0, next_b = 0;
  for (; next_f < warm; ++next_f) out.push_back(nth(next_f, true));
  while (next_f < total) {
    out.push_back(nth(next_f++, true));
    out.push_back(nth(next_b++, false));
  }
  while (next_b < total) out.push_back(nth(next_b++, false));
  return out;
}

}  // namespace

int64_t task_time(const Schedule &s, int stage, TaskPhase phase) {
  if (phase == TaskPhase::Forward) return 1;
  if (!s.split_backward()) return 2;
  // Stage 0's inputs are the data: it has no input gradient to compute.
  if (stage == 0) return phase == TaskPhase::Backward ? 0 : 2;
  return 1;
}

namespace {

// Plays the pipeline with the tasks' times of task_time: whenever a stage is
// free it starts a ready B (its forward done, the next stage's B of the
// micro-batch done), else a ready forward if fewer than p are without their B
// and fewer than p + 1 without their W, else its oldest W whose B is done.
// Each kind of task runs in micro-batch order on a stage.
std::vector<std::vector<Task>> zero_bubble_order(const Schedule &s) {
  const int p = s.stages;
  const int64_t m = s.micro_batches;
  const size_t P = static_cast<size_t>(p);
  constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> f_end(P, std::vector<int64_t>(static_cast<size_t>(m), kNever)), b_end = f_end;
  std::vector<int64_t> nf(P, 0), nb(P, 0), nw(P, 0), busy(P, 0);
  std::vector<std::vector<Task>> out(P);
  for (int64_t t = 0;; ++t) {
    bool all_done = true;
    for (int i = 0; i < p; ++i) {
      const size_t I = static_cast<size_t>(i);
      while (busy[I] <= t) {  // (a task of no time lets the next start at once)
        int64_t j = nb[I];
        if (j < nf[I] && f_end[I][static_cast<size_t>(j)] <= t &&
            (i == p - 1 || b_end[I + 1][static_cast<size_t>(j)] <= t)) {
          b_end[I][static_cast<size_t>(j)] = busy[I] = t + task_time(s, i, TaskPhase::Backward);
          ++nb[I];
          out[I].push_back(bwd(i, j));
          continue;
        }
        j = nf[I];
        if (j < m && nf[I] - nb[I] < p && nf[I] - nw[I] < p + 1 &&
            (i == 0 || f_end[I - 1][static_cast<size_t>(j)] <= t)) {
          f_end[I][static_cast<size_t>(j)] = busy[I] = t + task_time(s, i, TaskPhase::Forward);
          ++nf[I];
          out[I].push_back(fwd(i, j));
          continue;
        }
        if (nw[I] < nb[I] && b_end[I][static_cast<size_t>(nw[I])] <= t) {
          busy[I] = t + task_time(s, i, TaskPhase::Weight);
          out[I].push_back({i, nw[I]++, TaskPhase::Weight});
          continue;
        }
        break;
      }
      if (nw[I] < m) all_done = false;
    }
    if (all_done) break;
    // Some stage starts a task at least every 2 units (the play is a valid
    // pipeline), so this ends within 6 * m * p units.
    CTR_CHECK(t <= 6 * m * p + 6);
  }
  return out;
}

}  // namespace

Schedule build_schedule(ScheduleKind kind, int stages, int64_t micro_batches, int virtual_stages) {
  CTR_REQUIRE(stages >= 1, CTR_STATUS_INVALID_OPTION, "pipeline: %d stages (at least 1 is needed)", stages);
  CTR_REQUIRE(micro_batches >= 1, CTR_STATUS_INVALID_OPTION,
              "pipeline: %lld micro-batches (at least 1 is needed)", static_cast<long long>(micro_batches));
  CTR_REQUIRE(kind != ScheduleKind::OneFOneB || micro_batches >= stages, CTR_STATUS_INVALID_OPTION,
              "pipeline schedule 1f1b needs at least as many micro-batches as stages: %lld micro-batch(es) "
              "for %d stages (raise micro_batches to %d or more, or choose gpipe)",
              static_cast<long long>(micro_batches), stages, stages);
  if (kind != ScheduleKind::Interleaved) {
    CTR_REQUIRE(virtual_stages == 1, CTR_STATUS_INVALID_OPTION,
                "option 'pp_virtual': %d virtual stages per rank need pp_schedule interleaved (schedule %s runs "
                "one stage per rank)",
                virtual_stages, schedule_kind_name(kind));
  } else {
    CTR_REQUIRE(stages >= 2, CTR_STATUS_INVALID_OPTION,
                "pipeline schedule interleaved needs at least 2 stages (pp), not %d", stages);
    CTR_REQUIRE(virtual_stages >= 2, CTR_STATUS_INVALID_OPTION,
                "pipeline schedule interleaved needs at least 2 virtual stages per rank (option 'pp_virtual'), "
                "not %d",
                virtual_stages);
    CTR_REQUIRE(micro_batches % stages == 0, CTR_STATUS_INVALID_OPTION,
                "pipeline schedule interleaved runs micro-batches in groups of one per stage: %lld micro-batch(es) "
                "is not a multiple of %d stages",
                static_cast<long long>(micro_batches), stages);
  }
  Schedule s;
  s.kind = kind;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.virtual_stages = virtual_stages;
  if (kind == ScheduleKind::ZeroBubble) {
    s.order = zero_bubble_order(s);
  } else if (kind == ScheduleKind::Interleaved) {
    for (int st = 0; st < stages; ++st) s.order.push_back(interleaved_order(st, stages, micro_batches, virtual_stages));
  } else {
    for (int st = 0; st < stages; ++st)
      s.order.push_back(kind == ScheduleKind::GPipe ? gpipe_order(st, micro_batches)
                                                    : one_f_one_b_order(st, stages, micro_batches));
  }
  check_schedule(s);
  return s;
}

SchedulePlay play_schedule(const Schedule &s, const std::function<double(const Task &)> &time, double transfer) {
  const int p = s.stages, V = s.virtual_count();
  const size_t M = static_cast<size_t>(s.micro_batches);
  // end[phase][virtual stage][micro-batch], -1 until the task ran
  std::vector<std::vector<std::vector<double>>> end(
      3, std::vector<std::vector<double>>(static_cast<size_t>(V), std::vector<double>(M, -1)));
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<double> free_at(static_cast<size_t>(p), 0);
  SchedulePlay out;
  for (bool moved = true; moved;) {
    moved = false;
    for (int st = 0; st < p; ++st) {
      const size_t S = static_cast<size_t>(st);
      while (next[S] < s.order[S].size()) {
        const Task &t = s.order[S][next[S]];
        const size_t mb = static_cast<size_t>(t.micro_batch);
        const int vs = t.chunk * p + st;
        double ready = free_at[S];
        auto after = [&](TaskPhase ph, int v, double extra) {
          const double e = end[static_cast<size_t>(ph)][static_cast<size_t>(v)][mb];
          if (e < 0) return false;
          ready = std::max(ready, e + extra);
          return true;
        };
        bool ok = true;
        if (t.phase == TaskPhase::Forward) {
          if (vs > 0) ok = after(TaskPhase::Forward, vs - 1, transfer);
        } else if (t.phase == TaskPhase::Backward) {
          ok = after(TaskPhase::Forward, vs, 0) && (vs == V - 1 || after(TaskPhase::Backward, vs + 1, transfer));
        } else {
          ok = after(TaskPhase::Backward, vs, 0);
        }
        if (!ok) break;
        const double cost = time(t);
        free_at[S] = end[static_cast<size_t>(t.phase)][static_cast<size_t>(vs)][mb] = ready + cost;
        out.busy += cost;
        out.span = std::max(out.span, free_at[S]);
        ++next[S];
        moved = true;
      }
    }
  }
  return out;
}

double schedule_bubble(const Schedule &s) {
  const SchedulePlay r =
      play_schedule(s, [&](const Task &t) { return static_cast<double>(task_time(s, t.stage, t.phase)); });
  return r.span > 0 ? 1.0 - r.busy / (r.span * s.stages) : 0.0;
}

Schedule pass_schedule(const Graph &g, const CompileOptions &opt) {
  const int64_t stages = opt.mesh.size("pp");
  CTR_REQUIRE(stages <= (1 << 16), CTR_STATUS_INVALID_OPTION, "pipeline: %lld stages", static_cast<long long>(stages));
  Schedule s = build_schedule(opt.pp_schedule, static_cast<int>(stages), opt.micro_batches, opt.pp_virtual);
  if (stages > 1 || !opt.pp_stages.empty()) s.spans = cut_stages(g, s.virtual_count(), opt.pp_stages, s.virtual_stages);
  return s;
}

// ------------------------------------------------------------------------------------------
// Playing

void check_schedule(Schedule &s) {
  const int p = s.stages, v = s.virtual_stages, V = s.virtual_count();
  const int64_t m = s.micro_batches;
  CTR_REQUIRE(static_cast<int>(s.order.size()) == p, CTR_STATUS_INVALID_OPTION,
              "pipeline schedule: %zu task lists for %d stages", s.order.size(), p);
  const bool split = s.split_backward(), chunks = v > 1;
  const int64_t per_mb = (split ? 3 : 2) * v;
  // done[phase][virtual stage][mb]
  std::vector<std::vector<std::vector<char>>> done(
      3, std::vector<std::vector<char>>(static_cast<size_t>(V), std::vector<char>(static_cast<size_t>(m), 0)));
  auto is_done = [&](TaskPhase ph, int vs, int64_t mb) {
    return done[static_cast<size_t>(ph)][static_cast<size_t>(vs)][static_cast<size_t>(mb)] != 0;
  };
  for (int st = 0; st < p; ++st) {
    const auto &list = s.order[static_cast<size_t>(st)];
    CTR_REQUIRE(static_cast<int64_t>(list.size()) == per_mb * m, CTR_STATUS_INVALID_OPTION,
                "pipeline schedule: stage %d has %zu tasks, not %lld (%s per micro-batch%s)", st, list.size(),
                static_cast<long long>(per_mb * m),
                split ? "a forward, a backward and a weight-gradient task" : "a forward and a backward",
                chunks ? " and chunk" : "");
    std::vector<char> seen(static_cast<size_t>(3 * m * v), 0);
    for (const Task &t : list) {
      CTR_REQUIRE(t.stage == st && t.micro_batch >= 0 && t.micro_batch < m && t.chunk >= 0 && t.chunk < v &&
                      (split || t.phase != TaskPhase::Weight),
                  CTR_STATUS_INVALID_OPTION, "pipeline schedule: stage %d lists task %s of stage %d, out of place", st,
                  task_text(t, chunks).c_str(), t.stage);
      char &once = seen[static_cast<size_t>((t.micro_batch * 3 + static_cast<int64_t>(t.phase)) * v + t.chunk)];
      CTR_REQUIRE(!once, CTR_STATUS_INVALID_OPTION, "pipeline schedule: stage %d lists %s twice", st,
                  task_text(t, chunks).c_str());
      once = 1;
    }
  }
  // Per stage: the newest micro-batch started, the oldest not finished (all
  // its last tasks, B or split W, run) and how many of each's last tasks ran.
  const TaskPhase last_phase = split ? TaskPhase::Weight : TaskPhase::Backward;
  std::vector<size_t> next(static_cast<size_t>(p), 0);
  std::vector<int64_t> newest(static_cast<size_t>(p), -1), oldest(static_cast<size_t>(p), 0);
  std::vector<std::vector<int>> finished(static_cast<size_t>(p), std::vector<int>(static_cast<size_t>(m), 0));
  s.in_flight.assign(static_cast<size_t>(p), 0);
  for (;;) {
    bool moved = false, all_done = true;
    for (int st = 0; st < p; ++st) {
      const size_t S = static_cast<size_t>(st);
      const auto &list = s.order[S];
      size_t &i = next[S];
      // Run every task of this stage whose inputs are there.
      while (i < list.size()) {
        const Task &t = list[i];
        const int vs = t.chunk * p + st;
        const bool ready =
            t.phase == TaskPhase::Forward  ? vs == 0 || is_done(TaskPhase::Forward, vs - 1, t.micro_batch)
            : t.phase == TaskPhase::Weight ? is_done(TaskPhase::Backward, vs, t.micro_batch)
                                           : is_done(TaskPhase::Forward, vs, t.micro_batch) &&
                                                 (vs == V - 1 || is_done(TaskPhase::Backward, vs + 1, t.micro_batch));
        if (!ready) break;
        done[static_cast<size_t>(t.phase)][static_cast<size_t>(vs)][static_cast<size_t>(t.micro_batch)] = 1;
        // A micro-batch's activations are held from its first forward on the
        // stage to the last task reading them: its W when the backward is split.
        if (t.phase == TaskPhase::Forward) newest[S] = std::max(newest[S], t.micro_batch);
        if (t.phase == last_phase) ++finished[S][static_cast<size_t>(t.micro_batch)];
        while (oldest[S] < m && finished[S][static_cast<size_t>(oldest[S])] == v) ++oldest[S];
        s.in_flight[S] = std::max(s.in_flight[S], newest[S] - std::min(oldest[S], newest[S] + 1) + 1);
        ++i;
        moved = true;
      }
      if (i < list.size()) all_done = false;
    }
    if (all_done) return;
    if (!moved) break;
  }
  std::string stuck;
  for (int st = 0; st < p; ++st) {
    const size_t i = next[static_cast<size_t>(st)];
    if (i == s.order[static_cast<size_t>(st)].size()) continue;
    const Task &t = s.order[static_cast<size_t>(st)][i];
    const int vs = t.chunk * p + st;
    std::string on;
    if (t.phase == TaskPhase::Backward && !is_done(TaskPhase::Forward, vs, t.micro_batch))
      on = "its own " + task_text({st, t.micro_batch, TaskPhase::Forward, t.chunk}, chunks);
    else if (t.phase == TaskPhase::Weight)
      on = "its own " + task_text({st, t.micro_batch, TaskPhase::Backward, t.chunk}, chunks);
    else
      on = strformat("stage %d", (t.phase == TaskPhase::Forward ? vs - 1 + V : vs + 1) % p);
    stuck += strformat("%sstage %d waits in %s for %s", stuck.empty() ? "" : "; ", st,
                       task_text(t, chunks).c_str(), on.c_str());
  }
  fail(CTR_STATUS_INVALID_OPTION,
       strformat("pipeline schedule %s (%d stages, %lld micro-batches) cannot run to the end: %s",
                 schedule_kind_name(s.kind), p, static_cast<long long>(m), stuck.c_str()));
}

}  // namespace ctr
