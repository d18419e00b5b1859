"""Recover: which way a checkpoint is resumed, decided from what the job and the checkpoint's manifest say.

A pure decision (no process group, no files read): :func:`resume_route` names the loader that fits, or raises
:class:`~lightning_hetero.recover.refusal.ResumeRefused` with what to do instead. Every rank holds the same manifest
(:meth:`~lightning_hetero.recover.recovery.Recovery.choose` gathered it), so every rank takes the same route or
raises the same error; every restart would too.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Optional

from lightning_hetero.configure.zero_stage import resume_stage_mismatch
from lightning_hetero.recover.refusal import ResumeRefused


class Route(enum.Enum):
    LIGHTNING_FILE = "a .ckpt file another strategy (DDP...) wrote"
    PIPELINE = "a pipeline's checkpoint directory, each rank's blocks by name"
    FROM_PIPELINE = "a pipeline's checkpoint directory, into training without `pipeline`, the whole model by name"
    INTO_PIPELINE = "a data-parallel checkpoint directory, into a pipeline: each rank's blocks by name"
    # A ZeRO directory, this package's or Lightning's DeepSpeedStrategy's (whose data position is added after).
    SAME_WORLD_SIZE = "a ZeRO checkpoint directory saved by as many ranks"
    ANOTHER_WORLD_SIZE = "a ZeRO checkpoint directory saved by another number of ranks"


def file_route(path: Path, pipeline: bool) -> Route:
    """A checkpoint file (not a directory): a Lightning checkpoint, which a pipeline cannot take yet."""
    if pipeline:
        raise ResumeRefused(
            f"HeteroStrategy(pipeline=...) cannot resume {path}, a Lightning checkpoint file: a pipeline resumes"
            " its own checkpoint directories for now. Resume it without `pipeline`."
        )
    return Route.LIGHTNING_FILE


def resume_route(
    chosen: Path,
    manifest: dict[str, Any],
    *,
    pipeline: bool,
    local: Optional[str],
    world_size: int,
    zero_stage: int,
    stage_is_automatic: bool,
) -> Route:
    """The route for the checkpoint directory ``chosen`` with its ``manifest``. ``pipeline``: this job splits the
    model into stages; ``local``: its ``sync`` mode when ranks train on their own (local SGD / DiLoCo), else None."""
    saved_pipeline = bool(manifest.get("pipeline"))
    if pipeline and not saved_pipeline:
        if manifest.get("sync") is not None:
            raise ResumeRefused(
                f"Checkpoint {chosen} was saved with `sync={manifest['sync']!r}`: each rank trained on its own and"
                " holds its own optimizer state, which no stage can take. Resume it with the same `sync` and without"
                " `pipeline`."
            )
        return Route.INTO_PIPELINE
    if saved_pipeline and not pipeline:
        if local is not None:
            raise ResumeRefused(
                f"Checkpoint {chosen} was saved with `pipeline`, and `sync={local!r}` needs each rank's own optimizer"
                " state: resume it with `pipeline`, or without `sync` (data parallel takes the whole model by name)."
            )
        return Route.FROM_PIPELINE
    if pipeline:
        return Route.PIPELINE
    mismatch = resume_stage_mismatch(manifest.get("zero_stage"), zero_stage, stage_is_automatic, str(chosen))
    if mismatch:
        raise ResumeRefused(mismatch)
    if manifest.get("world_size", world_size) == world_size:
        return Route.SAME_WORLD_SIZE
    if local is not None:
        raise ResumeRefused(
            f"Checkpoint {chosen} was trained on {manifest.get('world_size')} ranks with `sync={local!r}`, and each"
            " rank's own optimizer state is in it: resume it on as many ranks."
        )
    return Route.ANOTHER_WORLD_SIZE
