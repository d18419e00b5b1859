"""Steps skipped for non-finite gradients: counted, skipped at ZeRO-0 too, and a run without a loss scale that keeps
producing them stopped on every rank with the ranks named (pure parts and a fake engine; 2-rank runs below)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
from conftest import run_fit

from lightning_hetero.precision.nonfinite import (
    NonFiniteGuard,
    NonFiniteStepsError,
    gradients_are_finite,
    streak_message,
)


class FakeEngine:
    """What the guard reads of DeepSpeed's engine; ``step(skip)`` stands for one optimizer step."""

    def __init__(self, stage=2, fp16=False, optimizer=None, module=None, bf16=False):
        self.skipped_steps = 0
        self.stage, self.fp16, self.bf16 = stage, fp16, bf16
        self.optimizer = optimizer if optimizer is not None else object()
        self.module = module

    def zero_optimization_stage(self):
        return self.stage

    def fp16_enabled(self):
        return self.fp16

    def bfloat16_enabled(self):
        return self.bf16

    def step(self, skip):
        self.skipped_steps += int(skip)


def gather_as(first_nonfinite_on_other_ranks):
    """A gather for rank 0 of a job whose other ranks report these first non-finite steps (-1: none)."""
    return lambda tensor: [tensor] + [torch.tensor([s]) for s in first_nonfinite_on_other_ranks]


def run_steps(guard, engine, losses):
    """Each entry: (this rank's loss, whether the job skipped the step)."""
    for step, (loss, skip) in enumerate(losses):
        guard.loss_computed(torch.tensor(loss))
        engine.step(skip)
        guard.step_ended(step)


def test_a_streak_of_skipped_steps_stops_the_run_naming_the_ranks_whose_loss_was_not_finite():
    engine = FakeEngine()
    guard = NonFiniteGuard(3, gather_as([2]))  # rank 1 went non-finite at step 2 as well
    guard.attach(engine, has_loss_scale=False, skipping_installed=False, precision="32-true")
    nan = float("nan")
    with pytest.raises(NonFiniteStepsError) as error:
        run_steps(guard, engine, [(1.0, False), (1.0, False), (nan, True), (nan, True), (nan, True)])
    message = str(error.value)
    assert "3 optimizer steps in a row (steps 2 to 4) had non-finite gradients" in message
    assert "on rank 0 from step 2; rank 1 from step 2" in message and "in 32-true there is no loss scale" in message
    assert guard.skipped == [2, 3, 4]


def test_a_finite_step_ends_the_streak_and_skips_are_only_counted_with_a_loss_scale_or_no_limit():
    nan = float("nan")
    for limit, scaled in [(2, False), (2, True), (None, False)]:
        engine = FakeEngine()
        guard = NonFiniteGuard(limit, gather_as([-1]))
        guard.attach(engine, has_loss_scale=scaled, skipping_installed=scaled, precision="32-true")
        steps = [(nan, True), (1.0, False), (nan, True), (1.0, False)]
        if limit is None or scaled:
            steps += [(nan, True)] * 5  # fp16 overflows while the scale comes down, or a run told never to stop
        run_steps(guard, engine, steps)
        assert guard.skipped == [0, 2, *range(4, len(steps))] if len(steps) > 4 else [0, 2]
        assert guard.summary()["skipped_steps"] == guard.skipped


def test_deepspeeds_fp16_counts_as_a_loss_scale():
    engine = FakeEngine(fp16=True)
    guard = NonFiniteGuard(1, gather_as([-1]))
    guard.attach(engine, has_loss_scale=False, skipping_installed=False, precision="16-mixed")
    run_steps(guard, engine, [(float("inf"), True)] * 3)
    assert guard.skipped == [0, 1, 2]


def test_finite_losses_with_a_skipped_step_blame_the_gradients():
    message = streak_message([5, 6, 7], [None, None], "bf16-mixed", 3)
    assert "Every rank's loss was finite, so a gradient overflowed" in message and "steps 5 to 7" in message


def test_at_zero_0_a_step_with_non_finite_gradients_is_skipped_and_counted_by_the_engine():
    network = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    engine = FakeEngine(stage=0, optimizer=optimizer, module=network)
    guard = NonFiniteGuard(None, gather_as([]))
    guard.attach(engine, has_loss_scale=False, skipping_installed=False, precision="32-true")
    before = [p.detach().clone() for p in network.parameters()]
    network(torch.ones(2, 3)).sum().mul(float("nan")).backward()
    optimizer.step()
    assert optimizer.overflow is True  # what DeepSpeed's engine reads to count engine.skipped_steps
    assert all(torch.equal(a, b) for a, b in zip(before, network.parameters()))
    optimizer.zero_grad()
    network(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    assert optimizer.overflow is False and not torch.equal(before[0], network.weight)
    guard.detach()
    assert "step" not in optimizer.__dict__


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deepspeeds_own_precision_optimizer_at_zero_0_is_left_to_skip_its_own_steps(precision):
    """`Trainer(precision="bf16-mixed")`: at ZeRO-0 DeepSpeed wraps the optimizer in its own mixed-precision optimizer
    (which skips a non-finite step itself), and builds one without any optimizer for validate and test. Attaching
    raised a TypeError about `device_precision` and fp16 ranks, which the user never set."""

    class DeepSpeedMixedPrecisionOptimizer:  # (FP16_Optimizer / BF16_Optimizer: not a torch optimizer)
        overflow = False

        def step(self):
            pass

    wrapper = DeepSpeedMixedPrecisionOptimizer()
    engine = FakeEngine(stage=0, optimizer=wrapper, module=torch.nn.Linear(3, 1), **{precision: True})
    guard = NonFiniteGuard(3, gather_as([]))
    guard.attach(engine, has_loss_scale=False, skipping_installed=False, precision="bf16-mixed")
    assert "step" not in vars(wrapper)  # DeepSpeed's own overflow check decides; the engine counts the skips
    run_steps(guard, engine, [(float("nan"), True), (1.0, False)])
    assert guard.skipped == [0]
    guard.detach()


def test_gradients_are_finite():
    a, b = torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)
    assert gradients_are_finite([a, b])  # no gradients yet
    a.grad, b.grad = torch.ones(3), torch.tensor([1.0, math.inf])
    assert not gradients_are_finite([a, b])
    b.grad = torch.ones(2)
    assert gradients_are_finite([a, b])


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 2])
def test_a_loss_that_goes_nan_on_one_rank_stops_every_rank_naming_it(stage, tmp_path):
    """Rank 1's loss is NaN from step 3 on. It used to train on (ZeRO-0: every parameter NaN; ZeRO-2: every step
    skipped) and exit 0; now steps 3 to 5 are skipped with the parameters untouched, and both ranks stop there."""
    run = run_fit(
        tmp_path,
        "--batch-sizes",
        "8",
        "8",
        "--samples",
        "128",
        "--stage",
        str(stage),
        "--nan-from",
        "1:3",
        "--record-every-step",
    )
    assert run.returncode != 0
    expected = "3 optimizer steps in a row (steps 3 to 5) had non-finite gradients"
    assert run.output.count(expected) >= 2 and "on rank 1 from step 3" in run.output, run.output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "per_step.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x) for record in records for x in record["params"])


@pytest.mark.multiprocess
def test_skipped_steps_are_counted_in_the_report_and_by_the_monitor_when_the_run_may_go_on(tmp_path):
    """max_nonfinite_steps=None: a NaN on rank 1 at steps 2 and 3 only is skipped at ZeRO-0 and the run finishes."""
    run = run_fit(
        tmp_path,
        "--batch-sizes",
        "8",
        "8",
        "--samples",
        "128",
        "--stage",
        "0",
        "--nan-from",
        "1:2",
        "--nan-until",
        "4",
        "--monitor",
        "--strategy-args",
        '{"max_nonfinite_steps": null}',
    )
    assert run.returncode == 0, run.output[-3000:]
    report = json.loads(next(tmp_path.rglob("hetero/report.json")).read_text())
    assert report["nonfinite"]["skipped_steps"] == [2, 3] and report["summary"]["skipped_steps"] == 2
    assert "2 optimizer steps skipped for non-finite gradients (2, 3)" in run.output
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    logged = {int(r["step"]): float(r["hetero/skipped_steps"]) for r in rows if r.get("hetero/skipped_steps")}
    assert logged[1] == 0 and logged[2] == 1 and logged[3] == 2 and logged[7] == 2
    assert all(math.isfinite(v) for v in run.result["params"]["network.0.weight"][0])
