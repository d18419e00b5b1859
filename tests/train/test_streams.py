"""The stream loader (an IterableDataset split by rank) in one process, the other ranks' counts given."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_hetero.train.streams import HeteroStreamLoader


class Stream(IterableDataset):
    def __init__(self, items):
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)


def loader_for(items, batch_sizes, rank, other_counts, drop_last=False, epoch=lambda: 0):
    """Rank ``rank``'s loader; ``other_counts(step)`` is what the other ranks draw at each step (a list per rank)."""
    steps = []

    def agree(count):
        counts = list(other_counts(len(steps)))
        counts.insert(rank, count)
        steps.append(counts)
        return counts

    user = DataLoader(Stream(items), batch_size=2, drop_last=drop_last)
    return HeteroStreamLoader(user, batch_sizes, rank, agree, epoch), steps


def test_each_step_takes_this_ranks_micro_batch_and_the_epoch_ends_at_the_first_empty_stream():
    loader, steps = loader_for(range(10), [3, 5], 0, lambda step: [5, 5, 2, 0][step : step + 1])
    batches = [batch.tolist() for batch in loader]
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]  # the third is a short one for rank 1 (2 of 5)
    assert steps[-1] == [1, 0]  # rank 1 had nothing left: the fourth step is not taken
    assert loader.dropped == 1  # the sample rank 0 drew for it
    assert [loader.batch_trained() for _ in batches] == [(3, 8), (3, 8), (3, 5)]  # (this rank's, every rank's)
    assert loader.state_dict()["samples_taken_per_rank"] == [9, 12]


def test_drop_last_drops_a_short_step():
    loader, _ = loader_for(range(10), [3, 5], 0, lambda step: [5, 2][step : step + 1], drop_last=True)
    assert [batch.tolist() for batch in loader] == [[0, 1, 2]]


def test_the_counts_follow_the_batch_trained_not_the_one_drawn_ahead():
    """Lightning reads an unsized loader one batch ahead: the counts wait until the step that trains the batch."""
    loader, _ = loader_for(range(7), [3, 5], 0, lambda step: [5, 1, 0][step : step + 1])
    iterator = iter(loader)
    first, second = next(iterator), next(iterator)  # the second drawn before the first is trained
    assert loader.batch_trained() == (3, 8) and loader.batch_trained() == (3, 4)
    assert first.tolist() == [0, 1, 2] and second.tolist() == [3, 4, 5]


def test_a_resume_skips_what_each_stream_gave_and_a_new_split_applies_from_the_next_draw():
    loader, _ = loader_for(range(20), [3, 5], 0, lambda step: [5] * 10, epoch=lambda: 1)
    loader.load_state_dict(
        {"epoch": 1, "samples_taken_per_rank": [6, 10], "global_samples_consumed": 16, "batch_sizes": [3, 5]}
    )
    iterator = iter(loader)
    assert next(iterator).tolist() == [6, 7, 8]
    loader.hetero_batch_sampler.use_split([4, 4])
    assert next(iterator).tolist() == [9, 10, 11, 12]
    with pytest.raises(ValueError, match="must give each of the 2 ranks at least one sample"):
        loader.hetero_batch_sampler.use_split([8, 0])


def test_a_checkpoint_of_another_epoch_or_world_size_starts_the_streams_afresh():
    loader, _ = loader_for(range(6), [3, 5], 0, lambda step: [5] * 3, epoch=lambda: 2)
    loader.load_state_dict({"epoch": 1, "samples_taken_per_rank": [6, 10]})
    assert next(iter(loader)).tolist() == [0, 1, 2]
    with pytest.warns(UserWarning, match="taken with 3 ranks' streams and this job has 2"):
        loader.load_state_dict({"epoch": 2, "samples_taken_per_rank": [1, 1, 1]})
    with pytest.raises(ValueError, match="was not written by HeteroStrategy's stream loader"):
        loader.load_state_dict({"epoch": 0})


def test_the_users_collate_function_makes_the_micro_batch():
    user = DataLoader(
        Stream([{"x": i} for i in range(4)]),
        batch_size=2,
        collate_fn=lambda samples: torch.tensor([s["x"] * 10 for s in samples]),
    )
    loader = HeteroStreamLoader(user, [2, 2], 1, lambda count: [count, count], lambda: 0)
    assert [batch.tolist() for batch in loader] == [[0, 10], [20, 30]]
