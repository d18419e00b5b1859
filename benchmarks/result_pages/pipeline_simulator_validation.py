"""The results page of ``benchmarks/pipeline_simulator_validation.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Section, record_of, row_of

TITLE = "The planner's pipeline against runs here: `benchmarks/pipeline_simulator_validation.py`"
INTRO = (
    "`lightning-hetero plan --pipeline-blocks blocks` for `examples.spirals:SpiralChain` (12 residual blocks of "
    "256) on a cluster file of two one-core CPUs, the second at `speed: 0.4`, against fits of "
    "`configs/spirals_pipeline.yaml` for one epoch each (2 CPU ranks of one thread, rank 1 emulated at 0.4, global "
    "batch 128, 1F1B with 4 micro-batches). The prediction is made once per run of the script, then every fit is "
    "compared with it: the blocks placed on the slow rank, and the step, the run report's median schedule time "
    "from step 2 on (the longest rank's compute and waiting per step). The how-to page is "
    "[Planning a cluster](../planning.md)."
)

RATIO_COLUMNS = (
    Column("step, predicted / measured", "step_predicted_over_measured"),
    Column("blocks on the slow rank, predicted / measured", "slow_blocks_predicted_over_measured"),
)
TIME_COLUMNS = (
    Column("measured step (schedule), ms", "schedule_ms", ".1f"),
    Column("predicted step, ms", "predicted_step_ms", ".1f"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """A section of ratios (predicted over measured, a cell over the fits of a run of the script) and one of the
    step times themselves; a row per run of the script."""
    ratios, times = [], []
    for path in files:
        record = record_of(path)
        fits = record["runs"]
        setting = f"{len(fits)} fit{'s' if len(fits) != 1 else ''} of one epoch"
        ratios.append(row_of(path, record, setting, {c.key: [fit[c.key] for fit in fits] for c in RATIO_COLUMNS}))
        step = {
            "schedule_ms": [fit["schedule_ms"] for fit in fits],
            "predicted_step_ms": [record["predicted"]["step_ms"]],
        }
        times.append(row_of(path, record, setting, step))
    if not ratios:
        return []
    return [
        Section(
            "Predicted over measured",
            "1 is a right prediction. The step is predicted from each block's share of the step measured here by "
            "`plan`, at each device's rate, plus the boundaries' transfers; it holds no per-micro-batch cost of the "
            "training loop (Lightning's training-step path on every stage, a gloo send and its wait).",
            RATIO_COLUMNS,
            tuple(ratios),
            "pipeline_simulator_validation.png",
        ),
        Section(
            "The step times",
            "The measured schedule time of each fit, and the one predicted step of the run (n=1): both are measured "
            "on this machine, so a busy machine moves both.",
            TIME_COLUMNS,
            tuple(times),
            "pipeline_simulator_validation_ms.png",
            reference=None,
        ),
    ]
