"""The launchers users already run start libctr jobs for real: Open MPI's mpirun
and torchrun each train the same two-rank fsdp=2 job as `ctr launch -n 2`, and
each must end with the same per-step losses and the same parameters, bit for
bit. A launcher that is not installed is a skip that names it.

usage: pytest test_launchers.py --ctr CTR   (or CTR=... in the environment)
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess

import pytest

CTR = os.path.abspath(os.environ.get("CTR", "build/tools/ctr/ctr"))
VENV_BIN = os.path.join(os.path.dirname(__file__), "..", "..", ".venv", "bin")
STEPS = 3
LIMIT_S = 120  # a hung job fails the test instead of blocking CI


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    """This process's environment less any launcher's variables, so each job sees
    only those of the launcher that starts it."""
    drop = ("OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    names |= {"CTR_" + n for n in names} | {"CTR_JOB_TOKEN"}
    return {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in names}


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("launchers") / "g.ctrg")
    subprocess.run([CTR, "graph", "build", "--preset", "gpt", "--layers", "1", "--dim", "32", "--heads", "2",
                    "--seq", "16", "-o", path], check=True, capture_output=True, timeout=60)
    return path


def train(prefix, graph, out_dir):
    """Runs PREFIX ctr run GRAPH on fsdp=2 and returns (losses, digest of the final
    parameters)."""
    os.makedirs(out_dir, exist_ok=True)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    params = os.path.join(out_dir, "params.safetensors")
    cmd = prefix + [CTR, "run", graph, "--mesh", "fsdp=2", "--steps", str(STEPS), "--batch", "2",
                    "--seed", "7", "--log-every", "0", "--timeout", "30", "--save-dir",
                    os.path.join(out_dir, "ckpt"), "--metrics", metrics, "--export-safetensors", params]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S, env=clean_env(), cwd=out_dir)
    assert p.returncode == 0, f"{' '.join(prefix)} exited {p.returncode}:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"
    assert "x 2 ranks" in p.stdout, p.stdout[-1500:]
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    assert len(losses) == STEPS
    with open(params, "rb") as f:
        return losses, hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def reference(graph, tmp_path_factory):
    return train([CTR, "launch", "-n", "2", "--"], graph, str(tmp_path_factory.mktemp("ctr_launch")))


def test_mpirun_equals_ctr_launch(graph, reference, tmp_path):
    mpirun = shutil.which("mpirun")
    if not mpirun:
        pytest.skip("Open MPI's mpirun is not installed (Debian: openmpi-bin)")
    prefix = [mpirun, "-n", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        prefix.append("--allow-run-as-root")
    assert train(prefix, graph, str(tmp_path)) == reference


def test_torchrun_equals_ctr_launch(graph, reference, tmp_path):
    torchrun = os.path.join(VENV_BIN, "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    if not torchrun:
        pytest.skip("torchrun is not installed (the test environment's PyTorch has it)")
    prefix = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(free_port()), "--no-python"]
    assert train(prefix, graph, str(tmp_path)) == reference


def test_incomplete_environment_names_the_variable(graph):
    env = dict(clean_env(), RANK="0")
    p = subprocess.run([CTR, "run", graph, "--mesh", "fsdp=2", "--steps", "1", "--batch", "2"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode != 0
    assert "torchrun environment is incomplete: WORLD_SIZE is not set" in p.stderr, p.stderr
