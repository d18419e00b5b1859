"""Train: a stage's optimizer state sharded over the pipelines that hold it (``HeteroStrategy(pipeline=..., stage=1)``).

With more ranks than stages, every stage is held by one rank per pipeline, and after each step's gradient sums those
ranks hold the same gradients: each stepping the whole stage would keep the whole optimizer state on every one of
them. ZeRO-1 instead: each of them owns a contiguous run of the stage's parameters (in the chain's order) and steps
only those (the others' gradients are dropped before the step, so the user's torch optimizer makes no state for
them), then every owner broadcasts what it stepped to the other copies. The update is one process's: the gradients
are the summed ones, clipped by the whole model's norm before any of this, and torch's optimizers step each parameter
from its own gradient and state. The modules outside the chain, which every rank holds, are sharded the same way over
every rank, in equal shares.

How much each copy owns (``shards``): ``"memory"`` (the default), in proportion to what each rank's memory leaves
once its stage's parameters, gradients and activations are in (:func:`shard_fractions`), so a device with little
memory holds a small shard of the state beside a large one, and equal shares where the memory is equal or not known;
or ``"equal"``, as DeepSpeed's ZeRO (the same bytes each).
The placement counts the state as held (:func:`sharded_costs`): a rank holds its share of it, and under ``"memory"``
a stage fits when the mean memory of its ranks holds it (the shares then fit each rank by construction).

Checkpoints stay keyed by parameter name: each rank saves the state it owns, and a resume (any boundaries, any number
of pipelines, sharded or not) takes every name from whichever file holds it (:mod:`lightning_hetero.pipeline.state`).

The pipeline's decisions are here (:func:`sharded_costs`, :func:`shard_rooms`); the shares, owners and the object that
applies them in training are shared with data-parallel training (:mod:`lightning_hetero.train.optimizer_shards`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from lightning_hetero.pipeline.placement import BlockCosts, StagePlacement

# The optimizer state's part of a parameter's training bytes as the placement counts them (blocks.ADAM_COPIES: the
# parameter, its gradient and Adam's two moments): the two moments.
STATE_SHARE = 0.5


def _state_bytes_held(training_bytes: float, copies: int) -> float:
    """A parameter's training bytes on a rank that holds ``1/copies`` of its optimizer state."""
    return training_bytes * (1.0 - STATE_SHARE + STATE_SHARE / copies)


def sharded_costs(costs: BlockCosts, stages: int, replicas: int, sharded: bool, shards: str) -> BlockCosts:
    """The placement's costs as the ranks of the first pipeline stand for their stage's every copy (the pipelines keep
    the first one's placement): slot ``r``'s memory is the least of ranks ``p*S + r`` (the mean, with ``"memory"``
    shards, whose state goes where the memory is), and with ``sharded`` a block's bytes count ``1/replicas`` of its
    optimizer state and the outside modules' ``1/world`` (their shards are equal)."""
    world = costs.ranks
    memory = list(costs.memory_bytes)
    for slot in range(stages):
        copies = [costs.memory_bytes[p * stages + slot] for p in range(replicas)]
        known = [m for m in copies if m is not None]
        if not known:
            continue
        pooled = sharded and shards == "memory" and len(known) == len(copies)
        memory[slot] = int(statistics.mean(known)) if pooled else min(known)
    if not sharded:
        return replace(costs, memory_bytes=tuple(memory))
    return replace(
        costs,
        memory_bytes=tuple(memory),
        parameter_bytes=tuple(int(_state_bytes_held(b, replicas)) for b in costs.parameter_bytes),
        outside_bytes=int(_state_bytes_held(costs.outside_bytes, world)),
    )


def shard_rooms(
    costs: BlockCosts, placement: StagePlacement, stage: int, stage_ranks: Sequence[int], held_samples: int
) -> list[Optional[int]]:
    """What each rank holding ``stage`` may give its share of the stage's optimizer state: its memory (``costs``, one
    entry per rank, unpooled) less the stage's parameters and gradients, ``held_samples`` samples' activations and the
    modules outside the chain as held (their state in equal shares); None where the memory is not known."""
    blocks = placement.blocks_of(stage)
    parameters = sum(costs.parameter_bytes[b] for b in blocks)
    used = (
        parameters * (1.0 - STATE_SHARE)
        + held_samples * sum(costs.activation_bytes[b] for b in blocks)
        + _state_bytes_held(costs.outside_bytes, costs.ranks)
    )
    memory = [costs.memory_bytes[r] for r in stage_ranks]
    return [None if m is None else int(m - used) for m in memory]
