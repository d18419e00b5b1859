"""Keep this machine's cores from going idle while a benchmark runs (``--keep-cores-awake``).

On this machine (a virtual one) a core that has gone idle takes about 2.5-3 ms to wake for a thread that another core
wakes, as when a peer's data arrives for a rank blocked in a collective: ``collective_latency.py`` measured the late
rank's 80 KiB all-reduce at a median of 2.9 ms against 0.35 ms with the cores kept busy. A busy loop per core at the
idle scheduling policy (``SCHED_IDLE``: it runs only when nothing else wants the core, and gives way at once) keeps
them from going idle, as a host whose idle cores poll would. The loops are this module's child processes, each
killed by its PID when the block ends, however it ends (and ending by itself if this process is killed).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# The loop ends by itself once its parent is gone (a benchmark killed with SIGKILL cannot kill it), checking about
# every millisecond.
_BUSY_LOOP = (
    "import os, sys\n"
    "core, parent = int(sys.argv[1]), int(sys.argv[2])\n"
    "os.sched_setaffinity(0, {core})\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(20000):\n"
    "        pass\n"
)


@contextlib.contextmanager
def cores_kept_awake(enabled: bool = True) -> Iterator[None]:
    """One idle-priority busy loop per core for the block (nothing if not ``enabled``)."""
    loops: list[subprocess.Popen[bytes]] = []
    try:
        if enabled:
            for core in sorted(os.sched_getaffinity(0)):
                loops.append(subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(core), str(os.getpid())]))
        yield
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()
