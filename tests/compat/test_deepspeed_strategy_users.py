"""What a user of Lightning's DeepSpeedStrategy relies on when switching to HeteroStrategy: real 2-rank fits on CPU.

Each case failed before (issue 29, item 8); the numbers compare parameters with one process trained on the same
global batches (:func:`reference_training`), the claim "the same update as before the switch". The pure decisions
behind them are in the fast tier: tests/configure/test_configure.py (a config's stage, ``zero_optimization=False``),
tests/precision/test_nonfinite.py (DeepSpeed's own bf16), tests/recover/test_from_deepspeed.py (the directory).
Lightning's own DeepSpeed tests, run against the strategy, are in test_lightning_deepspeed.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import RandomSampler

sys.path.insert(0, str(Path(__file__).parent.parent / "workers"))

from common import IndexedRegression, max_param_difference, reference_training  # noqa: E402
from conftest import run_fit  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


def contiguous_steps(num_samples: int, global_batch: int) -> list[list[int]]:
    return [list(range(k, k + global_batch)) for k in range(0, num_samples - global_batch + 1, global_batch)]


def test_a_config_without_a_zero_section_trains_at_zero_0_with_a_plain_torch_optimizer(tmp_path):
    """A DeepSpeed config from PL_DEEPSPEED_CONFIG_PATH with no `zero_optimization` section is ZeRO-0 to DeepSpeed and
    to DeepSpeedStrategy. It ran ZeRO-2 here, where the model's torch SGD failed at setup with DeepSpeed's "untested
    ZeRO Optimizer" (it needs `zero_allow_untested_optimizer`)."""
    config = tmp_path / "deepspeed.json"
    config.write_text(json.dumps({"gradient_clipping": 0.0}))
    run = run_fit(
        tmp_path / "run",
        "--strategy-args",
        '{"stage": null}',
        "--batch-sizes",
        "3",
        "13",
        env={"PL_DEEPSPEED_CONFIG_PATH": str(config)},
    )
    assert run.returncode == 0, run.output[-3000:]
    rank_0 = json.loads((tmp_path / "run" / "hetero" / "rank_0.json").read_text())
    assert rank_0["deepspeed_config"]["zero_optimization"]["stage"] == 0
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16))
    assert max_param_difference(run.result, reference) <= TOLERANCE


def test_bf16_mixed_fits_validates_and_tests_at_zero_0(tmp_path):
    """`Trainer(precision="bf16-mixed")` is DeepSpeed's own bf16, as under DeepSpeedStrategy. At ZeRO-0 the fit failed
    at setup, and validate/test at every stage, with a TypeError about `device_precision` and fp16 ranks: the
    non-finite-step guard tried to patch DeepSpeed's own mixed-precision optimizer (which skips such steps itself)."""
    run = run_fit(
        tmp_path,
        "--stage",
        "0",
        "--precision",
        "bf16-mixed",
        "--batch-sizes",
        "3",
        "13",
        "--val-samples",
        "8",
        "--test-samples",
        "8",
    )
    assert run.returncode == 0, run.output[-3000:]
    rank_0 = json.loads((tmp_path / "hetero" / "rank_0.json").read_text())
    assert rank_0["deepspeed_config"]["bf16"]["enabled"] is True
    assert "val_loss" in run.result["metrics"]
    assert json.loads((tmp_path / "test_result.json").read_text())["test_loss"] > 0
    # bf16 weights: within bf16's rounding of one fp32 process (measured 2.8e-3; the last step alone moves 0.43).
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16))
    assert max_param_difference(run.result, reference) <= 1e-2


def test_a_model_built_in_configure_model_is_profiled_after_it_is_built(tmp_path):
    """Lightning formats the DeepSpeed config in `model_sharded_context`, before `configure_model` runs; the automatic
    split's profile ran there, on a model without layers ("'NoneType' object is not callable"). ZeRO-2, with
    `validate` in bf16 during the fit."""
    run = run_fit(tmp_path, "--stage", "2", "--configure-model", "--precision", "bf16-mixed", "--val-samples", "8")
    assert run.returncode == 0, run.output[-3000:]
    assert "HeteroStrategy plan (auto" in run.output  # the profile ran
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16))
    assert max_param_difference(run.result, reference) <= 1e-2  # (bf16, as above)


def test_at_zero_3_a_test_before_the_fit_of_a_partitioned_model_then_trains_as_one_process(tmp_path):
    """ZeRO-3 creates a `configure_model` model partitioned, and `trainer.test()` leaves it so with its engine's
    hooks on the modules: the profile of the fit that follows broke on the empty parameters ("The size of tensor a
    (32) must match the size of tensor b (0)"), and the test engine's leftover hooks broke the fit's first step ("pop
    from an empty deque", under DeepSpeedStrategy too). The profile now gathers the parameters, and each engine's
    init drops an earlier engine's hooks."""
    run = run_fit(tmp_path / "auto", "--stage", "3", "--configure-model", "--test-first", "--test-samples", "8")
    assert run.returncode == 0, run.output[-3000:]
    assert "HeteroStrategy plan (auto" in run.output
    assert json.loads((tmp_path / "auto" / "test_result.json").read_text())["test_loss"] > 0
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16))
    assert max_param_difference(run.result, reference) <= TOLERANCE
    fixed = run_fit(
        tmp_path / "fixed",
        "--stage",
        "3",
        "--configure-model",
        "--test-first",
        "--test-samples",
        "8",
        "--batch-sizes",
        "3",
        "13",
    )
    assert fixed.returncode == 0, fixed.output[-3000:]
    assert max_param_difference(fixed.result, reference) <= TOLERANCE


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeedstrategy_checkpoint_directory_continues_under_hetero_as_the_uninterrupted_run(stage, tmp_path):
    """A user switching from strategy="deepspeed" mid-epoch: Lightning's DeepSpeedStrategy (made to run on CPU) trains
    3 steps (Adam, 2 ranks x 8) and saves its checkpoint directory; HeteroStrategy (micro-batches 5/11, the same
    global batch) continues from it: DeepSpeed's states, the loops and the place in the shuffled epoch carry over, and
    two epochs end with the parameters one process reaches. It was refused: "it has no hetero_manifest.json"."""
    common = ["--samples", "96", "--shuffle", "--optimizer", "adam", "--record-steps", "--stage", str(stage)]
    before = run_fit(
        tmp_path / "deepspeed", *common, "--deepspeed-strategy", "--max-steps", "3", "--checkpoint-every", "3"
    )
    assert before.returncode == 0, before.output[-3000:]
    (saved,) = (tmp_path / "deepspeed" / "ckpt").iterdir()
    assert saved.is_dir() and not (saved / "hetero_manifest.json").exists()
    resumed = run_fit(
        tmp_path / "hetero", *common, "--batch-sizes", "5", "11", "--max-epochs", "2", "--ckpt-path", str(saved)
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"continuing from {saved}, a checkpoint of Lightning's DeepSpeedStrategy (ZeRO-{stage}" in resumed.output
    assert resumed.result["global_step"] == 12
    dataset = IndexedRegression(96)
    orders = [list(RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + epoch))) for epoch in (0, 1)]
    steps = [order[begin : begin + 16] for order in orders for begin in range(0, 96, 16)]
    records = [json.loads(line) for line in (tmp_path / "hetero" / "steps.jsonl").read_text().splitlines()]
    assert sorted(i for r in records if r["epoch"] == 0 for i in r["indices"]) == sorted(orders[0][48:])
    difference = max_param_difference(resumed.result, reference_training(dataset, steps, optimizer_name="adam"))
    print(f"ZeRO-{stage}: largest parameter difference from the uninterrupted run: {difference:.1e}")
    assert difference <= TOLERANCE


@pytest.mark.fault
def test_a_deepspeedstrategy_checkpoint_continues_on_another_number_of_ranks(tmp_path):
    """The same directory (ZeRO-2, 2 ranks, Adam) resumed on 1 rank, as a DDP file can be: the facts read from its
    files take it through DeepSpeed's universal format, and the checkpoint's global batch of 16 is kept."""
    common = ["--samples", "96", "--shuffle", "--optimizer", "adam", "--record-steps", "--stage", "2"]
    before = run_fit(
        tmp_path / "deepspeed", *common, "--deepspeed-strategy", "--max-steps", "3", "--checkpoint-every", "3"
    )
    assert before.returncode == 0, before.output[-3000:]
    (saved,) = (tmp_path / "deepspeed" / "ckpt").iterdir()
    resumed = run_fit(tmp_path / "hetero", *common, "--devices", "1", "--max-epochs", "2", "--ckpt-path", str(saved))
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "was saved by 2 ranks; this job has 1: converted to DeepSpeed's universal format" in resumed.output
    assert "keeping the checkpoint's global batch of 16 on 1 ranks" in resumed.output
    assert resumed.result["global_step"] == 12
    dataset = IndexedRegression(96)
    orders = [list(RandomSampler(dataset, generator=torch.Generator().manual_seed(7 + epoch))) for epoch in (0, 1)]
    steps = [order[begin : begin + 16] for order in orders for begin in range(0, 96, 16)]
    difference = max_param_difference(resumed.result, reference_training(dataset, steps, optimizer_name="adam"))
    assert difference <= TOLERANCE  # (measured 1.5e-8)
