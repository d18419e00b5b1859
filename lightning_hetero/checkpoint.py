"""Recover: a checkpoint is complete or it is ignored.

A DeepSpeed checkpoint is a directory that every rank writes into. Written in place, a kill in the middle (a
preempted node, an OOM kill) leaves a directory that looks like a checkpoint, is found by ``ckpt_path="last"``, and
fails to load or, worse, loads a mix of two steps. So a save goes through three steps:

1. every rank writes into a staging directory beside the target, ``.<name>.partial`` (a name Lightning's "last"
   search does not match);
2. once all ranks have finished, rank 0 writes a small manifest into it, :data:`MANIFEST_NAME`: format version,
   world size, global step, global samples consumed, the split, the device facts, and the size of every file;
3. rank 0 publishes it under the target name with one atomic rename (an atomic exchange with the previous checkpoint
   of that name, e.g. ``last.ckpt``, which is then deleted).

A directory is complete when its manifest reads and every file it lists is there with the listed size (a truncated
or missing file is "corrupt"); sizes, not checksums, so that checking a large checkpoint costs no reading. Only
complete checkpoints are resumed from: :func:`choose_checkpoint` skips an incomplete "last" with a warning naming
it, and refuses an incomplete checkpoint named explicitly.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

MANIFEST_NAME = "hetero_manifest.json"
FORMAT_VERSION = 1
# Files under this name inside a checkpoint are derived from it (the universal-format conversion cached for a resume
# at another world size) and are not part of what the manifest vouches for.
DERIVED_DIRNAME = "universal"
_STAGING_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"
# Lightning's ModelCheckpoint names its "last" checkpoints last.ckpt, last-v1.ckpt, ...
_LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


def staging_path(target: Path) -> Path:
    """Where a checkpoint for ``target`` is written before it is published."""
    return target.parent / f".{target.name}{_STAGING_SUFFIX}"


def list_files(directory: Path) -> dict[str, int]:
    """Every file under ``directory`` (relative POSIX path -> size in bytes), manifest and derived files excluded."""
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and relative.parts[0] not in (MANIFEST_NAME, DERIVED_DIRNAME):
            files[relative.as_posix()] = path.stat().st_size
    return files


def write_manifest(directory: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """Record ``facts`` and the files of the finished checkpoint in ``directory`` (written last, flushed to disk)."""
    manifest = {"format_version": FORMAT_VERSION, **facts, "files": list_files(directory)}
    temporary = directory / f"{MANIFEST_NAME}.tmp"
    with open(temporary, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, directory / MANIFEST_NAME)
    _sync_directory(directory)
    return manifest


def read_manifest(path: Path) -> Optional[dict[str, Any]]:
    """The manifest of checkpoint ``path``; None when it has none or it does not read."""
    try:
        manifest = json.loads((Path(path) / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def incompleteness(path: Path) -> Optional[str]:
    """Why checkpoint ``path`` cannot be resumed from; None when it is complete."""
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a DeepSpeed checkpoint directory"
    if not (path / MANIFEST_NAME).exists():
        return f"it has no {MANIFEST_NAME} (its save was interrupted, or it was written without HeteroStrategy)"
    manifest = read_manifest(path)
    if manifest is None or not isinstance(manifest.get("files"), dict):
        return f"its {MANIFEST_NAME} does not read"
    if manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version")
        return f"its manifest has format version {version!r}, this package reads {FORMAT_VERSION}"
    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    return None


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first (by global step, then modification time)."""
    if not Path(directory).is_dir():
        return []
    found = [p for p in Path(directory).iterdir() if not p.name.startswith(".") and incompleteness(p) is None]

    def age(path: Path) -> tuple[int, float]:
        manifest = read_manifest(path) or {}
        return int(manifest.get("global_step", -1)), path.stat().st_mtime

    return sorted(found, key=age)


def is_last_name(path: Path) -> bool:
    """Whether ``path`` is named like Lightning's "last" checkpoints (last.ckpt, last-v1.ckpt)."""
    return bool(_LAST_NAME.match(Path(path).name))


def choose_checkpoint(path: Path) -> tuple[Path, Optional[str]]:
    """The checkpoint to resume from when Lightning chose ``path``, and a warning to show if it is another one.

    A complete ``path`` is used as it is. An incomplete "last" checkpoint is skipped for the newest complete one in
    its directory (a save that was killed must cost the steps since the previous checkpoint, not the run). An
    incomplete checkpoint named explicitly is an error: loading another one silently would not be what was asked.
    """
    path = Path(path)
    reason = incompleteness(path)
    if reason is None:
        return path, None
    others = [p for p in complete_checkpoints(path.parent) if p != path]
    if is_last_name(path) and others:
        chosen = others[-1]
        return chosen, (
            f"HeteroStrategy: skipping checkpoint {path}: {reason}. Resuming from {chosen}, the newest complete"
            " checkpoint beside it."
        )
    nearby = f" Complete checkpoints beside it: {', '.join(p.name for p in others)}." if others else ""
    raise ValueError(
        f"`ckpt_path` resolves to {path}, which cannot be resumed from: {reason}.{nearby} Pass a complete"
        " checkpoint, or delete this one to start from scratch."
    )


def is_only_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` is complete and no other checkpoint in its directory is (pruning it would leave none)."""
    path = Path(path)
    if incompleteness(path) is not None:
        return False
    others = (p for p in path.parent.iterdir() if p != path and not p.name.startswith("."))
    return not any(incompleteness(other) is None for other in others)  # stops at the first complete one


def remove_stale_staging(target: Path) -> None:
    """Delete what an interrupted save of ``target`` left behind."""
    for leftover in (staging_path(target), _replaced_path(target)):
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)


def publish(staging: Path, target: Path) -> None:
    """Make the finished checkpoint in ``staging`` appear as ``target`` in one step, replacing any previous one."""
    if not target.exists() and not target.is_symlink():
        os.rename(staging, target)
    elif _exchange(staging, target):
        _remove(staging)  # now holds the previous checkpoint
    else:
        # No atomic exchange on this file system: for the instant between the two renames no checkpoint has the
        # target's name (the previous one is complete under `.replaced`).
        replaced = _replaced_path(target)
        os.rename(target, replaced)
        os.rename(staging, target)
        _remove(replaced)
    _sync_directory(target.parent)


def _replaced_path(target: Path) -> Path:
    return target.parent / f".{target.name}{_REPLACED_SUFFIX}"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # glibc before 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # kernel or file system without the flag
        return False
    raise OSError(error, os.strerror(error), str(first), None, str(second))


def _sync_directory(directory: Path) -> None:
    """Flush a directory's entries (a rename) to disk, where the platform allows it."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
