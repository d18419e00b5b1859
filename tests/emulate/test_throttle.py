"""A rank slowed everywhere (lightning_hetero/emulate/throttle.py): the decisions, and a throttled process measured."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
from conftest import REPO

from lightning_hetero.emulate import throttle
from lightning_hetero.emulate.emulation import NoEmulation, ProcessEmulation, check_slowdown, emulation_for
from lightning_hetero.emulate.slowdown import speed_schedule


def test_the_quota_and_the_duty_cycle_give_the_speed_of_each_period():
    assert throttle.quota_microseconds(0.4, 0.01) == 4000
    assert throttle.quota_microseconds(0.05, 0.01) == 1000  # (the kernel's smallest quota)
    assert throttle.duty_cycle(0.25, 0.01) == pytest.approx((0.0025, 0.0075))
    assert throttle.duty_cycle(1.0, 0.01) == (0.01, 0.0)


def test_the_cgroup_goes_under_the_one_the_process_is_in(tmp_path):
    """cgroup v1's cpu controller first (mounted alone or with cpuacct), else v2's unified hierarchy; none without
    either (the duty cycle then)."""
    (tmp_path / "cpu,cpuacct" / "jobs").mkdir(parents=True)
    place = throttle.cgroup_place("5:cpu,cpuacct:/jobs\n0::/", 42, tmp_path)
    assert place == throttle.CgroupPlace(
        tmp_path / "cpu,cpuacct" / "jobs" / f"{throttle.CGROUP_PREFIX}42", 1, tmp_path / "cpu,cpuacct/jobs/cgroup.procs"
    )
    (tmp_path / "cpu").mkdir()
    assert throttle.cgroup_place("1:cpu:/\n", 7, tmp_path).directory == tmp_path / "cpu" / f"{throttle.CGROUP_PREFIX}7"
    v2 = throttle.cgroup_place("0::/user.slice\n", 7, tmp_path)
    assert (v2.version, v2.directory.parent) == (2, tmp_path / "user.slice")
    assert throttle.cgroup_place("3:memory:/x\n", 7, tmp_path) is None


def test_emulate_slowdown_is_compute_or_process_and_names_the_fix(monkeypatch):
    assert check_slowdown(None) == "compute" and check_slowdown("process") == "process"
    assert check_slowdown("sends") == "sends"
    monkeypatch.setenv("LIGHTNING_HETERO_EMULATE_SLOWDOWN", "process")
    assert check_slowdown(None) == "process"
    with pytest.raises(
        ValueError, match=r"`emulate_slowdown='quota'` .* is not one of \['compute', 'process', 'sends'\]"
    ):
        check_slowdown("quota")
    import torch

    assert isinstance(emulation_for(None, 0, torch.device("cpu"), "process"), NoEmulation)


def test_a_rank_at_full_speed_is_not_throttled_and_a_drift_starts_and_ends_it(monkeypatch):
    """The limit follows a drift schedule: none at speed 1, started when the speed drops, changed, lifted."""
    calls = []

    class Fake:
        def set_speed(self, speed):
            calls.append(("set", speed))

        def stop(self):
            calls.append(("stop",))

    monkeypatch.setattr(throttle, "start_throttle", lambda speed: calls.append(("start", speed)) or Fake())
    emulation = ProcessEmulation(speed_schedule({0: [1.0, 1.0], 10: [1.0, 0.4], 20: [1.0, 0.6], 30: [1.0, 1.0]}), 1)
    assert calls == [] and emulation.throttle is None
    for step in range(40):
        emulation.at_step(step)
    assert calls == [("start", 0.4), ("set", 0.6), ("stop",)]
    emulation.stop()
    assert calls[-1] == ("stop",) and len(calls) == 3  # (nothing left to stop)


# The throttle module needs only the standard library: loaded from its file, the burning process starts in a tenth of
# a second instead of importing the package (and Lightning with it), seconds of CPU that the other tests would miss.
BURN = """
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("throttle", {module!r})
throttle = importlib.util.module_from_spec(spec)
sys.modules["throttle"] = throttle  # (its dataclasses look their module up while they are made)
spec.loader.exec_module(throttle)
assert not {{"torch", "lightning_hetero"}} & set(sys.modules), "throttle.py imports more than the standard library"
if {duty_cycle}:
    throttle.cgroup_place = lambda *args: None  # (where no cgroup can be made)
held = throttle.start_throttle({speed}) if {speed} < 1 else None
print(json.dumps({{"pid": os.getpid(), "how": held.describe() if held else "none"}}), flush=True)
wall, cpu = time.perf_counter(), time.process_time()
while time.perf_counter() - wall < 1.0:
    sum(range(1000))
print(json.dumps({{"cpu_share": (time.process_time() - cpu) / (time.perf_counter() - wall)}}), flush=True)
if {hang}:
    time.sleep(60)
if held:
    held.stop()
"""


def burn(speed: float, duty_cycle: bool, hang: bool = False) -> subprocess.Popen:
    script = BURN.format(module=throttle.__file__, speed=speed, duty_cycle=duty_cycle, hang=hang)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("duty_cycle", [False, True], ids=["cgroup (root)", "duty cycle"])
def test_a_throttled_process_gets_its_speed_of_a_core(duty_cycle):
    """A busy loop held to 0.4 of a core never gets more than that (0.5 of its wall time on the CPU, with slack for
    the period's edges), by a cgroup where this process may make one (root here and in CI) and by the duty cycle
    otherwise. How much less it gets depends on the machine's other load (the duty cycle's running windows are shared
    with it too), so its floor is measured in the same second: an unheld busy loop started beside it, whose share is
    what a core gives now. The held loop gets at least a quarter of that (0.4 of it by the duty cycle, and min(0.4, it)
    by the cgroup): it is held, not stopped."""
    if not duty_cycle and not os.access(str(throttle.CGROUP_ROOT), os.W_OK):
        pytest.skip("no cgroup can be made here (not root)")
    held, beside = burn(0.4, duty_cycle), burn(1.0, duty_cycle)
    try:
        started = json.loads(held.stdout.readline())
        json.loads(beside.stdout.readline())
        share = json.loads(held.stdout.readline())["cpu_share"]
        unheld_share = json.loads(beside.stdout.readline())["cpu_share"]
        assert held.wait(timeout=30) == 0 and beside.wait(timeout=30) == 0
    finally:
        held.kill()
        beside.kill()
    assert ("duty cycle" in started["how"]) == duty_cycle
    assert 0.25 * unheld_share <= share <= 0.5, (share, unheld_share)


@pytest.mark.fault
def test_a_killed_rank_leaves_no_helper_and_no_cgroup_behind():
    """The rank killed (SIGKILL, by its PID) while held: its duty-cycle helper leaves, and the next throttle removes
    the empty cgroup a killed rank left."""
    process = burn(0.4, duty_cycle=True, hang=True)
    try:
        pid = json.loads(process.stdout.readline())["pid"]
        process.stdout.readline()
        helpers = [child for child in _children(pid)]
        assert len(helpers) == 1
        os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_exists(helper) for helper in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_exists(helper) for helper in helpers)
    finally:
        process.kill()
    if not os.access(str(throttle.CGROUP_ROOT), os.W_OK):
        return
    killed = burn(0.4, duty_cycle=False, hang=True)
    try:
        pid = json.loads(killed.stdout.readline())["pid"]
        killed.stdout.readline()
        left = throttle.cgroup_place(open(f"/proc/{os.getpid()}/cgroup").read(), pid).directory
        assert left.is_dir()
        os.kill(pid, signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        killed.kill()
    assert left.is_dir()  # (the kernel keeps an empty cgroup)
    again = burn(0.9, duty_cycle=False)
    try:
        again.stdout.readline()
        assert not left.exists()
        again.stdout.readline()
        assert again.wait(timeout=30) == 0
    finally:
        again.kill()


def _children(pid: int) -> list[int]:
    import psutil

    return [child.pid for child in psutil.Process(pid).children()]


def _exists(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.multiprocess
def test_a_fit_with_a_rank_held_by_a_cpu_quota_measures_what_the_kernel_held_on_that_rank(tmp_path):
    """`emulate_slowdown="process"` with speeds [1.0, 0.2]: rank 1's whole process is held to 20 % of a core. Its
    compute clock does not see it (the profile plans an equal split), the kernel's run delay does: the run report
    records rank 1 held more ms per step than rank 0 (which the machine's other processes hold too, under a suite
    run beside this test: 0.4 of a core did not bind there, the core already shared)."""
    from conftest import run_fit

    run = run_fit(
        tmp_path,
        "--samples",
        "160",
        "--hidden",
        "64",
        "--depth",
        "3",
        "--emulate-speeds",
        "1.0",
        "0.2",
        "--strategy-args",
        '{"emulate_slowdown": "process"}',
    )
    assert run.returncode == 0, run.output[-3000:]
    summary = json.loads((tmp_path / "hetero" / "report.json").read_text())["summary"]
    held = summary["held_seconds_per_step"]
    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("the kernel keeps no run delay here")
    assert held[1] > 1.5 * held[0] + 0.002, held


@pytest.mark.multiprocess
def test_a_fit_with_a_rank_on_a_slow_link_holds_its_sends_and_the_other_waits_inside_the_exchange(tmp_path):
    """`emulate_slowdown="sends"` with speeds [1.0, 0.02]: rank 1 sends on a link of 2 % of 1 Gbit/s, so each of its
    sends of a step is held back 49 x its payload's time at 1 Gbit/s before it is issued, and rank 0 waits for it inside
    the gradient exchange (the report's time inside it). Its compute is untouched: the two ranks compute alike."""
    from conftest import run_fit

    run = run_fit(
        tmp_path,
        "--samples",
        "96",
        "--hidden",
        "64",
        "--depth",
        "3",
        "--emulate-speeds",
        "1.0",
        "0.02",
        "--strategy-args",
        '{"emulate_slowdown": "sends", "stage": 0}',
    )
    assert run.returncode == 0, run.output[-3000:]
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    from common import make_network

    gradient_bytes = 4 * sum(p.numel() for p in make_network(hidden=64, depth=3).parameters())  # (fp32, ZeRO-0)
    one_hold = 49 * gradient_bytes * 8 / 1e9
    inside = report["summary"]["exchange_seconds_per_step"]
    assert inside[0] >= 0.5 * one_hold, (inside, one_hold)  # rank 0 waits for rank 1's held sends
    computes = [statistics.median(step["compute_seconds"][rank] for step in report["steps"]) for rank in (0, 1)]
    assert max(computes) < 0.5 * one_hold, computes  # (the hold is not compute)
