"""The pipeline's stage placement (:mod:`lightning_hetero.pipeline.placement`) against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_hetero.pipeline.placement import BlockCosts, check_boundaries, in_flight, place_stages


def brute_force(costs: BlockCosts, stages: int, holds: list[int]) -> float | None:
    """Every order of the ranks, every split: the least slowest stage that fits (written apart from the module)."""
    best = None
    for order in itertools.permutations(range(costs.ranks), stages):
        for cut in itertools.combinations(range(1, costs.blocks), stages - 1):
            edges = (0, *cut, costs.blocks)
            slowest, fits = 0.0, True
            for s in range(stages):
                blocks = range(edges[s], edges[s + 1])
                rank = order[s]
                used = costs.outside_bytes + sum(
                    costs.parameter_bytes[b] + holds[s] * costs.activation_bytes[b] for b in blocks
                )
                ceiling = costs.memory_bytes[rank]
                fits = fits and (ceiling is None or used <= ceiling)
                seconds = sum(costs.seconds[rank][b] for b in blocks) + costs.before_seconds[rank]
                if s == stages - 1:
                    seconds += costs.after_seconds[rank]
                slowest = max(slowest, seconds)
            if fits and (best is None or slowest < best):
                best = slowest
    return best


def random_costs(rng: random.Random, ranks: int, blocks: int) -> BlockCosts:
    speed = [rng.choice([1.0, 0.4, 0.7, 2.5]) for _ in range(ranks)]
    work = [rng.choice([1.0, 2.0, 3.0, 0.5]) for _ in range(blocks)]
    return BlockCosts(
        seconds=tuple(tuple(w / s for w in work) for s in speed),
        parameter_bytes=tuple(rng.choice([10, 40, 100]) for _ in range(blocks)),
        activation_bytes=tuple(rng.choice([1, 5, 20]) for _ in range(blocks)),
        memory_bytes=tuple(rng.choice([None, 150, 300, 600]) for _ in range(ranks)),
        after_seconds=tuple(rng.choice([0.0, 0.5]) for _ in range(ranks)),
        before_seconds=tuple(rng.choice([0.0, 0.2]) for _ in range(ranks)),
        outside_bytes=rng.choice([0, 20]),
    )


@pytest.mark.parametrize("seed", range(300))
def test_the_placement_is_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    ranks = rng.randint(1, 4)
    blocks = rng.randint(ranks, 7)
    costs = random_costs(rng, ranks, blocks)
    schedule, micro_batches, micro_batch = rng.choice(["1f1b", "gpipe"]), rng.randint(1, 4), rng.randint(1, 3)
    holds = [in_flight(schedule, s, ranks, micro_batches) * micro_batch for s in range(ranks)]
    expected = brute_force(costs, ranks, holds)
    if expected is None:
        with pytest.raises(ValueError, match="no split of the chain"):
            place_stages(costs, ranks, schedule, micro_batches, micro_batch)
        return
    placement = place_stages(costs, ranks, schedule, micro_batches, micro_batch)
    assert placement.slowest_seconds == pytest.approx(expected)
    assert sorted(placement.ranks) == list(range(ranks))
    covered = [b for s in range(ranks) for b in placement.blocks_of(s)]
    assert covered == list(range(blocks))  # contiguous, every block once, every stage at least one
    assert all(len(placement.blocks_of(s)) >= 1 for s in range(ranks))
    for rank, used in zip(placement.ranks, placement.stage_bytes):
        assert costs.memory_bytes[rank] is None or used <= costs.memory_bytes[rank]


def test_a_slow_device_gets_fewer_equal_blocks():
    costs = BlockCosts(
        seconds=((1.0,) * 8, (2.5,) * 8),  # rank 1 runs at 0.4 of rank 0's speed
        parameter_bytes=(1,) * 8,
        activation_bytes=(1,) * 8,
        memory_bytes=(None, None),
    )
    placement = place_stages(costs, 2, ranks=(0, 1))
    # 6 blocks at 1.0 beside 2 at 2.5 (6 vs 5 s); the equal split would take 4 x 2.5 = 10 s.
    assert placement.slowest_seconds == 6.0
    assert placement.balance == pytest.approx((6 + 5) / 12)
    equal = place_stages(costs, 2, boundaries=[4])
    assert equal.slowest_seconds / placement.slowest_seconds == pytest.approx(10 / 6)


def test_memory_moves_blocks_off_a_small_device():
    costs = BlockCosts(
        seconds=((1.0,) * 4, (1.0,) * 4), parameter_bytes=(10,) * 4, activation_bytes=(0,) * 4, memory_bytes=(10, None)
    )
    placement = place_stages(costs, 2)
    assert [len(placement.blocks_of(s)) for s in range(2)] == [1, 3]
    assert placement.ranks == (0, 1)


def test_given_boundaries_are_kept_and_checked():
    costs = BlockCosts(
        seconds=((1.0,) * 4,) * 2, parameter_bytes=(10,) * 4, activation_bytes=(0,) * 4, memory_bytes=(15, None)
    )
    with pytest.raises(ValueError, match=r"stage 0 \(blocks \[0, 1\]\) needs .* `boundaries`"):
        place_stages(costs, 2, boundaries=[2])
    assert place_stages(costs, 2, boundaries=[1]).source == "boundaries"


@pytest.mark.parametrize(
    ("boundaries", "stages", "blocks", "match"),
    [
        ([2, 1], 3, 4, "increase strictly"),
        ([0], 2, 4, "between 1 and 3"),
        ([4], 2, 4, "between 1 and 3"),
        ([1, 2], 2, 4, "2 entries for 2 stages"),
        ([2, 2], 3, 4, "increase strictly"),
    ],
)
def test_bad_boundaries_name_the_argument(boundaries, stages, blocks, match):
    with pytest.raises(ValueError, match=match):
        check_boundaries(boundaries, stages, blocks)


def test_more_stages_than_blocks_is_refused():
    costs = BlockCosts(
        seconds=((1.0,) * 2,) * 3, parameter_bytes=(1,) * 2, activation_bytes=(1,) * 2, memory_bytes=(None,) * 3
    )
    with pytest.raises(ValueError, match="`stages` 3 is more than the chain's 2 blocks"):
        place_stages(costs, 3)


def test_in_flight_by_schedule():
    assert [in_flight("1f1b", s, 3, 8) for s in range(3)] == [3, 2, 1]
    assert [in_flight("gpipe", s, 3, 8) for s in range(3)] == [8, 8, 8]
    assert [in_flight("1f1b", s, 3, 2) for s in range(3)] == [2, 2, 1]


@pytest.mark.parametrize("boundaries", [None, [2, 4]])
def test_rank_0_runs_the_last_stage_when_asked(boundaries):
    costs = BlockCosts(
        seconds=((1.0,) * 6, (2.5,) * 6, (1.0,) * 6),
        parameter_bytes=(1,) * 6,
        activation_bytes=(1,) * 6,
        memory_bytes=(None,) * 3,
    )
    placement = place_stages(costs, 3, boundaries=boundaries, last_rank=0)
    assert placement.ranks[-1] == 0
    free = place_stages(costs, 3)
    if boundaries is None:  # the constraint costs nothing here: the slow rank gets the fewest blocks either way
        assert placement.slowest_seconds == free.slowest_seconds


def test_a_rank_that_slowed_down_gives_blocks_away():
    from lightning_hetero.pipeline.placement import replan_stages

    costs = BlockCosts(
        seconds=((1.0,) * 8, (1.0,) * 8), parameter_bytes=(1,) * 8, activation_bytes=(1,) * 8, memory_bytes=(None, None)
    )
    current = place_stages(costs, 2, ranks=(1, 0), search_orders=False)
    assert current.boundaries == (4,)
    # Rank 1 (stage 0) now takes 2.5x as long as planned: it keeps 2 or 3 blocks (2 x 2.5 = 5 vs 6; 3 x 2.5 = 7.5).
    decision = replan_stages(costs, current, [1.0, 2.5], 0.05, "1f1b", 4, 1)
    assert decision.placement is not None and decision.placement.boundaries == (2,)
    assert decision.placement.ranks == (1, 0) and "[4] -> [2]" in decision.reason
    # Measured as planned: nothing moves; a gain below the threshold moves nothing either.
    assert replan_stages(costs, current, [1.0, 1.0], 0.05, "1f1b", 4, 1).placement is None
    assert replan_stages(costs, current, [1.0, 1.1], 0.5, "1f1b", 4, 1).placement is None


def test_a_faster_pipeline_gets_a_larger_share():
    from lightning_hetero.pipeline.placement import pipeline_shares

    # Pipeline 0 on ranks 0-1 at full speed, pipeline 1 on ranks 2-3 at 0.4: shares 1 : 0.4 of 70 samples.
    seconds = ((1.0,) * 4, (1.0,) * 4, (2.5,) * 4, (2.5,) * 4)
    costs = BlockCosts(seconds, (1,) * 4, (1,) * 4, (None,) * 4)
    placement = place_stages(costs, 2, ranks=(0, 1), search_orders=False, last_rank=0)
    assert pipeline_shares(costs, placement, 2, 70) == (50, 20)
    assert pipeline_shares(costs, placement, 1, 70) == (70,)


def test_an_interleaved_placement_cuts_each_stage_s_blocks_into_chunks_round_the_stages():
    """Placed by speed (6 blocks on rank 0 beside 2 on the slower rank 1), then each stage's blocks cut into 2 chunks
    laid out round the stages: rank 0's chunks [0-2] and [4-6], rank 1's [3] and [7]; each stage keeps its count, and
    its time and memory are those of the blocks it holds."""
    costs = BlockCosts(
        seconds=((1.0,) * 8, (2.5,) * 8),
        parameter_bytes=tuple(range(1, 9)),
        activation_bytes=(1,) * 8,
        memory_bytes=(None, None),
    )
    placement = place_stages(costs, 2, "interleaved", 4, 1, ranks=(0, 1), search_orders=False, chunks=2)
    assert [list(c) for c in placement.chunks_of(0)] == [[0, 1, 2], [4, 5, 6]]
    assert [list(c) for c in placement.chunks_of(1)] == [[3], [7]]
    assert placement.blocks_of(1) == [3, 7] and placement.boundaries == (6,)
    holds = [in_flight("interleaved", s, 2, 4, 2) for s in range(2)]  # (4 + 1 and 2 + 1 chunk passes: 3 and 2)
    assert holds == [3, 2]
    assert placement.stage_bytes == (1 + 2 + 3 + 5 + 6 + 7 + 3 * 6, 4 + 8 + 2 * 2)
    assert placement.stage_seconds == (6.0, 5.0)
    # The step: every micro-batch at the slowest stage's pace, the fill and drain through chunks of half a stage.
    assert placement.step_seconds(4, 1) == pytest.approx(4 * 6 + 5 / 2)
    assert place_stages(costs, 2, ranks=(0, 1), search_orders=False).step_seconds(4, 1) == pytest.approx(4 * 6 + 5)


def test_a_stage_with_fewer_blocks_than_chunks_is_refused():
    costs = BlockCosts(
        seconds=((1.0,) * 4,) * 2, parameter_bytes=(1,) * 4, activation_bytes=(0,) * 4, memory_bytes=(None, None)
    )
    with pytest.raises(ValueError, match=r"stage 0 holds 1 block\(s\), fewer than `virtual_stages` 2"):
        place_stages(costs, 2, "interleaved", boundaries=[1], chunks=2)


def test_an_interleaved_placement_by_speed_gives_every_stage_a_block_per_chunk():
    """Rank 1 at a sixth of rank 0's speed: 1F1B gives it 1 of 8 blocks; interleaved with 2 chunks it must hold 2 (one
    per chunk), which the search keeps to instead of refusing the split it would have made. A chain too short for
    every stage's chunks is refused with the counts."""
    costs = BlockCosts(
        seconds=((1.0,) * 8, (6.0,) * 8), parameter_bytes=(1,) * 8, activation_bytes=(0,) * 8, memory_bytes=(None,) * 2
    )
    assert [len(place_stages(costs, 2, ranks=(0, 1), search_orders=False).blocks_of(s)) for s in range(2)] == [7, 1]
    interleaved = place_stages(costs, 2, "interleaved", 4, 1, ranks=(0, 1), search_orders=False, chunks=2)
    assert [len(interleaved.blocks_of(s)) for s in range(2)] == [6, 2]
    assert [len(c) for c in interleaved.chunks_of(1)] == [1, 1]
    with pytest.raises(ValueError, match="2 stages of `virtual_stages` 5 chunks need 10 blocks, and the chain has 8"):
        place_stages(costs, 2, "interleaved", 4, 1, ranks=(0, 1), chunks=5)
