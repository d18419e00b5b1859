"""Plan: the exact min-max planner: the integer split that minimises the slowest rank's predicted step time within
every device's memory, and the choice between it and the equal split.

Pure functions over cost models (:class:`~lightning_hetero.measure.cost.CostModel`), tested exhaustively."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.runtime.checks import check_positive_int
from lightning_hetero.runtime.checks import is_int as _is_int
from lightning_hetero.split.decisions.split import check_global_batch_covers_ranks, split_by_weights


@dataclass(frozen=True)
class PlannedSplit:
    """A split chosen by :func:`plan_min_max` with the predicted step time of every rank."""

    batch_sizes: tuple[int, ...]
    predicted_step_time: float  # max(predicted_times): the step waits for the slowest rank
    predicted_times: tuple[float, ...]

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    def speedup_over(self, baseline_step_time: float) -> float:
        """How many times faster than ``baseline_step_time`` (e.g. :func:`equal_split_time`) this split should be."""
        return baseline_step_time / self.predicted_step_time


def predicted_times(costs: Sequence[CostModel], batch_sizes: Sequence[int]) -> tuple[float, ...]:
    """Each rank's predicted step time for ``batch_sizes``; ``inf`` for a rank whose micro-batch exceeds its ceiling.

    ``inf`` rather than an error because an over-ceiling split is a legitimate thing to report on (the equal split of a
    job with a small device is often one): it runs out of memory, so it never finishes.
    """
    if len(costs) != len(batch_sizes):
        raise ValueError(
            f"{len(costs)} cost models but {len(batch_sizes)} batch sizes ({list(batch_sizes)}): give one per rank."
        )
    bad = [b for b in batch_sizes if not _is_int(b) or b < 1]
    if bad:
        raise ValueError(f"batch sizes {list(batch_sizes)} hold {bad}: every rank needs an integer micro-batch >= 1.")
    return tuple(
        math.inf if cost.max_batch is not None and size > cost.max_batch else cost.time(size)
        for cost, size in zip(costs, batch_sizes)
    )


def predicted_step_time(costs: Sequence[CostModel], batch_sizes: Sequence[int]) -> float:
    """Predicted time of one step with ``batch_sizes``: the slowest rank's; ``inf`` if a micro-batch does not fit."""
    return max(predicted_times(costs, batch_sizes))


def equal_split_time(costs: Sequence[CostModel], global_batch_size: int) -> float:
    """Predicted step time of the equal split (``split_by_weights(B, [1] * W)``), the baseline a plan is compared to.

    ``inf`` when the equal split puts more samples on some rank than its ``max_batch``: that job would not run at all.
    Raises ValueError (from :func:`split_by_weights`) when ``global_batch_size`` is smaller than the world size.
    """
    return predicted_step_time(costs, split_by_weights(global_batch_size, [1.0] * len(costs)))


# The fewest samples the planner gives a rank when the global batch allows it: a rank with one sample crashes a model
# whose BatchNorm is not synchronized ("Expected more than 1 value per channel when training"), as DDP would with a
# per-rank batch of one, and the package chose that split, not the user.
MIN_SAMPLES_PER_RANK = 2


def rank_floors(costs: Sequence[CostModel], global_batch_size: int, minimum: int) -> list[int]:
    """Each rank's fewest samples: ``minimum``, or its ceiling when lower; one each when the batch cannot give every
    rank that many."""
    floors = [minimum if cost.max_batch is None else max(1, min(minimum, cost.max_batch)) for cost in costs]
    return floors if sum(floors) <= global_batch_size else [1] * len(costs)


def plan_min_max(costs: Sequence[CostModel], global_batch_size: int, minimum: int = 1) -> PlannedSplit:
    """Integer micro-batch sizes ``b_r`` (``f_r <= b_r <= max_batch_r``, summing to ``global_batch_size``) that minimise
    the predicted step time ``max_r costs[r].time(b_r)`` exactly. ``f_r``: ``minimum`` samples, or the rank's ceiling
    when lower, or 1 when the batch cannot give every rank ``minimum`` (:func:`rank_floors`).

    Ties among optimal splits are broken so that every rank computes the same answer and no rank waits longer than it
    must: the split returned makes the vector of per-rank times, sorted from slowest to fastest, lexicographically
    smallest (fewest ranks at the maximum, then the smallest second-slowest time, ...), and among splits with equal
    such vectors gives the extra samples to the lower ranks (the lexicographically largest ``batch_sizes``), as
    :func:`split_by_weights` does, so identical devices get exactly the equal split. That lexicographic guarantee
    holds whenever each rank's time strictly grows with its batch, which is always the case unless ``per_sample`` is
    so small next to ``fixed`` that adjacent batch sizes round to the same float; the maximum is minimal in every case.

    How: call a sample's *cost* the time its rank reaches when it takes that sample. Each rank's first ``f_r``
    samples are compulsory; of the rest, an optimal split takes the ``B - sum(f)`` cheapest. So it finds the lowest
    level ``L`` with at least ``B - sum(f)`` optional samples costing ``<= L`` (a search over the at most 2**63
    non-negative doubles, each probe
    counting O(1) per rank), gives every rank all its samples cheaper than ``L``, and hands out the ones costing exactly
    ``L`` to the ranks already closest to ``L``. O(64 W) time evaluations in the usual case plus an O(W log W) sort,
    independent of ``B``.

    Raises ValueError when the batch cannot be split: fewer samples than ranks, or more than the memory ceilings hold.
    """
    check_plannable(costs, global_batch_size)
    floors = rank_floors(costs, global_batch_size, minimum)
    optional_samples = global_batch_size - sum(floors)  # beyond every rank's compulsory ones
    if optional_samples == 0:
        sizes = list(floors)
    else:
        # No rank ever takes more than its floor plus every optional sample: this bounds every search even for ranks
        # without a memory ceiling.
        cap = optional_samples + max(floors)
        level = _lowest_sufficient_level(costs, floors, optional_samples, cap)
        sizes = _fill_up_to_level(costs, floors, level, global_batch_size, cap)
    times = tuple(cost.time(size) for cost, size in zip(costs, sizes))
    return PlannedSplit(batch_sizes=tuple(sizes), predicted_step_time=max(times), predicted_times=times)


def check_plannable(costs: Sequence[CostModel], global_batch_size: int) -> int:
    """The world size, once the inputs are known to admit a split; a ValueError saying what to change otherwise."""
    world_size = len(costs)
    if world_size == 0:
        raise ValueError("plan_min_max got no cost models: give one CostModel per rank, in global rank order.")
    not_models = [c for c in costs if not isinstance(c, CostModel)]
    if not_models:
        raise ValueError(f"plan_min_max needs one CostModel per rank, got {not_models[:3]!r}.")
    check_positive_int("global_batch_size", global_batch_size)
    check_global_batch_covers_ranks(global_batch_size, world_size)
    ceilings = [cost.max_batch for cost in costs if cost.max_batch is not None]
    if len(ceilings) == world_size:
        capacity = sum(ceilings)
        if global_batch_size > capacity:
            raise ValueError(
                f"`global_batch_size={global_batch_size}` does not fit: the ranks' memory ceilings"
                f" (max_batch={[cost.max_batch for cost in costs]}) hold at most {capacity} samples per step. Lower"
                f" the global batch to at most {capacity}, add devices, or keep the effective batch with gradient"
                f" accumulation (at least {math.ceil(global_batch_size / capacity)} accumulation steps of at most"
                f" {capacity} samples each)."
            )
    return world_size


def _optional_samples_within(
    costs: Sequence[CostModel], floors: Sequence[int], level: float, cap: int, enough: int
) -> int:
    """How many optional samples (each rank's beyond its floor) cost ``<= level``; stops counting at ``enough``."""
    total = 0
    for cost, floor in zip(costs, floors):
        total += max(0, cost.largest_batch_within(level, cap) - floor)
        if total >= enough:
            break
    return total


def _lowest_sufficient_level(
    costs: Sequence[CostModel], floors: Sequence[int], optional_samples: int, cap: int
) -> float:
    """The smallest float ``L`` with at least ``optional_samples`` non-compulsory samples costing ``<= L``.

    The count only changes at values ``time_r(k)``, so the smallest such float *is* one of them: searching the floats
    themselves (by bisecting their bit patterns, which for non-negative doubles sort like the values) finds it exactly,
    with no tolerance to choose and at most 64 probes.
    """
    # Imported here rather than at the top because this section is appended below the module's import block.
    import struct

    double, signed = struct.Struct("<d"), struct.Struct("<q")

    def ordinal(value: float) -> int:
        return signed.unpack(double.pack(value))[0]

    def from_ordinal(ordinal_value: int) -> float:
        return double.unpack(signed.pack(ordinal_value))[0]

    # Below the cheapest first optional sample nothing optional fits; at the dearest sample any rank may need, all of
    # them do (`check_plannable` made sure that is enough).
    reachable = [(c, f) for c, f in zip(costs, floors) if c.max_batch is None or c.max_batch > f]
    too_low = ordinal(min(cost.time(floor + 1) for cost, floor in reachable)) - 1
    high_enough = ordinal(max(cost.time(cap if cost.max_batch is None else min(cap, cost.max_batch)) for cost in costs))
    while high_enough - too_low > 1:
        middle = (too_low + high_enough) // 2
        if _optional_samples_within(costs, floors, from_ordinal(middle), cap, optional_samples) >= optional_samples:
            high_enough = middle
        else:
            too_low = middle
    return from_ordinal(high_enough)


def _fill_up_to_level(
    costs: Sequence[CostModel], floors: Sequence[int], level: float, global_batch_size: int, cap: int
) -> list[int]:
    """Give every rank all its samples cheaper than ``level``, then the missing ones among those costing exactly it."""
    just_below = math.nextafter(level, -math.inf)
    # max(floor, ...): the compulsory samples count even when they alone cost more than `level`.
    sizes = [max(f, cost.largest_batch_within(just_below, cap)) for cost, f in zip(costs, floors)]
    at_level = [max(f, c.largest_batch_within(level, cap)) - size for c, f, size in zip(costs, floors, sizes)]
    missing = global_batch_size - sum(sizes)
    # A rank that gets no sample at `level` stays at its current time, so the ranks already closest to `level` should
    # get them: that leaves the lowest times to the others (the lexicographic tie-break of plan_min_max) and serves
    # ranks already at `level` first, lifting no more ranks to it than needed. Equal times: lower rank first.
    takers = sorted(
        (rank for rank, room in enumerate(at_level) if room > 0),
        key=lambda rank: (-costs[rank].time(sizes[rank]), rank),
    )
    for rank in takers:
        if missing == 0:
            break
        taken = min(at_level[rank], missing)
        sizes[rank] += taken
        missing -= taken
    return sizes


# The automatic split stays equal unless the planner predicts at least this gain over the equal split: below it an
# uneven split would mostly chase timing noise.
MIN_PREDICTED_GAIN = 0.05
# ... and this much when every rank's device is the same model (same static facts): those ranks are presumed equally
# fast, and a one-shot profile can tell them apart by more than 5 % for a while. On this project's 2-vCPU test
# machine, profiles of identical ranks predicted gains of 6-18 % (once 28 %) that training then did not show: those
# splits ran 6-8 % slower than the equal one. With 2 ranks, a same-model rank has to be 1.5x slower to be split around.
MIN_PREDICTED_GAIN_SAME_MODEL = 0.25


def required_gain(same_model: bool) -> float:
    """The predicted gain over the equal split that the automatic split needs before it leaves the equal split."""
    return MIN_PREDICTED_GAIN_SAME_MODEL if same_model else MIN_PREDICTED_GAIN


@dataclass(frozen=True)
class AutomaticSplit:
    """The automatic split's decision and the predictions behind it."""

    planned: PlannedSplit  # what the job will run
    equal_split_step_time: float  # inf when the equal split breaks a memory ceiling
    kept_equal: bool  # the planner's split was not worth it
    min_gain: float  # the predicted gain the planner's split needed

    @property
    def predicted_speedup(self) -> float:
        return self.planned.speedup_over(self.equal_split_step_time)


def plan_automatic_split(
    costs: Sequence[CostModel], global_batch_size: int, min_gain: float = MIN_PREDICTED_GAIN
) -> AutomaticSplit:
    """:func:`plan_min_max`, unless the equal split fits in memory and is predicted within ``min_gain`` of it."""
    planned = plan_min_max(costs, global_batch_size, MIN_SAMPLES_PER_RANK)
    equal_time = equal_split_time(costs, global_batch_size)
    if planned.speedup_over(equal_time) >= 1 + min_gain:
        return AutomaticSplit(planned, equal_time, kept_equal=False, min_gain=min_gain)
    equal = tuple(split_by_weights(global_batch_size, [1.0] * len(costs)))
    times = predicted_times(costs, equal)
    return AutomaticSplit(PlannedSplit(equal, max(times), times), equal_time, kept_equal=True, min_gain=min_gain)
