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


def check_chain_order(
    module: LightningModule,
    blocks: Sequence[nn.Module],
    names: Sequence[str],
    path: str,
    batch: Any,
    device: torch.device,
) -> None:
    """``training_step`` on ``batch`` (no backward, nothing kept) runs each block once, in the chain's order: what a
    pipeline needs (its stages hand their output to the next). Raises naming the attribute and the block."""
    called: list[int] = []
    handles = [
        block.register_forward_pre_hook(lambda _m, _a, index=index: called.append(index))
        for index, block in enumerate(blocks)
    ]
    try:
        with preserved_training_state(module, device), training_step_in_isolation(module), torch.no_grad():
            module.train()
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
