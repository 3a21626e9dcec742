#!/usr/bin/env python3
"""PyTorch definitions of libctr's two model presets, `gpt` and `llama`, for the benchmarks.

    .venv/bin/python3 tools/bench/torch_models.py                 # print both presets' parameters
    .venv/bin/python3 tools/bench/torch_models.py --preset llama --layers 2 --dim 128 --heads 4

    from torch_models import GPT, GPTConfig, Llama, LlamaConfig, flops_per_token
    model = GPT(GPTConfig(vocab=256, seq=256, layers=4, dim=256, heads=4), seed=0)
    logits, loss = model(tokens, targets)        # tokens, targets: [B, T] integer tensors

The modules themselves are the reference models in tools/export/models (gpt.py, llama.py),
shared with the exporter and the parity tests so there is one definition of each preset in
PyTorch; this file re-exports them under their old names and adds what the benchmarks need on
top: building a preset by name and counting its parameters and FLOPs the way libctr does.
"""

import argparse
import os
import sys
from typing import Optional, Tuple

import torch.nn as nn

# The reference models live with the exporter; make them importable from a source checkout.
_EXPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "export")
if os.path.isdir(os.path.join(_EXPORT_DIR, "models")) and _EXPORT_DIR not in sys.path:
    sys.path.insert(0, os.path.abspath(_EXPORT_DIR))

from models.blocks import RMSNorm, rotary_tables  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "RMSNorm", "rotary_tables", "build",
           "lookup_only_parameters", "counted_parameters", "flops_per_token"]


# ------------------------------------------------------------------------------------------------
# Building presets and counting FLOPs


def build(preset: str, vocab: int, seq: int, layers: int, dim: int, heads: int,
          kv_heads: Optional[int] = None, seed: int = 0) -> nn.Module:
    """The model `ctr graph build --preset PRESET` describes, with that preset's defaults."""
    if preset == "gpt":
        return GPT(GPTConfig(vocab=vocab, seq=seq, layers=layers, dim=dim, heads=heads), seed)
    if preset == "llama":
        kv = heads if kv_heads is None else kv_heads
        return Llama(LlamaConfig(vocab=vocab, seq=seq, layers=layers, dim=dim, heads=heads,
                                 kv_heads=kv), seed)
    raise ValueError(f"unknown preset {preset!r} (expected gpt or llama)")


def lookup_only_parameters(model: nn.Module) -> Tuple[str, ...]:
    """Embedding tables that are only gathered from, never multiplied: their rows cost no FLOPs."""
    if isinstance(model, GPT):
        return ("wpe",) if model.lm_head is None else ("wpe", "wte")
    if isinstance(model, Llama):
        return () if model.output is None else ("tok_embeddings.weight",)
    raise TypeError(f"not a preset model: {type(model).__name__}")


def counted_parameters(model: nn.Module) -> int:
    skip = set(lookup_only_parameters(model))
    return sum(p.numel() for n, p in model.named_parameters() if n not in skip)


def flops_per_token(model: nn.Module, seq: Optional[int] = None) -> int:
    """Training FLOPs per token: 6 * N + 12 * L * T * C.

    N counts every parameter except lookup-only embedding tables (6 = 2 forward + 4 backward per
    multiply-accumulate). 12 * L * T * C is the attention term for the score and value products
    (4 * T * C forward per token and layer, times 3 with backward) at sequence length T (default:
    the model's), with no discount for the causal mask, as in the PaLM paper's accounting."""
    cfg = model.cfg
    t = cfg.seq if seq is None else seq
    return 6 * counted_parameters(model) + 12 * cfg.layers * t * cfg.dim


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=("gpt", "llama", "both"), default="both")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    args = ap.parse_args()
    for preset in ("gpt", "llama") if args.preset == "both" else (args.preset,):
        m = build(preset, args.vocab, args.seq, args.layers, args.dim, args.heads, args.kv_heads)
        total = sum(p.numel() for p in m.parameters())
        print(f"{preset}: {total:,} parameters, {counted_parameters(m):,} counted for FLOPs, "
              f"{flops_per_token(m):,} FLOPs/token")
        for name, p in m.named_parameters():
            print(f"  {name:40s} {list(p.shape)}  std {p.std().item():.5f}")


if __name__ == "__main__":
    main()
