"""The split in force has one owner: every change goes through it and reaches the sampler and DeepSpeed."""

from __future__ import annotations

import pytest

from lightning_hetero.split.decisions.split import SplitPlan
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


class JobListeners:
    """What the job is to the training loader: its batch listeners, which own the split in force."""

    def __init__(self, split):
        self.split = split

    def training_batch(self, local_samples, global_samples):
        pass


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_the_training_loader_is_freed_by_its_last_reference_not_by_the_cyclic_collector(persistent_workers):
    """The loader holds the job's listeners and they hold the split in force, which cuts the loader. Held strongly,
    that cycle left the loader to the cyclic collector, which tears its worker queues down before the iterator's
    shutdown reaches the workers: each worker then waited out torch's 5 s join timeout (10 s with 2 workers)."""
    import gc
    import weakref

    from torch.utils.data import DataLoader

    from lightning_hetero.train.loaders import rebuild_loader

    split = SplitInForce(rank=0)
    split.start(SplitPlan((4, 4), source="fixed"), None)
    listeners = JobListeners(split)
    user = DataLoader(list(range(40)), batch_size=4, num_workers=2, persistent_workers=persistent_workers)
    loader = rebuild_loader(user, [4, 4], 0, 0, on_batch=listeners.training_batch)
    split.cut_by(loader)
    split.use((5, 3))  # the split reaches the loader while it lives
    assert loader.hetero_batch_sampler.batch_sizes == (5, 3)
    assert len([batch for batch in loader]) == 5
    freed = weakref.ref(loader)
    gc.disable()
    try:
        del loader
        assert freed() is None, "the training loader is kept alive by a reference cycle"
    finally:
        gc.enable()
    assert split.loader is None and split.global_samples_consumed() is None
