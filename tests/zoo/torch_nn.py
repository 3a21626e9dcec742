"""Two GPTs built from torch.nn's own transformer layers, as tutorials and quick experiments
write them: one stacks nn.TransformerEncoderLayer (pre-norm, batch first) under a causal mask
from nn.Transformer.generate_square_subsequent_mask, the other calls nn.MultiheadAttention
directly with a boolean causal mask and its default need_weights=True (so torch computes the
scores with baddbmm on [batch*heads, seq, head_dim] and averages the weights it returns).
Dropout is 0: libctr has none."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class EncoderGPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        T = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(self.norm(x))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask)
        x = x + a
        return x + self.mlp(self.ln2(x))


class MHAGPT(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        T = idx.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos[:, :T]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(vocab, seq, dim, heads, layers, seed, kind="encoder"):
    torch.manual_seed(seed)
    cls = {"encoder": EncoderGPT, "mha": MHAGPT}[kind]
    return cls(vocab, seq, dim, heads, layers), loss_fn
