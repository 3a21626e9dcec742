"""The reference PyTorch model of libctr's `llama` preset (lib/graph/presets.cc).

Llama style: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP of width
256 * ceil((8C/3) / 256), no biases and an untied output head by default. Parameter names
equal the preset's tensor names (Meta's reference implementation's):

    tok_embeddings.weight [V,C], layers.{i}.{attention_norm,ffn_norm}.weight,
    layers.{i}.attention.{wq,wk,wv,wo}.weight, layers.{i}.feed_forward.{w1,w2,w3}.weight,
    norm.weight, and output.weight [V,C] unless tied.

It is a reference, written for clarity: plain fp32 modules, no fused kernels. RMSNorm,
rotary, the attention core and SwiGLU are the blocks of models.blocks, which the exporter
(ctr_export) maps onto libctr's rmsnorm, rope, attention and swiglu ops. The rotary tables
are non-persistent buffers and stay out of the state_dict.

Initialisation is deterministic for a seed (std 0.02, residual projections scaled by
1/sqrt(2 * layers), norms at one) but not bit equal to libctr's counter-based RNG.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .blocks import CausalAttention, RMSNorm, Rotary, SwiGLU, causal_lm_loss, check_heads


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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * d, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.heads * d, cfg.dim, bias=False)
        self.rotary = Rotary(d, cfg.seq, cfg.rope_theta)
        self.core = CausalAttention(cfg.heads, cfg.kv_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.rotary(self.wq(x))
        k = self.rotary(self.wk(x))
        return self.wo(self.core(q, k, self.wv(x)))


class LlamaFeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        f = cfg.hidden()
        self.w1 = nn.Linear(cfg.dim, f, bias=False)  # gate
        self.w2 = nn.Linear(f, cfg.dim, bias=False)  # down
        self.w3 = nn.Linear(cfg.dim, f, bias=False)  # up
        self.swiglu = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.swiglu(self.w1(x), self.w3(x)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = LlamaFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """forward(tokens [B,T], targets [B,T] or None) -> (logits [B,T,V], mean loss or None)."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        super().__init__()
        check_heads(cfg.dim, cfg.heads, cfg.kv_heads)
        if (cfg.dim // cfg.heads) % 2 != 0:
            raise ValueError(f"head size {cfg.dim // cfg.heads} must be even for rotary")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab, bias=False)
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
        torch._assert(tokens.shape[1] <= self.cfg.seq,
                      "sequence longer than the model's rotary tables")
        x = self.tok_embeddings(tokens.long())
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        logits = x @ self.tok_embeddings.weight.t() if self.output is None else self.output(x)
        return logits, causal_lm_loss(logits, targets)
