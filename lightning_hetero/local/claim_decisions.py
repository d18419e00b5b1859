"""Plan: the asynchronous merge's decisions, as pure functions (see :mod:`lightning_hetero.local.claims`).

With ``sync_options={"asynchronous": True}`` an epoch's order is cut into micro-batches of the loader's batch size
("claims"), numbered in order. Each rank's first claim is its own (claim ``r`` for rank ``r``, so every rank trains at
least one micro-batch an epoch); the others are taken from a counter that every rank increments when it wants its
next micro-batch, so a faster rank takes more of them and every claim is trained once. Merge ``m`` (m >= 1) falls at
claim ``m * every``: no rank trains that claim or a later one before the merge (:func:`merges_to_join`), and each
rank joins it as soon as it can, so a rank waits at most for the micro-batch another rank is in. The epoch's end
merges what is left; near it a slower rank leaves the last claims to the faster ones (:func:`leaves_the_rest`), and a
much faster rank takes over the claim a slower one drew ahead and has not started (:func:`takes_over_read_ahead`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Optional


def claims_in_epoch(num_samples: int, micro_batch: int, drop_last: bool) -> int:
    """The number of micro-batches of ``micro_batch`` positions an epoch of ``num_samples`` is cut into: a last,
    shorter one is kept unless ``drop_last``."""
    if micro_batch < 1 or num_samples < 0:
        raise ValueError(f"micro_batch={micro_batch} must be >= 1 and num_samples={num_samples} >= 0")
    full, rest = divmod(num_samples, micro_batch)
    return full + (1 if rest and not drop_last else 0)


def claim_positions(claim: int, micro_batch: int, num_samples: int) -> range:
    """The positions of the epoch's order that claim ``claim`` trains on."""
    begin = claim * micro_batch
    return range(begin, min(begin + micro_batch, num_samples))


def merges_due(drawn: int, joined: int, every: int, claims: int) -> int:
    """How many merges whose claim (``m * every``, inside the epoch of ``claims``) has been drawn (``drawn`` claims
    are, counting the ranks' own first ones), less the ``joined`` a rank joined already this epoch: what it joins at
    the epoch's end (``drawn`` = ``claims``)."""
    if every < 1:
        raise ValueError(f"every={every} must be >= 1")
    reached = min(drawn, claims)
    passed = (reached - 1) // every if reached > 0 else 0  # boundaries m*every < reached, m >= 1
    return max(0, passed - joined)


def merges_to_join(current: int, drawn: int, held: Collection[int], joined: int, every: int, claims: int) -> int:
    """How many merges a rank joins before it trains claim ``current``: merge m's claim ``b = m * every`` (inside the
    epoch) is a boundary no rank trains past before the merge. The rank joins it when it reaches it (``current >=
    b``), or at once when another rank drew it (``drawn > b`` and ``b`` not among the claims this rank ``held``,
    ``current`` included): the holder of ``b`` reaches the merge once it finished the claims it holds before ``b``,
    so a rank that drew ``b`` itself trains on to it instead of waiting, and every other rank waits at most for the
    micro-batch the holder is in."""
    count = 0
    while (joined + count + 1) * every < claims:
        boundary = (joined + count + 1) * every
        if current < boundary and (drawn <= boundary or boundary in held):
            break
        count += 1
    return count


def merges_in_epoch(every: int, claims: int) -> int:
    """The merges inside an epoch of ``claims`` micro-batches (the epoch's end merges once more)."""
    return merges_due(claims, 0, every, claims)


def others_per_micro_batch(draws: Sequence[int], every: Optional[int] = None, intervals: int = 4) -> Optional[float]:
    """How many claims the other ranks draw while this rank trains one micro-batch: ``draws`` are this rank's last
    draws from the counter, in order, one as it starts each micro-batch (when Lightning reads the next batch ahead).
    The mean over the last ``intervals`` intervals between two draws in which the counter passed no merge's claim
    (``m * every``, drawn by another rank inside the interval or by this rank at its start; ``every`` None: no merge
    inside the epoch): in one that did, the others stopped at the merge and waited there for this rank's micro-batch,
    drawing fewer than their speed gives, and a rate taken from it would keep a slower rank drawing claims that the
    others would have trained sooner. None before one such interval."""
    # (clear: the first merge claim at or after `earlier`, m >= 1, is at or after `later`)
    usable = [
        later - earlier - 1
        for earlier, later in zip(draws, draws[1:])
        if every is None or max(every, -(-earlier // every) * every) >= later
    ][-intervals:]
    return sum(usable) / len(usable) if usable else None


def leaves_the_rest(remaining: int, others_rate: Optional[float], others: int) -> bool:
    """Whether a rank, as it starts a micro-batch, draws no more claims of the epoch and leaves the ``remaining``
    undrawn ones to the ``others`` ranks (who draw ``others_rate`` claims a micro-batch of its,
    :func:`others_per_micro_batch`; each is inside a micro-batch and holds one more drawn ahead).

    Drawing one, it would hold it while it trains the one it starts (Lightning reads a batch ahead) and end the epoch
    two of its micro-batches from now, the others waiting for it at the epoch's last merge. Leaving, it ends one
    from now, and the others when they have trained the rest and the two each has in hand (at most). When that is
    within two of its micro-batches, the epoch ends no later, and no rank waits for another longer than one of the
    slower's. (Ranks of equal speeds never leave: the others would need more than two.)"""
    return others_rate is not None and 0 < remaining and remaining + 2 * others <= 2 * others_rate


def takes_over_read_ahead(others_rate: Optional[float]) -> bool:
    """Whether a rank that finds every claim of the epoch drawn, as it starts its last micro-batch, takes over a claim
    a slower rank drew ahead (Lightning reads a batch ahead) and has not started: when the others draw at most half a
    claim while it trains one micro-batch (``others_rate``, :func:`others_per_micro_batch`), so that each other
    rank's micro-batch is at least two of its own. It then trains its last and the one taken over before the slower
    rank ends the micro-batch it is in, or within that micro-batch after it: nobody waits for the other longer than
    one micro-batch of the slower. Left to the slower rank, that claim would keep the faster waiting for the
    micro-batch the slower is in and then for all of the one drawn ahead. (Closer speeds leave it: the taker would
    end up to two of its micro-batches after the slower one.)"""
    return others_rate is not None and others_rate <= 0.5


def merge_summary(records_by_rank: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The run report's ``asynchronous`` section from every rank's merge records (the same merges on every rank):
    each merge's micro-batches per rank and each rank's wait in it for the last to arrive (its time there less the
    least any rank spent there: the exchange and the merge's work are every rank's), the time from the start of each
    rank's last micro-batch to the merge (None: it trained none since the last), and per rank the totals, with the
    claims each rank drew ahead and left to a faster one at an epoch's end (``claims_given_away``) and those it took
    over (``claims_taken_over``). Every contribution was trained from the last merged parameters: ``staleness`` is 0
    merges."""
    merges = [
        {
            "epoch": same[0]["epoch"],
            "micro_batches": [record["micro_batches"] for record in same],
            "wait_seconds": [record["seconds"] - min(r["seconds"] for r in same) for record in same],
            "last_step_seconds": [record.get("last_step_seconds") for record in same],
        }
        for same in zip(*records_by_rank)
    ]
    ranks = range(len(records_by_rank))
    return {
        "merges": len(merges),
        "micro_batches": [sum(merge["micro_batches"][rank] for merge in merges) for rank in ranks],
        "most_wait_seconds": [max((merge["wait_seconds"][rank] for merge in merges), default=0.0) for rank in ranks],
        "claims_given_away": [sum(record.get("gave_away", 0) for record in records) for records in records_by_rank],
        "claims_taken_over": [sum(record.get("took_over", 0) for record in records) for records in records_by_rank],
        "staleness": 0,
        "per_merge": merges,
    }
