"""Recover: when a rank's process is gone, every other rank stops within the peer timeout instead of hanging.

A rank killed with SIGKILL (or by the OOM killer, or with its machine) raises nothing and publishes nothing. Its
peers learn of it only if their next collective breaks, and some never break: gloo waits without a timeout in parts
of DeepSpeed's step (``all_gather_dp_groups``), so a survivor could wait for ever, or for the 30-minute process-group
timeout where there is one.

So every rank runs a heartbeat thread while a trainer call runs. Each second it increments its own counter in the
rendezvous store (over its own connection, never the one the main thread uses) and reads its peers' counters. A
peer whose counter has not moved for ``peer_timeout`` seconds is lost; so is every peer when the store itself stops
answering for that long (it lives in rank 0's process under Lightning's launcher, in the agent under torchrun). The
rank then prints which rank was lost and leaves with :data:`EXIT_CODE_PEER_LOST` at once, from the thread: its main
thread may be inside a collective that will never return.

What tells a dead peer from a slow one: the heartbeat runs beside the work, not inside it. A rank writing a large
checkpoint, profiling, converting a checkpoint or waiting for the others in a collective keeps beating; only a process
that no longer runs (killed, crashed, frozen with SIGSTOP, its host down) stops. A legitimate wait of any length never
trips it. The decision is the pure :func:`lost_ranks`.

No store call has a deadline of its own: a ``TCPStore.add`` against a frozen store host (SIGSTOP) blocks until the
host runs again, whatever the store's timeout, and a reconnect to a dead host takes about 10 s. So the store traffic
runs in one thread (:class:`PeerWatchdog`'s heartbeat) and the decision in another that never touches the store: it
reads the times of the last answers the heartbeat thread got, with a clock read at the moment of deciding, so a
store that hangs, refuses or answers slowly is noticed ``peer_timeout`` seconds after its last answer all the same.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, TypeVar

T = TypeVar("T")

HEARTBEAT_SECONDS = 1.0
# How often the decision is taken: it only reads memory, so it can be frequent and keep the bound tight.
DECISION_SECONDS = 0.25
DEFAULT_PEER_TIMEOUT = 30.0
MIN_PEER_TIMEOUT = 5 * HEARTBEAT_SECONDS
# EX_TEMPFAIL: "a temporary failure; retry". torchrun (--max-restarts) and schedulers read any non-zero code as
# "not finished".
EXIT_CODE_PEER_LOST = 75
_STORE_SECONDS = 5.0  # the timeout of each heartbeat connection (it bounds waits for keys, not every call)
# How long the lost-rank message waits for the errors the lost ranks recorded (the store may be what was lost).
_FAILURES_SECONDS = 1.0
_KEY = "lightning_hetero/heartbeat/{run}/{rank}"
_FINISHED_KEY = "lightning_hetero/finished/{run}/{rank}"


def check_peer_timeout(peer_timeout: Any) -> None:
    """``peer_timeout`` is None (no watchdog) or a finite number of seconds >= :data:`MIN_PEER_TIMEOUT`."""
    if peer_timeout is None:
        return
    number = not isinstance(peer_timeout, bool) and isinstance(peer_timeout, (int, float))
    if not number or not math.isfinite(peer_timeout) or peer_timeout < MIN_PEER_TIMEOUT:
        raise ValueError(
            f"`peer_timeout={peer_timeout!r}` must be a finite number of seconds >= {MIN_PEER_TIMEOUT:g} (the"
            f" heartbeat comes every {HEARTBEAT_SECONDS:g} s and a busy machine may delay a few), or None to wait on a"
            f" lost rank as long as the process group's timeout. The default is {DEFAULT_PEER_TIMEOUT:g}."
        )


def lost_ranks(
    last_heard: dict[int, float], finished: set[int], store_answered: float, now: float, timeout: float
) -> tuple[list[int], bool]:
    """The peers to give up on, and whether it is because the store went silent.

    A peer is lost when its counter has not moved for ``timeout`` seconds; every peer is, when the store itself has
    not answered for that long (``store_answered``: when the last round of store calls that completed began). Peers
    that said they finished their trainer call are never lost.
    """
    unfinished = sorted(rank for rank in last_heard if rank not in finished)
    if now - store_answered >= timeout:
        return unfinished, True
    return [rank for rank in unfinished if now - last_heard[rank] >= timeout], False


def lost_message(
    rank: int, lost: list[int], timeout: float, store_lost: bool, failures: dict[int, str], store_silent: float = 0.0
) -> str:
    """What rank ``rank`` says before it exits; ``store_silent``: seconds since the store last answered it."""
    named = ", ".join(map(str, lost))
    which = f"rank {named} has" if len(lost) == 1 else f"ranks {named} have"
    host = f"the rendezvous store stopped answering ({store_host()} hosts it)"
    why = f"{host} for {timeout:g} s" if store_lost else f"no heartbeat came for {timeout:g} s"
    if not store_lost and store_silent > 2 * HEARTBEAT_SECONDS:
        # A silent store silences every peer too: which of the two is gone cannot be told apart yet.
        why += f" and the rendezvous store ({store_host()} hosts it) has not answered for {store_silent:.0f} s"
    recorded = "".join(f" Rank {r} had failed with {failures[r]}." for r in sorted(failures))
    return (
        f"HeteroStrategy: {which} been lost: {why}, so its process is gone or frozen (killed,"
        f" out of memory, stopped, its machine down).{recorded} Rank {rank} exits with code {EXIT_CODE_PEER_LOST}"
        ' instead of waiting for it in a collective. Resume with `fit(ckpt_path="last")`; under `torchrun'
        " --max-restarts` that happens by itself."
    )


def store_host() -> str:
    """Which process hosts this job's rendezvous store, in words."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return "the torchrun agent"
    return "rank 0"


class PeerWatchdog:
    """The heartbeat of one rank and the decision that its peers are lost (see the module's docstring).

    Two daemon threads: the heartbeat talks to the store (``connect()`` gives a new connection) every ``interval``
    and may block in a call for as long as the store host is frozen; the decision runs every ``check_every`` from
    the times the heartbeat recorded, and calls ``on_lost(message)`` (default: print it, exit 75). Each thread's
    loop only waits and calls its round (:meth:`_beat_once`, :meth:`_decide_once`), which reads ``clock``.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        rank: int,
        world_size: int,
        timeout: float,
        run_id: str,
        on_lost: Optional[Callable[[str], None]] = None,
        read_failures: Optional[Callable[[Any], dict[int, str]]] = None,
        interval: float = HEARTBEAT_SECONDS,
        check_every: float = DECISION_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._run_id = run_id
        self._on_lost = on_lost or _exit_now
        self._read_failures = read_failures or (lambda store: {})
        self._interval, self._check_every, self._clock = interval, check_every, clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._finished = False
        self._lock = threading.Lock()
        self._peers = [r for r in range(world_size) if r != rank]
        # Written by the heartbeat thread, read by the decision (under the lock).
        self._last_heard: dict[int, float] = {}
        self._store_answered = 0.0
        self._finished_peers: set[int] = set()
        # The decision's own: when it last decided, and when this process ran again after a pause (None: it did not).
        self._checked = 0.0
        self._resumed: float | None = None
        self.lost: list[int] = []

    def start(self) -> None:
        self._begin(self._clock())
        self._threads = [
            threading.Thread(target=self._beat, name="lightning_hetero-heartbeat", daemon=True),
            threading.Thread(target=self._watch, name="lightning_hetero-watchdog", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def stop(self, finished: bool) -> None:
        """End both threads. ``finished``: the trainer call ended normally, so the others must not count this rank
        as lost when its process exits (a rank that failed stays silent: its peers must stop too). Waits at most a
        few seconds: a heartbeat stuck in a call to a frozen store is left behind (a daemon thread)."""
        if not self._threads:
            return
        self._finished = finished
        self._stop.set()
        beat, watch = self._threads
        watch.join()  # it never blocks
        # Only a rank that finished has something left to say (that it finished); one that failed does not wait for
        # a heartbeat stuck in a reconnect (about 10 s to a dead store) before it exits. It does let a round in
        # flight (milliseconds) end: a store call that returns while the interpreter finalises aborts the process
        # ("terminate called without an active exception", exit 134 instead of the run's own code).
        beat.join(timeout=_STORE_SECONDS + self._interval if finished else self._interval)
        self._threads = []

    def _begin(self, now: float) -> None:
        """Where both rounds start at clock time ``now``: every peer and the store just heard, a decision just taken."""
        self._last_heard = {peer: now for peer in self._peers}
        self._store_answered = now
        self._checked, self._resumed = now, None

    def store_silent_for(self) -> float:
        """Seconds since the store last answered this rank's heartbeat (about one interval while all is well)."""
        with self._lock:
            return self._clock() - self._store_answered

    def _key(self, rank: int) -> str:
        return _KEY.format(run=self._run_id, rank=rank)

    def _finished_key(self, rank: int) -> str:
        return _FINISHED_KEY.format(run=self._run_id, rank=rank)

    def _beat(self) -> None:
        counts: dict[int, int] = {}
        store = None
        while not self._stop.is_set():
            store = self._beat_once(store, counts)
            self._stop.wait(self._interval)
        try:
            if store is not None and self._finished:
                store.add(self._finished_key(self.rank), 1)
        except Exception:  # noqa: BLE001 - the others then time out on this rank only if they are still running
            pass

    def _beat_once(self, store: Any, counts: dict[int, int]) -> Any:
        """One heartbeat round: beat, read the peers' counters (``counts``: the last ones read, updated) and finished
        flags, and record when they were heard. Returns the connection to use next round (``store``, or a new one),
        or None after any failure: the next round reconnects. It may block as long as the store does."""
        began = self._clock()
        try:
            if store is None:
                store = self._connect()
            store.add(self._key(self.rank), 1)
            heard, finished = {}, set()
            for peer in self._peers:
                count = store.add(self._key(peer), 0)  # a read that never waits for a missing key
                if count != counts.get(peer):
                    counts[peer] = count
                    heard[peer] = began  # it beat after our previous round began at the latest
                if store.add(self._finished_key(peer), 0):
                    finished.add(peer)
            with self._lock:
                self._last_heard.update(heard)
                self._finished_peers |= finished
                self._store_answered = began
            return store
        except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
            return None

    def _watch(self) -> None:
        while not self._stop.wait(self._check_every):
            if self._decide_once(self._clock()):
                return

    def _decide_once(self, now: float) -> bool:
        """One decision at clock time ``now`` from the times the heartbeat recorded; it never touches the store. When
        peers are lost it calls ``on_lost`` and returns True (the decision ends there)."""
        if now - self._checked > self._interval + self._check_every:
            # This process did not run for a while (stopped, starved): the heartbeat has not had its turn either,
            # so its times are stale. Decide again once it has had one round.
            self._resumed = now
        self._checked = now
        if self._resumed is not None and now - self._resumed < self._interval + self._check_every:
            return False
        self._resumed = None
        with self._lock:
            lost, store_lost = lost_ranks(
                self._last_heard, self._finished_peers, self._store_answered, now, self.timeout
            )
            store_silent = now - self._store_answered
        if not lost:
            return False
        self.lost = lost
        failures = {} if store_silent > 2 * self._interval else self._recorded_failures()
        self._on_lost(lost_message(self.rank, lost, self.timeout, store_lost, failures, store_silent))
        return True

    def _recorded_failures(self) -> dict[int, str]:
        """What the lost ranks recorded before going, over a connection of its own, within a deadline."""
        try:
            return call_with_deadline(lambda: self._read_failures(self._connect()), _FAILURES_SECONDS)
        except Exception:  # noqa: BLE001 - the store may be what was lost
            return {}


def call_with_deadline(function: Callable[[], T], seconds: float) -> T:
    """``function()``'s result, or TimeoutError when it has not returned within ``seconds``.

    It runs in a daemon thread: a store call cannot be interrupted, so one that never returns is left behind (and
    ends with the process) instead of holding up its caller.
    """
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, function()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome.append((False, error))

    thread = threading.Thread(target=run, name="lightning_hetero-deadline", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise TimeoutError(f"no answer within {seconds:g} s")
    succeeded, value = outcome[0]
    if not succeeded:
        raise value
    return value


def _exit_now(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE_PEER_LOST)


def store_connector(timeout: float = _STORE_SECONDS) -> Callable[[], Any]:
    """A function that opens a new client connection to this job's rendezvous store (MASTER_ADDR, MASTER_PORT)."""
    import torch.distributed

    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))

    def connect() -> Any:
        return torch.distributed.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )

    return connect


def run_id(trainer_call: int) -> str:
    """Names the keys of one trainer call (every rank makes the same calls) of this attempt: a job restarted by
    torchrun, or the next ``fit``/``validate`` in the same processes, must not read the counters of an earlier one."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{attempt}-{trainer_call}"
