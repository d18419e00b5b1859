"""The heartbeat watchdog: the decision (pure) and the thread against a real store, with a fake clock."""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest
import torch.distributed

from lightning_hetero import liveness


def test_a_peer_silent_for_the_timeout_is_lost_unless_it_finished():
    heard = {1: 100.0, 2: 70.0, 3: 60.0}
    assert liveness.lost_ranks(heard, finished=set(), store_lost_since=None, now=100.0, timeout=30) == [2, 3]
    assert liveness.lost_ranks(heard, finished={3}, store_lost_since=None, now=100.0, timeout=30) == [2]
    assert liveness.lost_ranks(heard, finished=set(), store_lost_since=None, now=99.0, timeout=30) == [3]


def test_a_store_unreachable_for_the_timeout_loses_every_unfinished_peer():
    heard = {1: 100.0, 2: 100.0}
    assert liveness.lost_ranks(heard, set(), store_lost_since=80.0, now=100.0, timeout=30) == []
    assert liveness.lost_ranks(heard, {2}, store_lost_since=70.0, now=100.0, timeout=30) == [1]


def test_the_message_names_the_lost_rank_the_exit_code_and_the_recorded_failure():
    message = liveness.lost_message(0, [1], 30, store_lost=False, failures={1: "RuntimeError: boom"})
    assert "rank 1 has been lost: no heartbeat came for 30 s" in message
    assert "Rank 1 had failed with RuntimeError: boom" in message and "code 75" in message
    assert "ranks 0, 2 have been lost: the rendezvous store" in liveness.lost_message(1, [0, 2], 30, True, {})


@pytest.mark.parametrize("value", [0, 4.9, -1, True, "30", [30]])
def test_a_bad_peer_timeout_is_refused_naming_the_value(value):
    with pytest.raises(ValueError, match=re.escape(f"`peer_timeout={value!r}` must be a number of seconds >= 5")):
        liveness.check_peer_timeout(value)


@pytest.mark.parametrize("value", [None, 5, 30.0, 3600])
def test_good_peer_timeouts_pass(value):
    liveness.check_peer_timeout(value)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # each look at the clock is a second later: the timeout passes in a few rounds
        return self.now


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
        connect, rank=0, world_size=3, timeout=5, run_id="t", interval=0.001, clock=FakeClock(),
        on_lost=lambda message: (messages.append(message), lost.set()),
    )  # fmt: skip
    store.add("lightning_hetero/finished/t/2", 1)  # rank 2 finished its trainer call; rank 1 never beats
    watchdog.start()
    assert lost.wait(10)
    assert watchdog.lost == [1] and "rank 1 has been lost" in messages[0]
    assert store.add("lightning_hetero/heartbeat/t/0", 0) > 0  # it beat meanwhile


def test_the_thread_keeps_quiet_while_peers_beat_and_says_it_finished_when_stopped():
    store, connect = start_store()
    messages = []
    clock = FakeClock()

    def clock_with_a_beating_peer() -> float:
        store.add("lightning_hetero/heartbeat/u/0", 1)  # rank 0 beats once per round, however slow the rounds
        return clock()

    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=5, run_id="u", interval=0.001,
                                     clock=clock_with_a_beating_peer, on_lost=messages.append)  # fmt: skip
    watchdog.start()
    threading.Event().wait(0.3)  # many rounds, each a fake second: far past the timeout
    watchdog.stop(finished=True)
    assert messages == [] and clock.now > 20
    assert store.add("lightning_hetero/finished/u/1", 0) == 1


def test_an_unreachable_store_loses_the_peers():
    messages = []

    def connect():
        raise ConnectionRefusedError("store gone")

    watchdog = liveness.PeerWatchdog(connect, 1, 2, timeout=5, run_id="v", interval=0.001, clock=FakeClock(),
                                     on_lost=messages.append)  # fmt: skip
    watchdog.start()
    watchdog._thread.join(10)
    assert watchdog.lost == [0] and "the rendezvous store stopped answering" in messages[0]
