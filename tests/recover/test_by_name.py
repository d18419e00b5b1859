"""A checkpoint keyed by parameter name (a pipeline's) read whole, and given to an optimizer by index."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hetero.recover.by_name import indexed_optimizer_state, named_optimizer_state
from lightning_hetero.recover.refusal import ResumeRefused


def two_group_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    groups = [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.01}]
    optimizer = torch.optim.Adam(groups)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_named_state_given_back_by_index_restores_the_optimizer_and_its_groups():
    model, optimizer = two_group_model()
    named = named_optimizer_state(model, optimizer)
    # As the whole model's reader merges it, and for an optimizer over the same parameters in another order of names.
    parameters = [(n, p) for n, p in model.named_parameters()]
    indexed = indexed_optimizer_state(named, parameters)
    fresh_model, fresh = two_group_model()
    fresh.load_state_dict(indexed)
    for before, after in zip(optimizer.param_groups, fresh.param_groups):
        assert before["lr"] == after["lr"] and len(before["params"]) == len(after["params"])
    for (name, parameter), (_, fresh_parameter) in zip(model.named_parameters(), fresh_model.named_parameters()):
        for key, value in optimizer.state[parameter].items():
            assert torch.equal(fresh.state[fresh_parameter][key], value), (name, key)
    # Each parameter's tensors are its own, even where the file's entries shared one.
    shared = torch.tensor(1.0)
    for value in named["state"].values():
        value["step"] = shared
    steps = [value["step"] for value in indexed_optimizer_state(named, parameters)["state"].values()]
    assert len({id(step) for step in steps}) == len(steps)


def test_a_parameter_the_checkpoint_does_not_hold_is_refused_with_its_name():
    model, optimizer = two_group_model()
    named = named_optimizer_state(model, optimizer)
    parameters = [*model.named_parameters(), ("head.weight", nn.Parameter(torch.zeros(1)))]
    with pytest.raises(ResumeRefused, match=r"holds no \['head.weight'\]"):
        indexed_optimizer_state(named, parameters)
