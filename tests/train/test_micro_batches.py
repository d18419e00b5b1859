"""A rank's batch cut into micro-batches, their loss weights, and the collectives an early micro-batch may make."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightning_hetero.split.decisions.split import SplitPlan, loss_weight, micro_batch_sizes, resolve_split
from lightning_hetero.train.micro_batches import MicroBatchGuard, raise_if_unreduced, split_batch, step_loss
from lightning_hetero.train.weights import LossWeights

Pair = namedtuple("Pair", ["x", "y"])


@pytest.mark.parametrize(
    ("samples", "steps", "sizes"),
    [(12, 3, [4, 4, 4]), (13, 3, [5, 4, 4]), (14, 3, [5, 5, 4]), (2, 3, [1, 1]), (1, 1, [1]), (7, 1, [7])],
)
def test_micro_batches_differ_by_at_most_one_and_none_is_empty(samples, steps, sizes):
    assert micro_batch_sizes(samples, steps) == sizes


def test_every_kind_of_batch_is_cut_along_the_samples():
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    batch = {
        "pair": Pair(x, y),
        "names": ["a", "b", "c", "d", "e"],
        "scale": torch.tensor(2.0),
        "tag": "t",
        "nested": [x, (y,)],
    }
    pieces = split_batch(batch, [3, 2])
    assert [type(p["pair"]) for p in pieces] == [Pair, Pair]
    assert torch.equal(pieces[0]["pair"].x, x[:3]) and torch.equal(pieces[1]["pair"].y, y[3:])
    assert pieces[0]["names"] == ["a", "b", "c"] and pieces[1]["names"] == ["d", "e"]
    assert all(p["scale"] is batch["scale"] and p["tag"] == "t" for p in pieces)  # one per batch: every piece
    assert torch.equal(pieces[1]["nested"][0], x[3:]) and torch.equal(pieces[1]["nested"][1][0], y[3:])
    # Pieces put back together are the batch.
    assert torch.equal(torch.cat([p["pair"].x for p in pieces]), x)
    # One micro-batch: the batch itself, untouched.
    assert split_batch(batch, [5])[0] is batch


def test_a_tensor_that_is_not_per_sample_is_named_in_the_error():
    batch = (torch.zeros(6, 2), {"table": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"batch\[1\]\['table'\] is a tensor of shape \(4, 3\).*6 samples"):
        split_batch(batch, [3, 3])


def test_the_micro_batches_weights_add_up_to_the_ranks_weight():
    weights = LossWeights("mean")
    weights.join(rank=1, world_size=2, sum_over_ranks=lambda value: value)
    weights.training_batch(13, 16)
    whole = weights.current(None)
    parts = []
    for size in micro_batch_sizes(13, 3):
        weights.micro_batch(size)
        parts.append(weights.current(None))
    assert parts == [loss_weight(size, 16, 2) for size in (5, 4, 4)]
    assert sum(parts) == pytest.approx(whole)
    weights.step_started()  # the next batch starts without micro-batch in hand
    assert weights.current(None) == whole


def test_split_plans_with_micro_steps():
    plan = resolve_split(2, 16, batch_sizes=[4, 4], micro_steps=[1, 3])
    assert (plan.batch_sizes, plan.micro_steps, plan.micro_batches) == ((4, 12), (1, 3), (4, 4))
    assert plan.has_micro_steps and plan.global_batch_size == 16
    equal = resolve_split(2, 15, micro_steps=[2, 1])
    assert (equal.batch_sizes, equal.micro_steps, equal.micro_batches) == ((8, 7), (2, 1), (4, 7))
    assert SplitPlan((3, 5), "equal").micro_steps == (1, 1) and not SplitPlan((3, 5), "equal").has_micro_steps
    with pytest.raises(ValueError, match="the equal split gives rank 0 2 samples .* fewer than its 3 micro-steps"):
        resolve_split(2, 4, micro_steps=[3, 1])
    with pytest.raises(ValueError, match=r"`micro_steps=\[1, 2, 3\]` has 3 entries but the job has 2 ranks"):
        resolve_split(2, 16, micro_steps=[1, 2, 3])
    with pytest.raises(ValueError, match="do not fit the samples per rank"):
        SplitPlan((3, 5), "re-plan", (4, 1))


def test_an_early_micro_batch_refuses_collectives_and_the_last_makes_them():
    guard = MicroBatchGuard()
    guard.refuse_collective("all_gather")  # not inside a micro-batch: nothing to refuse
    with guard.early_micro_batch():
        assert guard.early
        with pytest.raises(RuntimeError, match="`all_gather` was called inside `training_step`.*micro_steps"):
            guard.refuse_collective("all_gather")
    assert not guard.early


def test_step_loss_reads_what_training_step_returns():
    loss = torch.tensor(1.5)
    assert step_loss(loss) is loss and step_loss({"loss": loss, "other": 1}) is loss and step_loss(None) is None


def test_a_gradient_left_after_the_last_zero_2_backward_is_named():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    raise_if_unreduced(module)  # every gradient reduced (and removed): nothing to say
    module[1].weight.grad = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match=r"parameters \['1.weight'\] had gradients from an earlier micro-batch"):
        raise_if_unreduced(module)


def test_the_merge_weighs_each_ranks_pseudo_gradient_by_its_samples():
    """Rank 0 trained on 30 samples from the anchor 1.0 to 0.4, rank 1 on 10 samples to 0.8: local SGD ends at
    (30 * 0.4 + 10 * 0.8) / 40 = 0.5; DiLoCo with outer lr 1 and no momentum at the same place."""
    from lightning_hetero.local.merges import LocalTraining

    other_count, other_delta = 10.0, 1.0 - 0.8

    def all_reduce(tensor: torch.Tensor) -> None:  # adds what rank 1 contributes
        if tensor.dtype == torch.float64 and tensor.numel() == 1:
            tensor += other_count
        else:
            tensor += other_count / 40 * other_delta

    for outer in (None, {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}):
        parameter = torch.nn.Parameter(torch.tensor([1.0]))
        local = LocalTraining("local_sgd" if outer is None else "diloco", 4, outer, None)
        local.attach([parameter], None)
        with torch.no_grad():
            parameter.fill_(0.4)
        assert not local.step_done(30, last_of_epoch=False, all_reduce=all_reduce)  # step 1 of 4: no merge
        assert local.step_done(0, last_of_epoch=True, all_reduce=all_reduce)  # the epoch's end: merge
        assert parameter.item() == pytest.approx(0.5)
        assert local.samples_since_sync == 0 and local.synchronizations == 1
