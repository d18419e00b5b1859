"""Train: what the asynchronous merges by speed (:mod:`lightning_hetero.local.claims`) cannot run with, checked on
every rank at setup, before any collective."""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader

from lightning_hetero.local.claim_decisions import claims_in_epoch
from lightning_hetero.train.loaders import loader_batch_size


def describe_asynchronous_refusal(trainer: Any, loader: Any, module: Any, world_size: int) -> Optional[str]:
    """Why a fit cannot merge asynchronously (None when it can): what needs the ranks' steps in step, or an epoch
    too short to give every rank a micro-batch. Checked on every rank at setup, before any collective."""
    mode = "with `sync_options['asynchronous']=True`: each rank takes as many steps as its speed allows, so"
    if trainer.fast_dev_run:
        return (
            f"`Trainer(fast_dev_run={trainer.fast_dev_run!r})` {mode} a count of steps would stop the ranks at"
            " different places. Use `max_epochs=1` with a small dataset instead."
        )
    for name, unset in (("max_steps", -1), ("min_steps", None)):
        value = getattr(trainer, name)
        if value not in (unset, None):
            return (
                f"`Trainer({name}={value})` {mode} a count of steps would stop the ranks at different places. Use"
                " `max_epochs` / `min_epochs`."
            )
    # (a time-based `val_check_interval` leaves `trainer.val_check_interval` unset: Lightning keeps it apart)
    timed = getattr(trainer, "_val_check_time_interval", None)
    for name in ("limit_train_batches", "val_check_interval"):
        value = getattr(trainer, name, None) if not (name == "val_check_interval" and timed) else f"{timed} s"
        if value is not None and not (isinstance(value, float) and value == 1.0):  # (an int 1 is one batch)
            return (
                f"`Trainer({name}={value!r})` {mode} the ranks would stop (or validate) at different places. Keep"
                f" the default ({name}=1.0: the whole epoch)."
            )
    for callback in trainer.callbacks:
        if isinstance(callback, Timer):  # (for `max_time`: it broadcasts rank 0's clock every step)
            return (
                f"`Trainer(max_time=...)` (Lightning's Timer) {mode} the Timer's agreement at every training step"
                " would meet other calls. Use `max_epochs`."
            )
        every = getattr(callback, "_every_n_train_steps", 0) or getattr(callback, "_train_time_interval", None)
        if every:
            return (
                f"`{type(callback).__name__}` saving every {every} training steps (or at a time interval) {mode} the"
                " ranks are not at the same place then; an epoch's end is. Save at epoch ends (`every_n_epochs`)."
            )
    if module is not None and is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        return (
            f"`training_step(self, dataloader_iter)` {mode} the strategy must hand each step its micro-batch (and know"
            " the epoch's last). Take the batch as `training_step(self, batch, batch_idx)`."
        )
    if isinstance(loader, DataLoader):
        if getattr(loader, "in_order", True) is False:
            return (
                "A training loader with `in_order=False` with `sync_options['asynchronous']=True`: the claims need the"
                " batches back in the order they were drawn. Drop `in_order=False`."
            )
        size, sampler = loader_batch_size(loader), getattr(loader.batch_sampler, "sampler", None)
        drop_last = bool(getattr(loader.batch_sampler, "drop_last", False))
        claims = claims_in_epoch(len(sampler), size, drop_last) if size and sampler is not None else world_size
        if claims < world_size:
            return (
                f"The training loader gives {claims} micro-batches of {size} an epoch {mode} each of the {world_size}"
                " ranks needs one at least (its first, so that every rank logs and validates alike). Use more samples"
                " or a smaller batch size."
            )
    return None
