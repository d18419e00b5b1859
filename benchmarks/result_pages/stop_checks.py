"""The results page of ``benchmarks/stop_checks.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Section, record_of, row_of

TITLE = "What agreeing on a stop at every step costs: `benchmarks/stop_checks.py`"
INTRO = (
    "Two CPU ranks of the same speed train the examples' spiral classifier (4 blocks, Adam, ZeRO-0, the equal "
    "split, re-planning off, one torch thread per rank). Before each training step Lightning calls the loop's "
    "`_broadcast_sigterm_tensor`, which the package replaces with the ranks' agreement on a stop (a small "
    "all-reduce). In one fit, 20-step phases take turns: the agreement at every step (as Lightning's broadcast) or "
    "paced (every step until the ranks know their pace, then about once a second, the package's). A round is a pair "
    "of neighbouring phases (the fit's first pair left out): the median wall time between two steps' starts on rank "
    "0 over each phase's second half, and their ratio. The how-to page is "
    "[Fault tolerance](../fault-tolerance.md#preemption)."
)

STOP_COLUMNS = (
    Column("every step / paced, time between step starts", "ratio"),
    Column("every step, ms between step starts", "every_step_ms", ".2f"),
    Column("paced, ms between step starts", "paced_ms", ".2f"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/stop_checks.py``'s runs: one section, a row per run of the script, each figure over every pair
    of phases of its fits."""
    rows = []
    for path in files:
        record = record_of(path)
        pairs = [pair for fit in record["runs"] for pair in fit]
        values = {column.key: [pair[column.key] for pair in pairs] for column in STOP_COLUMNS}
        setting = record["setting"]
        fits = len(record["runs"])
        described = (
            f"width {setting['hidden']}, batch {setting['global_batch']}, {fits} fit{'s' * (fits != 1)} of "
            f"{setting['steps']} steps, {'pinned' if setting['pinned'] else 'not pinned'}"
        )
        rows.append(row_of(path, record, described, values, record.get("note", "")))
    if not rows:
        return []
    intro = (
        "Each round is a pair of phases of one fit, every fit of the run pooled. *every step / paced* over 1 is what "
        "the agreement at every step adds to a step; the milliseconds say how short the steps are (the shorter, the "
        "larger the agreement's share). *pinned*: each rank's threads on a core of its own (`--pin`)."
    )
    return [
        Section(
            "The agreement at every step against the paced one", intro, STOP_COLUMNS, tuple(rows), "stop_checks.png"
        )
    ]
