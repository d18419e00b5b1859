"""Checks of the user's arguments shared by every way in (constructor, CLI YAML, environment variables).

Pure functions: each raises a ValueError that names the argument, the value it got and the fix, so a mistake fails
in the constructor, before any process group exists, instead of somewhere inside a collective.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence, Set
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
# How each rank's loss relates to its micro-batch: "mean" over its samples (the usual `F.cross_entropy`), or "sum".
LOSS_REDUCTIONS = ("mean", "sum")


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy integers too


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def per_rank_list(name: str, value: Any, example: str) -> list[Any]:
    """``value`` as a list with one entry per rank, in global rank order.

    A scalar, a string, a set or a mapping is refused rather than guessed at: ``{0: 8, 1: 8}`` would otherwise be
    read as its keys ``[0, 1]``, and ``8`` has no length. ``example`` is a valid value to show in the message.
    """
    if isinstance(value, Mapping):
        raise ValueError(
            f"`{name}={value!r}` is a mapping; give a list with one entry per rank in global rank order, e.g."
            f" `{name}={example}` (a mapping would be read by its keys)."
        )
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays and tensors
    if isinstance(value, (str, bytes, Set)) or not isinstance(value, Sequence):
        raise ValueError(
            f"`{name}={value!r}` is not a list: give one entry per rank in global rank order, e.g. `{name}={example}`."
        )
    return list(value)


def check_stage(stage: Any, name: str = "stage") -> None:
    if not is_int(stage) or stage not in ZERO_STAGES:
        raise ValueError(f"`{name}={stage!r}` is not a ZeRO stage: use the integer 0, 1, 2 or 3.")


def check_loss_reduction(loss_reduction: Any) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"`loss_reduction={loss_reduction!r}` is not one of {list(LOSS_REDUCTIONS)}: use \"mean\" when"
            ' `training_step` returns the mean over its batch (e.g. `F.cross_entropy(...)`), "sum" when it returns'
            " the sum (e.g. `reduction=\"sum\"`)."
        )
