"""Re-plan: when the devices do not do what the plan assumed, pick a better split from what they did.

Every ``window`` training steps the ranks exchange their step records (:mod:`~.watch.meter`), so every rank
holds the same numbers; :class:`Rebalancer` turns them into a decision with pure arithmetic and no rank argument, so
every rank takes the same one and switches at the same step.

How a decision is made:

1. **Refit** each rank's cost model from its recent steps (:func:`refit_cost_models`). The starting model (the
   profile's line, or a line through the origin when there was no profile) keeps its *shape*; its *level* is scaled
   by the weighted median of ``measured compute / predicted compute`` over the steps since the split last changed.
   The median ignores outliers (a garbage collection, a page fault, the step that restarts the loader's workers);
   the weights halve every ``window`` steps. The spread of those ratios (their median absolute deviation) gives how
   uncertain each rank's level is. When the newest window's level differs from the older steps' by more than that
   uncertainty allows, the device changed (a drift): the older steps are dropped and the newest window alone
   decides, so a drift is followed in one switch instead of being averaged with what came before.
2. **Plan** the split that minimises the slowest rank's predicted compute with the exact planner
   (:func:`lightning_hetero.plan.planner.plan_min_max`), within each device's memory ceiling.
3. **Switch** only if the new split is predicted faster than the current one by at least ``threshold`` plus the
   noise margin, judged by the same refitted models, and only once ``MIN_INTERVAL_WINDOWS`` windows have been
   measured under the current split. The threshold is a dead band (a split within it of the best is kept); the
   margin is ``NOISE_MARGIN_SIGMAS`` standard errors of the predicted gain, from the ranks' spreads: noisy
   measurements need a larger predicted gain before they move the split, so timing noise alone does not make it
   wander, while a real imbalance (a misread profile, a drift) clears it within a window or two.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.plan.explore import StepSearch, cost_model_leaves_unexplained, held_beyond_others, window_of
from lightning_hetero.plan.micro_steps import micro_steps_for, plan_micro_steps, rank_time
from lightning_hetero.plan.planner import plan_min_max, predicted_step_time
from lightning_hetero.runtime.checks import check_positive_int, is_real

DEFAULT_THRESHOLD = 0.05
# Windows of records a refit looks back at, at most (their weights halve every window, so older ones hardly count).
# Steps between two exchanges of the ranks' records (one small gather each), which are also the re-plan points.
DEFAULT_WINDOW = 20
HISTORY_WINDOWS = 4
# Windows between two switches: a decision rests on at least two windows measured under the split in use (never on
# one noisy window), and a split runs long enough to repay what switching costs (the loader's read-ahead).
MIN_INTERVAL_WINDOWS = 2
# Standard errors of the predicted gain that a switch must clear on top of the threshold: with 3, noise alone moves
# the split in about one decision in a thousand (one-sided normal tail), so hardly ever in a run.
NOISE_MARGIN_SIGMAS = 3.0
# A median's standard error is sqrt(pi / 2) times the mean's for normal data; MAD * 1.4826 estimates sigma.
_MEDIAN_EFFICIENCY = 1.2533
_MAD_TO_SIGMA = 1.4826


def check_rebalance_arguments(rebalance: Any, window: Any, threshold: Any) -> None:
    """Constructor checks of ``HeteroStrategy(rebalance=..., rebalance_window=..., rebalance_threshold=...)``."""
    if rebalance is not None and not isinstance(rebalance, bool):
        raise ValueError(
            f"`rebalance={rebalance!r}` must be True, False or None (None: on for the automatic split, off when"
            " `batch_sizes` or `weights` fix it)."
        )
    check_positive_int("rebalance_window", window, ": the training steps between two exchanges of the ranks'"
                       f" measurements (default {DEFAULT_WINDOW}).")  # fmt: skip
    if not is_real(threshold) or not math.isfinite(threshold) or threshold < 0:
        raise ValueError(
            f"`rebalance_threshold={threshold!r}` must be a finite number >= 0: the predicted gain a new split needs"
            f" before the job switches to it (default {DEFAULT_THRESHOLD}, i.e. 5 % faster)."
        )


@dataclass(frozen=True)
class Replan:
    """A switch to ``batch_sizes`` from the training step ``step`` on, predicted ``predicted_gain`` faster."""

    step: int
    batch_sizes: tuple[int, ...]
    predicted_gain: float  # predicted step time of the old split / the new one - 1
    micro_steps: tuple[int, ...] = ()  # each rank's micro-steps under the new split (() : one each)
    data_waits: tuple[float, ...] = ()  # each rank's wait for its data per step, counted in its time
    # "model": planned from the refitted cost models; "search": a split the search on the measured step runs next
    # (a trial, or back to the best it measured: plan/explore.py), with the late rank it moves samples from
    source: str = "model"
    late_rank: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        steps = list(self.micro_steps) or [1] * len(self.batch_sizes)
        return {"step": self.step, "batch_sizes": list(self.batch_sizes), "micro_steps": steps,
                "predicted_gain": self.predicted_gain, "data_wait_seconds": list(self.data_waits),
                "source": self.source, "late_rank": self.late_rank}  # fmt: skip


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at which half the total weight lies on either side (the lower one on an exact tie)."""
    if not values or len(values) != len(weights):
        raise ValueError(f"weighted_median needs as many weights as values (>= 1), got {len(values)}, {len(weights)}")
    pairs = sorted(zip(values, weights))
    half = sum(weights) / 2
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= half:
            return value
    return pairs[-1][0]


@dataclass(frozen=True)
class RankFit:
    """A rank's refitted cost model (its wait for data included) and the relative standard error of its level."""

    cost: CostModel
    relative_error: float
    data_wait: float = 0.0  # seconds per step the rank waited for its loader, counted in ``cost.fixed``


def refit_cost_models(
    base: Sequence[CostModel], steps: Sequence[dict[str, Any]], window: int, micro_steps: bool = False
) -> Optional[list[RankFit]]:
    """Each rank's ``base`` model scaled to the level its ``steps`` (report entries, oldest first) measured, plus the
    time it waited for its data per step.

    Weights halve every ``window`` steps; the newest ``window`` steps alone decide when they show a drift. None when
    some rank has no step with a measured compute (nothing to fit it to). ``micro_steps``: a rank's time is
    :func:`~lightning_hetero.plan.micro_steps.rank_time` (its samples in as many micro-batches as memory needs).

    A rank's measured time is its compute or, where the ranks are held unevenly (:func:`held_unevenly`), its arrival at
    the gradient exchange where that is longer (:mod:`~.watch.meter`: the wall time of its own work in the step,
    whatever held its process besides its compute). Where every rank's wall time exceeds its compute alike (cores
    shared with other processes) the compute clock alone is the steadier measure.

    A wait for data is paid once per step whatever the rank's share (a loader with too few workers, slow storage): it
    is added to the model's fixed cost, so the planner gives that rank fewer samples until its compute plus its wait
    matches the others'. (A wait that grows with the share is under-corrected once and measured again.)
    """
    predict = rank_time if micro_steps else CostModel.time
    arrivals_count = held_unevenly(steps, len(base))
    refitted = []
    for rank, model in enumerate(base):
        ratios, waits, weights, newest, per_fixed = [], [], [], 0, 1
        for age, step in enumerate(reversed(steps)):
            compute = step["compute_seconds"][rank]
            if compute > 0:
                # Where some rank is held unevenly: what it took before the exchange on the wall clock, its compute
                # and what held its process besides (a CPU quota), which its compute clock does not see.
                arrival = step.get("arrival_seconds", (0.0,) * len(base))[rank] if arrivals_count else 0.0
                taken = max(compute, arrival)
                ratios.append(taken / predict(model, step["batch_sizes"][rank]))
                waits.append(step.get("data_wait_seconds", (0.0,) * len(base))[rank])
                weights.append(0.5 ** (age / window))
                newest += age < window
                if len(ratios) == 1 and micro_steps:  # the fixed cost is paid per micro-step, the wait per step
                    per_fixed = step.get("micro_steps", (1,) * len(base))[rank]
        if not ratios:
            return None
        scale, error = _recent_level(ratios, weights, newest, relative=True)
        wait, wait_error = _recent_level(waits, weights, newest, relative=False)
        predicted = scale * predict(model, steps[-1]["batch_sizes"][rank])
        total_error = math.hypot(error * predicted, wait_error) / (predicted + wait)
        cost = CostModel(model.fixed * scale + wait / per_fixed, model.per_sample * scale, model.max_batch)
        refitted.append(RankFit(cost, total_error, wait))
    return refitted


def held_unevenly(steps: Sequence[dict[str, Any]], world_size: int) -> bool:
    """Whether some rank is held beyond the others by what its compute clock does not see
    (:func:`~.explore.held_beyond_others`, over the median step; ``steps``: report entries; False where arrivals were
    not timed, or fewer than 3 steps were)."""
    timed = [step for step in steps if len(step.get("arrival_seconds", ())) == world_size]
    if len(timed) < 3:
        return False
    return held_beyond_others(timed, statistics.median(step["step_seconds"] for step in timed))[0] is not None


def _recent_level(
    values: Sequence[float], weights: Sequence[float], newest: int, relative: bool
) -> tuple[float, float]:
    """The level of ``values`` (newest first) and its standard error (relative or in the values' unit): the newest
    ``newest`` values' alone when they differ from the older ones' by more than the noise allows (a drift)."""
    level, error = _level(values, weights, relative)
    if 0 < newest < len(values):
        new_level, new_error = _level(values[:newest], weights[:newest], relative)
        old_level, old_error = _level(values[newest:], weights[newest:], relative)
        if relative:
            drifted = abs(new_level / old_level - 1) > NOISE_MARGIN_SIGMAS * math.hypot(new_error, old_error)
        else:
            drifted = abs(new_level - old_level) > NOISE_MARGIN_SIGMAS * math.hypot(new_error, old_error)
        if drifted:
            return new_level, new_error
    return level, error


def _level(values: Sequence[float], weights: Sequence[float], relative: bool = True) -> tuple[float, float]:
    """The weighted median of ``values`` and its standard error (from the median absolute deviation), relative to
    the median or in the values' unit."""
    level = weighted_median(values, weights)
    spread = _MAD_TO_SIGMA * weighted_median([abs(value - level) for value in values], weights)
    effective_count = sum(weights) ** 2 / sum(weight * weight for weight in weights)
    error = _MEDIAN_EFFICIENCY * spread / math.sqrt(effective_count)
    return level, (error / level if relative else error)


def gain_uncertainty(fits: Sequence[RankFit]) -> float:
    """The noise margin a predicted gain must clear: ``NOISE_MARGIN_SIGMAS`` standard errors of it.

    A rank's time is predicted with its level's relative error; the gain is a ratio of two such predictions, whose
    relative error is about the root sum of squares of the ranks' (an upper bound for the ranks that decide it).
    """
    return NOISE_MARGIN_SIGMAS * math.sqrt(sum(fit.relative_error**2 for fit in fits))


def decide_split(
    costs: Sequence[CostModel], current: Sequence[int], threshold: float, margin: float = 0.0, micro_steps: bool = False
) -> Optional[tuple[tuple[int, ...], float, tuple[int, ...]]]:
    """The planner's split, its predicted gain over ``current`` and its micro-steps, or None when that gain is below
    ``threshold + margin``.

    A current split that breaks a memory ceiling is predicted infinitely slow: any split that fits is taken. With
    ``micro_steps`` a rank whose share exceeds its ceiling takes it in several micro-batches
    (:func:`~lightning_hetero.plan.micro_steps.plan_micro_steps`) instead.
    """
    if micro_steps:
        in_steps = plan_micro_steps(costs, sum(current))
        planned_sizes, planned_time, steps = in_steps.samples, in_steps.predicted_step_time, in_steps.micro_steps
        current_time = max(rank_time(cost, n) for cost, n in zip(costs, current))
    else:
        planned = plan_min_max(costs, sum(current))
        planned_sizes, planned_time, steps = planned.batch_sizes, planned.predicted_step_time, ()
        current_time = predicted_step_time(costs, current)
    if planned_sizes == tuple(current):
        return None
    gain = current_time / planned_time - 1
    if gain < threshold + margin:
        return None
    return planned_sizes, gain, steps


@dataclass
class Rebalancer:
    """The split a job runs with, and when to change it (no collective and no clock: fed the exchanged steps).

    ``base_costs`` are the starting cost models in rank order (the profile's, or ``CostModel(0, 1)`` per rank when
    the split was fixed by the user, i.e. time proportional to the batch); ``split`` the split in use.
    """

    base_costs: Sequence[CostModel]
    split: tuple[int, ...]
    window: int = DEFAULT_WINDOW
    threshold: float = DEFAULT_THRESHOLD
    # The planner may give a memory-bound rank more micro-steps (automatic micro-steps; with the user's fixed ones,
    # `base_costs` already count each rank's k fixed costs and k times its ceiling, and every re-plan keeps them).
    micro_steps: bool = False
    fixed_micro_steps: tuple[int, ...] = ()
    changed_at: int = 0  # the training step from which `split` is in use
    replans: list[Replan] = field(default_factory=list)
    # The search on the measured step, for what the cost models do not explain (plan/explore.py; None: off)
    search: Optional[StepSearch] = None

    def consider(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        """Decide before training step ``next_step``, given every step so far (the same list on every rank): the
        cost models' re-plan, once ``MIN_INTERVAL_WINDOWS`` windows ran under the split in use, else, where they leave
        the step unexplained (:func:`~.explore.cost_model_leaves_unexplained`), the search's next split
        (plan/explore.py); while the search holds the split (a trial, or one it kept), the search alone."""
        if self.search is not None and self.search.holds:
            return self._searched(steps, next_step)
        if next_step - self.changed_at < MIN_INTERVAL_WINDOWS * self.window:
            return None  # (the cost models decide first, once the split has run long enough to be measured)
        replan = self._planned(steps, next_step)
        if replan is not None:
            if self.search is not None:
                self.search.reset()
            return replan
        if self.search is None:
            return None
        since_change = [step for step in steps if step["step"] >= self.changed_at][-HISTORY_WINDOWS * self.window :]
        if not cost_model_leaves_unexplained(since_change):
            return None  # (the cost models balance what the ranks take: nothing for the search to find)
        return self._searched(steps, next_step)

    def _searched(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        """The search's next split from the last window's steps under the split in use (the first left out)."""
        assert self.search is not None
        window = window_of([step for step in steps[-self.window :] if step["step"] >= self.changed_at])
        if window is None or window.split != tuple(self.split):
            return None
        split = self.search.decide(window)
        if split is None or tuple(split) == tuple(self.split):
            return None
        steps_per_rank = self.micro_steps_of(split) if (self.micro_steps or self.fixed_micro_steps) else ()
        if any(n < k for n, k in zip(split, steps_per_rank)):
            return None  # (a rank would get fewer samples than its fixed micro-steps)
        replan = Replan(next_step, tuple(split), 0.0, steps_per_rank, source="search", late_rank=window.late)
        self.adopt(replan.batch_sizes, next_step)
        self.replans.append(replan)
        return replan

    def _planned(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        since_change = [step for step in steps if step["step"] >= self.changed_at]
        recent = since_change[-HISTORY_WINDOWS * self.window :]
        fits = refit_cost_models(self.base_costs, recent, self.window, self.micro_steps)
        if fits is None:
            return None
        costs, margin = [fit.cost for fit in fits], gain_uncertainty(fits)
        decision = decide_split(costs, self.split, self.threshold, margin, self.micro_steps)
        if decision is None:
            return None
        sizes, gain, micro_steps = decision
        micro_steps = micro_steps or self.fixed_micro_steps
        if micro_steps and any(n < k for n, k in zip(sizes, micro_steps)):
            return None  # a rank would get fewer samples than its fixed micro-steps: keep the split that has them
        replan = Replan(next_step, sizes, gain, micro_steps, tuple(fit.data_wait for fit in fits))
        self.adopt(replan.batch_sizes, next_step)
        self.replans.append(replan)
        return replan

    def micro_steps_of(self, split: Sequence[int]) -> tuple[int, ...]:
        """Each rank's micro-steps under ``split`` (a checkpoint's, which records the samples only): the fixed ones,
        or as few as each rank's memory ceiling allows."""
        if self.fixed_micro_steps:
            return self.fixed_micro_steps
        if self.micro_steps:
            return tuple(micro_steps_for(cost, n) for cost, n in zip(self.base_costs, split))
        return (1,) * len(split)

    def adopt(self, split: Sequence[int], step: int) -> None:
        """Run with ``split`` from ``step`` on (a re-plan, or the split a checkpoint recorded)."""
        self.split = tuple(split)
        self.changed_at = step
