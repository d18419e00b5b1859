"""Split: one training step on this rank, as Lightning's hooks reach it (training_step, backward, optimizer_step).

A rank's batch may be taken in several micro-batches (``micro_steps``, :mod:`~lightning_hetero.train.micro_batches`):
the first goes through Lightning's closure (``training_step``, then ``backward``), and the others run inside
``backward``, because Lightning zeroes the gradients between the two. With local SGD / DiLoCo the others are inner
steps of their own, each with its optimizer step, after Lightning's (:mod:`lightning_hetero.local.training`). Only a
rank's last micro-batch makes collectives.

Every piece of the rank's compute runs inside :meth:`TrainingSteps.scope`: a "mean" logged with ``sync_dist`` is
weighted by the rank's samples (:mod:`~lightning_hetero.train.weights`), an emulated slow rank stretches it
(:mod:`~lightning_hetero.emulate`) and the exchange inside is counted for the report
(:mod:`~lightning_hetero.comm.communication`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_hetero.comm.communication import Communication
from lightning_hetero.precision.nonfinite import NonFiniteGuard
from lightning_hetero.recover.recovery import Recovery
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.tracing import phase
from lightning_hetero.split.decisions.split import micro_batch_sizes
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.micro_batches import (
    MicroBatchGuard,
    raise_if_unreduced,
    reduction_held_back,
    split_batch,
    step_loss,
)
from lightning_hetero.train.mode import Backward, UserStep
from lightning_hetero.train.sharding import DataSharding
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.loss_reduction import LossReductionCheck
from lightning_hetero.watch.watcher import Watcher


@dataclass(frozen=True)
class RankParts:
    """What a data-parallel rank trains with, each by name: its rank among ``world_size``, the job's collectives, its
    emulation, the watcher, the gradient exchange's communication, the split in force, the data sharding, the loss
    weights, the micro-batch guard, the non-finite guard, the loss-reduction check and the recovery."""

    rank: int
    world_size: int
    collectives: Collectives
    emulation: Any
    watcher: Watcher
    communication: Communication
    split: SplitInForce
    sharding: DataSharding
    loss_weights: LossWeights
    micro_batch_guard: MicroBatchGuard
    nonfinite: NonFiniteGuard
    loss_check: LossReductionCheck
    recovery: Recovery


class TrainingSteps:
    """This rank's training steps, through its ``parts``. The training mode sets ``engine`` (DeepSpeed's, from
    attach to detach) and ``buffer_sync`` (rank 0's buffers to every rank before each forward, as DDP's
    broadcast_buffers; None on one rank or without an optimizer)."""

    def __init__(self, parts: RankParts) -> None:
        self._parts = parts
        self.engine: Optional[Any] = None
        # This step's micro-batches after the first, and the user's step they run through (see the module doc).
        self._later: list[tuple[Any, Optional[int]]] = []
        self._user_step: Optional[UserStep] = None
        self.buffer_sync: Optional[BufferSync] = None

    @contextlib.contextmanager
    def scope(self, counted: bool = True) -> Iterator[None]:
        """Around a piece of this rank's compute in a training step (``counted``: its exchange counts for the report;
        off where an enclosing scope counts already)."""
        parts = self._parts
        counting = parts.communication.counting() if counted else contextlib.nullcontext()
        with parts.loss_weights.weighted_sync(), parts.emulation.slowed(), counting:
            yield

    def training_step(self, batch: Any, user_step: UserStep, buffers_synced: bool = True) -> Any:
        """Lightning's ``training_step``: the first micro-batch of this rank's batch (all of it without micro-steps);
        the others wait for :meth:`backward` or :meth:`later_micro_batches`. ``buffers_synced``: rank 0's buffers
        are sent first (off where the mode's merges send them)."""
        with self.scope():
            if self.buffer_sync is not None and buffers_synced:
                self._parts.collectives.before_each()
                self.buffer_sync.sync()
            (first, samples), *later = self._micro_batches_of(batch)
            self._later, self._user_step = later, user_step
            output = self._micro_batch_step(first, samples, not later)
        self._parts.loss_weights.step_returned(output)
        return output

    def backward(
        self, closure_loss: Tensor, backward: Backward, accumulated: int, zero_stage: int, module: Any
    ) -> None:
        """Lightning's ``backward`` of the first micro-batch's loss, then every later micro-batch's forward and
        backward. ``accumulated``: the Trainer's ``accumulate_grad_batches`` (Lightning's closure divided the first
        loss by it; the later ones are divided alike)."""
        later, self._later = self._later, []
        self.weighted_backward(closure_loss, backward, last=not later)
        for index, (batch, samples) in enumerate(later):
            last = index == len(later) - 1
            with self.scope():
                output = self._micro_batch_step(batch, samples, last)
            self.weighted_backward(step_loss(output) / accumulated, backward, last)
        if later and zero_stage == 2:
            raise_if_unreduced(module)

    def later_micro_batches(self, before_each: Callable[[], object]) -> Iterator[tuple[Any, bool]]:
        """This step's micro-batches after the first, each an inner step of its own: ``before_each`` (the engine's
        zero_grad), its forward in the step's scope (not counted: the inner step's caller counts), then the caller's
        backward and optimizer step; yields each one's output and whether it is the last."""
        later, self._later = self._later, []
        for index, (batch, samples) in enumerate(later):
            last = index == len(later) - 1
            before_each()
            with self.scope(counted=False):
                output = self._micro_batch_step(batch, samples, last)
            yield output, last

    def step_starts(self, global_step: int) -> None:
        """A training step starts: the emulated speed of this step, the loss check's and the loss weights' step, and
        a stream's counts (Lightning drew its batch a step ahead)."""
        parts = self._parts
        parts.emulation.at_step(global_step)  # a drift schedule: the emulated speed from this step on
        parts.loss_check.step_starts()  # (its gathers come here, at the same step on every rank)
        parts.loss_weights.step_started()
        stream = parts.sharding.training_stream
        if stream is not None:
            # Lightning drew this batch a step ahead: the step starts, and takes its counts, now.
            parts.watcher.before_fetch()
            self.batch_ready(*stream.batch_trained())

    def batch_ready(self, local_samples: int, global_samples: int) -> None:
        """This rank's batch of the step is drawn: its samples, and the global batch's, weigh the loss and the watch."""
        self._parts.loss_weights.training_batch(local_samples, global_samples)
        self._parts.watcher.meter.batch_ready(local_samples, self._parts.split.micro_steps)

    def _micro_batch_returned(self, samples: Optional[int], output: Any) -> None:
        """``training_step`` returned ``output`` for ``samples`` of this rank's batch (None: the whole batch)."""
        parts = self._parts
        parts.loss_check.loss(samples if samples is not None else parts.loss_weights.batch_samples(), step_loss(output))

    def _micro_batches_of(self, batch: Any) -> list[tuple[Any, Optional[int]]]:
        """The batch in hand as this rank's micro-batches and their sample counts: itself alone without micro-steps."""
        parts = self._parts
        samples, steps = parts.loss_weights.batch_samples(), parts.split.micro_steps
        if steps == 1 or samples is None:
            return [(batch, None)]
        sizes = micro_batch_sizes(samples, steps)
        return list(zip(split_batch(batch, sizes), sizes))

    def _micro_batch_step(self, batch: Any, samples: Optional[int], last: bool) -> Any:
        """The user's training_step on one micro-batch (``samples`` None: the whole batch, no micro-steps). Only the
        rank's last one makes collectives (see train/micro_batches.py)."""
        parts, user_step = self._parts, self._user_step
        assert user_step is not None
        if samples is None:
            with phase("training_step (forward)"):
                output = user_step(batch, None)
            self._micro_batch_returned(None, output)
            return output
        parts.loss_weights.micro_batch(samples)
        with contextlib.nullcontext() if last else parts.micro_batch_guard.early_micro_batch():
            with phase(f"training_step (forward) of a micro-batch of {samples} samples"):
                output = user_step(batch, samples)
        self._micro_batch_returned(samples, output)
        if step_loss(output) is None:
            raise RuntimeError(
                "HeteroStrategy: `training_step` returned None (skip this batch) for one of this rank's micro-batches"
                " (`micro_steps`, or the inner steps of `sync`). The other ranks would still run theirs and wait for"
                " this one. Skip inside the step instead (e.g. return `loss * 0`), or train without them."
            )
        return output

    def weighted_backward(self, loss: Tensor, backward: Backward, last: bool) -> None:
        """The backward of one micro-batch's loss, weighted. DeepSpeed averages ranks equally; weighting the loss
        makes that average the full-batch mean. A rank's micro-batches before its last keep their gradients local
        (train/micro_batches.py)."""
        parts = self._parts
        parts.nonfinite.loss_computed(loss)
        held_back = contextlib.nullcontext() if last else reduction_held_back(self.engine)
        with parts.emulation.slowed(), parts.communication.counting(), held_back, phase("backward"):
            backward(loss * parts.loss_weights.current(parts.split.plan))
        parts.watcher.meter.backward_ended()
