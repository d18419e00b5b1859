"""`Trainer(sync_batchnorm=True)` on two CPU ranks (gloo) with unequal micro-batches: the update and the running
statistics are one process's on the global batch (issue 29 item 3: BatchNorm under batch_sizes=[3, 13] ended 0.80
from DDP, and sync_batchnorm was refused off CUDA)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import IndexedRegression, batchnorm_reference_training, max_param_difference  # noqa: E402
from conftest import run_fit  # noqa: E402
from test_strategy_multiprocess import contiguous_steps  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
BATCH_SIZES = [3, 13]


@pytest.mark.parametrize(
    ("stage", "micro_steps"),
    [(0, [1, 1]), (2, [1, 1]), (2, [2, 2]), (3, [1, 1])],
    ids=["zero0", "zero2", "zero2-micro-steps", "zero3"],
)
def test_sync_batchnorm_equals_one_process_on_the_global_batch(stage, micro_steps, tmp_path):
    global_batch = sum(b * k for b, k in zip(BATCH_SIZES, micro_steps))
    dataset, steps = IndexedRegression(64), contiguous_steps(64, global_batch, 64 // global_batch)
    run = run_fit(
        tmp_path,
        "--stage",
        str(stage),
        "--batch-sizes",
        *map(str, BATCH_SIZES),
        "--batchnorm",
        "--sync-batchnorm",
        "--strategy-args",
        json.dumps({"micro_steps": micro_steps}),
        "--samples",
        "64",
        warnings=True,
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["batchnorm_types"] == ["SampleWeightedSyncBatchNorm"]
    parameters, statistics = batchnorm_reference_training(dataset, steps, BATCH_SIZES, micro_steps)
    difference = max_param_difference(run.result, parameters)
    trained = {name[len("network.") :]: torch.tensor(v) for name, v in run.result["running_statistics"].items()}
    statistics_difference = max(
        (trained[name] - value.double()).abs().max().item() for name, value in statistics.items()
    )
    print(f"from one process: parameters {difference:.1e}, running statistics {statistics_difference:.1e}")
    assert difference <= TOLERANCE and statistics_difference <= TOLERANCE
    assert "micro-batch is 3 samples" not in run.output  # synchronized: no warning about small micro-batches


def test_without_sync_the_plan_says_a_batchnorm_sees_few_samples(tmp_path):
    run = run_fit(tmp_path, "--batch-sizes", *map(str, BATCH_SIZES), "--batchnorm", "--max-steps", "1", warnings=True)
    assert run.returncode == 0, run.output[-4000:]
    assert "rank 0's micro-batch is 3 samples (below 16)" in run.output
    assert "Pass `Trainer(sync_batchnorm=True)`" in run.output
