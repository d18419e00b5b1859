"""The profiler trace (lightning_hetero.watch.trace, lightning_hetero.runtime.tracing), in one process."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_hetero.runtime import tracing
from lightning_hetero.watch.trace import (
    MERGED_NAME,
    StepTracer,
    check_trace,
    merge_rank_traces,
    traces_text,
    write_merged,
)


@pytest.mark.parametrize(
    "value, message",
    [
        ([20, 21], r"`trace=\[20, 21\]` must be a dict with the key 'steps'"),
        ({"step": [1]}, r"`trace=\{'step': \[1\]\}` must be a dict with the key 'steps'"),
        ({"steps": [1], "ranks": [0]}, r"must be a dict with the key 'steps'"),
        ({"steps": []}, r"`trace\['steps'\]=\[\]` must be a non-empty list"),
        ({"steps": "20"}, r"`trace\['steps'\]='20'` must be a non-empty list"),
        ({"steps": [3, 3]}, r"`trace\['steps'\]=\[3, 3\]` must hold distinct whole numbers >= 0"),
        ({"steps": [-1]}, r"must hold distinct whole numbers >= 0"),
        ({"steps": [1.5]}, r"must hold distinct whole numbers >= 0"),
        ({"steps": list(range(51))}, r"at most 50 of them"),
    ],
)
def test_bad_trace_arguments_are_named_with_an_example(value, message):
    with pytest.raises(ValueError, match=message):
        check_trace(value)


def test_a_trace_with_a_pipeline_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"with `pipeline=...`: a pipeline's stages run their own schedule"):
        check_trace({"steps": [1]}, pipeline={"stages": 2})


def test_good_trace_arguments_give_the_sorted_steps():
    assert check_trace(None) is None
    assert check_trace({"steps": [22, 20, 21]}) == (20, 21, 22)


def test_a_phase_is_a_no_op_outside_a_recording_and_a_named_range_inside_one(tmp_path):
    assert not tracing.recording()
    with tracing.phase("backward"):  # nothing to record: no profiler, no error
        pass
    assert tracing.open_span("x") is None
    tracer = StepTracer((1, 2), torch.device("cpu"))
    tracer.directory, tracer.rank = tmp_path, 3
    for index in range(4):  # the watch opens and closes each step
        tracer.step_opens(index)
        assert tracing.recording() == (index in (1, 2))
        with tracing.phase(f"step {index}"):
            torch.ones(4) * 2
        span = tracing.open_span("fetch")
        if span is not None:
            span.end()
        tracer.step_closed(index)
    assert tracer.written == tmp_path / "trace_rank_3.json" and not tracing.recording()
    trace = json.loads(tracer.written.read_text())
    names = [event["name"] for event in trace["traceEvents"]]
    assert "hetero: step 1" in names and "hetero: step 2" in names and names.count("hetero: fetch") == 2
    assert "hetero: step 0" not in names and "hetero: step 3" not in names
    assert trace["hetero"] == {"rank": 3, "steps": [1, 2]}


def test_a_fit_that_ends_inside_or_before_the_chosen_steps_says_what_it_recorded(tmp_path):
    tracer = StepTracer((1, 2, 3), torch.device("cpu"))
    tracer.directory = tmp_path
    for index in range(3):  # the fit has 3 steps: 0, 1, 2
        tracer.step_opens(index)
        tracer.step_closed(index)
    tracer.stop()  # the fit's end
    assert json.loads(tracer.written.read_text())["hetero"]["steps"] == [1, 2] and not tracing.recording()
    assert write_merged(tmp_path, 1, (1, 2, 3))["steps"] == [1, 2]
    empty = tmp_path / "none"
    empty.mkdir()
    section = write_merged(empty, 2, (40, 41))
    assert section == {"requested": [40, 41], "steps": []} and not (empty / MERGED_NAME).exists()
    assert "no profiler trace: the fit trained 30 steps, before step 40 of" in traces_text(section, 30)


def trace_of(rank, base_ns, events):
    spans = [{"ph": "X", "name": name, "pid": 900 + rank, "tid": 1, "ts": ts, "dur": dur} for name, ts, dur in events]
    own_name = {"ph": "M", "name": "process_name", "pid": 900 + rank, "tid": 0, "args": {"name": "python"}}
    return {
        "baseTimeNanoseconds": base_ns,
        "hetero": {"rank": rank, "steps": [4, 5]},
        "traceEvents": [own_name, *spans],
    }


def test_the_ranks_traces_share_one_time_axis_one_process_each():
    """Rank 1's file counts from a base 2 ms later: its events land 2 ms later on the common axis, which starts at
    the earliest event of all; each rank is a process named by its rank (its own process name dropped)."""
    rank_0 = trace_of(
        0, 1_000_000_000, [("hetero: backward", 100.0, 50.0), ("hetero: exchange: all_reduce", 150.0, 900.0)]
    )
    rank_1 = trace_of(1, 1_002_000_000, [("hetero: backward", 10.0, 990.0)])
    merged = merge_rank_traces([rank_0, rank_1])
    spans = {(e["pid"], e["name"]): e for e in merged["traceEvents"] if e.get("ph") == "X"}
    assert spans[(0, "hetero: backward")]["ts"] == pytest.approx(0.0)
    assert spans[(0, "hetero: exchange: all_reduce")]["ts"] == pytest.approx(50.0)
    assert spans[(1, "hetero: backward")]["ts"] == pytest.approx(2000.0 + 10.0 - 100.0)
    names = [(e["pid"], e["args"]["name"]) for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert names == [(0, "rank 0"), (1, "rank 1")]
    assert merged["hetero"] == {"ranks": [0, 1], "steps": [4, 5]}
    flows = [trace_of(rank, 0, []) for rank in (0, 1)]
    for flow in flows:  # a launch-to-kernel arrow, numbered alike on every rank
        flow["traceEvents"].append({"ph": "s", "name": "ac2g", "pid": 0, "tid": 1, "ts": 1.0, "id": 7})
    arrows = [e["id"] for e in merge_rank_traces(flows)["traceEvents"] if e.get("ph") == "s"]
    assert len(set(arrows)) == 2  # each rank's stays its own


def test_rank_0_merges_the_files_it_finds_and_names_the_missing(tmp_path):
    (tmp_path / "trace_rank_0.json").write_text(json.dumps(trace_of(0, 0, [("hetero: backward", 1.0, 2.0)])))
    section = write_merged(tmp_path, world_size=2)
    assert section == {
        "ranks": ["trace_rank_0.json"],
        "missing": ["trace_rank_1.json"],
        "merged": MERGED_NAME,
        "steps": [4, 5],
    }
    assert json.loads((tmp_path / MERGED_NAME).read_text())["hetero"]["ranks"] == [0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run benchmarks/gpu_check.sh there)")
def test_on_cuda_the_trace_holds_the_gpus_kernels_beside_the_phases(tmp_path):
    tracer = StepTracer((0,), torch.device("cuda", 0))
    tracer.directory = tmp_path
    tracer.step_opens(0)
    with tracing.phase("backward"):  # also an NVTX range: it must push and pop cleanly
        (torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")).sum().item()
    tracer.step_closed(0)
    events = json.loads(tracer.written.read_text())["traceEvents"]
    assert any(event.get("name") == "hetero: backward" for event in events)
    assert any(event.get("cat") == "kernel" for event in events)  # the GPU's own activity


def test_a_traced_function_is_traced_once_however_often_it_is_wrapped(tmp_path):
    """An engine attached again (a later trainer call) keeps one phase around its step, not one per attach."""
    from lightning_hetero.runtime import tracing

    calls = []
    step = tracing.traced(lambda: calls.append(1), "optimizer update")
    assert tracing.traced(step, "optimizer update") is step
    with torch.profiler.profile() as profile:
        tracing.start_recording(nvtx=False)
        try:
            tracing.traced(step, "optimizer update")()
        finally:
            tracing.stop_recording()
    names = [event.name for event in profile.events()]
    assert calls == [1] and names.count("hetero: optimizer update") == 1
