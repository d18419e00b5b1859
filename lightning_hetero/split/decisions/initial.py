"""Plan: the split a trainer call starts with, and the cost models the re-planner starts from.

Pure functions of what the ranks gathered (arguments, profiles, device facts, precisions): every rank calls them with
the same values and takes the same decision, so no rank waits for another's choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_hetero.emulate.memory import lower_ceiling
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.rank_profile import RankProfile, loss_reduction_mismatch
from lightning_hetero.split.decisions.explore import StepSearch
from lightning_hetero.split.decisions.micro_steps import plan_automatic_split_in_micro_steps, with_fixed_micro_steps
from lightning_hetero.split.decisions.planner import plan_automatic_split, required_gain
from lightning_hetero.split.decisions.replan import Rebalancer
from lightning_hetero.split.decisions.split import SplitPlan, check_every_micro_batch_has_a_sample, resolve_split


@dataclass(frozen=True)
class InitialPlan:
    plan: SplitPlan
    prediction: Optional[dict[str, Any]]  # the planner's predicted step times (automatic split only)
    warning: Optional[str] = None  # a profile that contradicts the declared loss reduction


def cost_models(profiles: Sequence[RankProfile], held_bytes: float) -> list[CostModel]:
    """Each rank's profile as a cost model, its memory ceiling lowered by what the profile could not see."""
    return [profile.reserving(held_bytes).cost_model() for profile in profiles]


def within_emulated_memory(
    profiles: Optional[Sequence[RankProfile]], ceilings: Optional[Sequence[Optional[int]]]
) -> Optional[list[RankProfile]]:
    """The profiles with each rank's emulated memory ceiling (:mod:`~lightning_hetero.emulate.memory`) applied."""
    if profiles is None:
        return None
    if ceilings is None:
        return list(profiles)
    return [replace(p, max_batch=lower_ceiling(p.max_batch, c)) for p, c in zip(profiles, ceilings)]


def initial_plan(
    world_size: int,
    global_batch_size: int,
    batch_sizes: Optional[Sequence[int]],
    weights: Optional[Sequence[float]],
    profiles: Optional[Sequence[RankProfile]],
    loss_reduction: str,
    identical_devices: bool,
    held_bytes: float,
    micro_steps: Optional[Sequence[int]] = None,
    unequal_micro_steps: bool = False,
) -> InitialPlan:
    """The fixed split the user gave, or the planner's from the profiles.

    ``identical_devices``: same-model devices in one precision and no emulated speeds, presumed equally fast unless
    the profile says otherwise by a wide margin (:func:`~lightning_hetero.split.decisions.planner.required_gain`).
    ``held_bytes``: memory each rank holds until the step that its profile did not see.
    ``micro_steps``: the user's micro-steps per rank (the planner splits the samples around them), or None: one per
    rank unless ``unequal_micro_steps`` lets the planner give a memory-bound rank more
    (:func:`~lightning_hetero.split.decisions.micro_steps.plan_automatic_split_in_micro_steps`).
    """
    if profiles is None:
        return InitialPlan(resolve_split(world_size, global_batch_size, batch_sizes, weights, micro_steps), None)
    resolve_split(world_size, global_batch_size)  # the global batch must give every rank a sample
    warning = loss_reduction_mismatch([profile.loss_ratio for profile in profiles], loss_reduction)
    costs, min_gain = cost_models(profiles, held_bytes), required_gain(identical_devices)
    if micro_steps is not None:
        steps = tuple(micro_steps)
        decision = plan_automatic_split(with_fixed_micro_steps(costs, steps), global_batch_size, min_gain=min_gain)
        check_every_micro_batch_has_a_sample(decision.planned.batch_sizes, steps, "the automatic split")
    elif unequal_micro_steps:
        decision, steps = plan_automatic_split_in_micro_steps(costs, global_batch_size, min_gain)
    else:
        steps = (1,) * world_size
        decision = plan_automatic_split(costs, global_batch_size, min_gain=min_gain)
    planned = decision.planned
    source = "auto"
    if decision.kept_equal:
        devices = "same-model devices" if identical_devices else "devices"
        source = f"auto: equal, predicted gain < {decision.min_gain:.0%} on {devices}"
    prediction = {
        "step_seconds": planned.predicted_step_time,
        "rank_step_seconds": list(planned.predicted_times),
        "equal_split_step_seconds": decision.equal_split_step_time,
        "speedup": decision.predicted_speedup,
    }
    return InitialPlan(SplitPlan(planned.batch_sizes, source, steps), prediction, warning)


def rebalancer_for(
    plan: SplitPlan,
    profiles: Optional[Sequence[RankProfile]],
    held_bytes: float,
    window: int,
    threshold: float,
    fixed_micro_steps: bool = False,
    unequal_micro_steps: bool = False,
    ceilings: Optional[Sequence[Optional[int]]] = None,
) -> Rebalancer:
    """What re-plans the split during a fit, starting from the profiles' cost models; a split the user fixed has
    no profile: time proportional to the batch, and no memory ceiling known but an emulated one (``ceilings``).

    ``fixed_micro_steps``: the user fixed each rank's micro-steps, which every re-plan keeps; otherwise, where
    ``unequal_micro_steps`` allows it, a re-plan may give a rank whose share outgrew its memory more micro-steps.
    """
    world_size = len(plan.batch_sizes)
    if profiles is not None:
        base = cost_models(profiles, held_bytes)
    else:
        limits = ceilings if ceilings is not None else [None] * world_size
        base = [CostModel(fixed=0.0, per_sample=1.0, max_batch=limit) for limit in limits]
    if fixed_micro_steps:
        base = with_fixed_micro_steps(base, plan.micro_steps)
        return Rebalancer(base, plan.batch_sizes, window, threshold, fixed_micro_steps=plan.micro_steps)
    # The search's splits stay within each rank's memory ceiling, or, with micro-steps planned where memory binds, take
    # as many micro-steps as the ceiling needs.
    ceilings = () if unequal_micro_steps else tuple(cost.max_batch for cost in base)
    search = StepSearch(sum(plan.batch_sizes), ceilings)
    return Rebalancer(base, plan.batch_sizes, window, threshold, micro_steps=unequal_micro_steps, search=search)
