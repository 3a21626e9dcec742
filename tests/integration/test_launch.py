#!/usr/bin/python3
"""`ctr launch`: rank environment, prefixed output, the job ending with the first
failing rank's status, and signal forwarding; with a communicator, an fsdp=2 job's
communication metrics. Every run has a hard time limit.

usage: test_launch.py CTR
"""
import json
import os
import signal
import subprocess
import sys
import time

CTR = os.path.abspath(sys.argv[1])
# Without a communicator in the build (-Ducx=disabled) only the launcher itself is tested.
HAVE_COMM = "--no-comm" not in sys.argv[2:]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def launch(n, script, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([CTR, "launch", "-n", str(n), "--grace-ms", "2000", "--", "sh", "-c", script],
                       capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def main():
    # Environment and prefixes.
    p, _ = launch(3, 'echo "rank=$CTR_RANK world=$CTR_WORLD_SIZE port=$CTR_MASTER_PORT token=${#CTR_JOB_TOKEN}"; echo err >&2')
    check(p.returncode == 0, f"clean job exited {p.returncode}: {p.stderr}")
    for r in range(3):
        check(any(line.startswith(f"[{r}] rank={r} world=3 port=") and line.endswith("token=32")
                  for line in p.stdout.splitlines()), f"rank {r} line missing: {p.stdout}")
        check(f"[{r}] err" in p.stderr, f"rank {r} stderr not prefixed: {p.stderr}")
    ports = {line.split("port=")[1].split()[0] for line in p.stdout.splitlines() if "port=" in line}
    check(len(ports) == 1, f"ranks disagree on the port: {ports}")

    # Rank 0, and only rank 0, inherits the launcher's socket, already listening
    # on the job's port (its store takes it over: the port cannot be lost to
    # another process before rank 0 starts).
    probe = ("import os, socket\n"
             "v = os.environ.get('CTR_MASTER_LISTEN_FD')\n"
             "if v is None:\n"
             "    print('none')\n"
             "else:\n"
             "    s = socket.socket(fileno=int(v))\n"
             "    ok = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and "
             "s.getsockname() == ('127.0.0.1', int(os.environ['CTR_MASTER_PORT']))\n"
             "    s.detach()\n"
             "    print('listening' if ok else 'wrong socket')\n")
    p = subprocess.run([CTR, "launch", "-n", "2", "--", sys.executable, "-c", probe],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 0 and "[0] listening" in p.stdout and "[1] none" in p.stdout,
          f"the store's socket: {p.returncode} {p.stdout} {p.stderr}")

    # One rank fails: the others (blocked reading a pipe nobody writes) are
    # stopped and the launcher returns the failing rank's status.
    p, elapsed = launch(3, 'if [ "$CTR_RANK" = 1 ]; then exit 7; fi; exec cat')
    check(p.returncode == 7, f"expected the failing rank's status 7, got {p.returncode}")
    check("rank 1 exited with status 7" in p.stderr, f"no failure note: {p.stderr}")
    check(elapsed < 30, f"stopping the job took {elapsed:.1f} s")

    # A command that cannot start.
    p = subprocess.run([CTR, "launch", "-n", "2", "--", "/nonexistent/program"],
                       capture_output=True, text=True, timeout=60)
    check(p.returncode == 127 and "cannot run '/nonexistent/program'" in p.stderr,
          f"missing program: {p.returncode} {p.stderr}")

    # Ranks that cannot all be started (descriptors run out after a few): the
    # started ones are killed and reaped, nothing is left running.
    import resource
    marker = f"300.{os.getpid()}"  # a sleep no one else runs
    p = subprocess.run([CTR, "launch", "-n", "64", "--", "sleep", marker],
                       capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32)))
    left = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    check(p.returncode == 1 and "launch: pipe: Too many open files" in p.stderr and not left,
          f"64 ranks with 32 descriptors: exit {p.returncode}, {p.stderr[-400:]}, left running: {left}")

    # SIGTERM to the launcher is forwarded; ranks that trap it report and exit.
    proc = subprocess.Popen(
        [CTR, "launch", "-n", "2", "--", "sh", "-c",
         'trap "echo got-term; exit 0" TERM; echo ready; while :; do :; done'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        if not line:
            break
        ready += "ready" in line
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        failures.append("launcher did not stop after SIGTERM")
    check(out.count("got-term") == 2, f"SIGTERM not forwarded to both ranks: {out} {err}")
    check(proc.returncode == 128 + signal.SIGTERM, f"launcher exit after SIGTERM: {proc.returncode}")

    if not HAVE_COMM:
        print("launch: multi-rank training checks skipped: this build has no communicator")
        return finish()

    # A training job whose rank 1 hangs at step 5: rank 0 fails within --timeout
    # naming rank 1, and the launcher ends the job with that failure.
    import tempfile
    graph = os.path.join(tempfile.mkdtemp(prefix="ctr_launch_"), "g.ctrg")
    subprocess.run([CTR, "graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "32",
                    "--heads", "2", "--seq", "16", "-o", graph], check=True, capture_output=True, timeout=60)
    for kind, want_status, needle in [("hang", 75, "waiting for rank 1"), ("exit", 87, "rank 1 exited with status 87")]:
        t0 = time.monotonic()
        p = subprocess.run([CTR, "launch", "-n", "2", "--grace-ms", "2000", "--", CTR, "run", graph,
                            "--mesh", "fsdp=2", "--steps", "20", "--batch", "2", "--log-every", "0",
                            "--timeout", "3"],
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CTR_FAULT_INJECT": f"{kind}_at_step:5:rank:1"})
        elapsed = time.monotonic() - t0
        check(p.returncode == want_status, f"{kind}: launcher exited {p.returncode}, expected {want_status}")
        check(needle in p.stderr, f"{kind}: message lacks '{needle}': {p.stderr[-600:]}")
        check(elapsed < 60, f"{kind}: the job took {elapsed:.1f} s to end")

    # Rank 1 dies with collectives in flight on the comm stream (it exits right
    # after issuing one), outside any launcher: rank 0, waiting on them, fails
    # naming rank 1, well within its timeout.
    def rank_env(r, port):
        env = {"CTR_RANK": str(r), "CTR_WORLD_SIZE": "2", "CTR_MASTER_ADDR": "127.0.0.1",
               "CTR_MASTER_PORT": str(port)}
        if r == 1:
            env["CTR_FAULT_INJECT"] = "exitcomm_at_step:3:rank:1"
        return env
    t0 = time.monotonic()
    procs, outs, _ = run_two_ranks(graph, rank_env, ["--steps", "20", "--log-every", "0", "--timeout", "10"], 60)
    elapsed = time.monotonic() - t0
    check(procs[1].returncode == 87, f"exitcomm: rank 1 exited {procs[1].returncode}, expected 87")
    check(procs[0].returncode not in (0, None), "exitcomm: rank 0 did not fail")
    check("rank 1" in outs[0][1], f"exitcomm: rank 0 did not name rank 1: {outs[0][1][-600:]}")
    check(elapsed < 10, f"exitcomm: rank 0 took {elapsed:.1f} s to fail (timeout 10 s)")

    # The same inside a mixture-of-experts layer split over ep=2: rank 1 dies as
    # the token exchange (an all-to-all) starts; rank 0, inside it, names rank 1.
    # (Without the load-balancing loss, the exchanges are the only collectives.)
    moe = os.path.join(os.path.dirname(graph), "moe.ctrg")
    subprocess.run([CTR, "graph", "build", "--preset", "moe", "--layers", "2", "--dim", "32", "--heads", "2",
                    "--seq", "16", "--experts", "4", "--ffn-dim", "32", "--aux-loss", "0", "-o", moe],
                   check=True, capture_output=True, timeout=60)
    t0 = time.monotonic()
    procs, outs, _ = run_two_ranks(moe, rank_env, ["--steps", "20", "--log-every", "0", "--timeout", "10"], 60,
                                   mesh="ep=2")
    elapsed = time.monotonic() - t0
    check(procs[1].returncode == 87, f"moe exitcomm: rank 1 exited {procs[1].returncode}, expected 87")
    check(procs[0].returncode not in (0, None), "moe exitcomm: rank 0 did not fail")
    check("rank 1" in outs[0][1] and "moe_" in outs[0][1],
          f"moe exitcomm: rank 0 did not name rank 1 and the exchange: {outs[0][1][-600:]}")
    check(elapsed < 10, f"moe exitcomm: rank 0 took {elapsed:.1f} s to fail (timeout 10 s)")

    # A clean fsdp=2 job: every step gathers parameters and reduces gradients, so
    # rank 0's metrics show communication; the part compute waited for is within
    # the step (it may exceed comm_ms slightly: the two are timed on different
    # threads).
    metrics = os.path.join(os.path.dirname(graph), "metrics.jsonl")
    p = subprocess.run([CTR, "launch", "-n", "2", "--grace-ms", "2000", "--", CTR, "run", graph,
                        "--mesh", "fsdp=2", "--steps", "3", "--batch", "2", "--log-every", "1",
                        "--timeout", "20", "--metrics", metrics],
                       capture_output=True, text=True, timeout=120)
    check(p.returncode == 0, f"fsdp=2 job exited {p.returncode}: {p.stderr[-600:]}")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    check(len(rows) == 3, f"fsdp=2 metrics: {len(rows)} lines, expected 3")
    for r in rows:
        ok = (r["comm_ms"] > 0 and 0 <= r["exposed_comm_ms"] <= r["step_ms"]
              and 0 < r["compute_ms"] <= r["step_ms"])
        check(ok, f"fsdp=2 step {r.get('step')}: compute {r['compute_ms']} comm {r['comm_ms']} "
                  f"exposed {r['exposed_comm_ms']} step {r['step_ms']} ms")
    lines = p.stdout.splitlines()
    check(sum(line.startswith("[0] step ") and " | comm " in line and "(exposed " in line
              for line in lines) == 3, f"fsdp=2 progress lines lack comm: {p.stdout[-600:]}")
    check(any(line.startswith("[0] done: 3 steps") and "| compute " in line and "(exposed " in line
              for line in lines), f"fsdp=2 summary lacks compute/comm: {p.stdout[-600:]}")

    # Two ranks of one host read each other's parameters and gradients in place
    # (the CPU backend's buffers are shared host allocations): the flight
    # records, written when the meshes go, show direct collectives, and the
    # losses equal those of the same job through the segment (CTR_SHM_DIRECT=0).
    wide = os.path.join(os.path.dirname(graph), "wide.ctrg")
    subprocess.run([CTR, "graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "128",
                    "--heads", "2", "--seq", "32", "-o", wide], check=True, capture_output=True,
                   timeout=60)
    losses, paths = {}, {}
    for direct in ("1", "0"):
        flight = tempfile.mkdtemp(prefix="ctr_flight_")
        out = os.path.join(flight, "metrics.jsonl")
        env = dict(os.environ, CTR_FLIGHT_DIR=flight, CTR_SHM_DIRECT=direct)
        p = subprocess.run([CTR, "launch", "-n", "2", "--", CTR, "run", wide, "--mesh", "fsdp=2",
                            "--steps", "3", "--batch", "2", "--log-every", "0", "--timeout", "20",
                            "--metrics", out], capture_output=True, text=True, timeout=120, env=env)
        check(p.returncode == 0, f"CTR_SHM_DIRECT={direct} job exited {p.returncode}: {p.stderr[-600:]}")
        losses[direct] = [json.loads(line)["loss"] for line in open(out)] if os.path.exists(out) else []
        for r in (0, 1):
            path = os.path.join(flight, f"flight-rank{r:05d}.json")
            record = json.load(open(path)) if os.path.exists(path) else []
            check(record, f"CTR_SHM_DIRECT={direct}: rank {r} wrote no flight record")
            largest = max(record, key=lambda e: e["bytes"]) if record else {}
            paths[(direct, r)] = ({e["path"] for e in record}, largest.get("path"))
    # The fenced test backend (CTR_FENCE_MEMORY=1) keeps its own private mappings.
    want = "shm" if os.environ.get("CTR_FENCE_MEMORY") == "1" else "shm direct"
    for r in (0, 1):
        check(paths[("1", r)][1] == want,
              f"rank {r}: its largest collective took path {paths[('1', r)][1]}, not '{want}'")
        check("shm direct" not in paths[("0", r)][0],
              f"rank {r} under CTR_SHM_DIRECT=0: collectives took {paths[('0', r)][0]}")
    check(len(losses["1"]) == 3 and losses["1"] == losses["0"],
          f"losses with direct collectives {losses['1']} differ from the segment's {losses['0']}")

    # Other launchers' environments: torchrun, Slurm (srun) and Open MPI (mpirun)
    # start the ranks themselves; libctr reads their variables. Last, ranks started by
    # hand with a CTR_MASTER_LISTEN_FD that is no store socket.
    for style in ("torchrun", "slurm", "ompi", "stale fd"):
        def rank_env(r, port):
            if style == "torchrun":
                return dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
            if style == "slurm":
                return dict(SLURM_PROCID=str(r), SLURM_NTASKS="2", CTR_MASTER_ADDR="127.0.0.1",
                            CTR_MASTER_PORT=str(port))
            if style == "ompi":
                return dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                            CTR_MASTER_ADDR="127.0.0.1", CTR_MASTER_PORT=str(port))
            # A descriptor number that is not the store's socket (here: stderr,
            # and one that is not open) is ignored; rank 0 binds the port itself.
            return dict(CTR_RANK=str(r), CTR_WORLD_SIZE="2", CTR_MASTER_PORT=str(port),
                        CTR_MASTER_LISTEN_FD=("2" if r == 0 else "977"))
        procs, outs, hung = run_two_ranks(graph, rank_env, ["--steps", "3", "--log-every", "1", "--timeout", "20"],
                                          90)
        if hung:
            failures.append(f"{style}: a rank did not finish")
        check(all(pr.returncode == 0 for pr in procs), f"{style}: exit codes {[pr.returncode for pr in procs]}: {outs[0][1][-400:]}")
        check("x 2 ranks" in outs[0][0] and "done: 3 steps" in outs[0][0], f"{style}: rank 0 output: {outs[0][0][-400:]}")

    return finish()


def run_two_ranks(graph, rank_env, args, limit_s, mesh="fsdp=2"):
    """Starts `ctr run GRAPH --mesh MESH --batch 2 ARGS` as two ranks without a launcher,
    rank_env(rank, port) giving each its variables (the CTR_ ones of this process are
    dropped), and waits limit_s for each. Returns (procs, [(stdout, stderr)], any killed)."""
    for attempt in range(4):
        port = free_port_pair()
        procs = []
        for r in range(2):
            env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
            env.update(rank_env(r, port))
            procs.append(subprocess.Popen([CTR, "run", graph, "--mesh", mesh, "--batch", "2", *args],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs, hung = [], False
        for pr in procs:
            try:
                outs.append(pr.communicate(timeout=limit_s))
            except subprocess.TimeoutExpired:
                pr.kill()
                outs.append(pr.communicate())
                hung = True
        # Between choosing the port and rank 0 binding it, another process on
        # this machine may take it (as with any launcher that hands a port
        # number to its ranks): start again on another one.
        if "Address already in use" not in outs[0][1]:
            break
    return procs, outs, hung


def free_port_pair():
    """A port P such that P and P + 1 are both free now (torchrun's variables give
    MASTER_PORT, held by torch's own store there, and libctr listens on the next)."""
    import socket
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def finish():
    # Usage errors.
    p = subprocess.run([CTR, "launch", "-n", "0", "--", "true"], capture_output=True, text=True, timeout=30)
    check(p.returncode == 2, f"-n 0 exited {p.returncode}")

    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("launch: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
