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

KEY_PREFIX = "lightning_hetero/failure/"
# How long a rank whose collective broke looks for its peers' errors: the failing rank wrote before leaving, so this
# only covers a store that answers slowly.
READ_SECONDS = 3.0
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


def describe(exception: BaseException) -> str:
    return f"{type(exception).__name__}: {exception}"


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
            f"HeteroStrategy: rank {rank} lost its connection to the other ranks, and rank 0 (which hosts the"
            " rendezvous store) no longer answers: rank 0 failed or was killed. Its own output has the cause."
        )
    return (
        f"HeteroStrategy: rank {rank} lost its connection to another rank, which recorded no error: it was probably"
        " killed (out of memory, SIGKILL, a lost node). Its own output, or the system log, has the cause."
    )


def publish_failure(rank: int, exception: BaseException) -> None:
    """Record this rank's error in the rendezvous store; best effort (a dead store is no reason to hide the error)."""
    store = _default_store()
    if store is None:
        return
    try:
        store.set(f"{KEY_PREFIX}{rank}", describe(exception)[:2000])
    except Exception:  # noqa: S110 - the rank is failing already; its own error is what it raises
        pass


def read_failures(world_size: int, exclude: int, wait: float = READ_SECONDS) -> tuple[dict[int, str], bool]:
    """The errors other ranks recorded, and whether the store answered at all. Waits at most ``wait`` seconds."""
    store = _default_store()
    if store is None:
        return {}, False
    keys = {rank: f"{KEY_PREFIX}{rank}" for rank in range(world_size) if rank != exclude}
    deadline = time.monotonic() + wait
    timeout_before = getattr(store, "timeout", None)
    try:
        store.set_timeout(timedelta(seconds=wait))
        while True:
            found = {rank: store.get(key).decode() for rank, key in keys.items() if store.check([key])}
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
        return torch.distributed.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
