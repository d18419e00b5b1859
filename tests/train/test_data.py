"""Unit tests for lightning_hetero.train: global batches cut into per-rank slices, and resumable loaders.

Several ranks are simulated in one process by building one sampler or loader per rank; no process group is needed
because every rank computes the same global order and the same list of steps.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.data import _set_sampler_epoch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

from lightning_hetero.split.decisions.split import split_by_weights
from lightning_hetero.train.loaders import (
    HeteroDataLoader,
    describe_unsupported_loader,
    loader_batch_size,
    rebuild_loader,
)
from lightning_hetero.train.order import (
    STATE_BATCH_SIZES,
    STATE_EPOCH,
    STATE_NUM_SAMPLES,
    STATE_SAMPLES_CONSUMED,
    STATE_SEED,
    GlobalOrder,
    GlobalStep,
    HeteroBatchSampler,
    epoch_steps,
)

batch_size_lists = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4)


class Indexed(Dataset):
    """Item ``i`` is ``i``: a batch shows exactly which samples it holds."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


def as_lists(batches) -> list[list[int]]:
    return [batch.tolist() if isinstance(batch, torch.Tensor) else list(batch) for batch in batches]


def user_loader(num_samples: int, shuffle: bool = True, drop_last: bool = False, **kwargs) -> DataLoader:
    return DataLoader(Indexed(num_samples), batch_size=4, shuffle=shuffle, drop_last=drop_last, **kwargs)


def rank_loaders(num_samples, batch_sizes, seed=0, shuffle=True, drop_last=False, **kwargs) -> list[HeteroDataLoader]:
    return [
        rebuild_loader(user_loader(num_samples, shuffle, drop_last, **kwargs), batch_sizes, rank, seed)
        for rank in range(len(batch_sizes))
    ]


def run_epoch(loader: DataLoader, epoch: int) -> list[list[int]]:
    _set_sampler_epoch(loader, epoch)  # what Lightning's loops call before iterating
    return as_lists(loader)


# ---------------------------------------------------------------------------------------------- epoch_steps


@settings(database=None, max_examples=200, deadline=None)
@given(
    num_samples=st.integers(0, 60),
    batch_sizes=batch_size_lists,
    drop_last=st.booleans(),
    start_offset=st.integers(0, 63),
)
def test_epoch_steps_properties(num_samples, batch_sizes, drop_last, start_offset):
    start = min(start_offset, num_samples + 2)
    steps = epoch_steps(num_samples, batch_sizes, drop_last, start)
    world, global_batch = len(batch_sizes), sum(batch_sizes)
    available = max(0, num_samples - start)

    # Contiguous, in order, from `start`, inside the epoch.
    if steps:
        assert steps[0].begin == start
    for before, after in zip(steps, steps[1:]):
        assert after.begin == before.end
    assert all(step.end <= num_samples for step in steps)
    for step in steps:
        assert len(step.sizes) == world
        assert all(size >= 1 for size in step.sizes)  # every rank takes part in every step
        # The ranks' slices tile the step in rank order.
        assert [p for rank in range(world) for p in step.positions(rank)] == list(range(step.begin, step.end))
    # Full steps carry exactly the split; only the last step may differ, split in the same proportions with at least
    # 2 samples a rank where the split gave every rank 2 and the step has 2 for each (else 1).
    assert all(step.sizes == tuple(batch_sizes) for step in steps[:-1])
    if steps and steps[-1].sizes != tuple(batch_sizes):
        last = steps[-1]
        assert not drop_last
        floor = 2 if min(batch_sizes) >= 2 and last.global_size >= 2 * world else 1
        assert list(last.sizes) == split_by_weights(last.global_size, batch_sizes, floor)
        assert min(last.sizes) >= floor
        assert world <= last.global_size < global_batch + world

    if drop_last:
        assert all(step.sizes == tuple(batch_sizes) for step in steps)
        assert len(steps) == available // global_batch
    elif available >= world:
        # Every position of [start, num_samples) exactly once.
        used = [p for step in steps for rank in range(world) for p in step.positions(rank)]
        assert used == list(range(start, num_samples))
        assert len(steps) == available // global_batch + (available % global_batch >= world)
    else:
        assert steps == []  # fewer samples than ranks, and no previous step to join


def test_epoch_steps_short_remainder_joins_previous_step():
    # 11 samples, B=5, W=2: the last sample cannot give both ranks one, so it joins the second step.
    assert epoch_steps(11, [2, 3], drop_last=False) == [GlobalStep(0, (2, 3)), GlobalStep(5, (2, 4))]
    # With 12 the remainder (2 samples) is a step of its own: one sample per rank.
    expected = [GlobalStep(0, (2, 3)), GlobalStep(5, (2, 3)), GlobalStep(10, (1, 1))]
    assert epoch_steps(12, [2, 3], drop_last=False) == expected
    assert epoch_steps(12, [2, 3], drop_last=True) == [GlobalStep(0, (2, 3)), GlobalStep(5, (2, 3))]
    assert epoch_steps(10, [2, 3], drop_last=False) == [GlobalStep(0, (2, 3)), GlobalStep(5, (2, 3))]


def test_epoch_steps_edge_cases():
    assert epoch_steps(0, [2, 3], drop_last=False) == []
    assert epoch_steps(1, [2, 3], drop_last=False) == []  # fewer samples than ranks
    assert epoch_steps(3, [2, 3], drop_last=False) == [GlobalStep(0, (1, 2))]
    assert epoch_steps(3, [2, 3], drop_last=True) == []
    assert epoch_steps(10, [2, 3], drop_last=False, start=10) == []
    assert epoch_steps(10, [2, 3], drop_last=False, start=12) == []
    # A start off the step grid (a resume after the split changed) begins exactly there.
    assert epoch_steps(10, [2, 3], drop_last=False, start=3) == [GlobalStep(3, (2, 3)), GlobalStep(8, (1, 1))]
    assert epoch_steps(7, [4], drop_last=False) == [GlobalStep(0, (4,)), GlobalStep(4, (3,))]
    step = GlobalStep(6, (2, 5, 1))
    assert (step.global_size, step.end) == (8, 14)
    assert [list(step.positions(r)) for r in range(3)] == [[6, 7], [8, 9, 10, 11, 12], [13]]


# ---------------------------------------------------------------------------------------------- GlobalOrder


def test_global_order_keeps_sequential_order():
    order = GlobalOrder(SequentialSampler(range(9)), seed=3)
    order.set_epoch(5)
    assert list(order) == list(range(9))
    assert len(order) == 9
    assert not order.shuffles


def test_global_order_random_sampler_same_for_every_rank_and_new_per_epoch():
    data = range(50)
    # Two ranks: separate samplers with different generators; the global RNG state differs between them too.
    rank0 = GlobalOrder(RandomSampler(data, generator=torch.Generator().manual_seed(1)), seed=42)
    rank1 = GlobalOrder(RandomSampler(data, generator=torch.Generator().manual_seed(2)), seed=42)
    assert rank0.shuffles
    torch.manual_seed(0)
    first = list(rank0)
    torch.manual_seed(999)
    assert list(rank1) == first
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert list(rank0) == first  # the same epoch iterated again gives the same order

    rank0.set_epoch(1)
    rank1.set_epoch(1)
    second = list(rank0)
    assert list(rank1) == second
    assert second != first and sorted(second) == list(range(50))
    rank0.set_epoch(0)
    assert list(rank0) == first  # the order is a function of seed + epoch only
    assert list(GlobalOrder(RandomSampler(data), seed=43)) != first
    # The documented contract (checkpoints rely on it): the permutation torch draws from a generator seeded
    # seed + epoch.
    expected = list(RandomSampler(data, generator=torch.Generator().manual_seed(42 + 1)))
    assert second == expected


@pytest.mark.parametrize(
    "make",
    [
        lambda: SubsetRandomSampler(list(range(0, 60, 2))),
        lambda: WeightedRandomSampler([1.0] * 20 + [5.0] * 20, num_samples=40, replacement=True),
        lambda: WeightedRandomSampler([1.0] * 30, num_samples=25, replacement=False),
    ],
)
def test_global_order_seeds_torch_random_samplers_identically_on_every_rank(make):
    user0, user1 = make(), make()
    rank0, rank1 = GlobalOrder(user0, seed=5), GlobalOrder(user1, seed=5)
    assert rank0.shuffles
    torch.manual_seed(0)
    first = list(rank0)
    torch.manual_seed(1)  # the ranks' global RNGs drift apart during training: the order must not depend on them
    assert list(rank1) == first and len(first) == len(rank0)
    rank0.set_epoch(1)
    assert list(rank0) != first
    assert user0.generator is None  # the user's sampler is not modified
    if isinstance(user0, SubsetRandomSampler):
        assert sorted(first) == sorted(user0.indices)


def test_global_order_keeps_replacement_and_num_samples():
    with_replacement = GlobalOrder(RandomSampler(range(5), replacement=True, num_samples=200), seed=0)
    drawn = list(with_replacement)
    assert len(drawn) == len(with_replacement) == 200
    assert set(drawn) <= set(range(5)) and max(Counter(drawn).values()) > 1  # with replacement: repeats
    assert drawn == list(GlobalOrder(RandomSampler(range(5), replacement=True, num_samples=200), seed=0))

    subset = GlobalOrder(RandomSampler(range(20), num_samples=7), seed=0)
    drawn = list(subset)
    assert len(drawn) == len(subset) == 7 and len(set(drawn)) == 7  # without replacement: no repeats


class EpochSampler(Sampler[int]):
    """A custom sampler with its own per-epoch order (the same on every rank)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        shift = self.epochs[-1] if self.epochs else 0
        return iter([(i + shift) % self.length for i in range(self.length)])

    def __len__(self) -> int:
        return self.length


class PlainSampler(Sampler[int]):
    def __init__(self, indices):
        self.indices = list(indices)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def test_global_order_forwards_set_epoch_to_custom_sampler():
    custom = EpochSampler(6)
    order = GlobalOrder(custom, seed=0)
    order.set_epoch(2)
    assert custom.epochs == [2]
    assert order.epoch == 2
    assert list(order) == [2, 3, 4, 5, 0, 1]
    assert not order.shuffles
    plain = GlobalOrder(PlainSampler([4, 0, 2]), seed=0)
    plain.set_epoch(7)  # no set_epoch on the user's sampler: nothing to forward, no error
    assert list(plain) == [4, 0, 2]


def test_lightning_set_epoch_reaches_the_user_sampler_through_the_rebuilt_loader():
    custom = EpochSampler(10)
    loader = rebuild_loader(DataLoader(Indexed(10), sampler=custom, batch_size=2), [2, 3], rank=0, seed=0)
    _set_sampler_epoch(loader, 4)
    assert custom.epochs[-1] == 4
    assert loader.hetero_batch_sampler.epoch == 4
    assert as_lists(loader) == [[4, 5], [9, 0]]


# ---------------------------------------------------------------------------------------------- HeteroBatchSampler


@settings(database=None, max_examples=60, deadline=None)
@given(
    num_samples=st.integers(1, 40),
    batch_sizes=batch_size_lists,
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_batch_samplers_of_all_ranks_cover_the_epoch_order_once(num_samples, batch_sizes, drop_last, shuffle, epoch):
    def order():
        base = RandomSampler(range(num_samples)) if shuffle else SequentialSampler(range(num_samples))
        global_order = GlobalOrder(base, seed=11)
        global_order.set_epoch(epoch)
        return global_order

    samplers = [HeteroBatchSampler(order(), batch_sizes, rank, drop_last) for rank in range(len(batch_sizes))]
    per_rank = [list(sampler) for sampler in samplers]
    steps = epoch_steps(num_samples, batch_sizes, drop_last)
    epoch_order = list(order())

    # Every rank runs the same number of steps, and len() says how many.
    assert all(len(batches) == len(sampler) == len(steps) for batches, sampler in zip(per_rank, samplers))
    for index, step in enumerate(steps):
        for rank in range(len(batch_sizes)):
            assert len(per_rank[rank][index]) == step.sizes[rank]
        # Within a step the ranks' slices, in rank order, are the next contiguous run of the epoch order.
        assert flat(batches[index] for batches in per_rank) == epoch_order[step.begin : step.end]
    union = flat(flat(batches) for batches in zip(*per_rank)) if steps else []
    if not drop_last and num_samples >= len(batch_sizes):
        assert union == epoch_order  # each sample of the epoch exactly once
        assert sorted(union) == list(range(num_samples))
    else:
        assert len(set(union)) == len(union) and set(union) <= set(epoch_order)


def test_batch_sampler_rejects_rank_outside_split():
    order = GlobalOrder(SequentialSampler(range(8)))
    with pytest.raises(ValueError, match=r"rank 2 is outside the split \[4, 4\]"):
        HeteroBatchSampler(order, [4, 4], rank=2, drop_last=False)
    with pytest.raises(ValueError, match="rank -1"):
        HeteroBatchSampler(order, [4, 4], rank=-1, drop_last=False)


def test_batch_sampler_with_replacement_sampler_tiles_the_draws():
    def order():
        return GlobalOrder(RandomSampler(range(4), replacement=True, num_samples=13), seed=5)

    per_rank = [list(HeteroBatchSampler(order(), [1, 3], rank, drop_last=False)) for rank in range(2)]
    assert flat(flat(step) for step in zip(*per_rank)) == list(order())


# ---------------------------------------------------------------------------------------------- HeteroDataLoader


def resume(loader_factory, state, epoch):
    loader = loader_factory()
    loader.load_state_dict(state)
    # A checkpoint taken right after restoring keeps the position (and records the split this loader cuts).
    assert loader.state_dict() == state | {STATE_BATCH_SIZES: list(loader.hetero_batch_sampler.batch_sizes)}
    assert loader.take_checkpoint_split() == tuple(state[STATE_BATCH_SIZES])  # for the strategy to decide on
    assert loader.take_checkpoint_split() is None  # once
    return run_epoch(loader, epoch)


@settings(database=None, max_examples=40, deadline=None)
@given(
    num_samples=st.integers(1, 30),  # torch's RandomSampler refuses an empty dataset
    batch_sizes=batch_size_lists,
    new_batch_sizes=batch_size_lists,
    drop_last=st.booleans(),
    shuffle=st.booleans(),
    epoch=st.integers(0, 2),
    stop_fraction=st.floats(0, 1),
)
def test_loader_resumes_exactly_where_it_stopped(
    num_samples, batch_sizes, new_batch_sizes, drop_last, shuffle, epoch, stop_fraction
):
    world = len(batch_sizes)

    def factory(rank, sizes=batch_sizes):
        return lambda: rebuild_loader(user_loader(num_samples, shuffle, drop_last), sizes, rank, seed=7)

    full = [run_epoch(factory(rank)(), epoch) for rank in range(world)]
    steps = epoch_steps(num_samples, batch_sizes, drop_last)
    stop = round(stop_fraction * len(steps))

    # Each rank stops after `stop` batches of the epoch (a checkpoint is taken there).
    states, before = [], []
    for rank in range(world):
        loader = factory(rank)()
        _set_sampler_epoch(loader, epoch)
        iterator = iter(loader)
        taken = as_lists(itertools.islice(iterator, stop))
        assert taken == full[rank][:stop]
        states.append(loader.state_dict())
        before.append(taken)
    # The loader state is the same on every rank: DeepSpeed saves rank 0's and every rank loads it.
    assert all(state == states[0] for state in states)
    state = states[0]
    assert state[STATE_NUM_SAMPLES] == num_samples and state[STATE_SEED] == 7
    assert state[STATE_BATCH_SIZES] == batch_sizes
    if stop:
        assert state[STATE_EPOCH] == epoch
        assert state[STATE_SAMPLES_CONSUMED] == steps[stop - 1].end

    # Same split: each rank gets exactly its remaining batches.
    after = [resume(factory(rank), state, epoch) for rank in range(world)]
    assert after == [batches[stop:] for batches in full]
    # The run as a whole used each sample of the epoch once.
    used = flat(flat(b) for b in before) + flat(flat(b) for b in after)
    assert len(used) == len(set(used))
    if not drop_last and num_samples >= world:
        assert sorted(used) == list(range(num_samples))

    # Another epoch than the checkpoint's starts from the beginning.
    assert [resume(factory(rank), state, epoch + 1) for rank in range(world)] == [
        run_epoch(factory(rank)(), epoch + 1) for rank in range(world)
    ]

    # A new split (e.g. another world size) keeps the global position: still no sample twice, none skipped.
    consumed = state[STATE_SAMPLES_CONSUMED] if stop else 0
    resumed = [resume(factory(rank, new_batch_sizes), state, epoch) for rank in range(len(new_batch_sizes))]
    used = flat(flat(b) for b in before) + flat(flat(b) for b in resumed)
    assert len(used) == len(set(used))
    if not drop_last and ((stop and consumed == num_samples) or num_samples - consumed >= len(new_batch_sizes)):
        assert sorted(used) == list(range(num_samples))


def test_loader_len_counts_whole_epoch_steps():
    for drop_last, expected in ((False, 3), (True, 2)):
        loaders = rank_loaders(12, [2, 3], drop_last=drop_last)
        for loader in loaders:
            assert len(loader) == expected == len(run_epoch(loader, 0))
    loader = rank_loaders(12, [2, 3])[1]
    loader.load_state_dict({STATE_EPOCH: 0, STATE_SAMPLES_CONSUMED: 5, STATE_NUM_SAMPLES: 12, STATE_SEED: 0})
    assert len(loader) == 3  # Lightning counts a resumed epoch from its beginning


def test_loader_state_before_and_after_an_epoch():
    loader = rank_loaders(11, [2, 3], seed=9)[0]
    fixed = {STATE_NUM_SAMPLES: 11, STATE_SEED: 9, STATE_BATCH_SIZES: [2, 3]}
    assert loader.state_dict() == {STATE_EPOCH: 0, STATE_SAMPLES_CONSUMED: 0} | fixed
    run_epoch(loader, 3)
    assert loader.state_dict() == {STATE_EPOCH: 3, STATE_SAMPLES_CONSUMED: 11} | fixed
    # Resuming that end-of-epoch state in the same epoch yields nothing more.
    fresh = rank_loaders(11, [2, 3], seed=9)[0]
    fresh.load_state_dict(loader.state_dict())
    assert run_epoch(fresh, 3) == []
    # The resume position is used once: the next epoch (or a second pass) starts from the beginning.
    assert run_epoch(fresh, 3) == run_epoch(rank_loaders(11, [2, 3], seed=9)[0], 3)


def test_loader_on_batch_receives_local_and_global_sizes():
    calls: list[tuple[int, int]] = []
    user = user_loader(11, shuffle=False)
    loader = rebuild_loader(user, [2, 3], rank=1, seed=0, on_batch=lambda local, total: calls.append((local, total)))
    _set_sampler_epoch(loader, 0)
    for batch in loader:
        # Told before the loop receives the batch, with that batch's sizes (the last step is larger: 11 = 5 + 6).
        assert calls[-1][0] == len(batch)
    assert calls == [(3, 5), (4, 6)]
    rank0_calls: list[tuple[int, int]] = []
    rank0 = rebuild_loader(user_loader(11, shuffle=False), [2, 3], 0, 0, on_batch=lambda *a: rank0_calls.append(a))
    assert [len(b) for b in rank0] == [2, 2]
    assert rank0_calls == [(2, 5), (2, 6)]


def _state(**overrides):
    return {STATE_EPOCH: 1, STATE_SAMPLES_CONSUMED: 5, STATE_NUM_SAMPLES: 20, STATE_SEED: 3} | overrides


def test_load_state_dict_rejects_incompatible_states():
    shuffled = rank_loaders(20, [2, 3], seed=3)[0]
    with pytest.raises(ValueError, match=r"lacks \['global_samples_consumed'\]"):
        shuffled.load_state_dict({STATE_EPOCH: 1, STATE_NUM_SAMPLES: 20, STATE_SEED: 3})
    with pytest.raises(ValueError, match=r"lacks \['epoch', 'global_samples_consumed', 'num_samples', 'seed'\]"):
        shuffled.load_state_dict({"some_other_loader": 1})
    with pytest.raises(ValueError, match=r"training set of 21 samples but the loader now has 20"):
        shuffled.load_state_dict(_state(num_samples=21))
    with pytest.raises(ValueError, match=r"shuffle seed is 4 but this run's is 3.*seed_everything\(4\)"):
        shuffled.load_state_dict(_state(seed=4))
    with pytest.raises(ValueError, match=r"global_samples_consumed=21"):
        shuffled.load_state_dict(_state(global_samples_consumed=21))
    with pytest.raises(ValueError, match=r"global_samples_consumed=-1"):
        shuffled.load_state_dict(_state(global_samples_consumed=-1))
    # A rejected state leaves the loader as it was.
    assert shuffled.state_dict()[STATE_SAMPLES_CONSUMED] == 0
    # Without shuffling the seed does not matter: the order is the same whatever it is.
    sequential = rank_loaders(20, [2, 3], seed=3, shuffle=False)[0]
    sequential.load_state_dict(_state(seed=4))
    assert run_epoch(sequential, 1) == [list(range(5, 7)), list(range(10, 12)), list(range(15, 17))]


def _mark_worker(worker_id: int) -> None:
    WorkerTagged.tag = 100 + worker_id


class WorkerTagged(Indexed):
    tag = -1  # set in each worker process by `_mark_worker`

    def __getitem__(self, index: int):
        return index, WorkerTagged.tag


def _pairs_collate(items):
    return {"index": [i for i, _ in items], "tag": [t for _, t in items]}


def test_loader_with_worker_processes_resumes_exactly():
    def factory(rank):
        user = DataLoader(
            WorkerTagged(23),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            collate_fn=_pairs_collate,
            worker_init_fn=_mark_worker,
        )
        return rebuild_loader(user, [3, 5], rank, seed=1)

    full = [[b["index"] for b in _iterate(factory(rank), 2)] for rank in range(2)]
    assert sorted(flat(full[0]) + flat(full[1])) == list(range(23))
    stop = 1
    states, before = [], []
    for rank in range(2):
        loader = factory(rank)
        _set_sampler_epoch(loader, 2)
        iterator = iter(loader)
        taken = [next(iterator) for _ in range(stop)]
        # The collate_fn and worker_init_fn of the user's loader are in use (items came from worker processes).
        assert all(tag >= 100 for batch in taken for tag in batch["tag"])
        before.append([batch["index"] for batch in taken])
        states.append(loader.state_dict())  # exact although the workers have read ahead
        iterator.close()
    assert states[0] == states[1]
    assert states[0][STATE_SAMPLES_CONSUMED] == 8 * stop
    after = []
    for rank in range(2):
        loader = factory(rank)
        loader.load_state_dict(states[0])
        after.append([b["index"] for b in _iterate(loader, 2)])
    assert after == [batches[stop:] for batches in full]
    assert sorted(flat(before[0] + before[1] + after[0] + after[1])) == list(range(23))


def _iterate(loader, epoch):
    _set_sampler_epoch(loader, epoch)
    return list(loader)


# ---------------------------------------------------------------------------------------------- rebuild_loader


def _init(worker_id: int) -> None:  # pragma: no cover - only its identity is checked
    pass


def _collate(items):
    return torch.tensor(items) * 10


def test_rebuild_loader_keeps_user_settings_with_workers():
    user = DataLoader(
        Indexed(30),
        batch_size=4,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=True,
        worker_init_fn=_init,
        persistent_workers=True,
        prefetch_factor=3,
        timeout=7,
    )
    loader = rebuild_loader(user, [2, 6], rank=1, seed=5)
    assert isinstance(loader, HeteroDataLoader)
    assert loader.dataset is user.dataset
    assert loader.num_workers == 2
    assert loader.collate_fn is _collate
    assert loader.pin_memory is True
    assert loader.worker_init_fn is _init
    assert loader.persistent_workers is True
    assert loader.prefetch_factor == 3
    assert loader.timeout == 7
    sampler = loader.hetero_batch_sampler
    assert isinstance(sampler, HeteroBatchSampler)
    assert sampler.drop_last is True and sampler.rank == 1 and sampler.batch_sizes == (2, 6)
    assert sampler.sampler.user_sampler is user.sampler and sampler.sampler.seed == 5
    assert len(loader) == 30 // 8  # drop_last: the partial global batch is dropped


def test_rebuild_loader_keeps_collate_and_drop_last_without_workers():
    for drop_last, expected in ((True, [[0, 10], [50, 60]]), (False, [[0, 10], [50, 60], [100]])):
        user = DataLoader(Indexed(12), batch_size=4, shuffle=False, drop_last=drop_last, collate_fn=_collate)
        loader = rebuild_loader(user, [2, 3], rank=0, seed=0)
        assert loader.num_workers == 0 and loader.persistent_workers is False
        assert loader.collate_fn is _collate
        assert as_lists(loader) == expected  # custom collate applied; drop_last decides the short last step
    shuffled_default = rebuild_loader(DataLoader(Indexed(12), batch_size=4), [2, 3], 1, 0)
    batches = as_lists(shuffled_default)
    assert batches == [[2, 3, 4], [7, 8, 9], [11]]  # default collate (tensors), the user's sequential order


def test_describe_unsupported_loader():
    assert describe_unsupported_loader(DataLoader(Stream(), batch_size=2), "training loader") is None  # a stream
    message = describe_unsupported_loader(DataLoader(Stream(), batch_size=None), "training loader")
    assert "training loader" in message and "IterableDataset (Stream) and `batch_size=None`" in message
    message = describe_unsupported_loader(DataLoader(Indexed(8), batch_size=None), "val loader")
    assert "val loader" in message and "batch_size=None" in message

    class MyBatchSampler(BatchSampler):
        pass

    custom = DataLoader(Indexed(8), batch_sampler=MyBatchSampler(SequentialSampler(range(8)), 2, False))
    message = describe_unsupported_loader(custom, "training loader")
    assert "custom `batch_sampler`" in message and "MyBatchSampler" in message
    plain_list = DataLoader(Indexed(8), batch_sampler=[[0, 1], [2, 3]])
    assert "custom `batch_sampler`" in describe_unsupported_loader(plain_list, "training loader")

    sharded = DataLoader(Indexed(8), batch_size=2, sampler=DistributedSampler(Indexed(8), num_replicas=2, rank=0))
    message = describe_unsupported_loader(sharded, "training loader")
    assert "training loader" in message and "DistributedSampler" in message

    assert describe_unsupported_loader(DataLoader(Indexed(8), batch_size=2), "training loader") is None
    assert describe_unsupported_loader(DataLoader(Indexed(8), batch_size=2, shuffle=True), "x") is None
    assert describe_unsupported_loader(DataLoader(Indexed(8), sampler=EpochSampler(8), batch_size=2), "x") is None


def test_loader_batch_size():
    assert loader_batch_size(DataLoader(Indexed(8), batch_size=3)) == 3
    assert loader_batch_size(DataLoader(Indexed(8), batch_size=None)) is None


# ---------------------------------------------------------------------------------------------- re-split mid-epoch


def run_epoch_with_resplits(num_samples, batch_sizes, splits, epochs=(1,), **kwargs):
    """Every rank's batches of the ``epochs``, the split changed to ``splits[k]`` before step ``k`` (as the strategy
    does from the loader's ``on_fetch``, on every rank at the same step), and the ``(local, global)`` sizes told."""
    per_rank, told = [], []
    for rank in range(len(batch_sizes)):
        loader = rank_loaders(num_samples, batch_sizes, seed=3, **kwargs)[rank]
        fetches, sizes = [], []

        # The sampler, not the loader: a loader in a reference cycle is left to the cyclic collector, which costs a
        # loader with worker processes 5 s per worker (see test_split_in_force.py).
        def before_fetch(sampler=loader.hetero_batch_sampler, fetches=fetches):
            if len(fetches) in splits:
                sampler.use_split(splits[len(fetches)])
            fetches.append(1)

        loader.on_fetch = before_fetch
        loader.on_batch = lambda local, total, sizes=sizes: sizes.append((local, total))
        per_rank.append([batch for epoch in epochs for batch in run_epoch(loader, epoch)])
        told.append(sizes)
    return per_rank, told


@settings(database=None, max_examples=60, deadline=None)
@given(
    num_samples=st.integers(4, 40),
    batch_sizes=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    changes=st.lists(st.tuples(st.integers(0, 12), st.lists(st.floats(0.1, 10), min_size=4, max_size=4)), max_size=3),
    drop_last=st.booleans(),
)
def test_a_resplit_mid_epoch_keeps_every_sample_once_and_the_global_batches(
    num_samples, batch_sizes, changes, drop_last
):
    world, global_batch = len(batch_sizes), sum(batch_sizes)
    splits = {step: split_by_weights(global_batch, weights[:world]) for step, weights in changes}
    unchanged, _ = run_epoch_with_resplits(num_samples, batch_sizes, {}, drop_last=drop_last)
    changed, told = run_epoch_with_resplits(num_samples, batch_sizes, splits, drop_last=drop_last)
    # Same steps, and each global batch (all ranks' slices in rank order) holds the same samples in the same order:
    # the update of every step is the one the unchanged split would make.
    assert len({len(batches) for batches in changed}) == 1 and len(changed[0]) == len(unchanged[0])
    for step in range(len(unchanged[0])):
        assert flat(rank[step] for rank in changed) == flat(rank[step] for rank in unchanged)
        expected_split = batch_sizes
        for start in sorted(k for k in splits if k <= step):
            expected_split = splits[start]
        sizes = [len(rank[step]) for rank in changed]
        if sum(sizes) == global_batch:  # full batches carry the split in force (a short last one, its proportions)
            assert sizes == list(expected_split)
        assert [rank_told[step] for rank_told in told] == [(size, sum(sizes)) for size in sizes]
    used = flat(flat(batches) for batches in changed)
    assert len(used) == len(set(used))


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_resplit_discards_the_workers_read_ahead(persistent_workers):
    # DataLoader's own timeout bounds each batch fetched from the worker processes: a hang fails the test.
    kwargs = {"num_workers": 2, "persistent_workers": persistent_workers, "prefetch_factor": 4, "timeout": 60}
    splits = {3: [1, 7], 5: [6, 2], 12: [3, 5]}  # the last in the second epoch, over the same (persistent) workers
    changed, _ = run_epoch_with_resplits(80, [4, 4], splits, epochs=(0, 1), **kwargs)
    unchanged, _ = run_epoch_with_resplits(80, [4, 4], {}, epochs=(0, 1))
    assert [len(batch) for batch in changed[0]] == [4, 4, 4, 1, 1, 6, 6, 6, 6, 6] + [6, 6, 3, 3, 3, 3, 3, 3, 3, 3]
    assert [flat(step) for step in zip(*changed)] == [flat(step) for step in zip(*unchanged)]


def test_use_split_refuses_another_world_size_or_global_batch():
    sampler = rank_loaders(12, [2, 3])[0].hetero_batch_sampler
    for bad in ([5], [2, 2], [0, 5], [1, 2, 2]):
        with pytest.raises(ValueError, match="must give each of the 2 ranks at least one sample and sum to"):
            sampler.use_split(bad)
    sampler.use_split([4, 1])
    assert sampler.batch_sizes == (4, 1)


def test_an_evaluation_order_is_padded_to_a_multiple_of_the_ranks_as_ddps_sampler_pads_it():
    order = GlobalOrder(SequentialSampler(range(11)), seed=0, pad_to=3)
    assert len(order) == 12 and list(order) == [*range(11), 0]
    assert list(GlobalOrder(SequentialSampler(range(2)), pad_to=5)) == [0, 1, 0, 1, 0]  # fewer samples than ranks
    assert len(GlobalOrder(SequentialSampler(range(0)), pad_to=3)) == 0
    shuffled = GlobalOrder(RandomSampler(range(7)), seed=4, pad_to=4)
    drawn = list(shuffled)
    assert len(drawn) == 8 and drawn[7] == drawn[0] and sorted(drawn[:7]) == list(range(7))


@pytest.mark.parametrize(
    ("samples", "drop_last", "per_rank"),
    [(11, False, [[4, 4, 4]]), (10, False, [[4, 4], [1, 1]]), (10, True, [[4, 4]])],
)
def test_evaluation_loaders_give_every_rank_the_same_number_of_samples_at_every_step(samples, drop_last, per_rank):
    world_size = len(per_rank[0])
    user = DataLoader(list(range(samples)), batch_size=4, drop_last=drop_last)
    loaders = [rebuild_loader(user, [4] * world_size, rank, seed=0, pad=True) for rank in range(world_size)]
    batches = [list(loader) for loader in loaders]
    assert [[len(batches[rank][step]) for rank in range(world_size)] for step in range(len(batches[0]))] == per_rank


def test_several_training_loaders_are_refused_and_one_inside_a_collection_is_used():
    from lightning.pytorch.utilities import CombinedLoader

    from lightning_hetero.train.loaders import describe_several_training_loaders, only_loader

    first, second = DataLoader(list(range(8)), batch_size=2), DataLoader(list(range(8)), batch_size=4)
    for single in (first, {"a": first}, [first], CombinedLoader({"a": first}, "max_size_cycle")):
        assert describe_several_training_loaders(single) is None and only_loader(single) is first
    assert "a dict of 2 loaders (a, b)" in describe_several_training_loaders({"a": first, "b": second})
    assert "a dict of 2 loaders (a, b)" in describe_several_training_loaders(
        CombinedLoader({"a": first, "b": second}, "max_size_cycle")
    )
    assert "is 2 loaders" in describe_several_training_loaders([first, second])


def test_an_epoch_s_short_last_batch_leaves_no_rank_one_sample_where_the_split_gave_each_two():
    """A planned (62, 2) split and 94 samples: the last batch of 30 is split 28/2, not 29/1 (a BatchNorm that is not
    synchronized fails on one sample); a batch too short for two each, or a split that gave a rank one, keeps the
    floor of one."""
    steps = epoch_steps(94, [62, 2], drop_last=False)
    assert [step.sizes for step in steps] == [(62, 2), (28, 2)]
    assert epoch_steps(67, [62, 2], drop_last=False)[-1].sizes == (2, 1)  # (3 samples: not two each)
    assert epoch_steps(95, [63, 1], drop_last=False)[-1].sizes == (30, 1)  # (the user's split gave one)
