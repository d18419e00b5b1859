"""Simulate: the step model: each device's cost model and memory ceiling, the plan the package would make, the
gradient exchange over the cluster's links, and the step time they add up to. Pure functions of the cluster, the
workload and the options.

A step is ``max_r(compute_r) + exchange + max_r(optimizer_r) + loop overhead``: the ranks wait for the slowest
before the exchange and DeepSpeed steps the optimizer after it (no overlap is assumed); the loop overhead is 0 unless
a run calibrates it (:class:`LoopCalibration`). Compute is ``k_r * fixed_r + per_sample_r * n_r`` for ``n_r`` samples
in ``k_r`` micro-batches (:mod:`~lightning_hetero.plan.micro_steps`); memory is the model's state for the ZeRO stage,
DeepSpeed's gradient buffer and activations per sample, within the device's memory less ``PLANNING_HEADROOM`` and,
on a GPU, its CUDA context.

A GPU's compute is a roofline over the step's operators (:func:`gpu_seconds`), its achievable fractions fitted to
published training speeds (:mod:`.catalog`); ``benchmarks/planner_validation.py`` holds it against them.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from lightning_hetero.comm.compression import check_compression, check_exchange
from lightning_hetero.comm.topology import Topology, decide_hierarchical
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.operators import OperatorCost, roofline_seconds
from lightning_hetero.measure.profiler import MEMORY_HEADROOM
from lightning_hetero.plan.micro_steps import MicroStepPlan, micro_steps_for, plan_micro_steps
from lightning_hetero.plan import zero_stage as zero_stage_plan
from lightning_hetero.plan.split import split_by_weights
from lightning_hetero.plan.zero_stage import ModelSize, StageChoice
from lightning_hetero.precision.choice import FP32, unsupported
from lightning_hetero.simulate.catalog import (
    DEFAULT_BANDWIDTH_EFFICIENCY,
    MATMUL_EFFICIENCY,
    DeviceKind,
    kind_of_device_name,
)
from lightning_hetero.simulate.cluster import Cluster, Link
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
TOPK_BYTES_PER_ENTRY = 8  # an fp32 value and an int32 index


@dataclass(frozen=True)
class LoopCalibration:
    """A CPU step in the training loop against the same step measured alone here, from a run (:func:`calibrate_loop`).

    In the loop a CPU rank's compute is ``loop_compute_seconds + compute_factor * (what the step measured here
    predicts)`` at speed 1 (Lightning's step wrapper, DeepSpeed's gradient hooks and the loss weighting add a fixed
    part; data loading between steps and the other ranks on the machine cool the caches), stretched by a rank's
    slowness like the rest of its compute; an emulated slow rank stretches it too. ``step_overhead_seconds``: wall
    time per step beyond the slowest rank's compute, the exchange and the optimizer (Lightning's loop, DeepSpeed's
    step bookkeeping, the package's watch), added to every step. Without a calibration run the prediction is the
    step measured here, the exchange and the optimizer only.
    """

    loop_compute_seconds: float = 0.0
    compute_factor: float = 1.0
    step_overhead_seconds: float = 0.0


SETTLED_STEPS = 20  # the last steps of a run, over which a calibration takes its medians


def least_squares_slope(points: Sequence[tuple[int, float]]) -> float:
    """The slope of compute seconds against micro-batch size; 0 when every point has the same size."""
    mean_b, mean_c = statistics.fmean(b for b, _ in points), statistics.fmean(c for _, c in points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    return sum((b - mean_b) * (c - mean_c) for b, c in points) / spread if spread else 0.0


def calibrate_loop(
    report: dict, rank_files: Sequence[dict], workload: Workload, exchange_and_optimizer_seconds: float
) -> LoopCalibration:
    """The :class:`LoopCalibration` a CPU run on this machine shows: ``report`` its report.json, ``rank_files`` its
    rank_<r>.json, ``workload`` the same model measured here, ``exchange_and_optimizer_seconds`` what the step model
    predicts for that run. Ranks at unequal micro-batches (``batch_sizes=[...]``) give both the fixed part and the
    factor; at equal ones only the fixed part can be told (the factor stays 1)."""
    steps = report["steps"][-SETTLED_STEPS:]
    speeds = rank_files[0]["plan"].get("emulate_speeds") or [1.0] * len(rank_files)
    # Each rank's median compute at its median micro-batch, at speed 1.
    points = [
        (
            round(statistics.median(step["batch_sizes"][r] for step in steps)),
            statistics.median(step["compute_seconds"][r] for step in steps) * speeds[r],
        )
        for r in range(len(rank_files))
    ]
    slope = least_squares_slope(points)
    # Never faster than the step measured here; with the factor settled, the fixed part is what the points leave.
    factor = max(1.0, slope / workload.here_seconds_per_sample)
    intercept = statistics.fmean(c - factor * workload.here_seconds_per_sample * b for b, c in points)
    non_compute = [step["step_seconds"] - max(step["compute_seconds"]) for step in steps]
    return LoopCalibration(
        loop_compute_seconds=max(0.0, intercept - factor * workload.here_fixed_seconds),
        compute_factor=factor,
        step_overhead_seconds=max(0.0, statistics.median(non_compute) - exchange_and_optimizer_seconds),
    )


@dataclass(frozen=True)
class Options:
    global_batch_size: int
    zero_stage: Optional[int] = 0  # None: HeteroStrategy's default, the lowest stage that fits (automatic_stage)
    compression: Optional[str] = None
    compression_options: dict = field(default_factory=dict)
    hierarchical: object = "auto"
    calibrated_efficiency: dict = field(default_factory=dict)  # kind name -> fraction of peak measured in a run
    loop: LoopCalibration = field(default_factory=LoopCalibration)
    precision: Optional[str] = None  # every device's precision; None: what device_precision="auto" chooses


@dataclass(frozen=True)
class DevicePrediction:
    kind: str
    node: int
    precision: str
    samples: int  # per optimizer step
    micro_batch: int  # the largest of its micro-batches
    micro_steps: int
    memory_bytes: float  # predicted use at this micro-batch
    memory_capacity_bytes: float
    compute_seconds: float
    cost: CostModel


@dataclass(frozen=True)
class Exchange:
    seconds: float
    wire_bytes: float  # sent by all ranks together per step
    inter_node_bytes: float  # of which crossing between nodes
    hierarchical: bool
    reason: str


@dataclass(frozen=True)
class Prediction:
    devices: tuple[DevicePrediction, ...]
    compute_seconds: float
    exchange: Exchange
    optimizer_seconds: float
    overhead_seconds: float = 0.0  # the calibrated step overhead (LoopCalibration.step_overhead_seconds)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exchange.seconds + self.optimizer_seconds + self.overhead_seconds


# ------------------------------------------------------------------------------------------------------ per device


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


def automatic_stage(cluster: Cluster, workload: Workload, options: Options) -> StageChoice:
    """The stage HeteroStrategy chooses when none is named (:func:`~lightning_hetero.plan.zero_stage.choose_stage`):
    the lowest at which every device holds the model's state and its planned micro-batch's activations (those of the
    plan at ZeRO-3, which leaves the most room); ZeRO-0 alone with a compression hook."""
    choice = check_compression(options.compression, options.compression_options or None)
    allowed = (0,) if choice.needs_hook or options.hierarchical is True else zero_stage_plan.STAGES
    roomiest = predict(cluster, workload, replace(options, zero_stage=allowed[-1]))
    activations = [d.micro_batch * activation_bytes(workload, d.precision) for d in roomiest.devices]
    # (choose_stage fills MEMORY_HEADROOM of a run's free memory; the simulator's devices may fill their usable bytes)
    free = [usable_memory_bytes(d.kind) / MEMORY_HEADROOM for d in cluster.devices]
    return zero_stage_plan.choose_stage(ModelSize(workload.parameters, workload.parameters), len(cluster.devices),
                                        free, activations, allowed)  # fmt: skip


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
    state = rank_state_bytes(workload.parameters, options.zero_stage, world_size)
    room = usable_memory_bytes(kind) - state
    per_sample_bytes = activation_bytes(workload, precision)
    max_batch = None if per_sample_bytes <= 0 else math.floor(max(0.0, room) / per_sample_bytes)
    if max_batch is not None and max_batch < 1:
        raise ValueError(
            f"a {kind.name} cannot hold this model at ZeRO-{options.zero_stage}: its state takes"
            f" {state / 2**30:.1f} GiB of the {usable_memory_bytes(kind) / 2**30:.1f} GiB a plan may use of its"
            f" {kind.memory_bytes / 2**30:.1f} GiB. Use a higher `--stage`, or `--drop {kind.name}`."
        )
    return CostModel(fixed=fixed, per_sample=per_sample, max_batch=max_batch)


def optimizer_seconds(kind: DeviceKind, parameters: int, zero_stage: int, world_size: int) -> float:
    local = parameters / (world_size if zero_stage >= 1 else 1)
    return ADAM_STEP_BYTES * local / kind.memory_bandwidth


# -------------------------------------------------------------------------------------------------------- exchange


def gradient_payload_bytes(workload: Workload, compression: Optional[str], options: dict) -> float:
    """What one rank contributes to the gradient reduction per step."""
    if compression in ("fp16", "bf16"):
        return 2.0 * workload.parameters
    if compression == "powersgd":
        rank = options.get("matrix_approximation_rank", 1)
        return PARAMETER_BYTES * sum(
            rank * (rows + cols) if cols > 1 and rows > 1 else rows * cols for rows, cols in workload.matrix_shapes
        )
    return PARAMETER_BYTES * float(workload.parameters)


def _ring_seconds(world: int, volume: float, link: Link) -> float:
    """A ring all-reduce of ``volume`` bytes over ``world`` ranks whose slowest link is ``link``."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world * volume / link.bandwidth + 2 * (world - 1) * link.latency


def _slowest(links: Sequence[Link]) -> Link:
    return Link(min(link.bandwidth for link in links), max(link.latency for link in links))


def exchange(cluster: Cluster, workload: Workload, options: Options) -> Exchange:
    """The gradient exchange of one step: seconds, bytes sent, and whether it is hierarchical (and why)."""
    world = len(cluster.devices)
    choice = check_compression(options.compression, options.compression_options or None)
    check_exchange(choice, options.hierarchical, options.zero_stage)
    payload = gradient_payload_bytes(workload, choice.mode, dict(choice.options))
    topology = Topology(tuple(device.node for device in cluster.devices))
    if options.zero_stage > 0:
        hierarchical, reason = (
            False,
            f"off: ZeRO-{options.zero_stage} reduces inside DeepSpeed's optimizer (stage 0 only)",
        )
    else:
        hierarchical, reason = decide_hierarchical(options.hierarchical, topology)
        if hierarchical:  # the package's reason lists every rank of every node: too long for a cluster
            reason = f"{reason.split(':')[0]}: {topology.num_nodes} nodes, one payload per node crosses between them"
    ranks_per_node = Counter(device.node for device in cluster.devices)
    nodes = sorted(ranks_per_node)
    used_links = [cluster.node_links[node] for node in nodes if ranks_per_node[node] > 1]
    if len(nodes) > 1:
        used_links.append(cluster.inter_node)
    if world <= 1:
        return Exchange(0.0, 0.0, 0.0, False, "one rank: nothing to exchange")
    if choice.mode == "topk":
        entries = choice.options.get("ratio", 0.01) * workload.parameters
        volume = (world - 1) * entries * TOPK_BYTES_PER_ENTRY  # an all-gather: every rank receives every other's
        link = _slowest(used_links)
        seconds = volume / link.bandwidth + 2 * (world - 1) * link.latency
        wire = world * volume
        return Exchange(seconds, wire, wire if len(nodes) > 1 else 0.0, False, reason)
    # ZeRO-1/2 reduce-scatter the gradients and all-gather the updated parameters (fp32); ZeRO-3 also gathers the
    # parameters for forward and backward: the same ring traffic as one all-reduce of the sum.
    extra = {0: 0.0, 1: PARAMETER_BYTES * workload.parameters, 2: PARAMETER_BYTES * workload.parameters}.get(
        options.zero_stage, 2 * PARAMETER_BYTES * workload.parameters
    )
    volume = payload if options.zero_stage == 0 else (payload + extra) / 2
    if hierarchical:
        seconds, wire, crossing = _hierarchical(cluster, ranks_per_node, volume)
        return Exchange(seconds, wire, crossing, True, reason)
    seconds = _ring_seconds(world, volume, _slowest(used_links))
    wire = 2 * (world - 1) * volume
    # The ring crosses between nodes once per node, each crossing carrying what every link of the ring carries.
    crossing = len(nodes) * 2 * (world - 1) / world * volume if len(nodes) > 1 else 0.0
    return Exchange(seconds, wire, crossing, False, reason)


def _hierarchical(cluster: Cluster, ranks_per_node: Counter, volume: float) -> tuple[float, float, float]:
    """Reduce inside each node to its leader, all-reduce between the leaders, broadcast back inside each node."""
    inside = max(
        (2 * volume / cluster.node_links[node].bandwidth + 2 * cluster.node_links[node].latency) if count > 1 else 0.0
        for node, count in ranks_per_node.items()
    )
    between = _ring_seconds(len(ranks_per_node), volume, cluster.inter_node)
    crossing = 2 * (len(ranks_per_node) - 1) * volume
    wire = crossing + sum(2 * (count - 1) * volume for count in ranks_per_node.values())
    return inside + between, wire, crossing


# ---------------------------------------------------------------------------------------------------------- a plan


def predict(cluster: Cluster, workload: Workload, options: Options, equal: bool = False) -> Prediction:
    """The plan the package would make (or the equal split, with DDP's common accumulation) and its step time."""
    if options.zero_stage is None:
        options = replace(options, zero_stage=automatic_stage(cluster, workload, options).stage)
    world = len(cluster.devices)
    # Devices of one entry share their kind object: one cost model each, so 10,000 devices cost a few entries.
    kinds = {id(device.kind): device.kind for device in cluster.devices}
    cost_of = {key: device_cost(kind, workload, options, world) for key, kind in kinds.items()}
    costs = [cost_of[id(device.kind)] for device in cluster.devices]
    plan = (
        equal_split(costs, options.global_batch_size) if equal else plan_micro_steps(costs, options.global_batch_size)
    )
    precisions = {key: precision_of(kind, options) for key, kind in kinds.items()}
    state = rank_state_bytes(workload.parameters, options.zero_stage, world)
    devices = tuple(
        DevicePrediction(
            kind=device.kind.name,
            node=device.node,
            precision=precisions[id(device.kind)],
            samples=n,
            micro_batch=b,
            micro_steps=k,
            memory_bytes=state + b * activation_bytes(workload, precisions[id(device.kind)]),
            memory_capacity_bytes=device.kind.memory_bytes,
            compute_seconds=seconds,
            cost=cost,
        )
        for device, cost, n, b, k, seconds in zip(
            cluster.devices, costs, plan.samples, plan.batch_sizes, plan.micro_steps, plan.predicted_times
        )
    )
    optimizer = max(optimizer_seconds(kind, workload.parameters, options.zero_stage, world) for kind in kinds.values())
    return Prediction(
        devices, plan.predicted_step_time, exchange(cluster, workload, options), optimizer,
        options.loop.step_overhead_seconds,
    )  # fmt: skip


def equal_split(costs: Sequence[CostModel], global_batch_size: int) -> MicroStepPlan:
    """DDP's split: the same samples on every rank, in the same number of micro-batches everywhere when one rank's
    memory needs more than one (``accumulate_grad_batches``)."""
    samples = split_by_weights(global_batch_size, [1.0] * len(costs))
    steps = max(micro_steps_for(c, n) for c, n in zip(costs, samples))
    times = tuple(steps * c.fixed + c.per_sample * n for c, n in zip(costs, samples))
    return MicroStepPlan(tuple(samples), (steps,) * len(costs), times)
