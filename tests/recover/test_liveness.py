"""The heartbeat watchdog: the decision (pure) and the thread against a real store, with a fake clock."""

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


def start_store():
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    connect = lambda: torch.distributed.TCPStore(  # noqa: E731
        "127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5)
    )
    return store, connect


def test_the_thread_gives_up_on_a_silent_peer_and_not_on_one_that_finished():
    store, connect = start_store()
    lost = threading.Event()
    messages = []
    watchdog = liveness.PeerWatchdog(
        connect, rank=0, world_size=3, timeout=0.5, run_id="t", interval=0.02, check_every=0.01,
        on_lost=lambda message: (messages.append(message), lost.set()),
    )  # fmt: skip
    store.add("lightning_hetero/finished/t/2", 1)  # rank 2 finished its trainer call; rank 1 never beats
    watchdog.start()
    try:
        assert lost.wait(10)
        assert watchdog.lost == [1] and "rank 1 has been lost" in messages[0]
        assert store.add("lightning_hetero/heartbeat/t/0", 0) > 0  # it beat meanwhile
    finally:
        watchdog.stop(finished=False)


def test_the_thread_keeps_quiet_while_peers_beat_and_says_it_finished_when_stopped():
    store, connect = start_store()
    messages = []
    stopping = threading.Event()

    def peer_beats():
        while not stopping.wait(0.05):
            store.add("lightning_hetero/heartbeat/u/0", 1)

    peer = threading.Thread(target=peer_beats, daemon=True)
    peer.start()
    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=0.5, run_id="u", interval=0.02, check_every=0.01,
                                     on_lost=messages.append)  # fmt: skip
    watchdog.start()
    time.sleep(2.0)  # four timeouts
    watchdog.stop(finished=True)
    stopping.set()
    peer.join(5)
    assert messages == []
    assert store.add("lightning_hetero/finished/u/1", 0) == 1


def test_an_unreachable_store_loses_the_peers():
    messages = []

    def connect():
        raise ConnectionRefusedError("store gone")

    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=0.5, run_id="v", interval=0.02, check_every=0.01,
                                     on_lost=messages.append)  # fmt: skip
    watchdog.start()
    try:
        watchdog._threads[1].join(10)
        assert watchdog.lost == [0] and "the rendezvous store stopped answering" in messages[0]
    finally:
        watchdog.stop(finished=False)


class FrozenStore:
    """A store whose host is frozen (SIGSTOP): every call blocks until it is thawed, whatever its timeout."""

    def __init__(self) -> None:
        self.thawed = threading.Event()

    def add(self, key, amount):
        self.thawed.wait()
        return 0


@pytest.mark.parametrize("frozen_in", ["add", "connect"])
def test_a_frozen_store_is_noticed_after_the_timeout_although_the_call_never_returns(frozen_in):
    """The decision never waits on the store: a call that blocks (add to a frozen host; a reconnect, which takes about
    10 s to a dead one) still ends in the store being declared lost one timeout after its last answer."""
    store = FrozenStore()
    lost = threading.Event()
    messages = []

    def connect():
        if frozen_in == "connect":
            store.thawed.wait()
        return store

    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=0.5, run_id="w", interval=0.05, check_every=0.02,
                                     on_lost=lambda message: (messages.append(message), lost.set()))  # fmt: skip
    started = time.monotonic()
    watchdog.start()
    try:
        assert lost.wait(10), "the watchdog waited with the store"
        waited = time.monotonic() - started
        assert watchdog.lost == [0] and "the rendezvous store stopped answering" in messages[0]
        assert 0.5 <= waited < 5, waited  # one timeout after the start (the last answer), not when the call returns
    finally:
        store.thawed.set()
        watchdog.stop(finished=False)


def test_a_process_that_did_not_run_for_a_while_lets_the_heartbeat_catch_up_before_deciding():
    """After a pause of the whole process (SIGSTOP and SIGCONT, or starvation) every time the heartbeat recorded is
    old; a peer that kept beating meanwhile must not be declared lost before the heartbeat has read it again."""
    store, connect = start_store()
    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]  # noqa: E731
    messages = []
    beating = threading.Event()

    def peer_beats():
        peer = connect()
        while not beating.is_set():
            peer.add("lightning_hetero/heartbeat/x/0", 1)
            time.sleep(0.02)

    peer = threading.Thread(target=peer_beats, daemon=True)
    peer.start()
    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=1.0, run_id="x", interval=0.05, check_every=0.02,
                                     clock=clock, on_lost=messages.append)  # fmt: skip
    watchdog.start()
    try:
        time.sleep(0.3)
        offset[0] += 100.0  # the process was stopped for 100 s; the peer went on beating
        time.sleep(0.5)
        assert messages == []
    finally:
        beating.set()
        watchdog.stop(finished=True)
        peer.join(5)


def test_a_call_with_a_deadline_returns_its_result_raises_its_error_or_times_out():
    assert liveness.call_with_deadline(lambda: 3, 1.0) == 3
    with pytest.raises(KeyError):
        liveness.call_with_deadline(lambda: {}["missing"], 1.0)
    never = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        liveness.call_with_deadline(never.wait, 0.2)
    assert time.monotonic() - started < 2
    never.set()
