"""Compression that keeps its loss: ``compression_options={"max_error": ...}`` for ``"powersgd"`` and ``"topk"``.

At the first compressed step, every ``error_check_every`` steps and at the step after each raise, each rank
all-reduces, uncompressed, a sample of each bucket's entries of what it gives the hook (its gradient plus the error
feedback the hook carries: so a raise's release of that feedback is not read as the new setting's error), and compares
the compressed average there: the relative error ``||compressed - exact|| / ||exact||``, each bucket scaled by its size
over its sample. Above ``max_error``, PowerSGD's rank (top-k's ratio) doubles from the next step, never past what
``max_bytes_fraction`` of the uncompressed bytes allows (the checks' own entries counted). A raise drops PowerSGD's
warm-started P and Q (shaped by the rank; new ones come from its seeded generator, the same on every rank) and keeps
the error feedback.

On PowerSGD's last uncompressed step, whose result is the exact average, the bound estimates PowerSGD's first step at
the rank and each doubling up to the budget, locally, and starts at the first within ``max_error``: steps at too low
a rank until checks raise it are what cost loss. Each check and calibration ends with one all-reduce of its sums, so
every rank decides on the same numbers (devices of different kinds round differently) at the same step.

Why measured: rank 1 ended 18-19 % above the uncompressed loss after 60 steps here (2.9x on the wide spiral
classifier), rank 4-8 within 2 %; which rank a model needs depends on its gradients. Why 0.02: at 0.1 the examples'
default spiral classifier settled at rank 4 (error 0.04) and ended 28 % above; at 0.02, 2.6-4.5 % (benchmarks/
communication.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

ERROR_BOUND_DEFAULTS: dict[str, Any] = {"max_error": 0.02, "error_check_every": 5, "max_bytes_fraction": 0.1}
ERROR_BOUND_KEYS = frozenset(ERROR_BOUND_DEFAULTS)
ERROR_SAMPLE_ENTRIES = 2048  # entries of each bucket compared at a check (their exact all-reduce is the check's cost)
SETTING = {"powersgd": "matrix_approximation_rank", "topk": "ratio"}
TOPK_WIRE_FACTOR = 2  # top-k sends a value and an index (4 bytes each) per entry kept, against 4 bytes uncompressed
POWERSGD_MIN_COMPRESSION_RATE = 2.0  # PowerSGDState's default


# ---------------------------------------------------------------------------------------------- decisions (pure)


def check_error_bound_options(mode: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """The error bound's settings from ``compression_options`` (defaults filled in); ``{}`` when ``max_error`` is None
    (a fixed setting, as before). Raised in the constructor with the argument, its value and the fix."""
    options = {**ERROR_BOUND_DEFAULTS, **{key: given[key] for key in ERROR_BOUND_KEYS & set(given)}}
    max_error = options["max_error"]
    if max_error is None:
        extra = sorted((ERROR_BOUND_KEYS - {"max_error"}) & set(given))
        if extra:
            raise ValueError(
                f"`compression_options` sets {extra} with `max_error=None` (no error bound): they have nothing to"
                f" bound. Drop them, or give `max_error` (default {ERROR_BOUND_DEFAULTS['max_error']})."
            )
        return {}
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not 0 < max_error < 1:
        raise ValueError(
            f"`compression_options={{'max_error': {max_error!r}}}` for compression={mode!r} must be a relative error"
            " in (0, 1): the largest ||compressed - exact|| / ||exact|| of the averaged gradient to keep (e.g. 0.02),"
            " or None for a fixed setting."
        )
    every = options["error_check_every"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"`compression_options={{'error_check_every': {every!r}}}` for compression={mode!r} must be a whole"
            " number of optimizer steps, 1 or more (e.g. 5): how often the compression's error is checked."
        )
    fraction = options["max_bytes_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(
            f"`compression_options={{'max_bytes_fraction': {fraction!r}}}` for compression={mode!r} must be a"
            " fraction in (0, 1]: the most the compressed exchange may send, relative to uncompressed (e.g. 0.1)."
        )
    return options


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's PowerSGD rule (``_should_compress``): compress a matrix when that sends ``min_compression_rate`` times
    fewer entries."""
    return (rows + cols) * min(rows, cols, rank) * min_compression_rate < rows * cols


def powersgd_payload(shapes: Sequence[tuple[int, int]], rank: int, min_compression_rate: float) -> int:
    """Entries one rank puts on the wire per step for gradients viewed as these matrices (``shape[0]`` by the rest,
    as torch's hook views them): P and Q of each compressed one, the others whole."""
    total = 0
    for rows, cols in shapes:
        low = min(rows, cols, rank)
        total += (rows + cols) * low if should_compress(rows, cols, rank, min_compression_rate) else rows * cols
    return total


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A gradient as PowerSGD views it (0-dim ones travel as (1,), as in DDP's buckets)."""
    rows = int(shape[0]) if len(shape) else 1
    return rows, math.prod(int(size) for size in shape[1:]) if len(shape) > 1 else 1


def largest_setting(
    mode: str,
    shapes: Sequence[tuple[int, int]],
    max_bytes_fraction: float,
    min_compression_rate: float,
    overhead: float = 0.0,
) -> float:
    """The largest PowerSGD rank (top-k ratio) whose payload, plus ``overhead`` entries per step (the checks'), is
    within ``max_bytes_fraction`` of uncompressed (a rank of at least 1)."""
    whole = sum(rows * cols for rows, cols in shapes)
    budget = max_bytes_fraction * whole - overhead
    if mode == "topk":
        return max(budget / whole, 0.0) / TOPK_WIRE_FACTOR if whole else max_bytes_fraction / TOPK_WIRE_FACTOR
    widest = max((min(rows, cols) for rows, cols in shapes), default=1)
    best = 1
    for rank in range(2, widest + 1):  # (the payload grows with the rank: a matrix left whole sends more)
        payload = powersgd_payload(shapes, rank, min_compression_rate)
        if payload > budget:
            break
        best = rank
        if payload == whole:  # every matrix travels whole from this rank on: a larger one changes nothing
            break
    return best


def raised_setting(current: float, relative_error: float, max_error: float, largest: float) -> Optional[float]:
    """The setting for the next steps after a check: doubled (at most ``largest``) when the error is above
    ``max_error``; None to keep it (within the bound, or already at the largest)."""
    if relative_error <= max_error or current >= largest:
        return None
    raised = min(2 * current, largest)
    return int(raised) if isinstance(current, int) else raised


def first_power_step_error(matrix: Tensor, rank: int, generator: torch.Generator) -> float:
    """The squared error of PowerSGD's first step on ``matrix`` (one power iteration from a random Q, no warm start,
    no error feedback): what compressing it at ``rank`` would lose, computed locally."""
    rows, cols = matrix.shape
    start = torch.randn(cols, min(rows, cols, rank), generator=generator).to(matrix)
    p = torch.linalg.qr(matrix @ start).Q
    q = matrix.T @ p
    return float((matrix - p @ q.T).square().sum())


def candidate_settings(start: float, largest: float) -> list[float]:
    """The settings a calibration compares: ``start`` doubled until ``largest``, which ends the list."""
    settings = [start]
    while settings[-1] < largest:
        raised = raised_setting(settings[-1], 1.0, 0.0, largest)
        assert raised is not None  # (below the largest, a check above the bound always raises)
        settings.append(raised)
    return settings


def sample_indices(numel: int, step: int, bucket: int, count: int = ERROR_SAMPLE_ENTRIES) -> Tensor:
    """The entries a check compares: the same on every rank (seeded by the step and the bucket), all when few.
    Drawn with replacement (an unbiased estimate all the same), so a 25 MiB bucket costs ``count`` draws, not a
    permutation of its millions of entries."""
    if numel <= count:
        return torch.arange(numel)
    generator = torch.Generator().manual_seed(1_000_003 * step + bucket)
    return torch.randint(numel, (count,), generator=generator)


@dataclass(frozen=True)
class ErrorCheck:
    step: int  # the exchange's optimizer step (counted by the hook from the fit's first, resumes included)
    relative_error: float
    setting: float  # the rank (ratio) the step was compressed with
    raised_to: Optional[float] = None  # the setting from the next step on, when this check raised it
    estimated: bool = False  # before compressing: PowerSGD's first step on the exact average, without sending it


# ---------------------------------------------------------------------------------------------- the hook


class ErrorBoundState:
    """The inner hook's state and the bound's: checks so far, the current setting, the largest allowed."""

    def __init__(self, mode: str, inner_hook: Any, inner_state: Any, options: Mapping[str, Any]) -> None:
        self.mode = mode
        self.inner_hook = inner_hook
        self.inner_state = inner_state
        self.max_error = float(options["max_error"])
        self.every = int(options["error_check_every"])
        self.max_bytes_fraction = float(options["max_bytes_fraction"])
        self.start_setting = self.setting
        self.steps_done = 0  # exchanges completed, over the fit and the resumes
        self.next_check = 0  # the first step compressed, then every `every` steps; the next one after a raise
        self.checks: list[ErrorCheck] = []
        self.shapes: dict[int, list[tuple[int, int]]] = {}  # bucket index -> its gradients as matrices
        self.shapes_complete = False  # every bucket seen since the buckets last changed (the budget needs them all)
        self.step_label: Callable[[], int] = lambda: self.steps_done  # the optimizer step a check is recorded at
        self.device = torch.device("cpu")  # the gradients' (a collective of this state's runs there: NCCL needs CUDA)
        self._checking = self._calibrating = False
        self._estimates: dict[float, float] = {}  # a calibration's squared errors per candidate setting, so far
        self._candidates: list[float] = []  # the settings a calibration compares (fixed at its first bucket)
        self._capped_said = False  # (said once per fit: the error stays above the bound at the largest setting)
        self._sums = torch.zeros(2, dtype=torch.float64)  # this step's scaled squared error and exact norm, so far

    @property
    def setting(self) -> float:
        return getattr(self.inner_state, SETTING[self.mode])

    # Every bucket's gradients as PowerSGD views them; PowerSGD's min_compression_rate (top-k has none); the hook's
    # group (every rank, or the node leaders in a hierarchical reduction).
    matrices = property(lambda self: [shape for bucket in self.shapes.values() for shape in bucket])
    compression_rate = property(
        lambda self: getattr(self.inner_state, "min_compression_rate", POWERSGD_MIN_COMPRESSION_RATE)
    )
    group = property(lambda self: getattr(self.inner_state, "process_group", None) or dist.group.WORLD)

    def largest(self) -> float:
        rate, overhead = self.compression_rate, self.check_overhead()
        return largest_setting(self.mode, self.matrices, self.max_bytes_fraction, rate, overhead)

    def check_overhead(self) -> float:
        """The checks' entries on the wire per step, on average: each bucket's sample and the 2 agreed sums, every
        ``every`` steps (counted in the budget, so that the exchange and its checks stay within it)."""
        sampled = sum(
            min(sum(rows * cols for rows, cols in bucket), ERROR_SAMPLE_ENTRIES) for bucket in self.shapes.values()
        )
        return (sampled + 2) / self.every

    def compressing(self) -> bool:
        """Whether this step is compressed (PowerSGD runs a plain all-reduce for ``start_powerSGD_iter`` steps)."""
        return self.mode != "powersgd" or self.inner_state.iter >= self.inner_state.start_powerSGD_iter

    def change_setting(self, value: float) -> None:
        setattr(self.inner_state, SETTING[self.mode], value)
        for slot in ("p_memory_dict", "q_memory_dict"):  # shaped by the rank: rebuilt at the next step
            if isinstance(getattr(self.inner_state, slot, None), dict):
                getattr(self.inner_state, slot).clear()

    def calibrates_now(self) -> bool:
        """PowerSGD's last uncompressed step: its result is the exact average, on which the first compressed step's
        setting is chosen (so that a model whose gradients need rank 8 does not take its first steps at rank 1).
        Only when every bucket's shapes are known from an earlier step (the candidates run up to the budget's
        largest); otherwise (a resume on that very step, buckets that just changed) the checks alone raise it."""
        if self.mode != "powersgd" or not self.shapes_complete:
            return False
        return self.inner_state.iter == self.inner_state.start_powerSGD_iter - 1

    def estimate(self, index: int, averaged: Tensor) -> None:
        """Add this bucket's squared error at every candidate setting, and its squared norm, to the calibration."""
        rate = self.compression_rate
        self._sums[1] += float(averaged.float().square().sum())
        offset, settings = 0, self._candidates
        for rows, cols in self.shapes[index]:
            matrix = averaged[offset : offset + rows * cols].view(rows, cols).float()
            offset += rows * cols
            for setting in settings:
                if should_compress(rows, cols, int(setting), rate):  # (else it travels whole: no error)
                    generator = torch.Generator().manual_seed(self.steps_done)
                    error = first_power_step_error(matrix, int(setting), generator)
                    self._estimates[setting] = self._estimates.get(setting, 0.0) + error

    def _agreed(self, values: Union[Tensor, Sequence[float]]) -> list[float]:
        """The ranks' mean of ``values``: the same numbers on every rank, however each computed its own (devices of
        different kinds round differently), so every rank takes the same decision."""
        tensor = torch.as_tensor(values, dtype=torch.float64).to(self.device)
        dist.all_reduce(tensor, group=self.group)
        return (tensor / dist.get_world_size(self.group)).tolist()

    def _end_calibration(self) -> None:
        settings = self._candidates
        estimates = [self._estimates.get(setting, 0.0) for setting in settings]
        *errors, norm = self._agreed([*estimates, float(self._sums[1])])
        relative = [math.sqrt(error / norm) if norm > 0 else 0.0 for error in errors]
        chosen = next((s for s, e in zip(settings, relative) if e <= self.max_error), settings[-1])
        self.checks.append(
            ErrorCheck(
                self.step_label(), relative[0], self.setting, chosen if chosen != self.setting else None, estimated=True
            )
        )
        if chosen != self.setting:
            estimate = ", ".join(f"{s:g}: {e:.3f}" for s, e in zip(settings, relative))
            why = (
                f"the first within max_error {self.max_error:g}"
                if relative[settings.index(chosen)] <= self.max_error
                else f"none is within max_error {self.max_error:g}, and this is the most that max_bytes_fraction"
                f" {self.max_bytes_fraction:g} allows"
            )
            rank_zero_info(
                f"HeteroStrategy: {self.mode} starts at {SETTING[self.mode]} {chosen:g}, not {self.setting:g}: its"
                f" estimated relative error on step {self.step_label()}'s averaged gradient per"
                f" {SETTING[self.mode]} ({estimate}): {why}."
            )
            self.change_setting(chosen)

    def end_step(self) -> None:
        if self._calibrating:
            self._end_calibration()
        self.shapes_complete = True
        if self._checking:
            error_sq, exact_sq = self._agreed(self._sums)
            if not (math.isfinite(error_sq) and math.isfinite(exact_sq)):
                # A non-finite gradient (the non-finite step guard deals with it): no figure, no raise; the next
                # step is checked instead (every rank sees the same agreed sums, so every rank skips alike).
                self.next_check = self.steps_done + 1
                self.steps_done += 1
                self._checking = self._calibrating = False
                return
            relative = math.sqrt(error_sq / exact_sq) if exact_sq > 0 else 0.0
            largest = self.largest()
            raised = raised_setting(self.setting, relative, self.max_error, largest)
            self.checks.append(ErrorCheck(self.step_label(), relative, self.setting, raised))
            # After a raise the next step is checked too: the steps compressed too coarsely in a row, until the
            # setting holds the bound, are what cost loss (at every 5 steps, 1 -> 8 took 15 steps of a 60-step run).
            self.next_check = self.steps_done + (1 if raised is not None else self.every)
            if raised is not None:
                rank_zero_info(
                    f"HeteroStrategy: {self.mode}'s relative error {relative:.3f} at step {self.step_label()} is above"
                    f" max_error {self.max_error:g}: {SETTING[self.mode]} {self.setting:g} -> {raised:g} from the next"
                    f" step ({self.bytes_fraction(raised):.3g} of uncompressed bytes; the most within"
                    f" max_bytes_fraction {self.max_bytes_fraction:g} is {largest:g})."
                )
                self.change_setting(raised)
            elif relative > self.max_error and not self._capped_said:
                self._capped_said = True
                rank_zero_info(
                    f"HeteroStrategy: {self.mode}'s relative error {relative:.3f} at step {self.step_label()} stays"
                    f" above max_error {self.max_error:g} at {SETTING[self.mode]} {self.setting:g}, the most that"
                    f" max_bytes_fraction {self.max_bytes_fraction:g} allows: raise max_bytes_fraction to send more,"
                    " or accept the error."
                )
        self.steps_done += 1
        self._checking = self._calibrating = False

    def bytes_fraction(self, setting: float) -> float:
        """What the exchange sends at ``setting``, relative to uncompressed (as far as the buckets seen so far go)."""
        if self.mode == "topk":
            return TOPK_WIRE_FACTOR * setting
        shapes = self.matrices
        whole = max(1, sum(rows * cols for rows, cols in shapes))
        return powersgd_payload(shapes, int(setting), self.compression_rate) / whole

    def summary(self) -> dict[str, Any]:
        """The report's ``communication.error_bound``."""
        last = self.checks[-1] if self.checks else None
        return {
            "max_error": self.max_error,
            "error_check_every": self.every,
            "max_bytes_fraction": self.max_bytes_fraction,
            "setting": SETTING[self.mode],
            "start": self.start_setting,
            "current": self.setting,
            "largest": self.largest() if self.shapes else None,
            "bytes_fraction": self.bytes_fraction(self.setting) if self.shapes else None,
            "last_error": None if last is None else last.relative_error,
            "checks": [asdict(check) for check in self.checks],
        }

    def progress(self) -> dict[str, Any]:
        """What a checkpoint keeps of the bound (the inner state's progress is saved beside it, by
        :func:`~lightning_hetero.comm.compression.hook_state_dict`)."""
        return {
            "setting": self.setting,
            "steps_done": self.steps_done,
            "next_check": self.next_check,
            "checks": [asdict(check) for check in self.checks],
        }

    def restore_progress(self, saved: Mapping[str, Any]) -> None:
        setattr(self.inner_state, SETTING[self.mode], saved["setting"])
        self.steps_done, self.next_check = int(saved["steps_done"]), int(saved["next_check"])
        self.checks = [ErrorCheck(**check) for check in saved["checks"]]


def error_bounded_hook(state: ErrorBoundState, bucket: Any) -> torch.futures.Future[Tensor]:
    """The inner hook on ``bucket``, checked against the exact average of a sample at a check step."""
    index = bucket.index()
    state.device = bucket.buffer().device
    if index not in state.shapes:  # (cleared when the buckets change: forget_bucket_state)
        state.shapes[index] = [matrix_shape(parameter.shape) for parameter in bucket.parameters()]
    if index == 0:
        state._checking = state.compressing() and state.steps_done >= state.next_check
        state._calibrating = state.calibrates_now()
        state._sums, state._estimates = torch.zeros(2, dtype=torch.float64, device=state.device), {}
        state._candidates = candidate_settings(state.setting, state.largest()) if state._calibrating else []
    sample = exact = None
    if state._checking:
        buffer = bucket.buffer()
        sample = sample_indices(buffer.numel(), state.steps_done, index).to(buffer.device)
        exact = buffer.index_select(0, sample).float()  # before the hook: PowerSGD adds its error feedback in place
        feedback = getattr(state.inner_state, "error_dict", {}).get(index)
        if feedback is not None:  # (what the hook will add to this rank's input; none before its first step)
            exact += feedback.index_select(0, sample).float()
        dist.all_reduce(exact, group=state.group)
        exact.div_(dist.get_world_size(state.group))
    result = state.inner_hook(state.inner_state, bucket).wait()
    if isinstance(result, (list, tuple)):
        result = result[0]
    if state._calibrating:
        state.estimate(index, result)
    if sample is not None and exact is not None:
        scale = bucket.buffer().numel() / sample.numel()
        compressed = result.index_select(0, sample).float()
        state._sums[0] += scale * (compressed - exact).double().square().sum()  # (on the device: one sync a step)
        state._sums[1] += scale * exact.double().square().sum()
    if bucket.is_last():
        state.end_step()
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(result)
    return future
