#!/usr/bin/env python3
"""Ordinary PyTorch model code exports and trains in libctr exactly as in PyTorch.

    .venv/bin/python3 tests/bindings/test_zoo.py [case ...]

Each case is a model of tests/zoo, written the way common open-source model files are
(nanoGPT, Hugging Face GPT-2, Meta's Llama, Hugging Face Llama), exported with ctr_export's
ATen-level tracer before training. PyTorch and libctr then take 20 AdamW steps from the same
weights on the same batches, with warm-up + cosine schedule, weight decay on matrices only
and global-norm clipping (the protocol and tolerances of test_parity.py): per-step losses
agree within 1e-4 relative and the final weights within 1e-4 absolute.

The fuse pass rewrites each graph's primitive patterns to fused ops (attention, rmsnorm,
swiglu, gelu, rope): every case asserts which fused ops the compiled graph holds (read from
`ctr graph inspect --after fuse`, the tool named by CTR_TOOL) and trains a second time with
fuse=0, the per-step losses of the two agreeing within 1e-5 relative.
Exits 77 (skipped) when torch or numpy is missing; prints "N passed, N failed" last.
"""
import os
import sys
import tempfile

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "tools", "export"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

try:
    import numpy as np
    import torch.nn as nn
except ImportError as e:
    print(f"test_zoo: {e.name} is not installed; skipped")
    sys.exit(77)

import importlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import ctr  # noqa: E402
import ctr_export  # noqa: E402
from test_parity import BATCH, LOSS_RTOL, OPT, WEIGHT_ATOL, batches, run_all, train_ctr, \
    train_torch  # noqa: E402

SIZES = dict(vocab=128, seq=32, dim=64, heads=4, layers=2)

# case: (zoo module, build options)
CASES = {
    "nanogpt": ("nanogpt", {}),
    "nanogpt-nobias": ("nanogpt", dict(bias=False)),
    # scaled_dot_product_attention(is_causal=True) (on the CPU, its flash kernel),
    # mapped by the exporter straight onto libctr's attention.
    "nanogpt-flash": ("nanogpt", dict(flash=True)),
    "gpt2_hf": ("gpt2_hf", {}),
    "llama_meta": ("llama_meta", {}),
    "llama_hf": ("llama_hf", {}),
}

# Fused vs unfused losses, per step (the same arithmetic up to round-off).
FUSE_RTOL = 1e-5

# case: how many of each fused op the graph holds after the fuse pass (layers = 2). Ops
# absent here must be absent there too (nanogpt's exact GELU was a gelu op before fusion).
FUSED = {
    "nanogpt": dict(attention=2, gelu=2),
    "nanogpt-nobias": dict(attention=2, gelu=2),
    "nanogpt-flash": dict(attention=2, gelu=2),
    "gpt2_hf": dict(attention=2, gelu=2),
    # The complex-number rotary embedding becomes rope interleaved=1 (q and k per layer).
    "llama_meta": dict(attention=2, rmsnorm=5, swiglu=2, rope=4),
    "llama_hf": dict(attention=2, rmsnorm=5, swiglu=2, rope=4),
}
FUSED_OPS = ("attention", "rmsnorm", "swiglu", "gelu", "rope")


def ctr_tool():
    """The ctr tool: CTR_TOOL, else beside the library of CTR_LIBRARY in a build tree."""
    tool = os.environ.get("CTR_TOOL")
    if not tool and os.environ.get("CTR_LIBRARY"):
        tool = os.path.join(os.path.dirname(os.path.dirname(os.environ["CTR_LIBRARY"])), "tools", "ctr")
    return tool if tool and os.path.exists(tool) else None


def fused_ops(path):
    """Counts of the fused ops in the graph after the fuse pass, and the pass's report."""
    out = subprocess.run([ctr_tool(), "graph", "inspect", path, "--after", "fuse", "--batch", str(BATCH),
                          "--seq", str(SIZES["seq"])], check=True, capture_output=True, text=True).stdout
    ops = re.findall(r"^  \[\d+\] .* = (\w+)\(", out, re.M)
    report = out[:out.index("\ngraph ")] if "\ngraph " in out else out
    return {op: ops.count(op) for op in FUSED_OPS if op in ops}, report


class WithLoss(nn.Module):
    """model(tokens) -> logits plus loss_fn, as model(tokens, targets) -> (logits, loss)."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, tokens, targets):
        out = self.model(tokens)
        return out, self.loss_fn(out, targets)


def run_case(case, results):
    module, options = CASES[case]
    mod = importlib.import_module(f"zoo.{module}")
    model, loss_fn = mod.build(**SIZES, seed=1, **options)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(SIZES["vocab"], SIZES["seq"])
    tmp = tempfile.mkdtemp(prefix="ctr_zoo_")
    path = os.path.join(tmp, f"{case}.ctrg")
    ctr_export.export(model, data[0], loss_fn, path)
    trained = model if loss_fn is None else WithLoss(model, loss_fn)
    torch_losses = train_torch(trained, data)

    step_opts = dict(batch=BATCH, seq=SIZES["seq"], **OPT)
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(path) as graph, \
            ctr.Step(mesh, graph, **step_opts) as s:
        names = list(graph.params)
        for name in names:  # the embedded weights are the model's, bit for bit
            assert np.array_equal(s.get_param(name), state[name].numpy()), name
        losses = train_ctr(s, data)
        worst, where = 0.0, ""
        final = model.state_dict()
        for name in names:
            d = float(np.abs(s.get_param(name) - final[name].numpy()).max())
            if d > worst:
                worst, where = d, name
        with ctr.Step(mesh, graph, fuse=0, **step_opts) as plain:
            unfused = train_ctr(plain, data)
    if not ctr_tool():
        print(f"  {case}: the ctr tool was not found (CTR_TOOL): fused ops not checked")
    else:
        counts, report = fused_ops(path)
        assert counts == FUSED[case], f"{case}: fused ops {counts}, expected {FUSED[case]}\n{report}"
    os.remove(path)
    os.rmdir(tmp)
    frel = [abs(a - b) / abs(b) for a, b in zip(losses, unfused)]
    bad = [(i, a, b) for i, (a, b, r) in enumerate(zip(losses, unfused, frel)) if r > FUSE_RTOL]
    assert not bad, f"{case}: fused and unfused losses differ beyond {FUSE_RTOL:g} relative at " + \
        ", ".join(f"step {i}: fused {a:.7f} unfused {b:.7f}" for i, a, b in bad[:5])
    rel = [abs(a - b) / abs(a) for a, b in zip(torch_losses, losses)]
    results.append((case, "export", max(rel), worst, where))
    print(f"  {case:15s} loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f}  max rel loss diff "
          f"{max(rel):.2e}  max |weight diff| {worst:.2e} ({where})  fused/unfused {max(frel):.2e}")
    bad = [(i, a, b) for i, (a, b, r) in enumerate(zip(torch_losses, losses, rel)) if r > LOSS_RTOL]
    assert not bad, f"{case}: losses differ beyond {LOSS_RTOL:g} relative at " + \
        ", ".join(f"step {i}: torch {a:.7f} libctr {b:.7f}" for i, a, b in bad[:5])
    assert worst <= WEIGHT_ATOL, f"{case}: final weights differ by {worst:.3g} in {where}"
    assert torch_losses[-1] < torch_losses[0] - 0.5, f"{case}: the loss did not fall"


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1:] or list(CASES), run_case))
