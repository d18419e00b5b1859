"""Plan: the split a trainer call starts with, and the cost models the re-planner starts from.

Pure functions of what the ranks gathered (arguments, profiles, device facts, precisions): every rank calls them with
the same values and takes the same decision, so no rank waits for another's choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.profiler import RankProfile, loss_reduction_mismatch
from lightning_hetero.plan.planner import plan_automatic_split, required_gain
from lightning_hetero.plan.replan import Rebalancer
from lightning_hetero.plan.split import SplitPlan, resolve_split


@dataclass(frozen=True)
class InitialPlan:
    plan: SplitPlan
    prediction: Optional[dict[str, Any]]  # the planner's predicted step times (automatic split only)
    warning: Optional[str] = None  # a profile that contradicts the declared loss reduction


def cost_models(profiles: Sequence[RankProfile], held_bytes: float) -> list[CostModel]:
    """Each rank's profile as a cost model, its memory ceiling lowered by what the profile could not see."""
    return [profile.reserving(held_bytes).cost_model() for profile in profiles]


def initial_plan(
    world_size: int,
    global_batch_size: int,
    batch_sizes: Optional[Sequence[int]],
    weights: Optional[Sequence[float]],
    profiles: Optional[Sequence[RankProfile]],
    loss_reduction: str,
    identical_devices: bool,
    held_bytes: float,
) -> InitialPlan:
    """The fixed split the user gave, or the planner's from the profiles.

    ``identical_devices``: same-model devices in one precision and no emulated speeds, presumed equally fast unless
    the profile says otherwise by a wide margin (:func:`~lightning_hetero.plan.planner.required_gain`).
    ``held_bytes``: memory each rank holds until the step that its profile did not see.
    """
    if profiles is None:
        return InitialPlan(resolve_split(world_size, global_batch_size, batch_sizes, weights), None)
    resolve_split(world_size, global_batch_size)  # the global batch must give every rank a sample
    warning = loss_reduction_mismatch([profile.loss_ratio for profile in profiles], loss_reduction)
    decision = plan_automatic_split(
        cost_models(profiles, held_bytes), global_batch_size, min_gain=required_gain(identical_devices)
    )
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
    return InitialPlan(SplitPlan(planned.batch_sizes, source=source), prediction, warning)


def rebalancer_for(
    plan: SplitPlan,
    profiles: Optional[Sequence[RankProfile]],
    held_bytes: float,
    window: int,
    threshold: float,
) -> Rebalancer:
    """What re-plans the split during a fit, starting from the profiles' cost models; a split the user fixed has
    no profile: time proportional to the batch, and no memory ceiling known."""
    world_size = len(plan.batch_sizes)
    if profiles is not None:
        base = cost_models(profiles, held_bytes)
    else:
        base = [CostModel(fixed=0.0, per_sample=1.0)] * world_size
    return Rebalancer(base, plan.batch_sizes, window, threshold)
