"""Plan: the pipeline's plan as printed at fit start: each stage's rank, blocks, time per micro-batch and memory.

Apart from the placement search (:mod:`.placement`), whose result it only reads: the wording can change
without touching the arithmetic that the brute-force tests pin down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning_hetero.pipeline.options import PipelineChoice
from lightning_hetero.pipeline.placement import StagePlacement


def describe_pipeline(
    placement: StagePlacement,
    names: Sequence[str],
    choice: PipelineChoice,
    replicas: int,
    micro_batches: int,
    micro_batch: int,
    measured: Optional[Sequence[Any]],
    memory_bytes: Optional[Sequence[Optional[int]]] = None,
    shares: Sequence[int] = (),
    pooled_memory: bool = False,
) -> str:
    """The plan as printed at fit start: each stage's rank, blocks, time per micro-batch and memory (``pooled_memory``:
    ``memory_bytes`` is the mean of each stage's ranks, which memory-sized optimizer shards fill)."""
    lines = [
        f"HeteroStrategy pipeline: {choice.stages} stages x {replicas} pipeline(s), {choice.schedule}, {micro_batches}"
        f" micro-batches of {micro_batch} samples per pipeline and step"
        + (f" (the pipelines' shares of the global batch: {list(shares)})" if shares and replicas > 1 else "")
    ]
    for stage in range(choice.stages):
        blocks = placement.blocks_of(stage)
        shown = " + ".join(
            f"{names[chunk[0]]}..{names[chunk[-1]]}" if len(chunk) > 1 else names[chunk[0]]
            for chunk in placement.chunks_of(stage)
        )
        line = f"  stage {stage} on rank {placement.ranks[stage]}: blocks {shown} ({len(blocks)})"
        if measured:
            line += f", {placement.stage_seconds[stage] * micro_batch * 1e3:.2f} ms per micro-batch"
        line += f", {placement.stage_bytes[stage] / 2**20:.1f} MiB"
        ceiling = memory_bytes[placement.ranks[stage]] if memory_bytes else None
        if ceiling is not None:
            line += f" of the {ceiling / 2**20:.1f} MiB " + (
                "its ranks may use on average" if pooled_memory else "it may use"
            )
        lines.append(line)
    if measured:
        predicted = placement.step_seconds(micro_batches, micro_batch)
        lines.append(
            f"  placed by measured speed and memory: balance {placement.balance:.2f} (1 = every stage as slow as the"
            f" slowest), predicted step {predicted * 1e3:.1f} ms"
        )
    else:
        lines.append("  boundaries as given (`boundaries`)")
    return "\n".join(lines)
