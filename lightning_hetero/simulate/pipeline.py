"""Simulate: a pipeline on the described cluster (``lightning-hetero plan --pipeline-blocks NAME``).

The chain's blocks are measured here (:func:`lightning_hetero.pipeline.blocks.measure_blocks`: each block's share of
the step's time on this CPU, its parameters and the activations it keeps), each share turned into FLOPs of the
measured step, and each device's time for a block is those FLOPs at its rate, as the batch split's model has it
(:func:`lightning_hetero.simulate.device_model.device_cost`). The stages are placed as a run places them
(:func:`lightning_hetero.pipeline.placement.place_stages`, within each device's memory), the first pipeline on the first
``stages`` devices. The step: the schedule over the micro-batches (the slowest stage for each, the others while the
pipeline fills and drains) plus each boundary's activation and gradient over its node's link (the slower link between
nodes). Per-micro-batch overheads (the training step's Python path, each send's latency on a host) are not
modelled: on this machine's CPU ranks the measured schedule took about twice the prediction (README, "Planning a
cluster"). Pure: values in, values out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lightning_hetero.pipeline.placement import BlockCosts, place_stages
from lightning_hetero.simulate.cluster import Cluster
from lightning_hetero.simulate.device_model import device_seconds, usable_memory_bytes
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload


@dataclass(frozen=True)
class ChainShares:
    """What the chain's blocks are of the step measured here, per sample."""

    names: tuple[str, ...]
    time_shares: tuple[float, ...]  # each block's share of the step's time (forward + backward)
    before_share: float  # what precedes the chain (every stage runs it)
    after_share: float  # what follows it and the loss (the last stage)
    parameter_bytes: tuple[int, ...]  # each block's training state (with Adam's)
    outside_bytes: int
    activation_bytes: tuple[int, ...]  # per sample
    output_bytes: tuple[int, ...]  # each block's output per sample: what crosses a boundary after it


def predict_pipeline(
    cluster: Cluster,
    workload: Workload,
    chain: ChainShares,
    options: Options,
    stages: int,
    schedule: str = "1f1b",
    micro_batches: Optional[int] = None,
) -> dict[str, Any]:
    """The placement and step of a pipeline of ``stages`` stages on the cluster's devices (several pipelines side by
    side when there are more devices: each takes an equal share of the global batch)."""
    devices = cluster.devices
    if stages < 2 or len(devices) % stages:
        raise ValueError(
            f"`--pipeline-stages {stages}`: the cluster's {len(devices)} devices cannot form pipelines of {stages}"
            f" stages; give a number >= 2 that divides {len(devices)}."
        )
    replicas = len(devices) // stages
    batch = -(-options.global_batch_size // replicas)
    micro_batches = max(1, min(batch, micro_batches or 2 * stages))
    micro_batch = -(-batch // micro_batches)
    first = devices[:stages]
    seconds, before, after = [], [], []
    for device in first:
        per_sample = device_seconds(device.kind, workload, options)[1]
        seconds.append(tuple(per_sample * share for share in chain.time_shares))
        before.append(per_sample * chain.before_share)
        after.append(per_sample * chain.after_share)
    costs = BlockCosts(
        seconds=tuple(seconds),
        parameter_bytes=chain.parameter_bytes,
        activation_bytes=chain.activation_bytes,
        memory_bytes=tuple(int(usable_memory_bytes(d.kind)) for d in first),
        after_seconds=tuple(after),
        outside_bytes=chain.outside_bytes,
        before_seconds=tuple(before),
    )
    placement = place_stages(
        costs, stages, schedule, micro_batches, micro_batch, ranks=tuple(range(stages)), last_rank=0
    )
    compute = placement.step_seconds(micro_batches, micro_batch)
    transfer = 0.0
    for index, boundary in enumerate(placement.boundaries):  # an activation forward, a gradient back, per micro-batch
        sender, receiver = placement.ranks[index], placement.ranks[index + 1]
        link = (
            cluster.node_links[first[sender].node]
            if first[sender].node == first[receiver].node
            else (cluster.inter_node or cluster.node_links[0])
        )
        message = chain.output_bytes[boundary - 1] * micro_batch
        transfer += 2 * micro_batches * (message / link.bandwidth + link.latency)
    busy = micro_batches * placement.slowest_seconds * micro_batch
    return {
        "stages": [
            {
                "stage": s,
                "kind": first[rank].kind.name,
                "rank": rank,
                "blocks": [chain.names[b] for b in placement.blocks_of(s)],
                "compute_ms_per_micro_batch": 1e3 * placement.stage_seconds[s] * micro_batch,
                "memory_bytes": placement.stage_bytes[s],
                "memory_capacity_bytes": first[rank].kind.memory_bytes,
            }
            for s, rank in enumerate(placement.ranks)
        ],
        "replicas": replicas,
        "schedule": schedule,
        "micro_batches": micro_batches,
        "micro_batch": micro_batch,
        "step_ms": 1e3 * (compute + transfer),
        "transfer_ms": 1e3 * transfer,
        "bubble": max(0.0, 1.0 - busy / compute) if compute else 0.0,
        "balance": placement.balance,
    }


def describe_pipeline_prediction(result: dict[str, Any], data_parallel_ms: Optional[float], why_not: str) -> list[str]:
    lines = [
        f"pipeline: {len(result['stages'])} stages x {result['replicas']} pipeline(s), {result['schedule']},"
        f" {result['micro_batches']} micro-batches of {result['micro_batch']} samples"
    ]
    for stage in result["stages"]:
        blocks = stage["blocks"]
        shown = f"{blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else blocks[0]
        lines.append(
            f"  stage {stage['stage']} on device {stage['rank']} ({stage['kind']}): blocks {shown} ({len(blocks)}),"
            f" {stage['compute_ms_per_micro_batch']:.2f} ms per micro-batch, {stage['memory_bytes'] / 2**30:.2f} of"
            f" {stage['memory_capacity_bytes'] / 2**30:.0f} GiB"
        )
    line = (
        f"  step {result['step_ms']:.2f} ms (boundaries {result['transfer_ms']:.2f} ms), bubble"
        f" {result['bubble']:.0%}, balance {result['balance']:.2f}"
    )
    if data_parallel_ms is None:
        line += f"; data parallelism cannot train this ({why_not}): the pipeline can"
    else:
        ratio = data_parallel_ms / result["step_ms"]
        faster = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
        line += f"; the batch split's step {data_parallel_ms:.2f} ms: the pipeline is {faster}"
    lines.append(line)
    return lines


def chain_shares(module: Any, path: str, batch: Any, samples: int, device: Any) -> ChainShares:
    """:class:`ChainShares` of ``module``'s chain at ``path``, measured here on ``batch``."""
    import torch

    from lightning_hetero.measure.profiler import preserved_training_state, training_step_in_isolation
    from lightning_hetero.pipeline.blocks import check_chain_order, measure_blocks, training_bytes
    from lightning_hetero.pipeline.chain import block_of, find_chain

    chain, names = find_chain(module, path)
    blocks = [block_of(chain, name) for name in names]
    check_chain_order(module, blocks, names, path, batch, device)
    measured = measure_blocks(module, blocks, batch, samples, device)
    total = sum(measured.seconds) + measured.before_seconds + measured.after_seconds
    outputs: dict[int, int] = {}
    handles = [
        block.register_forward_hook(
            lambda _m, _a, out, index=index: outputs.__setitem__(index, out.numel() * out.element_size())
        )
        for index, block in enumerate(blocks)
    ]
    try:
        with preserved_training_state(module, device), training_step_in_isolation(module), torch.no_grad():
            module.training_step(batch, 0)
    finally:
        for handle in handles:
            handle.remove()
    return ChainShares(
        names=tuple(names),
        time_shares=tuple(s / total for s in measured.seconds),
        before_share=measured.before_seconds / total,
        after_share=measured.after_seconds / total,
        parameter_bytes=tuple(training_bytes(block) for block in blocks),
        outside_bytes=measured.outside_bytes,
        activation_bytes=measured.activation_bytes,
        output_bytes=tuple(-(-outputs.get(i, 0) // samples) for i in range(len(blocks))),
    )
