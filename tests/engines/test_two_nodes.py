"""Two nodes on one machine: two network namespaces, each with its own host name (a UTS namespace) and one end of a
veth pair (10.77.0.1 and 10.77.0.2), each running a torchrun agent of the README's elastic command.

The two agents are real nodes to everything the package and torch see: different host names, different addresses,
traffic over the veth link (gloo bound to each namespace's interface). The file system is shared, as a cluster's
checkpoint storage is. Needs root and iproute2 (`ip netns`); skipped elsewhere, saying why. The namespaces and the
per-namespace hosts files are removed at the end; every process started is killed by PID.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ENGINES_ONE_AT_A_TIME, REPO, kill_tree

from lightning_hetero.recover import checkpoint

pytestmark = [pytest.mark.engines, ENGINES_ONE_AT_A_TIME]

SUBNET = "10.77.0"
PORT = 29417


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes():
    """Two namespaces `hx<pid>_a` / `_b` joined by a veth pair; yields [(namespace, interface, host, address)]."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("iproute2 and util-linux (`ip netns`, `unshare`) are needed for two network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"hx{os.getpid() % 100000}"
    nodes = [(f"{tag}_{x}", f"{tag}v{x}", f"node-{x}", f"{SUBNET}.{i + 1}") for i, x in enumerate("ab")]
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address} {host}\n" for _, _, host, address in nodes)
    try:
        try:
            for namespace, *_ in nodes:
                _ip("netns", "add", namespace)
        except subprocess.CalledProcessError as error:
            pytest.skip(f"`ip netns add` is refused here: {error.stderr.decode().strip()}")
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for namespace, interface, _, address in nodes:
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # `ip netns exec` mounts /etc/netns/<namespace>/hosts over /etc/hosts: each node resolves both names.
            (Path("/etc/netns") / namespace).mkdir(parents=True, exist_ok=True)
            (Path("/etc/netns") / namespace / "hosts").write_text(hosts)
        yield nodes
    finally:
        for namespace, *_ in nodes:
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, timeout=30)  # the veth too
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


@pytest.mark.fault
def test_a_job_on_two_nodes_reduces_hierarchically_and_survives_the_loss_of_one(two_nodes, tmp_path):
    """The elastic command on two nodes of 2 ranks: the ranks find two hosts, so the reduction is hierarchical
    (ZeRO-0); once a 4-rank checkpoint is published, node b (its agent and workers) is killed. Node a's agent
    re-rendezvouses alone and the job finishes on its 2 ranks, resumed from the 4-rank checkpoint, with the same
    global batch, re-planned for 2 ranks."""
    root = tmp_path / "run"
    plan_file = root / "hetero" / "plan.json"
    agents, logs = [], []
    try:
        for namespace, interface, host, _ in two_nodes:
            torchrun = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1:2",
                "--nproc-per-node=2",
                "--max-restarts=3",
                "--monitor-interval=0.5",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={two_nodes[0][3]}:{PORT}",
                "--rdzv-id=two-nodes",
                "--rdzv-conf=last_call_timeout=5",
                str(REPO / "examples" / "fault_tolerant.py"),
                "--root",
                str(root),
                "--train-samples",
                "1536",
                "--epochs",
                "4",
                "--every",
                "3",
                "--stage",
                "0",
            ]
            # A node: its own network (ip netns exec) and host name (unshare --uts), gloo on its veth end.
            command = [
                "ip",
                "netns",
                "exec",
                namespace,
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname {host} && exec "$@"',
                "sh",
                *torchrun,
            ]
            log = tmp_path / f"{host}.log"
            logs.append(log)
            environment = {
                **os.environ,
                "PYTHONWARNINGS": "ignore",
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": interface,
            }
            with open(log, "w") as handle:
                agents.append(
                    subprocess.Popen(
                        command,
                        cwd=REPO,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=environment,
                    )
                )
            time.sleep(1.0)  # node a hosts the rendezvous store
        deadline = time.monotonic() + 240
        while checkpoint.incompleteness(root / "checkpoints" / "last.ckpt") is not None:
            assert all(agent.poll() is None for agent in agents), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint was published: " + logs[0].read_text()[-3000:]
            time.sleep(0.2)
        four_ranks = json.loads(plan_file.read_text())
        assert checkpoint.read_manifest(root / "checkpoints" / "last.ckpt")["world_size"] == 4
        kill_tree(agents[1].pid)  # node b is lost
        agents[0].wait(timeout=240)
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    output = logs[0].read_text()
    assert agents[0].returncode == 0, output[-4000:]
    # Two hosts, two ranks each: detected by host name, and the reduction goes through one rank per node.
    communication = four_ranks["communication"]
    assert communication["nodes"] == [0, 0, 1, 1], communication
    assert communication["hierarchical"] is True, communication
    hosts = [device["hostname"] for device in four_ranks["devices"]]
    assert hosts == ["node-a", "node-a", "node-b", "node-b"], hosts
    # The survivor resumed the 4-rank checkpoint on its 2 ranks, with the global batch kept and a new split.
    # (ZeRO-0 keeps whole states on every rank: no conversion is needed to load 4 ranks' checkpoint on 2.)
    assert "Restored all states from the checkpoint" in output, output[-4000:]
    assert "finished at step 24" in output, output[-4000:]
    two_ranks = json.loads(plan_file.read_text())
    assert two_ranks["global_batch_size"] == 256 and len(two_ranks["batch_sizes"]) == 2, two_ranks
    assert sum(two_ranks["batch_sizes"]) == 256 and two_ranks["communication"]["nodes"] == [0, 0]
    assert checkpoint.read_manifest(root / "checkpoints" / "last.ckpt")["world_size"] == 2
