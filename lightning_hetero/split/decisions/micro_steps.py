"""Plan: per-rank micro-steps for memory-bound ranks: rank r takes ``n_r`` samples per optimizer step in ``k_r``
micro-batches, so a fast device with little memory still takes the share its speed deserves.

``k_r = ceil(n_r / max_batch_r)``: as few micro-steps as the rank's memory allows (each pays the fixed cost again),
and its micro-batches as equal as possible (sizes differ by at most one, so any ``n_r`` can be cut exactly; the loss
weights make every sample count the same whatever its micro-batch). A rank's time is ``k_r * fixed_r +
per_sample_r * n_r``. A pure function over cost models, like
:func:`~lightning_hetero.split.decisions.planner.plan_min_max`: it minimises the slowest rank's time for exactly the
global batch. Without a binding memory ceiling every ``k_r = 1`` and the slowest rank's time is ``plan_min_max``'s.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.measure.cost import CostModel, last_true
from lightning_hetero.split.decisions.planner import (
    MIN_SAMPLES_PER_RANK,
    AutomaticSplit,
    PlannedSplit,
    check_plannable,
    plan_automatic_split,
    plan_min_max,
)
from lightning_hetero.split.decisions.split import split_by_weights

# ZeRO stages whose ranks may run different numbers of forward/backward passes per optimizer step: 0-2 reduce once, in
# the step (the strategy runs them with DeepSpeed's managed accumulation off); ZeRO-3 gathers parameters in every
# forward and reduces in every backward, so each rank must run as many as the others.
UNEQUAL_MICRO_STEP_STAGES = (0, 1, 2)


@dataclass(frozen=True)
class MicroStepPlan:
    samples: tuple[int, ...]  # n_r: samples per optimizer step
    micro_steps: tuple[int, ...]  # k_r: micro-batches per optimizer step
    predicted_times: tuple[float, ...]

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Each rank's largest micro-batch (what its memory must hold)."""
        return tuple(-(-n // k) for n, k in zip(self.samples, self.micro_steps))

    @property
    def predicted_step_time(self) -> float:
        return max(self.predicted_times)

    @property
    def global_batch_size(self) -> int:
        return sum(self.samples)


def micro_steps_for(cost: CostModel, samples: int) -> int:
    return 1 if cost.max_batch is None or samples <= cost.max_batch else -(-samples // cost.max_batch)


def rank_time(cost: CostModel, samples: int) -> float:
    """Predicted seconds for ``samples`` samples in as few micro-batches as memory allows (``cost.time`` for one)."""
    return micro_steps_for(cost, samples) * cost.fixed + cost.per_sample * samples


def most_samples_within(cost: CostModel, level: float, cap: int) -> int:
    """The most samples (at most ``cap``) the rank takes within ``level`` seconds; 0 if not even one."""
    per_sample = cost.per_sample + (cost.fixed / cost.max_batch if cost.max_batch else 0.0)
    quotient = (level - (0.0 if cost.max_batch else cost.fixed)) / per_sample
    guess = cap if quotient >= cap else max(0, int(quotient))
    return last_true(lambda n: rank_time(cost, n) <= level, guess, cap)


def plan_micro_steps(costs: Sequence[CostModel], global_batch_size: int, minimum: int = 1) -> MicroStepPlan:
    """The samples and micro-steps per rank that minimise the slowest rank's time for exactly ``global_batch_size``,
    every rank taking at least ``minimum`` samples (1 each when the batch cannot give every rank that many; a memory
    ceiling does not lower it: a rank takes its samples in micro-batches).

    Searches the one number that decides it, the lowest time level at which the ranks together can take the global
    batch (bisection over floats down to adjacent values; a rank's time grows with its samples). A rank too slow for
    even its floor within it still takes its floor: it then sets the step time, and the level balances the others.
    Ranks with equal cost models are evaluated once per model, so 10,000 devices of a few kinds cost a few evaluations
    per level.
    """
    check_plannable([CostModel(c.fixed, c.per_sample) for c in costs], global_batch_size)
    floor = minimum if minimum * len(costs) <= global_batch_size else 1
    groups = Counter(costs)
    # Every rank takes at least its floor, however long that takes it; the level balances the others below that.
    low, high = 0.0, max(rank_time(c, floor) for c in groups)
    while _capacity(groups, high, global_batch_size, floor) < global_batch_size:
        low, high = high, high * 2 if high > 0 else 1.0
    while True:
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if _capacity(groups, middle, global_batch_size, floor) >= global_batch_size:
            high = middle
        else:
            low = middle
    at_level = {cost: max(floor, most_samples_within(cost, high, global_batch_size)) for cost in groups}
    below = {
        cost: max(floor, most_samples_within(cost, math.nextafter(high, 0.0), global_batch_size)) for cost in groups
    }
    samples = _trim_to(costs, at_level, below, global_batch_size, floor)
    steps = tuple(micro_steps_for(c, n) for c, n in zip(costs, samples))
    return MicroStepPlan(tuple(samples), steps, tuple(rank_time(c, n) for c, n in zip(costs, samples)))


def _capacity(groups: Counter, level: float, cap: int, floor: int) -> int:
    """Samples the ranks take within ``level``, each at least ``floor``."""
    total = 0
    for cost, count in groups.items():
        total += count * max(floor, most_samples_within(cost, level, cap))
        if total >= cap:
            return total
    return total


def _trim_to(costs: Sequence[CostModel], at_level: dict, below: dict, global_batch_size: int, floor: int) -> list[int]:
    """Exactly ``global_batch_size`` samples: the level's samples less some of those that only the level itself allows
    (one per rank in turn, so equal devices differ by at most one), then, if still too many, any above ``floor``
    each."""
    samples = [at_level[cost] for cost in costs]
    excess = sum(samples) - global_batch_size
    for floors in ([below[cost] for cost in costs], [floor] * len(costs)):
        while excess > 0:
            removable = [rank for rank, n in enumerate(samples) if n > floors[rank]]
            if not removable:
                break
            take = min(excess, len(removable))
            # Round-robin over the ranks that still hold removable samples, the slowest first, one sample each.
            removable.sort(key=lambda rank: -rank_time(costs[rank], samples[rank]))
            for rank in removable[:take]:
                samples[rank] -= 1
            excess -= take
    return samples


def micro_steps_refusal(
    micro_steps: Optional[Sequence[int]],
    stage: int,
    loss_reduction: str,
    automatic_optimization: bool,
    sync_batchnorm: bool = False,
) -> Optional[str]:
    """Why the job cannot run the micro-steps the user fixed (None when it can): checked on every rank before any
    collective, so every rank raises the same error."""
    if micro_steps is None or all(k == 1 for k in micro_steps):
        return None
    if sync_batchnorm and len(set(micro_steps)) > 1:
        return (
            f"`micro_steps={list(micro_steps)}` differ across ranks, and `Trainer(sync_batchnorm=True)` exchanges"
            " BatchNorm statistics in every forward pass, so every rank must make as many passes as the others (the"
            " ranks' i-th micro-batches normalize together). Give every rank the same count, or remove"
            " `sync_batchnorm=True`."
        )
    if stage not in UNEQUAL_MICRO_STEP_STAGES and len(set(micro_steps)) > 1:
        return (
            f"`micro_steps={list(micro_steps)}` differ across ranks, which ZeRO stage {stage} cannot run: it gathers"
            " the parameters in every forward and reduces in every backward, so every rank must make as many passes"
            f" as the others. Use a stage in {list(UNEQUAL_MICRO_STEP_STAGES)}, or the same count on every rank."
        )
    if loss_reduction == "token_mean":
        return (
            f"`micro_steps={list(micro_steps)}` with `loss_reduction='token_mean'`: a token mean's weight needs the"
            " whole global batch's token count before the first backward, which micro-batches taken one after the"
            " other do not know. Use `loss_reduction='sum'` and divide by your own token count, or micro_steps=None."
        )
    if not automatic_optimization:
        return (
            f"`micro_steps={list(micro_steps)}` with manual optimization: the strategy cannot split a step that your"
            " `training_step` drives itself. Accumulate inside your step instead, or use automatic optimization."
        )
    return None


def automatic_micro_steps_allowed(
    stage: int, loss_reduction: str, automatic_optimization: bool, sync_batchnorm: bool = False
) -> bool:
    """Whether the automatic planner may give a memory-bound rank more micro-steps than another."""
    probe = (2, 1)
    return micro_steps_refusal(probe, stage, loss_reduction, automatic_optimization, sync_batchnorm) is None


def with_fixed_micro_steps(costs: Sequence[CostModel], micro_steps: Sequence[int]) -> list[CostModel]:
    """Cost models over a rank's samples per step when it always takes them in ``k_r`` micro-batches: ``k_r`` fixed
    costs, and room for ``k_r`` times its micro-batch ceiling (the planner's ``plan_min_max`` then applies as is)."""
    return [
        CostModel(k * cost.fixed, cost.per_sample, None if cost.max_batch is None else k * cost.max_batch)
        for cost, k in zip(costs, micro_steps)
    ]


def plan_automatic_split_in_micro_steps(
    costs: Sequence[CostModel], global_batch_size: int, min_gain: float
) -> tuple[AutomaticSplit, tuple[int, ...]]:
    """The automatic split when ranks may take more micro-steps than others, and each rank's micro-steps.

    One micro-batch per rank (:func:`plan_automatic_split`, unchanged) unless a memory ceiling binds: then the split in
    micro-steps is predicted faster (or the only one that fits), and it is compared with the equal split taken in as
    few micro-steps as each rank's memory allows (what DDP with gradient accumulation would need).
    """
    planned = plan_micro_steps(costs, global_batch_size, MIN_SAMPLES_PER_RANK)
    try:
        single = plan_min_max(costs, global_batch_size, MIN_SAMPLES_PER_RANK)
    except ValueError:  # the ceilings together hold less than the global batch
        single = None
    if single is not None and single.predicted_step_time <= planned.predicted_step_time:
        return plan_automatic_split(costs, global_batch_size, min_gain), (1,) * len(costs)
    equal = tuple(split_by_weights(global_batch_size, [1.0] * len(costs)))
    equal_times = tuple(rank_time(cost, n) for cost, n in zip(costs, equal))
    chosen = PlannedSplit(planned.samples, planned.predicted_step_time, planned.predicted_times)
    if chosen.speedup_over(max(equal_times)) >= 1 + min_gain:
        return AutomaticSplit(chosen, max(equal_times), kept_equal=False, min_gain=min_gain), planned.micro_steps
    kept = PlannedSplit(equal, max(equal_times), equal_times)
    steps = tuple(micro_steps_for(cost, n) for cost, n in zip(costs, equal))
    return AutomaticSplit(kept, max(equal_times), kept_equal=True, min_gain=min_gain), steps
