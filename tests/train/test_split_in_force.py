"""The split in force has one owner: every change goes through it and reaches the sampler and DeepSpeed."""

from __future__ import annotations

import pytest

from lightning_hetero.plan.split import SplitPlan
from lightning_hetero.train.order import STATE_SAMPLES_CONSUMED
from lightning_hetero.train.split_in_force import SplitInForce


class FakeSampler:
    def __init__(self, batch_sizes):
        self.batch_sizes = tuple(batch_sizes)

    def use_split(self, batch_sizes):
        self.batch_sizes = tuple(batch_sizes)


class FakeLoader:
    def __init__(self, batch_sizes, consumed=0):
        self.hetero_batch_sampler = FakeSampler(batch_sizes)
        self.consumed = consumed

    def state_dict(self):
        return {STATE_SAMPLES_CONSUMED: self.consumed}


def test_without_a_plan_the_micro_batch_is_one_and_no_position_is_known():
    split = SplitInForce(rank=1)
    assert split.plan is None and split.micro_batch == 1
    assert split.global_samples_consumed() is None


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_start_tells_every_follower_this_ranks_micro_batch(rank):
    split, told = SplitInForce(rank), []
    split.follow(told.append)
    split.start(SplitPlan((6, 3, 1), source="auto"), {"speedup": 1.5})
    assert told == [(6, 3, 1)[rank]]
    assert split.batch_sizes == (6, 3, 1) and split.plan.global_batch_size == 10
    assert split.prediction == {"speedup": 1.5}


def test_a_change_reaches_the_loaders_sampler_and_every_follower_and_is_what_everyone_reads():
    split, engine, config = SplitInForce(rank=0), [], []
    split.follow(engine.append)
    split.follow(config.append)
    split.start(SplitPlan((8, 8), source="fixed"), None)
    loader = FakeLoader((8, 8), consumed=32)
    split.cut_by(loader)
    split.use((11, 5))
    assert loader.hetero_batch_sampler.batch_sizes == (11, 5)  # the next global batch is cut by the new split
    assert engine == config == [8, 11]
    assert split.plan == SplitPlan((11, 5), source="re-plan") and split.micro_batch == 11
    assert split.global_samples_consumed() == 32
    split.use((9, 7), source="checkpoint")
    assert split.plan.source == "checkpoint" and loader.hetero_batch_sampler.batch_sizes == (9, 7)


def test_a_change_before_the_loader_is_built_is_what_the_loader_is_cut_from():
    split = SplitInForce(rank=1)
    split.start(SplitPlan((8, 8), source="auto"), None)
    split.use((10, 6))  # e.g. a resume on another world size that keeps the checkpoint's global batch
    loader = FakeLoader(split.batch_sizes)
    split.cut_by(loader)
    assert loader.hetero_batch_sampler.batch_sizes == (10, 6) and split.micro_batch == 6
