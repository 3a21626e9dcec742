#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora, tests/fuzz/corpus/<target>/, from scratch.

    tests/fuzz/make_corpus.py BUILD_DIR [OUT_DIR]

BUILD_DIR is a configured and built meson build directory; its `ctr` tool makes
the graph files, token files and safetensors weights, and, in a -Dfuzz=true
build, fuzz_checkpoint writes a real checkpoint of its model. Rendezvous frames
and option strings are written here by hand (the store's wire format is
described in lib/comm/store.cc). OUT_DIR defaults to tests/fuzz/corpus; each
target's directory is emptied first, so the result depends only on the sources.

Graph seeds for ops no preset uses (the element-wise unary ops, the general math ops, the layout
ops) are written with ctr_export's graph writer (tools/export/ctr_export/graphfile.py), which
needs flatc and Python's flatbuffers and numpy (.venv/bin/python3 has them); the models of
tests/zoo are exported with ctr_export itself (torch).

The small model is the one of tests/fuzz/fuzz_common.h (GPT, 1 layer, width 8,
2 heads, vocabulary 16, 4 positions): the safetensors and checkpoint seeds only
reach the deep paths when their tensors match it.
"""

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

SMALL = ["--layers", "1", "--dim", "8", "--heads", "2", "--vocab", "16", "--seq", "4"]


def run(*args, env=None):
    subprocess.run([str(a) for a in args], check=True, stdout=subprocess.DEVNULL, env=env)


def put(directory, name, data):
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------------------
# Files made by the ctr tool


def graphs(ctr, out, tmp):
    for name, args in [
        ("gpt", ["--preset", "gpt"] + SMALL),
        ("gpt_untied_2layers", ["--preset", "gpt", "--layers", "2", "--dim", "8", "--heads", "2",
                                "--vocab", "16", "--seq", "4", "--untied"]),
        ("llama_gqa", ["--preset", "llama", "--layers", "1", "--dim", "8", "--heads", "2",
                       "--kv-heads", "1", "--vocab", "16", "--seq", "4", "--ffn-dim", "16"]),
        ("moe_shared", ["--preset", "moe", "--layers", "1", "--dim", "8", "--heads", "2",
                        "--vocab", "16", "--seq", "4", "--experts", "3", "--top-k", "2",
                        "--ffn-dim", "8", "--shared-ffn-dim", "4"]),
        ("moe_top1_sigmoid", ["--preset", "moe", "--layers", "1", "--dim", "8", "--heads", "2",
                              "--vocab", "16", "--seq", "4", "--experts", "4", "--top-k", "1",
                              "--ffn-dim", "8", "--router-score", "sigmoid", "--aux-loss", "0"]),
    ]:
        path = os.path.join(tmp, name + ".ctrg")
        run(ctr, "graph", "build", *args, "-o", path)
        shutil.copy(path, os.path.join(out, name + ".ctrg"))


# ---------------------------------------------------------------------------
# Graphs written with ctr_export's graph writer: ops that no preset uses.

def graphfile():
    """ctr_export's graph writer, loaded from the source tree by itself: the package's
    __init__ would import the tracer, and with it PyTorch."""
    name = "ctr_export_graphfile"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                            "export", "ctr_export", "graphfile.py")
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


UNARY_VOCAB, UNARY_DIM, UNARY_SEQ = 128, 8, 4  # the vocabulary covers `ctr run`'s synthetic corpus


class GraphWriter:
    """A graph file built tensor by tensor for the written seeds: parameters drawn from a
    seeded normal, constants and nodes appended in order (ids are list positions)."""

    def __init__(self, seed):
        import numpy as np
        self.np = np
        self.gf = graphfile()
        self.rng = np.random.default_rng(seed)
        self.tensors, self.nodes = [], []

    def tensor(self, name, **kw):
        self.tensors.append(self.gf.TensorDef(name=name, **kw))
        return len(self.tensors) - 1

    def ids(self, name):
        return self.tensor(name, dtype=self.gf.DTYPE["I32"], dims=["batch", "seq"],
                           role=self.gf.ROLE["Input"])

    def param(self, name, shape, std):
        data = (self.rng.standard_normal(shape) * std).astype("<f4").tobytes()
        return self.tensor(name, dims=list(shape), role=self.gf.ROLE["Param"],
                           init=self.gf.INIT["Data"], data=data)

    def const(self, name, values, shape):
        data = self.np.asarray(values, dtype="<f4").reshape(shape).tobytes()
        return self.tensor(name, dims=list(shape), role=self.gf.ROLE["Const"],
                           init=self.gf.INIT["Data"], data=data)

    def node(self, op, name, inputs, attrs=None):
        out = self.tensor(name)
        self.nodes.append(self.gf.NodeDef(op=op, name=name, inputs=inputs, outputs=[out],
                                          attrs=attrs or {}))
        return out

    def graph(self, name, loss, vocab, max_seq):
        return self.gf.GraphDef(name=name, tensors=self.tensors, nodes=self.nodes, loss=loss,
                                metadata=[("vocab", str(vocab)), ("max_seq", str(max_seq))])


def unary_ops_graph():
    """tokens -> embedding -> every element-wise unary op in turn -> linear head ->
    cross-entropy. Each op's input stays in its domain whatever the weights: tanh and erf
    bound the embedding, sigmoid maps it into (0.3, 0.7), and from there sqrt, rsqrt,
    reciprocal and pow stay in (0.5, 1.4), log below 0, neg above 0, exp in (1, 1.6)."""
    w = GraphWriter(0)

    tokens = w.ids("tokens")
    targets = w.ids("targets")
    wte = w.param("wte", (UNARY_VOCAB, UNARY_DIM), 1.0)
    head = w.param("head.weight", (UNARY_VOCAB, UNARY_DIM), 0.5)
    x = w.node("embedding", "emb", [wte, tokens])
    for op, attrs in [("tanh", None), ("erf", None), ("sigmoid", None), ("sqrt", None),
                      ("rsqrt", None), ("reciprocal", None), ("pow", {"exponent": 1.5}),
                      ("log", None), ("neg", None), ("exp", None)]:
        x = w.node(op, op, [x], attrs)
    logits = w.node("linear", "logits", [x, head])
    loss = w.node("cross_entropy", "loss", [logits, targets])
    return w.graph("unary_ops", loss, UNARY_VOCAB, UNARY_SEQ)


def math_ops_graph():
    """tokens -> embedding -> the general math ops (broadcasting add, sub, mul and div with
    scalar constants of shape [] and [1], a trailing bias and size-1 dims; mean, var, amax,
    expand, masked_fill with -inf under a constant mask, softmax, log_softmax over the seq
    dim, sum, exact gelu) -> linear head -> cross-entropy. The mask leaves some features
    unmasked, so the softmax never sees a row of -inf."""
    w = GraphWriter(1)

    D = UNARY_DIM
    tokens = w.ids("tokens")
    targets = w.ids("targets")
    wte = w.param("wte", (UNARY_VOCAB, D), 1.0)
    bias = w.param("bias", (D,), 0.1)
    head = w.param("head.weight", (UNARY_VOCAB, D), 0.5)
    half = w.const("half", [0.5], [])
    two = w.const("two", [2.0], [1])
    one = w.const("one", [1.0], [])
    mask = w.const("mask", [0, 1, 0, 0, 1, 0, 0, 0][:D], [D])
    x = w.node("embedding", "emb", [wte, tokens])
    a = w.node("mul", "scaled", [x, half])
    a = w.node("sub", "shifted", [a, bias])
    a = w.node("div", "halved", [a, two])
    mu = w.node("mean", "mu", [a], {"dims": [-1], "keepdim": 1})
    a = w.node("sub", "centred", [a, mu])
    va = w.node("var", "var", [a], {"dims": [-1], "keepdim": 1})
    a = w.node("div", "normed", [a, w.node("add", "var1", [va, one])])
    mx = w.node("amax", "max", [a], {"dims": [-1], "keepdim": 1})
    a = w.node("add", "plus_max", [a, w.node("expand", "max_wide", [mx], {"shape": [-1, -1, D]})])
    a = w.node("masked_fill", "masked", [a, mask], {"value": float("-inf")})
    p = w.node("softmax", "probs", [a], {"dim": -1})
    q = w.node("log_softmax", "seq_logp", [x], {"dim": 1})
    s = w.node("sum", "seq_sum", [q], {"dims": [1], "keepdim": 1})
    h = w.node("mul", "mixed", [p, s])
    h = w.node("gelu", "gelu", [h], {"approximate": "none"})
    logits = w.node("linear", "logits", [h, head])
    loss = w.node("cross_entropy", "loss", [logits, targets])
    return w.graph("math_ops", loss, UNARY_VOCAB, UNARY_SEQ)


LAYOUT_MAX_SEQ = 8


def layout_ops_graph():
    """tokens -> embedding + a positional table sliced to "seq" -> times a constant
    (rotary-like) table sliced to "seq" -> reshape by size expressions, strided slices
    (torch's end 9223372036854775807 among them), cat of two and of three inputs,
    transpose, rope on interleaved pairs -> linear head -> cross-entropy. Every layout op with symbolic sizes,
    with max_seq above the fuzzer's seq so that the slices cut."""
    import numpy as np
    w = GraphWriter(1)
    D, V = 8, UNARY_VOCAB

    tokens = w.ids("tokens")
    targets = w.ids("targets")
    wte = w.param("wte", (V, D), 1.0)
    pos = w.param("wpe", (LAYOUT_MAX_SEQ, D), 0.1)
    angles = np.arange(LAYOUT_MAX_SEQ)[:, None] * 0.5 ** np.arange(D)[None, :]
    cos = w.const("rotary_cos", np.cos(angles), [LAYOUT_MAX_SEQ, D])
    head = w.param("head.weight", (V, 3 * D), 0.5)
    x = w.node("embedding", "emb", [wte, tokens])
    p = w.node("slice", "pos_seq", [pos], {"dim": 0, "end": "seq"})
    x = w.node("add", "emb_pos", [x, p])
    c = w.node("slice", "cos_seq", [cos], {"dim": 0, "start": 0, "end": "seq"})
    x = w.node("mul", "rotated", [x, c])
    flat = w.node("reshape", "flat", [x], {"dims": "batch*seq,-1"})
    even = w.node("slice", "even", [flat], {"dim": -1, "start": 0, "end": 9223372036854775807,
                                          "step": 2})
    odd = w.node("slice", "odd", [flat], {"dim": 1, "start": 1, "step": 2})
    swapped = w.node("cat", "swapped", [odd, even], {"dim": -1})
    pairs = w.node("reshape", "pairs", [swapped], {"dims": "batch,seq,2,4"})
    pairs = w.node("transpose", "pairs_t", [pairs], {"perm": [0, 1, 3, 2]})
    y = w.node("reshape", "mixed", [pairs], {"dims": "batch, seq, 2*4"})
    y = w.node("rope", "rope_pairs", [y], {"heads": 2, "theta": 100.0, "interleaved": 1})
    wide = w.node("cat", "wide", [y, x, y], {"dim": 2})
    logits = w.node("linear", "logits", [wide, head])
    loss = w.node("cross_entropy", "loss", [logits, targets])
    return w.graph("layout_ops", loss, V, LAYOUT_MAX_SEQ)


def written_graphs(out):
    put(out, "unary_ops.ctrg", graphfile().serialize(unary_ops_graph()))
    put(out, "math_ops.ctrg", graphfile().serialize(math_ops_graph()))
    put(out, "layout_ops.ctrg", graphfile().serialize(layout_ops_graph()))
    exported_graphs(out)


def exported_graphs(out):
    """The models of tests/zoo at a small size, exported with ctr_export's ATen
    tracer: graphs of the general ops in the shapes the fuse pass rewrites (attention, RMSNorm,
    SwiGLU, GELU and both RoPE forms). Skipped, with a note, where torch is missing."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(os.path.join(here, "..", ".."))
    sys.path[:0] = [os.path.join(root, "tools", "export"), os.path.join(root, "tests")]
    try:
        import torch
    except ImportError:
        print("make_corpus: torch is missing; the exported zoo seeds are not written")
        return
    import ctr_export
    for name in ("nanogpt", "gpt2_hf", "llama_meta", "llama_hf"):
        mod = importlib.import_module(f"zoo.{name}")
        # The vocabulary covers `ctr run`'s synthetic corpus, so the seeds also train there.
        model, loss_fn = mod.build(vocab=UNARY_VOCAB, seq=8, dim=16, heads=2, layers=1, seed=0)
        tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
        put(out, f"zoo_{name}.ctrg", ctr_export.export_bytes(model, (tokens, tokens), loss_fn))


def files(ctr, out, tmp):
    """fuzz_files: the first byte picks .bin (0), .npy (1), .json (2), .safetensors (3)."""
    text = os.path.join(tmp, "text.txt")
    with open(text, "w") as f:
        f.write("A few short lines of text.\nEach byte is one token.\n" * 3)
    made = {}
    for fmt, ext in [("llmc", "bin"), ("npy", "npy")]:
        path = os.path.join(tmp, f"tokens.{ext}")
        run(ctr, "data", "tokenize", text, "-o", path, "--format", fmt, "--eot", "256")
        made[fmt] = path
        wide = os.path.join(tmp, f"tokens4.{ext}")
        run(ctr, "data", "convert", path, "-o", wide, "--to", fmt, "--width", "4")
        made[fmt + "4"] = wide
    for key, head in [("llmc", 0), ("llmc4", 0), ("npy", 1), ("npy4", 1)]:
        with open(made[key], "rb") as f:
            put(out, f"{key}", bytes([head]) + f.read())
    # The harness keeps a data.txt next to the manifest.
    manifests = {
        "manifest_windows": {"datasets": [{"files": ["data.txt"], "weight": 0.7},
                                          {"files": ["data.txt", "data.txt"], "weight": 0.3,
                                           "name": "twice", "format": "bytes"}],
                             "format": "auto", "mode": "windows"},
        "manifest_documents": {"datasets": [{"files": ["data.txt"]}], "mode": "documents",
                               "eot": 10},
    }
    for name, m in manifests.items():
        put(out, name, bytes([2]) + json.dumps(m).encode())
    graph = os.path.join(tmp, "small.ctrg")
    run(ctr, "graph", "build", "--preset", "gpt", *SMALL, "-o", graph)
    weights = os.path.join(tmp, "small.safetensors")
    run(ctr, "export", graph, "--safetensors", weights)
    with open(weights, "rb") as f:
        put(out, "safetensors", bytes([3]) + f.read())


def checkpoint(build, out):
    """fuzz_checkpoint writes the checkpoint it saved (first byte 0: meta.json, 1: shard)."""
    exe = os.path.join(build, "tests", "fuzz", "fuzz_checkpoint")
    if not os.path.exists(exe):
        sys.exit(f"make_corpus: {exe} is missing: build with -Dfuzz=true (clang)")
    env = dict(os.environ, CTR_FUZZ_SEEDS=out)
    # Linked with the shared AddressSanitizer runtime (as tools/sanitize.sh
    # builds it), the fuzzer has libFuzzer's C++ library ahead of that runtime,
    # which must come first: preload it.
    ldd = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
    for line in ldd.splitlines():
        if "libclang_rt.asan" in line and "=>" in line:
            env["LD_PRELOAD"] = line.split("=>")[1].split("(")[0].strip()
    run(exe, env=env)


# ---------------------------------------------------------------------------
# Rendezvous frames: u32 length, then a u8 request kind and its fields
# (strings are a u32 length and bytes, integers little-endian i64).

HELLO, JOIN, SET, GET, ADD, BARRIER, PROOF, HEARTBEAT, FAILURE = 1, 2, 3, 4, 5, 6, 7, 8, 9
PROTOCOL = b"ctr-rendezvous/3"  # as lib/comm/store.cc speaks
WORLD = 3  # as in fuzz_store.cc
# The first byte of a seed: who sends the rest (see fuzz_store.cc).
STRANGER, RANK1 = b"\x00", b"\x01"


def frame(body):
    return struct.pack("<I", len(body)) + body


def s(b):
    return struct.pack("<I", len(b)) + b


def i64(v):
    return struct.pack("<q", v)


def hello(protocol=PROTOCOL, rank=1, world=WORLD, nonce=b"n" * 16):
    return frame(bytes([HELLO]) + s(protocol) + i64(rank) + i64(world) + s(nonce))


def req(kind, *fields):
    return frame(bytes([kind]) + b"".join(fields))


def store(out):
    stranger = {
        "hello_only": hello(),
        "hello_then_forged_proof": hello() + req(PROOF, s(b"\0" * 32)),
        "hello_then_empty_proof": hello() + req(PROOF, s(b"")),
        "proof_before_hello": req(PROOF, s(b"x" * 32)),
        "old_protocol": frame(bytes([HELLO]) + s(b"fuzz-token") + i64(1) + i64(WORLD)),
        "other_protocol": hello(protocol=b"ctr-rendezvous/9"),
        "wrong_world": hello(world=WORLD + 1),
        "rank_out_of_range": hello(rank=7),
        "rank_negative": hello(rank=-1),
        "claims_rank_zero": hello(rank=0),
        "claims_rank_two": hello(rank=2),
        "short_nonce": hello(nonce=b"n"),
        "hello_twice": hello() + hello(),
        "request_before_admission": req(SET, s(b"k"), s(b"v")),
        "join_before_admission": req(JOIN, i64(100)),
        "empty_frame": frame(b""),
        "truncated_frame": hello()[:9],
        "length_over_limit_before_hello": struct.pack("<I", 64 * 1024 + 1) + b"\x01",
        "length_max": struct.pack("<I", 0xFFFFFFFF),
        "garbage": bytes(range(256)),
    }
    rank1 = {
        "session": req(JOIN, i64(1000), i64(1000)) + req(SET, s(b"key"), s(b"value")) +
                   req(GET, s(b"key"), i64(100)) + req(ADD, s(b"count"), i64(5)) +
                   req(ADD, s(b"count"), i64(-2)) + req(GET, s(b"count"), i64(100)),
        "heartbeats": req(HEARTBEAT) + req(HEARTBEAT) + req(HEARTBEAT, i64(1)),
        "failure": req(FAILURE, s(b"rank 1 saw a NaN")) + req(HEARTBEAT),
        "failure_malformed": req(FAILURE, struct.pack("<I", 99) + b"x"),
        "get_missing_parks": req(GET, s(b"nobody-sets-this"), i64(50)),
        "barrier_alone": req(BARRIER, s(b"b"), i64(50)),
        "barrier_twice": req(BARRIER, s(b"b"), i64(50)) + req(BARRIER, s(b"b"), i64(50)),
        "add_to_text": req(SET, s(b"k"), s(b"text")) + req(ADD, s(b"k"), i64(1)),
        "add_wraps": req(ADD, s(b"n"), i64(2**63 - 1)) + req(ADD, s(b"n"), i64(1)),
        "timeout_huge": req(GET, s(b"x"), i64(2**62)),
        "timeout_negative": req(BARRIER, s(b"x"), i64(-5)),
        "hello_again": hello(),
        "proof_again": req(PROOF, s(b"x" * 32)),
        "unknown_request": req(99, i64(0)),
        "set_string_overruns": req(SET, struct.pack("<I", 1000) + b"short"),
        "trailing_bytes": req(JOIN, i64(10), i64(10) + b"extra"),
        "length_over_limit": struct.pack("<I", (256 << 20) + 1) + bytes([SET]),
        "empty_frame": frame(b""),
        "garbage": bytes(range(256)),
    }
    for name, data in stranger.items():
        put(out, "stranger_" + name, STRANGER + data)
    for name, data in rank1.items():
        put(out, "rank1_" + name, RANK1 + data)


# ---------------------------------------------------------------------------
# Option strings: first byte 0 mesh, 1 preset, 2 step; then "key=value" lines.


def options(out):
    seeds = {
        "mesh_all_keys": (0, "world=1\nrank=0\nmesh=fsdp=1\nthreads=2\ncomm_nice=0\ndevice=cpu\n"
                             "transport=ucx\nmaster_addr=127.0.0.1\nmaster_port=29500\n"
                             "job_token=token\ntimeout=5.5"),
        "mesh_axes": (0, "mesh=dp=1,fsdp=1,ep=1,tp=1,pp=1"),
        "mesh_bad_axis": (0, "mesh=dp=1,zz=1"),
        "mesh_no_plugin": (0, "device=nosuch"),
        "mesh_wrong_type": (0, "rank=\"zero\"\ntimeout=\"long\""),
        "mesh_unknown_key": (0, "wrold=1"),
        "preset_gpt": (1, "preset=gpt\nlayers=2\ndim=16\nheads=2\nvocab=32\nseq=8\nffn_dim=32\n"
                          "tied=1\ninit_std=0.02\nnorm_eps=1e-5"),
        "preset_llama": (1, "preset=llama\nlayers=1\ndim=16\nheads=4\nkv_heads=2\nvocab=32\nseq=8\n"
                            "rope_theta=10000.5"),
        "preset_unknown": (1, "preset=bert"),
        "preset_heads_do_not_divide": (1, "dim=10\nheads=3"),
        "step_optimizer": (2, "batch=2\nseq=4\nmicro_batches=2\nseed=1\nlr=0.001\nmin_lr=0.0001\n"
                              "warmup_steps=1\ndecay_steps=10\nschedule=linear\nbeta1=0.9\n"
                              "beta2=0.95\neps=1e-8\nweight_decay=0.1\ngrad_clip=1.5\n"
                              "check_finite=1"),
        "step_schedule": (2, "recompute=selective\nbucket=bytes\nbucket_bytes=1024\nprefetch=2\n"
                             "defer_reduce=0\nmemory_budget=100000\noverlap=0\n"
                             "reshard_after_forward=0\nkeep=logits\nasync_save=1\n"
                             "async_save_lag=3"),
        "step_large_batch": (2, "batch=1048576\nmicro_batches=65536"),
        "step_small_limit": (2, "memory_limit=1000"),
        "step_seq_too_long": (2, "seq=5"),
    }
    for name, (head, text) in seeds.items():
        put(out, name, bytes([head]) + text.encode())


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[2].strip())
    build = os.path.abspath(sys.argv[1])
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(sys.argv[2]) if len(sys.argv) == 3 else os.path.join(here, "corpus")
    ctr = os.path.join(build, "tools", "ctr")
    targets = {"graph": None, "files": None, "checkpoint": None, "store": None, "options": None}
    for t in targets:
        d = os.path.join(root, t)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        targets[t] = d
    with tempfile.TemporaryDirectory() as tmp:
        graphs(ctr, targets["graph"], tmp)
        written_graphs(targets["graph"])
        files(ctr, targets["files"], tmp)
    checkpoint(build, targets["checkpoint"])
    store(targets["store"])
    options(targets["options"])
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    print(f"make_corpus: wrote {root} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
