"""Configure: the ZeRO stage when the user names none (``stage=None``, the default): the lowest stage that fits.

Each ZeRO stage shards more of the model's state over the ranks (1: the optimizer state, 2: the gradients too, 3: the
parameters too) and pays for it on every step: on 2 identical CPU ranks the default ZeRO-2 step cost 1.19x DDP's and
ZeRO-0 1.02x. So the stage is the lowest whose memory fits every device: the model, its gradients and its optimizer
state on that rank, plus the activations of its planned micro-batch, within ``MEMORY_HEADROOM`` of its free memory.

What is not known is assumed on the safe side: the optimizer state is Adam's (two fp32 moments, 8 bytes per trainable
parameter; SGD needs less), the parameters count although the free memory may already exclude them, and without a
profile (a fixed split) half the room is kept for activations. Ranks that share a device (CPU ranks on one host, two
ranks on one GPU) share its free memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM

STAGES = (0, 1, 2, 3)
FP32_BYTES, HALF_BYTES = 4, 2
OPTIMIZER_STATE_BYTES = 8  # per trainable parameter: Adam's exp_avg and exp_avg_sq in fp32
UNPROFILED_ACTIVATION_SHARE = 0.5  # of the room, kept for activations when no profile measured them


# Trainer precisions in which DeepSpeed keeps half-precision parameters and gradients beside an fp32 master copy.
HALF_PRECISION_ENGINES = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")


@dataclass(frozen=True)
class ModelSize:
    """What the model's state takes: parameters (all, and those that train) and how DeepSpeed holds them."""

    parameters: int
    trainable: int
    half_precision_engine: bool = False  # DeepSpeed's fp16/bf16 mode: half parameters and gradients, fp32 master copy


def model_state_bytes(size: ModelSize, stage: int, world_size: int) -> float:
    """The parameters, gradients, optimizer state (and fp32 master weights in DeepSpeed's half mode) one rank holds at
    ZeRO ``stage`` over ``world_size`` ranks."""
    shards = max(1, world_size)
    element = HALF_BYTES if size.half_precision_engine else FP32_BYTES
    parameters = element * size.parameters
    gradients = element * size.trainable
    optimizer = (OPTIMIZER_STATE_BYTES + (FP32_BYTES if size.half_precision_engine else 0)) * size.trainable
    return (
        parameters / (shards if stage >= 3 else 1)
        + gradients / (shards if stage >= 2 else 1)
        + optimizer / (shards if stage >= 1 else 1)
    )


@dataclass(frozen=True)
class StageChoice:
    stage: int
    reason: str  # one line for the plan output
    spare_bytes: Optional[float]  # the least room left on any rank at that stage (None: no rank's memory is known)


def readable_bytes(value: float) -> str:
    """``value`` bytes in the largest binary unit that keeps it at or above 1 (``12.2 KiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def shared_free_bytes(free: Sequence[Optional[float]], devices: Sequence[tuple]) -> list[Optional[float]]:
    """Each rank's part of its device's free memory: ranks that name the same device (``devices[r]``, e.g. (host,
    "cpu") or (host, "cuda", index)) share it equally."""
    counts: dict[tuple, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    return [None if f is None else f / counts[d] for f, d in zip(free, devices)]


def choose_stage(
    size: ModelSize,
    world_size: int,
    free_bytes: Sequence[Optional[float]],
    activation_bytes: Optional[Sequence[float]],
    allowed: Sequence[int] = STAGES,
    training: bool = True,
) -> StageChoice:
    """The lowest of ``allowed`` stages at which every rank's model state plus activations fit in ``MEMORY_HEADROOM``
    of its ``free_bytes`` (its share, see :func:`shared_free_bytes`; None: unknown, taken to fit).

    ``activation_bytes``: each rank's activations at its planned micro-batch, or None when nothing measured them
    (then the state must fit in ``UNPROFILED_ACTIVATION_SHARE`` of the room). ``training`` False (validate, test,
    predict): only the parameters are held. When no allowed stage fits, the highest, with a reason that says so.
    """
    if not training:
        size = ModelSize(size.parameters, 0, size.half_precision_engine)
    what = "the model, its gradients and optimizer state" if training else "the model"
    counted = " per rank, counting Adam's state" if training else " per rank"
    known = [(r, free) for r, free in enumerate(free_bytes) if free is not None]
    if not known:
        stage = allowed[0]
        return StageChoice(stage, f"ZeRO stage {stage} (auto): no rank's free memory is known", None)
    first_misfit: Optional[str] = None
    for stage in allowed:
        state = model_state_bytes(size, stage, world_size)
        spare, misfit = None, None
        for rank, free in known:
            room = MEMORY_HEADROOM * free
            if activation_bytes is None:
                need, limit = state, UNPROFILED_ACTIVATION_SHARE * room
            else:
                need, limit = state + activation_bytes[rank], room
            left = limit - need
            spare = left if spare is None else min(spare, left)
            if left < 0 and misfit is None:
                misfit = (
                    f"at ZeRO stage {stage} rank {rank} would need {readable_bytes(need)} of its"
                    f" {readable_bytes(limit)}"
                    f" ({readable_bytes(free)} free x {MEMORY_HEADROOM:g}"
                    + (
                        f" x {UNPROFILED_ACTIVATION_SHARE:g} kept from unmeasured activations)"
                        if activation_bytes is None
                        else ")"
                    )
                )
        if misfit is None:
            assert spare is not None  # (some rank's memory is known)
            held = f"{what} ({readable_bytes(state)}{counted})"
            activations = "" if activation_bytes is None else " and each rank's micro-batch activations"
            lower = f"; {first_misfit}" if first_misfit else ""
            return StageChoice(
                stage,
                f"ZeRO stage {stage} (auto): {held}{activations} fit every device with {readable_bytes(spare)} to"
                f" spare{lower}",
                spare,
            )
        first_misfit = first_misfit or misfit
        last_misfit, last_spare = misfit, spare
    stage = allowed[-1]
    return StageChoice(
        stage,
        f"ZeRO stage {stage} (auto): {what} do not fit at any stage ({last_misfit}); the fit may run out of memory:"
        " give smaller micro-batches (`micro_steps`), offload (`offload_optimizer=True`), or more devices",
        last_spare,
    )


def resume_stage_mismatch(saved: Optional[int], stage: int, automatic: bool, path: str) -> Optional[str]:
    """Why a checkpoint saved at ZeRO ``saved`` cannot resume in a run at ``stage`` (None when it can): each stage lays
    out the optimizer state its own way, and loading another's would fail or lose it."""
    if saved is None or saved == stage:
        return None
    chosen = " (chosen automatically: the lowest that fits)" if automatic else ""
    return (
        f"Checkpoint {path} was saved at ZeRO stage {saved}, and this run is at ZeRO stage {stage}{chosen}: the"
        f" optimizer state is laid out by stage. Pass `stage={saved}` (or `strategy='hetero_stage_{saved}'`) to resume"
        " it."
    )
