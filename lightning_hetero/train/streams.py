"""Train: an ``IterableDataset`` is split by taking each rank's micro-batch from that rank's own stream.

Under DDP each rank iterates its own copy of an IterableDataset, which shards itself (by rank, by worker, by file),
and takes ``batch_size`` samples per step. :class:`HeteroStreamLoader` keeps that and gives rank ``r`` its own
``b_r`` samples per step instead, so a map-style dataset's guarantees become:

* every sample a rank's stream yields is trained on at most once per epoch, in the stream's order;
* the epoch ends for every rank at the first step where some rank's stream has nothing left (without this agreement
  the ranks would run different numbers of steps and wait for each other for ever); the samples the other ranks drew
  for that step are not used, and are counted in :attr:`HeteroStreamLoader.dropped` (the epoch's last steps may be
  short: a rank that gets fewer than ``b_r`` samples trains on what it got, with ``drop_last`` the step is dropped);
* each step's loss weight comes from the samples every rank actually got (one gather of the counts per step, the
  price of streams), so the update is the mean over the step's samples, as for map-style data.

A re-plan changes ``b_r`` between two steps without restarting the streams. A checkpoint records how many samples each
rank has trained on this epoch; a resume on the same number of ranks skips that many in each stream (the stream must
yield the same samples again, as a seeded or file-backed one does); on another number of ranks the streams start the
epoch afresh, with a warning.

Lightning reads an unsized loader one batch ahead (to know which batch is the last), so a batch is drawn a step before
it is trained on. The counts of each drawn batch therefore wait in a queue until the strategy takes them, as the step
that trains on the batch begins (:meth:`HeteroStreamLoader.batch_trained`): the loss weight, the step's record and the
checkpoint's place all follow the batch being trained, not the one drawn ahead.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, default_collate

from lightning_hetero.train.order import checked_new_split

STATE_EPOCH = "epoch"
STATE_TAKEN = "samples_taken_per_rank"  # rank-independent: every rank knows every rank's counts
STATE_SAMPLES_CONSUMED = "global_samples_consumed"
STATE_BATCH_SIZES = "batch_sizes"
# DataLoader arguments carried over to the loader of single samples (batching is ours).
_KEPT_STREAM_SETTINGS = (
    "num_workers",
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


def is_stream(dataloader: Any) -> bool:
    return isinstance(dataloader, DataLoader) and isinstance(dataloader.dataset, IterableDataset)


class StreamSplit:
    """The split a stream loader takes its micro-batches by (what the split follower reads and changes)."""

    def __init__(self, batch_sizes: Sequence[int], rank: int) -> None:
        self.batch_sizes = tuple(int(b) for b in batch_sizes)
        self.rank = rank

    def use_split(self, batch_sizes: Sequence[int]) -> None:
        self.batch_sizes = checked_new_split(self.batch_sizes, batch_sizes)


def _samples_as_they_come(samples: Any) -> Any:
    return samples  # with batch_size=None a DataLoader hands each sample to its collate_fn alone


class HeteroStreamLoader(DataLoader):
    """The user's loader settings over its IterableDataset, batched per rank (see the module docstring).

    ``agree_counts(n)`` gathers every rank's sample count for the step (a collective, called once per step on every
    rank); ``current_epoch()`` is the trainer's epoch; ``on_draw()`` is told of each batch drawn. The strategy calls
    :meth:`batch_trained` as each training step begins.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        batch_sizes: Sequence[int],
        rank: int,
        agree_counts: Callable[[int], list[int]],
        current_epoch: Callable[[], int],
        on_draw: Optional[Callable[[], None]] = None,
    ) -> None:
        kwargs = {key: getattr(dataloader, key) for key in _KEPT_STREAM_SETTINGS if hasattr(dataloader, key)}
        if kwargs.get("num_workers", 0) == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        super().__init__(dataloader.dataset, batch_size=None, collate_fn=_samples_as_they_come, **kwargs)
        self.collate = dataloader.collate_fn if dataloader.batch_size is not None else default_collate
        self.drop_short_steps = bool(getattr(dataloader, "drop_last", False))  # (DataLoader owns drop_last)
        self.hetero_batch_sampler = StreamSplit(batch_sizes, rank)
        self.agree_counts = agree_counts
        self.current_epoch = current_epoch  # the trainer's: Lightning tells a stream's loader no epoch
        self.on_draw = on_draw
        self.epoch = 0
        self._drawn: collections.deque[list[int]] = collections.deque()  # every rank's counts, batch by batch
        self.taken = [0] * len(batch_sizes)  # trained on this epoch, per rank
        self.dropped = 0  # samples drawn but not trained on at the epoch's end (every rank knows all of them)
        self._resume_at: Optional[tuple[int, list[int]]] = None
        self._checkpoint_split: Optional[tuple[int, ...]] = None
        self._said_dropped = False

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        split = self.hetero_batch_sampler
        self.epoch = self.current_epoch()
        skip = 0
        if self._resume_at is not None and self._resume_at[0] == self.epoch:
            self.taken = list(self._resume_at[1])
            skip = self.taken[split.rank]
        else:
            self.taken = [0] * len(split.batch_sizes)
        self._resume_at = None
        self._drawn.clear()
        stream = super().__iter__()
        if skip:
            for _ in itertools.islice(stream, skip):
                pass
        while True:
            wanted = split.batch_sizes[split.rank]  # the split in force when the batch is drawn
            samples = list(itertools.islice(stream, wanted))
            counts = self.agree_counts(len(samples))
            short = any(count < size for count, size in zip(counts, split.batch_sizes))
            if min(counts) == 0 or (self.drop_short_steps and short):
                self._end_epoch(sum(counts))
                return
            self._drawn.append(counts)
            if self.on_draw is not None:
                self.on_draw()
            yield self.collate(samples)

    def batch_trained(self) -> tuple[int, int]:
        """The step training on the oldest batch drawn begins: its (this rank's, every rank's) sample counts."""
        counts = self._drawn.popleft()
        for rank, count in enumerate(counts):
            self.taken[rank] += count
        return counts[self.hetero_batch_sampler.rank], sum(counts)

    def _end_epoch(self, dropped: int) -> None:
        self.dropped += dropped
        if dropped and not self._said_dropped:
            self._said_dropped = True
            rank_zero_warn(
                f"HeteroStrategy: a rank's stream ended while others still had samples: the epoch ends for every rank"
                f" there, and the {dropped} samples drawn for that step are not trained on (counted in the loader's"
                " `dropped`). Give every rank's stream the same length per epoch to use them all."
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            STATE_EPOCH: self.epoch,
            STATE_TAKEN: list(self.taken),
            STATE_SAMPLES_CONSUMED: sum(self.taken),
            STATE_BATCH_SIZES: list(self.hetero_batch_sampler.batch_sizes),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        taken = state_dict.get(STATE_TAKEN)
        if taken is None or STATE_EPOCH not in state_dict:
            raise ValueError(
                f"The checkpoint's training-loader state {state_dict} was not written by HeteroStrategy's stream"
                " loader. Resume from a checkpoint of a HeteroStrategy run on the same IterableDataset."
            )
        if len(taken) != len(self.hetero_batch_sampler.batch_sizes):
            rank_zero_warn(
                f"HeteroStrategy: the checkpoint was taken with {len(taken)} ranks' streams and this job has"
                f" {len(self.hetero_batch_sampler.batch_sizes)}: a stream's place cannot be carried to another rank,"
                f" so epoch {state_dict[STATE_EPOCH]} starts again from the beginning of every stream."
            )
            return
        self._resume_at = (state_dict[STATE_EPOCH], list(taken))
        saved_split = state_dict.get(STATE_BATCH_SIZES)
        self._checkpoint_split = tuple(saved_split) if saved_split is not None else None

    def take_checkpoint_split(self) -> Optional[tuple[int, ...]]:
        split, self._checkpoint_split = self._checkpoint_split, None
        return split
