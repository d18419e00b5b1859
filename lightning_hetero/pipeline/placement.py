"""Plan: which contiguous blocks of the model's chain each pipeline stage holds, and which rank runs each stage.

A pipeline of ``S`` stages runs a chain of ``B`` blocks (``HeteroStrategy(pipeline=...)``,
:mod:`lightning_hetero.pipeline.stage`): stage ``s`` holds blocks ``boundaries[s-1] .. boundaries[s]-1``. Every
micro-batch passes through every stage, so in the steady state the pipeline moves at the pace of its slowest stage;
the placement minimizes that stage's time per sample, within every device's memory:

    minimize  max over s of  sum_{b in stage s} seconds[rank_s][b]  (+ what comes before the chain, which every stage
              runs, and what comes after it on the last)
    subject to  sum_{b in stage s} (parameter_bytes[b] + in_flight_s * activation_bytes[b]) + fixed_bytes
                <= memory_bytes[rank_s]

Exact: a dynamic program over (stage, first block) for each order of the ranks (every order for up to
:data:`MAX_ORDERS_SEARCHED` ranks, as a device's place in the chain changes which stage its memory must hold), tested
against brute force. Pure functions (values in, values out; no process group, no clock).

The same search places the stages again in training (:func:`replan_stages`, on the times scaled by what each rank
measured), and prices a placement on other ranks (:func:`pipeline_shares`), so those stay here beside it. The
``pipeline`` argument's checks are in :mod:`lightning_hetero.pipeline.options`, the plan as printed in
:mod:`lightning_hetero.pipeline.description`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from lightning_hetero.split.decisions.split import split_by_weights

MAX_ORDERS_SEARCHED = 6  # 720 orders at most; beyond, the ranks keep their order (fast devices first is not better)


@dataclass(frozen=True)
class BlockCosts:
    """What each rank measured of each block, and what the chain costs apart from its blocks.

    ``seconds[r][b]``: forward + backward of block ``b`` on rank ``r``'s device, per sample. ``parameter_bytes[b]``:
    the block's parameters, gradients and optimizer state. ``activation_bytes[b]``: what one sample's forward through
    it keeps for the backward. ``memory_bytes[r]``: what rank ``r`` may use (None: no ceiling). The modules outside
    the chain (:mod:`lightning_hetero.pipeline.stage`), per sample on each rank: ``before_seconds``, what precedes the
    chain, which every stage runs; ``after_seconds``, what follows it and the loss, the last stage's;
    ``outside_bytes``, their parameters, which every stage holds.
    """

    seconds: tuple[tuple[float, ...], ...]
    parameter_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    memory_bytes: tuple[Optional[int], ...]
    after_seconds: tuple[float, ...] = ()
    outside_bytes: int = 0
    before_seconds: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        blocks = len(self.parameter_bytes)
        if len(self.activation_bytes) != blocks or any(len(row) != blocks for row in self.seconds):
            raise ValueError("BlockCosts: every rank's seconds and every byte count need one entry per block.")
        if len(self.memory_bytes) != len(self.seconds):
            raise ValueError("BlockCosts: memory_bytes needs one entry per rank, as seconds has.")
        for name in ("after_seconds", "before_seconds"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * len(self.seconds))

    @property
    def blocks(self) -> int:
        return len(self.parameter_bytes)

    @property
    def ranks(self) -> int:
        return len(self.seconds)


@dataclass(frozen=True)
class StagePlacement:
    """Stage ``s`` holds blocks ``starts[s] .. starts[s+1]-1`` (``boundaries`` are ``starts[1:]``) on ``ranks[s]``."""

    boundaries: tuple[int, ...]
    ranks: tuple[int, ...]
    stage_seconds: tuple[float, ...]  # per sample of a micro-batch, on the stage's rank
    stage_bytes: tuple[int, ...]
    blocks: int
    source: str  # "balanced" (searched) or "boundaries" (the user's)
    # The interleaved schedule's chunks: the first block of each of the S*V chunks of the chain, chunk g held by
    # stage g % S (empty: each stage holds its one contiguous range, `boundaries`).
    chunk_starts: tuple[int, ...] = ()

    @property
    def starts(self) -> tuple[int, ...]:
        return (0, *self.boundaries)

    def chunks_of(self, stage: int) -> list[range]:
        """The contiguous ranges of blocks ``stage`` holds: its chunks in the chain's order (one without chunks)."""
        if not self.chunk_starts:
            ends = (*self.boundaries, self.blocks)
            return [range(self.starts[stage], ends[stage])]
        stages = len(self.ranks)
        ends = (*self.chunk_starts[1:], self.blocks)
        return [range(self.chunk_starts[g], ends[g]) for g in range(stage, len(self.chunk_starts), stages)]

    def blocks_of(self, stage: int) -> list[int]:
        """Every block ``stage`` holds, in the chain's order."""
        return [block for chunk in self.chunks_of(stage) for block in chunk]

    @property
    def slowest_seconds(self) -> float:
        return max(self.stage_seconds)

    @property
    def balance(self) -> float:
        """Mean stage time over the slowest: 1.0 when every stage takes as long (no stage waits for another)."""
        return (
            sum(self.stage_seconds) / (len(self.stage_seconds) * self.slowest_seconds) if self.slowest_seconds else 1.0
        )

    def step_seconds(self, micro_batches: int, micro_batch: int) -> float:
        """A step of ``micro_batches`` micro-batches of ``micro_batch`` samples by GPipe's or 1F1B's schedule: the
        slowest stage for every micro-batch, plus the others once while the pipeline fills and drains. Interleaved
        with ``V`` chunks per stage, the fill and drain pass through chunks, a ``V``-th of a stage each: the others'
        part shrinks ``V`` times."""
        per = [t * micro_batch for t in self.stage_seconds]
        chunks = len(self.chunk_starts) // len(self.ranks) if self.chunk_starts else 1
        return micro_batches * max(per) + (sum(per) - max(per)) / chunks


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int, chunks: int = 1) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once: all of them under GPipe (every forward before
    any backward), ``stages - stage`` at most under 1F1B (its warm-up). Interleaved, with ``chunks`` per rank: its
    warm-up's chunk passes and one more, each a chunk's activations (a ``chunks``-th of the stage's), in whole
    micro-batches of the stage."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "interleaved":
        passes = min(micro_batches * chunks, (stages - stage - 1) * 2 + (chunks - 1) * stages + 1)
        return -(-passes // chunks)
    return min(stages - stage, micro_batches)


def interleave(costs: BlockCosts, placement: StagePlacement, chunks: int, holds: Sequence[int]) -> StagePlacement:
    """``placement`` (contiguous stages, placed by speed) cut into ``chunks`` chunks per stage for the interleaved
    schedule: stage ``s``'s block count split into ``chunks`` near-equal parts, the chain laid out as chunk 0 of every
    stage in order, then chunk 1 of every stage, and so on; each stage holds as many blocks as placed, and its time and
    memory are those of the blocks it now holds. Raises ValueError when a stage holds fewer blocks than ``chunks``."""
    stages = len(placement.ranks)
    ends = (*placement.boundaries, placement.blocks)
    counts = [ends[s] - placement.starts[s] for s in range(stages)]
    short = [(s, n) for s, n in enumerate(counts) if n < chunks]
    if short:
        stage, count = short[0]
        raise ValueError(
            f"HeteroStrategy(pipeline=...): stage {stage} holds {count} block(s), fewer than `virtual_stages` {chunks};"
            " each chunk needs a block. Use fewer `virtual_stages`, fewer `stages`, or a chain of more blocks."
        )
    parts = [split_by_weights(n, [1.0] * chunks) for n in counts]
    starts, first = [], 0
    for chunk in range(chunks):
        for stage in range(stages):
            starts.append(first)
            first += parts[stage][chunk]
    interleaved = replace(placement, chunk_starts=tuple(starts))
    seconds, used = [], []
    for stage in range(stages):
        rank = placement.ranks[stage]
        held = interleaved.blocks_of(stage)
        time = sum(costs.seconds[rank][b] for b in held) + costs.before_seconds[rank]
        seconds.append(time + (costs.after_seconds[rank] if stage == stages - 1 else 0.0))
        activations = sum(costs.activation_bytes[b] for b in held)
        used.append(costs.outside_bytes + sum(costs.parameter_bytes[b] for b in held) + holds[stage] * activations)
    return replace(interleaved, stage_seconds=tuple(seconds), stage_bytes=tuple(used))


def check_boundaries(boundaries: Sequence[int], stages: int, blocks: int) -> tuple[int, ...]:
    """``boundaries`` (the first block of every stage after the first) checked against the chain; raised at setup."""
    values = tuple(boundaries)
    if len(values) != stages - 1:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `boundaries` {list(values)} has {len(values)} entries for {stages} stages;"
            f" give {stages - 1}: the index of the first block of each stage after the first."
        )
    if any(not 0 < b < blocks for b in values) or list(values) != sorted(set(values)):
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `boundaries` {list(values)} must increase strictly, each between 1 and"
            f" {blocks - 1} (the chain has {blocks} blocks), so that every stage holds at least one block."
        )
    return values


def _stage_cost(costs: BlockCosts, rank: int, first: int, end: int, stage: int, stages: int) -> float:
    seconds = sum(costs.seconds[rank][first:end]) + costs.before_seconds[rank]
    if stage == stages - 1:
        seconds += costs.after_seconds[rank]
    return seconds


def _stage_bytes(costs: BlockCosts, first: int, end: int, held: int) -> int:
    return costs.outside_bytes + sum(costs.parameter_bytes[first:end]) + held * sum(costs.activation_bytes[first:end])


def _fits(costs: BlockCosts, rank: int, used: int) -> bool:
    ceiling = costs.memory_bytes[rank]
    return ceiling is None or used <= ceiling


def _placement(costs: BlockCosts, order: Sequence[int], starts: Sequence[int], holds: Sequence[int], source: str):
    stages = len(order)
    ends = (*starts[1:], costs.blocks)
    return StagePlacement(
        boundaries=tuple(starts[1:]),
        ranks=tuple(order),
        stage_seconds=tuple(_stage_cost(costs, order[s], starts[s], ends[s], s, stages) for s in range(stages)),
        stage_bytes=tuple(_stage_bytes(costs, starts[s], ends[s], holds[s]) for s in range(stages)),
        blocks=costs.blocks,
        source=source,
    )


def _best_for_order(
    costs: BlockCosts, order: Sequence[int], holds: Sequence[int], least: int = 1
) -> Optional[tuple[float, tuple]]:
    """The min-max split of the chain over the stages in ``order``, each stage holding at least ``least`` blocks
    (the interleaved schedule's chunks): (slowest stage, first blocks), None if none fits.

    ``best[s][j]``: the least slowest-stage time of stages ``s..S-1`` holding blocks ``j..B-1``. Ties go to the split
    whose earlier stages hold fewer blocks, so the answer is the same on every rank."""
    stages, blocks = len(order), costs.blocks
    best: list[list[Optional[tuple[float, tuple]]]] = [[None] * (blocks + 1) for _ in range(stages + 1)]
    best[stages][blocks] = (0.0, ())
    for s in range(stages - 1, -1, -1):
        for first in range(blocks - (stages - s) * least + 1):
            candidates = []
            for end in range(first + least, blocks - (stages - s - 1) * least + 1):
                rest = best[s + 1][end]
                if rest is None or not _fits(costs, order[s], _stage_bytes(costs, first, end, holds[s])):
                    continue
                cost = max(_stage_cost(costs, order[s], first, end, s, stages), rest[0])
                candidates.append((cost, (first, *rest[1])))
            if candidates:
                best[s][first] = min(candidates, key=lambda c: (c[0], c[1]))
    return best[0][0]


def place_stages(
    costs: BlockCosts,
    stages: int,
    schedule: str = "1f1b",
    micro_batches: int = 1,
    micro_batch: int = 1,
    boundaries: Optional[Sequence[int]] = None,
    ranks: Optional[Sequence[int]] = None,
    search_orders: bool = True,
    last_rank: Optional[int] = None,
    chunks: int = 1,
) -> StagePlacement:
    """The placement of the chain on ``stages`` of the ranks ``ranks`` (default: all of ``costs``' ranks, one stage
    each) whose slowest stage is fastest within every device's memory, the ranks in any order (in theirs without
    ``search_orders``), with ``last_rank`` (if given) running the last stage; with ``boundaries``, those, on the
    ranks in order (``last_rank`` moved last). Raises ValueError naming what does not
    fit when no placement does."""
    pool = tuple(range(costs.ranks)) if ranks is None else tuple(ranks)
    if last_rank is not None and last_rank in pool:
        pool = (*[r for r in pool if r != last_rank], last_rank)
    if len(pool) != stages:
        raise ValueError(f"place_stages: {stages} stages need {stages} ranks, got {list(pool)}.")
    if stages > costs.blocks:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `stages` {stages} is more than the chain's {costs.blocks} blocks; every"
            f" stage needs at least one block. Use at most {costs.blocks} stages."
        )
    if stages * chunks > costs.blocks:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): {stages} stages of `virtual_stages` {chunks} chunks need {stages * chunks}"
            f" blocks, and the chain has {costs.blocks}. Use fewer `virtual_stages` or fewer `stages`."
        )
    holds = [in_flight(schedule, s, stages, micro_batches, chunks) * micro_batch for s in range(stages)]
    if boundaries is not None:
        starts = (0, *check_boundaries(boundaries, stages, costs.blocks))
        placement = _placement(costs, pool, starts, holds, "boundaries")
        if chunks > 1:
            placement = interleave(costs, placement, chunks, holds)
        _raise_if_over(costs, placement)
        return placement
    orders: Any = [pool]
    if search_orders and stages <= MAX_ORDERS_SEARCHED:
        orders = (o for o in itertools.permutations(pool) if last_rank not in pool or o[-1] == last_rank)
    found: Optional[tuple[float, tuple, tuple]] = None
    for order in orders:
        result = _best_for_order(costs, order, holds, chunks)  # (each stage at least a block per chunk)
        if result is not None and (found is None or (result[0], order) < (found[0], found[2])):
            found = (result[0], result[1], order)
    if found is None:
        needed = _stage_bytes(costs, 0, costs.blocks, max(holds))
        ceilings = [costs.memory_bytes[r] for r in pool]
        raise ValueError(
            f"HeteroStrategy(pipeline=...): no split of the chain's {costs.blocks} blocks over {stages} stages fits"
            f" the devices' memory (ceilings {_mib(ceilings)} MiB; the whole chain needs {needed / 2**20:.1f} MiB"
            f" with {max(holds)} samples in flight). Use more stages, fewer micro-batch samples, or larger devices."
        )
    placed = _placement(costs, found[2], found[1], holds, "balanced")
    if chunks > 1:  # (the counts placed by speed, cut into chunks: within memory as the chunks' own blocks say)
        placed = interleave(costs, placed, chunks, holds)
        _raise_if_over(costs, placed)
    return placed


def _raise_if_over(costs: BlockCosts, placement: StagePlacement) -> None:
    for stage, (rank, used) in enumerate(zip(placement.ranks, placement.stage_bytes)):
        if not _fits(costs, rank, used):
            ceiling = costs.memory_bytes[rank]
            assert ceiling is not None  # (an unknown ceiling fits)
            fix = (
                " (`boundaries`). Move blocks to another stage, or leave out `boundaries` to have them placed."
                if placement.source == "boundaries"
                else " once its blocks are cut into `virtual_stages` chunks. Use fewer `virtual_stages`, fewer"
                " micro-batch samples, or more stages."
            )
            raise ValueError(
                f"HeteroStrategy(pipeline=...): stage {stage} (blocks {list(placement.blocks_of(stage))}) needs"
                f" {used / 2**20:.1f} MiB on rank {rank}, above its {ceiling / 2**20:.1f} MiB{fix}"
            )


def _mib(values: Sequence[Optional[int]]) -> list:
    return [None if v is None else round(v / 2**20, 1) for v in values]


def block_costs(
    measured: Optional[Sequence[Any]],
    blocks: int,
    ranks: int,
    parameter_bytes: Sequence[int],
    outside_bytes: int,
    ceilings: Sequence[Optional[float]],
) -> BlockCosts:
    """The placement's input: every rank's measured block costs (:class:`~lightning_hetero.pipeline.blocks.
    BlockMeasurement`), or without measurements (fixed ``boundaries``) one second per block and no activations.
    ``parameter_bytes``: each block's training state; ``ceilings``: each rank's emulated device memory (None: none),
    of which :data:`~lightning_hetero.measure.profiler.MEMORY_HEADROOM` may be planned, as of free memory."""
    from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM

    capped = [None if c is None else int(MEMORY_HEADROOM * c) for c in ceilings]
    if not measured:
        return BlockCosts(
            ((1.0,) * blocks,) * ranks,
            tuple(parameter_bytes),
            (0,) * blocks,
            tuple(capped),
            outside_bytes=outside_bytes,
        )
    memory = [
        m.memory_bytes if c is None else (c if m.memory_bytes is None else min(c, m.memory_bytes))
        for m, c in zip(measured, capped)
    ]
    return BlockCosts(
        seconds=tuple(tuple(m.seconds) for m in measured),
        parameter_bytes=tuple(parameter_bytes),
        activation_bytes=tuple(max(m.activation_bytes[b] for m in measured) for b in range(blocks)),
        memory_bytes=tuple(memory),
        after_seconds=tuple(m.after_seconds for m in measured),
        before_seconds=tuple(m.before_seconds for m in measured),
        outside_bytes=outside_bytes,
    )


def scaled_costs(costs: BlockCosts, factors: Sequence[float]) -> BlockCosts:
    """``costs`` with rank r's times multiplied by ``factors[r]``: what it measured in training over what the
    placement predicted for its stage (a device that slowed down has a factor above 1)."""
    return BlockCosts(
        seconds=tuple(tuple(t * f for t in row) for row, f in zip(costs.seconds, factors)),
        parameter_bytes=costs.parameter_bytes,
        activation_bytes=costs.activation_bytes,
        memory_bytes=costs.memory_bytes,
        after_seconds=tuple(t * f for t, f in zip(costs.after_seconds, factors)),
        outside_bytes=costs.outside_bytes,
        before_seconds=tuple(t * f for t, f in zip(costs.before_seconds, factors)),
    )


def stage_seconds_under(costs: BlockCosts, placement: StagePlacement) -> tuple[float, ...]:
    """Each stage's time per sample that ``costs`` (as first measured) predict for ``placement``'s boundaries: what
    the times measured in training are compared with (a re-planned placement's own times are scaled ones)."""
    return _placement(costs, placement.ranks, placement.starts, [0] * len(placement.ranks), "").stage_seconds


def pipeline_shares(costs: BlockCosts, placement: StagePlacement, replicas: int, global_batch: int) -> tuple[int, ...]:
    """Each pipeline's share of the global batch, in proportion to its throughput: pipeline ``p`` (ranks ``p*S ..``,
    its stages on them in the placement's order) runs at the pace of its slowest stage under the common boundaries."""
    stages = len(placement.ranks)
    speeds = []
    for replica in range(replicas):
        ranks = tuple(replica * stages + r for r in placement.ranks)
        slowest = _placement(costs, ranks, placement.starts, [0] * stages, "").slowest_seconds
        speeds.append(1.0 / slowest if slowest > 0 else 1.0)
    return tuple(split_by_weights(global_batch, speeds))


@dataclass(frozen=True)
class StageReplan:
    """A re-plan decision: the new placement (None: keep the current one) and why."""

    placement: Optional[StagePlacement]
    reason: str


def replan_stages(
    costs: BlockCosts,
    current: StagePlacement,
    factors: Sequence[float],
    threshold: float,
    schedule: str,
    micro_batches: int,
    micro_batch: int,
) -> StageReplan:
    """Blocks moved between the stages (the ranks keep their stages) when, with each rank's times scaled by what it
    measured (``factors``), another split's slowest stage is faster than the current one's by more than
    ``threshold`` (a fraction). Pure: the same decision on every rank from the same gathered factors."""
    scaled = scaled_costs(costs, factors)
    now = _placement(scaled, current.ranks, current.starts, [0] * len(current.ranks), "balanced").slowest_seconds
    best = place_stages(
        scaled, len(current.ranks), schedule, micro_batches, micro_batch, ranks=current.ranks, search_orders=False
    )
    gain = 1.0 - best.slowest_seconds / now if now > 0 else 0.0
    if best.boundaries == current.boundaries or gain <= threshold:
        return StageReplan(None, f"kept boundaries {list(current.boundaries)} (predicted gain {gain:.0%})")
    return StageReplan(
        best,
        f"boundaries {list(current.boundaries)} -> {list(best.boundaries)}: the slowest stage predicted"
        f" {gain:.0%} faster (measured speed factors {[round(f, 2) for f in factors]})",
    )
