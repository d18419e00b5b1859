"""Measure: what a rank's profile is (:class:`RankProfile`) and the pure decisions taken from its timings: the probed
sizes, the fitted cost line, the memory ceiling, and what the loss's growth says about its reduction.

Kept apart from :mod:`.profiler` (which runs the user's step) so that the planners, the watcher and the simulator can
read and judge a profile without importing the measuring code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from lightning_hetero.measure.cost import CostModel

# Fraction of the free memory a plan may fill: activations are not the only allocations (fragmentation, workspace).
MEMORY_HEADROOM = 0.8


@dataclass(frozen=True)
class RankProfile:
    """What one rank measured: step time per probed micro-batch and the fitted cost model."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]  # fastest forward+backward time per probed size
    fixed_seconds: float
    seconds_per_sample: float
    max_batch: Optional[int]  # memory ceiling; None = no limit found
    bytes_per_sample: Optional[float]
    wall_seconds: float  # what profiling cost on this rank
    free_bytes: Optional[float] = None  # the device's free memory when profiled (what the ceiling was taken from)
    # The loss of a batch given twice (the same samples, concatenated) over the loss of the batch: 1 for a mean over
    # the batch, 2 for a sum; None when it could not be measured (a loss that is not a positive number).
    loss_ratio: Optional[float] = None

    def cost_model(self) -> CostModel:
        return CostModel(fixed=self.fixed_seconds, per_sample=self.seconds_per_sample, max_batch=self.max_batch)

    def reserving(self, reserved_bytes: float) -> RankProfile:
        """This profile with ``reserved_bytes`` of the free memory taken by something else during training."""
        if self.free_bytes is None or not self.bytes_per_sample:
            return self
        ceiling = memory_ceiling(self.bytes_per_sample, max(0.0, self.free_bytes - reserved_bytes))
        assert ceiling is not None
        return replace(self, max_batch=ceiling if self.max_batch is None else min(self.max_batch, ceiling))

    def throughput(self, batch_size: int) -> float:
        """Predicted samples per second of local compute at ``batch_size``."""
        return batch_size / self.cost_model().time(batch_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankProfile:
        return cls(**{**data, "batch_sizes": tuple(data["batch_sizes"]), "seconds": tuple(data["seconds"])})


def probe_sizes(global_batch_size: int, world_size: int) -> list[int]:
    """Micro-batch sizes to time: from an eighth of the equal share to twice it, so that the fitted line holds for
    the small batches a slow rank may be given as well as the large ones of a fast rank. Never one sample where the
    share is more: a BatchNorm in training refuses a batch of one sample per channel ("Expected more than 1 value
    per channel"), so a model that trains at its share would fail in the probe."""
    share = max(1, global_batch_size // world_size)
    smallest = min(share, 2)
    return sorted({max(smallest, share // 8), max(smallest, share // 2), share, max(2, 2 * share)})


def fit_linear_cost(batch_sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = fixed + per_sample * batch``, with ``fixed >= 0`` and ``per_sample > 0``.

    Timing noise can make the unconstrained fit's intercept negative (or, at tiny sizes, the slope); then the
    constrained optimum lies on that boundary and is refitted there.
    """
    if len(batch_sizes) != len(seconds) or len(set(batch_sizes)) < 2:
        raise ValueError(f"need timings at two or more distinct batch sizes, got {list(batch_sizes)}")
    n = len(batch_sizes)
    mean_b = sum(batch_sizes) / n
    mean_t = sum(seconds) / n
    covariance = sum((b - mean_b) * (t - mean_t) for b, t in zip(batch_sizes, seconds))
    variance = sum((b - mean_b) ** 2 for b in batch_sizes)
    per_sample = covariance / variance
    fixed = mean_t - per_sample * mean_b
    if fixed < 0:  # through the origin
        fixed, per_sample = 0.0, sum(b * t for b, t in zip(batch_sizes, seconds)) / sum(b * b for b in batch_sizes)
    smallest_positive = max(mean_t, 1e-9) * 1e-6 / max(batch_sizes)
    if per_sample <= 0:  # flat in batch size: all cost is fixed; keep a tiny slope so more samples never look free
        fixed, per_sample = mean_t, smallest_positive
    return fixed, max(per_sample, smallest_positive)


def doubled_loss_ratio(single: float, doubled: float) -> Optional[float]:
    """``doubled / single`` (the loss of a batch given twice over the batch's own), when both are positive numbers."""
    if not (math.isfinite(single) and math.isfinite(doubled)) or single <= 0 or doubled <= 0:
        return None
    return doubled / single


# A summed loss doubles when the batch is given twice; a mean (over samples, or over tokens) stays the same.
_SUM_RATIO, _MEAN_RATIO = 1.6, 1.25


def loss_reduction_mismatch(
    ratios: Sequence[Optional[float]], loss_reduction: str, measured_by: str = "the profile"
) -> Optional[str]:
    """A warning when every rank that measured it says the loss is a sum and ``loss_reduction="mean"``, or the
    reverse (``ratios``: each rank's loss on a batch given twice over its own, None where not measured;
    ``measured_by``: what measured them, for the message)."""
    known = [ratio for ratio in ratios if ratio is not None]
    if not known:
        return None
    shown = ", ".join(f"{ratio:.2f}" for ratio in known)
    if loss_reduction == "mean" and min(known) > _SUM_RATIO:
        return (
            "HeteroStrategy: `training_step`'s loss doubles when its batch is given twice"
            f" ({measured_by} measured {shown}), as a sum over the batch does, but `loss_reduction='mean'`: with"
            " unequal micro-batches that trains differently from DDP. Pass `HeteroStrategy(loss_reduction='sum')` if"
            " the loss is a sum (e.g. `reduction='sum'`)."
        )
    if loss_reduction == "sum" and max(known) < _MEAN_RATIO:
        return (
            "HeteroStrategy: `training_step`'s loss stays the same when its batch is given twice"
            f" ({measured_by} measured {shown}), as a mean over the batch does, but `loss_reduction='sum'`: with"
            " unequal micro-batches that trains differently from DDP. Pass `loss_reduction='mean'` (the default) if"
            " the loss is a mean."
        )
    return None


def memory_ceiling(bytes_per_sample: Optional[float], free_bytes: Optional[float]) -> Optional[int]:
    """The largest micro-batch whose activations fit in ``MEMORY_HEADROOM`` of the free memory (None: unknown)."""
    if not bytes_per_sample or bytes_per_sample <= 0 or free_bytes is None:
        return None
    return max(0, math.floor(free_bytes * MEMORY_HEADROOM / bytes_per_sample))
