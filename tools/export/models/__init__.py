"""Reference PyTorch models of libctr's presets, the side the runtime is checked against.

    from models.gpt import GPT, GPTConfig        # the `gpt` preset
    from models.llama import Llama, LlamaConfig  # the `llama` preset
    from models.moe import MoE, MoEConfig        # the `moe` preset (llama with MoE layers)
    model = GPT(GPTConfig(vocab=256, seq=256, layers=4, dim=256, heads=4), seed=0)
    logits, loss = model(tokens, targets)        # tokens, targets: [B, T] integer tensors

Parameter names equal the presets' tensor names, and the blocks that are single libctr ops
(models.blocks) say so, so the exporter (ctr_export) turns either model into a graph file.
The benchmarks (tools/bench/torch_models.py) and the parity tests use these same modules.
"""

from .blocks import CausalAttention, RMSNorm, Rotary, SwiGLU, rotary_tables
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .moe import MoE, MoEConfig

__all__ = ["CausalAttention", "GPT", "GPTConfig", "Llama", "LlamaConfig", "MoE", "MoEConfig",
           "RMSNorm", "Rotary", "SwiGLU", "rotary_tables"]
