"""Split: the optimizer state sharded over the data-parallel ranks by each one's memory (``HeteroStrategy(stage=1 or
2, shards="memory")``).

DeepSpeed's ZeRO-1/2 give every rank the same share of the optimizer state, so beside a large device a small one
decides whether the model fits, and how much room its micro-batch's activations have. Here DeepSpeed's engine runs
ZeRO-0 and the package takes over its gradient exchange and its step:

- each rank owns a contiguous run of the module's parameters (in the module's order), sized in proportion to what its
  memory leaves once the parameters, gradients and its micro-batch's activations are in (:func:`optimizer_rooms`,
  :func:`~lightning_hetero.train.optimizer_shards.shard_fractions`); equal shares where no rank's memory is known;
- at the optimizer step's boundary (where DeepSpeed's ZeRO-0 all-reduces) each owner's gradients are reduced to it
  alone, one ``reduce`` per owner of a flat tensor of its parameters' gradients (an uneven reduce-scatter, which gloo
  and NCCL both run), averaged over the ranks as DeepSpeed averages them; the other ranks drop those gradients
  (``stage=2``'s gradient shards: the gradients are whole during the backward, as at ZeRO-1, and only the owner's
  share outlives the exchange);
- the whole model's gradient norm is the owners' squared norms summed (one all-reduce of a number): clipping by it,
  and the non-finite guard's agreement to skip a step, see one process's norm;
- each owner steps its parameters with the user's torch optimizer, which so keeps state for those alone, then
  broadcasts them (:class:`~lightning_hetero.train.optimizer_shards.OptimizerShards`).

The update is one process's: the same averaged gradients, clipped by the same norm, each parameter stepped from its
own gradient and state.

Checkpoints: DeepSpeed's files hold the module and the trainer's state; the optimizer state they hold is rank 0's share
alone and is never read back. Each rank writes the state it owns by parameter name (``optimizer_shard_rank{r}.pt``,
:mod:`lightning_hetero.recover.by_name`), so a resume on any number of ranks, any memory, or without shards at ZeRO-0
takes every name from whichever file holds it (:func:`load_named_shards`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_hetero.configure.zero_stage import OPTIMIZER_STATE_BYTES, UNPROFILED_ACTIVATION_SHARE, readable_bytes
from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM
from lightning_hetero.recover import by_name
from lightning_hetero.train.gradient_norm import clip_to_norm, squared_norm
from lightning_hetero.train.optimizer_shards import OptimizerShards, ShardedSet, same_dtype_groups, shard_fractions

MiB = 2**20
MANIFEST_KEY = by_name.SHARDS_KEY  # the manifest's: the optimizer state is in the shard files (and who held what)


# ---------------------------------------------------------------------------------------------------- decisions


def optimizer_rooms(
    free_bytes: Sequence[Optional[float]], model_bytes: float, activation_bytes: Optional[Sequence[float]]
) -> list[Optional[float]]:
    """What each rank's memory leaves for its share of the optimizer state: ``MEMORY_HEADROOM`` of its free bytes
    (None: not known), less the whole model's parameters and gradients (``model_bytes``) and its micro-batch's
    activations; where nothing measured the activations (``activation_bytes`` None) half of the room is kept for them,
    as the ZeRO stage's choice keeps it (:func:`~lightning_hetero.configure.zero_stage.choose_stage`)."""
    rooms: list[Optional[float]] = []
    for rank, free in enumerate(free_bytes):
        if free is None:
            rooms.append(None)
            continue
        room = MEMORY_HEADROOM * free
        if activation_bytes is None:
            rooms.append(UNPROFILED_ACTIVATION_SHARE * room - model_bytes)
        else:
            rooms.append(room - model_bytes - activation_bytes[rank])
    return rooms


def shares_misfit(rooms: Sequence[Optional[float]], fractions: Sequence[float], state_bytes: float) -> Optional[str]:
    """Where a rank's share of ``state_bytes`` (the optimizer state) does not fit its room, the first such rank
    said; None when every share fits (or no room is known)."""
    for rank, (room, fraction) in enumerate(zip(rooms, fractions)):
        if room is not None and fraction * state_bytes > room:
            return (
                f"rank {rank} would hold {fraction * state_bytes / MiB:.2f} MiB of the optimizer state with"
                f" {max(room, 0.0) / MiB:.2f} MiB left after the model, its gradients and activations"
            )
    return None


def shards_resume_refusal(chosen: Path, manifest: dict[str, Any], sharded_now: bool, zero_stage: int) -> Optional[str]:
    """Why a data-parallel job cannot resume ``chosen``, or None: a checkpoint of memory-sized shards keeps its
    optimizer state by name, one file per rank, which this package reads with shards or at ZeRO-0; DeepSpeed's ZeRO
    1-3 optimizers read DeepSpeed's own files only."""
    saved_stage = manifest.get("zero_stage", 0)
    if sharded_now and MANIFEST_KEY not in manifest and saved_stage:
        return (
            f"Checkpoint {chosen} was saved by DeepSpeed's ZeRO-{saved_stage} optimizer, and memory-sized shards run on"
            f" DeepSpeed's ZeRO-0 engine. Resume it without `shards` (at `stage={saved_stage}`); a checkpoint that run"
            " saves at `stage=0` resumes with `shards='memory'`."
        )
    if MANIFEST_KEY not in manifest or sharded_now or zero_stage == 0:
        return None
    return (
        f"Checkpoint {chosen} was saved with memory-sized optimizer shards (`shards='memory'`): its optimizer state is"
        f" in one file per rank, by name, which DeepSpeed's ZeRO-{zero_stage} optimizer cannot read. Resume it with"
        " `shards='memory'` (at `stage=1` or `2`, on any number of ranks), or at `stage=0`."
    )


# A re-plan moves the shards when a rank's share would change by this much of the state (or a share no longer fits):
# smaller changes are not worth sending optimizer state for.
MOVE_THRESHOLD = 0.05


def shares_to_move(
    current: Sequence[float], wanted: Sequence[float], rooms: Sequence[Optional[float]], state_bytes: float
) -> bool:
    """Whether a re-planned split's rooms call for new shares: a rank's share would change by
    :data:`MOVE_THRESHOLD` or more, or the current shares no longer fit the rooms while the wanted ones do."""
    if len(current) != len(wanted):
        return True
    if max(abs(c - w) for c, w in zip(current, wanted)) >= MOVE_THRESHOLD:
        return True
    return shares_misfit(rooms, current, state_bytes) is not None and shares_misfit(rooms, wanted, state_bytes) is None


def plan_line(
    rooms: Sequence[Optional[float]], fractions: Sequence[float], reason: str, held: Sequence[int], stage: int
) -> str:
    """The plan's line: each rank's share of the optimizer state, why, and what each had room for."""
    total = sum(held) or 1
    shares = ", ".join(f"rank {r} {100 * b / total:.0f} %" for r, b in enumerate(held))
    gradients = " and its gradients" if stage == 2 else ""
    left = ""
    if all(room is not None for room in rooms):
        left = "; left after the model, gradients and activations: " + ", ".join(
            readable_bytes(max(room, 0.0)) for room in rooms if room is not None
        )
    return f"optimizer state{gradients} sharded by memory ({reason}): {shares}{left}"


# ---------------------------------------------------------------------------------------------------- training


class MemoryShards:
    """This rank's part of memory-sized shards in data-parallel training: started with the rooms at a fit's start
    (:meth:`start`), attached to DeepSpeed's ZeRO-0 engine (:meth:`attach`: its exchange and step replaced), its
    state saved and loaded by name."""

    def __init__(self, rank: int, world_size: int, stage: int) -> None:
        self.rank, self.world_size, self.stage = rank, world_size, stage
        self.shards: Optional[OptimizerShards] = None
        self.max_norm = 0.0  # the whole model's gradient clipping (0: none), taken over from DeepSpeed at start
        self.description = ""
        self._engine: Optional[Any] = None
        self._step_norm: Optional[float] = None
        self._undo: list[Callable[[], None]] = []

    @property
    def _set(self) -> ShardedSet:
        assert self.shards is not None
        return self.shards.sets[0]

    def start(
        self,
        module: nn.Module,
        rooms: Sequence[Optional[float]],
        emulated: bool,
        config: dict[str, Any],
        trainer: Any,
    ) -> Optional[str]:
        """Decide each rank's share from ``rooms`` (:func:`optimizer_rooms`; every rank the same); returns a warning
        when a share does not fit a real device's memory (``emulated``: an emulated one, where it is refused as the
        device would fail). Gradient clipping is taken over from DeepSpeed, whose ZeRO-0 engine would clip each
        rank's shard by its own norm: ``config``'s ``gradient_clipping`` (else the Trainer's ``gradient_clip_val``)
        is the whole model's, and the engine's is set to 0."""
        given = config.get("gradient_clipping")
        self.max_norm = float(given if given is not None else (trainer.gradient_clip_val or 0.0))
        config["gradient_clipping"] = 0.0
        named = list(module.named_parameters())
        short = [(rank, room) for rank, room in enumerate(rooms) if room is not None and room < 0]
        if short and self.world_size > 1:
            rank, room = short[0]
            message = (
                f"HeteroStrategy(stage={self.stage}, shards='memory'): rank {rank} cannot hold the model, its"
                f" gradients and its micro-batch's activations ({readable_bytes(-room)} over its memory) before any"
                " optimizer state"
            )
            if emulated:  # (an emulated device that a real one would overflow: refused, as the device would fail)
                raise ValueError(
                    f"{message}: an out-of-memory error on a real device. Split the model (`pipeline`), or give the"
                    " ranks more memory."
                )
            warning: Optional[str] = f"{message}; the fit may run out of memory (rank {rank} holds none of the state)."
        else:
            warning = None
        fractions, reason = shard_fractions(
            [None if room is None else int(room) for room in rooms], "memory" if self.world_size > 1 else "equal"
        )
        parameters = [p for _, p in named]
        self.shards = OptimizerShards(
            self.rank,
            [ShardedSet([n for n, _ in named], parameters, list(range(self.world_size)), None, fractions, reason)],
        )
        held = self._set.share_bytes()
        self.description = plan_line(rooms, fractions, reason, held, self.stage)
        trained = sum(p.numel() for p in parameters if p.requires_grad)
        misfit = shares_misfit(rooms, [b / (sum(held) or 1) for b in held], OPTIMIZER_STATE_BYTES * trained)
        if warning is not None or misfit is None:
            return warning
        message = (
            f"HeteroStrategy(stage={self.stage}, shards='memory'): {misfit} (counting Adam's state,"
            f" {OPTIMIZER_STATE_BYTES} bytes per trained parameter)"
        )
        if emulated:
            raise ValueError(f"{message}: an out-of-memory error on a real device. Split the model (`pipeline`).")
        return f"{message}; the fit may run out of memory."

    def replan(self, rooms: Sequence[Optional[float]], optimizer: Any) -> Optional[str]:
        """The split was re-planned (between two steps, on every rank alike): when its rooms call for other shares
        (:func:`shares_to_move`), the owners are decided again and the optimizer state goes to its new owners; returns
        the line saying so (None: the shares stay)."""
        if self.shards is None or self.world_size < 2:
            return None
        sharded = self._set
        held = sharded.share_bytes()
        current = [b / (sum(held) or 1) for b in held]
        fractions, reason = shard_fractions([None if room is None else max(0, int(room)) for room in rooms], "memory")
        trained = sum(p.numel() for p in sharded.parameters if p.requires_grad)
        # (the targets compared, not the shares held: a few large tensors keep those away from any target)
        if not shares_to_move(sharded.fractions, fractions, rooms, OPTIMIZER_STATE_BYTES * trained):
            return None
        moved_set = ShardedSet(sharded.names, sharded.parameters, sharded.ranks, None, tuple(fractions), reason)
        if moved_set.owners == sharded.owners:  # (the same owners at the new targets: nothing to send)
            self.shards.sets[0] = moved_set
            return None
        changed = sum(1 for old, new in zip(sharded.owners, moved_set.owners) if old != new)
        self.shards.reassign(0, sharded.names, sharded.parameters, optimizer, tuple(fractions), reason)
        moved = self._set.share_bytes()
        self.description = plan_line(rooms, fractions, reason, moved, self.stage)
        before = ", ".join(f"{100 * c:.1f} %" for c in current)
        after = ", ".join(f"{100 * b / (sum(moved) or 1):.1f} %" for b in moved)
        return (
            f"HeteroStrategy re-plan: the optimizer state's shards move, {changed} of {len(moved_set.owners)}"
            f" parameters to another rank: [{before}] -> [{after}] ({reason})"
        )

    # ------------------------------------------------------------------ the engine

    def attach(self, engine: Any, agree_nonfinite: Callable[[Callable[[], bool]], None]) -> None:
        """DeepSpeed's ZeRO-0 engine exists: its exchange becomes the reduction to the owners, its step clips by the
        whole model's norm and broadcasts what each owner stepped. ``agree_nonfinite``: hands the non-finite guard
        the question every rank answers alike (is the whole model's gradient norm finite?)."""
        if engine.optimizer is None:  # (an evaluation's engine: nothing is stepped)
            return
        if (
            engine.fp16_enabled()
            or engine.bfloat16_enabled()
            or not isinstance(engine.optimizer, torch.optim.Optimizer)
        ):
            raise ValueError(
                f"HeteroStrategy(stage={self.stage}, shards='memory'): DeepSpeed's engine wraps the optimizer"
                f" ({type(engine.optimizer).__name__}: its own fp16/bf16 training), so each rank's share cannot be"
                " stepped alone. Train with `Trainer(precision='32-true')`, or leave out `shards`."
            )
        assert self.shards is not None, "start() decides the shares before the engine is built"
        self._engine = engine
        self.shards.drop_unowned_state(engine.optimizer)  # (an optimizer that made its state when it was built)
        engine.allreduce_gradients = self.reduce_to_owners
        step = engine.step
        engine.step = self._agreed_step(step)
        agree_nonfinite(self._nonfinite)
        self._undo = [
            lambda: engine.__dict__.pop("allreduce_gradients", None),
            lambda: setattr(engine, "step", step),
            lambda: agree_nonfinite(lambda: False),
        ]

    def detach(self) -> None:
        for undo in self._undo:
            undo()
        self._undo, self._engine, self._step_norm = [], None, None

    def reduce_to_owners(self, *args: Any, **kwargs: Any) -> None:
        """In place of DeepSpeed's ZeRO-0 all-reduce (DeepSpeed calls it after every backward, and in its step when
        the package's config leaves the accumulation to Lightning; like it, this exchanges only at the accumulation
        boundary): each owner receives the mean over the ranks of its parameters' gradients, one flat tensor per
        owner, and the other ranks drop them. A parameter that trains but got no gradient on a rank counts zeros
        there, as DeepSpeed's all-reduce does. Then the whole model's norm is agreed and the owned gradients are
        clipped by it (``coefficient = max_norm / (norm + 1e-6)`` when under 1, as ``clip_grad_norm_``), before
        DeepSpeed's optimizer step runs."""
        engine = self._engine
        if engine is None or not engine.is_gradient_accumulation_boundary():
            return
        sharded = self._set
        with torch.no_grad():
            for copy, owner in enumerate(sharded.ranks):
                owned = [p for p, o in zip(sharded.parameters, sharded.owners) if o == copy and p.requires_grad]
                for group in same_dtype_groups(owned):  # (torch.cat would promote a mixed run)
                    flat = torch.cat([_gradient(p).reshape(-1) for p in group])
                    if self.world_size > 1:
                        dist.reduce(flat, dst=owner)
                    if owner != self.rank:
                        for parameter in group:
                            parameter.grad = None
                        continue
                    flat.div_(self.world_size)
                    offset = 0
                    for parameter in group:
                        parameter.grad = flat[offset : offset + parameter.numel()].view_as(parameter).clone()
                        offset += parameter.numel()
            # The whole model's norm, the same on every rank: the owners' squared norms summed in one all-reduce.
            owned = sharded.owned_by(self.rank)
            device = sharded.parameters[0].device if sharded.parameters else torch.device("cpu")
            squares = squared_norm(owned, device)
            if self.world_size > 1:
                dist.all_reduce(squares)
            norm = float(squares.sqrt())
            self._step_norm = norm
            if self.max_norm > 0 and math.isfinite(norm):  # (a step skipped for its norm keeps its gradients)
                clip_to_norm(owned, self.max_norm, norm)

    def _nonfinite(self) -> bool:
        """Whether this step's whole gradient norm, agreed at the reduction, is not finite (False before it)."""
        return self._step_norm is not None and not math.isfinite(self._step_norm)

    def _agreed_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        """DeepSpeed's step (whose optimizer steps each rank's owned parameters, or skips on every rank alike when
        the agreed norm is not finite), then, when the gradients were reduced for it, every owner's parameters
        broadcast."""

        def agreed(*args: Any, **kwargs: Any) -> Any:
            shards = self.shards
            assert shards is not None
            try:
                result = step(*args, **kwargs)
                if self._step_norm is not None:  # (reduced: the optimizer step ran, or was skipped everywhere)
                    shards.drop_unowned_gradients()
                    shards.gather_parameters()
                return result
            finally:
                self._step_norm = None

        return agreed

    # ------------------------------------------------------------------ checkpoints

    def manifest_entry(self) -> dict[str, Any]:
        """What the manifest records: the state is in the shard files, and who held what."""
        sharded = self._set
        return {"ranks": sharded.ranks, "share_bytes": sharded.share_bytes(), "reason": sharded.reason}

    def save(self, directory: Path, module: nn.Module, optimizer: Any) -> None:
        """This rank's optimizer state, by parameter name (every group's names, its own parameters' state)."""
        torch.save(
            {"optimizer": by_name.named_optimizer_state(module, optimizer)},
            directory / by_name.SHARD_FILE.format(rank=self.rank),
        )

    def unowned_names(self) -> set[str]:
        return self.shards.unowned_names() if self.shards is not None else set()


def _gradient(parameter: nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:
        return torch.zeros_like(parameter)
    return parameter.grad.detach()


def load_named_shards(
    directory: Path,
    manifest: dict[str, Any],
    module: nn.Module,
    optimizer: Any,
    optimizer_parameters: Sequence[tuple[str, Any]],
    skipped: set[str],
) -> None:
    """A checkpoint saved with memory-sized shards: the optimizer state of every rank's file, by name, into this
    rank's ``optimizer`` (over ``optimizer_parameters``, (name, parameter) in its order), less the names another rank
    of this job owns (``skipped``). DeepSpeed's load already put rank 0's share in: it is replaced whole."""
    if optimizer is None or not optimizer_parameters:
        return
    saved_by = manifest.get(MANIFEST_KEY, {}).get("ranks") or []
    named = by_name.merged_shard_state(directory, len(saved_by))
    kept = {
        "state": {k: v for k, v in named["state"].items() if k not in skipped},
        "param_groups": named["param_groups"],
    }
    optimizer.load_state_dict(by_name.indexed_optimizer_state(kept, list(optimizer_parameters)))
