#!/usr/bin/env python3
"""Training-step speed of libctr's `moe` preset against PyTorch on the CPU.

    .venv/bin/python3 tools/bench/bench_moe.py       # V=256 T=128 L=2 H=4 Hkv=2 C=128 B=8 E=8 k=2
    .venv/bin/python3 tools/bench/bench_moe.py --top-k 1 --router-score sigmoid --shared-ffn-dim 256
    .venv/bin/python3 tools/bench/bench_moe.py --ctr build/tools/ctr --steps 40 --json out.json

The companion of bench_gpt.py (whose sgemm peak, ctr lookup and summary it reuses), for the
mixture-of-experts preset. One script measures both sides on the same configuration:
  1. the OpenBLAS sgemm peak on this machine, with the same thread count;
  2. PyTorch: the reference model tools/export/models/moe.py, eager fp32, the expert loop
     written the usual way (gather the tokens routed to each expert, run it, index_add_ the
     weighted rows back), forward + backward + torch.optim.AdamW, --warmup steps untimed,
     then the median of --steps timed steps;
  3. libctr: `ctr graph build --preset moe` then `ctr run --metrics`, the first --warmup
     steps of the metrics file skipped and the median step_ms taken.

Both sides are charged the same model FLOPs per token, 6 * N_active + 12 * L * T * C, where
N_active counts the parameters a token is multiplied by: attention, the router, k of the E
experts, the shared expert if any and the output head (not the lookup-only token embeddings,
unless tied). Expert load is not equal in practice, but the total over tokens is exactly k
expert evaluations per token, so the count is exact for the batch as a whole.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "export"))
sys.dont_write_bytecode = True  # the imports below must not leave __pycache__ in the tree

import bench_gpt  # noqa: E402  (sgemm_peak, find_ctr, summarize, fmt)

# ------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Training-step speed of libctr's moe preset against PyTorch on the CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vocab", type=int, default=256, help="V")
    ap.add_argument("--seq", type=int, default=128, help="T")
    ap.add_argument("--layers", type=int, default=2, help="L")
    ap.add_argument("--heads", type=int, default=4, help="H")
    ap.add_argument("--kv-heads", type=int, default=2, help="Hkv")
    ap.add_argument("--dim", type=int, default=128, help="C")
    ap.add_argument("--ffn-dim", type=int, default=0,
                    help="each expert's hidden width F; 0: the preset's 256*ceil((8C/3)/256)")
    ap.add_argument("--experts", type=int, default=8, help="E")
    ap.add_argument("--top-k", type=int, default=2, help="k, experts per token")
    ap.add_argument("--shared-ffn-dim", type=int, default=0, help="shared expert width; 0: none")
    ap.add_argument("--router-score", choices=("softmax", "sigmoid"), default="softmax")
    ap.add_argument("--batch", type=int, default=8, help="B")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch.set_num_threads, and the sgemm peak's OpenBLAS threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "default"),
                    help="OMP_WAIT_POLICY for PyTorch; PASSIVE is its fastest setting on a "
                         "2-core machine")
    ap.add_argument("--ctr", default="build/tools/ctr",
                    help="the ctr binary; a relative path is tried from the current directory, "
                         "then from the repository root")
    ap.add_argument("--ctr-timeout", type=float, default=3600.0, help="seconds per ctr command")
    ap.add_argument("--sgemm-bin", default=None,
                    help="a built sgemm_peak; default: compile tools/bench/sgemm_peak.c with cc")
    ap.add_argument("--skip-torch", action="store_true", help="measure libctr only")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the figures as one JSON object ('-' for stdout)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if not 1 <= args.top_k <= args.experts:
        ap.error("--top-k must be in 1..--experts")
    return args


def config_string(a: argparse.Namespace) -> str:
    s = (f"V={a.vocab} T={a.seq} L={a.layers} H={a.heads} Hkv={a.kv_heads} C={a.dim} "
         f"F={hidden(a)} E={a.experts} k={a.top_k} router={a.router_score}")
    if a.shared_ffn_dim:
        s += f" Fs={a.shared_ffn_dim}"
    return s + f" B={a.batch}"


def hidden(a: argparse.Namespace) -> int:
    return a.ffn_dim if a.ffn_dim > 0 else 256 * ((8 * a.dim + 767) // 768)


# ------------------------------------------------------------------------------------------------
# The model and its FLOPs


def build_model(args: argparse.Namespace):
    from models.moe import MoE, MoEConfig

    cfg = MoEConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, dim=args.dim,
                    heads=args.heads, kv_heads=args.kv_heads, ffn_dim=hidden(args),
                    experts=args.experts, top_k=args.top_k, shared_ffn_dim=args.shared_ffn_dim,
                    router_score=args.router_score)
    return MoE(cfg, seed=args.seed)


def model_figures(args: argparse.Namespace) -> dict:
    m = build_model(args)
    total = sum(p.numel() for p in m.parameters())
    experts = sum(p.numel() for n, p in m.named_parameters() if ".moe.experts." in n)
    lookup = m.tok_embeddings.weight.numel() if m.output is not None else 0
    # Of the experts' weights a token meets k/E; everything else once (embedding rows: never).
    active = total - lookup - experts + experts * args.top_k // args.experts
    attn = 12 * args.layers * args.seq * args.dim
    return {"params": total, "expert_params": experts, "active_params": active,
            "excluded": ["tok_embeddings.weight"] if lookup else [], "attn_flops": attn,
            "flops_per_token": 6 * active + attn}


# ------------------------------------------------------------------------------------------------
# PyTorch


def run_torch(args: argparse.Namespace, model_flops: int) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = build_model(args)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # Random tokens stand in for a corpus: the step's cost depends on the routing, not on the
    # token values, and random inputs route close to evenly, as a trained balancer aims for.
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        _, loss = model(tokens, targets)
        loss.backward()
        opt.step()
        return loss.item()

    losses, times_ms = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        dt = (time.perf_counter() - t0) * 1e3
        if i >= args.warmup:
            times_ms.append(dt)
    counts = model.routing_stats()[0]
    return bench_gpt.summarize(times_ms, args, model_flops, first_loss=losses[0],
                               last_loss=losses[-1], threads=torch.get_num_threads(),
                               version=torch.__version__,
                               expert_tokens_min=int(counts.min()),
                               expert_tokens_max=int(counts.max()))


# ------------------------------------------------------------------------------------------------
# libctr through the ctr CLI


def ctr_commands(args: argparse.Namespace, ctr: Path, graph: str, metrics: str):
    build = [str(ctr), "graph", "build", "--preset", "moe", "--layers", str(args.layers),
             "--dim", str(args.dim), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
             "--vocab", str(args.vocab), "--seq", str(args.seq), "--ffn-dim", str(hidden(args)),
             "--experts", str(args.experts), "--top-k", str(args.top_k),
             "--shared-ffn-dim", str(args.shared_ffn_dim), "--router-score", args.router_score,
             "-o", graph]
    run = [str(ctr), "run", graph, "--steps", str(args.warmup + args.steps),
           "--batch", str(args.batch), "--seq", str(args.seq), "--lr", repr(args.lr),
           "--warmup", "0", "--threads", str(args.threads), "--metrics", metrics]
    return build, run


def run_ctr(args: argparse.Namespace, ctr: Path, model_flops: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ctr-bench-") as tmp:
        graph = os.path.join(tmp, "moe.ctrg")
        metrics = os.path.join(tmp, "metrics.jsonl")
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
                   OMP_NUM_THREADS=str(args.threads))
        for cmd in ctr_commands(args, ctr, graph, metrics):
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                   timeout=args.ctr_timeout)
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {args.ctr_timeout:.0f} s: {' '.join(cmd)}"}
            if r.returncode != 0:
                tail = (r.stderr or r.stdout).strip()[-600:]
                return {"error": f"exited {r.returncode}: {' '.join(cmd)}\n{tail}"}
        try:
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            return {"error": f"cannot read the metrics file: {e}"}

    rows.sort(key=lambda r: r.get("step", 0))
    timed = rows[args.warmup:]
    if not timed or any("step_ms" not in r for r in timed):
        return {"error": f"the metrics file has {len(rows)} steps, "
                         f"{len(timed)} after warm-up, or lacks step_ms"}
    extra = {"first_loss": rows[0].get("loss"), "last_loss": rows[-1].get("loss"),
             "reported_flops_per_token": timed[-1].get("flops_per_token"),
             "peak_bytes": max((r.get("peak_bytes") or 0) for r in rows) or None,
             "steps_in_metrics": len(rows)}
    return bench_gpt.summarize([float(r["step_ms"]) for r in timed], args, model_flops, **extra)


# ------------------------------------------------------------------------------------------------
# The table


def print_table(args, fig, peak, torch_r, ctr_r, ctr_note) -> None:
    fmt = bench_gpt.fmt
    peak_g = peak.get("sgemm_gflops")
    print(f"preset moe  {config_string(args)}  threads={args.threads}  "
          f"warm-up {args.warmup}, median of {args.steps} steps")
    print(f"parameters {fig['params']:,} (experts {fig['expert_params']:,}); active per token "
          f"N = {fig['active_params']:,} (k/E of the experts, excluding lookup-only "
          f"{', '.join(fig['excluded']) or 'nothing'})")
    print(f"FLOPs/token = 6*N + 12*L*T*C = 6*{fig['active_params']:,} + "
          f"12*{args.layers}*{args.seq}*{args.dim} = {fig['flops_per_token']:,}")
    if peak_g is not None:
        print(f"OpenBLAS sgemm peak: {peak_g:.1f} GFLOP/s ({peak.get('threads')} threads, "
              f"best of {len(peak.get('shapes', []))} shapes)")
    else:
        print(f"OpenBLAS sgemm peak: not measured ({peak.get('error')})")
    print()

    t = torch_r or {}
    c = ctr_r if ctr_r and "error" not in ctr_r else {}

    def ratio(key):
        a, b = t.get(key), c.get(key)
        return b / a if a and b else None

    def frac(r):
        return r["gflops"] / peak_g if peak_g and r.get("gflops") else None

    rows = [
        ("step ms (median)", t.get("step_ms"), c.get("step_ms"), ratio("step_ms"), ".1f"),
        ("tokens/s", t.get("tokens_per_s"), c.get("tokens_per_s"), ratio("tokens_per_s"), ",.0f"),
        ("model FLOPs/token", fig["flops_per_token"] if t else None,
         fig["flops_per_token"] if c else None, None, ",d"),
        ("achieved GFLOP/s", t.get("gflops"), c.get("gflops"), ratio("gflops"), ".2f"),
        ("fraction of sgemm peak", frac(t), frac(c), None, ".1%"),
    ]
    print(f"{'':24s}{'pytorch':>14s}{'libctr':>14s}{'libctr/pytorch':>16s}")
    for name, a, b, r, spec in rows:
        print(f"{name:24s}{fmt(a, spec):>14s}{fmt(b, spec):>14s}{fmt(r, '.3f'):>16s}")
    print()

    if t:
        print(f"pytorch {t['version']}: eager fp32, expert loop + index_add_, fwd+bwd+AdamW, "
              f"{t['threads']} threads, OMP_WAIT_POLICY={args.omp_wait_policy}; step ms min/max "
              f"{t['step_ms_min']:.1f}/{t['step_ms_max']:.1f}; loss {t['first_loss']:.4f} -> "
              f"{t['last_loss']:.4f}; tokens per expert in the last step "
              f"{t['expert_tokens_min']}..{t['expert_tokens_max']} "
              f"(even: {args.batch * args.seq * args.top_k // args.experts})")
    if c:
        line = (f"libctr: step ms min/max {c['step_ms_min']:.1f}/{c['step_ms_max']:.1f}; "
                f"{c['steps_in_metrics']} steps in the metrics file")
        if c.get("first_loss") is not None and c.get("last_loss") is not None:
            line += f"; loss {c['first_loss']:.4f} -> {c['last_loss']:.4f}"
        if c.get("peak_bytes"):
            line += f"; peak {c['peak_bytes'] / 2**20:.1f} MiB"
        print(line)
        rep = c.get("reported_flops_per_token")
        if rep and abs(rep - fig["flops_per_token"]) > 1e-3 * fig["flops_per_token"]:
            print(f"note: libctr reports flops_per_token {rep:,}, this script counts "
                  f"{fig['flops_per_token']:,}; the table uses the latter for both")
    if ctr_note:
        print(ctr_note)


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    # libgomp reads OMP_WAIT_POLICY once, when torch first loads it, so it is set before
    # anything imports torch (model_figures does); set later it has no effect.
    if args.omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    fig = model_figures(args)

    # The peak first, on a quiet machine, before PyTorch's threads exist.
    peak = bench_gpt.sgemm_peak(args)
    torch_r = None if args.skip_torch else run_torch(args, fig["flops_per_token"])

    ctr_r, ctr_note = None, None
    ctr = bench_gpt.find_ctr(args.ctr)
    if ctr is None:
        ctr_note = f"libctr was not run: no ctr binary at {args.ctr} (build it, or pass --ctr PATH)"
    else:
        ctr_r = run_ctr(args, ctr, fig["flops_per_token"])
        if "error" in ctr_r:
            ctr_note = f"libctr run failed ({ctr}): {ctr_r['error']}"

    print_table(args, fig, peak, torch_r, ctr_r, ctr_note)

    if args.json:
        doc = {"preset": "moe", "config": vars(args), "model": fig, "sgemm": peak,
               "pytorch": torch_r, "libctr": ctr_r if ctr_r and "error" not in ctr_r else None,
               "libctr_note": ctr_note}
        text = json.dumps(doc, indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if (ctr_r is None or "error" not in ctr_r) else 1


if __name__ == "__main__":
    sys.exit(main())
