#!/usr/bin/python3
"""Communication hidden under compute, over a slow link: fsdp=2 with one rank in each of two
network namespaces joined by a veth pair shaped with tc (default 1 Gbit/s and 100 us each
way), UCX over TCP on that link only.

    sudo /usr/bin/python3 tools/bench/overlap/bench_overlap.py --ctr build/tools/ctr
    ... --rate 1gbit --delay 100us --steps 12 --warmup 3 --layers 12 [--only compute-bound]

For two model sizes — one where communication per step is shorter than compute, one where
it is longer — it runs the same training job under these schedules and prints, per schedule,
the median step time, exposed communication (time compute waited for the comm stream), time
collectives were in flight, the planned per-rank memory, and the share of the no-overlap
schedule's exposed communication that each schedule hides:

    no overlap          one collective per tensor, each waited for at its issue
                        (--no-overlap --bucket none --prefetch 0 --no-defer-reduce)
    bucket              one collective per block and kind, where the shard pass puts the
                        first of them, waited at first use (--prefetch 0 --no-defer-reduce)
    bucket+reorder      and gathered one block ahead, reduce-scatters deferred (the default)
    bucket+reorder k=2  gathered two blocks ahead
    1 MiB buckets+reorder  buckets of at most 1 MiB instead of one per block, scheduled
                        as the default: the first block's gathers and the last one's
                        reductions, which nothing can hide, partly overlap that block

With --meshes it compares layouts instead, each with the default schedule and the same
global batch: fsdp=2, tp=2 and tp=2 with sequence parallelism, with the communication in
flight per mesh axis and the exposed share.

Needs root (ip netns, tc). The namespaces (ctrbench0, ctrbench1) and the veth pair are
created at the start and removed at the end; traffic stays between them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NS = ("ctrbench0", "ctrbench1")
ADDR = ("10.231.0.1", "10.231.0.2")
DEV = ("ctrveth0", "ctrveth1")

SCHEDULES = [
    ("no overlap", ["--no-overlap", "--bucket", "none", "--prefetch", "0", "--no-defer-reduce"]),
    ("bucket", ["--prefetch", "0", "--no-defer-reduce"]),
    ("bucket+reorder", []),
    ("bucket+reorder k=2", ["--prefetch", "2"]),
    ("1 MiB buckets+reorder", ["--bucket", "bytes", "--bucket-bytes", str(1 << 20)]),
]


def sh(*cmd, check=True):
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


# The mesh comparison (--meshes): name, mesh, per-rank batch relative to fsdp=2's, flags.
MESHES = [("fsdp=2", "fsdp=2", 1, []),
          ("tp=2", "tp=2", 2, []),
          ("tp=2 + sp", "tp=2", 2, ["--sequence-parallel"])]


def setup(rate, delay):
    """Returns how the link is shaped: netem (rate and delay) where the kernel has it, else
    tbf (rate only)."""
    teardown()
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1], "netns", NS[1])
    shaping = f"netem rate {rate}, delay {delay} each way"
    for ns, dev, addr in zip(NS, DEV, ADDR):
        sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        r = sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", delay,
               "rate", rate, "limit", "100000", check=False)
        if r.returncode != 0:
            # No netem in this kernel: shape the rate with a token bucket, no added delay.
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", "64kb", "latency", "50ms")
            shaping = f"tbf rate {rate} each way (this kernel has no netem: no added delay)"
    # UCX refuses a TCP interface as unreachable until the new link has settled.
    for _ in range(100):
        if all("LOWER_UP" in sh("ip", "-n", ns, "link", "show", "dev", dev).stdout for ns, dev in zip(NS, DEV)):
            break
        time.sleep(0.1)
    time.sleep(2)
    return shaping


def teardown():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)


def run_job(args, graph, flags, tmp, name, mesh="fsdp=2", batch=None):
    procs, metrics = [], []
    for rank in (0, 1):
        m = os.path.join(tmp, f"{name}.{rank}.jsonl")
        metrics.append(m)
        env = dict(os.environ, CTR_RANK=str(rank), CTR_WORLD_SIZE="2", CTR_MASTER_ADDR=ADDR[0],
                   CTR_MASTER_PORT=str(args.port), CTR_JOB_TOKEN="bench-overlap", UCX_TLS="self,tcp",
                   UCX_NET_DEVICES=DEV[rank], CTR_NUM_THREADS=str(args.threads))
        cmd = ["ip", "netns", "exec", NS[rank], args.ctr, "run", graph, "--mesh", mesh,
               "--steps", str(args.warmup + args.steps), "--batch", str(batch or args.batch_of[graph]),
               "--seq", str(args.seq), "--log-every", "1000", "--timeout", "120", "--metrics", m] + flags
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{name}: a rank exited {p.returncode}:\n{out[-2000:]}")
    rows = [json.loads(line) for line in open(metrics[0]) if line.strip()][args.warmup:]
    first_line = outs[0].splitlines()[0] if outs[0] else ""
    mem = first_line.split("memory per rank ")[-1].split(" MiB")[0] if "memory per rank" in first_line else "?"
    return {
        "step_ms": statistics.median(r["step_ms"] for r in rows),
        "exposed_ms": statistics.median(r["exposed_comm_ms"] for r in rows),
        "comm_ms": statistics.median(r["comm_ms"] for r in rows),
        "compute_ms": statistics.median(r["compute_ms"] for r in rows),
        "memory_mib": mem,
        "loss": rows[-1]["loss"],
        "comm_ms_by_axis": {a: statistics.median(r["comm_ms_by_axis"].get(a, 0.0) for r in rows)
                            for a in rows[-1].get("comm_ms_by_axis", {})},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctr", default="build/tools/ctr")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="100us")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per rank (2 ranks share the machine)")
    ap.add_argument("--port", type=int, default=29731)
    ap.add_argument("--layers", type=int, default=12,
                    help="transformer blocks of both models (the first block's gathers and the last "
                         "one's reductions cannot overlap anything: fewer blocks expose a larger share)")
    ap.add_argument("--only", choices=["compute-bound", "comm-bound"], help="run one of the two models")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--meshes", action="store_true",
                    help="instead of the schedules: fsdp=2 against tp=2 and tp=2 with sequence parallelism, each "
                         "with the default schedule and the same global batch")
    args = ap.parse_args()
    args.ctr = os.path.abspath(args.ctr)
    if os.geteuid() != 0:
        sys.exit("bench_overlap: needs root for ip netns and tc")
    tmp = tempfile.mkdtemp(prefix="ctr-bench-overlap-")
    # Two sizes of the gpt preset: the first computes longer than it communicates, the
    # second communicates longer than it computes.
    layers = str(args.layers)
    sizes = [("compute-bound", ["--layers", layers, "--dim", "256", "--heads", "4"], 8),
             ("comm-bound", ["--layers", layers, "--dim", "512", "--heads", "8"], 1)]
    if args.only:
        sizes = [s for s in sizes if s[0] == args.only]
    args.batch_of = {}
    results = {}
    shaping = setup(args.rate, args.delay)
    print(f"link: {shaping}", flush=True)
    try:
        for size, gflags, batch in sizes:
            graph = os.path.join(tmp, f"{size}.ctrg")
            sh(args.ctr, "graph", "build", "--preset", "gpt", "--vocab", "256", "--seq", str(args.seq),
               *gflags, "-o", graph)
            args.batch_of[graph] = batch
            if args.meshes:
                # A tp group reads the same rows: tp=2 runs the whole global batch on both ranks.
                for name, mesh, b, flags in MESHES:
                    r = run_job(args, graph, flags, tmp, f"{size}-{name.replace(' ', '_')}", mesh, batch * b)
                    results[(size, name)] = r
                    axes = ", ".join(f"{a} {ms:.1f}" for a, ms in sorted(r["comm_ms_by_axis"].items()))
                    print(f"  {size:13s} {name:10s} step {r['step_ms']:8.1f} ms  exposed {r['exposed_ms']:8.1f}  "
                          f"comm {r['comm_ms']:8.1f} ({axes})  compute {r['compute_ms']:8.1f}  "
                          f"mem {r['memory_mib']} MiB", flush=True)
                continue
            for name, flags in SCHEDULES:
                results[(size, name)] = run_job(args, graph, flags, tmp, f"{size}-{name.replace(' ', '_')}")
                r = results[(size, name)]
                print(f"  {size:13s} {name:18s} step {r['step_ms']:8.1f} ms  exposed {r['exposed_ms']:8.1f}  "
                      f"comm {r['comm_ms']:8.1f}  compute {r['compute_ms']:8.1f}  mem {r['memory_mib']} MiB",
                      flush=True)
    finally:
        teardown()

    if args.meshes:
        print(f"\nlink: {shaping}; one rank per namespace, UCX over TCP; gpt preset, {args.layers} blocks; "
              f"{args.threads} compute thread(s) per rank; median of {args.steps} steps after {args.warmup}")
        print("| model | mesh | step ms | exposed comm ms | comm in flight ms (by axis) | exposed share | "
              "step vs fsdp=2 | memory per rank MiB |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for size, _, _ in sizes:
            base = results[(size, "fsdp=2")]
            for name, _, _, _ in MESHES:
                r = results[(size, name)]
                axes = ", ".join(f"{a} {ms:.1f}" for a, ms in sorted(r["comm_ms_by_axis"].items()))
                share = r["exposed_ms"] / r["comm_ms"] if r["comm_ms"] > 0 else 0
                print(f"| {size} | {name} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | {r['comm_ms']:.1f} "
                      f"({axes}) | {share * 100:.0f}% | {r['step_ms'] / base['step_ms']:.2f}x | "
                      f"{r['memory_mib']} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({f"{k[0]}/{k[1]}": v for k, v in results.items()}, f, indent=1)
        return
    print(f"\nlink: {shaping}; fsdp=2, one rank per namespace, UCX over TCP; gpt preset, {args.layers} blocks; "
          f"{args.threads} compute thread(s) per rank; median of {args.steps} steps after {args.warmup}")
    print("| model | schedule | step ms | exposed comm ms | comm in flight ms | hidden | throughput vs no overlap "
          "| memory per rank MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, _, _ in sizes:
        base = results[(size, "no overlap")]
        for name, _ in SCHEDULES:
            r = results[(size, name)]
            hidden = 1 - r["exposed_ms"] / base["exposed_ms"] if base["exposed_ms"] > 0 else 0
            gain = base["step_ms"] / r["step_ms"] - 1
            print(f"| {size} | {name} | {r['step_ms']:.1f} | {r['exposed_ms']:.1f} | {r['comm_ms']:.1f} | "
                  f"{hidden * 100:.0f}% | {gain * 100:+.1f}% | {r['memory_mib']} |")
        losses = {results[(size, n)]["loss"] for n, _ in SCHEDULES}
        print(f"| {size} | final losses equal across schedules: {len(losses) == 1} | | | | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{k[0]}/{k[1]}": v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
