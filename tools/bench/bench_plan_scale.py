#!/usr/bin/python3
"""The planner at scale: the plan it ranks first for Llama-3 shapes and a 64-expert MoE on
8 to 4096 H100s, and how long the search takes on this machine.

    /usr/bin/python3 tools/bench/bench_plan_scale.py --ctr build/tools/ctr --cluster profiles/h100-node.json

Each model is built with `ctr graph build` (its shape below; a graph file holds no weights)
and planned with `ctr plan --world N --global-batch 512 --seq 8192` (4M tokens per step).
Prints one markdown row per model and world: the first plan (mesh, schedule, micro-batches,
recompute, cp mode), its predicted step time, tokens/s, MFU and memory per device, the
candidates and how many were compiled, and the search's wall time. These are predictions
from the profile's numbers, not runs. Nothing is asserted.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True

import bench_gpt  # noqa: E402  (find_ctr)

VOCAB = 128256
MODELS = {
    "llama3-8b": ["--preset", "llama", "--layers", "32", "--dim", "4096", "--heads", "32", "--kv-heads", "8",
                  "--ffn-dim", "14336"],
    "llama3-70b": ["--preset", "llama", "--layers", "80", "--dim", "8192", "--heads", "64", "--kv-heads", "8",
                   "--ffn-dim", "28672"],
    "llama3-405b": ["--preset", "llama", "--layers", "126", "--dim", "16384", "--heads", "128", "--kv-heads", "8",
                    "--ffn-dim", "53248"],
    "moe-64x": ["--preset", "moe", "--layers", "24", "--dim", "2048", "--heads", "16", "--experts", "64",
                "--top-k", "8", "--ffn-dim", "1024"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctr", default="build/tools/ctr")
    ap.add_argument("--cluster", default=str(HERE.parent.parent / "profiles" / "h100-node.json"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="8,64,512,4096")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per search before it is given up")
    a = ap.parse_args()
    ctr = str(bench_gpt.find_ctr(a.ctr))
    print("| model | devices | first plan | predicted step | tokens/s | MFU | GiB/device | candidates (compiled) "
          "| search |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            graph = os.path.join(tmp, f"{name}.ctrg")
            built = subprocess.run([ctr, "graph", "build", *MODELS[name], "--vocab", str(VOCAB), "--seq",
                                    str(a.seq), "-o", graph], capture_output=True, text=True, check=True)
            print(f"<!-- {built.stdout.strip()} -->", flush=True)
            for world in (int(w) for w in a.worlds.split(",")):
                t0 = time.monotonic()
                try:
                    p = subprocess.run([ctr, "plan", graph, "--cluster", a.cluster, "--world", str(world),
                                        "--global-batch", str(a.global_batch), "--seq", str(a.seq), "--top", "1",
                                        "--json"], capture_output=True, text=True, timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    print(f"| {name} | {world} | (search not finished in {a.timeout:.0f} s) | | | | | | |", flush=True)
                    continue
                wall = time.monotonic() - t0
                if p.returncode != 0:
                    print(f"| {name} | {world} | error: {p.stderr.strip()[:200]} | | | | | | |", flush=True)
                    continue
                r = json.loads(p.stdout)
                best = r["plans"][0] if r["plans"] else None
                counts = f"{r['candidates']} ({r['compiled']})"
                if not best or not best["feasible"]:
                    why = best["why"] if best else "no candidates"
                    print(f"| {name} | {world} | none feasible: {why[:160]} | | | | | {counts} | {wall:.1f} s |",
                          flush=True)
                    continue
                layout = (f"{best['mesh']}, {best['schedule']}, {best['micro_batches']}×{best['batch']}, "
                          f"recompute {best['recompute']}" + (f", {best['cp_mode']}" if "cp_mode" in best else ""))
                print(f"| {name} | {world} | {layout} | {best['step_ms'] / 1000:.2f} s | {best['tokens_per_s']:,.0f} "
                      f"| {100 * best['mfu']:.1f}% | {best['memory_bytes'] / 2**30:.1f} | {counts} | {wall:.1f} s |",
                      flush=True)


if __name__ == "__main__":
    main()
