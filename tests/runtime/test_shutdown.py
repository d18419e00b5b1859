"""Unit tests for lightning_hetero.runtime.shutdown: the exit clean-up waits while a gloo worker thread is runnable.

A stand-in thread takes gloo's worker name ("pt_gloo_runloop") through prctl and spins, which is what a worker that
still has a release to finish looks like from /proc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

import pytest

from lightning_hetero.runtime.shutdown import (
    GLOO_WORKER_THREAD_NAME,
    runnable_gloo_workers,
    wait_for_gloo_workers_to_settle,
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread states from /proc")
PR_SET_NAME = 15


class NamedThread(threading.Thread):
    """A thread that names itself like a gloo worker, then spins (runnable) or sleeps until told to stop."""

    def __init__(self, spin: bool) -> None:
        super().__init__(daemon=True)
        self.spin = spin
        self.named = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_NAME, GLOO_WORKER_THREAD_NAME.encode(), 0, 0, 0)
        self.named.set()
        while not self.stop.is_set():
            if not self.spin:
                self.stop.wait()
            # Spinning in Python keeps the thread runnable: it holds or waits for the GIL, or computes.

    def __enter__(self) -> NamedThread:
        self.start()
        assert self.named.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(5)


class FakeClock:
    """``time`` for shutdown.py: sleeping moves the clock, nothing waits (a loaded machine cannot stretch it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch) -> FakeClock:
    from lightning_hetero.runtime import shutdown

    clock = FakeClock()
    monkeypatch.setattr(shutdown, "time", clock)
    return clock


def test_no_gloo_workers_means_settled_at_once(fake_clock):
    from lightning_hetero.runtime.shutdown import _POLL_SECONDS, _QUIET_CHECKS

    assert runnable_gloo_workers() == 0
    assert wait_for_gloo_workers_to_settle(max_wait=2.0)
    assert fake_clock.now == pytest.approx(_QUIET_CHECKS * _POLL_SECONDS)  # the quiet checks, no more


def test_a_sleeping_worker_does_not_hold_up_the_exit():
    with NamedThread(spin=False):
        time.sleep(0.05)
        assert runnable_gloo_workers() == 0
        assert wait_for_gloo_workers_to_settle(max_wait=2.0)


def test_a_runnable_worker_is_counted():
    with NamedThread(spin=True):
        # A spinning thread is runnable whenever it is looked at, apart from the moments it waits for the GIL.
        assert any(runnable_gloo_workers() == 1 for _ in range(50))
    assert wait_for_gloo_workers_to_settle(max_wait=2.0)


def test_a_worker_that_stays_runnable_is_waited_for_up_to_the_bound_and_no_longer(fake_clock, monkeypatch):
    from lightning_hetero.runtime import shutdown

    monkeypatch.setattr(shutdown, "runnable_gloo_workers", lambda: 1)
    assert not wait_for_gloo_workers_to_settle(max_wait=0.3)
    assert 0.3 <= fake_clock.now < 0.3 + 2 * shutdown._POLL_SECONDS
    # one that settles after a while: waited for, then the quiet checks
    states = iter([1, 1, 1])
    monkeypatch.setattr(shutdown, "runnable_gloo_workers", lambda: next(states, 0))
    fake_clock.now = 0.0
    assert wait_for_gloo_workers_to_settle(max_wait=2.0)
    assert fake_clock.now == pytest.approx((3 + shutdown._QUIET_CHECKS) * shutdown._POLL_SECONDS)


SCRIPT = """
import sys
from lightning_hetero.runtime import shutdown
shutdown.register_exit_cleanup()
error = RuntimeError("Connection reset by peer")
if sys.argv[1] in ("uncaught", "caught"):
    shutdown.exit_with_if_uncaught(error, 75)
if sys.argv[1] == "caught":
    try:
        raise error
    except RuntimeError:
        print("caught")
    sys.exit(0)
raise error
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("how", "code"), [("uncaught", 75), ("caught", 0), ("unmarked", 1)])
def test_an_exception_marked_for_an_exit_code_exits_with_it_only_when_uncaught(how, code, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert result.returncode == code, result.stderr[-2000:]
    if how != "caught":
        assert "RuntimeError: Connection reset by peer" in result.stderr  # the traceback is printed as usual


SIGTERM_SCRIPT = """
import os, signal, sys, time
from lightning_hetero.recover.stopping import REPEATED_SIGNAL_SECONDS, StopOnSigterm
now = [0.0]  # the handler's clock, moved on below rather than slept through
stop = StopOnSigterm(lambda tensor: None, None, clock=lambda: now[0])
signal.signal(signal.SIGTERM, stop.on_sigterm)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("first SIGTERM noted:", stop.requested, flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # at once: the same request forwarded (srun, then torchrun's agent)
time.sleep(0.2)
print("a repeat changed nothing", flush=True)
now[0] += REPEATED_SIGNAL_SECONDS + 1
os.kill(os.getpid(), signal.SIGTERM)  # later: the run is stuck and never reaches an agreement
time.sleep(5)
print("still running", flush=True)
"""


@pytest.mark.fault
def test_a_later_second_sigterm_ends_a_stuck_process_at_once_and_a_repeat_does_not():
    import subprocess
    import sys

    from lightning_hetero.recover.stopping import EXIT_CODE_INTERRUPTED

    result = subprocess.run([sys.executable, "-c", SIGTERM_SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_CODE_INTERRUPTED, result.stderr[-2000:]
    assert "first SIGTERM noted: True" in result.stdout and "a repeat changed nothing" in result.stdout
    assert "still running" not in result.stdout
    assert "a second SIGTERM" in result.stderr
