"""Building blocks of the reference models that are single ops in libctr's graph op set.

Each block is written out in plain PyTorch (so its forward and backward are torch's own, the
reference the runtime is checked against) and names the libctr op it is equal to in the class
attribute `ctr_op`. The exporter (ctr_export) treats a module with `ctr_op` as a leaf: it does
not trace into it but emits that one op, reading the attributes documented on each class.
Tracing into them instead would produce ops the graph format does not have (masked_fill,
repeat_interleave, cat, rsqrt), and the fused op is what libctr runs fastest anyway.

Shapes follow libctr's ops, not the usual [B, H, T, D] layout: attention and rotary take
activations as [batch, seq, heads * head_dim], exactly what the projections produce, so a
block maps onto its op without reshapes around it.
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """libctr op rmsnorm(x, weight), attribute eps: x * rsqrt(mean(x^2) + eps) * weight."""

    ctr_op = "rmsnorm"

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq, head_dim/2]: angle(t, i) = t * theta^(-2i/D).

    Computed in float64 and rounded once to float32, as libctr's rope kernel does, so both
    sides start from the correctly rounded values rather than whatever an fp32 pow gives."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    angle = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().float(), angle.sin().float()


class Rotary(nn.Module):
    """libctr op rope(x), attributes heads and theta, on x [B, T, heads * head_dim].

    The "rotate half" form of Llama/NeoX: at position t, element i of each head (i < D/2) is
    paired with element i + D/2 and the pair is rotated by t * theta^(-2i/D). The number of
    heads is read from the input width, so one module serves queries and grouped keys."""

    ctr_op = "rope"

    def __init__(self, head_dim: int, seq: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"head size {head_dim} must be even for rotary")
        self.head_dim = head_dim
        self.theta = theta
        cos, sin = rotary_tables(seq, head_dim, theta)
        # Derived from the config, not trained: kept out of the state_dict.
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        d = self.head_dim
        x = x.view(b, t, width // d, d)
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]  # broadcast over heads
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return y.view(b, t, width)


class CausalAttention(nn.Module):
    """libctr op attention(q, k, v), attributes heads, kv_heads, causal (1), scale.

    q [B, T, heads * D], k and v [B, T, kv_heads * D]; query head h reads kv head
    h // (heads / kv_heads). Softmax attention with a causal mask, scaled by 1/sqrt(D)
    unless `scale` is given. Written out so every op is visible; no parameters."""

    ctr_op = "attention"

    def __init__(self, heads: int, kv_heads: Optional[int] = None,
                 scale: Optional[float] = None):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads != 0:
            raise ValueError(f"heads {heads} is not a multiple of kv_heads {kv_heads}")
        self.heads = heads
        self.kv_heads = kv_heads
        self.scale = scale
        self.causal = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, width = q.shape
        d = width // self.heads
        q = q.view(b, t, self.heads, d).transpose(1, 2)  # [B, H, T, D]
        k = k.view(b, t, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, d).transpose(1, 2)
        group = self.heads // self.kv_heads
        if group > 1:  # each kv head serves `group` consecutive query heads
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        scale = 1.0 / math.sqrt(d) if self.scale is None else self.scale
        scores = (q @ k.transpose(-2, -1)) * scale
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)  # above diagonal
        scores = scores.masked_fill(mask, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return y.transpose(1, 2).reshape(b, t, width)


class SwiGLU(nn.Module):
    """libctr op swiglu(gate, up) = silu(gate) * up."""

    ctr_op = "swiglu"

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


def causal_lm_loss(logits: torch.Tensor, targets: Optional[torch.Tensor]
                   ) -> Optional[torch.Tensor]:
    """Mean next-token cross-entropy over all positions (libctr's loss)."""
    if targets is None:
        return None
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def check_heads(dim: int, heads: int, kv_heads: int) -> None:
    if heads <= 0 or dim % heads != 0:
        raise ValueError(f"dim {dim} is not divisible by heads {heads}")
    if kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(f"heads {heads} is not divisible by kv_heads {kv_heads}")
