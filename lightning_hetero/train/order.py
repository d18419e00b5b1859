"""Train: the data order that gives each rank its slice of every global batch.

The order of an epoch is the same on every rank (the user's sampler, made rank-independent). It is cut into global
batches of ``B`` samples; rank ``r`` takes the contiguous slice after ranks ``< r``. Positions are counted in GLOBAL
samples, so a resumed run keeps its place even when the split or the world size changed.

Lightning never sees these samplers directly: :class:`HeteroDataLoader` replaces the user's loader (keeping its
settings) and counts the batches it hands to the loop, which is what a checkpoint records.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import (
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_hetero.split.decisions.planner import MIN_SAMPLES_PER_RANK
from lightning_hetero.split.decisions.split import split_by_weights

# Keys of the loader state saved in Lightning's checkpoint. No key depends on the rank: DeepSpeed writes the client
# state from data-parallel rank 0 only and every rank reads that one file.
STATE_EPOCH = "epoch"
STATE_SAMPLES_CONSUMED = "global_samples_consumed"
STATE_NUM_SAMPLES = "num_samples"
STATE_SEED = "seed"
_STATE_KEYS = (STATE_EPOCH, STATE_SAMPLES_CONSUMED, STATE_NUM_SAMPLES, STATE_SEED)
# The split in use when the checkpoint was taken (a re-plan may have changed it); absent from older checkpoints.
STATE_BATCH_SIZES = "batch_sizes"
# torch's samplers that draw from their `generator` (or, without one, from the global RNG, which drifts apart between
# ranks): GlobalOrder iterates a copy seeded with ``seed + epoch`` so that every rank draws the same order.
_SEEDED_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
# Positions of an epoch's order that are hashed to compare ranks: enough to tell two shuffles (or two datasets in a
# different order) apart, and cheap for any dataset size.
FINGERPRINT_POSITIONS = 4096


@dataclass(frozen=True)
class GlobalStep:
    """One global batch: positions ``[begin, begin + sum(sizes))`` of the epoch order, ``sizes[r]`` for rank ``r``."""

    begin: int
    sizes: tuple[int, ...]

    @property
    def global_size(self) -> int:
        return sum(self.sizes)

    @property
    def end(self) -> int:
        return self.begin + self.global_size

    def positions(self, rank: int) -> range:
        start = self.begin + sum(self.sizes[:rank])
        return range(start, start + self.sizes[rank])


def epoch_steps(num_samples: int, batch_sizes: Sequence[int], drop_last: bool, start: int = 0) -> list[GlobalStep]:
    """The global batches of one epoch over ``num_samples`` positions, beginning at position ``start``.

    Full batches carry exactly ``batch_sizes``. A last batch shorter than ``B`` is dropped when ``drop_last``;
    otherwise it is split in the same proportions with at least one sample per rank. When it holds fewer samples
    than there are ranks it cannot give every rank one, so it joins the previous batch instead of being dropped.
    Every rank computes the same list, so all run the same number of steps and every position is used once.
    """
    global_batch = sum(batch_sizes)
    world_size = len(batch_sizes)
    bounds = list(range(start, num_samples, global_batch))
    steps = [(begin, min(begin + global_batch, num_samples)) for begin in bounds]
    if steps and steps[-1][1] - steps[-1][0] < global_batch:
        begin, end = steps.pop()
        if not drop_last:
            if end - begin < world_size and steps:
                begin = steps.pop()[0]
            if end - begin >= world_size:
                steps.append((begin, end))
    return [
        GlobalStep(
            begin,
            tuple(batch_sizes)
            if end - begin == global_batch
            else tuple(split_by_weights(end - begin, batch_sizes, _short_batch_floor(end - begin, batch_sizes))),
        )
        for begin, end in steps
    ]


def _short_batch_floor(samples: int, batch_sizes: Sequence[int]) -> int:
    """The fewest samples a rank takes of an epoch's short last batch: 2 where the split gives every rank 2 or more
    and the batch has 2 for each (a BatchNorm that is not synchronized fails on one sample), else 1."""
    floor = MIN_SAMPLES_PER_RANK
    return floor if min(batch_sizes) >= floor and samples >= floor * len(batch_sizes) else 1


def checked_new_split(current: Sequence[int], new: Sequence[int]) -> tuple[int, ...]:
    """``new`` as a tuple, if it can replace ``current``: the same ranks and global batch, every rank a sample."""
    sizes = tuple(int(b) for b in new)
    if len(sizes) != len(current) or sum(sizes) != sum(current) or min(sizes) < 1:
        raise ValueError(
            f"a new split {list(sizes)} must give each of the {len(current)} ranks at least one sample"
            f" and sum to the global batch {sum(current)}"
        )
    return sizes


class GlobalOrder(Sampler[int]):
    """The user's sampler made identical on every rank, with a new order per epoch where it shuffles.

    A ``RandomSampler``, ``SubsetRandomSampler`` or ``WeightedRandomSampler`` draws from a generator seeded with
    ``seed + epoch`` (its other settings are kept); any other sampler is iterated as it is and must itself give every
    rank the same order (``set_epoch`` is forwarded). With ``pad_to`` the order is lengthened to a multiple of it by
    repeating its first samples, as DDP's DistributedSampler pads (evaluation: every rank gets as many samples).
    """

    def __init__(self, sampler: Union[Sampler[int], Iterable[int]], seed: int = 0, pad_to: int = 1) -> None:
        self.user_sampler = sampler
        self.seed = seed
        self.pad_to = pad_to
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        forward = getattr(self.user_sampler, "set_epoch", None)
        if callable(forward):
            forward(epoch)

    @property
    def shuffles(self) -> bool:
        return isinstance(self.user_sampler, _SEEDED_SAMPLERS)

    def __iter__(self) -> Iterator[int]:
        sampler = self.user_sampler
        if isinstance(sampler, _SEEDED_SAMPLERS):
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            seeded = copy.copy(sampler)  # same settings, our generator; the user's sampler is left untouched
            seeded.generator = generator
            sampler = seeded
        padding = len(self) - len(self.user_sampler)  # type: ignore[arg-type]  # (a map-style order: it has one)
        if not padding:
            return iter(sampler)
        order = list(sampler)
        return iter(order + (order * (padding // len(order) + 1))[:padding])

    def __len__(self) -> int:
        samples = len(self.user_sampler)  # type: ignore[arg-type]  # (a map-style order: it has one)
        return -(-samples // self.pad_to) * self.pad_to if samples else 0


class HeteroBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of every global batch of the epoch (dataset indices)."""

    def __init__(self, order: GlobalOrder, batch_sizes: Sequence[int], rank: int, drop_last: bool) -> None:
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank {rank} is outside the split {list(batch_sizes)}")
        self.sampler = order  # the attribute Lightning's `_set_sampler_epoch` looks for
        self.batch_sizes = tuple(batch_sizes)
        self.rank = rank
        self.drop_last = drop_last
        self._steps: Optional[list[GlobalStep]] = None

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def use_split(self, batch_sizes: Sequence[int]) -> None:
        """Cut the global batches with ``batch_sizes`` from now on (same world size, same global batch).

        The loader notices before its next batch and cuts the rest of the epoch anew from its position; the global
        batches keep their positions, so every sample is still used once and the step count is unchanged.
        """
        self.batch_sizes = checked_new_split(self.batch_sizes, batch_sizes)

    def steps(self, start: int = 0) -> list[GlobalStep]:
        return epoch_steps(len(self.sampler), self.batch_sizes, self.drop_last, start)

    def begin_iteration(self, start: int = 0) -> list[GlobalStep]:
        """Fix the steps of the next ``__iter__`` (the loader calls this to count what it hands out)."""
        self._steps = self.steps(start)
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        steps = self._steps if self._steps is not None else self.steps()
        self._steps = None
        if not steps:
            return
        order = list(self.sampler)
        for step in steps:
            yield [order[p] for p in step.positions(self.rank)]

    def __len__(self) -> int:
        """Steps in a whole epoch (Lightning counts a resumed epoch from its beginning)."""
        return len(self.steps())


def local_seed() -> int:
    """This rank's `seed_everything` seed (Lightning keeps it in PL_GLOBAL_SEED), 0 when none was set."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def agreed_seed(seeds: list[int]) -> int:
    """Rank 0's seed, for the data order of every rank; different seeds on other ranks are said, not used.

    A per-rank seed (``seed_everything(seed + rank)``, for different augmentations) is legitimate, but the epoch order
    must be the same on every rank or samples are used twice and others never.
    """
    if any(seed != seeds[0] for seed in seeds):
        per_rank = ", ".join(f"rank {rank}: {seed}" for rank, seed in enumerate(seeds))
        rank_zero_warn(
            f"HeteroStrategy: `seed_everything` gave the ranks different seeds ({per_rank}). The data order uses rank"
            f" 0's seed {seeds[0]} on every rank, so that each sample is used once per epoch; the other random"
            " numbers (dropout, augmentations) keep each rank's own seed."
        )
    return seeds[0]
