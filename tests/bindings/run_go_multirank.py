#!/usr/bin/python3
"""A two-rank FSDP run driven from Go through `ctr launch`.

usage: run_go_multirank.py BUILD_DIR

Builds tests/bindings/go_multirank (a Go program that creates its mesh with
ctr.NewMeshFromEnv and mesh=fsdp=2) and runs

    BUILD_DIR/tools/ctr launch -n 2 -- go_multirank fsdp=2 8 STEPS CKPT_DIR

under a hard time limit, then checks that the launcher and both ranks exited
0, that rank 0 printed one loss per step and the loss fell, and that the
collective checkpoint save at the end left a checkpoint. The same program on
one rank (fsdp=1, same global batch) must give the same losses within 1e-5
relative: the design's "N ranks train like one", seen from Go.
Exits 77 (skipped) when no Go toolchain is installed.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xlang_toolchains as tc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TIME_LIMIT = 180  # seconds for one launched job; a hang fails the test instead of blocking CI
STEPS, GLOBAL_BATCH = 8, 8
LOSS = re.compile(r"^\[0\] step (\d+) loss (\S+)$")


def launch(ctr, prog, nprocs, mesh, ckpt, env):
    """Runs one job; returns (losses, stderr, error or None)."""
    cmd = [ctr, "launch", "-n", str(nprocs), "--", prog, mesh, str(GLOBAL_BATCH), str(STEPS)]
    if ckpt:
        cmd.append(ckpt)
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired as e:
        return None, "", f"timed out after {TIME_LIMIT} s: {' '.join(cmd)}\n{e.stderr or ''}"
    if p.returncode != 0:
        return None, p.stderr, (f"exit {p.returncode}: {' '.join(cmd)}\n"
                                f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    losses = []
    for line in p.stdout.splitlines():
        m = LOSS.match(line)
        if m:
            if int(m.group(1)) != len(losses) + 1:
                return None, p.stderr, f"step lines out of order:\n{p.stdout}"
            losses.append(float(m.group(2)))
    return losses, p.stderr + p.stdout, None


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    build = os.path.abspath(sys.argv[1])
    ctr = os.path.join(build, "tools", "ctr")
    go = tc.find_go()
    if go is None:
        print("go_multirank: SKIP: no Go toolchain found; install Go >= 1.19 (apt-get install golang-go)")
        return 77
    work = os.path.join(build, "bindings-out", "multirank")
    prog, err = tc.build_go_bin(build, work, go, os.path.join(HERE, "go_multirank"), "go_multirank")
    if err:
        print(f"go_multirank: build failed: {err}")
        return 1

    env = tc.base_env(build)
    env["CTR_NUM_THREADS"] = "1"  # two ranks on a small machine: one thread each
    tmp = tempfile.mkdtemp(prefix="ctr_go_multirank_")
    failures = []
    try:
        ckpt = os.path.join(tmp, "ckpt")
        two, log, err = launch(ctr, prog, 2, "fsdp=2", ckpt, env)
        if err:
            failures.append(f"2 ranks: {err}")
        else:
            print("2 ranks (fsdp=2):", " ".join(f"{x:.6f}" for x in two))
            for r in (0, 1):
                if f"rank {r} of 2 done" not in log:
                    failures.append(f"rank {r} did not report finishing:\n{log[-3000:]}")
            if len(two) != STEPS:
                failures.append(f"rank 0 printed {len(two)} losses, want {STEPS}")
            elif not two[-1] < two[0]:
                failures.append(f"the loss did not fall: {two}")
            if not os.path.isdir(ckpt) or not os.listdir(ckpt):
                failures.append(f"no checkpoint was written to {ckpt}")

        one, _, err = launch(ctr, prog, 1, "fsdp=1", None, env)
        if err:
            failures.append(f"1 rank: {err}")
        elif two and len(one) == len(two):
            print("1 rank  (fsdp=1):", " ".join(f"{x:.6f}" for x in one))
            worst = max(abs(a - b) / abs(b) for a, b in zip(two, one))
            print(f"max relative difference 2 ranks vs 1: {worst:.2e}")
            if worst > 1e-5:
                failures.append(f"2 ranks differ from 1 by {worst:.2e} relative:\n  {two}\n  {one}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if failures:
        print(f"go_multirank: {len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("go_multirank: 2 ranks from Go trained, checkpointed and matched 1 rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
