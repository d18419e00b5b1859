"""Driver for the Ray Train tests: Ray's documented Lightning recipe with RayHeteroStrategy on a local Ray cluster.

Starts a Ray cluster on 127.0.0.1 (its daemons' PIDs go to `ray_pids` in --out, for the test to kill if this driver
dies), runs `TorchTrainer` with CPU workers, and writes `result.json`: Ray's `Result.metrics`, the attempts each
worker made, and per attempt every rank's sample indices and the final parameters.

`--kill-rank R --kill-at-step S` makes rank R of the first attempt kill itself (SIGKILL, by its own PID) once the
fit reaches global step S: Ray sees a dead worker and, with `--max-failures`, restarts the group from the last
checkpoint Ray holds.

`--elastic` runs two Ray nodes of 1 CPU each and `ScalingConfig(num_workers=(1, 2))`; `--lose-node-at-step S`
removes the second node (its raylet and the worker on it) at step S of the first attempt: Ray restarts the group on
the one worker that fits what is left.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray  # noqa: E402
import ray.train  # noqa: E402
import torch  # noqa: E402
from common import IndexedRegression, RegressionModule  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

# The two-node cluster listens on this loopback address: ray.init rewrites 127.0.0.1 to the machine's network address
# when it connects to a running cluster, where nothing listens.
LOOPBACK = "127.0.0.2"
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the checkpoints it holds


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def experiment_name(out: Path) -> str:
    """The run's Ray experiment name, one per test (its --out): Ray's RayTrainReportCallback stages each epoch's
    checkpoint in /tmp under the job id, this name and the rank, and every fresh cluster's first job has the same id,
    so a shared name put a test into the folder a previous test's worker, still ending, held."""
    return f"hetero-{hashlib.sha1(str(out).encode()).hexdigest()[:10]}"


class Record(Callback):
    """Each rank appends what it trained on to `attempts.jsonl` when the fit ends; rank R may die at step S."""

    def __init__(self, out: Path, kill_rank: int, kill_at_step: int, lose_node_at_step: int) -> None:
        self.out, self.kill_rank, self.kill_at_step = out, kill_rank, kill_at_step
        self.lose_node_at_step = lose_node_at_step

    def _wait_until_ray_holds_a_checkpoint(self) -> None:
        # Ray's controller registers a reported checkpoint when it next polls the workers (every few seconds); a
        # report not yet registered is lost with the worker group. Fail once Ray holds one, as a worker that dies
        # later in a real epoch would.
        deadline = time.monotonic() + 60
        while "checkpoint_dir_name" not in _text(self.out / "ray_storage" / experiment_name(self.out) / SNAPSHOT):
            if time.monotonic() > deadline:
                raise RuntimeError("Ray registered no checkpoint within 60 s")
            time.sleep(0.2)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        first_attempt = not (self.out / "killed").exists()
        if first_attempt and trainer.global_rank == self.kill_rank and trainer.global_step == self.kill_at_step:
            self._wait_until_ray_holds_a_checkpoint()
            (self.out / "killed").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        lost = self.out / "node_lost"
        if not lost.exists() and trainer.global_step == self.lose_node_at_step:
            # Every rank waits here while the driver removes the second node from the Ray cluster; the survivor's
            # next collective (or its watchdog) then fails, and Ray restarts the group on what is left.
            self._wait_until_ray_holds_a_checkpoint()
            (self.out / "lose_node").write_text("")
            deadline = time.monotonic() + 60
            while not lost.exists() and time.monotonic() < deadline:
                time.sleep(0.2)

    def on_fit_end(self, trainer, pl_module) -> None:
        params = {name: p.detach().double().tolist() for name, p in pl_module.named_parameters()}
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "seen": pl_module.seen,
            "params": params,
            "batch_sizes": list(trainer.strategy.plan.batch_sizes),
        }
        with open(self.out / "attempts.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")


def train_func(config: dict) -> None:
    from lightning_hetero import HeteroMonitor
    from lightning_hetero.ray import RayHeteroStrategy

    out = Path(config["out"])
    module = RegressionModule()
    loader = DataLoader(IndexedRegression(config["samples"]), batch_size=4)
    trainer = Trainer(
        devices="auto",
        accelerator="auto",
        # Fixed batch sizes, or (elastic: the number of workers changes) a global batch split automatically.
        strategy=RayHeteroStrategy(
            stage=config["stage"],
            batch_sizes=config["batch_sizes"] or None,
            global_batch_size=None if config["batch_sizes"] else 8,
            rebalance=False,
            rebalance_window=2,
        ),
        plugins=[RayLightningEnvironment()],
        callbacks=[
            HeteroMonitor(),
            RayTrainReportCallback(),
            Record(out, config["kill_rank"], config["kill_at_step"], config["lose_node_at_step"]),
        ],
        max_epochs=config["epochs"],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=str(out / "root"),
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            path = os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME)
            (out / f"resumed_from_rank{trainer.global_rank}").write_text(path)
            trainer.fit(module, loader, ckpt_path=path)
    else:
        trainer.fit(module, loader)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[6, 2], help="none: global batch 8, automatic")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--elastic", action="store_true", help="2 nodes of 1 CPU, num_workers=(1, 2)")
    parser.add_argument("--lose-node-at-step", type=int, default=-1, help="(elastic) remove the second node there")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    temp_dir = str(Path("/tmp") / f"ray_{os.getpid()}")
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}}
    cluster, second_node = None, None
    if args.elastic:
        # Two Ray nodes on this machine (Ray's own test cluster): the second can be removed, as a lost node is.
        from ray.cluster_utils import Cluster

        node_args = {"num_cpus": 1, "include_dashboard": False, "node_ip_address": LOOPBACK}  # (in /tmp/ray)
        cluster = Cluster(initialize_head=True, head_node_args=node_args)
        second_node = cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK)
        ray.init(address=cluster.address, runtime_env=runtime_env, log_to_driver=True)
        nodes = [cluster.head_node, second_node]
    else:
        ray.init(
            num_cpus=args.workers,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
            log_to_driver=True,
            runtime_env=runtime_env,
        )
        nodes = [ray._private.worker._global_node]
    pids = [info.process.pid for node in nodes for infos in node.all_processes.values() for info in infos]
    (args.out / "ray_pids").write_text("\n".join(map(str, pids)))
    if second_node is not None and args.lose_node_at_step >= 0:

        def lose_the_second_node() -> None:
            deadline = time.monotonic() + 300
            while not (args.out / "lose_node").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if (args.out / "lose_node").exists():
                cluster.remove_node(second_node)
                (args.out / "node_lost").write_text("")

        threading.Thread(target=lose_the_second_node, daemon=True).start()
    try:
        config = {
            "out": str(args.out),
            "stage": args.stage,
            "batch_sizes": args.batch_sizes,
            "samples": args.samples,
            "epochs": args.epochs,
            "kill_rank": args.kill_rank,
            "kill_at_step": args.kill_at_step,
            "lose_node_at_step": args.lose_node_at_step,
        }
        trainer = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=(1, 2) if args.elastic else args.workers, use_gpu=False),
            run_config=RunConfig(
                name=experiment_name(args.out),
                storage_path=str(args.out / "ray_storage"),
                failure_config=FailureConfig(max_failures=args.max_failures),
            ),
        )
        result = trainer.fit()
        attempts = [json.loads(line) for line in (args.out / "attempts.jsonl").read_text().splitlines()]
        summary = {
            "metrics": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))},
            "checkpoint": result.checkpoint.path if isinstance(result.checkpoint, Checkpoint) else None,
            "error": repr(result.error) if result.error else None,
            "attempts": attempts,
        }
        (args.out / "result.json").write_text(json.dumps(summary))
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
