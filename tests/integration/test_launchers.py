"""The launchers users already run start libctr jobs for real: Open MPI's mpirun,
torchrun and Slurm's srun (on a one-node cluster this test starts: munged,
slurmctld and slurmd, configured in a temporary directory) each train the same
two-rank fsdp=2 job as `ctr launch -n 2`, and each must end with the same
per-step losses and the same parameters, bit for bit. A launcher that is not
installed, or a cluster whose daemons cannot start here, is a skip that says why.

usage: pytest test_launchers.py --ctr CTR   (or CTR=... in the environment)
"""
import getpass
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time

import pytest

CTR = os.path.abspath(os.environ.get("CTR", "build/tools/ctr"))
VENV_BIN = os.path.join(os.path.dirname(__file__), "..", "..", ".venv", "bin")
STEPS = 3
LIMIT_S = 120  # a hung job fails the test instead of blocking CI


def free_port():
    """A port P free now with P + 1 free too: under torchrun, torch's own store
    holds MASTER_PORT and libctr's rank 0 listens on the next one."""
    while True:
        with socket.socket() as s, socket.socket() as t:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


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


def run_args(graph, out_dir, steps=STEPS):
    """`ctr run GRAPH` on fsdp=2, writing its losses and final parameters under out_dir."""
    return [CTR, "run", graph, "--mesh", "fsdp=2", "--steps", str(steps), "--batch", "2", "--seed", "7",
            "--log-every", "0", "--timeout", "30", "--save-dir", os.path.join(out_dir, "ckpt"),
            "--metrics", os.path.join(out_dir, "metrics.jsonl"),
            "--export-safetensors", os.path.join(out_dir, "params.safetensors")]


def result(out_dir, steps=STEPS):
    """(per-step losses, digest of the final parameters) of the run in out_dir."""
    losses = [json.loads(line)["loss"] for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    assert len(losses) == steps
    with open(os.path.join(out_dir, "params.safetensors"), "rb") as f:
        return losses, hashlib.sha256(f.read()).hexdigest()


def train(prefix, graph, out_dir, env=None, steps=STEPS):
    os.makedirs(out_dir, exist_ok=True)
    p = subprocess.run(prefix + run_args(graph, out_dir, steps), capture_output=True, text=True,
                       timeout=LIMIT_S, env={**clean_env(), **(env or {})}, cwd=out_dir)
    assert p.returncode == 0, f"{' '.join(prefix)} exited {p.returncode}:\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"
    assert "x 2 ranks" in p.stdout, p.stdout[-1500:]
    return result(out_dir, steps)


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


# ------------------------------------------------------------------------------------------
# Slurm: a one-node cluster of local daemons

SLURM_CONF = """ClusterName=ctrtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
InactiveLimit=0
KillWait=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def stop_daemon(pid_file):
    try:
        pid = int(open(pid_file).read().split()[0])
        os.kill(pid, 15)
    except (OSError, ValueError, IndexError):
        pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """Starts munged, slurmctld and slurmd on free ports; yields the environment
    (SLURM_CONF) under which srun and sbatch reach them."""
    for prog in ("munged", "slurmctld", "slurmd", "srun"):
        if not shutil.which(prog) and not os.path.exists(f"/usr/sbin/{prog}"):
            pytest.skip(f"Slurm's {prog} is not installed (Debian: slurm-wlm, munge)")
    d = str(tmp_path_factory.mktemp("slurm"))
    os.chmod(d, 0o755)  # munged checks that its socket's directory is reachable
    os.makedirs(os.path.join(d, "state"))
    os.makedirs(os.path.join(d, "spool"))
    with open(os.path.join(d, "munge.key"), "wb") as f:
        f.write(os.urandom(128))
    os.chmod(os.path.join(d, "munge.key"), 0o600)
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(SLURM_CONF.format(host=socket.gethostname(), ctld_port=free_port(), d_port=free_port(),
                                  user=getpass.getuser(), dir=d, cpus=os.cpu_count()))
    env = {**clean_env(), "SLURM_CONF": conf}
    sbin = lambda p: shutil.which(p) or f"/usr/sbin/{p}"
    started = []
    try:
        for name, cmd in [
            ("munged", [sbin("munged"), "--force", "-S", f"{d}/munge.sock", f"--key-file={d}/munge.key",
                        f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]),
            ("slurmctld", [sbin("slurmctld"), "-f", conf, "-i"]),
            ("slurmd", [sbin("slurmd"), "-f", conf]),
        ]:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
            if p.returncode != 0:
                pytest.skip(f"{name} cannot start in this environment: {(p.stderr or p.stdout).strip()[-300:]}")
            started.append(f"{d}/{name}.pid")
        deadline = time.monotonic() + 30
        while True:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30, env=env)
            if p.returncode == 0 and p.stdout.strip() in ("idle", "mixed", "allocated"):
                break
            if time.monotonic() > deadline:
                logs = "".join(open(f"{d}/{n}.log").read()[-400:] for n in ("slurmctld", "slurmd")
                               if os.path.exists(f"{d}/{n}.log"))
                pytest.skip(f"the one-node Slurm cluster did not become ready: {p.stdout} {p.stderr} {logs}")
            time.sleep(0.2)
        yield env
    finally:
        for pid_file in reversed(started):
            stop_daemon(pid_file)


def test_srun_equals_ctr_launch(graph, reference, slurm, tmp_path):
    assert train(["srun", "-n", "2", "--time", "2"], graph, str(tmp_path), env=slurm) == reference


def slurm_logs(env):
    """The tails of the test cluster's daemon logs, for a failure's message."""
    d = os.path.dirname(env["SLURM_CONF"])
    return "".join(f"\n--- {n}.log\n" + open(f"{d}/{n}.log").read()[-3000:] for n in ("slurmctld", "slurmd")
                   if os.path.exists(f"{d}/{n}.log"))


def wait_for(what, cond, limit_s, detail=lambda: ""):
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {limit_s} s: {detail()}"
        time.sleep(0.2)


def test_sbatch_job_requeued_resumes_from_its_checkpoint(graph, slurm, tmp_path):
    """A batch job hangs after its checkpoint of step 4 (rank 1 blocks at step 5 on
    the first attempt only); `scontrol requeue` kills it and Slurm starts it again,
    and the same script resumes from that checkpoint and ends as an uninterrupted
    job does."""
    d = str(tmp_path / "job")
    os.makedirs(d)
    steps = 6
    args = " ".join(run_args(graph, d, steps))
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\n"
                      "export CTR_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}\n"
                      f"exec srun -n 2 {args} --save-every 2 --resume latest\n")
    out = str(tmp_path / "job.out")
    env = {**slurm, "CTR_FAULT_INJECT": "hang_at_step:5:rank:1"}
    p = subprocess.run(["sbatch", "--parsable", "--requeue", "-n", "2", "--time", "3", "-o", out,
                        "--open-mode=append", str(script)], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    text = lambda: open(out).read() if os.path.exists(out) else ""

    def state():
        q = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30,
                           env=slurm)
        return q.stdout.split("JobState=")[1].split()[0] if "JobState=" in q.stdout else q.stderr

    try:
        wait_for("the first attempt saves step 4", lambda: "ckpt/step_00000004" in text(), 60,
                 text)
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=30, env=slurm)
        # Slurm holds a requeued job back until the credentials of its first attempt
        # expire (cred_expire, 5 s on this cluster); starting it sooner is refused.
        wait_for("the job is requeued", lambda: state() == "PENDING", 30, state)
        wait_for("the requeued job completes", lambda: state() in ("COMPLETED", "FAILED", "CANCELLED"), 120,
                 lambda: f"{state()}: {text()[-1500:]}")
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, env=slurm)
    assert state() == "COMPLETED", text()[-1500:] + slurm_logs(slurm)
    assert "resum" in text(), text()[-1500:]
    want = train([CTR, "launch", "-n", "2", "--"], graph, str(tmp_path / "whole"), steps=steps)
    assert result(d, steps) == want
