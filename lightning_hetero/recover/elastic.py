"""Recover: what the strategy does at Lightning's checkpoint and exception points so that a job survives losing ranks.

* :func:`save_atomically`: every checkpoint goes through :mod:`lightning_hetero.recover.checkpoint`'s staging, manifest
  and atomic publish.
* :func:`interrupt_checkpoint_path`: where a preempted (SIGTERM) job saves before it exits, so that
  ``fit(ckpt_path="last")`` finds it: ``last.ckpt`` in the first ``ModelCheckpoint``'s directory.
* :func:`prune_unless_only`: ``ModelCheckpoint``'s pruning never deletes the only complete checkpoint.
* :func:`init_process_group_for_this_attempt`: a job that torchrun restarted connects its ranks afresh.
* :func:`convert_to_universal`: a checkpoint saved by another number of ranks becomes DeepSpeed's universal
  checkpoint (cached inside it), which loads at any world size with the optimizer state (:mod:`.universal`), once
  :func:`check_convertible` has found its optimizer state per parameter.
* :func:`launched_layout`: the ``devices`` and ``num_nodes`` of the launcher's job, for an elastic job's script.

The strategy keeps the lifecycle (which hook calls what); these functions keep the file handling out of it.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning_hetero.recover import checkpoint, liveness, universal
from lightning_hetero.recover.refusal import ResumeRefused

SHARED_FOLDER_MARK = ".hetero_rank_0_prepared"  # in the staging folder while the ranks write


def save_atomically(
    target: Path,
    write: Callable[[Path], None],
    manifest_facts: Callable[[], dict[str, Any]],
    is_global_zero: bool,
    agree: Callable[[str, Callable[[], tuple[Any, Any]]], Any],
    hold_writer_lock: Callable[[Path], None],
) -> None:
    """Every rank calls this; ``write(directory)`` is the DeepSpeed save of this rank's part into ``directory``.

    Three agreements order it (``agree(what, step)`` runs ``step`` on every rank and raises on every rank when it
    failed on any, naming it): nobody writes into the staging directory before rank 0 holds the directory's writer
    lock and has cleared what an interrupted save left there; nobody has unfinished files when rank 0 lists them
    into the manifest; nobody goes on (to prune the previous checkpoint, or to save again) before the new one is
    published. A failed write (a full disk on any rank) stops every rank with the reason, and rank 0 removes the
    staging directory once all have stopped writing: the previous checkpoint stays the one to resume from. A rank
    that does not see rank 0's staging directory (not a shared file system) stops every rank before anyone writes.
    ``agree`` returns (this rank's result, every rank's shared part), as the strategy's gather-or-raise does.
    """
    staging = checkpoint.staging_path(target)
    seen_by_all = staging / SHARED_FOLDER_MARK

    def prepare() -> tuple[None, Optional[str]]:
        if not is_global_zero:
            return None, None
        target.parent.mkdir(parents=True, exist_ok=True)
        hold_writer_lock(target.parent)
        checkpoint.remove_stale_staging(target)
        # Rank 0 publishes what every rank wrote into its staging folder: a rank that writes elsewhere (a folder of
        # the same name on its own machine's disk) would leave its part out of the checkpoint, unnoticed until a
        # resume fails. Every rank reads this mark back before it writes.
        staging.mkdir(parents=True)
        token = uuid.uuid4().hex
        seen_by_all.write_text(token)
        return None, token

    _, shared = agree("preparing the checkpoint", prepare)
    token = shared[0]

    def write_part() -> tuple[None, None]:
        if not seen_by_all.is_file() or seen_by_all.read_text() != token:
            raise RuntimeError(
                f"this rank does not see the checkpoint folder rank 0 prepared in {target.parent} (on"
                f" {socket.gethostname()}): every rank writes its part where rank 0 publishes the checkpoint, so the"
                " folder must be on a file system every rank shares (as DeepSpeed's resume needs too). Save to"
                " shared storage."
            )
        try:
            write(staging)
        except Exception as error:
            raise checkpoint.explain_write_failure(error, target) from error
        return None, None

    def publish() -> tuple[None, None]:
        if is_global_zero:
            seen_by_all.unlink()
            try:
                checkpoint.write_manifest(staging, manifest_facts())
            except Exception as error:
                raise checkpoint.explain_write_failure(error, target) from error
            checkpoint.publish(staging, target)
        return None, None

    try:
        agree("writing the checkpoint", write_part)
        agree("publishing the checkpoint", publish)
    except BaseException:
        if is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
        raise


class DeferredWriteErrors:
    """Inside the block, a disk write of DeepSpeed's save that fails is remembered instead of raised.

    DeepSpeed's ``save_checkpoint`` ends with a barrier that every rank must reach: a rank whose write raised (a full
    disk) would leave for the next collective while the others wait in that barrier (seen: a hang). So the save's
    disk writes (each file, directory and the recovery script DeepSpeed copies in) keep their failure, DeepSpeed's
    collectives run as usual, and :meth:`raise_first` raises it after the save returned, where the strategy shares
    it with every rank. DeepSpeed's own ``latest`` file (a plain ``open``) is written by :meth:`write_latest` instead.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.errors: list[BaseException] = []
        self._latest: Optional[tuple[str, str]] = None  # (directory, tag) that DeepSpeed would have written
        self._shadowed: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> DeferredWriteErrors:
        engine, files = self._engine, self._engine.checkpoint_engine
        save_checkpoint = engine.save_checkpoint

        def save_without_latest(save_dir: Any, tag: Any = None, *args: Any, save_latest: bool = True, **kwargs: Any):
            if save_latest:
                self._latest = (str(save_dir), str(tag))
            return save_checkpoint(save_dir, tag, *args, save_latest=False, **kwargs)

        for owner, name in ((files, "save"), (files, "makedirs"), (engine, "_copy_recovery_script")):
            self._shadow(owner, name, self._remembering(getattr(owner, name)))
        self._shadow(engine, "save_checkpoint", save_without_latest)
        return self

    def _remembering(self, write: Callable[..., Any]) -> Callable[..., Any]:
        def write_or_remember(*args: Any, **kwargs: Any) -> Any:  # (DeepSpeed passes state_dict=, path=)
            try:
                return write(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - raised by raise_first, after DeepSpeed's barrier
                self.errors.append(error)
                return None

        return write_or_remember

    def _shadow(self, owner: Any, name: str, replacement: Any) -> None:
        """An instance attribute shadows the method until __exit__, which puts back what the instance held."""
        self._shadowed.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, replacement)

    def __exit__(self, *exc: object) -> None:
        for owner, name, before in reversed(self._shadowed):
            if before is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)
        self._shadowed = []

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def write_latest(self, is_global_zero: bool) -> None:
        """DeepSpeed's ``latest`` file (the tag a load reads), written by rank 0 as DeepSpeed would have."""
        if is_global_zero and self._latest is not None:
            directory, tag = self._latest
            Path(directory, "latest").write_text(tag)


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


def launched_layout(default_devices: int) -> tuple[int, int]:
    """``(devices, num_nodes)`` for ``Trainer`` from the launcher that started this process.

    Under torchrun (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``) the ranks per node and the number of nodes: in an elastic
    job (``--nnodes=1:4``) the number of nodes changes between restarts, so a script must not fix it (Lightning
    refuses ``devices x num_nodes`` that differs from the world size). In an srun step, Slurm's tasks per node and
    nodes. Otherwise ``(default_devices, 1)``: Lightning's launcher starts that many ranks on this machine.
    """
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    slurm_tasks, slurm_nodes = os.environ.get("SLURM_STEP_NUM_TASKS"), os.environ.get("SLURM_STEP_NUM_NODES")
    if (local is None or world is None) and slurm_tasks and slurm_nodes:
        # An srun step (set there only, not in the batch script): Lightning's SLURMEnvironment takes the ranks from
        # Slurm and refuses `devices` other than the tasks per node.
        tasks, nodes = int(slurm_tasks), int(slurm_nodes)
        if tasks % nodes:
            raise ValueError(
                f"srun started {tasks} tasks on {nodes} nodes: Lightning needs the same number of tasks on every"
                " node (`Trainer(devices=..., num_nodes=...)`). Use `#SBATCH --ntasks-per-node`."
            )
        return tasks // nodes, nodes
    if local is None or world is None:
        return default_devices, 1
    per_node, ranks = int(local), int(world)
    if ranks % per_node:
        raise ValueError(
            f"torchrun started {ranks} ranks with LOCAL_WORLD_SIZE={per_node} on this node: Lightning needs the same"
            " number of ranks on every node (`Trainer(devices=..., num_nodes=...)`). Give every agent the same"
            " `--nproc-per-node`."
        )
    return per_node, ranks // per_node


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
    agent_store = liveness.store_connector(timeout.total_seconds())()
    store = torch.distributed.PrefixStore(f"lightning_hetero/attempt_{attempt}/", agent_store)
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


UNIVERSAL_MARKER = "latest_universal"


def needs_universal(manifest: dict[str, Any], world_size: int) -> bool:
    """Whether a checkpoint must be converted to load on ``world_size`` ranks (ZeRO 1-3 shard by world size)."""
    return manifest.get("world_size") != world_size and manifest.get("zero_stage", 0) > 0


def check_convertible(path: Path, manifest: dict[str, Any], world_size: int, in_full: bool = False) -> None:
    """Every rank, before anything is converted: refuse an optimizer whose state is not per parameter (read from rank
    0's optimizer file, memory-mapped; ``in_full``: the user trusts the checkpoint), with what to do, as every restart
    on as many ranks would be refused."""
    tag = checkpoint.deepspeed_tag(path)
    keys = universal.state_keys(path / tag, in_full)
    why = universal.refusal(
        path,
        str(manifest.get("optimizer")),
        manifest.get("zero_stage", 0),
        manifest.get("world_size"),
        world_size,
        keys,
    )
    if why is not None:
        raise ResumeRefused(why)


def convert_to_universal(path: Path, in_full: bool = False) -> tuple[Path, Optional[float]]:
    """Convert checkpoint ``path`` to DeepSpeed's universal format in ``path/universal`` (rank 0 only; ``in_full``: the
    user trusts the checkpoint, else its files are read weights-only with DeepSpeed's own classes allowed).

    Returns the directory to load from and the seconds the conversion took (None when the cached one was used). The
    conversion (:mod:`.universal`) is published with a rename, so a conversion that was killed is redone, never
    half-used.
    """
    converted = path / checkpoint.DERIVED_DIRNAME
    if (converted / UNIVERSAL_MARKER).exists():
        return converted, None
    staging = path / f".{checkpoint.DERIVED_DIRNAME}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    tag = checkpoint.deepspeed_tag(path)
    started = time.perf_counter()
    try:
        universal.convert(path / tag, staging / tag, in_full)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.rename(staging, converted)
    return converted, time.perf_counter() - started
