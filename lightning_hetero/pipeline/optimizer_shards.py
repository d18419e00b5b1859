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

Pure decisions first (:func:`sharded_costs`, :func:`shard_rooms`, :func:`shard_fractions`, :func:`owners_by_fraction`),
then the object that applies them in training (:class:`OptimizerShards`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_hetero.pipeline.placement import BlockCosts, StagePlacement

SHARDS = ("equal", "memory")
# The optimizer state's part of a parameter's training bytes as the placement counts them (blocks.ADAM_COPIES: the
# parameter, its gradient and Adam's two moments): the two moments.
STATE_SHARE = 0.5


def check_shards(value: Any) -> Optional[str]:
    """The ``shards`` argument, checked in the constructor (None: the default, :func:`default_shards`)."""
    if value is not None and value not in SHARDS:
        raise ValueError(
            f"HeteroStrategy(shards={value!r}): give one of {list(SHARDS)}: 'equal' gives each copy the same share of"
            " the optimizer state (DeepSpeed's ZeRO), 'memory' a share in proportion to its free memory."
        )
    return value


def default_shards(shards: Optional[str], stage: Optional[int], pipeline: bool) -> str:
    """``shards`` when given; else ``"memory"`` for a pipeline at ``stage=1`` (equal shares where the ranks' memory is
    equal or unknown: :func:`shard_fractions`), and ``"equal"`` elsewhere (DeepSpeed's ZeRO)."""
    if shards is not None:
        return shards
    return "memory" if pipeline and stage == 1 else "equal"


def shards_refusal(shards: Optional[str], stage: Optional[int], pipeline: bool) -> Optional[str]:
    """Why ``shards`` cannot go with the other arguments, or None (checked in the constructor)."""
    if shards in (None, "equal"):
        return None
    if not pipeline:
        return (
            f"HeteroStrategy(shards={shards!r}): memory-sized optimizer shards run inside a pipeline for now"
            " (`pipeline=..., stage=1`); DeepSpeed's ZeRO shards evenly. Leave out `shards`, or add `pipeline`."
        )
    if stage != 1:
        return (
            f"HeteroStrategy(pipeline=..., shards={shards!r}, stage={stage!r}): `shards` sizes the optimizer state's"
            " shards, which a pipeline makes at `stage=1` only. Pass `stage=1`, or leave out `shards`."
        )
    return None


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


def shard_fractions(rooms: Sequence[Optional[int]], shards: str) -> tuple[tuple[float, ...], str]:
    """Each copy's fraction of a stage's optimizer state, and why: equal shares under ``"equal"``; under ``"memory"``
    in proportion to each copy's room (a copy without room takes none), equal when a room is unknown or none is
    left (the placement refused a stage that does not fit before this)."""
    copies = len(rooms)
    equal = tuple(1.0 / copies for _ in rooms)
    if shards == "equal" or copies == 1:
        return equal, "equal shares"
    if any(room is None for room in rooms):
        return equal, "equal shares: not every rank's memory is known"
    positive = [max(0, room) for room in rooms if room is not None]
    if sum(positive) <= 0:
        return equal, "equal shares: no rank has room left after its activations"
    return tuple(room / sum(positive) for room in positive), "in proportion to the memory left after activations"


def owners_by_fraction(sizes: Sequence[int], fractions: Sequence[float]) -> tuple[int, ...]:
    """The copy that owns each parameter (``sizes``: their bytes, in order): contiguous runs, copy ``c`` owning the
    parameters whose middle byte falls in its ``fractions[c]`` of the total, so each copy's bytes are within one
    parameter of its fraction (a copy with fraction 0 owns none)."""
    total = sum(sizes)
    ends, running = [], 0.0
    for fraction in fractions:
        running += fraction
        ends.append(running * total)
    ends[-1] = float("inf")  # (rounding: the last byte belongs to someone)
    owners, start = [], 0
    for size in sizes:
        middle = start + size / 2
        owners.append(next(c for c, end in enumerate(ends) if (middle < end and fractions[c] > 0) or end == ends[-1]))
        start += size
    return tuple(owners)


@dataclass
class ShardedSet:
    """Parameters held by every rank in ``ranks`` (one copy each), each stepped by its owner only: ``owners[i]``
    indexes ``ranks``. ``group``: the process group of ``ranks`` (None: every rank)."""

    names: list[str]
    parameters: list[nn.Parameter]
    ranks: list[int]
    group: Any
    fractions: tuple[float, ...]
    reason: str
    owners: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.owners:
            self.owners = owners_by_fraction([_bytes(p) for p in self.parameters], self.fractions)

    def owned_by(self, rank: int) -> list[nn.Parameter]:
        copy = self.ranks.index(rank)
        return [p for p, owner in zip(self.parameters, self.owners) if owner == copy]

    def share_bytes(self) -> list[int]:
        """Each copy's bytes of the parameters it owns (its optimizer state is as many times that as the optimizer
        keeps per parameter)."""
        held = [0] * len(self.ranks)
        for parameter, owner in zip(self.parameters, self.owners):
            held[owner] += _bytes(parameter)
        return held


class OptimizerShards:
    """This rank's shards (ZeRO-1 over the copies): the stage's parameters over its pipelines, the outside modules'
    over every rank. Around the optimizer step: :meth:`drop_unowned_gradients`, the step, :meth:`gather_parameters`."""

    def __init__(self, rank: int, sets: list[ShardedSet]) -> None:
        self.rank = rank
        self.sets = sets

    def _unowned(self) -> list[nn.Parameter]:
        owned = {id(p) for s in self.sets for p in s.owned_by(self.rank)}
        return [p for s in self.sets for p in s.parameters if id(p) not in owned]

    def drop_unowned_gradients(self) -> None:
        """Before the step: only the parameters this rank owns keep a gradient, so the optimizer steps (and keeps
        state for) those alone (torch's optimizers skip a parameter without a gradient)."""
        for parameter in self._unowned():
            parameter.grad = None

    def unowned_names(self) -> set[str]:
        """The names of the parameters this rank holds but another copy steps: a resume loads no state for them."""
        return {
            name
            for sharded in self.sets
            for name, owner in zip(sharded.names, sharded.owners)
            if sharded.ranks[owner] != self.rank
        }

    def drop_unowned_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer state of parameters this rank does not own forgotten: an optimizer that makes its state when
        it is built (Adagrad's sums) made it for every parameter."""
        for parameter in self._unowned():
            optimizer.state.pop(parameter, None)

    def gather_parameters(self) -> None:
        """After the step: each owner's stepped parameters broadcast to the other copies, one flat tensor per owner;
        every rank of a set calls it (the step is taken or skipped alike on every rank)."""
        with torch.no_grad():
            for sharded in self.sets:
                if len(sharded.ranks) < 2:
                    continue
                for copy, source in enumerate(sharded.ranks):
                    owned = [p for p, owner in zip(sharded.parameters, sharded.owners) if owner == copy]
                    if not owned:
                        continue
                    flat = torch.cat([p.detach().reshape(-1) for p in owned])
                    dist.broadcast(flat, src=source, group=sharded.group)
                    if source != self.rank:
                        offset = 0
                        for parameter in owned:
                            parameter.copy_(flat[offset : offset + parameter.numel()].view_as(parameter))
                            offset += parameter.numel()

    def reassign(
        self, index: int, names: list[str], parameters: list[nn.Parameter], optimizer: torch.optim.Optimizer
    ) -> None:
        """Set ``index`` now holds ``parameters`` (blocks moved in or out): owners decided again with the same
        fractions, and each parameter's optimizer state sent to its new owner (every copy sends the state it holds
        but no longer owns; a moved block arrived with the state of all its former owners)."""
        old = self.sets[index]
        new = ShardedSet(names, parameters, old.ranks, old.group, old.fractions, old.reason)
        owned = {id(p) for p in new.owned_by(self.rank)}
        leaving = {
            name: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
            for name, p in zip(names, parameters)
            if id(p) not in owned and p in optimizer.state
        }
        everyone: list[Any] = [None] * len(old.ranks)
        dist.all_gather_object(everyone, leaving, group=old.group)
        for name, parameter in zip(names, parameters):
            if id(parameter) in owned and parameter not in optimizer.state:
                sent = next((part[name] for part in everyone if name in part), None)
                if sent is not None:
                    optimizer.state[parameter] = {
                        k: v.to(parameter.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                        for k, v in sent.items()
                    }
        self.sets[index] = new
        self.drop_unowned_state(optimizer)

    def describe(self, what: Sequence[str]) -> list[str]:
        """A line per set: each rank's share of its optimizer state, and why (``what``: each set's name)."""
        lines = []
        for sharded, name in zip(self.sets, what):
            held = sharded.share_bytes()
            total = sum(held) or 1
            shares = ", ".join(f"rank {r} {100 * b / total:.0f} %" for r, b in zip(sharded.ranks, held))
            lines.append(f"  optimizer state of {name} sharded over ranks {sharded.ranks} ({sharded.reason}): {shares}")
        return lines


def _bytes(parameter: nn.Parameter) -> int:
    return parameter.numel() * parameter.element_size()
