"""Train: the corrections unequal batches need, so that the update and the logged metrics are DDP's.

DeepSpeed averages the ranks' gradients equally, so each rank's loss is weighted by its share of the global batch
(:func:`~lightning_hetero.split.decisions.split.loss_weight`): ``b_r * W / B`` for a mean, 1 for a sum, ``n_r * W / N``
in tokens for a token mean. A ``self.log(..., sync_dist=True)`` mean inside a step is weighted by each rank's samples
the same way. The counts come from each batch as the loader hands it over, so a short last batch is weighted right.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.runtime.checks import token_count
from lightning_hetero.split.decisions.split import SplitPlan, loss_weight


class LossWeights:
    """This rank's sample counts of the batch in hand, and the weights derived from them."""

    def __init__(self, loss_reduction: str) -> None:
        self.loss_reduction = loss_reduction
        self.rank, self.world_size = 0, 1
        self._sum_over_ranks: Callable[[float], float] = lambda value: value
        self._reduce_in_place: Callable[..., None] = lambda tensor, op, group: None
        # (local, global) sample counts of the batch the loop is working on, told by the loader as it hands it over.
        self._batch_samples: Optional[tuple[int, int]] = None
        self._eval_batch_samples: Optional[tuple[int, int]] = None  # (those of a map-style evaluation loader)
        self._step_tokens: Optional[float] = None  # loss_reduction="token_mean": this rank's count in this batch
        self._micro_batch_samples: Optional[int] = None  # the micro-batch in hand, when the batch is taken in several
        # Local SGD / DiLoCo: each rank minimises its own loss between synchronizations (no exchange to weight).
        self.local = False
        self._sync_weight: Optional[int] = None

    def join(
        self,
        rank: int,
        world_size: int,
        sum_over_ranks: Callable[[float], float],
        reduce_in_place: Callable[..., None] = lambda tensor, op, group: None,
    ) -> None:
        """The job this rank belongs to (known at setup); ``reduce_in_place(tensor, op, group)``: the job's
        :meth:`~lightning_hetero.runtime.collectives.Collectives.reduce_in_place` (the default: one rank's own)."""
        self.rank, self.world_size, self._sum_over_ranks = rank, world_size, sum_over_ranks
        self._reduce_in_place = reduce_in_place

    def training_batch(self, local_samples: int, global_samples: int) -> None:
        self._batch_samples = (local_samples, global_samples)

    def evaluation_batch(self, local_samples: int, global_samples: int) -> None:
        self._eval_batch_samples = (local_samples, global_samples)

    def forget_evaluation_batch(self) -> None:
        self._eval_batch_samples = None

    def step_started(self) -> None:
        self._step_tokens = None
        self._micro_batch_samples = None

    def micro_batch(self, samples: int) -> None:
        """The rank takes its batch in micro-batches (``micro_steps``): the next loss is over ``samples`` of them, and
        weighs ``samples * W / B`` (a mean), so the micro-batches' losses add up to the batch's weighted loss."""
        self._micro_batch_samples = samples
        if self._sync_weight is not None:
            self._sync_weight = samples

    def batch_samples(self) -> Optional[int]:
        """This rank's samples in the batch in hand (None before the loader told)."""
        return self._batch_samples[0] if self._batch_samples is not None else None

    def step_returned(self, output: Any) -> None:
        if self.loss_reduction == "token_mean":
            self._step_tokens = token_count(output)  # the weight needs it before backward

    def current(self, plan: Optional[SplitPlan]) -> float:
        """The loss weight of the batch being trained on (the last global batch may be shorter); one all-reduce of
        the ranks' token counts per batch for a token mean."""
        if self.local:
            return 1.0
        if self.loss_reduction == "token_mean":
            if self._step_tokens is None:
                raise RuntimeError("HeteroStrategy: the token count of this batch is unknown (no training_step ran).")
            total = self._sum_over_ranks(self._step_tokens)
            return loss_weight(self._step_tokens, total, self.world_size, self.loss_reduction)
        if self._batch_samples is not None:
            local, global_samples = self._batch_samples
            if self._micro_batch_samples is not None:
                local = self._micro_batch_samples
            return loss_weight(local, global_samples, self.world_size, self.loss_reduction)
        if plan is not None:
            return plan.loss_weight(self.rank, self.loss_reduction)
        return 1.0

    @contextlib.contextmanager
    def weighted_sync(self, evaluating: bool = False) -> Iterator[None]:
        """Inside: a ``sync_dist`` mean is weighted by this rank's samples (:meth:`reduce`)."""
        # An evaluation batch's counts come from its map-style loader as it is handed over; a stream's evaluation
        # batches are read ahead and carry none: their metrics are a plain mean over ranks, as under DDP.
        samples = self._eval_batch_samples if evaluating else self._batch_samples
        self._sync_weight = samples[0] if samples is not None else None
        try:
            yield
        finally:
            self._sync_weight = None

    def reduce(self, tensor: Any, group: Optional[Any], reduce_op: Any, plain_reduce: Callable[..., Any]) -> Any:
        """Inside a step, a "mean" is weighted by each rank's sample count (``self.log(..., sync_dist=True)``).

        Lightning's epoch-level mean divides summed values by summed batch sizes, both averaged over ranks (that part
        only needs the integer average done in floating point); the per-step value is a plain mean over ranks,
        which unequal batches would bias. Outside a step ``plain_reduce`` (the parent's) applies.
        """
        is_mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if is_mean and isinstance(tensor, Tensor) and not tensor.is_floating_point():
            # Lightning averages the epoch's summed batch sizes (an integer tensor) across ranks; with unequal
            # shards an integer mean truncates (11 samples on 3 ranks -> 3) and biases every epoch metric. Averaged
            # in torch's default dtype, as DDP's true division does, so the metric divided by it keeps its dtype.
            tensor = tensor.to(torch.get_default_dtype())
        weighted = is_mean and self._sync_weight is not None and isinstance(tensor, Tensor) and self.world_size > 1
        if not weighted:
            return plain_reduce(tensor, group=group, reduce_op=reduce_op)
        assert self._sync_weight is not None  # (weighted)
        weight = float(self._sync_weight)
        packed = torch.cat(
            [tensor.detach().double().reshape(-1) * weight, tensor.new_tensor([weight], dtype=torch.float64)]
        )
        self._reduce_in_place(packed, "sum", group)
        return (packed[:-1] / packed[-1]).reshape(tensor.shape).to(tensor.dtype)
