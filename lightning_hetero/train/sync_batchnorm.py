"""Train: ``Trainer(sync_batchnorm=True)`` on every backend, BatchNorm over the global batch with unequal micro-batches.

Without it each rank's BatchNorm normalizes over its own micro-batch: with a split of 3 and 13 samples, rank 0's
statistics come from 3 samples, and the update differs from one process on the global batch (0.80 in a trial). Torch's
``SyncBatchNorm`` computes them over every rank, weighted by each rank's count, but runs on CUDA tensors only; on a
gloo job (CPU ranks, or CUDA beside CPU) :class:`SampleWeightedSyncBatchNorm` does the same with one all-reduce of
each channel's sum, sum of squares and count in the forward, and one of the gradient's two sums in the backward, so
that the update and the running statistics are those of one process on the global batch.

With ``micro_steps`` each of a rank's forward passes exchanges statistics, so every rank must make as many (the
ranks' i-th micro-batches normalize together); :func:`~lightning_hetero.split.decisions.micro_steps.micro_steps_refusal`
says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed
from lightning.pytorch.plugins import LayerSync, TorchSyncBatchNorm
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

AllReduce = Callable[[Tensor], None]  # sums a tensor over the ranks, in place

# Below this many samples per micro-batch a BatchNorm's statistics are noisy enough to say so in the plan output.
SMALL_BATCHNORM_BATCH = 16


def _sum_over_ranks(tensor: Tensor) -> None:
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)


def _channel_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(values: Tensor, x: Tensor) -> Tensor:
    return values.reshape(1, -1, *([1] * (x.dim() - 2)))


def global_moments(x: Tensor, all_reduce: AllReduce) -> tuple[Tensor, Tensor, float]:
    """Each channel's mean and (biased) variance over every rank's samples, and their count: one all-reduce of the
    sums, in float64 so that the variance from the sum of squares keeps its digits."""
    channels = x.shape[1]
    dims = _channel_dims(x)
    wide = x.detach().double()
    count = torch.tensor([x.numel() / channels], dtype=torch.float64, device=x.device)
    packed = torch.cat([wide.sum(dims), (wide * wide).sum(dims), count])
    all_reduce(packed)
    total = float(packed[-1])
    mean = packed[:channels] / total
    variance = (packed[channels : 2 * channels] / total - mean * mean).clamp_min(0.0)
    return mean, variance, total


class _GlobalBatchNorm(torch.autograd.Function):
    """``(x - mean) * invstd * weight + bias`` with the mean and variance of the global batch; the backward's sums
    over the global batch too (each rank's gradient is then that of the sum of every rank's loss)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Optional[Tensor],
        bias: Optional[Tensor],
        mean: Tensor,
        invstd: Tensor,
        total: float,
        all_reduce: AllReduce,
    ) -> Tensor:
        normalized = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
        ctx.save_for_backward(normalized, weight, invstd)
        ctx.total, ctx.all_reduce = total, all_reduce
        ctx.has_bias = bias is not None
        output = normalized
        if weight is not None:
            output = output * _per_channel(weight, x)
        if bias is not None:
            output = output + _per_channel(bias, x)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Optional[Tensor], ...]:
        normalized, weight, invstd = ctx.saved_tensors
        dims = _channel_dims(grad_output)
        local_sum = grad_output.sum(dims, dtype=torch.float64)
        local_dot = (grad_output * normalized).sum(dims, dtype=torch.float64)
        packed = torch.cat([local_sum, local_dot])
        ctx.all_reduce(packed)
        channels = local_sum.numel()
        mean_grad = (packed[:channels] / ctx.total).to(grad_output.dtype)
        mean_dot = (packed[channels:] / ctx.total).to(grad_output.dtype)
        scale = invstd if weight is None else invstd * weight
        grad_input = _per_channel(scale, grad_output) * (
            grad_output - _per_channel(mean_grad, grad_output) - normalized * _per_channel(mean_dot, grad_output)
        )
        # The parameters' gradients are this rank's part; the gradient exchange adds the ranks' parts, as for any
        # other parameter.
        grad_weight = local_dot.to(weight.dtype) if weight is not None else None
        grad_bias = local_sum.to(grad_output.dtype) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


class SampleWeightedSyncBatchNorm(_BatchNorm):
    """A BatchNorm whose training-mode statistics are those of every rank's samples together (each rank weighs by its
    sample count); in eval mode, or without a process group of several ranks, a plain BatchNorm."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        all_reduce: AllReduce = _sum_over_ranks,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.all_reduce = all_reduce
        self.replaced: type = nn.BatchNorm1d  # the class it stands for (put back by HeteroSyncBatchNorm.revert)

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"{type(self).__name__} expects an input of 2 or more dimensions, got {input.dim()}")

    def _synchronized(self) -> bool:
        if self.all_reduce is not _sum_over_ranks:
            return True  # (tests reduce over their own ranks)
        return (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and (torch.distributed.get_world_size() > 1)
        )

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not (self.training and self._synchronized()):
            return super().forward(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as _BatchNorm computes it
                factor = 1.0 / float(self.num_batches_tracked)
        compute = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
        mean, variance, total = global_moments(compute, self.all_reduce)
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got input size {list(input.shape)} over every"
                " rank"
            )
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = variance * total / (total - 1)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(variance + self.eps).to(compute.dtype)
        output = _GlobalBatchNorm.apply(
            compute, self.weight, self.bias, mean.to(compute.dtype), invstd, total, self.all_reduce
        )
        # (as torch's batch_norm under autocast, a half-precision input gives a float32 output)
        return output


def convert_batchnorms(module: nn.Module, all_reduce: AllReduce = _sum_over_ranks) -> nn.Module:
    """Every BatchNorm in ``module`` replaced by a :class:`SampleWeightedSyncBatchNorm` holding the same parameters
    and buffers (the same tensors: an optimizer built before still updates them)."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SampleWeightedSyncBatchNorm):
        converted = SampleWeightedSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, all_reduce
        )
        converted.replaced = type(module)
        _take_tensors(converted, module)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_batchnorms(child, all_reduce))
    return converted


def _take_tensors(target: nn.Module, source: nn.Module) -> None:
    """``target`` (a BatchNorm of the other class) holds ``source``'s very tensors and mode: nothing is copied."""
    if source.affine:
        with torch.no_grad():
            target.weight = source.weight
            target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked
    target.training = source.training


def revert_batchnorms(module: nn.Module) -> nn.Module:
    """:func:`convert_batchnorms` undone: each layer back to its own class, with the same tensors."""
    reverted = module
    if isinstance(module, SampleWeightedSyncBatchNorm):
        reverted = module.replaced(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        _take_tensors(reverted, module)
    for name, child in module.named_children():
        reverted.add_module(name, revert_batchnorms(child))
    return reverted


class HeteroSyncBatchNorm(LayerSync):
    """Lightning's plug point for ``Trainer(sync_batchnorm=True)``, for process groups whose backend torch's
    ``SyncBatchNorm`` cannot use (gloo): the strategy puts it in place of Lightning's ``TorchSyncBatchNorm``."""

    def apply(self, model: nn.Module) -> nn.Module:
        return convert_batchnorms(model)

    def revert(self, model: nn.Module) -> nn.Module:
        return revert_batchnorms(model)


def layer_sync_for(layer_sync: Optional[LayerSync], backend: str) -> Optional[LayerSync]:
    """The layer sync to apply: Lightning's torch SyncBatchNorm where its collectives run (NCCL), ours elsewhere; a
    user's own LayerSync plugin as given."""
    if type(layer_sync) is TorchSyncBatchNorm and backend != "nccl":
        return HeteroSyncBatchNorm()
    return layer_sync


def with_layer_sync(layer_sync: Optional[LayerSync], model: nn.Module, fitting: bool) -> tuple[Any, nn.Module]:
    """`Trainer(sync_batchnorm=True)` applied for a fit (the layer sync and the model it returns), where
    DDPStrategy.setup applies it: after the profile (which must run the module's own BatchNorms: a SyncBatchNorm
    would communicate from each rank's probe, with different batch sizes), before DeepSpeed wraps the module."""
    if layer_sync is None or not fitting:
        return layer_sync, model
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
    layer_sync = layer_sync_for(layer_sync, backend)
    return layer_sync, layer_sync.apply(model)  # type: ignore[union-attr]


def has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(layer, _BatchNorm) for layer in module.modules())


def small_batchnorm_warning(micro_batches: list[int], module: nn.Module, synchronized: bool) -> Optional[str]:
    """What the plan output says when a BatchNorm will normalize over few samples on some rank and the statistics
    are not synchronized (None otherwise)."""
    if synchronized or len(micro_batches) < 2 or not has_batchnorm(module):
        return None
    smallest = min(micro_batches)
    if smallest >= SMALL_BATCHNORM_BATCH:
        return None
    rank = micro_batches.index(smallest)
    return (
        f"HeteroStrategy: the model has BatchNorm layers and rank {rank}'s micro-batch is {smallest} samples (below"
        f" {SMALL_BATCHNORM_BATCH}): each rank normalizes over its own micro-batch, so its statistics are noisy and"
        " the update differs from one process on the global batch. Pass `Trainer(sync_batchnorm=True)` to normalize"
        " over every rank's samples together."
    )
