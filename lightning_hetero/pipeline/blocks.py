"""Measure: what each block of the pipeline's chain costs on this rank's device (time, parameter and activation
memory), from the user's own ``training_step`` on real samples, before the model is split.

Forward time per block from hooks around it; backward time per block from when the gradient reaches its output to
when it reaches the previous block's output (the first block's ends with the backward). The modules outside the
chain take the rest of the step. Activation memory is what autograd saves for the backward while the block runs.
Times are this rank's compute clock, stretched by an emulated speed like the profile's
(:mod:`lightning_hetero.measure.profiler`), and the fastest of a few repeats; everything is put back after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

import psutil
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hetero.emulate.slowdown import SlowdownEmulator, compute_clock
from lightning_hetero.measure.profiler import (
    DistinctSavedBytes,
    loss_of,
    preserved_training_state,
    training_step_in_isolation,
)
from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM

ADAM_COPIES = 4  # parameters, gradients and Adam's two moments: what a block's parameters cost in training


@dataclass(frozen=True)
class BlockMeasurement:
    """One rank's costs of each block, per sample; ``before_seconds``: the forward before the chain (every stage
    runs it), ``after_seconds``: what follows the chain, forward and backward, and the loss (the last stage's)."""

    seconds: tuple[float, ...]
    parameter_bytes: tuple[int, ...]
    activation_bytes: tuple[int, ...]
    before_seconds: float
    after_seconds: float
    outside_bytes: int
    memory_bytes: Optional[int]  # what the device may hold (free memory, with headroom)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlockMeasurement:
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**fields)


def measure_blocks(
    module: LightningModule,
    blocks: Sequence[nn.Module],
    batch: Any,
    samples: int,
    device: torch.device,
    emulator: Optional[SlowdownEmulator] = None,
    repeats: int = 8,
) -> BlockMeasurement:
    """Time and size each of ``blocks`` (the chain, in order) in ``module.training_step(batch, 0)``."""
    clock = compute_clock(device)
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    count = len(blocks)
    best_forward = [float("inf")] * count
    best_backward = [float("inf")] * count
    best_before = float("inf")
    best_after = float("inf")
    saved = [0] * (count + 1)  # the last entry: outside the chain

    def one_step() -> None:
        nonlocal best_before, best_after
        forward_start: dict[int, float] = {}
        forward_end: dict[int, float] = {}
        forward = [0.0] * count
        gradient_at: dict[int, float] = {}  # when the gradient reached block b's output
        current = [count]
        saved_now = [0] * (count + 1)
        handles = []

        counter = DistinctSavedBytes()

        def pack(tensor: Tensor) -> Tensor:
            # Each storage once (an in-place output the next block saves too), to the block that saved it first.
            before_bytes = counter.bytes
            counter.pack(tensor)
            saved_now[current[0]] += counter.bytes - before_bytes
            return tensor

        for index, block in enumerate(blocks):

            def before(_module: nn.Module, _args: Any, index: int = index) -> None:
                synchronize()
                current[0] = index
                forward_start[index] = clock()

            def after(_module: nn.Module, _args: Any, output: Any, index: int = index) -> None:
                synchronize()
                forward_end[index] = clock()
                forward[index] = forward_end[index] - forward_start[index]
                current[0] = count
                if isinstance(output, Tensor) and output.requires_grad:

                    def arrived(gradient: Tensor, index: int = index) -> None:
                        synchronize()
                        gradient_at[index] = clock()

                    output.register_hook(arrived)

            handles += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
        try:
            synchronize()
            begin = clock()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = loss_of(module.training_step(batch, 0))
            synchronize()
            loss_at = clock()
            if loss is not None and loss.requires_grad:
                loss.backward()
            synchronize()
            end = clock()
        finally:
            for handle in handles:
                handle.remove()
        module.zero_grad(set_to_none=True)
        backward = [
            max(0.0, (gradient_at.get(b - 1, end) if b > 0 else end) - gradient_at.get(b, end)) for b in range(count)
        ]
        # (the first block's backward runs until the end: it includes the outside modules' before the chain)
        for b in range(count):
            best_forward[b] = min(best_forward[b], forward[b])
            best_backward[b] = min(best_backward[b], backward[b])
        last = count - 1
        before_chain = forward_start.get(0, end) - begin
        after_chain = (loss_at - forward_end.get(last, loss_at)) + (gradient_at.get(last, loss_at) - loss_at)
        best_before, best_after = min(best_before, before_chain), min(best_after, after_chain)
        saved[:] = saved_now

    with preserved_training_state(module, device), training_step_in_isolation(module):
        module.train()
        for _ in range(1 + repeats):
            one_step()
    stretch = 1.0 / emulator.speed if emulator is not None else 1.0
    seconds = tuple(stretch * (f + b) / samples for f, b in zip(best_forward, best_backward))
    return BlockMeasurement(
        seconds=seconds,
        parameter_bytes=tuple(training_bytes(block) for block in blocks),
        activation_bytes=tuple(-(-saved[b] // samples) for b in range(count)),
        before_seconds=stretch * best_before / samples,
        after_seconds=stretch * max(0.0, best_after) / samples,
        outside_bytes=training_bytes(module) - sum(training_bytes(block) for block in blocks),
        memory_bytes=free_memory_bytes(device),
    )


# Where a tensor was made while the whole model runs once: inside block i ("in", i), or after block i finished and
# before the next began ("after", i). Block i's output is retagged ("after", i): what the next stage receives.
Zone = tuple[str, int]


def reads_another_stage_could_hold(producer: Zone, reader: Zone) -> bool:
    """Whether code running in zone ``reader`` reads a tensor made in zone ``producer`` that a stage boundary could
    keep from it: a stage hands the next only its last block's output (and every stage recomputes what runs before
    the chain). Inside block j, what block j made and what followed block j-1's end are at hand; after block k, only
    what followed block k's end."""
    kind, index = reader
    if kind == "in":
        return producer not in (("in", index), ("after", index - 1))
    return producer != ("after", index)


class _Provenance(TorchDispatchMode):
    """Tags every tensor an operation makes with the zone it was made in, and records each read of a tensor from a
    zone the reading zone cannot rely on (:func:`reads_another_stage_could_hold`); before the first block nothing is
    tagged (every stage runs that part)."""

    def __init__(self) -> None:
        super().__init__()
        self.zone: Optional[Zone] = None
        self.tags: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.skips: list[tuple[Zone, Zone]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        zone = self.zone
        if zone is not None:
            for value in tree_leaves((args, kwargs or {})):
                producer = self.tags.get(value) if isinstance(value, Tensor) else None
                if producer is not None and reads_another_stage_could_hold(producer, zone):
                    if (producer, zone) not in self.skips:
                        self.skips.append((producer, zone))
        result = func(*args, **(kwargs or {}))
        if zone is not None:
            for value in tree_leaves(result):
                if isinstance(value, Tensor) and value not in self.tags:
                    self.tags[value] = zone
        return result

    def block_ended(self, index: int, output: Any) -> None:
        for value in tree_leaves(output):
            if isinstance(value, Tensor):
                self.tags[value] = ("after", index)
        self.zone = ("after", index)


def describe_skip(producer: Zone, reader: Zone, names: Sequence[str]) -> str:
    """``block 'a'`` -> ``block 'c'`` in words: where the tensor was made, and where it was read."""
    made = f"inside block {names[producer[1]]!r}" if producer[0] == "in" else f"after block {names[producer[1]]!r}"
    if reader[0] == "in":
        read = f"block {names[reader[1]]!r}"
    elif reader[1] == len(names) - 1:
        read = "the code after the chain (the last stage's)"
    else:
        read = f"the code between block {names[reader[1]]!r} and the next"
    return f"{read} reads a tensor made {made}"


def check_chain_order(
    module: LightningModule,
    blocks: Sequence[nn.Module],
    names: Sequence[str],
    path: str,
    batch: Any,
    device: torch.device,
) -> None:
    """``training_step`` on ``batch`` (no backward, nothing kept) runs each block once, in the chain's order, and no
    block (or the code after one) reads a tensor that an earlier block made other than the previous block's output:
    what a pipeline needs (a stage hands the next only its output). Raises naming the attribute and the blocks."""
    called: list[int] = []
    provenance = _Provenance()

    def starts(index: int) -> None:
        called.append(index)
        provenance.zone = ("in", index)

    handles = [
        block.register_forward_pre_hook(lambda _m, _a, index=index: starts(index)) for index, block in enumerate(blocks)
    ]
    handles += [
        block.register_forward_hook(lambda _m, _a, output, index=index: provenance.block_ended(index, output))
        for index, block in enumerate(blocks)
    ]
    try:
        with preserved_training_state(module, device), training_step_in_isolation(module), torch.no_grad():
            module.train()
            with provenance:
                module.training_step(batch, 0)
    finally:
        for handle in handles:
            handle.remove()
    if called != list(range(len(blocks))):
        shown = [names[i] for i in called]
        if not called:
            what = "runs none of them"
        elif len(set(called)) < len(called):
            what = f"runs block {names[next(i for i in called if called.count(i) > 1)]!r} more than once ({shown})"
        elif sorted(called) != called:
            what = f"runs them out of order ({shown})"
        else:
            what = f"runs only {shown}"
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `training_step` {what} of the {len(blocks)} blocks of `{path}`. A pipeline"
            " needs every block applied once, in the chain's order (each stage hands its output to the next). Apply"
            " them so, or train without `pipeline`."
        )
    if provenance.skips:
        found = "; ".join(describe_skip(producer, reader, names) for producer, reader in provenance.skips[:3])
        raise ValueError(
            f"HeteroStrategy(pipeline=...): a skip connection in the chain `{path}`: {found}. A stage hands the next"
            " only its last block's output, so on another stage that tensor would not be there (the stage would use"
            " its own discarded copy, silently). Pass everything a later block needs through each block's output, or"
            " compute it before the chain (every stage runs that part), or train without `pipeline`."
        )


def training_bytes(module: nn.Module) -> int:
    """What ``module``'s parameters take in training: themselves, their gradients and Adam's two moments."""
    return ADAM_COPIES * sum(p.numel() * p.element_size() for p in module.parameters())


def free_memory_bytes(device: torch.device) -> int:
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
    return int(free * MEMORY_HEADROOM)


def first_batch(loader: Any, samples: int, device: torch.device, move: Callable[[Any, torch.device], Any]) -> Any:
    """``samples`` samples of the training loader's dataset (read directly: the data order is untouched)."""
    dataset, collate = loader.dataset, loader.collate_fn
    return move(collate([dataset[i % len(dataset)] for i in range(samples)]), device)
