"""The models of the public GPU training benchmarks, as LightningModules on synthetic data, for
`benchmarks/planner_validation.py` and `lightning-hetero plan`:

- ``ResNet50``: ResNet-50 v1.5 (the stride-2 convolution in the 3x3 of each bottleneck, as NVIDIA's and torchvision's),
  224x224 images, 1,000 classes: 25,557,032 parameters.
- ``BertBase``: BERT-base (12 layers, hidden 768, 12 heads, feed-forward 3,072, GELU, post-norm, vocabulary 30,522)
  with a SQuAD span head on ``seq_len`` tokens (384 in the fine-tuning benchmarks): 109,483,778 parameters (BERT-base's
  109,482,240 and the span head's 1,538); ``BertLarge`` (24 layers, hidden 1,024, 16 heads): 335,143,938.

Written here (no torchvision or transformers dependency); their parameter counts are tested against the published
ones. Data is random: the step's cost does not depend on the values.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        outputs = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)  # v1.5: the stride is here
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inputs != outputs:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class _RandomImages(Dataset):
    def __init__(self, samples: int, size: int, classes: int) -> None:
        self.samples, self.size, self.classes = samples, size, classes

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        return torch.randn(3, self.size, self.size, generator=generator), index % self.classes


class ResNet50(pl.LightningModule):
    def __init__(self, image_size: int = 224, classes: int = 1000, batch_size: int = 32) -> None:
        super().__init__()
        self.image_size, self.classes, self.batch_size = image_size, classes, batch_size
        layers, inputs = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for index in range(blocks):
                layers.append(_Bottleneck(inputs, width, stride if index == 0 else 1))
                inputs = width * _Bottleneck.expansion
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(inputs, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return nn.functional.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(_RandomImages(64, self.image_size, self.classes), batch_size=self.batch_size)


class _RandomTokens(Dataset):
    def __init__(self, samples: int, seq_len: int, vocabulary: int) -> None:
        self.samples, self.seq_len, self.vocabulary = samples, seq_len, vocabulary

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, self.vocabulary, (self.seq_len,), generator=generator)
        start = int(torch.randint(0, self.seq_len, (1,), generator=generator))
        return tokens, start, min(self.seq_len - 1, start + 8)


class _BertLayer(nn.Module):
    """One BERT encoder layer as NVIDIA's PyTorch BERT (DeepLearningExamples, modeling.py) writes it, which the
    published figures ran: attention written out (``softmax(q k^T / sqrt(d))``, dropout on the probabilities),
    post-norm, GELU."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attention_output, self.attention_norm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate, self.output = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        return x.view(batch, length, self.heads, hidden // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        context = torch.matmul(self.dropout(torch.softmax(scores, dim=-1)), v)
        context = context.permute(0, 2, 1, 3).reshape(x.shape)
        x = self.attention_norm(x + self.dropout(self.attention_output(context)))
        return self.output_norm(x + self.dropout(self.output(nn.functional.gelu(self.intermediate(x)))))


class BertBase(pl.LightningModule):
    def __init__(
        self,
        seq_len: int = 384,
        layers: int = 12,
        hidden: int = 768,
        heads: int = 12,
        vocabulary: int = 30522,
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.seq_len, self.vocabulary, self.batch_size = seq_len, vocabulary, batch_size
        self.tokens = nn.Embedding(vocabulary, hidden)
        self.positions = nn.Embedding(512, hidden)
        self.segments = nn.Embedding(2, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.encoder = nn.Sequential(*(_BertLayer(hidden, heads) for _ in range(layers)))
        self.pooler = nn.Linear(hidden, hidden)  # BERT's pooler: part of the published parameter count
        self.span = nn.Linear(hidden, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions) + self.segments(torch.zeros_like(tokens))
        return self.span(self.encoder(self.dropout(self.embedding_norm(x))))

    def training_step(self, batch, batch_idx):
        tokens, starts, ends = batch
        logits = self(tokens)
        start_logits, end_logits = logits[..., 0], logits[..., 1]
        loss = nn.functional.cross_entropy(start_logits, starts) + nn.functional.cross_entropy(end_logits, ends)
        return loss / 2

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-5)

    def train_dataloader(self):
        return DataLoader(_RandomTokens(64, self.seq_len, self.vocabulary), batch_size=self.batch_size)


class BertLarge(BertBase):
    def __init__(self, seq_len: int = 384, batch_size: int = 4) -> None:
        super().__init__(seq_len=seq_len, layers=24, hidden=1024, heads=16, batch_size=batch_size)
