#!/usr/bin/python3
"""tools/gpu/check.sh on a build tree with the GPUs hidden (CUDA_VISIBLE_DEVICES empty), as on
a machine without one: it exits 0 within its budget, leaves exactly summary.txt, logs.tar.xz and
console.log, the probe and the plugin test pass, the probe found glibc, and every GPU stage is
skipped with a reason.

usage: test_gpu_check.py CHECK_SH BUILD_DIR
"""
import os
import subprocess
import sys
import tarfile
import tempfile
import time

CHECK, BUILD = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
GPU_STAGES = ["smoke", "gpu_suite", "rerun", "memcheck", "gpt2_small", "kernels", "ranks", "bench"]
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def stages(summary):
    """stage name -> (result, note) from summary.txt's table."""
    out, table = {}, False
    for line in summary.splitlines():
        if line.startswith("stage "):
            table = True
            continue
        if table and not line.strip():
            break
        if table:
            parts = line.split(None, 3)
            out[parts[0]] = (parts[1], parts[3] if len(parts) > 3 else "")
    return out


def main():
    with tempfile.TemporaryDirectory(prefix="ctr_gpu_check_") as tmp:
        report = os.path.join(tmp, "report")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TMPDIR=tmp)
        env.pop("CTR_CHECK_DEVICE", None)
        t0 = time.monotonic()
        p = subprocess.run([CHECK, report, "--from-build", BUILD, "--budget", "100"], capture_output=True,
                           text=True, timeout=150, env=env)
        elapsed = time.monotonic() - t0
        check(p.returncode == 0, f"check.sh exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        check(elapsed < 100, f"check.sh took {elapsed:.0f} s on a budget of 100 s")
        files = sorted(os.listdir(report)) if os.path.isdir(report) else []
        check(files == ["console.log", "logs.tar.xz", "summary.txt"], f"report files: {files}")
        if failures:
            return 1
        summary = open(os.path.join(report, "summary.txt")).read()
        console = open(os.path.join(report, "console.log")).read()
        check(console == p.stdout, "console.log is not what check.sh printed")
        got = stages(summary)
        for name in ["probe", "plugin"]:
            check(got.get(name, ("missing",))[0] == "PASS", f"stage {name}: {got.get(name)}\n{summary}")
        for name in GPU_STAGES:
            result, note = got.get(name, ("missing", ""))
            check(result == "SKIP" and note.startswith("no usable GPU: ") and len(note) > len("no usable GPU: "),
                  f"stage {name} is not skipped for want of a GPU: {result} {note}")
        check(any(line.strip().startswith("glibc: 2.") for line in summary.splitlines()),
              f"the probe found no glibc version:\n{summary}")
        check("ctr version: ctr " in summary, f"no ctr version in the summary:\n{summary}")
        with tarfile.open(os.path.join(report, "logs.tar.xz")) as t:
            names = t.getnames()
        for log in ["logs/probe.txt", "logs/plugin.log", "logs/ctr_version.log"]:
            check(log in names, f"{log} missing from logs.tar.xz: {names}")
        # Only the three report files: the check's own scratch directory is gone.
        check(os.listdir(tmp) == ["report"], f"left behind in TMPDIR: {os.listdir(tmp)}")

    for f in failures:
        print("FAIL:", f)
    print(f"gpu check: {'FAIL' if failures else 'ok'} ({elapsed:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
