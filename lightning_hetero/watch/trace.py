"""Watch: a profiler trace of chosen training steps on every rank (``HeteroStrategy(trace={"steps": [...]})``).

Each rank records the chosen steps with ``torch.profiler`` (CPU, and CUDA on a GPU), from the fetch of the first to
the end of the last, with the package's phases named (:mod:`lightning_hetero.runtime.tracing`), and writes
``trace_rank_<r>.json`` (Chrome trace format, which Perfetto and ``chrome://tracing`` open) beside the run report.
At the end of the fit rank 0 puts every rank's file it can read into ``trace_all_ranks.json``, one process per rank
on one time axis (the ranks' clocks are the host's: on several hosts they are as close as the hosts' clocks), so one
timeline shows who waits for whom; the run report lists the files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hetero.runtime import quiet, tracing
from lightning_hetero.runtime.checks import is_int

TRACE_KEYS = ("steps",)
MAX_TRACED_STEPS = 50  # a trace grows with every step: a few steps show the pattern
MERGED_NAME = "trace_all_ranks.json"
_ID_STRIDE = 1 << 40  # each rank's flow ids moved into a range of their own (every rank's count from similar values)


def check_trace(trace: Any, pipeline: Any = None) -> Optional[tuple[int, ...]]:
    """Constructor check of ``trace``: None, or ``{"steps": [...]}`` with training step indices (0 is the fit's first
    step), each at most once. Returns the steps, sorted."""
    if trace is None:
        return None
    if pipeline is not None:
        raise ValueError(
            f"`trace={trace!r}` with `pipeline=...`: a pipeline's stages run their own schedule, which the trace does"
            " not follow yet. Drop `trace` (or profile a pipeline with torch.profiler around `trainer.fit`)."
        )
    example = "e.g. `trace={'steps': [20, 21, 22]}` (training steps of the fit, counted from 0)"
    if not isinstance(trace, dict) or set(trace) - set(TRACE_KEYS) or "steps" not in trace:
        raise ValueError(f"`trace={trace!r}` must be a dict with the key 'steps': {example}.")
    steps = trace["steps"]
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence) or not steps:
        raise ValueError(f"`trace['steps']={steps!r}` must be a non-empty list of step indices: {example}.")
    bad = [step for step in steps if not is_int(step) or step < 0]
    if bad or len(set(steps)) != len(steps) or len(steps) > MAX_TRACED_STEPS:
        raise ValueError(
            f"`trace['steps']={list(steps)}` must hold distinct whole numbers >= 0 (training steps of the fit,"
            f" counted from 0), at most {MAX_TRACED_STEPS} of them: {example}."
        )
    return tuple(sorted(int(step) for step in steps))


class StepTracer:
    """Starts ``torch.profiler`` before the first chosen step and stops it after the last, on this rank.

    Told by the watch when a step opens and closes (``index``: the fit's training step, from 0); ``directory`` and
    ``rank`` are set when the fit's plan is written. Steps between the first and the last chosen one are recorded
    too (the profiler runs through them), and marked in the file's metadata.
    """

    def __init__(self, steps: tuple[int, ...], device: torch.device) -> None:
        self.steps = steps
        self.device = device
        self.directory: Optional[Path] = None
        self.rank = 0
        self.written: Optional[Path] = None
        self.recorded: list[int] = []  # the steps recorded (fewer than chosen when the fit ends first)
        self._profiler: Optional[torch.profiler.profile] = None

    def step_opens(self, index: int) -> None:
        if index == self.steps[0] and self._profiler is None and self.written is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            # Kineto prints its stages from C++ on stderr. Only the start is silenced: a peer watchdog's last line
            # may come during a stop, which takes longer.
            with quiet.native_stderr_silenced():
                self._profiler.start()
            tracing.start_recording(nvtx=self.device.type == "cuda")
        if self._profiler is not None:
            self.recorded.append(index)

    def step_closed(self, index: int) -> None:
        if index == self.steps[-1]:
            self.stop()

    def stop(self) -> None:
        """Stop recording (at the last chosen step's end, or the fit's) and write this rank's file."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        tracing.stop_recording()
        profiler.stop()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"trace_rank_{self.rank}.json"
            profiler.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            trace["hetero"] = {"rank": self.rank, "steps": self.recorded}
            path.write_text(json.dumps(trace))
            self.written = path


def merge_rank_traces(traces: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's trace on one time axis: each event's time made absolute (``ts`` is microseconds after the file's
    ``baseTimeNanoseconds``), measured from the earliest, and each rank one process (``pid`` = its rank), named."""
    starts = [
        _base_microseconds(trace) + min((e["ts"] for e in trace["traceEvents"] if "ts" in e), default=0.0)
        for trace in traces
    ]
    origin = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    for trace in traces:
        rank, shift = trace["hetero"]["rank"], _base_microseconds(trace) - origin
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for event in trace["traceEvents"]:
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index"):
                continue
            moved = {**event, "pid": rank}
            if "ts" in moved:
                moved["ts"] = moved["ts"] + shift
            if isinstance(moved.get("id"), int):  # flow arrows (a launch to its kernel) stay inside their rank
                moved["id"] = moved["id"] + rank * _ID_STRIDE
            events.append(moved)
    steps = traces[0]["hetero"]["steps"] if traces else []
    ranks = [trace["hetero"]["rank"] for trace in traces]
    return {"traceEvents": events, "displayTimeUnit": "ms", "hetero": {"ranks": ranks, "steps": steps}}


def _base_microseconds(trace: dict[str, Any]) -> float:
    return float(trace.get("baseTimeNanoseconds", 0)) / 1e3


def write_merged(directory: Path, world_size: int, chosen: Sequence[int] = ()) -> dict[str, Any]:
    """Rank 0 at the end of the fit: the ranks' files it finds, merged. The report's ``"traces"`` section; without
    any file (the fit ended before the first ``chosen`` step), what was asked for."""
    found = [directory / f"trace_rank_{rank}.json" for rank in range(world_size)]
    readable = [path for path in found if path.is_file()]
    if not readable:
        return {"requested": list(chosen), "steps": []}
    section: dict[str, Any] = {"ranks": [path.name for path in readable]}
    missing = [path.name for path in found if not path.is_file()]
    if missing:
        section["missing"] = missing  # (their ranks wrote them on another host's disk)
    merged = merge_rank_traces([json.loads(path.read_text()) for path in readable])
    (directory / MERGED_NAME).write_text(json.dumps(merged))
    section["merged"] = MERGED_NAME
    section["steps"] = merged["hetero"]["steps"]
    return section


def traces_text(section: Optional[dict[str, Any]], trained_steps: int = 0) -> str:
    if section and "requested" in section:
        return (
            f"; no profiler trace: the fit trained {trained_steps} steps, before step {section['requested'][0]} of"
            f" `trace={{'steps': {section['requested']}}}` (steps count from 0 in each fit)"
        )
    if not section or "merged" not in section:
        return ""
    missing = f" ({', '.join(section['missing'])} not found here)" if section.get("missing") else ""
    return (
        f"; a profiler trace of steps {section['steps']}: {section['merged']} (every rank on one timeline; open it in"
        f" https://ui.perfetto.dev) and {', '.join(section['ranks'])}{missing}"
    )
