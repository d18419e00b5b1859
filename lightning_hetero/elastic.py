"""Recover: what the strategy does at Lightning's checkpoint and exception points so that a job survives losing ranks.

* :func:`save_atomically`: every checkpoint goes through :mod:`lightning_hetero.checkpoint`'s staging, manifest
  and atomic publish.
* :func:`interrupt_checkpoint_path`: where a preempted (SIGTERM) job saves before it exits, so that
  ``fit(ckpt_path="last")`` finds it: ``last.ckpt`` in the first ``ModelCheckpoint``'s directory.
* :func:`prune_unless_only`: ``ModelCheckpoint``'s pruning never deletes the only complete checkpoint.
* :func:`init_process_group_for_this_attempt`: a job that torchrun restarted connects its ranks afresh.

The strategy keeps the lifecycle (which hook calls what); these functions keep the file handling out of it.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from lightning_hetero import checkpoint


def save_atomically(
    target: Path,
    write: Callable[[Path], None],
    manifest_facts: Callable[[], dict[str, Any]],
    is_global_zero: bool,
    barrier: Callable[[], None],
) -> None:
    """Every rank calls this; ``write(directory)`` is the DeepSpeed save of this rank's part into ``directory``.

    The barriers order it: nobody writes into the staging directory before rank 0 has cleared what an interrupted
    save left there, nobody has unfinished files when rank 0 lists them into the manifest, and nobody goes on (to
    prune the previous checkpoint, or to save again) before the new one is published.
    """
    staging = checkpoint.staging_path(target)
    if is_global_zero:
        target.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_stale_staging(target)
    barrier()
    write(staging)
    barrier()
    if is_global_zero:
        checkpoint.write_manifest(staging, manifest_facts())
        checkpoint.publish(staging, target)
    barrier()


def prune_unless_only(path: Path, remove: Callable[[Path], None]) -> bool:
    """Remove checkpoint ``path`` unless it is the only complete one in its directory; False when it was kept."""
    if checkpoint.is_only_complete_checkpoint(path):
        warnings.warn(
            f"HeteroStrategy kept checkpoint {path}: it is the only complete checkpoint in its directory, and a"
            " resume needs one.",
            stacklevel=2,
        )
        return False
    remove(path)
    return True


def interrupt_checkpoint_path(trainer: Any) -> Optional[Path]:
    """``last.ckpt`` in the directory of the trainer's first ``ModelCheckpoint``; None when it has none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return None


def init_process_group_for_this_attempt(backend: str, rank: int, world_size: int, timeout: timedelta) -> bool:
    """Under torchrun, set up the default process group with keys of this restart attempt only; False elsewhere.

    torchrun's c10d rendezvous gives every attempt the same store (``TORCHELASTIC_USE_AGENT_STORE``), and the
    workers' process group writes its connection keys into it without a per-attempt prefix. After a restart, a rank
    could read the address a rank of the killed attempt left there, and gloo failed with "connectFullMesh ...
    Connection refused", or waited. A prefix per attempt keeps each attempt's keys apart. DeepSpeed and Lightning
    then find the group initialised and use it.
    """
    import torch.distributed

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or torch.distributed.is_initialized():
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    store = torch.distributed.PrefixStore(f"lightning_hetero/attempt_{attempt}/", agent_store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True
