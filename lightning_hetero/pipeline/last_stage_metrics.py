"""Train: what a pipeline's last stages log reaches the ranks and callbacks that read it.

Only the last stage of each pipeline runs the rest of ``training_step`` and ``validation_step``, so only it logs:
``self.log(..., sync_dist=True)`` reduces over the last stages alone (:func:`log_synced_over`), and rank 0's
metrics reach every rank before the callbacks that read them (:class:`LastStageMetrics`). Apart from the schedule
(:mod:`lightning_hetero.pipeline.stage`): this is about Lightning's logging, not about the stages' exchange.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule


def log_synced_over(module: LightningModule, group: Any) -> Callable[[], None]:
    """``module.log`` and ``log_dict`` with ``sync_dist=True`` reduce over ``group`` (unless the call names its own
    ``sync_dist_group``); returns what undoes it. Instance attributes shadow the methods, as the profiler's stubs do."""
    original_log, original_log_dict = module.log, module.log_dict

    def log(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = group
        original_log(*args, **kwargs)

    def log_dict(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("sync_dist") and kwargs.get("sync_dist_group") is None:
            kwargs["sync_dist_group"] = group
        original_log_dict(*args, **kwargs)

    module.__dict__.update(log=log, log_dict=log_dict)

    def undo() -> None:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)

    return undo


class LastStageMetrics(Callback):
    """Every rank sees the metrics the last stage logged (``trainer.callback_metrics``), before the callbacks that
    read them run: ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` decide the same on every rank. Only the last
    stage runs the rest of ``training_step`` and ``validation_step``, so only it logs; rank 0 is a last stage."""

    def _share(self, trainer: Any) -> None:
        shared = [
            {k: v.detach().cpu() for k, v in trainer.callback_metrics.items()} if trainer.global_rank == 0 else None
        ]
        dist.broadcast_object_list(shared, src=0)
        if trainer.global_rank != 0:
            trainer.callback_metrics.update(shared[0])

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._share(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._share(trainer)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._share(trainer)
