"""The planner through `ctr plan` (the C ABI's ctr_plan): every layout of a
graph's step on a world of devices, compiled by the step's passes and priced
from a cluster profile. Checked here: the ranking is deterministic; the memory
each plan predicts is what step creation plans (rank 0's peak_bytes, byte for
byte); a plan the planner calls infeasible for memory is refused by step
creation under that memory, and a feasible one runs; meshes the model cannot
take are listed with the reason; bad profiles and options are named; a device
that computes in bf16 is planned in bf16 (memory as a bf16 step plans it); `ctr run
--mesh auto` runs the first feasible plan for the job's world, with the
predictions in its metrics, exactly as that plan given by hand. The
predicted step times beside the measured ones are in tools/bench/bench_plan.py.

usage: CTR=PATH_TO_CTR pytest test_plan.py
"""
import json
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = os.path.join(HERE, "..", "..", "profiles", "cpu-2core.json")


def run(ctr, *args, expect=0, timeout=120):
    p = subprocess.run([ctr, *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == expect, (f"`ctr {' '.join(args)}` exited {p.returncode}, expected {expect}\n"
                                    f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


@pytest.fixture(scope="module")
def graph(ctr, tmp_path_factory):
    g = str(tmp_path_factory.mktemp("plan") / "gpt.ctrg")
    run(ctr, "graph", "build", "--preset", "gpt", "--layers", "4", "--dim", "64", "--heads", "2", "--seq", "32",
        "-o", g)
    return g


def plan(ctr, graph, *args, world=2, batch=8, profile=PROFILE):
    out = run(ctr, "plan", graph, "--cluster", profile, "--world", str(world), "--global-batch", str(batch), "--json",
              *args).stdout
    return json.loads(out)


def test_the_ranking_is_deterministic_and_covers_every_axis(ctr, graph):
    a, b = plan(ctr, graph, "--no-prune"), plan(ctr, graph, "--no-prune")
    strip = [{k: v for k, v in p.items()} for p in a["plans"]]
    assert strip == b["plans"]
    meshes = {p["mesh"] for p in a["plans"]}
    assert {"fsdp=2", "dp=2", "tp=2", "cp=2", "pp=2"} <= meshes, meshes
    assert {p["schedule"] for p in a["plans"] if p["mesh"] == "pp=2"} == {"1f1b", "zb", "interleaved"}
    assert all(p["virtual_stages"] == 2 for p in a["plans"] if p.get("schedule") == "interleaved")
    assert {p["cp_mode"] for p in a["plans"] if p["mesh"] == "cp=2"} == {"gather", "ulysses", "ring"}
    assert a["candidates"] == len(a["plans"]) == a["compiled"]
    assert a["feasible"] == sum(p["feasible"] for p in a["plans"])
    steps = [p["step_ms"] for p in a["plans"] if p["feasible"]]
    assert steps == sorted(steps) and all(s > 0 for s in steps)
    for p in a["plans"]:
        assert 0 < p["mfu"] < 1 and p["memory_bytes"] > 0, p
    table = run(ctr, "plan", graph, "--cluster", PROFILE, "--world", "2", "--global-batch", "8", "--explain", "1").stdout
    assert "rank  mesh" in table and "plan 1: " in table, table


@pytest.mark.parametrize("mesh,schedule,micro,recompute,cp_mode", [
    ("single", "1f1b", 1, "none", "gather"), ("fsdp=2", "1f1b", 1, "all", "gather"),
    ("tp=2", "1f1b", 1, "none", "gather"), ("pp=2", "1f1b", 4, "all", "gather"), ("pp=2", "zb", 2, "none", "gather"),
    ("pp=2", "interleaved", 4, "none", "gather"), ("pp=2", "interleaved", 2, "all", "gather"),
    ("cp=2", "1f1b", 1, "none", "gather"), ("cp=2", "1f1b", 2, "all", "ulysses"), ("cp=2", "1f1b", 1, "none", "ring")])
def test_predicted_memory_is_what_step_creation_plans(ctr, graph, tmp_path, mesh, schedule, micro, recompute,
                                                      cp_mode):
    world = 1 if mesh == "single" else 2
    got = plan(ctr, graph, "--no-prune", world=world)
    [p] = [p for p in got["plans"] if (p["mesh"], p["schedule"], p["micro_batches"], p["recompute"],
                                       p.get("cp_mode", "gather")) == (mesh, schedule, micro, recompute, cp_mode)]
    metrics = str(tmp_path / "m.jsonl")
    args = ["run", graph, "--mesh", "fsdp=1" if mesh == "single" else mesh, "--steps", "1", "--batch", str(p["batch"]),
            "--micro-batches", str(micro), "--recompute", recompute, "--pp-schedule", schedule, "--log-every", "0",
            "--cp-mode", cp_mode, "--metrics", metrics]
    run(ctr, *(["launch", "-n", "2", "--", ctr] + args if world > 1 else args), timeout=120)
    peak = json.loads(open(metrics).readline())["peak_bytes"]  # rank 0's: stage 0's
    assert p["stages"][0]["memory_bytes"] == peak, (p, peak)
    assert p["memory_bytes"] == max(s["memory_bytes"] for s in p["stages"])


def test_a_plan_infeasible_for_memory_is_refused_by_step_creation(ctr, graph, tmp_path):
    everything = plan(ctr, graph, "--no-prune")["plans"]
    sizes = sorted({p["memory_bytes"] for p in everything})
    limit = (sizes[0] + sizes[-1]) // 2
    prof = json.load(open(PROFILE))
    prof["device"]["memory_bytes"] = limit
    small = str(tmp_path / "small.json")
    json.dump(prof, open(small, "w"))
    got = plan(ctr, graph, profile=small)["plans"]
    too_big = [p for p in got if not p["feasible"] and p.get("memory_bytes", 0) > limit]
    fits = [p for p in got if p["feasible"]]
    assert too_big and fits and all(p["memory_bytes"] <= limit for p in fits)
    assert "more than the" in too_big[0]["why"] and "GiB of one Xeon core" in too_big[0]["why"], too_big[0]
    for p, expect in ((too_big[0], 1), (fits[0], 0)):
        world = 1 if p["mesh"] == "single" else 2
        args = ["run", graph, "--mesh", "fsdp=1" if p["mesh"] == "single" else p["mesh"], "--steps", "1", "--batch",
                str(p["batch"]), "--micro-batches", str(p["micro_batches"]), "--recompute", p["recompute"],
                "--pp-schedule", p["schedule"], "--cp-mode", p.get("cp_mode", "gather"), "--log-every", "0",
                "--memory-limit", str(limit)]
        r = run(ctr, *(["launch", "-n", str(world), "--", ctr] + args if world > 1 else args), expect=expect,
                timeout=120)
        if expect:
            assert "more than the memory limit" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]


@pytest.mark.parametrize("world,batch,fraction", [(2, 8, None), (2, 8, 0.5), (4, 16, 0.3), (4, 16, 0.02)])
def test_pruning_keeps_every_plan_worth_listing(ctr, graph, tmp_path, world, batch, fraction):
    """The search refuses without compiling what the memory bounds rule out and,
    with one stage, more micro-batches than the fewest that fit. Against the
    exhaustive search on a device whose memory cuts through the candidates: the
    same candidates, the same plan first, every plan it prices priced alike,
    every refusal for memory a plan that does not fit, and every layout it
    prunes no faster than the one it names."""
    everything = plan(ctr, graph, "--no-prune", world=world, batch=batch)["plans"]
    sizes = sorted(p["memory_bytes"] for p in everything if "memory_bytes" in p)
    prof = json.load(open(PROFILE))
    if fraction is not None:  # a device whose memory only some layouts fit
        prof["device"]["memory_bytes"] = int(sizes[0] + (sizes[-1] - sizes[0]) * fraction)
    limit = prof["device"]["memory_bytes"]
    small = str(tmp_path / "small.json")
    json.dump(prof, open(small, "w"))
    full = plan(ctr, graph, "--no-prune", world=world, batch=batch, profile=small)
    pruned = plan(ctr, graph, world=world, batch=batch, profile=small)
    assert pruned["candidates"] == full["candidates"] == len(pruned["plans"])
    assert pruned["compiled"] < full["compiled"], (pruned["compiled"], full["compiled"])
    key = lambda p: (p["mesh"], p.get("schedule"), p.get("micro_batches"), p.get("recompute"), p.get("cp_mode"))
    whole = {key(p): p for p in full["plans"]}
    assert len(whole) == len(full["plans"])
    first = [p for p in full["plans"] if p["feasible"]][:1]
    assert [p for p in pruned["plans"] if p["feasible"]][:1] == first
    refused = stage_bound = 0
    for p in pruned["plans"]:
        q = whole[key(p)]
        if "memory_bytes" in p:
            assert p == q
        elif p.get("pruned") and "first stage alone" in p["why"]:
            # A pipeline group whose first stage is busy longer than the fastest
            # one-stage plan: the exhaustive search prices it no faster.
            bound = float(p["why"].split()[2])
            assert bound > first[0]["step_ms"], (p, first)
            assert not q["feasible"] or q["step_ms"] >= bound * (1 - 1e-9), (p, q)
            stage_bound += 1
        elif p.get("pruned"):
            named = int(p["why"].split("same layout with ")[1].split()[0])
            peer = whole[key({**p, "micro_batches": named})]
            assert peer["feasible"] and q["step_ms"] >= peer["step_ms"] * (1 - 1e-12), (p, q, peer)
        elif p["why"] == q.get("why"):
            assert not q["feasible"], (p, q)  # a layout the model cannot take, as its group's others
        else:
            # Refused for memory: the exhaustive search finds it too big, or
            # a layout the model cannot take at all.
            refused += 1
            assert not q["feasible"] and q.get("memory_bytes", limit + 1) > limit, (p, q)
            assert "more than the" in p["why"], p
    assert refused > 0 or fraction is None or fraction > 0.4
    assert any(p.get("pruned") for p in pruned["plans"]) or fraction < 0.1
    assert stage_bound > 0 or fraction is not None


def test_mesh_auto_runs_the_first_feasible_plan_as_the_same_plan_by_hand(ctr, graph, tmp_path):
    """`ctr run --mesh auto` plans for the job's world (2 ranks from the launcher),
    prints the plan it chose, runs it with the predictions in every metrics row, and
    trains exactly as the same layout given by hand."""
    first = next(p for p in plan(ctr, graph)["plans"] if p["feasible"])
    auto, hand = str(tmp_path / "auto.jsonl"), str(tmp_path / "hand.jsonl")
    common = ["--steps", "4", "--log-every", "0"]
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", "auto", "--cluster", PROFILE,
            "--global-batch", "8", "--metrics", auto, *common, timeout=120)
    assert f"plan: {first['mesh']}, {first['micro_batches']} micro-batch" in r.stdout, r.stdout
    assert "the fastest of" in r.stdout and "feasible layouts" in r.stdout, r.stdout
    got = [json.loads(line) for line in open(auto)]
    assert len(got) == 4
    for row in got:
        assert row["predicted_step_ms"] == pytest.approx(first["step_ms"], rel=1e-12), row
        assert row["predicted_memory_bytes"] == first["memory_bytes"] == row["peak_bytes"], (row, first)
    run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", first["mesh"], "--batch", str(first["batch"]),
        "--micro-batches", str(first["micro_batches"]), "--recompute", first["recompute"], "--pp-schedule",
        first["schedule"], "--cp-mode", first.get("cp_mode", "gather"), "--metrics", hand, *common, timeout=120)
    want = [json.loads(line) for line in open(hand)]
    assert [row["loss"] for row in got] == [row["loss"] for row in want]
    assert "predicted_step_ms" not in want[0]
    # What --mesh auto needs, and what only goes with it, are named.
    r = run(ctr, "run", graph, "--mesh", "auto", "--global-batch", "8", "--steps", "1", expect=1)
    assert "--mesh auto needs --cluster FILE" in r.stderr, r.stderr
    r = run(ctr, "run", graph, "--mesh", "auto", "--cluster", PROFILE, "--steps", "1", expect=1)
    assert "--mesh auto needs --global-batch N" in r.stderr, r.stderr
    r = run(ctr, "run", graph, "--global-batch", "8", "--steps", "1", expect=1)
    assert "go with --mesh auto" in r.stderr, r.stderr
    # Nothing feasible: the reasons of the first layouts.
    tiny = json.load(open(PROFILE))
    tiny["device"]["memory_bytes"] = 1000
    small = str(tmp_path / "tiny.json")
    json.dump(tiny, open(small, "w"))
    r = run(ctr, "run", graph, "--mesh", "auto", "--cluster", small, "--global-batch", "8", "--steps", "1", expect=1)
    assert "is feasible" in r.stderr and "more than the" in r.stderr, r.stderr


def bf16_profile(tmp_path):
    prof = json.load(open(PROFILE))
    prof["device"]["precision"] = "bf16"
    path = str(tmp_path / "bf16.json")
    json.dump(prof, open(path, "w"))
    return path


def test_a_bf16_device_is_planned_in_bf16(ctr, graph, tmp_path):
    """A profile whose device computes in bf16 (device.precision, as the H100 and
    H200 profiles say) has every candidate compiled in bf16: the plans need less
    memory than in fp32, the memory predicted is what a bf16 step creation plans,
    and `--mesh auto` runs the plan in bf16 (refusing an explicit fp32)."""
    probe = subprocess.run([ctr, "run", graph, "--steps", "1", "--batch", "2", "--precision", "bf16"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 and "AVX512_BF16" in probe.stdout + probe.stderr:
        pytest.skip(f"this CPU cannot run bf16: {probe.stderr.strip()}")
    prof = bf16_profile(tmp_path)
    half, whole = plan(ctr, graph, "--no-prune", profile=prof), plan(ctr, graph, "--no-prune")
    assert (half["precision"], whole["precision"]) == ("bf16", "fp32")
    by_key = {(p["mesh"], p["schedule"], p["micro_batches"], p["recompute"], p.get("cp_mode")): p
              for p in whole["plans"] if "memory_bytes" in p}
    # One micro-batch of 4 or 8 sequences: the activations outweigh the bf16
    # copies of the weights (which, in this small model, many micro-batches of
    # one sequence do not).
    pairs = [(p["memory_bytes"], by_key[k]["memory_bytes"], k) for p in half["plans"]
             if "memory_bytes" in p and p["micro_batches"] == 1
             for k in [(p["mesh"], p["schedule"], p["micro_batches"], p["recompute"], p.get("cp_mode"))] if k in by_key]
    assert len(pairs) >= 10 and all(a < b for a, b, _ in pairs), pairs
    for mesh in ("fsdp=2", "tp=2", "pp=2", "cp=2"):
        [p] = [p for p in half["plans"] if p["mesh"] == mesh and p["micro_batches"] == 2
               and p["recompute"] == "none" and p["schedule"] == "1f1b" and p.get("cp_mode", "gather") == "gather"]
        metrics = str(tmp_path / f"m_{mesh}.jsonl")
        run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", mesh, "--steps", "1", "--batch",
            str(p["batch"]), "--micro-batches", "2", "--precision", "bf16", "--log-every", "0", "--metrics", metrics,
            timeout=120)
        peak = json.loads(open(metrics).readline())["peak_bytes"]
        assert p["stages"][0]["memory_bytes"] == peak, (mesh, p, peak)
    first = next(p for p in plan(ctr, graph, profile=prof)["plans"] if p["feasible"])
    metrics = str(tmp_path / "auto.jsonl")
    r = run(ctr, "launch", "-n", "2", "--", ctr, "run", graph, "--mesh", "auto", "--cluster", prof, "--global-batch",
            "8", "--steps", "2", "--log-every", "0", "--metrics", metrics, timeout=120)
    assert ", bf16);" in r.stdout, r.stdout
    row = json.loads(open(metrics).readline())
    assert row["predicted_memory_bytes"] == first["memory_bytes"] == row["peak_bytes"], (row, first)
    r = run(ctr, "run", graph, "--mesh", "auto", "--cluster", prof, "--global-batch", "8", "--steps", "1",
            "--precision", "fp32", expect=1)
    assert "--precision fp32, but the cluster profile's device computes in bf16" in r.stderr, r.stderr


def test_a_flash_attention_device_is_planned_with_its_layout(ctr, graph, tmp_path):
    """device.attention "lse" (the CUDA backend's attention, which keeps each score
    row's log-sum-exp for backward, not the T x T probabilities): every plan of one
    micro-batch needs less memory than with the CPU's probabilities."""
    prof = json.load(open(PROFILE))
    prof["device"]["attention"] = "lse"
    path = str(tmp_path / "lse.json")
    json.dump(prof, open(path, "w"))
    lse, probs = plan(ctr, graph, "--no-prune", profile=path), plan(ctr, graph, "--no-prune")
    assert (lse["attention"], probs["attention"]) == ("lse", "probabilities")
    by_key = {(p["mesh"], p["schedule"], p["micro_batches"], p["recompute"], p.get("cp_mode")): p
              for p in probs["plans"] if "memory_bytes" in p}
    pairs = [(p["memory_bytes"], by_key[k]["memory_bytes"], k) for p in lse["plans"]
             if "memory_bytes" in p and p["micro_batches"] == 1 and p["mesh"] != "cp=2"
             for k in [(p["mesh"], p["schedule"], p["micro_batches"], p["recompute"], p.get("cp_mode"))] if k in by_key]
    assert len(pairs) >= 6 and all(a < b for a, b, _ in pairs), pairs
    prof["device"]["attention"] = "flash"
    json.dump(prof, open(path, "w"))
    r = run(ctr, "plan", graph, "--cluster", path, "--world", "2", "--global-batch", "8", expect=1)
    assert "device: field 'attention' must be \"probabilities\" or \"lse\", got \"flash\"" in r.stderr, r.stderr


def test_meshes_the_model_cannot_take_are_named(ctr, graph):
    got = plan(ctr, graph, world=3, batch=3)
    why = {p["mesh"]: p["why"] for p in got["plans"] if not p["feasible"]}
    assert "tp=3" in why and "3" in why["tp=3"], why
    assert any(p["feasible"] for p in got["plans"]), got["plans"]
    odd = plan(ctr, graph, world=2, batch=3)
    assert "the global batch of 3 does not split over 2 data ranks" in {p["mesh"]: p.get("why", "") for p in
                                                                        odd["plans"]}["fsdp=2"]


def test_bad_profiles_and_options_are_named(ctr, graph, tmp_path):
    bad = str(tmp_path / "bad.json")
    prof = json.load(open(PROFILE))
    del prof["device"]["flops"]
    json.dump(prof, open(bad, "w"))
    r = run(ctr, "plan", graph, "--cluster", bad, "--world", "2", "--global-batch", "8", expect=1)
    assert "device: field 'flops' (a number) is missing" in r.stderr, r.stderr
    open(bad, "w").write("{not json")
    r = run(ctr, "plan", graph, "--cluster", bad, "--world", "2", "--global-batch", "8", expect=1)
    assert "not JSON" in r.stderr, r.stderr
    r = run(ctr, "plan", graph, "--cluster", str(tmp_path / "none.json"), "--world", "2", "--global-batch", "8",
            expect=1)
    assert "none.json" in r.stderr, r.stderr
    r = run(ctr, "plan", graph, "--cluster", PROFILE, "--world", "2", "--global-batch", "8", "--recompute", "some",
            expect=1)
    assert "'some' is not a policy" in r.stderr, r.stderr
    prof = json.load(open(PROFILE))
    prof["device"]["precision"] = "fp8"
    json.dump(prof, open(bad, "w"))
    r = run(ctr, "plan", graph, "--cluster", bad, "--world", "2", "--global-batch", "8", expect=1)
    assert "device: field 'precision' must be \"fp32\" or \"bf16\", got \"fp8\"" in r.stderr, r.stderr


def test_calibrate_measures_the_kernels_into_a_profile_the_planner_reads(ctr, graph, tmp_path):
    out = str(tmp_path / "cal.json")
    p = subprocess.run([ctr, "calibrate", "--base", PROFILE, "-o", out, "--steps", "3"], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, CTR_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    prof = json.load(open(out))
    base = json.load(open(PROFILE))
    assert prof["links"] == base["links"] and prof["devices_per_host"] == base["devices_per_host"]
    for op in ("linear", "linear_bwd_x", "linear_bwd_w"):
        assert prof["ops"][op]["flops"] > 1e8, prof["ops"][op]
    assert any("bytes_per_s" in v for v in prof["ops"].values())
    assert prof["device"]["flops"] == prof["ops"]["linear"]["flops"]
    assert prof["sources"]["ops"].startswith("measured by ctr calibrate on ")
    assert "CTR_NUM_THREADS=1" in prof["sources"]["device.flops"]
    got = plan(ctr, graph, profile=out)
    assert got["feasible"] > 0 and got["sources"]["ops"] == prof["sources"]["ops"]
    r = run(ctr, "calibrate", "--base", str(tmp_path / "none.json"), "-o", out, expect=1)
    assert "cannot open the base profile" in r.stderr, r.stderr
