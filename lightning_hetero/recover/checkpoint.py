"""Recover: a checkpoint is complete or it is ignored.

A DeepSpeed checkpoint is a directory that every rank writes into. Written in place, a kill in the middle (a
preempted node, an OOM kill) leaves a directory that looks like a checkpoint, is found by ``ckpt_path="last"``, and
fails to load or, worse, loads a mix of two steps. So a save goes through three steps:

1. every rank writes into a staging directory beside the target, ``.<name>.partial`` (a name Lightning's "last"
   search does not match);
2. once all ranks have finished, rank 0 writes a small manifest into it, :data:`MANIFEST_NAME`: format version,
   world size, global step, global samples consumed, the split, the device facts, and the size and CRC-32 of every
   file;
3. rank 0 publishes it under the target name with one atomic rename (an atomic exchange with the previous checkpoint
   of that name, e.g. ``last.ckpt``, which is then deleted).

A directory is complete when its manifest reads and every file it lists is there with the listed size (a truncated
or missing file is "corrupt"), and, where the reader asks (:func:`choose_checkpoint`, at resume), with the listed
checksum: a file damaged in place keeps its size. Only complete checkpoints are resumed from: :func:`choose_checkpoint`
skips an incomplete or damaged "last" with a warning naming it, and refuses one named explicitly.

One job writes into a directory at a time: rank 0 holds an exclusive lock (:class:`WriterLock`, ``flock`` on
``.<directory>`` + :data:`WRITER_LOCK_SUFFIX` beside it, so that the directory lists only checkpoints) while it saves
there, and a second job's save is refused naming the holder, instead of
deleting the other job's staging directory as leftovers. A failed write (a full disk, whose torch error says
"unexpected pos") is explained (:func:`explain_write_failure`) and its staging directory removed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Optional

from lightning_hetero.comm.communication import STATE_DIRNAME as HOOK_STATE_DIRNAME
from lightning_hetero.recover.refusal import ResumeRefused

MANIFEST_NAME = "hetero_manifest.json"
# Local training's per-rank state (each rank's inner optimizer, DiLoCo's outer one, the error feedback) in a checkpoint
# directory: written and read by lightning_hetero.local.merges, listed here with the package's other rank files.
LOCAL_STATE_DIRNAME = "hetero_local_sgd"
# 2: each file's size and CRC-32 ({"size": n, "crc32": "8 hex digits"}); 1: its size only (still read).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
WRITER_LOCK_SUFFIX = ".hetero_writer.lock"
_CHUNK = 8 << 20
# Below this much free space, a write that failed is taken to have filled the disk (torch's own error does not say).
_DISK_FULL_BYTES = 1 << 20
# Files under this name inside a checkpoint are derived from it (the universal-format conversion cached for a resume
# at another world size) and are not part of what the manifest vouches for.
DERIVED_DIRNAME = "universal"
_STAGING_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"
# Lightning's ModelCheckpoint names its "last" checkpoints last.ckpt, last-v1.ckpt, ...
_LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


# The key the package adds to Lightning's state in every checkpoint it writes (DeepSpeed's rank-0 model-states file):
# a checkpoint that lost its manifest is still known for the package's own (see from_deepspeed.written_by_the_package).
PACKAGE_MARK = "lightning_hetero"


def package_files(directory: Path) -> list[Path]:
    """The package's files in a checkpoint directory that each rank reads alone: local training's per-rank state and
    the exchange hooks' (error feedback). The hooks' are read only when the job's compression matches the
    checkpoint's, but a bad one is refused whatever this job's compression: a file the package never writes that way
    means the checkpoint was altered. (The pipeline's rank files are read by every rank, so every rank refuses a bad
    one itself.)"""
    folders = (Path(directory) / LOCAL_STATE_DIRNAME, Path(directory) / HOOK_STATE_DIRNAME)
    return [path for folder in folders for path in sorted(folder.glob("*.pt"))]


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


def file_crc32(path: Path) -> str:
    """The CRC-32 of a file's contents as 8 hex digits (zlib's, about 2 GB/s here; it detects damage, not tampering)."""
    checksum = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            checksum = zlib.crc32(chunk, checksum)
    return f"{checksum:08x}"


def write_manifest(directory: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """Record ``facts`` and the files of the finished checkpoint in ``directory`` (written last, flushed to disk)."""
    listed = list_files(directory)
    files = {name: {"size": size, "crc32": file_crc32(directory / name)} for name, size in listed.items()}
    manifest = {"format_version": FORMAT_VERSION, **facts, "files": files}
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


def _listed(entry: Any) -> tuple[Optional[int], Optional[str]]:
    """(size, crc32) of a manifest's file entry: ``{"size", "crc32"}`` (version 2) or a bare size (version 1)."""
    if isinstance(entry, dict):
        return entry.get("size"), entry.get("crc32")
    return entry, None


def incompleteness(path: Path, verify_checksums: bool = False) -> Optional[str]:
    """Why checkpoint ``path`` cannot be resumed from; None when it is complete.

    Sizes are always compared (no reading); ``verify_checksums`` also reads every file and compares its CRC-32 with
    the manifest's, which finds a file damaged in place (its size unchanged).
    """
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
    if manifest.get("format_version") not in READABLE_VERSIONS:
        version = manifest.get("format_version")
        return f"its manifest has format version {version!r}, this package reads {list(READABLE_VERSIONS)}"
    for name, entry in manifest["files"].items():
        file = path / name
        size, _ = _listed(entry)
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {size}"
    if verify_checksums:
        for name, entry in manifest["files"].items():
            _, crc32 = _listed(entry)
            if crc32 is not None and file_crc32(path / name) != crc32:
                return f"{name} does not match its checksum (it changed after it was written: damaged)"
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


def deepspeed_tag(path: Path) -> str:
    """The tag folder's name of DeepSpeed checkpoint directory ``path``, as its ``latest`` file names it."""
    return (path / "latest").read_text().strip()


def is_last_name(path: Path) -> bool:
    """Whether ``path`` is named like Lightning's "last" checkpoints (last.ckpt, last-v1.ckpt)."""
    return bool(_LAST_NAME.match(Path(path).name))


def choose_checkpoint(path: Path) -> tuple[Path, Optional[str]]:
    """The checkpoint to resume from when Lightning chose ``path``, and a warning to show if it is another one.

    A complete ``path`` (checksums verified) is used as it is. An incomplete or damaged "last" checkpoint is skipped
    for the newest complete one in its directory (a save that was killed, or a file damaged on disk, must cost the
    steps since the previous checkpoint, not the run); each candidate is verified in turn. An incomplete checkpoint
    named explicitly is an error: loading another one silently would not be what was asked.
    """
    path = Path(path)
    reason = incompleteness(path, verify_checksums=True)
    if reason is None:
        return path, None
    others = [p for p in complete_checkpoints(path.parent) if p != path]
    if is_last_name(path):
        skipped = [f"{path}: {reason}"]
        for candidate in reversed(others):
            damage = incompleteness(candidate, verify_checksums=True)
            if damage is None:
                return candidate, (
                    f"HeteroStrategy: skipping checkpoint {'; and '.join(skipped)}. Resuming from {candidate}, the"
                    " newest complete checkpoint beside it."
                )
            skipped.append(f"{candidate}: {damage}")
        others = []
    nearby = f" Complete checkpoints beside it: {', '.join(p.name for p in others)}." if others else ""
    raise ResumeRefused(
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
    """Delete what an interrupted save of ``target`` left behind (call it holding the directory's writer lock: with
    another job writing there, its staging directory would not be stale)."""
    for leftover in (staging_path(target), _replaced_path(target)):
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)


class WriterLock:
    """This process's exclusive right to save checkpoints into one directory, held until :meth:`release`.

    An advisory ``flock`` on a file beside the directory (:func:`writer_lock_path`: not inside it, where it showed
    up in the listing of the user's checkpoints): the kernel drops it when the process ends, however it ends, so a
    killed job never leaves a stale lock. The file says who holds it, for the refusal, and is removed on release (a
    killed holder leaves it behind, unlocked: the next job takes it over).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.path = writer_lock_path(self.directory)
        self._inside = False  # (the fallback taken: the lock file inside the folder)
        self._handle: Optional[Any] = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        """Take the lock (at once, or a ValueError naming the job that holds it); nothing when already held."""
        while self._handle is None:
            try:
                handle = open(self.path, "a+")
            except OSError as error:
                if self._inside or error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                # A parent the job may not write into (a shared root holding only its folder, a read-only file system
                # with the folder mounted writable): the lock goes inside the folder instead.
                self.path, self._inside = self.directory / WRITER_LOCK_SUFFIX, True
                continue
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise ValueError(
                    f"HeteroStrategy: another job is saving checkpoints into {self.directory} ({holder} holds"
                    f" {self.path}). Two jobs writing one directory would replace and prune each other's"
                    " checkpoints; give this one its own `ModelCheckpoint(dirpath=...)` (or `default_root_dir`), or"
                    " wait for the other to finish."
                ) from None
            if not _same_file(handle, self.path):  # released and removed by its holder meanwhile: take the new one
                handle.close()
                continue
            handle.seek(0)
            handle.truncate()
            handle.write(f"process {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
            handle.flush()
            self._handle = handle

    def release(self) -> None:
        if self._handle is not None:
            try:
                self.path.unlink()  # while still locked, so no one locks the name it had meanwhile
            except OSError:
                pass
            self._handle.close()  # closing drops the flock
            self._handle = None


def writer_lock_path(directory: Path) -> Path:
    """The lock file of checkpoint directory ``directory``: ``.<name>.hetero_writer.lock`` in its parent, the same for
    every path to it (resolved: a second job reaching it through a link finds the same lock)."""
    resolved = Path(directory).resolve()
    return resolved.parent / f".{resolved.name}{WRITER_LOCK_SUFFIX}"


def _same_file(handle: Any, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except OSError:
        return False


def is_disk_full(error: BaseException, path: Path) -> bool:
    """Whether ``error``, raised writing under ``path``, came from a full file system (or quota).

    An ``OSError`` says so with its errno; torch's zip writer does not (``RuntimeError: unexpected pos 5440 vs
    5334``), so a write that failed with almost no space left where it wrote is taken to be one too.
    """
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes(path) < _DISK_FULL_BYTES


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def explain_write_failure(error: BaseException, target: Path) -> BaseException:
    """The error to raise when writing checkpoint ``target`` failed: a full disk named as such, others unchanged."""
    if not is_disk_full(error, staging_path(target)):
        return error
    return OSError(
        errno.ENOSPC,
        f"No space left on device (ENOSPC) while writing checkpoint {target} ({free_bytes(target.parent)} bytes free"
        f" on its file system; the writer said: {type(error).__name__}: {error}). The partial checkpoint is removed"
        " and the previous one is kept. Free some space, or save to a larger disk (`ModelCheckpoint(dirpath=...)`).",
    )


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
