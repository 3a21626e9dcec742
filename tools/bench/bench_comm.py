#!/usr/bin/python3
"""Communicator bandwidth between two local ranks, next to its peers on this machine.

    bench_comm.py BUILD/tools/bench/bench_comm [--sizes 4096,65536,...] [--no-perftest]

Starts two bench_comm ranks (rendezvous on a free loopback port), then runs
ucx_perftest's tag_bw (UCP tagged send/receive, one direction, one stream) as
server and client at each size on 127.0.0.1, and prints one table: our all_reduce
and all_gather bus bandwidth, ucx_perftest's bandwidth, memcpy bandwidth, and the
ratios. Bus bandwidth is what one link carries (NCCL's convention), so it is
comparable with a point-to-point figure; memcpy is the ceiling for moving bytes
through memory here. Also prints the CPU use of an idle communicator.

Nothing is asserted: figures depend on the machine and its load.
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


def run_ranks(exe):
    port = free_port()
    procs = []
    for rank in range(2):
        env = base_env()
        env.update(CTR_RANK=str(rank), CTR_WORLD_SIZE="2", CTR_MASTER_ADDR="127.0.0.1",
                   CTR_MASTER_PORT=str(port), CTR_JOB_TOKEN="bench")
        procs.append(subprocess.Popen([exe], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
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
        if f[0] == "coll":
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


def perftest(size):
    """ucx_perftest tag_bw at one size; returns GB/s or None."""
    port = free_port()
    iters = str(max(20, min(20000, (2 << 30) // size)))
    common = ["-t", "tag_bw", "-s", str(size), "-n", iters, "-w", "10", "-p", str(port), "-f"]
    env = base_env()
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
    args = ap.parse_args()

    coll, memcpy, idle = run_ranks(args.bench_comm)
    have_perftest = shutil.which("ucx_perftest") and not args.no_perftest
    peer = {s: perftest(s) for s in SIZES} if have_perftest else {}

    def ratio(a, b):
        return f"{a / b:6.2f}" if a and b else "     -"

    print("two ranks on one machine; GB/s = 1e9 bytes/s; bus bandwidth for the collectives")
    print(f"{'size':>8} {'all_reduce':>10} {'all_gather':>10} {'perftest':>9} {'memcpy':>8}"
          f" {'ar/pt':>6} {'ag/pt':>6} {'ar/mc':>6} {'ag/mc':>6}")
    for s in SIZES:
        ar, ag, pt, mc = coll.get(("all_reduce", s)), coll.get(("all_gather", s)), peer.get(s), memcpy.get(s)
        print(f"{human(s):>8} {ar or 0:10.2f} {ag or 0:10.2f} "
              f"{(f'{pt:9.2f}' if pt else '        -')} {mc or 0:8.2f}"
              f" {ratio(ar, pt)} {ratio(ag, pt)} {ratio(ar, mc)} {ratio(ag, mc)}")
    for r in sorted(idle):
        print(f"idle communicator, rank {r}: {idle[r]:.2f}% of one core")


if __name__ == "__main__":
    main()
