"""A small real task for the examples: classify points of three interleaved spirals (data generated, no download).

A plain LightningModule and LightningDataModule: nothing in them knows about HeteroStrategy.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_spirals(num_samples: int, num_classes: int = 3, noise: float = 0.25, seed: int = 0) -> TensorDataset:
    """Points on ``num_classes`` spiral arms (2-D) with Gaussian noise; label = arm."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_samples) % num_classes
    radius = torch.rand(num_samples, generator=generator)
    angle = 4.0 * radius + labels * (2 * math.pi / num_classes) + noise * torch.randn(num_samples, generator=generator)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(points, labels)


class SpiralDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 64, train_samples: int = 6000, val_samples: int = 1500) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set = make_spirals(self.hparams.train_samples, seed=0)
        self.val_set = make_spirals(self.hparams.val_samples, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class SpiralClassifier(LightningModule):
    """An MLP whose hidden residual block is applied ``depth`` times with shared weights.

    Sharing keeps the parameters (and so the gradient communication) small while the compute per sample grows
    with ``depth``: the kind of model where splitting the batch by device speed pays.
    """

    def __init__(self, hidden: int = 256, depth: int = 12, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Linear(2, hidden)
        self.block = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.embed(points))
        for _ in range(self.hparams.depth):
            hidden = hidden + torch.tanh(self.block(hidden))
        return self.head(hidden)

    def training_step(self, batch, batch_idx):
        points, labels = batch
        loss = nn.functional.cross_entropy(self(points), labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def _evaluate(self, batch, prefix: str) -> None:
        points, labels = batch
        logits = self(points)
        self.log(f"{prefix}_loss", nn.functional.cross_entropy(logits, labels), sync_dist=True)
        self.log(f"{prefix}_acc", (logits.argmax(dim=1) == labels).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class SpiralChain(SpiralClassifier):
    """The same task with ``depth`` residual blocks of their own, held in ``self.blocks`` (an ``nn.Sequential``):
    a chain that ``HeteroStrategy(pipeline={"stages": 2, "blocks": "blocks"})`` splits into stages."""

    def __init__(self, hidden: int = 256, depth: int = 12, lr: float = 3e-3) -> None:
        super().__init__(hidden, depth, lr)
        del self.block
        self.blocks = nn.Sequential(*[Residual(hidden) for _ in range(depth)])

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.embed(points))))


class Residual(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))
