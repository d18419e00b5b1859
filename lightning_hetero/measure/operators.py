"""Measure: what each operator of a training step computes and moves, the inputs of a roofline device model.

A GPU kernel takes about ``max(FLOPs / achievable FLOP rate, bytes / achievable memory bandwidth)`` plus a launch
cost. Counting FLOPs alone (``FlopCounterMode``) made every GPU a fraction of its tensor-core peak, and published
training speeds follow memory bandwidth far more closely: a convolution network's batch norms, activations and
additions move many bytes and compute almost nothing. So each operator is recorded as the FLOPs torch's own formulas
give it (``torch.utils.flop_counter.flop_registry``: matrix products, convolutions, attention) and the bytes of its
inputs and outputs, the way a kernel reads and writes them. Views (``view``, ``t``, ``expand``...) launch no kernel
and move nothing: they are left out. Measured at two batch sizes, every operator becomes a line in the batch
(:class:`OperatorCost`), which :func:`roofline_seconds` evaluates for any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from lightning_hetero.runtime.internal_access import patched
from lightning_hetero.runtime.torch_internals import TORCH_STATE

DROPOUT, ATTENTION = (
    next(i for i in TORCH_STATE if (i.module, i.name) == ("torch.nn.functional", name))
    for name in ("dropout", "scaled_dot_product_attention")
)


@dataclass(frozen=True)
class OperatorCost:
    """One operator of a step as a line in the micro-batch ``b``: ``flops + flops_per_sample * b`` FLOPs and
    ``bytes + bytes_per_sample * b`` bytes read and written (in the precision it was measured in)."""

    flops: float
    flops_per_sample: float
    bytes: float
    bytes_per_sample: float
    kind: str = "other"  # "matmul" (runs on tensor cores in 16-bit) or "other"


def _dropout_as_on_cuda(input, p=0.5, training=True, inplace=False):
    if not training or p <= 0 or p >= 1:
        return input
    return torch.native_dropout(input, p, True)[0]


def _attention_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    if kwargs.get("enable_gqa") or query.dim() != 4 or query.shape[-1] != value.shape[-1]:
        return _PLAIN_ATTENTION(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )[0]
    except (RuntimeError, TypeError):  # (a mask or dtype CPU's flash kernel refuses: counted as the step runs it)
        return _PLAIN_ATTENTION(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)


_PLAIN_ATTENTION = functional.scaled_dot_product_attention


@contextlib.contextmanager
def launched_as_on_cuda() -> Iterator[None]:
    """Runs the functions whose CPU kernels are split where CUDA runs one fused kernel as CUDA runs them, so that the
    operators counted are the kernels a GPU launches: dropout (on CPU a float mask made by ``bernoulli_`` and
    ``div_``, then ``mul``; on CUDA one ``native_dropout`` that writes a bool mask) and scaled-dot-product attention
    (on CPU with dropout the attention matrix is written, soft-maxed and dropped out; CUDA's flash and
    memory-efficient kernels never write it: counted as CPU's flash kernel without the dropout, whose bytes and FLOPs
    are CUDA's). ``torch.nn.functional``'s two functions are replaced for the duration, which reaches ``nn.Dropout``
    and ``nn.MultiheadAttention`` (they look them up there at each call). For counting only: values differ."""
    with patched(DROPOUT, _dropout_as_on_cuda), patched(ATTENTION, _attention_as_on_cuda):
        yield


# CPU kernels counted with the FLOP formula of the CUDA kernel they stand for (launched_as_on_cuda).
_FORMULA_OF = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        torch.ops.aten._scaled_dot_product_flash_attention_backward
    ),
}


def _tensors(values: Any) -> list[torch.Tensor]:
    return [value for value in tree_flatten(values)[0] if isinstance(value, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(tensor)


def _writes_an_argument(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return any(argument.alias_info is not None and argument.alias_info.is_write for argument in schema.arguments)


_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided}


class OperatorRecorder(TorchDispatchMode):
    """Records ``(flops, bytes, kind)`` of every kernel-launching operator run under it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[float, float, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        input_storages = {_storage_key(t) for t in inputs}
        # A view shares its input's storage and writes nothing: no kernel. An in-place operator shares it too, but
        # its schema says it writes an argument: a kernel that reads and writes it.
        if outputs and not _writes_an_argument(func) and all(_storage_key(t) in input_storages for t in outputs):
            return out
        if not outputs and not _writes_an_argument(func):
            return out  # (queries such as ``is_nonzero`` on a CPU tensor, ``_local_scalar_dense``)
        if func._overloadpacket in _ALLOCATIONS:
            return out  # memory handed out, no kernel
        formula = flop_registry.get(_FORMULA_OF.get(func._overloadpacket, func._overloadpacket))
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        moved = sum(t.numel() * t.element_size() for t in inputs if t.device.type != "meta")
        moved += sum(t.numel() * t.element_size() for t in outputs)
        self.records.append((flops, float(moved), "matmul" if formula is not None else "other"))
        return out


def operator_lines(
    small: Sequence[tuple[float, float, str]],
    large: Sequence[tuple[float, float, str]],
    small_batch: int,
    large_batch: int,
) -> tuple[OperatorCost, ...]:
    """Each operator as a line in the batch, from its records at two micro-batch sizes. When the two steps ran
    different operators (a model whose control flow depends on the batch), the step's totals per kind make the
    lines instead: the roofline then applies to the sums, a coarser but still bounded estimate."""
    span = large_batch - small_batch

    def line(a: tuple[float, float, str], b: tuple[float, float, str]) -> OperatorCost:
        flops_slope, bytes_slope = (b[0] - a[0]) / span, (b[1] - a[1]) / span
        return OperatorCost(
            flops=max(0.0, a[0] - flops_slope * small_batch),
            flops_per_sample=max(0.0, flops_slope),
            bytes=max(0.0, a[1] - bytes_slope * small_batch),
            bytes_per_sample=max(0.0, bytes_slope),
            kind=a[2],
        )

    if len(small) == len(large) and all(a[2] == b[2] for a, b in zip(small, large)):
        return tuple(line(a, b) for a, b in zip(small, large))

    def totals(records: Sequence[tuple[float, float, str]], kind: str) -> tuple[float, float, str]:
        chosen = [r for r in records if r[2] == kind]
        return sum(r[0] for r in chosen), sum(r[1] for r in chosen), kind

    return tuple(line(totals(small, kind), totals(large, kind)) for kind in ("matmul", "other"))


def roofline_seconds(
    operators: Sequence[OperatorCost],
    flop_rate: float,
    other_flop_rate: float,
    bandwidth: float,
    byte_scale: float,
    launch_seconds: float,
) -> tuple[float, float]:
    """``(fixed, per_sample)`` seconds of a step on a device: each operator at the roofline, ``max(FLOPs / rate,
    bytes * byte_scale / bandwidth)``, its batch-independent and per-sample parts bounded apart (the max of sums is
    at most the sum of maxes, so the line is never below the roofline and meets it for large batches), plus a launch
    per operator. ``flop_rate`` is the rate of matrix products (tensor cores in 16-bit), ``other_flop_rate`` the rest;
    ``byte_scale`` turns the measured fp32 bytes into the precision the device trains in."""
    fixed = per_sample = 0.0
    for op in operators:
        rate = flop_rate if op.kind == "matmul" else other_flop_rate
        fixed += max(op.flops / rate, op.bytes * byte_scale / bandwidth)
        per_sample += max(op.flops_per_sample / rate, op.bytes_per_sample * byte_scale / bandwidth)
    return fixed + launch_seconds * len(operators), per_sample
