#!/usr/bin/env python3
"""Training-step speed of libctr against PyTorch on the CPU, for the gpt and llama presets.

    .venv/bin/python3 tools/bench/bench_gpt.py                        # gpt, V=256 T=256 L=4 H=4 C=256 B=8
    .venv/bin/python3 tools/bench/bench_gpt.py --preset llama         # same sizes, --kv-heads 2
    .venv/bin/python3 tools/bench/bench_gpt.py --size small --precision bf16   # V=50257 T=128 L=6 H=6 C=384 B=4
    .venv/bin/python3 tools/bench/bench_gpt.py --torch-compile           # PyTorch under torch.compile
    .venv/bin/python3 tools/bench/bench_gpt.py --ctr build/tools/ctr --steps 20 --json out.json

One script measures both sides on the same configuration and prints one table:
  1. the OpenBLAS sgemm rate on this machine (tools/bench/sgemm_peak.c, compiled with cc into a
     temporary directory unless --sgemm-bin is given), with the same thread count, for reference;
  2. PyTorch: torch_models.py's model, forward + backward + AdamW step, --warmup steps untimed,
     then the median of --steps timed steps; with --precision bf16 the forward and backward run
     under torch.autocast("cpu", torch.bfloat16), PyTorch's own mixed precision; with
     --torch-compile the model is torch.compile'd first (its compile time is in the warm-up);
  3. libctr: `ctr graph build` then `ctr run --metrics` (with --precision), the first --warmup
     steps of the metrics file skipped and the median step_ms taken. Skipped, with a note, if the
     ctr binary is absent.

Both sides are charged the same model FLOPs per token, 6 * N + 12 * L * T * C, where N excludes
embedding tables used only as lookups (wpe, and wte/tok_embeddings when untied). Achieved
GFLOP/s is that times tokens/s, and the last row divides it by the peak of the precision in use
as libctr measures it once per process with a register-only loop (the fp32 FMA peak, or the bf16
dot-product/AMX peak; the `peak_flops` of ctr's metrics), the same denominator for both sides:
the MFU of each runtime. No step can beat that loop, so no figure passes 100%.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.dont_write_bytecode = True  # importing torch_models must not leave __pycache__ in the tree

# ------------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Training-step speed of libctr against PyTorch on the CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--preset", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--size", choices=("default", "small"), default="default",
                    help="small: V=50257 T=128 L=6 H=6 C=384 B=4 (GPT-2's vocabulary), "
                         "overriding --vocab/--seq/--layers/--heads/--dim/--batch")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: libctr --precision bf16, PyTorch under bf16 autocast")
    ap.add_argument("--torch-compile", action="store_true",
                    help="run PyTorch's model under torch.compile")
    ap.add_argument("--vocab", type=int, default=256, help="V")
    ap.add_argument("--seq", type=int, default=256, help="T")
    ap.add_argument("--layers", type=int, default=4, help="L")
    ap.add_argument("--heads", type=int, default=4, help="H")
    ap.add_argument("--kv-heads", type=int, default=2, help="llama only")
    ap.add_argument("--dim", type=int, default=256, help="C")
    ap.add_argument("--batch", type=int, default=8, help="B")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch.set_num_threads, and the sgemm peak's OpenBLAS threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "default"),
                    help="OMP_WAIT_POLICY for PyTorch; PASSIVE is its fastest setting on a "
                         "2-core machine (about 1.75x its default)")
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
    if args.size == "small":
        args.vocab, args.seq, args.layers, args.heads, args.dim, args.batch = 50257, 128, 6, 6, 384, 4
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    return args


def config_string(a: argparse.Namespace) -> str:
    s = f"V={a.vocab} T={a.seq} L={a.layers} H={a.heads}"
    if a.preset == "llama":
        s += f" Hkv={a.kv_heads}"
    return s + f" C={a.dim} B={a.batch}"


# ------------------------------------------------------------------------------------------------
# sgemm rate (reference)


def sgemm_peak(args: argparse.Namespace) -> dict:
    """Runs sgemm_peak (building it first if needed); its JSON line, or {"error": why}."""
    with tempfile.TemporaryDirectory(prefix="ctr-bench-sgemm-") as tmp:
        exe = args.sgemm_bin
        if exe is None:
            exe = os.path.join(tmp, "sgemm_peak")
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O2", "-o", exe, str(HERE / "sgemm_peak.c"), "-lopenblas"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                return {"error": f"{' '.join(cmd)} failed: {r.stderr.strip()[-400:]}"}
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads))
        r = subprocess.run([exe, "--threads", str(args.threads)], capture_output=True, text=True,
                           env=env)
        if r.returncode != 0:
            return {"error": f"{exe} exited {r.returncode}: {r.stderr.strip()[-400:]}"}
        try:
            return json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"error": f"{exe} printed no JSON line: {r.stdout[-200:]!r}"}


# ------------------------------------------------------------------------------------------------
# PyTorch


def run_torch(args: argparse.Namespace, model_flops: int) -> dict:
    import torch
    import torch_models

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = torch_models.build(args.preset, args.vocab, args.seq, args.layers, args.dim,
                               args.heads, args.kv_heads, seed=args.seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # Random bytes stand in for a corpus: the step's cost does not depend on the token values.
    g = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    run_model = torch.compile(model) if args.torch_compile else model

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if args.precision == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = run_model(tokens, targets)
        else:
            _, loss = run_model(tokens, targets)
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
    return summarize(times_ms, args, model_flops,
                     first_loss=losses[0], last_loss=losses[-1], threads=torch.get_num_threads(),
                     version=torch.__version__)


# ------------------------------------------------------------------------------------------------
# libctr through the ctr CLI


def find_ctr(path: str):
    p = Path(path)
    for cand in ([p] if p.is_absolute() else [Path.cwd() / p, REPO / p]):
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    found = shutil.which(path) if os.sep not in path else None
    return Path(found) if found else None


def run_ctr(args: argparse.Namespace, ctr: Path, model_flops: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ctr-bench-") as tmp:
        graph = os.path.join(tmp, f"{args.preset}.ctrg")
        metrics = os.path.join(tmp, "metrics.jsonl")
        build = [str(ctr), "graph", "build", "--preset", args.preset, "--layers", str(args.layers),
                 "--dim", str(args.dim), "--heads", str(args.heads)]
        if args.preset == "llama":
            build += ["--kv-heads", str(args.kv_heads)]
        build += ["--vocab", str(args.vocab), "--seq", str(args.seq), "-o", graph]
        run = [str(ctr), "run", graph, "--steps", str(args.warmup + args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq), "--lr", repr(args.lr),
               "--warmup", "0", "--metrics", metrics, "--precision", args.precision]
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads),
                   OMP_NUM_THREADS=str(args.threads), CTR_NUM_THREADS=str(args.threads))
        for cmd in (build, run):
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
             "peak_flops": timed[-1].get("peak_flops") or None,
             "steps_in_metrics": len(rows)}
    return summarize([float(r["step_ms"]) for r in timed], args, model_flops, **extra)


# ------------------------------------------------------------------------------------------------
# Figures and the table


def summarize(times_ms, args: argparse.Namespace, model_flops: int, **extra) -> dict:
    # tokens/s from the median step, for both sides, so the two rows are defined the same way.
    ms = statistics.median(times_ms)
    tokens_per_s = args.batch * args.seq / (ms / 1e3)
    out = {"step_ms": ms, "step_ms_min": min(times_ms), "step_ms_max": max(times_ms),
           "timed_steps": len(times_ms), "tokens_per_s": tokens_per_s,
           "gflops": model_flops * tokens_per_s / 1e9}
    out.update(extra)
    return out


def model_figures(args: argparse.Namespace) -> dict:
    import torch_models

    m = torch_models.build(args.preset, args.vocab, args.seq, args.layers, args.dim, args.heads,
                           args.kv_heads)
    counted = torch_models.counted_parameters(m)
    attn = 12 * args.layers * args.seq * args.dim
    return {"params": sum(p.numel() for p in m.parameters()), "counted_params": counted,
            "excluded": list(torch_models.lookup_only_parameters(m)),
            "attn_flops": attn, "flops_per_token": torch_models.flops_per_token(m)}


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(args, fig, peak, torch_r, ctr_r, ctr_note) -> None:
    sgemm_g = peak.get("sgemm_gflops")
    compiled = ", PyTorch under torch.compile" if args.torch_compile else ""
    print(f"preset {args.preset}  {config_string(args)}  {args.precision}  threads={args.threads}  "
          f"warm-up {args.warmup}, median of {args.steps} steps{compiled}")
    print(f"parameters {fig['params']:,}; counted for FLOPs N = {fig['counted_params']:,} "
          f"(excluding lookup-only {', '.join(fig['excluded']) or 'nothing'})")
    print(f"FLOPs/token = 6*N + 12*L*T*C = 6*{fig['counted_params']:,} + "
          f"12*{args.layers}*{args.seq}*{args.dim} = {fig['flops_per_token']:,}")
    if sgemm_g is not None:
        print(f"OpenBLAS sgemm (reference): {sgemm_g:.1f} GFLOP/s ({peak.get('threads')} threads, "
              f"best of {len(peak.get('shapes', []))} shapes)")
    else:
        print(f"OpenBLAS sgemm (reference): not measured ({peak.get('error')})")

    t = torch_r or {}
    c = ctr_r if ctr_r and "error" not in ctr_r else {}
    peak_f = c.get("peak_flops")
    peak_g = peak_f / 1e9 if peak_f else None
    kind = "bf16 (dot products / AMX tiles)" if args.precision == "bf16" else "fp32 FMA"
    if peak_g:
        print(f"{kind} peak: {peak_g:.1f} GFLOP/s ({args.threads} threads, register-only loop, "
              f"measured by libctr in its run)")
    else:
        print(f"{kind} peak: not known (libctr did not run or reported none); no MFU row")
    print()

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
        (f"MFU ({args.precision} peak)", frac(t), frac(c), None, ".1%"),
    ]
    print(f"{'':24s}{'pytorch':>14s}{'libctr':>14s}{'libctr/pytorch':>16s}")
    for name, a, b, r, spec in rows:
        print(f"{name:24s}{fmt(a, spec):>14s}{fmt(b, spec):>14s}{fmt(r, '.3f'):>16s}")
    print()

    if t:
        print(f"pytorch {t['version']}: fwd+bwd+AdamW, {t['threads']} threads, OMP_WAIT_POLICY={args.omp_wait_policy}; step ms min/max "
              f"{t['step_ms_min']:.1f}/{t['step_ms_max']:.1f}; loss {t['first_loss']:.4f} -> "
              f"{t['last_loss']:.4f}")
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
    peak = sgemm_peak(args)
    torch_r = None if args.skip_torch else run_torch(args, fig["flops_per_token"])

    ctr_r, ctr_note = None, None
    ctr = find_ctr(args.ctr)
    if ctr is None:
        ctr_note = f"libctr was not run: no ctr binary at {args.ctr} (build it, or pass --ctr PATH)"
    else:
        ctr_r = run_ctr(args, ctr, fig["flops_per_token"])
        if "error" in ctr_r:
            ctr_note = f"libctr run failed ({ctr}): {ctr_r['error']}"

    print_table(args, fig, peak, torch_r, ctr_r, ctr_note)

    if args.json:
        doc = {"preset": args.preset, "config": vars(args), "model": fig, "sgemm": peak,
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
