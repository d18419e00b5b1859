"""Train: the whole model's gradient norm when each rank holds only part of the gradients, and clipping by it.

A pipeline's stages and memory-sized optimizer shards both leave each rank with some of the gradients: each adds up
the squares of the ones it counts (:func:`squared_norm`), one all-reduce of that number gives every rank the whole
model's norm, and every rank scales what it holds by the same factor (:func:`clip_to_norm`), as one process's
``torch.nn.utils.clip_grad_norm_`` on the whole model would.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def squared_norm(parameters: Iterable[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The sum of the squares of ``parameters``' gradients (those that have one), in float64 on ``device``: the
    all-reduce's operand."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for parameter in parameters:
        if parameter.grad is not None:
            squares += parameter.grad.detach().double().pow(2).sum()
    return squares


def clip_to_norm(parameters: Iterable[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale every gradient of ``parameters`` by one factor so that a whole model's gradient ``norm`` is at most
    ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` (``coefficient = max_norm / (norm + 1e-6)``, applied when
    under 1)."""
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for parameter in parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(coefficient)
