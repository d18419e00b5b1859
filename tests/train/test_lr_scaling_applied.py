"""A learning-rate scaling applied to real optimizers and schedulers (lightning_hetero.train.lr_scaling)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hetero.configure.lr_scaling import LrScaling
from lightning_hetero.train.lr_scaling import base_optimizer, scale_optimizers


class Wrapper:
    """Stands in for Lightning's LightningOptimizer and DeepSpeed's ZeRO optimizer: the torch one as `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def parameters():
    return [torch.nn.Parameter(torch.ones(3))]


def test_adamw_and_a_lambda_schedule_go_on_at_the_scaled_rate_after_the_scheduler_steps():
    """The rate a schedule computes from its base_lrs stays scaled at its next step (a scheduler restored after the
    scaling would undo it), and AdamW's decoupled decay keeps lr * weight_decay scaled by k."""
    optimizer = torch.optim.AdamW(parameters(), lr=0.01, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    optimizer.step()
    schedule.step()  # epoch 1: lr = 0.01 / 2
    scaling = LrScaling("sqrt", 16, 4)  # k = 1/4: lr x 1/2, weight decay x 1/2
    assert scale_optimizers([Wrapper(Wrapper(optimizer))], [schedule], scaling) is True
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(0.01 / 2 * 0.5) and group["initial_lr"] == pytest.approx(0.005)
    assert group["weight_decay"] == pytest.approx(0.05)
    assert group["lr"] * group["weight_decay"] == pytest.approx(0.005 * 0.1 * 0.25)  # x k
    optimizer.step()
    schedule.step()  # epoch 2: lr = scaled base / 3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 / 3)


def test_sgd_and_adam_keep_their_coupled_weight_decay_and_a_decoupled_adam_scales_it():
    sgd = torch.optim.SGD(parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    assert scale_optimizers([sgd], [], LrScaling("linear", 8, 16)) is False
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.2) and sgd.param_groups[0]["weight_decay"] == 0.01
    adam = torch.optim.Adam(parameters(), lr=0.001, weight_decay=0.01)
    scale_optimizers([adam], [], LrScaling("sqrt", 8, 16))
    assert adam.param_groups[0]["lr"] == pytest.approx(0.001 * math.sqrt(2)) and adam.param_groups[0][
        "weight_decay"
    ] == pytest.approx(0.01)
    decoupled = torch.optim.Adam(parameters(), lr=0.001, weight_decay=0.01, decoupled_weight_decay=True)
    assert scale_optimizers([decoupled], [], LrScaling("sqrt", 8, 16)) is True
    assert decoupled.param_groups[0]["weight_decay"] == pytest.approx(0.01 * math.sqrt(2))


def test_one_cycle_bounds_and_a_step_schedule_scale_too():
    optimizer = torch.optim.SGD(parameters(), lr=0.1, momentum=0.9)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=10)
    before = dict(optimizer.param_groups[0])
    scale_optimizers([optimizer], [cycle], LrScaling("linear", 10, 5))
    for key in ("lr", "initial_lr", "max_lr", "min_lr"):
        assert optimizer.param_groups[0][key] == pytest.approx(before[key] * 0.5), key
    step = torch.optim.SGD(parameters(), lr=0.1)
    decay = torch.optim.lr_scheduler.StepLR(step, step_size=1, gamma=0.5)
    scale_optimizers([step], [decay], LrScaling("linear", 10, 20))
    step.step()
    decay.step()  # chainable: from the group's (scaled) rate
    assert step.param_groups[0]["lr"] == pytest.approx(0.1 * 2 * 0.5) and decay.base_lrs == [pytest.approx(0.2)]


def test_the_torch_optimizer_is_found_under_its_wrappers():
    optimizer = torch.optim.SGD(parameters(), lr=0.1)
    assert base_optimizer(Wrapper(Wrapper(optimizer))) is optimizer and base_optimizer(optimizer) is optimizer


def test_the_schedulers_a_sequential_or_chained_schedule_holds_and_a_cosine_floor_scale_too():
    """A warm-up then a decay (SequentialLR): each inner scheduler computes from its own base_lrs, so scaling the
    outer one alone was undone at the next step."""
    optimizer = torch.optim.AdamW(parameters(), lr=1.0)
    warm = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=0.1)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[2])
    scale_optimizers([optimizer], [schedule], LrScaling("linear", 8, 16))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0) and cosine.eta_min == pytest.approx(0.2)
    optimizer.step()
    schedule.step()  # still the warm-up: from its (scaled) base
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0)
    optimizer.step()
    schedule.step()  # the cosine's first step, from its scaled base down to its scaled floor
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0)
    for _ in range(10):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


def test_a_tensor_learning_rate_is_scaled_in_place():
    rate = torch.tensor(0.01)
    optimizer = torch.optim.Adam(parameters(), lr=rate)
    scale_optimizers([optimizer], [], LrScaling("linear", 4, 8))
    assert optimizer.param_groups[0]["lr"] is rate and float(rate) == pytest.approx(0.02)
