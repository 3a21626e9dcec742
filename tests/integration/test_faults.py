#!/usr/bin/python3
"""Failures of a running job: a rank killed at a random step, a stopped rank, a killed
launcher, a straggler, a non-finite loss under each configured behaviour, and automatic restart from the
last checkpoint. Every check has a time bound and
looks for processes left behind.

usage: test_faults.py CTR
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

CTR = os.path.abspath(sys.argv[1])
TIMEOUT_S = 4.0  # the mesh timeout the jobs run with
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    env["CTR_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def processes_marked(mark):
    """Pids of live processes whose environment carries CTR_TEST_MARK=mark."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"CTR_TEST_MARK={mark}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(") ")[-1].startswith("Z"):
                            continue  # exited, not yet reaped
                    found.append(int(pid))
        except OSError:
            pass
    return found


def rank_pids(launcher_pid, n, limit_s=20):
    """{rank: pid} of a launcher's children, once all n have started."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        pids = {}
        out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
        for pid in out.split():
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for e in env:
                if e.startswith(b"CTR_RANK="):
                    pids[int(e[9:])] = int(pid)
        if len(pids) == n:
            return pids
        time.sleep(0.02)
    return {}


class Drain:
    """Reads a pipe on a thread, keeping each line with the time it arrived."""

    def __init__(self, pipe):
        import threading
        self.lines, self.cv = [], threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self.thread.start()

    def _run(self, pipe):
        for line in pipe:
            with self.cv:
                self.lines.append((time.monotonic(), line))
                self.cv.notify_all()

    def wait_for(self, pred, limit_s):
        with self.cv:
            return self.cv.wait_for(lambda: any(pred(l) for _, l in self.lines), limit_s)

    def time_of(self, pred):
        self.thread.join(5)
        return next((t for t, l in self.lines if pred(l)), None)


def train_args(graph, world, steps, extra=(), timeout_s=TIMEOUT_S):
    return [CTR, "run", graph, "--mesh", f"fsdp={world}", "--batch", "2", "--steps", str(steps),
            "--timeout", str(timeout_s), "--log-every", "1", *extra]


def killed_ranks(graph):
    """kill -9 of a random rank at a random step: every other rank ends with an error naming
    it within the timeout, the launcher reports it, nothing is left behind."""
    rng = random.Random(1234)
    for rnd in range(3):
        world, step, victim = 3, rng.randint(3, 25), rng.randrange(3)
        mark = uuid.uuid4().hex
        t0 = time.monotonic()
        p = subprocess.run([CTR, "launch", "-n", str(world), "--grace-ms", "20000", "--",
                            *train_args(graph, world, 60)],
                           capture_output=True, text=True, timeout=120,
                           env=clean_env(CTR_TEST_MARK=mark,
                                         CTR_FAULT_INJECT=f"kill_at_step:{step}:rank:{victim}"))
        elapsed = time.monotonic() - t0
        check(p.returncode != 0, f"round {rnd}: the job survived a killed rank")
        check(f"rank {victim} exited with status 137" in p.stderr,
              f"round {rnd}: launcher did not name rank {victim}: {p.stderr[-2000:]}")
        for r in range(world):
            if r == victim:
                continue
            lines = [l for l in p.stderr.splitlines() if l.startswith(f"[{r}] ctr: error:")]
            # A survivor may be stopped by the launcher before its own error; one that
            # reports must name the killed rank.
            check(all(f"rank {victim}" in l for l in lines),
                  f"round {rnd}: rank {r} reported without naming rank {victim}: {lines}")
        check(elapsed < TIMEOUT_S + 15, f"round {rnd}: the job took {elapsed:.1f} s to end")
        check(not processes_marked(mark), f"round {rnd}: processes left behind: {processes_marked(mark)}")


def killed_rank_without_launcher(graph):
    """Without a launcher to stop them (torchrun, Slurm), the survivors of a killed rank find
    out for themselves: each exits with status 75 and an error naming it, within the timeout."""
    import socket
    rng = random.Random(99)
    for rnd in range(2):
        world, step, victim = 3, rng.randint(3, 25), rng.randrange(3)
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            port = sk.getsockname()[1]
        mark = uuid.uuid4().hex
        procs = []
        for r in range(world):
            env = clean_env(CTR_RANK=str(r), CTR_WORLD_SIZE=str(world), CTR_MASTER_PORT=str(port),
                            CTR_JOB_TOKEN="t" + mark, CTR_TEST_MARK=mark,
                            CTR_FAULT_INJECT=f"kill_at_step:{step}:rank:{victim}")
            procs.append(subprocess.Popen(train_args(graph, world, 100000), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True, env=env))
        procs[victim].wait(timeout=60)
        t_kill = time.monotonic()
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                _, err = p.communicate(timeout=TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            took = time.monotonic() - t_kill
            check(p.returncode == 75 and f"rank {victim}" in err,
                  f"round {rnd}: survivor {r} exited {p.returncode} after rank {victim} died: {err[-1500:]}")
            check(took <= TIMEOUT_S + 2.0, f"round {rnd}: survivor {r} took {took:.1f} s to end")
        check(not processes_marked(mark), f"round {rnd}: processes left behind")


def skipped_collective(graph):
    """A rank that hangs before issuing a step's collectives (it skips them) is named by the
    flight recorders, with the collective it never issued; the others' errors say so."""
    p = subprocess.run([CTR, "launch", "-n", "2", "--", *train_args(graph, 2, 40)], capture_output=True,
                       text=True, timeout=120, env=clean_env(CTR_FAULT_INJECT="hang_at_step:6:rank:1"))
    err = [l for l in p.stderr.splitlines() if l.startswith("[0] ctr: error:")]
    check(p.returncode == 75 and err and "flight recorder: " in err[0] and "rank 1 never issued #" in err[0]
          and "all_gather 'bucket.all_gather" in err[0].split("never issued")[1],
          f"skipped collective: {p.returncode} {p.stderr[-1500:]}")


def async_error(graph):
    """ctr_mesh_async_error: a rank stopped with SIGSTOP is reported to the others in the
    background while they do nothing on the mesh, within the timeout plus two heartbeats."""
    binding = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python")
    code = (
        "import sys, time, ctr\n"
        "m = ctr.Mesh.from_env(timeout=%s)\n"
        "print('joined', flush=True)\n"
        "if m.rank == 0:\n"
        "    t0 = time.monotonic()\n"
        "    while time.monotonic() - t0 < 60:\n"
        "        e = m.async_error()\n"
        "        if e: print('async', round(time.monotonic() - t0, 2), e, flush=True); break\n"
        "        time.sleep(0.05)\n"
        "else:\n"
        "    time.sleep(120)\n" % TIMEOUT_S)
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = []
    for r in range(2):
        env = clean_env(CTR_RANK=str(r), CTR_WORLD_SIZE="2", CTR_MASTER_PORT=str(port), PYTHONPATH=binding,
                        CTR_LIBRARY=os.environ.get("CTR_LIBRARY", ""))
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    for p in procs:
        p.stdout.readline()
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        out, err = procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        out, err = procs[0].communicate()
    procs[1].kill()
    procs[1].communicate()
    check("async" in out and "rank 1 sent no heartbeat" in out, f"async error: {out} {err[-800:]}")
    if "async" in out:
        took = float(out.split()[1])
        check(took <= TIMEOUT_S * 1.25 + 1.0, f"async error after {took} s (timeout {TIMEOUT_S} s)")


def stopped_rank(graph):
    """SIGSTOP of a rank mid-training: the others name it within the timeout plus 3 s (the
    transport's grace to cancel transfers and the wait for the ranks' flight records), and
    the job ends."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([CTR, "launch", "-n", "2", "--", *train_args(graph, 2, 100000)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(CTR_TEST_MARK=mark))
    out, err = Drain(proc.stdout), Drain(proc.stderr)
    pids = rank_pids(proc.pid, 2)
    check(len(pids) == 2, "ranks did not start")
    # Let it train a little, then stop rank 1.
    out.wait_for(lambda l: "step" in l and "loss" in l, 60)
    os.kill(pids[1], signal.SIGSTOP)
    t_stop = time.monotonic()
    proc.wait(timeout=60)
    ended = time.monotonic() - t_stop
    named_at = err.time_of(lambda l: l.startswith("[0] ctr: error:") and "rank 1" in l)
    named_at = None if named_at is None else named_at - t_stop
    check(named_at is not None and named_at <= TIMEOUT_S + 3.0,
          f"a stopped rank was named after {named_at} s (timeout {TIMEOUT_S} s)")
    check(proc.returncode == 75, f"job with a stopped rank exited {proc.returncode}")
    check(ended <= TIMEOUT_S + 5.0, f"the job ended {ended:.1f} s after the stop")
    check(not processes_marked(mark), f"stopped rank: processes left behind: {processes_marked(mark)}")

    # The launcher itself ends a job whose rank stays stopped (--stopped-ms), before any
    # collective times out.
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([CTR, "launch", "-n", "2", "--stopped-ms", "1000", "--",
                             *train_args(graph, 2, 100000, timeout_s=30)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(CTR_TEST_MARK=mark))
    out, err_lines = Drain(proc.stdout), Drain(proc.stderr)
    pids = rank_pids(proc.pid, 2)
    out.wait_for(lambda l: "loss" in l, 60)
    os.kill(pids[1], signal.SIGSTOP)
    t_stop = time.monotonic()
    proc.wait(timeout=60)
    err_lines.thread.join(5)
    err = "".join(l for _, l in err_lines.lines)
    ended = time.monotonic() - t_stop
    check("rank 1 has been stopped (signal 19) for 1.0 s" in err, f"launcher did not name the stopped rank: {err}")
    check(ended < 1.0 + 6.0, f"launcher took {ended:.1f} s to end a job with a stopped rank")
    check(not processes_marked(mark), f"stopped-ms: processes left behind: {processes_marked(mark)}")


def killed_launcher(graph):
    """SIGKILL of `ctr launch`: its ranks die with it (within 2 s)."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([CTR, "launch", "-n", "2", "--", *train_args(graph, 2, 100000)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=clean_env(CTR_TEST_MARK=mark))
    out = Drain(proc.stdout)
    pids = rank_pids(proc.pid, 2)
    out.wait_for(lambda l: "loss" in l, 60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    while processes_marked(mark) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    left = processes_marked(mark)
    check(not left and time.monotonic() - t0 < 2.0,
          f"ranks outlived a killed launcher by {time.monotonic() - t0:.1f} s: {left}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    check(len(pids) == 2, "ranks did not start")


def final_loss(metrics):
    lines = [json.loads(l) for l in open(metrics)]
    return lines[-1]["step"], lines[-1]["loss"], [l["step"] for l in lines]


def restart(graph, tmp):
    """--max-restarts: a job whose rank is killed resumes from its last checkpoint and ends
    with the uninterrupted run's final loss, bit for bit; the metrics file is continuous."""
    steps = 24
    results = {}
    for name, inject, restarts in (("plain", None, 0), ("killed", "kill_at_step:13:rank:1", 2)):
        d = os.path.join(tmp, name)
        metrics = os.path.join(tmp, name + ".jsonl")
        env = clean_env(CTR_TEST_MARK=uuid.uuid4().hex)
        if inject:
            env["CTR_FAULT_INJECT"] = inject
        p = subprocess.run([CTR, "launch", "-n", "2", "--max-restarts", str(restarts), "--",
                            *train_args(graph, 2, steps, ["--save-every", "5", "--save-dir", d,
                                                          "--resume", "latest", "--metrics", metrics])],
                           capture_output=True, text=True, timeout=240, env=env)
        check(p.returncode == 0, f"{name} run exited {p.returncode}: {p.stderr[-3000:]}")
        if p.returncode == 0:
            results[name] = final_loss(metrics)
        if inject:
            check("restarting the job (restart 1 of 2)" in p.stderr, f"no restart: {p.stderr[-2000:]}")
            check("resumed from" in p.stdout and "step_00000010" in p.stdout,
                  f"the restart did not resume from step 10: {p.stdout[-2000:]}")
        else:
            check("no checkpoint in" in p.stdout, f"--resume latest without a checkpoint: {p.stdout[-1000:]}")
    if len(results) == 2:
        check(results["plain"][:2] == results["killed"][:2],
              f"final step/loss differ: uninterrupted {results['plain'][:2]}, restarted {results['killed'][:2]}")
        check(results["killed"][2] == list(range(1, steps + 1)),
              f"metrics of the restarted run are not one step each: {results['killed'][2]}")

    # A failure a restart cannot fix (exit status 1) is not retried.
    p = subprocess.run([CTR, "launch", "-n", "2", "--max-restarts", "3", "--", CTR, "run", "/nonexistent.ctrg",
                        "--steps", "5", "--batch", "2"],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    check(p.returncode == 1 and "restarting" not in p.stderr, f"permanent failure retried: {p.stderr}")


def nonfinite(graph, tmp):
    """A NaN loss injected at step 4, under each --on-nonfinite behaviour."""
    def run_with(name, args, inject="nan_at_step:4:rank:0", world=1):
        metrics = os.path.join(tmp, f"nf_{name}.jsonl")
        cmd = [CTR, "run", graph, "--batch", "2", "--steps", "10", "--log-every", "1", "--metrics", metrics,
               "--mesh", f"fsdp={world}", *args]
        if world > 1:
            cmd = [CTR, "launch", "-n", str(world), "--", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env(CTR_FAULT_INJECT=inject))
        lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
        return p, lines

    p, ref = run_with("ref", [], inject="")
    check(p.returncode == 0 and len(ref) == 10, f"reference run: {p.returncode} {p.stderr[-500:]}")
    check(all(0 < l["mfu"] < 1 for l in ref), f"MFU out of range: {[l.get('mfu') for l in ref]}")

    p, lines = run_with("stop", [])
    check(p.returncode == 1 and "step 4: loss nan" in p.stderr and "not finite" in p.stderr,
          f"stop: {p.returncode} {p.stderr[-800:]}")
    check([l["step"] for l in lines] == [1, 2, 3], f"stop: metrics of steps {[l['step'] for l in lines]}")

    p, lines = run_with("skip", ["--on-nonfinite", "skip"])
    check(p.returncode == 0 and "1 skipped (non-finite)" in p.stdout, f"skip: {p.returncode} {p.stdout[-800:]}")
    check([l["skipped_steps"] for l in lines] == [0, 0, 0] + [1] * 7, f"skip: {[l['skipped_steps'] for l in lines]}")
    check([l["loss"] for l in lines[:3]] == [l["loss"] for l in ref[:3]], "skip: steps before the NaN differ")
    p, lines = run_with("skip2", ["--on-nonfinite", "skip"], inject="nan_at_step:4:rank:1", world=2)
    check(p.returncode == 0 and lines and lines[-1]["skipped_steps"] == 1,
          f"skip on one of two ranks: {p.returncode} {p.stderr[-800:]}")

    d = os.path.join(tmp, "nf_ckpt")
    p, lines = run_with("rewind", ["--on-nonfinite", "rewind", "--save-every", "2", "--save-dir", d])
    check(p.returncode == 0 and "step 4: not finite; rewound to" in p.stdout and "(step 2)" in p.stdout
          and "step 4: passing over the batch" in p.stdout, f"rewind: {p.returncode} {p.stdout[-1500:]} {p.stderr[-500:]}")
    check([l["step"] for l in lines] == list(range(1, 11)), f"rewind: metrics steps {[l['step'] for l in lines]}")
    check([l["loss"] for l in lines[:3]] == [l["loss"] for l in ref[:3]], "rewind: steps before the NaN differ")
    check(all(l["skipped_steps"] == 0 for l in lines), "rewind counted a skipped update")
    p, _ = run_with("rewind0", ["--on-nonfinite", "rewind", "--save-dir", os.path.join(tmp, "none")])
    check(p.returncode == 1 and "needs a checkpoint" in p.stderr, f"rewind without a checkpoint: {p.stderr[-500:]}")


def stragglers(graph, tmp):
    """A rank slowed by an injected delay is named as a straggler in the log and the
    metrics; an even job names nobody."""
    for inject, want in (("slow:60:rank:2", [2]), ("", [])):
        metrics = os.path.join(tmp, "strag.jsonl")
        p = subprocess.run([CTR, "launch", "-n", "3", "--", *train_args(graph, 3, 20, [
            "--straggler-every", "5", "--straggler-factor", "3", "--metrics", metrics])],
                           capture_output=True, text=True, timeout=120, env=clean_env(CTR_FAULT_INJECT=inject))
        check(p.returncode == 0, f"straggler run ({inject}): {p.returncode} {p.stderr[-800:]}")
        lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
        named = [l["stragglers"] for l in lines if l["step"] % 5 == 0]
        if want:
            check("straggler at step 5: rank 2:" in p.stderr, f"slow rank not named: {p.stderr[-800:]}")
            check(named and all(n == want for n in named), f"stragglers in the metrics: {named}")
        else:
            check("straggler" not in p.stderr and all(n == [] for n in named),
                  f"an even job named a straggler: {named} {p.stderr[-500:]}")


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_faults_")
    try:
        graph = os.path.join(tmp, "g.ctrg")
        subprocess.run([CTR, "graph", "build", "--preset", "gpt", "--layers", "2", "--dim", "32", "--heads", "2",
                        "--vocab", "256", "--seq", "16", "-o", graph], check=True, capture_output=True)
        for part in (killed_ranks, killed_rank_without_launcher, stopped_rank, skipped_collective, async_error,
                     killed_launcher):
            t0 = time.monotonic()
            part(graph)
            print(f"faults: {part.__name__} done in {time.monotonic() - t0:.1f} s", flush=True)
        t0 = time.monotonic()
        stragglers(graph, tmp)
        print(f"faults: stragglers done in {time.monotonic() - t0:.1f} s", flush=True)
        t0 = time.monotonic()
        nonfinite(graph, tmp)
        print(f"faults: nonfinite done in {time.monotonic() - t0:.1f} s", flush=True)
        t0 = time.monotonic()
        restart(graph, tmp)
        print(f"faults: restart done in {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("faults: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
