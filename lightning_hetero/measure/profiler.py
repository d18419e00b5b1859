"""Measure: a short benchmark of the user's own training step on this rank, giving a cost model and a memory ceiling.

Forward + backward of ``training_step`` on real samples at a few micro-batch sizes, after warm-up, on a plain local
module (before DeepSpeed wraps it), so it measures local compute and never waits in a collective. Everything it
touches is put back: parameters and buffers (BatchNorm statistics), gradients, and the random number generators
(dropout, augmentations), so a profiled run trains exactly like an unprofiled one with the same split. It reads
samples from the dataset directly, never through the sampler, so the data order is untouched.

The profile's type and the pure fitting and sizing decisions are in :mod:`.rank_profile`; this module is the
measuring part (:func:`profile_training_step`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import psutil
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_hetero.emulate.slowdown import SlowdownEmulator, compute_clock
from lightning_hetero.measure.rank_profile import RankProfile, doubled_loss_ratio, fit_linear_cost, memory_ceiling
from lightning_hetero.runtime.randomness import preserved_random_state


class _NoOptimizer:
    """Stands in for ``self.optimizers()`` while profiling a manual-optimization step: nothing may be updated."""

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        pass

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> None:
        if closure is not None:
            closure()


class _NoScheduler:
    """Stands in for ``self.lr_schedulers()`` while profiling: a manual step may call ``sch.step()``."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextlib.contextmanager
def training_step_in_isolation(module: nn.Module) -> Iterator[None]:
    """Run ``training_step`` outside Lightning's loop: logging and optimizer calls become no-ops, backward is plain."""

    def no_op(*args: Any, **kwargs: Any) -> None:
        return None

    def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if torch.is_grad_enabled():  # (not while only the loss is measured, under no_grad: see _doubled_loss_ratio)
            loss.backward(*args, **kwargs)

    stubs = {
        "log": no_op,
        "log_dict": no_op,
        "optimizers": lambda *args, **kwargs: _NoOptimizer(),
        "lr_schedulers": lambda *args, **kwargs: _NoScheduler(),
        "manual_backward": backward,
        "toggle_optimizer": no_op,
        "untoggle_optimizer": no_op,
    }
    shadowed = {name: module.__dict__[name] for name in stubs if name in module.__dict__}
    module.__dict__.update(stubs)  # instance attributes shadow the methods
    try:
        yield
    finally:
        for name in stubs:
            module.__dict__.pop(name, None)
        module.__dict__.update(shadowed)


@contextlib.contextmanager
def preserved_training_state(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Put parameters, buffers, gradients and every RNG back as they were."""
    # Parameters and all buffers, non-persistent ones too (which state_dict leaves out).
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    saved_tensors = {name: tensor.detach().clone() for name, tensor in tensors}
    saved_grads = {
        name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in module.named_parameters()
    }
    # Every submodule's own mode: Lightning trains frozen submodules (e.g. a BatchNorm in eval) as the user left them.
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    # A torchmetrics Metric updated in training_step keeps its state in plain attributes (not buffers): the probe's
    # batches must not count in the epoch's metric.
    metrics = [(submodule, _metric_state(submodule)) for submodule in module.modules() if _is_metric(submodule)]
    try:
        with preserved_random_state(device):
            yield
    finally:
        for metric, state in metrics:
            for name, value in state.items():
                setattr(metric, name, value)
        with torch.no_grad():
            for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
                tensor.copy_(saved_tensors[name])
        for name, p in module.named_parameters():
            p.grad = saved_grads[name]
        for submodule, training in modes:
            submodule.training = training


# What a torchmetrics Metric accumulates besides its declared states (update counts, the cached result).
_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache")


def _is_metric(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_defaults", None), dict) and hasattr(module, "_update_count")


def _metric_state(metric: nn.Module) -> dict[str, Any]:
    declared: dict[str, Any] = getattr(metric, "_defaults")  # noqa: B009 - (nn.Module's __getattr__ types it as a Tensor)
    names = [*declared, *(name for name in _METRIC_BOOKKEEPING if hasattr(metric, name))]
    return {name: copy.deepcopy(getattr(metric, name)) for name in names}


class DistinctSavedBytes:
    """What autograd keeps for the backward, each storage once: an in-place ReLU's output, which the next layer also
    saves, and views and aliases of one tensor are one allocation (counting every saved tensor counted ResNet-50's
    124.3 MiB per sample against 81.9 MiB distinct). Used as ``saved_tensors_hooks(counter.pack, counter.unpack)``."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # (a tensor without a plain storage: counted as itself)
            key, size = id(tensor), tensor.numel() * tensor.element_size()
        if key not in self._seen:
            self._seen.add(key)
            self.bytes += size
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def loss_of(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def profile_training_step(
    module: LightningModule,
    make_batch: Callable[[int], Any],
    batch_sizes: Sequence[int],
    device: torch.device,
    warmup: int = 1,
    repeats: int = 3,
    emulator: Optional[SlowdownEmulator] = None,
    free_bytes: Optional[float] = None,
    time_batch_assembly: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    make_doubled_batch: Optional[Callable[[int], Any]] = None,
) -> RankProfile:
    """Time forward + backward of ``module.training_step`` at each size (fastest of ``repeats`` after ``warmup``).

    Time is this rank's compute clock (:func:`~.emulate.slowdown.compute_clock`: the thread's CPU time on
    CPU, synchronised wall time on CUDA) plus any emulated slowdown, so ranks that share CPU cores during the
    probe do not mistake waiting for a core for a slow device.

    ``make_batch(n)`` returns a batch of ``n`` samples already on ``device``. With ``time_batch_assembly`` it is
    called, and timed, in every attempt: when the loader has no workers, reading and collating samples happens on
    the training thread and grows with the micro-batch like compute does. Activation memory per sample is the
    growth of what autograd saves for backward between sizes; with ``free_bytes`` it gives the memory ceiling. A
    CUDA out-of-memory at a size caps the ceiling below it and stops the probing there.

    ``autocast`` is the rank's precision context (see :mod:`lightning_hetero.precision.choice`): the step is timed, and
    its saved activations counted, in the precision the rank will train in.
    """
    started = time.perf_counter()
    slowed = emulator.slowed if emulator is not None else contextlib.nullcontext
    clock = compute_clock(device)
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    timed_sizes = sorted(set(batch_sizes))
    timings: dict[int, list[float]] = {size: [] for size in timed_sizes}
    saved_bytes: dict[int, float] = {}
    batches: dict[int, Any] = {}
    oom_at: Optional[int] = None
    # Manual optimization: training_step does its own (stubbed) manual_backward; a second backward would fail.
    automatic = getattr(module, "automatic_optimization", True)

    def time_one_step(size: int) -> float:
        saved = DistinctSavedBytes()

        synchronize()
        begin, compute_begin = time.perf_counter(), clock()
        slept_before = emulator.added_seconds if emulator is not None else 0.0
        if time_batch_assembly or size not in batches:
            batches[size] = make_batch(size)  # not slowed: loading runs on the host, whatever the device
        with slowed(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            with autocast():
                loss = loss_of(module.training_step(batches[size], 0))
            if automatic and loss is not None and loss.requires_grad:
                loss.backward()
        synchronize()
        wall, compute = time.perf_counter() - begin, clock() - compute_begin
        slept = (emulator.added_seconds if emulator is not None else 0.0) - slept_before
        module.zero_grad(set_to_none=True)
        saved_bytes[size] = float(saved.bytes)
        # This rank's own compute (never longer than the wall time) plus the emulated slowdown: time spent waiting
        # for a CPU core that other processes hold is not this device's speed.
        return min(compute, wall - slept) + slept

    with preserved_training_state(module, device), training_step_in_isolation(module):
        module.train()
        # Rounds over all sizes, so that a burst of interference from elsewhere hits every size alike; the
        # fastest repeat is kept, since interference only ever adds time.
        for attempt in range(warmup + repeats):
            for size in list(timed_sizes):
                try:
                    seconds = time_one_step(size)
                except torch.cuda.OutOfMemoryError:
                    oom_at = size
                    timed_sizes = [s for s in timed_sizes if s < size]
                    module.zero_grad(set_to_none=True)
                    batches.clear()
                    torch.cuda.empty_cache()
                    break
                if attempt >= warmup:
                    timings[size].append(seconds)
        loss_ratio = None
        if make_doubled_batch is not None and timed_sizes:
            size = timed_sizes[len(timed_sizes) // 2]  # a middle size: dropout's noise averages out over its samples
            loss_ratio = _doubled_loss_ratio(module, make_batch(size), make_doubled_batch(size), autocast)
    fastest = [min(timings[size]) for size in timed_sizes]
    if len(timed_sizes) < 2:
        raise RuntimeError(
            f"HeteroStrategy's profiler could time only micro-batch sizes {timed_sizes} on {device}"
            f"{f' (out of memory at {oom_at})' if oom_at else ''}. Give `batch_sizes=[...]` or `weights=[...]`"
            " instead of the automatic split, or a smaller global batch."
        )
    fixed, per_sample = fit_linear_cost(timed_sizes, fastest)
    smallest, largest = timed_sizes[0], timed_sizes[-1]
    bytes_per_sample = (saved_bytes[largest] - saved_bytes[smallest]) / (largest - smallest) or None
    ceiling = memory_ceiling(bytes_per_sample, free_bytes)
    if oom_at is not None:
        ceiling = min(ceiling, oom_at - 1) if ceiling is not None else oom_at - 1
    return RankProfile(
        batch_sizes=tuple(timed_sizes),
        seconds=tuple(fastest),
        fixed_seconds=fixed,
        seconds_per_sample=per_sample,
        max_batch=ceiling,
        bytes_per_sample=bytes_per_sample,
        wall_seconds=time.perf_counter() - started,
        free_bytes=free_bytes,
        loss_ratio=loss_ratio,
    )


def _doubled_loss_ratio(
    module: LightningModule, batch: Any, doubled: Any, autocast: Callable[[], contextlib.AbstractContextManager]
) -> Optional[float]:
    """The training step's loss on ``doubled`` (``batch``'s samples twice) over its loss on ``batch``, no backward.

    In eval mode (the caller puts the modes back), so that dropout draws no masks and BatchNorm uses its running
    statistics: each sample's loss is then the same in both batches, and the ratio is exactly 1 (mean) or 2 (sum).
    Both steps start from the same random state, so a step that draws its own randomness (a masking, a noise) draws
    alike in both.
    """
    module.eval()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    with torch.no_grad(), autocast():
        with preserved_random_state(device):
            single = loss_of(module.training_step(batch, 0))
        with preserved_random_state(device):
            twice = loss_of(module.training_step(doubled, 0))
    if single is None or twice is None or single.numel() != 1 or twice.numel() != 1:
        return None
    return doubled_loss_ratio(float(single), float(twice))


def _batch_maker(dataset: Any, collate: Callable[[list[Any]], Any], device: torch.device) -> Callable[..., Any]:
    """``make_batch(size, times=1)``: the dataset's first ``size`` samples (repeated where it has fewer), given
    ``times`` over, collated as the loader collates them, on ``device``."""

    def make_batch(size: int, times: int = 1) -> Any:
        return move_data_to_device(collate([dataset[i % len(dataset)] for i in range(size)] * times), device)

    return make_batch


def loss_ratio_from_loader(
    module: LightningModule,
    loader: Any,
    size: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Optional[float]:
    """The training step's loss on a micro-batch of ``size`` samples of the training ``loader`` given twice, over its
    loss on the micro-batch: 1 for a mean over the batch, 2 for a sum (:func:`_doubled_loss_ratio`: eval mode, no
    gradient; parameters, buffers, modes and every RNG put back, so training goes on as if it never ran). None where
    a batch cannot be doubled: a stream (its samples would be drawn ahead of training), not a DataLoader, an empty
    dataset, or a step that returns no scalar loss."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) or size < 1:
        return None
    try:
        if len(loader.dataset) == 0:  # type: ignore[arg-type]
            return None
    except TypeError:  # (a map-style dataset without a length)
        return None
    make_batch = _batch_maker(loader.dataset, loader.collate_fn, device)
    with preserved_training_state(module, device), training_step_in_isolation(module):
        return _doubled_loss_ratio(module, make_batch(size), make_batch(size, times=2), autocast)


def profile_from_loader(
    module: LightningModule,
    loader: Any,
    batch_sizes: Sequence[int],
    device: torch.device,
    emulator: Optional[SlowdownEmulator] = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> RankProfile:
    """:func:`profile_training_step` on samples of the training ``loader`` (read from its dataset directly, or the first
    ones of a stream), with the device's free memory for the ceiling."""
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"The automatic split profiles the model on samples of the training DataLoader, got"
            f" {type(loader).__name__}. Pass `batch_sizes=[...]` or `weights=[...]`."
        )
    dataset: Any = loader.dataset  # (a stream's first samples replace it below: a list)
    collate = loader.collate_fn
    if isinstance(dataset, IterableDataset):
        # A stream has no indices: the first samples of a fresh iterator of it (each rank's own stream), repeated as
        # needed; the training's iterators are made later and are not touched.
        dataset = list(itertools.islice(iter(dataset), max(batch_sizes)))
        if not dataset:
            raise ValueError(
                "The training loader's IterableDataset yielded no sample to profile the training step with. Give it"
                " samples, or pass `batch_sizes=[...]` or `weights=[...]`."
            )

    make_batch = _batch_maker(dataset, collate, device)
    if device.type == "cuda":
        free_bytes = float(torch.cuda.mem_get_info(device)[0])
    else:
        free_bytes = float(psutil.virtual_memory().available)
    return profile_training_step(
        module,
        make_batch,
        batch_sizes,
        device,
        emulator=emulator,
        free_bytes=free_bytes,
        time_batch_assembly=loader.num_workers == 0,
        autocast=autocast,
        make_doubled_batch=lambda size: make_batch(size, times=2),
    )
