#!/usr/bin/python3
"""N ranks train like one: the gpt and llama presets on 1 rank and on fsdp=2,
fsdp=4 and dp=2 x fsdp=2 (and fsdp=2 with every or no parameter resharded after
forward, and with micro-batches) with the same global batch give the same per-step
losses within 1e-5 relative and the same final weights. So do tensor-parallel meshes
made from the same single-device graphs: tp=2, fsdp=2 x tp=2, dp=2 x tp=2, tp=2 with
micro-batches, and tp=4, each also with sequence parallelism, and the heads split over a
vocabulary of 61 words that tp does not divide (gpt's tied to its embedding; gpt; llama's 2 kv heads do not split over 4 ranks, which is
refused naming the node and the numbers). So does the moe
preset (4 experts, top-2) with its experts
split over ep: ep=2, ep=4, ep=2 x fsdp=2, dp=2 x ep=2, dp=2, fsdp=2, and tp=2 and ep=2 x tp=2
(also with sequence parallelism), whose attention is split over tp, and cp=2, ep=2 x cp=2
and cp=2 with Ulysses, whose sequences are split (the
load-balancing loss is computed over the global batch on every mesh). Context
parallelism splits the sequences of the same graphs: cp=2, cp=4 (gpt), fsdp=2 x cp=2
and tp=2 x cp=2 (llama also with sequence parallelism), each rank holding two mirrored
chunks of every sequence; with cp_mode=ulysses (heads exchanged all-to-all) on gpt cp=2,
cp=4, tp=2 x cp=2 and llama cp=2, fsdp=2 x cp=2 with micro-batches (llama's 2 kv heads on
cp=4 are refused), and with cp_mode=ring (keys and values passed around the ranks, attention
in blocks merged by log-sum-exp) on cp=2, cp=4, tp=2 x cp=2; its planned activations fall
against one rank's, and a
sequence length 2*cp does not divide is refused. In bf16 on the
CPU, gpt on fsdp=2 matches one rank within 2e-4 relative, and tp=2 (also with sp and a
vocabulary of 61 words), cp=2 in each mode, tp=2 x cp=2 (gpt) and llama's tp=2 with sp and
tp=2 x cp=2 on the ring within 3e-4, and so do moe's ep=2, ep=2 x fsdp=2, ep=2 x tp=2 and
cp=2, each planning less activation memory than in fp32.

usage: test_equivalence.py CTR EQUIV_TRAIN
"""
import os
import subprocess
import sys
import tempfile

CTR, PROG = sys.argv[1], sys.argv[2]
STEPS, BATCH = 20, 8
TIME_LIMIT = 240  # seconds per launched job; a hang fails the test instead of blocking CI
SP = "sequence_parallel=1"
ULYSSES = "cp_mode=ulysses"
RING = "cp_mode=ring"


def run(preset, nprocs, mesh, out, reshard=1, micro=1, extra=None):
    cmd = [CTR, "launch", "-n", str(nprocs), "--", PROG, preset, mesh, str(BATCH), str(STEPS),
           out, str(reshard), str(micro)] + ([extra] if extra else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        return f"timed out after {TIME_LIMIT} s: {' '.join(cmd)}"
    if p.returncode != 0:
        return f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return None


def read(path):
    losses, param, memory = [], None, None
    for line in open(path):
        parts = line.split()
        if parts[0] == "param2":
            param2[path] = float(parts[1])
        elif parts[0] == "param":
            param = float(parts[1])
        elif parts[0] == "memory":
            memory = int(parts[1]) + int(parts[2])
            arena[path] = int(parts[3])
        else:
            losses.append(float(parts[0]))
    return losses, param, memory


# The second checksum (a row-parallel weight under tp), and the planned
# activation arena, by output file.
param2, arena = {}, {}


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_equiv_")
    failures = []
    for preset in ("gpt", "llama", "moe"):
        ref_path = os.path.join(tmp, f"{preset}_1.txt")
        err = run(preset, 1, "fsdp=1", ref_path)
        if err:
            failures.append(err)
            continue
        ref, ref_param, ref_mem = read(ref_path)
        if len(ref) != STEPS or not ref[-1] < ref[0]:
            failures.append(f"{preset}: reference run did not train: {ref}")
        cases = [(2, "fsdp=2", 1, 1), (4, "fsdp=4", 1, 1), (4, "dp=2,fsdp=2", 1, 1),
                 (2, "dp=2", 1, 1), (2, "fsdp=2", 0, 1), (2, "fsdp=2", 2, 1), (2, "fsdp=2", 1, 2),
                 # Tensor parallelism from the same single-device graph: heads
                 # and MLP features split (llama: 2 kv heads, so tp <= 2).
                 (2, "tp=2", 1, 1), (4, "fsdp=2,tp=2", 1, 1), (4, "dp=2,tp=2", 1, 1), (2, "tp=2", 1, 2),
                 # Sequence parallelism: norms and residuals split by tokens
                 # between the regions.
                 (2, "tp=2", 1, 1, SP), (4, "fsdp=2,tp=2", 1, 1, SP), (2, "tp=2", 1, 2, SP),
                 # Context parallelism: sequences split in mirrored chunks,
                 # keys and values gathered over cp.
                 (2, "cp=2", 1, 1), (4, "fsdp=2,cp=2", 1, 1), (4, "tp=2,cp=2", 1, 1),
                 # ... or heads exchanged for positions all-to-all (Ulysses), or keys
                 # and values passed around the ring, attention in blocks.
                 (2, "cp=2", 1, 1, ULYSSES), (2, "cp=2", 1, 1, RING), (4, "tp=2,cp=2", 1, 1, RING)]
        if preset == "gpt":
            cases += [(4, "tp=4", 1, 1), (4, "tp=4", 1, 1, SP), (4, "dp=2,tp=2", 1, 1, SP), (4, "cp=4", 1, 1),
                      (4, "cp=4", 1, 1, ULYSSES), (4, "tp=2,cp=2", 1, 1, ULYSSES), (4, "cp=4", 1, 1, RING)]
        if preset == "llama":
            cases += [(4, "tp=2,cp=2", 1, 1, SP), (4, "fsdp=2,cp=2", 1, 2, ULYSSES), (4, "cp=4", 1, 2, RING)]
        if preset == "moe":
            # The load-balancing loss is over each micro-batch of the global
            # batch, so micro-batches would change it: none here.
            cases = [(2, "ep=2", 1, 1), (4, "ep=4", 1, 1), (4, "ep=2,fsdp=2", 1, 1),
                     (4, "dp=2,ep=2", 1, 1), (2, "dp=2", 1, 1), (2, "fsdp=2", 1, 1),
                     # Attention split over tp, the experts whole on each tp rank.
                     (2, "tp=2", 1, 1), (4, "ep=2,tp=2", 1, 1), (4, "ep=2,tp=2", 1, 1, SP),
                     # Sequences split over cp: routing is per token, the statistics global.
                     (2, "cp=2", 1, 1), (4, "ep=2,cp=2", 1, 1), (2, "cp=2", 1, 1, ULYSSES),
                     (2, "cp=2", 1, 1, RING)]
        for n, mesh, reshard, micro, *more in cases:
            opts = more[0] if more else None
            label = f"{preset} {mesh} reshard={reshard} micro={micro}" + (f" {opts}" if opts else "")
            path = os.path.join(tmp, f"{preset}_{mesh}_{reshard}_{micro}{'_' + opts if opts else ''}.txt")
            err = run(preset, n, mesh, path, reshard, micro, extra=opts)
            if err:
                failures.append(f"{label}: {err}")
                continue
            got, param, mem = read(path)
            sizes = dict((k, int(v)) for k, v in (a.split("=") for a in mesh.split(",")))
            fsdp, ep, tp = sizes.get("fsdp", 1), sizes.get("ep", 1), sizes.get("tp", 1)
            # Parameters + optimizer state per rank shrink ~1/fsdp (padding and
            # 64-byte alignment of each shard add a little).
            # (With micro-batches a gradient accumulator joins Adam's m and v.)
            extra = 4 / 3 if micro > 1 else 1.0
            # moe: expert weights (most of this model) shrink ~1/(ep * fsdp), the rest ~1/fsdp.
            # tp: the attention and MLP weights (most of these models) shrink ~1/tp.
            # (moe: tp splits the attention only, the experts stay whole on every tp rank.)
            tp_share = (0.97 if preset == "moe" else 0.8) if tp > 1 else 1.0
            bound = ref_mem * extra / fsdp * 1.15 * (0.75 if ep > 1 else 1.0) * tp_share
            if mem is None or not mem <= bound:
                failures.append(f"{label}: rank 0 holds {mem} bytes of params+optimizer, "
                                f"one rank holds {ref_mem}; expected at most {bound:.0f}")
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if got else 1.0
            if len(got) != STEPS or worst > 1e-5:
                failures.append(f"{label}: losses differ from 1 rank by {worst:.2e} relative\n"
                                f"  1 rank: {ref[:5]}...\n  {mesh}: {got[:5]}...")
            if param is None or abs(param - ref_param) > 1e-4 * abs(ref_param):
                failures.append(f"{label}: final weights differ: {param} vs {ref_param}")
            p2, ref2 = param2.get(path), param2.get(ref_path)
            if ref2 is not None and (p2 is None or abs(p2 - ref2) > 1e-4 * abs(ref2)):
                failures.append(f"{label}: final MLP output weights differ: {p2} vs {ref2}")
            if mesh in ("cp=2", "cp=4") and opts is None and not arena[path] < 0.75 * arena[ref_path]:
                # Every activation holds 1/cp of the positions (attention's
                # probabilities 1/cp of the rows; gathered keys and values whole).
                failures.append(f"{label}: activation arena {arena[path]} bytes, not below 3/4 of one rank's "
                                f"{arena[ref_path]}")
            if opts == SP:
                # Norms, residuals and their saved statistics take 1/tp of the
                # tokens: the planned activations fall against tp alone.
                plain = os.path.join(tmp, f"{preset}_{mesh}_{reshard}_{micro}.txt")
                if plain in arena and not arena[path] < arena[plain]:
                    failures.append(f"{label}: activation arena {arena[path]} bytes, not below tp alone's "
                                    f"{arena[plain]}")
            print(f"{label}: max relative loss difference {worst:.2e}, "
                  f"weights {param:.9g} vs {ref_param:.9g}, params+optimizer {mem} of {ref_mem} bytes")
    # A vocabulary tp does not divide (61 words): the head is split over the words
    # (31 and 30 per rank on tp=2, 16 and 13 on tp=4) and the loss comes from every
    # rank's row statistics, never from whole logits; gpt's head shares its weight
    # with the embedding, which looks up each rank's words and sums over tp.
    for preset, meshes in [("llama", [(2, "tp=2", ""), (4, "fsdp=2,tp=2", SP)]),
                           ("gpt", [(2, "tp=2", ""), (4, "tp=4", SP), (4, "fsdp=2,tp=2", SP)])]:
        ref_path = os.path.join(tmp, f"{preset}_vocab61_1.txt")
        err = run(preset, 1, "fsdp=1", ref_path, extra="vocab=61")
        if err:
            failures.append(f"{preset} with 61 words: {err}")
            continue
        ref, ref_param, _ = read(ref_path)
        for n, mesh, opts in meshes:
            opts = "vocab=61" + ("," + opts if opts else "")
            path = os.path.join(tmp, f"{preset}_vocab61_{mesh}_{opts}.txt")
            err = run(preset, n, mesh, path, extra=opts)
            if err:
                failures.append(f"{preset} with 61 words {mesh}: {err}")
                continue
            got, param, _ = read(path)
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if got else 1.0
            if len(got) != STEPS or worst > 1e-5 or param is None or abs(param - ref_param) > 1e-4 * abs(ref_param):
                failures.append(f"{preset} with 61 words {mesh} {opts}: losses differ by {worst:.2e} relative, "
                                f"weights {param} vs {ref_param}")
            print(f"{preset} with 61 words, {mesh} {opts}: max relative loss difference {worst:.2e}, "
                  f"weights {param:.9g} vs {ref_param:.9g}")
    # Skewed routing: a zero router (and no learning, so it stays zero) sends every
    # token of every rank to expert 0 (top-1) or experts 0 and 1 (top-2), all on
    # ep rank 0. Nothing may be dropped: each mesh trains as one rank does.
    for k in (1, 2):
        extra = f"top_k={k},zero_router=1,lr=0"
        ref_path = os.path.join(tmp, f"skew{k}_1.txt")
        err = run("moe", 1, "fsdp=1", ref_path, extra=extra)
        if err:
            failures.append(f"skew top-{k}: {err}")
            continue
        ref, _, _ = read(ref_path)
        for n, mesh in [(2, "ep=2"), (4, "ep=4"), (4, "dp=2,ep=2")]:
            path = os.path.join(tmp, f"skew{k}_{mesh}.txt")
            err = run("moe", n, mesh, path, extra=extra)
            if err:
                failures.append(f"skew top-{k} {mesh}: {err}")
                continue
            got, _, _ = read(path)
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if got and ref else 1.0
            if len(got) != STEPS or worst > 1e-5:
                failures.append(f"skew top-{k} {mesh}: losses differ from 1 rank by {worst:.2e} relative")
            print(f"moe, every token to expert{'s 0, 1' if k == 2 else ' 0'}, {mesh}: "
                  f"max relative loss difference {worst:.2e}")
    # bf16 on the CPU: every mesh trains as one rank does within bf16's own noise.
    # Not bitwise: each rank multiplies part of the rows or features and sums
    # over ranks in another order, so f32 accumulators differ in their last bits
    # (as in fp32, which the 1e-5 above allows), and rounding activations to
    # bf16 can turn such a difference into one bf16 unit; under tp and cp the
    # activations summed over ranks (row-parallel outputs, their gradients) are
    # bf16 partial sums, rounded once more than on one rank. The bound (3e-4;
    # 2e-4 for fsdp, which sums f32 gradients only) is below nothing bf16 does
    # not do, so each run also plans a smaller activation arena than the same
    # mesh in fp32 (bf16 really ran).
    bf16_cases = [("gpt", 2, "fsdp=2", None, 2e-4), ("gpt", 2, "tp=2", None, 3e-4), ("gpt", 2, "tp=2", SP, 3e-4),
                  ("gpt", 2, "cp=2", None, 3e-4), ("gpt", 2, "cp=2", ULYSSES, 3e-4), ("gpt", 2, "cp=2", RING, 3e-4),
                  ("gpt", 4, "tp=2,cp=2", None, 3e-4), ("llama", 2, "tp=2", SP, 3e-4),
                  ("llama", 4, "tp=2,cp=2", RING, 3e-4), ("gpt", 2, "tp=2", "vocab=61", 3e-4),
                  # Expert rows exchanged in bf16, the load-balancing statistics
                  # summed over the world in f32.
                  ("moe", 2, "ep=2", None, 3e-4), ("moe", 4, "ep=2,fsdp=2", None, 3e-4),
                  ("moe", 4, "ep=2,tp=2", None, 3e-4), ("moe", 2, "cp=2", None, 3e-4)]
    refs = {}
    for preset, n, mesh, opts, bound in bf16_cases:
        label = f"{preset} bf16 {mesh}" + (f" {opts}" if opts else "")
        vocab = opts if opts and opts.startswith("vocab") else None
        key = (preset, vocab)
        if key not in refs:
            ref_path = os.path.join(tmp, f"{preset}_{vocab}_bf16_1.txt")
            refs[key] = (ref_path, run(preset, 1, "fsdp=1", ref_path,
                                       extra="precision=bf16" + (f",{vocab}" if vocab else "")))
        ref_path, err = refs[key]
        if err and "AVX512_BF16" in err:
            print(f"{label}: skipped, this CPU cannot run bf16 ({err.strip().splitlines()[-1]})")
            continue
        if err:
            failures.append(f"{preset} bf16 1 rank: {err}")
            continue
        ref, _, _ = read(ref_path)
        path = os.path.join(tmp, f"{preset}_{mesh}_{opts}_bf16.txt")
        err = run(preset, n, mesh, path, extra="precision=bf16" + (f",{opts}" if opts else ""))
        got, _, _ = read(path) if not err else ([], None, None)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref)) if got else 1.0
        if err or len(got) != STEPS or worst > bound or not ref[-1] < ref[0]:
            failures.append(f"{label}: {err or ''} losses differ from 1 rank by {worst:.2e} relative "
                            f"(bound {bound:.0e})\n  1 rank: {ref[:5]}...\n  {mesh}: {got[:5]}...")
            continue
        fp32 = os.path.join(tmp, f"{preset}_{mesh}_1_1{'_' + opts if opts and not vocab else ''}.txt")
        if vocab:
            fp32 = os.path.join(tmp, f"{preset}_vocab61_{mesh}_{vocab}.txt")
        if fp32 not in arena:
            failures.append(f"{label}: no fp32 run of the same mesh to compare its arena with ({fp32})")
        elif not arena[path] < arena[fp32]:
            failures.append(f"{label}: activation arena {arena[path]} bytes, not below the fp32 run's {arena[fp32]}")
        else:
            print(f"{label}: max relative loss difference {worst:.2e} (bound {bound:.0e}), "
                  f"arena {arena[path]} of fp32's {arena[fp32]} bytes")
    # Meshes the model cannot take are refused at step creation, naming why.
    for preset, n, mesh, want, *more in [
            ("llama", 4, "tp=4", "heads=2 is not divisible by 4 ranks"),
            ("gpt", 3, "cp=3", "sequence length 16 is not divisible by 6"),
            ("llama", 4, "cp=4", "heads=4 and kv_heads=2 on this rank, which cp=4 does not divide", ULYSSES)]:
        cmd = [CTR, "launch", "-n", str(n), "--", PROG, preset, mesh, str(BATCH), str(STEPS),
               os.path.join(tmp, f"refused_{preset}.txt"), "1", "1"] + more
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT)
        err = None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr}"
        if not err or want not in err or mesh.split("=")[0] not in err:
            failures.append(f"{preset} {mesh}: expected a refusal naming '{want}', got: {err}")
        else:
            print(f"{preset} {mesh}: refused ({want})")
    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("equivalence: all meshes match one rank")
    return 0


if __name__ == "__main__":
    sys.exit(main())
