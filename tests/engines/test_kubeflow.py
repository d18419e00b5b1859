"""Kubeflow, emulated: the manifests in configs/kubeflow/ run as processes on one machine.

No cluster here: each pod is a process running its container's command line (``torchrun`` is ``python -m
torch.distributed.run``, the same program) in the repository (the image's working directory), with the environment
the operator sets in that pod, and the manifests' shared volume a temporary directory. What the operator sets:

- Kubeflow Trainer v2 (``TrainJob``, torch-distributed runtime): ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK`` (the pod's index), ``PET_MASTER_ADDR`` (node 0's pod: 127.0.0.1 here), ``PET_MASTER_PORT``;
  torchrun reads them.
- The Training Operator v1 (``PyTorchJob``): ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (the pods), ``RANK``
  (the pod's index), which Kubernetes substitutes for ``$(NAME)`` in the command.

A lost pod is emulated by killing its process tree (torchrun and its worker) by PID; the operator's restart by
starting every pod's command again, as a JobSet's failure policy (or the PyTorchJob's ``restartPolicy``) does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ENGINES_ONE_AT_A_TIME, REPO, free_port, kill_tree

from lightning_hetero.recover import checkpoint

pytestmark = [pytest.mark.engines, pytest.mark.fault, ENGINES_ONE_AT_A_TIME]

MANIFESTS = REPO / "configs" / "kubeflow"
MOUNT = "/shared"  # the volume both manifests mount
IMAGE_ROOT = "/workspace"  # where the image holds this repository
POD_TIMEOUT = 240


def trainjob_pods(manifest: dict, shared: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    """Each node's command line and the environment the torch-distributed runtime gives it."""
    trainer = manifest["spec"]["trainer"]
    command = [part.replace(MOUNT, str(shared)).replace(IMAGE_ROOT, str(REPO)) for part in trainer["command"]]
    own = {item["name"]: item["value"] for item in trainer.get("env", [])}
    return [
        (
            command,
            {
                **own,
                "PET_NNODES": str(trainer["numNodes"]),
                "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(node),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            },
        )
        for node in range(trainer["numNodes"])
    ]


def test_the_trainjob_sets_only_what_kubeflow_trainer_accepts_and_restarts_on_a_lost_pod():
    """What the emulation cannot show, checked in the manifests: the TrainJob's container override holds only the
    fields Kubeflow Trainer's API has (a `workingDir` there was refused, or dropped and the relative script path with
    it), its command's paths are absolute, and the runtime it names restarts the job (the default one does not)."""
    manifest = yaml.safe_load((MANIFESTS / "trainjob.yaml").read_text())
    for override in manifest["spec"].get("podTemplateOverrides", []):
        for container in override["spec"].get("containers", []):
            assert set(container) <= {"name", "env", "volumeMounts", "securityContext"}, container
    script = manifest["spec"]["trainer"]["command"][1]
    assert script.startswith(IMAGE_ROOT + "/") and (REPO / script[len(IMAGE_ROOT) + 1 :]).is_file(), script
    reference = manifest["spec"]["runtimeRef"]
    runtime = yaml.safe_load((MANIFESTS / "runtime.yaml").read_text())
    assert (reference["name"], reference["kind"]) == (runtime["metadata"]["name"], runtime["kind"])
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] >= 1
    assert [job["name"] for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]] == ["node"]


def pytorchjob_pods(manifest: dict, shared: Path, port: int) -> list[tuple[list[str], dict[str, str]]]:
    """Each replica's command line, ``$(NAME)`` substituted from the environment the operator gives its pod."""
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    replicas = [(role, index) for role in ("Master", "Worker") for index in range(specs[role]["replicas"])]
    pods = []
    for rank, (role, _) in enumerate(replicas):
        (container,) = specs[role]["template"]["spec"]["containers"]
        environment = {item["name"]: item["value"] for item in container.get("env", [])}
        environment.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(len(replicas)), RANK=str(rank)
        )
        command = [expand(part, environment).replace(MOUNT, str(shared)) for part in container["command"]]
        pods.append((command, environment))
    return pods


def expand(argument: str, environment: dict[str, str]) -> str:
    """Kubernetes' substitution of ``$(NAME)`` in a container's command by the container's environment."""
    return re.sub(r"\$\((\w+)\)", lambda match: environment[match.group(1)], argument)


def start_pods(pods: list[tuple[list[str], dict[str, str]]]) -> list[subprocess.Popen]:
    started = []
    for command, environment in pods:
        assert command[0] == "torchrun", command
        argv = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
        started.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore", **environment},
            )
        )
    return started


def finish(pods: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    try:
        for pod in pods:
            output, _ = pod.communicate(timeout=POD_TIMEOUT)
            results.append((pod.returncode, output))
    finally:
        for pod in pods:
            kill_tree(pod.pid)
    return results


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    """The module's weights in the job's last checkpoint (the end of training: its every-3-steps save of step 24)."""
    states = torch.load(
        root / "checkpoints" / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )  # (our own test's file)
    return {name: tensor.clone() for name, tensor in states["module"].items()}


def test_a_trainjob_loses_a_pod_and_resumes_from_the_shared_volume_as_the_uninterrupted_job(tmp_path):
    """The TrainJob manifest, 2 pods: an uninterrupted run, then a run whose second pod is killed once a checkpoint is
    on the shared volume. The first pod's rank stops (the lost peer named) instead of waiting; the job started again
    resumes from the last complete checkpoint and ends with the uninterrupted run's weights, bit for bit (a fixed
    split: the same sums in the same order)."""
    manifest = yaml.safe_load((MANIFESTS / "trainjob.yaml").read_text())
    uninterrupted = tmp_path / "uninterrupted"
    finished = finish(start_pods(trainjob_pods(manifest, uninterrupted, free_port())))
    for code, output in finished:
        assert code == 0, output[-3000:]
    assert "finished at step 24" in finished[0][1], finished[0][1][-3000:]  # (rank 0's pod prints it)

    shared = tmp_path / "shared"
    pods = start_pods(trainjob_pods(manifest, shared, free_port()))
    root = shared / "hetero-spirals"
    try:
        deadline = time.monotonic() + POD_TIMEOUT
        while checkpoint.incompleteness(root / "checkpoints" / "last.ckpt") is not None:
            assert all(pod.poll() is None for pod in pods), pods[0].communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no checkpoint reached the shared volume"
            time.sleep(0.1)
        kill_tree(pods[1].pid)  # the pod is lost: its torchrun and its rank
        output, _ = pods[0].communicate(timeout=POD_TIMEOUT)
    finally:
        for pod in pods:
            kill_tree(pod.pid)
    assert pods[0].returncode != 0, output[-3000:]
    assert re.search(r"rank 1 has been lost|rank 0 lost its connection to another rank", output), output[-3000:]
    assert "Rank 0 exits with code 75" in output, output[-3000:]
    saved_at = checkpoint.read_manifest(root / "checkpoints" / "last.ckpt")["global_step"]
    assert 0 < saved_at < 24

    restarted = finish(start_pods(trainjob_pods(manifest, shared, free_port())))  # the JobSet started again
    for code, output in restarted:
        assert code == 0, output[-3000:]
    said = restarted[0][1]
    assert f"Restored all states from the checkpoint at {root / 'checkpoints' / 'last.ckpt'}" in said, said[-3000:]
    assert f"run report: {24 - saved_at} steps" in said and "finished at step 24" in said, said[-3000:]
    expected, resumed = final_weights(uninterrupted / "hetero-spirals"), final_weights(root)
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert torch.equal(expected[name], resumed[name]), name


def test_a_pytorchjob_runs_the_same_job_from_its_operators_environment(tmp_path):
    """The PyTorchJob manifest (Master and Worker, torchrun with `$(WORLD_SIZE)`, `$(RANK)`, `$(MASTER_ADDR)` and
    `$(MASTER_PORT)` from the operator) trains the same job as the TrainJob, to the same weights."""
    shared = tmp_path / "shared"
    pods = pytorchjob_pods(yaml.safe_load((MANIFESTS / "pytorchjob.yaml").read_text()), shared, free_port())
    assert [command[1:5] for command, _ in pods] == [
        ["--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1", "--master-addr=127.0.0.1"] for rank in (0, 1)
    ]
    for code, output in finish(start_pods(pods)):
        assert code == 0, output[-3000:]
    trainjob = tmp_path / "trainjob"
    finish(start_pods(trainjob_pods(yaml.safe_load((MANIFESTS / "trainjob.yaml").read_text()), trainjob, free_port())))
    expected, trained = final_weights(trainjob / "hetero-spirals"), final_weights(shared / "hetero-spirals-v1")
    for name in expected:
        assert torch.equal(expected[name], trained[name]), name
