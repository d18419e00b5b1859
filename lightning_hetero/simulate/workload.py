"""Simulate: the user's training step as the step model needs it, measured here on one batch of their data.

FLOPs per sample of forward + backward (``torch.utils.flop_counter.FlopCounterMode`` at two batch sizes, so the part
that does not grow with the batch is apart), the number of operators a step launches (a fixed cost per kernel on a
GPU), the trainable parameters and their shapes (gradient and optimizer-state bytes), activation memory per sample
(what autograd saves for backward), and this machine's CPU profile of the same step (the package's own profiler),
which calibrates what fraction of its peak a CPU reaches on this model.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_hetero.measure.cpu import cpu_facts
from lightning_hetero.precision.choice import FP32
from lightning_hetero.measure.profiler import (
    loss_of,
    preserved_training_state,
    profile_from_loader,
    training_step_in_isolation,
)
from lightning_hetero.simulate.catalog import CPU_DEFAULTS, DeviceKind, cpu_kind

PROBE_SIZES = (8, 32)


@dataclass(frozen=True)
class Workload:
    """One training step of the user's model, in device-independent terms (fp32 training)."""

    name: str
    parameters: int  # trainable elements
    matrix_shapes: tuple[tuple[int, int], ...]  # trainable parameters viewed as matrices (PowerSGD's payload)
    flops_per_sample: float  # forward + backward
    fixed_flops: float
    operators_per_step: int  # aten operators one forward + backward runs (kernel launches on a GPU)
    activation_bytes_per_sample: float
    # This machine's CPU measured on the same step: its cost model and the kind that describes it (its threads).
    here_fixed_seconds: float
    here_seconds_per_sample: float
    here_kind: DeviceKind

    @property
    def here_efficiency(self) -> float:
        """The fraction of this CPU's fp32 peak the step reached here."""
        return self.flops_per_sample / self.here_seconds_per_sample / self.here_kind.peak_flops[FP32]


def load_object(spec: str, what: str) -> Any:
    """``module:attribute`` imported (the working directory on the path, as ``python -m`` has it)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"`{what} {spec}` must be MODULE:CLASS, e.g. examples.spirals:SpiralClassifier")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"`{what} {spec}`: {error}") from None


class _OperatorCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _step_counts(module: torch.nn.Module, batch: Any) -> tuple[float, int]:
    counter = FlopCounterMode(display=False)
    operators = _OperatorCounter()
    with preserved_training_state(module, torch.device("cpu")), training_step_in_isolation(module), counter, operators:
        loss = loss_of(module.training_step(batch, 0))
        if loss is not None and loss.requires_grad:
            loss.backward()
    module.zero_grad(set_to_none=True)
    return float(counter.get_total_flops()), operators.count


def here_cpu_kind() -> DeviceKind:
    """This machine's CPU as the step model describes it: torch's threads as cores, its ISA and clock."""
    features = set(cpu_facts().isa_features)
    # The fastest instruction set torch's kernels use on this CPU, by the feature flag that enables it.
    isa = next(
        (
            isa
            for flag, isa in (("amx_bf16", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"))
            if flag in features
        ),
        "avx2",
    )
    frequency = psutil.cpu_freq()
    clocks_mhz = (frequency.max, frequency.current) if frequency else ()
    ghz = next((mhz / 1e3 for mhz in clocks_mhz if mhz), CPU_DEFAULTS["ghz"])
    return cpu_kind(max(1, torch.get_num_threads()), isa, round(ghz, 2))


def measure_workload(module: torch.nn.Module, loader: Any, name: str, sizes: Sequence[int] = PROBE_SIZES) -> Workload:
    """The :class:`Workload` of ``module``'s training step on samples of ``loader`` (on this CPU), profiled at the
    micro-batch ``sizes`` (the package profiles at ``probe_sizes(global batch, world size)``: give those, so that
    the line fitted here is the one a run fits)."""
    module = module.to("cpu")
    profile = profile_from_loader(module, loader, sizes, torch.device("cpu"))
    collate, dataset = loader.collate_fn, loader.dataset

    def batch_of(size: int) -> Any:
        return collate([dataset[i % len(dataset)] for i in range(size)])

    small, large = PROBE_SIZES
    module.train()
    flops_small, operators = _step_counts(module, batch_of(small))
    flops_large, _ = _step_counts(module, batch_of(large))
    per_sample = (flops_large - flops_small) / (large - small)
    trainable = [p for p in module.parameters() if p.requires_grad]
    return Workload(
        name=name,
        parameters=sum(p.numel() for p in trainable),
        matrix_shapes=tuple(
            (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1) for p in trainable
        ),
        flops_per_sample=max(per_sample, 1.0),
        fixed_flops=max(0.0, flops_small - per_sample * small),
        operators_per_step=operators,
        activation_bytes_per_sample=profile.bytes_per_sample or 0.0,
        here_fixed_seconds=profile.fixed_seconds,
        here_seconds_per_sample=profile.seconds_per_sample,
        here_kind=here_cpu_kind(),
    )


def training_loader(model: Any, datamodule: Any) -> Any:
    """The training DataLoader: the datamodule's, else the model's own."""
    source = datamodule if datamodule is not None else model
    if datamodule is not None:
        datamodule.setup("fit")
    try:
        return source.train_dataloader()
    except Exception as error:  # Lightning raises MisconfigurationException when the hook is not overridden
        raise ValueError(
            f"{type(source).__name__}.train_dataloader() gave no loader ({error}); give `--data MODULE:CLASS`, a"
            " LightningDataModule whose train_dataloader() gives the training samples"
        ) from None
