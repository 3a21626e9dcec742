#!/usr/bin/python3
"""Checkpoints through the ctr tool: exact resume, resharding onto other meshes
(fsdp, ep, tp and cp), refusal of damaged checkpoints with a fallback to the previous good one, and
crash safety of a save.

usage: test_checkpoint.py CTR
"""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

CTR = os.path.abspath(sys.argv[1])
TIME_LIMIT = 240
STEPS = 20
GLOBAL_BATCH = 12
failures = []
tmp = tempfile.mkdtemp(prefix="ctr_ckpt_")
graph = os.path.join(tmp, "g.ctrg")


def run(args, nprocs=1, expect=0, env=None):
    cmd = [CTR, *args] if nprocs == 1 else [CTR, "launch", "-n", str(nprocs), "--", CTR, *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT,
                           env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        failures.append(f"timed out: {' '.join(cmd)}")
        return None
    if p.returncode != expect:
        failures.append(f"`{' '.join(cmd)}` exited {p.returncode}, expected {expect}\n"
                        f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def train(name, mesh_world, extra, metrics):
    world = mesh_world
    args = ["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH // world),
            "--log-every", "0", "--lr", "3e-3", "--warmup", "3", "--metrics", metrics,
            "--mesh", f"fsdp={world}", *extra]
    return run(args, nprocs=world)


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)] if os.path.exists(path) else []


def check(cond, msg):
    if not cond:
        failures.append(msg)


_xxhash = ctypes.CDLL("libxxhash.so.0")
_xxhash.XXH3_64bits.restype = ctypes.c_uint64
_xxhash.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def meta_checksum(meta):
    """The checksum a checkpoint's meta.json carries: xxh3 of its compact JSON (sorted keys)
    without the checksum key, as 16 hex digits."""
    text = json.dumps({k: v for k, v in meta.items() if k != "checksum"}, separators=(",", ":"),
                      sort_keys=True, ensure_ascii=False).encode()
    return "%016x" % _xxhash.XXH3_64bits(text, len(text))


def main():
    run(["graph", "build", "--preset", "llama", "--layers", "2", "--dim", "48", "--heads", "4",
         "--kv-heads", "2", "--vocab", "250", "--seq", "32", "-o", graph])

    # Reference: 20 uninterrupted steps on one rank.
    ref_path = os.path.join(tmp, "ref.jsonl")
    train("ref", 1, [], ref_path)
    ref = losses(ref_path)
    check(len(ref) == STEPS, f"reference run wrote {len(ref)} steps")

    # 1. Same mesh, stop at 10, resume: bitwise identical (1 rank and fsdp=2).
    for world in (1, 2):
        d = os.path.join(tmp, f"same{world}")
        full = os.path.join(tmp, f"full{world}.jsonl")
        a, b = os.path.join(tmp, f"a{world}.jsonl"), os.path.join(tmp, f"b{world}.jsonl")
        train("full", world, [], full)
        train("a", world, ["--stop-after", "10", "--save-every", "5", "--save-dir", d], a)
        train("b", world, ["--resume", "latest", "--save-dir", d], b)
        got = losses(a) + losses(b)
        want = losses(full)
        check(len(got) == STEPS and got == want,
              f"fsdp={world}: resumed losses are not bitwise equal to an uninterrupted run:\n"
              f"  {want}\n  {got}")

    # 2. Another mesh: fsdp=4 -> 2 -> 1 -> 3 (global batch 12 throughout), with an
    #    asynchronous save on the way; compared with the one-rank reference.
    d = os.path.join(tmp, "reshard")
    parts = []
    chain = [(4, 5), (2, 10), (1, 15), (3, 20)]
    for k, (world, stop) in enumerate(chain):
        m = os.path.join(tmp, f"r{k}.jsonl")
        extra = ["--save-every", "5", "--save-dir", d, "--stop-after", "5"]
        if k > 0:
            extra += ["--resume", "latest"]
        if k == 1:
            extra += ["--async-save"]
        train(f"r{k}", world, extra, m)
        parts += losses(m)
    check(len(parts) == STEPS, f"reshard chain produced {len(parts)} steps")
    if len(parts) == STEPS and len(ref) == STEPS:
        worst = max(abs(x - y) / abs(y) for x, y in zip(parts, ref))
        check(worst <= 1e-5, f"fsdp 4->2->1->3 differs from one rank by {worst:.2e} relative")
        print(f"reshard 4->2->1->3: max relative loss difference {worst:.2e}")

    # 2b. A mixture-of-experts model moves between expert layouts: ep=2 -> 1 rank ->
    #     ep=4 -> ep=2 x tp=2 (the attention split over tp) -> ep=2 x fsdp=2 (its experts
    #     split 2, 1, 4, 2 and 2 ways), with the loader
    #     state; compared with its own one-rank reference.
    moe_graph = os.path.join(tmp, "moe.ctrg")
    run(["graph", "build", "--preset", "moe", "--layers", "2", "--dim", "32", "--heads", "4",
         "--kv-heads", "2", "--vocab", "256", "--seq", "32", "--experts", "4", "--top-k", "2",
         "--ffn-dim", "32", "--shared-ffn-dim", "16", "-o", moe_graph])

    def train_moe(world, mesh, extra, metrics):
        data = world // (2 if "tp=2" in mesh else 1)  # a tp group reads the same rows
        args = ["run", moe_graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH // data),
                "--log-every", "0", "--lr", "3e-3", "--warmup", "3", "--metrics", metrics,
                "--mesh", mesh, *extra]
        return run(args, nprocs=world)

    moe_ref_path = os.path.join(tmp, "moe_ref.jsonl")
    train_moe(1, "fsdp=1", [], moe_ref_path)
    moe_ref = losses(moe_ref_path)
    d = os.path.join(tmp, "moe_reshard")
    parts = []
    for k, (world, mesh) in enumerate([(2, "ep=2"), (1, "fsdp=1"), (4, "ep=4"), (4, "ep=2,tp=2"),
                                       (4, "ep=2,fsdp=2")]):
        m = os.path.join(tmp, f"moe{k}.jsonl")
        extra = ["--save-every", "4", "--save-dir", d, "--stop-after", "4"]
        if k > 0:
            extra += ["--resume", "latest"]
        train_moe(world, mesh, extra, m)
        parts += losses(m)
    check(len(parts) == STEPS and len(moe_ref) == STEPS,
          f"moe reshard chain produced {len(parts)} steps, reference {len(moe_ref)}")
    if len(parts) == STEPS and len(moe_ref) == STEPS:
        worst = max(abs(x - y) / abs(y) for x, y in zip(parts, moe_ref))
        check(worst <= 1e-5, f"moe ep 2->1->4->2 x tp 2->2 x fsdp 2 differs from one rank by {worst:.2e} relative")
        print(f"moe reshard ep=2 -> 1 -> ep=4 -> ep=2,tp=2 -> ep=2,fsdp=2: max relative loss difference {worst:.2e}")

    # 2c. Tensor parallelism: the same llama moves between tp=2 x fsdp=2 (its
    #     attention and MLP weights split on their output or input dim, then on
    #     rows; its head of 250 words split over the vocabulary, 125 rows per tp
    #     rank, 63 and 62 per fsdp rank) -> fsdp=4 -> tp=2 -> one rank; compared
    #     with the one-rank reference.
    d = os.path.join(tmp, "tp_reshard")
    parts = []
    for k, (world, mesh) in enumerate([(4, "fsdp=2,tp=2"), (4, "fsdp=4"), (2, "tp=2"), (1, "fsdp=1")]):
        m = os.path.join(tmp, f"tp{k}.jsonl")
        shares = world // (2 if "tp=2" in mesh else 1)  # a tp group reads one share of the batch
        extra = ["--save-every", "5", "--save-dir", d, "--stop-after", "5"]
        if k > 0:
            extra += ["--resume", "latest"]
        run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH // shares), "--log-every", "0",
             "--lr", "3e-3", "--warmup", "3", "--metrics", m, "--mesh", mesh, *extra], nprocs=world)
        parts += losses(m)
        if k == 0 and os.path.exists(m):
            # Communication per mesh axis (ctr_step_comm_metrics): both axes, adding up to comm_ms.
            for line in open(m):
                j = json.loads(line)
                axes = j.get("comm_ms_by_axis", {})
                check(sorted(axes) == ["fsdp", "tp"] and all(v > 0 for v in axes.values())
                      and abs(sum(axes.values()) - j["comm_ms"]) <= 1e-6 * j["comm_ms"] + 1e-6,
                      f"comm per axis on {mesh}: {axes}, comm_ms {j['comm_ms']}")
    check(len(parts) == STEPS, f"tp reshard chain produced {len(parts)} steps")
    if len(parts) == STEPS and len(ref) == STEPS:
        worst = max(abs(x - y) / abs(y) for x, y in zip(parts, ref))
        check(worst <= 1e-5, f"tp=2 x fsdp=2 -> fsdp=4 -> tp=2 -> 1 differs from one rank by {worst:.2e} relative")
        print(f"reshard tp=2,fsdp=2 -> fsdp=4 -> tp=2 -> 1: max relative loss difference {worst:.2e}")

    # 2d. Context parallelism: parameters replicated over cp, so the same llama
    #     moves between fsdp=2 x cp=2 -> cp=2 -> tp=2 x cp=2 -> one rank; a cp
    #     group reads one share of the batch, as a tp group does.
    d = os.path.join(tmp, "cp_reshard")
    parts = []
    for k, (world, mesh) in enumerate([(4, "fsdp=2,cp=2"), (2, "cp=2"), (4, "tp=2,cp=2"), (1, "fsdp=1")]):
        m = os.path.join(tmp, f"cp{k}.jsonl")
        shares = world // (2 if "cp=2" in mesh else 1) // (2 if "tp=2" in mesh else 1)
        extra = ["--save-every", "5", "--save-dir", d, "--stop-after", "5"]
        if k > 0:
            extra += ["--resume", "latest"]
        run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH // shares), "--log-every", "0",
             "--lr", "3e-3", "--warmup", "3", "--metrics", m, "--mesh", mesh, *extra], nprocs=world)
        parts += losses(m)
    check(len(parts) == STEPS, f"cp reshard chain produced {len(parts)} steps")
    if len(parts) == STEPS and len(ref) == STEPS:
        worst = max(abs(x - y) / abs(y) for x, y in zip(parts, ref))
        check(worst <= 1e-5, f"cp=2 x fsdp=2 -> cp=2 -> tp=2 x cp=2 -> 1 differs from one rank by {worst:.2e} relative")
        print(f"reshard fsdp=2,cp=2 -> cp=2 -> tp=2,cp=2 -> 1: max relative loss difference {worst:.2e}")

    # 3. Damaged checkpoints are refused with a message naming file and tensor,
    #    and --resume latest falls back to the previous good one.
    d = os.path.join(tmp, "damage")
    train("d", 2, ["--stop-after", "10", "--save-every", "5", "--save-dir", d, "--keep", "5"],
          os.path.join(tmp, "d.jsonl"))
    newest = os.path.join(d, "step_00000010")
    backup = os.path.join(tmp, "backup")
    shutil.copytree(newest, backup)

    def restore():
        shutil.rmtree(newest)
        shutil.copytree(backup, newest)

    def load_once(expect_ok, needle, label):
        p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
                 "--resume", newest, "--stop-after", "1"], expect=0 if expect_ok else 1)
        if p is not None and not expect_ok:
            check("ctr: error: checkpoint error" in p.stderr and needle in p.stderr,
                  f"{label}: message lacks '{needle}': {p.stderr.strip()}")

    shard = os.path.join(newest, "rank00000.bin")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    load_once(False, "rank00000.bin", "truncated shard")
    restore()
    with open(shard, "r+b") as f:
        f.seek(size // 3)
        b = f.read(1)
        f.seek(size // 3)
        f.write(bytes([b[0] ^ 0x40]))
    load_once(False, "checksum mismatch in tensor", "flipped byte")
    restore()
    os.remove(os.path.join(newest, "meta.json"))
    load_once(False, "meta.json", "missing metadata")
    restore()
    other = os.path.join(tmp, "other.ctrg")
    run(["graph", "build", "--preset", "llama", "--layers", "2", "--dim", "64", "--heads", "4",
         "--vocab", "256", "--seq", "32", "-o", other])
    p = run(["run", other, "--steps", "2", "--batch", "2", "--log-every", "0", "--resume", newest],
            expect=1)
    if p is not None:
        check("mismatched graph" in p.stderr, f"mismatched graph message: {p.stderr.strip()}")
    load_once(True, "", "restored copy")
    # Corrupt the newest, then --resume latest must warn and use step 5.
    with open(shard, "r+b") as f:
        f.seek(size // 3)
        f.write(b"\xff\xff\xff\xff")
    p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
             "--resume", "latest", "--save-dir", d, "--stop-after", "1"])
    if p is not None:
        check("unusable" in p.stderr and "step_00000005" in p.stdout,
              f"fallback to the previous checkpoint did not happen:\n{p.stdout}\n{p.stderr}")
    restore()

    # Metadata is checked before it is believed: its checksum, then every size in it
    # against the graph and the files. Edits with the checksum recomputed reach the
    # size checks; a claim of 2^34 rows is refused by name, not met with an allocation.
    meta_path = os.path.join(newest, "meta.json")
    check(meta_checksum(json.load(open(meta_path))) == json.load(open(meta_path))["checksum"],
          "this test's checksum does not reproduce the library's")

    def edit_meta(change, fix_checksum=True):
        meta = json.load(open(meta_path))
        change(meta)
        if fix_checksum:
            meta["checksum"] = meta_checksum(meta)
        json.dump(meta, open(meta_path, "w"))

    # Entries are boxes (per dim [lo, hi)); a version-2 entry's "rows" are read as a
    # box whole in the other dims and checked the same way.
    def huge(m, key):
        e = m["shards"][0]
        if key == "box":
            e["box"][0] = [0, 2 ** 34]
        else:
            del e["box"]
            e["rows"] = [0, 2 ** 34]

    for key in ("box", "rows"):
        edit_meta(lambda m: huge(m, key))
        load_once(False, "rows 0..17179869184 of", f"2^34 rows ({key})")
        p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
                 "--resume", "latest", "--save-dir", d, "--stop-after", "1"])
        if p is not None:
            check("unusable" in p.stderr and "step_00000005" in p.stdout and "out of memory" not in p.stderr,
                  f"2^34 rows ({key}): no fallback to the previous checkpoint:\n{p.stdout}\n{p.stderr}")
        restore()
    edit_meta(lambda m: m["shards"][0].update(box=[[0, 1]]))
    load_once(False, "a box of 1 dims for a tensor of 2", "box of the wrong rank")
    restore()
    edit_meta(lambda m: m["shards"][0].update(offset=1 << 40))
    load_once(False, "the file has", "offset past the file")
    restore()
    edit_meta(lambda m: m.update(step=10 ** 15))
    load_once(False, "step 1000000000000000 is out of range", "absurd step")
    restore()
    edit_meta(lambda m: m.update(step=7), fix_checksum=False)
    load_once(False, "checksum mismatch (the file was damaged or edited)", "edited metadata")
    restore()

    # A damaged `latest` (garbage; a short printable line followed by more garbage; a
    # name that is not a checkpoint's; a megabyte of random bytes) falls back to the
    # newest complete one, and the warning names `latest`.
    for junk in (b"\x00\xffnot a name\n", b"@`\n" + bytes(range(256)), b"elsewhere\n", os.urandom(1 << 20)):
        with open(os.path.join(d, "latest"), "wb") as f:
            f.write(junk)
        p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
                 "--resume", "latest", "--save-dir", d, "--stop-after", "1"])
        if p is not None:
            check("step_00000010" in p.stdout and "latest" in p.stderr,
                  f"damaged latest ({len(junk)} bytes): {p.stdout}\n{p.stderr}")
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("step_00000010\n")

    # When one of two ranks finds its shard damaged, both report that rank's own error.
    with open(os.path.join(newest, "rank00001.bin"), "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 0x01]))
    p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH // 2), "--log-every", "0",
             "--mesh", "fsdp=2", "--resume", newest, "--stop-after", "1"], nprocs=2, expect=1)
    if p is not None:
        rank0 = [l for l in p.stderr.splitlines() if l.startswith("[0]") and "error" in l]
        check(rank0 and "rank 1: " in rank0[0] and "rank00001.bin: checksum mismatch" in rank0[0],
              f"rank 0 does not show rank 1's error: {p.stderr}")
    restore()

    # 4. A process killed in the middle of a save leaves the previous checkpoint
    #    as `latest`, and it loads.
    d = os.path.join(tmp, "crash")
    train("c1", 1, ["--stop-after", "5", "--save-every", "5", "--save-dir", d],
          os.path.join(tmp, "c1.jsonl"))
    p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
             "--resume", "latest", "--save-dir", d, "--save-every", "5", "--stop-after", "5"],
            expect=86, env={"CTR_FAULT_INJECT": "save_before_publish"})
    latest = open(os.path.join(d, "latest")).read().strip() if os.path.exists(os.path.join(d, "latest")) else ""
    check(latest == "step_00000005", f"after a crash in save, latest is '{latest}'")
    check(not os.path.exists(os.path.join(d, "step_00000010")),
          "a crashed save left a step_00000010 directory")
    p = run(["run", graph, "--steps", str(STEPS), "--batch", str(GLOBAL_BATCH), "--log-every", "0",
             "--resume", "latest", "--save-dir", d, "--stop-after", "1"])
    if p is not None:
        check("resumed from" in p.stdout and "step_00000005" in p.stdout,
              f"resume after crash: {p.stdout}")

    # 5. Weights out as safetensors, and a readable header.
    st = os.path.join(tmp, "w.safetensors")
    run(["run", graph, "--steps", "2", "--batch", "2", "--log-every", "0", "--export-safetensors", st])
    if os.path.exists(st):
        raw = open(st, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        check("tok_embeddings.weight" in header and header["tok_embeddings.weight"]["shape"] == [250, 48],
              f"safetensors header: {list(header)[:5]}")
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        check(len(raw) == 8 + n + end, "safetensors data size does not match its header")

    # 6. ctr export from a checkpoint; the file round-trips through --init-safetensors.
    st2 = os.path.join(tmp, "from_ckpt.safetensors")
    run(["export", graph, "--checkpoint", os.path.join(tmp, "same1", "step_00000010"), "--safetensors", st2])
    m1, m2 = os.path.join(tmp, "i1.jsonl"), os.path.join(tmp, "i2.jsonl")
    run(["run", graph, "--steps", "3", "--batch", "2", "--log-every", "0", "--init-safetensors", st2,
         "--metrics", m1, "--schedule", "constant", "--lr", "0"])
    run(["run", graph, "--steps", "3", "--batch", "2", "--log-every", "0", "--metrics", m2,
         "--schedule", "constant", "--lr", "0"])
    l1, l2 = losses(m1), losses(m2)
    check(len(l1) == 3 and len(l2) == 3 and l1[0] < l2[0] - 0.05,
          f"parameters from the safetensors file should give a trained model's loss: {l1} vs {l2}")
    p = run(["run", graph, "--steps", "1", "--batch", "2", "--init-safetensors", graph], expect=1)
    if p is not None:
        check("ctr: error:" in p.stderr and graph in p.stderr, f"bad safetensors message: {p.stderr}")

    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("checkpoint: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
