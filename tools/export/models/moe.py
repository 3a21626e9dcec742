"""The reference PyTorch model of libctr's `moe` preset (lib/graph/presets.cc).

The llama model (models.llama: RMSNorm, rotary positions, grouped-query attention, no biases,
an untied output head by default) with the feed-forward of every block replaced by a
mixture of E SwiGLU experts, of which each token uses its top k. Parameter names equal the
preset's tensor names; per block, besides llama's attention and norms:

    layers.{i}.moe.router.weight [E,C]
    layers.{i}.moe.experts.w1 [E,F,C], .w3 [E,F,C], .w2 [E,C,F]     (stacked expert weights)
    layers.{i}.moe.shared.{w1,w3}.weight [Fs,C], .w2.weight [C,Fs]   (only if shared_ffn_dim)

The MoE layer, on the normalised rows h [N, C] of the N = B*T tokens:

    logits = h @ router^T                         [N, E]
    s      = softmax(logits) or sigmoid(logits)   (router_score)
    vals, idx = top k of s per row, largest first
    w      = vals / sum(vals) if router_renorm else vals   (renorm default: on iff k > 1)
    y[n]   = sum_j w[n,j] * expert_{idx[n,j]}(h[n])  (+ shared(h[n]) with a shared expert)
    expert_e(h) = (silu(h W1[e]^T) * (h W3[e]^T)) W2[e]^T

It is written the way open-source MoE code usually is: a loop over the experts, each
gathering the (token, slot) pairs routed to it, running its SwiGLU on those rows only and
scattering the weighted result back with index_add_. Every block adds two auxiliary losses
to the language-model loss:

    load balancing  aux = aux_loss * E * sum_e f_e * P_e, with f_e the fraction of the N*k
                    assignments that went to expert e (a count, no gradient) and P_e the mean
                    over tokens of softmax(logits)[:, e] (the softmax also when the router
                    scores with a sigmoid);
    router z-loss   z = z_loss * mean_n logsumexp(logits[n])^2.

After a forward, routing_stats() gives the tokens each layer's experts received and the
summed auxiliary losses, the figures libctr reports in its metrics.

It is a reference, written for clarity: plain fp32, no fused kernels, no capacity limit
(no token is dropped). Initialisation is deterministic for a seed (std 0.02; wo and the
experts' and shared expert's w2 scaled by 1/sqrt(2 * layers); norms at one) but not bit
equal to libctr's counter-based RNG.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import RMSNorm, SwiGLU, check_heads
from .llama import LlamaAttention, LlamaConfig, LlamaFeedForward


@dataclass
class MoEConfig(LlamaConfig):
    """LlamaConfig's fields (ffn_dim is each expert's hidden width F) and the MoE's own."""

    experts: int = 8  # E
    top_k: int = 2  # k, experts per token
    shared_ffn_dim: int = 0  # hidden width of an always-on shared expert; 0: none
    router_score: str = "softmax"  # "softmax" or "sigmoid"
    router_renorm: Optional[bool] = None  # None: renormalise the top-k scores iff top_k > 1
    aux_loss: float = 0.01  # load-balancing coefficient
    z_loss: float = 0.001  # router z-loss coefficient

    def renorm(self) -> bool:
        return self.top_k > 1 if self.router_renorm is None else bool(self.router_renorm)


class Experts(nn.Module):
    """E SwiGLU MLPs with their weights stacked: w1, w3 [E, F, C] and w2 [E, C, F]."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))  # down
        self.swiglu = SwiGLU()

    def unstacked(self) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each expert's (w1, w3, w2), as views of the stacked weights.

        Taken once per forward with unbind rather than as w1[e] inside the expert loop: the
        backward of unbind stacks the E gradients once, where each of E separate indexings
        would add a zero-filled gradient of the whole [E, ...] tensor."""
        return list(zip(self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)))

    def forward(self, weights: Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                h: torch.Tensor) -> torch.Tensor:
        """One expert, given its (w1, w3, w2) from unstacked(), on rows h [n, C]."""
        w1, w3, w2 = weights
        return self.swiglu(h @ w1.t(), h @ w3.t()) @ w2.t()


class MoEFeedForward(nn.Module):
    """forward(h [B,T,C]) -> (y [B,T,C], this layer's aux + z loss).

    The exporter (ctr_export) maps the whole layer onto libctr's moe ops (ctr_op)."""

    ctr_op = "moe"

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        if cfg.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"router_score {cfg.router_score!r} is not softmax or sigmoid")
        if not 1 <= cfg.top_k <= cfg.experts:
            raise ValueError(f"top_k {cfg.top_k} must be in 1..experts ({cfg.experts})")
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.dim, cfg.hidden())
        self.shared = None
        if cfg.shared_ffn_dim > 0:  # llama's SwiGLU MLP, at the shared expert's width
            self.shared = LlamaFeedForward(dataclasses.replace(cfg, ffn_dim=cfg.shared_ffn_dim))
        # Of the last forward, for routing_stats(): tokens per expert, aux and z loss.
        self.last_counts: Optional[torch.Tensor] = None
        self.last_aux: Optional[torch.Tensor] = None
        self.last_z: Optional[torch.Tensor] = None

    def route(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [N, k] and expert indices [N, k] of the router logits [N, E]."""
        cfg = self.cfg
        scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
        vals, idx = torch.topk(scores, cfg.top_k, dim=-1)  # sorted, largest first
        if cfg.renorm():
            vals = vals / vals.sum(-1, keepdim=True)
        return vals, idx

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        shape = h.shape
        h = h.reshape(-1, shape[-1])  # [N, C]: routing is per token
        n = h.shape[0]
        logits = self.router(h)  # [N, E]
        weights, idx = self.route(logits)

        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts.unstacked()):
            token, slot = torch.where(idx == e)  # the (token, slot) pairs routed to e
            if token.numel() == 0:
                continue
            out = self.experts(expert, h.index_select(0, token))
            y.index_add_(0, token, out * weights[token, slot].unsqueeze(-1))
        if self.shared is not None:
            y = y + self.shared(h)

        counts = torch.bincount(idx.reshape(-1), minlength=cfg.experts)  # [E], sums to N*k
        f = counts.to(logits.dtype) / (n * cfg.top_k)
        p = logits.softmax(-1).mean(0)
        aux = cfg.aux_loss * cfg.experts * (f * p).sum()
        z = cfg.z_loss * torch.logsumexp(logits, -1).pow(2).mean()
        self.last_counts, self.last_aux, self.last_z = counts, aux.detach(), z.detach()
        return y.view(shape), aux + z


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.moe = MoEFeedForward(cfg)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x))
        out = self.moe(self.ffn_norm(x))
        # Indexed rather than unpacked: torch.fx traces indexing of a module's result.
        return x + out[0], out[1]


class MoE(nn.Module):
    """forward(tokens [B,T], targets [B,T] or None) -> (logits [B,T,V], loss or None).

    The loss is the mean next-token cross-entropy (targets < 0 ignored) plus every block's
    load-balancing and z-loss."""

    def __init__(self, cfg: MoEConfig, seed: int = 0):
        super().__init__()
        check_heads(cfg.dim, cfg.heads, cfg.kv_heads)
        if (cfg.dim // cfg.heads) % 2 != 0:
            raise ValueError(f"head size {cfg.dim // cfg.heads} must be even for rotary")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
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
            elif name.endswith(("attention.wo.weight", "experts.w2", "shared.w2.weight")):
                p.normal_(0.0, residual_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        torch._assert(tokens.shape[1] <= self.cfg.seq,
                      "sequence longer than the model's rotary tables")
        x = self.tok_embeddings(tokens.long())
        aux = []
        for layer in self.layers:
            x, a = layer(x)
            aux.append(a)
        x = self.norm(x)
        logits = x @ self.tok_embeddings.weight.t() if self.output is None else self.output(x)
        if targets is None:
            return logits, None
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(),
                             ignore_index=-1)
        loss = ce
        for a in aux:  # an add per block, which the exporter maps one to one
            loss = loss + a
        return logits, loss

    def routing_stats(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Of the last forward: tokens routed to each expert, int64 [layers, E] (each row
        sums to B*T*k), and the load-balancing and z-losses summed over the layers (their
        coefficients applied), as detached scalars."""
        moes = [layer.moe for layer in self.layers]
        if moes[0].last_counts is None:
            raise RuntimeError("routing_stats() before the first forward")
        return (torch.stack([m.last_counts for m in moes]),
                torch.stack([m.last_aux for m in moes]).sum(),
                torch.stack([m.last_z for m in moes]).sum())
