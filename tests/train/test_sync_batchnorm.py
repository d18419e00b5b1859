"""BatchNorm over every rank's samples on any backend (:mod:`lightning_hetero.train.sync_batchnorm`): ranks of
unequal micro-batches, run as threads that sum through a barrier, give one process's update on the global batch."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from lightning.pytorch.plugins import TorchSyncBatchNorm
from torch import nn

from lightning_hetero.train.sync_batchnorm import (
    HeteroSyncBatchNorm,
    SampleWeightedSyncBatchNorm,
    convert_batchnorms,
    layer_sync_for,
    revert_batchnorms,
    small_batchnorm_warning,
)


class ThreadRanks:
    """``world`` ranks as threads; ``reducer(rank)`` sums a tensor over them in place, as an all-reduce does."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world
        self.reductions = 0

    def reducer(self, rank: int):
        def all_reduce(tensor: torch.Tensor) -> None:
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.slots)
            if rank == 0:
                self.reductions += 1
            self.barrier.wait()
            tensor.copy_(total)

        return all_reduce

    def run(self, work) -> list:
        results, errors = [None] * self.world, []

        def target(rank: int) -> None:
            try:
                results[rank] = work(rank)
            except BaseException as error:  # surfaced below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if errors:
            raise errors[0]
        return results


def inputs(samples: int, image: bool, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (samples, 5, 2, 3) if image else (samples, 3)
    return torch.randn(shape, generator=generator) * 3 + 1


def make(image: bool, momentum) -> nn.Module:
    features = 4
    if image:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(5, features, 1),
            nn.BatchNorm2d(features, momentum=momentum),
            nn.Tanh(),
            nn.Flatten(),
            nn.Linear(features * 2 * 3, 1),
        )
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, features), nn.BatchNorm1d(features, momentum=momentum), nn.Tanh(), nn.Linear(features, 1)
    )


@pytest.mark.parametrize("image", [False, True], ids=["BatchNorm1d", "BatchNorm2d"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_unequal_ranks_give_one_process_update_and_running_statistics(image, momentum):
    sizes = (3, 13)
    total = sum(sizes)
    x = inputs(total, image, seed=1)
    y = torch.randn(total, 1, generator=torch.Generator().manual_seed(2))
    reference = make(image, momentum)
    ranks = ThreadRanks(len(sizes))
    replicas = [convert_batchnorms(copy.deepcopy(reference), ranks.reducer(r)) for r in range(len(sizes))]
    # One process on the global batch, two steps (the running statistics move twice).
    for _ in range(2):
        reference.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
    offsets = [0, sizes[0]]

    def rank_steps(rank: int):
        model = replicas[rank]
        part = slice(offsets[rank], offsets[rank] + sizes[rank])
        for _ in range(2):
            model.zero_grad()
            # The strategy's loss weight b_r * W / B; the gradient exchange then averages the ranks' gradients.
            loss = nn.functional.mse_loss(model(x[part]), y[part]) * sizes[rank] * len(sizes) / total
            (loss / len(sizes)).backward()
        return model

    models = ranks.run(rank_steps)
    for name, parameter in reference.named_parameters():
        exchanged = sum(dict(m.named_parameters())[name].grad for m in models)  # (the exchange's sum of averages)
        assert torch.allclose(exchanged, parameter.grad, atol=1e-6), name
    for name, buffer in reference.named_buffers():
        for model in models:
            assert torch.allclose(dict(model.named_buffers())[name].double(), buffer.double(), atol=1e-6), name
    assert ranks.reductions == 2 * 2  # one in each forward and one in each backward


def test_eval_mode_and_a_single_process_use_the_running_statistics_without_collectives():
    ranks = ThreadRanks(1)
    layer = convert_batchnorms(nn.BatchNorm1d(3), ranks.reducer(0))
    layer.running_mean.fill_(1.0)
    layer.eval()
    out = layer(torch.ones(2, 3))
    assert torch.allclose(out, torch.zeros(2, 3), atol=1e-4) and ranks.reductions == 0
    plain = convert_batchnorms(nn.BatchNorm1d(3))  # the default all-reduce, no process group: a plain BatchNorm
    plain(torch.randn(4, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        convert_batchnorms(nn.BatchNorm1d(3), ranks.reducer(0))(torch.randn(1, 3))


def test_conversion_keeps_the_tensors_and_revert_puts_each_class_back():
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Sequential(nn.BatchNorm2d(4), nn.SyncBatchNorm(2)), nn.Linear(3, 1))
    weights = [layer.weight for layer in model.modules() if isinstance(layer, nn.modules.batchnorm._BatchNorm)]
    means = [layer.running_mean for layer in model.modules() if isinstance(layer, nn.modules.batchnorm._BatchNorm)]
    converted = HeteroSyncBatchNorm().apply(model)
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert all(type(layer) is SampleWeightedSyncBatchNorm for layer in layers)
    assert [layer.weight for layer in layers] == weights and [layer.running_mean for layer in layers] == means
    reverted = HeteroSyncBatchNorm().revert(converted)
    kinds = [type(m) for m in reverted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert kinds == [nn.BatchNorm1d, nn.BatchNorm2d, nn.SyncBatchNorm]
    assert revert_batchnorms(nn.Linear(2, 2)).__class__ is nn.Linear


def test_the_layer_sync_is_torchs_on_nccl_and_ours_elsewhere_and_a_users_own_stays():
    assert type(layer_sync_for(TorchSyncBatchNorm(), "gloo")) is HeteroSyncBatchNorm
    assert type(layer_sync_for(TorchSyncBatchNorm(), "nccl")) is TorchSyncBatchNorm
    own = HeteroSyncBatchNorm()
    assert layer_sync_for(own, "gloo") is own and layer_sync_for(None, "gloo") is None


def test_the_plan_warns_when_a_batchnorm_sees_few_samples_without_sync():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    warning = small_batchnorm_warning([3, 13], model, synchronized=False)
    assert "rank 0's micro-batch is 3 samples (below 16)" in warning and "Trainer(sync_batchnorm=True)" in warning
    assert small_batchnorm_warning([3, 13], model, synchronized=True) is None
    assert small_batchnorm_warning([16, 40], model, synchronized=False) is None
    assert small_batchnorm_warning([3, 13], nn.Linear(3, 4), synchronized=False) is None
    assert small_batchnorm_warning([3], model, synchronized=False) is None
