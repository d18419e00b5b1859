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
    moves to its nearer edge. Fragments that cannot all hold a value are refused."""
    total, fragments = sum(sizes), int(fragments)
    if not 1 <= fragments <= total:
        raise ValueError(
            f"`sync_options['fragments']={fragments}`: the model trains {total} parameter values, and each fragment"
            f" needs at least one. Use at most {total} fragments."
        )
    starts = [0, *itertools.accumulate(sizes)][:-1]
    cuts = [total * fragment // fragments for fragment in range(1, fragments)]
    for position, cut in enumerate(cuts):
        for index in uncut:
            begin, end = starts[index], starts[index] + sizes[index]
            if begin < cut < end:
                cuts[position] = begin if cut - begin <= end - cut else end
    edges = [0, *cuts, total]
    if any(low >= high for low, high in zip(edges, edges[1:])):
        raise ValueError(
            f"`sync_options['fragments']={fragments}`: the model's {total} parameter values cannot be cut into"
            f" {fragments} non-empty fragments of about equal size: its tensors {sorted(uncut)} are not contiguous in"
            " memory and stay whole. Use fewer fragments."
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
