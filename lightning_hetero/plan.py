"""Plan: how one global batch of ``B`` samples is split into per-rank micro-batches.

Everything here is a pure function (values in, values out; no process group, no clock), so it is tested
exhaustively and the strategy only calls it. Two groups of checks exist because the constructor does not know the
world size yet: :func:`check_split_arguments` runs in ``HeteroStrategy.__init__``; :func:`resolve_batch_sizes`
runs at setup on every rank, before any collective, with the world size and the global batch known.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from lightning_hetero.arguments import is_int as _is_int
from lightning_hetero.arguments import is_real as _is_real
from lightning_hetero.arguments import per_rank_list


@dataclass(frozen=True)
class SplitPlan:
    """The per-rank micro-batch sizes of one global batch and where they came from."""

    batch_sizes: tuple[int, ...]
    source: str  # "batch_sizes", "weights" or "equal": which argument decided the split

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

    def shares(self) -> tuple[float, ...]:
        total = self.global_batch_size
        return tuple(b / total for b in self.batch_sizes)

    def loss_weight(self, rank: int, loss_reduction: str = "mean") -> float:
        """Factor on rank ``rank``'s loss that makes DeepSpeed's update the one DDP makes: see :func:`loss_weight`."""
        return loss_weight(self.batch_sizes[rank], self.global_batch_size, self.world_size, loss_reduction)


def loss_weight(local_samples: int, global_samples: int, world_size: int, loss_reduction: str = "mean") -> float:
    """The factor on a rank's loss under which DeepSpeed's update is DDP's, whatever the split.

    DeepSpeed divides the summed gradients by the world size ``W`` whatever each rank's batch was. For a loss that is
    the mean over the rank's ``b_r`` samples (``loss_reduction="mean"``), DDP's update is the gradient of the mean over
    all ``B`` samples, so the rank counts ``b_r * W / B`` times its own mean. For a loss that is the sum over its
    samples (``"sum"``), DDP's update is the gradient of the global sum divided by ``W``: exactly DeepSpeed's
    average of the ranks' sums, so the factor is 1. For ``"token_mean"`` the counts are tokens, not samples: a rank
    whose loss is the mean over its ``n_r`` tokens counts ``n_r * W / N`` times, so the update is the gradient of the
    mean over all ``N`` tokens of the global batch (what one process computes on it; DDP's average of per-rank token
    means is not that when the ranks' token counts differ). ``N`` is 0 when no rank has a token: the factor is then 0.
    """
    if loss_reduction == "sum":
        return 1.0
    return local_samples * world_size / global_samples if global_samples else 0.0


def split_by_weights(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """Integer parts of ``total`` proportional to ``weights``, each at least ``minimum``, summing to ``total``.

    Largest-remainder (Hamilton) apportionment: every part is the floor or the ceiling of its exact quota
    ``total * w / sum(w)`` unless the ``minimum`` lifts it. Ties go to the lower rank, so every rank computes the
    same split. Requires ``total >= minimum * len(weights)``.
    """
    count = len(weights)
    if count == 0:
        raise ValueError("split_by_weights needs at least one weight")
    if total < minimum * count:
        raise ValueError(f"cannot split {total} into {count} parts of at least {minimum} each")
    bad = [w for w in weights if not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0]
    if bad:
        raise ValueError(f"split_by_weights needs finite weights > 0, got {list(weights)} (bad: {bad})")
    # Exact rational quotas: no overflow for huge weights, no rounding that could move a part off its floor/ceil or
    # turn a tie into a non-tie (every rank must compute the same split).
    exact = [Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(float(w)) for w in weights]
    weight_sum = sum(exact)
    quotas = [total * w / weight_sum for w in exact]
    parts = [max(minimum, math.floor(q)) for q in quotas]
    excess = sum(parts) - total
    # Too many: take back from the parts furthest above their quota (never below the minimum); on a tie the higher
    # rank gives one back, so the lower rank keeps the larger part as in the hand-out below.
    while excess > 0:
        candidates = [i for i in range(count) if parts[i] > minimum]
        i = max(candidates, key=lambda i: (parts[i] - quotas[i], i))
        parts[i] -= 1
        excess -= 1
    # Too few: hand out to the largest remainders.
    order = sorted(range(count), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[: -excess if excess < 0 else 0]:
        parts[i] += 1
    return parts


def check_split_arguments(
    global_batch_size: Optional[int],
    batch_sizes: Optional[Sequence[int]],
    weights: Optional[Sequence[float]],
) -> None:
    """Checks that need no world size: run them in the constructor so a mistake fails before any process starts."""
    if batch_sizes is not None and weights is not None:
        raise ValueError(
            f"HeteroStrategy got both `batch_sizes={batch_sizes!r}` and `weights={weights!r}`."
            " Pass one of them: `batch_sizes` fixes each rank's micro-batch, `weights` derives them."
        )
    if global_batch_size is not None and (not _is_int(global_batch_size) or global_batch_size < 1):
        raise ValueError(
            f"`global_batch_size={global_batch_size!r}` must be a positive integer (samples per optimizer step"
            " across all ranks), or None to use the training loader's batch_size times the world size."
        )
    if batch_sizes is not None:
        batch_sizes = per_rank_list("batch_sizes", batch_sizes, "[8, 24]")
        if len(batch_sizes) == 0:
            raise ValueError("`batch_sizes=[]` is empty: give one micro-batch size per rank, e.g. [8, 24].")
        bad = [b for b in batch_sizes if not _is_int(b) or b < 1]
        if bad:
            raise ValueError(
                f"`batch_sizes={list(batch_sizes)}` holds {bad}: every rank needs an integer micro-batch of at least"
                " 1. Raise those entries, or leave the rank out of the job."
            )
        if global_batch_size is not None and sum(batch_sizes) != global_batch_size:
            raise ValueError(
                f"`batch_sizes={list(batch_sizes)}` sums to {sum(batch_sizes)} but `global_batch_size="
                f"{global_batch_size}`. Make them agree, or drop `global_batch_size` (it is then the sum)."
            )
    if weights is not None:
        weights = per_rank_list("weights", weights, "[1.0, 0.4]")
        if len(weights) == 0:
            raise ValueError("`weights=[]` is empty: give one relative capability per rank, e.g. [1.0, 0.4].")
        bad_weights = [w for w in weights if not _is_real(w) or not math.isfinite(w) or w <= 0]
        if bad_weights:
            raise ValueError(
                f"`weights={list(weights)}` holds {bad_weights}: each weight must be a finite number > 0"
                " (a relative capability such as 1.0 for the fastest rank and 0.4 for a slower one)."
            )


def resolve_split(
    world_size: int,
    global_batch_size: int,
    batch_sizes: Optional[Sequence[int]] = None,
    weights: Optional[Sequence[float]] = None,
) -> SplitPlan:
    """The split for a job of ``world_size`` ranks: explicit sizes, sizes derived from weights, or an equal split."""
    check_split_arguments(global_batch_size, batch_sizes, weights)
    if batch_sizes is not None and len(batch_sizes) != world_size:
        raise ValueError(
            f"`batch_sizes={list(batch_sizes)}` has {len(batch_sizes)} entries but the job has {world_size}"
            " ranks. Give exactly one micro-batch size per rank (in global rank order), or use `weights`."
        )
    if weights is not None and len(weights) != world_size:
        raise ValueError(
            f"`weights={list(weights)}` has {len(weights)} entries but the job has {world_size} ranks."
            " Give exactly one weight per rank, in global rank order."
        )
    if global_batch_size < world_size:
        raise ValueError(
            f"`global_batch_size={global_batch_size}` is smaller than the world size {world_size}: every rank needs"
            f" at least one sample per step. Use a global batch of at least {world_size}, or fewer devices."
        )
    if batch_sizes is not None:
        return SplitPlan(tuple(int(b) for b in batch_sizes), source="batch_sizes")
    if weights is not None:
        return SplitPlan(tuple(split_by_weights(global_batch_size, weights)), source="weights")
    return SplitPlan(tuple(split_by_weights(global_batch_size, [1.0] * world_size)), source="equal")


# ---------------------------------------------------------------------------------------------------------------------
# Planner: the split of one global batch that minimises the slowest rank's predicted step time.
#
# Every rank waits for the slowest at each optimizer step, so the step takes max_r time_r(b_r). `plan_min_max` finds
# integer sizes minimising that maximum exactly. It never loops over samples: it searches the one number that decides
# the answer, the time level below which every sample is taken (see `_lowest_sufficient_level`), in at most 64
# feasibility checks of O(W) time evaluations each (a few more per rank only where rounding flattens its times), and
# only ever compares values that `CostModel.time` itself returns, so floating-point rounding cannot make it disagree
# with an evaluation of the split it returns.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted step time of one rank as a function of its micro-batch size ``b``: ``fixed + per_sample * b`` seconds.

    ``fixed`` is what a step costs whatever the batch (optimizer step, communication, launch overheads), ``per_sample``
    the cost of one more sample, and ``max_batch`` the largest micro-batch that fits in the device's memory (None: no
    ceiling known). The fields are stored as ``float``/``int`` so that every rank evaluates the same IEEE expression.
    """

    fixed: float
    per_sample: float
    max_batch: Optional[int] = None

    def __post_init__(self) -> None:
        if not _is_real(self.fixed) or not math.isfinite(self.fixed) or self.fixed < 0:
            raise ValueError(
                f"CostModel `fixed={self.fixed!r}` must be a finite number of seconds >= 0 (the part of a step that"
                " does not depend on the micro-batch size)."
            )
        if not _is_real(self.per_sample) or not math.isfinite(self.per_sample) or self.per_sample <= 0:
            raise ValueError(
                f"CostModel `per_sample={self.per_sample!r}` must be a finite number of seconds > 0 (what one more"
                " sample adds to a step); a rank whose step time does not grow with its batch cannot be balanced."
            )
        if self.max_batch is not None:
            if not _is_int(self.max_batch):
                raise ValueError(
                    f"CostModel `max_batch={self.max_batch!r}` must be an integer (the largest micro-batch that fits"
                    " in the device's memory) or None when no ceiling is known."
                )
            if self.max_batch < 1:
                raise ValueError(
                    f"CostModel `max_batch={self.max_batch}`: the device cannot hold even one sample, so it cannot"
                    " take part in data-parallel training. Leave it out of the job, or free memory on it (a larger"
                    " ZeRO stage, offloading, activation checkpointing)."
                )
        # An int `fixed` or `per_sample` would make time() exact integer arithmetic, whose values the planner's search
        # over floats could step over; store floats so time() is one IEEE expression everywhere.
        object.__setattr__(self, "fixed", float(self.fixed))
        object.__setattr__(self, "per_sample", float(self.per_sample))

    def time(self, batch_size: int) -> float:
        """Predicted seconds for one step with a micro-batch of ``batch_size`` samples (ignores ``max_batch``)."""
        return self.fixed + self.per_sample * batch_size

    def largest_batch_within(self, time_limit: float, cap: int) -> int:
        """The largest ``b <= min(cap, max_batch)`` with ``time(b) <= time_limit``; 0 if even one sample is too slow.

        The closed form ``(time_limit - fixed) / per_sample`` can be off by rounding, so it is only a starting guess:
        the answer is settled by comparing ``time(b)`` itself, which never decreases as ``b`` grows (IEEE
        multiplication and addition are monotone), using a galloping search that costs two evaluations when the guess
        is right and O(log(error)) otherwise.
        """
        high = cap if self.max_batch is None else min(cap, self.max_batch)
        if high < 1:
            return 0
        quotient = (time_limit - self.fixed) / self.per_sample
        # `quotient >= high` also catches inf; below 1 start from 0 and let the search try b = 1 itself.
        if quotient >= high:
            guess = high
        elif quotient >= 1:
            guess = int(quotient)
        else:
            guess = 0
        return _last_true(lambda b: self.time(b) <= time_limit, guess, high)


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


def plan_min_max(costs: Sequence[CostModel], global_batch_size: int) -> PlannedSplit:
    """Integer micro-batch sizes ``b_r`` (``1 <= b_r <= max_batch_r``, summing to ``global_batch_size``) that minimise
    the predicted step time ``max_r costs[r].time(b_r)`` exactly.

    Ties among optimal splits are broken so that every rank computes the same answer and no rank waits longer than it
    must: the split returned makes the vector of per-rank times, sorted from slowest to fastest, lexicographically
    smallest (fewest ranks at the maximum, then the smallest second-slowest time, ...), and among splits with equal
    such vectors gives the extra samples to the lower ranks (the lexicographically largest ``batch_sizes``), as
    :func:`split_by_weights` does, so identical devices get exactly the equal split. That lexicographic guarantee
    holds whenever each rank's time strictly grows with its batch, which is always the case unless ``per_sample`` is
    so small next to ``fixed`` that adjacent batch sizes round to the same float; the maximum is minimal in every case.

    How: call a sample's *cost* the time its rank reaches when it takes that sample. Each rank's first sample is
    compulsory; of the rest, an optimal split takes the ``B - W`` cheapest. So it finds the lowest level ``L`` with at
    least ``B - W`` optional samples costing ``<= L`` (a search over the at most 2**63 non-negative doubles, each probe
    counting O(1) per rank), gives every rank all its samples cheaper than ``L``, and hands out the ones costing exactly
    ``L`` to the ranks already closest to ``L``. O(64 W) time evaluations in the usual case plus an O(W log W) sort,
    independent of ``B``.

    Raises ValueError when the batch cannot be split: fewer samples than ranks, or more than the memory ceilings hold.
    """
    world_size = _check_plannable(costs, global_batch_size)
    optional_samples = global_batch_size - world_size  # beyond every rank's compulsory first one
    if optional_samples == 0:
        sizes = [1] * world_size
    else:
        # No rank ever takes more than B - (W - 1) samples (the others hold one each): this bounds every search even
        # for ranks without a memory ceiling.
        cap = optional_samples + 1
        level = _lowest_sufficient_level(costs, optional_samples, cap)
        sizes = _fill_up_to_level(costs, level, global_batch_size, cap)
    times = tuple(cost.time(size) for cost, size in zip(costs, sizes))
    return PlannedSplit(batch_sizes=tuple(sizes), predicted_step_time=max(times), predicted_times=times)


def _check_plannable(costs: Sequence[CostModel], global_batch_size: int) -> int:
    """The world size, once the inputs are known to admit a split; a ValueError saying what to change otherwise."""
    world_size = len(costs)
    if world_size == 0:
        raise ValueError("plan_min_max got no cost models: give one CostModel per rank, in global rank order.")
    not_models = [c for c in costs if not isinstance(c, CostModel)]
    if not_models:
        raise ValueError(f"plan_min_max needs one CostModel per rank, got {not_models[:3]!r}.")
    if not _is_int(global_batch_size) or global_batch_size < 1:
        raise ValueError(f"`global_batch_size={global_batch_size!r}` must be a positive integer.")
    if global_batch_size < world_size:
        raise ValueError(
            f"`global_batch_size={global_batch_size}` is smaller than the world size {world_size}: every rank needs"
            f" at least one sample per step. Use a global batch of at least {world_size}, or fewer devices."
        )
    if all(cost.max_batch is not None for cost in costs):
        capacity = sum(cost.max_batch for cost in costs)
        if global_batch_size > capacity:
            raise ValueError(
                f"`global_batch_size={global_batch_size}` does not fit: the ranks' memory ceilings"
                f" (max_batch={[cost.max_batch for cost in costs]}) hold at most {capacity} samples per step. Lower"
                f" the global batch to at most {capacity}, add devices, or keep the effective batch with gradient"
                f" accumulation (at least {math.ceil(global_batch_size / capacity)} accumulation steps of at most"
                f" {capacity} samples each)."
            )
    return world_size


def _optional_samples_within(costs: Sequence[CostModel], level: float, cap: int, enough: int) -> int:
    """How many optional samples (each rank's second and later) cost ``<= level``; stops counting at ``enough``."""
    total = 0
    for cost in costs:
        total += max(0, cost.largest_batch_within(level, cap) - 1)
        if total >= enough:
            break
    return total


def _lowest_sufficient_level(costs: Sequence[CostModel], optional_samples: int, cap: int) -> float:
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

    # Below the cheapest second sample nothing optional fits; at the dearest sample any rank may need, all of them do
    # (`_check_plannable` made sure that is enough).
    reachable = [cost for cost in costs if cost.max_batch is None or cost.max_batch >= 2]
    too_low = ordinal(min(cost.time(2) for cost in reachable)) - 1
    high_enough = ordinal(max(cost.time(cap if cost.max_batch is None else min(cap, cost.max_batch)) for cost in costs))
    while high_enough - too_low > 1:
        middle = (too_low + high_enough) // 2
        if _optional_samples_within(costs, from_ordinal(middle), cap, optional_samples) >= optional_samples:
            high_enough = middle
        else:
            too_low = middle
    return from_ordinal(high_enough)


def _fill_up_to_level(costs: Sequence[CostModel], level: float, global_batch_size: int, cap: int) -> list[int]:
    """Give every rank all its samples cheaper than ``level``, then the missing ones among those costing exactly it."""
    just_below = math.nextafter(level, -math.inf)
    # max(1, ...): the compulsory first sample counts even when it alone costs more than `level`.
    sizes = [max(1, cost.largest_batch_within(just_below, cap)) for cost in costs]
    at_level = [max(1, cost.largest_batch_within(level, cap)) - size for cost, size in zip(costs, sizes)]
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


def _last_true(holds, guess: int, high: int) -> int:
    """The largest ``k`` in ``[0, high]`` with ``holds(k)``, for a ``holds`` that is true up to some point, then false.

    ``holds(0)`` is taken to be true and never called. Gallops from ``guess`` (doubling steps towards the boundary),
    then bisects the bracket found, so a good guess costs one or two calls.
    """
    if guess == 0 or holds(guess):
        good, step = guess, 1
        while True:
            probe = good + step
            if probe > high:
                bad = high + 1
                break
            if not holds(probe):
                bad = probe
                break
            good, step = probe, step * 2
    else:
        bad, step = guess, 1
        while True:
            probe = bad - step
            if probe < 1:
                good = 0
                break
            if holds(probe):
                good = probe
                break
            bad, step = probe, step * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        if holds(middle):
            good = middle
        else:
            bad = middle
    return good


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
    planned = plan_min_max(costs, global_batch_size)
    equal_time = equal_split_time(costs, global_batch_size)
    if planned.speedup_over(equal_time) >= 1 + min_gain:
        return AutomaticSplit(planned, equal_time, kept_equal=False, min_gain=min_gain)
    equal = tuple(split_by_weights(global_batch_size, [1.0] * len(costs)))
    times = predicted_times(costs, equal)
    return AutomaticSplit(PlannedSplit(equal, max(times), times), equal_time, kept_equal=True, min_gain=min_gain)
