"""Train: the counter of an epoch's claims for the asynchronous merges (:mod:`lightning_hetero.local.claims`), kept
in the job's rendezvous store, whose atomic ``add`` every rank shares."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, Optional

# A client of the job's rendezvous store: ``add(key, amount) -> new value`` (TCPStore's).
StoreAdd = Callable[[str, int], int]


class ClaimCounter:
    """The counter of one epoch's micro-batches, shared by the ranks through the store (``add`` is atomic)."""

    def __init__(self, add: StoreAdd, run: str, delete: Optional[Callable[[str], Any]] = None) -> None:
        self._add, self._run, self._delete = add, run, delete  # (delete: the store's delete_key, if it has one)

    def _key(self, epoch: int) -> str:
        return f"lightning_hetero/claims/{self._run}/epoch_{epoch}"

    def take(self, epoch: int) -> int:
        """The next dynamic draw of ``epoch`` (0, 1, ... across the ranks, in the order they ask)."""
        return self._add(self._key(epoch), 1) - 1

    def taken(self, epoch: int) -> int:
        """How many dynamic draws of ``epoch`` have been taken by any rank."""
        return self._add(self._key(epoch), 0)

    def publish_ahead(self, epoch: int, rank: int, claim: int, published: int) -> int:
        """Tell the others ``rank`` drew ``claim`` (``published``: what it told before, or 0); returns what it tells."""
        self._add(f"{self._key(epoch)}/ahead_{rank}", claim + 1 - published)
        return claim + 1

    def ahead_of(self, epoch: int, rank: int) -> Optional[int]:
        """The latest claim ``rank`` drew from the counter this epoch (None: none yet)."""
        told = self._add(f"{self._key(epoch)}/ahead_{rank}", 0)
        return told - 1 if told else None

    def start(self, epoch: int, claim: int) -> bool:
        """Whether this rank is the first to start ``claim``: the rank that drew it as it starts training it, or a
        faster rank taking it over. One atomic ``add`` decides, so exactly one of them trains it."""
        return self._add(f"{self._key(epoch)}/start_{claim}", 1) == 1

    def forget(self, epoch: int, rank: int, started: Collection[int]) -> None:
        """After the epoch's last merge (no rank takes a claim over any more): the keys this rank's claims left in
        the store, so that a long fit does not fill it with one per micro-batch."""
        if self._delete is not None:
            for key in [f"ahead_{rank}", *(f"start_{claim}" for claim in started)]:
                self._delete(f"{self._key(epoch)}/{key}")

    def leave(self, epoch: int, world_size: int) -> bool:
        """Whether this rank may draw no more claims of ``epoch``: granted to every rank but the last to ask, so that
        one rank always draws to the end and every claim is trained."""
        return self._add(f"{self._key(epoch)}/left", 1) < world_size
