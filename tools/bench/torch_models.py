#!/usr/bin/python3
"""PyTorch definitions of libctr's two model presets, `gpt` and `llama`.

    /usr/bin/python3 tools/bench/torch_models.py                 # print both presets' parameters
    /usr/bin/python3 tools/bench/torch_models.py --preset llama --layers 2 --dim 128 --heads 4

    from torch_models import GPT, GPTConfig, Llama, LlamaConfig, flops_per_token
    model = GPT(GPTConfig(vocab=256, seq=256, layers=4, dim=256, heads=4), seed=0)
    logits, loss = model(tokens, targets)        # tokens, targets: [B, T] integer tensors

These are the reference the runtime is checked against (benchmarks now, parity tests later), so
they are written for clarity rather than speed: plain fp32 nn.Modules, no fused kernels, no
dropout, and parameter names equal to the tensor names of the presets' graph files, so a
state_dict maps one to one onto libctr's parameters. Everything that is not a parameter (the
rotary tables, the causal mask) is a non-persistent buffer and stays out of the state_dict.

Initialisation is deterministic for a given seed (a private torch.Generator, parameters visited
in state_dict order) but is not bit-equal to libctr's counter-based RNG; parity tests copy
weights across rather than relying on equal init.
"""

import argparse
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------------------------------------
# Configurations


@dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 256  # the longest sequence; wpe has this many rows
    layers: int = 4
    dim: int = 256
    heads: int = 4
    tie_embeddings: bool = True  # logits = x wte^T; untied adds lm_head.weight [V, C]
    eps: float = 1e-5


@dataclass
class LlamaConfig:
    vocab: int = 256
    seq: int = 256  # the longest sequence; the rotary tables have this many rows
    layers: int = 4
    dim: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: Optional[int] = None  # None: 256 * ceil((8C/3) / 256)
    rope_theta: float = 10000.0
    tie_embeddings: bool = False  # untied: a separate output.weight [V, C]
    eps: float = 1e-5

    def hidden(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        # (8C/3)/256 is exactly 8C/768, so integer ceiling division needs no floating point.
        return 256 * ((8 * self.dim + 767) // 768)


def _check_heads(dim: int, heads: int, kv_heads: int) -> None:
    if heads <= 0 or dim % heads != 0:
        raise ValueError(f"dim {dim} is not divisible by heads {heads}")
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(f"heads {heads} is not divisible by kv_heads {kv_heads}")


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)  # True above the diagonal: masked


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention on [B, H, T, D] tensors, written out so every op is visible."""
    t, d = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    scores = scores.masked_fill(mask[:t, :t], float("-inf"))
    return F.softmax(scores, dim=-1) @ v


# ------------------------------------------------------------------------------------------------
# gpt: GPT-2 style, LayerNorm before each block, learned positions, GELU (tanh) MLP


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c = cfg.dim
        self.heads = cfg.heads
        self.wq = nn.Linear(c, c)
        self.wk = nn.Linear(c, c)
        self.wv = nn.Linear(c, c)
        self.wo = nn.Linear(c, c)
        self.register_buffer("mask", _causal_mask(cfg.seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, c // h).transpose(1, 2)  # [B, H, T, D]

        y = _attention(split(self.wq(x)), split(self.wk(x)), split(self.wv(x)), self.mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, c))


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.proj = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Parameters: wte [V,C], wpe [T,C], layers.{i}.{ln1,attn.{wq,wk,wv,wo},ln2,mlp.{fc,proj}}.*,
    ln_f.{weight,bias}, and lm_head.weight [V,C] only when untied."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        _check_heads(cfg.dim, cfg.heads, cfg.heads)
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(cfg.vocab, cfg.dim))
        self.wpe = nn.Parameter(torch.empty(cfg.seq, cfg.dim))
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim, eps=cfg.eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("attn.wo.weight", "mlp.proj.weight")):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = tokens.shape[1]
        if t > self.cfg.seq:
            raise ValueError(f"sequence length {t} exceeds the model's {self.cfg.seq}")
        x = F.embedding(tokens.long(), self.wte) + self.wpe[:t]
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        logits = x @ self.wte.t() if self.lm_head is None else self.lm_head(x)
        return logits, _loss(logits, targets)


# ------------------------------------------------------------------------------------------------
# llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, head_dim/2]: angle(t, i) = t * theta^(-2i/D).

    Computed in float64 and rounded once to float32, so the tables are the correctly rounded
    values rather than whatever an fp32 pow happens to give."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().float(), angle.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half form on [B, H, T, D]: element i is paired with element i + D/2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.wq(x).view(b, t, self.heads, d).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, d).transpose(1, 2)
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        # Query head h reads kv head h // (H/Hkv): repeat each kv head H/Hkv times in place.
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        y = _attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.heads * d))


class LlamaFeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        f = cfg.hidden()
        self.w1 = nn.Linear(cfg.dim, f, bias=False)  # gate
        self.w2 = nn.Linear(f, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, f, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = LlamaFeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Parameters: tok_embeddings.weight [V,C], layers.{i}.{attention_norm, attention.{wq,wk,wv,wo},
    ffn_norm, feed_forward.{w1,w2,w3}}.weight, norm.weight, and output.weight [V,C] unless tied."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        super().__init__()
        _check_heads(cfg.dim, cfg.heads, cfg.kv_heads)
        if (cfg.dim // cfg.heads) % 2 != 0:
            raise ValueError(f"head size {cfg.dim // cfg.heads} must be even for rotary")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq, cfg.dim // cfg.heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("mask", _causal_mask(cfg.seq), persistent=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):  # attention_norm, ffn_norm, norm
                p.fill_(1.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if tokens.shape[1] > self.cfg.seq:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's {self.cfg.seq}")
        x = self.tok_embeddings(tokens.long())
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin, self.mask)
        x = self.norm(x)
        if self.output is None:
            logits = x @ self.tok_embeddings.weight.t()
        else:
            logits = self.output(x)
        return logits, _loss(logits, targets)


# ------------------------------------------------------------------------------------------------
# Shared helpers


def _loss(logits: torch.Tensor, targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if targets is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


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
