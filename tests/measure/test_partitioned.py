"""A ZeRO-3 model's profile: an earlier engine's hooks go, the user's stay (the gathered profile itself runs in the
2-rank tests of tests/compat/test_deepspeed_strategy_users.py)."""

from __future__ import annotations

import torch

from lightning_hetero.measure.partitioned import drop_deepspeed_hooks, partitioned_parameters


def test_only_deepspeeds_forward_hooks_are_dropped_with_their_flags():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    calls = []

    def users_hook(module, args):
        calls.append("user")

    def deepspeeds_hook(module, *args, **kwargs):  # (as DeepSpeed's ZeRO-3 coordinator registers them)
        calls.append("deepspeed")

    deepspeeds_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    model.register_forward_pre_hook(users_hook)
    model[0].register_forward_pre_hook(deepspeeds_hook, with_kwargs=True)
    model[1].register_forward_hook(deepspeeds_hook, always_call=True)
    assert drop_deepspeed_hooks(model) == 2
    model(torch.ones(1, 2))
    assert calls == ["user"]
    assert not model[0]._forward_pre_hooks_with_kwargs and not model[1]._forward_hooks_always_called
    assert drop_deepspeed_hooks(model) == 0


def test_only_zero_3_partitioned_parameters_are_gathered():
    model = torch.nn.Linear(2, 1)
    assert partitioned_parameters(model) == []
    model.weight.ds_id = 0  # what deepspeed.zero.Init marks a partitioned parameter with
    assert partitioned_parameters(model) == [model.weight]
