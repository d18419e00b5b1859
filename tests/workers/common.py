"""Model and data shared by the multi-process worker scripts and the single-process references in the tests."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import Dataset

IN_FEATURES = 4


class IndexedRegression(Dataset):
    """Deterministic regression data; each item carries its index so tests can see which samples were used."""

    def __init__(self, num_samples: int = 64, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, IN_FEATURES, generator=generator)
        noise = 0.1 * torch.randn(num_samples, generator=generator)
        self.y = (self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + noise)[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


def make_network(
    seed: int = 0, hidden: int = 8, dropout: float = 0.0, depth: int = 1, batchnorm: bool = False
) -> nn.Module:
    """``depth`` hidden layers of width ``hidden``; dropout after the first (to test RNG preservation); with
    ``batchnorm`` a BatchNorm1d on the inputs first (its running statistics are buffers)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.BatchNorm1d(IN_FEATURES)] if batchnorm else []
    layers += [nn.Linear(IN_FEATURES, hidden), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(hidden, 1))


# The optimizers the tests train with (the model's and the single-process reference's), each with the state it keeps
# per parameter: SGD's momentum_buffer; Adam's exp_avg, exp_avg_sq and step (AdamW with amsgrad adds max_exp_avg_sq);
# RMSprop's square_avg, momentum_buffer and grad_avg (centered) and step; Adagrad's sum and step. NAdam also keeps
# mu_product, a number that is not the step.
OPTIMIZERS = {
    "sgd": lambda params, lr, momentum: torch.optim.SGD(params, lr=lr, momentum=momentum),
    "adam": lambda params, lr, momentum: torch.optim.Adam(params, lr=lr / 5),
    "adamw": lambda params, lr, momentum: torch.optim.AdamW(params, lr=lr / 5, weight_decay=0.01, amsgrad=True),
    "rmsprop": lambda params, lr, momentum: torch.optim.RMSprop(params, lr=lr / 10, momentum=0.5, centered=True),
    "adagrad": lambda params, lr, momentum: torch.optim.Adagrad(params, lr=lr),
    "nadam": lambda params, lr, momentum: torch.optim.NAdam(params, lr=lr / 5),
}


def make_optimizer(name: str, parameters, lr: float, momentum: float) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](parameters, lr, momentum)


def batch_loss(network: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.mse_loss(network(x), y, reduction=reduction)


class RegressionModule(LightningModule):
    """A plain LightningModule: nothing in it knows about HeteroStrategy."""

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        manual: bool = False,
        hidden: int = 8,
        dropout: float = 0.0,
        depth: int = 1,
        manual_accumulation: int = 1,
        reduction: str = "mean",
        optimizer: str = "sgd",
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.network = make_network(hidden=hidden, dropout=dropout, depth=depth, batchnorm=batchnorm)
        # With batchnorm, a buffer the model keeps itself too (samples its forward passes saw), and what each step's
        # forward started from.
        if batchnorm:
            self.register_buffer("samples_seen", torch.zeros((), dtype=torch.int64))
        self.buffer_trace: list[dict] = []
        self.gathered_shapes: dict[str, list] = {}
        self.lr, self.momentum = lr, momentum
        self.automatic_optimization = not manual
        # Manual optimization with the accumulation Lightning documents: backward on loss / k, step every k batches.
        self.manual_accumulation = manual_accumulation
        self.reduction = reduction
        self.seen: list[int] = []
        self.emulated_delay: list = []
        self.eval_seen: list[int] = []
        self.test_seen: list[int] = []

    def on_train_batch_start(self, batch, batch_idx):
        # Recorded in a hook, not in training_step: the automatic split's profiler runs training_step itself.
        self.seen.extend(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        if hasattr(self, "samples_seen"):
            # (not while profiling or checking the loss: both run the step outside the loop, the check without grad)
            if self.trainer.training and getattr(self, "_trace_buffers", False) and torch.is_grad_enabled():
                running = self.network[0].running_mean
                self.buffer_trace.append({"samples_seen": int(self.samples_seen), "running_mean": running.tolist()})
            self.samples_seen += len(x)
        loss = batch_loss(self.network, x, y, self.reduction)
        self.log("train_loss", loss, sync_dist=True)
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            k = self.manual_accumulation
            self.manual_backward(loss / k)
            if (batch_idx + 1) % k == 0 or self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
                optimizer.step()
                optimizer.zero_grad()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y, index = batch
        self.eval_seen.extend(index.tolist())
        self._gather_predictions("validation", x)
        self.log("val_loss", batch_loss(self.network, x, y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y, index = batch
        self.test_seen.extend(index.tolist())
        self._gather_predictions("test", x)
        self.log("test_loss", batch_loss(self.network, x, y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, y, index = batch
        self._gather_predictions("predict", x)
        return self.network(x)

    def _gather_predictions(self, stage, x):
        """With ``gather_in_eval``: every rank's predictions, as a user computing a metric over all of them would."""
        if getattr(self, "gather_in_eval", False):
            self.gathered_shapes.setdefault(stage, []).append(list(self.all_gather(self.network(x)).shape))

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters(), self.lr, self.momentum)


class ConfiguredRegressionModule(RegressionModule):
    """The same model, its network built in ``configure_model`` (Lightning's hook for sharded models: under ZeRO-3 the
    layers are created partitioned), as the models of Lightning's own DeepSpeed tests are."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        names = ("hidden", "dropout", "depth", "batchnorm")
        self._network_arguments = {key: kwargs[key] for key in names if key in kwargs}
        self.network = None

    def configure_model(self) -> None:
        if self.network is None:
            self.network = make_network(**self._network_arguments)


def cpu_deepspeed_strategy(**kwargs):
    """Lightning's own DeepSpeedStrategy with the three things that keep it off CPUs removed (see
    shared/design/facts.md): its CUDA-only check, and CPU devices without the index DeepSpeed takes as its device rank.
    The reference a user switches from, and the writer of the checkpoint directories such a user brings."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    from lightning_hetero.runtime import startup
    from lightning_hetero.runtime.shutdown import register_exit_cleanup

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            DDPStrategy.setup_environment(self)  # (DeepSpeedStrategy's own adds only the CUDA check)
            register_exit_cleanup()  # the gloo exit race (runtime/shutdown.py) hits it too

        def _init_deepspeed_distributed(self) -> None:
            with startup.without_shared_memory_comm_op():  # (not 30 s of compiling an op training never uses)
                super()._init_deepspeed_distributed()

    return CPUDeepSpeedStrategy(**kwargs)


def reference_training(
    dataset: IndexedRegression,
    steps: list[list[int]],
    lr: float = 0.05,
    momentum: float = 0.9,
    accumulate: int = 1,
    batches_per_epoch: int = 0,
    sum_over_ranks: int = 0,
    optimizer_name: str = "sgd",
    hidden: int = 8,
    depth: int = 1,
    clip: float = 0.0,
):
    """One process, whole global batches: what every HeteroStrategy run must reproduce.

    ``steps`` are global batches; with ``accumulate=k`` an optimizer step follows every k of them and the last of
    each epoch (``batches_per_epoch``, default: all steps are one epoch), each batch's loss divided by k: DDP's
    gradient accumulation in Lightning. ``sum_over_ranks=W`` trains a summed loss as DDP on W ranks does: the
    gradient of the global batch's sum divided by W. ``clip``: each step's gradients clipped to that norm, as
    ``Trainer(gradient_clip_val=clip)`` on one process.
    """
    network = make_network(hidden=hidden, depth=depth)
    optimizer = make_optimizer(optimizer_name, network.parameters(), lr, momentum)
    epoch_length = batches_per_epoch or len(steps)
    windows = [
        steps[begin : min(begin + accumulate, epoch_begin + epoch_length)]
        for epoch_begin in range(0, len(steps), epoch_length)
        for begin in range(epoch_begin, min(epoch_begin + epoch_length, len(steps)), accumulate)
    ]
    for window in windows:
        optimizer.zero_grad()
        for indices in window:
            x, y = dataset.x[indices], dataset.y[indices]
            if sum_over_ranks:
                loss = batch_loss(network, x, y, "sum") / sum_over_ranks
            else:
                loss = batch_loss(network, x, y)
            (loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(network.parameters(), clip)
        optimizer.step()
    return {name: p.detach().clone() for name, p in network.named_parameters()}


def batchnorm_reference_training(
    dataset: IndexedRegression, steps: list[list[int]], batch_sizes: list[int], micro_steps: list[int]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process with BatchNorm over the global batch: what `Trainer(sync_batchnorm=True)` must reproduce.

    Rank r takes ``batch_sizes[r] * micro_steps[r]`` samples of each global batch (contiguous, after the ranks before
    it) in micro-batches of ``batch_sizes[r]``; the ranks' i-th micro-batches normalize together (every rank makes as
    many passes). Each pass's loss is its squared errors over the global batch's count, so the step's gradient is that
    of the global batch's mean loss. Returns the parameters and the running statistics.
    """
    network = make_network(batchnorm=True)
    optimizer = torch.optim.SGD(network.parameters(), lr=0.05, momentum=0.9)
    for indices in steps:
        optimizer.zero_grad()
        shares, begin = [], 0
        for size, count in zip(batch_sizes, micro_steps):
            shares.append(indices[begin : begin + size * count])
            begin += size * count
        for i in range(micro_steps[0]):
            together = [j for share, size in zip(shares, batch_sizes) for j in share[i * size : (i + 1) * size]]
            x, y = dataset.x[together], dataset.y[together]
            (batch_loss(network, x, y, "sum") / len(indices)).backward()
        optimizer.step()
    parameters = {name: p.detach().clone() for name, p in network.named_parameters()}
    statistics = {
        name: b.clone() for name, b in network.named_buffers() if name.endswith(("running_mean", "running_var"))
    }
    return parameters, statistics


def max_param_difference(result: dict, reference: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between a worker's final parameters (result.json) and a reference's."""
    return max(
        (torch.tensor(result["params"][f"network.{name}"], dtype=torch.float64) - value.double()).abs().max().item()
        for name, value in reference.items()
    )


def mixed_precision_reference(
    dataset: IndexedRegression,
    steps: list[list[list[int]]],
    precisions: list[str],
    accumulate: int = 1,
) -> list[torch.Tensor]:
    """One process computing what ranks in different precisions compute, without a process group.

    ``steps[n][r]`` are rank r's sample indices in global batch n; rank r's mean loss runs under its own autocast
    (``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``) and is weighted by its share of the global batch, as
    HeteroStrategy weights it; an optimizer step follows every ``accumulate`` batches. With an fp16 part, the job's
    loss scale (2**16 at first) multiplies that part's loss and divides its gradients; a non-finite one skips the
    optimizer step and halves the scale, as the strategy's agreed loss scale does. Returns the flat parameters after
    every batch.
    """
    dtypes = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": None}
    network = make_network()
    parameters = list(network.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9)
    scale, overflow = 2.0**16, False
    flat_after_batch = []
    for n, parts in enumerate(steps):
        if n % accumulate == 0:
            optimizer.zero_grad()
            overflow = False
        total = sum(len(part) for part in parts)
        for part, precision in zip(parts, precisions):
            dtype = dtypes[precision]
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = batch_loss(network, dataset.x[part], dataset.y[part])
            # The strategy's loss weight b_r * W / B, applied to Lightning's loss / k; DeepSpeed then averages the W
            # ranks' gradients (here: divides by W after this rank's backward, as the reduction does).
            weighted = loss / accumulate * (len(part) * len(parts) / total)
            if precision != "16-mixed":
                (weighted / len(parts)).backward()
                continue
            gradients = torch.autograd.grad(weighted * scale, parameters)
            for parameter, gradient in zip(parameters, gradients):
                unscaled = gradient * (1.0 / scale) / len(parts)
                overflow = overflow or not bool(torch.isfinite(unscaled).all())
                parameter.grad = unscaled if parameter.grad is None else parameter.grad + unscaled
        if (n + 1) % accumulate == 0:
            if overflow:
                scale /= 2
            else:
                optimizer.step()
        flat_after_batch.append(torch.cat([p.detach().reshape(-1) for p in parameters]).double())
    return flat_after_batch


def full_data_loss(dataset: IndexedRegression, flat_parameters: torch.Tensor, **architecture: Any) -> float:
    """The mean loss over the whole dataset of the network with these (flat) parameters (``architecture``: the
    arguments of :func:`make_network` it was built with)."""
    network = make_network(**architecture)
    torch.nn.utils.vector_to_parameters(flat_parameters.float(), network.parameters())
    with torch.no_grad():
        return batch_loss(network, dataset.x, dataset.y).item()


IGNORE = -100
VOCABULARY, SEQUENCE = 11, 6


class PaddedTokens(Dataset):
    """Token sequences of different lengths, padded to SEQUENCE: targets past each length are IGNORE (as a collator
    pads them), so samples carry from 1 to SEQUENCE tokens that count in the loss. Items carry their index."""

    def __init__(self, num_samples: int = 48, seed: int = 3) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randint(0, VOCABULARY, (num_samples, SEQUENCE), generator=generator)
        self.targets = torch.randint(0, VOCABULARY, (num_samples, SEQUENCE), generator=generator)
        lengths = torch.randint(1, SEQUENCE + 1, (num_samples,), generator=generator)
        self.targets[torch.arange(SEQUENCE)[None, :] >= lengths[:, None]] = IGNORE

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        return self.inputs[index], self.targets[index], index


def make_token_network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCABULARY, 8), nn.Tanh(), nn.Linear(8, VOCABULARY))


def token_loss(network: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over the tokens that are not padding (cross_entropy with ignore_index)."""
    logits = network(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), targets.reshape(-1), ignore_index=IGNORE)


class TokenModule(LightningModule):
    """A token-level mean loss over padded sequences; returns its token count for loss_reduction="token_mean"."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__()
        self.network = make_token_network()
        self.lr = lr
        self.seen: list[int] = []
        self.emulated_delay: list = []
        self.eval_seen: list[int] = []
        self.buffer_trace: list = []
        self.gathered_shapes: dict = {}

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.extend(batch[2].tolist())

    def training_step(self, batch, batch_idx):
        inputs, targets, index = batch
        return {"loss": token_loss(self.network, inputs, targets), "num_tokens": (targets != IGNORE).sum()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_reference_training(
    dataset: PaddedTokens, steps: list[list[int]], lr: float = 0.5, weights_by_samples: Optional[list[int]] = None
):
    """One process on whole global batches: SGD on the mean over all tokens of each global batch. With
    ``weights_by_samples`` (the micro-batches), each rank's token mean weighted by its samples instead."""
    network = make_token_network()
    optimizer = torch.optim.SGD(network.parameters(), lr=lr)
    for indices in steps:
        optimizer.zero_grad()
        if weights_by_samples is None:
            token_loss(network, dataset.inputs[indices], dataset.targets[indices]).backward()
        else:
            begin = 0
            for size in weights_by_samples:
                part = indices[begin : begin + size]
                begin += size
                (token_loss(network, dataset.inputs[part], dataset.targets[part]) * size / len(indices)).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in network.named_parameters()}
