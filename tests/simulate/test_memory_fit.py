"""`lightning-hetero plan`'s largest model with even and with memory-sized optimizer shards
(:mod:`lightning_hetero.simulate.memory_fit`): the bounds against a direct check of every rank's bytes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_hetero.simulate.memory_fit import describe, largest_even, largest_memory_sized, memory_fit
from lightning_hetero.train.optimizer_shards import shard_fractions

GB = 1e9


def even_fits(rooms, stage, parameters) -> bool:
    n = len(rooms)
    held = parameters * (4 + (4 / n if stage == 2 else 4) + 8 / n)
    return all(held <= room * (1 + 1e-9) for room in rooms)


def memory_sized_fits(rooms, parameters) -> bool:
    """The shares the training decides (shard_fractions of what each rank has left after the model and gradients)
    hold Adam's state on every rank."""
    left = [room - 8 * parameters for room in rooms]
    if any(x < -1e-9 * room for x, room in zip(left, rooms)):
        return False
    fractions, _ = shard_fractions([int(max(0.0, x)) for x in left], "memory")
    return all(f * 8 * parameters <= max(0.0, x) * (1 + 1e-6) + 1 for f, x in zip(fractions, left))


@given(st.lists(st.floats(min_value=1e6, max_value=1e11), min_size=2, max_size=8))
def test_each_bound_is_the_largest_model_that_fits_every_rank(rooms):
    for stage in (1, 2):
        largest = largest_even(rooms, stage)
        assert even_fits(rooms, stage, largest) and not even_fits(rooms, stage, largest * 1.001)
    largest = largest_memory_sized(rooms)
    assert memory_sized_fits(rooms, largest) and not memory_sized_fits(rooms, largest * 1.001)
    # Never less than even ZeRO-1 holds (the same whole gradients, better shares); where the rooms are equal, exactly
    # that, and less than ZeRO-2's, whose gradients are sharded during the backward.
    assert largest >= largest_even(rooms, 1) * (1 - 1e-9)


def test_on_equal_devices_memory_sized_shards_hold_what_even_zero_1_holds_and_less_than_zero_2():
    rooms = [10 * GB] * 4
    assert largest_memory_sized(rooms) == pytest.approx(largest_even(rooms, 1))
    assert largest_memory_sized(rooms) < largest_even(rooms, 2)


def test_a_24_gb_device_beside_an_80_gb_one_holds_a_quarter_more_with_memory_sized_shards():
    fit = memory_fit(["RTX-4090", "A100-80GB"], [24 * GB, 80 * GB])
    assert fit["zero1_even_parameters"] == pytest.approx(2 * GB)  # 24 GB / 12 bytes a parameter
    assert fit["zero2_even_parameters"] == pytest.approx(2.4 * GB)  # 24 GB / 10
    assert fit["memory_sized_parameters"] == pytest.approx(3 * GB)  # the 4090's model and gradients: 24 GB / 8
    assert fit["even_limited_by"] == "RTX-4090"
    assert describe(fit) == (
        "largest model beside the planned activations (fp32, Adam): even ZeRO-1 shards 2.00 B parameters, even"
        " ZeRO-2 2.40 B parameters (limited by the RTX-4090), memory-sized shards (`stage=2, shards='memory'`) 3.00 B"
        " parameters (1.25x ZeRO-2's)"
    )
    assert json.loads(json.dumps(fit)) == fit
