"""Per-rank micro-steps end to end: two ranks on CPU (gloo), one taking its share in several micro-batches.

The claim under test: the update equals one process on the same global batches, every sample is used once, a
mid-epoch resume continues exactly, Lightning's accumulation composes, and ZeRO-3 refuses unequal counts on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import IndexedRegression, max_param_difference, reference_training  # noqa: E402
from conftest import run_fit  # noqa: E402
from test_strategy_multiprocess import contiguous_steps, rank_slices  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
# Rank 0 takes 4 samples in one micro-batch, rank 1 takes 12 in three of 4: a global batch of 16.
MICRO_BATCHES, MICRO_STEPS = [4, 4], [1, 3]
SHARES = [4, 12]


def micro_step_args(stage: int) -> list[str]:
    strategy = json.dumps({"micro_steps": MICRO_STEPS})
    return ["--stage", str(stage), "--batch-sizes", *map(str, MICRO_BATCHES), "--strategy-args", strategy]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_micro_steps_equal_one_process_and_resume_mid_epoch(stage, tmp_path):
    dataset, steps = IndexedRegression(64), contiguous_steps(64, 16, 4)
    checkpoint_every = ["--checkpoint-every", "2"] if stage == 2 else []
    first = run_fit(tmp_path / "first", *micro_step_args(stage), "--max-steps", "2", *checkpoint_every)
    assert first.returncode == 0, first.output[-4000:]
    assert first.result["global_step"] == 2  # optimizer steps: one per global batch, whatever the micro-steps
    assert first.result["seen"] == rank_slices(steps[:2], SHARES)
    assert max_param_difference(first.result, reference_training(dataset, steps[:2])) <= TOLERANCE
    plan = json.loads((tmp_path / "first" / "hetero" / "plan.json").read_text())
    assert (plan["batch_sizes"], plan["micro_steps"]) == (SHARES, MICRO_STEPS)
    assert "micro-steps" in first.output  # the plan table has the column
    run_report = json.loads((tmp_path / "first" / "hetero" / "report.json").read_text())
    assert [step["micro_steps"] for step in run_report["steps"]] == [MICRO_STEPS, MICRO_STEPS]
    assert f"micro-steps per rank at the end {MICRO_STEPS}" in first.output

    if stage != 2:
        return  # (the resume is the same at every stage: the loader's position and the split, checked once)
    (checkpoint,) = (tmp_path / "first" / "ckpt").iterdir()
    resumed = run_fit(tmp_path / "resumed", *micro_step_args(stage), "--ckpt-path", str(checkpoint))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert resumed.result["seen"] == rank_slices(steps[2:], SHARES)
    assert max_param_difference(resumed.result, reference_training(dataset, steps)) <= TOLERANCE


def test_micro_steps_with_lightnings_accumulation_and_a_short_last_batch_equal_one_process(tmp_path):
    """70 samples, global batch 16: four full batches and one of 6 (rank 1 takes 4 of them in 3 micro-batches of
    2, 1, 1), with `accumulate_grad_batches=2`: steps after batches 2, 4 and 5, each batch's loss divided by 2."""
    run = run_fit(
        tmp_path,
        *micro_step_args(2),
        "--samples",
        "70",
        "--accumulate",
        "2",
        "--max-epochs",
        "2",
    )
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["global_step"] == 6
    dataset = IndexedRegression(70)
    batches = [list(range(b, min(b + 16, 70))) for b in range(0, 70, 16)] * 2
    reference = reference_training(dataset, batches, accumulate=2, batches_per_epoch=5)
    assert max_param_difference(run.result, reference) <= TOLERANCE
    assert sorted(sum(run.result["seen"], [])) == sorted(list(range(70)) * 2)


def test_unequal_micro_steps_are_refused_at_zero_3_on_every_rank(tmp_path):
    run = run_fit(tmp_path, *micro_step_args(3), timeout=120)
    assert run.returncode != 0
    message = "differ across ranks, which ZeRO stage 3 cannot run"
    assert run.output.count(message) >= 2, run.output[-4000:]  # raised on both ranks, before any collective


def test_the_automatic_split_takes_micro_steps_where_the_memory_holds_less_than_the_global_batch(tmp_path):
    """Both ranks hold 4 samples per micro-batch and the global batch is 16: no split in one micro-batch each fits,
    so the planner cuts each rank's share into micro-batches of at most 4 (rank 1 is 2.5x slower: it takes fewer
    samples, unless this tiny model's fixed cost per micro-step outweighs that), and the update is still one
    process's on the same global batches."""
    run = run_fit(
        tmp_path,
        "--stage",
        "2",
        "--emulate-speeds",
        "1.0",
        "0.4",
        "--max-steps",
        "3",
        env={"LIGHTNING_HETERO_EMULATE_MEMORY": "4,4"},
    )
    assert run.returncode == 0, run.output[-4000:]
    plan = json.loads((tmp_path / "hetero" / "plan.json").read_text())
    samples, steps = plan["batch_sizes"], plan["micro_steps"]
    assert sum(samples) == 16 and samples[0] >= samples[1], plan
    assert steps == [-(-n // 4) for n in samples], plan  # as few micro-steps as the ceiling allows
    assert "micro-steps" in run.output
    reference = reference_training(IndexedRegression(64), contiguous_steps(64, 16, 3))
    assert max_param_difference(run.result, reference) <= TOLERANCE
    assert run.result["seen"] == rank_slices(contiguous_steps(64, 16, 3), samples)


def test_a_fixed_split_over_the_emulated_memory_is_refused_on_every_rank(tmp_path):
    run = run_fit(tmp_path, "--batch-sizes", "12", "4", timeout=120, env={"LIGHTNING_HETERO_EMULATE_MEMORY": "4,-"})
    assert run.returncode != 0
    message = "Rank 0's micro-batch of 12 samples (12 in 1 micro-step) does not fit"
    assert run.output.count(message) >= 2, run.output[-4000:]
