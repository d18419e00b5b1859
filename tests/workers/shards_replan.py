"""Two gloo ranks train with memory-sized shards, re-shard mid-training and train on.

Run by tests/train/test_memory_shards.py.

Each rank trains a small MLP (a frozen layer, a float64 parameter) with Adam on its half of every batch through
:class:`MemoryShards` attached to a stand-in for DeepSpeed's ZeRO-0 engine (its exchange and step, as DeepSpeed calls
them); after 3 steps the rooms change, the shares move (the optimizer state goes to its new owners), and 3 more steps
follow. Rank 0 prints a JSON line: the
shares before and after, each rank's parameters with state, and the largest difference from one process on the
whole batches."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_hetero.split.optimizer_shards import MemoryShards  # noqa: E402

STEPS_BEFORE, STEPS_AFTER = 3, 3


class Network(torch.nn.Module):
    """An MLP with a frozen input layer (no optimizer state, never sent) and a float64 output scale (its own dtype:
    a flat tensor of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.frozen(x)) * self.scale.float()


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return Network()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)) for _ in range(6)]


class Engine:
    """DeepSpeed's ZeRO-0 engine as far as the shards see it: the boundary, the exchange it calls, its step."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def fp16_enabled(self) -> bool:
        return False

    def bfloat16_enabled(self) -> bool:
        return False

    def allreduce_gradients(self) -> None:
        raise AssertionError("replaced by the shards")

    def step(self) -> None:
        self.allreduce_gradients()  # (DeepSpeed's step exchanges when Lightning owns the accumulation)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def rank_main(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(60))
    module = network()
    optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=0.05)
    shards = MemoryShards(rank, 2, stage=2)
    trainer = type("Trainer", (), {"gradient_clip_val": 0.0})()
    shards.start(module, [3000.0, 1000.0], emulated=False, config={}, trainer=trainer)
    before = shards._set.share_bytes()
    engine = Engine(module, optimizer)
    shards.attach(engine, lambda agreed: None)
    line = None
    for step, (x, y) in enumerate(batches()):
        if step == STEPS_BEFORE:
            line = shards.replan([1000.0, 3000.0], optimizer)
        half = slice(4 * rank, 4 * rank + 4)
        torch.nn.functional.mse_loss(module(x[half]), y[half]).backward()
        engine.step()
    after = shards._set.share_bytes()
    names = {id(p): n for n, p in module.named_parameters()}
    held = sorted(names[id(p)] for p in optimizer.state)
    everyone: list = [None, None]
    dist.all_gather_object(everyone, held)
    if rank == 0:
        reference = network()
        reference_optimizer = torch.optim.Adam([p for p in reference.parameters() if p.requires_grad], lr=0.05)
        for x, y in batches():
            torch.nn.functional.mse_loss(reference(x), y).backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        difference = max(
            (p - q).abs().max().item() for p, q in zip(module.parameters(), reference.parameters(), strict=True)
        )
        result = {"before": before, "after": after, "held": everyone, "difference": difference, "line": line}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1],), nprocs=2, join=True)
