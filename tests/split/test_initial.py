"""The split a fit starts with: the user's, or the planner's from the profiles."""

from __future__ import annotations

import pytest

from lightning_hetero.measure.rank_profile import RankProfile
from lightning_hetero.split.decisions.initial import cost_models, initial_plan, rebalancer_for
from lightning_hetero.split.decisions.split import SplitPlan


def profile(per_sample, fixed=0.001, max_batch=None, loss_ratio=None):
    return RankProfile(
        batch_sizes=(2, 4),
        seconds=(fixed + 2 * per_sample, fixed + 4 * per_sample),
        fixed_seconds=fixed,
        seconds_per_sample=per_sample,
        max_batch=max_batch,
        bytes_per_sample=None,
        wall_seconds=0.1,
        loss_ratio=loss_ratio,
    )


def plan(**changes):
    arguments = dict(
        world_size=2,
        global_batch_size=30,
        batch_sizes=None,
        weights=None,
        profiles=None,
        loss_reduction="mean",
        identical_devices=False,
        held_bytes=0.0,
    )
    return initial_plan(**{**arguments, **changes})


def test_a_fixed_split_is_the_users_and_predicts_nothing():
    start = plan(batch_sizes=[20, 10])
    assert start.plan == SplitPlan((20, 10), source=start.plan.source) and start.prediction is None
    assert plan(weights=[2.0, 1.0]).plan.batch_sizes == (20, 10)


def test_the_automatic_split_gives_the_faster_rank_more_and_says_what_it_predicts():
    start = plan(profiles=[profile(0.001), profile(0.002)])
    assert start.plan.source == "auto" and start.plan.batch_sizes == (20, 10)
    assert start.prediction["speedup"] > 1.2 and len(start.prediction["rank_step_seconds"]) == 2


def test_identical_devices_keep_the_equal_split_unless_the_gain_is_large():
    start = plan(profiles=[profile(0.001), profile(0.00105)], identical_devices=True)
    assert start.plan.batch_sizes == (15, 15) and "equal" in start.plan.source and "same-model" in start.plan.source


def test_a_global_batch_smaller_than_the_ranks_is_refused_even_when_profiled():
    with pytest.raises(ValueError):
        plan(global_batch_size=1, profiles=[profile(0.001), profile(0.002)])


def test_a_sum_loss_declared_as_a_mean_is_warned_about():
    start = plan(profiles=[profile(0.001, loss_ratio=2.0), profile(0.002, loss_ratio=2.0)])
    assert start.warning and "sum" in start.warning


def test_the_re_planner_starts_from_the_profiles_or_from_time_proportional_to_the_batch():
    profiles = [profile(0.001), profile(0.002)]
    fixed = rebalancer_for(SplitPlan((20, 10), source="fixed"), None, 0.0, window=20, threshold=0.05)
    assert [cost.per_sample for cost in fixed.base_costs] == [1.0, 1.0]
    planned = rebalancer_for(SplitPlan((20, 10), source="auto"), profiles, 0.0, window=20, threshold=0.05)
    assert [cost.per_sample for cost in planned.base_costs] == [m.per_sample for m in cost_models(profiles, 0.0)]
