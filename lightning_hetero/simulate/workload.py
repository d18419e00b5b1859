"""Simulate: the user's training step as the step model needs it, measured here on one batch of their data.

Each operator's FLOPs and bytes (:mod:`~lightning_hetero.measure.operators`, counted at two small batch sizes, so the
part that does not grow with the batch is apart: the GPU roofline), the trainable parameters and their shapes
(gradient and optimizer-state bytes), activation memory per sample (the distinct storages autograd saves for
backward), and this machine's CPU profile of the same step (the package's own profiler, at sizes capped so that it
fits a laptop), which calibrates what fraction of its peak a CPU reaches on this model.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from lightning.pytorch import LightningModule

from lightning_hetero.measure.cpu import cpu_facts
from lightning_hetero.measure.operators import OperatorCost, OperatorRecorder, launched_as_on_cuda, operator_lines
from lightning_hetero.measure.profiler import (
    DistinctSavedBytes,
    loss_of,
    preserved_training_state,
    profile_from_loader,
    training_step_in_isolation,
)
from lightning_hetero.precision.choice import FP32
from lightning_hetero.simulate.catalog import CPU_DEFAULTS, DeviceKind, cpu_kind

PROBE_SIZES = (8, 32)
# The two micro-batches whose operators are counted (FLOPs, bytes, saved activations): small, so that a model of
# GPU size counts in seconds here; every count is a line in the batch past the first samples.
COUNT_SIZES = (2, 4)
# What one timed step here may cost: about 3 s of this machine's CPU, 1 GiB of activations.
TIMING_FLOPS = 100e9
TIMING_BYTES = 2**30


@dataclass(frozen=True)
class Workload:
    """One training step of the user's model, in device-independent terms (fp32 training)."""

    name: str
    parameters: int  # trainable elements
    matrix_shapes: tuple[tuple[int, int], ...]  # trainable parameters viewed as matrices (PowerSGD's payload)
    flops_per_sample: float  # forward + backward
    fixed_flops: float
    operators_per_step: int  # aten operators one forward + backward runs (kernel launches on a GPU)
    activation_bytes_per_sample: float  # saved for backward, each storage once, as a GPU runs it (fused attention)
    # This machine's CPU measured on the same step: its cost model and the kind that describes it (its threads).
    here_fixed_seconds: float
    here_seconds_per_sample: float
    here_kind: DeviceKind
    # Each operator's FLOPs and bytes as lines in the batch (:mod:`~lightning_hetero.measure.operators`): the GPU
    # roofline. Empty: the step is its FLOPs alone (a workload described by hand).
    operators: tuple[OperatorCost, ...] = ()

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


@dataclass(frozen=True)
class _StepCounts:
    records: list  # OperatorRecorder.records
    saved_bytes: float  # distinct storages autograd saved for the backward

    @property
    def flops(self) -> float:
        return sum(record[0] for record in self.records)


def _step_counts(module: LightningModule, batch: Any) -> _StepCounts:
    recorder, saved = OperatorRecorder(), DistinctSavedBytes()
    # (the kernels a GPU launches: CPU's split dropout and attention counted as CUDA's fused ones)
    with contextlib.ExitStack() as counting:
        for context in (
            preserved_training_state(module, torch.device("cpu")),
            training_step_in_isolation(module),
            launched_as_on_cuda(),
            recorder,
        ):
            counting.enter_context(context)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            loss = loss_of(module.training_step(batch, 0))
        if loss is not None and loss.requires_grad:
            loss.backward()
    module.zero_grad(set_to_none=True)
    return _StepCounts(recorder.records, float(saved.bytes))


def timing_sizes(sizes: Sequence[int], flops_per_sample: float, bytes_per_sample: float) -> list[int]:
    """``sizes`` (the micro-batches a run would time) capped so that each timed step here stays within
    :data:`TIMING_FLOPS` and :data:`TIMING_BYTES`: planning a cluster of GPUs must not need their memory on this
    machine. Time and memory are linear in the batch past the first samples (the counts at :data:`COUNT_SIZES`
    extrapolate), so the line fitted at smaller sizes holds for the larger ones."""
    cap = min(TIMING_FLOPS / max(flops_per_sample, 1.0), TIMING_BYTES / max(bytes_per_sample, 1.0))
    capped = sorted({max(1, min(size, math.floor(cap))) for size in sizes})
    if len(capped) < 2:  # two sizes at least, or the line has no slope
        capped = sorted({1, 2} | set(capped))
    return capped


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


def measure_workload(module: LightningModule, loader: Any, name: str, sizes: Sequence[int] = PROBE_SIZES) -> Workload:
    """The :class:`Workload` of ``module``'s training step on samples of ``loader`` (on this CPU): its operators
    counted at :data:`COUNT_SIZES`, and this CPU's timing at the micro-batch ``sizes`` capped by :func:`timing_sizes`
    (the package profiles at ``probe_sizes(global batch, world size)``: give those, so that the line fitted here is
    the one a run fits, as far as this machine can time them)."""
    module = module.to("cpu")
    collate, dataset = loader.collate_fn, loader.dataset

    def batch_of(size: int) -> Any:
        return collate([dataset[i % len(dataset)] for i in range(size)])

    small, large = COUNT_SIZES
    module.train()
    counted_small, counted_large = _step_counts(module, batch_of(small)), _step_counts(module, batch_of(large))
    per_sample = (counted_large.flops - counted_small.flops) / (large - small)
    saved_per_sample = max(0.0, (counted_large.saved_bytes - counted_small.saved_bytes) / (large - small))
    profile = profile_from_loader(
        module, loader, timing_sizes(sizes, per_sample, saved_per_sample), torch.device("cpu")
    )
    trainable = [p for p in module.parameters() if p.requires_grad]
    return Workload(
        name=name,
        parameters=sum(p.numel() for p in trainable),
        matrix_shapes=tuple(
            (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1) for p in trainable
        ),
        flops_per_sample=max(per_sample, 1.0),
        fixed_flops=max(0.0, counted_small.flops - per_sample * small),
        operators_per_step=len(counted_small.records),
        activation_bytes_per_sample=saved_per_sample,
        here_fixed_seconds=profile.fixed_seconds,
        here_seconds_per_sample=profile.seconds_per_sample,
        here_kind=here_cpu_kind(),
        operators=operator_lines(counted_small.records, counted_large.records, small, large),
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
