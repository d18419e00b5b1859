"""The whole model's gradient norm from parts, and clipping by it (:mod:`lightning_hetero.train.gradient_norm`),
against torch's ``clip_grad_norm_`` on the whole model."""

from __future__ import annotations

import torch

from lightning_hetero.train.gradient_norm import clip_to_norm, squared_norm


def model_with_gradients() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 1))
    model(torch.randn(4, 5)).sum().backward()
    model[2].bias.grad = None  # (a parameter without a gradient counts nothing)
    return model


def test_parts_squared_norms_add_up_to_the_whole_models_and_clipping_each_part_clips_as_torch_does():
    model, reference = model_with_gradients(), model_with_gradients()
    parts = [list(model[0].parameters()), list(model[1].parameters()) + list(model[2].parameters())]
    norm = float(sum(squared_norm(part, torch.device("cpu")) for part in parts).sqrt())
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    assert abs(norm - float(expected)) <= 1e-6 * float(expected)
    for part in parts:
        clip_to_norm(part, 0.1, norm)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert (ours.grad is None) == (theirs.grad is None)
        if ours.grad is not None:
            assert torch.allclose(ours.grad, theirs.grad, rtol=1e-6, atol=0)


def test_a_norm_under_the_bound_leaves_the_gradients_alone():
    model = model_with_gradients()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = float(squared_norm(model.parameters(), torch.device("cpu")).sqrt())
    clip_to_norm(model.parameters(), norm * 2, norm)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in model.parameters() if p.grad is not None]))
