"""Simulate: the step model: the plan the package would make over the cluster's devices and the step time it adds up
to. Pure functions of the cluster, the workload and the options.

A step is ``max_r(compute_r) + exchange + max_r(optimizer_r) + loop overhead``: the ranks wait for the slowest
before the exchange and DeepSpeed steps the optimizer after it (no overlap is assumed); the loop overhead is 0 unless
a run calibrates it (:class:`~.step_options.LoopCalibration`). Compute is ``k_r * fixed_r + per_sample_r * n_r`` for
``n_r`` samples in ``k_r`` micro-batches (:mod:`~lightning_hetero.split.decisions.micro_steps`); memory is the model's
state for the ZeRO stage, DeepSpeed's gradient buffer and activations per sample, within the device's memory less
``PLANNING_HEADROOM`` (:mod:`.device_model`) and, on a GPU, its CUDA context.

Each device's cost model and memory ceiling is :mod:`.device_model` (a GPU's compute is a roofline over the step's
operators, :func:`~.device_model.gpu_seconds`, its achievable fractions fitted to published training speeds in
:mod:`.catalog`; ``benchmarks/planner_validation.py`` holds it against them); the exchange is
:mod:`.gradient_exchange`; the options are :mod:`.step_options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from lightning_hetero.comm.compression import check_compression
from lightning_hetero.configure import zero_stage as zero_stage_plan
from lightning_hetero.configure.zero_stage import ModelSize, StageChoice
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM
from lightning_hetero.simulate.cluster import Cluster
from lightning_hetero.simulate.device_model import (
    activation_bytes,
    cluster_costs,
    optimizer_seconds,
    precision_of,
    rank_state_bytes,
    usable_memory_bytes,
)
from lightning_hetero.simulate.gradient_exchange import Exchange, exchange
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload
from lightning_hetero.split.decisions.micro_steps import MicroStepPlan, micro_steps_for, plan_micro_steps
from lightning_hetero.split.decisions.split import split_by_weights


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
class Prediction:
    devices: tuple[DevicePrediction, ...]
    compute_seconds: float
    exchange: Exchange
    optimizer_seconds: float
    overhead_seconds: float = 0.0  # the calibrated step overhead (LoopCalibration.step_overhead_seconds)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.exchange.seconds + self.optimizer_seconds + self.overhead_seconds


def automatic_stage(cluster: Cluster, workload: Workload, options: Options) -> StageChoice:
    """The stage HeteroStrategy chooses when none is named
    (:func:`~lightning_hetero.configure.zero_stage.choose_stage`): the lowest at which every device holds the model's
    state and its planned micro-batch's activations (those of the plan at ZeRO-3, which leaves the most room); ZeRO-0
    alone with a compression hook."""
    choice = check_compression(options.compression, options.compression_options or None)
    allowed = (0,) if choice.needs_hook or options.hierarchical is True else zero_stage_plan.STAGES
    roomiest = predict(cluster, workload, replace(options, zero_stage=allowed[-1]))
    activations = [d.micro_batch * activation_bytes(workload, d.precision) for d in roomiest.devices]
    # (choose_stage fills MEMORY_HEADROOM of a run's free memory; the simulator's devices may fill their usable bytes)
    free = [usable_memory_bytes(d.kind) / MEMORY_HEADROOM for d in cluster.devices]
    return zero_stage_plan.choose_stage(
        ModelSize(workload.parameters, workload.parameters), len(cluster.devices), free, activations, allowed
    )


def predict(cluster: Cluster, workload: Workload, options: Options, equal: bool = False) -> Prediction:
    """The plan the package would make (or the equal split, with DDP's common accumulation) and its step time."""
    stage = options.zero_stage
    if stage is None:
        stage = automatic_stage(cluster, workload, options).stage
        options = replace(options, zero_stage=stage)
    world = len(cluster.devices)
    # Devices of one entry share their kind object: one precision each, as one cost model (cluster_costs).
    kinds = {id(device.kind): device.kind for device in cluster.devices}
    costs = cluster_costs(cluster, workload, options)
    plan = (
        equal_split(costs, options.global_batch_size) if equal else plan_micro_steps(costs, options.global_batch_size)
    )
    precisions = {key: precision_of(kind, options) for key, kind in kinds.items()}
    state = rank_state_bytes(workload.parameters, stage, world)
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
    optimizer = max(optimizer_seconds(kind, workload.parameters, stage, world) for kind in kinds.values())
    return Prediction(
        devices,
        plan.predicted_step_time,
        exchange(cluster, workload, options),
        optimizer,
        options.loop.step_overhead_seconds,
    )


def equal_split(costs: Sequence[CostModel], global_batch_size: int) -> MicroStepPlan:
    """DDP's split: the same samples on every rank, in the same number of micro-batches everywhere when one rank's
    memory needs more than one (``accumulate_grad_batches``)."""
    samples = split_by_weights(global_batch_size, [1.0] * len(costs))
    steps = max(micro_steps_for(c, n) for c, n in zip(costs, samples))
    times = tuple(steps * c.fixed + c.per_sample * n for c, n in zip(costs, samples))
    return MicroStepPlan(tuple(samples), (steps,) * len(costs), times)
