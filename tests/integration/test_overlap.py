#!/usr/bin/python3
"""Scheduling changes no bits: the same training job under every schedule of its
collectives, and with activation recompute, gives bitwise the same losses,
gradient norms and final weights.

Schedules: every collective waited for at its issue (overlap=0); collectives
where the shard pass put them (prefetch=0, no deferral); the default (prefetch
1, reduce-scatters deferred); prefetch 2 and 3; prefetch 3 within a small
memory budget; recompute all, and selective with prefetch 2; buckets per block
(the default), none, and by a byte budget (also in place: an all-reduce bucket
over several reduce-scatter buckets must follow the last of them). Meshes: one rank,
fsdp=2, fsdp=4 and dp=2 x fsdp=2, on the gpt preset (2 layers), plus llama on
one rank and on fsdp=2, and moe (its token exchanges on the comm stream) on ep=2 and
ep=2 x fsdp=2; in bf16, gpt on fsdp=2 and llama on dp=2 x fsdp=2 (the shards' bf16 copies
gathered, recomputed statistics kept f32 as the forward's are).

usage: test_overlap.py CTR EQUIV_TRAIN
"""
import os
import subprocess
import sys
import tempfile

CTR, PROG = sys.argv[1], sys.argv[2]
STEPS, BATCH = 6, 8
TIME_LIMIT = 240

SCHEDULES = [
    ("no overlap", "overlap=0"),
    ("in place", "prefetch=0,defer_reduce=0"),
    ("default", ""),
    ("prefetch 2", "prefetch=2"),
    ("prefetch 3 no defer", "prefetch=3,defer_reduce=0"),
    ("prefetch 3 budget", "prefetch=3,memory_budget=60000"),
    ("recompute all", "recompute=all"),
    ("no buckets", "bucket=none"),
    ("buckets of 20 KB", "bucket=bytes,bucket_bytes=20000"),
    ("buckets of 20 KB in place", "bucket=bytes,bucket_bytes=20000,prefetch=0,defer_reduce=0"),
    ("recompute selective, prefetch 2", "recompute=selective,prefetch=2"),
]


def run(preset, nprocs, mesh, out, extra):
    cmd = [CTR, "launch", "-n", str(nprocs), "--", PROG, preset, mesh, str(BATCH), str(STEPS), out,
           "1", "1", extra]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIME_LIMIT} s: {' '.join(cmd)}"
    if p.returncode != 0:
        return None, f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    with open(out) as f:
        return [line.strip() for line in f if not line.startswith("memory")], None


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_overlap_")
    failures = []
    cases = [("gpt", 1, "fsdp=1"), ("gpt", 2, "fsdp=2"), ("gpt", 4, "fsdp=4"), ("gpt", 4, "dp=2,fsdp=2"),
             ("llama", 1, "fsdp=1"), ("llama", 2, "fsdp=2"), ("moe", 2, "ep=2"), ("moe", 4, "ep=2,fsdp=2"),
             # bf16: the shards' bf16 copies are cast at each phase's start and
             # gathered in bf16, wherever the schedule issues the gathers.
             ("gpt", 2, "fsdp=2", "precision=bf16"), ("llama", 4, "dp=2,fsdp=2", "precision=bf16")]
    for preset, n, mesh, *more in cases:
        ref = None
        skipped = False
        for name, extra in SCHEDULES:
            if more:
                extra = ",".join(x for x in (more[0], extra) if x)
            out = os.path.join(tmp, f"{preset}_{mesh.replace(',', '_')}_{name.replace(' ', '_')}{len(more)}.txt")
            lines, err = run(preset, n, mesh, out, extra)
            if err and more and "AVX512_BF16" in err:
                print(f"{preset} {mesh} {more[0]}: skipped, this CPU cannot run bf16")
                skipped = True
                break
            if err:
                failures.append(f"{preset} {mesh} {name}: {err}")
                continue
            # The losses and a parameter checksum (gpt and llama: a second one).
            want = STEPS + (1 if preset == "moe" else 2)
            if len(lines) != want:
                failures.append(f"{preset} {mesh} {name}: {len(lines)} lines, expected {want}")
                continue
            if ref is None:
                ref = (name, lines)
            elif lines != ref[1]:
                diff = next(i for i, (a, b) in enumerate(zip(lines, ref[1])) if a != b)
                failures.append(f"{preset} {mesh}: '{name}' differs from '{ref[0]}' at line {diff}: "
                                f"{lines[diff]} vs {ref[1][diff]}")
        if not skipped:
            print(f"{preset} {mesh}{' ' + more[0] if more else ''}: {len(SCHEDULES)} schedules compared")
    for f in failures:
        print("FAIL:", f)
    print(f"{0 if failures else 1} passed, {1 if failures else 0} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
