"""Telling a summed loss from a mean one by the first training steps (:mod:`lightning_hetero.watch.loss_reduction`):
the verdict, no false one on a loss that varies a lot between batches, and the check's gathers."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_hetero.watch.loss_reduction import (
    FIRST_CHECK,
    LAST_CHECK,
    LossReductionCheck,
    loss_scaling,
    mismatch_warning,
)

SIZES = (3, 13)


def steps_of(losses_for, count, sizes=SIZES, seed=0):
    """``count`` steps of ``(samples, loss)`` per rank, the loss drawn by ``losses_for(samples, rng)``."""
    rng = random.Random(seed)
    return [[(float(b), losses_for(b, rng)) for b in sizes] for _ in range(count)]


def summed(b, rng, spread=0.3):
    return sum(rng.lognormvariate(0.0, spread) for _ in range(b))  # each sample's loss, added


def averaged(b, rng, spread=0.3):
    return summed(b, rng, spread) / b


def between_batches(mean_loss, sigma):
    """A loss whose level changes a lot from one batch to the next (a factor e^N(0, sigma), on every rank apart)."""
    return lambda b, rng: mean_loss(b, rng) * rng.lognormvariate(0.0, sigma)


def test_a_sum_and_a_mean_are_told_apart_in_the_first_steps():
    assert loss_scaling(steps_of(summed, FIRST_CHECK)).reduction == "sum"
    assert loss_scaling(steps_of(averaged, FIRST_CHECK)).reduction == "mean"
    exact_sum = loss_scaling([[(3.0, 6.0), (13.0, 26.0)]] * 3)
    assert exact_sum.reduction == "sum" and exact_sum.slope == pytest.approx(1.0)
    assert loss_scaling([[(3.0, 0.7), (13.0, 0.7)]] * 3).reduction == "mean"


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_a_mean_loss_that_varies_a_lot_between_batches_never_looks_like_a_sum(sigma):
    """Over 300 runs of each noise level, neither check (10 steps, then 40) ever calls a mean loss a sum."""
    for seed in range(300):
        for count in (FIRST_CHECK, LAST_CHECK):
            scaling = loss_scaling(steps_of(between_batches(averaged, sigma), count, seed=seed))
            assert scaling.reduction != "sum", (sigma, seed, count, scaling)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_a_summed_loss_that_varies_a_lot_between_batches_never_looks_like_a_mean(sigma):
    found = []
    for seed in range(300):
        for count in (FIRST_CHECK, LAST_CHECK):
            scaling = loss_scaling(steps_of(between_batches(summed, sigma), count, seed=seed))
            assert scaling.reduction != "mean", (sigma, seed, count, scaling)
        found.append(scaling.reduction == "sum")
    # With a batch-to-batch factor of e^N(0, 0.5), 40 steps tell in 299 of 300 runs here; at e^N(0, 2) in 1 of 7.
    if sigma == 0.5:
        assert sum(found) >= 295


def test_steps_that_cannot_tell_are_left_out():
    # Equal micro-batches (a mean and a sum train alike), a loss of zero, of mixed signs, or not finite.
    assert loss_scaling([[(8.0, 1.0), (8.0, 3.0)]] * 10).reduction is None
    for bad in (
        [(3.0, 0.0), (13.0, 1.0)],
        [(3.0, -1.0), (13.0, 1.0)],
        [(3.0, math.nan), (13.0, 1.0)],
        [(math.nan, 1.0), (13.0, 1.0)],
    ):
        assert loss_scaling([bad] * 10).steps == 0
    # Losses of one sign, all negative: a negative summed loss still grows with the batch.
    assert loss_scaling([[(3.0, -6.0), (13.0, -26.0)]] * 3).reduction == "sum"
    # Fewer than three informative steps: no verdict.
    assert loss_scaling([[(3.0, 6.0), (13.0, 26.0)]] * 2).reduction is None


def test_the_warning_names_the_argument_to_pass_and_what_was_seen():
    scaling = loss_scaling([[(3.0, 6.0), (13.0, 26.0)]] * 3)
    warning = mismatch_warning(scaling, "mean")
    assert "HeteroStrategy(loss_reduction='sum')" in warning and "3 samples: loss 6" in warning
    assert "13 samples: loss 26" in warning and "slope of 1.00" in warning
    assert mismatch_warning(scaling, "sum") is None
    mean = loss_scaling([[(3.0, 0.7), (13.0, 0.7)]] * 3)
    assert "`loss_reduction='mean'` (the default)" in mismatch_warning(mean, "sum")
    assert mismatch_warning(mean, "mean") is None
    assert mismatch_warning(loss_scaling([]), "mean") is None


class TwoRanks:
    """The check's gather with a second rank whose losses ``other(step)`` gives (rank 1 takes 13 samples)."""

    def __init__(self, other):
        self.other, self.calls = other, []

    def __call__(self, mine):
        self.calls.append(len(mine))
        theirs = torch.tensor([[13.0, self.other(t)] for t in range(len(mine))], dtype=torch.float64)
        return [mine, theirs]


def run_steps(check, steps, loss_of_step, micro_batches=((3, 1.0),)):
    for step in range(steps):
        check.step_starts()
        for samples, share in micro_batches:
            check.loss(samples, torch.tensor(loss_of_step(step) * share))
    check.fit_ends()


def test_the_check_gathers_once_at_the_tenth_step_and_warns_once():
    gather, warnings = TwoRanks(lambda step: 26.0 + step), []
    check = LossReductionCheck("mean", gather, warnings.append)
    check.start(active=True)
    run_steps(check, 30, lambda step: 6.0 + step / 4)
    assert gather.calls == [FIRST_CHECK] and len(warnings) == 1 and "loss_reduction='sum'" in warnings[0]
    assert check.verdict.reduction == "sum" and not check.active


def test_an_undecided_first_check_is_followed_by_one_at_the_fit_end_or_the_last_check():
    noisy = random.Random(3)
    levels = [noisy.lognormvariate(0, 2.0) for _ in range(200)]
    gather = TwoRanks(lambda step: levels[2 * step + 1])
    check = LossReductionCheck("mean", gather, lambda message: None)
    check.start(active=True)
    run_steps(check, 25, lambda step: levels[2 * step])  # a mean loss, very noisy: 10 steps cannot tell
    assert gather.calls == [FIRST_CHECK, 25] and check.verdict.steps == 25
    gather = TwoRanks(lambda step: levels[2 * step + 1])
    check = LossReductionCheck("mean", gather, lambda message: None)
    check.start(active=True)
    run_steps(check, 60, lambda step: levels[2 * step])
    assert gather.calls == [FIRST_CHECK, LAST_CHECK] and check.verdict.steps == LAST_CHECK


def test_micro_batches_count_by_their_geometric_mean_and_a_short_fit_is_checked_at_its_end():
    gather, warnings = TwoRanks(lambda step: 26.0), []
    check = LossReductionCheck("mean", gather, warnings.append)
    check.start(active=True)
    # Rank 0 takes its 3 samples as 1 + 2, each micro-batch's summed loss 2 and 4 (geometric means: 1.41 samples,
    # loss 2.83: still a sum's slope against rank 1's 13 samples and 26).
    run_steps(check, 4, lambda step: 2.0, micro_batches=((1, 1.0), (2, 2.0)))
    assert gather.calls == [4] and check.verdict.reduction == "sum" and len(warnings) == 1


def test_an_inactive_check_never_gathers():
    gather = TwoRanks(lambda step: 26.0)
    check = LossReductionCheck("mean", gather, lambda message: None)
    check.start(active=False)
    run_steps(check, 20, lambda step: 6.0)
    token_mean = LossReductionCheck("token_mean", gather, lambda message: None)
    token_mean.start(active=True)
    run_steps(token_mean, 20, lambda step: 6.0)
    assert gather.calls == []
