"""Checks of the user's arguments shared by every way in (constructor, CLI YAML, environment variables).

Pure functions: each raises a ValueError that names the argument, the value it got and the fix, so a mistake fails
in the constructor, before any process group exists, instead of somewhere inside a collective.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence, Set
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
# How each rank's loss relates to its micro-batch: "mean" over its samples (the usual `F.cross_entropy`), "sum", or
# "token_mean": a mean over a count the training step returns with it (tokens that are not padding).
LOSS_REDUCTIONS = ("mean", "sum", "token_mean")
# The key of training_step's output that holds that count, with loss_reduction="token_mean".
TOKEN_COUNT_KEY = "num_tokens"


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # numpy integers too


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any, meaning: str = ".") -> None:
    """``value`` is an integer >= 1 (numpy integers too; not a bool): else a ValueError "`name=value` must be a
    positive integer" followed by ``meaning`` (what the argument counts, and the fix)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"`{name}={value!r}` must be a positive integer{meaning}")


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


def check_one_per_rank(named: str, entries: int, world_size: int, fix: str) -> None:
    """A per-rank setting has one entry per rank: else a ValueError, "`named` has N entries but the job has M ranks.
    ``fix``" (``named`` is the argument as the user wrote it, ``weights=[1.0, 0.4]``, backticks included)."""
    if entries != world_size:
        raise ValueError(f"{named} has {entries} entries but the job has {world_size} ranks. {fix}")


def check_stage(stage: Any, name: str = "stage") -> None:
    if not is_int(stage) or stage not in ZERO_STAGES:
        raise ValueError(f"`{name}={stage!r}` is not a ZeRO stage: use the integer 0, 1, 2 or 3.")


def check_loss_reduction(loss_reduction: Any) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f'`loss_reduction={loss_reduction!r}` is not one of {list(LOSS_REDUCTIONS)}: use "mean" when'
            ' `training_step` returns the mean over its batch (e.g. `F.cross_entropy(...)`), "sum" when it returns'
            ' the sum (e.g. `reduction="sum"`), "token_mean" when it returns the mean over its tokens together with'
            f' their count (`{{"loss": loss, "{TOKEN_COUNT_KEY}": n}}`).'
        )


def token_count(output: Any) -> float:
    """The token count a ``training_step`` returned under :data:`TOKEN_COUNT_KEY` (loss_reduction="token_mean")."""
    count: Any = output.get(TOKEN_COUNT_KEY) if isinstance(output, Mapping) else None  # (whatever the step gave)
    if hasattr(count, "item") and getattr(count, "numel", lambda: 1)() == 1:
        count = count.item()
    if not is_real(count) or count < 0 or count != count:
        raise ValueError(
            f"HeteroStrategy(loss_reduction='token_mean') needs `training_step` to return the number of tokens its"
            f' loss is the mean over: `return {{"loss": loss, "{TOKEN_COUNT_KEY}": n}}` with n >= 0 (e.g. `(targets !='
            f" ignore_index).sum()`); it returned {_describe_output(output)}."
        )
    return float(count)


def _describe_output(output: Any) -> str:
    if isinstance(output, Mapping):
        shown = output.get(TOKEN_COUNT_KEY, "<missing>")
        return f"a dict with keys {sorted(map(str, output))} and `{TOKEN_COUNT_KEY}={shown!r}`"
    return f"a {type(output).__name__}"
