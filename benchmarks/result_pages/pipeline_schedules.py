"""The results page of ``benchmarks/pipeline_schedules.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "The interleaved schedule against 1F1B: `benchmarks/pipeline_schedules.py`"
INTRO = (
    "Two CPU ranks train a chain of 8 equal blocks (Linear 1024 and tanh) as a 2-stage pipeline placed by measured "
    "speed, 4 micro-batches of 16 samples, 40 steps per fit, measured over steps 5-39: once with 1F1B and once "
    "interleaved with 2 chunks per rank, back to back in alternating order. What the script does, and why, is in its "
    "docstring; the how-to page is [Pipeline parallelism](../pipeline.md)."
)

RATIO_COLUMNS = (
    Column("1f1b / interleaved, step", "step_1f1b_over_interleaved"),
    Column("1f1b / interleaved, stage 0's bubble", "bubble_1f1b_over_interleaved_stage_0"),
    Column("1f1b / interleaved, stage 1's bubble", "bubble_1f1b_over_interleaved_stage_1"),
)
PREDICTION_COLUMNS = (
    Column("1f1b: measured / predicted step", "measured_over_predicted_1f1b"),
    Column("interleaved: measured / predicted step", "measured_over_predicted_interleaved"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/pipeline_schedules.py``'s runs: the schedules' ratios, and the planner's prediction."""
    ratio_rows, prediction_rows = [], []
    for path in files:
        record = json.loads(path.read_text())
        summary = record["summary"]
        placed = f"boundaries [{record['boundary']}]" if record.get("boundary") else "placed by speed"
        setting = f"{len(record['pairs'])} pairs, speeds {record.get('speeds')}, {placed}"
        date = record.get("started", "")[:10]
        for columns, rows in ((RATIO_COLUMNS, ratio_rows), (PREDICTION_COLUMNS, prediction_rows)):
            if columns is PREDICTION_COLUMNS and record.get("boundary"):
                continue  # (blocks not measured: no prediction)
            values = {column.key: summary[column.key] for column in columns}
            rows.append(Row(path.name, record.get("commit", ""), date, setting, values, record.get("note", "")))
    if not ratio_rows:
        return []
    return [
        Section(
            "The interleaved schedule against 1F1B",
            "Per pair, the 1F1B fit's figure over the interleaved fit's: over 1, the interleaved schedule is better. "
            "A stage's bubble is its time waiting for a neighbour per step (the fill and drain, and any imbalance).",
            RATIO_COLUMNS,
            tuple(ratio_rows),
            "pipeline_schedules.png",
        ),
        Section(
            "The planner's predicted step against the measured one",
            "The measured step over the planner's prediction for the same placement and schedule, which counts the "
            "stages' measured compute only (no hand-offs, no optimizer step or gradient sums, no Lightning loop).",
            PREDICTION_COLUMNS,
            tuple(prediction_rows),
            "pipeline_schedules_prediction.png",
        ),
    ]
