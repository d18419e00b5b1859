"""The search of the split on the measured step (lightning_hetero.split.decisions.explore), on a fake clock.

The simulated job: each rank's own work per step is ``fixed + per_sample * samples``, the step is the slowest rank's
plus an exchange, each time with a random noise factor (and now and then a large outlier); a rank's arrival at the
exchange is its own work. A window is ``WINDOW`` such steps under one split, fed to the search as the re-planner
feeds it; the search's answer is the split of the next window.
"""

from __future__ import annotations

import random

import pytest

from lightning_hetero.split.decisions.explore import StepSearch, Window, late_and_early, level_of, moved, window_of

WINDOW = 20  # (the re-planner's default window)
BATCH = 512


def step_time(work, split):
    return max(fixed + per_sample * n for (fixed, per_sample), n in zip(work, split)) + 0.002


def simulate(work, search, split, windows, seed, noise=0.08, outliers=0.03, start=0):
    """Run ``windows`` windows from ``split``; ``work(window)`` gives every rank's (fixed, per sample) seconds. Returns
    the split of every window, in order."""
    rng = random.Random(seed)
    splits = []
    for index in range(start, start + windows):
        splits.append(split)
        steps = []
        for step in range(WINDOW):
            factor = rng.lognormvariate(0, noise) * (rng.uniform(2, 6) if rng.random() < outliers else 1)
            own = [
                (fixed + per_sample * n) * rng.lognormvariate(0, noise)
                for (fixed, per_sample), n in zip(work(index), split)
            ]
            steps.append(
                {
                    "step": index * WINDOW + step,
                    "batch_sizes": list(split),
                    "arrival_seconds": own,
                    "step_seconds": (max(own) + 0.002) * factor,
                }
            )
        decided = search.decide(window_of(steps))
        split = decided if decided is not None else split
    return splits


def best_split(work):
    return min(((BATCH - n, n) for n in range(1, BATCH)), key=lambda split: step_time(work, split))


EQUAL = (BATCH // 2, BATCH // 2)
SAME = [(0.002, 0.00004)] * 2
# Rank 1 held to 40 % of a core: its whole own work takes 2.5x as long.
HELD = [(0.002, 0.00004), (0.005, 0.0001)]


def test_a_windows_level_its_error_and_the_late_rank():
    level, error = level_of([0.010, 0.011, 0.009, 0.010])
    assert level == pytest.approx(0.010) and 0 < error < 0.001
    assert late_and_early([[0.004, 0.010], [0.0042, 0.0098], [0.0039, 0.0103]] * 3, 0.012) == (1, 0)
    assert late_and_early([[0.004, 0.010], [0.010, 0.004]] * 5, 0.012) == (None, None)  # taking turns
    assert late_and_early([[0.004, 0.0045]] * 10, 0.012) == (None, None)  # within the exchange's jitter
    assert late_and_early([[0.0, 0.0]] * 10, 0.012) == (None, None)  # nothing timed
    steps = [
        {"step": k, "batch_sizes": [8, 8], "step_seconds": 0.01, "arrival_seconds": [0.004, 0.009]}
        for k in range(WINDOW)
    ]
    assert window_of(steps) == Window((8, 8), 0.01, 0.0, 1, 0, pytest.approx(0.005), 0.0)
    assert window_of(steps[:3]) is None  # (too few steps, the first left out)
    assert moved((10, 6), 1, 0, 8) == (15, 1) and moved((10, 1), 1, 0, 4) is None


@pytest.mark.parametrize("seed", range(5))
def test_a_held_rank_is_searched_away_from_to_within_5_percent_of_the_best_split_and_the_split_stays(seed):
    """From the equal split (what the plan gives ranks whose compute clocks agree), 40 % slower than the best: the
    search moves samples off the late rank, settles within 5 % of the best split's step, within its budget; over the
    next 100 windows under noise, what it tries again costs under 2 % of their time."""
    search = StepSearch(BATCH)
    splits = simulate(lambda window: HELD, search, EQUAL, windows=40, seed=seed)
    best = best_split(HELD)
    assert step_time(HELD, EQUAL) / step_time(HELD, best) > 1.4
    assert step_time(HELD, splits[-1]) <= 1.05 * step_time(HELD, best)
    assert search.settled and search.trials <= search.max_trials
    later = simulate(lambda window: HELD, search, splits[-1], windows=100, seed=seed + 100)
    assert sum(step_time(HELD, split) for split in later) <= 1.02 * 100 * step_time(HELD, splits[-1])


@pytest.mark.parametrize("seed", range(5))
def test_identical_ranks_never_start_a_search(seed):
    """They take turns being last at the exchange: nothing says which way to move, so nothing is tried."""
    search = StepSearch(BATCH)
    splits = simulate(lambda window: SAME, search, EQUAL, windows=100, seed=seed, noise=0.15)
    assert set(splits) == {EQUAL} and search.trials == 0


@pytest.mark.parametrize("seed", range(5))
def test_a_throttle_that_comes_and_goes_is_followed_both_ways(seed):
    """Rank 1 is held from window 20 to window 80: the settled split's level drifts, the search starts again, moves
    off rank 1, and after the throttle lifts drifts back toward the equal split."""
    search = StepSearch(BATCH)

    def work(window):
        return HELD if 20 <= window < 80 else SAME

    splits = simulate(work, search, EQUAL, windows=140, seed=seed)
    assert set(splits[:21]) == {EQUAL}
    assert step_time(HELD, splits[79]) <= 1.05 * step_time(HELD, best_split(HELD))
    assert step_time(SAME, splits[-1]) <= 1.05 * step_time(SAME, EQUAL)


def test_the_exploration_budget_bounds_the_trials_of_one_search():
    """A landscape that keeps rewarding moves (rank 1 ever later) still stops after ``max_trials``."""
    search = StepSearch(BATCH, max_trials=5, first_move=32)
    simulate(lambda window: [(0.0, 0.00001), (0.02, 0.001)], search, EQUAL, windows=30, seed=0, noise=0.01, outliers=0)
    per_search = [
        sum(entry["search"] == number for entry in search.history) for number in range(1, search.searches + 1)
    ]
    assert per_search[0] == 5 and max(per_search) <= 5


def test_a_first_trial_toward_a_held_rank_moves_a_quarter_as_much():
    """Past the share its quota carries a held rank's step jumps by a period of the quota: the search edges toward
    it (a quarter of the first move) and moves off it in full."""
    toward = StepSearch(BATCH)
    assert toward.decide(Window((480, 32), 0.020, 0.0002, late=0, early=1, lateness=0.01, held=1)) == (464, 48)
    away = StepSearch(BATCH)
    assert away.decide(Window((256, 256), 0.050, 0.0005, late=1, early=0, lateness=0.02, held=1)) == (320, 192)


def test_a_settled_search_starts_again_on_a_late_rank_only_when_it_is_later_than_where_it_settled():
    """Settled with rank 0 last by 10 ms (the trials toward rank 1 were measured no faster), windows that leave rank 0
    last by as much do not start it again (it tried every few windows, each time a window of slow steps at a quota);
    rank 0 later by beyond the noise (the other rank's throttle lifted) does, as does another rank late."""

    def window(lateness, late=0, level=0.020):
        return Window((480, 32), level, 0.0002, late=late, early=1 - late, lateness=lateness, lateness_error=0.0005)

    search = StepSearch(BATCH)
    search.decide(Window((480, 32), 0.020, 0.0002))  # (no rank late: nothing says which way, it settles)
    assert search.settled
    search._settled_on = window(0.010)  # (as if it had settled there with rank 0 last by 10 ms)
    for _ in range(4):
        assert search.decide(window(0.0105)) is None and search.settled
    assert search.decide(window(0.016)) is None  # (one window: a drift needs two in a row)
    assert search.decide(window(0.016)) is not None and search.said == "started"
    other = StepSearch(BATCH)
    other.decide(Window((480, 32), 0.020, 0.0002))
    other._settled_on = window(0.010)
    other.decide(window(0.004, late=1))
    assert other.decide(window(0.004, late=1)) is not None
