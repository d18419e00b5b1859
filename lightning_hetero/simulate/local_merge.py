"""Simulate: local SGD / DiLoCo over the cluster (``lightning-hetero plan --sync diloco``): each device's inner steps,
the training step, and what the merges cost on the link, with streaming fragments, overlap and quantization.

A training step is the slowest rank's inner steps: rank r takes ``inner_steps[r]`` micro-batches of ``b_r`` samples,
each with its own optimizer step (ZeRO-0), planned as the package plans them
(:func:`~lightning_hetero.local.inner_steps.plan_inner_steps`). One fragment merges every ``sync_every / fragments``
steps: an all-reduce of its values (fp32, fp16 or bf16), or gathers of every rank's int8 / int4 blocks and of their
scales (:mod:`~.comm.quantize`), over the slowest link the ranks use, after an all-reduce of the sample counts (latency
only). Without overlap every rank waits for the merge; with ``overlap_steps`` k the exchange runs behind the next k
training steps, and a rank waits only for what outlasts them. The counts are always waited for; the merge of every
fragment at an epoch's end (waited for, once an epoch) is not charged. The loop calibration's overhead (``--calibrate``)
is added to each training step, as to every-step training's. Pure functions of the cluster, the workload and the
settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_hetero.comm import quantize
from lightning_hetero.local.inner_steps import plan_inner_steps
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.simulate.cluster import Cluster
from lightning_hetero.simulate.device_model import PARAMETER_BYTES, cluster_costs, optimizer_seconds
from lightning_hetero.simulate.gradient_exchange import ring_seconds, slowest_used_link
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload

WIRE_BYTES_PER_VALUE = {None: PARAMETER_BYTES, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class LocalPlan:
    """Local SGD / DiLoCo as the package would run it over a cluster (one entry per rank in rank order)."""

    inner_steps: tuple[int, ...]
    micro_batches: tuple[int, ...]
    inner_step_seconds: tuple[float, ...]  # one micro-batch's compute and its optimizer step
    compute_seconds: float  # a training step: the slowest rank's inner steps
    merge_bytes_per_rank: float  # what one rank sends in one merge (one fragment)
    merge_seconds: float  # one merge's exchange on the link, counts included
    merge_inter_node_bytes: float  # what one merge moves between nodes, all ranks together
    steps_between_merges: int  # sync_every / fragments
    link_wait_seconds: float  # per training step: what the merges leave the ranks waiting, after any overlap

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.link_wait_seconds

    @property
    def samples_per_step(self) -> int:
        return sum(k * b for k, b in zip(self.inner_steps, self.micro_batches))


def merge_payload_bytes(values: int, compression: Optional[str]) -> float:
    """What one rank sends for ``values`` values of its pseudo-gradient: their wire dtype, or int8 / int4 blocks with
    an fp32 scale each."""
    bits = quantize.BITS.get(compression or "")
    if bits is not None:
        return float(quantize.wire_bytes(values, bits))
    return float(WIRE_BYTES_PER_VALUE[compression] * values)


def merge_exchange(cluster: Cluster, payload: float, quantized: bool) -> tuple[float, float, float]:
    """One merge of ``payload`` bytes a rank: the seconds of the sample counts' all-reduce (a few bytes: its
    latency), the seconds of the exchange (a ring all-reduce, or a ring all-gather when quantized: each rank receives
    every other rank's payload), and the bytes between nodes."""
    world = len(cluster.devices)
    if world <= 1:
        return 0.0, 0.0, 0.0
    link = slowest_used_link(cluster)
    counts = ring_seconds(world, 0.0, link)
    if quantized:  # (two gathers, the blocks and then their scales: a latency each per ring step)
        seconds = (world - 1) * (payload / link.bandwidth + 2 * link.latency)
        per_link = (world - 1) * payload  # what each link of the ring carries
    else:
        seconds = ring_seconds(world, payload, link)
        per_link = 2 * (world - 1) / world * payload
    nodes = len({device.node for device in cluster.devices})
    return counts, seconds, nodes * per_link if nodes > 1 else 0.0


def plan_local(
    cluster: Cluster,
    workload: Workload,
    costs: Sequence[CostModel],
    optimizer_seconds: Sequence[float],
    micro_batches: Sequence[int],
    sync_every: int,
    fragments: int = 1,
    overlap_steps: Optional[int] = None,
    compression: Optional[str] = None,
    inner_steps: Optional[Sequence[int]] = None,
) -> LocalPlan:
    """The local training the package would run: ``costs`` and ``optimizer_seconds`` per rank (ZeRO-0), each rank's
    micro-batch, the merge's settings (as ``HeteroStrategy`` takes them) and the inner steps (None: planned)."""
    steps = tuple(inner_steps) if inner_steps is not None else plan_inner_steps(costs, micro_batches)
    inner = tuple(cost.time(b) + optimizer for cost, b, optimizer in zip(costs, micro_batches, optimizer_seconds))
    compute = max(k * seconds for k, seconds in zip(steps, inner))
    values = -(-workload.parameters // fragments)  # (the largest fragment: equal to a value)
    payload = merge_payload_bytes(values, compression)
    counts, exchange, crossing = merge_exchange(cluster, payload, compression in quantize.BITS)
    between = sync_every // fragments
    hidden = 0.0 if overlap_steps is None else min(exchange, overlap_steps * compute)  # (the counts are waited for)
    return LocalPlan(
        steps,
        tuple(micro_batches),
        inner,
        compute,
        payload,
        counts + exchange,
        crossing,
        between,
        (counts + exchange - hidden) / between,
    )


def evaluate_local(
    cluster: Cluster, workload: Workload, options: Options, merge: dict[str, Any], every_step_ms: float
) -> dict[str, Any]:
    """:func:`plan_local` over ``cluster`` with the settings of :func:`~.command.local_settings`, as ``plan --json``'s
    keys (``every_step_ms``: the every-step plan's step, for the speedup); each rank's micro-batch is the global batch
    over the ranks (the loader's batch, as HeteroStrategy's), each device's cost model at ZeRO-0."""
    world = len(cluster.devices)
    costs = cluster_costs(cluster, workload, replace(options, zero_stage=0, compression=None))  # (local: ZeRO-0)
    micro = [max(1, options.global_batch_size // world)] * world
    for device, cost in zip(cluster.devices, costs):
        if cost.max_batch is not None and cost.max_batch < micro[0]:
            raise ValueError(
                f"a {device.kind.name} holds at most {cost.max_batch} samples a micro-batch at ZeRO-0, and local"
                f" training gives each rank {micro[0]} (the global batch over the ranks). Use a smaller"
                " `--global-batch-size`."
            )
    optimizer = [optimizer_seconds(device.kind, workload.parameters, 0, world) for device in cluster.devices]
    plan = plan_local(
        cluster,
        workload,
        costs,
        optimizer,
        micro,
        merge["sync_every"],
        merge["fragments"],
        merge["overlap_steps"],
        merge["compression"],
        merge["inner_steps"],
    )
    overhead = options.loop.step_overhead_seconds
    rate = plan.samples_per_step / (plan.step_seconds + overhead)
    return {
        **{key: merge[key] for key in ("sync", "sync_every", "fragments", "overlap_steps", "compression")},
        "devices": [
            {"kind": device.kind.name, "inner_steps": k, "micro_batch": b, "inner_step_ms": seconds * 1e3}
            for device, k, b, seconds in zip(
                cluster.devices, plan.inner_steps, plan.micro_batches, plan.inner_step_seconds
            )
        ],
        "training_step_ms": {
            "total": (plan.step_seconds + overhead) * 1e3,
            "compute": plan.compute_seconds * 1e3,
            "link_wait": plan.link_wait_seconds * 1e3,
            "overhead": overhead * 1e3,
        },
        "link_wait_over_compute": plan.link_wait_seconds / plan.compute_seconds,
        "merge": {
            "bytes_per_rank": plan.merge_bytes_per_rank,
            "ms": plan.merge_seconds * 1e3,
            "inter_node_bytes": plan.merge_inter_node_bytes,
            "every_steps": plan.steps_between_merges,
        },
        "samples_per_second": rate,
        "speedup_over_every_step": rate / (options.global_batch_size / (every_step_ms / 1e3)),
    }
