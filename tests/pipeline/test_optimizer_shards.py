"""A pipeline's `stage=1` optimizer shards: the pure decisions (:mod:`lightning_hetero.pipeline.optimizer_shards`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_hetero import HeteroStrategy
from lightning_hetero.pipeline.optimizer_shards import shard_rooms, sharded_costs
from lightning_hetero.pipeline.placement import BlockCosts, place_stages
from lightning_hetero.train.optimizer_shards import (
    check_shards,
    default_shards,
    owners_by_fraction,
    shard_fractions,
    shards_refusal,
)

MiB = 2**20


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=30),
    weights=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=6).filter(lambda w: sum(w) > 0),
)
def test_each_copy_owns_a_contiguous_run_within_one_parameter_of_its_fraction(sizes, weights):
    fractions = [w / sum(weights) for w in weights]
    owners = owners_by_fraction(sizes, fractions)
    assert len(owners) == len(sizes)
    assert list(owners) == sorted(owners)  # contiguous runs, in the copies' order
    largest = max(sizes)
    total = sum(sizes)
    for copy, fraction in enumerate(fractions):
        held = sum(size for size, owner in zip(sizes, owners) if owner == copy)
        assert abs(held - fraction * total) <= largest + 1e-6 * total, (copy, held, fraction * total)
        if fraction == 0:
            assert held == 0 or all(size == 0 for size, owner in zip(sizes, owners) if owner == copy)


@pytest.mark.parametrize("copies", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("parameters", [8, 24, 96])
def test_equal_shards_of_equal_parameters_give_each_copy_as_many(copies, parameters):
    owners = owners_by_fraction([64] * parameters, [1 / copies] * copies)
    counts = [owners.count(c) for c in range(copies)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == parameters


def test_a_copy_without_room_owns_nothing_and_the_others_share_in_proportion():
    fractions, reason = shard_fractions([3 * MiB, -MiB, MiB], "memory")
    assert fractions == (0.75, 0.0, 0.25) and "in proportion" in reason
    owners = owners_by_fraction([100] * 40, fractions)
    assert owners.count(1) == 0 and owners.count(0) == 30 and owners.count(2) == 10


@pytest.mark.parametrize(
    ("rooms", "shards", "expected", "why"),
    [
        ([4 * MiB, 4 * MiB], "equal", (0.5, 0.5), "equal shares"),
        ([9 * MiB, MiB], "equal", (0.5, 0.5), "equal shares"),
        ([9 * MiB, MiB], "memory", (0.9, 0.1), "in proportion to the memory left"),
        ([None, MiB], "memory", (0.5, 0.5), "not every rank's memory is known"),
        ([0, -MiB], "memory", (0.5, 0.5), "no rank has room left"),
        ([MiB], "memory", (1.0,), "equal shares"),
    ],
)
def test_shard_fractions_say_why(rooms, shards, expected, why):
    fractions, reason = shard_fractions(rooms, shards)
    assert fractions == pytest.approx(expected) and why in reason


def costs_for(memory: list) -> BlockCosts:
    """Four ranks, six blocks of 1 MiB training bytes (half of it Adam's state), 0.1 MiB outside the chain."""
    return BlockCosts(
        seconds=((1.0,) * 6,) * 4,
        parameter_bytes=(MiB,) * 6,
        activation_bytes=(1000,) * 6,
        memory_bytes=tuple(memory),
        outside_bytes=MiB // 10,
    )


def test_unsharded_stages_must_fit_the_least_memory_of_their_copies():
    """Without shards a slot stands for its stage's every copy: the least memory of ranks r, r+S, ..."""
    costs = sharded_costs(costs_for([8 * MiB, 8 * MiB, 8 * MiB, 2 * MiB]), 2, 2, sharded=False, shards="equal")
    assert costs.memory_bytes == (8 * MiB, 2 * MiB, 8 * MiB, 2 * MiB)
    assert costs.parameter_bytes == (MiB,) * 6 and costs.outside_bytes == MiB // 10


def test_sharded_stages_count_their_share_of_the_state_and_memory_shards_pool_the_copies_memory():
    equal = sharded_costs(costs_for([8 * MiB, 8 * MiB, 8 * MiB, 2 * MiB]), 2, 2, sharded=True, shards="equal")
    assert equal.memory_bytes[:2] == (8 * MiB, 2 * MiB)
    assert equal.parameter_bytes == (int(0.75 * MiB),) * 6  # the parameter, its gradient, half of Adam's moments
    assert equal.outside_bytes == int((MiB // 10) * (0.5 + 0.5 / 4))  # (over all 4 ranks)
    memory = sharded_costs(costs_for([8 * MiB, 8 * MiB, 8 * MiB, 2 * MiB]), 2, 2, sharded=True, shards="memory")
    assert memory.memory_bytes[:2] == (8 * MiB, 5 * MiB)  # (the mean of ranks 1 and 3)
    # An unknown memory is no ceiling: the known ones bound the slot.
    unknown = sharded_costs(costs_for([None, 8 * MiB, None, None]), 2, 2, sharded=True, shards="memory")
    assert unknown.memory_bytes[:2] == (None, 8 * MiB)


def test_three_blocks_that_fit_only_with_memory_shards_are_placed_and_their_rooms_hold_the_state():
    """Rank 1's copy of a stage has 2.2 MiB: three blocks (3.1 MiB whole with the outside modules, 2.3 MiB at equal
    shards) fit it only when its copy on rank 3 (8 MiB) takes the larger share; the shares then fit each rank."""
    own = costs_for([8 * MiB, 2.2 * MiB, 8 * MiB, 8 * MiB])
    for sharded, shards in ((False, "equal"), (True, "equal")):
        with pytest.raises(ValueError, match="stage 0 .* needs"):
            place_stages(sharded_costs(own, 2, 2, sharded, shards), 2, boundaries=[3], ranks=(1, 0))
    placement = place_stages(sharded_costs(own, 2, 2, True, "memory"), 2, boundaries=[3], ranks=(1, 0))
    rooms = shard_rooms(own, placement, 0, [1, 3], held_samples=2)
    fractions, _ = shard_fractions(rooms, "memory")
    state = 3 * MiB * 0.5
    assert all(fraction * state <= room for fraction, room in zip(fractions, rooms))
    assert fractions[0] < 0.2 < 0.8 < fractions[1]


def test_the_shards_argument_is_checked_with_the_fix_and_defaults_to_memory_in_a_pipeline_at_stage_1():
    assert check_shards("memory") == "memory" and check_shards(None) is None
    assert default_shards(None, 1, pipeline=True) == "memory"
    assert default_shards(None, 1, pipeline=False) == default_shards(None, 0, pipeline=True) == "equal"
    assert default_shards("equal", 1, pipeline=True) == "equal"
    assert HeteroStrategy(pipeline={"stages": 2, "blocks": "net"}, stage=1).settings.shards == "memory"
    with pytest.raises(ValueError, match=r"shards='even'.*'equal', 'memory'"):
        check_shards("even")
    assert shards_refusal("equal", None, pipeline=False) is None
    assert shards_refusal("memory", 1, pipeline=False) is None  # (data parallel: tests/train/test_optimizer_shards.py)
    assert "Pass `stage=1`" in shards_refusal("memory", None, pipeline=True)
    assert shards_refusal("memory", 1, pipeline=True) is None


def test_a_pipeline_at_stage_1_runs_deepspeed_at_zero_0_and_stage_2_is_refused():
    strategy = HeteroStrategy(pipeline={"stages": 2, "blocks": "net"}, stage=1, shards="memory")
    assert strategy.config["zero_optimization"]["stage"] == 0 and strategy.settings.stage == 1
    with pytest.raises(ValueError, match=r"stage=2.*ZeRO-2/3 inside a stage are not built"):
        HeteroStrategy(pipeline={"stages": 2, "blocks": "net"}, stage=2)
    with pytest.raises(ValueError, match=r"shards='memory', stage=None.*Pass `stage=1` or `stage=2`"):
        HeteroStrategy(shards="memory")
