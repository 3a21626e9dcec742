#!/usr/bin/python3
"""Cross-language bit-identity: the same training recipe through C, Rust, Go
and Python prints byte-identical losses.

usage: run_xlang.py BUILD_DIR

Builds tests/bindings/xlang.c (with cc, against BUILD_DIR/lib/libctr.so and
the public header only), tests/bindings/xlang_rust and tests/bindings/xlang_go,
runs them and tests/bindings/xlang_python.py, and compares their standard
output byte for byte. Each prints `step <i> loss <%.17g>` for 10 steps; since
%.17g round-trips a double, equal text means bit-equal losses, i.e. every
binding hands the library the same options, data and call order.

The C program is the reference and must run. A binding whose toolchain (or,
for Python, whose program) is missing is skipped with a note; if none could
run, the test exits 77 (skipped). All programs run with the same
CTR_NUM_THREADS so the library's reductions are split the same way.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import xlang_toolchains as tc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_TIME_LIMIT = 300  # seconds per program
LINE = re.compile(r"step (\d+) loss (\S+)")


def run(cmd, env):
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, timeout=RUN_TIME_LIMIT)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {RUN_TIME_LIMIT} s"
    if p.returncode != 0:
        return None, f"exit {p.returncode}\n{p.stderr.decode(errors='replace')[-3000:]}"
    return p.stdout, None


def check_shape(out):
    """None if out is exactly 10 well-formed, finite lines; else what is wrong."""
    lines = out.decode(errors="replace").splitlines()
    if len(lines) != 10:
        return f"{len(lines)} lines instead of 10"
    for i, line in enumerate(lines, 1):
        m = LINE.fullmatch(line)
        if not m or int(m.group(1)) != i:
            return f"line {i} is {line!r}"
        try:
            float(m.group(2))
        except ValueError:
            return f"line {i} has no number: {line!r}"
    return None


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    build = os.path.abspath(sys.argv[1])
    env = tc.base_env(build)
    env["CTR_NUM_THREADS"] = os.environ.get("CTR_NUM_THREADS", "2")
    out_dir = os.path.join(build, "bindings-out", "xlang")
    os.makedirs(out_dir, exist_ok=True)

    programs = []  # (name, command)
    failures = []

    cc = os.environ.get("CC", "cc")
    c_bin = os.path.join(out_dir, "xlang_c")
    err = tc.run_build([cc, "-std=c99", "-Wall", "-Wextra", "-I",
                        os.path.join(tc.SRC, "include"), os.path.join(HERE, "xlang.c"),
                        "-L", os.path.join(build, "lib"), "-lctr", "-o", c_bin],
                       tc.compiler_env(build))
    if err:
        print(f"xlang: C: build failed: {err}")
        return 1
    programs.append(("C", [c_bin]))

    cargo = tc.find_cargo()
    if cargo is None:
        print("xlang: Rust: SKIP: no cargo found")
    else:
        path, err = tc.build_rust_bin(build, out_dir, cargo, os.path.join(HERE, "xlang_rust"), "ctr-xlang")
        if err:
            failures.append(f"Rust: build failed: {err}")
        else:
            programs.append(("Rust", [path]))

    go = tc.find_go()
    if go is None:
        print("xlang: Go: SKIP: no go toolchain found")
    else:
        path, err = tc.build_go_bin(build, out_dir, go, os.path.join(HERE, "xlang_go"), "xlang_go")
        if err:
            failures.append(f"Go: build failed: {err}")
        else:
            programs.append(("Go", [path]))

    py = os.path.join(HERE, "xlang_python.py")
    if not os.path.exists(py):
        print("xlang: Python: SKIP: tests/bindings/xlang_python.py does not exist yet")
    else:
        programs.append(("Python", [sys.executable, py]))

    outputs = {}
    for name, cmd in programs:
        out, err = run(cmd, env)
        if err:
            failures.append(f"{name}: {' '.join(cmd)}: {err}")
            continue
        shape = check_shape(out)
        if shape:
            failures.append(f"{name}: malformed output: {shape}\n{out.decode(errors='replace')}")
            continue
        outputs[name] = out

    ref = outputs.get("C")
    if ref is not None:
        print("xlang: C reference:\n" + ref.decode())
        for name, out in outputs.items():
            if name == "C":
                continue
            if out == ref:
                print(f"xlang: {name}: byte-identical to C")
            else:
                diff = [f"  line {i}: C {a!r} vs {name} {b!r}"
                        for i, (a, b) in enumerate(zip(ref.decode().splitlines(),
                                                       out.decode().splitlines()), 1) if a != b]
                failures.append(f"{name}: output differs from C:\n" + "\n".join(diff))

    if failures:
        print(f"xlang: {len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    compared = [n for n in outputs if n != "C"]
    if not compared:
        print("xlang: SKIP: no binding could run, nothing to compare with C")
        return 77
    print(f"xlang: {', '.join(['C'] + compared)} print byte-identical losses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
