"""Runtime: checkpoint files are read without running code from them.

``torch.load(weights_only=False)`` unpickles anything, and unpickling can call any function the file names: a
checkpoint from elsewhere (a shared volume, a download) could run code on every rank that resumes it. So:

* :func:`load_package_file` reads the files the package writes itself (local training's and the exchange hooks'
  per-rank state, the pipeline's files, Lightning's state inside them) with ``weights_only=True``: tensors, numbers,
  strings and containers, nothing else (Lightning saves its hyper-parameters as a plain dict).
* :func:`load_lightning_file` reads a user's Lightning ``.ckpt`` (and the Lightning state inside a pipeline
  checkpoint) the way ``Trainer.fit(ckpt_path=..., weights_only=...)`` asks, as Lightning itself passes it on to
  ``torch.load``: ``weights_only=None`` is torch's default (weights-only since torch 2.6, unless
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), and an explicit ``weights_only=False`` unpickles everything.

A file refused here is named with the way to load it anyway (:class:`UnsafeCheckpointFile`). DeepSpeed's own files
(its optimizer states pickle its loss scaler and fragment addresses) are read as DeepSpeed reads them, in full: its
engine unpickles them at every resume whatever this package does, so a checkpoint directory must come from a source
you trust.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Optional

import torch


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file holds objects that ``weights_only`` loading refuses (it could run code)."""


def load_package_file(path: Path) -> Any:
    """A file this package wrote, on the CPU, weights-only."""
    return _load(
        Path(path), True, "a file HeteroStrategy writes holds tensors and plain containers only, so this one was"
        " altered or comes from elsewhere (or from a version before 2026-11-26, which pickled PowerSGD's random"
        " state). Resume from a copy of the checkpoint you trust."
    )  # fmt: skip


def load_lightning_file(path: Path, weights_only: Optional[bool] = None) -> Any:
    """A Lightning ``.ckpt`` file, on the CPU, as Lightning's ``weights_only`` argument asks (None: torch's default)."""
    return _load(
        Path(path), weights_only, "`weights_only` was not False. If you trust where it came from, pass"
        " `weights_only=False` to `Trainer.fit` (or to `load_from_checkpoint`), or allow those classes with"
        " `torch.serialization.add_safe_globals([...])` before loading."
    )  # fmt: skip


def _load(path: Path, weights_only: Optional[bool], why_and_fix: str) -> Any:
    if weights_only is False:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        # (None: torch decides, as for Lightning, which hands it None too)
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as error:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - the names only help the message
            names = []
        held = f" ({', '.join(names[:5])})" if names else ""
        raise UnsafeCheckpointFile(
            f"Checkpoint file {path} holds objects that loading it could run code from{held}, so it was refused:"
            f" {why_and_fix}"
        ) from error
