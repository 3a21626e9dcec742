"""What a host program does without the `ctr` tool, through the public C ABI (here by
the Python binding): host collectives over the mesh (the world and each axis's
group), the mesh described, a graph inspected after any pass, the passes listed,
a data file described, token files written, read and counted in samples as the
loader reads them (a manifest's sub-datasets too); bad axes, roots, ids and
ranges named; a rank that leaves mid-job failing its peers' collectives within
the mesh deadline, naming it.

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


TOKENS = """
import json, os, sys
import numpy as np
import ctr
d = sys.argv[1]
ids = np.arange(1000, dtype=np.uint32) % 300
ctr.write_tokens(os.path.join(d, "a.bin"), ids, "llmc", 2)
ctr.write_tokens(os.path.join(d, "b.npy"), ids[:500], "npy", 4)
t = ctr.Tokens(os.path.join(d, "a.bin"))
out = {"info": t.info, "read": t.read(295, 10).tolist(), "windows": t.samples(16),
       "documents": t.samples(16, "documents", 299)}
json.dump({"datasets": [{"name": "x", "files": ["a.bin"], "weight": 3},
                                    {"name": "y", "files": ["b.npy"]}]}, open(os.path.join(d, "m.json"), "w"))
out["manifest"] = ctr.manifest_info(os.path.join(d, "m.json"))
out["y"] = ctr.Tokens(os.path.join(d, "m.json"), dataset=1).info
errors = []
for bad in (lambda: ctr.write_tokens(os.path.join(d, "c.bin"), [70000], "llmc", 2),
            lambda: ctr.Tokens(os.path.join(d, "m.json")),
            lambda: t.read(995, 10),
            lambda: ctr.Tokens(os.path.join(d, "a.bin")).samples(5000)):
    try:
        bad()
        errors.append(None)
    except ctr.CtrError as e:
        errors.append([e.status.name, str(e)])
out["errors"] = errors
out["leftover"] = sorted(f for f in os.listdir(d) if f.startswith("c.bin"))
print("RESULT " + json.dumps(out))
"""


def test_token_files_written_and_read_as_the_loader_reads_them(ctr, env, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    got = results(launch(ctr, env, tmp_path, 1, TOKENS, str(d)).stdout)[0]
    info = got["info"]
    assert info["tokens"] == 1000 and info["max_id"] == 299 and "llm.c" in info["kind"], info
    assert info["files"][0]["width"] == 2 and info["files"][0]["header_bytes"] == 1024, info
    assert got["read"] == [295, 296, 297, 298, 299, 0, 1, 2, 3, 4]
    assert got["windows"] == (1000 - 1) // 16, got["windows"]
    assert got["documents"] > 0
    m = got["manifest"]
    assert [x["name"] for x in m["datasets"]] == ["x", "y"] and m["datasets"][0]["weight"] == 3, m
    assert got["y"]["tokens"] == 500 and got["y"]["files"][0]["width"] == 4, got["y"]
    too_big, manifest, past_end, short = got["errors"]
    assert too_big[0] == "DATA_ERROR" and "70000" in too_big[1], too_big
    assert manifest[0] == "INVALID_ARGUMENT" and "option 'dataset'" in manifest[1], manifest
    assert past_end[0] == "INVALID_ARGUMENT" and "[995, 1005) of 1000" in past_end[1], past_end
    assert short[0] == "DATA_ERROR", short
    assert got["leftover"] == [], got["leftover"]  # the failed write left no file behind
    # The ctr tool reads the files the binding wrote.
    out = subprocess.run([ctr, "data", "inspect", str(d / "m.json"), "--seq", "16"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "dataset 1: y" in out.stdout and "tokens: 500" in out.stdout, out.stdout
