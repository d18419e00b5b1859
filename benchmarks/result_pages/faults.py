"""The results page of ``benchmarks/faults.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "How soon the others stop after a rank is lost or frozen: `benchmarks/faults.py`"
INTRO = (
    "Two CPU ranks train `tests/workers/fit.py` (ZeRO-2, gloo, micro-batches of 8) under each way of starting them: "
    "*lightning* (Lightning's launcher; rank 0 hosts the rendezvous store), *env* (both ranks started by hand with "
    "env:// variables; rank 0 hosts the store) and *torchrun* (`--standalone`: the agent starts both ranks and hosts "
    "the store). Once both ranks have trained three steps, one process gets SIGKILL (gone) or SIGSTOP (frozen, its "
    "sockets left open): rank 0, rank 1 or the torchrun agent; a case is `launcher:victim:signal`. The survivors are "
    "watched every 50 ms until their processes are gone (a zombie counts as gone); a survivor's figure is the "
    'seconds from the signal to its end, and what it said: 75 when it printed the package\'s "exits with code 75", '
    "else what ended it (Lightning's launcher ending the job, torchrun stopping the workers). The target is every "
    "survivor gone within `peer_timeout` + 2 s (the dashed line). Busy processes run meanwhile as the setting says "
    "(the machine's cores shared with the ranks). The how-to page is "
    "[Fault tolerance](../fault-tolerance.md#lost-and-frozen-ranks)."
)

SECONDS = Column("seconds from the signal to a survivor's end", "seconds", ".1f")
SUMMARY_COLUMNS = (
    SECONDS,
    Column("after a kill (SIGKILL), s", "killed", ".1f"),
    Column("after a freeze (SIGSTOP), s", "frozen", ".1f"),
)


def survivors(record: dict[str, Any], keep: Any = lambda result: True) -> list[tuple[str, Optional[float], str]]:
    """Every survivor of the record's cases that ``keep`` keeps: its case, its seconds (None: still running when the
    watch ended) and what it said."""
    return [
        (result["case"], seconds, result["said"][name])
        for result in record["results"]
        if keep(result)
        for name, seconds in result["seconds"].items()
    ]


def late(found: list[tuple[str, Optional[float], str]], target: float) -> int:
    """How many of ``found`` were still running at ``target`` seconds (or when the watch ended)."""
    return sum(seconds is None or seconds > target for _, seconds, _ in found)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/faults.py``'s runs, by ``peer_timeout``: every survivor of a run together (a row per run of the
    script), then case by case (a row per case of each run), each figure over the survivors of every round."""
    by_timeout: dict[float, tuple[list[Row], list[Row]]] = {}
    for path in files:
        record = record_of(path)
        setting = record["setting"]
        target = setting["target_seconds"]
        every = survivors(record)
        values = {
            "seconds": [seconds for _, seconds, _ in every],
            "killed": [seconds for case, seconds, _ in every if case.endswith(":KILL")],
            "frozen": [seconds for case, seconds, _ in every if case.endswith(":STOP")],
        }
        runs = setting["runs"]
        launchers = "+".join(dict.fromkeys(case.split(":")[0] for case in setting["cases"]))
        described = (
            f"{launchers}, {setting['load']} busy processes, {len(setting['cases'])} cases x {runs} "
            f"run{'s' * (runs != 1)}: "
            f"{late(every, target)} of {len(every)} survivors later than {target:g} s"
        )
        summary, cases = by_timeout.setdefault(setting["peer_timeout"], ([], []))
        summary.append(row_of(path, record, described, values, record.get("note", "")))
        for case in setting["cases"]:
            found = survivors(record, lambda result, case=case: result["case"] == case)
            said = ", ".join(sorted({f"{said}" for _, _, said in found}))
            still = late(found, target)
            described = f"{case}, {setting['load']} busy: said {said}" + (f"; {still} late" if still else "")
            failed = [r for r in record["results"] if r["case"] == case and "error" in r]
            if failed:  # (the job never started training in these rounds: nothing measured there)
                described += f"; {len(failed)} round(s) not started"
            cases.append(row_of(path, record, described, {"seconds": [seconds for _, seconds, _ in found]}))
    result = []
    for timeout, (summary, cases) in sorted(by_timeout.items()):
        name = f"faults_{timeout:g}".replace(".", "_")
        result.append(
            Section(
                f"peer_timeout = {timeout:g} s: every survivor",
                "Every survivor of every case and round of a run (a survivor still running when the watch ended "
                "counts in the setting's late ones, not in the cells). A kill usually breaks the survivors' "
                "collective at once; a freeze is found by the heartbeat watchdog after `peer_timeout`.",
                SUMMARY_COLUMNS,
                tuple(summary),
                f"{name}.png",
                reference=timeout + 2,
            )
        )
        result.append(
            Section(
                f"peer_timeout = {timeout:g} s: case by case",
                "A row per case of a run: the case's survivors over the run's rounds (under torchrun, a lost agent "
                "leaves two survivors), and what they said (75: the package's exit).",
                (SECONDS,),
                tuple(cases),
                f"{name}_cases.png",
                reference=timeout + 2,
            )
        )
    return result
