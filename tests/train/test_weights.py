"""The loss weight and the sample-weighted sync_dist mean that make unequal batches give DDP's update and metrics."""

from __future__ import annotations

import pytest
import torch

from lightning_hetero.split.decisions.split import SplitPlan
from lightning_hetero.train.weights import LossWeights


def weights(reduction, rank=0, world_size=2, total=None):
    loss_weights = LossWeights(reduction)
    loss_weights.join(rank, world_size, (lambda value: total) if total is not None else (lambda value: value))
    return loss_weights


@pytest.mark.parametrize(("local", "global_", "expected"), [(10, 16, 10 * 2 / 16), (6, 16, 6 * 2 / 16), (3, 5, 1.2)])
def test_a_mean_loss_is_weighted_by_this_batchs_share_times_the_ranks(local, global_, expected):
    loss_weights = weights("mean")
    loss_weights.training_batch(local, global_)
    assert loss_weights.current(SplitPlan((8, 8), source="fixed")) == pytest.approx(expected)


def test_a_summed_loss_is_not_weighted_and_before_any_batch_the_plan_gives_the_weight():
    summed = weights("sum")
    summed.training_batch(10, 16)
    assert summed.current(None) == 1.0
    assert weights("mean", rank=1).current(SplitPlan((12, 4), source="fixed")) == pytest.approx(4 * 2 / 16)
    assert weights("mean").current(None) == 1.0


def test_a_token_mean_is_weighted_by_this_ranks_tokens_over_every_ranks():
    loss_weights = weights("token_mean", total=40.0)  # the all-reduce of the ranks' counts
    loss_weights.step_started()
    with pytest.raises(RuntimeError, match="token count of this batch is unknown"):
        loss_weights.current(None)
    loss_weights.step_returned({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(10)})
    assert loss_weights.current(None) == pytest.approx(10 * 2 / 40)


def test_a_mean_outside_a_step_or_on_one_rank_is_the_parents():
    loss_weights, calls = weights("mean", world_size=1), []

    def plain(tensor, group=None, reduce_op=None):
        calls.append(reduce_op)
        return tensor

    value = torch.tensor([2.0])
    assert loss_weights.reduce(value, None, "mean", plain) is value
    loss_weights.training_batch(10, 16)
    with loss_weights.weighted_sync():
        loss_weights.reduce(value, None, "mean", plain)  # one rank: nothing to weight over
    # Lightning's epoch mean of summed integer batch sizes: averaged in floating point, not truncated.
    assert loss_weights.reduce(torch.tensor([11]), None, "mean", plain).dtype == torch.get_default_dtype()
    assert calls == ["mean"] * 3
