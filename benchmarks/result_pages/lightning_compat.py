"""The results page of ``benchmarks/lightning_compat/count.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Section, record_of, row_of

SCRIPT = "lightning_compat/count.py"  # (the script and the Lightning tests it runs have a folder of their own)
TITLE = "Lightning's DeepSpeed tests: `benchmarks/lightning_compat/count.py`"
INTRO = (
    "Lightning 2.6.5's own DeepSpeed tests (`test_deepspeed.py` and the DeepSpeed cases of `test_registry.py`, kept "
    "in `benchmarks/lightning_compat/lightning_tests.py`) run against `HeteroStrategy` and, as the reference, against "
    "Lightning's `DeepSpeedStrategy`. The *CPU tests* run as Lightning wrote them; the *moved tests* are the GPU ones "
    "moved to CPU (bf16 for fp16; for DeepSpeedStrategy its three CPU blockers removed), each in a process of its "
    "own. A count is the number of tests that passed (an `xfail` Lightning marks counts as not passed). The notes "
    "give the versions installed (the tests are those of Lightning's 2.6.5 release) and name every test that did not "
    "pass; why each one fails is in [the drop-in page](../drop-in.md)."
)

COLUMNS = (
    Column("CPU tests passed", "cpu_passed", ".0f"),
    Column("CPU tests run", "cpu_run", ".0f"),
    Column("moved tests passed", "moved_passed", ".0f"),
    Column("moved tests run", "moved_run", ".0f"),
)
STRATEGIES = {"hetero": "HeteroStrategy", "deepspeed": "DeepSpeedStrategy (the reference)"}


def counts(outcomes: dict[str, str]) -> tuple[int, int]:
    """How many of ``outcomes`` (test name to pytest's outcome) passed, and how many ran."""
    return sum(outcome == "PASSED" for outcome in outcomes.values()), len(outcomes)


def sections(files: Sequence[Path]) -> list[Section]:
    """One table: a row per counted strategy and run, its failures in the notes."""
    rows = []
    for path in files:
        record = record_of(path)
        cpu_passed, cpu_run = counts(record["cpu"])
        moved_passed, moved_run = counts(record["moved"])
        values = {
            "cpu_passed": [cpu_passed],
            "cpu_run": [cpu_run],
            "moved_passed": [moved_passed],
            "moved_run": [moved_run],
        }
        not_passed = sorted(
            f"`{test}` ({outcome.lower()})"
            for part in ("cpu", "moved")
            for test, outcome in record[part].items()
            if outcome != "PASSED"
        )
        versions = ", ".join(f"{name} {number}" for name, number in record.get("versions", {}).items())
        note = f"{versions}; not passed: {', '.join(not_passed) or 'none'}"
        rows.append(row_of(path, record, STRATEGIES[record["strategy"]], values, note))
    if not rows:
        return []
    return [
        Section(
            "Tests passed, by strategy",
            "Each count is one run of the script (n=1): which tests pass does not change from run to run.",
            COLUMNS,
            tuple(rows),
            "lightning_compat.png",
            reference=None,
        )
    ]
