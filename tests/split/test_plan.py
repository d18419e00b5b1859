"""Unit tests for lightning_hetero.split.decisions.split: the split of a global batch into per-rank micro-batches
(pure functions)."""

from __future__ import annotations

import dataclasses
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.split.decisions.split import (
    SplitPlan,
    check_split_arguments,
    loss_weight,
    resolve_split,
    split_by_weights,
)

FAST = settings(database=None, max_examples=100, deadline=None)

positive_weights = st.one_of(
    st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
    st.integers(min_value=1, max_value=1000),
)


def exact_quotas(total: int, weights) -> list[Fraction]:
    exact = [Fraction(w) for w in weights]
    return [total * w / sum(exact) for w in exact]


def hamilton_reference(total: int, weights) -> list[int]:
    """Largest remainders, ties to the lower rank, computed exactly (no minimum)."""
    quotas = exact_quotas(total, weights)
    parts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


@st.composite
def split_cases(draw):
    weights = draw(st.lists(positive_weights, min_size=1, max_size=8))
    minimum = draw(st.integers(min_value=0, max_value=3))
    total = draw(st.integers(min_value=minimum * len(weights), max_value=minimum * len(weights) + 200))
    return total, weights, minimum


# ---------------------------------------------------------------------------------------------- split_by_weights


@FAST
@given(split_cases())
def test_split_sums_to_total_and_respects_minimum(case):
    total, weights, minimum = case
    parts = split_by_weights(total, weights, minimum)
    assert len(parts) == len(weights)
    assert sum(parts) == total
    assert all(isinstance(p, int) for p in parts)
    assert all(p >= minimum for p in parts)


@FAST
@given(split_cases())
def test_split_parts_are_floor_or_ceil_of_quota_unless_lifted(case):
    total, weights, minimum = case
    parts = split_by_weights(total, weights, minimum)
    quotas = exact_quotas(total, weights)
    lifted = any(math.floor(q) < minimum for q in quotas)
    for part, quota in zip(parts, quotas):
        # Never more than the ceiling (or the minimum, when the minimum is what lifted it).
        assert part <= max(minimum, math.ceil(quota))
        if math.floor(quota) < minimum:
            assert part == minimum  # a lifted part gets the minimum, no more
        if not lifted:
            assert part in (math.floor(quota), math.ceil(quota))
    if not lifted:
        # Largest remainders get the ceilings, ties to the lower rank: the deterministic Hamilton result.
        assert parts == hamilton_reference(total, weights)


@FAST
@given(split_cases())
def test_split_is_deterministic(case):
    total, weights, minimum = case
    first = split_by_weights(total, weights, minimum)
    assert split_by_weights(total, list(weights), minimum) == first
    assert split_by_weights(total, tuple(weights), minimum) == first


@FAST
@given(st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=16))
def test_split_reproduces_integer_weights_that_sum_to_total(batch_sizes):
    assert split_by_weights(sum(batch_sizes), batch_sizes) == batch_sizes


@FAST
@given(st.lists(st.integers(min_value=1, max_value=100), min_size=1, max_size=8), st.integers(2, 5))
def test_split_is_exact_for_proportional_weights(batch_sizes, factor):
    # Integer multiples and power-of-two scaled float weights have integer quotas: no rounding at all.
    total = factor * sum(batch_sizes)
    assert split_by_weights(total, batch_sizes) == [factor * b for b in batch_sizes]
    assert split_by_weights(sum(batch_sizes), [b * 0.25 for b in batch_sizes]) == batch_sizes


@FAST
@given(st.integers(min_value=1, max_value=10), st.integers(min_value=0, max_value=200))
def test_split_with_equal_weights_differs_by_at_most_one_and_favours_low_ranks(count, extra):
    total = count + extra
    parts = split_by_weights(total, [1.0] * count)
    assert max(parts) - min(parts) <= 1
    assert parts == sorted(parts, reverse=True)  # ties go to the lower ranks


@pytest.mark.parametrize(
    ("total", "weights", "minimum", "expected"),
    [
        (10, [1, 1], 1, [5, 5]),
        (10, [1, 1, 1], 1, [4, 3, 3]),
        (4, [1, 1, 1], 1, [2, 1, 1]),
        (5, [1, 1, 1, 1], 1, [2, 1, 1, 1]),
        (10, [0.1, 0.2, 0.7], 1, [1, 2, 7]),
        (32, [1.0, 0.4], 1, [23, 9]),  # quotas 22.857, 9.143
        (10, [1000, 1], 1, [9, 1]),  # the minimum lifts rank 1 (quota 0.01)
        (10, [1000, 1], 0, [10, 0]),
        (6, [1, 1, 1, 1000], 1, [1, 1, 1, 3]),
        (7, [3, 3, 1], 2, [3, 2, 2]),  # the minimum lifts rank 2; a tie, so the higher rank gives one back
        (3, [5], 1, [3]),
        (0, [1, 2], 0, [0, 0]),
    ],
)
def test_split_explicit_cases(total, weights, minimum, expected):
    assert split_by_weights(total, weights, minimum) == expected


def test_split_tie_breaking_is_continuous_in_the_weights():
    # A negligible third weight must not flip which of two equal ranks gets the larger part.
    assert split_by_weights(4, [2, 2, 1e-20]) == split_by_weights(4, [2, 2, 1e-10]) == [2, 1, 1]
    assert split_by_weights(7, [3, 3, 1], 2) == split_by_weights(7, [3, 3, 1.0000001], 2) == [3, 2, 2]


def test_split_handles_extreme_finite_weights():
    assert split_by_weights(10, [1.7e308, 1.7e308]) == [5, 5]
    assert split_by_weights(4, [1e-310, 3e-310]) == [1, 3]
    assert split_by_weights(10, [1e300, 1e-300]) == [9, 1]


def test_split_rejects_impossible_requests():
    with pytest.raises(ValueError, match="at least one weight"):
        split_by_weights(4, [])
    with pytest.raises(ValueError, match=r"cannot split 3 into 4 parts of at least 1"):
        split_by_weights(3, [1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"cannot split 5 into 2 parts of at least 3"):
        split_by_weights(5, [1, 1], minimum=3)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "2"])
def test_split_rejects_invalid_weights(bad):
    with pytest.raises(ValueError, match="finite weights > 0"):
        split_by_weights(10, [1.0, bad])


# ---------------------------------------------------------------------------------------------- argument checks


def _raises(match_parts, function, *args, **kwargs):
    with pytest.raises(ValueError) as info:
        function(*args, **kwargs)
    for part in match_parts:
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"
    return info.value


@pytest.mark.parametrize(
    ("kwargs", "mentions"),
    [
        (dict(batch_sizes=[4, 4], weights=[1.0, 1.0]), ["batch_sizes=[4, 4]", "weights=[1.0, 1.0]"]),
        (dict(batch_sizes=[4, 0]), ["batch_sizes=[4, 0]", "[0]"]),
        (dict(batch_sizes=[4, -2]), ["batch_sizes=[4, -2]", "[-2]"]),
        (dict(batch_sizes=[4, 2.5]), ["batch_sizes=[4, 2.5]", "[2.5]"]),
        (dict(batch_sizes=[4, True]), ["batch_sizes=[4, True]", "[True]"]),
        (dict(batch_sizes=[4, "8"]), ["batch_sizes=[4, '8']", "['8']"]),
        (dict(batch_sizes=[]), ["batch_sizes=[]"]),
        (dict(global_batch_size=10, batch_sizes=[4, 4]), ["batch_sizes=[4, 4]", "sums to 8", "global_batch_size=10"]),
        (dict(weights=[1.0, 0.0]), ["weights=[1.0, 0.0]", "[0.0]"]),
        (dict(weights=[1.0, -0.5]), ["weights=[1.0, -0.5]", "[-0.5]"]),
        (dict(weights=[1.0, float("nan")]), ["weights=[1.0, nan]", "[nan]"]),
        (dict(weights=[float("inf"), 1.0]), ["weights=[inf, 1.0]", "[inf]"]),
        (dict(weights=[1.0, "x"]), ["weights=[1.0, 'x']"]),
        (dict(weights=[]), ["weights=[]"]),
        (dict(global_batch_size=0), ["global_batch_size=0"]),
        (dict(global_batch_size=-3), ["global_batch_size=-3"]),
        (dict(global_batch_size=8.0), ["global_batch_size=8.0"]),
        (dict(global_batch_size=True), ["global_batch_size=True"]),
    ],
)
def test_check_split_arguments_names_argument_and_value(kwargs, mentions):
    arguments = dict(global_batch_size=None, batch_sizes=None, weights=None) | kwargs
    _raises(mentions, check_split_arguments, **arguments)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(global_batch_size=32),
        dict(batch_sizes=[8, 24]),
        dict(global_batch_size=32, batch_sizes=[8, 24]),
        dict(weights=[1.0, 0.4]),
        dict(global_batch_size=7, weights=[3, 1]),
    ],
)
def test_check_split_arguments_accepts_valid_arguments(kwargs):
    assert check_split_arguments(**(dict(global_batch_size=None, batch_sizes=None, weights=None) | kwargs)) is None


@pytest.mark.parametrize(
    ("args", "kwargs", "mentions"),
    [
        ((2, 8), dict(batch_sizes=[4, 4], weights=[1, 1]), ["batch_sizes=[4, 4]", "weights=[1, 1]"]),
        ((3, 8), dict(batch_sizes=[4, 4]), ["batch_sizes=[4, 4]", "2 entries", "3"]),
        ((2, 8), dict(weights=[1.0, 1.0, 1.0]), ["weights=[1.0, 1.0, 1.0]", "3 entries", "2"]),
        ((4, 3), dict(), ["global_batch_size=3", "world size 4"]),
        ((4, 3), dict(weights=[1, 1, 1, 1]), ["global_batch_size=3", "world size 4"]),
        ((2, 0), dict(), ["global_batch_size=0"]),
        ((2, 9), dict(batch_sizes=[4, 4]), ["batch_sizes=[4, 4]", "sums to 8", "global_batch_size=9"]),
        ((2, 8), dict(batch_sizes=[8, 0]), ["batch_sizes=[8, 0]"]),
        ((2, 8), dict(weights=[1.0, 0.0]), ["weights=[1.0, 0.0]"]),
    ],
)
def test_resolve_split_errors(args, kwargs, mentions):
    _raises(mentions, resolve_split, *args, **kwargs)


def test_resolve_split_sources():
    assert resolve_split(2, 32, batch_sizes=[8, 24]) == SplitPlan((8, 24), "batch_sizes")
    assert resolve_split(2, 32, weights=[1.0, 3.0]) == SplitPlan((8, 24), "weights")
    assert resolve_split(3, 10) == SplitPlan((4, 3, 3), "equal")
    assert resolve_split(1, 5) == SplitPlan((5,), "equal")


@FAST
@given(st.integers(1, 8), st.integers(0, 100), st.data())
def test_resolve_split_properties(world_size, extra, data):
    global_batch_size = world_size + extra
    weights = data.draw(st.none() | st.lists(positive_weights, min_size=world_size, max_size=world_size))
    plan = resolve_split(world_size, global_batch_size, weights=weights)
    assert plan.world_size == world_size
    assert plan.global_batch_size == global_batch_size
    assert all(b >= 1 for b in plan.batch_sizes)
    assert isinstance(plan.batch_sizes, tuple)
    if weights is None:
        assert plan.source == "equal"
        assert max(plan.batch_sizes) - min(plan.batch_sizes) <= 1
    else:
        assert plan.source == "weights"
        assert list(plan.batch_sizes) == split_by_weights(global_batch_size, weights)
    # Explicit sizes round-trip through resolve_split unchanged.
    again = resolve_split(world_size, global_batch_size, batch_sizes=list(plan.batch_sizes))
    assert again.batch_sizes == plan.batch_sizes and again.source == "batch_sizes"


# ---------------------------------------------------------------------------------------------- SplitPlan


def test_split_plan_basics():
    plan = SplitPlan((8, 24), "batch_sizes")
    assert plan.global_batch_size == 32
    assert plan.world_size == 2
    assert plan.shares() == (0.25, 0.75)
    assert plan.loss_weight(0) == pytest.approx(0.5)
    assert plan.loss_weight(1) == pytest.approx(1.5)
    assert loss_weight(8, 32, 2) == pytest.approx(0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.batch_sizes = (1, 1)  # frozen: every rank must keep the same plan


@FAST
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.integers(0, 2**32 - 1))
def test_loss_weight_makes_equal_rank_average_the_full_batch_mean(batch_sizes, seed):
    plan = SplitPlan(tuple(batch_sizes), "batch_sizes")
    world = plan.world_size
    for rank, b in enumerate(batch_sizes):
        assert math.isclose(plan.loss_weight(rank), b * world / plan.global_batch_size)
    assert math.isclose(math.fsum(plan.loss_weight(r) for r in range(world)), world)
    assert math.isclose(math.fsum(plan.shares()), 1.0)
    # DeepSpeed averages the ranks' (weighted) mean losses with equal weight: that must be the full-batch mean.
    rng = random.Random(seed)
    losses = [[rng.uniform(0, 10) for _ in range(b)] for b in batch_sizes]
    rank_means = [math.fsum(rank_losses) / len(rank_losses) for rank_losses in losses]
    deepspeed_average = math.fsum(plan.loss_weight(r) * rank_means[r] for r in range(world)) / world
    full_mean = math.fsum(x for rank_losses in losses for x in rank_losses) / plan.global_batch_size
    assert math.isclose(deepspeed_average, full_mean, rel_tol=1e-9)


def test_numpy_integers_are_accepted_as_batch_sizes():
    import numpy

    plan = resolve_split(2, 32, [numpy.int64(8), 24])
    assert plan.batch_sizes == (8, 24)


def test_giving_both_batch_sizes_and_weights_is_reported_before_their_lengths():
    with pytest.raises(ValueError, match="both `batch_sizes"):
        resolve_split(3, 32, batch_sizes=[8, 24], weights=[1.0, 1.0])


def test_a_token_mean_is_weighted_by_tokens_and_counted_outside_the_loss():
    import torch

    from lightning_hetero.runtime.checks import token_count
    from lightning_hetero.split.decisions.split import loss_weight

    assert loss_weight(30, 40, 2, "token_mean") == 1.5 and loss_weight(10, 40, 2, "token_mean") == 0.5
    assert loss_weight(0, 0, 2, "token_mean") == 0.0  # no token anywhere: nothing to learn from this batch
    assert token_count({"loss": 1.0, "num_tokens": torch.tensor(7)}) == 7.0 and token_count({"num_tokens": 0}) == 0
    for bad in (torch.tensor(1.0), {"loss": 1.0}, {"num_tokens": -1}, {"num_tokens": torch.ones(2)}):
        with pytest.raises(ValueError, match="needs `training_step` to return the number of tokens"):
            token_count(bad)
