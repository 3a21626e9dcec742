#!/usr/bin/python3
"""Communicator bandwidth between two local ranks, next to its peers on this machine.

    bench_comm.py BUILD/tools/bench/bench_comm [--repeat N] [--no-perftest]

Starts two bench_comm ranks (rendezvous on a free loopback port) twice, with
buffers in ordinary memory and in shared host allocations (which the
shared-memory path reads in place, as the CPU backend's parameters, gradients
and arena are), then runs ucx_perftest's tag_bw (UCP tagged send/receive, one
direction, one stream) as server and client at each size on 127.0.0.1, and
prints one table: our all_reduce, all_gather, reduce_scatter and all_to_all_v
bus bandwidth on both kinds of buffers, ucx_perftest's bandwidth, memcpy
bandwidth, and the ratios of the shared-buffer figures to perftest's. Bus bandwidth is what one link carries (NCCL's convention), so it is
comparable with a point-to-point figure; memcpy is the ceiling for moving bytes
through memory here. Also prints the CPU use of an idle communicator.

ucx_perftest runs twice: with UCX's default transports, which on one machine
include CMA (a single-copy read of the peer's memory), and with shared memory
only (UCX_TLS=self,sysv), which is what the communicator's endpoints get: with
peer failure detection and wakeups, UCX 1.13 does not use CMA.

The two ranks share this host, so the communicator takes its shared-memory path;
CTR_SHM=0 in the environment measures the UCX path instead.

Nothing is asserted: figures depend on the machine and its load. Busy-polling
peers suffer badly when other work competes for the cores, so --repeat N runs
everything N times and keeps the best figure of each (the least disturbed).
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
RUN_LIMIT_S = 300


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env():
    env = dict(os.environ)
    env.setdefault("UCX_LOG_LEVEL", "error")
    env.setdefault("UCX_NET_DEVICES", "lo")  # keep any TCP traffic on loopback
    return env


def run_ranks(exe, shared):
    port = free_port()
    procs = []
    for rank in range(2):
        env = base_env()
        env.update(CTR_RANK=str(rank), CTR_WORLD_SIZE="2", CTR_MASTER_ADDR="127.0.0.1",
                   CTR_MASTER_PORT=str(port), CTR_JOB_TOKEN="bench")
        procs.append(subprocess.Popen([exe] + (["--shared"] if shared else []), env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    deadline = time.monotonic() + RUN_LIMIT_S
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"bench_comm: no result within {RUN_LIMIT_S} s")
        if p.returncode != 0:
            sys.exit(f"bench_comm: a rank failed ({p.returncode}):\n{err}")
        outs.append(out)
    coll, memcpy, idle = {}, {}, {}
    for line in outs[0].splitlines():
        f = line.split()
        if f[0] in ("coll", "coll_shared"):
            coll[(f[1], int(f[2]))] = float(f[10])  # busbw_gbs
        elif f[0] == "memcpy":
            memcpy[int(f[1])] = float(f[3])
        elif f[0] == "idle_cpu":
            idle[int(f[2])] = float(f[4])
    return coll, memcpy, idle


def listening(port):
    """Whether something listens on the TCP port (from /proc/net/tcp*)."""
    want = f":{port:04X}"
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if parts[1].endswith(want) and parts[3] == "0A":
                        return True
        except OSError:
            pass
    return False


def perftest(size, tls=None):
    """ucx_perftest tag_bw at one size; returns GB/s or None."""
    port = free_port()
    iters = str(max(20, min(20000, (2 << 30) // size)))
    common = ["-t", "tag_bw", "-s", str(size), "-n", iters, "-w", "10", "-p", str(port), "-f"]
    env = base_env()
    if tls:
        env["UCX_TLS"] = tls
    server = subprocess.Popen(["ucx_perftest"] + common, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        # The client needs the server's listening socket; wait for it (bounded).
        deadline = time.monotonic() + 10
        while not listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        client = subprocess.run(["ucx_perftest", "127.0.0.1"] + common, env=env,
                                capture_output=True, text=True, timeout=120)
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    # The last line holds: iterations, latency percentile, average and overall
    # overhead (us), average and overall bandwidth (MB/s, MiB really), msg rates.
    rows = [l.split() for l in client.stdout.splitlines() if l.strip() and l.split()[0].isdigit()]
    if client.returncode != 0 or not rows:
        return None
    return float(rows[-1][5]) * (1 << 20) / 1e9


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_comm")
    ap.add_argument("--no-perftest", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    def best(into, new):
        for k, v in new.items():
            if v is not None and (into.get(k) is None or v > into[k]):
                into[k] = v

    coll, shared, memcpy, peer, shm, idle = {}, {}, {}, {}, {}, {}
    have_perftest = shutil.which("ucx_perftest") and not args.no_perftest
    for _ in range(max(1, args.repeat)):
        c, m, i = run_ranks(args.bench_comm, False)
        best(coll, c)
        best(memcpy, m)
        idle = {r: min(v, idle.get(r, v)) for r, v in i.items()}
        c, _, _ = run_ranks(args.bench_comm, True)
        best(shared, c)
        if have_perftest:
            best(peer, {s: perftest(s) for s in SIZES})
            best(shm, {s: perftest(s, "self,sysv") for s in SIZES})

    def num(x, width):
        return f"{x:{width}.2f}" if x else " " * (width - 1) + "-"

    def ratio(a, b):
        return f"{a / b:6.2f}" if a and b else "     -"

    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_v"]
    short = ["ar", "ag", "rs", "a2a"]
    print(f"two ranks on one machine, best of {max(1, args.repeat)}; GB/s = 1e9 bytes/s;"
          " bus bandwidth for the collectives")
    print("ordinary buffers, then shared host allocations (sh); pt = ucx_perftest tag_bw (default")
    print("transports), shm = the same on shared memory only, mc = memcpy; ratios: shared buffers")
    print(f"{'size':>8} " + " ".join(f"{x:>6}" for x in short) + " "
          + " ".join(f"{'sh ' + x:>6}" for x in short)
          + f" {'pt':>6} {'shm':>6} {'mc':>6} "
          + " ".join(f"{x + '/pt':>6}" for x in short) + " "
          + " ".join(f"{x + '/shm':>7}" for x in short))
    for s in SIZES:
        plain = [coll.get((op, s)) for op in ops]
        sh = [shared.get((op, s)) for op in ops]
        pt, sm, mc = peer.get(s), shm.get(s), memcpy.get(s)
        print(f"{human(s):>8} " + " ".join(num(x, 6) for x in plain) + " "
              + " ".join(num(x, 6) for x in sh) + f" {num(pt, 6)} {num(sm, 6)} {num(mc, 6)} "
              + " ".join(ratio(x, pt) for x in sh) + " "
              + " ".join(f"{ratio(x, sm):>7}" for x in sh))
    for r in sorted(idle):
        print(f"idle communicator, rank {r}: {idle[r]:.2f}% of one core")


if __name__ == "__main__":
    main()
