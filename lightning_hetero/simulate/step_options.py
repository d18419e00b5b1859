"""Simulate: what the step model is asked beyond the cluster and the workload (:class:`Options`), among it the
training loop's costs that a CPU run of the same model shows (:class:`LoopCalibration`, from :func:`calibrate_loop`).

Kept apart from :mod:`.predict` so that the per-device model (:mod:`.device_model`) and the exchange
(:mod:`.gradient_exchange`) can take the options without importing the plan that adds them up.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from lightning_hetero.simulate.workload import Workload


@dataclass(frozen=True)
class LoopCalibration:
    """A CPU step in the training loop against the same step measured alone here, from a run (:func:`calibrate_loop`).

    In the loop a CPU rank's compute is ``loop_compute_seconds + compute_factor * (what the step measured here
    predicts)`` at speed 1 (Lightning's step wrapper, DeepSpeed's gradient hooks and the loss weighting add a fixed
    part; data loading between steps and the other ranks on the machine cool the caches), stretched by a rank's
    slowness like the rest of its compute; an emulated slow rank stretches it too. ``step_overhead_seconds``: wall
    time per step beyond the slowest rank's compute, the exchange and the optimizer (Lightning's loop, DeepSpeed's
    step bookkeeping, the package's watch), added to every step. Without a calibration run the prediction is the
    step measured here, the exchange and the optimizer only.
    """

    loop_compute_seconds: float = 0.0
    compute_factor: float = 1.0
    step_overhead_seconds: float = 0.0


SETTLED_STEPS = 20  # the last steps of a run, over which a calibration takes its medians


def least_squares_slope(points: Sequence[tuple[int, float]]) -> float:
    """The slope of compute seconds against micro-batch size; 0 when every point has the same size."""
    mean_b, mean_c = statistics.fmean(b for b, _ in points), statistics.fmean(c for _, c in points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    return sum((b - mean_b) * (c - mean_c) for b, c in points) / spread if spread else 0.0


def calibrate_loop(
    report: dict, rank_files: Sequence[dict], workload: Workload, exchange_and_optimizer_seconds: float
) -> LoopCalibration:
    """The :class:`LoopCalibration` a CPU run on this machine shows: ``report`` its report.json, ``rank_files`` its
    rank_<r>.json, ``workload`` the same model measured here, ``exchange_and_optimizer_seconds`` what the step model
    predicts for that run. Ranks at unequal micro-batches (``batch_sizes=[...]``) give both the fixed part and the
    factor; at equal ones only the fixed part can be told (the factor stays 1)."""
    steps = report["steps"][-SETTLED_STEPS:]
    speeds = rank_files[0]["plan"].get("emulate_speeds") or [1.0] * len(rank_files)
    # Each rank's median compute at its median micro-batch, at speed 1.
    points = [
        (
            round(statistics.median(step["batch_sizes"][r] for step in steps)),
            statistics.median(step["compute_seconds"][r] for step in steps) * speeds[r],
        )
        for r in range(len(rank_files))
    ]
    slope = least_squares_slope(points)
    # Never faster than the step measured here; with the factor settled, the fixed part is what the points leave.
    factor = max(1.0, slope / workload.here_seconds_per_sample)
    intercept = statistics.fmean(c - factor * workload.here_seconds_per_sample * b for b, c in points)
    non_compute = [step["step_seconds"] - max(step["compute_seconds"]) for step in steps]
    return LoopCalibration(
        loop_compute_seconds=max(0.0, intercept - factor * workload.here_fixed_seconds),
        compute_factor=factor,
        step_overhead_seconds=max(0.0, statistics.median(non_compute) - exchange_and_optimizer_seconds),
    )


@dataclass(frozen=True)
class Options:
    global_batch_size: int
    zero_stage: Optional[int] = 0  # None: HeteroStrategy's default, the lowest stage that fits (automatic_stage)
    compression: Optional[str] = None
    compression_options: dict = field(default_factory=dict)
    hierarchical: Union[str, bool] = "auto"  # "auto", True or False, as HeteroStrategy takes it
    calibrated_efficiency: dict = field(default_factory=dict)  # kind name -> fraction of peak measured in a run
    loop: LoopCalibration = field(default_factory=LoopCalibration)
    precision: Optional[str] = None  # every device's precision; None: what device_precision="auto" chooses
