#!/usr/bin/python3
"""Runs comm_test as N local processes: the collectives, then the failure modes.

    run_comm.py BUILD/tests/comm_test [--ucx] [-k SUBSTRING]

Local ranks take the shared-memory path; with --ucx they run with CTR_SHM=0 and
take the UCX path alone. comm_test checks which one it got. -k runs only the
cases whose name contains SUBSTRING.

Each case starts its ranks with the rendezvous on a free loopback port and a
fresh job token, under a hard time limit (the processes are killed and the case
fails when it passes), and checks every rank's exit status and messages. The
failure modes check what the failing side reports, and that it does so within
the timeout it was given rather than hanging.
"""

import os
import secrets
import socket
import subprocess
import sys
import time

# Under AddressSanitizer (the sanitizer job sets ASAN_OPTIONS) every rank runs
# several times slower on the same cores.
HARD_LIMIT_S = 420 if os.environ.get("ASAN_OPTIONS") else 60


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Case:
    def __init__(self, name, world, mode="all", started=None, timeout_ms=30000,
                 late_rank0=False, expect=None, max_s=None, leaver=None, env=None, rank_env=None):
        self.name = name
        self.world = world
        self.mode = mode
        self.started = started if started is not None else list(range(world))
        self.timeout_ms = timeout_ms
        self.late_rank0 = late_rank0
        self.expect = expect or {}  # rank -> substrings its stderr must contain
        self.max_s = max_s          # the whole case must end within this
        self.leaver = leaver        # a rank that exits on purpose, reporting no PASS
        self.env = env or {}        # more environment for every rank
        self.rank_env = rank_env or {}  # rank -> more environment for it


def run(exe, case, ucx_only=False):
    port, token = free_port(), secrets.token_hex(8)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    base.update({"CTR_SHM": "0", "CTR_TEST_PATH": "ucx"} if ucx_only else {"CTR_TEST_PATH": "shm"})
    procs = {}
    order = sorted(case.started, key=lambda r: (r == 0) if case.late_rank0 else 0)
    t0 = time.monotonic()
    for r in order:
        if r == 0 and case.late_rank0:
            # The scenario, not synchronisation: the others must keep retrying
            # until rank 0's store is up, whenever that happens.
            time.sleep(0.5)
        env = dict(base, CTR_RANK=str(r), CTR_WORLD_SIZE=str(case.world),
                   CTR_MASTER_ADDR="127.0.0.1", CTR_MASTER_PORT=str(port),
                   CTR_JOB_TOKEN=token, CTR_TIMEOUT_MS=str(case.timeout_ms), **case.env)
        env.update(case.rank_env.get(r, {}))
        procs[r] = subprocess.Popen([exe, case.mode], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    outs, problems = {}, []
    deadline = t0 + HARD_LIMIT_S
    for r, p in procs.items():
        try:
            outs[r] = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            problems.append(f"rank {r} still running after {HARD_LIMIT_S} s: killed")
            for q in procs.values():
                if q.poll() is None:
                    q.kill()
            for rr, q in procs.items():
                outs.setdefault(rr, q.communicate())
            break
    elapsed = time.monotonic() - t0

    quiet = "UCX_LOG_LEVEL" not in os.environ  # a user asking for UCX logs gets them
    for r, p in procs.items():
        out, err = outs[r]
        if p.returncode != 0:
            problems.append(f"rank {r} exited with {p.returncode}")
        if r == case.leaver:
            if "exiting without a word" not in out:
                problems.append(f"rank {r} did not leave as planned")
        elif "PASS" not in out:
            problems.append(f"rank {r} did not report PASS")
        for want in case.expect.get(r, []):
            if want not in err:
                problems.append(f"rank {r}: stderr lacks {want!r}")
        if quiet:
            for line in err.splitlines():
                if not (line.startswith("comm_test:") or line.startswith("ctr: rendezvous: refused")):
                    problems.append(f"rank {r}: unexpected output: {line}")
    if case.max_s is not None and elapsed > case.max_s:
        problems.append(f"took {elapsed:.1f} s, more than {case.max_s:.1f} s")
    return elapsed, problems, outs


def main():
    args = sys.argv[1:]
    ucx_only = "--ucx" in args
    args = [a for a in args if a != "--ucx"]
    only = None
    if "-k" in args and args.index("-k") + 1 < len(args):
        i = args.index("-k")
        only = args[i + 1]
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit("usage: run_comm.py COMM_TEST [--ucx] [-k SUBSTRING]")
    exe = args[0]
    cases = [Case(f"collectives, {n} rank{'s' if n > 1 else ''}", n) for n in (1, 2, 3)]
    cases.append(Case("collectives, 4 ranks, rank 0 starts last", 4, late_rank0=True))
    # One rank declines direct reads: shared host buffers go through the segment on all.
    cases.append(Case("shared buffers, 3 ranks, CTR_SHM_DIRECT=0 on rank 1", 3, "shared",
                      env={"CTR_TEST_DIRECT": "0"}, rank_env={1: {"CTR_SHM_DIRECT": "0"}}))
    # The rank with another token finds out first: rank 0's proof does not match
    # its token, so it never sends its own.
    cases.append(Case("wrong job token", 2, "token", timeout_ms=5000, max_s=15, expect={
        0: ["rank 1 of 2 did not join within 5.0 s"],
        1: ["the store at 127.0.0.1:", "does not hold this job's token"]}))
    cases.append(Case("wrong job token, 3 ranks", 3, "token", timeout_ms=5000, max_s=15, expect={
        0: ["rank 2 of 3 did not join"], 1: ["rank 2 of 3 did not join"],
        2: ["does not hold this job's token"]}))
    cases.append(Case("missing rank", 3, "missing", started=[0, 1], timeout_ms=3000, max_s=10,
                      # Rank 1 joins after rank 0 and reports the time it waited itself.
                      expect={0: ["rank 2 of 3 did not join within 3.0 s"],
                              1: ["rank 2 of 3 did not join within"]}))
    for n in (2, 3, 4):
        cases.append(Case(f"dead rank, {n} ranks", n, "dead", timeout_ms=5000, max_s=20, leaver=n - 1,
                          expect={r: [f"rank {n - 1}", "failed as expected"] for r in range(n - 1)}))
    # On the UCX path the survivors' transfers with the dead rank are given up
    # a grace after the failure (UCP completes them neither way).
    for n in (2, 3):
        cases.append(Case(f"rank dead mid-collective, {n} ranks", n, "dead-mid", timeout_ms=5000,
                          max_s=20, leaver=n - 1,
                          expect={r: [f"rank {n - 1}", "failed as expected"] for r in range(n - 1)}))
        cases.append(Case(f"rank dead mid-collective on shared buffers, {n} ranks", n,
                          "dead-mid-shared", timeout_ms=5000, max_s=20, leaver=n - 1,
                          expect={r: [f"rank {n - 1}", "failed as expected"] for r in range(n - 1)}))
    for n in (2, 3):
        cases.append(Case(f"hung rank, {n} ranks", n, "hang", timeout_ms=10000, max_s=25,
                          expect={r: [f"waiting for rank {n - 1}"] for r in range(n - 1)}))

    for n in (2, 3):
        cases.append(Case(f"recv from a silent rank, {n} ranks", n, "p2p-hang", timeout_ms=10000,
                          max_s=20, expect={0: [f"waiting for rank {n - 1}"]}))

    cases.append(Case("store server dies", 3, "server-dead", timeout_ms=10000, max_s=15, leaver=0,
                      expect={r: ["lost the connection to the store"] for r in (1, 2)}))

    if only is not None:
        cases = [c for c in cases if only in c.name]
    failed = 0
    for case in cases:
        elapsed, problems, outs = run(exe, case, ucx_only)
        print(f"{'ok  ' if not problems else 'FAIL'} {case.name} ({elapsed:.1f} s)", flush=True)
        if problems:
            failed += 1
            for p in problems:
                print(f"     {p}")
            for r in sorted(outs):
                for stream, text in zip(("stdout", "stderr"), outs[r]):
                    for line in text.splitlines():
                        print(f"     [rank {r} {stream}] {line}")
    print(f"{len(cases) - failed} of {len(cases)} cases passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
