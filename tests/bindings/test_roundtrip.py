#!/usr/bin/env python3
"""Weights make the round trip PyTorch -> libctr -> PyTorch (and back) unchanged.

    .venv/bin/python3 tests/bindings/test_roundtrip.py

For each reference model: export it with ctr_export, train 5 steps in libctr, write the
weights with Step.export_safetensors, read that file with the small safetensors reader below
(written from the format's description, independent of libctr and of the safetensors
package), load it into a fresh PyTorch model, and check that PyTorch's logits on a new batch
equal the logits libctr kept (Step option keep="logits", Step.get_output after evaluate).
Then the other way: Step.import_safetensors of libctr's own file restores every parameter bit
for bit, and of files written here from a PyTorch state_dict (f32, and bf16 that libctr
widens) sets exactly those values; a name the graph lacks is refused unless allow_extra.

A third model, built here from plain torch.nn pieces rather than the reference blocks
(nn.Embedding positions from torch.arange, a shared nn.LayerNorm, batched matmul, softmax,
scalar arithmetic, subtraction, SiLU, tanh-GELU, view/permute/reshape, a loss_fn), checks the
exporter's generic op mapping by training it a few steps on both sides.

Exits 77 (skipped) when torch or numpy is missing; prints "N passed, N failed" last.
"""
import json
import os
import shutil
import struct
import sys
import tempfile
import traceback

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "tools", "export"))

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print(f"test_roundtrip: {e.name} is not installed; skipped")
    sys.exit(77)

import ctr  # noqa: E402
import ctr_export  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402

BATCH, SEQ, VOCAB = 4, 32, 128
SIZES = dict(vocab=VOCAB, seq=SEQ, layers=2, dim=64, heads=4)
LOGITS_ATOL = 1e-4  # the logits are O(1..10); fp32 forward passes differ by ~1e-6
STEP_OPTS = dict(batch=BATCH, seq=SEQ, lr=3e-3, warmup_steps=2, keep="logits")

# ------------------------------------------------------------------------------------------------
# safetensors, from the format's description: an 8-byte little-endian header length N, N bytes
# of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then
# the raw little-endian data, offsets relative to its start.

_NP = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I32": "<i4", "I64": "<i8"}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    assert len(blob) >= 8, "file shorter than its header length"
    (n,) = struct.unpack("<Q", blob[:8])
    assert 8 + n <= len(blob), f"header length {n} runs past the end of the file"
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    out, spans = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = info["shape"]
        count = int(np.prod(shape)) if shape else 1
        assert info["dtype"] in _NP, f"{name}: dtype {info['dtype']}"
        assert end - begin == count * np.dtype(_NP[info["dtype"]]).itemsize, \
            f"{name}: {end - begin} bytes for shape {shape}"
        assert 0 <= begin <= end <= len(data), f"{name}: offsets {begin}..{end} out of range"
        spans.append((begin, end))
        arr = np.frombuffer(data[begin:end], dtype=_NP[info["dtype"]]).reshape(shape)
        out[name] = torch.from_numpy(arr.astype(np.float32))
    spans.sort()
    pos = 0
    for b, e in spans:  # the tensors tile the data region: no gaps, no overlaps
        assert b == pos, f"data region has a gap or overlap at byte {b} (expected {pos})"
        pos = e
    assert pos == len(data), f"{len(data) - pos} trailing bytes after the last tensor"
    return out


def write_safetensors(path, tensors, dtype="F32"):
    header, chunks, pos = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous()
        if dtype == "BF16":
            # bf16 is the top half of an f32: round to nearest even, keep the high 16 bits.
            bits = t.float().numpy().view(np.uint32).astype(np.uint64)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
            raw = bits.tobytes()
        else:
            raw = t.float().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [pos, pos + len(raw)]}
        chunks.append(raw)
        pos += len(raw)
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header).encode("utf-8")
    head += b" " * (-len(head) % 8)  # data 8-byte aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(chunks))


def bf16_round(t):
    bits = t.float().numpy().view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


# ------------------------------------------------------------------------------------------------


def batch(seed, vocab=VOCAB, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    rows = (start + stride * torch.arange(seq + 1)[None, :]) % vocab
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def feed(step, tokens, targets):
    step.set_input("tokens", tokens.numpy().astype(np.int32))
    step.set_input("targets", targets.numpy().astype(np.int32))


def build(kind, seed):
    if kind == "gpt":
        return GPT(GPTConfig(**SIZES), seed=seed)
    return Llama(LlamaConfig(kv_heads=2, **SIZES), seed=seed)


def roundtrip(kind, tmp, figures):
    model = build(kind, seed=2)
    graph_path = os.path.join(tmp, f"{kind}.ctrg")
    st_path = os.path.join(tmp, f"{kind}.safetensors")
    ctr_export.export(model, batch(0), None, graph_path)
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(graph_path) as graph:
        assert graph.tensor_info("logits").shape == (-1, -1, VOCAB), graph.tensor_info("logits")
        with ctr.Step(mesh, graph, **STEP_OPTS) as step:
            for i in range(5):
                feed(step, *batch(100 + i))
                step.run()
            step.export_safetensors(st_path)
            trained = {name: step.get_param(name) for name in graph.params}

            # libctr -> PyTorch: the file loads into a fresh model; the logits agree.
            weights = read_safetensors(st_path)
            assert sorted(weights) == sorted(model.state_dict()), \
                sorted(set(weights) ^ set(model.state_dict()))
            fresh = build(kind, seed=99)
            fresh.load_state_dict(weights, strict=True)
            for name, w in weights.items():
                assert np.array_equal(w.numpy(), trained[name]), f"{name}: file != get_param"
            tokens, targets = batch(777)
            with torch.no_grad():
                want_logits, want_loss = fresh(tokens, targets)
            feed(step, tokens, targets)
            loss = step.evaluate()
            logits = step.get_output("logits")
            assert logits.shape == (BATCH, SEQ, VOCAB), logits.shape
            diff = float(np.abs(logits - want_logits.numpy()).max())
            rel_loss = abs(loss - want_loss.item()) / want_loss.item()
            figures.append((kind, diff, rel_loss))
            print(f"  {kind:5s} libctr->torch: max |logit diff| {diff:.2e}, "
                  f"loss rel diff {rel_loss:.2e}")
            assert diff <= LOGITS_ATOL, f"{kind}: logits differ by {diff:.3g} > {LOGITS_ATOL}"
            assert rel_loss <= 1e-5, f"{kind}: loss {loss} vs torch {want_loss.item()}"

        # libctr -> libctr: a new step (initial weights from the file) imports the trained ones.
        with ctr.Step(mesh, graph, **STEP_OPTS) as other:
            assert not np.array_equal(other.get_param(graph.params[0]),
                                      trained[graph.params[0]])
            other.import_safetensors(st_path)
            for name in graph.params:
                assert np.array_equal(other.get_param(name), trained[name]), name
            feed(other, tokens, targets)
            assert other.evaluate() == loss, "same weights, same batch, different loss"

            # PyTorch -> libctr, f32: exactly the values written.
            src = build(kind, seed=5)
            f32_path = os.path.join(tmp, f"{kind}.torch.safetensors")
            write_safetensors(f32_path, src.state_dict())
            other.import_safetensors(f32_path)
            for name, w in src.state_dict().items():
                assert np.array_equal(other.get_param(name), w.numpy()), name
            with torch.no_grad():
                _, src_loss = src(tokens, targets)
            feed(other, tokens, targets)
            assert abs(other.evaluate() - src_loss.item()) <= 1e-5 * src_loss.item()

            # bf16 is widened: the values are the bf16 roundings of the originals.
            bf_path = os.path.join(tmp, f"{kind}.bf16.safetensors")
            write_safetensors(bf_path, src.state_dict(), dtype="BF16")
            other.import_safetensors(bf_path)
            for name, w in src.state_dict().items():
                assert np.array_equal(other.get_param(name), bf16_round(w)), name

            # A tensor the graph does not have: refused unless allow_extra.
            extra = dict(src.state_dict())
            extra["extra.weight"] = torch.zeros(3)
            extra_path = os.path.join(tmp, f"{kind}.extra.safetensors")
            write_safetensors(extra_path, extra)
            try:
                other.import_safetensors(extra_path)
                raise AssertionError("a file with an extra tensor was accepted")
            except ctr.CtrError as e:
                assert "extra.weight" in e.message, e.message
            other.import_safetensors(extra_path, allow_extra=True)
            # A missing one is refused and names it.
            missing = dict(src.state_dict())
            gone = sorted(missing)[-1]
            del missing[gone]
            write_safetensors(extra_path, missing)
            try:
                other.import_safetensors(extra_path)
                raise AssertionError("a file lacking a parameter was accepted")
            except ctr.CtrError as e:
                assert gone in e.message, e.message


# ------------------------------------------------------------------------------------------------
# Generic ops: a model made of plain torch.nn pieces


class Mixer(nn.Module):
    def __init__(self, vocab=64, seq=16, dim=32):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(0.0)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        b, t = tokens.shape[0], tokens.shape[1]  # fx cannot unpack a traced shape
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        h = self.norm(x)
        mix = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / 8.0, dim=-1)
        x = x + mix @ h
        x = x - 0.5 * self.drop(F.silu(x)) * self.gain
        x = x + self.down(self.act(self.up(self.norm(x))))
        y = x.view(b, t, 2, -1).permute(0, 1, 3, 2).reshape(b, t, -1)
        return self.head(y)


def mixer_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def generic_ops(tmp, figures):
    torch.manual_seed(3)
    model = Mixer()
    path = os.path.join(tmp, "mixer.ctrg")
    ctr_export.export(model, batch(0, 64, 16), mixer_loss, path)
    data = [batch(200 + i, 64, 16) for i in range(6)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    want = []
    for tokens, targets in data:
        opt.zero_grad()
        loss = mixer_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        want.append(loss.item())
    got = []
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(path) as graph, \
            ctr.Step(mesh, graph, batch=BATCH, seq=16, lr=1e-3, weight_decay=0.0,
                     grad_clip=0.0) as step:
        assert graph.param_count == sum(p.numel() for p in model.parameters())
        for tokens, targets in data:
            feed(step, tokens, targets)
            got.append(step.run()["loss"])
        for name, p in model.named_parameters():
            d = float(np.abs(step.get_param(name) - p.detach().numpy()).max())
            assert d < 1e-4, f"mixer: {name} differs by {d:.3g} after {len(data)} steps"
    rel = max(abs(a - b) / a for a, b in zip(want, got))
    figures.append(("mixer", rel, None))
    print(f"  mixer generic ops: losses {want[0]:.4f} -> {want[-1]:.4f}, max rel diff {rel:.2e}")
    assert rel <= 1e-4, f"mixer: torch {want} vs libctr {got}"


def main():
    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp(prefix="ctr_roundtrip_")
    passed = failed = 0
    figures = []
    tests = [("gpt", lambda: roundtrip("gpt", tmp, figures)),
             ("llama", lambda: roundtrip("llama", tmp, figures)),
             ("generic_ops", lambda: generic_ops(tmp, figures))]
    try:
        for name, fn in tests:
            try:
                fn()
            except Exception:
                failed += 1
                print(f"FAIL {name}:\n{traceback.format_exc()}")
            else:
                passed += 1
                print(f"ok   {name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
