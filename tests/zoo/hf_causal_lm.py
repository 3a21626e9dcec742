"""Causal language models of the transformers library, built from their own config classes
at a given size with random weights (nothing downloaded), called as their documentation
shows: model(input_ids=tokens, labels=tokens), the model's own shifted loss.

build(vocab, seq, dim, heads, layers, seed, case=...) returns (model, None): the model takes
(tokens, targets) and returns (logits, loss), as the exporter's loss-inside form wants; the
targets are not read (the labels are the tokens). Shared by tests/bindings/test_zoo_hf.py and
tools/bench/bench_export.py.
"""
import torch
import torch.nn as nn

PAD = 5  # the pad token: its embedding row gets no gradient (padding_idx)

# case: (model class, config class, config beyond the sizes; kv_heads: kv heads as a
# fraction of the heads, head_dim: set explicitly where the class has it)
CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(kv=2)),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(kv=2, window=True)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(kv=2)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(kv=2, head_dim=True)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(kv=4, head_dim=True)),
    # Logits capped low enough that tanh bends a tiny model's scores.
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(kv=2, head_dim=True, window=True,
                                                         extra=dict(attn_logit_softcapping=0.05))),
    "phi": ("PhiForCausalLM", "PhiConfig", dict()),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict()),
    "olmo": ("OlmoForCausalLM", "OlmoConfig", dict()),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict()),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(kv=2)),
    # Attention written out (attn_implementation="eager"): the mask is a constant built for
    # the batch and added to the scores.
    "llama-eager": ("LlamaForCausalLM", "LlamaConfig", dict(kv=2, eager=True)),
    "gpt_neox-eager": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(eager=True)),
}


def config(case, vocab, seq, dim, heads, layers):
    import transformers
    _, cfg_cls, o = CASES[case]
    kw = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
              num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=seq,
              pad_token_id=PAD, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if "kv" in o:
        kw["num_key_value_heads"] = max(1, heads // o["kv"])
    if o.get("head_dim"):
        kw["head_dim"] = dim // heads
    if o.get("window"):
        kw["sliding_window"] = max(2, seq * 3 // 8)  # shorter than the sequence
    if o.get("eager"):
        kw["attn_implementation"] = "eager"
    kw.update(o.get("extra", {}))
    return getattr(transformers, cfg_cls)(**kw)


class CausalLM(nn.Module):
    """model(tokens, targets) -> (logits, loss) around a transformers causal LM."""

    def __init__(self, case, cfg, seed):
        super().__init__()
        import transformers
        torch.manual_seed(seed)
        self.model = getattr(transformers, CASES[case][0])(cfg)

    def forward(self, tokens, targets):
        out = self.model(input_ids=tokens, labels=tokens)
        return out.logits, out.loss


def build(vocab, seq, dim, heads, layers, seed, case="llama"):
    return CausalLM(case, config(case, vocab, seq, dim, heads, layers), seed), None
