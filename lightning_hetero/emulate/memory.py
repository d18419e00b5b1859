"""Memory emulation: give identical devices the memory ceilings of smaller ones (a test and demo aid).

``LIGHTNING_HETERO_EMULATE_MEMORY=64,16`` says rank 0 holds at most 64 samples per micro-batch and rank 1 at most 16
(``-`` for a rank without a ceiling). The ceilings join what each rank's profile measured (the lower one wins), so the
planner sees a memory-bound device as it would see a GPU whose profile ran out of memory, and a split whose
micro-batch would not fit is refused before training, as a real device would fail. Memory itself is not limited: a
CPU has no per-process ceiling the package could set without affecting everything else on the machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

ENV_VAR = "LIGHTNING_HETERO_EMULATE_MEMORY"


def emulated_ceilings_from_environment() -> Optional[tuple[Optional[int], ...]]:
    """Each rank's emulated micro-batch ceiling in samples (None: no ceiling), or None when the variable is unset."""
    text = os.environ.get(ENV_VAR)
    if text is None or not text.strip():
        return None
    ceilings: list[Optional[int]] = []
    for part in text.split(","):
        part = part.strip()
        if part == "-":
            ceilings.append(None)
            continue
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"`{ENV_VAR}={text!r}`: {part!r} is not a micro-batch ceiling. Give each rank the most samples its"
                f" memory holds in one micro-batch, a whole number >= 1 (or - for no ceiling), e.g. `{ENV_VAR}=64,16`."
            )
        ceilings.append(value)
    return tuple(ceilings)


def check_ceilings(ceilings: Optional[Sequence[Optional[int]]], world_size: int) -> None:
    if ceilings is not None and len(ceilings) != world_size:
        raise ValueError(
            f"`{ENV_VAR}={os.environ.get(ENV_VAR)!r}` has {len(ceilings)} entries but the job has {world_size} ranks."
            " Give one ceiling per rank (- for none)."
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
