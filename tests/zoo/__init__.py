"""Small models written the way common open-source model files are, for the exporter's tests.

Each module defines `build(vocab, seq, dim, heads, layers, seed)` returning (model, loss_fn):
loss_fn is None when the model computes its own loss (forward(idx, targets) -> (logits, loss)).
Nothing here is written for the exporter: shape unpacking, tuple-unpacked splits, registered
mask buffers, complex rotary embeddings and weight tying by assignment are the point.
"""

MODELS = ["nanogpt", "gpt2_hf", "llama_meta", "llama_hf", "torch_nn", "hf_causal_lm"]
