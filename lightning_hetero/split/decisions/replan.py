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

   The rank held beyond the others by what its compute clock does not see (:func:`held_most`: a CPU quota) is
   measured by its whole step less its wait for the others at the exchange: the quota holds its exchange and its
   update as much as its samples. Where it ran a share at least ``LINE_SPREAD`` different under the split before, it
   gets the line through its two measured levels (:func:`line_through`): its time per step is largely fixed, and
   scaling the profile's line, which is mostly per sample, moved it a fraction of the way per re-plan (at a 40 %
   quota: 5 re-plans, 200 steps). Elsewhere (``emulate_speeds``, a slower device) the profile's shape holds and the
   scaled line is the steadier one.
2. **Plan** the split that minimises the slowest rank's predicted compute with the exact planner
   (:func:`lightning_hetero.split.decisions.planner.plan_min_max`), within each device's memory ceiling. A rank seen
   held stays marked while the kernel holds it longer than the others, else for ``HELD_MEMORY_WINDOWS`` windows (doubled
   after each lapse), and the plan never gives a marked rank more samples: past the share its quota carries, its step
   jumps by a period of the quota, which its measured times at a smaller share do not show.
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
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.runtime.checks import check_positive_int, is_real
from lightning_hetero.split.decisions.explore import (
    StepSearch,
    cost_model_leaves_unexplained,
    held_beyond_others,
    kernel_holds_more,
    late_and_early,
    window_of,
)
from lightning_hetero.split.decisions.micro_steps import micro_steps_for, plan_micro_steps, rank_time
from lightning_hetero.split.decisions.planner import MIN_SAMPLES_PER_RANK, plan_min_max, predicted_step_time

DEFAULT_THRESHOLD = 0.05
# Windows of records a refit looks back at, at most (their weights halve every window, so older ones hardly count).
# Steps between two exchanges of the ranks' records (one small gather each), which are also the re-plan points.
DEFAULT_WINDOW = 20
HISTORY_WINDOWS = 4
# Windows between two switches: a decision rests on at least two windows measured under the split in use (never on
# one noisy window), and a split runs long enough to repay what switching costs (the loader's read-ahead).
MIN_INTERVAL_WINDOWS = 2
# Windows a rank seen held beyond the others (a CPU quota) stays marked after it was last seen so, or held longer than
# the others by the kernel (explore.kernel_holds_more), doubled each time a mark lapses and the rank is seen held again;
# two windows once the kernel that held it longer no longer does. The cost model does not give a marked rank more
# samples: below the share its quota carries a held rank looks free (its little work fits in the quota), and the model,
# scaling its time at a few samples, gave it back past that share (at a 40 % quota: from 1 sample to 144, a 42 ms step
# for a 21 ms one, every third re-plan). A lapsed mark lets the model try once more: a quota that lifted is followed,
# one that did not costs a window, ever more rarely.
HELD_MEMORY_WINDOWS = 10
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
    check_positive_int(
        "rebalance_window",
        window,
        f": the training steps between two exchanges of the ranks' measurements (default {DEFAULT_WINDOW}).",
    )
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
    # (a trial, or back to the best it measured: split/decisions/explore.py), with the late rank it moves samples from
    source: str = "model"
    late_rank: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        steps = list(self.micro_steps) or [1] * len(self.batch_sizes)
        return {
            "step": self.step,
            "batch_sizes": list(self.batch_sizes),
            "micro_steps": steps,
            "predicted_gain": self.predicted_gain,
            "data_wait_seconds": list(self.data_waits),
            "source": self.source,
            "late_rank": self.late_rank,
        }


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


# Two splits whose shares for a rank differ by at least this fraction of the larger give its line through them; closer
# ones leave the slope to the timing noise (a 3 % error of each level over a 25 % spread is a 17 % error of the slope).
LINE_SPREAD = 0.25


def line_through(
    samples: int, seconds: float, earlier_samples: int, earlier_seconds: float, least_per_sample: float
) -> Optional[tuple[float, float]]:
    """The line ``(fixed, per_sample)`` through a held rank's measured time per step under two shares, when they
    differ by at least ``LINE_SPREAD`` of the larger; None otherwise, or where the line needs a negative fixed cost
    (the caller then scales the profile's line).

    Its slope is at least ``least_per_sample`` (the profile's, measured with nothing holding the rank): a held rank
    does not take a sample in less time than it did free. Two levels closer than that slope allows, or in the wrong
    order, are the step's fixed part and its noise (the 10 ms period of a CPU quota makes the step bimodal): the line
    then keeps the least slope through the newer level, and the time it does not explain is fixed, which moves the
    split further the way the held rank's time already points, never back (a flat line read as "the samples cost
    nothing" gave the held rank more again).
    """
    if abs(samples - earlier_samples) < LINE_SPREAD * max(samples, earlier_samples):
        return None
    per_sample = max((seconds - earlier_seconds) / (samples - earlier_samples), least_per_sample)
    fixed = seconds - per_sample * samples
    if fixed < 0:
        return None
    return fixed, per_sample


def refit_cost_models(
    base: Sequence[CostModel],
    steps: Sequence[dict[str, Any]],
    window: int,
    micro_steps: bool = False,
    earlier: Sequence[dict[str, Any]] = (),
) -> Optional[list[RankFit]]:
    """Each rank's ``base`` model scaled to the level its ``steps`` (report entries, oldest first) measured, plus the
    time it waited for its data per step.

    Weights halve every ``window`` steps; the newest ``window`` steps alone decide when they show a drift. None when
    some rank has no step with a measured compute (nothing to fit it to). ``micro_steps``: a rank's time is
    :func:`~lightning_hetero.split.decisions.micro_steps.rank_time` (its samples in as many micro-batches as memory
    needs).

    A rank's measured time is its compute or, where some rank is held beyond the others (:func:`held_most`), its
    arrival at the gradient exchange where that is longer (:mod:`~.watch.meter`: the wall time of its own work in the
    step, whatever held its process besides its compute; the held rank's whole step less its wait for the others).
    Where every rank's wall time exceeds its compute alike (cores shared with other processes) the compute clock alone
    is the steadier measure.

    A wait for data is paid once per step whatever the rank's share (a loader with too few workers, slow storage): it
    is added to the model's fixed cost, so the planner gives that rank fewer samples until its compute plus its wait
    matches the others'. (A wait that grows with the share is under-corrected once and measured again.)

    ``earlier``: the steps under the split before (one split); the held rank (:func:`held_most`), where its share
    there differs enough and it ran in one micro-step under both, gets the line through its two levels
    (:func:`line_through`).
    """
    predict = rank_time if micro_steps else CostModel.time
    held_rank = held_most(steps, len(base))
    arrivals_count = held_rank is not None

    def taken(step: dict[str, Any], rank: int) -> float:
        compute, arrivals = step["compute_seconds"][rank], step.get("arrival_seconds", ())
        if not arrivals_count or len(arrivals) != len(base):
            return compute
        if rank == held_rank:
            # The held rank's own step: the whole step but its wait for the others at the exchange (and for its
            # data, counted apart). A CPU quota holds its exchange and its update after it as much as its samples,
            # and they are what the step is short of: its arrival alone left a third of a 50 ms step unexplained.
            waited = max(arrivals) - arrivals[rank] + step.get("data_wait_seconds", (0.0,) * len(base))[rank]
            return max(compute, step.get("step_seconds", 0.0) - waited)
        # Another rank: what it took before the exchange on the wall clock, its compute and what held its process
        # besides, which its compute clock does not see.
        return max(compute, arrivals[rank])

    refitted = []
    for rank, model in enumerate(base):
        ratios, waits, weights, newest, per_fixed = [], [], [], 0, 1
        for age, step in enumerate(reversed(steps)):
            compute = step["compute_seconds"][rank]
            if compute > 0:
                ratios.append(taken(step, rank) / predict(model, step["batch_sizes"][rank]))
                waits.append(step.get("data_wait_seconds", (0.0,) * len(base))[rank])
                weights.append(0.5 ** (age / window))
                newest += age < window
                if len(ratios) == 1 and micro_steps:  # the fixed cost is paid per micro-step, the wait per step
                    per_fixed = step.get("micro_steps", (1,) * len(base))[rank]
        if not ratios:
            return None
        scale, error = _recent_level(ratios, weights, newest, relative=True)
        wait, wait_error = _recent_level(waits, weights, newest, relative=False)
        samples = steps[-1]["batch_sizes"][rank]
        predicted = scale * predict(model, samples)
        total_error = math.hypot(error * predicted, wait_error) / (predicted + wait)
        fixed, per_sample = model.fixed * scale, model.per_sample * scale
        if rank == held_rank and per_fixed == 1:
            line = _line_from_earlier(earlier, rank, samples, predicted, taken, model.per_sample)
            if line is not None:
                fixed, per_sample = line
        refitted.append(RankFit(CostModel(fixed + wait / per_fixed, per_sample, model.max_batch), total_error, wait))
    return refitted


def _line_from_earlier(
    earlier: Sequence[dict[str, Any]], rank: int, samples: int, level: float, taken: Any, least_per_sample: float
) -> Optional[tuple[float, float]]:
    """The line through ``rank``'s ``level`` at ``samples`` and its median time under the ``earlier`` split (the
    first of those steps left out: the first after a switch, or one of the window before), where it ran there in one
    micro-step and with a measured compute."""
    measured = [step for step in earlier[1:] if step["compute_seconds"][rank] > 0]
    if len(measured) < 3 or any(step.get("micro_steps", (1,) * (rank + 1))[rank] != 1 for step in measured):
        return None
    earlier_level = statistics.median(taken(step, rank) for step in measured)
    return line_through(samples, level, measured[-1]["batch_sizes"][rank], earlier_level, least_per_sample)


def held_most(steps: Sequence[dict[str, Any]], world_size: int) -> Optional[int]:
    """The rank held beyond the others by what its compute clock does not see (:func:`~.explore.held_beyond_others`,
    over the median step; ``steps``: report entries); None where no rank is, arrivals were not timed, or fewer than 3
    steps were."""
    timed = [step for step in steps if len(step.get("arrival_seconds", ())) == world_size]
    if len(timed) < 3:
        return None
    return held_beyond_others(timed, statistics.median(step["step_seconds"] for step in timed))[0]


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
    costs: Sequence[CostModel],
    current: Sequence[int],
    threshold: float,
    margin: float = 0.0,
    micro_steps: bool = False,
    kept_from_more: Sequence[int] = (),
) -> Optional[tuple[tuple[int, ...], float, tuple[int, ...]]]:
    """The planner's split, its predicted gain over ``current`` and its micro-steps, or None when that gain is below
    ``threshold + margin``.

    A current split that breaks a memory ceiling is predicted infinitely slow: any split that fits is taken. With
    ``micro_steps`` a rank whose share exceeds its ceiling takes it in several micro-batches
    (:func:`~lightning_hetero.split.decisions.micro_steps.plan_micro_steps`) instead. A rank in ``kept_from_more`` that
    the planner would give more keeps its current share, and the other ranks are planned over the rest.
    """

    def step_time(split: Sequence[int]) -> float:
        if micro_steps:
            return max(rank_time(cost, n) for cost, n in zip(costs, split))
        return predicted_step_time(costs, split)  # (inf where a rank's share breaks its memory ceiling)

    ranks, kept = range(len(current)), set[int]()
    while True:
        free = [rank for rank in ranks if rank not in kept]
        if not free:
            return None
        planned = _planned_over(
            [costs[rank] for rank in free], sum(current) - sum(current[r] for r in kept), micro_steps
        )
        sizes, steps = dict(zip(free, planned[0])), dict(zip(free, planned[1]))
        over = {rank for rank in free if rank in kept_from_more and sizes[rank] > current[rank]}
        if not over:
            break
        kept |= over
    for rank in kept:
        sizes[rank], steps[rank] = current[rank], micro_steps_for(costs[rank], current[rank]) if micro_steps else 1
    planned_sizes = tuple(sizes[rank] for rank in ranks)
    if planned_sizes == tuple(current):
        return None
    gain = step_time(current) / step_time(planned_sizes) - 1
    if gain < threshold + margin:
        return None
    return planned_sizes, gain, tuple(steps[rank] for rank in ranks) if micro_steps else ()


def _planned_over(
    costs: Sequence[CostModel], samples: int, micro_steps: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The min-max split of ``samples`` over these ranks (:func:`plan_min_max`, or with ``micro_steps``
    :func:`plan_micro_steps`) and each rank's micro-steps (1 each without)."""
    if micro_steps:
        in_steps = plan_micro_steps(costs, samples, MIN_SAMPLES_PER_RANK)
        return in_steps.samples, in_steps.micro_steps
    return plan_min_max(costs, samples, MIN_SAMPLES_PER_RANK).batch_sizes, (1,) * len(costs)


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
    # The search on the measured step, for what the cost models do not explain (split/decisions/explore.py; None: off)
    search: Optional[StepSearch] = None
    # Ranks seen held beyond the others, and the step from which each mark lapses (``HELD_MEMORY_WINDOWS``)
    held_until: dict[int, int] = field(default_factory=dict)
    held_lapses: int = 0  # marks that lapsed and were set again: each doubles how long a mark holds
    _lapsed: set[int] = field(default_factory=set)
    _kernel_held: set[int] = field(default_factory=set)  # marked ranks the kernel held longer in the last window

    def consider(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        """Decide before training step ``next_step``, given every step so far (the same list on every rank): the
        cost models' re-plan, once ``MIN_INTERVAL_WINDOWS`` windows ran under the split in use, else, where they leave
        the step unexplained (:func:`~.explore.cost_model_leaves_unexplained`), the search's next split
        (split/decisions/explore.py); while the search holds the split (a trial, or one it kept), the search alone."""
        self._mark_held(steps, next_step)
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
        if not (self.held_until or cost_model_leaves_unexplained(since_change)):
            return None  # (the cost models balance what the ranks take: nothing for the search to find)
        return self._searched(steps, next_step)

    def _mark_held(self, steps: Sequence[dict[str, Any]], next_step: int) -> None:
        """Mark the rank held beyond the others over the last window under the split in use, keep the marks of ranks
        the kernel still holds longer than the others, and let the others' lapse (``held_until``)."""
        last = [step for step in steps[-self.window :] if step["step"] >= self.changed_at]
        for rank in list(self.held_until):
            if kernel_holds_more(last, rank):
                self.held_until[rank] = next_step + self._held_memory()
                self._kernel_held.add(rank)
                continue
            if rank in self._kernel_held:
                # The kernel held it longer than the others and no longer does: the quota lifted (or its share now
                # fits it, which the next windows show), so the mark lapses after MIN_INTERVAL_WINDOWS more windows.
                self._kernel_held.discard(rank)
                self.held_until[rank] = min(self.held_until[rank], next_step + MIN_INTERVAL_WINDOWS * self.window)
            if next_step >= self.held_until[rank]:
                del self.held_until[rank]
                self._lapsed.add(rank)
                if self.search is not None:
                    self.search.reset()  # (a split the search kept for the held rank is the cost model's again)
        held = held_most(last, len(self.split))
        if held is None or held != self._late_in(last):
            # (only the rank the others wait for: a fast rank the kernel holds a little under a loaded machine, marked,
            # kept the samples it should have taken from a slow one for a window or more)
            return
        if held in self._lapsed:  # (held again after its mark lapsed: remembered twice as long)
            self._lapsed.discard(held)
            self.held_lapses += 1
        self.held_until[held] = next_step + self._held_memory()

    def _late_in(self, steps: Sequence[dict[str, Any]]) -> Optional[int]:
        """The rank evidently last at the exchange over these steps (:func:`~.explore.late_and_early`), if any."""
        timed = [step for step in steps if len(step.get("arrival_seconds", ())) == len(self.split)]
        if len(timed) < 3:
            return None
        level = statistics.median(step["step_seconds"] for step in timed)
        return late_and_early([step["arrival_seconds"] for step in timed], level)[0]

    def _held_memory(self) -> int:
        return HELD_MEMORY_WINDOWS * self.window * 2**self.held_lapses

    def _searched(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        """The search's next split from the last window's steps under the split in use (the first left out)."""
        assert self.search is not None
        window = window_of([step for step in steps[-self.window :] if step["step"] >= self.changed_at])
        if window is None or window.split != tuple(self.split):
            return None
        if window.held is None and len(self.held_until) == 1:  # (a rank held earlier, free at its share now)
            window = replace(window, held=next(iter(self.held_until)))
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
        fits = refit_cost_models(self.base_costs, recent, self.window, self.micro_steps, self._earlier(steps))
        if fits is None:
            return None
        costs, margin = [fit.cost for fit in fits], gain_uncertainty(fits)
        # A rank held by what its compute clock does not see (a CPU quota), or held within HELD_MEMORY_WINDOWS, is not
        # given more by the cost model: past the share its quota carries, its step jumps by a period of the quota (at
        # 40 %: from 21 to 29 ms at the same split, in benchmarks/throttled.py), which no line through its times
        # foresees. Taking samples from it costs the others a little per sample; the search on the measured step,
        # which measures what it tries, may still give it more.
        decision = decide_split(costs, self.split, self.threshold, margin, self.micro_steps, tuple(self.held_until))
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

    def _earlier(self, steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The last window of steps of the split run just before the one in use (one window: a device that drifted
        while that split ran is measured as it was at its end, not averaged with what it was before)."""
        before = [step for step in steps if step["step"] < self.changed_at][-self.window - 1 :]
        if not before:
            return []
        split = before[-1]["batch_sizes"]
        start = len(before)
        while start > 0 and before[start - 1]["batch_sizes"] == split:
            start -= 1
        return before[start:]

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
