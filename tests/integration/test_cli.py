#!/usr/bin/python3
"""End-to-end checks of the ctr tool: build, inspect and train from the command
line, and clear failures (exit 1, one 'ctr: error:' line) for bad input.

usage: test_cli.py PATH_TO_CTR
"""
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

CTR = os.path.abspath(sys.argv[1])
failures = []


def run(*args, expect=0, timeout=300):
    p = subprocess.run([CTR, *args], capture_output=True, text=True, timeout=timeout)
    if p.returncode != expect:
        failures.append(f"`ctr {' '.join(args)}` exited {p.returncode}, expected {expect}\n"
                        f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


def check(cond, msg):
    if not cond:
        failures.append(msg)


def forward_list(dump, phase="forward"):
    """The forward (or backward) instruction list of a `--after lower` dump, as
    (stream, kind, op, name)."""
    out, on = [], False
    for line in dump.splitlines():
        if line.startswith(phase + ":"):
            on = True
            continue
        if on and re.match(r"^[a-z]", line):
            break
        if on:
            parts = line.split()
            if len(parts) >= 5 and parts[3] in ("kernel", "collective"):
                out.append((int(parts[2]), parts[3], parts[4], parts[5] if len(parts) > 5 else ""))
    return out


def arena_bytes(dump):
    m = re.search(r"memory plan: arena (\d+) bytes", dump)
    return int(m.group(1)) if m else None


def check_schedule(tmp):
    """On a 4-block model under fsdp=2, the default schedule issues block i+1's
    all-gathers before block i computes, collectives run on the comm stream and
    compute on stream 0; a reorder budget bounds the planned memory."""
    g4 = os.path.join(tmp, "four.ctrg")
    run("graph", "build", "--preset", "gpt", "--layers", "4", "--dim", "64", "--heads", "4",
        "--vocab", "256", "--seq", "32", "-o", g4)
    fwd = forward_list(run("graph", "inspect", g4, "--after", "lower", "--fsdp", "2").stdout)
    check(fwd, "no forward instructions in the lower dump")
    for stream, kind, _, _ in fwd:
        check((kind == "collective") == (stream == 1), f"{kind} on stream {stream}")
    def first(pred):
        return next((i for i, x in enumerate(fwd) if pred(x)), None)
    for i in range(3):
        gather = first(lambda x: x[1] == "collective" and x[2] == "all_gather"
                       and f"layers.{i + 1}." in x[3])
        compute = first(lambda x: x[1] == "kernel" and x[3].startswith(f"layers.{i}."))
        check(gather is not None and compute is not None and gather < compute,
              f"block {i + 1}'s all-gather (at {gather}) is not issued before block {i} "
              f"computes (at {compute})")
    # Bucketed by block (the default): one all-gather per segment in forward (embedding,
    # 4 blocks, head), the first block's in two parts (attention, then MLP: forward waits
    # only for the first), against one per parameter without buckets.
    gathers = sum(1 for x in fwd if x[1] == "collective")
    first_block = [x[3] for x in fwd if x[2] == "all_gather" and ".layers.0." in x[3]]
    check(len(first_block) == 2 and "ln1" in first_block[0] and "mlp" in first_block[1],
          f"the first block's gathers are {first_block}: expected an attention part, then an MLP part")
    unbucketed = forward_list(run("graph", "inspect", g4, "--after", "lower", "--fsdp", "2",
                                  "--bucket", "none").stdout)
    check(gathers == 7, f"{gathers} forward collectives with --bucket block, expected 7")
    check(sum(1 for x in unbucketed if x[1] == "collective") > 40,
          "--bucket none should leave one all-gather per parameter")
    # Backward reads the last block's parameters first: by default they stay gathered from
    # forward (no backward all-gather of layers.3), and past the last gathers a gradient's
    # reduce-scatter is issued before the next block computes (block 1's before block 0's).
    dump = run("graph", "inspect", g4, "--after", "lower", "--fsdp", "2").stdout
    bwd = forward_list(dump, "backward")
    check(bwd, "no backward instructions in the lower dump")
    bwd_gathers = [x[3] for x in bwd if x[2] == "all_gather"]
    check(not any("layers.3." in n for n in bwd_gathers) and any("layers.2." in n for n in bwd_gathers),
          f"backward gathers {bwd_gathers}: expected layers.2 but not layers.3")
    # Kernels of backward are named by op; the last one is the embedding's backward.
    rs1 = next((k for k, x in enumerate(bwd) if x[2] == "reduce_scatter" and "layers.1." in x[3]), None)
    # The last block's reduce-scatters come in two parts, the first (MLP) while its
    # attention's backward still computes.
    rs0 = [k for k, x in enumerate(bwd) if x[2] == "reduce_scatter" and ".layers.0." in x[3]]
    kernels = [k for k, x in enumerate(bwd) if x[1] == "kernel"]
    check(rs1 is not None and len(rs0) == 2 and rs1 < rs0[0]
          and sum(1 for k in kernels if rs1 < k < rs0[-1]) >= 10
          and sum(1 for k in kernels if rs0[0] < k < rs0[1]) >= 3,
          f"block 1's reduce-scatter (at {rs1}) and block 0's two (at {rs0}) are not spread over "
          f"block 0's backward")
    always = forward_list(run("graph", "inspect", g4, "--after", "lower", "--fsdp", "2",
                              "--reshard", "always").stdout, "backward")
    check(any(x[2] == "all_gather" and "layers.3." in x[3] for x in always),
          "--reshard always should gather layers.3 again in backward")
    # prefetch 0 keeps each gather right before its first reader.
    fwd0 = forward_list(run("graph", "inspect", g4, "--after", "lower", "--fsdp", "2",
                            "--prefetch", "0").stdout)
    for i in range(3):
        gather = next(k for k, x in enumerate(fwd0) if x[1] == "collective"
                      and f"layers.{i + 1}." in x[3])
        compute = next(k for k, x in enumerate(fwd0) if x[1] == "kernel"
                       and x[3].startswith(f"layers.{i}."))
        check(gather > compute, f"--prefetch 0 still gathers block {i + 1} before block {i}")
    base = arena_bytes(run("graph", "inspect", g4, "--after", "plan_memory", "--fsdp", "2",
                           "--prefetch", "0", "--no-defer-reduce").stdout)
    deep = arena_bytes(run("graph", "inspect", g4, "--after", "plan_memory", "--fsdp", "2",
                           "--prefetch", "3").stdout)
    budget = (base + deep) // 2
    bounded = arena_bytes(run("graph", "inspect", g4, "--after", "plan_memory", "--fsdp", "2",
                              "--prefetch", "3", "--memory-budget", str(budget)).stdout)
    check(None not in (base, deep, bounded), "plan_memory dump lacks the arena size")
    if None not in (base, deep, bounded):
        check(deep > base, f"prefetch 3 should hold more memory than none ({deep} vs {base})")
        check(bounded <= budget, f"with a budget of {budget} bytes the planned arena is {bounded}")
        # Recompute lowers the planned peak: selective below none, all below selective.
        peaks = [arena_bytes(run("graph", "inspect", g4, "--after", "plan_memory", "--batch", "4",
                                 "--recompute", mode).stdout) for mode in ("none", "selective", "all")]
        check(None not in peaks and peaks[0] > peaks[1] > peaks[2],
              f"recompute none/selective/all plan {peaks} bytes")
        chosen = run("graph", "inspect", g4, "--after", "reorder", "--fsdp", "2", "--prefetch", "3",
                     "--memory-budget", str(budget)).stdout.splitlines()[0]
        check(chosen.startswith("reorder: prefetch") and "budget" in chosen,
              f"reorder dump does not say what it chose: {chosen}")


def check_placements(tmp):
    """`inspect --after shard` prints each parameter's placement per mesh axis and
    its whole shape: uneven fsdp shards padded to equal blocks, expert weights
    split over ep and again over fsdp (ep outermost)."""
    g = os.path.join(tmp, "place.ctrg")
    run("graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "64", "--heads", "4",
        "--vocab", "250", "--seq", "32", "-o", g)
    dump = run("graph", "inspect", g, "--after", "shard", "--fsdp", "3", "--rank", "2").stdout
    wte = next((line for line in dump.splitlines() if " wte:" in line), "")
    check("wte:f32[84,64] placed fsdp:S(0) of [250,64]" in wte, f"uneven fsdp placement: {wte!r}")
    whole = run("graph", "inspect", g, "--after", "shard").stdout
    check(" placed " not in whole, "a one-rank step has placed tensors")
    m = os.path.join(tmp, "place_moe.ctrg")
    run("graph", "build", "--preset", "moe", "--layers", "1", "--dim", "64", "--heads", "4",
        "--experts", "4", "--vocab", "256", "--seq", "32", "-o", m)
    dump = run("graph", "inspect", m, "--after", "shard", "--fsdp", "2", "--ep", "2").stdout
    experts = [line for line in dump.splitlines() if "experts.w1:" in line]
    check(experts and all("placed ep:S(0), fsdp:S(0) of [4," in line for line in experts),
          f"expert weights over ep and fsdp: {experts}")
    # Experts under tp: the attention split, the experts split over ep only.
    tpm = run("graph", "inspect", m, "--after", "place", "--tp", "2", "--ep", "2").stdout
    check("mixture-of-experts layers run whole on every rank of the tp group" in tpm
          and "experts.w1:f32[2,256,64] placed ep:S(0) of [4,256,64]" in tpm
          and "wq.weight:f32[32,64] placed tp:S(0) of [64,64]" in tpm, f"moe on ep=2 x tp=2: {tpm[:3000]}")
    # Tensor parallelism: attention and MLP regions, Megatron's 4 all-reduces of
    # B*T*C floats per layer per micro-batch, the weights' blocks; sizes that do not
    # fit are refused naming the node and the numbers.
    tp = run("graph", "inspect", g, "--after", "place", "--tp", "2", "--batch", "2").stdout
    btc = 2 * 32 * 64 * 4
    check("2 tensor-parallel regions" in tp and f"per micro-batch: 4 all-reduces over tp, {4 * btc} bytes" in tp
          and tp.count(f"{btc} bytes forward (the row-parallel sum), {btc} bytes backward") == 2,
          f"tp regions and volumes: {tp[:800]}")
    check("layers.0.mlp.fc.weight:f32[128,64] placed tp:S(0) of [256,64]" in tp
          and "layers.0.mlp.proj.weight:f32[64,128] placed tp:S(1) of [64,256]" in tp
          and "heads=2" in tp, f"tp blocks: {tp[:1500]}")
    r = run("graph", "inspect", g, "--after", "place", "--tp", "3", expect=1)
    check("does not divide" in r.stderr and "tp=3" in r.stderr, f"tp=3 on 4 heads: {r.stderr}")
    # Sequence parallelism: the same bytes as all-gathers and reduce-scatters, the
    # norms on this rank's rows of the B*T tokens, a token count tp does not divide refused.
    sp = run("graph", "inspect", g, "--after", "place", "--tp", "2", "--batch", "2", "--rank", "1",
             "--sequence-parallel").stdout
    # (Two regions and the vocabulary-parallel head: 3 all-gathers, 2 reduce-scatters.)
    check(f"3 all-gathers and 2 reduce-scatters over tp at the regions' edges, of {5 * btc} bytes of whole "
          f"tensors forward and {5 * btc} backward" in sp and "layers.0.ln2:f32[32,64]" in sp
          and "ln_f:f32[32,64]" in sp and "slice(" in sp and "start=32" in sp,
          f"sequence parallel volumes and blocks: {sp[:3000]}")
    # Backward gathers each region's input again for the weight gradients (forward
    # keeps 1/tp of the rows), so sp plans less than tp alone.
    again = run("graph", "inspect", g, "--after", "recompute", "--tp", "2", "--batch", "2",
                "--sequence-parallel").stdout
    check(again.count(".sp_gathered.regather:f32[64,64] = all_gather(") == 3
          and "layers.0.ln1.tp.regather:f32[2,32,64] = reshape(" in again, f"sp gathers in backward: {again[:3000]}")
    arena = {}
    for label, extra in (("tp", []), ("sp", ["--sequence-parallel"])):
        planned = run("graph", "inspect", g, "--after", "plan_memory", "--tp", "2", "--batch", "2", *extra).stdout
        arena[label] = int(re.search(r"arena (\d+) bytes", planned).group(1))
    check(arena["sp"] < arena["tp"] - 2 * 64 * 64 * 4, f"planned arenas with and without sp: {arena}")
    r = run("graph", "inspect", g, "--after", "place", "--tp", "2", "--seq", "31", "--sequence-parallel",
            expect=1)
    check("31 tokens" in r.stderr and "tp=2" in r.stderr, f"sp with 31 tokens on tp=2: {r.stderr}")
    # A vocabulary tp does not divide is split unevenly: an untied head of 250 words
    # on tp=4 holds 63 words per rank (61 on the last), the loss from an all-gather
    # of 3 floats per row; gpt's head, tied to its embedding (above), is split with it.
    lm = os.path.join(tmp, "place_llama.ctrg")
    run("graph", "build", "--preset", "llama", "--layers", "1", "--dim", "64", "--heads", "4",
        "--kv-heads", "4", "--vocab", "250", "--seq", "32", "-o", lm)
    tp4 = run("graph", "inspect", lm, "--after", "place", "--tp", "4", "--rank", "3").stdout
    check("2 tensor-parallel regions" in tp4
          and "vocabulary-parallel head: logits over 250 words, 63 per rank (the last rank's 61 valid), loss "
          f"from an all-gather of 3 floats per row ({12 * 32 * 4} bytes per micro-batch)" in tp4
          and "output.weight:f32[63,64] placed tp:S(0) of [250,64]" in tp4
          and "offset=189" in tp4 and "valid=61" in tp4 and "logits:f32[1,32,63]" in tp4,
          f"llama on tp=4 with 250 words: {tp4[:3000]}")
    check("tied to embedding tok_emb: each rank looks up its words, an all-reduce over tp completes the rows "
          f"({btc} bytes forward)" in tp and "wte:f32[125,64] placed tp:S(0) of [250,64]" in tp
          and "vocab_embedding(" in tp, f"gpt's tied head on tp=2: {tp[:3000]}")
    # Context parallelism: 32 positions in 4 chunks of 8, rank 1 holding chunks 1
    # and 2 of tokens, targets and the position table; keys and values (B*T*C
    # floats each, whole) gathered over cp for the attention at global positions.
    cp = run("graph", "inspect", g, "--after", "place", "--cp", "2", "--batch", "2", "--rank", "1").stdout
    check("place: cp=2, sequences of 32 positions in 4 chunks of 8; this rank (cp index 1) holds chunks 1 and 2"
          in cp and f"1 attentions gather keys and values over cp ({2 * btc} bytes per micro-batch" in cp
          and "1 position tables at global positions" in cp
          and "tokens.cp_first:i32[2,8] = slice(%0) dim=1 end=16 start=8" in cp
          and "tok_emb:f32[2,16,64] = embedding(" in cp and "= cp_attention(" in cp
          and "cp_index=1 cp_ranks=2" in cp, f"cp=2 split: {cp[:3000]}")
    # Ulysses: q, k, v and the output exchanged all-to-all (half of each rank's
    # B*T/2*C floats leave it), the attention on every position of 2 of the 4 heads.
    uc = run("graph", "inspect", g, "--after", "place", "--cp", "2", "--batch", "2", "--rank", "1",
             "--cp-mode", "ulysses").stdout
    check(f"1 attentions exchange heads for positions all-to-all over cp (q, k, v in, the output back) "
          f"({4 * btc // 4} bytes per micro-batch sent to other ranks forward" in uc
          and uc.count("= all_to_all(") == 4 and "cp_index=-1 cp_ranks=2 heads=2 kv_heads=2" in uc
          and "layers.0.attn.q.cp_sequence:f32[2,32,32]" in uc, f"cp=2 ulysses: {uc[:3000]}")
    # Ring: k and v passed on 3 times each on cp=4, 4 blocks of attention merged 3 times;
    # compute waits for each shift alone (block 1 for the first shifts of k and v).
    ring = run("graph", "inspect", g, "--after", "place", "--cp", "4", "--batch", "2", "--rank", "1",
               "--cp-mode", "ring").stdout
    check(ring.count("= ring_shift(") == 6 and ring.count("= cp_attention_block(") == 4
          and ring.count("= attn_merge(") == 3 and "cp_index=1 cp_ranks=4 cp_source=0" in ring
          and "pass keys and values around the cp ring" in ring, f"cp=4 ring: {ring[:3000]}")
    # Backward passes the keys and values around the ring again (the copies named
    # .resend) rather than keeping every rank's blocks from forward: no backward
    # node reads a block forward received.
    rec = run("graph", "inspect", g, "--after", "recompute", "--cp", "4", "--batch", "2", "--rank", "1",
              "--cp-mode", "ring").stdout
    fwd_part, bwd_part = rec.split("-- backward --")
    received = set(re.findall(r"(%\d+) layers\.0\.attn\.[kv]\.cp_ring\d:", fwd_part))
    resent = re.findall(r"(%\d+) layers\.0\.attn\.[kv]\.cp_ring\d\.resend:\S+ = ring_shift\(", bwd_part)
    readers = [line for line in bwd_part.splitlines() if "= cp_attention_block_bwd(" in line]
    check(len(received) == 6 and len(resent) == 6 and len(readers) == 4
          and all(set(re.findall(r"%\d+", line.split("= ", 1)[1])).isdisjoint(received) for line in readers)
          and sum(len(set(re.findall(r"%\d+", line.split("= ", 1)[1])) & set(resent)) for line in readers) == 6,
          f"ring keys re-sent in backward: {bwd_part[:3000]}")
    lowered = run("graph", "inspect", g, "--after", "lower", "--cp", "4", "--batch", "2", "--rank", "1",
                  "--cp-mode", "ring").stdout
    fwd = lowered.split("forward:")[1].split("backward:")[0].splitlines()
    block1 = next(i for i, line in enumerate(fwd) if "cp_attention_block layers.0.attn.out.cp_block1" in line)
    block2 = next(i for i, line in enumerate(fwd) if "cp_attention_block layers.0.attn.out.cp_block2" in line)
    check(sum("stream 0 wait" in line for line in fwd[block1 - 2:block1]) == 2
          and sum("stream 0 wait" in line for line in fwd[block2 - 3:block2]) == 2,
          f"waits before the ring's blocks: {fwd}")
    r = run("graph", "inspect", g, "--after", "place", "--cp", "8", "--cp-mode", "ulysses", expect=1)
    check("cp=8, cp_mode ulysses" in r.stderr and "heads=4 and kv_heads=4" in r.stderr
          and "cp_mode gather" in r.stderr, f"ulysses cp=8 on 4 heads: {r.stderr}")
    r = run("graph", "inspect", g, "--after", "place", "--cp", "3", expect=1)
    check("cp=3" in r.stderr and "sequence length 32 is not divisible by 6" in r.stderr,
          f"cp=3 on 32 positions: {r.stderr}")
    # bf16 under cp and tp: the collectives carry bf16 activations; the
    # vocabulary-parallel head's statistics stay f32.
    b = run("graph", "inspect", g, "--after", "precision", "--cp", "2", "--precision", "bf16").stdout
    check("layers.0.attn.k.cp_gathered_rows:bf16[" in b and "= cp_attention(" in b
          and "layers.0.attn.out:bf16[" in b, f"bf16 under cp: {b[:3000]}")
    # bf16 under fsdp, every weight gathered again for the backward: each shard
    # is cast at the phase's start and its bf16 copy gathered (half the bytes);
    # no whole f32 weight is gathered. (By default the last block's and the
    # head's, which the backward reuses, are gathered in f32.)
    b = run("graph", "inspect", g, "--after", "shard", "--fsdp", "2", "--precision", "bf16", "--reshard",
            "always").stdout
    check("layers.0.attn.wq.weight.bf16:bf16[64,64] = all_gather(" in b and ".full:f32" not in b
          and "layers.0.attn.wq.weight.bf16.shard:bf16[32,64] = cast(" in b, f"bf16 under fsdp: {b[:3000]}")
    b = run("graph", "inspect", g, "--after", "precision", "--tp", "2", "--precision", "bf16").stdout
    check("layers.0.attn.proj.sum:bf16[" in b and "logits.stats:f32[" in b and "loss.lse:f32[" in b,
          f"bf16 under tp: {b[:3000]}")
    # Experts under cp: routing, permutation and expert GEMMs on this rank's positions.
    mcp = run("graph", "inspect", m, "--after", "place", "--cp", "2", "--batch", "2").stdout
    check("layers.0.moe.permuted:f32[64,64]" in mcp and "layers.0.moe.slots:i32[2,16,2] = moe_permute(" in mcp
          and "layers.0.moe.combined:f32[2,16,64] = moe_unpermute(" in mcp, f"cp on the moe preset: {mcp[:3000]}")


def check_special_files(tmp, graph):
    """A FIFO where a graph, data file, manifest or checkpoint file should be is refused
    at once, naming it; it never blocks the process. A resume whose newest checkpoint has
    a FIFO for metadata falls back to the older one."""
    fifo = os.path.join(tmp, "pipe")
    os.mkfifo(fifo)
    r = run("graph", "inspect", fifo, expect=1, timeout=30)
    check("is a FIFO, not a regular file" in r.stderr, f"graph FIFO: {r.stderr[-300:]}")
    r = run("run", graph, "--data", fifo, "--steps", "1", expect=1, timeout=30)
    check("is a FIFO, not a regular file" in r.stderr, f"data FIFO: {r.stderr[-300:]}")
    manifest = os.path.join(tmp, "pipe.json")
    os.mkfifo(manifest)
    r = run("run", graph, "--data", manifest, "--steps", "1", expect=1, timeout=30)
    check("is a FIFO, not a regular file" in r.stderr, f"manifest FIFO: {r.stderr[-300:]}")
    ck = os.path.join(tmp, "ck_fifo")
    run("run", graph, "--steps", "4", "--batch", "2", "--save-every", "2", "--save-dir", ck,
        "--log-every", "0", timeout=120)
    newest = os.path.join(ck, "step_00000004", "meta.json")
    if os.path.exists(newest):
        os.remove(newest)
        os.mkfifo(newest)
    r = run("run", graph, "--steps", "6", "--batch", "2", "--save-dir", ck, "--resume", "latest",
            "--log-every", "0", timeout=120)
    check("resumed from" in r.stdout and "step_00000002" in r.stdout,
          f"resume past a FIFO meta.json: {r.stdout[-300:]} {r.stderr[-300:]}")
    check("not a regular file" in r.stderr, f"the skipped checkpoint is not explained: {r.stderr[-300:]}")


def check_exported_seq(tmp):
    """A graph whose length limit only its metadata knows (an exported model: a causal mask
    stored at max_seq = 8) trains with `ctr run` and no --seq: the default is max_seq."""
    here = os.path.dirname(os.path.abspath(__file__))
    graph = os.path.join(here, "..", "fuzz", "corpus", "graph", "zoo_nanogpt.ctrg")
    r = run("run", graph, "--steps", "2", "--batch", "2", "--log-every", "1")
    check("batch 2 x seq 8" in r.stdout, f"exported graph's default seq: {r.stdout[:300]}")
    r = run("run", graph, "--steps", "1", "--batch", "2", "--seq", "9", expect=1)
    check("ctr: error:" in r.stderr, f"seq beyond the mask: {r.stderr}")


def check_moe(tmp):
    """The moe preset: its options, its per-layer metrics, and the warning for an
    expert its router never picks."""
    graph = os.path.join(tmp, "moe.ctrg")
    r = run("graph", "build", "--preset", "moe", "--layers", "2", "--dim", "32", "--heads", "4",
            "--kv-heads", "2", "--vocab", "256", "--seq", "16", "--experts", "4", "--top-k", "2",
            "--ffn-dim", "32", "--shared-ffn-dim", "16", "-o", graph)
    check("moe preset" in r.stdout, f"moe build: {r.stdout}")
    r = run("graph", "build", "--preset", "gpt", "--experts", "4", "-o", graph + ".bad", expect=1)
    check("'experts' is for the moe preset" in r.stderr, f"moe option on gpt: {r.stderr}")
    r = run("graph", "build", "--preset", "moe", "--experts", "4", "--top-k", "5", "-o", graph + ".bad", expect=1)
    check("'top_k' (5) must be in 1..experts (4)" in r.stderr, f"top-k > experts: {r.stderr}")
    out = run("graph", "inspect", graph, "--after", "shard", "--ep", "2").stdout
    check("moe_dispatch" in out and "moe_combine" in out and "[2,32,32]" in out,
          "inspect --ep 2 lacks the exchanges or the split expert weights")

    # Metrics: tokens per expert per layer (top-2 of batch x seq tokens) and the
    # auxiliary losses.
    metrics = os.path.join(tmp, "moe.jsonl")
    weights = os.path.join(tmp, "moe.safetensors")
    run("run", graph, "--steps", "3", "--batch", "4", "--seq", "16", "--log-every", "0", "--metrics", metrics,
        "--export-safetensors", weights)
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    check(len(rows) == 3 and all(len(row.get("moe", [])) == 2 for row in rows),
          f"moe metrics: {rows[:1]}")
    for row in rows:
        for layer in row.get("moe", []):
            check(sum(layer["tokens_per_expert"]) == 4 * 16 * 2 and len(layer["tokens_per_expert"]) == 4,
                  f"tokens per expert of {layer['layer']}: {layer['tokens_per_expert']}")
            check(layer["aux_loss"] > 0 and layer["z_loss"] > 0, f"aux losses: {layer}")

    # A router of zeros ties every token and sends it to experts 0 and 1; with no
    # learning it stays so, and the tool warns about experts 2 and 3.
    if os.path.exists(weights):
        with open(weights, "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            for name, info in header.items():
                if name.endswith("router.weight"):
                    a, b = info["data_offsets"]
                    f.seek(8 + n + a)
                    f.write(bytes(b - a))
        r = run("run", graph, "--steps", "4", "--batch", "4", "--seq", "16", "--log-every", "0", "--lr", "0",
                "--init-safetensors", weights, "--idle-expert-steps", "3", "--metrics", metrics)
        rows = [json.loads(line) for line in open(metrics)]
        check(all(layer["tokens_per_expert"] == [64, 64, 0, 0] for row in rows for layer in row["moe"]),
              f"zero router: {[row['moe'] for row in rows][:1]}")
        for e in (2, 3):
            check(f"expert {e} of layers.0.moe has received no token for 3 steps" in r.stderr,
                  f"no warning for idle expert {e}: {r.stderr[-500:]}")
        check("expert 0 " not in r.stderr, f"warned about a busy expert: {r.stderr[-500:]}")


def main():
    tmp = tempfile.mkdtemp(prefix="ctr_cli_")
    graph = os.path.join(tmp, "tiny.ctrg")
    run("graph", "build", "--preset", "gpt", "--layers", "2", "--dim", "64", "--heads", "4",
        "--vocab", "256", "--seq", "32", "-o", graph)
    check(os.path.getsize(graph) > 100, "graph file not written")

    # Every registered pass prints; the list comes from the tool itself (the
    # error for an unknown pass names them all) and must match its help.
    r = run("graph", "inspect", graph, "--after", "nonsense", expect=2)
    help_text = run("graph", "inspect", "--help").stdout
    listed = re.search(r"Passes: ([a-z_, ]+)", " ".join(help_text.split()))
    check(listed is not None, f"inspect --help does not list the passes: {help_text}")
    passes = [p.strip() for p in listed.group(1).split(",")] if listed else []
    for p in ["load", "verify", "infer_shapes", "autodiff", "shard", "lower", "plan_memory"]:
        check(p in passes, f"pass {p} missing from the registered list {passes}")
    for p in passes:
        out = run("graph", "inspect", graph, "--after", p, "--batch", "2").stdout
        check(len(out) > 200, f"inspect --after {p} printed almost nothing")
        if p == "autodiff":
            check("-- backward --" in out and "linear_bwd_w" in out, "autodiff dump lacks backward nodes")
        if p == "plan_memory":
            check("memory plan: arena" in out, "plan_memory dump lacks the plan summary")
        if p == "lower":
            check("backward:" in out, "lower dump lacks the backward list")
    r = run("graph", "inspect", graph, "--after", "nonsense", expect=2)
    check("nonsense" in r.stderr and "autodiff" in r.stderr, f"bad pass name message: {r.stderr}")
    out = run("graph", "inspect", graph, "--after", "shard", "--fsdp", "2", "--dp", "2").stdout
    check("all_gather" in out and "reduce_scatter" in out and "all_reduce" in out,
          "shard dump lacks the collectives")
    check_schedule(tmp)
    check_placements(tmp)
    check_special_files(tmp, graph)

    # Train on a learnable byte text: a short sentence repeated.
    data = os.path.join(tmp, "text.txt")
    with open(data, "w") as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 400)
    metrics = os.path.join(tmp, "m.jsonl")
    r = run("run", graph, "--data", data, "--steps", "80", "--batch", "8", "--lr", "3e-3",
            "--warmup", "5", "--metrics", metrics, "--log-every", "20")
    check("step" in r.stdout and "tok/s" in r.stdout and "ETA" in r.stdout,
          f"no progress line in: {r.stdout[:500]}")
    rows = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
    check(len(rows) == 80, f"metrics has {len(rows)} rows, expected 80")
    if rows:
        for key in ["step", "loss", "grad_norm", "lr", "step_ms", "tokens_per_s", "peak_bytes",
                    "save_wait_ms", "compute_ms", "comm_ms", "exposed_comm_ms"]:
            check(key in rows[0], f"metrics lacks key {key}")
        # One rank: no collectives, and no communication in the progress line.
        check(all(0 < row["compute_ms"] <= row["step_ms"] and row["comm_ms"] >= 0
                  and row["exposed_comm_ms"] >= 0 for row in rows if "compute_ms" in row),
              f"step times out of range: {rows[0]}")
        check(" | comm " not in r.stdout and "| compute " in r.stdout,
              f"one-rank progress or summary: {r.stdout[-300:]}")
        check(rows[0]["loss"] > 4.0, f"initial loss {rows[0]['loss']} is not near log(256)")
        check(rows[-1]["loss"] < 1.0, f"loss did not fall below 1.0: {rows[-1]['loss']}")
        check(rows[0]["lr"] < rows[10]["lr"], "warm-up did not raise the learning rate")

    # The README's quick start relies on defaults: no --batch, no --data.
    r = run("run", graph, "--steps", "2", "--log-every", "1")
    check("batch 8 x seq 32" in r.stdout and "synthetic" in r.stdout, f"defaults changed: {r.stdout[:300]}")

    # Bad inputs: each is one clear error line and exit status 1.
    junk = os.path.join(tmp, "junk.ctrg")
    with open(junk, "wb") as f:
        f.write(b"\x00" * 3 + b"not a graph at all" * 10)
    r = run("run", junk, "--steps", "1", "--batch", "1", expect=1)
    check("ctr: error: invalid graph" in r.stderr and "identifier" in r.stderr,
          f"junk graph message: {r.stderr}")
    r = run("run", os.path.join(tmp, "missing.ctrg"), "--steps", "1", "--batch", "1", expect=1)
    check("missing.ctrg" in r.stderr, f"missing file message: {r.stderr}")
    r = run("graph", "build", "--preset", "bert", "-o", junk, expect=2)
    check("bert" in r.stderr, f"unknown preset message: {r.stderr}")
    r = run("graph", "build", "--preset", "gpt", "--dim", "10", "--heads", "4", "-o", junk, expect=1)
    check("multiple of 'heads'" in r.stderr, f"bad dims message: {r.stderr}")
    run("run", expect=2)  # usage error

    # An llm.c token file whose tokens exceed the model's vocabulary.
    tokfile = os.path.join(tmp, "big_vocab.bin")
    with open(tokfile, "wb") as f:
        header = [20240520, 1, 1000] + [0] * 253
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<1000H", *[(i * 37) % 1000 for i in range(1000)]))
    r = run("run", graph, "--data", tokfile, "--steps", "1", "--batch", "2", expect=1)
    check("ctr: error:" in r.stderr and ("vocab" in r.stderr or "range" in r.stderr),
          f"out-of-vocab message: {r.stderr}")
    # A truncated token file.
    with open(tokfile, "r+b") as f:
        f.truncate(256 * 4 + 100)
    r = run("run", graph, "--data", tokfile, "--steps", "1", "--batch", "2", expect=1)
    check("ctr: error: data error" in r.stderr and "big_vocab.bin" in r.stderr,
          f"truncated token file message: {r.stderr}")

    check_moe(tmp)
    check_exported_seq(tmp)

    if failures:
        print(f"{len(failures)} failure(s):")
        for f in failures:
            print(" -", f)
        return 1
    print("cli: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
