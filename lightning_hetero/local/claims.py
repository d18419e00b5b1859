"""Train: local SGD / DiLoCo merged asynchronously by speed (``sync_options={"asynchronous": True}``).

In the synchronous local modes every rank takes its planned inner steps per training step, so a rank that slows
down after the plan makes the others wait at every step until the inner steps are re-planned. Here no rank waits for
another between merges, and a rank that is slow contributes what it has:

- **Claims.** The epoch's shared order is cut into micro-batches of the loader's batch size
  (:mod:`~lightning_hetero.local.claim_decisions`). Each rank trains its own first one, then asks a counter in the job's
  rendezvous store for the next (one ``add`` a micro-batch), so each rank trains as many as its speed allows and every
  micro-batch is trained once an epoch.
- **No collective between merges.** A training step is one micro-batch on each rank, and the ranks' steps are not
  in step: the per-step agreements of the synchronous modes move to the merges (the stop on SIGTERM, rank 0's
  buffers) or stay on the rank (a ``sync_dist`` value logged in ``training_step`` is the rank's own; epoch values
  are reduced across ranks at the epoch's end as before).
- **Merges.** Merge ``m`` falls at claim ``m * sync_every * world_size`` (as many samples between merges as the
  synchronous modes with one inner step per rank), and no rank trains that claim or a later one before the merge.
  Before training a micro-batch each rank reads the counter: it joins a merge whose claim another rank drew at once,
  and one whose claim it drew itself when it reaches it (:func:`~.claim_decisions.merges_to_join`). So
  the merge's collectives wait for the last rank to finish the micro-batch it is in, no more (at an epoch's end a
  slower rank leaves the last claims to faster ones, :func:`~.claim_decisions.leaves_the_rest`, or it
  would also hold the one Lightning read ahead for it; a rank at least twice as fast takes that one over if it is
  not started, :func:`~.claim_decisions.takes_over_read_ahead`, and the slower rank steps through it
  training nothing). Each rank's progress is weighted by the samples it trained
  since the last merge (one all-reduce of the counts), so a rank that slowed contributes fewer samples, not stale
  ones: every rank trained from the same merged parameters. The epoch's end merges what is left, so validation and
  checkpoints see one model.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any, Optional

from torch.utils.data import DataLoader, Sampler

from lightning_hetero.local.claim_counter import ClaimCounter
from lightning_hetero.local.claim_decisions import (
    claim_positions,
    claims_in_epoch,
    leaves_the_rest,
    merge_summary,
    merges_due,
    merges_to_join,
    others_per_micro_batch,
    takes_over_read_ahead,
)
from lightning_hetero.local.merges import LocalTraining
from lightning_hetero.split.steps import RankParts
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.loaders import HeteroDataLoader, kept_loader_settings
from lightning_hetero.train.micro_batches import split_batch
from lightning_hetero.train.streams import HeteroStreamLoader

RATE_DRAWS = 9  # a rank's last draws, whose intervals clear of a merge measure how fast the others draw


class ClaimingBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches of the epoch: its own first claim, then whatever the counter hands it, then at the
    epoch's end any claim it takes over from a slower rank (also in :attr:`taken_over`). The claims it yields are
    queued in :attr:`pending` (in order), for the loader to tell which claim each batch came from."""

    def __init__(
        self,
        order: Any,
        micro_batch: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        counter: ClaimCounter,
        epoch_of: Optional[Callable[[], int]] = None,
        merge_every: Optional[int] = None,
    ) -> None:
        self.sampler, self.micro_batch, self.drop_last, self.merge_every = order, micro_batch, drop_last, merge_every
        self.rank, self.world_size, self.counter, self.epoch_of = rank, world_size, counter, epoch_of
        self.pending: collections.deque[int] = collections.deque()
        self.taken_over: set[int] = set()
        self.started: list[int] = []  # (the claims of the epoch this rank started, whose keys it forgets at the end)

    # (named `sampler` as a BatchSampler's is: Lightning's `_set_sampler_epoch` finds the order's set_epoch there)

    @property
    def epoch(self) -> int:
        return int(self.sampler.epoch)

    def claims(self) -> int:
        return claims_in_epoch(len(self.sampler), self.micro_batch, self.drop_last)

    def begin_epoch(self) -> None:
        """Before an epoch's first batch: its number (``epoch_of``), which names its counter and seeds its order. (A
        resumed fit reads ahead of a loader without a length before Lightning sets the epoch.)"""
        if self.epoch_of is not None:
            self.sampler.set_epoch(self.epoch_of())
        self.pending.clear()
        self.taken_over.clear()
        self.started.clear()

    def __iter__(self) -> Iterator[list[int]]:
        positions = list(iter(self.sampler))
        total, epoch = self.claims(), self.epoch
        if self.rank < min(self.world_size, total):
            self.pending.append(self.rank)
            yield [positions[p] for p in claim_positions(self.rank, self.micro_batch, len(positions))]
        draws: list[int] = []  # (this rank's last draws from the counter)
        published = 0  # (the latest told to the others, plus one)
        to_the_end = False  # (refused leave: the last rank to ask draws every claim left)
        while True:
            if not to_the_end and self._would_leave_the_rest(draws, total, epoch):
                if self.counter.leave(epoch, self.world_size):
                    return
                to_the_end = True
            claim = self.world_size + self.counter.take(epoch)
            draws = [*draws[1 - RATE_DRAWS :], claim]
            if claim >= total:
                yield from self._take_over(positions, total, epoch, others_per_micro_batch(draws, self.merge_every))
                return
            self.pending.append(claim)
            published = self.counter.publish_ahead(epoch, self.rank, claim, published)
            yield [positions[p] for p in claim_positions(claim, self.micro_batch, len(positions))]

    def given_away(self, claim: int) -> bool:
        """As this rank starts ``claim``: whether a faster rank took it over (not its own first, or one it took)."""
        if claim < self.world_size or claim in self.taken_over:
            return False
        if self.counter.start(self.epoch, claim):
            self.started.append(claim)
            return False
        return True

    def _take_over(self, positions: list[int], total: int, epoch: int, rate: Optional[float]) -> Iterator[list[int]]:
        """Every claim of the epoch is drawn: take over, one at each read-ahead, the claim each slower rank drew last
        if it has not started it (:func:`~.claim_decisions.takes_over_read_ahead`)."""
        if not takes_over_read_ahead(rate):
            return
        for other in range(self.world_size):
            claim = self.counter.ahead_of(epoch, other) if other != self.rank else None
            if claim is not None and claim < total and self.counter.start(epoch, claim):
                self.taken_over.add(claim)
                self.started.append(claim)
                self.pending.append(claim)
                yield [positions[p] for p in claim_positions(claim, self.micro_batch, len(positions))]

    def _would_leave_the_rest(self, draws: list[int], total: int, epoch: int) -> bool:
        """:func:`~.claim_decisions.leaves_the_rest` for the claims left undrawn, read from the counter
        (a round trip) near the epoch's end only: the others draw about ``rate`` before this rank's next draw."""
        rate = others_per_micro_batch(draws, self.merge_every)
        if rate is None or total - 1 - draws[-1] > 4 * rate + 2:
            return False
        return leaves_the_rest(total - self.world_size - self.counter.taken(epoch), rate, self.world_size - 1)


class ClaimingDataLoader(DataLoader):
    """The user's loader settings over a :class:`ClaimingBatchSampler`. It has no length (each rank's count of
    micro-batches is known only at the epoch's end), so Lightning ends the epoch when it is exhausted and validates
    then. ``on_start()`` is told when an epoch's first batch is asked for, ``on_batch(claim)`` the claim of each batch
    as the loop receives it, ``on_empty()`` when an epoch ends before this rank received any (it still joins
    the merges; the setup refuses an epoch of fewer micro-batches than ranks, so every rank has its own first)."""

    def __init__(
        self,
        dataset: Any,
        batch_sampler: ClaimingBatchSampler,
        on_start: Callable[[], None],
        on_batch: Callable[[int], None],
        on_empty: Callable[[], None],
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_sampler=batch_sampler, **loader_kwargs)
        self.on_start, self.on_batch, self.on_empty = on_start, on_batch, on_empty

    @property
    def claiming_sampler(self) -> ClaimingBatchSampler:
        return self.batch_sampler  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: nothing runs until the first batch is asked for. The epoch is begin_epoch's: a resumed fit asks
        # for it before Lightning's `set_epoch`.
        sampler = self.claiming_sampler
        sampler.begin_epoch()
        self.on_start()
        received = 0
        for batch in super().__iter__():  # (batches come back in the order the sampler drew them)
            claim = sampler.pending.popleft()
            received += 1
            self.on_batch(claim)
            yield batch
        if received == 0:
            self.on_empty()


# The training loaders the strategy built: handed to it again (a reload), they are kept as they are.
REBUILT_LOADERS = (HeteroDataLoader, HeteroStreamLoader, ClaimingDataLoader)


class AsynchronousMerges:
    """When this rank joins the merges of an epoch, and what each merge cost it.

    ``merge()`` runs one merge on this rank (the ranks' collectives; every rank runs the same sequence of them: the
    merges of an epoch in order, then the epoch's last). ``taken(epoch)`` reads the counter."""

    def __init__(
        self,
        sync_every: int,
        world_size: int,
        taken: Callable[[int], int],
        merge: Callable[[], None],
        link_clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.every = sync_every * world_size  # claims between two merges
        self.world_size, self._taken, self._merge, self._link_clock = world_size, taken, merge, link_clock
        self.epoch, self.claims = 0, 0
        self.joined = 0  # merges of this epoch this rank joined
        self.trained = 0  # micro-batches this rank trained since the last merge
        self.gave_away = self.took_over = 0  # claims it left to a faster rank, or took from a slower, since then
        self.finished = True  # the epoch's last merge is done
        self._since = self._step_started = time.perf_counter()  # (the last merge's end or the epoch's start; and
        # the start of this rank's last micro-batch)
        # One record per merge: the micro-batches this rank contributed, the seconds it spent in the merge (its wait
        # for the last rank to reach it, and the exchange), of those the exchange's (``link_clock``'s), this rank's
        # mean seconds from one micro-batch to the next since the last merge (the loop's own time included), and from
        # the start of its last micro-batch to the merge (what the others wait for at most, if it arrives last)
        self.records: list[dict[str, Any]] = []

    def epoch_starts(self, epoch: int, claims: int) -> None:
        self.epoch, self.claims = epoch, claims
        self.joined, self.finished = 0, False
        self._since = time.perf_counter()

    def before_micro_batch(self, claim: int, held: Collection[int], trains: bool = True) -> None:
        """Before this rank trains claim ``claim`` (``held``: every claim it drew and has not trained, ``claim``
        included; ``trains`` False: a faster rank took it over): the merges it joins now
        (:func:`~.claim_decisions.merges_to_join`)."""
        drawn = self.world_size + self._taken(self.epoch)  # (each rank's own first claim, and the counter's)
        due = merges_to_join(claim, drawn, held, self.joined, self.every, self.claims)
        for _ in range(due):
            self._run_merge()
            self.joined += 1
        if trains:
            self._step_started = time.perf_counter()

    def micro_batch_trained(self) -> None:
        self.trained += 1

    def epoch_ends(self) -> None:
        """This rank trained its last micro-batch of the epoch (or had none): the merges it has not joined, then the
        epoch's last, so that every rank holds the same parameters."""
        if self.finished:
            return
        remaining = merges_due(self.claims, self.joined, self.every, self.claims)
        for _ in range(remaining + 1):
            self._run_merge()
        self.joined += remaining
        self.finished = True

    def _run_merge(self) -> None:
        started, link = time.perf_counter(), self._link_clock()
        cycle = (started - self._since) / self.trained if self.trained else None
        step = started - self._step_started if self.trained else None
        self._merge()
        self._since = time.perf_counter()
        self.records.append(
            {
                "epoch": self.epoch,
                "micro_batches": self.trained,
                "seconds": self._since - started,
                "link_seconds": self._link_clock() - link,
                "cycle_seconds": cycle,
                "last_step_seconds": step,
                "gave_away": self.gave_away,
                "took_over": self.took_over,
            }
        )
        self.trained = self.gave_away = self.took_over = 0


class AsynchronousTraining:
    """The rank's side of the asynchronous merges: the training loader that claims, the merges at step boundaries,
    and what stays on the rank meanwhile. ``parts``: the rank's (:class:`~lightning_hetero.split.steps.RankParts`);
    ``local``: the merges' state; ``batch_ready(local, global)``: a micro-batch's samples told to the loss weights and
    the watch; ``buffer_sync()``: rank 0's buffers' sync, sent at each merge (None: none)."""

    def __init__(
        self,
        parts: RankParts,
        local: LocalTraining,
        sync_every: int,
        batch_ready: Callable[[int, int], None],
        buffer_sync: Callable[[], Optional[BufferSync]],
    ) -> None:
        self._parts, self._local, self._sync_every = parts, local, sync_every
        self._batch_ready, self._buffer_sync = batch_ready, buffer_sync
        self.merges = AsynchronousMerges(sync_every, 1, lambda epoch: 0, self._merge)
        # The claims of the batches handed to the loop and not yet trained (Lightning draws one a step ahead of an
        # unsized loader, so a step's counts are taken when it starts, as for a stream)
        self._handed: collections.deque[int] = collections.deque()
        self._sampler: Optional[ClaimingBatchSampler] = None
        self._store: Any = None
        self._run = ""  # the trainer call whose loader claims (liveness.run_id)
        self.given_away = False  # the micro-batch about to be trained went to a faster rank (received)

    def loader(self, hetero_loader: Any, trainer: Any, run: str, connect: Callable[[], Any]) -> ClaimingDataLoader:
        """The training loader rebuilt to claim its micro-batches (``hetero_loader``: the strategy's, whose order,
        settings and checks it keeps; ``connect`` opens a client of the job's store)."""
        parts = self._parts
        self._handed.clear()
        if self._store is None:
            self._store = connect()
        counter = ClaimCounter(self._store.add, run, getattr(self._store, "delete_key", None))
        records = self.merges.records if run == self._run else []  # (a loader reloaded in the same fit keeps them)
        self._run = run
        self.merges = AsynchronousMerges(
            self._sync_every, parts.world_size, counter.taken, self._merge, lambda: self._local.link_wait_seconds
        )
        self.merges.records = records
        micro_batch = parts.split.batch_sizes[parts.rank]  # (the loader's batch size: one inner step a training step)
        # The epoch: the number Lightning gives set_epoch (the epochs processed), right also before it restored a
        # resumed fit's epoch into `current_epoch`
        sampler = ClaimingBatchSampler(
            hetero_loader.hetero_batch_sampler.sampler,
            micro_batch,
            hetero_loader.hetero_batch_sampler.drop_last,
            parts.rank,
            parts.world_size,
            counter,
            lambda: trainer.fit_loop.epoch_progress.current.processed,
            self.merges.every,
        )
        self._sampler = sampler

        def on_start() -> None:
            self._handed.clear()  # (a loader Lightning starts twice, reloading it, left the first start's claim here)
            self.merges.epoch_starts(sampler.epoch, sampler.claims())

        return ClaimingDataLoader(
            hetero_loader.dataset,
            sampler,
            on_start,
            self._handed.append,
            self.merges.epoch_ends,
            **kept_loader_settings(hetero_loader),
        )

    def summary(self) -> dict[str, Any]:
        """Every rank's merge records gathered (a collective: every rank calls it), summarized for the run report."""
        return merge_summary(self._parts.collectives.gather_objects(self.merges.records))

    def received(self, batch: Any, trainer: Any) -> Any:
        """A training batch as the strategy moves it to the device, before the user's batch hooks (not
        ``on_before_batch_transfer``, which Lightning calls first): if a faster rank took its claim over, this rank
        trains nothing on it, and its hooks see it emptied (no sample counted twice); else it is this rank's now."""
        sampler = self._sampler
        if trainer is None or not trainer.training or sampler is None or not self._handed:
            return batch
        self.given_away = sampler.given_away(self._handed[0])
        if not self.given_away:
            return batch
        samples = len(claim_positions(self._handed[0], sampler.micro_batch, len(sampler.sampler)))
        with contextlib.suppress(ValueError):  # (a tensor not cut along the batch: the hooks see the batch whole)
            return split_batch(batch, [0, samples])[0]
        return batch

    def optimizer_step(self, step: Callable[[], Any], closure: Callable[[], Any]) -> Any:
        """Lightning's optimizer step (``step``, which runs ``closure``), unless this rank's micro-batch went to a
        faster rank: then the closure alone (its training_step trains nothing: a zero loss, no backward, no step)."""
        if self.given_away:
            closure()
            return None
        return step()

    def step_starts(self) -> None:
        """Before this rank trains its next micro-batch: the step's measurement opens, then the merges that are due
        (their wait is part of the step)."""
        parts = self._parts
        parts.watcher.before_fetch()
        sampler = self._sampler
        assert sampler is not None  # (the loader was built: Lightning steps on its batches)
        claim = self._handed.popleft()
        samples = 0 if self.given_away else len(claim_positions(claim, sampler.micro_batch, len(sampler.sampler)))
        self._batch_ready(samples, samples)
        self.merges.before_micro_batch(claim, {claim, *self._handed, *sampler.pending}, trains=not self.given_away)
        self.merges.took_over += claim in sampler.taken_over
        parts.micro_batch_guard.between_merges = True  # (until the epoch's end: see MicroBatchGuard)

    def step_ended(self, samples: int, last_of_epoch: bool) -> None:
        local = self._local
        if self.given_away:
            self.merges.gave_away += 1
        else:
            local.steps_done += 1
            local.steps_since_sync += 1
            local.samples_since_sync += samples
            self.merges.micro_batch_trained()
        if last_of_epoch:
            self._parts.micro_batch_guard.between_merges = False
            self.merges.epoch_ends()
            sampler = self._sampler
            if sampler is not None:  # (after the epoch's last merge: no rank takes a claim of it over any more)
                sampler.counter.forget(sampler.epoch, sampler.rank, sampler.started)

    def _merge(self) -> None:
        """One merge, the same collectives on every rank: the local training's synchronization (a rank that trained
        nothing since the last contributes nothing), rank 0's buffers, and the agreement on a stop (SIGTERM)."""
        parts = self._parts
        # (between merges no longer: an agreed stop below raises into the checkpoint on exit, whose collectives run
        # on every rank at this same merge; the next step sets it again)
        parts.micro_batch_guard.between_merges = False
        parts.collectives.before_each()
        with parts.communication.counting():
            self._local.synchronize(parts.collectives.reduce_in_place, parts.collectives.gather_tensor, [0])
        buffer_sync = self._buffer_sync()
        if buffer_sync is not None:
            buffer_sync.sync()
        parts.recovery.agree_on_stop()
