#!/usr/bin/python3
"""Pipeline schedules against GPipe on the CPU: bubble, step time and activation memory.

    /usr/bin/python3 tools/bench/bench_pipeline.py             # gpt L=8 C=256 H=4 T=128, 8 micro-batches
    /usr/bin/python3 tools/bench/bench_pipeline.py --ctr build/tools/ctr --steps 6 --json out.json

For pp=2 and pp=4 and each schedule (gpipe, the peer, 1f1b, zb and interleaved with 2 chunks
per rank) with --micro-batches
micro-batches of --batch rows, `ctr launch -n P -- ctr run --mesh pp=P --trace` runs
--steps steps, one thread per rank. From the trace (every step but the first):
  - the measured bubble (the share of a step's span a rank is outside its own
    forwards, backwards and weight-gradient tasks, mean over the ranks) beside the
    schedule's arithmetic as `ctr graph inspect --after schedule` prints it
    ((p - 1) / (m + p - 1) for gpipe and 1f1b, near (p - 1) / (3m + p - 1) for zb,
    (p - 1) / (2m + p - 1) for interleaved);
  - the step time (span of a step's tasks over the ranks), and its ratio to gpipe's;
  - the simulated step time: the schedule played with each stage's (and chunk's) median
    measured forward, backward and weight-gradient times, sends free (what the schedule costs on ranks that do
    not share cores);
  - the activation memory per stage: the planned arena times the micro-batches the
    schedule keeps in flight there (`ctr graph inspect --after schedule`, `--after
    plan_memory` of each stage's rank).
With 4 ranks on a 2-core machine the processes are oversubscribed: the measured pp=4
figures include waiting for a core, the simulated ones do not. Nothing is asserted.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True

import bench_gpt  # noqa: E402  (find_ctr)


def schedule_orders(ctr, graph, pp, micro, schedule):
    out = subprocess.run([ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", str(pp), "--micro-batches",
                          str(micro), "--pp-schedule", schedule], capture_output=True, text=True, check=True).stdout
    orders, in_flight = [], []
    arithmetic = float(re.search(r"\nbubble ([\d.]+)%", out).group(1)) / 100
    for line in out.splitlines():
        m = re.match(r"stage (\d+): (.*) \((\d+) in flight\)", line)
        if m:
            orders.append(m.group(2).split())
            in_flight.append(int(m.group(3)))
    return orders, in_flight, arithmetic


def arena_mib(ctr, graph, pp, rank, batch, schedule):
    out = subprocess.run([ctr, "graph", "inspect", graph, "--after", "plan_memory", "--pp", str(pp), "--rank",
                          str(rank), "--batch", str(batch), "--micro-batches", str(pp), "--pp-schedule", schedule],
                         capture_output=True, text=True, check=True).stdout
    return float(re.search(r"arena \d+ bytes \(([\d.]+) MiB", out).group(1))


def parse_task(name):
    """"F3" -> ("F", 3, 0); "B1c1" (interleaved: on the rank's chunk 1) -> ("B", 1, 1)."""
    m = re.fullmatch(r"([FBW])(\d+)(?:c(\d+))?", name)
    return m.group(1), int(m.group(2)), int(m.group(3) or 0)


def simulate(orders, times):
    """Makespan of playing the schedule with per-stage (and chunk) task times, sends free.
    Virtual stage c * p + s is stage s's chunk c (one chunk without interleaving)."""
    p = len(orders)
    chunks = 1 + max(parse_task(t)[2] for t in orders[0])
    last = chunks * p - 1
    done = {}
    clock = [0.0] * p
    pos = [0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, mb, c = parse_task(orders[s][pos[s]])
                vs = c * p + s
                need = [(vs - 1, "F", mb)] if kind == "F" and vs > 0 else []
                if kind == "B":
                    need = [(vs, "F", mb)] + ([(vs + 1, "B", mb)] if vs < last else [])
                if kind == "W":
                    need = [(vs, "B", mb)]
                if any(n not in done for n in need):
                    break
                start = max([clock[s]] + [done[n] for n in need])
                clock[s] = start + times[kind][(s, c)]
                done[(vs, kind, mb)] = clock[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("schedule does not run to the end")
    return max(clock)


def measure(ctr, graph, pp, micro, batch, steps, schedule, tmp):
    trace = os.path.join(tmp, f"trace_{pp}_{schedule}.json")
    env = dict(os.environ, CTR_NUM_THREADS="1")
    subprocess.run([ctr, "launch", "-n", str(pp), "--", ctr, "run", graph, "--mesh", f"pp={pp}", "--steps",
                    str(steps), "--batch", str(batch), "--micro-batches", str(micro), "--pp-schedule", schedule,
                    "--log-every", "0", "--trace", trace], capture_output=True, text=True, check=True, env=env)
    events = [e for e in json.load(open(trace))["traceEvents"] if e["ph"] == "X"]
    spans, busy = {}, {}
    kinds = {"forward": "F", "backward": "B", "weight": "W"}
    durs = {k: {} for k in kinds.values()}  # kind -> (stage, chunk) -> durations
    for e in events:
        step = e["args"]["step"]
        if step == 1 or e["cat"] not in kinds:
            continue
        lo, hi = spans.get(step, (e["ts"], e["ts"] + e["dur"]))
        spans[step] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
        busy[(step, e["pid"])] = busy.get((step, e["pid"]), 0) + e["dur"]
        chunk = parse_task(e["name"])[2]
        durs[kinds[e["cat"]]].setdefault((e["args"]["stage"], chunk), []).append(e["dur"])
    idle = total = 0.0
    for step, (lo, hi) in spans.items():
        for r in range(pp):
            idle += (hi - lo) - busy.get((step, r), 0)
            total += hi - lo
    step_ms = statistics.median(hi - lo for lo, hi in spans.values()) / 1000
    orders, in_flight, arithmetic = schedule_orders(ctr, graph, pp, micro, schedule)
    chunks = 2 if schedule == "interleaved" else 1
    times = {k: {(s, c): statistics.median(d[(s, c)]) / 1000 if d.get((s, c)) else 0.0
                 for s in range(pp) for c in range(chunks)} for k, d in durs.items()}
    sim_ms = simulate(orders, times)
    arena = [arena_mib(ctr, graph, pp, s, batch, schedule) for s in range(pp)]
    return {"pp": pp, "schedule": schedule, "micro_batches": micro, "bubble": idle / total,
            "bubble_arithmetic": arithmetic, "step_ms": step_ms, "simulated_ms": sim_ms,
            "activations_mib": [a * k for a, k in zip(arena, in_flight)], "in_flight": in_flight}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctr", default="build/tools/ctr")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ctr = bench_gpt.find_ctr(a.ctr)
    if ctr is None:
        sys.exit(f"no ctr tool at {a.ctr} (build it, or give --ctr)")
    ctr = str(ctr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        graph = os.path.join(tmp, "gpt.ctrg")
        subprocess.run([ctr, "graph", "build", "--preset", "gpt", "--layers", str(a.layers), "--dim", str(a.dim),
                        "--heads", "4", "--seq", str(a.seq), "-o", graph], check=True, capture_output=True)
        print(f"gpt L={a.layers} C={a.dim} T={a.seq}, {a.micro_batches} micro-batches of {a.batch} rows, "
              f"one thread per rank; {os.cpu_count()} cores")
        print(f"{'mesh':6} {'schedule':8} {'bubble':>7} {'(arith.)':>8} {'step ms':>8} {'vs gpipe':>8} "
              f"{'simulated':>9} {'vs gpipe':>8}  activations per stage (MiB)")
        for pp in (2, 4):
            peer = None
            for schedule in ("gpipe", "1f1b", "zb", "interleaved"):
                r = measure(ctr, graph, pp, a.micro_batches, a.batch, a.steps, schedule, tmp)
                peer = peer or r
                rows.append(r)
                print(f"pp={pp:<3} {schedule:8} {r['bubble']:7.1%} {r['bubble_arithmetic']:8.1%} "
                      f"{r['step_ms']:8.1f} {r['step_ms'] / peer['step_ms']:8.2f} {r['simulated_ms']:9.1f} "
                      f"{r['simulated_ms'] / peer['simulated_ms']:8.2f}  "
                      + " ".join(f"{m:.1f}" for m in r["activations_mib"]), flush=True)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
