"""A profiler trace of 3 steps on 2 ranks (HeteroStrategy(trace=...)): the files, the phases, and the wait."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import run_fit  # noqa: E402

pytestmark = pytest.mark.multiprocess

TRACED = [4, 5, 6]
PHASES = (
    "fetch the batch",
    "training_step (forward)",
    "backward",
    "exchange: all_reduce",
    "optimizer step",
    "optimizer update",
)


def test_a_trace_of_three_steps_puts_both_ranks_on_one_timeline_with_the_phases_and_the_reports_wait(tmp_path):
    """Rank 1 emulates a device 20x slower. Each rank writes its Chrome trace beside the run report; rank 0 merges
    them into one file, one process per rank on one time axis, which the report and its line name. The package's
    phases are named on both ranks, inside the traced steps only. The fast rank's time in the exchange's collectives
    (where it waits for the slow one) matches the run report's wait for it over the same steps within 10 %: the
    report's also holds the host's work after backward, small beside that wait."""
    run = run_fit(
        tmp_path,
        "--samples",
        "160",
        "--batch-sizes",
        "8",
        "8",
        "--emulate-speeds",
        "1.0",
        "0.05",
        "--hidden",
        "64",
        "--strategy-args",
        json.dumps({"trace": {"steps": TRACED}}),
    )
    assert run.returncode == 0, run.output[-4000:]
    directory = tmp_path / "hetero"
    report = json.loads((directory / "report.json").read_text())
    assert report["traces"] == {
        "ranks": ["trace_rank_0.json", "trace_rank_1.json"],
        "merged": "trace_all_ranks.json",
        "steps": TRACED,
    }
    assert "a profiler trace of steps [4, 5, 6]: trace_all_ranks.json (every rank on one timeline" in run.output
    assert "profiler_start" not in run.output  # (the profiler's own line on stderr, at its start)
    merged = json.loads((directory / "trace_all_ranks.json").read_text())  # valid JSON, as Perfetto reads it
    names = {event["args"]["name"] for event in merged["traceEvents"] if event.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1"}
    ours = [event for event in merged["traceEvents"] if event.get("name", "").startswith("hetero: ")]
    for rank in (0, 1):
        for phase in PHASES:
            spans = [e for e in ours if e["pid"] == rank and e["name"].startswith(f"hetero: {phase}")]
            assert len(spans) >= len(TRACED), (rank, phase)
    for rank in (0, 1):  # the update (DeepSpeed's step, after the closure) is named inside Lightning's optimizer step
        steps = [e for e in ours if e["pid"] == rank and e["name"].startswith("hetero: optimizer step")]
        for update in (e for e in ours if e["pid"] == rank and e["name"].startswith("hetero: optimizer update")):
            assert any(s["ts"] <= update["ts"] and update["ts"] + update["dur"] <= s["ts"] + s["dur"] for s in steps)
    fetches = sorted(e["ts"] for e in ours if e["pid"] == 0 and e["name"].startswith("hetero: fetch"))
    assert len(fetches) == len(TRACED)  # one per traced step, no other step recorded
    for rank in (0, 1):  # each rank's own file is a valid trace too, marked with its rank and steps
        own = json.loads((directory / f"trace_rank_{rank}.json").read_text())
        assert own["hetero"] == {"rank": rank, "steps": TRACED} and own["traceEvents"]
    exchange = collections.defaultdict(float)
    for event in ours:
        if event["name"].startswith("hetero: exchange"):
            exchange[event["pid"]] += event["dur"] / 1e6
    waited = [sum(report["steps"][step]["wait_seconds"][rank] for step in TRACED) for rank in (0, 1)]
    print(f"fast rank: {exchange[0] * 1e3:.1f} ms in the exchange (trace), {waited[0] * 1e3:.1f} ms waiting (report)")
    assert waited[0] > 2 * waited[1]  # it is the fast rank that waits
    assert exchange[0] == pytest.approx(waited[0], rel=0.10)
