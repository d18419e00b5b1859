"""The per-rank micro-step planner (:mod:`lightning_hetero.split.decisions.micro_steps`), against brute force."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.split.decisions.micro_steps import (
    automatic_micro_steps_allowed,
    micro_steps_refusal,
    most_samples_within,
    plan_automatic_split_in_micro_steps,
    plan_micro_steps,
    rank_time,
    with_fixed_micro_steps,
)
from lightning_hetero.split.decisions.planner import plan_automatic_split, plan_min_max
from lightning_hetero.split.decisions.replan import Rebalancer


def brute_force(costs: list[CostModel], global_batch_size: int, minimum: int = 1) -> Optional[float]:
    """The lowest slowest-rank time over every composition of the batch into at least ``minimum`` samples per rank."""
    best = None
    for choice in itertools.product(range(minimum, global_batch_size + 1), repeat=len(costs)):
        if sum(choice) == global_batch_size:
            slowest = max(rank_time(c, n) for c, n in zip(costs, choice))
            best = slowest if best is None else min(best, slowest)
    return best


costs_strategy = st.builds(
    CostModel,
    fixed=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    per_sample=st.sampled_from([0.25, 1.0, 2.5]),
    max_batch=st.one_of(st.none(), st.integers(1, 5)),
)


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(costs_strategy, min_size=1, max_size=3), global_batch_size=st.integers(1, 11))
def test_the_plan_is_as_fast_as_brute_force_and_exact(costs, global_batch_size):
    if global_batch_size < len(costs):
        with pytest.raises(ValueError, match="smaller than the world size"):
            plan_micro_steps(costs, global_batch_size)
        return
    optimum = brute_force(costs, global_batch_size)
    plan = plan_micro_steps(costs, global_batch_size)
    assert plan.global_batch_size == global_batch_size
    assert all(n >= 1 for n in plan.samples)
    assert plan.predicted_step_time == optimum
    for cost, n, b, k, seconds in zip(costs, plan.samples, plan.batch_sizes, plan.micro_steps, plan.predicted_times):
        assert cost.max_batch is None or b <= cost.max_batch  # every micro-batch fits
        assert k == 1 or (k - 1) * cost.max_batch < n  # and no fewer micro-batches would
        assert seconds == k * cost.fixed + cost.per_sample * n


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(costs_strategy, min_size=1, max_size=3), global_batch_size=st.integers(1, 11))
def test_with_a_floor_of_two_samples_the_plan_is_brute_forces_over_the_splits_that_keep_it(costs, global_batch_size):
    if global_batch_size < len(costs):
        return  # (refused: the test above)
    plan = plan_micro_steps(costs, global_batch_size, minimum=2)
    floor = 2 if 2 * len(costs) <= global_batch_size else 1  # (one each when the batch cannot give every rank two)
    assert plan.global_batch_size == global_batch_size and min(plan.samples) >= floor
    assert plan.predicted_step_time == brute_force(costs, global_batch_size, floor)


def test_the_automatic_split_in_micro_steps_keeps_the_floor_of_two_samples():
    """Profiles a fit measured (2026-11-30): rank 1's larger fixed cost made the micro-step plan give it 1 sample of 32
    (31/1, every micro-step 1), beating the floored single split by 0.3 %; the floor of 2 was lost that way."""
    costs = [
        CostModel(fixed=0.0005443739566075018, per_sample=8.106037475344764e-06, max_batch=68761307),
        CostModel(fixed=0.00091892552268244, per_sample=3.7224122287968734e-06, max_batch=68761307),
    ]
    decision, steps = plan_automatic_split_in_micro_steps(costs, 32, min_gain=0.05)
    assert min(decision.planned.batch_sizes) >= 2 and sum(decision.planned.batch_sizes) == 32


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.builds(CostModel, fixed=st.floats(0, 2), per_sample=st.floats(1e-3, 1)), min_size=1, max_size=6),
    global_batch_size=st.integers(6, 500),
)
def test_without_a_memory_ceiling_it_is_the_min_max_plan_with_one_micro_step(costs, global_batch_size):
    plan = plan_micro_steps(costs, global_batch_size)
    assert plan.micro_steps == (1,) * len(costs)
    assert plan.global_batch_size == global_batch_size
    assert plan.predicted_step_time == plan_min_max(costs, global_batch_size).predicted_step_time


def test_a_memory_bound_fast_rank_takes_its_share_in_micro_steps():
    fast = CostModel(fixed=0.01, per_sample=0.001, max_batch=25)  # 2.5x faster, room for a quarter of the batch
    slow = CostModel(fixed=0.01, per_sample=0.0025)
    capped = plan_min_max([fast, slow], 100)
    plan = plan_micro_steps([fast, slow], 100)
    assert capped.batch_sizes == (25, 75)
    assert plan.micro_steps[0] > 1 and plan.micro_steps[1] == 1
    assert plan.batch_sizes[0] <= 25 and plan.global_batch_size == 100
    assert plan.predicted_step_time < 0.8 * capped.predicted_step_time


def test_most_samples_within_pays_the_fixed_cost_per_micro_step():
    cost = CostModel(fixed=1.0, per_sample=1.0, max_batch=4)
    assert most_samples_within(cost, 3.0, 100) == 2  # one micro-batch: 1 + 2
    assert most_samples_within(cost, 10.0, 100) == 8  # two micro-batches of 4: 2 + 8
    assert most_samples_within(cost, 10.0, 5) == 5  # capped
    assert most_samples_within(cost, 1.5, 100) == 0


def test_ten_thousand_ranks_of_four_kinds_are_planned_with_equal_devices_within_one_sample():
    kinds = [CostModel(0.01, 1e-3, 8), CostModel(0.01, 2e-3, 32), CostModel(0.02, 5e-3), CostModel(0.01, 1e-3)]
    costs = [kinds[r % 4] for r in range(10_000)]
    plan = plan_micro_steps(costs, 123_457)
    assert plan.global_batch_size == 123_457
    assert max(plan.batch_sizes[0::4]) <= 8
    for kind in range(4):
        assert max(plan.samples[kind::4]) - min(plan.samples[kind::4]) <= 1


def test_a_rank_slow_for_even_one_sample_takes_one_and_the_others_stay_balanced():
    slow = CostModel(fixed=8.0, per_sample=1.0)  # 9 s for its one sample: it sets the step time whatever the rest do
    fast, medium = CostModel(fixed=1.0, per_sample=0.01), CostModel(fixed=1.0, per_sample=0.04)
    plan = plan_micro_steps([fast, medium, slow], 501)
    assert plan.samples[2] == 1 and plan.predicted_step_time == 9.0
    # The other two are balanced with each other (not left at a sample each with the rest on one of them).
    assert abs(plan.predicted_times[0] - plan.predicted_times[1]) <= 0.04
    assert plan.samples[:2] == (400, 100)


# ---------------------------------------------------------------------------------------------------- the job's choices


def test_the_automatic_split_keeps_one_micro_step_where_no_ceiling_binds():
    costs = [CostModel(0.01, 0.001), CostModel(0.01, 0.0025)]
    decision, steps = plan_automatic_split_in_micro_steps(costs, 100, min_gain=0.05)
    assert steps == (1, 1)
    assert decision.planned.batch_sizes == plan_automatic_split(costs, 100).planned.batch_sizes


def test_the_automatic_split_takes_micro_steps_when_the_fast_ranks_ceiling_binds():
    fast, slow = CostModel(0.01, 0.001, max_batch=25), CostModel(0.01, 0.0025)
    decision, steps = plan_automatic_split_in_micro_steps([fast, slow], 100, min_gain=0.05)
    planned = plan_micro_steps([fast, slow], 100)
    assert (decision.planned.batch_sizes, steps) == (planned.samples, planned.micro_steps)
    assert steps[0] > 1 and not decision.kept_equal
    # The baseline is the equal split taken in as many micro-steps as memory needs (50 = 2 x 25 on the fast rank).
    assert decision.equal_split_step_time == max(rank_time(fast, 50), rank_time(slow, 50))


def test_the_automatic_split_in_micro_steps_runs_where_the_ceilings_hold_less_than_the_global_batch():
    costs = [CostModel(0.01, 0.001, max_batch=10), CostModel(0.01, 0.001, max_batch=10)]
    with pytest.raises(ValueError, match="does not fit"):
        plan_automatic_split(costs, 64)
    decision, steps = plan_automatic_split_in_micro_steps(costs, 64, min_gain=0.05)
    assert decision.planned.batch_sizes == (32, 32) and steps == (4, 4)
    assert decision.kept_equal  # equal devices: the equal split, in micro-steps


def test_fixed_micro_steps_plan_with_k_fixed_costs_and_k_times_the_ceiling():
    costs = with_fixed_micro_steps([CostModel(0.5, 0.1, max_batch=4), CostModel(0.5, 0.1)], [3, 1])
    assert costs == [CostModel(1.5, 0.1, max_batch=12), CostModel(0.5, 0.1)]
    plan = plan_min_max(costs, 20)
    assert plan.batch_sizes[0] <= 12 and sum(plan.batch_sizes) == 20


@pytest.mark.parametrize(
    ("micro_steps", "stage", "reduction", "automatic", "refused"),
    [
        (None, 3, "token_mean", False, None),
        ([1, 1], 3, "token_mean", False, None),
        ([3, 1], 0, "mean", True, None),
        ([3, 1], 2, "sum", True, None),
        ([2, 2], 3, "mean", True, None),  # equal counts: every rank gathers and reduces as often
        ([3, 1], 3, "mean", True, "ZeRO stage 3 cannot run"),
        ([3, 1], 1, "token_mean", True, "token_mean"),
        ([3, 1], 1, "mean", False, "manual optimization"),
    ],
)
def test_what_micro_steps_are_refused(micro_steps, stage, reduction, automatic, refused):
    message = micro_steps_refusal(micro_steps, stage, reduction, automatic)
    if refused is None:
        assert message is None
    else:
        assert refused in message and str(micro_steps) in message
    assert automatic_micro_steps_allowed(stage, reduction, automatic) == (
        stage < 3 and reduction != "token_mean" and automatic
    )


def test_synchronized_batchnorm_needs_as_many_passes_on_every_rank():
    message = micro_steps_refusal([3, 1], 2, "mean", True, sync_batchnorm=True)
    assert "`Trainer(sync_batchnorm=True)` exchanges BatchNorm statistics in every forward pass" in message
    assert micro_steps_refusal([2, 2], 2, "mean", True, sync_batchnorm=True) is None
    assert not automatic_micro_steps_allowed(2, "mean", True, sync_batchnorm=True)
    assert automatic_micro_steps_allowed(2, "mean", True, sync_batchnorm=False)


def test_a_rebalancer_in_micro_steps_moves_samples_to_a_memory_bound_fast_rank():
    fast, slow = CostModel(0.0, 1.0, max_batch=10), CostModel(0.0, 2.5)
    rebalancer = Rebalancer([fast, slow], (10, 30), window=2, threshold=0.05, micro_steps=True)
    # Measured as predicted: the fast rank 10 s, the slow one 75 s.
    steps = [{"step": s, "batch_sizes": [10, 30], "compute_seconds": [10.0, 75.0]} for s in range(4)]
    replan = rebalancer.consider(steps, 4)
    assert replan is not None
    expected = plan_micro_steps([fast, slow], 40)
    assert (replan.batch_sizes, replan.micro_steps) == (expected.samples, expected.micro_steps)
    assert replan.micro_steps[0] > 1
    assert rebalancer.micro_steps_of((20, 20)) == (2, 1)  # a checkpoint's split: as few as memory allows


def test_a_rebalancer_with_fixed_micro_steps_keeps_them():
    base = with_fixed_micro_steps([CostModel(0.0, 1.0), CostModel(0.0, 1.0)], (2, 1))
    rebalancer = Rebalancer(base, (20, 20), window=2, threshold=0.05, fixed_micro_steps=(2, 1))
    steps = [{"step": s, "batch_sizes": [20, 20], "compute_seconds": [20.0, 60.0]} for s in range(4)]
    replan = rebalancer.consider(steps, 4)
    assert replan is not None and replan.micro_steps == (2, 1) and replan.batch_sizes[0] > 20
    assert rebalancer.micro_steps_of((30, 10)) == (2, 1)


def test_a_rebalancer_with_fixed_micro_steps_never_leaves_a_rank_fewer_samples_than_its_micro_steps():
    base = with_fixed_micro_steps([CostModel(0.0, 1.0), CostModel(0.0, 1.0)], (1, 3))
    rebalancer = Rebalancer(base, (5, 3), window=2, threshold=0.05, fixed_micro_steps=(1, 3))
    # Rank 1 measured 100x slower: the planner would give it 1 sample, fewer than its 3 micro-steps.
    steps = [{"step": s, "batch_sizes": [5, 3], "compute_seconds": [5.0, 300.0]} for s in range(4)]
    assert rebalancer.consider(steps, 4) is None
