"""Checkpoints written by earlier versions of the package keep resuming (the redesign moved every module)."""

from __future__ import annotations

import shutil
import sys

import pytest
from conftest import WORKERS, run_fit

sys.path.insert(0, str(WORKERS))
from common import IndexedRegression, max_param_difference, reference_training  # noqa: E402

from lightning_hetero.recover import checkpoint  # noqa: E402

pytestmark = pytest.mark.multiprocess

SAVED = WORKERS.parent / "data" / "before_the_redesign" / "epoch=0-step=4.ckpt"


def test_a_checkpoint_written_before_the_redesign_resumes_as_the_uninterrupted_run(tmp_path):
    """The flat layout's ZeRO-2 checkpoint (2 ranks, micro-batches 10/6, Adam, HeteroMonitor's state) finishes its
    epoch with the parameters of the uninterrupted run and uses each remaining sample once."""
    saved = tmp_path / SAVED.name
    shutil.copytree(SAVED, saved)  # (a resume may add derived files next to it)
    assert checkpoint.incompleteness(saved) is None
    resumed = run_fit(
        tmp_path / "resumed",
        "--samples",
        "160",
        "--stage",
        "2",
        "--optimizer",
        "adam",
        "--batch-sizes",
        "10",
        "6",
        "--monitor",
        "--ckpt-path",
        str(saved),
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert resumed.result["global_step"] == 10
    assert sorted(sum(resumed.result["seen"], [])) == list(range(64, 160))
    steps = [list(range(k, k + 16)) for k in range(0, 160, 16)]
    reference = reference_training(IndexedRegression(160), steps, optimizer_name="adam")
    assert max_param_difference(resumed.result, reference) <= 1e-5
