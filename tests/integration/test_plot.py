#!/usr/bin/python3
"""`ctr plot`: a real `ctr run --metrics` file and a hand-written one (with MFU,
eval losses, non-finite losses, communication times and a cut-off last line)
drawn into one SVG, read back with xml.etree: every series of every run is a
<path> with as many points as the file has finite values, the legend names both
files, the notes count the gaps. Then the errors: a missing file, a line of
garbage, an empty file, a line that is not an object or lacks its step, bad usage.

usage: test_plot.py PATH_TO_CTR
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

CTR = os.path.abspath(sys.argv[1])
SVG = "{http://www.w3.org/2000/svg}"
failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)


def run(*args, expect=0, timeout=120):
    p = subprocess.run([CTR, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != expect:
        failures.append(f"`ctr {' '.join(args)}` exited {p.returncode}, expected {expect}\n"
                        f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


def error_line(p, *words):
    """A failure is exactly one 'ctr: error:' line naming each of words."""
    lines = [l for l in p.stderr.splitlines() if not l.startswith("ctr: warning:")]
    check(len(lines) == 1 and lines[0].startswith("ctr: error:"),
          f"expected one 'ctr: error:' line, got: {p.stderr!r}")
    for w in words:
        check(w in p.stderr, f"error does not mention {w!r}: {p.stderr!r}")


def points(d):
    """Coordinate pairs of a path's d attribute."""
    return len(re.findall(r"-?\d+(?:\.\d+)?,-?\d+(?:\.\d+)?", d))


def series(root):
    """{(run, series): (data-points, drawn points)} of the chart's lines."""
    out = {}
    for el in root.iter(SVG + "path"):
        if el.get("class") == "series":
            key = (el.get("data-run"), el.get("data-series"))
            check(key not in out, f"series {key} drawn twice")
            out[key] = (int(el.get("data-points")), points(el.get("d")))
    return out


def texts(root):
    return ["".join(t.itertext()) for t in root.iter(SVG + "text")]


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_plot_")
    p = lambda name: os.path.join(tmp, name)

    # A real run's metrics.
    graph = p("g.ctrg")
    run("graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "32", "--heads", "2",
        "--vocab", "256", "--seq", "16", "-o", graph)
    steps = 12
    run("run", graph, "--steps", str(steps), "--batch", "2", "--log-every", "0",
        "--eval-every", "6", "--eval-batches", "1", "--metrics", p("real.jsonl"))
    real = [json.loads(l) for l in open(p("real.jsonl"))]
    check(len(real) == steps, f"the run wrote {len(real)} lines for {steps} steps")

    # A second run written by hand, as another tool (Python's json) would: MFU,
    # NaN and infinite losses, communication times, and a last line still being written.
    nonfinite = {4: math.nan, 9: math.inf}
    hand_steps = 15
    with open(p("hand.jsonl"), "w") as f:
        for s in range(1, hand_steps + 1):
            f.write(json.dumps({"step": s, "loss": nonfinite.get(s, 6.0 - 0.2 * s),
                                "tokens_per_s": 1000.0 + 10 * s, "mfu": 0.25 + 0.01 * s,
                                "exposed_comm_ms": 0.5 * s, "comm_ms": 1.0 * s}) + "\n")
        f.write('{"step": 16, "loss": 2.')

    out = p("run.svg")
    r = run("plot", p("real.jsonl"), p("hand.jsonl"), "-o", out, "--comm", "--log-loss",
            "--title", "real & hand")
    check("incomplete last line" in r.stderr and "hand.jsonl:16" in r.stderr,
          f"no warning for the cut-off last line: {r.stderr!r}")
    check(r.stdout.startswith(f"wrote {out}: 2 runs"), f"summary: {r.stdout!r}")
    root = ET.parse(out).getroot()
    check(root.tag == SVG + "svg", f"root element {root.tag}")
    got = series(root)
    want = {
        ("real.jsonl", "loss"): steps,
        ("real.jsonl", "eval_loss"): 2,
        ("real.jsonl", "tokens_per_s"): steps,
        ("real.jsonl", "exposed_comm_ms"): steps,
        ("real.jsonl", "comm_ms"): steps,
        ("real.jsonl", "mfu"): steps,
        ("hand.jsonl", "loss"): hand_steps - len(nonfinite),
        ("hand.jsonl", "tokens_per_s"): hand_steps,
        ("hand.jsonl", "mfu"): hand_steps,
        ("hand.jsonl", "exposed_comm_ms"): hand_steps,
        ("hand.jsonl", "comm_ms"): hand_steps,
    }
    check(set(got) == set(want), f"series drawn: {sorted(got)}, expected {sorted(want)}")
    for key, n in want.items():
        if key in got:
            check(got[key] == (n, n), f"{key}: {got[key]} points (declared, drawn), expected {n}")
    gaps = [el for el in root.iter(SVG + "path")
            if el.get("class") == "gaps" and el.get("data-run") == "hand.jsonl"]
    check(len(gaps) == 1 and gaps[0].get("data-points") == "2", "the two gaps are not marked")
    legend = [g.get("data-run") for g in root.iter(SVG + "g") if g.get("class") == "legend"]
    check(legend == ["real.jsonl", "hand.jsonl"], f"legend: {legend}")
    headings = [g.get("data-heading") for g in root.iter(SVG + "g") if g.get("class") == "panel"]
    check(len(headings) == 4 and headings[0].startswith("loss (log scale)") and
          headings[1].startswith("throughput") and headings[2].startswith("MFU") and
          headings[3].startswith("communication"), f"panels: {headings}")
    words = texts(root)
    check("real & hand" in words, "no title")
    check(any("hand.jsonl: 2 non-finite losses drawn as gaps (steps 4, 9)" in t for t in words),
          f"no note on the gaps: {words[-4:]}")
    check("%" in " ".join(words), "the MFU axis has no percent labels")

    # One run without MFU (the run's lines less their "mfu"): the panel is left out, and a
    # note says why.
    with open(p("real.jsonl")) as f, open(p("nomfu.jsonl"), "w") as g:
        for line in f:
            d = json.loads(line)
            d.pop("mfu", None)
            g.write(json.dumps(d) + "\n")
    out1 = p("one.svg")
    run("plot", p("nomfu.jsonl"), "-o", out1)
    root = ET.parse(out1).getroot()
    check(not any(s == "mfu" for _, s in series(root)), "an MFU line without MFU data")
    check(any("no MFU in these runs" in t for t in texts(root)), "no note on the missing MFU")

    # Errors name the file (and line); nothing is written.
    missing = p("missing.jsonl")
    r = run("plot", p("real.jsonl"), missing, "-o", p("x.svg"), expect=1)
    error_line(r, missing, "cannot open")
    with open(p("garbage.jsonl"), "w") as f:
        f.write(json.dumps(real[0]) + "\nthis is not json\n" + json.dumps(real[1]) + "\n")
    r = run("plot", p("garbage.jsonl"), "-o", p("x.svg"), expect=1)
    error_line(r, p("garbage.jsonl") + ":2:", "not valid JSON")
    open(p("empty.jsonl"), "w").close()
    r = run("plot", p("empty.jsonl"), "-o", p("x.svg"), expect=1)
    error_line(r, p("empty.jsonl"), "no metrics lines")
    with open(p("array.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": 3}\n[1, 2]\n')
    r = run("plot", p("array.jsonl"), "-o", p("x.svg"), expect=1)
    error_line(r, p("array.jsonl") + ":2:", "expected a JSON object")
    with open(p("nostep.jsonl"), "w") as f:
        f.write('{"loss": 3}\n')
    r = run("plot", p("nostep.jsonl"), "-o", p("x.svg"), expect=1)
    error_line(r, p("nostep.jsonl") + ":1:", '"step"')
    with open(p("badloss.jsonl"), "w") as f:
        f.write('{"step": 1, "loss": "low"}\n')
    r = run("plot", p("badloss.jsonl"), "-o", p("x.svg"), expect=1)
    error_line(r, p("badloss.jsonl") + ":1:", '"loss" is a string')
    check(not os.path.exists(p("x.svg")), "a failed plot wrote its output")

    # Usage errors exit 2.
    run("plot", p("real.jsonl"), expect=2)
    run("plot", "-o", p("x.svg"), expect=2)
    run("plot", p("real.jsonl"), "-o", p("x.svg"), "--width", "10", expect=2)

    if failures:
        print(f"{len(failures)} failure(s); files kept in {tmp}:")
        for f in failures:
            print(" -", f)
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
