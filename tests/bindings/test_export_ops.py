"""Single ATen constructs the exporter maps, each trained against PyTorch (pytest).

    .venv/bin/python3 -m pytest tests/bindings/test_export_ops.py

Each case is a small model built around one construct. It is exported before training, then
PyTorch and libctr take 20 AdamW steps from the same weights on the same batches, with the
optimizer, schedule and tolerances of test_parity.py: per-step losses within LOSS_RTOL
relative, every final weight within WEIGHT_ATOL. Cases whose construct shows in particular
weights (the padding row of an embedding) check those weights on their own as well, and
show that without the construct's mapping the same weights would end elsewhere.
"""
import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ctr
import ctr_export
from test_parity import BATCH, LOSS_RTOL, OPT, STEPS, WEIGHT_ATOL, schedule, train_ctr, \
    train_torch

VOCAB, DIM, SEQ = 32, 16, 12


def random_batches(pad=None, pad_share=0.3, seed=0):
    """STEPS batches of random tokens and targets; with pad, about pad_share of the tokens
    are the padding id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if pad is not None:
            tokens[torch.rand(BATCH, SEQ, generator=g) < pad_share] = pad
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((tokens, targets))
    return out


def train_both(model, data, tmp_path, tracer="aten"):
    """Exports model(tokens, targets) -> (logits, loss), trains it in PyTorch and in libctr;
    (torch losses, libctr losses, libctr's final weights by name)."""
    path = os.fspath(tmp_path / "model.ctrg")
    ctr_export.export(model, data[0], None, path, tracer=tracer)
    torch_losses = train_torch(model, data)
    with ctr.Mesh(threads=2) as mesh, ctr.Graph.load(path) as graph, \
            ctr.Step(mesh, graph, batch=BATCH, seq=SEQ, **OPT) as step:
        ctr_losses = train_ctr(step, data)
        weights = {name: step.get_param(name) for name in graph.params}
    return torch_losses, ctr_losses, weights


def assert_same_training(model, torch_losses, ctr_losses, weights):
    for i, (a, b) in enumerate(zip(torch_losses, ctr_losses)):
        assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {i}: torch {a:.7f} libctr {b:.7f}"
    final = model.state_dict()
    assert set(weights) == set(final)
    for name, got in weights.items():
        d = float(np.abs(got - final[name].numpy()).max())
        assert d <= WEIGHT_ATOL, f"{name}: libctr's final weights differ by {d:.3g}"


# ------------------------------------------------------------------------------------------
# nn.Embedding(padding_idx=...)


class PaddedLM(nn.Module):
    """An embedding with a padding row, a nonlinearity, a linear head, the loss."""

    def __init__(self, padding_idx, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
        self.head = nn.Linear(DIM, VOCAB)
        with torch.no_grad():  # nn.Embedding zeroes the padding row; weight decay shows on
            self.emb.weight.normal_()  # a row that is not zero

    def forward(self, tokens, targets):
        logits = self.head(F.silu(self.emb(tokens)))
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("tracer", ["aten", "fx"])
@pytest.mark.parametrize("padding_idx", [5, -2])
def test_embedding_padding_idx(tmp_path, tracer, padding_idx):
    model = PaddedLM(padding_idx)
    row = padding_idx % VOCAB
    initial = model.emb.weight[row].detach().clone()
    data = random_batches(pad=row)
    assert sum(int((t == row).sum()) for t, _ in data) > STEPS * BATCH  # the row is looked up

    torch_losses, ctr_losses, weights = train_both(model, data, tmp_path, tracer)
    assert_same_training(model, torch_losses, ctr_losses, weights)

    # PyTorch passes no gradient to the padding row; AdamW's weight decay still shrinks it by
    # (1 - lr * weight_decay) per step. libctr's row is exactly that.
    decayed = initial.clone()
    for s in range(STEPS):
        decayed *= 1 - schedule(s) * OPT["weight_decay"]
    got = torch.from_numpy(weights["emb.weight"][row])
    assert torch.allclose(model.emb.weight[row].detach(), decayed, rtol=0, atol=1e-6)
    assert torch.allclose(got, decayed, rtol=0, atol=1e-6), float((got - decayed).abs().max())

    # Without padding_idx the same lookups move the row far from that.
    plain = PaddedLM(None)
    train_torch(plain, data)
    assert float((plain.emb.weight[row].detach() - decayed).abs().max()) > 100 * WEIGHT_ATOL


def test_embedding_padding_idx_in_graph_file(tmp_path):
    """The padding row is an attribute of the embedding node; without padding_idx no
    attribute is written."""
    data = random_batches()
    padded = ctr_export.to_graph(PaddedLM(3), data[0], None)
    plain = ctr_export.to_graph(PaddedLM(None), data[0], None)
    assert [n.attrs for n in padded.nodes if n.op == "embedding"] == [{"padding_idx": 3}]
    assert [n.attrs for n in plain.nodes if n.op == "embedding"] == [{}]


class FreqScaled(PaddedLM):
    def __init__(self):
        super().__init__(None)
        self.emb = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)


@pytest.mark.parametrize("tracer", ["aten", "fx"])
def test_embedding_scale_grad_by_freq_refused(tracer):
    with pytest.raises(ctr_export.ExportError, match="scale_grad_by_freq") as e:
        ctr_export.to_graph(FreqScaled(), random_batches()[0], None, tracer=tracer)
    assert e.value.file and os.path.basename(e.value.file) == os.path.basename(__file__)
    assert e.value.line is not None
