"""Train: one training step on this rank, as Lightning's hooks reach it (training_step, backward, optimizer_step).

A rank's batch may be taken in several micro-batches (``micro_steps``, :mod:`.micro_batches`): the first goes through
Lightning's closure (``training_step``, then ``backward``), and the others run inside ``backward``, because Lightning
zeroes the gradients between the two. With local SGD / DiLoCo the others are inner steps of their own, each with its
optimizer step, after Lightning's (:mod:`.local_sgd`). Only a rank's last micro-batch makes collectives.

Every piece of the rank's compute runs inside :meth:`TrainingSteps.scope`: a "mean" logged with ``sync_dist`` is
weighted by the rank's samples (:mod:`.weights`), an emulated slow rank stretches it (:mod:`~lightning_hetero.emulate`)
and the exchange inside is counted for the report (:mod:`~lightning_hetero.comm.communication`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.plan.split import micro_batch_sizes
from lightning_hetero.runtime.tracing import phase
from lightning_hetero.train.micro_batches import raise_if_unreduced, reduction_held_back, split_batch, step_loss

# The user's training_step on one micro-batch and its sample count (None: the whole batch, no micro-steps).
UserStep = Callable[[Any, Optional[int]], Any]
# Lightning's backward (the engine's) of one loss, its optimizer and arguments bound (what it returns is unused).
Backward = Callable[[Tensor], object]


class TrainingSteps:
    """This rank's training steps. ``job``: the :class:`~lightning_hetero.job.HeteroJob` whose capability objects
    (loss weights, emulation, communication, the micro-batch guard, the non-finite guard, the watcher, local
    training) the steps go through; they are read at each step, since :meth:`HeteroJob.join` replaces some."""

    def __init__(self, job: Any) -> None:
        self._job = job
        # This step's micro-batches after the first, and the user's step they run through (see the module doc).
        self._later: list[tuple[Any, Optional[int]]] = []
        self._user_step: Optional[UserStep] = None
        # Rank 0's buffers to every rank before each forward, as DDP's broadcast_buffers (train/buffers.py).
        self.buffer_sync: Optional[Any] = None

    @contextlib.contextmanager
    def scope(self, counted: bool = True) -> Iterator[None]:
        """Around a piece of this rank's compute in a training step (``counted``: its exchange counts for the report;
        off where an enclosing scope counts already)."""
        job = self._job
        counting = job.communication.counting() if counted else contextlib.nullcontext()
        with job.loss_weights.weighted_sync(), job.emulation.slowed(), counting:
            yield

    def training_step(self, batch: Any, user_step: UserStep, global_step: int) -> Any:
        """Lightning's ``training_step``: the first micro-batch of this rank's batch (all of it without micro-steps);
        the others wait for :meth:`backward` or :meth:`inner_steps`."""
        job = self._job
        self._step_starts(global_step)
        if job.claims is not None:  # (asynchronous merges: the merges due, and rank 0's buffers with them)
            job.claims.step_starts()
            if job.claims.given_away:  # a faster rank trains this micro-batch: a loss of nothing, no backward
                return torch.zeros((), device=job.engine.device if job.engine is not None else None)
        with self.scope():
            if self.buffer_sync is not None and job.claims is None:
                job.collectives.before_each()
                self.buffer_sync.sync()
            (first, samples), *later = self._micro_batches_of(batch)
            self._later, self._user_step = later, user_step
            output = self._micro_batch_step(first, samples, not later)
        job.loss_weights.step_returned(output)
        return output

    def backward(
        self, closure_loss: Tensor, backward: Backward, accumulated: int, zero_stage: int, module: Any
    ) -> None:
        """Lightning's ``backward`` of the first micro-batch's loss, then every later micro-batch's forward and
        backward. ``accumulated``: the Trainer's ``accumulate_grad_batches`` (Lightning's closure divided the first
        loss by it; the later ones are divided alike)."""
        if self._job.claims is not None and self._job.claims.given_away:
            return  # (nothing was trained: see training_step)
        if self._job.local is not None:  # the other micro-batches are inner steps of their own (inner_steps)
            self._weighted_backward(closure_loss, backward, last=True)
            return
        later, self._later = self._later, []
        self._weighted_backward(closure_loss, backward, last=not later)
        for index, (batch, samples) in enumerate(later):
            last = index == len(later) - 1
            with self.scope():
                output = self._micro_batch_step(batch, samples, last)
            self._weighted_backward(step_loss(output) / accumulated, backward, last)
        if later and zero_stage == 2:
            raise_if_unreduced(module)

    def inner_steps(self, backward: Backward, engine: Any, last_batch_of_epoch: bool) -> None:
        """Local SGD / DiLoCo, after Lightning's optimizer step: this rank's other micro-batches, each an inner step
        of its own (the first went through Lightning's closure); then the synchronization when it is due."""
        job = self._job
        if job.claims is not None:  # one micro-batch a step; the merges come at the next step's start
            job.claims.step_ended(job.loss_weights.batch_samples() or 0, last_batch_of_epoch)
            return
        later, self._later = self._later, []
        for index, (batch, samples) in enumerate(later):
            engine.zero_grad()
            with self.scope(counted=False):
                output = self._micro_batch_step(batch, samples, index == len(later) - 1)
            self._weighted_backward(step_loss(output), backward, last=True)
            with job.emulation.slowed():
                engine.step()
        # The ranks synchronize when it is time (one decision on all); an emulated slow rank reaches the
        # synchronization when a slow device would.
        job.collectives.before_each()
        # (In the background an overlapped merge's exchange pays the emulated link at its wait.)
        with job.communication.in_background(), phase("local step end (the merge, when due)"):
            job.local.step_done(
                job.loss_weights.batch_samples() or 0,
                last_batch_of_epoch,
                job.collectives.reduce_in_place,
                job.collectives.gather_tensor,
                job.collectives.start_in_background,
            )

    def _step_starts(self, global_step: int) -> None:
        job = self._job
        job.emulation.at_step(global_step)  # a drift schedule: the emulated speed from this step on
        job.loss_check.step_starts()  # (its gathers come here, at the same step on every rank)
        job.loss_weights.step_started()
        stream = job.sharding.training_stream
        if stream is not None:
            # Lightning drew this batch a step ahead: the step starts, and takes its counts, now.
            assert job.watcher is not None
            job.watcher.before_fetch()
            job.training_batch(*stream.batch_trained())

    def _micro_batch_returned(self, samples: Optional[int], output: Any) -> None:
        """``training_step`` returned ``output`` for ``samples`` of this rank's batch (None: the whole batch)."""
        job = self._job
        job.loss_check.loss(samples if samples is not None else job.loss_weights.batch_samples(), step_loss(output))

    def _micro_batches_of(self, batch: Any) -> list[tuple[Any, Optional[int]]]:
        """The batch in hand as this rank's micro-batches and their sample counts: itself alone without micro-steps."""
        job = self._job
        samples, steps = job.loss_weights.batch_samples(), job.split.micro_steps
        if steps == 1 or samples is None:
            return [(batch, None)]
        sizes = micro_batch_sizes(samples, steps)
        return list(zip(split_batch(batch, sizes), sizes))

    def _micro_batch_step(self, batch: Any, samples: Optional[int], last: bool) -> Any:
        """The user's training_step on one micro-batch (``samples`` None: the whole batch, no micro-steps). Only the
        rank's last one makes collectives (see train/micro_batches.py)."""
        job, user_step = self._job, self._user_step
        assert user_step is not None
        if samples is None:
            with phase("training_step (forward)"):
                output = user_step(batch, None)
            self._micro_batch_returned(None, output)
            return output
        job.loss_weights.micro_batch(samples)
        with contextlib.nullcontext() if last else job.micro_batch_guard.early_micro_batch():
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

    def _weighted_backward(self, loss: Tensor, backward: Backward, last: bool) -> None:
        # DeepSpeed averages ranks equally; weighting the loss makes that average the full-batch mean. A rank's
        # micro-batches before its last keep their gradients local (train/micro_batches.py).
        job = self._job
        job.nonfinite.loss_computed(loss)
        held_back = contextlib.nullcontext() if last else reduction_held_back(job.engine)
        with job.emulation.slowed(), job.communication.counting(), held_back, phase("backward"):
            backward(loss * job.current_loss_weight())
        job.watcher.meter.backward_ended()
