"""Unit tests for emulate/slowdown.py: speed parsing and checking, and the slowdown emulator's clock (local
compute is stretched to ``1/speed``; blocking waits, like a collective's, are not)."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lightning_hetero.emulate.slowdown import (
    ENV_VAR,
    SlowdownEmulator,
    check_speeds,
    compute_clock,
    parse_schedule,
    parse_speeds,
    speed_schedule,
    speeds_from_environment,
)

CPU = torch.device("cpu")
ATTEMPTS = 3  # other processes share the cores: a timing property must hold in one of a few tries


# ---------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "speeds"),
    [("1.0,0.4", (1.0, 0.4)), ("1", (1.0,)), (" 1.0 , 0.25 ", (1.0, 0.25)), ("1e-3", (0.001,))],
)
def test_parse_speeds(text, speeds):
    parsed = parse_speeds(text)
    assert parsed == speeds
    assert isinstance(parsed, tuple) and all(type(s) is float for s in parsed)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("a,b", "'a,b'"),  # not numbers: the raw text is quoted
        ("1.0,x", "'1.0,x'"),
        ("", "is empty"),
        (" , ", "is empty"),
        ("1.0,,0.4", "has an empty entry (position 1)"),  # not two speeds
        ("0.5,1,", "has an empty entry (position 2)"),
        ("1.0,0", "[1.0, 0.0]"),
        ("1.5", "[1.5]"),
        ("nan", "[nan]"),
        ("1.0,inf", "[1.0, inf]"),
        ("-0.5", "[-0.5]"),
    ],
)
def test_parse_speeds_errors_name_the_variable_and_value(text, shown):
    with pytest.raises(ValueError) as error:
        parse_speeds(text)
    message = str(error.value)
    assert f"`{ENV_VAR}" in message
    assert shown in message


def test_parse_speeds_names_the_given_source():
    with pytest.raises(ValueError, match=r"`--emulate-speeds='fast'`"):
        parse_speeds("fast", source="--emulate-speeds")
    with pytest.raises(ValueError, match=r"`--emulate-speeds=\[2\.0\]` holds \[2\.0\]"):
        parse_speeds("2", source="--emulate-speeds")


@pytest.mark.parametrize("speeds", [[1.0], [0.25, 1.0], (1, 0.5), [1e-9], [np.float64(0.5)]])
def test_check_speeds_accepts(speeds):
    check_speeds(speeds)  # no error


@pytest.mark.parametrize(
    ("speeds", "bad"),
    [
        ([0.0], "[0.0]"),
        ([1.0, 1.01], "[1.01]"),
        ([-1], "[-1]"),
        ([math.nan], "[nan]"),
        ([math.inf, 0.5], "[inf]"),
        ([True], "[True]"),  # a bool is not a speed
        (["0.5"], "['0.5']"),
        ([None, 0.5, 2.0], "[None, 2.0]"),
    ],
)
def test_check_speeds_rejects(speeds, bad):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]") as error:
        check_speeds(speeds)
    assert f"holds {bad}" in str(error.value)
    assert "`emulate_speeds=" in str(error.value)  # the default source: the strategy's argument


def test_check_speeds_rejects_empty():
    with pytest.raises(ValueError, match="`emulate_speeds` is empty"):
        check_speeds([])


def test_speeds_from_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert speeds_from_environment() is None
    monkeypatch.setenv(ENV_VAR, "   ")
    assert speeds_from_environment() is None
    monkeypatch.setenv(ENV_VAR, "1.0, 0.4")
    assert speeds_from_environment() == speed_schedule([1.0, 0.4])
    monkeypatch.setenv(ENV_VAR, "1.0,1.0;200:1.0,0.4")
    assert speeds_from_environment() == speed_schedule({0: [1.0, 1.0], 200: [1.0, 0.4]})
    monkeypatch.setenv(ENV_VAR, "1.0,zero")
    with pytest.raises(ValueError, match=rf"`{ENV_VAR}='1.0,zero'`"):
        speeds_from_environment()
    monkeypatch.setenv(ENV_VAR, "1.0,0")
    with pytest.raises(ValueError, match=rf"`{ENV_VAR}=\[1.0, 0.0\]` holds \[0.0\]"):
        speeds_from_environment()


@pytest.mark.parametrize("speed", [0.0, 1.5, math.nan, True])
def test_emulator_rejects_invalid_speed(speed):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        SlowdownEmulator(speed, CPU)


# ---------------------------------------------------------------------------------------------------- the clock


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def intra_op_threads(request) -> Iterator[int]:
    """Both CPU clocks: this thread's CPU time (one intra-op thread) and the process's (several)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(threads)


def test_compute_clock_on_cpu(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert compute_clock(CPU) is time.thread_time
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert compute_clock(CPU) is time.process_time


def _calibrate_work(seconds: float) -> int:
    """Iterations of a pure-Python loop that take about ``seconds`` of CPU time."""
    n = 20_000
    while True:
        start = time.thread_time()
        _work(n)
        took = time.thread_time() - start
        if took > 0.01:
            return max(1, int(n * seconds / took))
        n *= 4


def _work(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def _wall(block) -> float:
    start = time.perf_counter()
    block()
    return time.perf_counter() - start


def _timed(block) -> tuple[float, float]:
    """Wall time of ``block`` and the share of it this thread was on a CPU (below 1: other processes had the core)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    block()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return wall, cpu / wall


def test_cpu_work_is_stretched_to_one_over_speed(intra_op_threads):
    n = _calibrate_work(0.05)
    ratios, starved = [], True
    for _ in range(ATTEMPTS):
        emulator = SlowdownEmulator(0.5, CPU)

        def emulated(emulator: SlowdownEmulator = emulator) -> None:
            with emulator.slowed():
                _work(n)

        # Interleaved, and the fastest of each kept: interference from other processes only ever adds time.
        runs = [(_timed(lambda: _work(n)), _timed(emulated)) for _ in range(3)]
        plain, slowed = min(p[0] for p, _ in runs), min(s[0] for _, s in runs)
        added = emulator.added_seconds / len(runs)
        ratios.append((round(slowed / plain, 2), round(added / plain, 2)))
        # ~2x as long; the added sleep is about one more plain run (the CPU time the block used).
        if 1.6 <= slowed / plain <= 3 and 0.6 <= added / plain <= 1.5:
            break
        starved = starved and min(p[1] for p, _ in runs) < 0.8
    else:
        if starved:  # the emulator stretches CPU time, which a starved thread gets less of than wall time
            pytest.skip(f"the machine is too loaded to time this (ratios {ratios})")
        pytest.fail(f"speed 0.5 should double ~50 ms of CPU work; (time, added) ratios to a plain run: {ratios}")


@pytest.mark.parametrize("speed", [0.5, 0.25])
def test_added_sleep_is_the_blocks_cpu_time_times_one_over_speed_minus_one(speed):
    """The same property in CPU time, which other processes' load does not distort."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = _calibrate_work(0.02)
        emulator = SlowdownEmulator(speed, CPU)
        with emulator.slowed():
            cpu = time.thread_time()
            _work(n)
            cpu = time.thread_time() - cpu
    finally:
        torch.set_num_threads(torch_threads)
    assert emulator.added_seconds == pytest.approx((1 / speed - 1) * cpu, rel=0.15, abs=2e-3)


def test_speed_one_adds_nothing(intra_op_threads):
    n = _calibrate_work(0.02)
    emulator = SlowdownEmulator(1.0, CPU)
    for _ in range(3):
        with emulator.slowed():
            _work(n)
    assert emulator.added_seconds == 0.0


@pytest.mark.parametrize(
    "wait",
    [
        pytest.param(lambda: time.sleep(0.05), id="sleep"),
        pytest.param(lambda: threading.Event().wait(0.05), id="event-wait"),
    ],
)
def test_blocking_wait_is_not_stretched(intra_op_threads, wait):
    """Time spent blocked (e.g. in a gloo collective, waiting for slower ranks) is not multiplied."""
    emulator = SlowdownEmulator(0.25, CPU)  # would add 150 ms if the 50 ms wait were counted
    with emulator.slowed():
        wait()
    # added_seconds is every second the emulator slept (catch_up is its one sleep): the decision, without a wall
    # clock that a loaded machine stretches (the test asserted elapsed < 150 ms too). Counting the wait would add
    # 150 ms; with 2 intra-op threads the process's CPU time also holds what OpenMP's workers spin after an earlier
    # test's parallel op (12.5 ms added once in a shuffled run), so the bound is 50 ms, not 10.
    assert emulator.added_seconds < 0.05


def test_waiting_for_another_thread_is_not_stretched():
    """A collective-like wait: this thread blocks until a peer (sleeping, as a slower rank's compute) delivers."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thread_time: only this thread's CPU counts
    try:
        emulator = SlowdownEmulator(0.25, CPU)
        delivered: queue.Queue[int] = queue.Queue()
        peer = threading.Thread(target=lambda: (time.sleep(0.05), delivered.put(1)))
        with emulator.slowed():
            peer.start()
            assert delivered.get(timeout=5) == 1
        peer.join()
    finally:
        torch.set_num_threads(torch_threads)
    assert emulator.added_seconds < 0.01


def test_parallel_compute_is_stretched_by_its_duration_not_its_cpu_time(monkeypatch):
    """With several intra-op threads the process's CPU time grows N times faster than the wall clock during
    parallel compute; the stretch must still be ``1/speed`` of the block's duration, not of N times it."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(time, "process_time", lambda: 4 * time.perf_counter())  # four busy workers
    emulator = SlowdownEmulator(0.5, CPU)
    start = time.perf_counter()
    with emulator.slowed():
        time.sleep(0.03)  # stands for 30 ms of 4-thread compute
    block = time.perf_counter() - start - emulator.added_seconds
    assert emulator.added_seconds == pytest.approx(block, rel=0.5)  # ~1x the block (speed 0.5), not ~4x
    assert emulator.added_seconds < 2 * block


def test_added_seconds_accumulate_and_exceptions_propagate(intra_op_threads):
    n = _calibrate_work(0.01)
    emulator = SlowdownEmulator(0.5, CPU)
    with emulator.slowed():
        _work(n)
    first = emulator.added_seconds
    assert first > 0
    with pytest.raises(KeyError):
        with emulator.slowed():
            _work(n)
            raise KeyError("boom")
    assert emulator.added_seconds > first  # the failed block's compute was stretched too


def test_excluded_work_is_not_stretched():
    """Host-side bookkeeping inside a slowed block (e.g. DeepSpeed's gradient reduction hooks) is not stretched."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = _calibrate_work(0.03)
        emulator = SlowdownEmulator(0.25, CPU)  # stretching the 30 ms would add 90 ms
        with emulator.slowed():
            with emulator.excluded():
                _work(n)
        assert emulator.added_seconds < 0.02
    finally:
        torch.set_num_threads(torch_threads)


def test_at_host_speed_wraps_an_instance_method():
    class Engine:
        def reduce(self, x: int) -> int:
            _work(_calibrate_work(0.02))
            return 2 * x

    engine = Engine()
    emulator = SlowdownEmulator(0.25, CPU)
    assert emulator.at_host_speed(engine, "missing") is False
    assert emulator.at_host_speed(engine, "reduce") is True
    assert "reduce" in vars(engine) and Engine().reduce.__func__ is Engine.reduce  # the instance only
    with emulator.slowed():
        assert engine.reduce(21) == 42
    assert emulator.added_seconds < 0.5 * 3 * 0.02  # well below the stretch of the ~20 ms it did


def test_the_delay_is_paid_before_a_host_speed_call():
    """A gradient exchange must start only after the slow rank's stretched backward, so that peers wait at the
    collective as they would for a slower device; sleeping after it would hide the delay."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = _calibrate_work(0.03)
        emulator = SlowdownEmulator(0.25, CPU)
        paid_when_called: list[float] = []

        class Engine:
            def allreduce_gradients(self) -> None:
                paid_when_called.append(emulator.added_seconds)

        engine = Engine()
        emulator.at_host_speed(engine, "allreduce_gradients")
        with emulator.slowed():
            cpu = time.thread_time()
            _work(n)  # the backward compute
            cpu = time.thread_time() - cpu
            engine.allreduce_gradients()
        after_block = emulator.added_seconds
    finally:
        torch.set_num_threads(torch_threads)
    assert paid_when_called[0] == pytest.approx(3 * cpu, rel=0.15, abs=3e-3)  # all of it, before the exchange
    assert after_block - paid_when_called[0] < 0.2 * paid_when_called[0]  # little left to pay at the end


def test_catch_up_outside_a_block_does_nothing():
    emulator = SlowdownEmulator(0.25, CPU)
    _work(_calibrate_work(0.01))
    emulator.catch_up()
    assert emulator.added_seconds == 0.0


def test_nested_blocks_stretch_once():
    """Manual optimization runs backward (a slowed block) inside training_step (another): the inner compute is
    stretched once, not by both blocks."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = _calibrate_work(0.02)
        emulator = SlowdownEmulator(0.5, CPU)
        with emulator.slowed():
            cpu = time.thread_time()
            _work(n)
            with emulator.slowed():
                _work(n)
            _work(n)
            cpu = time.thread_time() - cpu
    finally:
        torch.set_num_threads(torch_threads)
    assert emulator.added_seconds == pytest.approx(cpu, rel=0.15, abs=3e-3)  # (1/0.5 - 1) x all of it, once


def _single_thread_cpu(block) -> float:
    """Run ``block`` with one intra-op thread (the emulator's thread-time clock); its CPU seconds."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.thread_time()
        block()
        return time.thread_time() - start
    finally:
        torch.set_num_threads(torch_threads)


def test_nested_exclusions_count_once():
    """A bucket reduce (excluded) runs inside a gradient hook (excluded): its time must not be subtracted twice
    from the compute, or the compute around it would go unstretched."""
    n = _calibrate_work(0.03)
    emulator = SlowdownEmulator(0.25, CPU)
    compute: list[float] = []

    def block() -> None:
        with emulator.slowed():
            compute.append(_single_thread_cpu(lambda: _work(n)))
            with emulator.excluded(), emulator.excluded():
                _work(n)

    _single_thread_cpu(block)
    # 3 x the 30 ms of compute; counting the excluded 30 ms twice would leave nothing to stretch.
    assert emulator.added_seconds == pytest.approx(3 * compute[0], rel=0.2, abs=5e-3)


def test_a_delay_paid_inside_an_exclusion_leaves_the_excluded_part_out():
    """ZeRO-2 reduces a full bucket from inside a gradient hook: the delay paid there is for the compute before
    the hook, not for the hook's own bookkeeping up to that point."""
    n = _calibrate_work(0.03)
    emulator = SlowdownEmulator(0.25, CPU)
    paid_at_reduce: list[float] = []
    compute: list[float] = []

    def block() -> None:
        with emulator.slowed():
            compute.append(_single_thread_cpu(lambda: _work(n)))
            with emulator.excluded():
                _work(n)  # bookkeeping before the bucket is full
                emulator.catch_up()
                paid_at_reduce.append(emulator.added_seconds)

    _single_thread_cpu(block)
    assert paid_at_reduce[0] == pytest.approx(3 * compute[0], rel=0.2, abs=5e-3)
    assert emulator.added_seconds == pytest.approx(paid_at_reduce[0], rel=0.1, abs=3e-3)  # nothing more at the end


def test_bookkeeping_wrapped_without_paying_first_does_not_sleep_when_called():
    """Per-parameter gradient hooks only fill buckets: they are excluded from the stretch but pay nothing, so that
    a backward pass sleeps once before its reduction rather than once per parameter."""
    calls: list[float] = []
    emulator = SlowdownEmulator(0.25, CPU)

    class Optimizer:
        def reduce_ready_partitions_and_remove_grads(self, param: int) -> None:
            calls.append(emulator.added_seconds)
            _work(_calibrate_work(0.01))

    optimizer = Optimizer()
    assert emulator.at_host_speed(optimizer, "reduce_ready_partitions_and_remove_grads", pay_first=False)
    n = _calibrate_work(0.02)
    compute: list[float] = []

    def block() -> None:
        with emulator.slowed():
            for param in range(3):
                compute.append(_single_thread_cpu(lambda: _work(n)))  # autograd computing this gradient
                optimizer.reduce_ready_partitions_and_remove_grads(param)

    _single_thread_cpu(block)
    assert calls == [0.0, 0.0, 0.0]  # no sleep inside the hooks
    # 3 x the compute, paid once at the block's end; the hooks' own work is not stretched.
    assert emulator.added_seconds == pytest.approx(3 * sum(compute), rel=0.2, abs=5e-3)


# ---------------------------------------------------------------------------------------------------- drift schedules


def test_a_schedule_changes_speeds_at_the_given_global_steps():
    schedule = parse_schedule("1.0,1.0;200:1.0,0.4;300:0.5,1")
    assert [schedule.at(step) for step in (0, 199, 200, 299, 300, 10_000)] == [
        (1.0, 1.0),
        (1.0, 1.0),
        (1.0, 0.4),
        (1.0, 0.4),
        (0.5, 1.0),
        (0.5, 1.0),
    ]
    assert schedule.world_size == 2
    assert schedule == speed_schedule({0: [1.0, 1.0], 300: [0.5, 1.0], 200: [1.0, 0.4]})  # any key order
    assert schedule.to_json() == {"0": [1.0, 1.0], "200": [1.0, 0.4], "300": [0.5, 1.0]}
    assert speed_schedule([1.0, 0.4]).to_json() == [1.0, 0.4]  # a constant list stays a list
    assert parse_schedule("1.0,0.4") == speed_schedule([1.0, 0.4])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({200: [1.0, 0.4]}, "does not say the speeds at step 0"),
        ({0: [1.0, 1.0], -5: [1.0, 0.4]}, "keys must be global steps (integers >= 0), got [-5]"),
        ({0: [1.0, 1.0], 2.5: [1.0, 0.4]}, "got [2.5]"),
        ({}, "got none"),
        ({0: [1.0, 1.0], 200: [1.0]}, "different numbers of ranks at different steps (step 0: 2, step 200: 1)"),
        ({0: [1.0, 1.0], 200: [1.0, 1.5]}, "`emulate_speeds[200]=[1.0, 1.5]` holds [1.5]"),
        ({0: 0.4}, "`emulate_speeds[0]=0.4` is not a list"),
    ],
)
def test_bad_schedules_are_clear_errors(value, message):
    with pytest.raises(ValueError) as error:
        speed_schedule(value)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.0,1.0;1.0,0.4", "entry 2 ('1.0,0.4') must be `STEP:speeds`"),
        ("1.0,1.0;x:1.0,0.4", "entry 2 ('x:1.0,0.4') must be `STEP:speeds`"),
        ("1.0,1.0;200:1.0,0.4;200:1.0,0.5", "gives step 200 twice"),
        ("1.0,1.0;200:1.0,,0.4", "has an empty entry"),
        ("200:1.0,0.4", "does not say the speeds at step 0"),
    ],
)
def test_bad_schedules_in_the_environment_variable_name_it(text, message):
    with pytest.raises(ValueError) as error:
        parse_schedule(text)
    assert message in str(error.value) and ENV_VAR in str(error.value)
