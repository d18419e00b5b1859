"""Activation memory counted once per storage (measure/profiler.py, issue 31)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hetero.measure.profiler import DistinctSavedBytes, profile_training_step


class InPlace(nn.Module):
    """Linear 8 -> 32, an in-place ReLU (its output is the next Linear's saved input too), Linear 32 -> 4, MSE."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def test_a_tensor_saved_twice_is_counted_once():
    counter = DistinctSavedBytes()
    x = torch.randn(10, 32)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        y = torch.relu_(x.clone().requires_grad_() * 1.0)  # relu_ saves its output; the product saves it again
        (y * y).sum().backward()
    assert counter.bytes == 10 * 32 * 4


def test_the_profile_counts_each_activation_once():
    torch.manual_seed(0)
    model = InPlace()

    def batch(size: int):
        return torch.randn(size, 8), torch.randn(size, 4)

    profile = profile_training_step(model, batch, [4, 12], torch.device("cpu"), warmup=0, repeats=1)
    # Per sample: the input (8 floats), the ReLU's output that the second Linear also saves (32, once), the output
    # and the target the loss saves (4 + 4): 48 floats. Counting every saved tensor gave 80.
    assert profile.bytes_per_sample == 48 * 4
