#!/usr/bin/env python3
"""The exporter refuses what libctr cannot run, and says what and where.

    .venv/bin/python3 tests/bindings/test_export_errors.py

Each case is a small module with one construct libctr cannot run (torch.cumsum, nn.Conv1d,
softplus, dropout in training, a mask computed from activations, reading a value on the host;
and, for the torch.fx tracer, a branch on a traced size). ctr_export.export must raise
ExportError whose message names the ATen op (or the fx construct) and the file and line of
the call, with .op, .file and .line set to match; the line numbers are found from the source
of this file (the lines marked "# MARK"), so editing the cases cannot silently break the test.
Control flow on the sequence length is refused naming the cause. Constructs the ATen tracer
handles (exact GELU, reductions, general broadcasting, slicing activations, shape unpacking)
must export, as must the model without any of them.

Exits 77 (skipped) when torch is missing; prints "N passed, N failed" last.
"""
import os
import sys
import traceback

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools", "export"))

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print(f"test_export_errors: {e.name} is not installed; skipped")
    sys.exit(77)

import ctr_export  # noqa: E402

VOCAB, DIM = 32, 16


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Base(nn.Module):
    """Embedding -> (the case's construct) -> linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def body(self, x):
        return x

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens)))


class Cumsum(Base):
    def body(self, x):
        return torch.cumsum(x, dim=1)  # MARK cumsum


class Conv(Base):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, padding=1)

    def body(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)  # MARK conv


class ErfGelu(Base):
    def body(self, x):
        return F.gelu(x)  # MARK gelu


class Dropout(Base):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def body(self, x):
        return self.drop(x)  # MARK dropout


class Mean(Base):
    def body(self, x):
        return x * x.mean(dim=-1, keepdim=True)  # MARK mean


class Broadcast(Base):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 1, DIM))

    def body(self, x):
        return x * self.scale  # MARK broadcast


class Slice(Base):
    def body(self, x):
        return x[:, :, :4].repeat(1, 1, DIM // 4)  # MARK slice


class Softplus(Base):
    def body(self, x):
        return F.softplus(x)  # MARK softplus


class ActivationMask(Base):
    def body(self, x):
        return x.masked_fill(x > 0, 0.0)  # MARK activation mask


class HostRead(Base):
    def body(self, x):
        return x * float(x.sum().item())  # MARK item


class SeqControlFlow(Base):
    def body(self, x):
        return x * 2 if x.shape[1] % 2 == 0 else x


class Unpack(Base):
    def body(self, x):
        b, t, c = x.shape  # MARK unpack
        return x.view(b, t, c)


class SizeBranch(Base):
    def body(self, x):
        if x.shape[1] > 1:  # MARK size branch
            x = x * 2
        return x


CASES = [
    # (module class, op named in the message, marker on the offending line, phrase, tracer)
    (Cumsum, "aten.cumsum.default", "cumsum", "running sum", "auto"),
    (Conv, "aten.convolution.default", "conv", "convolutions", "auto"),
    (Softplus, "aten.softplus.default", "softplus", "no equivalent", "auto"),
    (Dropout, "aten.bernoulli_.float", "dropout", "model.eval()", "auto"),
    (ActivationMask, "aten.gt.Scalar", "activation mask", "mask computed", "auto"),
    (HostRead, "Tensor.item", "item", "on the host", "auto"),
    (SizeBranch, "torch.fx", "size branch", "cannot trace", "fx"),
]

# Constructs the ATen tracer maps onto libctr's general ops.
EXPORTS = [ErfGelu, Mean, Broadcast, Slice, Unpack, SizeBranch]


def line_of(marker):
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if text.rstrip().endswith(f"# MARK {marker}"):
                return number
    raise AssertionError(f"no line marked {marker}")


def example():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (2, 8), generator=g),
            torch.randint(0, VOCAB, (2, 8), generator=g))


def check_case(cls, op, marker, phrase, tracer):
    line = line_of(marker)
    try:
        ctr_export.export_bytes(cls(), example(), loss_fn, tracer=tracer)
    except ctr_export.ExportError as e:
        msg = str(e)
        me = os.path.abspath(__file__)
        assert op in msg, f"the message does not name {op}: {msg}"
        assert f"{me}:{line}" in msg, f"the message does not point at line {line}: {msg}"
        assert phrase in msg, f"the message lacks {phrase!r}: {msg}"
        assert e.op == op and e.file == me and e.line == line, (e.op, e.file, e.line)
        print(f"    {msg.splitlines()[0]}")
        return
    raise AssertionError(f"{cls.__name__} exported without error")


def check_exports(cls):
    data = ctr_export.export_bytes(cls(), example(), loss_fn)
    # A size-prefixed FlatBuffer: length, root offset, then the file identifier.
    assert data[8:12] == b"CTRG", data[:12]
    assert int.from_bytes(data[:4], "little") == len(data) - 4, "size prefix"


def check_seq_control_flow():
    try:
        ctr_export.export_bytes(SeqControlFlow(), example(), loss_fn)
    except ctr_export.ExportError as e:
        assert "different ops at two batch/sequence sizes" in str(e), str(e)
        print(f"    {str(e).splitlines()[0]}")
        return
    raise AssertionError("control flow on the sequence length exported without error")


def main():
    passed = failed = 0
    tests = [(f"refuses {c[0].__name__}", (lambda c=c: check_case(*c))) for c in CASES]
    tests.append(("refuses control flow on the sequence length", check_seq_control_flow))
    tests += [(f"exports {cls.__name__}", (lambda cls=cls: check_exports(cls))) for cls in EXPORTS]
    tests.append(("exports the clean model", lambda: check_exports(Base)))
    for name, fn in tests:
        try:
            fn()
        except Exception:
            failed += 1
            print(f"FAIL {name}:\n{traceback.format_exc()}")
        else:
            passed += 1
            print(f"ok   {name}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
