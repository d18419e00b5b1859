"""Local SGD / DiLoCo decisions: the arguments, what is refused, the inner steps, the synchronization schedule."""

from __future__ import annotations

import math

import pytest

from lightning_hetero.local.inner_steps import (
    DILOCO_DEFAULTS,
    InnerStepsRebalancer,
    balance,
    check_inner_steps_length,
    check_sync_arguments,
    describe_sync,
    inner_steps_for,
    is_sync_step,
    plan_inner_steps,
    sync_eager,
    sync_fragments,
    sync_overlap,
    sync_refusal,
)
from lightning_hetero.measure.cost import CostModel


def test_sync_arguments_give_the_outer_optimizer():
    assert check_sync_arguments("every_step", 1, None, None) is None
    assert check_sync_arguments("local_sgd", 8, [2, 1], None) is None
    assert check_sync_arguments("diloco", 8, None, None) == DILOCO_DEFAULTS
    assert check_sync_arguments("diloco", 8, None, {"outer_lr": 1.0, "outer_momentum": 0.0}) == {
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "nesterov": False,  # (no Nesterov without momentum)
    }


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("sometimes", 1, None, None), "`sync='sometimes'` is not one of"),
        (("diloco", 0, None, None), "`sync_every=0` must be a positive integer"),
        (("diloco", 2.5, None, None), "`sync_every=2.5`"),
        (("every_step", 4, None, None), "`sync_every` is given with `sync='every_step'`"),
        (("every_step", 1, [2, 1], None), "`inner_steps` is given with `sync='every_step'`"),
        (("diloco", 4, [2, 0], None), "`inner_steps=[2, 0]` must hold one whole number >= 1 per rank"),
        (("diloco", 4, 2, None), "`inner_steps=2` is not a list"),
        (("diloco", 4, None, {"lr": 0.7}), "has ['lr']; the keys are"),
        (("local_sgd", 4, None, {"outer_lr": 0.7}), "is given with `sync='local_sgd'`"),
        (("diloco", 4, None, {"outer_lr": 0}), "`sync_options['outer_lr']=0` must be a finite number > 0"),
        (("diloco", 4, None, {"outer_momentum": 1.0}), "`sync_options['outer_momentum']=1.0` must be a finite"),
        (("diloco", 4, None, {"outer_lr": math.nan}), "outer_lr"),
        (("diloco", 4, None, {"nesterov": "yes"}), "`sync_options['nesterov']='yes'` must be True or False"),
    ],
)
def test_bad_sync_arguments_are_named(arguments, message):
    with pytest.raises(ValueError) as error:
        check_sync_arguments(*arguments)
    assert message in str(error.value)


BASE = dict(
    sync="diloco",
    stage=0,
    compression_mode=None,
    precisions=["32-true"],
    micro_steps=None,
    weights=None,
    global_batch_size=None,
    hierarchical="auto",
    automatic_optimization=True,
)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, None),
        ({"sync": "every_step", "stage": 3}, None),
        ({"compression_mode": "bf16"}, None),
        ({"precisions": ["bf16-mixed"]}, None),
        ({"stage": 2}, "needs `stage=0`: ZeRO stage 2 shards"),
        ({"compression_mode": "powersgd"}, "with `compression='powersgd'`"),
        ({"hierarchical": True}, "with `hierarchical=True`"),
        ({"precisions": ["16-mixed"]}, "with an fp16 rank"),
        ({"micro_steps": [2, 1]}, "with `micro_steps`"),
        ({"weights": [1.0, 0.4]}, "with `weights`"),
        ({"global_batch_size": 64}, "with `global_batch_size`"),
        ({"automatic_optimization": False}, "with manual optimization"),
    ],
)
def test_what_local_training_refuses(changes, message):
    refusal = sync_refusal(**{**BASE, **changes})
    assert refusal is None if message is None else message in refusal


def test_inner_steps_follow_the_speeds():
    fast = CostModel(0.0, 1.0)
    # As many inner steps as the rank computes while the slowest computes one, to the nearest whole step.
    assert plan_inner_steps([fast, CostModel(0.0, 2.5)], [8, 8]) == (3, 1)
    assert plan_inner_steps([fast, CostModel(0.0, 2.25)], [8, 8]) == (2, 1)
    assert plan_inner_steps([fast, fast], [8, 8]) == (1, 1)
    assert plan_inner_steps([CostModel(0.0, 2.5), fast, CostModel(0.0, 10.0)], [8, 8, 8]) == (4, 10, 1)
    # The micro-batches count: a rank with twice the micro-batch takes half the steps.
    assert plan_inner_steps([fast, CostModel(0.0, 4.0)], [16, 8]) == (2, 1)
    check_inner_steps_length([2, 1], 2)
    with pytest.raises(ValueError, match=r"`inner_steps=\[2, 1\]` has 2 entries but the job has 3 ranks"):
        check_inner_steps_length([2, 1], 3)


def test_the_ranks_synchronize_every_h_steps_and_at_each_epochs_end():
    assert [is_sync_step(step, 4, last_of_epoch=False) for step in range(1, 9)] == [False] * 3 + [True] + [
        False
    ] * 3 + [True]
    assert is_sync_step(5, 4, last_of_epoch=True)
    assert "every 4 training steps" in describe_sync("diloco", 4, [2, 1], DILOCO_DEFAULTS)
    assert "Nesterov" in describe_sync("diloco", 4, [2, 1], DILOCO_DEFAULTS)
    assert describe_sync("every_step", 1, [1, 1], None) == "gradients exchanged at every step"
    streaming = describe_sync("local_sgd", 8, [2, 1], None, fragments=4)
    assert "every 2 training steps, one of 4 fragments of the parameters in turn (each every 8)" in streaming


def test_a_rank_that_waits_for_its_data_gets_fewer_inner_steps_and_the_others_fill_the_wait():
    """Equal devices (20 ms per inner step), rank 1's loader 30 ms behind per training step: rank 0 takes the inner
    steps that fill rank 1's wait plus its one step (50 ms: 3 of 20 ms after rounding), where compute alone saw a
    balanced [1, 1]."""
    assert inner_steps_for([0.02, 0.02]) == (1, 1)
    assert inner_steps_for([0.02, 0.02], [0.0, 0.03]) == (3, 1)
    assert balance((3, 1), [0.02, 0.02], [0.0, 0.03]) > balance((1, 1), [0.02, 0.02], [0.0, 0.03])
    rebalancer = InnerStepsRebalancer([64, 64], (1, 1), window=2)
    steps = [
        {"step": s, "batch_sizes": [64, 64], "compute_seconds": [0.02, 0.02], "data_wait_seconds": [0.0, 0.03]}
        for s in range(4)
    ]
    replan = rebalancer.consider(steps, 4)
    assert replan is not None and replan.micro_steps == (3, 1) and replan.data_waits == (0.0, 0.03)
    no_wait = [{**step, "data_wait_seconds": [0.0, 0.0]} for step in steps]
    assert InnerStepsRebalancer([64, 64], (1, 1), window=2).consider(no_wait, 4) is None


def test_inner_steps_follow_what_the_ranks_measure():
    rebalancer = InnerStepsRebalancer([64, 64], (1, 1), window=2)
    # Rank 1 computes 2.5x as long per inner step (1 inner step each so far).
    steps = [{"step": s, "batch_sizes": [64, 64], "compute_seconds": [0.02, 0.05]} for s in range(4)]
    assert rebalancer.consider(steps[:3], 3) is None  # not two windows yet
    replan = rebalancer.consider(steps, 4)
    # The step keeps its 128 samples, shared 3:1.
    assert replan is not None and replan.micro_steps == (3, 1) and replan.batch_sizes == (96, 32)
    assert replan.predicted_gain == pytest.approx(balance((3, 1), [0.02, 0.05]) - balance((1, 1), [0.02, 0.05]))
    # Measured as predicted under the new counts (96 samples at 0.02 s per 64, 32 at 0.05 s per 64): no change.
    later = steps + [{"step": s, "batch_sizes": [96, 32], "compute_seconds": [0.03, 0.025]} for s in range(4, 12)]
    assert rebalancer.consider(later, 12) is None
    assert rebalancer.micro_steps_of((96, 32)) == (3, 1)
    rebalancer.restored = (2, 1)  # a checkpoint's record
    rebalancer.adopt((85, 43), 12)
    assert rebalancer.inner_steps == (2, 1) and rebalancer.changed_at == 12


def test_noise_below_the_gain_does_not_change_the_inner_steps():
    rebalancer = InnerStepsRebalancer([64, 64], (2, 1), window=2)
    steps = [
        {"step": s, "batch_sizes": [128, 64], "compute_seconds": [0.05, 0.052 + 0.004 * (s % 2)]} for s in range(8)
    ]
    assert rebalancer.consider(steps, 8) is None


def test_inner_steps_are_not_changed_where_the_step_has_too_few_samples_for_them():
    rebalancer = InnerStepsRebalancer([1, 1], (1, 1), window=2)
    steps = [{"step": s, "batch_sizes": [1, 1], "compute_seconds": [0.01, 0.05]} for s in range(4)]
    assert rebalancer.consider(steps, 4) is None  # 5 inner steps wanted on rank 0, 2 samples in the step


@pytest.mark.parametrize("fragments", [0, 3, 2.5, "2", True])
def test_fragments_must_divide_sync_every(fragments):
    with pytest.raises(ValueError, match="must be a whole number >= 1 that divides `sync_every=8`"):
        sync_fragments({"fragments": fragments}, 8)
    assert sync_fragments({"fragments": 4}, 8) == 4 and sync_fragments(None, 8) == 1


@pytest.mark.parametrize("value", [1, "yes", None, 0.0])
def test_overlap_must_be_true_or_false(value):
    with pytest.raises(ValueError, match=rf"`sync_options\['overlap'\]={value!r}` must be True or False"):
        check_sync_arguments("diloco", 4, None, {"overlap": value})


def test_overlap_is_a_sync_option_of_both_local_modes_and_the_plan_says_what_it_does():
    assert check_sync_arguments("local_sgd", 4, None, {"overlap": True}) is None
    assert check_sync_arguments("diloco", 4, None, {"overlap": False, "fragments": 2}) == DILOCO_DEFAULTS
    # None: off; else the steps after which a merge is applied: 1 by default, at most the steps between two merges
    assert sync_overlap(None, 8) is None and sync_overlap({"overlap": True}, 8) == 1
    assert sync_overlap({"overlap": True, "fragments": 4, "overlap_steps": 2}, 8) == 2
    assert sync_overlap({"overlap": True, "overlap_steps": 8}, 8) == 8
    line = describe_sync("diloco", 4, [2, 1], DILOCO_DEFAULTS, fragments=2, overlap=2)
    assert (
        "each merge is sent in the background while the ranks train on from the outer step of their own progress, its"
        " outer step applied at the next" in line
    )
    assert "train on from their own parameters, its outer step applied 1 training steps later" in describe_sync(
        "diloco", 4, [2, 1], DILOCO_DEFAULTS, overlap=1, eager=False
    )
    assert "applied 1 training steps later" in describe_sync("diloco", 4, [2, 1], DILOCO_DEFAULTS, overlap=1)
    assert "background" not in describe_sync("diloco", 4, [2, 1], DILOCO_DEFAULTS, fragments=2)


@pytest.mark.parametrize(
    "options",
    [
        {"overlap_steps": 1},
        {"overlap": False, "overlap_steps": 1},
        {"overlap": True, "overlap_steps": 0},
        {"overlap": True, "overlap_steps": 5},
        {"overlap": True, "overlap_steps": 1.5},
        {"overlap": True, "fragments": 2, "overlap_steps": 3},
    ],
)
def test_overlap_steps_are_refused_outside_1_to_the_steps_between_merges_or_without_overlap(options):
    interval = 4 // options.get("fragments", 1)
    message = (
        rf"`sync_options\['overlap_steps'\]={options['overlap_steps']!r}` must be a whole number from 1 to {interval}"
    )
    with pytest.raises(ValueError, match=message):
        check_sync_arguments("diloco", 4, None, options)


def test_eager_is_an_overlap_option_of_diloco_true_by_default():
    """``eager`` (what a rank trains on from while a merge is in flight) is read with overlap alone; its default is
    the outer step of the rank's own progress. With local SGD that step is the rank's own parameters whatever
    ``eager`` says, so it is refused there; the plan line says what the ranks train on from."""
    assert check_sync_arguments("diloco", 4, None, {"overlap": True, "eager": False}) == DILOCO_DEFAULTS
    assert sync_eager(None) is True and sync_eager({"overlap": True}) is True
    assert sync_eager({"overlap": True, "eager": False}) is False
    for eager in (True, False):
        with pytest.raises(ValueError, match=r"is given with `sync='local_sgd'`.*`eager`.*is its own parameters"):
            check_sync_arguments("local_sgd", 4, None, {"overlap": True, "eager": eager})
    assert "train on from their own parameters" in describe_sync("local_sgd", 4, [2, 1], None, overlap=1)


@pytest.mark.parametrize(
    "options",
    [
        {"eager": False},
        {"overlap": False, "eager": True},
        {"overlap": True, "eager": 0},
        {"overlap": True, "eager": "no"},
        {"overlap": True, "eager": None},
        {"eager": None},
    ],
)
def test_eager_is_refused_without_overlap_or_other_than_true_or_false(options):
    message = rf"`sync_options\['eager'\]={options['eager']!r}` must be True or False, given with `overlap=True`"
    with pytest.raises(ValueError, match=message):
        check_sync_arguments("diloco", 4, None, options)


def test_fragments_are_a_sync_option_of_both_local_modes_and_not_an_outer_setting():
    assert check_sync_arguments("local_sgd", 4, None, {"fragments": 2}) is None
    assert check_sync_arguments("diloco", 4, None, {"fragments": 2}) == DILOCO_DEFAULTS
