"""The heartbeat watchdog: the decision (pure), its two rounds played on a fake clock against fake stores, and the
threads once end to end against a real store. Nothing here depends on how fast the machine runs."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed

from lightning_hetero.recover import liveness


def test_a_peer_silent_for_the_timeout_is_lost_unless_it_finished():
    heard = {1: 100.0, 2: 70.0, 3: 60.0}
    assert liveness.lost_ranks(heard, finished=set(), store_answered=100.0, now=100.0, timeout=30) == ([2, 3], False)
    assert liveness.lost_ranks(heard, finished={3}, store_answered=100.0, now=100.0, timeout=30) == ([2], False)
    assert liveness.lost_ranks(heard, finished=set(), store_answered=99.0, now=99.0, timeout=30) == ([3], False)


def test_a_store_silent_for_the_timeout_loses_every_unfinished_peer_and_says_it_was_the_store():
    heard = {1: 80.0, 2: 75.0}
    assert liveness.lost_ranks(heard, set(), store_answered=80.0, now=100.0, timeout=30) == ([], False)
    assert liveness.lost_ranks(heard, {2}, store_answered=70.0, now=100.0, timeout=30) == ([1], True)


def test_the_message_names_the_lost_rank_the_exit_code_and_the_recorded_failure():
    message = liveness.lost_message(0, [1], 30, store_lost=False, failures={1: "RuntimeError: boom"})
    assert "rank 1 has been lost: no heartbeat came for 30 s" in message
    assert "Rank 1 had failed with RuntimeError: boom" in message and "code 75" in message
    assert "ranks 0, 2 have been lost: the rendezvous store" in liveness.lost_message(1, [0, 2], 30, True, {})


def test_a_peer_lost_while_the_store_is_silent_too_says_both():
    message = liveness.lost_message(1, [0], 10, store_lost=False, failures={}, store_silent=9.4)
    assert "no heartbeat came for 10 s and the rendezvous store" in message and "has not answered for 9 s" in message
    assert "has not answered" not in liveness.lost_message(1, [0], 10, store_lost=False, failures={}, store_silent=1)


def test_the_message_names_the_store_host(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert "stopped answering (rank 0 hosts it)" in liveness.lost_message(1, [0], 10, True, {})
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "stopped answering (the torchrun agent hosts it)" in liveness.lost_message(1, [0], 10, True, {})


@pytest.mark.parametrize("value", [0, 4.9, -1, True, "30", [30], float("nan"), float("inf")])
def test_a_bad_peer_timeout_is_refused_naming_the_value(value):
    pattern = f"`peer_timeout={value!r}` must be a finite number of seconds >= 5"
    with pytest.raises(ValueError, match=re.escape(pattern)):
        liveness.check_peer_timeout(value)


@pytest.mark.parametrize("value", [None, 5, 30.0, 3600])
def test_good_peer_timeouts_pass(value):
    liveness.check_peer_timeout(value)


TIMEOUT, INTERVAL, CHECK_EVERY = 5.0, 1.0, 0.25  # binary fractions: the fake clock's sums are exact


class Clock:
    """A fake clock: the time is ``now``, which the test sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class DictStore:
    """TCPStore's ``add``: adds ``amount`` to the key's count (0 when missing) and returns the new count."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str, amount: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


def beat_key(rank: int) -> str:
    return f"lightning_hetero/heartbeat/t/{rank}"


def finished_key(rank: int) -> str:
    return f"lightning_hetero/finished/t/{rank}"


class Rounds:
    """Plays a watchdog's two threads on a fake clock: a decision every ``CHECK_EVERY`` and, every ``INTERVAL``, a
    heartbeat round before it. The threads' loops only wait and call these rounds."""

    def __init__(self, connect, rank: int, world_size: int) -> None:
        self.clock, self.messages = Clock(), []
        self.watchdog = liveness.PeerWatchdog(
            connect,
            rank,
            world_size,
            TIMEOUT,
            run_id="t",
            on_lost=self.messages.append,
            interval=INTERVAL,
            check_every=CHECK_EVERY,
            clock=self.clock,
        )
        self.watchdog._begin(self.clock.now)
        self.store, self.counts = None, {}

    def beat(self) -> None:
        self.store = self.watchdog._beat_once(self.store, self.counts)

    def decide(self) -> bool:
        return self.watchdog._decide_once(self.clock.now)

    def play(self, until: float, peers=lambda now: None, beat: bool = True):
        """Advances the clock to ``until`` (or to the decision that gives up); ``peers(now)``: what the peers do
        before each heartbeat round. Returns when the peers were given up on, or None."""
        while self.clock.now < until:
            self.clock.now += CHECK_EVERY
            if beat and self.clock.now % INTERVAL == 0:
                peers(self.clock.now)
                self.beat()
            if self.decide():
                return self.clock.now
        return None


def test_a_silent_peer_is_lost_after_the_timeout_and_one_that_finished_is_not():
    store = DictStore()
    rounds = Rounds(lambda: store, rank=0, world_size=3)

    def peers(now):
        if now <= 2:  # ranks 1 and 2 beat until 2 s; then rank 1 goes silent and rank 2 says it finished
            store.add(beat_key(1), 1)
            store.add(beat_key(2), 1)
        if now == 2:
            store.add(finished_key(2), 1)

    rounds.beat()
    assert rounds.play(until=60, peers=peers) == 2 + TIMEOUT
    assert rounds.watchdog.lost == [1] and len(rounds.messages) == 1
    assert "rank 1 has been lost: no heartbeat came for 5 s" in rounds.messages[0]
    assert store.counts[beat_key(0)] == 8  # it beat at 0, 1, ..., 7 s


def test_peers_that_keep_beating_are_never_lost_over_many_timeouts():
    store = DictStore()
    rounds = Rounds(lambda: store, rank=1, world_size=3)

    def peers(now):
        store.add(beat_key(0), 1)  # rank 0 beats every second, rank 2 every 4 s: always heard within the timeout
        if now % 4 == 0:
            store.add(beat_key(2), 1)

    rounds.beat()
    assert rounds.play(until=10 * TIMEOUT, peers=peers) is None
    assert rounds.messages == [] and rounds.watchdog.lost == []
    assert store.counts[beat_key(1)] == 51


def test_an_unreachable_store_loses_the_peers():
    attempts = []

    def connect():
        attempts.append(rounds.clock.now)
        raise ConnectionRefusedError("store gone")

    rounds = Rounds(connect, rank=1, world_size=2)
    rounds.beat()
    assert rounds.play(until=60) == TIMEOUT
    assert rounds.watchdog.lost == [0] and len(rounds.messages) == 1
    message = rounds.messages[0]
    assert "rank 0 has been lost: the rendezvous store stopped answering (rank 0 hosts it) for 5 s" in message
    assert attempts == [0, 1, 2, 3, 4, 5]  # every round tried to connect again


def test_a_connection_that_fails_is_dropped_and_the_next_round_reconnects():
    store, connections = DictStore(), []

    def connect():
        connections.append(store)
        return store

    class Broken:
        def add(self, key, amount):
            raise ConnectionResetError("gone")

    rounds = Rounds(connect, rank=0, world_size=2)
    assert rounds.watchdog._beat_once(Broken(), {}) is None
    assert rounds.watchdog._beat_once(None, {}) is store and connections == [store]
    assert rounds.watchdog._beat_once(store, {}) is store and connections == [store]  # kept while it answers


class FreezableStore(DictStore):
    """A store whose host can be frozen (SIGSTOP): then every call blocks until it is thawed, whatever its timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.blocked, self.thawed = False, threading.Event(), threading.Event()

    def wait_while_frozen(self) -> None:
        if self.frozen:
            self.blocked.set()
            self.thawed.wait()

    def add(self, key, amount):
        self.wait_while_frozen()
        return super().add(key, amount)


@pytest.mark.parametrize("frozen_in", ["add", "connect"])
def test_a_frozen_store_is_noticed_after_the_timeout_although_the_call_never_returns(frozen_in):
    """The decision never waits on the store: while a heartbeat round blocks in a call (add to a frozen host; a
    reconnect, which takes about 10 s to a dead one), the store is declared lost one timeout after its last answer."""
    store = FreezableStore()

    def connect():
        store.wait_while_frozen()
        return store

    rounds = Rounds(connect, rank=1, world_size=2)
    rounds.beat()
    assert rounds.play(until=2, peers=lambda now: store.add(beat_key(0), 1)) is None  # the last answer: at 2 s
    store.frozen = True
    if frozen_in == "connect":
        rounds.store = None  # the connection broke: the next round reconnects
    rounds.clock.now = 3.0
    heartbeat = threading.Thread(target=rounds.beat, daemon=True)  # the heartbeat thread's next round
    heartbeat.start()
    try:
        assert store.blocked.wait(30)
        assert rounds.play(until=60, beat=False) == 2 + TIMEOUT
        assert heartbeat.is_alive()  # still inside the call
        assert rounds.watchdog.lost == [0] and "the rendezvous store stopped answering" in rounds.messages[0]
    finally:
        store.thawed.set()
        heartbeat.join(30)


@pytest.mark.parametrize("peer_beat_meanwhile", [True, False])
def test_a_process_that_did_not_run_for_a_while_lets_the_heartbeat_catch_up_before_deciding(peer_beat_meanwhile):
    """After a pause of the whole process (SIGSTOP and SIGCONT, or starvation) every time the heartbeat recorded is
    old; a peer that kept beating meanwhile must not be declared lost before the heartbeat has read it again, and
    one that did not is lost once it has."""
    store = DictStore()
    rounds = Rounds(lambda: store, rank=1, world_size=2)
    rounds.beat()
    assert rounds.play(until=3, peers=lambda now: store.add(beat_key(0), 1)) is None
    rounds.clock.now += 100.0  # the process was stopped for 100 s
    if peer_beat_meanwhile:
        store.add(beat_key(0), 100)
    assert not rounds.decide()  # the decision ran first: the heartbeat has not had its turn yet
    rounds.clock.now += CHECK_EVERY
    assert not rounds.decide()
    rounds.beat()  # its turn: at 103.25 s
    if peer_beat_meanwhile:
        assert rounds.play(until=103 + 10 * TIMEOUT, peers=lambda now: store.add(beat_key(0), 1)) is None
        assert rounds.messages == []
    else:
        assert rounds.play(until=103 + 10 * TIMEOUT) == 103 + INTERVAL + CHECK_EVERY  # the first decision it takes
        assert rounds.watchdog.lost == [0] and "rank 0 has been lost: no heartbeat came" in rounds.messages[0]


def start_store():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    connect = lambda: torch.distributed.TCPStore(  # noqa: E731
        "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5)
    )
    return store, connect


def eventually(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_threads_give_up_on_a_silent_peer_against_a_real_store_and_say_they_finished_when_stopped():
    """The wiring, end to end on the real clock: the heartbeat thread talks to a real TCPStore, the decision thread
    calls on_lost, stop() says this rank finished. The margins are generous and nothing is timed: whether the heartbeat
    or the decision runs first, the silent rank 1 is lost."""
    store, connect = start_store()
    lost = threading.Event()
    messages = []
    watchdog = liveness.PeerWatchdog(
        connect,
        rank=0,
        world_size=2,
        timeout=0.5,
        run_id="e",
        interval=0.02,
        check_every=0.01,
        on_lost=lambda message: (messages.append(message), lost.set()),
    )
    watchdog.start()
    try:
        assert lost.wait(30)
        assert watchdog.lost == [1] and "rank 1 has been lost" in messages[0]
    finally:
        watchdog.stop(finished=True)
    assert eventually(lambda: store.add("lightning_hetero/finished/e/0", 0) == 1)
    assert store.add("lightning_hetero/heartbeat/e/0", 0) > 0  # it beat before


def test_a_call_with_a_deadline_returns_its_result_raises_its_error_or_times_out():
    # A call that ends returns at once, whatever its deadline: a generous one cannot expire from load.
    assert liveness.call_with_deadline(lambda: 3, 30) == 3
    with pytest.raises(KeyError):
        liveness.call_with_deadline(lambda: {}["missing"], 30)
    never = threading.Event()  # a call that never returns: its deadline must expire, however slow the machine
    try:
        with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
            liveness.call_with_deadline(never.wait, 0.2)
    finally:
        never.set()
