"""The results page of ``benchmarks/throttled.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "A rank slowed everywhere: `benchmarks/throttled.py`"
INTRO = (
    "Two CPU ranks, each pinned to a core of its own, train a 64-512-512-10 MLP with AdamW on a global batch "
    "of 512; rank 1 is slowed in the way each section says. A fit's figure is the median (or mean) wall time of "
    "its steps after the first 40; a round's ratio compares two fits run back to back. What the script does, "
    "and why, is in its docstring; the discussion is in "
    "[Benchmarks](../benchmarks.md#a-rank-slowed-everywhere-a-cpu-quota)."
)

THROTTLED_SPLIT = (
    Column("auto / best fixed, median step", "auto_over_best"),
    Column("DDP / auto, median step", "ddp_over_auto"),
    Column("auto / best fixed, mean step", "mean_auto_over_best"),
    Column("DDP / auto, mean step", "mean_ddp_over_auto"),
)
THROTTLED_REGRESSION = (
    Column("now / before, median step", "now_over_before"),
    Column("now / before, mean step", "mean_now_over_before"),
)
THROTTLED_FORMS = {
    "quota": (
        "Rank 1 under a CPU quota",
        "Rank 1's whole process held by the kernel's CFS quota to the given share of its core (1.0: identical ranks, "
        "no quota), the package not told. Each round runs the automatic split, Lightning's DDP and the best fixed "
        "split a sweep found, back to back. *auto / best fixed* under 1 is better than any fixed split; *DDP / auto* "
        "over 1 is the speedup over DDP.",
    ),
    "intermittent": (
        "A quota that comes and goes",
        "Rank 1 held to 40 % of its core from step 100 to step 300 only.",
    ),
    "neighbour": (
        "A busy neighbour on rank 1's core",
        "A busy process shares rank 1's core (the limit column gives the share left to rank 1).",
    ),
    "emulated": (
        "The package's own process emulation",
        'Rank 1 slowed by `HeteroStrategy(emulate_speeds=[1.0, limit], emulate_slowdown="process")` in the automatic '
        "and fixed fits (DDP's fit gets the script's quota, the same kernel mechanism).",
    ),
    "sends": (
        "The package's own slow-link emulation",
        'Rank 1\'s sends held back by `emulate_slowdown="sends"`: a delay no split removes. DDP cannot be slowed so: '
        "no DDP column.",
    ),
}


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/throttled.py``'s runs: a section per form (``--form``), and the regression runs
    (``--regression``: the automatic split under `emulate_speeds`, this checkout against an older one)."""
    by_form: dict[str, list[Row]] = {form: [] for form in THROTTLED_FORMS}
    regression: list[Row] = []
    quota_regression: list[Row] = []
    for path in files:
        record = json.loads(path.read_text())
        date = record.get("started", "")[:10]
        note = record.get("note", "")
        if "regression" in record:
            commit = record.get("commit", "")
            if record.get("before_commit"):
                commit = f"{commit} vs {record['before_commit']}"
            values = {column.key: record.get(column.key, []) for column in THROTTLED_REGRESSION}
            if record.get("regression_limit") is not None:
                setting = f"quota {record['regression_limit']}"
                quota_regression.append(Row(path.name, commit, date, setting, values, note))
                continue
            speed = _emulated_speed(record["command"])
            regression.append(Row(path.name, commit, date, f"speeds [1.0, {speed}]", values, note))
            continue
        for limit, result in record["limits"].items():
            values = {column.key: result.get(column.key, []) for column in THROTTLED_SPLIT}
            setting = f"limit {limit}, best fixed {result['best_fixed'].removeprefix('fixed:')}"
            by_form[record["form"]].append(Row(path.name, record.get("commit", ""), date, setting, values, note))
    sections = [
        Section(title, intro, THROTTLED_SPLIT, tuple(by_form[form]), f"throttled_{form}.png")
        for form, (title, intro) in THROTTLED_FORMS.items()
        if by_form[form]
    ]
    if regression:
        intro = (
            "Under the package's own `emulate_speeds` (compute stretched per sample, no quota), the automatic split "
            "of this checkout (*now*) against an older one (*before*: the package before issue 52's work), in pairs "
            "of fits run back to back in alternating order. Under 1 is faster now."
        )
        sections.append(
            Section(
                "emulate_speeds against the package before",
                intro,
                THROTTLED_REGRESSION,
                tuple(regression),
                "throttled_regression.png",
            )
        )
    if quota_regression:
        intro = (
            "Rank 1 held by the CPU quota, the automatic split of this checkout (*now*) against an older one "
            "(*before*), in pairs of fits run back to back in alternating order: where separate runs of the sweep "
            "cannot tell two versions apart. Under 1 is faster now."
        )
        sections.append(
            Section(
                "The quota: the package against an older version",
                intro,
                THROTTLED_REGRESSION,
                tuple(quota_regression),
                "throttled_quota_regression.png",
            )
        )
    return sections


def _emulated_speed(command: str) -> str:
    words = command.split()
    return words[words.index("--emulated-speed") + 1] if "--emulated-speed" in words else "0.4"
