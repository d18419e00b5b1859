"""Per-device precision end to end: 2 ranks on CPU (gloo) in different precisions, each run bounded by a timeout.

What the user relies on: ranks in different precisions stay in sync and compute what the same mixed computation in
one process computes (the gradient reduction adds matching gradients together); a bf16 rank beside an fp32 one ends
close to an all-fp32 run; an fp16 overflow on one rank skips the step on every rank and halves the shared loss scale;
a checkpoint keeps that scale.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, run_fit

sys.path.insert(0, str(WORKERS))

from common import IndexedRegression, full_data_loss, mixed_precision_reference  # noqa: E402

pytestmark = pytest.mark.multiprocess

SAMPLES = 64
# Different precisions run different floating-point operations, so equality with the one-process simulation of the
# same computation is up to the summation order of the reduction (fp32 rounding), not bit for bit.
SIMULATION_TOLERANCE = 1e-6
# bf16 on one rank beside fp32: the final loss over the whole training set, relative to an all-fp32 run's.
BF16_LOSS_TOLERANCE = 0.02


def per_step(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "per_step.jsonl").read_text().splitlines()]


def batches_by_step(seen: list[list[int]], batch_sizes: list[int], steps: int) -> list[list[list[int]]]:
    return [[seen[r][n * b : (n + 1) * b] for r, b in enumerate(batch_sizes)] for n in range(steps)]


@pytest.mark.parametrize(("stage", "precisions"), [(2, ["bf16-mixed", "32-true"]), (3, ["16-mixed", "32-true"])])
def test_ranks_in_different_precisions_compute_the_mixed_batch_exactly(stage, precisions, tmp_path):
    """Unequal micro-batches, gradient accumulation, ZeRO-2/3 (the stages whose reduction depends on gradient order);
    with fp16, the loss scale, its skipped steps and the unscaled gradients too."""
    batch_sizes, accumulate, epochs = [10, 6], 2, 2
    strategy = {"device_precision": precisions, "batch_sizes": batch_sizes}
    run = run_fit(
        tmp_path,
        "--stage",
        str(stage),
        "--samples",
        str(SAMPLES),
        "--max-epochs",
        str(epochs),
        "--accumulate",
        str(accumulate),
        "--strategy-args",
        json.dumps(strategy),
        "--record-every-step",
    )
    assert run.returncode == 0, run.output[-3000:]
    records = per_step(tmp_path)
    steps = epochs * SAMPLES // sum(batch_sizes)
    assert len(records) == steps
    assert max(record["spread"] for record in records) == 0.0  # every rank holds the same parameters, every step
    # (At ZeRO-2/3 the ranks gather each other's partitions, so that alone does not show the reduction is right;
    # the comparison with one process computing the same mixed batches does.)
    dataset = IndexedRegression(SAMPLES)
    simulated = mixed_precision_reference(
        dataset, batches_by_step(run.result["seen"], batch_sizes, steps), precisions, accumulate
    )
    differences = [(torch.tensor(r["params"]) - s).abs().max().item() for r, s in zip(records, simulated)]
    assert max(differences) < SIMULATION_TOLERANCE, differences
    if "16-mixed" in precisions:
        assert records[-1]["skipped_steps"] >= 1  # the scale settled from 2**16 on this model: skips were exercised

    # bf16 against the same training in fp32 everywhere: close.
    if "bf16-mixed" in precisions:
        all_fp32 = mixed_precision_reference(
            dataset, batches_by_step(run.result["seen"], batch_sizes, steps), ["32-true"] * 2, accumulate
        )
        ours, reference = full_data_loss(dataset, simulated[-1]), full_data_loss(dataset, all_fp32[-1])
        assert abs(ours - reference) / reference < BF16_LOSS_TOLERANCE, (ours, reference)
    for rank, expected in enumerate(precisions):
        record = json.loads((tmp_path / "hetero" / f"rank_{rank}.json").read_text())
        assert record["precision"] == expected
    assert precisions[0] in run.output and "precision" in run.output  # the plan table's column


def overflow_run(out: Path, stage: int, *extra: str):
    strategy = {"device_precision": ["16-mixed", "32-true"], "batch_sizes": [8, 8]}
    return run_fit(
        out,
        "--stage",
        str(stage),
        "--samples",
        str(SAMPLES),
        "--max-epochs",
        "2",
        "--overflow",
        "0:5",
        "--strategy-args",
        json.dumps(strategy),
        "--record-every-step",
        "--monitor",
        *extra,
    )


def assert_overflows_skip_on_every_rank(out: Path) -> list[dict]:
    records = per_step(out)
    assert len(records) == 8
    assert max(record["spread"] for record in records) == 0.0  # in sync after every step, skipped or not
    # Rank 0's loss is inf at global step 5: the sixth record. A skipped step leaves the parameters as they were and
    # halves the scale; a step that is not skipped changes them. (The first steps may overflow by themselves: the
    # scale starts at 2**16, which this model's fp16 gradients exceed, as with torch's GradScaler.)
    initial = 2.0**16
    for before, after in zip([{"params": None, "loss_scale": initial, "skipped_steps": 0}] + records, records):
        skipped = after["skipped_steps"] == before["skipped_steps"] + 1
        assert after["loss_scale"] == (before["loss_scale"] / 2 if skipped else before["loss_scale"])
        if before["params"] is not None:
            assert (after["params"] == before["params"]) == skipped
    injected = records[5]
    assert injected["skipped_steps"] == records[4]["skipped_steps"] + 1
    assert records[-1]["params"] != injected["params"]  # training went on
    log_dir = out / "csv" / "version_0"  # the CSVLogger's (--monitor): the run report is written beside it
    report = json.loads((log_dir / "hetero" / "report.json").read_text())
    skipped = [{"step": entry["step"], "ranks": entry["ranks"]} for entry in report["precision"]["skipped_steps"]]
    assert {"step": 5, "ranks": [0]} in skipped
    assert report["precision"]["loss_scale"] == records[-1]["loss_scale"]
    # HeteroMonitor logs the scale after every optimizer step to the user's logger.
    with open(log_dir / "metrics.csv") as file:
        logged = {
            int(row["step"]): float(row["hetero/loss_scale"])
            for row in csv.DictReader(file)
            if row.get("hetero/loss_scale")
        }
    assert logged == {index: record["loss_scale"] for index, record in enumerate(records)}
    return records


@pytest.mark.parametrize("stage", [0, 3])  # ZeRO-2: in the checkpoint test below
def test_an_fp16_overflow_on_one_rank_skips_that_step_on_every_rank_and_halves_the_scale(stage, tmp_path):
    run = overflow_run(tmp_path, stage)
    assert run.returncode == 0, run.output[-3000:]
    assert_overflows_skip_on_every_rank(tmp_path)


def test_a_checkpoint_taken_after_a_skip_resumes_with_its_scale_and_continues_exactly(tmp_path):
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    run = overflow_run(uninterrupted, 2, "--checkpoint-every", "6")
    assert run.returncode == 0, run.output[-3000:]
    records = assert_overflows_skip_on_every_rank(uninterrupted)
    checkpoint = uninterrupted / "ckpt" / "epoch=1-step=6.ckpt"
    assert checkpoint.is_dir(), sorted(p.name for p in (uninterrupted / "ckpt").iterdir())
    assert records[5]["loss_scale"] < records[4]["loss_scale"]  # the step before the checkpoint halved it
    again = overflow_run(resumed, 2, "--ckpt-path", str(checkpoint))
    assert again.returncode == 0, again.output[-3000:]
    continued = per_step(resumed)
    assert [r["step"] for r in continued] == [7, 8]
    # The first step after the resume trains at the scale the checkpoint held (no spurious overflow from 2**16).
    assert continued[0]["loss_scale"] == records[6]["loss_scale"]
    for ours, theirs in zip(continued, records[6:]):
        assert (torch.tensor(ours["params"]) - torch.tensor(theirs["params"])).abs().max().item() < 1e-6
