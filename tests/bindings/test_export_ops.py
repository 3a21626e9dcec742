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
from ctr_export.graphfile import ROLE
from test_parity import BATCH, LOSS_RTOL, OPT, STEPS, WEIGHT_ATOL, schedule, train_ctr, \
    train_torch

VOCAB, DIM, SEQ = 32, 16, 12


def random_batches(pad=None, pad_share=0.3, seed=0):
    """STEPS batches of random tokens, each target a fixed function of its token (so the loss
    can fall); with pad, about pad_share of the tokens are the padding id."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        if pad is not None:
            tokens[torch.rand(BATCH, SEQ, generator=g) < pad_share] = pad
        out.append((tokens, (3 * tokens + 1) % VOCAB))
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
    final = dict(model.named_parameters())
    assert set(weights) == set(final)
    for name, got in weights.items():
        d = float(np.abs(got - final[name].detach().numpy()).max())
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


# ------------------------------------------------------------------------------------------
# Decompositions of ATen ops the model code records


class Body(nn.Module):
    """Embedding -> (the case's body) -> linear head -> cross-entropy."""

    def __init__(self, seed=1):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        logits = self.head(self.body(self.emb(tokens)))
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class InPlace(Body):
    """In-place arithmetic and activations on activations (x += ..., x.mul_(...))."""

    def body(self, x):
        h = self.lin(x)
        h += x
        h.mul_(0.5)
        h.sub_(0.1)
        F.silu(h, inplace=True)
        return h.div_(2.0)


class InPlaceMaskedFill(Body):
    """Scores of a causal attention masked in place, as older model code does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))

    def body(self, x):
        T = x.shape[1]
        att = self.lin(x) @ x.transpose(1, 2)
        att.masked_fill_(self.mask[:T, :T], float("-inf"))
        return F.softmax(att, dim=-1) @ x


class Baddbmm(Body):
    """Attention scores by baddbmm, beta * scores + alpha * q @ k^T (beta = 0: q @ k^T)."""

    def __init__(self, beta):
        super().__init__()
        self.beta = beta

    def body(self, x):
        q, kt = self.lin(x), x.transpose(1, 2)
        att = torch.baddbmm(q @ kt, q, kt, beta=self.beta, alpha=0.25)
        return F.softmax(att, dim=-1) @ x


class Addmm(Body):
    """A linear layer written as addmm with alpha and beta."""

    def body(self, x):
        B, T, C = x.shape
        h = torch.addmm(self.lin.bias, x.reshape(B * T, C), self.lin.weight.t(), beta=0.5,
                        alpha=2.0)
        return torch.tanh(h.reshape(B, T, C))


class TransposedIds(nn.Module):
    """Sequence-first code: tokens.t() into the embedding, transposed back for the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        h = self.emb(tokens.t())  # [T, B, C]
        logits = self.head(torch.tanh(self.lin(h))).transpose(0, 1)
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class LogSoftmaxView(nn.Module):
    """log_softmax, then a view flattening batch and sequence, then nll_loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, targets):
        logp = F.log_softmax(self.head(torch.tanh(self.emb(tokens))), dim=-1)
        return logp, F.nll_loss(logp.view(-1, VOCAB), targets.view(-1))


class Activations(Body):
    """relu and clamp, functional and in place, with one bound or two."""

    def body(self, x):
        h = F.relu(self.lin(x)) + torch.clamp(x, -0.5, 0.4)
        h = h + x.clamp_min(-0.2) - x.clamp(max=0.3)
        h.clamp_(-1.0, 1.0)
        return torch.relu_(h)


DECOMPOSED = {
    "relu-clamp": (Activations, {"relu": 2, "clamp": 4}),
    "inplace": (InPlace, {"add": 1, "mul": 1, "sub": 1, "silu": 1, "div": 1}),
    "inplace-masked-fill": (InPlaceMaskedFill, {"masked_fill": 1}),
    "baddbmm": (lambda: Baddbmm(0.5), {"matmul": 3}),
    "baddbmm-beta0": (lambda: Baddbmm(0.0), {"matmul": 2}),
    "addmm": (Addmm, {"linear": 2}),
    "transposed-ids": (TransposedIds, {"embedding": 1}),
    "log-softmax-view": (LogSoftmaxView, {"cross_entropy": 1, "log_softmax": 1}),
}


@pytest.mark.parametrize("case", sorted(DECOMPOSED))
def test_decomposed(tmp_path, case):
    make, ops = DECOMPOSED[case]
    model = make()
    data = random_batches()
    graph = ctr_export.to_graph(model, data[0], None)
    counts = {op: sum(n.op == op for n in graph.nodes) for op in ops}
    assert counts == ops, counts
    torch_losses, ctr_losses, weights = train_both(model, data, tmp_path)
    assert_same_training(model, torch_losses, ctr_losses, weights)
    assert torch_losses[-1] < torch_losses[0], "the loss did not fall"


class InPlaceOnStaleView(Body):
    def body(self, x):
        h = self.lin(x)
        v = h.view(-1, DIM)
        h.mul_(2.0)  # MARK stale view
        return torch.tanh(v).view(x.shape)


def line_of(marker):
    with open(__file__, encoding="utf-8") as f:
        return next(i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# MARK {marker}"))


def test_inplace_refusals():
    data = random_batches()
    with pytest.raises(ctr_export.ExportError, match="read afterwards through another view") as e:
        ctr_export.to_graph(InPlaceOnStaleView(), data[0], None)
    assert e.value.op == "aten.mul_.Tensor" and e.value.line == line_of("stale view")
    assert os.path.samefile(e.value.file, __file__)


class ShiftedLabelsLoss(nn.Module):
    """The causal-LM loss of Hugging Face's models: labels padded with the ignored index,
    shifted by one, both sides flattened."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, labels):
        logits = self.head(torch.tanh(self.lin(self.emb(tokens))))
        labels = F.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        loss = F.cross_entropy(logits.view(-1, VOCAB), shift_labels.view(-1), ignore_index=-100)
        return logits, loss


def test_shifted_labels_loss(tmp_path):
    # labels[t + 1] follows from tokens[t], so the shifted loss can fall.
    data = []
    for tokens, targets in random_batches():
        labels = torch.roll(targets, 1, dims=1)
        data.append((tokens, labels))
    model = ShiftedLabelsLoss()
    graph = ctr_export.to_graph(model, data[0], None)
    assert [n.op for n in graph.nodes if n.op in ("slice", "cross_entropy")] == \
        ["slice", "slice", "cross_entropy"]
    torch_losses, ctr_losses, weights = train_both(model, data, tmp_path)
    assert_same_training(model, torch_losses, ctr_losses, weights)
    assert torch_losses[-1] < torch_losses[0], "the loss did not fall"


class PaddedNotIgnored(ShiftedLabelsLoss):
    def forward(self, tokens, labels):
        logits = self.head(self.emb(tokens))
        labels = F.pad(labels, (0, 1), value=0)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), labels[..., 1:].reshape(-1))  # MARK pad 0


def test_padding_that_would_count_is_refused():
    with pytest.raises(ctr_export.ExportError, match="not the ignored index") as e:
        ctr_export.to_graph(PaddedNotIgnored(), random_batches()[0], None)
    assert e.value.line == line_of("pad 0") and os.path.samefile(e.value.file, __file__)


# ------------------------------------------------------------------------------------------
# A model of the transformers library itself


class HFCausalLM(nn.Module):
    """transformers' GPT2LMHeadModel (a small random one, nothing downloaded), its own loss
    from labels = the tokens."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2,
                         attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                         eos_token_id=0)
        torch.manual_seed(1)
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, tokens, targets):
        out = self.model(input_ids=tokens, labels=tokens)
        return out.logits, out.loss


def test_transformers_gpt2(tmp_path):
    data = random_batches()
    model = HFCausalLM()
    torch_losses, ctr_losses, weights = train_both(model, data, tmp_path)
    assert_same_training(model, torch_losses, ctr_losses, weights)


# ------------------------------------------------------------------------------------------
# Masks built for the batch, and scaled_dot_product_attention with a mask


class BatchMask(Body):
    """Scores masked by a constant built for the batch (`.expand(batch, ...)`, as the masks
    of transformers are), added as 0 / -inf."""

    def body(self, x):
        B, T, _ = x.shape
        i = torch.arange(T)
        allowed = (i[None, :] <= i[:, None])[None].expand(B, -1, -1)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        att = self.lin(x) @ x.transpose(1, 2) + mask
        return F.softmax(att, dim=-1) @ x


class PerRowMask(Body):
    def body(self, x):
        B, T, _ = x.shape
        rows = torch.arange(B).float()  # MARK per row
        bias = rows[:, None, None].expand(B, T, T) * 0.1
        return F.softmax(self.lin(x) @ x.transpose(1, 2) + bias, dim=-1) @ x


class SdpaMask(Body):
    """scaled_dot_product_attention on [B, H, T, D] with a constant mask: a boolean causal
    one, a boolean sliding window (3 positions), or a float window."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def body(self, x):
        B, T, C = x.shape
        q = self.lin(x).view(B, T, 2, C // 2).transpose(1, 2)
        k = x.view(B, T, 2, C // 2).transpose(1, 2)
        i = torch.arange(T)
        allowed = i[None, :] <= i[:, None]
        if self.kind != "causal":
            allowed = allowed & (i[:, None] - i[None, :] < 3)
        mask = allowed if self.kind != "float" else torch.where(allowed, 0.0, float("-inf"))
        o = F.scaled_dot_product_attention(q, k, k, attn_mask=mask[None, None])
        return o.transpose(1, 2).reshape(B, T, C)


class SdpaActivationMask(Body):
    def body(self, x):
        B, T, C = x.shape
        q = x.view(B, T, 1, C).transpose(1, 2)
        mask = self.lin(x)[..., :T].unsqueeze(1) > 0  # MARK activation mask
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask).transpose(1, 2).reshape(B, T, C)
        return o.transpose(1, 2).reshape(B, T, C)


# On the CPU, PyTorch turns a boolean attn_mask into a float one (0 / -inf) before its kernel;
# the exporter folds that into the constant, so every mask is added to the scores.
MASKED = {
    "batch-mask": (BatchMask, {"add": 1, "softmax": 1}),
    "sdpa-causal-mask": (lambda: SdpaMask("causal"), {"add": 1, "softmax": 1}),
    "sdpa-window-mask": (lambda: SdpaMask("window"), {"add": 1, "softmax": 1}),
    "sdpa-float-mask": (lambda: SdpaMask("float"), {"add": 1, "softmax": 1}),
}


@pytest.mark.parametrize("case", sorted(MASKED))
def test_masks(tmp_path, case):
    make, ops = MASKED[case]
    model = make()
    data = random_batches()
    graph = ctr_export.to_graph(model, data[0], None)
    counts = {op: sum(n.op == op for n in graph.nodes) for op in ops}
    assert counts == ops, counts
    if case == "batch-mask":  # stored once, one row broadcast over the batch
        consts = [t.dims for t in graph.tensors if t.role == ROLE["Const"] and t.dims
                  and len(t.dims) == 3]
        assert consts == [[1, SEQ, SEQ]], consts
    torch_losses, ctr_losses, weights = train_both(model, data, tmp_path)
    assert_same_training(model, torch_losses, ctr_losses, weights)
    assert torch_losses[-1] < torch_losses[0], "the loss did not fall"


def test_mask_refusals():
    data = random_batches()
    with pytest.raises(ctr_export.ExportError, match="holds different values per batch row") as e:
        ctr_export.to_graph(PerRowMask(), data[0], None)
    assert e.value.line == line_of("per row") and os.path.samefile(e.value.file, __file__)
    with pytest.raises(ctr_export.ExportError, match="mask computed from the model's activations") as e:
        ctr_export.to_graph(SdpaActivationMask(), data[0], None)
    assert e.value.line == line_of("activation mask") and os.path.samefile(e.value.file, __file__)
