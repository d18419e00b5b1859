"""Emulate: a rank slowed everywhere, its whole process held to a fraction of a core (``emulate_slowdown="process"``).

``emulate_speeds`` alone stretches a rank's compute, in proportion to its micro-batch: exactly what the planner
models. A rank that is slow everywhere is not that. A host CPU limited by the kernel (Kubernetes CPU limits, a shared
VM), a noisy neighbour, a weak host feeding a fast device: such a rank is slow in its loop, its optimizer and its part
of the exchange too, and the kernel stops it wherever its quota runs out, often inside a collective, where the other
ranks then wait. With ``emulate_slowdown="process"`` a rank of speed ``f`` gets that: its process may run ``f`` of each
period of :data:`PERIOD_SECONDS`.

* Where the process may make a cgroup (root, cgroup v1's ``cpu`` controller or v2's ``cpu.max``), the kernel's CFS
  bandwidth control holds it: a cgroup of its own under the one it is in, quota ``f`` x period. All its threads
  together then get ``f`` of one core, as under a container's CPU limit.
* Otherwise a helper process stops and continues it (SIGSTOP, SIGCONT) in a duty cycle of the same period: it runs
  ``f`` of each period (on as many cores as it has threads: with one intra-op thread, as above). The helper exits,
  continuing the rank first, when told to, when the rank is gone, or on SIGTERM.

A drift schedule (``{step: speeds}``) changes the limit at those steps. The profiler and the step meter measure the
rank's compute on its CPU clock, which does not advance while the kernel holds it: the throttle is not seen as a slower
device, as a real one is not. The decisions here (the quota, the duty cycle, where the cgroup goes) are pure functions.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

PERIOD_SECONDS = 0.01  # the CFS period most containers run with is 100 ms; 10 ms keeps a 20 ms step's throttle even
MIN_QUOTA_MICROSECONDS = 1000  # the kernel refuses a CFS quota below 1 ms
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PREFIX = "lightning_hetero_throttle_"


def quota_microseconds(speed: float, period_seconds: float = PERIOD_SECONDS) -> int:
    """The CFS quota that lets a process run ``speed`` of each period, in microseconds (at least the kernel's 1 ms)."""
    return max(MIN_QUOTA_MICROSECONDS, round(speed * period_seconds * 1e6))


def duty_cycle(speed: float, period_seconds: float = PERIOD_SECONDS) -> tuple[float, float]:
    """(seconds running, seconds stopped) of each period for a process held to ``speed`` of it."""
    running = speed * period_seconds
    return running, period_seconds - running


@dataclass(frozen=True)
class CgroupPlace:
    """Where this process's own cgroup goes: ``directory`` (to make), ``version`` (1 or 2), and ``back`` (the
    cgroup.procs file of the cgroup it is in, to return to)."""

    directory: Path
    version: int
    back: Path


def cgroup_place(proc_self_cgroup: str, pid: int, root: Path = CGROUP_ROOT) -> Optional[CgroupPlace]:
    """The cgroup to make for process ``pid`` from its ``/proc/self/cgroup`` text: under cgroup v1's ``cpu``
    controller (a line ``N:cpu,cpuacct:/path``), else v2's unified hierarchy (``0::/path``); None without either."""
    lines = [line.split(":", 2) for line in proc_self_cgroup.splitlines() if line.count(":") >= 2]
    for _, controllers, path in lines:
        if "cpu" in controllers.split(","):
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if mount is not None:
                here = mount / path.lstrip("/")
                return CgroupPlace(here / f"{CGROUP_PREFIX}{pid}", 1, here / "cgroup.procs")
    for _, controllers, path in lines:
        if controllers == "":
            here = root / path.lstrip("/")
            return CgroupPlace(here / f"{CGROUP_PREFIX}{pid}", 2, here / "cgroup.procs")
    return None


class CgroupThrottle:
    """This process in a cgroup of its own whose CFS quota is ``speed`` of each period (see the module docstring)."""

    def __init__(self, place: CgroupPlace, period_seconds: float = PERIOD_SECONDS) -> None:
        self.place, self.period_seconds = place, period_seconds

    def start(self, speed: float) -> None:
        """Make the cgroup, set its quota and move this process (all its threads) into it; OSError when not allowed."""
        _remove_stale_cgroups(self.place.directory.parent)
        self.place.directory.mkdir(exist_ok=True)
        try:
            self.set_speed(speed)
            (self.place.directory / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.stop()
            raise

    def set_speed(self, speed: float) -> None:
        period, quota = round(self.period_seconds * 1e6), quota_microseconds(speed, self.period_seconds)
        if self.place.version == 1:
            (self.place.directory / "cpu.cfs_period_us").write_text(str(period))
            (self.place.directory / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.place.directory / "cpu.max").write_text(f"{quota} {period}")

    def stop(self) -> None:
        """Back into the cgroup it came from, and the cgroup removed (each step tried: called at exit too)."""
        with contextlib.suppress(OSError):
            self.place.back.write_text(str(os.getpid()))
        with contextlib.suppress(OSError):
            self.place.directory.rmdir()

    def describe(self) -> str:
        return f"cgroup v{self.place.version} CPU quota ({self.place.directory})"


def _remove_stale_cgroups(parent: Path) -> None:
    """Cgroups that killed ranks left behind (empty ones of processes that are gone)."""
    with contextlib.suppress(OSError):
        for leftover in parent.glob(f"{CGROUP_PREFIX}*"):
            pid = leftover.name.removeprefix(CGROUP_PREFIX)
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    leftover.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The helper of the duty cycle: stops and continues its parent, and continues it before it leaves, however it leaves.
_DUTY_CYCLE_HELPER = """
import os, signal, sys, time
target, running, stopped = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
def leave(*_):
    try:
        os.kill(target, signal.SIGCONT)
    except ProcessLookupError:
        pass
    os._exit(0)
signal.signal(signal.SIGTERM, leave)
signal.signal(signal.SIGINT, leave)
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: told when the rank dies
except Exception:
    pass
parent = os.getppid()
try:
    while os.getppid() == parent:
        time.sleep(running)
        os.kill(target, signal.SIGSTOP)
        time.sleep(stopped)
        os.kill(target, signal.SIGCONT)
except ProcessLookupError:
    pass
leave()
"""


class DutyCycleThrottle:
    """A helper process that stops and continues this one, running ``speed`` of each period (see the module
    docstring): where no cgroup can be made."""

    def __init__(self, period_seconds: float = PERIOD_SECONDS) -> None:
        self.period_seconds = period_seconds
        self._helper: Optional[subprocess.Popen] = None

    def start(self, speed: float) -> None:
        self.set_speed(speed)

    def set_speed(self, speed: float) -> None:
        self.stop()
        running, stopped = duty_cycle(speed, self.period_seconds)
        if stopped <= 0:
            return
        command = [sys.executable, "-c", _DUTY_CYCLE_HELPER, str(os.getpid()), repr(running), repr(stopped)]
        self._helper = subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True)

    def stop(self) -> None:
        """The helper told to leave (it continues this process first), and waited for."""
        helper, self._helper = self._helper, None
        if helper is None:
            return
        with contextlib.suppress(ProcessLookupError):
            helper.send_signal(signal.SIGTERM)
        try:
            helper.wait(timeout=5)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait(timeout=5)

    def describe(self) -> str:
        return "a helper's SIGSTOP/SIGCONT duty cycle (no cgroup could be made)"


Throttle = Union[CgroupThrottle, DutyCycleThrottle]


def start_throttle(speed: float, period_seconds: float = PERIOD_SECONDS) -> Throttle:
    """This process held to ``speed`` of each period from now on: by its own cgroup where it may make one, else by a
    duty-cycle helper. Undone at exit (and by ``stop()``)."""
    place = None
    with contextlib.suppress(OSError):
        place = cgroup_place(Path("/proc/self/cgroup").read_text(), os.getpid())
    throttle: Throttle
    if place is not None:
        throttle = CgroupThrottle(place, period_seconds)
        try:
            throttle.start(speed)
        except OSError:
            throttle = DutyCycleThrottle(period_seconds)
            throttle.start(speed)
    else:
        throttle = DutyCycleThrottle(period_seconds)
        throttle.start(speed)
    atexit.register(throttle.stop)
    return throttle
