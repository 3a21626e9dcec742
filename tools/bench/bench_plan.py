#!/usr/bin/python3
"""The planner's predictions against measured steps on this machine.

    /usr/bin/python3 tools/bench/bench_plan.py --ctr build/tools/ctr --cluster profiles/cpu-2core.json

For the gpt and llama presets (L=4 C=256 H=4 T=128) on 1 and 2 ranks (one compute thread per rank,
CTR_NUM_THREADS=1), `ctr plan --json` lists every layout; each feasible plan is run with `ctr launch`
for --steps steps and its median step time (steps after the first) and peak memory per rank
(ctr_step_memory, the metrics' peak_bytes, rank 0's: the first stage's) are set beside the
prediction. Prints per plan the
predicted and measured step time and their error, and the median and p90 absolute error, the
share of plans within 10%, the memory error, Kendall's tau between the predicted and measured
rankings, and how far the plan ranked first is from the fastest measured. Nothing is asserted.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True

import bench_gpt  # noqa: E402  (find_ctr)


def kendall_tau(a, b):
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x > 0) - (x < 0) if y > 0 else ((x < 0) - (x > 0) if y < 0 else 0)
    return s / (n * (n - 1) / 2) if n > 1 else 1.0


def measure(ctr, graph, plan, world, steps, tmp):
    metrics = os.path.join(tmp, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    mesh = "fsdp=1" if plan["mesh"] == "single" else plan["mesh"]
    args = [ctr, "run", graph, "--mesh", mesh, "--steps", str(steps), "--batch", str(plan["batch"]),
            "--micro-batches", str(plan["micro_batches"]), "--recompute", plan["recompute"], "--log-every", "0",
            "--metrics", metrics, "--precision", "fp32"]
    if "pp=" in mesh:
        args += ["--pp-schedule", plan["schedule"]]
    if "cp_mode" in plan:
        args += ["--cp-mode", plan["cp_mode"]]
    cmd = [ctr, "launch", "-n", str(world), "--"] + args if world > 1 else args
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, CTR_NUM_THREADS="1"))
    lines = [json.loads(line) for line in open(metrics)]
    return statistics.median(d["step_ms"] for d in lines[1:]), lines[-1]["peak_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctr", default="build/tools/ctr")
    ap.add_argument("--cluster", default=str(HERE.parent.parent / "profiles" / "cpu-2core.json"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ctr = bench_gpt.find_ctr(a.ctr)
    if ctr is None:
        sys.exit(f"no ctr tool at {a.ctr} (build it, or give --ctr)")
    ctr = str(ctr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("gpt", "llama"):
            graph = os.path.join(tmp, f"{preset}.ctrg")
            subprocess.run([ctr, "graph", "build", "--preset", preset, "--layers", "4", "--dim", "256", "--heads",
                            "4", "--seq", "128", "-o", graph], check=True, capture_output=True)
            for world in (1, 2):
                out = subprocess.run([ctr, "plan", graph, "--cluster", a.cluster, "--world", str(world),
                                      "--global-batch", str(a.global_batch), "--json", "--no-prune"], capture_output=True,
                                     text=True, check=True).stdout
                for plan in json.loads(out)["plans"]:
                    if not plan["feasible"]:
                        continue
                    ms, peak = measure(ctr, graph, plan, world, a.steps, tmp)
                    r = dict(preset=preset, world=world, mesh=plan["mesh"], schedule=plan["schedule"],
                             micro=plan["micro_batches"], recompute=plan["recompute"],
                             cp_mode=plan.get("cp_mode", ""),
                             predicted_ms=plan["step_ms"], measured_ms=ms,
                             predicted_bytes=plan["stages"][0]["memory_bytes"], measured_bytes=peak)
                    r["error"] = r["predicted_ms"] / ms - 1
                    rows.append(r)
                    print(f"{preset:6} {world} {plan['mesh']:10} {plan['schedule']:5} {r['cp_mode']:7} "
                          f"m={plan['micro_batches']:<2} "
                          f"{plan['recompute']:5} predicted {r['predicted_ms']:8.1f} ms measured {ms:8.1f} ms "
                          f"({r['error']:+.1%}); memory {r['predicted_bytes'] / 2**20:.2f} MiB vs "
                          f"{peak / 2**20:.2f} MiB", flush=True)
    errs = sorted(abs(r["error"]) for r in rows)
    print(f"\n{len(rows)} plans: median |error| {statistics.median(errs):.1%}, p90 {errs[int(0.9 * (len(errs) - 1))]:.1%}, "
          f"within 10%: {sum(e <= 0.10 for e in errs) / len(errs):.0%}; "
          f"memory exact in {sum(r['predicted_bytes'] == r['measured_bytes'] for r in rows)} of {len(rows)}")
    for preset in ("gpt", "llama"):
        for world in (1, 2):
            sel = [r for r in rows if r["preset"] == preset and r["world"] == world]
            if len(sel) < 2:
                continue
            tau = kendall_tau([r["predicted_ms"] for r in sel], [r["measured_ms"] for r in sel])
            first = min(sel, key=lambda r: r["predicted_ms"])
            best = min(r["measured_ms"] for r in sel)
            print(f"{preset} on {world} rank(s): Kendall tau {tau:+.2f}; the plan ranked first "
                  f"({first['mesh']} {first['schedule']} m={first['micro']} {first['recompute']}) measured "
                  f"{first['measured_ms'] / best - 1:+.1%} from the fastest")
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
