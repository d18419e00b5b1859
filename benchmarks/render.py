"""Render the committed benchmark results into the docs' results pages: a table per benchmark form and a strip plot of
every paired round's ratio, from the JSON the scripts wrote (``benchmarks/measured/<script>_*.json``, every run, the
machine, the commit, the date and the command).

    python benchmarks/render.py           # writes docs/results/<script>.md and docs/images/results/<script>_*.png
    python benchmarks/render.py --check   # exits 1 where a committed page differs from what its JSON renders to

A table cell is one ratio over the paired rounds of one run of a script: ``median [min-max], n``. The pages are
generated: edit the JSON's script (or this renderer), never the page; the test suite runs ``--check``
(tests/test_results_pages.py), so a page cannot drift from the JSON it quotes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "measured"
PAGES = ROOT / "docs" / "results"
IMAGES = ROOT / "docs" / "images" / "results"


def cell(values: Sequence[float]) -> str:
    """``median [min-max], n`` of the finite ``values`` (a ratio's rounds); "-" where there is none."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    if not finite:
        return "-"
    return f"{statistics.median(finite):.3f} [{min(finite):.3f}-{max(finite):.3f}], n={len(finite)}"


@dataclass(frozen=True)
class Column:
    """One ratio of a results table: its heading and where each run's list of per-round values is in the JSON."""

    heading: str
    key: str


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
    """A heading, what its figures mean, its columns (the first is the strip plot's) and its rows, oldest first."""

    title: str
    intro: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    plot: str  # the strip plot's file name under docs/images/results/


# ------------------------------------------------------------------------------------------ benchmarks/throttled.py

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


def throttled_sections(files: Sequence[Path]) -> list[Section]:
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


# ------------------------------------------------------------------------------------------ benchmarks/throughput.py

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
}


def throughput_sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/throughput.py``'s runs: a section per scenario, a row per run of the script."""
    rows: dict[str, list[Row]] = {name: [] for name in THROUGHPUT_SCENARIOS}
    for path in files:
        record = json.loads(path.read_text())
        for name, runs in record["results"].items():
            columns = THROUGHPUT_SCENARIOS[name][2]
            values = {column.key: [_dotted(run, column.key) for run in runs] for column in columns}
            date = record.get("started", "")[:10]
            rows[name].append(Row(path.name, record.get("commit", ""), date, name, values, record.get("note", "")))
    return [
        Section(title, intro, columns, tuple(rows[name]), f"throughput_{name}.png")
        for name, (title, intro, columns) in THROUGHPUT_SCENARIOS.items()
        if rows[name]
    ]


# ------------------------------------------------------------------------------ benchmarks/pipeline_balance.py

PIPELINE_COLUMNS = (
    Column("equal / placed, step", "equal_over_placed"),
    Column("equal / placed, slowest stage's compute", "slowest_stage_equal_over_placed"),
    Column("placed balance", "placed_balance"),
)


def pipeline_balance_sections(files: Sequence[Path]) -> list[Section]:
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


# ------------------------------------------------------------------------------ benchmarks/communication.py

COMMUNICATION_COLUMNS = (
    Column("step time / none flat", "step_seconds"),
    Column("bytes between nodes / none flat", "inter_node_bytes_per_step"),
    Column("final loss / none flat", "final_loss"),
)


def communication_sections(files: Sequence[Path]) -> list[Section]:
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


def _dotted(record: dict, key: str) -> float:
    for part in key.split("."):
        record = record[part]
    return float(record)  # type: ignore[arg-type]


def _emulated_speed(command: str) -> str:
    words = command.split()
    return words[words.index("--emulated-speed") + 1] if "--emulated-speed" in words else "0.4"


SCRIPTS = {
    "communication": (
        "Compression and hierarchical reduction: `benchmarks/communication.py`",
        "What fp16 on the wire, PowerSGD and top-k under the error bound (and PowerSGD at a fixed rank 1, without it) "
        "and hierarchical reduction save between two emulated nodes, and what they cost in loss. The model is an MLP "
        "256-1024-1024-10 (1.3 M parameters) with Adam on a teacher-labelled task; the script's docstring says how "
        "each figure is taken. The how-to page is [Communication](../communication.md).",
        communication_sections,
    ),
    "pipeline_balance": (
        "A pipeline placed by speed: `benchmarks/pipeline_balance.py`",
        "Two CPU ranks, rank 1 emulated at 0.4 of rank 0's speed (`emulate_speeds=[1.0, 0.4]`), train a chain of 8 "
        "equal blocks (Linear 1024 and tanh) as a 2-stage pipeline, 1F1B with 4 micro-batches of 16 samples, 50 "
        "steps per fit, measured over steps 25-49. What the script does, and why, is in its docstring; the how-to "
        "page is [Pipeline parallelism](../pipeline.md).",
        pipeline_balance_sections,
    ),
    "throughput": (
        "The split against the equal one: `benchmarks/throughput.py`",
        "ZeRO-2 on CPU with gloo, one intra-op thread per rank, a global batch of 512, 240 steps per fit, an MLP whose "
        "256-wide hidden layer is applied 4 times (much compute per sample, few parameters), Adam. Each run of the "
        "script fits every scenario's variants back to back; a cell is a ratio over the script's runs. What is "
        "measured, and why, is in the repository's `benchmarks/README.md` and in [Benchmarks](../benchmarks.md).",
        throughput_sections,
    ),
    "throttled": (
        "A rank slowed everywhere: `benchmarks/throttled.py`",
        "Two CPU ranks, each pinned to a core of its own, train a 64-512-512-10 MLP with AdamW on a global batch "
        "of 512; rank 1 is slowed in the way each section says. A fit's figure is the median (or mean) wall time of "
        "its steps after the first 40; a round's ratio compares two fits run back to back. What the script does, "
        "and why, is in its docstring; the discussion is in "
        "[Benchmarks](../benchmarks.md#a-rank-slowed-everywhere-a-cpu-quota).",
        throttled_sections,
    ),
}

# ------------------------------------------------------------------------------------------ rendering


def script_of(name: str) -> str:
    """The script a measured file belongs to: the longest script name its file name starts with, then ``_``
    ("" for none)."""
    owners = [script for script in SCRIPTS if name.startswith(script + "_")]
    return max(owners, key=len, default="")


def measured_files(script: str) -> list[Path]:
    """``script``'s committed JSON files, oldest run first."""
    files = [path for path in MEASURED.glob(f"{script}_*.json") if script_of(path.name) == script]
    return sorted(files, key=lambda path: (json.loads(path.read_text()).get("started", ""), path.name))


def sections_of(script: str) -> list[Section]:
    """The sections of ``script``'s page, from its committed JSON, oldest run first."""
    return SCRIPTS[script][2](measured_files(script))


def page(script: str, sections: Sequence[Section]) -> str:
    """The Markdown page of ``script``'s results."""
    title, intro, _ = SCRIPTS[script]
    lines = [
        f"# {title}",
        "",
        "<!-- Generated by `python benchmarks/render.py` from benchmarks/measured/; do not edit. -->",
        "",
        intro,
        "",
        "Each cell is one ratio over a run's paired rounds: **median [min-max], n rounds**. The newest run of a "
        "section measures the code as it is; the older ones, the code at their commit.",
        "",
    ]
    for section in sections:
        lines += [f"## {section.title}", "", section.intro, ""]
        headings = [column.heading for column in section.columns]
        lines.append("| run | commit | date | setting | " + " | ".join(headings) + " |")
        lines.append("|---|---|---|---|" + "---|" * len(headings))
        for row in section.rows:
            cells = [cell(row.values.get(column.key, [])) for column in section.columns]
            lines.append(
                f"| `{row.file}` | {row.commit or '-'} | {row.date} | {row.setting} | " + " | ".join(cells) + " |"
            )
        lines += ["", f"![Every round's {section.columns[0].heading}](../images/results/{section.plot})", ""]
        notes = [f"- `{row.file}`: {row.note}" for row in section.rows if row.note]
        if notes:
            lines += ["Notes the runs recorded:", "", *notes, ""]
    lines += ["## Commands", ""]
    for path in measured_files(script):
        lines.append(f"- `{path.name}`: `{json.loads(path.read_text())['command']}`")
    return "\n".join(lines) + "\n"


def strip_plot(section: Section, path: Path) -> None:
    """Every round's value of the section's first column, a row per run, its median marked; a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = section.columns[0].key
    rows = list(section.rows)
    figure, axes = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.2))
    for index, row in enumerate(rows):
        values = [value for value in row.values.get(key, []) if value is not None and math.isfinite(value)]
        axes.scatter(values, [index] * len(values), s=18, alpha=0.7, color="tab:blue")
        if values:
            axes.plot([statistics.median(values)] * 2, [index - 0.3, index + 0.3], color="black", linewidth=2)
    axes.axvline(1.0, color="grey", linewidth=0.8, linestyle="--")
    labels = [f"{row.commit or row.file.removesuffix('.json')} {row.setting.split(',')[0]}" for row in rows]
    axes.set_yticks(range(len(rows)), labels)
    axes.set_xlabel(f"{section.columns[0].heading} (each round; bar: median)")
    axes.set_title(section.title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)


def rendered_pages() -> dict[Path, str]:
    """Every script's page, by its path, as the committed JSON renders it."""
    return {PAGES / f"{script}.md": page(script, sections_of(script)) for script in SCRIPTS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare the committed pages; write nothing")
    args = parser.parse_args()
    stale = []
    for path, text in rendered_pages().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        for section in sections_of(path.stem):
            strip_plot(section, IMAGES / section.plot)
        print(f"wrote {path.relative_to(ROOT)} and its plots")
    if stale:
        names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
        print(f"stale: {names}; run `python benchmarks/render.py` and commit the pages")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
