"""The results page of ``benchmarks/pipeline_balance.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "A pipeline placed by speed: `benchmarks/pipeline_balance.py`"
INTRO = (
    "Two CPU ranks, rank 1 emulated at 0.4 of rank 0's speed (`emulate_speeds=[1.0, 0.4]`), train a chain of 8 "
    "equal blocks (Linear 1024 and tanh) as a 2-stage pipeline, 1F1B with 4 micro-batches of 16 samples, 50 "
    "steps per fit, measured over steps 25-49. What the script does, and why, is in its docstring; the how-to "
    "page is [Pipeline parallelism](../pipeline.md)."
)

PIPELINE_COLUMNS = (
    Column("equal / placed, step", "equal_over_placed"),
    Column("equal / placed, slowest stage's compute", "slowest_stage_equal_over_placed"),
    Column("placed balance", "placed_balance"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/pipeline_balance.py``'s runs: one section, a row per run of the script."""
    rows = []
    for path in files:
        record = json.loads(path.read_text())
        values = {column.key: record["summary"][column.key] for column in PIPELINE_COLUMNS}
        setting = f"{len(record['pairs'])} pairs"
        date = record.get("started", "")[:10]
        rows.append(Row(path.name, record.get("commit", ""), date, setting, values, record.get("note", "")))
    intro = (
        "Two fits per pair, back to back in alternating order: *equal* with 4 blocks per stage, *placed* with the "
        "blocks measured on each rank and placed by the planner (re-planned every 20 steps). *equal / placed* over "
        "1 is the placed pipeline's gain; the slowest stage's compute leaves out the step's fixed costs; *placed "
        "balance* is, per step, the mean of the stages' compute over the larger (1: both stages as busy; in theory "
        "0.917 for the best integer split of 8 blocks at these speeds)."
    )
    if not rows:
        return []
    return [
        Section("Placed by speed against the equal split", intro, PIPELINE_COLUMNS, tuple(rows), "pipeline_balance.png")
    ]
