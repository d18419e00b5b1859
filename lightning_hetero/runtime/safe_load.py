"""Runtime: checkpoint files are read without running code from them.

``torch.load(weights_only=False)`` unpickles anything, and unpickling can call any function the file names: a
checkpoint from elsewhere (a shared volume, a download) could run code on every rank that resumes it. So no file is
unpickled in full unless the user said they trust it (:func:`unpickles_in_full`: ``weights_only=False`` passed to
``Trainer.fit`` or ``load_from_checkpoint``, or torch's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` with nothing passed):

* :func:`load_package_file` reads the files the package writes itself (local training's and the exchange hooks'
  per-rank state, the pipeline's rank files) with ``weights_only=True``: tensors, numbers, strings and containers,
  nothing else. Rank 0 checks local training's files for every rank as it chooses the checkpoint
  (:func:`check_package_files`), so that a bad one stops every rank together.
* :func:`load_lightning_file` reads a user's Lightning ``.ckpt`` (and the Lightning state inside a pipeline
  checkpoint) the way ``Trainer.fit(ckpt_path=..., weights_only=...)`` asks, as Lightning itself passes it on to
  ``torch.load``: ``weights_only=None`` is torch's default (weights-only since torch 2.6, unless
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), and an explicit ``weights_only=False`` unpickles everything.
* :func:`load_deepspeed_file` reads one of DeepSpeed's files (to recognise a DeepSpeedStrategy checkpoint, to convert
  one to the universal format): its globals are checked without unpickling, then it is loaded weights-only with
  DeepSpeed's own classes allowed (its loss scaler, ZeRO's stage, fragment addresses: :data:`DEEPSPEED_OWN_GLOBALS`).
* :func:`check_checkpoint_directory` checks every ``.pt`` file of a checkpoint directory the same way, without
  unpickling, before DeepSpeed's engine loads it: the engine unpickles its files in full whatever this package does.

A file refused here is named with the way to load it anyway (:class:`UnsafeCheckpointFile`). This is stricter than
Lightning's DeepSpeedStrategy, whose resume lets DeepSpeed unpickle everything under the default ``weights_only``: a
checkpoint whose Lightning state holds more than plain data (a ``Path`` hyper-parameter, a config object) needs
``weights_only=False`` here, as the same state in a Lightning ``.ckpt`` file does under Lightning.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hetero.runtime.internal_access import resolve
from lightning_hetero.runtime.lightning_internals import TRAINER_RUN


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file holds objects that ``weights_only`` loading refuses (it could run code)."""


# The classes DeepSpeed's checkpoint files pickle besides tensors and plain containers (seen in ZeRO-0/2/3 files of
# DeepSpeed 0.19: the loss scaler, ZeRO's stage, the fragment addresses of its flat groups): what a checkpoint
# directory's files may hold (its files DeepSpeed's engine then unpickles in full), and what a weights-only read of
# one of them allows.
DEEPSPEED_OWN_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


def requested_weights_only(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[bool]:
    """The ``weights_only`` of the trainer call loading a checkpoint: what Lightning hands the strategy's
    ``load_checkpoint`` (``args``, ``kwargs``), else what the user gave ``Trainer.fit`` (or ``validate``, ``test``,
    ``predict``), read from the frame of ``Trainer._run`` up the stack (:data:`.lightning_internals.TRAINER_RUN`:
    Lightning 2.6 drops it for a strategy that restores after setup, so ``Trainer.fit(weights_only=False)`` did
    nothing). None when neither says."""
    given = kwargs.get("weights_only", args[0] if args else None)
    if given is not None:
        return bool(given)
    run = resolve(TRAINER_RUN).__code__
    frame = inspect.currentframe()
    try:
        while frame is not None and frame.f_code is not run:
            frame = frame.f_back
        return None if frame is None else frame.f_locals.get("weights_only")
    finally:
        del frame  # (a frame kept in a local keeps every frame above it alive)


_TRUE_VALUES = ("1", "y", "yes", "true")  # (torch.load's reading of its environment switches)


def unpickles_in_full(weights_only: Optional[bool]) -> bool:
    """Whether the user trusts the checkpoint, as ``torch.load(weights_only=weights_only)`` decides it: an explicit
    False, or None with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set; ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` makes every load
    weights-only whatever was passed. Everything else (Lightning's default None, True) checks a file before any of
    it is unpickled."""
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES:
        return False
    if weights_only is None:
        return os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE_VALUES
    return not weights_only


_PACKAGE_FILE_REFUSED = (
    "a file HeteroStrategy writes holds tensors and plain containers only, so this one was altered or comes from"
    " elsewhere (or from a version before 2026-11-26, which pickled PowerSGD's random state). Resume from a copy of the"
    " checkpoint you trust."
)


def load_package_file(path: Path) -> Any:
    """A file this package wrote, on the CPU, weights-only."""
    return _load(Path(path), True, _PACKAGE_FILE_REFUSED)


def check_package_files(paths: list[Path]) -> None:
    """Files this package wrote, checked without unpickling before any rank loads its own (one rank's refusal would
    leave the others waiting): :class:`UnsafeCheckpointFile` for the first that holds more than tensors and plain
    containers, as :func:`load_package_file` would raise on the rank that reads it."""
    for path in paths:
        names = _globals_beyond_torchs(path, f"it was refused: {_PACKAGE_FILE_REFUSED}")
        if names:
            raise UnsafeCheckpointFile(
                f"Checkpoint file {path} holds objects that loading it could run code from ({', '.join(names[:5])}),"
                f" so it was refused: {_PACKAGE_FILE_REFUSED}"
            )


_TRUSTED_FIX = (
    "If you trust where it came from, pass `weights_only=False` to `Trainer.fit` (or to `load_from_checkpoint`), or"
    " allow those classes with `torch.serialization.add_safe_globals([...])` before loading."
)
# The files naming the tag folder DeepSpeed loads (its own, and its universal copy's)
_TAG_FILES = ("latest", "latest_universal")
# A folder being written (a save or a universal conversion that may have been killed): never loaded
_STAGING_SUFFIX = ".partial"


def load_lightning_file(path: Path, weights_only: Optional[bool] = None) -> Any:
    """A Lightning ``.ckpt`` file, on the CPU, as Lightning's ``weights_only`` argument asks (None: torch's default)."""
    return _load(Path(path), weights_only, f"`weights_only` was not False. {_TRUSTED_FIX}")


def check_checkpoint_directory(directory: Path) -> None:
    """A checkpoint directory the user has not said they trust (see :func:`unpickles_in_full`), checked without
    unpickling before DeepSpeed unpickles its files in full: every ``.pt`` file pickles only tensors, plain
    containers and DeepSpeed's own classes; nothing inside is a symbolic link (a scan does not follow one, DeepSpeed's
    load does); every ``latest`` and ``latest_universal`` file, at any depth (a cached universal copy has its own),
    names a folder beside it, never one outside or a staging folder. Else :class:`UnsafeCheckpointFile`. Staging
    folders (``.*.partial``: a save or conversion that was killed, never loaded) are left out, as no tag file may
    name one."""
    root = Path(directory).resolve()  # (a `last.ckpt` link to the checkpoint is Lightning's own)
    for folder, folders, files in os.walk(root, followlinks=False):
        folders[:] = sorted(name for name in folders if not name.endswith(_STAGING_SUFFIX))
        for name in sorted([*folders, *files]):
            path = Path(folder) / name
            if path.is_symlink():
                raise UnsafeCheckpointFile(
                    f"Checkpoint {root} holds a symbolic link, {path} -> {os.readlink(path)}, so the checkpoint was"
                    f" refused (its target is not checked; DeepSpeed's load would follow it). {_TRUSTED_FIX}"
                )
            if name in _TAG_FILES:
                _check_tag_file(root, path)
            elif name.endswith(".pt"):
                _check_deepspeed_file(path)


def _check_tag_file(root: Path, path: Path) -> None:
    """A tag file names the folder DeepSpeed loads from, beside it: one the scan checks (not outside the checkpoint,
    not a staging folder the scan leaves out, not the folder itself)."""
    tag = path.read_text().strip() if path.is_file() else ""
    named = (path.parent / tag).resolve() if tag else path.parent
    if not tag or named.parent != path.parent.resolve() or named.name.endswith(_STAGING_SUFFIX):
        raise UnsafeCheckpointFile(
            f"Checkpoint {root}: its `{path.relative_to(root)}` file names {tag!r}, not a folder beside it that was"
            f" checked, so the checkpoint was refused (DeepSpeed would load from there, unchecked). {_TRUSTED_FIX}"
        )


def _globals_beyond_torchs(path: Path, refused: str) -> list[str]:
    """The classes and functions ``path`` would unpickle beyond torch's weights-only ones, read without unpickling;
    a file that does not read so (not a zip checkpoint, unreadable) is refused, ``refused`` saying what follows."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception as error:  # noqa: BLE001 - not checked, so not trusted
        raise UnsafeCheckpointFile(
            f"Checkpoint file {path} could not be checked for objects that loading it could run code from"
            f" ({type(error).__name__}: {error}), so {refused}"
        ) from error


def _check_deepspeed_file(path: Path) -> None:
    names = _globals_beyond_torchs(path, f"the checkpoint was refused. {_TRUSTED_FIX}")
    foreign = [name for name in names if name not in DEEPSPEED_OWN_GLOBALS]
    if foreign:
        raise UnsafeCheckpointFile(
            f"Checkpoint file {path} holds objects that loading it could run code from ({', '.join(foreign[:5])}), so"
            f" the checkpoint was refused before anything in it was loaded (DeepSpeed's engine unpickles its files in"
            f" full). {_TRUSTED_FIX}"
        )


def load_deepspeed_file(path: Path, in_full: bool = False, mmap: bool = False) -> Any:
    """One of DeepSpeed's checkpoint files, on the CPU (``mmap``: tensors left on disk until read). Unless the user
    trusts the checkpoint (``in_full``, see :func:`unpickles_in_full`), its globals are checked first and it loads
    weights-only with DeepSpeed's own classes allowed: :class:`UnsafeCheckpointFile` names anything else."""
    path = Path(path)
    if in_full:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    _check_deepspeed_file(path)
    with torch.serialization.safe_globals(_deepspeed_own_classes()):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def _deepspeed_own_classes() -> list[Any]:
    classes = []
    for name in sorted(DEEPSPEED_OWN_GLOBALS):
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


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
