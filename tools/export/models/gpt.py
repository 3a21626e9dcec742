"""The reference PyTorch model of libctr's `gpt` preset (lib/graph/presets.cc).

GPT-2 style: learned positions, LayerNorm before each block, causal self-attention with
biases, a GELU (tanh) MLP of width 4C, a final LayerNorm and a head tied to the token
embedding by default. Parameter names equal the preset's tensor names (nanoGPT's), so a
state_dict maps one to one onto libctr's parameters and the exporter (ctr_export) writes a
graph file with the same names:

    wte [V,C], wpe [T,C], layers.{i}.{ln1,ln2}.{weight,bias},
    layers.{i}.attn.{wq,wk,wv,wo}.{weight,bias}, layers.{i}.mlp.{fc,proj}.{weight,bias},
    ln_f.{weight,bias}, and lm_head.weight [V,C] only when untied.

It is a reference, written for clarity: plain fp32 modules, no dropout, no fused kernels.
The attention core is models.blocks.CausalAttention, which the exporter maps onto libctr's
attention op; everything else is ordinary torch ops that map one to one.

Initialisation is deterministic for a seed (a private generator, parameters in state_dict
order, GPT-2's std 0.02 with residual projections scaled by 1/sqrt(2 * layers)) but not bit
equal to libctr's counter-based RNG: tests copy weights across rather than relying on it.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import CausalAttention, causal_lm_loss, check_heads


@dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 256  # the longest sequence; wpe has this many rows
    layers: int = 4
    dim: int = 256
    heads: int = 4
    tie_embeddings: bool = True  # logits = x wte^T; untied adds lm_head.weight [V, C]
    eps: float = 1e-5


class GPTAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        c = cfg.dim
        self.wq = nn.Linear(c, c)
        self.wk = nn.Linear(c, c)
        self.wv = nn.Linear(c, c)
        self.wo = nn.Linear(c, c)
        self.core = CausalAttention(cfg.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.core(self.wq(x), self.wk(x), self.wv(x)))


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
    """forward(tokens [B,T], targets [B,T] or None) -> (logits [B,T,V], mean loss or None)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        check_heads(cfg.dim, cfg.heads, cfg.heads)
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
        # torch._assert rather than `if ...: raise`, so that torch.fx can trace the check.
        torch._assert(t <= self.cfg.seq, "sequence longer than the model's positional table")
        x = F.embedding(tokens.long(), self.wte) + self.wpe[:t]
        for layer in self.layers:
            x = layer(x)
        x = self.ln_f(x)
        logits = x @ self.wte.t() if self.lm_head is None else self.lm_head(x)
        return logits, causal_lm_loss(logits, targets)
