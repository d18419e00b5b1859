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
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

HEARTBEAT_SECONDS = 1.0
DEFAULT_PEER_TIMEOUT = 30.0
MIN_PEER_TIMEOUT = 5 * HEARTBEAT_SECONDS
# EX_TEMPFAIL: "a temporary failure; retry". torchrun (--max-restarts) and schedulers read any non-zero code as
# "not finished".
EXIT_CODE_PEER_LOST = 75
_STORE_SECONDS = 5.0  # one store request, so that a frozen store host is noticed too
_KEY = "lightning_hetero/heartbeat/{run}/{rank}"
_FINISHED_KEY = "lightning_hetero/finished/{run}/{rank}"


def check_peer_timeout(peer_timeout: Any) -> None:
    """``peer_timeout`` is None (no watchdog) or a number of seconds >= :data:`MIN_PEER_TIMEOUT`."""
    if peer_timeout is None:
        return
    if isinstance(peer_timeout, bool) or not isinstance(peer_timeout, (int, float)) or peer_timeout < MIN_PEER_TIMEOUT:
        raise ValueError(
            f"`peer_timeout={peer_timeout!r}` must be a number of seconds >= {MIN_PEER_TIMEOUT:g} (the heartbeat comes"
            f" every {HEARTBEAT_SECONDS:g} s and a busy machine may delay a few), or None to wait on a lost rank as"
            f" long as the process group's timeout. The default is {DEFAULT_PEER_TIMEOUT:g}."
        )


def lost_ranks(
    last_heard: dict[int, float], finished: set[int], store_lost_since: Optional[float], now: float, timeout: float
) -> list[int]:
    """The peers to give up on: silent for ``timeout`` seconds (all of them when the store has been unreachable that
    long), except those that said they finished their trainer call."""
    if store_lost_since is not None and now - store_lost_since >= timeout:
        return sorted(rank for rank in last_heard if rank not in finished)
    return sorted(rank for rank, heard in last_heard.items() if now - heard >= timeout and rank not in finished)


def lost_message(rank: int, lost: list[int], timeout: float, store_lost: bool, failures: dict[int, str]) -> str:
    named = ", ".join(map(str, lost))
    which = f"rank {named} has" if len(lost) == 1 else f"ranks {named} have"
    why = (
        "the rendezvous store stopped answering (its host, rank 0 or the torchrun agent, is gone)"
        if store_lost
        else "no heartbeat came"
    )
    recorded = "".join(f" Rank {r} had failed with {failures[r]}." for r in sorted(failures))
    return (
        f"HeteroStrategy: {which} been lost: {why} for {timeout:g} s, so its process is gone or frozen (killed,"
        f" out of memory, its machine down).{recorded} Rank {rank} exits with code {EXIT_CODE_PEER_LOST} instead of"
        " waiting for it in a collective. Resume with `fit(ckpt_path=\"last\")`; under `torchrun --max-restarts`"
        " that happens by itself."
    )


class PeerWatchdog:
    """The heartbeat thread of one rank (see the module's docstring)."""

    def __init__(
        self,
        connect: Callable[[], Any],
        rank: int,
        world_size: int,
        timeout: float,
        run_id: str,
        on_lost: Optional[Callable[[str], None]] = None,
        read_failures: Optional[Callable[[], dict[int, str]]] = None,
        interval: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._run_id = run_id
        self._on_lost = on_lost or _exit_now
        self._read_failures = read_failures or dict
        self._interval, self._clock = interval, clock
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._finished = False
        self.lost: list[int] = []

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lightning_hetero-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, finished: bool) -> None:
        """End the heartbeat. ``finished``: the trainer call ended normally, so the others must not count this rank
        as lost when its process exits (a rank that failed stays silent: its peers must stop too)."""
        if self._thread is None:
            return
        self._finished = finished
        self._stop.set()
        self._thread.join(timeout=_STORE_SECONDS + self._interval)
        self._thread = None

    def _key(self, rank: int) -> str:
        return _KEY.format(run=self._run_id, rank=rank)

    def _finished_key(self, rank: int) -> str:
        return _FINISHED_KEY.format(run=self._run_id, rank=rank)

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        now = self._clock()
        last_heard = {peer: now for peer in peers}
        counts: dict[int, int] = {}
        finished: set[int] = set()
        store_lost_since: Optional[float] = None
        store = None
        while not self._stop.is_set():
            now = self._clock()
            try:
                if store is None:
                    store = self._connect()
                store.add(self._key(self.rank), 1)
                for peer in peers:
                    count = store.add(self._key(peer), 0)  # a read that never waits for a missing key
                    if count != counts.get(peer):
                        counts[peer], last_heard[peer] = count, now
                    if peer not in finished and store.add(self._finished_key(peer), 0):
                        finished.add(peer)
                store_lost_since = None
            except Exception:  # noqa: BLE001 - any failure to reach the store counts as silence
                store = None
                store_lost_since = now if store_lost_since is None else store_lost_since
            lost = lost_ranks(last_heard, finished, store_lost_since, now, self.timeout)
            if lost:
                self.lost = lost
                self._on_lost(lost_message(self.rank, lost, self.timeout, store_lost_since is not None,
                                           self._failures()))  # fmt: skip
                return
            self._stop.wait(self._interval)
        try:
            if store is not None and self._finished:
                store.add(self._finished_key(self.rank), 1)
        except Exception:  # noqa: BLE001 - the others then time out on this rank only if they are still running
            pass

    def _failures(self) -> dict[int, str]:
        try:
            return self._read_failures()
        except Exception:  # noqa: BLE001 - the store may be what was lost
            return {}


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
