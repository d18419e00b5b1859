"""Simulate: the gradient exchange of one step over the cluster's links: a ring all-reduce (or a top-k all-gather),
hierarchical across nodes when the package would make it so, with the bytes each compression sends.

Kept apart from the per-device model (:mod:`.device_model`): it depends on the whole cluster's placement and links,
not on one device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.comm.compression import check_compression, check_exchange
from lightning_hetero.comm.error_bound import POWERSGD_MIN_COMPRESSION_RATE, powersgd_payload
from lightning_hetero.comm.topology import Topology, decide_hierarchical
from lightning_hetero.simulate.cluster import Cluster, Link
from lightning_hetero.simulate.device_model import PARAMETER_BYTES
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload

TOPK_BYTES_PER_ENTRY = 8  # an fp32 value and an int32 index


@dataclass(frozen=True)
class Exchange:
    seconds: float
    wire_bytes: float  # sent by all ranks together per step
    inter_node_bytes: float  # of which crossing between nodes
    hierarchical: bool
    reason: str


def gradient_payload_bytes(workload: Workload, compression: Optional[str], options: dict) -> float:
    """What one rank contributes to the gradient reduction per step."""
    if compression in ("fp16", "bf16"):
        return 2.0 * workload.parameters
    if compression == "powersgd":  # at its starting rank (an error bound may raise it during the run)
        rank = options.get("matrix_approximation_rank", 1)
        rate = options.get("min_compression_rate", POWERSGD_MIN_COMPRESSION_RATE)
        return PARAMETER_BYTES * float(powersgd_payload(workload.matrix_shapes, rank, rate))
    return PARAMETER_BYTES * float(workload.parameters)


def ring_seconds(world: int, volume: float, link: Link) -> float:
    """A ring all-reduce of ``volume`` bytes over ``world`` ranks whose slowest link is ``link``."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world * volume / link.bandwidth + 2 * (world - 1) * link.latency


def _slowest(links: Sequence[Link]) -> Link:
    return Link(min(link.bandwidth for link in links), max(link.latency for link in links))


def slowest_used_link(cluster: Cluster) -> Link:
    """The slowest link a flat collective over every device of ``cluster`` crosses: each node's own where it holds
    several ranks, and the one between nodes when there are several (a cluster of several devices)."""
    ranks_per_node = Counter(device.node for device in cluster.devices)
    used_links = [cluster.node_links[node] for node in sorted(ranks_per_node) if ranks_per_node[node] > 1]
    if len(ranks_per_node) > 1:
        assert cluster.inter_node is not None  # (a cluster of several nodes has one)
        used_links.append(cluster.inter_node)
    return _slowest(used_links)


def exchange(cluster: Cluster, workload: Workload, options: Options) -> Exchange:
    """The gradient exchange of one step: seconds, bytes sent, and whether it is hierarchical (and why)."""
    world = len(cluster.devices)
    choice = check_compression(options.compression, options.compression_options or None)
    stage = options.zero_stage
    assert stage is not None  # (predict settles HeteroStrategy's automatic stage first)
    check_exchange(choice, options.hierarchical, stage)
    payload = gradient_payload_bytes(workload, choice.mode, dict(choice.options))
    topology = Topology(tuple(device.node for device in cluster.devices))
    if stage > 0:
        hierarchical, reason = (
            False,
            f"off: ZeRO-{stage} reduces inside DeepSpeed's optimizer (stage 0 only)",
        )
    else:
        hierarchical, reason = decide_hierarchical(options.hierarchical, topology)
        if hierarchical:  # the package's reason lists every rank of every node: too long for a cluster
            reason = f"{reason.split(':')[0]}: {topology.num_nodes} nodes, one payload per node crosses between them"
    ranks_per_node = Counter(device.node for device in cluster.devices)
    nodes = sorted(ranks_per_node)
    if world <= 1:
        return Exchange(0.0, 0.0, 0.0, False, "one rank: nothing to exchange")
    link = slowest_used_link(cluster)
    if choice.mode == "topk":
        entries = choice.options.get("ratio", 0.01) * workload.parameters
        volume = (world - 1) * entries * TOPK_BYTES_PER_ENTRY  # an all-gather: every rank receives every other's
        seconds = volume / link.bandwidth + 2 * (world - 1) * link.latency
        wire = world * volume
        return Exchange(seconds, wire, wire if len(nodes) > 1 else 0.0, False, reason)
    # ZeRO-1/2 reduce-scatter the gradients and all-gather the updated parameters (fp32); ZeRO-3 also gathers the
    # parameters for forward and backward: the same ring traffic as one all-reduce of the sum.
    extra = {0: 0.0, 1: PARAMETER_BYTES * workload.parameters, 2: PARAMETER_BYTES * workload.parameters}.get(
        stage, 2 * PARAMETER_BYTES * workload.parameters
    )
    volume = payload if stage == 0 else (payload + extra) / 2
    if hierarchical:
        seconds, wire, crossing = _hierarchical(cluster, ranks_per_node, volume)
        return Exchange(seconds, wire, crossing, True, reason)
    seconds = ring_seconds(world, volume, link)
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
    between = 0.0
    if len(ranks_per_node) > 1:
        assert cluster.inter_node is not None  # (a cluster of several nodes has one)
        between = ring_seconds(len(ranks_per_node), volume, cluster.inter_node)
    crossing = 2 * (len(ranks_per_node) - 1) * volume
    wire = crossing + sum(2 * (count - 1) * volume for count in ranks_per_node.values())
    return inside + between, wire, crossing
