"""The results page of ``benchmarks/throughput.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section, dotted

TITLE = "The split against the equal one: `benchmarks/throughput.py`"
INTRO = (
    "ZeRO-2 on CPU with gloo, one intra-op thread per rank, a global batch of 512, 240 steps per fit, an MLP whose "
    "256-wide hidden layer is applied 4 times (much compute per sample, few parameters), Adam. Each run of the "
    "script fits every scenario's variants back to back; a cell is a ratio over the script's runs. What is "
    "measured, and why, is in the repository's `benchmarks/README.md` and in [Benchmarks](../benchmarks.md)."
)

THROUGHPUT_SCENARIOS = {
    "2-emulated": (
        "Two ranks, one emulated 2.5x slower",
        "`emulate_speeds=[1.0, 0.4]`: the automatic split (profiled, re-planned every 20 steps) against the equal "
        "split (DDP's), two fits per run in alternating order. *auto / equal* is samples per second over the steady "
        "steps; *auto / ideal* is, within each step, the perfectly balanced step over the measured one (1 is ideal).",
        (
            Column("auto / equal, samples/s", "auto_over_equal"),
            Column("auto / ideal", "auto.ideal_ratio"),
            Column("equal / ideal", "equal.ideal_ratio"),
        ),
    ),
    "2-identical": (
        "Two identical ranks",
        "No emulation: what the automatic split costs where there is nothing to balance (1 is no cost).",
        (Column("auto / equal, samples/s", "auto_over_equal"), Column("auto / ideal", "auto.ideal_ratio")),
    ),
    "2-drift": (
        "A rank that slows mid-run",
        "Rank 1 drops to speed 0.4 at step 100: *auto / ideal* from 50 steps after the drift.",
        (Column("auto / ideal after the drift", "auto.ideal_ratio"),),
    ),
    "4-emulated": (
        "Four ranks on two cores",
        "`emulate_speeds=[1.0, 1.0, 0.5, 0.25]`, four ranks sharing two cores.",
        (Column("auto / equal, samples/s", "auto_over_equal"), Column("auto / ideal", "auto.ideal_ratio")),
    ),
    "2-memory": (
        "A fast rank with little memory",
        "`emulate_speeds=[1.0, 0.4]`, rank 0's memory emulated to 128 samples: automatic micro-steps against the "
        "split capped at what fits in one.",
        (Column("micro-steps / capped, samples/s", "micro_over_capped"),),
    ),
    "2-precision": (
        "bf16 beside fp32 on one CPU",
        'No emulation: `device_precision=["bf16-mixed", "32-true"]`, rank 0 under bf16 autocast, rank 1 in '
        "fp32, on this CPU (AVX512-BF16, no AMX). The automatic split against the equal one, two fits per run in "
        "alternating order. *slowest compute, equal / auto* is the slowest rank's compute per step, median over the "
        "steady steps, of the equal fit over the automatic one (above 1: the split took work off the slowest rank).",
        (
            Column("auto / equal, samples/s", "auto_over_equal"),
            Column("slowest compute, equal / auto", "equal_over_auto_slowest_compute"),
            Column("auto / ideal", "auto.ideal_ratio"),
            Column("equal / ideal", "equal.ideal_ratio"),
        ),
    ),
}


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/throughput.py``'s runs: a section per scenario, a row per run of the script."""
    rows: dict[str, list[Row]] = {name: [] for name in THROUGHPUT_SCENARIOS}
    for path in files:
        record = json.loads(path.read_text())
        for name, runs in record["results"].items():
            columns = THROUGHPUT_SCENARIOS[name][2]
            values = {column.key: [dotted(run, column.key) for run in runs] for column in columns}
            date = record.get("started", "")[:10]
            rows[name].append(Row(path.name, record.get("commit", ""), date, name, values, record.get("note", "")))
    return [
        Section(title, intro, columns, tuple(rows[name]), f"throughput_{name}.png")
        for name, (title, intro, columns) in THROUGHPUT_SCENARIOS.items()
        if rows[name]
    ]
