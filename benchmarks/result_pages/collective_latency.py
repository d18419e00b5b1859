"""The results page of ``benchmarks/collective_latency.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "What one exchange costs a late rank: `benchmarks/collective_latency.py`"
INTRO = (
    "Plain torch, without the package: two processes (gloo on 127.0.0.1, one intra-op thread each) repeat a round in "
    "which rank 0 computes for 4 ms (a busy loop standing in for forward and backward), rank 1 arrives 5 ms late "
    "(asleep, as a loader stall), and both all-reduce 80 KiB of float32 (the defaults; each row says its own). The "
    "figure is the late rank's wall time in the all-reduce, every round after 50 of warm-up: the exchange itself "
    "plus any delay in waking the rank that arrived first and blocked waiting for it. *waiter*: rank 0 waits for "
    "the late rank; *no waiter*: the control, rank 0 sleeps as long, so neither waits long for the other; "
    "*pinned*: each rank's threads on a core of its own (as two hosts); *unpinned*: the scheduler places them; "
    "*cores kept awake*: an idle-priority busy loop on every core (`benchmarks/awake.py`). This is the per-step "
    "cost that `benchmarks/data_stall.py`'s split cannot move; the how-to page is [The run report](../run-report.md)."
)

COLUMNS = (
    Column("late rank's all-reduce, ms", "exchange_ms", ".2f"),
    Column("90th percentile, ms", "p90_ms", ".2f"),
    Column("share of exchanges over 2 ms", "share_over_2ms", ".2f"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/collective_latency.py``'s runs: one section, a row per setting of each run of the script (its
    rounds the late rank's exchanges; the 90th percentile and the share over 2 ms are one figure per setting)."""
    rows: list[Row] = []
    for path in files:
        record = record_of(path)
        held = record["setting"]
        awake = " (cores kept awake)" if held.get("cores_kept_awake") else ""
        for index, (name, result) in enumerate(record["results"].items()):
            setting = (
                f"{name.replace(',', '')}{awake}, {held['kib']} KiB, {held['busy_ms']:g} ms busy, "
                f"{held['late_ms']:g} ms late, {held['rounds']} rounds"
            )
            values = {
                "exchange_ms": result["exchange_ms"],
                "p90_ms": [result["p90_ms"]],
                "share_over_2ms": [result["share_over_2ms"]],
            }
            rows.append(row_of(path, record, setting, values, record.get("note", "") if index == 0 else ""))
    if not rows:
        return []
    intro = (
        "A cell of the first column is the late rank's all-reduce over every measured round of one setting; the "
        "90th percentile and the share of exchanges over 2 ms are the script's figures, one per setting. The plot "
        "shows every exchange, on a log scale."
    )
    return [
        Section(
            "The late rank's all-reduce",
            intro,
            COLUMNS,
            tuple(rows),
            "collective_latency.png",
            reference=None,
            log=True,
        )
    ]
