#!/usr/bin/python3
"""End-to-end checks of `ctr data` (tokenize, inspect, convert) and of training
from a manifest of weighted datasets with `ctr run --data manifest.json`,
including the loader state a checkpoint keeps and a resume from it.

Files are checked byte by byte with struct, independently of the library that
wrote them, so a writer bug cannot hide behind the same reader. Every failure
must be one 'ctr: error:' line on stderr and exit status 1.

usage: test_data_cli.py PATH_TO_CTR
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

CTR = os.path.abspath(sys.argv[1])
failures = []


def run(*args, expect=0, timeout=300):
    p = subprocess.run([CTR, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != expect:
        failures.append(f"`ctr {' '.join(args)}` exited {p.returncode}, expected {expect}\n"
                        f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


def check(cond, msg):
    if not cond:
        failures.append(msg)


def error_line(p, *words):
    """A failure is exactly one 'ctr: error:' line naming each of words."""
    lines = [l for l in p.stderr.splitlines() if not l.startswith("ctr: warning:")]
    check(len(lines) == 1 and lines[0].startswith("ctr: error:"),
          f"expected one 'ctr: error:' line, got: {p.stderr!r}")
    for w in words:
        check(w in p.stderr, f"error does not mention {w!r}: {p.stderr!r}")


# --- Readers of each format, written from the format descriptions -------------------------

def read_llmc(path):
    raw = open(path, "rb").read()
    magic, version, count = struct.unpack_from("<iii", raw, 0)
    width = {20240520: 2, 20240801: 4}[magic]
    check(version == {2: 1, 4: 7}[width], f"{path}: bad llm.c version {version}")
    check(len(raw) == 1024 + count * width, f"{path}: size does not match the header count")
    fmt = "<%d%s" % (count, "H" if width == 2 else "I")
    return width, list(struct.unpack_from(fmt, raw, 1024))


def read_npy(path):
    raw = open(path, "rb").read()
    check(raw[:6] == b"\x93NUMPY", f"{path}: no .npy magic")
    major = raw[6]
    hlen = struct.unpack_from("<H" if major == 1 else "<I", raw, 8)[0]
    start = 10 if major == 1 else 12
    header = eval(raw[start:start + hlen].decode("latin1"))  # NumPy's own literal syntax
    check(start + hlen == len(raw) - header["shape"][0] * int(header["descr"][2]) and
          (start + hlen) % 64 == 0, f"{path}: bad .npy layout")
    code = {"<u2": "H", "<u4": "I", "<i4": "i"}[header["descr"]]
    n = header["shape"][0]
    return header["descr"], list(struct.unpack_from("<%d%s" % (n, code), raw, start + hlen))


def read_raw(path, width):
    raw = open(path, "rb").read()
    return list(struct.unpack("<%d%s" % (len(raw) // width, "H" if width == 2 else "I"), raw))


def write_npy(path, descr, values):
    code = {"<u2": "H", "<u4": "I", "<i4": "i", "<f4": "f"}[descr]
    d = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (descr, len(values))
    pad = (10 + len(d) + 1 + 63) // 64 * 64 - 10 - len(d) - 1
    header = (d + " " * pad + "\n").encode()
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header)
        f.write(struct.pack("<%d%s" % (len(values), code), *values))


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_data_cli_")
    p = lambda name: os.path.join(tmp, name)

    a_text = b"the quick brown fox jumps over the lazy dog.\n" * 120
    b_text = b"Pack my box with five dozen liquor jugs!\n" * 90
    open(p("a.txt"), "wb").write(a_text)
    open(p("b.txt"), "wb").write(b_text)
    want = list(a_text) + [256] + list(b_text)

    # --- tokenize ----------------------------------------------------------------------------
    r = run("data", "tokenize", p("a.txt"), p("b.txt"), "-o", p("ab.bin"), "--eot", "256")
    check("llm.c uint16" in r.stdout and f"{len(want):,} tokens" in r.stdout,
          f"tokenize summary: {r.stdout!r}")
    if os.path.exists(p("ab.bin")):
        width, toks = read_llmc(p("ab.bin"))
        check(width == 2 and toks == want, "tokenize llmc: wrong tokens")
    run("data", "tokenize", p("a.txt"), "-o", p("a.npy"), "--format", "npy")
    if os.path.exists(p("a.npy")):
        descr, toks = read_npy(p("a.npy"))
        check(descr == "<u2" and toks == list(a_text), "tokenize npy: wrong tokens")
    run("data", "tokenize", p("b.txt"), "-o", p("b.u32"), "--format", "u32")
    check(os.path.exists(p("b.u32")) and read_raw(p("b.u32"), 4) == list(b_text),
          "tokenize u32: wrong tokens")
    run("data", "tokenize", p("a.txt"), p("b.txt"), "-o", p("wide.bin"), "--eot", "70000")
    if os.path.exists(p("wide.bin")):
        width, toks = read_llmc(p("wide.bin"))
        check(width == 4 and toks[len(a_text)] == 70000, "tokenize: an eot above 65535 needs uint32")

    r = run("data", "tokenize", p("a.txt"), "-o", p("x.u16"), "--format", "u16", "--eot", "70000",
            expect=1)
    error_line(r, "70000")
    r = run("data", "tokenize", p("missing.txt"), "-o", p("x.bin"), expect=1)
    error_line(r, p("missing.txt"))
    check(not os.path.exists(p("x.bin")) and not os.path.exists(p("x.bin.tmp")),
          "a failed tokenize left a file behind")

    # --- inspect -----------------------------------------------------------------------------
    r = run("data", "inspect", p("ab.bin"), "--seq", "32", "--eot", "256")
    for s in ["llm.c uint16", f"tokens: {len(want):,}", "max id: 256", "distinct ids:",
              "most frequent:", "first tokens: 116 104 101", "end-of-text id 256: 1 occurrences",
              "samples at seq 32:", "in documents mode"]:
        check(s in r.stdout, f"inspect lacks {s!r}: {r.stdout!r}")
    r = run("data", "inspect", p("b.u32"), "--format", "u32")
    check("uint32" in r.stdout and f"tokens: {len(b_text):,}" in r.stdout and "as text:" in r.stdout,
          f"inspect u32: {r.stdout!r}")

    manifest = p("mix.json")
    json.dump({"datasets": [{"files": ["ab.bin"], "weight": 0.7, "name": "prose"},
                            {"files": ["a.npy", "b.u32"], "weight": 0.3, "format": "auto"}]},
              open(manifest, "w"))
    r = run("data", "inspect", p("mix.json"))
    # b.u32 read as auto is bytes: the shard list is "mixed formats".
    for s in ["2 sub-datasets", "dataset 0: prose", "70.0% of draws", "dataset 1: a.npy, b.u32",
              "30.0% of draws", "files: 2, read as one sequence", "npy uint16"]:
        check(s in r.stdout, f"manifest inspect lacks {s!r}: {r.stdout!r}")

    write_npy(p("f4.npy"), "<f4", [1.0, 2.0])
    r = run("data", "inspect", p("f4.npy"), expect=1)
    error_line(r, p("f4.npy"), "dtype '<f4'")
    open(p("trunc.npy"), "wb").write(open(p("a.npy"), "rb").read()[:200])
    r = run("data", "inspect", p("trunc.npy"), expect=1)
    error_line(r, p("trunc.npy"), "truncated")
    json.dump({"datasets": [{"files": ["ab.bin"], "weight": -1}]}, open(p("bad.json"), "w"))
    r = run("data", "inspect", p("bad.json"), expect=1)
    error_line(r, p("bad.json"), "weight")

    # --- convert -----------------------------------------------------------------------------
    run("data", "convert", p("ab.bin"), "-o", p("ab.npy"), "--to", "npy")
    run("data", "convert", p("ab.npy"), "-o", p("ab.u32"), "--to", "u32")
    run("data", "convert", p("ab.u32"), "--format", "u32", "-o", p("ab2.bin"), "--to", "llmc")
    if os.path.exists(p("ab.npy")):
        check(read_npy(p("ab.npy")) == ("<u2", want), "convert to npy: wrong tokens")
    check(os.path.exists(p("ab.u32")) and read_raw(p("ab.u32"), 4) == want,
          "convert to u32: wrong tokens")
    check(os.path.exists(p("ab2.bin")) and
          open(p("ab2.bin"), "rb").read() == open(p("ab.bin"), "rb").read(),
          "llmc -> npy -> u32 -> llmc is not the original file")
    # In place: the output replaces the input only once it is complete.
    run("data", "convert", p("ab.u32"), "--format", "u32", "-o", p("ab.u32"), "--to", "u16")
    check(read_raw(p("ab.u32"), 2) == want, "in-place convert: wrong tokens")

    big = [1, 2, 65536, 3]
    open(p("big.u32"), "wb").write(struct.pack("<4I", *big))
    r = run("data", "convert", p("big.u32"), "--format", "u32", "-o", p("big.u16"), "--to", "u16",
            expect=1)
    error_line(r, p("big.u32"), "65536", "position 2", "16 bits")
    check(not os.path.exists(p("big.u16")) and not os.path.exists(p("big.u16.tmp")),
          "a refused convert left a file behind")
    r = run("data", "convert", p("big.u32"), "--format", "u32", "-o", p("big.npy"), "--to", "npy",
            "--width", "2", expect=1)
    error_line(r, "65536")
    run("data", "convert", p("big.u32"), "--format", "u32", "-o", p("big.bin"), "--to", "llmc")
    if os.path.exists(p("big.bin")):
        check(read_llmc(p("big.bin")) == (4, big), "convert picked the wrong llm.c width")
    write_npy(p("neg.npy"), "<i4", [5, -1, 7])
    r = run("data", "convert", p("neg.npy"), "-o", p("neg.bin"), "--to", "u32", expect=1)
    error_line(r, p("neg.npy"), "-1", "position 1")
    r = run("data", "convert", manifest, "-o", p("m.bin"), "--to", "llmc", expect=1)
    error_line(r, "manifest")
    r = run("data", "convert", p("ab.bin"), "-o", p("x.bin"), "--to", "bytes", expect=2)

    # --- training from a manifest ------------------------------------------------------------
    graph = p("tiny.ctrg")
    run("graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "32", "--heads", "2",
        "--vocab", "320", "--seq", "32", "-o", graph)
    for mode in ["windows", "documents"]:
        m = p(f"train_{mode}.json")
        spec = {"datasets": [{"files": ["ab.bin"], "weight": 0.7},
                             {"files": ["a.npy"], "weight": 0.3}], "mode": mode}
        if mode == "documents":
            spec["eot"] = 256
        json.dump(spec, open(m, "w"))
        save = p(f"ck_{mode}")
        metrics = p(f"m_{mode}.jsonl")
        r = run("run", graph, "--data", m, "--steps", "6", "--batch", "4", "--seq", "16",
                "--save-every", "3", "--save-dir", save, "--stop-after", "3", "--log-every", "1",
                "--metrics", metrics)
        check(f"data {m}: manifest of 2 datasets in 2 files" in r.stdout,
              f"run banner does not describe the manifest: {r.stdout[:400]!r}")
        meta_path = os.path.join(save, "step_00000003", "meta.json")
        if os.path.exists(meta_path):
            loader = json.load(open(meta_path))["loader"]
            check(loader["seq"] == 16 and loader["mode"] == mode and loader["draws"] == 12 and
                  len(loader["datasets"]) == 2, f"checkpoint loader state: {loader}")
            counts = [d["epoch"] * d["samples"] + d["position"] for d in loader["datasets"]]
            check(sum(counts) == 12 and abs(counts[0] - 0.7 * 12) <= 2,
                  f"12 draws at 0.7/0.3 gave {counts}")
        else:
            failures.append(f"no checkpoint at {meta_path}")
        r = run("run", graph, "--data", m, "--steps", "6", "--batch", "4", "--seq", "16",
                "--save-every", "3", "--save-dir", save, "--resume", "latest", "--log-every", "1")
        check("resumed from" in r.stdout and "step 6/6" in r.stdout, f"resume: {r.stdout[-400:]!r}")
        meta_path = os.path.join(save, "step_00000006", "meta.json")
        if os.path.exists(meta_path):
            loader = json.load(open(meta_path))["loader"]
            check(loader["draws"] == 24, f"after 6 steps of 4 rows the loader drew {loader['draws']}")
        # The same checkpoint refuses a loader over other data, naming the mismatch.
        r = run("run", graph, "--data", p("ab.bin"), "--steps", "7", "--batch", "4", "--seq", "16",
                "--save-dir", save, "--resume", os.path.join(save, "step_00000006"), expect=1)
        error_line(r, "data loader state", "another manifest" if mode == "windows" else "mode")

    r = run("run", graph, "--data", p("bad.json"), "--steps", "1", "--batch", "1", expect=1)
    error_line(r, p("bad.json"), "weight")
    json.dump({"datasets": [{"files": ["ab.bin"]}], "mode": "documents"}, open(p("noeot.json"), "w"))
    r = run("run", graph, "--data", p("noeot.json"), "--steps", "1", "--batch", "1", expect=1)
    error_line(r, "eot")

    # Ids that no int32 vocabulary holds: a negative id of an int32 .npy file and a uint32 id
    # above 2^31 are named as they are, without advice to build a 4-billion-token vocabulary.
    import numpy as np
    neg = np.full(4096, 5, dtype="<i4")
    neg[::7] = -3
    np.save(p("neg.npy"), neg)
    r = run("run", graph, "--data", p("neg.npy"), "--steps", "1", "--batch", "2", "--seq", "16", expect=1)
    error_line(r, p("neg.npy"), "is id 4294967293 (-3 as a signed int32)", "another dtype")
    check("4294967294" not in r.stderr, f"vocabulary advice for a negative id: {r.stderr}")
    big = np.full(4096, 5, dtype="<u4")
    big[::7] = 3_000_000_000
    np.save(p("big.npy"), big.astype("<u4"))
    r = run("run", graph, "--data", p("big.npy"), "--steps", "1", "--batch", "2", "--seq", "16", expect=1)
    error_line(r, p("big.npy"), "is id 3000000000 (")

    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
