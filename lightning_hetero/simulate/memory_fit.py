"""`lightning-hetero plan`: the largest model a described cluster holds with DeepSpeed's even shards and with
memory-sized ones (``HeteroStrategy(stage=2, shards="memory")``, :mod:`lightning_hetero.split.optimizer_shards`).

Each device holds, beside its planned micro-batch's activations, the parameters and gradients (fp32, 4 bytes each per
parameter) and its share of Adam's state (8 bytes per parameter). With even shards over ``n`` ranks a rank holds
``4 + 4/n + 8/n`` bytes per parameter at ZeRO-2 (``4 + 4 + 8/n`` at ZeRO-1): the device with the least room left
after its activations decides. With memory-sized shards each rank holds the whole gradients during the backward
(8 bytes per parameter) and a share of the state in proportion to the room that leaves, so the model fits when the
rooms together hold the state and every device holds the model and its gradients: ``8 P <= min room`` and
``8 P (n + 1) <= sum of rooms``. On devices of equal memory that is what even ZeRO-1 holds, and less than ZeRO-2,
whose gradients are sharded during the backward; memory-sized shards win where the memories differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MODEL_BYTES = 8.0  # fp32 parameter and gradient, per parameter
STATE_BYTES = 8.0  # Adam's two fp32 moments, per parameter


def largest_even(rooms: Sequence[float], stage: int) -> float:
    """The most parameters every rank holds at ZeRO ``stage`` (1 or 2) with even shards (``rooms``: each rank's bytes
    left after its activations)."""
    n = len(rooms)
    per_parameter = 4.0 + (4.0 / n if stage >= 2 else 4.0) + STATE_BYTES / n
    return max(0.0, min(rooms) / per_parameter)


def largest_memory_sized(rooms: Sequence[float]) -> float:
    """The most parameters the ranks hold with memory-sized shards (each rank the model and its gradients, the state in
    proportion to what each has left)."""
    n = len(rooms)
    return max(0.0, min(min(rooms) / MODEL_BYTES, sum(rooms) / (MODEL_BYTES * (n + 1))))


def memory_fit(kinds: Sequence[str], rooms: Sequence[float]) -> dict[str, Any]:
    """The JSON's ``memory_fit``: the largest parameter count with even ZeRO-1 and ZeRO-2 shards and with memory-sized
    shards, and the device that limits the even ones."""
    smallest = min(range(len(rooms)), key=lambda r: rooms[r])
    return {
        "zero1_even_parameters": largest_even(rooms, 1),
        "zero2_even_parameters": largest_even(rooms, 2),
        "memory_sized_parameters": largest_memory_sized(rooms),
        "even_limited_by": kinds[smallest],
        "room_bytes": list(rooms),
    }


def describe(fit: dict[str, Any]) -> str:
    """The plan output's line."""
    even2, memory = fit["zero2_even_parameters"], fit["memory_sized_parameters"]
    gain = f" ({memory / even2:.2f}x ZeRO-2's)" if even2 > 0 else ""
    return (
        "largest model beside the planned activations (fp32, Adam): even ZeRO-1 shards"
        f" {_count(fit['zero1_even_parameters'])}, even ZeRO-2 {_count(even2)} (limited by the"
        f" {fit['even_limited_by']}), memory-sized shards (`stage=2, shards='memory'`) {_count(memory)}{gain}"
    )


def _count(parameters: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= size:
            return f"{parameters / size:.2f} {unit} parameters"
    return f"{parameters:.0f} parameters"
