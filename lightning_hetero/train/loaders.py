"""Train: the user's loader rebuilt to hand each rank its slice of the global order, and the checks of loaders the
strategy cannot split (described before any collective, so that every rank raises the same error).

:class:`HeteroDataLoader` replaces the user's loader (keeping its settings) and counts the batches it hands to the
loop, which is what a checkpoint records; the order itself is :mod:`lightning_hetero.train.order`."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
)
from torch.utils.data.distributed import DistributedSampler

from lightning_hetero.runtime.randomness import preserved_random_state
from lightning_hetero.split.decisions.split import split_by_weights
from lightning_hetero.train.order import (
    _STATE_KEYS,
    FINGERPRINT_POSITIONS,
    STATE_BATCH_SIZES,
    STATE_EPOCH,
    STATE_NUM_SAMPLES,
    STATE_SAMPLES_CONSUMED,
    STATE_SEED,
    GlobalOrder,
    HeteroBatchSampler,
    epoch_steps,
)


class HeteroDataLoader(DataLoader):
    """The user's DataLoader settings over a :class:`HeteroBatchSampler`, resumable in global samples.

    It counts the batches it yields in the main process (Lightning does not prefetch sized loaders there), so
    ``state_dict()`` is exact even when worker processes read ahead. ``on_batch(local, global)`` is told the sample
    counts of every batch just before the loop receives it: the strategy derives the loss weight from them;
    ``on_fetch()`` just before each batch is fetched (where the step's measurement starts, and where the strategy
    may change the split: a global-batch boundary, reached by every rank at the same step).

    When the split changes, the pass over the data is restarted from the current position with the new split: the
    batches worker processes had read ahead under the old split are discarded (persistent workers are reset, not
    respawned), and the epoch's order is drawn again, the same order (its seed is ``seed + epoch``).
    """

    def __init__(
        self,
        dataset: Any,
        batch_sampler: HeteroBatchSampler,
        on_batch: Optional[Callable[[int, int], None]] = None,
        on_fetch: Optional[Callable[[], None]] = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        self.on_batch = on_batch
        self.on_fetch = on_fetch
        self._epoch_of_position = 0
        self._position = 0
        self._resume_at: Optional[tuple[int, int]] = None  # (epoch, global samples consumed) from a checkpoint
        # The split the checkpoint was taken with, until the strategy takes it (see `take_checkpoint_split`).
        self._checkpoint_split: Optional[tuple[int, ...]] = None

    @property
    def hetero_batch_sampler(self) -> HeteroBatchSampler:
        return self.batch_sampler  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: nothing runs until the first batch is asked for, after Lightning's `set_epoch`.
        sampler = self.hetero_batch_sampler
        start = 0
        if self._resume_at is not None and self._resume_at[0] == sampler.epoch:
            start = self._resume_at[1]
        self._resume_at = None
        steps = sampler.begin_iteration(start)
        self._epoch_of_position, self._position = sampler.epoch, start
        split, batches, index = sampler.batch_sizes, None, 0
        # A re-split keeps the global batches' bounds, so the number of steps left is fixed here.
        for _ in range(len(steps)):
            if self.on_fetch is not None:
                self.on_fetch()
            if sampler.batch_sizes != split:
                split, batches, index = sampler.batch_sizes, None, 0
                steps = sampler.begin_iteration(self._position)
            if batches is None:  # started at the first fetch, so a re-split there costs no discarded read-ahead
                batches = super().__iter__()
            step = steps[index]
            index += 1
            batch = next(batches)
            self._position = step.end
            if self.on_batch is not None:
                self.on_batch(step.sizes[sampler.rank], step.global_size)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        order = self.hetero_batch_sampler.sampler
        return {
            STATE_EPOCH: self._epoch_of_position,
            STATE_SAMPLES_CONSUMED: self._position,
            STATE_NUM_SAMPLES: len(order),
            STATE_SEED: order.seed,
            STATE_BATCH_SIZES: list(self.hetero_batch_sampler.batch_sizes),
        }

    def take_checkpoint_split(self) -> Optional[tuple[int, ...]]:
        """The split recorded in the checkpoint this loader was restored from (once; None otherwise).

        The loader does not apply it itself: whether a resumed fit keeps it (re-planning on) or the split the user
        fixed is the strategy's decision.
        """
        split, self._checkpoint_split = self._checkpoint_split, None
        return split

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(
                f"The checkpoint's training-loader state {state_dict} lacks {missing}: it was not written by"
                " HeteroStrategy's loader. Resume from a checkpoint of a HeteroStrategy run, or start a new run."
            )
        order = self.hetero_batch_sampler.sampler
        if state_dict[STATE_NUM_SAMPLES] != len(order):
            raise ValueError(
                f"The checkpoint was taken with a training set of {state_dict[STATE_NUM_SAMPLES]} samples but the"
                f" loader now has {len(order)}: the saved position would point at other samples. Resume with the"
                " same dataset."
            )
        if order.shuffles and state_dict[STATE_SEED] != order.seed:
            raise ValueError(
                f"The checkpoint's shuffle seed is {state_dict[STATE_SEED]} but this run's is {order.seed}: the"
                f" remaining samples of the epoch would differ. Call `seed_everything({state_dict[STATE_SEED]})`"
                " before building the Trainer (the seed comes from PL_GLOBAL_SEED)."
            )
        consumed = state_dict[STATE_SAMPLES_CONSUMED]
        if not 0 <= consumed <= len(order):
            raise ValueError(f"The checkpoint's `{STATE_SAMPLES_CONSUMED}={consumed}` is outside [0, {len(order)}].")
        self._resume_at = (state_dict[STATE_EPOCH], consumed)
        saved_split = state_dict.get(STATE_BATCH_SIZES)
        self._checkpoint_split = tuple(saved_split) if saved_split is not None else None
        self._epoch_of_position, self._position = self._resume_at


# DataLoader arguments carried over from the user's loader (everything except how batches are formed).
_KEPT_LOADER_SETTINGS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def describe_unsupported_loader(dataloader: DataLoader, name: str) -> Optional[str]:
    """Why this loader cannot be split by HeteroStrategy, or None when it can."""
    if isinstance(dataloader.dataset, IterableDataset):
        if dataloader.batch_size is None:
            return (
                f"The {name} has an IterableDataset ({type(dataloader.dataset).__name__}) and `batch_size=None`:"
                " HeteroStrategy forms each rank's micro-batch from the samples its stream yields. Give the loader a"
                " `batch_size` (and a stream of single samples)."
            )
        return None  # each rank takes its micro-batch from its own stream (see lightning_hetero.train.streams)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        return (
            f"The {name} has `batch_size=None` (automatic batching off), so there is no global batch to split."
            " Give it a `batch_size`."
        )
    if type(batch_sampler) is not BatchSampler:
        return (
            f"The {name} has a custom `batch_sampler` ({type(batch_sampler).__name__}). HeteroStrategy forms the"
            " global batches itself; give the loader a `sampler` (the order) and a `batch_size` instead."
        )
    if isinstance(batch_sampler.sampler, DistributedSampler):
        return (
            f"The {name} uses a {type(batch_sampler.sampler).__name__}, which gives every rank a different shard;"
            " HeteroStrategy needs the same order on every rank and shards it itself. Use `shuffle=True` (or the"
            " sampler you would wrap) instead of the DistributedSampler."
        )
    return None


def describe_empty_epoch(dataloader: DataLoader, global_batch: int, world_size: int, name: str) -> Optional[str]:
    """Why an epoch of this (map-style, batching) loader holds no step in which every rank gets a sample; None when
    it holds one. Without the check such a fit trains 0 steps and ends as if it had succeeded."""
    batch_sampler = dataloader.batch_sampler
    assert isinstance(batch_sampler, BatchSampler)  # checked by describe_unsupported_loader
    samples = len(batch_sampler.sampler)  # type: ignore[arg-type]  # (torch's Sampler declares no __len__)
    drop_last = batch_sampler.drop_last
    if epoch_steps(samples, split_by_weights(global_batch, [1] * world_size), drop_last):
        return None
    if samples == 0:
        why = "its dataset (or sampler) is empty"
    elif drop_last:
        why = f"it has {_samples(samples)}, fewer than the global batch of {global_batch}, and `drop_last=True` drops"
        why += " them"
    else:
        why = f"it has {_samples(samples)}, fewer than the {world_size} ranks, so no step can give every rank one"
    return f"The {name} gives no training step: {why}. Give it more samples (or fewer ranks, or a smaller batch)."


def _samples(count: int) -> str:
    return f"{count} sample{'' if count == 1 else 's'}"


def only_loader(loaders: Any) -> Any:
    """The one loader of ``train_dataloader()``'s result (a DataLoader, or one inside a dict, list or CombinedLoader);
    the result itself when it holds several or none."""
    if isinstance(loaders, DataLoader):
        return loaders
    from lightning.pytorch.utilities import CombinedLoader

    flattened = loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened
    return flattened[0] if len(flattened) == 1 else loaders


def describe_several_training_loaders(loaders: Any) -> Optional[str]:
    """Why ``train_dataloader()``'s result cannot be split (several loaders); None for a single one."""
    if isinstance(loaders, DataLoader):
        return None
    from lightning.pytorch.utilities import CombinedLoader

    flattened = loaders.flattened if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders).flattened
    if len(flattened) < 2:
        return None
    iterables = loaders.iterables if isinstance(loaders, CombinedLoader) else loaders
    keys = list(iterables.keys()) if isinstance(iterables, dict) else None
    which = f"a dict of {len(flattened)} loaders ({', '.join(map(str, keys))})" if keys else f"{len(flattened)} loaders"
    return (
        f"The training data is {which}. HeteroStrategy gives each rank its own share of one global batch and weights"
        " its loss by that share; a loss combining batches of several loaders (each split in its own proportions) has"
        " no weight that makes the update DDP's, so it would train differently without a word. Combine them into one"
        " Dataset (one whose samples hold an item of each, or a ConcatDataset) and one DataLoader."
    )


def loader_batch_size(dataloader: DataLoader) -> Optional[int]:
    batch_sampler = dataloader.batch_sampler
    return getattr(batch_sampler, "batch_size", None) if batch_sampler is not None else None


def rebuild_loader(
    dataloader: DataLoader,
    batch_sizes: Sequence[int],
    rank: int,
    seed: int,
    on_batch: Optional[Callable[[int, int], None]] = None,
    on_fetch: Optional[Callable[[], None]] = None,
    pad: bool = False,
) -> HeteroDataLoader:
    """A :class:`HeteroDataLoader` with the user's settings, order and ``drop_last``, cut by ``batch_sizes``.

    ``pad`` (evaluation, with equal ``batch_sizes``): unless the loader drops its last batch, the order is padded to a
    multiple of the world size as DDP's DistributedSampler pads it, so every step gives every rank as many samples
    (a user's ``self.all_gather`` needs equal shapes)."""
    user_batch_sampler = dataloader.batch_sampler
    assert isinstance(user_batch_sampler, BatchSampler)  # checked by describe_unsupported_loader
    drop_last = user_batch_sampler.drop_last
    pad_to = len(batch_sizes) if pad and not drop_last else 1
    batch_sampler = HeteroBatchSampler(
        GlobalOrder(user_batch_sampler.sampler, seed, pad_to), batch_sizes, rank, drop_last=drop_last
    )
    return HeteroDataLoader(
        dataloader.dataset, batch_sampler, on_batch=on_batch, on_fetch=on_fetch, **kept_loader_settings(dataloader)
    )


def kept_loader_settings(dataloader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader arguments a rebuilt loader keeps (all but how batches are formed)."""
    kwargs = {key: getattr(dataloader, key) for key in _KEPT_LOADER_SETTINGS if hasattr(dataloader, key)}
    if kwargs.get("num_workers", 0) == 0:
        # DataLoader refuses these with no workers, even at their defaults.
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    return kwargs


def describe_order(loader: HeteroDataLoader) -> dict[str, Any]:
    """What this rank's loader will cut, to compare across ranks before training on it.

    The dataset length, the samples and steps of an epoch, and a fingerprint of the first positions of epoch 0's
    order: ranks that differ in any of them would use some samples twice and others never (or run different
    numbers of steps and hang in a collective). Drawing the order leaves the global random generators and the
    sampler's own generator as they were.
    """
    batch_sampler = loader.hetero_batch_sampler
    order = GlobalOrder(batch_sampler.sampler.user_sampler, batch_sampler.sampler.seed)  # epoch 0, a fresh copy
    # A custom sampler is iterated itself: its own generator is put back too (other state it keeps cannot be).
    generator = getattr(order.user_sampler, "generator", None)
    saved = (generator, generator.get_state()) if isinstance(generator, torch.Generator) else None
    try:
        with preserved_random_state():
            first = [int(index) for index in itertools.islice(iter(order), FINGERPRINT_POSITIONS)]
    finally:
        if saved is not None:
            saved[0].set_state(saved[1])
    return {
        "dataset_length": len(loader.dataset),  # type: ignore[arg-type]  # (torch's Dataset declares no __len__)
        "samples_per_epoch": len(order),
        "steps_per_epoch": len(batch_sampler),
        "order_fingerprint": hashlib.sha256(repr(first).encode()).hexdigest()[:16],
    }
