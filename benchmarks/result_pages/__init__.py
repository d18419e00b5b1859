"""The results pages' pieces: a table cell, a column, a row, a section; and the page of each benchmark script, one
module here per script (``result_pages/<script>.py``, found by ``benchmarks/render.py``), each with

    TITLE        the page's heading
    INTRO        what the script runs, in a paragraph
    sections     ``sections(files) -> list[Section]``: the page's tables from the script's committed JSON files
                 (``benchmarks/measured/<script>_*.json``), oldest run first

A cell holds one figure over the rounds of one run: ``median [min-max], n``. Most figures are ratios of two fits run
back to back (a line at 1 in the strip plot); a section of absolute figures (seconds, differences) says so with
``reference=None``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


def cell(values: Sequence[Optional[float]], form: str = ".3f") -> str:
    """``median [min-max], n`` of the finite ``values`` (a figure's rounds), each written with ``form``; the value
    alone with ``n=1`` where there is one; "-" where there is none."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    if not finite:
        return "-"
    if len(finite) == 1:  # (one fit, one case: no range to give)
        return f"{finite[0]:{form}}, n=1"
    median, low, high = statistics.median(finite), min(finite), max(finite)
    return f"{median:{form}} [{low:{form}}-{high:{form}}], n={len(finite)}"


@dataclass(frozen=True)
class Column:
    """One figure of a results table: its heading, where each run's list of per-round values is in the JSON, and how
    a value is written (``.3f`` for ratios; ``.1e`` for a parameter difference, ``.2f`` for seconds)."""

    heading: str
    key: str
    form: str = ".3f"


@dataclass(frozen=True)
class Row:
    """One table row: a run of a script (its file, commit, date) at one setting, and each column's per-round values."""

    file: str
    commit: str
    date: str
    setting: str
    values: dict[str, list[float]]
    note: str = ""


@dataclass(frozen=True)
class Section:
    """A heading, what its figures mean, its columns (the first is the strip plot's) and its rows, oldest first.
    ``reference`` is the strip plot's dashed line (1 for a ratio; None for absolute figures); ``log`` puts the plot's
    axis on a log scale (for figures spread over decades, as parameter differences)."""

    title: str
    intro: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    plot: str  # the strip plot's file name under docs/images/results/
    reference: Optional[float] = 1.0
    log: bool = False


def dotted(record: dict, key: str) -> float:
    """The number at ``key`` in ``record``, ``a.b`` meaning ``record["a"]["b"]``."""
    for part in key.split("."):
        record = record[part]
    return float(record)  # type: ignore[arg-type]


def record_of(path: Path) -> dict[str, Any]:
    """A measured file's record."""
    return json.loads(path.read_text())


def row_of(path: Path, record: dict[str, Any], setting: str, values: dict[str, list[float]], note: str = "") -> Row:
    """The row of ``record`` (read from ``path``) at ``setting``: its file, commit and date from the run's facts."""
    return Row(path.name, record.get("commit", ""), record.get("started", "")[:10], setting, values, note)
