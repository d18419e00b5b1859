"""Top-k sparsification with error feedback, as a DDP comm hook (torch's signature; no maintained library has one).

Every rank adds what it held back last time, sends its ``ceil(ratio * n)`` largest-magnitude entries (fp32 values
and int32 indices, one all-gather each) and keeps the rest for the next step.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

TOPK_DEFAULTS: dict[str, Any] = {"ratio": 0.01}


class TopKState:
    """Top-k's settings and error feedback (what was not sent yet, per bucket); picklable without its group."""

    __slots__ = ("process_group", "ratio", "error_dict")

    def __init__(self, process_group: Optional[Any], ratio: float = TOPK_DEFAULTS["ratio"]) -> None:
        self.process_group = process_group
        self.ratio = float(ratio)
        self.error_dict: dict[int, Tensor] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "error_dict": self.error_dict}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        self.ratio = state["ratio"]
        self.error_dict = state["error_dict"]


def topk_hook(state: TopKState, bucket: Any) -> torch.futures.Future[Tensor]:
    """Average the bucket over ``state.process_group`` from each rank's largest entries, with error feedback.

    Every rank adds what it held back last time, sends its ``ceil(ratio * n)`` largest-magnitude entries (fp32
    values and int32 indices, one all-gather each), and keeps the rest for the next step. The sum of the sparse
    contributions, divided by the group size, replaces the bucket.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    index = bucket.index()
    corrected = buffer.float() + state.error_dict[index] if index in state.error_dict else buffer.float()
    count = max(1, math.ceil(state.ratio * corrected.numel()))
    indices = corrected.abs().topk(count, sorted=False).indices
    values = corrected[indices]
    state.error_dict[index] = corrected.index_fill(0, indices, 0.0)
    index_dtype = torch.int32 if corrected.numel() < 2**31 else torch.int64
    all_values = values.new_empty(world_size * count)
    all_indices = torch.empty(world_size * count, dtype=index_dtype, device=values.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (the new name in torch 2.13)
    gather(all_values, values, group=group)
    gather(all_indices, indices.to(index_dtype), group=group)
    dense = torch.zeros_like(corrected).index_add_(0, all_indices.long(), all_values).div_(world_size)
    buffer.copy_(dense)
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
