"""Local: training on each rank's own, the training modes of ``sync="local_sgd"`` or ``"diloco"``.

Each rank steps its own optimizer on its own gradients (no exchange at the step); its micro-batches after the first
are inner steps of their own, and the ranks merge their parameters when a synchronization is due
(:class:`~lightning_hetero.local.merges.LocalTraining`), before a checkpoint, a validation inside a fit and the end
of a fit. With ``asynchronous=True`` the ranks claim their micro-batches from a shared counter and merge at step
boundaries (:mod:`.claims`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.trainer.states import RunningStage
from torch import Tensor

from lightning_hetero.local.claims import AsynchronousTraining
from lightning_hetero.local.merges import LocalTraining
from lightning_hetero.runtime.tracing import phase
from lightning_hetero.split.steps import RankParts
from lightning_hetero.split.training import DataParallelTraining, SplitSetup
from lightning_hetero.train.micro_batches import step_loss
from lightning_hetero.train.mode import Backward, UserStep


def local_training_state(settings: Any) -> Optional[LocalTraining]:
    """The merges' state of local training (``settings``: the job's), which the setup's plan of inner steps and the
    mode share; None where the ranks exchange at every step."""
    if not settings.local:
        return None
    return LocalTraining(
        settings.sync,
        settings.sync_every,
        settings.outer,
        settings.compression.mode,
        settings.fragments,
        settings.overlap,
        settings.eager,
    )


class LocalTrainingMode(DataParallelTraining):
    """This rank's local training: the data-parallel mode's split and checkpoints, with ``local`` (the merges' state,
    which the setup's plan of inner steps also holds), ``sync`` (``"local_sgd"`` or ``"diloco"``, which a resume
    checks) and ``load_local_state(directory)`` (the setup's restore of the inner steps in force)."""

    def __init__(
        self,
        parts: RankParts,
        setup: SplitSetup,
        could_replan: bool,
        optimizer_order: Callable[[], list[tuple[str, Any]]],
        local: LocalTraining,
        sync: str,
        load_local_state: Callable[[Path], None],
    ) -> None:
        super().__init__(parts, setup, could_replan, optimizer_order)
        self.local, self._sync, self._load_local_state = local, sync, load_local_state

    def attach(self, engine: Any) -> None:
        super().attach(engine)
        if engine.optimizer is not None:
            # No exchange at the step: each rank steps its own optimizer on its own gradients until a synchronization.
            engine.enable_backward_allreduce = False
            self.local.attach([p for p in engine.module.parameters() if p.requires_grad], engine.optimizer)
            self.parts.nonfinite.rank_local = self.parts.rank

    def detach(self) -> None:
        self.local.detach()
        super().detach()

    def link_wait_seconds(self) -> float:
        return self.local.link_wait_seconds

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        """The first micro-batch's backward; the others are inner steps of their own, after Lightning's step."""
        self.steps.weighted_backward(closure_loss, backward, last=True)

    def _optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        result = step()
        self._inner_steps(backward, trainer.is_last_batch)
        return result

    def _inner_steps(self, backward: Backward, last_batch_of_epoch: bool) -> None:
        """After Lightning's optimizer step: this rank's other micro-batches, each an inner step of its own (the first
        went through Lightning's closure); then the synchronization when it is due."""
        parts, engine = self.parts, self.steps.engine
        assert engine is not None  # (attached: Lightning steps only after setting the engine up)
        for output, _ in self.steps.later_micro_batches(engine.zero_grad):
            self.steps.weighted_backward(step_loss(output), backward, last=True)
            with parts.emulation.slowed():
                engine.step()
        # The ranks synchronize when it is time (one decision on all); an emulated slow rank reaches the
        # synchronization when a slow device would.
        parts.collectives.before_each()
        # (In the background an overlapped merge's exchange pays the emulated link at its wait.)
        with parts.communication.in_background(), phase("local step end (the merge, when due)"):
            self.local.step_done(
                parts.loss_weights.batch_samples() or 0,
                last_batch_of_epoch,
                parts.collectives.reduce_in_place,
                parts.collectives.gather_tensor,
                parts.collectives.start_in_background,
            )

    def synchronize(self, counted: bool) -> None:
        """Synchronize now if any rank trained since the last synchronization; every rank calls it at the same point
        and decides alike. ``counted``: the exchange counts in the report (a checkpoint's does not)."""
        parts = self.parts
        if self.local.merge_pending:
            with parts.communication.counting() if counted else contextlib.nullcontext():
                parts.collectives.before_each()
                self.local.synchronize(parts.collectives.reduce_in_place, parts.collectives.gather_tensor)

    def _save_own_state(self, directory: Path) -> None:
        self.local.save(directory, self.parts.rank)

    def _local_sync(self) -> Optional[str]:
        return self._sync

    def _load_own_state(self, directory: Path) -> None:
        self._load_local_state(directory)


class AsynchronousTrainingMode(LocalTrainingMode):
    """Local training with asynchronous merges (``asynchronous=True``): a rank's training loader claims its
    micro-batches, one a step; a faster rank trains a slower one's claim, and the merges come at step boundaries
    (:class:`~lightning_hetero.local.claims.AsynchronousTraining`), counted in the job's rendezvous store."""

    exchanges_each_step = False

    def __init__(
        self,
        parts: RankParts,
        setup: SplitSetup,
        could_replan: bool,
        optimizer_order: Callable[[], list[tuple[str, Any]]],
        local: LocalTraining,
        sync: str,
        load_local_state: Callable[[Path], None],
        sync_every: int,
    ) -> None:
        super().__init__(parts, setup, could_replan, optimizer_order, local, sync, load_local_state)
        self.claims = AsynchronousTraining(
            parts, local, sync_every, self.steps.batch_ready, lambda: self.steps.buffer_sync
        )

    def shard(self, dataloader: Any, trainer: Any) -> Any:
        """The training loader rebuilt to claim its micro-batches (the split in force sizes them); evaluation loaders
        as in data parallel."""
        if trainer.state.stage != RunningStage.TRAINING:
            return super().shard(dataloader, trainer)
        loader = self._sharded(dataloader, trainer, training=True)
        recovery = self.parts.recovery
        return self.claims.loader(loader, trainer, recovery.run, recovery.connect_to_store)

    def batch_received(self, batch: Any, trainer: Any) -> Any:
        return self.claims.received(batch, trainer)

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> Any:
        """The merges due come first, and rank 0's buffers with them; a micro-batch a faster rank trains instead gets
        a loss of nothing here, and no backward."""
        self.steps.step_starts(trainer.global_step)
        self.claims.step_starts()
        if self.claims.given_away:
            engine = self.steps.engine
            return torch.zeros((), device=engine.device if engine is not None else None)
        return self.steps.training_step(batch, user_step, buffers_synced=False)

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        if not self.claims.given_away:  # (nothing was trained: see training_step)
            super().backward(closure_loss, backward, trainer, zero_stage)

    def _optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        result = self.claims.optimizer_step(step, closure)
        # One micro-batch a step; the merges come at the next step's start.
        self.claims.step_ended(self.parts.loss_weights.batch_samples() or 0, trainer.is_last_batch)
        return result

    def _asynchronous_summary(self) -> Optional[dict[str, Any]]:
        return self.claims.summary()
