"""Train: a rank's share of a global batch taken in several micro-batches (``micro_steps``), one optimizer step.

Lightning sees one batch per global batch on every rank, as without micro-steps, so its loop (batch counts,
validation intervals, ``max_steps``, checkpoints every n steps) stays in step on every rank whatever each rank's count.
The strategy cuts the batch the loader handed over into ``k`` micro-batches (:func:`split_batch`) and runs the
user's ``training_step`` and backward on each in turn; the last one's output goes back to Lightning's loop, which
does its backward and the optimizer step. Only one micro-batch's activations exist at a time, which is the point.

DeepSpeed's ZeRO-2 reduces the gradients in every backward; a rank's backward passes before its last are therefore run
with that reduction held back (:func:`reduction_held_back`, the flag DeepSpeed's own ``coalesce_grad_reduction``
sets), so the gradients add up locally and the last backward reduces their sum: one reduction per batch on every
rank, as without micro-steps. ZeRO-0/1 reduce in the optimizer step anyway; ZeRO-3 gathers in every forward, so its
ranks must all run as many micro-batches (``split/decisions/micro_steps.py`` refuses the rest).

Every rank must make the same collective calls in the same order, and ranks run different numbers of micro-batches.
So collectives that the user's ``training_step`` makes are only made by the last micro-batch on each rank (one call
per step everywhere): a ``self.log(..., sync_dist=True)`` in an earlier micro-batch is kept local (Lightning keeps the
last value of a step; its epoch mean still weighs every micro-batch by its size), and any other collective there is
refused with an error that says so, never left to hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

# Values that are one per sample when a list or tuple of them is as long as the batch (a batch of file names, labels).
_SAMPLE_LEAVES = (str, bytes, int, float, bool, type(None))


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """``batch`` cut along its first dimension into consecutive pieces of ``sizes`` samples.

    Tensors whose first dimension is the batch are cut; mappings, tuples (named ones too) and lists are cut member by
    member, except that a list or tuple of plain values (strings, numbers) as long as the batch is cut as samples;
    other plain values (an int, a string, a 0-d tensor) go to every piece. A tensor whose first dimension is not the
    batch cannot be placed in a piece: a ValueError names where it is.
    """
    total = sum(sizes)
    if len(sizes) == 1:
        return [batch]
    return _split(batch, list(sizes), total, "batch")


def _split(value: Any, sizes: list[int], total: int, where: str) -> list[Any]:
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return [value] * len(sizes)
        if value.shape[0] != total:
            raise ValueError(
                f"`micro_steps`: {where} is a tensor of shape {tuple(value.shape)}, whose first dimension is not the"
                f" batch's {total} samples, so the strategy cannot cut it into micro-batches of {sizes}. Give every"
                " per-sample tensor the batch as its first dimension, or train without micro-steps (`micro_steps`"
                " all 1 and a micro-batch that fits)."
            )
        return list(value.split(sizes))
    if isinstance(value, Mapping):
        cut = {key: _split(item, sizes, total, f"{where}[{key!r}]") for key, item in value.items()}
        return [_rebuild_mapping(value, {key: pieces[i] for key, pieces in cut.items()}) for i in range(len(sizes))]
    if isinstance(value, (list, tuple)):
        if len(value) == total and all(isinstance(item, _SAMPLE_LEAVES) for item in value):
            begins = [sum(sizes[:i]) for i in range(len(sizes))]
            return [_rebuild_sequence(value, value[b : b + n], as_samples=True) for b, n in zip(begins, sizes)]
        cut_items = [_split(item, sizes, total, f"{where}[{i}]") for i, item in enumerate(value)]
        return [_rebuild_sequence(value, [pieces[i] for pieces in cut_items]) for i in range(len(sizes))]
    return [value] * len(sizes)


def _rebuild_mapping(original: Mapping, items: dict) -> Any:
    factory: Any = type(original)  # (the user's mapping type: a dict, an OrderedDict, a BatchEncoding...)
    try:
        return factory(items)
    except TypeError:  # a mapping type whose constructor takes something else
        return items


def _rebuild_sequence(original: Any, items: Sequence[Any], as_samples: bool = False) -> Any:
    if isinstance(original, tuple) and hasattr(original, "_fields") and not as_samples:  # a namedtuple
        return type(original)(*items)
    if isinstance(original, tuple):
        return tuple(items)
    return list(items)


@contextlib.contextmanager
def reduction_held_back(engine: Any) -> Iterator[None]:
    """Inside, a ZeRO-2 engine keeps each backward's gradients on the parameters instead of reducing them: the two
    flags DeepSpeed's own ``coalesce_grad_reduction`` sets (its optimizer's guard in ``process_gradients``, and the
    engine's no-sync flag that skips the end-of-backward reduction, which would also clear the gradients). Other
    stages are left alone: ZeRO-0/1 reduce in the step anyway, and ZeRO-3 runs equal counts on every rank."""
    optimizer: Any = getattr(engine, "optimizer", None)
    if engine.zero_optimization_stage() != 2 or not hasattr(optimizer, "_coalesce_grad_reduction"):
        yield
        return
    engine.inside_no_sync_ctxt, optimizer._coalesce_grad_reduction = True, True
    try:
        yield
    finally:
        engine.inside_no_sync_ctxt, optimizer._coalesce_grad_reduction = False, False


def raise_if_unreduced(module: Any) -> None:
    """After a rank's last micro-batch under ZeRO-2, which reduces and removes every gradient it sees: a parameter
    still holding one was used by an earlier micro-batch and not by the last, and its gradient would be lost."""
    unreduced = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is not None]
    if unreduced:
        raise RuntimeError(
            f"HeteroStrategy: parameters {unreduced[:5]} had gradients from an earlier micro-batch of this step but"
            " none from the last one, so ZeRO-2 never reduced them (`micro_steps`). Use ZeRO stage 0 or 1 for a model"
            " whose parameters depend on the batch, or train without micro-steps."
        )


def step_loss(output: Any) -> Any:
    """The loss a ``training_step`` returned (a tensor, or a mapping's ``"loss"``); None when it skipped the batch."""
    if isinstance(output, Mapping):
        return output.get("loss")
    return output


class MicroBatchGuard:
    """Whether the user's ``training_step`` is running an early micro-batch (not the rank's last of the step), and
    what that means for the collectives it calls."""

    def __init__(self) -> None:
        self.early = False
        # Asynchronous merges (local/claims.py), from an epoch's first step to its end: the ranks' steps are not in
        # step, so whatever a step reduces or exchanges would meet another step of another rank.
        self.between_merges = False

    @property
    def rank_local(self) -> bool:
        """A ``sync_dist`` value logged now stays this rank's own (no other rank reduces it at the same time)."""
        return self.early or self.between_merges

    @contextlib.contextmanager
    def early_micro_batch(self) -> Iterator[None]:
        self.early = True
        try:
            yield
        finally:
            self.early = False

    def refuse_collective(self, name: str) -> None:
        """A collective other than a ``sync_dist`` reduce inside an early micro-batch: ranks run different numbers of
        them, so it would wait for a call that never comes on another rank."""
        if self.between_merges:
            raise RuntimeError(
                f"HeteroStrategy: `{name}` was called during a training step with `sync_options['asynchronous']=True`."
                " Each rank trains as many steps as its speed allows, so another rank is at another step and the"
                " collective would meet a different call there. Call it from an epoch-level hook (e.g."
                " `on_train_epoch_end`, `on_validation_epoch_end`), or merge synchronously."
            )
        if self.early:
            raise RuntimeError(
                f"HeteroStrategy: `{name}` was called inside `training_step` while this rank ran one of several"
                " micro-batches of a step (`micro_steps`). Ranks run different numbers of micro-batches, so a"
                " collective there would wait for calls other ranks never make. Call it from another hook (e.g."
                " `on_train_batch_end`), or train without micro-steps."
            )
