"""Plan: the streaming merge's fragments, which values of the model merge when (``sync_options={"fragments": F}``).

Streaming DiLoCo (Douillard et al. 2025) merges the parameters in F fragments in turn, so that 1/F of the model
crosses the wire at a time. A fragment here is a contiguous range of the model's values in its order, all of them of
as equal a size as the values allow, cut inside a parameter tensor where the range ends there: a model whose largest
tensor holds most of its values (one wide layer) still peaks at 1/F of them. A tensor's part in a fragment is a
"piece"; a tensor that is not cut is one piece. Pure functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Optional

# A piece of a parameter tensor: (its index in the model's order, first value, end value) of its flattened values.
Piece = tuple[int, int, int]


def due_fragments(steps_done: int, sync_every: int, fragments: int, last_of_epoch: bool) -> tuple[int, ...]:
    """The fragments that merge after ``steps_done`` training steps of the fit: fragment f every ``sync_every`` steps,
    ``sync_every / fragments`` steps after fragment f - 1; all of them at the end of each epoch (so that evaluation
    and the epoch's checkpoint see one model). With one fragment: every ``sync_every`` steps and at an epoch's end."""
    if last_of_epoch:
        return tuple(range(fragments))
    interval = sync_every // fragments
    if steps_done % interval:
        return ()
    return ((steps_done // interval - 1) % fragments,)


def fragment_pieces(
    sizes: Sequence[int], fragments: int, uncut: Collection[int] = ()
) -> tuple[list[Piece], list[tuple[int, int]]]:
    """The model's values (parameter tensors of ``sizes`` values, in its order) cut into ``fragments`` contiguous
    ranges of equal size (to a value), as pieces of tensors in the model's order, and each fragment's pieces
    ``[begin, end)``. Tensors in ``uncut`` (indices: e.g. not contiguous in memory) stay whole: a cut inside one
    moves to its nearer edge, or on to the next place left free. Fragments that cannot all hold a value are
    refused."""
    total, fragments = sum(sizes), int(fragments)
    if not 1 <= fragments <= total:
        raise ValueError(
            f"`sync_options['fragments']={fragments}`: the model trains {total} parameter values, and each fragment"
            f" needs at least one. Use at most {total} fragments."
        )
    starts = [0, *itertools.accumulate(sizes)][:-1]
    cuts = _cuts(sizes, starts, fragments, uncut)
    if cuts is None:
        raise ValueError(
            f"`sync_options['fragments']={fragments}`: the model's {total} parameter values cannot be cut into"
            f" {fragments} non-empty fragments: its tensors {sorted(uncut)} are not contiguous in memory and stay"
            " whole, which leaves too few places to cut. Use fewer fragments."
        )
    pieces: list[Piece] = []
    owners: list[int] = []  # each piece's fragment
    for index, (size, start) in enumerate(zip(sizes, starts)):
        inside = [cut - start for cut in cuts if start < cut < start + size]
        for begin, end in zip([0, *inside], [*inside, size]):
            pieces.append((index, begin, end))
            owners.append(sum(cut <= start + begin for cut in cuts))
    bounds = [(owners.index(fragment), len(owners) - owners[::-1].index(fragment)) for fragment in range(fragments)]
    return pieces, bounds


def _cuts(sizes: Sequence[int], starts: Sequence[int], fragments: int, uncut: Collection[int]) -> Optional[list[int]]:
    """Where the fragments end, in values from the model's start: at equal shares, moved off the inside of an uncut
    tensor (to its nearer edge), then pushed on past an earlier cut and back before a later one or the end, so that
    every fragment keeps a value. None when the uncut tensors leave too few places."""
    total = sum(sizes)
    whole = [(starts[index], starts[index] + sizes[index]) for index in uncut]

    def span_around(position: int) -> Optional[tuple[int, int]]:
        return next(((begin, end) for begin, end in whole if begin < position < end), None)

    cuts = []
    for fragment in range(1, fragments):
        cut = total * fragment // fragments
        span = span_around(cut)
        cuts.append(cut if span is None else span[0] if cut - span[0] <= span[1] - cut else span[1])
    previous = 0
    for position, cut in enumerate(cuts):
        if cut <= previous:  # (two cuts met at one tensor's edge: the later one moves on)
            span = span_around(previous + 1)
            cut = previous + 1 if span is None else span[1]
        cuts[position] = previous = cut
    following = total
    for position in reversed(range(len(cuts))):
        if cuts[position] >= following:  # (pushed to the end or past the next: back to the place before it)
            span = span_around(following - 1)
            cuts[position] = following - 1 if span is None else span[0]
        following = cuts[position]
    edges = [0, *cuts, total]
    return cuts if all(low < high for low, high in zip(edges, edges[1:])) else None
