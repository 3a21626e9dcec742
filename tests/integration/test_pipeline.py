"""Pipeline schedules through the ctr tool: `graph inspect --after schedule`
prints each stage's task order, configurations a schedule cannot run are refused
naming the numbers, and a one-stage step driven by its schedule trains alike for
every schedule that runs it (the same losses, bit for bit). Graphs cut into
pipeline stages (pp=2 and pp=4, each schedule, 1, stages and 2 x stages
micro-batches, and pp=2 with fsdp, dp and tp) train over 20 steps as the same
mesh without pp does: losses and final parameters within 1e-5; so do pp=2 and
pp=4 in bf16 against one rank in bf16, activations crossing in bf16.

usage: CTR=PATH_TO_CTR pytest test_pipeline.py
"""
import json
import os
import subprocess
import sys

import pytest


def run(ctr, *args, expect=0, timeout=120):
    p = subprocess.run([ctr, *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == expect, (f"`ctr {' '.join(args)}` exited {p.returncode}, expected {expect}\n"
                                    f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


@pytest.fixture(scope="module")
def graph(ctr, tmp_path_factory):
    g = str(tmp_path_factory.mktemp("pipeline") / "gpt.ctrg")
    run(ctr, "graph", "build", "--preset", "gpt", "--layers", "2", "--dim", "32", "--heads", "2",
        "--vocab", "128", "--seq", "16", "-o", g)
    return g


def stages(dump):
    return [line for line in dump.splitlines() if line.startswith("stage ")]


@pytest.mark.parametrize("schedule,micro,want", [
    ("gpipe", 1, ["stage 0: F0 B0 (1 in flight)", "stage 1: F0 B0 (1 in flight)"]),
    ("gpipe", 2, ["stage 0: F0 F1 B0 B1 (2 in flight)", "stage 1: F0 F1 B0 B1 (2 in flight)"]),
    ("1f1b", 2, ["stage 0: F0 F1 B0 B1 (2 in flight)", "stage 1: F0 B0 F1 B1 (1 in flight)"]),
    ("1f1b", 4, ["stage 0: F0 F1 B0 F2 B1 F3 B2 B3 (2 in flight)",
                 "stage 1: F0 B0 F1 B1 F2 B2 F3 B3 (1 in flight)"]),
    ("zb", 4, ["stage 0: F0 F1 B0 F2 W0 B1 F3 B2 W1 W2 B3 W3 (3 in flight)",
               "stage 1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3 (3 in flight)"]),
])
def test_inspect_prints_each_stage_order(ctr, graph, schedule, micro, want):
    out = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "2", "--micro-batches", str(micro),
              "--pp-schedule", schedule).stdout
    assert f"pipeline schedule {schedule}: 2 stage(s), {micro} micro-batch(es)" in out
    assert stages(out)[:2] == want
    bubble = {"gpipe": 1 / (micro + 1), "1f1b": 1 / (micro + 1), "zb": 1 / (3 * micro + 1)}[schedule]
    assert f"bubble {100 * bubble:.1f}% with tasks timed" in out, out[:600]


def test_interleaved_runs_each_rank_chunks_in_groups(ctr, graph):
    """Interleaved 1F1B with 2 chunks per rank on pp=2 (4 virtual stages, one
    block each): micro-batches go through in groups of two, chunk 0 then chunk
    1, after each rank's warm-up; its bubble is (p-1)/(v m + p-1) = 1/9 against
    1f1b's 1/5."""
    four = str(os.path.join(os.path.dirname(graph), "gpt4.ctrg"))
    run(ctr, "graph", "build", "--preset", "gpt", "--layers", "4", "--dim", "32", "--heads", "2", "--vocab", "128",
        "--seq", "16", "-o", four)
    out = run(ctr, "graph", "inspect", four, "--after", "schedule", "--pp", "2", "--micro-batches", "4",
              "--pp-schedule", "interleaved").stdout
    assert "pipeline schedule interleaved: 2 stage(s), 4 micro-batch(es), 2 virtual stages per rank" in out
    assert stages(out)[:2] == [
        "stage 0: F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0 (4 in flight)",
        "stage 1: F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0 (3 in flight)"]
    assert "virtual stage 2 (stage 0, chunk 1) holds blocks 2-2," in out
    assert "\nbubble 11.1% " in out, out
    one = run(ctr, "graph", "inspect", four, "--after", "schedule", "--pp", "2", "--micro-batches", "4").stdout
    assert "\nbubble 20.0% " in one, one
    cut = run(ctr, "graph", "inspect", four, "--after", "stages", "--pp", "2", "--rank", "1", "--micro-batches", "4",
              "--pp-schedule", "interleaved").stdout
    assert "this rank runs stage 1 of 2, 2 chunks (virtual stages 1, 3)" in cut, cut[:800]
    assert "receives 'layers.2.resid2' (#" in cut and "from stage 0 (chunk 1) (its gradient goes back)" in cut
    r = run(ctr, "graph", "inspect", four, "--after", "schedule", "--pp", "2", "--micro-batches", "2",
            "--pp-schedule", "interleaved", "--pp-stages", "2,2", expect=1)
    assert "option 'pp_stages': 2 entries for 4 virtual stages (2 per rank)" in r.stderr, r.stderr


@pytest.mark.parametrize("args,message", [
    (("--pp", "2", "--micro-batches", "3"),
     "interleaved runs micro-batches in groups of one per stage: 3 micro-batch(es) is not a multiple of 2 stages"),
    (("--pp", "1", "--micro-batches", "2"), "pipeline schedule interleaved needs at least 2 stages (pp), not 1"),
    (("--pp", "2", "--micro-batches", "2", "--pp-virtual", "1"),
     "needs at least 2 virtual stages per rank (option 'pp_virtual'), not 1"),
    (("--pp", "2", "--micro-batches", "2", "--pp-virtual", "2"),
     "pipeline: 4 virtual stages (2 per rank) need at least one block each, and graph 'gpt' has 2 block(s)"),
])
def test_interleaved_refusals_name_the_numbers(ctr, graph, args, message):
    r = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp-schedule", "interleaved", *args, expect=1)
    assert message in r.stderr, r.stderr


def test_virtual_stages_need_the_interleaved_schedule(ctr, graph):
    r = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "2", "--micro-batches", "2",
            "--pp-virtual", "2", expect=1)
    assert "option 'pp_virtual': 2 virtual stages per rank need pp_schedule interleaved" in r.stderr, r.stderr


def test_zero_bubble_splits_the_backward_of_a_stage(ctr, graph):
    """With zb, the last stage's backward is lowered as two phases: the nodes
    its input gradient needs, then the weight gradients; a norm weight's
    gradient written in the first goes through the micro-batch's own tensor."""
    out = run(ctr, "graph", "inspect", graph, "--after", "split_backward", "--pp", "2", "--rank", "1",
              "--pp-schedule", "zb", "--micro-batches", "2").stdout
    head = out.splitlines()[0]
    assert head.startswith("backward split: ") and "for the input gradients (B)" in head, head
    assert "-- backward: input gradients --" in out and "-- backward: weight gradients --" in out
    low = run(ctr, "graph", "inspect", graph, "--after", "lower", "--pp", "2", "--rank", "1", "--pp-schedule", "zb",
              "--micro-batches", "2").stdout
    assert "weight gradients: " in low and "linear_bwd_w" in low.split("weight gradients: ")[1]
    assert "linear_bwd_w" not in low.split("backward: ")[1].split("weight gradients: ")[0]
    plain = run(ctr, "graph", "inspect", graph, "--after", "split_backward", "--pp", "2", "--rank", "1",
                "--micro-batches", "2").stdout
    assert plain.startswith("backward not split")


def test_inspect_prints_each_stage_blocks(ctr, graph):
    out = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "2", "--micro-batches", "2",
              "--pp-stages", "1,1").stdout
    assert "stage 0 holds blocks 0-0 and what comes before them (embedding)," in out
    assert "stage 1 holds blocks 1-1 and what comes after them (head, loss)," in out
    r = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "2", "--micro-batches", "2",
            "--pp-stages", "1,2", expect=1)
    assert "the stages hold 3 blocks in all, and graph 'gpt' has 2" in r.stderr
    r = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "4", "--micro-batches", "4", expect=1)
    assert "4 stages need at least one block each, and graph 'gpt' has 2 block(s)" in r.stderr


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_refused(ctr, graph):
    r = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "4", "--micro-batches", "2", expect=1)
    assert "1f1b needs at least as many micro-batches as stages: 2 micro-batch(es) for 4 stages" in r.stderr


def test_gpipe_with_several_micro_batches_on_one_stage_holds_each(ctr, graph, tmp_path):
    """gpipe keeps every micro-batch in flight: each gets its own copy of the
    activations, and the step trains as 1f1b does, bit for bit."""
    args = ("--batch", "2", "--micro-batches", "2")
    assert losses(ctr, graph, tmp_path, "gpipe", *args, "--pp-schedule", "gpipe") == \
        losses(ctr, graph, tmp_path, "1f1b", *args)


def losses(ctr, graph, tmp_path, name, *args):
    metrics = str(tmp_path / f"{name}.jsonl")
    run(ctr, "run", graph, "--steps", "4", "--metrics", metrics, "--log-every", "100", *args)
    return [json.loads(line)["loss"] for line in open(metrics)]


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_one_stage_schedules_train_alike(ctr, graph, tmp_path, micro):
    """The same global batch, cut into 1, 2 or 4 micro-batches: the one-stage
    1f1b schedule (the default) and gpipe where it runs give the same losses
    bit for bit, and the cuts agree within 1e-5 relative."""
    batch = str(4 // micro)
    base = losses(ctr, graph, tmp_path, f"base{micro}", "--batch", batch, "--micro-batches", str(micro))
    named = losses(ctr, graph, tmp_path, f"1f1b{micro}", "--batch", batch, "--micro-batches", str(micro),
                   "--pp-schedule", "1f1b")
    assert base == named
    if micro == 1:
        assert losses(ctr, graph, tmp_path, "gpipe1", "--batch", batch, "--pp-schedule", "gpipe") == base
    whole = losses(ctr, graph, tmp_path, "whole", "--batch", "4")
    for a, b in zip(base, whole):
        assert abs(a - b) <= 1e-5 * abs(b), (base, whole)


def test_step_creation_on_two_ranks_refuses_without_hanging(ctr, graph):
    """The schedule's refusal comes at step creation on every rank."""
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", "pp=2", "--micro-batches", "1",
            "--steps", "1", "--batch", "2", expect=1, timeout=60)
    for rank in (0, 1):
        assert f"[{rank}] ctr: error: invalid option: pipeline schedule 1f1b needs at least as many " \
               "micro-batches as stages: 1 micro-batch(es) for 2 stages" in r.stdout + r.stderr


# ------------------------------------------------------------------------------------------
# Stages that run: each rank its stage's blocks, activations and gradients between them

STEPS = 20


def presets(ctr, tmp_path_factory, layers):
    """{preset: graph file} of gpt and llama of `layers` blocks."""
    out = {}
    for preset in ("gpt", "llama"):
        g = str(tmp_path_factory.mktemp(f"deep{layers}") / f"{preset}.ctrg")
        run(ctr, "graph", "build", "--preset", preset, "--layers", str(layers), "--dim", "32", "--heads", "2",
            "--seq", "16", "-o", g)
        out[preset] = g
    return out


@pytest.fixture(scope="module")
def deep(ctr, tmp_path_factory):
    """gpt (tied embedding: the first and the last stage read it) and llama of 4 blocks."""
    return presets(ctr, tmp_path_factory, 4)


def train(ctr, graph, out_dir, n, mesh, *args):
    """Losses and final parameters of STEPS steps of `ctr run` on n ranks."""
    np_ = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    os.makedirs(out_dir, exist_ok=True)
    metrics, params = os.path.join(out_dir, "m.jsonl"), os.path.join(out_dir, "p.safetensors")
    p = run(ctr, "launch", "-n", str(n), "--", ctr, "run", graph, "--mesh", mesh, "--steps", str(STEPS), "--seed",
            "7", "--batch", "2", "--log-every", "0", "--metrics", metrics, "--export-safetensors", params, *args,
            timeout=300)
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    assert len(losses) == STEPS, p.stdout[-2000:]
    return losses, {k: np_.asarray(v) for k, v in st.load_file(params).items()}


def assert_same(got, want, what):
    (lg, pg), (lw, pw) = got, want
    worst = max(abs(a - b) / abs(b) for a, b in zip(lg, lw))
    assert worst <= 1e-5, f"{what}: losses differ by {worst:.2e} relative\n{lg[:4]}\n{lw[:4]}"
    assert sorted(pg) == sorted(pw), f"{what}: parameters {sorted(pg)} vs {sorted(pw)}"
    for k in pw:
        err = float(abs(pg[k] - pw[k]).max())
        assert err <= 1e-5 * max(1.0, float(abs(pw[k]).max())), f"{what}: parameter {k} differs by {err:.2e}"
    assert lg[-1] < lg[0], f"{what}: the loss did not fall: {lg}"


@pytest.mark.parametrize("preset", ["gpt", "llama"])
def test_stages_train_as_one_rank(ctr, deep, tmp_path, preset):
    g = deep[preset]
    for micro in (1, 2, 4):
        want = train(ctr, g, str(tmp_path / f"one{micro}"), 1, "fsdp=1", "--micro-batches", str(micro))
        for schedule in ("gpipe", "1f1b", "zb"):
            if schedule == "1f1b" and micro < 2:
                continue
            got = train(ctr, g, str(tmp_path / f"pp2{schedule}{micro}"), 2, "pp=2", "--micro-batches", str(micro),
                        "--pp-schedule", schedule)
            assert_same(got, want, f"{preset} pp=2 {schedule} with {micro} micro-batch(es)")
        if micro == 4:
            for schedule in ("1f1b", "zb"):
                got = train(ctr, g, str(tmp_path / f"pp4{schedule}"), 4, "pp=4", "--micro-batches", "4",
                            "--pp-schedule", schedule)
                assert_same(got, want, f"{preset} pp=4 {schedule} with 4 micro-batches")


@pytest.fixture(scope="module")
def deep8(ctr, tmp_path_factory):
    """gpt and llama of 8 blocks: pp=4 with 2 chunks per rank."""
    return presets(ctr, tmp_path_factory, 8)


@pytest.mark.parametrize("preset", ["gpt", "llama"])
def test_interleaved_trains_as_one_rank(ctr, deep, deep8, tmp_path, preset):
    """Interleaved 1F1B, each rank running its chunks as separate tasks
    (activations going round the ranks twice, a tied embedding's gradient
    summed over the first and the last rank): pp=2 with 2 and 4 micro-batches
    (stages, 2 x stages), pp=4 with 2 chunks per rank and pp=2 with 4 train as
    one rank within 1e-5 in losses and final parameters."""
    for micro in (2, 4):
        want = train(ctr, deep[preset], str(tmp_path / f"one{micro}"), 1, "fsdp=1", "--micro-batches", str(micro))
        got = train(ctr, deep[preset], str(tmp_path / f"il{micro}"), 2, "pp=2", "--micro-batches", str(micro),
                    "--pp-schedule", "interleaved")
        assert_same(got, want, f"{preset} pp=2 interleaved with {micro} micro-batches")
    want = train(ctr, deep8[preset], str(tmp_path / "one8"), 1, "fsdp=1", "--micro-batches", "4")
    for n, chunks in ((4, 2), (2, 4)):
        got = train(ctr, deep8[preset], str(tmp_path / f"il{n}x{chunks}"), n, f"pp={n}", "--micro-batches", "4",
                    "--pp-schedule", "interleaved", "--pp-virtual", str(chunks))
        assert_same(got, want, f"{preset} pp={n} interleaved with {chunks} chunks per rank")


@pytest.mark.parametrize("preset,other", [("gpt", "fsdp=2"), ("llama", "tp=2"), ("gpt", "dp=2")])
def test_interleaved_composes_with_other_axes(ctr, deep, tmp_path, preset, other):
    """pp=2 interleaved beside fsdp (its prefetched gathers and deferred
    reduce-scatters run in the task they were moved into), tp or dp trains as
    that axis alone."""
    g = deep[preset]
    want = train(ctr, g, str(tmp_path / "alone"), 2, other, "--micro-batches", "4")
    got = train(ctr, g, str(tmp_path / "with_pp"), 4, "pp=2," + other, "--micro-batches", "4", "--pp-schedule",
                "interleaved")
    assert_same(got, want, f"{preset} pp=2,{other} interleaved")


def test_micro_batches_in_flight_share_what_lives_within_a_task(ctr, deep, tmp_path):
    """Under recompute a stage holds little from task to task: the plan keeps a
    copy per micro-batch in flight of that part only (the rest of the arena is
    shared), and gpipe and zb still train as one rank."""
    import re
    g = deep["gpt"]
    out = run(ctr, "graph", "inspect", g, "--after", "plan_memory", "--pp", "2", "--rank", "0", "--micro-batches",
              "4", "--pp-schedule", "gpipe", "--recompute", "all").stdout.splitlines()[0]
    m = re.search(r"arena (\d+) bytes .*; (\d+) bytes of it held from task to task, a copy per micro-batch in "
                  r"flight: (\d+) bytes for 4 in flight", out)
    assert m, out
    arena, held, total = (int(x) for x in m.groups())
    assert held < arena and total == 4 * held + (arena - held) and total < 4 * arena, out
    want = train(ctr, g, str(tmp_path / "one"), 1, "fsdp=1", "--micro-batches", "4", "--recompute", "all")
    for schedule in ("gpipe", "zb"):
        got = train(ctr, g, str(tmp_path / schedule), 2, "pp=2", "--micro-batches", "4", "--pp-schedule", schedule,
                    "--recompute", "all")
        assert_same(got, want, f"gpt pp=2 {schedule} with recompute all")


@pytest.mark.parametrize("preset,other,schedule", [("gpt", "fsdp=2", "1f1b"), ("llama", "tp=2", "1f1b"),
                                                   ("gpt", "dp=2", "1f1b"), ("llama", "fsdp=2", "zb"),
                                                   ("gpt", "tp=2", "zb")])
def test_stages_compose_with_other_axes(ctr, deep, tmp_path, preset, other, schedule):
    """pp=2 beside another axis trains as that axis alone does (which the
    equivalence test holds to one rank), zb's split backward too (its weight
    gradients' reduce-scatters and tp's reductions of input gradients)."""
    g = deep[preset]
    want = train(ctr, g, str(tmp_path / "alone"), 2, other, "--micro-batches", "2")
    got = train(ctr, g, str(tmp_path / "with_pp"), 4, "pp=2," + other, "--micro-batches", "2", "--pp-schedule",
                schedule)
    assert_same(got, want, f"{preset} pp=2,{other} {schedule}")


def test_stage_cut_refusals_name_what(ctr, deep, tmp_path):
    """A stage with no block is refused at step creation on every rank, without a hang."""
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", deep["gpt"], "--mesh", "pp=2", "--micro-batches", "2",
            "--steps", "1", "--batch", "2", "--pp-stages", "4,0", expect=1, timeout=60)
    assert "option 'pp_stages': stage 1 gets 0 blocks" in r.stdout + r.stderr


@pytest.mark.parametrize("preset", ["gpt", "llama"])
def test_stages_in_bf16_train_as_one_rank_in_bf16(ctr, deep, tmp_path, preset):
    """Under precision bf16 the activations and their gradients cross between
    stages in bf16 (the graph dump shows the received tensors so), and each
    stage computes what one rank does: the losses and parameters of pp=2 and
    pp=4 equal one rank's in bf16 within fp32's bound, and differ from fp32's."""
    g = deep[preset]
    r = subprocess.run([ctr, "run", g, "--steps", "1", "--batch", "2", "--precision", "bf16"], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0 and "AVX512_BF16" in r.stdout + r.stderr:
        pytest.skip(f"this CPU cannot run bf16: {r.stderr.strip()}")
    r = run(ctr, "graph", "inspect", g, "--after", "precision", "--pp", "2", "--micro-batches", "2", "--precision",
            "bf16")
    assert "input %" in r.stdout and ".grad_from_stage1:bf16[" in r.stdout, r.stdout[:2000]
    want = train(ctr, g, str(tmp_path / "one"), 1, "fsdp=1", "--micro-batches", "4", "--precision", "bf16")
    fp32 = train(ctr, g, str(tmp_path / "fp32"), 1, "fsdp=1", "--micro-batches", "4")
    worst = max(abs(a - b) / abs(b) for a, b in zip(want[0], fp32[0]))
    assert worst > 1e-5, f"{preset}: bf16 and fp32 losses agree within {worst:.2e}: bf16 did not run"
    for n, schedule in ((2, "1f1b"), (2, "zb"), (4, "1f1b"), (2, "interleaved")):
        got = train(ctr, g, str(tmp_path / f"pp{n}{schedule}"), n, f"pp={n}", "--micro-batches", "4",
                    "--pp-schedule", schedule, "--precision", "bf16")
        assert_same(got, want, f"{preset} pp={n} {schedule} in bf16")


KEEP_SCRIPT = """
import os, sys
import numpy as np
import ctr
mesh = ctr.Mesh.from_env(mesh=sys.argv[1])
graph = ctr.Graph.preset("gpt", layers=4, dim=32, heads=2, vocab=64, seq=16)
step = ctr.Step(mesh, graph, batch=2, micro_batches=2, seed=5, keep="logits,layers.0.ln1")
rng = np.random.default_rng(3)
tokens = rng.integers(0, 64, size=(4, 16), dtype=np.int32)
step.set_input("tokens", tokens)
step.set_input("targets", np.roll(tokens, -1, axis=1))
step.run()
for name, shape in (("logits", (2, 16, 64)), ("layers.0.ln1", (2, 16, 32))):
    try:
        out = step.get_output(name, shape=shape)
        np.save(os.path.join(sys.argv[2], f"{name}.{mesh.rank}.npy"), out)
        print(f"rank {mesh.rank}: {name} {out.shape}")
    except ctr.CtrError as e:
        print(f"rank {mesh.rank}: {name}: {e}")
"""


def test_kept_outputs_are_read_on_the_stage_that_computes_them(ctr, python_env, tmp_path):
    """Option keep on stages: a kept activation is read on the ranks of its
    stage (the logits on the last, the first block's norm on the first), equal
    to one rank's (the last micro-batch's); elsewhere it is refused naming the
    stage that computes it."""
    np_ = pytest.importorskip("numpy")
    script = tmp_path / "keep.py"
    script.write_text(KEEP_SCRIPT)
    env = python_env
    outs = {}
    for n, mesh in ((1, "fsdp=1"), (2, "pp=2")):
        d = tmp_path / mesh
        d.mkdir()
        p = subprocess.run([ctr, "launch", "-n", str(n), "--", sys.executable, str(script), mesh,
                            str(d)], capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        outs[mesh] = (d, p.stdout)
    one, _ = outs["fsdp=1"]
    two, text = outs["pp=2"]
    for name, rank in (("logits", 1), ("layers.0.ln1", 0)):
        want = np_.load(one / f"{name}.0.npy")
        got = np_.load(two / f"{name}.{rank}.npy")
        assert got.shape == want.shape and np_.array_equal(got, want), name
    assert "rank 0: logits: " in text and "is computed on pipeline stage 1, not this rank's stage 0" in text, text
    assert "rank 1: layers.0.ln1: " in text and "is computed on pipeline stage 0, not this rank's stage 1" in text, text


@pytest.mark.parametrize("other,schedule", [("", "1f1b"), ("", "zb"), ("ep=2", "1f1b"), ("ep=2", "zb"),
                                            ("ep=2", "interleaved")])
def test_experts_on_stages_train_as_without_stages(ctr, tmp_path, other, schedule):
    """moe on pp=2 (and pp=2 x ep=2) trains as one rank (as ep=2) does, within
    1e-5 in losses and final parameters, and reports the same expert metrics:
    each layer's tokens per expert and auxiliary losses, counted on its stage and
    summed over the stage's ranks (its load-balancing statistics too)."""
    g = str(tmp_path / "moe.ctrg")
    run(ctr, "graph", "build", "--preset", "moe", "--layers", "4", "--dim", "32", "--heads", "2", "--seq", "16",
        "--experts", "4", "--top-k", "2", "-o", g)
    n = 2 if other else 1
    want = train(ctr, g, str(tmp_path / "alone"), n, other or "fsdp=1", "--micro-batches", "4")
    got = train(ctr, g, str(tmp_path / "staged"), 2 * n, ",".join(filter(None, ["pp=2", other])), "--micro-batches",
                "4", "--pp-schedule", schedule)
    assert_same(got, want, f"moe pp=2 {other} {schedule}")

    def moe(d):
        return [json.loads(line)["moe"] for line in open(os.path.join(d, "m.jsonl"))]
    a, b = moe(str(tmp_path / "staged")), moe(str(tmp_path / "alone"))
    assert len(a[-1]) == 4 and all("aux_loss" in layer for layer in a[-1]), a[-1]
    for step_a, step_b in zip(a, b):
        for la, lb in zip(step_a, step_b):
            assert la["layer"] == lb["layer"] and la["tokens_per_expert"] == lb["tokens_per_expert"], (la, lb)
            assert abs(la["aux_loss"] - lb["aux_loss"]) <= 1e-6 * abs(lb["aux_loss"]), (la, lb)


def test_evaluation_on_stages_equals_one_rank(ctr, deep):
    """Held-out evaluation runs the forwards through the stages; every rank
    reports the last stage's loss, as one rank does."""
    args = ("run", deep["llama"], "--steps", "4", "--batch", "2", "--micro-batches", "2", "--eval-every", "2",
            "--eval-batches", "2", "--log-every", "1")
    one = [line for line in run(ctr, *args).stdout.splitlines() if line.startswith("eval ")]
    staged = [line[4:] for line in run(ctr, "launch", "-n", "2", "--", ctr, *args, "--mesh", "pp=2",
                                       timeout=120).stdout.splitlines() if line.startswith("[0] eval ")]
    assert len(one) == 2 and one == staged, (one, staged)


def test_a_hung_stage_is_named_with_the_task_waiting_for_it(ctr, deep):
    """Stage 1 hangs at step 2: stage 0 fails within the deadline, naming the
    rank, its own stage and task, and what it waited to receive."""
    env = dict(os.environ, CTR_FAULT_INJECT="hang_at_step:2:rank:1")
    p = subprocess.run([ctr, "launch", "-n", "2", "--", ctr, "run", deep["gpt"], "--mesh", "pp=2", "--steps", "3",
                        "--batch", "2", "--micro-batches", "2", "--timeout", "5", "--log-every", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    assert "timed out after 5.0 s waiting for rank 1" in out, out[-2000:]
    assert "stage 0 task B0: recv 'layers.1.resid2.grad_from_stage1' from stage 1" in out, out[-2000:]


def test_checkpoints_move_between_pipeline_meshes(ctr, deep, tmp_path):
    """Two steps on one rank, two on pp=2 x tp=2 resumed from its checkpoint, two on
    pp=4 (gpipe) resumed from theirs: the losses and final parameters of one
    uninterrupted run on one rank, within 1e-5. The pp=4 checkpoint loaded on
    pp=2 x fsdp=2 and on pp=2 interleaved gives back the same parameters, bit
    for bit."""
    np_ = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    g, ck = deep["gpt"], str(tmp_path / "ck")

    def part(tag, n, mesh, *extra):
        metrics, params = str(tmp_path / f"{tag}.jsonl"), str(tmp_path / f"{tag}.safetensors")
        run(ctr, "launch", "-n", str(n), "--", ctr, "run", g, "--mesh", mesh, "--steps", "6", "--seed", "7",
            "--batch", "2", "--micro-batches", "2", "--log-every", "0", "--metrics", metrics,
            "--export-safetensors", params, *extra, timeout=300)
        lines = [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []
        return {d["step"]: d["loss"] for d in lines}, st.load_file(params)

    whole, want = part("whole", 1, "fsdp=1")
    got = {}
    got.update(part("a", 1, "fsdp=1", "--save-dir", ck, "--save-every", "2", "--stop-after", "2")[0])
    got.update(part("b", 4, "pp=2,tp=2", "--save-dir", ck, "--save-every", "2", "--stop-after", "2", "--resume", "latest")[0])
    losses, params = part("c", 4, "pp=4", "--save-dir", ck, "--save-every", "2", "--resume", "latest", "--pp-schedule", "gpipe")
    got.update(losses)
    assert sorted(got) == list(range(1, 7)), got
    for step in whole:
        assert abs(got[step] - whole[step]) <= 1e-5 * abs(whole[step]), (step, got, whole)
    for k in want:
        assert float(np_.abs(params[k] - want[k]).max()) <= 1e-5 * max(1.0, float(np_.abs(want[k]).max())), k
    _, again = part("d", 4, "pp=2,fsdp=2", "--save-dir", ck, "--resume", "latest")
    assert all(np_.array_equal(again[k], params[k]) for k in params)
    # Interleaved: each rank holds other blocks (0 and 2 on stage 0), read from the same blocks.
    _, again = part("e", 2, "pp=2", "--save-dir", ck, "--resume", "latest", "--pp-schedule", "interleaved")
    assert all(np_.array_equal(again[k], params[k]) for k in params)


@pytest.mark.parametrize("schedule", ["1f1b", "zb", "interleaved"])
def test_trace_shows_each_rank_running_its_schedule(ctr, deep, tmp_path, schedule):
    """`ctr run --trace` writes every rank's tasks as Chrome trace events: each
    rank runs its stage's tasks in the schedule's order every step, a later stage
    starts a micro-batch's forward after the earlier stage started it (and the
    earlier stage its backward after the later one; a weight-gradient task after
    its own backward), and `ctr plot --timeline` draws one row per rank and
    measures the bubble, which the test reports beside the schedule's arithmetic
    (`inspect --after schedule`)."""
    trace, svg = str(tmp_path / "trace.json"), str(tmp_path / "timeline.svg")
    steps, micro = 3, 4
    run(ctr, "launch", "-n", "2", "--", ctr, "run", deep["gpt"], "--mesh", "pp=2", "--steps", str(steps), "--batch",
        "2", "--micro-batches", str(micro), "--log-every", "0", "--trace", trace, "--pp-schedule", schedule,
        timeout=120)
    events = json.load(open(trace))["traceEvents"]
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward", "weight")]
    dump = run(ctr, "graph", "inspect", deep["gpt"], "--after", "schedule", "--pp", "2", "--micro-batches",
               str(micro), "--pp-schedule", schedule).stdout
    order = stages(dump)
    for rank in (0, 1):
        want = order[rank].split(": ")[1].split(" (")[0].split()
        for step in range(1, steps + 1):
            got = [e["name"] for e in tasks if e["pid"] == rank and e["args"]["step"] == step]
            assert got == want, (rank, step, got, want)
    start = {(e["pid"], e["args"]["step"], e["name"]): e["ts"] for e in tasks}
    chunks = 2 if schedule == "interleaved" else 1

    def task(phase, mb, vs):  # (rank, name) of a task on virtual stage vs
        return (vs % 2, f"{phase}{mb}c{vs // 2}" if chunks > 1 else f"{phase}{mb}")
    for step in range(1, steps + 1):
        for mb in range(micro):
            for vs in range(2 * chunks - 1):
                (ra, fa), (rb, fb) = task("F", mb, vs), task("F", mb, vs + 1)
                assert start[(rb, step, fb)] >= start[(ra, step, fa)]
                (ra, ba), (rb, bb) = task("B", mb, vs), task("B", mb, vs + 1)
                assert start[(ra, step, ba)] >= start[(rb, step, bb)]
            if schedule == "zb":
                for rank in (0, 1):
                    assert start[(rank, step, f"W{mb}")] >= start[(rank, step, f"B{mb}")]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0 (stage 0)", "rank 1 (stage 1)"}, names
    p = run(ctr, "plot", "--timeline", trace, "-o", svg)
    text = open(svg).read()
    suffix = "c0" if chunks > 1 else ""
    assert "rank 0" in text and "rank 1" in text and f"<title>F0{suffix}: " in text and f"<title>B3{suffix}: " in text
    if schedule == "zb":
        assert "<title>W3: " in text
    bubble = float(p.stdout.split("bubble ")[1].split("%")[0]) / 100
    assert 0 <= bubble < 1, p.stdout
    arithmetic = float(dump.split("\nbubble ")[1].split("%")[0]) / 100
    print(f"{schedule}, 2 stages, {micro} micro-batches: measured bubble {bubble:.1%} "
          f"(the schedule's arithmetic {arithmetic:.1%}; tiny tasks on a shared 2-core machine)")
    r = run(ctr, "plot", "--timeline", str(tmp_path / "none.json"), "-o", svg, expect=1)
    assert "cannot open trace" in r.stderr
