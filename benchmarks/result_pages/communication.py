"""The results page of ``benchmarks/communication.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "Compression and hierarchical reduction: `benchmarks/communication.py`"
INTRO = (
    "What fp16 on the wire, PowerSGD and top-k under the error bound (and PowerSGD at a fixed rank 1, without it) "
    "and hierarchical reduction save between two emulated nodes, and what they cost in loss. The model is an MLP "
    "256-1024-1024-10 (1.3 M parameters) with Adam on a teacher-labelled task; the script's docstring says how "
    "each figure is taken. The how-to page is [Communication](../communication.md)."
)

COMMUNICATION_COLUMNS = (
    Column("step time / none flat", "step_seconds"),
    Column("bytes between nodes / none flat", "inter_node_bytes_per_step"),
    Column("final loss / none flat", "final_loss"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/communication.py``'s runs: a section per model, a row per compression and reduction of each run
    of the script, each figure over the uncompressed flat fit of the same round."""
    by_model: dict[str, list[Row]] = {}
    for path in files:
        record = json.loads(path.read_text())
        rounds = record["runs"]
        date = record.get("started", "")[:10]
        for name in rounds[0]:
            values = {
                column.key: [run[name][column.key] / run["none/flat"][column.key] for run in rounds]
                for column in COMMUNICATION_COLUMNS
            }
            row = Row(
                path.name,
                record.get("commit", ""),
                date,
                name,
                values,
                record.get("note", "") if name == "none/flat" else "",
            )
            by_model.setdefault(record["setting"]["model"], []).append(row)
    intro = (
        "4 ranks as 2 emulated nodes of 2 joined by an emulated 1 Gbit/s link with 0.1 ms latency, ZeRO-0, 60 steps "
        "of a fixed split 20/12/20/12; each compression flat and hierarchical, every fit of a round back to back (the "
        "order reversed in every other round). Each figure is over the uncompressed flat fit of the same round: the "
        "bytes and the loss are the same in every round, the step time is not."
    )
    return [
        Section(f"Model: {model}", intro, COMMUNICATION_COLUMNS, tuple(rows), f"communication_{model}.png")
        for model, rows in by_model.items()
    ]
