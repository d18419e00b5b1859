"""Slurm, real: a single-node cluster (examples/slurm/cluster.sh: munged, slurmctld, slurmd with 2 CPUs, 127.0.0.1)
runs the README's sbatch script, examples/slurm/train.sbatch, under Lightning's SLURMEnvironment.

The cluster is started once for this module and its three daemons are killed by PID at the end (with any job left).
Needs Debian's slurm-wlm and munge, and root (`.ci/run` installs them); skipped elsewhere, saying why.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ENGINES_ONE_AT_A_TIME, REPO

pytestmark = [pytest.mark.engines, ENGINES_ONE_AT_A_TIME]

SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
CLUSTER = REPO / "examples" / "slurm" / "cluster.sh"
# 2000 samples in global batches of 256: 8 steps an epoch; a checkpoint every 2 steps.
# A fixed split: the uninterrupted and the requeued job then make the same updates to the bit. (The automatic split
# follows measured times: on a noisy machine the two jobs' profiles, or a re-plan in one of them, chose different
# splits, and Adam carried the changed sum order to 1e-2 by step 240: 2 failures of the scontrol case, 2026-11-25
# with re-planning on, 2026-11-26 in a full suite with --no-rebalance, whose first plan still came from a profile.)
EXAMPLE_ARGS = ["--train-samples", "2000", "--every", "2", "--batch-sizes", "160", "96"]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free consecutive ports on 127.0.0.1")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [program for program in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(program) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's daemons run as root (examples/slurm/cluster.sh)")
    directory = tmp_path_factory.mktemp("slurm_cluster")
    env = {**os.environ, "SLURM_PORTS_BASE": str(_free_port_pair())}
    try:
        started = subprocess.run(
            [str(CLUSTER), "start", str(directory)], capture_output=True, text=True, env=env, timeout=60
        )
        assert started.returncode == 0, started.stdout + started.stderr
        yield {"SLURM_CONF": str(directory / "slurm.conf")}
    finally:
        conf = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
        subprocess.run(["scancel", "--full", "--user", "root"], env=conf, capture_output=True, timeout=30)
        subprocess.run([str(CLUSTER), "stop", str(directory)], timeout=30)


def slurm_run(slurm: dict, *command: str, timeout: float = 30) -> str:
    # The job's `python` is this one (sbatch passes the environment on).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, **slurm, "PYTHONWARNINGS": "ignore", "PATH": path}
    done = subprocess.run(list(command), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
    return done.stdout


def job_fields(slurm: dict, job: str) -> dict[str, str]:
    shown = slurm_run(slurm, "scontrol", "show", "job", job)
    return dict(re.findall(r"(\w+)=(\S*)", shown))


def submit(slurm: dict, root: Path, *args: str) -> tuple[str, Path]:
    log = root / "job.out"
    out = slurm_run(
        slurm, "sbatch", "--parsable", f"--output={log}", str(SBATCH), *EXAMPLE_ARGS, *args, "--root", str(root)
    )
    return out.strip().split(";")[0], log


def wait_for(condition, what: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s. Job log:\n{_tail(log)}")
        time.sleep(0.5)


def _tail(log: Path) -> str:
    return log.read_text()[-6000:] if log.exists() else "(no log)"


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    import lightning_hetero  # noqa: F401  (a checkpoint directory loads once the package is imported)
    from examples.spirals import SpiralClassifier

    model = SpiralClassifier.load_from_checkpoint(root / "checkpoints" / "last.ckpt")
    return {name: value.detach().clone() for name, value in model.named_parameters()}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """The sbatch script run to its end, never signalled: the weights a requeued job must end with."""
    root = tmp_path_factory.mktemp("uninterrupted")
    job, log = submit(slurm, root, "--epochs", "30")
    wait_for(lambda: job_fields(slurm, job)["JobState"] in ("COMPLETED", "FAILED"), "the job's end", 300, log)
    assert job_fields(slurm, job)["JobState"] == "COMPLETED", _tail(log)
    text = log.read_text()
    # Training ran under Lightning's SLURMEnvironment, one rank per task, with the heterogeneous plan.
    assert "SLURM auto-requeueing enabled" in text and "HeteroStrategy plan" in text, text[-3000:]
    assert "finished at step 240" in text, text[-3000:]
    return final_weights(root)


@pytest.mark.fault
@pytest.mark.parametrize("how", ["scontrol requeue", "SIGUSR1"])
def test_a_requeued_job_saves_is_requeued_and_resumes_exactly(how, slurm, uninterrupted, tmp_path):
    """`scontrol requeue` (Slurm's preemption: SIGTERM, then the job runs again) or SIGUSR1 (`--signal=USR1@...`,
    Lightning's auto-requeue signal: the job saves, requeues itself and exits) mid-fit: the job runs a second time
    from last.ckpt and ends with the weights of the uninterrupted job."""
    job, log = submit(slurm, tmp_path, "--epochs", "30")
    checkpoints = tmp_path / "checkpoints"
    wait_for(lambda: checkpoints.exists() and any(checkpoints.iterdir()), "the first checkpoint", 120, log)
    if how == "scontrol requeue":
        slurm_run(slurm, "scontrol", "requeue", job)
    else:
        slurm_run(slurm, "scancel", "--signal=USR1", job)  # to every task of the job's steps, as --signal does

    def requeued() -> bool:  # (REQUEUED and COMPLETING come first, while the first run's tasks end)
        fields = job_fields(slurm, job)
        return fields.get("Restarts") == "1" and fields["JobState"] in ("PENDING", "RUNNING", "COMPLETED")

    wait_for(requeued, "the requeue", 120, log)
    requeued_at = time.time()
    # Slurm holds a requeued job pending (Reason=BeginTime) for about two minutes; release it now, but only once the
    # first run has left the node and its revoked credential is in an earlier second than the new one's: slurmd
    # compares them to the second, and a launch in the same second as the requeue's kill was refused ("Killing
    # non-startable batch JobId=2: Job credential revoked" in slurmctld.log; the job then ended FAILED, 1 run in 6).
    wait_for(lambda: slurm_run(slurm, "sinfo", "-h", "-o", "%T").split() == ["idle"], "the node's release", 120, log)
    wait_for(lambda: time.time() - requeued_at > 2.0, "a later second", 10, log)
    if job_fields(slurm, job)["JobState"] == "PENDING":
        slurm_run(slurm, "scontrol", "update", f"jobid={job}", "StartTime=now")
    wait_for(lambda: job_fields(slurm, job)["JobState"] in ("COMPLETED", "FAILED"), "the second run's end", 400, log)
    text = log.read_text()
    assert job_fields(slurm, job)["JobState"] == "COMPLETED", text[-4000:]
    # The first run stopped at a step boundary and saved; the second resumed from that checkpoint.
    assert text.count("HeteroStrategy plan") == 2, text[-4000:]
    assert "finished at step 240" in text, text[-4000:]
    assert re.search(r"Restored all states from the checkpoint|Restoring states from the checkpoint", text), text
    if how == "SIGUSR1":
        assert f"requeued Slurm job {job}" in text, text[-4000:]
    resumed = final_weights(tmp_path)
    assert resumed.keys() == uninterrupted.keys()
    for name, value in uninterrupted.items():
        assert torch.allclose(resumed[name], value, atol=1e-5, rtol=0), name
