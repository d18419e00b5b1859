"""Precision: what the strategy does with ``device_precision`` at setup, once every rank's choice is known.

With ``device_precision`` set, this rank's :class:`~lightning_hetero.precision.plugin.HeteroPrecision` replaces the
Trainer's precision plugin (Lightning's plug point); without it the Trainer's plugin stays and every rank trains in
its precision. DeepSpeed forces the rest into the engine after it is built (``HeteroPrecision.attach``): it owns the
backward and the step, so the loss scale and the unscaling hooks go there, not into Lightning's precision hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.precision import choice
from lightning_hetero.precision.plugin import AutocastInside, HeteroPrecision


def job_plugin(
    setting: choice.DevicePrecision,
    precisions: Sequence[str],
    rank: int,
    device_facts: Sequence[DeviceFacts],
    gather_tensor: Callable[[Tensor], list[Tensor]],
    previous: Any,
) -> Optional[HeteroPrecision]:
    """This rank's plugin when ranks have their own precisions (None: the Trainer's stays); slow choices are said."""
    if setting is None:
        return None
    for other, (chosen, facts) in enumerate(zip(precisions, device_facts)):
        slow = choice.slow_precision(chosen, facts)
        if slow:
            rank_zero_warn(f"HeteroStrategy: rank {other} trains in {chosen!r}, but {slow}.")
    return HeteroPrecision(
        precisions[rank],
        device_facts[rank].kind,
        tuple(precisions),
        gather_tensor,
        # One Trainer's later fit continues with the scale it reached (a checkpoint restores its own).
        loss_scale=previous.loss_scale if isinstance(previous, HeteroPrecision) else None,
        device_types=tuple(facts.kind for facts in device_facts),
    )


def gradient_bytes_held_until_step(
    setting: choice.DevicePrecision,
    precisions: Sequence[str],
    device_facts: Sequence[DeviceFacts],
    zero_stage: int,
    module: torch.nn.Module,
) -> float:
    """Memory the profile did not see: ranks under different autocasts at ZeRO-2/3 hold every parameter's fp32
    gradient until the step (see :class:`~lightning_hetero.precision.plugin.ParameterOrderReduction`)."""
    kinds = [facts.kind for facts in device_facts]
    if setting is None or not choice.reduces_in_parameter_order(precisions, kinds, zero_stage):
        return 0.0
    return 4.0 * sum(p.numel() for p in module.parameters() if p.requires_grad)


def attach_to_engine(plugin: Any, engine: Any, device: torch.device, plain_redirection: Any) -> Any:
    """Put this rank's precision into the DeepSpeed engine; returns the forward redirection to use (autocast inside
    DeepSpeed's forward for a rank of its own precision, Lightning's plain one otherwise)."""
    if not isinstance(plugin, HeteroPrecision):
        return plain_redirection
    plugin.attach(engine, device)
    return AutocastInside(plain_redirection, plugin.autocast)


def loss_scale_value(plugin: Any) -> Optional[float]:
    """The job's loss scale (fp16 ranks), or None."""
    scale = getattr(plugin, "loss_scale", None)
    return scale.scale if scale is not None else None
