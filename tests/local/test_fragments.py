"""The streaming merge's fragments (local/fragments.py): which values of the model merge when."""

from __future__ import annotations

import itertools

import pytest

from lightning_hetero.local.fragments import due_fragments, fragment_pieces
from lightning_hetero.local.inner_steps import is_sync_step


@pytest.mark.parametrize("sync_every", [1, 2, 3, 4, 6, 8, 12])
def test_one_fragment_merges_exactly_when_the_whole_model_did(sync_every):
    for steps_done in range(1, 50):
        for last in (False, True):
            expected = (0,) if is_sync_step(steps_done, sync_every, last) else ()
            assert due_fragments(steps_done, sync_every, 1, last) == expected


@pytest.mark.parametrize(("sync_every", "fragments"), [(2, 2), (4, 2), (4, 4), (8, 4), (12, 3), (6, 6)])
def test_each_fragment_merges_every_sync_every_steps_in_turn_and_all_at_an_epochs_end(sync_every, fragments):
    interval = sync_every // fragments
    merged: dict[int, list[int]] = {fragment: [] for fragment in range(fragments)}
    for steps_done in range(1, 4 * sync_every + 1):
        due = due_fragments(steps_done, sync_every, fragments, last_of_epoch=False)
        assert len(due) == (steps_done % interval == 0)  # one fragment at a time, one every interval
        for fragment in due:
            merged[fragment].append(steps_done)
    for fragment, steps in merged.items():
        assert steps == [interval * (fragment + 1) + sync_every * k for k in range(4)]
    assert due_fragments(5, sync_every, fragments, last_of_epoch=True) == tuple(range(fragments))


def values_of(pieces, sizes):
    """Each piece as the range of the model's values it covers, in the model's order."""
    starts = [0, *itertools.accumulate(sizes)]
    return [(starts[tensor] + begin, starts[tensor] + end) for tensor, begin, end in pieces]


SIZES = [[10] * 8, [32, 8, 256, 32, 32, 1], [5, 5], [100, 1, 1, 1], [7], [1, 2, 3, 4, 5], [2**20, 1024, 2**20, 1024, 2]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("fragments", [1, 2, 3, 4, 5])
def test_fragments_hold_equal_shares_of_the_values_cutting_inside_tensors_and_cover_each_value_once(sizes, fragments):
    """The streaming merge's promise: with F fragments 1/F of the model is on the wire at a time, even where one
    tensor holds most of the values (two 1024x1024 weights of a 2.1 M-value model: whole tensors could not do better
    than half)."""
    if fragments > sum(sizes):
        return
    pieces, bounds = fragment_pieces(sizes, fragments)
    ranges = values_of(pieces, sizes)
    assert [low for low, _ in ranges] == [0] + [high for _, high in ranges[:-1]]  # in order, no gap, no overlap
    assert ranges[-1][1] == sum(sizes) and all(0 <= begin < end <= sizes[t] for t, begin, end in pieces)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(pieces)
    assert all(previous[1] == following[0] for previous, following in zip(bounds, bounds[1:]))
    shares = [sum(high - low for low, high in ranges[begin:end]) for begin, end in bounds]
    assert max(shares) - min(shares) <= 1 and sum(shares) == sum(sizes)
    assert len(pieces) <= len(sizes) + fragments - 1  # a tensor is cut only where a fragment ends inside it
    if fragments == 1:
        assert pieces == [(tensor, 0, size) for tensor, size in enumerate(sizes)]  # today's merge, tensor by tensor


def test_the_benchmarks_wide_model_peaks_at_a_quarter_with_four_fragments():
    sizes = [1048576, 1024, 1048576, 1024, 2]
    pieces, bounds = fragment_pieces(sizes, 4)
    shares = [sum(end - begin for _, begin, end in pieces[low:high]) for low, high in bounds]
    assert max(shares) == -(-sum(sizes) // 4)


def test_a_tensor_that_cannot_be_cut_stays_whole_and_the_cut_moves_to_its_nearer_edge():
    pieces, bounds = fragment_pieces([10, 30, 10], 2, uncut=[1])  # the cut at 25 is inside tensor 1 (10..40)
    assert pieces == [(0, 0, 10), (1, 0, 30), (2, 0, 10)] and bounds == [(0, 1), (1, 3)]  # 25 nearer 10 than 40
    pieces, bounds = fragment_pieces([30, 10, 10], 2, uncut=[0])
    assert pieces == [(0, 0, 30), (1, 0, 10), (2, 0, 10)] and bounds == [(0, 1), (1, 3)]


def test_a_tensor_without_values_belongs_to_one_fragment():
    pieces, bounds = fragment_pieces([5, 0, 5], 2)
    assert pieces == [(0, 0, 5), (1, 0, 0), (2, 0, 5)] and bounds == [(0, 1), (1, 3)]


def test_more_fragments_than_values_are_refused_naming_the_count():
    with pytest.raises(ValueError, match=r"trains 7 parameter values.*at most 7 fragments"):
        fragment_pieces([3, 4], 8)
    assert len(fragment_pieces([3, 4], 7)[1]) == 7


def test_cuts_that_meet_at_an_uncut_tensors_edge_move_on_to_the_next_free_place():
    """Both cuts of [100, 1, 1, 1] into 3 fragments fall inside the uncut first tensor (at 34 and 68): they would
    meet at its end; whole tensors still make 3 fragments, and a channels-last convolution network (its conv weights
    not contiguous) still makes 4."""
    pieces, bounds = fragment_pieces([100, 1, 1, 1], 3, uncut=[0])
    assert pieces == [(0, 0, 100), (1, 0, 1), (2, 0, 1), (3, 0, 1)] and bounds == [(0, 1), (1, 2), (2, 4)]
    sizes = [864, 32, 18432, 64, 4096, 10]
    pieces, bounds = fragment_pieces(sizes, 4, uncut=[0, 2])
    assert len(bounds) == 4 and all(begin < end for begin, end in bounds)
    assert all(begin == 0 and end == sizes[tensor] for tensor, begin, end in pieces if tensor in (0, 2))
    for fragments in range(2, 5):  # (every count that the tensors' edges allow, wherever the cuts fell)
        sizes, uncut = [7, 1, 1, 9, 1], [0, 3]
        assert len(fragment_pieces(sizes, fragments, uncut)[1]) == fragments


def test_fragments_that_whole_tensors_cannot_make_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"cannot be cut into 3 non-empty fragments.*tensors \[0\] are not contiguous"):
        fragment_pieces([100, 1], 3, uncut=[0])  # (one place to cut: after the first tensor)


def test_every_small_model_is_cut_exactly_when_its_free_places_are_enough():
    """Exhaustive over small models (1-4 tensors of 0-4 values, every subset uncut, 1-6 fragments): fragments are
    made exactly when the places a cut may go (not inside an uncut tensor) number at least fragments - 1, and then
    every fragment holds a value and each value is in one piece."""
    for count in range(1, 5):
        for sizes in itertools.product(range(5), repeat=count):
            total = sum(sizes)
            starts = [0, *itertools.accumulate(sizes)]
            for uncut in itertools.chain.from_iterable(
                itertools.combinations(range(count), k) for k in range(count + 1)
            ):
                inside = {p for t in uncut for p in range(starts[t] + 1, starts[t + 1])}
                free = len(set(range(1, total)) - inside)
                for fragments in range(1, min(total, 6) + 1):
                    if free < fragments - 1:
                        with pytest.raises(ValueError, match="cannot be cut"):
                            fragment_pieces(sizes, fragments, uncut)
                        continue
                    pieces, bounds = fragment_pieces(sizes, fragments, uncut)
                    ranges = values_of(pieces, sizes)
                    assert sum(high - low for low, high in ranges) == total
                    assert all(sum(high - low for low, high in ranges[b:e]) > 0 for b, e in bounds)
                    assert all((b, e) == (0, sizes[t]) for t, b, e in pieces if t in uncut)
