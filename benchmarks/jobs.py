"""A benchmark's job: one fit in a process session of its own, its output in a log file, and the whole session
killed when it runs past its deadline (no benchmark waits for ever on a stuck job); and what a run's record holds
besides its figures (the command, the commit, the machine, the date)."""

from __future__ import annotations

import os
import platform
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def run_job(command: list[str], log: Path, environment: dict[str, str], timeout: float, name: str) -> None:
    """Run ``command`` to the end; a ``RuntimeError`` naming ``name`` and the log if it fails or times out."""
    with open(log, "w") as handle:
        process = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=environment
        )
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise RuntimeError(f"{name} did not finish in {timeout} s; see {log}") from None
    if process.returncode != 0:
        raise RuntimeError(f"{name} failed ({process.returncode}); see {log}")


def checkout_first(checkout: Path, **variables: str) -> dict[str, str]:
    """This process's environment, with ``variables`` set and ``checkout`` first on ``PYTHONPATH``: a fit and every
    rank it starts (Lightning's launcher, torchrun) import the package of the checkout the benchmark is run from, not
    the editable install, so that a run from a git worktree measures that worktree."""
    path = os.pathsep.join(filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **variables, "PYTHONPATH": path}


def commit_of(checkout: Path) -> str:
    """The short commit of a git checkout ("" where it is not one: a copy of a working tree), for a run's record."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=checkout)
    return found.stdout.strip() if found.returncode == 0 else ""


def run_facts(script: str, argv: Sequence[str], checkout: Path) -> dict[str, Any]:
    """What every run's JSON records beside its figures, so that a results page can say what was run, where and when:
    the command (``script`` with ``argv``, quoted as a shell needs it), the commit of ``checkout``, the machine, its
    CPUs and the start time."""
    return {
        "command": shlex.join([script, *argv]),  # (an argument may hold spaces: local_sgd.py's --only)
        "commit": commit_of(checkout),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
