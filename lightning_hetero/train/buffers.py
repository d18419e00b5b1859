"""Train: the module's buffers are the same on every rank, as under DDP.

Buffers (BatchNorm's running statistics, a counter a model keeps) are not gradients: DeepSpeed leaves each rank's
copy to its own forward passes, so they drift apart (measured: BatchNorm running statistics 0.6 apart after a few
steps of unequal micro-batches, a sample counter 100 apart), and whatever rank 0 saves in a checkpoint is one rank's
view. DDP's answer (``broadcast_buffers=True``, its default) is to broadcast rank 0's buffers before every training
forward; :class:`BufferSync` does the same, at the strategy's ``training_step``. So the running statistics are rank
0's, updated from rank 0's micro-batch (with unequal splits that is rank 0's share of the batch, not ``B / W``);
``Trainer(sync_batchnorm=True)`` (CUDA) computes them over the whole batch instead.

One broadcast per buffer dtype and device per training step (the buffers of a dtype travel as one flat tensor);
nothing for a model without buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class BufferSync:
    """Before each training forward, every rank takes rank 0's buffers (``broadcast(flat, src=0)``)."""

    def __init__(self, buffers: Iterable[Tensor], broadcast: Callable[[Tensor], None]) -> None:
        groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for buffer in buffers:
            if buffer.numel():
                groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        self._groups = list(groups.values())
        self._broadcast = broadcast

    def __bool__(self) -> bool:
        return bool(self._groups)

    def sync(self) -> None:
        with torch.no_grad():
            for buffers in self._groups:
                flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
                self._broadcast(flat)
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()
