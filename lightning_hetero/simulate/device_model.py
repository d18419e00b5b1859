"""Simulate: one device's part of the step model: its compute time (a roofline over the step's operators on a GPU,
the step measured here on a CPU), its memory (the model's state for the ZeRO stage, DeepSpeed's gradient buffer,
activations) and its optimizer step. Pure functions of a device kind, the workload and the options.

A GPU's achievable fractions are fitted to published training speeds (:mod:`.catalog`);
``benchmarks/planner_validation.py`` holds the model against those speeds. The plan over all devices is
:mod:`.predict`.
"""

from __future__ import annotations

import math
from typing import Optional

from lightning_hetero.configure import zero_stage as zero_stage_plan
from lightning_hetero.configure.zero_stage import ModelSize
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.operators import OperatorCost, roofline_seconds
from lightning_hetero.precision.choice import FP32, unsupported
from lightning_hetero.simulate.catalog import (
    DEFAULT_BANDWIDTH_EFFICIENCY,
    MATMUL_EFFICIENCY,
    DeviceKind,
    kind_of_device_name,
)
from lightning_hetero.simulate.cluster import Cluster
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload

KERNEL_LAUNCH_SECONDS = 6e-6  # per operator on a GPU: the launch overhead that bounds small models
# A 16-bit kernel moves half the bytes of its fp32 count.
HALF_PRECISION_BYTES = 0.5
# What mixed precision keeps of the fp32 activations counted here: 0.5 if every saved tensor were 16-bit; soft-max
# outputs, normalisation statistics and masks stay wider, and cuDNN's workspaces grow with the batch. Fitted by
# `benchmarks/planner_validation.py --fit`: the smallest share at which no calibration row's largest micro-batch
# exceeds the largest batch its published runs used (the H100's ResNet-50 at 1,280 decides it).
HALF_PRECISION_ACTIVATIONS = 0.69
# The CUDA context with cuBLAS's and cuDNN's workspaces: 300-500 MiB for the context on recent drivers and a few
# hundred MiB of workspaces once the first kernels ran (PyTorch's "CUDA semantics" notes on memory management).
GPU_CONTEXT_BYTES = 2**30
# DeepSpeed's gradient buffers, up to a bucket of fp32 elements: stage 0 flattens the gradients for its all-reduce in
# buckets of MEMORY_OPT_ALLREDUCE_SIZE (deepspeed/runtime/engine.py, 5e8); stages 1-3 reduce through a bucket of
# reduce_bucket_size (Lightning's DeepSpeedStrategy default, 2e8).
DEEPSPEED_BUCKET_ELEMENTS = {0: 5e8, 1: 2e8, 2: 2e8, 3: 2e8}
# What a plan leaves free on every device for the caching allocator's fragmentation: said in the output.
PLANNING_HEADROOM = 0.10
# Adam's step reads the gradient (4 bytes), reads and writes the parameter (8) and both moments (16), per parameter.
ADAM_STEP_BYTES = 28
PARAMETER_BYTES = 4  # the engine stays fp32 (device_precision autocasts inside each rank)


def efficiency_of(kind: DeviceKind, workload: Workload, options: Options) -> float:
    """A CPU's fraction of peak on this model: given inline, measured in a run, else reached here."""
    if kind.efficiency is not None:
        return kind.efficiency
    if kind.name in options.calibrated_efficiency:
        return options.calibrated_efficiency[kind.name]
    return workload.here_efficiency  # (a CPU: what this one reached on the model; a GPU never gets here)


def efficiency_from_profile(rank_file: dict, workload: Workload) -> Optional[tuple[str, float]]:
    """``(kind, fraction of peak)`` a run's ``rank_<r>.json`` shows for a catalog GPU on this workload, or None."""
    device, profile = rank_file.get("device") or {}, rank_file.get("profile")
    kind = kind_of_device_name(device.get("name", "")) if device.get("kind") == "cuda" else None
    if kind is None or not profile or not profile.get("seconds_per_sample"):
        return None
    rate = workload.flops_per_sample / profile["seconds_per_sample"]
    return kind.name, rate / kind.peak(rank_file.get("precision") or FP32)


def model_state_bytes(parameters: int, zero_stage: int, world_size: int) -> float:
    """Parameters, gradients and Adam's state on one rank for ZeRO ``zero_stage`` over ``world_size`` ranks (the
    engine stays fp32: device_precision autocasts inside each rank)."""
    return zero_stage_plan.model_state_bytes(ModelSize(parameters, parameters), zero_stage, world_size)


def activation_bytes(workload: Workload, precision: str) -> float:
    factor = 1.0 if precision == FP32 else HALF_PRECISION_ACTIVATIONS
    return workload.activation_bytes_per_sample * factor


def precision_of(kind: DeviceKind, options: Options) -> str:
    """The precision a device of ``kind`` trains in: ``options.precision`` for all, else ``"auto"``'s choice."""
    if options.precision is None:
        return kind.precision()
    problem = unsupported(options.precision, kind.facts())
    if problem:
        raise ValueError(f"`--precision {options.precision}` cannot run on a {kind.name}: {problem}")
    return options.precision


def gpu_seconds(kind: DeviceKind, workload: Workload, options: Options) -> tuple[float, float]:
    """``(fixed, per_sample)`` seconds of the step on a GPU of ``kind``: each operator at the roofline (matrix
    products at ``MATMUL_EFFICIENCY`` of the peak at the rank's precision, the rest bound by the kind's achievable
    memory bandwidth, bytes halved in 16-bit) plus a launch each; a fraction of peak measured in a run
    (``--profile``) or given inline (``efficiency``) replaces the roofline by that fraction of the peak."""
    precision = precision_of(kind, options)
    flat = kind.efficiency if kind.efficiency is not None else options.calibrated_efficiency.get(kind.name)
    if flat is not None:
        rate = kind.peak(precision) * flat * kind.speed
        fixed = workload.operators_per_step * KERNEL_LAUNCH_SECONDS / kind.speed + workload.fixed_flops / rate
        return fixed, workload.flops_per_sample / rate
    operators = workload.operators or (
        OperatorCost(workload.fixed_flops, workload.flops_per_sample, 0.0, 0.0, "matmul"),
    )
    bandwidth = kind.memory_bandwidth * (kind.bandwidth_efficiency or DEFAULT_BANDWIDTH_EFFICIENCY) * kind.speed
    fixed, per_sample = roofline_seconds(
        operators,
        flop_rate=kind.peak(precision) * MATMUL_EFFICIENCY * kind.speed,
        other_flop_rate=kind.peak(FP32) * MATMUL_EFFICIENCY * kind.speed,
        bandwidth=bandwidth,
        byte_scale=1.0 if precision == FP32 else HALF_PRECISION_BYTES,
        launch_seconds=0.0,
    )
    # (the operators launched, not the lines: a model whose two counted steps differed has one line per kind)
    return fixed + workload.operators_per_step * KERNEL_LAUNCH_SECONDS / kind.speed, per_sample


def cpu_seconds(kind: DeviceKind, workload: Workload, options: Options) -> tuple[float, float]:
    """``(fixed, per_sample)`` seconds on a CPU: the step measured here (its fixed part: Python and operator
    overheads), what the training loop makes of it (LoopCalibration), scaled by how much slower this CPU is."""
    precision = precision_of(kind, options)
    rate = kind.peak(precision) * efficiency_of(kind, workload, options) * kind.speed
    here_rate = workload.flops_per_sample / workload.here_seconds_per_sample
    loop = options.loop
    fixed = (loop.compute_factor * workload.here_fixed_seconds + loop.loop_compute_seconds) * here_rate / rate
    return fixed, workload.flops_per_sample / rate * loop.compute_factor


def deepspeed_buffer_bytes(parameters: int, zero_stage: int) -> float:
    """What DeepSpeed's gradient reduction buffer takes on every rank (:data:`DEEPSPEED_BUCKET_ELEMENTS`)."""
    return PARAMETER_BYTES * min(float(parameters), DEEPSPEED_BUCKET_ELEMENTS[zero_stage])


def rank_state_bytes(parameters: int, zero_stage: int, world_size: int) -> float:
    """What one rank holds before any activation: the model's state for the ZeRO stage and DeepSpeed's buffer."""
    return model_state_bytes(parameters, zero_stage, world_size) + deepspeed_buffer_bytes(parameters, zero_stage)


def device_seconds(kind: DeviceKind, workload: Workload, options: Options) -> tuple[float, float]:
    """``(fixed, per_sample)`` seconds of the step on a device of ``kind``: a CPU's or a GPU's model."""
    return (cpu_seconds if kind.type == "cpu" else gpu_seconds)(kind, workload, options)


def usable_memory_bytes(kind: DeviceKind) -> float:
    """What a plan may fill on a device of ``kind``: its memory less the headroom left for the allocator
    (:data:`PLANNING_HEADROOM`, stated in the output) and, on a GPU, the CUDA context and library workspaces."""
    context = GPU_CONTEXT_BYTES if kind.type == "cuda" else 0.0
    return kind.memory_bytes * (1 - PLANNING_HEADROOM) - context


def device_cost(kind: DeviceKind, workload: Workload, options: Options, world_size: int) -> CostModel:
    """The cost model and memory ceiling of one device of ``kind`` for this workload."""
    precision = precision_of(kind, options)
    fixed, per_sample = device_seconds(kind, workload, options)
    stage = options.zero_stage
    assert stage is not None  # (predict settles HeteroStrategy's automatic stage first)
    state = rank_state_bytes(workload.parameters, stage, world_size)
    room = usable_memory_bytes(kind) - state
    per_sample_bytes = activation_bytes(workload, precision)
    max_batch = None if per_sample_bytes <= 0 else math.floor(max(0.0, room) / per_sample_bytes)
    if max_batch is not None and max_batch < 1:
        raise ValueError(
            f"a {kind.name} cannot hold this model at ZeRO-{stage}: its state takes"
            f" {state / 2**30:.1f} GiB of the {usable_memory_bytes(kind) / 2**30:.1f} GiB a plan may use of its"
            f" {kind.memory_bytes / 2**30:.1f} GiB. Use a higher `--stage`, or `--drop {kind.name}`."
        )
    return CostModel(fixed=fixed, per_sample=per_sample, max_batch=max_batch)


def cluster_costs(cluster: Cluster, workload: Workload, options: Options) -> list[CostModel]:
    """Each device's cost model, in rank order, computed once per kind: devices of one entry share their kind object,
    so 10,000 devices cost a few entries."""
    kinds = {id(device.kind): device.kind for device in cluster.devices}
    cost_of = {key: device_cost(kind, workload, options, len(cluster.devices)) for key, kind in kinds.items()}
    return [cost_of[id(device.kind)] for device in cluster.devices]


def optimizer_seconds(kind: DeviceKind, parameters: int, zero_stage: int, world_size: int) -> float:
    local = parameters / (world_size if zero_stage >= 1 else 1)
    return ADAM_STEP_BYTES * local / kind.memory_bandwidth
