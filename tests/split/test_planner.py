"""Tests of the min-max batch planner (:mod:`lightning_hetero.split.decisions.planner`: ``plan_min_max`` and helpers).

The planner claims exactness, so the main check is against brute force: every composition of small batches.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Sequence
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.split.decisions.planner import (
    MIN_PREDICTED_GAIN,
    MIN_SAMPLES_PER_RANK,
    PlannedSplit,
    equal_split_time,
    plan_automatic_split,
    plan_min_max,
    predicted_step_time,
    predicted_times,
    rank_floors,
    required_gain,
)
from lightning_hetero.split.decisions.split import split_by_weights

# Values that collide often (dyadic, so sums are exact) next to ones that round (0.1, 0.3): ties between ranks
# exercise the tie-break, rounding exercises the "compare only computed times" rule.
NICE_FIXED = [0.0, 0.5, 1.0, 2.0, 3.0, 0.1, 0.3]
NICE_PER_SAMPLE = [0.25, 0.5, 1.0, 1.5, 2.0, 0.1, 0.3]


def random_cost(rng: random.Random, max_ceiling: int = 6) -> CostModel:
    fixed = rng.choice(NICE_FIXED) if rng.random() < 0.6 else rng.uniform(0.0, 3.0)
    per_sample = rng.choice(NICE_PER_SAMPLE) if rng.random() < 0.6 else rng.uniform(0.05, 3.0)
    max_batch = None if rng.random() < 0.4 else rng.randint(1, max_ceiling)
    return CostModel(fixed, per_sample, max_batch)


def compositions(costs: Sequence[CostModel], total: int):
    """Every split of ``total`` with ``1 <= b_r <= max_batch_r``."""
    ranges = [range(1, (total if c.max_batch is None else min(total, c.max_batch)) + 1) for c in costs[:-1]]
    last = costs[-1]
    for head in itertools.product(*ranges):
        rest = total - sum(head)
        if rest >= 1 and (last.max_batch is None or rest <= last.max_batch):
            yield (*head, rest)


def brute_force(
    costs: Sequence[CostModel], total: int, minimum: int = 1
) -> Optional[tuple[tuple[float, ...], tuple[int, ...]]]:
    """The lexicographically smallest slowest-first time vector, and the lexicographically largest split reaching it,
    among the splits that give every rank its floor (:func:`rank_floors`; one each with ``minimum`` 1)."""
    floors = rank_floors(costs, total, minimum)
    best = None
    for sizes in compositions(costs, total):
        if any(b < f for b, f in zip(sizes, floors)):
            continue
        key = (tuple(sorted((c.time(b) for c, b in zip(costs, sizes)), reverse=True)), tuple(-b for b in sizes))
        if best is None or key < best:
            best = key
    if best is None:
        return None
    return best[0], tuple(-b for b in best[1])


def strictly_increasing(cost: CostModel, upto: int) -> bool:
    return all(cost.time(k) < cost.time(k + 1) for k in range(1, upto))


def assert_valid(costs: Sequence[CostModel], total: int, plan: PlannedSplit) -> None:
    assert len(plan.batch_sizes) == len(costs)
    assert sum(plan.batch_sizes) == total == plan.global_batch_size
    for cost, size in zip(costs, plan.batch_sizes):
        assert isinstance(size, int) and size >= 1
        assert cost.max_batch is None or size <= cost.max_batch
    assert plan.predicted_times == predicted_times(costs, plan.batch_sizes)
    assert plan.predicted_step_time == max(plan.predicted_times) == predicted_step_time(costs, plan.batch_sizes)


def greedy_reference_max(costs: Sequence[CostModel], total: int) -> float:
    """Optimal max by a different exact method: take the ``total - W`` cheapest optional samples one at a time."""
    sizes = [1] * len(costs)
    worst = max(c.time(1) for c in costs)
    heap = [(c.time(2), r) for r, c in enumerate(costs) if c.max_batch is None or c.max_batch >= 2]
    heapq.heapify(heap)
    for _ in range(total - len(costs)):
        cost_of_sample, r = heapq.heappop(heap)
        worst = max(worst, cost_of_sample)
        sizes[r] += 1
        if costs[r].max_batch is None or sizes[r] < costs[r].max_batch:
            heapq.heappush(heap, (costs[r].time(sizes[r] + 1), r))
    return worst


# --------------------------------------------------------------------------------------------- exactness vs brute force


def test_matches_brute_force_on_all_small_cases():
    rng = random.Random(20240611)
    checked = infeasible = 0
    for _ in range(600):
        world_size = rng.randint(1, 4)
        costs = [random_cost(rng) for _ in range(world_size)]
        total = rng.randint(world_size, 14)
        expected = brute_force(costs, total)
        if expected is None:
            infeasible += 1
            with pytest.raises(ValueError, match="does not fit"):
                plan_min_max(costs, total)
            continue
        best_times, best_sizes = expected
        plan = plan_min_max(costs, total)
        assert_valid(costs, total, plan)
        assert plan.predicted_step_time == best_times[0], (costs, total, plan)
        if all(strictly_increasing(c, total) for c in costs):
            # The documented tie-break: leximax-optimal times, extra samples to lower ranks among equals.
            assert tuple(sorted(plan.predicted_times, reverse=True)) == best_times, (costs, total, plan)
            assert plan.batch_sizes == best_sizes, (costs, total, plan)
        checked += 1
    assert checked > 400 and infeasible > 0


def test_max_is_exact_when_float_rounding_makes_times_plateau():
    # ulp(1e16) is 2, so 1e16 + 0.5 * k takes the same value for several consecutive k: times only weakly increase.
    rng = random.Random(7)
    for _ in range(200):
        world_size = rng.randint(1, 4)
        costs = [
            CostModel(rng.choice([1e16, 1e16 + 2, 0.0]), rng.choice([0.5, 1.0, 0.75, 3.0]), rng.choice([None, 3, 6]))
            for _ in range(world_size)
        ]
        total = rng.randint(world_size, 14)
        expected = brute_force(costs, total)
        if expected is None:
            continue
        plan = plan_min_max(costs, total)
        assert_valid(costs, total, plan)
        assert plan.predicted_step_time == expected[0][0], (costs, total, plan)


@settings(max_examples=150, deadline=None)
@given(
    models=st.lists(
        st.tuples(
            st.floats(0.0, 50.0),
            st.floats(1e-4, 10.0),
            st.one_of(st.none(), st.integers(1, 80)),
        ),
        min_size=1,
        max_size=12,
    ),
    extra=st.integers(0, 300),
)
def test_max_matches_greedy_reference_on_medium_cases(models, extra):
    costs = [CostModel(fixed, per_sample, ceiling) for fixed, per_sample, ceiling in models]
    total = len(costs) + extra
    capacity = math.inf if any(c.max_batch is None for c in costs) else sum(c.max_batch for c in costs)
    if total > capacity:
        with pytest.raises(ValueError, match="does not fit"):
            plan_min_max(costs, total)
        return
    plan = plan_min_max(costs, total)
    assert_valid(costs, total, plan)
    assert plan.predicted_step_time == greedy_reference_max(costs, total)


def test_largest_batch_within_matches_a_scan():
    rng = random.Random(3)
    for _ in range(2000):
        cost = CostModel(
            rng.choice([0.0, 0.1, 1.0, 1e6, 1e16, rng.uniform(0, 5)]),
            rng.choice([1e-12, 0.1, 0.3, 0.5, 1.0, rng.uniform(1e-3, 5)]),
            rng.choice([None, rng.randint(1, 60)]),
        )
        cap = rng.randint(0, 60)
        # Limits right at, just below and just above computed times: where rounding would bite.
        k = rng.randint(1, 60)
        limit = rng.choice(
            [cost.time(k), math.nextafter(cost.time(k), -math.inf), math.nextafter(cost.time(k), math.inf)]
        )
        high = cap if cost.max_batch is None else min(cap, cost.max_batch)
        expected = max([0] + [b for b in range(1, high + 1) if cost.time(b) <= limit])
        assert cost.largest_batch_within(limit, cap) == expected, (cost, limit, cap)


# ------------------------------------------------------------------------------------------------------- odd shapes


def test_one_very_slow_rank_gets_one_sample_and_the_rest_share_evenly():
    costs = [CostModel(0.0, 100.0)] + [CostModel(0.0, 1.0)] * 3
    plan = plan_min_max(costs, 40)
    assert plan.batch_sizes == (1, 13, 13, 13)
    assert plan.predicted_step_time == 100.0


def test_huge_fixed_cost_rank_keeps_its_compulsory_sample_only():
    costs = [CostModel(1000.0, 1.0), CostModel(0.0, 1.0)]
    plan = plan_min_max(costs, 100)
    assert plan.batch_sizes == (1, 99)
    assert plan.predicted_times == (1001.0, 99.0)


def test_binding_ceiling_moves_work_to_the_slower_rank():
    costs = [CostModel(0.0, 1.0, max_batch=10), CostModel(0.0, 3.0)]
    unbounded = plan_min_max([CostModel(0.0, 1.0), CostModel(0.0, 3.0)], 40)
    assert unbounded.batch_sizes == (30, 10)
    plan = plan_min_max(costs, 40)
    assert plan.batch_sizes == (10, 30)
    assert plan.predicted_step_time == 90.0


def test_every_ceiling_full():
    costs = [CostModel(0.0, 1.0, max_batch=4), CostModel(5.0, 1.0, max_batch=3), CostModel(0.0, 9.0, max_batch=2)]
    assert plan_min_max(costs, 9).batch_sizes == (4, 3, 2)


@pytest.mark.parametrize("world_size,total", [(2, 5), (4, 10), (7, 100), (8, 8), (16, 1000), (5, 1003)])
@pytest.mark.parametrize("ceiling", [None, 300])
def test_identical_devices_get_the_equal_split(world_size, total, ceiling):
    costs = [CostModel(0.2, 0.01, max_batch=ceiling)] * world_size
    plan = plan_min_max(costs, total)
    assert list(plan.batch_sizes) == split_by_weights(total, [1.0] * world_size)
    assert max(plan.batch_sizes) - min(plan.batch_sizes) <= 1
    assert list(plan.batch_sizes) == sorted(plan.batch_sizes, reverse=True)  # extras go to the lower ranks
    assert plan.predicted_step_time == equal_split_time(costs, total)


def test_single_rank_takes_everything():
    plan = plan_min_max([CostModel(0.5, 0.25)], 17)
    assert plan.batch_sizes == (17,)
    assert plan.predicted_step_time == 0.5 + 0.25 * 17
    assert plan_min_max([CostModel(0.5, 0.25, max_batch=17)], 17).batch_sizes == (17,)


def test_global_batch_equal_to_world_size_gives_one_each():
    costs = [CostModel(0.0, 1.0), CostModel(3.0, 0.1), CostModel(0.0, 5.0, max_batch=1)]
    assert plan_min_max(costs, 3).batch_sizes == (1, 1, 1)


def test_large_world_and_batch_plan_quickly():
    rng = random.Random(11)
    costs = [
        CostModel(rng.uniform(0.0, 0.5), rng.uniform(1e-4, 1e-2), rng.choice([None, rng.randint(5_000, 50_000)]))
        for _ in range(1024)
    ]
    total = 10**7
    # The work, not the wall clock (a loaded machine stretches that): the planner searches the time level in at most
    # 64 feasibility checks of O(W) evaluations each, never a loop over the 10^7 samples.
    evaluations = [0]
    real_time = CostModel.time

    def counted(self, batch_size):
        evaluations[0] += 1
        return real_time(self, batch_size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CostModel, "time", counted)
        plan = plan_min_max(costs, total)
    assert_valid(costs, total, plan)
    assert evaluations[0] <= 64 * 8 * len(costs), f"planning W=1024, B=1e7 evaluated {evaluations[0]} step times"
    # Optimality certificate without brute force: one sample fewer on every rank at the max would leave too few.
    bottleneck = plan.predicted_step_time
    room_below = sum(c.largest_batch_within(math.nextafter(bottleneck, -math.inf), total) for c in costs)
    assert room_below < total


def test_same_input_same_output():
    rng = random.Random(5)
    costs = [random_cost(rng, max_ceiling=500) for _ in range(50)]
    copies = [CostModel(c.fixed, c.per_sample, c.max_batch) for c in costs]
    assert plan_min_max(costs, 3000) == plan_min_max(costs, 3000) == plan_min_max(copies, 3000)


def test_permuting_ranks_permutes_the_plan():
    rng = random.Random(9)
    # Generic random floats: no two ranks share a time, so the optimum is unique and must move with its rank.
    costs = [CostModel(rng.uniform(0, 1), rng.uniform(0.001, 0.1), rng.choice([None, 400])) for _ in range(40)]
    plan = plan_min_max(costs, 5000)
    for _ in range(5):
        order = list(range(len(costs)))
        rng.shuffle(order)
        shuffled = plan_min_max([costs[i] for i in order], 5000)
        assert shuffled.batch_sizes == tuple(plan.batch_sizes[i] for i in order)


def test_permuting_identical_ranks_keeps_the_split_per_device_type():
    fast, slow = CostModel(0.1, 0.01), CostModel(0.1, 0.03)
    rng = random.Random(2)
    kinds = [fast] * 5 + [slow] * 3
    reference = None
    for _ in range(6):
        rng.shuffle(kinds)
        plan = plan_min_max(kinds, 203)
        per_kind = {
            kind: sorted((b for k, b in zip(kinds, plan.batch_sizes) if k == kind), reverse=True)
            for kind in (fast, slow)
        }
        assert reference is None or per_kind == reference
        reference = per_kind
        for kind in (fast, slow):  # among identical ranks the lower rank never holds fewer samples
            sizes = [b for k, b in zip(kinds, plan.batch_sizes) if k == kind]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


# ---------------------------------------------------------------------------------------------------------- speedup


def test_speedup_over_the_equal_split():
    costs = [CostModel(0.0, 1.0), CostModel(0.0, 2.5)]
    plan = plan_min_max(costs, 70)
    assert plan.batch_sizes == (50, 20)
    assert plan.predicted_times == (50.0, 50.0)
    equal = equal_split_time(costs, 70)  # 35 samples each: 35 s and 87.5 s
    assert equal == 87.5
    assert plan.speedup_over(equal) == pytest.approx(1.75)


def test_equal_split_that_breaks_a_ceiling_is_infinitely_slow():
    costs = [CostModel(0.0, 1.0), CostModel(0.0, 1.0, max_batch=10)]
    assert equal_split_time(costs, 40) == math.inf
    plan = plan_min_max(costs, 40)
    assert plan.batch_sizes == (30, 10)
    assert plan.speedup_over(equal_split_time(costs, 40)) == math.inf


def test_predicted_times_marks_only_the_overfull_rank():
    costs = [CostModel(0.0, 1.0), CostModel(0.0, 1.0, max_batch=10)]
    assert predicted_times(costs, [5, 11]) == (5.0, math.inf)


# ----------------------------------------------------------------------------------------------------------- errors


def test_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match=r"`global_batch_size=2` is smaller than the world size 3"):
        plan_min_max([CostModel(0.0, 1.0)] * 3, 2)


def test_more_samples_than_the_ceilings_hold():
    costs = [CostModel(0.0, 1.0, max_batch=8), CostModel(0.0, 2.0, max_batch=4)]
    with pytest.raises(ValueError) as error:
        plan_min_max(costs, 20)
    message = str(error.value)
    assert "global_batch_size=20" in message and "at most 12 samples" in message
    assert "max_batch=[8, 4]" in message
    assert "add devices" in message and "gradient accumulation" in message and "2 accumulation steps" in message
    assert plan_min_max(costs, 12).batch_sizes == (8, 4)  # exactly full is fine


def test_one_unbounded_rank_makes_any_batch_fit():
    costs = [CostModel(0.0, 1.0, max_batch=2), CostModel(0.0, 2.0)]
    assert plan_min_max(costs, 1000).batch_sizes == (2, 998)


@pytest.mark.parametrize(
    "fields,pattern",
    [
        ((-0.1, 1.0, None), r"`fixed=-0\.1`"),
        ((math.inf, 1.0, None), r"`fixed=inf`"),
        ((math.nan, 1.0, None), r"`fixed=nan`"),
        (("1", 1.0, None), r"`fixed='1'`"),
        ((0.0, 0.0, None), r"`per_sample=0\.0`"),
        ((0.0, -2.0, None), r"`per_sample=-2\.0`"),
        ((0.0, math.inf, None), r"`per_sample=inf`"),
        ((0.0, True, None), r"`per_sample=True`"),
        ((0.0, 1.0, 0), r"`max_batch=0`: the device cannot hold even one sample"),
        ((0.0, 1.0, -3), r"`max_batch=-3`"),
        ((0.0, 1.0, 2.5), r"`max_batch=2\.5`"),
    ],
)
def test_bad_cost_model_fields(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        CostModel(*fields)


def test_cost_model_stores_floats():
    cost = CostModel(1, 2, 3)
    assert type(cost.fixed) is float and type(cost.per_sample) is float and cost.max_batch == 3
    assert cost.time(4) == 9.0


@pytest.mark.parametrize("total", [0, -5, 2.0, True, None])
def test_bad_global_batch_size(total):
    with pytest.raises(ValueError, match="global_batch_size"):
        plan_min_max([CostModel(0.0, 1.0)], total)


def test_bad_costs_argument():
    with pytest.raises(ValueError, match="no cost models"):
        plan_min_max([], 4)
    with pytest.raises(ValueError, match="one CostModel per rank"):
        plan_min_max([1.0, 2.0], 4)


def test_predicted_step_time_rejects_mismatched_or_empty_sizes():
    costs = [CostModel(0.0, 1.0)] * 2
    with pytest.raises(ValueError, match=r"2 cost models but 3 batch sizes"):
        predicted_step_time(costs, [1, 2, 3])
    with pytest.raises(ValueError, match=r"hold \[0\]"):
        predicted_step_time(costs, [0, 2])


# ---------------------------------------------------------------- the automatic split's decision


def test_automatic_split_keeps_equal_when_the_gain_is_within_noise():
    # Identical devices whose measurements differ by 1%: the planner's uneven split would gain under 5%.
    costs = [CostModel(fixed=0.001, per_sample=1.00e-4), CostModel(fixed=0.001, per_sample=1.01e-4)]
    decision = plan_automatic_split(costs, 128)
    assert decision.kept_equal
    assert decision.planned.batch_sizes == (64, 64)
    assert decision.predicted_speedup == pytest.approx(1.0)
    assert decision.planned.predicted_step_time == pytest.approx(predicted_step_time(costs, [64, 64]))


def test_automatic_split_follows_the_planner_when_the_gain_is_real():
    costs = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=2.5)]
    decision = plan_automatic_split(costs, 70)
    assert not decision.kept_equal
    assert decision.planned == plan_min_max(costs, 70)
    assert decision.predicted_speedup == pytest.approx(87.5 / 50)


def test_automatic_split_never_keeps_an_equal_split_that_breaks_a_memory_ceiling():
    # Same speed, but rank 1 holds at most 20 samples: the equal split (35, 35) cannot run.
    costs = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=1.0, max_batch=20)]
    decision = plan_automatic_split(costs, 70)
    assert not decision.kept_equal
    assert decision.planned.batch_sizes == (50, 20)
    assert decision.equal_split_step_time == math.inf


@pytest.mark.parametrize("min_gain", [0.0, 0.2, 0.5])
def test_automatic_split_threshold_is_respected(min_gain):
    costs = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=1.5)]  # plan gains 1.2x
    decision = plan_automatic_split(costs, 100, min_gain=min_gain)
    predicted_gain = decision.equal_split_step_time / plan_min_max(costs, 100).predicted_step_time
    assert decision.kept_equal == (predicted_gain < 1 + min_gain)


def test_the_decision_records_the_gain_it_required():
    costs = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=1.5)]
    assert plan_automatic_split(costs, 100, min_gain=0.3).min_gain == 0.3
    assert plan_automatic_split(costs, 100).min_gain == MIN_PREDICTED_GAIN


def test_same_model_devices_need_a_wide_margin_to_leave_the_equal_split():
    """Two ranks of one GPU model whose profiles differ by 15 % (a transient on a shared host, say): the planner
    would gain about 7 %, which is enough for different devices, not for devices presumed equally fast."""
    assert required_gain(same_model=False) == MIN_PREDICTED_GAIN
    assert required_gain(same_model=True) > 3 * MIN_PREDICTED_GAIN
    noisy = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=1.15)]
    assert plan_automatic_split(noisy, 200, min_gain=required_gain(same_model=True)).planned.batch_sizes == (100, 100)
    assert plan_automatic_split(noisy, 200, min_gain=required_gain(same_model=False)).planned.batch_sizes == (107, 93)
    # A same-model rank that is really 1.6x slower (a throttled board) is still split around.
    throttled = [CostModel(fixed=0.0, per_sample=1.0), CostModel(fixed=0.0, per_sample=1.6)]
    assert not plan_automatic_split(throttled, 200, min_gain=required_gain(same_model=True)).kept_equal


# ------------------------------------------------------------------------------------- the floor of samples per rank


def test_a_floor_of_samples_per_rank_matches_brute_force_on_all_small_cases():
    rng = random.Random(20261130)
    checked = floored = 0
    for _ in range(600):
        world_size = rng.randint(1, 4)
        costs = [random_cost(rng) for _ in range(world_size)]
        total = rng.randint(world_size, 14)
        minimum = rng.choice([2, 3])
        expected = brute_force(costs, total, minimum)
        if expected is None:
            with pytest.raises(ValueError, match="does not fit"):
                plan_min_max(costs, total, minimum)
            continue
        plan = plan_min_max(costs, total, minimum)
        assert_valid(costs, total, plan)
        floors = rank_floors(costs, total, minimum)
        assert all(b >= f for b, f in zip(plan.batch_sizes, floors))
        assert plan.predicted_step_time == expected[0][0], (costs, total, minimum, plan)
        if all(strictly_increasing(c, total) for c in costs):
            assert plan.batch_sizes == expected[1], (costs, total, minimum, plan)
        floored += any(f > 1 for f in floors)
        checked += 1
    assert checked > 400 and floored > 200


def test_a_very_slow_rank_gets_two_samples_not_one_when_the_batch_allows():
    """The automatic split and the re-planner never leave a rank one sample (an unsynchronized BatchNorm fails on
    it) unless the batch is too small for two each or the rank's memory holds one."""
    costs = [CostModel(0.0, 100.0)] + [CostModel(0.0, 1.0)] * 3
    assert plan_min_max(costs, 40).batch_sizes == (1, 13, 13, 13)  # (the bare planner: one is the least)
    assert plan_automatic_split(costs, 40).planned.batch_sizes == (2, 13, 13, 12)
    assert plan_automatic_split(costs, 7).planned.batch_sizes == (1, 2, 2, 2)  # (too small for two each)
    bounded = [CostModel(0.0, 100.0, max_batch=1)] + [CostModel(0.0, 1.0)] * 3
    assert plan_automatic_split(bounded, 40).planned.batch_sizes == (1, 13, 13, 13)
    assert rank_floors(bounded, 40, MIN_SAMPLES_PER_RANK) == [1, 2, 2, 2]
    assert rank_floors(costs, 7, MIN_SAMPLES_PER_RANK) == [1, 1, 1, 1]
