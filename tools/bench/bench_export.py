#!/usr/bin/env python3
"""Step time of exported ordinary model code against the equivalent preset graph, on the CPU.

    .venv/bin/python3 tools/bench/bench_export.py                    # nanogpt vs --preset gpt
    .venv/bin/python3 tools/bench/bench_export.py --model llama_meta # vs --preset llama
    .venv/bin/python3 tools/bench/bench_export.py --no-fuse          # the exported graph unfused
    .venv/bin/python3 tools/bench/bench_export.py --model hf-mistral --torch
                                   # transformers' MistralForCausalLM vs --preset llama, and
                                   # PyTorch eager training the same model on the same batch

The model comes from tests/zoo (written the way common open-source model files are) and is
exported with ctr_export's ATen tracer; the peer is `ctr graph build --preset` at the same
sizes (V=256 T=256 L=4 H=4 C=256, B=8 by default). Both graphs run under `ctr run --metrics`
on the same thread count, alternating, --reps times each; the table gives the median step_ms
of all timed steps (the first --warmup steps of each run skipped) and the ratio exported /
preset: 1.00 means the exported model trains as fast as the preset. Differences in the models
themselves are printed with the table; the preset is built with the zoo model's feed-forward
width and head tying (nanogpt keeps its exact GELU, where the preset uses tanh).

hf-<class> models are transformers' causal-LM classes (tests/zoo/hf_causal_lm.py) at the
same sizes (kv heads H/2 where the class groups them, feed-forward width 2C, untied head),
with their own loss from labels. --torch adds PyTorch's step for the same model and batch:
eager forward, backward and AdamW on --threads threads, with OMP_WAIT_POLICY=PASSIVE (set
here before torch is imported, unless the environment sets it); --compile adds the same step
with the model under torch.compile (compiled during the warm-up steps, which are not timed).
"""

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.dont_write_bytecode = True
sys.path[:0] = [str(REPO / "tools" / "export"), str(REPO / "tests")]

PRESET = {"nanogpt": "gpt", "gpt2_hf": "gpt", "llama_meta": "llama", "llama_hf": "llama"}
# transformers' classes against the preset of the closest shape: RMSNorm + SwiGLU/GeGLU +
# rotary -> llama; LayerNorm + GELU -> gpt.
HF_PRESET = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
             "gemma": "llama", "gemma2": "llama", "olmo": "llama", "olmo2": "llama",
             "stablelm": "llama", "phi": "gpt", "gpt_neox": "gpt"}
HF_NOTES = {
    "llama": "",
    "mistral": "sliding window of 3T/8 (fused attention attribute window)",
    "qwen2": "q/k/v biases",
    "qwen3": "RMSNorm on q and k per head",
    "gemma": "GeGLU (preset: SwiGLU), embeddings scaled by sqrt(C), 1 kv head",
    "gemma2": "GeGLU, logit soft-capping, sliding window on alternate layers, 4 norms per layer, "
              "final logit soft-capping",
    "olmo": "LayerNorm without weights (preset: RMSNorm)",
    "olmo2": "RMSNorm on q and k, norms after the blocks",
    "stablelm": "LayerNorm (preset: RMSNorm), partial rotary (1/4 of the head)",
    "phi": "rotary on half the head, parallel attention and MLP, biases, tanh GELU",
    "gpt_neox": "rotary on 1/4 of the head, parallel residual, biases",
}

NOTES = {"nanogpt": "exact GELU (preset: tanh)",
         "gpt2_hf": "hand-written tanh GELU; preset built --untied like the model",
         "llama_meta": "rotary embeddings in complex form (fused as rope interleaved=1); preset "
                       "built with the model's feed-forward width",
         "llama_hf": "preset built --tied and with the model's feed-forward width"}

for _c, _p in HF_PRESET.items():
    PRESET[f"hf-{_c}"] = _p
    NOTES[f"hf-{_c}"] = "transformers' class with its own loss; " + (HF_NOTES[_c] or "same shape") + \
        "; preset built with the model's feed-forward width, untied"


def preset_flags(a):
    """Preset options that make the preset the same model as the zoo one."""
    if a.model == "gpt2_hf":
        return ["--untied"]
    if a.model == "llama_meta":
        hidden = int(2 * 4 * a.dim / 3)
        return ["--ffn-dim", str(32 * ((hidden + 31) // 32))]
    if a.model == "llama_hf":
        return ["--ffn-dim", str(2 * a.dim), "--tied"]
    if a.model.startswith("hf-"):
        return ["--ffn-dim", str(2 * a.dim), "--untied"] if PRESET[a.model] == "llama" else ["--untied"]
    return []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESET), default="nanogpt")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    ap.add_argument("--reps", type=int, default=3, help="runs of each graph, alternating")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-fuse", action="store_true", help="run the exported graph unfused")
    ap.add_argument("--torch", action="store_true",
                    help="also time PyTorch eager training the same model on the same batch")
    ap.add_argument("--compile", action="store_true",
                    help="with --torch, also time the model under torch.compile (inductor; compiled "
                         "during the warm-up steps)")
    ap.add_argument("--ctr", default=str(REPO / "build" / "tools" / "ctr"))
    return ap.parse_args(argv)


def build_model(a):
    if a.model.startswith("hf-"):
        mod = importlib.import_module("zoo.hf_causal_lm")
        return mod.build(vocab=a.vocab, seq=a.seq, dim=a.dim, heads=a.heads, layers=a.layers,
                         seed=0, case=a.model[3:])
    mod = importlib.import_module(f"zoo.{a.model}")
    return mod.build(vocab=a.vocab, seq=a.seq, dim=a.dim, heads=a.heads, layers=a.layers, seed=0)


def export_model(a, path):
    import torch

    import ctr_export
    model, loss_fn = build_model(a)
    example = torch.randint(0, a.vocab, (2, min(a.seq, 16)))
    ctr_export.export(model, (example, example), loss_fn, path, max_seq=a.seq)


def torch_steps(a, compiled=False):
    """PyTorch's step times (ms) for the same model and batch: eager (or torch.compile'd)
    forward, backward and AdamW, --threads threads, the first --warmup steps skipped."""
    import time

    import torch
    torch.set_num_threads(a.threads)
    model, loss_fn = build_model(a)
    if compiled:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(a.warmup + a.steps * a.reps):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if loss_fn is None:
            loss = model(tokens, tokens)[1]
        else:
            loss = loss_fn(model(tokens), tokens)
        loss.backward()
        opt.step()
        if i >= a.warmup:
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def preset_graph(a, path):
    cmd = [a.ctr, "graph", "build", "--preset", PRESET[a.model], "--layers", str(a.layers),
           "--dim", str(a.dim), "--heads", str(a.heads), "--vocab", str(a.vocab),
           "--seq", str(a.seq), "-o", path]
    if PRESET[a.model] == "llama":
        cmd += ["--kv-heads", str(max(1, a.heads // 2))]
    cmd += preset_flags(a)
    subprocess.run(cmd, check=True, capture_output=True)


def run(a, graph, tmp, extra):
    metrics = os.path.join(tmp, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [a.ctr, "run", graph, "--steps", str(a.warmup + a.steps), "--batch", str(a.batch),
           "--seq", str(a.seq), "--warmup", "0", "--metrics", metrics] + extra
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(a.threads), CTR_NUM_THREADS=str(a.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-800:]}")
    with open(metrics) as f:
        rows = sorted((json.loads(x) for x in f if x.strip()), key=lambda r: r["step"])
    return [float(r["step_ms"]) for r in rows[a.warmup:]]


def main(argv=None):
    a = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ctr-bench-export-") as tmp:
        exported, preset = os.path.join(tmp, "exported.ctrg"), os.path.join(tmp, "preset.ctrg")
        export_model(a, exported)
        preset_graph(a, preset)
        times = {"exported": [], "preset": []}
        for _ in range(a.reps):
            times["exported"] += run(a, exported, tmp, ["--no-fuse"] if a.no_fuse else [])
            times["preset"] += run(a, preset, tmp, [])
        if a.torch:
            times["torch"] = torch_steps(a)
        if a.torch and a.compile:
            times["compiled"] = torch_steps(a, compiled=True)
    e, p = statistics.median(times["exported"]), statistics.median(times["preset"])
    print(f"model {a.model} vs preset {PRESET[a.model]}: V={a.vocab} T={a.seq} L={a.layers} "
          f"H={a.heads} C={a.dim} B={a.batch}, {a.threads} threads, "
          f"{a.reps} x {a.steps} timed steps each{' (exported graph unfused)' if a.no_fuse else ''}")
    print(f"  differences: {NOTES[a.model]}")
    print(f"  {'graph':10s} {'median step_ms':>15s}")
    print(f"  {'exported':10s} {e:15.1f}")
    print(f"  {'preset':10s} {p:15.1f}")
    if a.torch:
        t = statistics.median(times["torch"])
        print(f"  {'pytorch':10s} {t:15.1f}   (eager, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']})")
    if "compiled" in times:
        c = statistics.median(times["compiled"])
        print(f"  {'compiled':10s} {c:15.1f}   (torch.compile, inductor)")
    print(f"  exported / preset: {e / p:.3f}")
    if a.torch:
        print(f"  pytorch / exported: {t / e:.3f}")
    if "compiled" in times:
        print(f"  compiled / exported: {c / e:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
