"""The results page of ``benchmarks/simulator_validation.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "The planner's batch split and step against runs here: `benchmarks/simulator_validation.py`"
INTRO = (
    "Real fits of the examples' spiral classifier (global batch 256, 80 steps, automatic split, one thread per "
    "rank, gloo) on emulated hardware, each configuration also written as a cluster file (a 1-core CPU of this "
    "machine per rank at its emulated speed, times its part of the 2 cores with 4 ranks; the gloo link measured "
    "first; the emulated 1 Gbit/s, 0.1 ms link between nodes) and predicted by the simulator, calibrated once per "
    "run of the script by a fit that is not validated (2 equal ranks at fixed micro-batches 176/80, ZeRO-0). "
    "Measured over each fit's last 20 steps: the median step time, and the *balancing* split, the one that "
    "equalises the ranks' measured compute (the re-planner's computation without the 5 % gain it waits for). The "
    "script's docstring says how each figure is taken; the how-to page is [Planning a cluster](../planning.md)."
)

RATIO_COLUMNS = (
    Column("step, predicted / measured", "step"),
    Column("step at the fit's own split, predicted / measured", "step_at_used_split"),
    Column("split: the worst rank's share, predicted / balancing", "split"),
)
ERROR_COLUMNS = (
    Column("split error", "split_error"),
    Column("split error, points of the batch", "share_points", ".1f"),
)


def ratios(fit: dict[str, Any]) -> dict[str, float]:
    """One fit's predictions over its measurements: the step, the step at the fit's own split (the step model alone),
    and the share of the rank whose share is furthest from the balancing split's, relatively (split_error's)."""
    measured = fit["measured"]
    shares = [(p, m) for p, m in zip(fit["predicted_split"], measured["balancing"])]
    predicted, balancing = max(shares, key=lambda share: abs(share[0] - share[1]) / share[1])
    total_predicted, total_balancing = sum(fit["predicted_split"]), sum(measured["balancing"])
    return {
        "step": fit["predicted_step_ms"] / measured["step_ms"],
        "step_at_used_split": fit["predicted_step_ms_at_used_split"] / measured["step_ms"],
        "split": (predicted / total_predicted) / (balancing / total_balancing),
        "split_error": fit["split_error"],
        "share_points": fit["share_points"],
    }


def setting_of(configuration: dict[str, Any]) -> str:
    """A configuration's name and speeds, without commas (a plot's label is a setting's text up to its first)."""
    speeds = "/".join(f"{speed:g}" for speed in configuration["speeds"])
    return f"{configuration['name'].replace(', ', '; ')} (speeds {speeds})"


def sections(files: Sequence[Path]) -> list[Section]:
    """A section of ratios (predicted over measured) and one of the split's errors; a row per configuration of each
    run of the script, a cell over the configuration's fits in that run (``--runs``)."""
    ratio_rows: list[Row] = []
    error_rows: list[Row] = []
    for path in files:
        record = record_of(path)
        for configuration in record["setting"]["configurations"]:
            fits = [ratios(fit) for fit in record["rows"] if fit["name"] == configuration["name"]]
            setting = setting_of(configuration)
            ratio_rows.append(row_of(path, record, setting, {c.key: [f[c.key] for f in fits] for c in RATIO_COLUMNS}))
            error_rows.append(row_of(path, record, setting, {c.key: [f[c.key] for f in fits] for c in ERROR_COLUMNS}))
    if not ratio_rows:
        return []
    return [
        Section(
            "Predicted over measured",
            "1 is a right prediction (the targets: the step within 20 %, the split within 10 %). *Step*: the "
            "predicted step against the median `step_seconds` of the fit's last 20 steps; *at the fit's own split*: "
            "the step model alone, at the split the fit ran (without the split's difference); *split*: the rank "
            "whose share of the batch is relatively furthest from the balancing split's, its predicted share over "
            "its balancing share.",
            RATIO_COLUMNS,
            tuple(ratio_rows),
            "simulator_validation.png",
        ),
        Section(
            "The split's error",
            "The largest relative difference of a rank's share, predicted against balancing (the target: 0.10), and "
            "the same difference in percentage points of the global batch (a rank of 4 % is 10 samples of 256).",
            ERROR_COLUMNS,
            tuple(error_rows),
            "simulator_validation_split.png",
            reference=None,
        ),
    ]
