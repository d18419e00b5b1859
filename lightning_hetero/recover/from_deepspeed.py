"""Recover: a fit continues from a checkpoint directory that Lightning's DeepSpeedStrategy wrote.

A user switching from ``strategy="deepspeed"`` mid-run has such a directory: DeepSpeed's own layout (``latest``, the
tag folder ``checkpoint/`` with every rank's model and optimizer states, Lightning's state in rank 0's model-states
file), as this strategy writes it, but without ``hetero_manifest.json``. The strategy's writes are complete or
ignored and a directory without a manifest is one that was never published; DeepSpeedStrategy writes in place, so
here a directory without a manifest is taken as DeepSpeedStrategy's when DeepSpeed's layout is whole: ``latest``
names a tag folder that holds every rank's files for the world size and ZeRO stage its rank-0 file records, that
file reads, and nothing in it says the package wrote it (a checkpoint of the package's own that lost its manifest is
incomplete, not foreign: :func:`written_by_the_package`). The file is read without running code from it: its globals
are checked first (:func:`~lightning_hetero.runtime.safe_load.load_deepspeed_file`). Then the facts a manifest would
give (:func:`deepspeed_strategy_facts`) come from that file, and the resume is the strategy's own: DeepSpeed loads
the states (at another number of ranks through its universal format, as for a manifest), and the training loader's
place in the epoch, which DeepSpeedStrategy does not save (its ``DistributedSampler`` is not stateful), is derived
from the loops' progress as for a DDP file (:mod:`.from_lightning`). Anything else without a manifest keeps the
package's answer (skipped when it is "last", an error when named), with DeepSpeedStrategy's own words when the path is
no DeepSpeed checkpoint at all.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.strategies.deepspeed import _is_deepspeed_checkpoint, _validate_checkpoint_directory
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hetero.recover import checkpoint
from lightning_hetero.recover import from_lightning as resume_lightning
from lightning_hetero.runtime.safe_load import UnsafeCheckpointFile, load_deepspeed_file
from lightning_hetero.train.order import STATE_SAMPLES_CONSUMED

# What a manifest built from DeepSpeedStrategy's files says about who wrote them (see deepspeed_strategy_facts).
WRITTEN_BY = "written_by"
DEEPSPEED_STRATEGY = "DeepSpeedStrategy"
_ZERO_3_MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
_MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_STATES = "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def deepspeed_strategy_facts(path: Path, in_full: bool = False) -> Optional[dict[str, Any]]:
    """What a manifest would record of ``path`` when it is a whole checkpoint that Lightning's DeepSpeedStrategy (or
    DeepSpeed itself) wrote; None when it is not one (a manifest, or the package's own checkpoint that lost it: see
    :func:`written_by_the_package`; files missing). The format is recognised from the file names first; the rank-0
    model-states file is then read as :func:`~lightning_hetero.runtime.safe_load.load_deepspeed_file` reads it, its
    globals checked before anything is unpickled unless the user trusts the checkpoint (``in_full``): a file that
    would run code raises :class:`~lightning_hetero.runtime.safe_load.UnsafeCheckpointFile` naming it."""
    path = Path(path)
    if not path.is_dir() or (path / checkpoint.MANIFEST_NAME).exists() or not (path / "latest").is_file():
        return None
    tag = checkpoint.deepspeed_tag(path)
    folder = path / tag
    first = next(
        (f for f in (folder / _MODEL_STATES, folder / _ZERO_3_MODEL_STATES.format(rank=0)) if f.is_file()), None
    )
    if not tag or first is None or checkpoint.package_files(path):
        return None
    states = _read_if_deepspeeds(first, in_full)
    if not isinstance(states, dict) or not isinstance(states.get("ds_config"), dict):
        return None
    if written_by_the_package(states):
        return None  # the package's own, without its manifest: incomplete, never another strategy's
    world_size = int(states.get("dp_world_size") or 1)
    zero = states["ds_config"].get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    expected = [_OPTIM_STATES.format(rank=r) for r in range(world_size)] if stage > 0 else []
    if stage == 3:
        expected += [_ZERO_3_MODEL_STATES.format(rank=r) for r in range(world_size)]
    if any(not (folder / name).is_file() for name in expected):
        return None  # a save killed half-way (DeepSpeedStrategy writes in place)
    micro_batch = states["ds_config"].get("train_micro_batch_size_per_gpu")
    return {
        WRITTEN_BY: DEEPSPEED_STRATEGY,
        "world_size": world_size,
        "zero_stage": stage,
        "global_step": states.get("global_step"),
        "epoch": states.get("epoch"),
        # DeepSpeedStrategy gives every rank the loader's batch: DDP's global batch, what the data position counts in.
        "batch_sizes": [int(micro_batch)] * world_size if isinstance(micro_batch, int) else None,
        "optimizer": _optimizer_name(states, folder / _OPTIM_STATES.format(rank=0), stage, in_full),
    }


def written_by_the_package(states: dict[str, Any]) -> bool:
    """Whether a DeepSpeed model-states file holds the state this package writes into every checkpoint: its mark
    (:data:`.checkpoint.PACKAGE_MARK`), or, in a checkpoint written before the mark, the training loader's position
    in global samples (DeepSpeedStrategy's ``DistributedSampler`` saves none)."""
    if checkpoint.PACKAGE_MARK in states:
        return True
    loops = states.get("loops")
    fit_loop = loops.get("fit_loop") if isinstance(loops, dict) else None
    loop_state = fit_loop.get("state_dict") if isinstance(fit_loop, dict) else None
    loaders = loop_state.get("combined_loader") if isinstance(loop_state, dict) else None
    return isinstance(loaders, list) and any(isinstance(s, dict) and STATE_SAMPLES_CONSUMED in s for s in loaders)


def _read_if_deepspeeds(path: Path, in_full: bool) -> Any:
    """DeepSpeed's file ``path``, or None when it is no torch checkpoint (then no DeepSpeed checkpoint either). A file
    that holds what loading it could run code from is refused (UnsafeCheckpointFile), not taken for something else."""
    if not zipfile.is_zipfile(path):  # (DeepSpeed saves in torch's zip format)
        return None
    try:
        return load_deepspeed_file(path, in_full, mmap=True)
    except UnsafeCheckpointFile:
        raise
    except Exception:  # noqa: BLE001 - not DeepSpeed's file: not DeepSpeed's checkpoint
        return None


def _optimizer_name(states: dict[str, Any], optim_file: Path, stage: int, in_full: bool) -> str:
    """Adam's name when the saved optimizer state holds Adam's moments (what DeepSpeed's universal converter reads, see
    :func:`.elastic.check_convertible`); else the DeepSpeed config's optimizer type, or "unknown"."""
    saved = states.get("optimizer")
    if stage > 0 and optim_file.is_file():
        saved = _read_if_deepspeeds(optim_file, in_full)
    if _holds_adam_moments(saved):
        return "Adam"
    configured = (states["ds_config"].get("optimizer") or {}).get("type")
    return str(configured) if configured else "unknown (no Adam moments in its state)"


def _holds_adam_moments(state: Any, depth: int = 0) -> bool:
    if depth > 6:
        return False
    if isinstance(state, dict):
        if "exp_avg" in state and "exp_avg_sq" in state:
            return True
        return any(_holds_adam_moments(value, depth + 1) for value in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_adam_moments(value, depth + 1) for value in state)
    return False


class NotACheckpoint(FileNotFoundError, ValueError):
    """A ``ckpt_path`` that is no checkpoint: DeepSpeedStrategy's FileNotFoundError (with its hint), and the ValueError
    the package raises for a checkpoint it cannot resume from."""


def _raise_deepspeedstrategys_answer(path: Path) -> None:
    try:
        _validate_checkpoint_directory(path)
    except FileNotFoundError as error:
        raise NotACheckpoint(str(error)) from None


def choose_checkpoint(path: Path, in_full: bool = False) -> tuple[str, Optional[str], Optional[dict[str, Any]]]:
    """:func:`.checkpoint.choose_checkpoint`, and a DeepSpeedStrategy directory taken as it is: (the path, a warning,
    the facts of a DeepSpeedStrategy directory or None). A path that is no checkpoint at all fails with
    DeepSpeedStrategy's message (it says when the path is a folder or a file inside a checkpoint). ``in_full``: the
    user trusts the checkpoint (see :func:`deepspeed_strategy_facts`)."""
    try:
        facts = deepspeed_strategy_facts(path, in_full)
    except UnsafeCheckpointFile:
        # A "last" beside complete checkpoints of the package is most likely its own that lost its manifest, whose
        # Lightning state holds more than plain data: skipped as any incomplete "last" (the one chosen is checked).
        if not (checkpoint.is_last_name(path) and checkpoint.complete_checkpoints(Path(path).parent)):
            raise
        facts = None
    if facts is not None:
        return str(path), None, facts
    try:
        chosen, warning = checkpoint.choose_checkpoint(path)
    except ValueError:
        if not _is_deepspeed_checkpoint(Path(path)):
            _raise_deepspeedstrategys_answer(path)  # it names the folder to load when a part of one was given
        raise
    return str(chosen), warning, None


def explain_a_file_inside_a_checkpoint(path: Path) -> None:
    """A ``ckpt_path`` that is a file of a DeepSpeed checkpoint folder, not a Lightning file: DeepSpeedStrategy's
    message, which names the folder to pass instead (nothing when ``path`` is not inside one)."""
    if Path(path).is_file() and _is_deepspeed_checkpoint(Path(path).parent.parent):
        _raise_deepspeedstrategys_answer(path)


def with_data_position(client_state: dict[str, Any], facts: dict[str, Any], order: Optional[Any]) -> dict[str, Any]:
    """Lightning's state from a DeepSpeedStrategy directory, with the training loader's place in the epoch that the
    loops' progress gives (``order``: the training loader's global order, None for a stream or when not fitting).
    DeepSpeedStrategy's ``DistributedSampler`` shuffled the epoch as a shuffling loader does here; an unshuffled loader
    is warned about, since that epoch's rest then differs."""
    global_batch = sum(facts.get("batch_sizes") or [])
    if order is None or not global_batch:
        return client_state
    state = resume_lightning.loader_state_for(client_state, global_batch, len(order), order.seed)
    if state is None:
        return client_state
    if not order.shuffles:
        rank_zero_warn(
            "HeteroStrategy: the DeepSpeedStrategy checkpoint stopped in the middle of an epoch, which its"
            " DistributedSampler shuffled; this unshuffled loader keeps its own order, so the rest of the epoch is"
            " not exactly the samples DeepSpeedStrategy had not used (later epochs are whole). Give the loader"
            " `shuffle=True` to continue its epoch exactly."
        )
    return resume_lightning.with_loader_state(client_state, state)


def is_deepspeed_strategys(manifest: dict[str, Any]) -> bool:
    return manifest.get(WRITTEN_BY) == DEEPSPEED_STRATEGY


def describe(path: Path, facts: dict[str, Any]) -> str:
    return (
        f"HeteroStrategy: continuing from {path}, a checkpoint of Lightning's DeepSpeedStrategy (ZeRO-"
        f"{facts['zero_stage']}, {facts['world_size']} rank{'s' if facts['world_size'] != 1 else ''}, step"
        f" {facts.get('global_step')}); it has no hetero_manifest.json, so its files are not verified by checksum."
    )
