#!/usr/bin/python3
"""`ctr check` under `ctr launch`: clean meshes of 2 and 4 ranks pass and rank 0
alone prints a table of every collective on every communicator; a rank that
corrupts its input is named with the collective and communicator; a rank that
sleeps before each timed collective is named as slow (exit 3); a rank that never
arrives fails the job within the mesh timeout (exit 75); bad options are usage
errors.
Sizes and iterations are small: the whole test takes seconds on two cores.

usage: test_check.py PATH_TO_CTR
"""
import os
import subprocess
import sys
import time

CTR = os.path.abspath(sys.argv[1])
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier"]
SMALL = ["--bytes", "64K", "--iters", "4", "--warmup", "1"]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def launch(n, *args, inject=None, expect=0, timeout=60):
    env = dict(os.environ)
    env.pop("CTR_CHECK_INJECT", None)
    if inject:
        env["CTR_CHECK_INJECT"] = inject
    t0 = time.monotonic()
    p = subprocess.run([CTR, "launch", "-n", str(n), "--grace-ms", "1000", "--", CTR, "check",
                        *args], capture_output=True, text=True, timeout=timeout, env=env)
    elapsed = time.monotonic() - t0
    what = f"check -n {n} {' '.join(args)} (inject {inject})"
    if p.returncode != expect:
        failures.append(f"{what} exited {p.returncode}, expected {expect}\n"
                        f"stdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}")
    return p, elapsed


def tables(stdout):
    """{communicator heading: [collective names of its rows]} from rank 0's output."""
    out, current = {}, None
    for line in stdout.splitlines():
        check(line.startswith("[0]"), f"a rank other than 0 printed: {line!r}")
        text = line[4:] if line.startswith("[0] ") else line[3:]
        if text.startswith("the world") or text.startswith("axis "):
            current = text.split(", the slowest group")[0]
            out[current] = []
        elif current and text.startswith("  ") and text.split()[0] in COLLECTIVES:
            out[current].append(text.split()[0])
        elif not text.strip():
            current = None
    return out


def clean_run(n, mesh_args, headings):
    p, elapsed = launch(n, *mesh_args, *SMALL)
    check("results: all exact" in p.stdout, f"-n {n}: no exact-results line: {p.stdout[-2000:]}")
    check("no slow rank" in p.stdout, f"-n {n}: a clean job has a slow rank: {p.stdout[-1500:]}")
    got = tables(p.stdout)
    check(list(got) == headings, f"-n {n}: communicators {list(got)}, expected {headings}")
    for head, rows in got.items():
        # The 4-byte all_reduce (latency) first, then every collective at --bytes.
        check(rows == ["all_reduce"] + COLLECTIVES, f"-n {n}: {head}: rows {rows}")
    check("(latency)" in p.stdout, f"-n {n}: no latency row")
    check("ctr: error" not in p.stderr, f"-n {n}: errors: {p.stderr[-1500:]}")
    return elapsed


def main():
    t_all = time.monotonic()

    # A world of one rank has no communicator: nothing to check, not an error.
    p = subprocess.run([CTR, "check"], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("CTR_")})
    check(p.returncode == 0 and "one rank" in p.stdout, f"one rank: {p.returncode} {p.stdout}")

    clean_run(2, [], ["the world (2 ranks)", "axis fsdp (2 ranks)"])
    clean_run(4, ["--mesh", "dp=2,fsdp=2"],
              ["the world (4 ranks)", "axis dp (2 groups of 2 ranks)",
               "axis fsdp (2 groups of 2 ranks)"])

    # Rank 1 adds one to one element of its input to every all_gather: the error
    # names the collective, each communicator, the sizes and rank 1 as the source.
    p, _ = launch(4, "--mesh", "dp=2,fsdp=2", *SMALL, inject="corrupt:1:all_gather", expect=1)
    errors = [l for l in p.stderr.splitlines() if "ctr: error:" in l]
    check(len(errors) == 3, f"corrupt all_gather: {len(errors)} error lines, expected 3 "
                            f"(world, dp, fsdp): {p.stderr[-2000:]}")
    for where in ["the world (4 ranks)", "axis dp", "axis fsdp"]:
        check(any(f"all_gather on {where}" in l and "4 KiB, 64 KiB" in l and
                  "the data from rank 1 was wrong" in l for l in errors),
              f"corrupt all_gather: nothing names all_gather on {where}: {errors}")
    check("results: WRONG" in p.stdout, f"corrupt: no WRONG line: {p.stdout[-1500:]}")

    # A wrong reduction: every rank of the group gets a wrong sum, and the gather
    # of the inputs that follows names the rank whose input was wrong.
    p, _ = launch(2, *SMALL, inject="corrupt:0:all_reduce", expect=1)
    errors = [l for l in p.stderr.splitlines() if "ctr: error:" in l]
    check(len(errors) == 2 and all("all_reduce on" in l and "wrong result on ranks 0, 1" in l and
                                   "the data from rank 0 was wrong" in l for l in errors),
          f"corrupt all_reduce: {errors}")

    # Rank 1 sleeps 20 ms before each timed collective: it is named, exit 3.
    p, _ = launch(2, *SMALL, inject="slow:1:20", expect=3)
    check("rank 1 is slow" in p.stderr, f"slow rank 1 not named: {p.stderr[-1500:]}")
    p, _ = launch(4, "--mesh", "dp=2,fsdp=2", *SMALL, inject="slow:2:20", expect=3)
    check("rank 2 is slow" in p.stderr, f"slow rank 2 not named: {p.stderr[-1500:]}")

    # A rank that never arrives: rank 0 fails within --timeout naming it, with the
    # status of a failure a restart may get past.
    p, elapsed = launch(2, *SMALL, "--timeout", "2", inject="slow:1:60000", expect=75)
    check("timed out" in p.stderr and "waiting for rank 1" in p.stderr,
          f"missing rank not named: {p.stderr[-1500:]}")
    check(elapsed < 20, f"the job with a missing rank took {elapsed:.1f} s to end (timeout 2 s)")

    # Bad input: usage errors exit 2 before any rendezvous; a bad mesh or
    # injection spec is an error naming it.
    for bad in (["--bytes", "lots"], ["--bytes", "0"], ["--iters", "0"], ["--no-such-option"]):
        p = subprocess.run([CTR, "check", *bad], capture_output=True, text=True, timeout=30)
        check(p.returncode == 2, f"check {bad}: exit {p.returncode}, expected 2: {p.stderr}")
    p, _ = launch(2, "--mesh", "dp=3", expect=1)
    check("dp=3" in p.stderr, f"bad mesh not named: {p.stderr[-800:]}")
    p, _ = launch(2, *SMALL, inject="corrupt:1:gather", expect=1)
    check("CTR_CHECK_INJECT" in p.stderr, f"bad injection not named: {p.stderr[-800:]}")

    print(f"check test: {time.monotonic() - t_all:.1f} s")
    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
