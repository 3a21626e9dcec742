#!/usr/bin/env python3
"""libctr trains the reference models exactly as PyTorch does.

    .venv/bin/python3 tests/bindings/test_parity.py

For each reference model (tools/export/models: gpt, llama with grouped-query attention, and
moe twice: top-2 softmax routing with a shared expert, top-1 sigmoid routing without) at a
small size, PyTorch and libctr start from the same weights and take 20 AdamW steps on the
same batches, with the same warm-up + cosine schedule, weight decay on matrices only and
global-norm clipping. The weights reach libctr two ways, both checked where they exist:
  - "set_param": the preset graph built by libctr, weights copied in by name;
  - "export":    the module exported with ctr_export, weights embedded in the .ctrg file
                 (the MoE layer as one unit: ctr_export maps it onto libctr's moe ops);
  - "aten":      gpt and llama exported by ctr_export's ATen-level tracer, which reads the
                 modules' code op by op instead of mapping them whole.
For moe the reference's expert loop is first checked against a dense evaluation of every
expert on every token, forward and backward, so a mistake there cannot pass as agreement;
and at every step the load-balancing and z-losses (summed over the layers, read from
libctr's kept layers.{i}.moe.{aux_loss,z_loss}) must agree within 1e-4 relative as well.
Per-step losses must agree within 1e-4 relative and the final weights within WEIGHT_ATOL
(absolute; the weights are O(0.02..1)). Everything runs in float32 on 2 threads per side.

The PyTorch side is written from the library's documented optimizer, not from its code:
torch.optim.AdamW with libctr's default betas/eps/decay, clip_grad_norm_, and a LambdaLR
reproducing the schedule lr(s) = lr*(s+1)/warmup for s < warmup, then
min_lr + (lr-min_lr)/2 * (1 + cos(pi*p)), p = (s-warmup)/decay_steps clipped to [0, 1].
Exits 77 (skipped) when torch or numpy is missing; prints "N passed, N failed" last.
"""
import math
import os
import re
import sys
import tempfile
import traceback

sys.dont_write_bytecode = True  # importing the models must not leave __pycache__ in the tree
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "tools", "export"))

try:
    import numpy as np
    import torch
except ImportError as e:
    print(f"test_parity: {e.name} is not installed; skipped")
    sys.exit(77)

import ctr  # noqa: E402
import ctr_export  # noqa: E402
from models.gpt import GPT, GPTConfig  # noqa: E402
from models.llama import Llama, LlamaConfig  # noqa: E402
from models.moe import MoE, MoEConfig  # noqa: E402

STEPS, BATCH = 20, 4
SIZES = dict(vocab=128, seq=32, layers=2, dim=64, heads=4)
OPT = dict(lr=2e-3, min_lr=2e-4, warmup_steps=5, decay_steps=15, beta1=0.9, beta2=0.95,
           eps=1e-8, weight_decay=0.1, grad_clip=1.0)
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-4
# The key bias has no gradient in exact arithmetic (adding a constant to every key shifts a
# softmax row by a constant), so both sides step it by AdamW-normalised rounding noise; it is
# only held to the bound of AdamW's total displacement, the sum of the learning rates.
ZERO_GRAD = re.compile(r"attn\.wk\.bias$")

# case: (preset, options beyond SIZES, shared by the preset and the reference config).
MOE = dict(kv_heads=2, experts=4, ffn_dim=32)
CASES = {
    "gpt": ("gpt", {}),
    "llama": ("llama", dict(kv_heads=2)),
    "moe": ("moe", dict(MOE, top_k=2, shared_ffn_dim=32)),
    "moe-top1": ("moe", dict(MOE, top_k=1, router_score="sigmoid")),
}
# Why a case has no "export" path.
NO_EXPORT = {}
# Cases without an "aten" path: the expert loop picks rows by the routing the data gives, which
# one trace would fix.
NO_ATEN = {"moe", "moe-top1"}


def schedule(s):
    """libctr's learning rate at optimizer step s (0-based), from its documentation."""
    lr, lo, w, d = OPT["lr"], OPT["min_lr"], OPT["warmup_steps"], OPT["decay_steps"]
    if s < w:
        return lr * (s + 1) / w
    p = min(1.0, max(0.0, (s - w) / d))
    return lo + 0.5 * (lr - lo) * (1.0 + math.cos(math.pi * p))


def batches(vocab, seq, seed=0):
    """Learnable data: each row counts up from a random start by a random stride (mod vocab),
    so the loss falls quickly and gradients are far from zero."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        start = torch.randint(0, vocab, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        rows = (start + stride * torch.arange(seq + 1)[None, :]) % vocab
        out.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
    return out


def train_torch(model, data, aux=None):
    """AdamW steps on data; the per-step losses. aux, if a list (moe): gets each step's
    (load-balancing, z) losses, summed over the layers."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=OPT["lr"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s) / OPT["lr"])
    losses = []
    for tokens, targets in data:
        opt.zero_grad(set_to_none=True)
        _, loss = model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["grad_clip"])
        opt.step()
        sched.step()
        losses.append(loss.item())
        if aux is not None:
            aux.append(tuple(float(v) for v in model.routing_stats()[1:]))
    return losses


def aux_outputs(layers):
    """The moe preset's auxiliary-loss tensors, for the step option keep."""
    return [f"layers.{i}.moe.{kind}" for kind in ("aux_loss", "z_loss") for i in range(layers)]


def train_ctr(step, data, aux=None):
    """As train_torch, on libctr; aux needs the step kept aux_outputs()."""
    losses = []
    for i, (tokens, targets) in enumerate(data):
        step.set_input("tokens", tokens.numpy().astype(np.int32))
        step.set_input("targets", targets.numpy().astype(np.int32))
        m = step.run()
        assert abs(m["lr"] - schedule(i)) <= 1e-12 * OPT["lr"], (i, m["lr"], schedule(i))
        losses.append(m["loss"])
        if aux is not None:
            kept = [float(step.get_output(n, shape=(1,))[0]) for n in aux_outputs(SIZES["layers"])]
            half = len(kept) // 2
            aux.append((sum(kept[:half]), sum(kept[half:])))
    return losses


def compare_aux(kind, torch_aux, ctr_aux):
    """Per-step load-balancing and z-losses of the two sides, within LOSS_RTOL relative."""
    rel = [abs(a - b) / abs(a) for ta, ca in zip(torch_aux, ctr_aux) for a, b in zip(ta, ca)]
    print(f"  {kind:8s} set_param aux {torch_aux[0][0]:.5f} -> {torch_aux[-1][0]:.5f}, "
          f"z {torch_aux[0][1]:.5f} -> {torch_aux[-1][1]:.5f}  max rel diff {max(rel):.2e}")
    bad = [(i, t, c) for i, (t, c) in enumerate(zip(torch_aux, ctr_aux))
           if any(abs(a - b) > LOSS_RTOL * abs(a) for a, b in zip(t, c))]
    assert not bad, f"{kind}: aux/z losses differ beyond {LOSS_RTOL:g} relative at " + \
        ", ".join(f"step {i}: torch {t} libctr {c}" for i, t, c in bad[:5])


def build(case, seed):
    preset, options = CASES[case]
    if preset == "gpt":
        return GPT(GPTConfig(**SIZES, **options), seed=seed)
    if preset == "llama":
        return Llama(LlamaConfig(**SIZES, **options), seed=seed)
    return MoE(MoEConfig(**SIZES, **options), seed=seed)


def dense_moe(layer, h):
    """An MoE layer's output computed densely: every expert on every token, weighted by a
    [N, E] matrix that is zero off each token's top k."""
    cfg, ex = layer.cfg, layer.experts
    h = h.reshape(-1, h.shape[-1])
    weights, idx = layer.route(layer.router(h))
    mix = torch.zeros(h.shape[0], cfg.experts).scatter_add(1, idx, weights)
    outs = torch.stack([torch.nn.functional.silu(h @ ex.w1[e].t()) * (h @ ex.w3[e].t())
                        @ ex.w2[e].t() for e in range(cfg.experts)], dim=1)  # [N, E, C]
    y = (mix.unsqueeze(-1) * outs).sum(1)
    return y if layer.shared is None else y + layer.shared(h)


def check_moe_reference(model, tokens):
    """The expert loop of every layer equals dense_moe, in value and in every gradient."""
    with torch.no_grad():
        x = model.tok_embeddings(tokens.long())
    for i, layer in enumerate(model.layers):
        h = layer.ffn_norm(x).detach()
        params = list(layer.moe.parameters())
        loop = layer.moe(h)[0].reshape(-1, h.shape[-1])
        dense = dense_moe(layer.moe, h)
        g_loop = torch.autograd.grad(loop.pow(2).sum(), params)
        g_dense = torch.autograd.grad(dense.pow(2).sum(), params)
        d = max([float((loop - dense).abs().max())] +
                [float((a - b).abs().max()) for a, b in zip(g_loop, g_dense)])
        assert d <= 1e-6, f"layer {i}: the expert loop differs from the dense form by {d:.3g}"
        with torch.no_grad():
            x = layer(x)[0]


def compare(kind, path, torch_losses, ctr_losses, model, step, names, results):
    rel = [abs(a - b) / abs(a) for a, b in zip(torch_losses, ctr_losses)]
    worst_w, worst_name, noise = 0.0, "", 0.0
    for name in names:
        want = model.state_dict()[name].numpy()
        got = step.get_param(name)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        d = float(np.abs(got - want).max())
        if ZERO_GRAD.search(name):
            noise = max(noise, d)
        elif d > worst_w:
            worst_w, worst_name = d, name
    results.append((kind, path, max(rel), worst_w, worst_name))
    print(f"  {kind:8s} {path:9s} loss {torch_losses[0]:.4f} -> {torch_losses[-1]:.4f}  "
          f"max rel loss diff {max(rel):.2e}  max |weight diff| {worst_w:.2e} ({worst_name})"
          + (f"  zero-gradient key bias {noise:.2e}" if noise else ""))
    lr_sum = sum(schedule(s) for s in range(STEPS))
    assert noise <= lr_sum, f"{kind}/{path}: key bias moved {noise:.3g} > {lr_sum:.3g}"
    bad = [(i, a, b) for i, (a, b, r) in enumerate(zip(torch_losses, ctr_losses, rel))
           if r > LOSS_RTOL]
    assert not bad, f"{kind}/{path}: losses differ beyond {LOSS_RTOL:g} relative at " + \
        ", ".join(f"step {i}: torch {a:.7f} libctr {b:.7f}" for i, a, b in bad[:5])
    assert worst_w <= WEIGHT_ATOL, \
        f"{kind}/{path}: final weights differ by {worst_w:.3g} in {worst_name} (> {WEIGHT_ATOL})"
    assert torch_losses[-1] < torch_losses[0] - 0.5, f"{kind}: the loss did not fall"


def parity(kind, results):
    torch.manual_seed(0)
    preset_name, options = CASES[kind]
    model = build(kind, seed=1)
    names = list(model.state_dict())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(SIZES["vocab"], SIZES["seq"])
    if preset_name == "moe":
        check_moe_reference(model, data[0][0])
    no_export = NO_EXPORT.get(preset_name)
    if not no_export:
        tmp = tempfile.mkdtemp(prefix="ctr_parity_")
        graph_path = os.path.join(tmp, f"{kind}.ctrg")
        # Export before training, so the file holds the initial weights.
        ctr_export.export(model, data[0], None, graph_path)
        aten_path = os.path.join(tmp, f"{kind}-aten.ctrg")
        if kind not in NO_ATEN:
            ctr_export.export(model, data[0], None, aten_path, tracer="aten")

    torch_aux = [] if preset_name == "moe" else None
    torch_losses = train_torch(model, data, torch_aux)

    preset = dict(SIZES, **options)
    step_opts = dict(batch=BATCH, seq=SIZES["seq"], **OPT)
    keep = dict(keep=",".join(aux_outputs(SIZES["layers"]))) if torch_aux is not None else {}
    with ctr.Mesh(threads=2) as mesh:
        # Path 1: libctr's own preset, weights copied in by name.
        with ctr.Graph.preset(preset_name, **preset) as graph, \
                ctr.Step(mesh, graph, **step_opts, **keep) as s:
            assert sorted(graph.params) == sorted(names), \
                f"preset and reference model name different parameters: " \
                f"{sorted(set(graph.params) ^ set(names))}"
            for name in names:
                s.set_param(name, initial[name].numpy())
            ctr_aux = [] if torch_aux is not None else None
            losses = train_ctr(s, data, ctr_aux)
            compare(kind, "set_param", torch_losses, losses, model, s, names, results)
            if torch_aux is not None:
                compare_aux(kind, torch_aux, ctr_aux)
        if no_export:
            print(f"  {kind:8s} export    skipped: {no_export}")
            return
        # Path 2: the exported graphs with the weights embedded.
        for path, file in (("export", graph_path), ("aten", aten_path)):
            if not os.path.exists(file):
                continue
            with ctr.Graph.load(file) as graph, ctr.Step(mesh, graph, **step_opts) as s:
                assert sorted(graph.params) == sorted(names), \
                    sorted(set(graph.params) ^ set(names))
                for name in names:  # the embedded weights are the initial ones, bit for bit
                    assert np.array_equal(s.get_param(name), initial[name].numpy()), name
                losses = train_ctr(s, data)
                compare(kind, path, torch_losses, losses, model, s, names, results)
            os.remove(file)
    os.rmdir(tmp)


def run_all(cases, fn):
    """fn(case, results) for each case, each failure printed; results collects
    (case, path, max relative loss difference, max weight difference, where). Exit status."""
    torch.set_num_threads(2)
    passed = failed = 0
    results = []
    for kind in cases:
        try:
            fn(kind, results)
        except Exception:
            failed += 1
            print(f"FAIL {kind}:\n{traceback.format_exc()}")
        else:
            passed += 1
            print(f"ok   {kind}")
    if results:
        print(f"tolerances: loss {LOSS_RTOL:g} relative per step, weights {WEIGHT_ATOL:g} "
              f"absolute; worst seen: loss {max(r[2] for r in results):.2e}, "
              f"weights {max(r[3] for r in results):.2e}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_all(CASES, parity))
