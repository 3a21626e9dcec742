#!/usr/bin/python3
"""Tensor and context parallelism against FSDP at the same world size and global batch, on the CPU.

    /usr/bin/python3 tools/bench/bench_tp.py                  # gpt L=4 C=256 H=8 T=256, global batch 8
    /usr/bin/python3 tools/bench/bench_tp.py --ctr build/tools/ctr --steps 12 --json out.json

For each world size (2 and 4) the peer is fsdp=W; the meshes measured against it are tp=W
(and fsdp=2 x tp=2 at W=4), each also with sequence parallelism ("+sp"), and cp=W with keys
and values gathered, with heads exchanged all-to-all ("+ulysses") and with keys and values
passed around the ring ("+ring"). Per mesh, rank 0's
figures:
  - planned memory: the activation arena and the parameter bytes from `ctr graph inspect
    --after plan_memory` (gradients take as many bytes as parameters, AdamW twice as many),
    next to the parameter bytes computed by hand: fsdp divides every parameter by its size;
    tp divides the attention and MLP weights (12 C^2 + 7 C per layer with biases, GPT-2 style)
    and the token embedding (tied to the vocabulary-parallel head), and leaves the position
    embedding, norms and row-parallel biases whole;
  - the bytes over tp per micro-batch that `inspect --after place` reports, next to
    Megatron's textbook volume: 4 all-reduces of B*T*C floats per layer, or with sequence
    parallelism 4 all-gathers and 4 reduce-scatters of B*T*C floats per layer, one pair at
    the vocabulary-parallel head, and each region's input (2 per layer and the head's)
    gathered again in backward for the weight gradients (whole-tensor bytes: each moves half
    of what an all-reduce of the same tensor moves on the wire);
  - the bytes over cp per micro-batch that `inspect --after place` reports (gathered keys
    and values, or what the all-to-alls send to other ranks), next to the volume counted by
    hand: gather, 2 B T C floats per layer (every rank's k and v); ulysses, 4 exchanges (q,
    k, v, the output) per layer of (cp-1)/cp of this rank's B T/cp C floats; ring, cp-1
    shifts of this rank's k and v (B T/cp C floats each) per layer;
  - the median step time of `ctr launch -n W -- ctr run --mesh M` over --steps steps (the
    first --warmup skipped), and its ratio to the peer's (--steps 0: memory and bytes only).
Nothing is asserted: the figures are printed (and written with --json) for BENCHMARKS.md.
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


def sizes(mesh):
    return dict((k, int(v)) for k, v in (a.split("=") for a in mesh.split(",")))


def inspect(ctr, graph, after, mesh, batch, sp=False, cp_mode=None):
    s = sizes(mesh)
    args = [ctr, "graph", "inspect", graph, "--after", after, "--batch", str(batch)]
    if sp:
        args.append("--sequence-parallel")
    if cp_mode:
        args += ["--cp-mode", cp_mode]
    for axis in ("fsdp", "tp", "cp"):
        if axis in s:
            args += [f"--{axis}", str(s[axis])]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def run(ctr, graph, world, mesh, batch, steps, warmup, threads, tmp, sp=False, cp_mode=None):
    tag = ("_sp" if sp else "") + (f"_{cp_mode}" if cp_mode else "")
    metrics = os.path.join(tmp, f"m_{mesh.replace(',', '_').replace('=', '')}{tag}.jsonl")
    cmd = [ctr, "launch", "-n", str(world), "--", ctr, "run", graph, "--steps", str(steps), "--batch",
           str(batch), "--mesh", mesh, "--log-every", "0", "--metrics", metrics]
    if sp:
        cmd.append("--sequence-parallel")
    if cp_mode:
        cmd += ["--cp-mode", cp_mode]
    env = {**os.environ, "CTR_NUM_THREADS": str(threads)}
    subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, timeout=1800)
    rows = [json.loads(line) for line in open(metrics)][warmup:]
    return statistics.median(r["step_ms"] for r in rows), statistics.median(r["comm_ms"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctr", default="build/tools/ctr")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (CTR_NUM_THREADS)")
    ap.add_argument("--json")
    a = ap.parse_args()
    found = bench_gpt.find_ctr(a.ctr)
    if not found:
        sys.exit(f"bench_tp: no ctr program at {a.ctr} (pass --ctr PATH)")
    ctr = str(found)
    tmp = tempfile.mkdtemp(prefix="ctr_bench_tp_")
    graph = os.path.join(tmp, "gpt.ctrg")
    subprocess.run([ctr, "graph", "build", "--preset", "gpt", "--layers", str(a.layers), "--dim", str(a.dim),
                    "--heads", str(a.heads), "--seq", str(a.seq), "--vocab", str(a.vocab), "-o", graph],
                   check=True, capture_output=True)
    L, C, T, V = a.layers, a.dim, a.seq, a.vocab
    total_params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    # q, k, v, o, fc, proj weights; q, k, v, fc biases; the head's weight, tied to the
    # embedding, split over the vocabulary (V divisible by tp here: no padding rows)
    split_params = L * (12 * C * C + 7 * C) + V * C
    print(f"gpt L={L} C={C} H={a.heads} T={T} V={V}, global batch {a.global_batch}, "
          f"{total_params / 1e6:.2f}M parameters, {a.threads} thread(s) per rank")
    print(f"{'mesh':>14} {'arena MiB':>10} {'params MiB':>11} {'by hand':>8} {'state MiB':>10} "
          f"{'tp|cp bytes/mb':>14} {'textbook':>9} {'arena vs':>8} {'step ms':>8} {'comm ms':>8} {'vs fsdp':>8}")
    results = []
    for world, meshes in ((2, ["fsdp=2", "tp=2", "tp=2+sp", "cp=2", "cp=2+ulysses", "cp=2+ring"]),
                          (4, ["fsdp=4", "tp=4", "tp=4+sp", "fsdp=2,tp=2", "fsdp=2,tp=2+sp", "cp=4",
                               "cp=4+ulysses", "cp=4+ring"])):
        peer_ms = peer_arena = None
        for label in meshes:
            mesh, sp = label.split("+")[0], label.endswith("+sp")
            cp_mode = next((m for m in ("ulysses", "ring") if label.endswith("+" + m)), None)
            s = sizes(mesh)
            tp, fsdp, cp = s.get("tp", 1), s.get("fsdp", 1), s.get("cp", 1)
            batch = a.global_batch // (world // (tp * cp))
            plan = inspect(ctr, graph, "plan_memory", mesh, batch, sp, cp_mode)
            arena = int(re.search(r"arena (\d+) bytes", plan).group(1))
            params = int(re.search(r"params (\d+) bytes", plan).group(1))
            hand = 4 * ((total_params - split_params) + split_params / tp) / fsdp
            tp_bytes = textbook = 0
            if tp > 1:
                placed = inspect(ctr, graph, "place", mesh, batch, sp)
                if sp:
                    m = re.search(r"of (\d+) bytes of whole tensors forward and (\d+) backward", placed)
                    again = re.search(r"gathers each region's input again for its weight gradients "
                                      r"\(\d+ all-gathers, (\d+) bytes\)", placed)
                    tp_bytes = int(m.group(1)) + int(m.group(2)) + int(again.group(1))
                    # per layer 2 regions, each an all-gather and a reduce-scatter forward, the same
                    # backward and its input gathered again; the head's input likewise
                    textbook = (10 * L + 3) * batch * T * C * 4
                else:
                    m = re.search(r"per micro-batch: \d+ all-reduces over tp, (\d+) bytes", placed)
                    tp_bytes = int(m.group(1))
                    textbook = 4 * L * batch * T * C * 4
            if cp > 1:
                placed = inspect(ctr, graph, "place", mesh, batch, cp_mode=cp_mode)
                tp_bytes = int(re.search(r"\((\d+) bytes per micro-batch", placed).group(1))
                if cp_mode == "ulysses":
                    textbook = 4 * L * (batch * T // cp * C * 4) * (cp - 1) // cp
                elif cp_mode == "ring":
                    textbook = 2 * L * (cp - 1) * (batch * T // cp * C * 4)
                else:
                    textbook = 2 * L * batch * T * C * 4
            step_ms = comm_ms = float("nan")
            if a.steps > 0:
                step_ms, comm_ms = run(ctr, graph, world, mesh, batch, a.steps, a.warmup, a.threads, tmp, sp,
                                       cp_mode)
            if peer_ms is None:
                peer_ms, peer_arena = step_ms, arena
            state = arena + 4 * params  # params, gradients, AdamW m and v
            row = dict(world=world, mesh=label, batch_per_rank=batch, arena_bytes=arena, param_bytes=params,
                       param_bytes_by_hand=hand, state_bytes=state, axis_bytes_per_micro_batch=tp_bytes,
                       textbook_bytes=textbook, arena_vs_fsdp=arena / peer_arena, step_ms=step_ms, comm_ms=comm_ms,
                       vs_fsdp=step_ms / peer_ms)
            results.append(row)
            print(f"{label:>14} {arena / 2**20:10.1f} {params / 2**20:11.2f} {hand / 2**20:8.2f} "
                  f"{state / 2**20:10.1f} {tp_bytes:14d} {textbook:9d} {arena / peer_arena:7.2f}x "
                  f"{step_ms:8.1f} {comm_ms:8.1f} "
                  f"{step_ms / peer_ms:7.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(config=vars(a), results=results), f, indent=1)


if __name__ == "__main__":
    main()
