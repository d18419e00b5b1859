"""A clean interpreter exit after a gloo job: a work-around for a race in torch (pytorch/pytorch#190489).

A gloo worker thread ("pt_gloo_runloop") releases each collective's work object after the caller's ``wait()`` has
returned. If the caller has already dropped its tensors, that release drops the last reference to their Python
objects and has to take the GIL. When the interpreter is finalising by then, taking the GIL ends the thread
inside a ``noexcept`` destructor and the whole process aborts with "terminate called without an active exception"
(exit code -6) after a run that succeeded. Only a short gap separates the last collective and the exit, so it is
rare, but a loaded machine (two ranks on two cores) hits it: a bare two-process gloo script that exits right after
an ``all_gather_object`` aborted in 10 of 80 processes here.

``destroy_process_group()`` alone does not close the gap: it unregisters the groups, but their worker threads live
on while anything references a group (DeepSpeed's engine, its parameters and ``deepspeed.utils.groups`` do). So at
exit this also waits, with the GIL released, until no gloo worker thread is runnable: a worker that still has a
release to finish gets the CPU and the GIL and finishes it while the interpreter can still serve it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Any, Optional

import torch.distributed

from lightning_hetero.runtime.files import read_text

GLOO_WORKER_THREAD_NAME = "pt_gloo_runloop"
# Settled means: two checks in a row, one poll apart, saw no gloo worker runnable. Bounded, so that a worker stuck
# in a collective another rank never joins (a job that failed) delays the exit by at most this long.
_POLL_SECONDS = 0.005
_QUIET_CHECKS = 2
_MAX_WAIT_SECONDS = 2.0


_EXIT_CODE_ATTRIBUTE = "_lightning_hetero_exit_code"
# The exit code an uncaught exception asked for (see exit_with_if_uncaught); None: Python's own (1).
_exit_code: Optional[int] = None


def register_exit_cleanup() -> None:
    """Destroy the process groups and let gloo's workers settle when the interpreter exits (once per process)."""
    atexit.unregister(_clean_up_at_exit)
    atexit.register(_clean_up_at_exit)
    if getattr(sys.excepthook, "__wrapped__", None) is None:
        sys.excepthook = _note_exit_code(sys.excepthook)


def exit_with_if_uncaught(exception: BaseException, code: int) -> None:
    """Make the process exit with ``code`` (instead of Python's 1) if ``exception`` ends it uncaught.

    A rank whose collective broke because a peer is gone exits as the watchdog does (75: "lost a peer; retry"), so a
    scheduler or torchrun reads the same code whichever noticed first. A script that catches the exception is
    untouched. The traceback is printed as usual, and the exit cleanup runs before the code is applied.
    """
    setattr(exception, _EXIT_CODE_ATTRIBUTE, code)


def requested_exit_code(exception: BaseException) -> Optional[int]:
    """The code :func:`exit_with_if_uncaught` gave ``exception``; None when it asked for none."""
    return getattr(exception, _EXIT_CODE_ATTRIBUTE, None)


def _note_exit_code(hook: Any) -> Any:
    def excepthook(kind: type, value: BaseException, traceback: Any) -> None:
        global _exit_code
        hook(kind, value, traceback)
        _exit_code = requested_exit_code(value)

    excepthook.__wrapped__ = hook  # type: ignore[attr-defined]
    return excepthook


def _clean_up_at_exit() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    wait_for_gloo_workers_to_settle()
    if _exit_code is not None:
        # atexit cannot change the code of an exit by exception; leaving here skips the handlers registered before
        # this one, so the two that matter are run first.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_code)


def wait_for_gloo_workers_to_settle(max_wait: float = _MAX_WAIT_SECONDS) -> bool:
    """Sleep (GIL released) until no gloo worker thread of this process is runnable; False if ``max_wait`` ran out.

    Where threads cannot be inspected (no ``/proc``), it sleeps the minimum and returns True.
    """
    deadline = time.monotonic() + max_wait
    quiet = 0
    while quiet < _QUIET_CHECKS:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
        quiet = 0 if runnable_gloo_workers() else quiet + 1
    return True


def runnable_gloo_workers() -> int:
    """How many of this process's gloo worker threads are running or waiting for a CPU (state R in /proc)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    runnable = 0
    for task in tasks:  # a thread that ends while we look reads as None
        if (read_text(f"/proc/self/task/{task}/comm") or "").strip() != GLOO_WORKER_THREAD_NAME:
            continue
        # The state follows the parenthesised name, which may itself hold spaces or parentheses.
        fields = (read_text(f"/proc/self/task/{task}/stat") or "").rpartition(")")[2].split()
        runnable += bool(fields) and fields[0] == "R"
    return runnable
