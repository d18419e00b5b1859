"""Ray Train: Ray's documented Lightning recipe with RayHeteroStrategy, on a real local Ray cluster (127.0.0.1).

Each test runs tests/workers/ray_fit.py, which starts the cluster, runs `TorchTrainer` with two CPU workers and
stops the cluster; if it dies instead, the test kills the daemons it started by the PIDs it wrote.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import pytest

pytest.importorskip("ray.train", reason="the Ray extra is not installed: pip install -e '.[test,ray]'")

sys.path.insert(0, str(Path(__file__).parent.parent / "workers"))
from common import IndexedRegression, max_param_difference, reference_training  # noqa: E402
from conftest import ENGINES_ONE_AT_A_TIME, WORKERS, kill_tree, run_bounded  # noqa: E402
from test_strategy_multiprocess import rank_slices  # noqa: E402

pytestmark = [pytest.mark.engines, ENGINES_ONE_AT_A_TIME]

TOLERANCE = 1e-5
BATCH_SIZES = [6, 2]  # rank 0 carries 3/4 of every step
SAMPLES, GLOBAL_BATCH = 32, 8


def epochs_of_steps(epochs: int) -> list[list[int]]:
    """The global batches of `epochs` epochs: the loader keeps its order, so every epoch is the same 4 batches."""
    return [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)) for k in range(SAMPLES // GLOBAL_BATCH)] * epochs


def run_ray(out: Path, *args: str, timeout: float = 240, env: Optional[dict[str, str]] = None) -> dict:
    command = [sys.executable, str(WORKERS / "ray_fit.py"), "--out", str(out), *args]
    try:
        returncode, output = run_bounded(command, timeout, env={"RAY_DEDUP_LOGS": "0", **(env or {})})
    finally:
        # Ray's daemons run in their own sessions: the driver stops them, or, if it died, these PIDs are theirs; with
        # the processes under them (the raylet's workers, which outlive a killed raylet for a while).
        pids = (out / "ray_pids").read_text().split() if (out / "ray_pids").exists() else []
        for pid in map(int, pids):
            kill_tree(pid)
    assert returncode == 0, output[-6000:]
    result = json.loads((out / "result.json").read_text())
    assert result["error"] is None, result["error"]
    result["by_rank"] = sorted(result["attempts"], key=lambda record: record["rank"])
    return result


@pytest.mark.multiprocess
def test_ray_recipe_trains_the_uneven_split_as_one_process(tmp_path):
    result = run_ray(tmp_path, "--epochs", "2")
    rank_0, rank_1 = result["by_rank"]
    assert [rank_0["world_size"], rank_0["batch_sizes"]] == [2, BATCH_SIZES]
    steps = epochs_of_steps(2)
    assert [rank_0["seen"], rank_1["seen"]] == rank_slices(steps, BATCH_SIZES)
    reference = reference_training(IndexedRegression(SAMPLES), steps)
    for record in (rank_0, rank_1):
        assert max_param_difference(record, reference) <= TOLERANCE
    # Ray's Result: the last epoch's checkpoint holds the package's checkpoint (manifest and every rank's part), and
    # the metrics carry each rank's figures from HeteroMonitor.
    saved = Path(result["checkpoint"]) / "checkpoint.ckpt"
    assert (saved / "hetero_manifest.json").exists()
    assert json.loads((saved / "hetero_manifest.json").read_text())["world_size"] == 2
    metrics = result["metrics"]
    assert metrics["step"] == 8
    assert [metrics[f"hetero/rank_{r}/micro_batch"] for r in range(2)] == BATCH_SIZES
    assert metrics["hetero/rank_0/compute_ms"] > 0 and metrics["hetero/rank_1/samples_per_second"] > 0


@pytest.mark.fault
def test_ray_restarts_a_killed_worker_and_the_fit_resumes_exactly(tmp_path):
    # Rank 1 SIGKILLs itself at step 6 of 12 (epoch 1 of 3, after Ray registered epoch 0's checkpoint): Ray sees the
    # dead worker, restarts the group (FailureConfig(max_failures=1)), and the recipe resumes from Ray's checkpoint.
    result = run_ray(tmp_path, "--epochs", "3", "--kill-rank", "1", "--kill-at-step", "6", "--max-failures", "1")
    assert (tmp_path / "killed").exists()
    resumed_from = {(tmp_path / f"resumed_from_rank{r}").read_text() for r in range(2)}
    assert len(resumed_from) == 1 and "checkpoint_" in resumed_from.pop()
    rank_0, rank_1 = result["by_rank"]
    assert rank_0["global_step"] == 12
    # The restarted attempt trained epochs 1 and 2 only, every sample once per epoch, and ends where one
    # uninterrupted process does.
    assert [rank_0["seen"], rank_1["seen"]] == rank_slices(epochs_of_steps(2), BATCH_SIZES)
    reference = reference_training(IndexedRegression(SAMPLES), epochs_of_steps(3))
    for record in (rank_0, rank_1):
        assert max_param_difference(record, reference) <= TOLERANCE


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_ray_elastic_loses_a_node_and_resumes_on_one_worker_with_the_same_global_batch(tmp_path):
    # Two Ray nodes of 1 CPU, ScalingConfig(num_workers=(1, 2)), a global batch of 8 split automatically, ZeRO-0
    # (whole states on every rank: SGD's momentum goes to another world size as it is). At step 6 of 12 the second
    # node is removed from the cluster: Ray restarts on the one worker left, which resumes the 2-worker checkpoint.
    # After the loss Ray first waits for 2 workers to start (60 s by default), then starts the 1 that fits.
    result = run_ray(
        tmp_path,
        "--elastic",
        "--batch-sizes",
        "--stage",
        "0",
        "--epochs",
        "3",
        "--lose-node-at-step",
        "6",
        "--max-failures",
        "1",
        timeout=280,
        env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"},
    )
    assert (tmp_path / "node_lost").exists()
    (only,) = result["by_rank"]
    assert (only["world_size"], only["batch_sizes"], only["global_step"]) == (1, [GLOBAL_BATCH], 12)
    resumed_from = Path((tmp_path / "resumed_from_rank0").read_text())
    assert json.loads((resumed_from / "hetero_manifest.json").read_text())["world_size"] == 2
    assert only["seen"] == [i for step in epochs_of_steps(2) for i in step]  # epochs 1 and 2, each sample once
    reference = reference_training(IndexedRegression(SAMPLES), epochs_of_steps(3))
    assert max_param_difference(only, reference) <= TOLERANCE
