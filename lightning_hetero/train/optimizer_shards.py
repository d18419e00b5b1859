"""Train: optimizer state sharded over the ranks that hold the same parameters, each share sized by memory or equal.

Two ways of training hold one parameter on several ranks and can step it on one of them: a pipeline's stage held by
several pipelines (:mod:`lightning_hetero.pipeline.optimizer_shards`) and data-parallel training, where every rank
holds the whole model (:mod:`lightning_hetero.split.optimizer_shards`). In both, each rank owns a contiguous run of the
parameters (:func:`owners_by_fraction`), sized by ``shards``: ``"memory"`` in proportion to what each rank's memory
leaves (:func:`shard_fractions`), ``"equal"`` as DeepSpeed's ZeRO. The owner alone steps its parameters, so the
user's torch optimizer keeps state for those alone (the others' gradients are dropped before the step), then each
owner broadcasts what it stepped (:class:`OptimizerShards`). torch's optimizers step each parameter from its own
gradient and state, so the update is one process's.

Pure decisions first (the arguments' checks, :func:`shard_fractions`, :func:`owners_by_fraction`), then the sets of
parameters and the object that applies them in training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

SHARDS = ("equal", "memory")
# The ZeRO stages that memory-sized shards stand for in data-parallel training: the optimizer state (1), and the
# gradients too once they are reduced to their owners (2).
SHARDED_STAGES = (1, 2)


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
    equal or unknown: :func:`shard_fractions`), and ``"equal"`` elsewhere (DeepSpeed's ZeRO, which data-parallel
    training keeps unless asked)."""
    if shards is not None:
        return shards
    return "memory" if pipeline and stage == 1 else "equal"


def shards_refusal(
    shards: Optional[str], stage: Optional[int], pipeline: bool, local: bool = False, exchange: Optional[str] = None
) -> Optional[str]:
    """Why ``shards`` cannot go with the other arguments, or None (checked in the constructor). ``local``: local
    SGD / DiLoCo; ``exchange``: the argument that changes the gradient exchange (compression, hierarchical
    reduction), None when none does."""
    if shards in (None, "equal"):
        return None
    if pipeline:
        if stage != 1:
            return (
                f"HeteroStrategy(pipeline=..., shards={shards!r}, stage={stage!r}): `shards` sizes the optimizer"
                " state's shards, which a pipeline makes at `stage=1` only. Pass `stage=1`, or leave out `shards`."
            )
        return None
    if local:
        return (
            f"HeteroStrategy(sync=..., shards={shards!r}): local training steps every rank's own copy of the model"
            " between synchronizations, so each rank keeps the whole optimizer state. Leave out `shards`."
        )
    if stage not in SHARDED_STAGES:
        return (
            f"HeteroStrategy(shards={shards!r}, stage={stage!r}): memory-sized shards split the optimizer state"
            " (`stage=1`), and the gradients once they are reduced (`stage=2`); ZeRO-3's parameter shards are"
            " DeepSpeed's, equal. Pass `stage=1` or `stage=2`, or leave out `shards`."
        )
    if exchange is not None:
        return (
            f"HeteroStrategy(shards={shards!r}, {exchange}): memory-sized shards reduce each gradient to the rank that"
            f" owns it, in 32-bit and over every rank at once, which `{exchange}` would change. Leave out `shards`,"
            f" or `{exchange.split('=')[0]}`."
        )
    return None


def check_shards_config(config: Mapping[str, Any], stage: Optional[int]) -> None:
    """A DeepSpeed config (the user's, or the one the arguments made) that memory-sized data-parallel shards cannot
    run with: offloading is DeepSpeed's, in its ZeRO optimizer's equal shards. Raised in the constructor."""
    zero = config.get("zero_optimization") or {}
    if config.get("optimizer"):
        raise ValueError(
            f"HeteroStrategy(stage={stage}, shards='memory') with a DeepSpeed config that sets `optimizer`: each rank's"
            " share is stepped by the torch optimizer `configure_optimizers` returns, and saved by its parameters'"
            " names. Leave `optimizer` out of the config and return the optimizer from `configure_optimizers`."
        )
    offloaded = [key for key in ("offload_optimizer", "offload_param") if isinstance(zero, Mapping) and zero.get(key)]
    if offloaded:
        raise ValueError(
            f"HeteroStrategy(stage={stage}, shards='memory') with `{offloaded[0]}`: memory-sized shards keep each"
            " rank's share of the optimizer state on its own device, and offloading belongs to DeepSpeed's equal"
            " shards. Leave out the offloading, or `shards`."
        )


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
        if not self.owners:  # (a frozen parameter weighs nothing: it has no optimizer state)
            self.owners = owners_by_fraction([_trained_bytes(p) for p in self.parameters], self.fractions)

    def owned_by(self, rank: int) -> list[nn.Parameter]:
        copy = self.ranks.index(rank)
        return [p for p, owner in zip(self.parameters, self.owners) if owner == copy]

    def share_bytes(self) -> list[int]:
        """Each copy's bytes of the parameters it owns (its optimizer state is as many times that as the optimizer
        keeps per parameter)."""
        held = [0] * len(self.ranks)
        for parameter, owner in zip(self.parameters, self.owners):
            held[owner] += _trained_bytes(parameter)
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
                    # (a frozen parameter was not stepped; one flat tensor per dtype: torch.cat would promote)
                    owned = [
                        p for p, owner in zip(sharded.parameters, sharded.owners) if owner == copy and p.requires_grad
                    ]
                    for group in same_dtype_groups(owned):
                        flat = torch.cat([p.detach().reshape(-1) for p in group])
                        dist.broadcast(flat, src=source, group=sharded.group)
                        if source != self.rank:
                            offset = 0
                            for parameter in group:
                                parameter.copy_(flat[offset : offset + parameter.numel()].view_as(parameter))
                                offset += parameter.numel()

    def reassign(
        self,
        index: int,
        names: list[str],
        parameters: list[nn.Parameter],
        optimizer: torch.optim.Optimizer,
        fractions: Optional[tuple[float, ...]] = None,
        reason: Optional[str] = None,
    ) -> None:
        """Set ``index`` now holds ``parameters`` (blocks moved in or out) at ``fractions`` (None: the same): owners
        decided again, and each parameter's optimizer state sent to its new owner (every copy sends the state it
        holds but no longer owns; a moved block arrived with the state of all its former owners). Every rank of the
        set calls it."""
        old = self.sets[index]
        new = ShardedSet(
            names,
            parameters,
            old.ranks,
            old.group,
            fractions if fractions is not None else old.fractions,
            reason if reason is not None else old.reason,
        )
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


def _trained_bytes(parameter: nn.Parameter) -> int:
    return parameter.numel() * parameter.element_size() if parameter.requires_grad else 0


def same_dtype_groups(parameters: Sequence[Any]) -> list[list[Any]]:
    """``parameters`` in runs of one dtype each, in their order of first appearance (the same on every rank: the
    same model), so that each run travels as one flat tensor."""
    groups: dict[torch.dtype, list[Any]] = {}
    for parameter in parameters:
        groups.setdefault(parameter.dtype, []).append(parameter)
    return list(groups.values())
