"""The results page of ``benchmarks/data_stall.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "Counting the wait for data: `benchmarks/data_stall.py`"
INTRO = (
    "Two CPU ranks of the same speed (one thread each, ZeRO-0) train the examples' spiral classifier (width 384, 4 "
    "blocks, Adam) on a global batch of 128; rank 1's loader is 5 ms behind on every batch (its collate function "
    "sleeps), as a loader whose host has too few cores or slow storage. Each fit alternates phases of 60 steps, "
    "re-planning every 10 steps: *ignoring* runs the split of a job that ignores the stall (by default the equal "
    "split, as DDP would run two ranks of the same speed), *counting* the re-planner as it is, which counts each "
    "rank's wait for data with its compute and gives the stalled rank fewer samples. A phase is measured over its "
    "last 20 steps: its median step time (the slowest rank's wall time from fetching its batch to the end of its "
    "optimizer step), the busiest rank's compute plus wait, and the stalled rank's share of the batch at its end. "
    "Each pair of neighbouring phases (ignoring, then counting) is a round: its figures are taken within the same "
    "fit a few seconds apart. `--sweep` measures the ceiling instead: fixed splits in turn, re-planning off. The "
    "script's docstring says more (`--pin`, `--keep-cores-awake`, `--baseline compute`); the how-to page is "
    "[The run report](../run-report.md)."
)

PAIR_COLUMNS = (
    Column("step ignoring / counting", "step_speedup"),
    Column("busiest rank's compute + wait, ignoring / counting", "busy_speedup"),
    Column("step ignoring, ms", "ignoring_step_ms", ".2f"),
    Column("step counting, ms", "counting_step_ms", ".2f"),
    Column("stalled rank's share, counting", "counting_share", ".2f"),
    Column("report names the stall (1 yes, 0 no)", "names_the_stall", ".0f"),
)
SWEEP_COLUMNS = (
    Column("step, ms (each phase's median)", "phase_step_ms", ".2f"),
    Column("equal split's step / this split's (medians of the phases)", "speedup_over_equal"),
)


def _held(setting: dict[str, Any]) -> str:
    """What a run held fixed beside its form, as a row's setting says it."""
    held = [f"{setting['stall_ms']:g} ms stall", "pinned" if setting.get("pinned") else "unpinned"]
    if setting.get("cores_kept_awake"):
        held.append("cores kept awake")
    held.append(f"width {setting['hidden']}, global batch {setting['global_batch']}")
    return ", ".join(held)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/data_stall.py``'s runs: the phases' pairs (a row per run of the script, its rounds the pairs of
    every fit) and the sweeps of fixed splits (a row per split of a sweep, its rounds the split's phases)."""
    pairs: list[Row] = []
    sweeps: list[Row] = []
    for path in files:
        record = record_of(path)
        setting = record["setting"]
        note = record.get("note", "")
        if "splits" in record:  # --sweep
            for index, (stalled, split) in enumerate(record["splits"].items()):
                values = {
                    "phase_step_ms": split["phase_step_ms"],
                    "speedup_over_equal": [split["speedup_over_equal"]],
                }
                text = (
                    f"rank 1 at {stalled} of {setting['global_batch']} samples, {_held(setting)}, "
                    f"phases of {setting['phase_steps']} steps"
                )
                sweeps.append(row_of(path, record, text, values, note if index == 0 else ""))
            continue
        every = [pair for run in record["runs"] for pair in run["pairs"]]
        values = {
            "step_speedup": [pair["step_speedup"] for pair in every],
            "busy_speedup": [pair["busy_speedup"] for pair in every],
            "ignoring_step_ms": [pair["ignoring"]["median_step_ms"] for pair in every],
            "counting_step_ms": [pair["counting"]["median_step_ms"] for pair in every],
            "counting_share": [pair["counting"]["stalled_rank_share"] for pair in every],
            "names_the_stall": [float(run["report_names_the_stall"]) for run in record["runs"]],
        }
        fits = len(record["runs"])
        count = f"{fits} fit{'s' if fits != 1 else ''} of {setting['phases']} phases"
        text = f"baseline {setting['baseline']}, {_held(setting)}, {count}"
        pairs.append(row_of(path, record, text, values, note))
    found = []
    if pairs:
        intro = (
            "Each round is a pair of neighbouring phases of one fit: the step time ignoring the stall over the step "
            "time counting it (above 1: counting the wait for data is faster), the same for the busiest rank's "
            "compute plus wait (the part a split moves), each phase's own median step, and the stalled rank's "
            "share of the global batch at the end of the counting phase (0.5 is the equal split). *Baseline* is "
            "the ignoring phases' split: `equal`, or `compute` (the re-planner balancing compute alone, which keeps "
            "part of the counting phase's shift). Whether the run report names the stalled rank is one figure per "
            "fit."
        )
        found.append(
            Section("Counting the wait against ignoring it", intro, PAIR_COLUMNS, tuple(pairs), "data_stall.png")
        )
    if sweeps:
        intro = (
            "`--sweep`: one fit whose phases run fixed splits in turn (re-planning off), each phase measured over "
            "its second half; the first phase (the plan's split) is left out. A round is a phase; the second "
            "column is the script's figure, the equal split's median step over this split's (one per split): what "
            "a fixed split gave on this machine and model, whatever the re-planner does."
        )
        found.append(
            Section("The ceiling: fixed splits", intro, SWEEP_COLUMNS, tuple(sweeps), "data_stall_sweep.png", None)
        )
    return found
