#!/usr/bin/python3
"""Training throughput on one GPU: `ctr run --device cuda` next to PyTorch on the same GPU in
the same run, same model, batch, sequence length and AdamW.

    python3 tools/bench/bench_gpu.py --ctr build/tools/ctr --model gpt2_small [--out DIR]
    python3 tools/bench/bench_gpu.py --ctr build/tools/ctr --model llama_1b --steps 20

Models: gpt2_small (the gpt preset at GPT-2 small's sizes: 12 layers, width 768, 12 heads,
vocabulary 50304, T = 1024) and llama_1b (the llama preset: 16 layers, width 2048, 16 heads,
8 kv heads, vocabulary 32000, T = 2048). The peers, each given its best setting: PyTorch eager
with bf16 autocast, fused AdamW and scaled_dot_product_attention (flash) in place of the
reference model's explicit attention, and the same under torch.compile. libctr runs with its
defaults (bf16 activations, f32 master weights, CUDA graphs). Reported: median tokens/s over the
timed steps (after --warmup), MFU against the GPU's dense bf16 peak (from its name, or
--peak-tflops), and the ratio of libctr to each peer. Prints a table and, with --out, writes
bench_gpu_MODEL.json there. Needs PyTorch with CUDA; without it only libctr runs. --time-limit
bounds the whole run: libctr's run is stopped at the limit, a peer is started only while time
remains and stops timing steps when it runs out (so a measurement may hold fewer steps than asked).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODELS = {
    "gpt2_small": dict(preset="gpt", layers=12, dim=768, heads=12, kv_heads=None, vocab=50304, seq=1024, batch=8),
    "llama_1b": dict(preset="llama", layers=16, dim=2048, heads=16, kv_heads=8, vocab=32000, seq=2048, batch=4),
}

# Dense bf16 tensor-core peaks (FLOP/s) by GPU name, from the vendors' data sheets.
PEAKS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]


def gpu_peak(name):
    for key, peak in PEAKS:
        if key in name:
            return peak
    return None


class Deadline:
    """Seconds left of --time-limit (None: no limit)."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds if seconds > 0 else None

    def left(self):
        return None if self.end is None else max(0.0, self.end - time.monotonic())


def run_ctr(ctr, m, steps, warmup, peak, workdir, deadline):
    graph = os.path.join(workdir, "model.ctrg")
    build = [ctr, "graph", "build", "--preset", m["preset"], "--layers", str(m["layers"]), "--dim", str(m["dim"]),
             "--heads", str(m["heads"]), "--vocab", str(m["vocab"]), "--seq", str(m["seq"]), "-o", graph]
    if m["kv_heads"]:
        build += ["--kv-heads", str(m["kv_heads"])]
    try:
        subprocess.run(build, check=True, capture_output=True, timeout=deadline.left())
    except subprocess.TimeoutExpired:
        return {"error": "time limit reached while building the graph"}
    metrics = os.path.join(workdir, "ctr_metrics.jsonl")
    cmd = [ctr, "run", graph, "--device", "cuda", "--steps", str(steps + warmup), "--batch", str(m["batch"]),
           "--lr", "3e-4", "--warmup", "0", "--log-every", "0", "--metrics", metrics]
    if peak:
        cmd += ["--peak-flops", str(peak)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline.left())
    except subprocess.TimeoutExpired:
        return {"error": "time limit reached"}
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr).strip().splitlines()[-1:]}
    rows = [json.loads(line) for line in open(metrics) if line.strip().startswith("{")]
    rows = [r for r in rows if "tokens_per_s" in r][warmup:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "loss_first": rows[0].get("loss"), "loss_last": rows[-1].get("loss")}


def run_torch(m, steps, warmup, compiled, deadline):
    import torch
    import torch.nn.functional as F
    from torch_models import build, flops_per_token
    import models.blocks as blocks

    def sdpa(self, q, k, v):  # the peer's best attention: PyTorch's flash kernel
        b, t, width = q.shape
        d = width // self.heads
        q = q.view(b, t, self.heads, d).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return y.transpose(1, 2).reshape(b, t, width)

    blocks.Attention.forward = sdpa
    torch.manual_seed(0)
    model = build(m["preset"], m["vocab"], m["seq"], m["layers"], m["dim"], m["heads"], m["kv_heads"]).cuda()
    fpt = flops_per_token(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_model = torch.compile(model) if compiled else model
    B, T = m["batch"], m["seq"]
    tokens = torch.randint(0, m["vocab"], (B, T), device="cuda")
    targets = torch.randint(0, m["vocab"], (B, T), device="cuda")
    times = []
    for i in range(steps + warmup):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if times and deadline.left() == 0:
            break
    if not times:
        return {"error": "time limit reached during warm-up"}
    return {"tokens_per_s": B * T / statistics.median(times), "timed_steps": len(times), "flops_per_token": fpt,
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctr", required=True)
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2_small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=0, help="override the model's batch")
    ap.add_argument("--peak-tflops", type=float, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--time-limit", type=float, default=0, help="seconds for the whole run (0: none)")
    args = ap.parse_args()
    m = dict(MODELS[args.model])
    deadline = Deadline(args.time_limit)
    if args.batch:
        m["batch"] = args.batch
    result = {"model": args.model, "config": m, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    name, peak = "", args.peak_tflops * 1e12 or None
    try:
        import torch
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            peak = peak or gpu_peak(name)
    except ImportError:
        torch = None
    result["gpu"], result["peak_flops"] = name, peak
    with tempfile.TemporaryDirectory() as work:
        result["ctr"] = run_ctr(args.ctr, m, args.steps, args.warmup, peak, work, deadline)
    if name:
        for label, compiled in (("torch_eager", False), ("torch_compile", True)):
            if deadline.left() is not None and deadline.left() < 20:
                result[label] = {"error": f"not run: {deadline.left():.0f} s of the time limit left"}
                continue
            try:
                result[label] = run_torch(m, args.steps, args.warmup, compiled, deadline)
            except Exception as e:  # a peer that fails is reported, not fatal
                result[label] = {"error": f"{type(e).__name__}: {e}"}
    fpt = next((result[k].get("flops_per_token") for k in ("torch_eager", "torch_compile")
                if k in result and "flops_per_token" in result[k]), None)
    print(f"{args.model} on {name or 'unknown GPU'} (batch {m['batch']}, T {m['seq']}), {result['date']}")
    print(f"{'run':<15} {'tokens/s':>12} {'MFU':>7} {'libctr / run':>13}")
    ctr_tps = result["ctr"].get("tokens_per_s")
    for label in ("ctr", "torch_eager", "torch_compile"):
        r = result.get(label)
        if not r:
            continue
        if "error" in r:
            print(f"{label:<15} error: {r['error']}")
            continue
        tps = r["tokens_per_s"]
        mfu = f"{100 * tps * fpt / peak:6.1f}%" if fpt and peak else "    n/a"
        ratio = f"{ctr_tps / tps:13.2f}" if ctr_tps else ""
        print(f"{label:<15} {tps:12.0f} {mfu} {ratio}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"bench_gpu_{args.model}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
