"""Train: apply a learning-rate scaling (:mod:`lightning_hetero.configure.lr_scaling`) to optimizers and schedulers.

It runs as the resumed fit's training starts (the strategy's ``on_train_start``): after DeepSpeed restored the
optimizer's groups and Lightning the schedulers' state (a scheduler restored after a scaling would undo it at its next
step, recomputing the rate from its ``base_lrs``), and before any step, so that every checkpoint of the fit, one saved
before its first step included, records the scaled rates with the new global batch: a later resume at that batch
scales nothing again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lightning_hetero.configure.lr_scaling import LrScaling

# Learning rates a parameter group may hold besides "lr": the schedulers' starting rate and OneCycleLR's bounds.
GROUP_RATES = ("lr", "initial_lr", "max_lr", "min_lr")
# Learning rates a scheduler holds (public attributes): what it computes the next rate from.
SCHEDULER_RATES = ("base_lrs", "max_lrs", "min_lrs")
# ... and a single floor (CosineAnnealingLR, CosineAnnealingWarmRestarts).
SCHEDULER_FLOORS = ("eta_min",)


def base_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Lightning's and DeepSpeed's wrappers (each keeps it as ``.optimizer``)."""
    seen = 0
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


def is_decoupled(optimizer: Any, group: dict[str, Any]) -> bool:
    """Whether ``group``'s weight decay is decoupled (AdamW's), not an L2 term in the gradient."""
    if isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay"):
        return True
    return bool(group.get("adam_w_mode") or getattr(optimizer, "adam_w_mode", False))  # DeepSpeed's Adam kernels


def scale_optimizers(optimizers: Iterable[Any], schedulers: Iterable[Any], scaling: LrScaling) -> bool:
    """Scale every group's learning rates (and its decoupled weight decay) and every scheduler's; True when some
    group's weight decay was decoupled and non-zero (so scaled)."""
    decoupled_any = False
    for wrapped in optimizers:
        optimizer = base_optimizer(wrapped)
        for group in optimizer.param_groups:
            for key in GROUP_RATES:
                if isinstance(group.get(key), torch.Tensor):  # a tensor rate (capturable, fused): kept in place
                    group[key].mul_(scaling.lr_factor)
                elif isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * scaling.lr_factor
            if group.get("weight_decay") and is_decoupled(optimizer, group):
                group["weight_decay"] = group["weight_decay"] * scaling.decoupled_decay_factor
                decoupled_any = True
    for scheduler in schedulers:
        _scale_scheduler(scheduler, scaling.lr_factor)
    return decoupled_any


def _scale_scheduler(scheduler: Any, factor: float) -> None:
    for key in SCHEDULER_RATES:
        rates = getattr(scheduler, key, None)
        if isinstance(rates, list) and all(isinstance(rate, (int, float)) for rate in rates):
            setattr(scheduler, key, [rate * factor for rate in rates])
    for key in SCHEDULER_FLOORS:
        if isinstance(getattr(scheduler, key, None), (int, float)):
            setattr(scheduler, key, getattr(scheduler, key) * factor)
    # SequentialLR and ChainedScheduler step the schedulers they hold, each from its own base_lrs: scaled too.
    for inner in getattr(scheduler, "_schedulers", None) or ():
        _scale_scheduler(inner, factor)
