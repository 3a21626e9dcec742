"""What a host program does without the `ctr` tool, through the public C ABI (here by
the Python binding): host collectives over the mesh (the world and each axis's
group), the mesh described, a graph inspected after any pass, the passes listed,
a data file described; bad axes and roots named; a rank that leaves mid-job
failing its peers' collectives within the mesh deadline, naming it.

usage: CTR=PATH_TO_CTR pytest test_host_api.py
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def env(python_env):
    return python_env


COLLECTIVES = """
import json, sys
import numpy as np
import ctr
mesh = ctr.Mesh.from_env(mesh=sys.argv[1])
r = mesh.rank
out = {"describe": mesh.describe()}
for axis in ["world"] + [a["name"] for a in out["describe"]["axes"]]:
    me, n, members = mesh.group(axis)
    x = np.arange(4 * n, dtype=np.float32) + 100 * r
    out[axis] = {
        "group": [me, n, members],
        "sum": mesh.all_reduce(x, "sum", axis).tolist(),
        "max": mesh.all_reduce(np.array([r], dtype=np.int64), "max", axis).tolist(),
        "avg": mesh.all_reduce(np.array([float(r)]), "avg", axis).tolist(),
        "gather": mesh.all_gather(np.array([r, 2 * r], dtype=np.int32), axis).tolist(),
        "scatter": mesh.reduce_scatter(x, "sum", axis).tolist(),
        "bcast": mesh.broadcast(np.array([r, r], dtype=np.float64), n - 1, axis).tolist(),
    }
    mesh.barrier(axis)
for bad in (lambda: mesh.group("xp"), lambda: mesh.broadcast(np.zeros(2), 7, "world")):
    try:
        bad()
        out.setdefault("errors", []).append(None)
    except ctr.CtrError as e:
        out.setdefault("errors", []).append([e.status.name, str(e)])
print("RESULT " + json.dumps(out))
"""


def launch(ctr, env, tmp_path, n, script, *args, expect=0):
    path = tmp_path / "host.py"
    path.write_text(script)
    p = subprocess.run([ctr, "launch", "-n", str(n), "--", sys.executable, str(path), *args], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == expect, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def results(stdout):
    out = {}
    for line in stdout.splitlines():
        if "RESULT " in line:
            rank = int(line.split("]")[0].lstrip("[")) if line.startswith("[") else 0
            out[rank] = json.loads(line.split("RESULT ", 1)[1])
    return out


@pytest.mark.parametrize("n,mesh", [(1, "dp=1"), (2, "dp=2"), (4, "dp=2,tp=2")])
def test_host_collectives_over_the_world_and_each_axis(ctr, env, tmp_path, n, mesh):
    got = results(launch(ctr, env, tmp_path, n, COLLECTIVES, mesh).stdout)
    assert sorted(got) == list(range(n)), got.keys()
    for r, res in got.items():
        d = res["describe"]
        assert d["rank"] == r and d["world"] == n and d["transport"] == ("none" if n == 1 else d["transport"])
        assert {a["name"]: a["size"] for a in d["axes"]}.items() >= {k: int(v) for k, v in
                                                                     (x.split("=") for x in mesh.split(","))}.items()
        for axis in ["world"] + [a["name"] for a in d["axes"]]:
            me, size, members = res[axis]["group"]
            assert members[me] == r and len(members) == size and sorted(members) == sorted(set(members))
            assert size == (n if axis == "world" else dict((a["name"], a["size"]) for a in d["axes"])[axis])
            base = [float(i) for i in range(4 * size)]
            want_sum = [size * b + 100 * sum(members) for b in base]
            assert res[axis]["sum"] == want_sum, (axis, res[axis]["sum"], want_sum)
            assert res[axis]["max"] == [max(members)]
            assert res[axis]["avg"] == [sum(members) / size]
            assert res[axis]["gather"] == [[m, 2 * m] for m in members]
            assert res[axis]["scatter"] == want_sum[4 * me:4 * me + 4]
            assert res[axis]["bcast"] == [float(members[-1])] * 2
        bad_axis, bad_root = res["errors"]
        assert bad_axis[0] == "INVALID_ARGUMENT" and "no axis 'xp'" in bad_axis[1], bad_axis
        assert bad_root[0] == "INVALID_ARGUMENT" and "root 7 of a group of" in bad_root[1], bad_root


LEAVER = """
import sys, time
import numpy as np
import ctr
mesh = ctr.Mesh.from_env(mesh="dp=2", timeout=3)
mesh.all_reduce(np.ones(4, dtype=np.float32))
if mesh.rank == 1:
    sys.exit(0)  # leaves the job before the second collective
t0 = time.time()
try:
    mesh.all_reduce(np.ones(4, dtype=np.float32))
    print("RESULT no error")
except ctr.CtrError as e:
    print(f"RESULT {e.status.name} after {time.time() - t0:.1f} s: {e}")
"""


def test_a_rank_that_leaves_fails_its_peers_host_collective_naming_it(ctr, env, tmp_path):
    p = launch(ctr, env, tmp_path, 2, LEAVER)
    line = [x for x in p.stdout.splitlines() if "RESULT " in x]
    assert line, p.stdout[-2000:] + p.stderr[-2000:]
    text = line[0].split("RESULT ", 1)[1]
    status, _, rest = text.partition(" after ")
    assert status in ("COMM_ERROR", "TIMEOUT"), text
    assert float(rest.split(" s:")[0]) < 30, text
    assert "rank 1" in text, text


def test_inspect_pass_names_and_data_through_the_abi(ctr, env, tmp_path):
    data = tmp_path / "tokens.bin"
    subprocess.run([ctr, "data", "tokenize", os.path.join(ROOT, "README.md"), "-o", str(data), "--eot", "256"],
                   check=True, capture_output=True, timeout=60)
    script = """
import json, sys
import ctr
g = ctr.Graph.preset("gpt", layers=4, dim=32, heads=2, vocab=64, seq=16)
names = ctr.pass_names()
sched = g.inspect("schedule", pp=2, micro_batches=4, pp_schedule="interleaved")
try:
    g.inspect("nonesuch")
    bad = None
except ctr.CtrError as e:
    bad = [e.status.name, str(e)]
print("RESULT " + json.dumps({"names": names, "schedule": sched, "bad": bad,
                              "data": ctr.describe_data(sys.argv[1])}))
"""
    got = results(launch(ctr, env, tmp_path, 1, script, str(data)).stdout)[0]
    assert got["names"][:3] == ["load", "verify", "infer_shapes"] and "plan_memory" in got["names"], got["names"]
    assert "pipeline schedule interleaved: 2 stage(s), 4 micro-batch(es), 2 virtual stages per rank" in got["schedule"]
    cli = subprocess.run([ctr, "graph", "inspect", "--help"], capture_output=True, text=True).stdout
    assert all(name in cli for name in got["names"]), cli
    assert got["bad"][0] == "INVALID_ARGUMENT" and "nonesuch" in got["bad"][1], got["bad"]
    name, kind = got["data"]
    assert name.endswith("tokens.bin") and "llm.c" in kind, got["data"]
