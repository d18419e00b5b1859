"""Memory emulation: give identical devices the memory ceilings of smaller ones (a test and demo aid).

``LIGHTNING_HETERO_EMULATE_MEMORY=64,16`` says rank 0 holds at most 64 samples per micro-batch and rank 1 at most 16
(``-`` for a rank without a ceiling). The ceilings join what each rank's profile measured (the lower one wins), so the
planner sees a memory-bound device as it would see a GPU whose profile ran out of memory, and a split whose
micro-batch would not fit is refused before training, as a real device would fail. Memory itself is not limited: a
CPU has no per-process ceiling the package could set without affecting everything else on the machine.

An entry with a unit is a ceiling in bytes instead (``LIGHTNING_HETERO_EMULATE_MEMORY=-,2MiB``: rank 1's device holds 2
MiB): it caps what the rank's device facts report free, so the ZeRO stage is chosen for it, a data-parallel job whose
model state does not fit it at any stage is refused before training, and a pipeline's stages are placed within it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from lightning_hetero.runtime.checks import check_one_per_rank

ENV_VAR = "LIGHTNING_HETERO_EMULATE_MEMORY"
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _entries() -> Optional[list[str]]:
    text = os.environ.get(ENV_VAR)
    if text is None or not text.strip():
        return None
    return [part.strip() for part in text.split(",")]


def _byte_entry(part: str) -> Optional[int]:
    """``part`` in bytes when it has a unit (``2MiB``), else None."""
    for unit, factor in UNITS.items():
        if part.endswith(unit):
            try:
                value = float(part[: -len(unit)])
            except ValueError:
                value = 0.0
            if not value > 0:
                raise ValueError(
                    f"`{ENV_VAR}={os.environ.get(ENV_VAR)!r}`: {part!r} is not a memory size. Give a positive number"
                    f" with a unit ({', '.join(UNITS)}), e.g. `2MiB`, or a micro-batch ceiling in samples."
                )
            return int(value * factor)
    return None


def emulated_byte_ceilings_from_environment() -> Optional[tuple[Optional[int], ...]]:
    """Each rank's emulated device memory in bytes (None: none given for it), or None when no entry has a unit."""
    parts = _entries()
    if parts is None:
        return None
    ceilings = tuple(_byte_entry(part) for part in parts)
    return ceilings if any(c is not None for c in ceilings) else None


def capped_free_bytes(free: Sequence[Optional[float]], ceilings: Optional[Sequence[Optional[int]]]) -> list:
    """Each rank's free memory with its emulated ceiling in bytes applied (the lower of the two)."""
    if ceilings is None:
        return list(free)
    return [_lower(f, c) for f, c in zip(free, ceilings)]


def _lower(free: Optional[float], ceiling: Optional[int]) -> Optional[float]:
    if ceiling is None:
        return free
    return ceiling if free is None else min(free, ceiling)


def emulated_ceilings_from_environment() -> Optional[tuple[Optional[int], ...]]:
    """Each rank's emulated micro-batch ceiling in samples (None: no ceiling), or None when the variable is unset."""
    text = os.environ.get(ENV_VAR)
    parts = _entries()
    if parts is None:
        return None
    ceilings: list[Optional[int]] = []
    for part in parts:
        if part == "-" or _byte_entry(part) is not None:  # (a size in bytes: emulated_byte_ceilings_from_environment)
            ceilings.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"`{ENV_VAR}={text!r}`: {part!r} is not a micro-batch ceiling. Give each rank the most samples its"
                f" memory holds in one micro-batch, a whole number >= 1 (or - for no ceiling), e.g. `{ENV_VAR}=64,16`,"
                " or the memory its device holds, with a unit (`2MiB`)."
            )
        ceilings.append(value)
    return tuple(ceilings)


def check_ceilings(ceilings: Optional[Sequence[Optional[int]]], world_size: int) -> None:
    if ceilings is not None:
        check_one_per_rank(
            f"`{ENV_VAR}={os.environ.get(ENV_VAR)!r}`",
            len(ceilings),
            world_size,
            "Give one ceiling per rank (- for none).",
        )


def lower_ceiling(measured: Optional[int], emulated: Optional[int]) -> Optional[int]:
    """The ceiling a rank plans with: the lower of what it measured and what is emulated."""
    if emulated is None:
        return measured
    return emulated if measured is None else min(measured, emulated)


def describe_overflow(
    samples: Sequence[int],
    micro_steps: Sequence[int],
    ceilings: Optional[Sequence[Optional[int]]],
    local_training: bool = False,
) -> Optional[str]:
    """What is wrong when some rank's micro-batch exceeds its emulated ceiling (None when every one fits).
    ``local_training``: the micro-batches are local SGD's inner steps, whose size the user sets."""
    if ceilings is None:
        return None
    for rank, (n, k, ceiling) in enumerate(zip(samples, micro_steps, ceilings)):
        micro_batch = -(-n // k)
        if ceiling is not None and micro_batch > ceiling:
            return (
                f"Rank {rank}'s micro-batch of {micro_batch} samples ({n} in {k} micro-step{'s' * (k > 1)}) does not"
                f" fit in its memory ({ENV_VAR} gives it at most {ceiling}): an out-of-memory error on a real device."
                + (
                    f" Give it micro-batches of at most {ceiling} samples (`batch_sizes=[...]`, or the loader's"
                    " `batch_size`)."
                    if local_training
                    else f" Give rank {rank} at least {-(-n // ceiling)} micro-steps (`micro_steps=[...]`), a smaller"
                    " share, or leave the split automatic."
                )
            )
    return None
