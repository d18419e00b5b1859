"""Unit tests for lightning_hetero.watch.meter (per-step measurement, exchange) and lightning_hetero.watch.report."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_hetero.watch import report
from lightning_hetero.watch.meter import (
    RunWatch,
    StepMeter,
    StepRecord,
    balance_efficiency,
    job_steps,
    pack_records,
    step_metrics,
    unpack_records,
)


class FakeClocks:
    def __init__(self) -> None:
        self.compute = self.wall = self.emulated = 0.0

    def advance(self, compute: float = 0.0, wall: float = 0.0, emulated: float = 0.0) -> None:
        self.compute += compute
        self.emulated += emulated
        self.wall += wall + emulated  # an emulated delay is a sleep: wall time, not compute-clock time


def make_meter(clocks: FakeClocks) -> StepMeter:
    return StepMeter(lambda: clocks.compute, lambda: clocks.emulated, lambda: clocks.wall)


def test_a_step_is_compute_from_fetch_to_backward_and_wall_time_to_its_last_activity():
    clocks = FakeClocks()
    meter = make_meter(clocks)
    meter.fetch_started()
    clocks.advance(compute=0.002, wall=0.002)  # fetch
    meter.batch_ready(12)
    clocks.advance(compute=0.010, wall=0.010, emulated=0.005)  # forward + backward, then the emulated delay
    meter.backward_ended()
    clocks.advance(wall=0.020)  # waiting for the slower rank in the exchange, the optimizer update
    meter.optimizer_step_ended()
    clocks.advance(wall=1.0)  # validation, callbacks: not part of the step
    meter.fetch_started()
    (record,) = meter.take()
    assert record == StepRecord(0, 12, compute_seconds=pytest.approx(0.017), step_seconds=pytest.approx(0.037))
    assert record.wait_seconds == pytest.approx(0.020)
    assert meter.take() == []  # taken once


def test_manual_optimization_counts_compute_up_to_the_last_backward():
    clocks = FakeClocks()
    meter = make_meter(clocks)
    meter.fetch_started()
    for _ in range(2):
        clocks.advance(compute=0.004, wall=0.004)
        meter.backward_ended()
    meter.training_ended()
    (record,) = meter.take()
    assert record.compute_seconds == pytest.approx(0.008) and record.step_seconds == pytest.approx(0.008)


def test_every_batch_gets_a_record_so_ranks_stay_aligned():
    clocks = FakeClocks()
    meter = make_meter(clocks)
    meter.fetch_started()  # no backward ran (a skipped step)
    meter.fetch_started()
    clocks.advance(compute=0.001, wall=0.001)
    meter.backward_ended()
    meter.training_ended()
    assert [(r.step, r.compute_seconds) for r in meter.take()] == [(0, 0.0), (1, pytest.approx(0.001))]


def test_run_watch_exchanges_every_window_and_at_the_end():
    clocks = FakeClocks()
    watch = RunWatch(make_meter(clocks), window=3)
    calls = []

    def all_gather(packed):  # two ranks; the other one a bit slower
        calls.append(len(packed))
        slower = packed.clone()
        slower[:, 2] *= 2  # compute seconds
        return [packed, slower]

    exchanged = []
    for _ in range(7):  # the loader calls before_fetch, then the batch goes through the training step
        exchanged.append(watch.before_fetch(all_gather))
        watch.meter.batch_ready(4)
        clocks.advance(compute=0.001, wall=0.001)
        watch.meter.backward_ended()
        clocks.advance(wall=0.5)  # callbacks, validation: not part of the step; the exchange is not either
    steps = watch.finish(all_gather)
    # Exchanges before the 4th and 7th fetch, of the 3 steps completed since the last (the step before a fetch is
    # closed first), and the last one at the end.
    assert exchanged == [False, False, False, True, False, False, True]
    assert calls == [3, 3, 1]
    assert watch.fetched == 7
    assert [step["step"] for step in steps] == list(range(7))
    assert all(step["step_seconds"] == pytest.approx(0.001) for step in steps)
    assert steps[0]["compute_seconds"] == [pytest.approx(0.001), pytest.approx(0.002)]
    assert steps[0]["batch_sizes"] == [4, 4]


def test_records_travel_as_one_float64_tensor_exactly():
    records = [
        StepRecord(0, 7, 0.0123456789, 0.02, 5e6, 123.0, link_wait_seconds=0.0031),
        StepRecord(
            1,
            300,
            1e-6,
            2.5,
            micro_steps=3,
            data_wait_seconds=0.0051,
            arrival_seconds=0.2,
            exchange_seconds=0.01,
            held_seconds=0.03,
        ),
    ]
    packed = pack_records(records)
    # with the bytes on the wire, the micro-steps, the wait on the link in merges, the wait for data, the arrival at
    # the gradient exchange, the time inside it and the time held by the kernel
    assert packed.dtype == torch.float64 and packed.shape == (2, 12)
    assert unpack_records(packed) == records
    assert pack_records([]).shape == (0, 12) and unpack_records(pack_records([])) == []
    # The monitor's metrics say each rank's micro-steps and its largest micro-batch.
    step = job_steps([[records[1]], [StepRecord(1, 10, 1e-3, 2.5)]])[0]
    assert step["micro_steps"] == [3, 1]
    metrics = step_metrics(step)
    assert metrics["hetero/rank_0/micro_steps"] == 3.0 and metrics["hetero/rank_0/micro_batch"] == 100.0
    assert metrics["hetero/rank_1/micro_steps"] == 1.0 and metrics["hetero/rank_0/share"] == 300 / 310


def test_the_time_in_merges_is_recorded_per_step_and_summed_against_compute_in_the_report():
    """Local SGD: the meter takes each step's share of the rank's wait on the link; the report gives each rank's mean
    per step and its ratio to the rank's compute, and says so in its line; without merges it says nothing."""
    clocks, merged = FakeClocks(), [0.0]
    meter = StepMeter(lambda: clocks.compute, lambda: clocks.emulated, lambda: clocks.wall, link_wait=lambda: merged[0])
    for wait in (0.0, 0.004):
        meter.fetch_started()
        meter.batch_ready(8)
        clocks.advance(compute=0.010, wall=0.010)
        meter.backward_ended()
        merged[0] += wait
        clocks.advance(wall=wait)
        meter.optimizer_step_ended()
    meter.training_ended()
    mine = meter.take()
    assert [record.link_wait_seconds for record in mine] == [0.0, pytest.approx(0.004)]
    other = [StepRecord(0, 8, 0.02, 0.02), StepRecord(1, 8, 0.02, 0.022, link_wait_seconds=0.002)]
    steps = job_steps([mine, other])
    assert steps[1]["link_wait_seconds"] == [pytest.approx(0.004), 0.002]
    assert step_metrics(steps[1])["hetero/rank_0/link_wait_ms"] == pytest.approx(4.0)
    summary = report.summarize(steps, [])
    assert summary["link_wait_seconds_per_step"] == [pytest.approx(0.002), pytest.approx(0.001)]
    assert summary["link_wait_over_compute"] == [pytest.approx(0.2), pytest.approx(0.05)]
    line = report.summary_text(report.build_report(steps, [], 2))
    expected = "waiting on the link in merges per step, per rank: 2.0 ms (20% of its compute), 1.0 ms (5% of its"
    assert expected in line
    plain = job_steps([[StepRecord(0, 8, 0.01, 0.01)], [StepRecord(0, 8, 0.01, 0.01)]])
    assert "link_wait_seconds_per_step" not in report.summarize(plain, [])
    assert "waiting on the link" not in report.summary_text(report.build_report(plain, [], 2))


def test_a_fetch_the_host_did_not_compute_is_a_wait_for_data_apart_from_compute_and_from_waiting_for_others():
    """On CPU the compute clock is the host's: a fetch that sleeps (a loader behind) is wall time only. The wait is
    the record's data_wait_seconds, not compute and not wait_seconds (which is waiting for the other ranks)."""
    clocks = FakeClocks()
    meter = make_meter(clocks)
    meter.fetch_started()
    clocks.advance(compute=0.001, wall=0.001)  # the fetch's own work (collating)
    clocks.advance(wall=0.005)  # waiting for the loader's workers
    meter.batch_ready(8)
    clocks.advance(compute=0.010, wall=0.010)
    meter.backward_ended()
    clocks.advance(wall=0.003)  # the exchange: waiting for the slower rank
    meter.optimizer_step_ended()
    meter.training_ended()
    (record,) = meter.take()
    assert record.data_wait_seconds == pytest.approx(0.005)
    assert record.compute_seconds == pytest.approx(0.011)
    assert record.step_seconds == pytest.approx(0.019) and record.wait_seconds == pytest.approx(0.003)


def test_on_cuda_the_wall_clock_compute_does_not_count_the_wait_for_data():
    """On CUDA the compute clock is (synchronised) wall time, so the stalled fetch advanced it: the host clock (the
    thread's CPU time) tells the wait apart, and compute leaves it out."""
    clocks, host = FakeClocks(), [0.0]
    meter = StepMeter(lambda: clocks.wall, lambda: clocks.emulated, lambda: clocks.wall, host_clock=lambda: host[0])
    meter.fetch_started()
    clocks.advance(compute=0.001, wall=0.001)
    host[0] += 0.001
    clocks.advance(wall=0.005)  # the stall
    meter.batch_ready(8)
    clocks.advance(compute=0.010, wall=0.010)
    host[0] += 0.0002  # launching kernels; the device computes
    meter.backward_ended()
    meter.training_ended()
    (record,) = meter.take()
    assert record.data_wait_seconds == pytest.approx(0.005)
    assert record.compute_seconds == pytest.approx(0.011)
    assert record.step_seconds == pytest.approx(0.016) and record.wait_seconds == pytest.approx(0.0)


def test_the_report_and_the_monitor_name_the_rank_that_waits_for_its_data_with_the_fix():
    stalled = [StepRecord(i, 8, 0.010, 0.016, data_wait_seconds=0.005 if i else 0.050) for i in range(5)]
    fine = [StepRecord(i, 8, 0.010, 0.016, data_wait_seconds=0.0002) for i in range(5)]
    steps = job_steps([fine, stalled])
    assert steps[1]["data_wait_seconds"] == [0.0002, 0.005]
    assert step_metrics(steps[1])["hetero/rank_1/data_wait_ms"] == pytest.approx(5.0)
    summary = report.summarize(steps, [])
    # Medians: the first batch of an epoch (its workers starting) does not count as the loader's pace.
    assert summary["data_wait_seconds_per_step"] == [0.0002, 0.005]
    assert summary["data_wait_over_compute"] == [pytest.approx(0.02), pytest.approx(0.5)]
    assert summary["data_stalled_ranks"] == [1]
    line = report.summary_text(report.build_report(steps, [], 2))
    assert "waiting for the data loader per step: rank 1 5.0 ms (50% of its compute)" in line
    assert "num_workers" in line and "rank 0" not in line.split("waiting for the data loader")[1]
    assert "re-planning counts the wait in the rank's time and gives it fewer samples" in line
    # A fixed split (re-planning off) does not promise what it does not do
    fixed = report.summary_text(report.build_report(steps, [], 2, replanning=False))
    assert "gives it fewer samples" not in fixed and "the split is fixed here; with `rebalance=True`" in fixed
    # ... nor one where no re-planning exists (asynchronous merges, one rank, local SGD with fixed inner steps)
    unavailable = report.summary_text(report.build_report(steps, [], 2, replanning=None))
    assert "re-plan" not in unavailable.split("data loader")[1] and "num_workers" in unavailable
    plain = job_steps([[StepRecord(0, 8, 0.01, 0.01)], [StepRecord(0, 8, 0.01, 0.01)]])
    assert "data_wait_seconds_per_step" not in report.summarize(plain, [])
    assert "data loader" not in report.summary_text(report.build_report(plain, [], 2))


def test_job_steps_refuses_ranks_with_different_step_counts():
    record = StepRecord(0, 4, 0.01, 0.02)
    with pytest.raises(ValueError, match=r"different numbers of steps: \[1, 2\]"):
        job_steps([[record], [record, record]])


@pytest.mark.parametrize(
    ("compute", "efficiency"), [([1.0, 1.0], 1.0), ([1.0, 0.5], 0.75), ([2.0, 0.0, 0.0, 0.0], 0.25), ([0.0, 0.0], 1.0)]
)
def test_balance_efficiency(compute, efficiency):
    assert balance_efficiency(compute) == pytest.approx(efficiency)


def synthetic_steps(count: int) -> list[dict]:
    """Rank 1 twice as slow for the first half, balanced after a re-plan at the middle."""
    steps = []
    for step in range(count):
        slow = 0.02 if step < count // 2 else 0.01
        batch_sizes = [8, 8] if step < count // 2 else [10, 6]
        steps.append(
            {
                "step": step,
                "batch_sizes": batch_sizes,
                "compute_seconds": [0.01, slow],
                "wait_seconds": [slow - 0.01, 0.0],
                "step_seconds": 0.025,
            }
        )
    return steps


def test_report_summary_and_files(tmp_path):
    steps = synthetic_steps(20)
    replans = [{"step": 10, "batch_sizes": [10, 6], "predicted_gain": 0.5}]
    run_report = report.build_report(steps, replans, world_size=2, exchange_seconds=0.005)
    summary = run_report["summary"]
    assert summary["measurement_share"] == pytest.approx(0.005 / (20 * 0.025))
    assert summary["steps"] == 20 and summary["replans"] == 1
    assert summary["samples_per_second"] == pytest.approx(16 / 0.025)
    assert summary["balance_efficiency_start"] == pytest.approx(0.75)
    assert summary["balance_efficiency_end"] == pytest.approx(1.0)
    text = report.summary_text(run_report)
    assert "20 steps, 640 samples/s, balance efficiency 0.75 at the start -> 1.00 at the end" in text
    json_path, png_path = report.write_report(run_report, tmp_path / "hetero")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(run_report))
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000


def test_an_empty_run_has_a_report_too(tmp_path):
    run_report = report.build_report([], [], world_size=2)
    assert report.summary_text(run_report) == "HeteroStrategy run report: no training step was recorded."
    report.write_report(run_report, tmp_path)


def test_step_metrics_per_rank_and_for_the_job():
    step = {
        "step": 3,
        "batch_sizes": [12, 4],
        "compute_seconds": [0.012, 0.008],
        "wait_seconds": [0.0, 0.004],
        "step_seconds": 0.016,
    }
    metrics = step_metrics(step)
    assert metrics["hetero/samples_per_second"] == pytest.approx(1000)
    assert metrics["hetero/balance_efficiency"] == pytest.approx(0.02 / 0.024)
    assert metrics["hetero/rank_1/share"] == 0.25 and metrics["hetero/rank_1/micro_batch"] == 4.0
    assert metrics["hetero/rank_1/compute_ms"] == pytest.approx(8.0) and metrics["hetero/rank_1/wait_ms"] == 4.0
    assert metrics["hetero/rank_0/samples_per_second"] == pytest.approx(1000)


def test_the_monitor_refuses_another_strategy():
    from lightning.pytorch import Trainer

    from lightning_hetero import HeteroMonitor

    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="HeteroMonitor reads what HeteroStrategy measures.*SingleDeviceStrategy"):
        HeteroMonitor().on_train_start(trainer, None)


def test_the_plan_says_whose_metrics_an_unsynced_log_shows_when_the_split_is_uneven():
    from lightning_hetero.split.decisions.split import SplitPlan
    from lightning_hetero.watch.report import plan_text

    uneven = plan_text(SplitPlan((3, 13), "batch_sizes"), 2, ["cpu", "cpu"], ["32-true"] * 2)
    assert "without `sync_dist=True` are rank 0's: 3 of the 16 samples of a step here" in uneven
    assert "sync_dist" not in plan_text(SplitPlan((8, 8), "batch_sizes"), 2, ["cpu", "cpu"], ["32-true"] * 2)


def test_the_arrival_at_the_gradient_exchange_and_the_time_inside_are_measured_per_step():
    """A rank's arrival is the wall time from the end of the previous step's exchange (the fetch in a fit's first
    step) to this step's first exchange (a nested entry counts once), its wait for data and its time blocked in other
    collectives before it left out: its whole own work of the step, the optimizer update after the last exchange
    included. A step without an exchange has none."""
    clocks = FakeClocks()
    meter = make_meter(clocks)
    meter.fetch_started()
    clocks.advance(wall=0.003)  # waiting for the loader
    meter.batch_ready(8)
    clocks.advance(compute=0.004, wall=0.010)  # 4 ms of compute over 10 ms of wall time: something held the process
    meter.collective(True)  # a `sync_dist` log: 5 ms waiting for the others there, not this rank's own work
    clocks.advance(wall=0.005)
    meter.collective(False)
    meter.exchange_entered()
    meter.collective(True)  # (inside the exchange: its time is the exchange's)
    meter.exchange_entered()  # (a hook's collective inside DeepSpeed's reduction)
    clocks.advance(wall=0.006)
    meter.exchange_left()
    meter.collective(False)
    meter.exchange_left()
    meter.backward_ended()
    clocks.advance(compute=0.001, wall=0.001)
    meter.exchange_entered()
    clocks.advance(wall=0.002)
    meter.exchange_left()
    clocks.advance(compute=0.004, wall=0.004)  # the optimizer update, after the exchange
    meter.optimizer_step_ended()
    meter.fetch_started()
    meter.batch_ready(8)
    clocks.advance(compute=0.005, wall=0.005)
    meter.exchange_entered()
    meter.exchange_left()
    meter.fetch_started()
    meter.batch_ready(8)
    meter.fit_ended()
    first, second, third = meter.take()
    assert first.arrival_seconds == pytest.approx(0.010) and first.exchange_seconds == pytest.approx(0.008)
    assert second.arrival_seconds == pytest.approx(0.009)  # its update (4 ms) and its compute (5 ms)
    assert (third.arrival_seconds, third.exchange_seconds) == (0.0, 0.0)
    assert unpack_records(pack_records([first]))[0] == first


def late_steps(arrivals_by_step, compute=(0.004, 0.004), step_seconds=0.020):
    return [
        {
            "step": k,
            "batch_sizes": [8, 8],
            "compute_seconds": list(compute),
            "wait_seconds": [0.0, 0.0],
            "arrival_seconds": list(arrivals),
            "exchange_seconds": [0.009, 0.001],
            "step_seconds": step_seconds,
        }
        for k, arrivals in enumerate(arrivals_by_step)
    ]


def test_the_report_names_the_rank_the_others_wait_for_and_what_holds_it():
    """Rank 1 arrives last at the gradient exchange in 9 of 10 steps, 6 ms after rank 0, 6 ms of its wall time before
    the exchange not explained by its compute (rank 0's: none): named, with what holds it. Arrivals that take turns
    (noise), or a lateness within the exchange's jitter, name no one; a run without a timed exchange (local SGD's
    merges) says nothing."""
    throttled = late_steps([(0.004, 0.010)] * 9 + [(0.011, 0.010)])
    summary = report.summarize(throttled, [])
    assert summary["late_rank"] == {
        "rank": 1,
        "last_share": 0.9,
        "median_lateness_seconds": pytest.approx(0.006),
        "held_beyond_others": True,
        "held_beyond_others_seconds": pytest.approx(0.006),
        "kernel_held_beyond_others_seconds": 0.0,
        "kernel_counted": False,
    }
    text = report.late_rank_text(summary)
    assert "the others wait for rank 1: it reaches the gradient exchange last in 90% of the steps" in text
    assert "6.0 ms after the first: its wall time before the exchange exceeds its compute by 6.0 ms per step" in text
    assert "a CPU quota, another process on its core" in text
    taking_turns = late_steps([(0.004, 0.010), (0.010, 0.004)] * 5)
    assert "late_rank" not in report.summarize(taking_turns, []) and report.late_rank_text({}) == ""
    jitter = late_steps([(0.0040, 0.0045)] * 10)  # 0.5 ms: below 1 ms
    assert "late_rank" not in report.summarize(jitter, [])
    slow_compute = late_steps([(0.004, 0.010)] * 10, compute=(0.004, 0.0095))  # its compute explains it
    assert "something besides its compute" not in report.late_rank_text(report.summarize(slow_compute, []))
    assert report.late_rank_summary(late_steps([(0.0, 0.0)] * 10)) == {}


def test_a_slow_device_beside_a_fast_one_is_not_said_to_be_held():
    """Every rank's loop does about the same work besides its compute (5 ms here): over the fast rank's small compute
    that is a large ratio (2x, against 1.3x for the slow one), which read as the ranks held unevenly. It is a
    difference that tells: the same 5 ms on both, so the slow rank is named late with nothing said to hold it, and
    the re-planner fits compute, not arrivals (an emulated 5x slower device was re-planned 9 steps late)."""
    from lightning_hetero.split.decisions.replan import held_most

    steps = late_steps([(0.010, 0.025)] * 10, compute=(0.005, 0.020), step_seconds=0.027)
    late = report.summarize(steps, [])["late_rank"]
    assert late["rank"] == 1 and not late["held_beyond_others"]
    assert "holds it" not in report.late_rank_text(report.summarize(steps, []))
    assert held_most(steps, 2) is None
    quota = late_steps([(0.010, 0.025)] * 10, compute=(0.005, 0.010), step_seconds=0.027)  # 15 ms more than rank 0
    assert held_most(quota, 2) is not None and report.summarize(quota, [])["late_rank"]["held_beyond_others"]


def test_the_monitor_metrics_carry_each_ranks_arrival_and_time_in_the_exchange():
    (step,) = late_steps([(0.004, 0.010)])
    metrics = step_metrics(step)
    assert metrics["hetero/rank_1/arrival_ms"] == pytest.approx(10.0)
    assert metrics["hetero/rank_0/exchange_ms"] == pytest.approx(9.0)


def test_a_fetch_held_by_the_kernel_is_not_a_wait_for_data_and_the_step_counts_what_was_held():
    """Under a CPU quota the fetching thread's CPU clock stands still while the kernel holds it, which read as a wait
    for data (the throttled rank was named a data stall, with more DataLoader workers as the fix). The time it was
    runnable but held (the kernel's run delay) is taken out of the wait, and the step records it."""
    clocks = FakeClocks()
    held = [0.0]
    meter = StepMeter(lambda: clocks.compute, lambda: 0.0, lambda: clocks.wall, held_clock=lambda: held[0])
    meter.fetch_started()
    clocks.advance(compute=0.001, wall=0.004)  # 1 ms of loading, 3 ms held by the quota
    held[0] += 0.003
    meter.batch_ready(8)
    clocks.advance(compute=0.004, wall=0.010)
    held[0] += 0.006
    meter.backward_ended()
    meter.fetch_started()
    (record,) = meter.take()
    assert record.data_wait_seconds == pytest.approx(0.0) and record.held_seconds == pytest.approx(0.009)


def test_the_kernels_run_delay_is_read_for_this_thread():
    """The clock reads the calling thread's run delay, each thread its own (its file is kept open per thread)."""
    import gc
    import os
    import threading
    from pathlib import Path

    from lightning_hetero.emulate.slowdown import held_clock

    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("the kernel keeps no run delay here")
    clock = held_clock()
    first = clock()
    assert first >= 0.0 and clock() >= first

    def read_directly() -> float:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9

    seen = {}

    def in_a_thread(name: str) -> None:
        sum(range(200_000))  # (some run time of its own, beside the others)
        seen[name] = (read_directly(), clock(), read_directly())

    threads = [threading.Thread(target=in_a_thread, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    before, read, after = read_directly(), clock(), read_directly()
    assert before <= read <= after  # (this thread's, after another thread opened its own)
    for low, value, high in seen.values():
        assert low <= value <= high
    opened = set(os.listdir("/proc/self/fd"))
    threads = [threading.Thread(target=clock) for _ in range(5)]
    for thread in threads:
        thread.start()
        thread.join(timeout=30)
    gc.collect()
    assert len(set(os.listdir("/proc/self/fd")) - opened) <= 1  # (each thread's file went with it: 5 if kept)
    # A child forked after this thread read the clock reads its own thread's, not its parent's.
    sum(range(2_000_000))  # (run time of the parent's own, which a child reading the parent's file would see)
    clock()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # (the child: its own read against a direct one, then out without Python's shutdown)
        os.close(read_end)
        low, value, high = read_directly(), clock(), read_directly()
        os.write(write_end, b"1" if low <= value <= high else b"0")
        os._exit(0)
    os.close(write_end)
    try:
        answer = os.read(read_end, 1)
    finally:
        os.close(read_end)
        os.waitpid(child, 0)
    assert answer == b"1"


def test_where_the_kernel_counts_it_the_late_rank_is_named_with_the_time_it_was_held():
    steps = late_steps([(0.004, 0.010)] * 10)
    for step in steps:
        step["held_seconds"] = [0.0, 0.006]
    text = report.late_rank_text(report.summarize(steps, []))
    assert (
        "the others wait for rank 1" in text and "the kernel held it 6.0 ms per step more than the rank it held" in text
    )
    both_held = late_steps([(0.004, 0.010)] * 10, compute=(0.004, 0.0095))  # held alike, 2 ms each: not the reason
    for step in both_held:
        step["held_seconds"] = [0.002, 0.002]
    assert "the kernel held" not in report.late_rank_text(report.summarize(both_held, []))
