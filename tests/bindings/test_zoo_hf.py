"""Model classes people bring, exported unchanged and trained against PyTorch (pytest).

    .venv/bin/python3 -m pytest tests/bindings/test_zoo_hf.py [-k llama]

The causal language models of the transformers library, each instantiated from its own
config class at a tiny size with random weights (nothing is downloaded), called the way its
documentation shows, `model(input_ids=tokens, labels=tokens)`, with its own shifted loss;
and two GPTs built from torch.nn's transformer layers (tests/zoo/torch_nn.py). Each is
exported by ctr_export before training; PyTorch and libctr then take 20 AdamW steps from the
same weights on the same batches with the protocol and tolerances of test_parity.py:
per-step losses within 1e-4 relative, every final weight within 1e-4 absolute (the padding
row of the embedding, which the pad token's lookups must not move, included). libctr trains
each graph a second time with the fuse pass off: the per-step losses agree within 1e-5
relative. Where the ctr tool is at hand (CTR_TOOL), the fused ops the compiled graph holds
are checked, and every attention-like pattern the fuse pass leaves must come with a reason.

One process covers every class, so transformers is imported once; the sizes are the
smallest that keep each class's structure (2 layers, grouped-query heads where the class
has them, partial rotary dims, a sliding window shorter than the sequence).
"""
import importlib
import os
import re
import subprocess

import numpy as np
import pytest
import torch
import torch.nn as nn

import ctr
import ctr_export
from test_parity import BATCH, LOSS_RTOL, OPT, STEPS, WEIGHT_ATOL, batches, schedule, train_ctr, \
    train_torch

transformers = pytest.importorskip("transformers")
from zoo import hf_causal_lm  # noqa: E402

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 4, 2
PAD = hf_causal_lm.PAD  # the pad token: its embedding row gets no gradient (padding_idx)
FUSE_RTOL = 1e-5
HF = hf_causal_lm.CASES
TORCH_NN = {"nn-encoder": "encoder", "nn-mha": "mha"}

# case: the fused ops the compiled graph holds (2 layers). Each attention the fuse pass
# leaves has a reason in its report (checked for every case).
_LLAMA = dict(attention=2, rmsnorm=5, rope=4, swiglu=2)
FUSED = {
    "llama": _LLAMA, "qwen2": _LLAMA, "llama-eager": _LLAMA,
    "qwen3": dict(_LLAMA, rmsnorm=9), "olmo2": dict(_LLAMA, rmsnorm=9),
    "olmo": dict(attention=2, rope=4, swiglu=2), "stablelm": dict(attention=2, rope=4, swiglu=2),
    # Gemma's MLP is GeGLU: gelu(gate) * up.
    "gemma": dict(attention=2, geglu=2, rmsnorm=5, rope=4),
    "phi": dict(attention=2, gelu=2, rope=4),
    "gpt_neox": dict(attention=2, gelu=2, rope=4), "gpt_neox-eager": dict(attention=2, gelu=2, rope=4),
    "nn-encoder": dict(attention=2, gelu=2),
    # The sliding window becomes the fused op's window attribute, logit soft-capping its
    # softcap (both in Gemma-2's first layer).
    "mistral": _LLAMA,
    "gemma2": dict(attention=2, geglu=2, rmsnorm=9, rope=4),
    # Heads folded into the batch dim, tokens time-major (torch.nn's own attention).
    "nn-mha": dict(attention=2, gelu=2),
}
FUSED_OPS = ("attention", "rmsnorm", "swiglu", "gelu", "geglu", "rope")
CASES = sorted(HF) + sorted(TORCH_NN)


class WithLoss(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, tokens, targets):
        out = self.model(tokens)
        return out, self.loss_fn(out, targets)


def build(case):
    if case in HF:
        return hf_causal_lm.build(VOCAB, SEQ, DIM, HEADS, LAYERS, seed=1, case=case)[0]
    mod = importlib.import_module("zoo.torch_nn")
    return WithLoss(*mod.build(VOCAB, SEQ, DIM, HEADS, LAYERS, seed=1, kind=TORCH_NN[case]))


def data():
    """Counting rows (learnable), with the pad token in every batch."""
    out = batches(VOCAB, SEQ)
    for tokens, _ in out:
        tokens[0, 3] = PAD
    return out


def ctr_tool():
    tool = os.environ.get("CTR_TOOL")
    return tool if tool and os.path.exists(tool) else None


def fuse_report(path):
    out = subprocess.run([ctr_tool(), "graph", "inspect", path, "--after", "fuse", "--batch",
                          str(BATCH), "--seq", str(SEQ)], check=True, capture_output=True,
                         text=True).stdout
    ops = re.findall(r"^  \[\d+\] .* = (\w+)\(", out, re.M)
    report = out[:out.index("\ngraph ")] if "\ngraph " in out else out
    return ops, report


@pytest.mark.parametrize("case", CASES)
def test_trains_as_pytorch(tmp_path, case):
    model = build(case)
    batches_ = data()
    path = os.fspath(tmp_path / f"{case}.ctrg")
    ctr_export.export(model, batches_[0], None, path)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch_losses = train_torch(model, batches_)
    opts = dict(batch=BATCH, seq=SEQ, **OPT)
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(path) as graph:
        with ctr.Step(mesh, graph, **opts) as step:
            for name in graph.params:  # the model's own weights, bit for bit
                assert np.array_equal(step.get_param(name), state[name].numpy()), name
            losses = train_ctr(step, batches_)
            weights = {name: step.get_param(name) for name in graph.params}
        with ctr.Step(mesh, graph, fuse=0, **opts) as plain:
            unfused = train_ctr(plain, batches_)
    for i, (a, b) in enumerate(zip(torch_losses, losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {i}: torch {a:.7f} libctr {b:.7f}"
    final = dict(model.named_parameters())
    assert set(weights) == set(final)
    for name, got in weights.items():
        want = final[name].detach().numpy()
        if name.endswith("in_proj_bias"):
            # nn.MultiheadAttention's packed q, k, v bias: the key third has no gradient in
            # exact arithmetic (a constant added to every key shifts each softmax row by a
            # constant), so both sides step it by AdamW-normalised rounding noise; it is held
            # to the bound of AdamW's total displacement, the sum of the learning rates.
            third = want.shape[0] // 3
            d = float(np.abs(got[third:2 * third] - want[third:2 * third]).max())
            assert d <= sum(schedule(s) for s in range(STEPS)), f"{name}: keys differ by {d:.3g}"
            got, want = np.delete(got, np.s_[third:2 * third]), np.delete(want, np.s_[third:2 * third])
        d = float(np.abs(got - want).max())
        assert d <= WEIGHT_ATOL, f"{name}: libctr's final weights differ by {d:.3g}"
    for i, (a, b) in enumerate(zip(losses, unfused)):
        assert abs(a - b) <= FUSE_RTOL * abs(b), f"step {i}: fused {a:.7f} unfused {b:.7f}"
    assert torch_losses[-1] < torch_losses[0] - 0.1, "the loss did not fall"
    if ctr_tool():
        ops, report = fuse_report(path)
        counts = {op: ops.count(op) for op in FUSED_OPS if op in ops}
        assert counts == FUSED[case], f"fused ops {counts}, expected {FUSED[case]}\n{report}"
        left = re.findall(r"^  attention in block \d+ not fused: .+", report, re.M)
        assert counts.get("attention", 0) + len(left) == LAYERS, report


def test_weights_from_safetensors(tmp_path):
    """A model whose weights come from a local safetensors file, as from_pretrained loads it
    (the file written here by save_pretrained, nothing downloaded), exports with exactly the
    file's weights, under the file's names behind the wrapper's prefix."""
    from safetensors.torch import load_file
    saved = build("llama").model
    with torch.no_grad():  # weights no fresh init would give
        for p in saved.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    saved.save_pretrained(os.fspath(tmp_path / "ckpt"))
    stored = load_file(os.fspath(tmp_path / "ckpt" / "model.safetensors"))

    model = build("llama")
    cls = type(model.model)
    model.model = cls.from_pretrained(os.fspath(tmp_path / "ckpt"), local_files_only=True)
    path = os.fspath(tmp_path / "loaded.ctrg")
    ctr_export.export(model, data()[0], None, path)
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(path) as graph, \
            ctr.Step(mesh, graph, batch=BATCH, seq=SEQ, **OPT) as step:
        names = list(graph.params)
        assert sorted(n[len("model."):] for n in names) == sorted(stored), names
        for name in names:
            assert np.array_equal(step.get_param(name), stored[name[len("model."):]].numpy()), name
        # and they are not the fresh model's
        fresh = build("llama").model.state_dict()
        assert not np.array_equal(step.get_param("model.model.embed_tokens.weight"),
                                  fresh["model.embed_tokens.weight"].numpy())
