"""Pipeline schedules through the ctr tool: `graph inspect --after schedule`
prints each stage's task order, configurations a schedule cannot run are refused
naming the numbers, and a one-stage step driven by its schedule trains alike for
every schedule that runs it (the same losses, bit for bit).

usage: CTR=PATH_TO_CTR pytest test_pipeline.py
"""
import json
import os
import subprocess

import pytest


@pytest.fixture(scope="module")
def ctr():
    path = os.environ.get("CTR")
    if not path:
        pytest.skip("no ctr tool given (CTR)")
    return os.path.abspath(path)


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
])
def test_inspect_prints_each_stage_order(ctr, graph, schedule, micro, want):
    out = run(ctr, "graph", "inspect", graph, "--after", "schedule", "--pp", "2", "--micro-batches", str(micro),
              "--pp-schedule", schedule).stdout
    assert f"pipeline schedule {schedule}: 2 stage(s), {micro} micro-batch(es)" in out
    assert stages(out)[:2] == want


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


def test_gpipe_with_several_micro_batches_on_one_stage_is_refused(ctr, graph):
    r = run(ctr, "run", graph, "--steps", "1", "--batch", "2", "--micro-batches", "2", "--pp-schedule", "gpipe",
            expect=1)
    assert "(2 micro-batches, 1 stage(s))" in r.stderr
    assert "pipeline schedule gpipe keeps 2 micro-batches in flight on stage 0" in r.stderr


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
    """The schedule's refusal comes at step creation on every rank, and pp > 1
    (not cut into stages yet) is refused by the shard pass, naming the axis."""
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", "pp=2", "--micro-batches", "1",
            "--steps", "1", "--batch", "2", expect=1, timeout=60)
    for rank in (0, 1):
        assert f"[{rank}] ctr: error: invalid option: pipeline schedule 1f1b needs at least as many " \
               "micro-batches as stages: 1 micro-batch(es) for 2 stages" in r.stdout + r.stderr
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", "pp=2", "--micro-batches", "2",
            "--steps", "1", "--batch", "2", expect=1, timeout=60)
    assert "mesh axis 'pp' has size 2" in r.stdout + r.stderr
