"""Recover: when one rank fails, every other rank says which one and with what error.

A rank whose ``training_step`` (or ``collate_fn``, or anything else) raises leaves the job; its peers only learn of it
when their next collective breaks, and then print gloo's "Connection reset by peer" and nothing about the cause. So
the failing rank writes its error into the rendezvous store (the key-value store every rank already reaches, no
collective involved) before it exits, and a rank whose collective broke reads the store and puts the first error
it finds in front of its own message. Reading never waits longer than ``READ_SECONDS``: if the store is gone (it
lives in rank 0's process), the message says so instead.

The decisions (is this a lost peer? what to say?) are pure functions; the store access is two small functions.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed

from lightning_hetero.recover.liveness import EXIT_CODE_PEER_LOST, call_with_deadline, store_host
from lightning_hetero.runtime.collectives import describe_failure
from lightning_hetero.runtime.internal_access import resolve
from lightning_hetero.runtime.torch_internals import DEFAULT_STORE

KEY_PREFIX = "lightning_hetero/failure/"
# How long a rank whose collective broke looks for its peers' errors: the failing rank wrote before leaving (before its
# sockets closed), so this only covers a store that answers slowly; a killed rank wrote nothing and costs the wait.
READ_SECONDS = 1.0
_POLL_SECONDS = 0.05
# What torch's gloo backend (and NCCL, where it raises instead of aborting the process) says when a peer process is
# gone (lower case). Phrases a rank's own failure can produce too (timeouts) are left out: that rank must publish.
_LOST_PEER_PHRASES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "communicator was aborted",
)


def is_lost_peer_error(exception: BaseException) -> bool:
    """Whether ``exception`` is a collective that broke because a peer went away (not this rank's own error)."""
    if isinstance(exception, getattr(torch.distributed, "DistNetworkError", ())):
        return True
    if not isinstance(exception, RuntimeError):
        return False
    text = str(exception).lower()
    return any(phrase in text for phrase in _LOST_PEER_PHRASES)


def lost_peer_explanation(rank: int, failures: dict[int, str], store_reachable: bool) -> str:
    """What rank ``rank`` says when its collective broke, given the errors its peers recorded."""
    if failures:
        first = min(failures)
        others = "".join(f"; rank {r} also failed ({failures[r]})" for r in sorted(failures) if r != first)
        return (
            f"HeteroStrategy: rank {first} failed with {failures[first]}{others}. Rank {rank} stopped because its"
            " collective with that rank broke (the error below); fix the error on the failing rank."
        )
    if not store_reachable:
        return (
            f"HeteroStrategy: rank {rank} lost its connection to the other ranks, and {store_host()}, which hosts the"
            " rendezvous store, no longer answers: it failed, was killed or is frozen. Its own output has the cause."
            f" Rank {rank} exits with code {EXIT_CODE_PEER_LOST}."
        )
    return (
        f"HeteroStrategy: rank {rank} lost its connection to another rank, which recorded no error: it was probably"
        " killed (out of memory, SIGKILL, a lost node). Its own output, or the system log, has the cause."
        f" Rank {rank} exits with code {EXIT_CODE_PEER_LOST}."
    )


def publish_failure(rank: int, exception: BaseException) -> None:
    """Record this rank's error in the rendezvous store; best effort (a dead store is no reason to hide the error),
    and bounded: a store call to a frozen host would wait until it runs again."""
    store = _default_store()
    if store is None:
        return
    try:
        call_with_deadline(lambda: store.set(f"{KEY_PREFIX}{rank}", describe_failure(exception)[:2000]), READ_SECONDS)
    except Exception:  # noqa: S110 - the rank is failing already; its own error is what it raises
        pass


def recorded_in(store: Any, world_size: int, exclude: int) -> dict[int, str]:
    """The errors ranks other than ``exclude`` recorded in ``store`` so far (one look, no waiting)."""
    keys = {rank: f"{KEY_PREFIX}{rank}" for rank in range(world_size) if rank != exclude}
    return {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}


def read_failures(world_size: int, exclude: int, wait: float = READ_SECONDS) -> tuple[dict[int, str], bool]:
    """The errors other ranks recorded, and whether the store answered at all. Returns within about ``wait`` seconds,
    also when the store's host is frozen (a store call then blocks whatever the store's timeout)."""
    try:
        return call_with_deadline(lambda: _poll_failures(world_size, exclude, wait), wait + _POLL_SECONDS + 1.0)
    except TimeoutError:
        return {}, False


def _poll_failures(world_size: int, exclude: int, wait: float) -> tuple[dict[int, str], bool]:
    store = _default_store()
    if store is None:
        return {}, False
    deadline = time.monotonic() + wait
    timeout_before = getattr(store, "timeout", None)
    try:
        store.set_timeout(timedelta(seconds=wait))
        while True:
            found = recorded_in(store, world_size, exclude)
            if found or time.monotonic() >= deadline:
                return found, True
            time.sleep(_POLL_SECONDS)
    except Exception:
        return {}, False
    finally:
        if timeout_before is not None:
            try:
                store.set_timeout(timeout_before)
            except Exception:  # noqa: S110 - a store that no longer answers keeps whatever timeout it had
                pass


def _default_store() -> Optional[Any]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        return resolve(DEFAULT_STORE)()
    except (RuntimeError, ValueError):
        return None
