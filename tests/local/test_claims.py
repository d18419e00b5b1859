"""Asynchronous merges by speed without processes: the claims' arithmetic exhaustively, the protocol with threads as
ranks (a merge is a barrier, as its collectives are), and what the mode refuses, each by name."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from lightning_hetero import HeteroStrategy
from lightning_hetero.local.claim_counter import ClaimCounter
from lightning_hetero.local.claim_decisions import (
    claim_positions,
    claims_in_epoch,
    leaves_the_rest,
    merge_summary,
    merges_due,
    merges_in_epoch,
    merges_to_join,
    others_per_micro_batch,
    takes_over_read_ahead,
)
from lightning_hetero.local.claims import AsynchronousMerges, ClaimingBatchSampler
from lightning_hetero.local.claims_refusal import describe_asynchronous_refusal
from lightning_hetero.train.micro_batches import MicroBatchGuard
from lightning_hetero.train.order import GlobalOrder
from lightning_hetero.watch.meter import RunWatch, StepMeter, pack_records


@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_is_cut_into_claims_that_cover_every_position_once(drop_last):
    for samples in range(0, 30):
        for micro in range(1, 8):
            claims = claims_in_epoch(samples, micro, drop_last)
            covered = [p for claim in range(claims) for p in claim_positions(claim, micro, samples)]
            kept = samples - samples % micro if drop_last else samples
            assert covered == list(range(kept)), (samples, micro)
            assert all(len(claim_positions(c, micro, samples)) >= 1 for c in range(claims))


def test_the_merges_due_are_the_boundaries_drawn_and_not_yet_joined():
    for claims in range(0, 25):
        for every in range(1, 7):
            boundaries = [m * every for m in range(1, claims + 1) if m * every < claims]
            assert merges_in_epoch(every, claims) == len(boundaries)
            for drawn in range(0, claims + 3):
                for joined in range(0, len(boundaries) + 1):
                    passed = sum(1 for b in boundaries if b < drawn)  # claim b drawn: the counter went past it
                    assert merges_due(drawn, joined, every, claims) == max(0, passed - joined)


def test_the_others_rate_is_their_draws_between_a_ranks_own():
    assert others_per_micro_batch([]) is None and others_per_micro_batch([7]) is None
    assert others_per_micro_batch([3, 4, 5]) == 0.0  # nobody else drew
    assert others_per_micro_batch([2, 10]) == 7.0
    assert others_per_micro_batch([2, 10, 14, 30]) == (30 - 2 - 3) / 3


def test_the_others_rate_leaves_out_the_intervals_in_which_the_counter_passed_a_merges_claim():
    # merges every 16 claims: 95 -> 98 passes 96 and 111 -> 114 passes 112 (the others waited at those merges)
    assert others_per_micro_batch([95, 98, 104, 111, 114], every=16) == (5 + 6) / 2
    assert others_per_micro_batch([95, 98, 104, 111, 114]) == (2 + 5 + 6 + 2) / 4  # no merge inside the epoch
    # This rank drew merge 1's claim (16) as its read-ahead: the others wait at the merge during its micro-batch then,
    # the interval from 16 to its next draw; the one that ends at 16 was clear.
    assert others_per_micro_batch([15, 16], every=16) == 0.0
    assert others_per_micro_batch([16, 31], every=16) is None
    assert others_per_micro_batch([17, 31], every=16) == 13.0  # (from after merge 1's claim to before merge 2's)
    assert others_per_micro_batch([10, 20, 40], every=16) is None  # every interval passed a merge: nothing measured
    # the last `intervals` intervals clear of a merge, whatever came before them
    assert others_per_micro_batch([0, 2, 4, 6, 8, 13], every=100, intervals=2) == (1 + 4) / 2
    for every in range(1, 12):
        for draws in ([0, 3, 5, 9, 14, 20, 21], [2, 4, 30, 31, 33]):
            clear = [b - a - 1 for a, b in zip(draws, draws[1:]) if not any(a <= m * every < b for m in range(1, 40))]
            expected = sum(clear[-4:]) / len(clear[-4:]) if clear else None
            assert others_per_micro_batch(draws, every) == expected, (every, draws)


class ScriptedCounter(ClaimCounter):
    """A counter whose draws by every rank are given in advance (``takes``, ``taken``): the other ranks' progress as
    a benchmark recorded it between this rank's draws."""

    def __init__(self, takes: list[int], taken: list[int]) -> None:
        super().__init__(store_add(), "scripted")
        self.takes, self.taken_values = takes, taken

    def take(self, epoch: int) -> int:
        return self.takes.pop(0)

    def taken(self, epoch: int) -> int:
        return self.taken_values.pop(0)


def test_a_slow_rank_leaves_an_epochs_last_claims_when_the_others_rate_between_merges_says_so():
    """Recorded at an epoch's end of `benchmarks/asynchronous_merges.py --anneal` (128 claims an epoch, merges every
    16, the fast rank about 6 claims a micro-batch of the slowed one): the slowed rank drew claims 95, 98, 104, 111
    and 114, and as it started 114 the counter stood at 120. Measured over every interval the others' rate read 3.75
    (the intervals across merges 96 and 112 gave 2: the fast rank waited there), so it drew one more and the fast
    rank waited for it a whole micro-batch. Over the intervals clear of a merge it reads 5.5: the 6 claims left, and
    the 2 the fast rank holds, take it 1.5 of the slowed rank's micro-batches, so the slowed rank leaves them."""
    counter = ScriptedCounter(takes=[93, 96, 102, 109, 112, 120], taken=[112, 120])
    sampler = ClaimingBatchSampler(GlobalOrder(range(512)), 4, False, 1, 2, counter, merge_every=16)
    drawn = [claim for claim, _ in zip(iter_claims(sampler), range(10))]
    assert drawn == [1, 95, 98, 104, 111, 114]  # its own first claim, then the counter's; none after 114
    assert counter.taken_values == []  # (read at the last two draws, when the end was near)


def iter_claims(sampler: ClaimingBatchSampler):
    for _ in sampler:
        yield sampler.pending[-1]


def test_a_rank_takes_over_a_read_ahead_claim_only_when_every_other_rank_is_at_least_twice_as_slow():
    assert not takes_over_read_ahead(None)  # nothing measured
    for rate in (0.0, 0.1, 0.25, 0.5):
        assert takes_over_read_ahead(rate)
    for rate in (0.51, 0.75, 1.0, 2.0, 7.5):
        assert not takes_over_read_ahead(rate)
    # The bound it keeps, two ranks: the taker (micro-batch t) finds the counter exhausted as it starts its last; the
    # slower one (micro-batch t / rate) has `left` of the one it is in to go. Taking over, the taker ends at 2t and the
    # slower at `left`: one waits for the other max(2t - left, left - 2t). At most one micro-batch of the slower rank
    # whatever `left` exactly when the rule takes over; above a rate of 0.5 some `left` would exceed it.
    t = 1.0
    for rate in (0.05, 0.1, 0.25, 0.4, 0.5, 0.6, 0.9, 1.0, 2.0):
        slow = t / rate
        worst = max(abs(2 * t - slow * k / 100) for k in range(1, 101))
        assert (worst <= slow + 1e-9) == takes_over_read_ahead(rate), rate


def test_a_slower_rank_leaves_the_last_claims_when_the_others_train_them_within_two_of_its_micro_batches():
    for others in range(1, 4):
        assert not any(leaves_the_rest(remaining, None, others) for remaining in range(0, 20))  # nothing measured
        for rate in (0.0, 0.25, 0.5, 1.0, 1.5, 3.0, 7.5, 12.0):
            for remaining in range(0, 40):
                # the others train the rest, and the two each has in hand at most (the one it is in, the one drawn
                # ahead), in (remaining + 2 * others) / rate of its micro-batches: it leaves when that is two at most
                expected = remaining > 0 and rate > 0 and (remaining + 2 * others) / rate <= 2
                assert leaves_the_rest(remaining, rate, others) == expected, (remaining, rate, others)


def test_every_rank_but_the_last_to_ask_may_leave_an_epochs_last_claims():
    counter = ClaimCounter(store_add(), "run")
    assert [counter.leave(0, 3) for _ in range(4)] == [True, True, False, False]
    assert [counter.leave(1, 3) for _ in range(2)] == [True, True]  # (each epoch its own)
    assert counter.taken(0) == 0  # (the draws' counter is not the leaves')


def store_add():
    """The store's ``add`` over a dict (one thread)."""
    values: dict[str, int] = {}

    def add(key: str, amount: int) -> int:
        values[key] = values.get(key, 0) + amount
        return values[key]

    return add


class ThreadRanks:
    """``world`` threads as ranks over one counter (the store's ``add``, under a lock); each merge is a barrier with a
    deadline, as a collective is; every event is logged in the order it happened. ``read_ahead``: each rank draws its
    next micro-batch as it starts one, as Lightning reads a batch ahead of a loader without a length; ``durations``:
    each rank's seconds a micro-batch (default: random, scaled by ``speeds``)."""

    def __init__(
        self,
        world: int,
        samples: int,
        micro: int,
        sync_every: int,
        speeds: list[float],
        seed: int,
        read_ahead: bool = False,
        durations: list[float] | None = None,
        stagger: bool = False,
    ) -> None:
        self.world, self.samples, self.micro, self.sync_every, self.speeds = world, samples, micro, sync_every, speeds
        self.lock, self.values, self.log = threading.Lock(), {}, []
        self.barriers: dict[tuple[int, int], threading.Barrier] = {}
        self.random = random.Random(seed)
        self.read_ahead, self.durations, self.stagger = read_ahead, durations, stagger

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]

    def event(self, *what) -> None:
        with self.lock:
            self.log.append(what)

    def run(self, epochs: int) -> None:
        errors = []

        def rank_main(rank: int) -> None:
            try:
                ranks = self

                class LoggedCounter(ClaimCounter):
                    def leave(self, epoch: int, world_size: int) -> bool:
                        granted = super().leave(epoch, world_size)
                        if granted:
                            ranks.event("left", rank, epoch)
                        return granted

                counter = LoggedCounter(self.add, "test")
                order = GlobalOrder(range(self.samples))
                sampler = ClaimingBatchSampler(
                    order, self.micro, False, rank, self.world, counter, merge_every=self.sync_every * self.world
                )
                merges_done = [0]

                def merge() -> None:
                    self.event("enter", rank, merges_done[0], order.epoch)
                    with self.lock:
                        barrier = self.barriers.setdefault((order.epoch, merges_done[0]), threading.Barrier(self.world))
                    barrier.wait(timeout=10)
                    self.event("leave", rank, merges_done[0], order.epoch)
                    merges_done[0] += 1

                merges = AsynchronousMerges(self.sync_every, self.world, counter.taken, merge)
                for epoch in range(epochs):
                    order.set_epoch(epoch)
                    sampler.begin_epoch()  # (as the loader does: a new epoch's claims, none taken over yet)
                    merges_done[0] = 0
                    merges.epoch_starts(epoch, sampler.claims())
                    batches = iter(sampler)
                    ahead = next(batches, None)
                    if self.durations and self.stagger:
                        # (ranks of equal speed a fraction of a micro-batch apart, as devices are: drawing at the same
                        # instant, which rank's draw lands in which interval is a race, and the rate a coin toss)
                        time.sleep(rank * self.durations[rank] / self.world)
                    while ahead is not None:
                        indices = ahead
                        claim = sampler.pending.popleft()
                        if self.read_ahead:
                            ahead = next(batches, None)
                        if sampler.given_away(claim):  # (a faster rank took it over: as the strategy's step)
                            merges.before_micro_batch(claim, {claim, *sampler.pending}, trains=False)
                            self.event("given", rank, epoch, claim)
                            if not self.read_ahead:
                                ahead = next(batches, None)
                            continue
                        merges.before_micro_batch(claim, {claim, *sampler.pending})
                        self.event("train", rank, epoch, claim, tuple(indices))
                        if self.durations:
                            time.sleep(self.durations[rank])
                        else:
                            time.sleep(self.random.uniform(0, 0.002) / self.speeds[rank])
                        merges.micro_batch_trained()
                        if not self.read_ahead:
                            ahead = next(batches, None)
                    merges.epoch_ends()
                    self.event("epoch", rank, epoch, len(merges.records))
            except Exception as error:  # (reported by the test, not lost in the thread)
                errors.append(error)

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert not any(thread.is_alive() for thread in threads), "a rank hangs"


@pytest.mark.parametrize("seed", range(6))
def test_threads_as_ranks_train_every_sample_once_join_the_same_merges_and_wait_for_one_micro_batch_at_most(seed):
    world, samples, micro, sync_every, epochs = 3, 53, 4, 2, 2
    ranks = ThreadRanks(world, samples, micro, sync_every, speeds=[1.0, 0.5, 0.2], seed=seed)
    ranks.run(epochs)
    log = ranks.log
    for epoch in range(epochs):
        trained = [e for e in log if e[0] == "train" and e[2] == epoch]
        assert sorted(p for e in trained for p in e[4]) == list(range(samples))  # every sample once an epoch
        assert sorted(e[3] for e in trained) == list(range(claims_in_epoch(samples, micro, False)))
    # Every rank ran the same merges: those inside each epoch, and each epoch's last.
    per_epoch = merges_in_epoch(sync_every * world, claims_in_epoch(samples, micro, False)) + 1
    ends = [e for e in log if e[0] == "epoch"]
    assert len(ends) == world * epochs and all(merges == per_epoch * (epoch + 1) for _, _, epoch, merges in ends)
    # A merge comes before any micro-batch at or past its claim, on every rank (what a rank contributes to merge m was
    # trained from merge m-1's parameters, on claims before merge m's).
    entered = {(rank, epoch): 0 for rank in range(world) for epoch in range(epochs)}
    for entry in log:
        if entry[0] == "enter":
            entered[(entry[1], entry[3])] += 1
        elif entry[0] == "train":
            _, rank, epoch, claim, _ = entry
            assert entered[(rank, epoch)] >= claim // (sync_every * world), (rank, epoch, claim)
    # Waiting is bounded by one micro-batch: once a rank entered a merge, every other rank starts at most one more
    # micro-batch (the one it had decided on when the merge's claim was drawn) before it joins the merge too. (A rank
    # that left an epoch's last claims to faster ones waits for them to train those: two of its micro-batches at most.)
    left_at = {(e[1], e[2]): index for index, e in enumerate(log) if e[0] == "left"}
    for index, entry in enumerate(log):
        if entry[0] != "enter" or left_at.get((entry[1], entry[3]), len(log)) < index:
            continue
        _, rank, merge, _ = entry
        started: dict[int, int] = {}
        joined = set()
        for later in log[index + 1 :]:
            if later[0] == "enter" and later[2] == merge:
                joined.add(later[1])
            elif later[0] == "train" and later[1] != rank and later[1] not in joined:
                started[later[1]] = started.get(later[1], 0) + 1
            if len(joined) == world - 1 or later[0] == "leave":
                break
        assert max(started.values(), default=0) <= 1, (
            f"a rank trained {started} while rank {rank} waited in merge {merge}"
        )
    # Not in step: the fast rank trained more micro-batches than the slowest.
    counts = [sum(1 for e in log if e[0] == "train" and e[1] == rank) for rank in range(world)]
    assert counts[0] > counts[2]


def last_merge_entries(log: list[tuple], world: int, epochs: int, per_epoch: int) -> dict[tuple[int, int], int]:
    """Where in ``log`` each (rank, epoch) entered that epoch's last merge."""
    entered = {(e[1], e[3]): index for index, e in enumerate(log) if e[0] == "enter" and e[2] == per_epoch - 1}
    assert len(entered) == world * epochs
    return entered


def assert_the_slow_rank_starts_nothing_while_the_fast_one_waits_at_the_last_merge(
    log: list[tuple], epochs: int, sync_every: int, samples: int, micro: int
) -> None:
    """Two ranks (0 fast, 1 slow): once rank 0 entered an epoch's last merge, rank 1 starts no micro-batch before it
    enters too."""
    per_epoch = merges_in_epoch(sync_every * 2, claims_in_epoch(samples, micro, False)) + 1
    entered = last_merge_entries(log, 2, epochs, per_epoch)
    for epoch in range(epochs):
        fast_entered, slow_entered = entered[(0, epoch)], entered[(1, epoch)]
        started = [e for e in log[fast_entered:slow_entered] if e[0] == "train" and e[1] == 1]
        assert not started, f"epoch {epoch}: the slow rank started {started} while the fast one waited"


@pytest.mark.parametrize("seed", range(3))
def test_at_an_epochs_end_a_slow_rank_that_reads_ahead_leaves_the_last_claims_to_the_fast_one(seed):
    """Lightning reads a batch ahead, so a slow rank holds the micro-batch it is in and one more: drawn near the end,
    the fast rank would wait for both at the epoch's last merge. It leaves them to the fast rank instead: once the
    fast rank entered the last merge, the slow one starts no micro-batch before it enters too."""
    world, samples, micro, sync_every, epochs = 2, 200, 4, 20, 2  # (one merge inside an epoch, 10 claims after it)
    ranks = ThreadRanks(world, samples, micro, sync_every, [1.0, 0.05], seed, read_ahead=True, durations=[0.001, 0.020])
    ranks.run(epochs)
    log = ranks.log
    for epoch in range(epochs):
        trained = [e for e in log if e[0] == "train" and e[2] == epoch]
        assert sorted(p for e in trained for p in e[4]) == list(range(samples))  # every sample once an epoch
        assert [e[1] for e in log if e[0] == "left" and e[2] == epoch] == [1]  # the slow rank left, alone
    assert_the_slow_rank_starts_nothing_while_the_fast_one_waits_at_the_last_merge(
        log, epochs, sync_every, samples, micro
    )


@pytest.mark.parametrize("seed", range(3))
def test_when_a_slow_rank_drew_ahead_at_an_epochs_end_the_fast_one_takes_that_claim_over(monkeypatch, seed):
    """With the rule that leaves the last claims switched off (as when its estimate of the others' rate errs), the
    slow rank draws to the end and holds a claim it read ahead: the fast rank, twenty times faster, takes it over as
    it reads past the end. Every sample is still trained once, and once the fast rank entered an epoch's last merge
    the slow one starts no micro-batch before it enters too (it gives away the one it drew ahead)."""
    monkeypatch.setattr("lightning_hetero.local.claims.leaves_the_rest", lambda remaining, rate, others: False)
    world, samples, micro, sync_every, epochs = 2, 200, 4, 20, 2  # (one merge inside an epoch, 10 claims after it)
    ranks = ThreadRanks(world, samples, micro, sync_every, [1.0, 0.05], seed, read_ahead=True, durations=[0.001, 0.020])
    ranks.run(epochs)
    log = ranks.log
    given = [e for e in log if e[0] == "given"]
    assert given and all(e[1] == 1 for e in given)  # the slow rank gave its read-ahead to the fast one
    for epoch in range(epochs):
        trained = [e for e in log if e[0] == "train" and e[2] == epoch]
        assert sorted(p for e in trained for p in e[4]) == list(range(samples))  # every sample once an epoch
        assert not [e for e in log if e[0] == "left" and e[2] == epoch]
    assert_the_slow_rank_starts_nothing_while_the_fast_one_waits_at_the_last_merge(
        log, epochs, sync_every, samples, micro
    )


@pytest.mark.parametrize("durations, sync_every", [([0.1, 0.1], 20), ([0.1, 0.1, 0.1], 20), ([0.02, 0.04], 1)])
def test_ranks_of_equal_speeds_or_in_lockstep_behind_frequent_merges_draw_to_the_end(durations, sync_every):
    """Leaving would end their epoch later: the others have as much in hand as the one that would leave. (Ranks of
    equal speed start each epoch a fraction of a micro-batch apart. Started together, they draw at the same instants,
    and the rate, a mean over at most four intervals, counts whichever draws won the race: a rank then measured the
    others up to twice as fast and left, about 1 run in 4 of the fast tier beside the other worker, whatever the
    micro-batches' length.)"""
    world, samples, micro, epochs = len(durations), 160, 4, 2
    stagger = len(set(durations)) == 1
    ranks = ThreadRanks(
        world, samples, micro, sync_every, [1.0] * world, 0, read_ahead=True, durations=durations, stagger=stagger
    )
    ranks.run(epochs)
    assert not [e for e in ranks.log if e[0] == "left"]
    for epoch in range(epochs):
        trained = [e for e in ranks.log if e[0] == "train" and e[2] == epoch]
        assert sorted(p for e in trained for p in e[4]) == list(range(samples))


def test_when_every_rank_would_leave_the_last_to_ask_draws_every_claim_left(monkeypatch):
    monkeypatch.setattr("lightning_hetero.local.claims.leaves_the_rest", lambda remaining, rate, others: True)
    # (a merge every 3 x 3 claims: its intervals clear of a merge give each rank a rate before the end)
    world, samples, micro, sync_every, epochs = 3, 101, 3, 3, 2
    ranks = ThreadRanks(world, samples, micro, sync_every, [1.0, 0.7, 0.4], 0, read_ahead=True)
    ranks.run(epochs)
    for epoch in range(epochs):
        trained = [e for e in ranks.log if e[0] == "train" and e[2] == epoch]
        assert sorted(p for e in trained for p in e[4]) == list(range(samples))  # every sample once an epoch
        assert len([e for e in ranks.log if e[0] == "left" and e[2] == epoch]) == world - 1
        assert ranks.values[f"lightning_hetero/claims/test/epoch_{epoch}/left"] == world  # (the last one refused)
    per_epoch = merges_in_epoch(sync_every * world, claims_in_epoch(samples, micro, False)) + 1
    assert all(entry[3] == per_epoch * (entry[2] + 1) for entry in ranks.log if entry[0] == "epoch")


def test_a_rank_joins_a_merge_before_its_claim_and_at_once_when_another_rank_drew_it():
    every, claims = 4, 20  # boundaries at 4, 8, 12, 16
    assert merges_to_join(3, 4, {3}, 0, every, claims) == 0  # nobody drew claim 4 yet
    assert merges_to_join(3, 5, {3}, 0, every, claims) == 1  # another rank drew 4: join now
    assert merges_to_join(3, 5, {3, 4}, 0, every, claims) == 0  # this rank holds 4: train 3 first
    assert merges_to_join(4, 5, {4}, 0, every, claims) == 1  # reached it
    assert merges_to_join(9, 13, {9, 12}, 0, every, claims) == 2  # 4 and 8 drawn by others; 12 is its own
    assert merges_to_join(12, 13, {12}, 1, every, claims) == 2  # reached 8 and 12, joined 4 already
    assert merges_to_join(19, 20, {19}, 4, every, claims) == 0  # no boundary at or past the epoch's end
    for current in range(claims):
        for drawn in range(current + 1, claims + 1):
            for joined in range(0, 5):
                for held in ({current}, {current, current + 1}, {current, drawn - 1}):
                    due = merges_to_join(current, drawn, held, joined, every, claims)
                    done = joined + due
                    # Joined: only boundaries it reached or another rank drew; stopped: never past a boundary, nor
                    # at one another rank drew
                    for boundary in range((joined + 1) * every, done * every + 1, every):
                        assert boundary <= current or (boundary < drawn and boundary not in held)
                    following = (done + 1) * every
                    if following < claims:
                        assert following > current and (following >= drawn or following in held)


def test_each_rank_trains_its_own_first_claim_then_the_counters():
    counter = ClaimCounter(store_add(), "run")
    order = GlobalOrder(range(10))
    first = ClaimingBatchSampler(order, 2, False, 0, 2, counter)
    second = ClaimingBatchSampler(order, 2, False, 1, 2, counter)
    a, b = iter(first), iter(second)
    assert next(a) == [0, 1] and next(b) == [2, 3]  # claims 0 and 1: each rank's own
    assert next(b) == [4, 5] and next(b) == [6, 7] and next(a) == [8, 9]  # then whoever asks first
    assert not any(second.given_away(claim) for claim in (1, 2, 3))  # (the second rank starts what it drew)
    assert list(a) == [] and list(b) == []
    assert list(first.pending) == [0, 4] and list(second.pending) == [1, 2, 3]


def test_after_an_epochs_last_merge_each_rank_forgets_the_keys_its_claims_left_in_the_store():
    values: dict[str, int] = {}

    def add(key: str, amount: int) -> int:
        values[key] = values.get(key, 0) + amount
        return values[key]

    counter = ClaimCounter(add, "run", values.pop)
    order = GlobalOrder(range(12))
    fast = ClaimingBatchSampler(order, 2, False, 0, 2, counter)
    slow = ClaimingBatchSampler(order, 2, False, 1, 2, counter)
    f, s = iter(fast), iter(slow)
    next(f), next(s), next(s)  # claims 0, 1 (each rank's own) and 2 (the slow rank's, drawn ahead)
    for _ in range(3):
        next(f)  # claims 3-5
    assert not fast.given_away(3) and not fast.given_away(4) and not fast.given_away(5)
    assert list(f) == [[4, 5]]  # every claim drawn: the fast rank takes claim 2 over
    assert slow.given_away(2) and not slow.given_away(1)  # (its own first claim has no key)
    for sampler in (fast, slow):
        counter.forget(0, sampler.rank, sampler.started)
    assert sorted(values) == ["lightning_hetero/claims/run/epoch_0"]  # the counter alone is left
    ClaimCounter(add, "run").forget(0, 0, [3])  # (a store that cannot delete keys: nothing happens)


@pytest.mark.parametrize("started_first", [False, True])
def test_at_an_epochs_end_a_much_faster_rank_takes_over_the_claim_a_slower_one_drew_ahead_unless_it_started(
    started_first,
):
    """Claims 2-7 of 8: the fast rank drew five, the slow one claim 3 (its read-ahead), and the counter is then
    exhausted. As the fast rank reads ahead past the end it takes claim 3 over, unless the slow rank started it
    first: one atomic start decides, so claim 3 is trained once, by one of them."""
    counter = ClaimCounter(store_add(), "run")
    order = GlobalOrder(range(16))
    fast = ClaimingBatchSampler(order, 2, False, 0, 2, counter)
    slow = ClaimingBatchSampler(order, 2, False, 1, 2, counter)
    f, s = iter(fast), iter(slow)
    assert next(f) == [0, 1] and next(s) == [2, 3]
    assert next(f) == [4, 5] and next(s) == [6, 7]  # claims 2 and 3
    assert [next(f) for _ in range(4)] == [[8, 9], [10, 11], [12, 13], [14, 15]]  # claims 4-7
    if started_first:
        assert not slow.given_away(3)  # the slow rank starts its read-ahead: its own
    took = list(f)  # the fast rank reads ahead past the end (the others drew none in its last 4: rate 0)
    if started_first:
        assert took == [] and fast.taken_over == set()
    else:
        assert took == [[6, 7]] and fast.taken_over == {3}
        assert slow.given_away(3)  # as the slow rank comes to start it, it finds it taken over
        assert not fast.given_away(3)  # the fast rank trains it


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"sync_options": {"asynchronous": True, "overlap": True}}, "sync_options['overlap']"),
        ({"sync_options": {"asynchronous": True, "fragments": 2}, "sync_every": 2}, "sync_options['fragments']"),
        ({"sync_options": {"asynchronous": True}, "inner_steps": [2, 1]}, "inner_steps"),
        ({"sync_options": {"asynchronous": True}, "rebalance": True}, "rebalance=True"),
        ({"sync_options": {"asynchronous": True}, "batch_sizes": [4, 4]}, "batch_sizes"),
        ({"sync_options": {"asynchronous": 1}}, "sync_options['asynchronous']=1"),
    ],
)
def test_what_asynchronous_merges_cannot_combine_with_is_refused_by_name(arguments, named):
    with pytest.raises(ValueError) as refused:
        HeteroStrategy(sync="diloco", **arguments)
    assert f"`{named}" in str(refused.value)


def test_every_step_training_refuses_the_asynchronous_option():
    with pytest.raises(ValueError, match="sync_options"):
        HeteroStrategy(sync_options={"asynchronous": True})


def refusal(loader=None, module=None, world_size=2, **trainer_arguments):
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, **trainer_arguments)
    return describe_asynchronous_refusal(trainer, loader, module, world_size)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"max_steps": 100}, "`Trainer(max_steps=100)`"),
        ({"min_steps": 10}, "`Trainer(min_steps=10)`"),
        ({"fast_dev_run": True}, "`Trainer(fast_dev_run=True)`"),
        ({"limit_train_batches": 0.5}, "`Trainer(limit_train_batches=0.5)`"),
        ({"limit_train_batches": 1}, "`Trainer(limit_train_batches=1)`"),  # (an int: one batch an epoch)
        ({"limit_train_batches": 10}, "`Trainer(limit_train_batches=10)`"),
        ({"val_check_interval": 1}, "`Trainer(val_check_interval=1)`"),  # (validation after every batch)
        ({"val_check_interval": 100}, "`Trainer(val_check_interval=100)`"),
        ({"val_check_interval": "00:00:01:00"}, "`Trainer(val_check_interval='60.0 s')`"),
        ({"max_time": "00:01:00:00"}, "`Trainer(max_time=...)`"),
    ],
)
def test_a_fit_that_needs_the_ranks_in_step_is_refused_by_name(arguments, named):
    assert named in refusal(**arguments)


def test_epoch_end_checkpoints_and_a_long_enough_epoch_are_accepted_and_the_rest_refused_by_name():
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    assert refusal(enable_checkpointing=False) is None
    assert refusal(callbacks=[ModelCheckpoint(every_n_epochs=1)]) is None
    assert "every 5 training steps" in refusal(callbacks=[ModelCheckpoint(every_n_train_steps=5)])
    loader = DataLoader(range(8), batch_size=2)
    assert refusal(loader=loader, world_size=4) is None  # 4 micro-batches for 4 ranks
    assert "gives 4 micro-batches of 2 an epoch" in refusal(loader=loader, world_size=5)
    loader.in_order = False
    assert "in_order=False" in refusal(loader=loader)

    class IteratorStep:
        def training_step(self, dataloader_iter):
            return None

    assert "`training_step(self, dataloader_iter)`" in refusal(module=IteratorStep())


def test_between_merges_a_step_reduces_nothing_and_refuses_the_users_collectives():
    guard = MicroBatchGuard()
    assert not guard.rank_local
    guard.refuse_collective("all_gather")  # in step: allowed
    guard.between_merges = True
    assert guard.rank_local
    with pytest.raises(RuntimeError, match=r"`all_gather`.*asynchronous"):
        guard.refuse_collective("all_gather")


FIELDS = pack_records([]).shape[1]  # (a record's numbers)


def test_the_records_of_ranks_with_different_step_counts_are_exchanged_once_padded():
    clock = [0.0]
    watch = RunWatch(StepMeter(lambda: clock[0], lambda: 0.0, lambda: clock[0]), window=0)
    sent = []

    def all_gather(packed):  # two ranks: this one took 1 step, the other one 3 (5 samples each)
        sent.append(packed.clone())
        if packed.shape == (1, FIELDS):  # the counts first
            return [packed, torch.full_like(packed, 3.0)]
        other = torch.zeros(3, FIELDS, dtype=packed.dtype)
        other[:, 0] = torch.arange(3, dtype=packed.dtype)
        other[:, 1] = 5
        return [packed, other]

    assert watch.before_fetch(all_gather) is False  # window 0: never an exchange inside the fit
    watch.meter.batch_ready(4)
    clock[0] += 0.001
    watch.meter.backward_ended()
    steps = watch.finish(all_gather)
    assert [tuple(t.shape) for t in sent] == [(1, FIELDS), (3, FIELDS)]  # the counts, then the records padded to 3
    assert sent[1][1:, 1].tolist() == [0.0, 0.0] and sent[1][:, 0].tolist() == [0.0, 1.0, 2.0]  # empty, numbered
    assert [step["batch_sizes"] for step in steps] == [[4, 5], [0, 5], [0, 5]]


def test_the_reports_section_gives_each_merges_contributions_and_each_ranks_wait_for_the_last_to_arrive():
    records = [
        [
            {"epoch": 0, "micro_batches": 6, "seconds": 0.30, "last_step_seconds": 0.05},
            {"epoch": 0, "micro_batches": 7, "seconds": 0.10, "last_step_seconds": 0.04},
        ],
        [
            {"epoch": 0, "micro_batches": 2, "seconds": 0.10, "last_step_seconds": 0.22},
            {"epoch": 0, "micro_batches": 1, "seconds": 0.25, "last_step_seconds": None, "gave_away": 1},
        ],
    ]
    records[0][1]["took_over"] = 1
    summary = merge_summary(records)
    assert summary["claims_given_away"] == [0, 1] and summary["claims_taken_over"] == [1, 0]
    assert summary["merges"] == 2 and summary["micro_batches"] == [13, 3] and summary["staleness"] == 0
    assert summary["most_wait_seconds"] == [pytest.approx(0.20), pytest.approx(0.15)]
    assert summary["per_merge"][1]["micro_batches"] == [7, 1]
    assert summary["per_merge"][0]["wait_seconds"] == [pytest.approx(0.20), 0.0]
    # (what rank 0 waited for: rank 1's last micro-batch, begun 0.22 s before it reached the merge)
    assert summary["per_merge"][0]["last_step_seconds"] == [0.05, 0.22]
    assert summary["per_merge"][1]["last_step_seconds"] == [0.04, None]


def test_a_merge_records_the_time_from_the_start_of_the_ranks_last_micro_batch_and_its_mean_cycle(monkeypatch):
    """One rank, a clock that moves by hand: two micro-batches of 0.1 s and 0.3 s, each after 0.05 s of the loop's
    own time, then the epoch's end: the merge records 0.3 s for the last micro-batch (from its start, after the
    merges due before it) and a cycle of 0.25 s, the mean time per micro-batch since the epoch's start (the loop's
    own time included)."""
    clock = [100.0]
    monkeypatch.setattr("lightning_hetero.local.claims.time.perf_counter", lambda: clock[0])
    merges = AsynchronousMerges(sync_every=8, world_size=1, taken=lambda epoch: 0, merge=lambda: None)
    merges.epoch_starts(0, claims=2)
    for claim, seconds in enumerate([0.1, 0.3]):
        clock[0] += 0.05
        merges.before_micro_batch(claim, {claim})
        clock[0] += seconds
        merges.micro_batch_trained()
    merges.epoch_ends()
    assert len(merges.records) == 1
    assert merges.records[0]["last_step_seconds"] == pytest.approx(0.3)
    assert merges.records[0]["cycle_seconds"] == pytest.approx(0.25)


def test_the_last_micro_batchs_time_leaves_out_the_merges_joined_before_it(monkeypatch):
    """A merge after every claim (one rank, sync_every 1), each taking 1 s: the micro-batch after a merge is timed from
    the end of that merge (its decision to train comes after it), so each merge's record holds that micro-batch's
    0.2 s, not the merge's second."""
    clock = [0.0]
    monkeypatch.setattr("lightning_hetero.local.claims.time.perf_counter", lambda: clock[0])

    def merge():
        clock[0] += 1.0

    current = [0]  # (the counter: this rank drew every claim up to the one it is about to train)
    merges = AsynchronousMerges(sync_every=1, world_size=1, taken=lambda epoch: current[0], merge=merge)
    merges.epoch_starts(0, claims=3)
    for claim in range(3):
        current[0] = claim
        merges.before_micro_batch(claim, {claim})
        clock[0] += 0.2
        merges.micro_batch_trained()
    merges.epoch_ends()
    steps = [record["last_step_seconds"] for record in merges.records]
    assert len(steps) == 3 and steps == [pytest.approx(0.2)] * 3
