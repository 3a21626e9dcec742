#!/usr/bin/python3
"""Two ranks train like one rank: the gpt and llama presets on device cuda,
fsdp=2 against one rank with the same global batch, precision fp32: every
step's loss within 1e-4 relative (the ranks' GEMMs have other shapes, so
cuBLASLt may sum in another order). Two transports: UCX with both ranks sharing
one GPU (collectives staged through host memory), and NCCL (collectives on
device memory), which needs a GPU per rank (NCCL refuses two ranks on one GPU)
and is skipped, saying why, on a machine with fewer. Exits 77 when device cuda
cannot be created.

usage: test_gpu_ranks.py CTR EQUIV_TRAIN
"""
import os
import subprocess
import sys
import tempfile

CTR, PROG = sys.argv[1], sys.argv[2]
STEPS, BATCH, LIMIT = 20, 8, 300
# Another device may be named (with "cpu" the test checks itself).
DEVICE = os.environ.get("CTR_TEST_DEVICE") or "cuda"


def run(preset, nprocs, mesh, out, transport="ucx"):
    env = dict(os.environ, CTR_TEST_DEVICE=DEVICE, CTR_TEST_TRANSPORT=transport)
    cmd = [CTR, "launch", "-n", str(nprocs), "--", PROG, preset, mesh, str(BATCH), str(STEPS), out, "1", "1",
           "precision=fp32"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=env)
    return p.returncode, p.stdout[-3000:] + p.stderr[-3000:]


def gpu_count():
    """GPUs the driver lists (CUDA_VISIBLE_DEVICES applied), 0 when unknown."""
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    n = sum(1 for line in p.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def losses(path):
    return [float(line.split()[0]) for line in open(path) if line.split()[0] not in ("param", "memory")]


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_gpu_ranks_")
    probe = os.path.join(tmp, "probe.txt")
    rc, log = run("gpt", 1, "fsdp=1", probe)
    if rc != 0 and ("cannot serve device 'cuda'" in log or "needs the backend plugin libctr-cuda.so" in log):
        why = [line for line in log.splitlines() if "cuda" in line]
        print("GPU suite skipped:", why[0] if why else log.strip().splitlines()[-1])
        return 77
    failures = []
    transports = ["ucx"]
    gpus = gpu_count()
    if DEVICE != "cuda":
        print(f"transport nccl skipped: device {DEVICE} (nccl needs device cuda)")
    elif gpus < 2:
        print(f"transport nccl skipped: {gpus} GPU(s) visible; fsdp=2 over NCCL needs one GPU per rank "
              "(NCCL refuses two ranks on one GPU)")
    else:
        transports.append("nccl")
    for transport in transports:
        for preset in ("gpt", "llama"):
            one = os.path.join(tmp, f"{preset}_1.txt")
            two = os.path.join(tmp, f"{preset}_2_{transport}.txt")
            before = len(failures)
            for n, mesh, out in ((1, "fsdp=1", one), (2, "fsdp=2", two)):
                rc, log = run(preset, n, mesh, out, transport)
                if rc != 0:
                    failures.append(f"{preset} {mesh} {transport}: exit {rc}\n{log}")
            if len(failures) > before:
                continue
            a, b = losses(one), losses(two)
            if len(a) != STEPS or len(b) != STEPS:
                failures.append(f"{preset} {transport}: {len(a)} and {len(b)} losses, want {STEPS}")
                continue
            for i, (x, y) in enumerate(zip(a, b)):
                if abs(x - y) > 1e-4 * abs(x):
                    failures.append(f"{preset} {transport} step {i}: one rank {x:.7f}, fsdp=2 {y:.7f}")
            print(f"{preset} {transport}: 1 rank {a[0]:.4f} -> {a[-1]:.4f}, fsdp=2 {b[0]:.4f} -> {b[-1]:.4f}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
