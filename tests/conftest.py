"""Shared helpers: run a worker script as a bounded, killable process group; the guards every test runs under.

Tiers: ``python -m pytest -q -m "not multiprocess and not fault"`` is the fast tier (no Python process is started);
a test that starts one carries the ``multiprocess`` or ``fault`` marker, and the guard below fails one that does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).parent.parent
# The package's own threads (heartbeat, watchdog, deadline calls) are named so.
PACKAGE_THREAD_PREFIX = "lightning_hetero-"


@pytest.fixture(autouse=True)
def no_package_thread_outlives_its_test():
    """A test that leaves a heartbeat running fails: at the interpreter's exit a daemon thread whose store call
    returns while Python finalises ends inside a noexcept C++ frame and aborts the whole process ("terminate called
    without an active exception", exit 134 after every test passed)."""
    before = set(threading.enumerate())  # a thread an earlier test left is that test's failure
    yield
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(PACKAGE_THREAD_PREFIX)]
        if not left:
            return
        time.sleep(0.05)
    pytest.fail(f"the test left the package's threads running: {left}; stop every watchdog it starts")


PROCESS_TIERS = ("multiprocess", "fault")
# With `pytest -n 2` (pytest-xdist, the README's test command) the engine tests run on one worker, one after the
# other: each starts a cluster's daemons (Ray's, Slurm's, torchrun agents in two network namespaces) that would
# otherwise compete with another cluster's for the same two cores; the other worker takes the rest.
# pytest 9.2 with pytest-xdist 3.8 ignores the group (xdist renames `item._nodeid`, which pytest 9.2 no longer reads:
# pytest-dev/pytest-xdist#1386): the test extra keeps pytest below 9.2 until xdist follows.
ENGINES_ONE_AT_A_TIME = pytest.mark.xdist_group("engines")


@pytest.fixture(autouse=True)
def a_test_that_starts_a_process_is_marked_for_its_tier(request, monkeypatch):
    """Keeps the fast tier free of processes: starting one from a test without a tier marker fails at once."""
    if any(request.node.get_closest_marker(tier) for tier in PROCESS_TIERS):
        yield
        return
    original = subprocess.Popen.__init__

    def refuse_python(self, *args, **kwargs):
        command = args[0] if args else kwargs.get("args")
        program = Path(str(command[0] if isinstance(command, (list, tuple)) else command).split()[0]).name
        # Python processes are what cost (seconds of imports each); a tool the standard library runs (uname,
        # ldconfig) is not a job.
        if program.startswith(("python", "torchrun")) or program == Path(sys.executable).name:
            pytest.fail(
                f"{request.node.nodeid} starts a Python process ({command!r}) but is marked neither"
                f" {' nor '.join(PROCESS_TIERS)}: mark it for its tier (see tests/conftest.py), or the fast tier"
                " starts processes"
            )
        original(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_python)
    yield


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous a test starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_tree(pid: int) -> None:
    """A process and every process under it, by PID: a torchrun agent and its workers, which torchrun starts each in a
    session of its own (so a process-group kill misses them)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for process in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


@dataclass
class RunResult:
    returncode: int
    output: str
    result: Optional[dict[str, Any]]


def run_bounded(
    command: list[str], timeout: float, cwd: Path = REPO, env: Optional[dict[str, str]] = None
) -> tuple[int, str]:
    """Run ``command`` in its own process group; on timeout kill the whole group (Lightning's launched ranks too)."""
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} did not finish within {timeout} s (a hang?). Output:\n{output[-4000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # leftover ranks of a failed run
        except ProcessLookupError:
            pass
    return process.returncode, output


class RunsCode:
    """Unpickling this calls exec, writing "ran" to ``marker``: what a crafted checkpoint does with
    `torch.load(weights_only=False)` (tests/runtime/test_safe_load.py, tests/recover/test_recovery.py, the
    weights_only_directory worker)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def crafted(path: Path, marker: Path, **rest) -> Path:
    """A checkpoint file at ``path`` that runs code (see :class:`RunsCode`) when it is unpickled in full."""
    import torch

    torch.save({"state_dict": {"w": torch.zeros(2)}, "payload": RunsCode(marker), **rest}, path)
    return path


def write_deepspeed_checkpoint(path, stage=2, world_size=2, optimizer_state=None, skip=(), **client_state):
    """DeepSpeed's layout as DeepSpeedStrategy saves it (tag "checkpoint"), with the entries the facts come from and
    ``client_state`` (what Lightning adds) in the model-states files (tests/recover/test_from_deepspeed.py,
    tests/runtime/test_safe_load.py)."""
    import torch

    folder = path / "checkpoint"
    folder.mkdir(parents=True)
    (path / "latest").write_text("checkpoint")
    states = {
        "module": {},
        "dp_world_size": world_size,
        "global_steps": 3,
        "global_step": 3,
        "epoch": 0,
        "ds_config": {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 8},
        "optimizer": optimizer_state if stage == 0 else None,
        **client_state,
    }
    names = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world_size)] if stage == 3 else []
    names = names or ["mp_rank_00_model_states.pt"]
    for name in names:
        torch.save(states, folder / name)
    if stage > 0:
        for rank in range(world_size):
            torch.save(
                {"optimizer_state_dict": {"base_optimizer_state": optimizer_state or {}}},
                folder / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            )
    for name in skip:
        (folder / name).unlink()
    return path


def sigterm_mid_training(command: list[str], out: Path, rank: int, ranks: int) -> tuple[int, str, dict[int, str]]:
    """Start ``command`` (a worker that writes ``pid_rank<r>`` into ``out`` once training runs and ``exit_rank<r>``
    as it exits), SIGTERM rank ``rank`` by its PID, and return the job's exit code, its output and every rank's
    recorded exit code. Bounded: 120 s to start training, 60 s to stop; the process group is killed after."""
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        pid_file = out / f"pid_rank{rank}"
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and process.poll() is None:
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    codes = {r: (out / f"exit_rank{r}").read_text() for r in range(ranks) if (out / f"exit_rank{r}").exists()}
    return process.returncode, output, codes


class WarmRanks:
    """The client of tests/workers/warm_ranks.py: one server per pytest session, started at the first job that asks
    for it and stopped (by PID) when the session ends."""

    def __init__(self) -> None:
        self.process: Optional[subprocess.Popen] = None
        self.directory: Optional[Path] = None
        self.jobs = 0

    @property
    def socket_path(self) -> Path:
        assert self.directory is not None
        return self.directory / "server.sock"

    def start(self) -> None:
        import tempfile

        self.directory = Path(tempfile.mkdtemp(prefix="warm-ranks-"))
        self.log = open(self.directory / "server.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, str(WORKERS / "warm_ranks.py"), str(self.socket_path)],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"},
        )
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not self.socket_path.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / "server.log").read_text()[-3000:]  # (stop() removes the directory)
                self.stop()
                pytest.fail(f"warm_ranks.py did not start within {SERVER_START_SECONDS} s: {log}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: the server kills the jobs that still run, then exits; SIGKILL if it has not within 10 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self.directory is not None:
            self.log.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def job_files(self) -> tuple[Path, Path]:
        """A new job's log and result files (beside the server's socket, not in the test's directory)."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        self.jobs += 1
        return self.directory / f"job-{self.jobs}.log", self.directory / f"job-{self.jobs}.result.json"

    def submit(self, request: dict) -> int:
        """The job's pid (its process group)."""
        import socket

        if self.process is None or self.process.poll() is not None:
            self.start()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(30)
            connection.connect(str(self.socket_path))
            connection.sendall((json.dumps(request) + "\n").encode())
            return int(connection.makefile().readline())


SERVER_START_SECONDS = 120
WARM_RANKS = WarmRanks()


def pytest_sessionfinish(session, exitstatus):
    WARM_RANKS.stop()


def devices_in(args: tuple[str, ...]) -> int:
    return int(args[args.index("--devices") + 1]) if "--devices" in args else 2


def run_warm_job(
    argv: list[str], ranks: int, timeout: float, env: dict[str, str], script: str = "fit"
) -> tuple[int, str]:
    """`SCRIPT ARGV` on each of ``ranks`` ranks, forked from the warm server (see tests/workers/warm_ranks.py, whose
    ``ENTRIES`` name the scripts); like run_bounded: (the job's code, every rank's output), and the test fails when
    the job outlives ``timeout``."""
    log, result = WARM_RANKS.job_files()
    request = {
        "script": script,
        "argv": argv,
        "env": {**os.environ, "PYTHONWARNINGS": "ignore", **env},
        "cwd": str(REPO),
        "log": str(log),
        "ranks": ranks,
        "result": str(result),
    }
    job = WARM_RANKS.submit(request)
    deadline = time.monotonic() + timeout
    while not result.exists():
        if time.monotonic() > deadline:
            try:
                os.killpg(job, signal.SIGKILL)
            except ProcessLookupError:
                pass
            pytest.fail(
                f"{script} {' '.join(argv)} did not finish within {timeout} s (a hang?). Output:\n"
                f"{log.read_text()[-4000:]}"
            )
        time.sleep(0.05)
    return json.loads(result.read_text())["returncode"], log.read_text()


def run_fit(
    out: Path,
    *args: str,
    timeout: float = 240,
    warnings: bool = False,
    env: Optional[dict[str, str]] = None,
    launcher: str = "warm",
) -> RunResult:
    """`tests/workers/fit.py` with ``args`` (and ``env`` added to the environment); its result.json (written by rank
    0) when the run succeeded.

    ``launcher``: "warm" forks the ranks from the warm server, all at once, as torchrun would start them (seconds
    faster per job); "lightning" runs the script, whose rank 0 starts the others through Lightning's launcher, as a
    user's `python train.py` does. Python warnings are hidden unless ``warnings`` (the test asserts one)."""
    env = {**(env or {}), **({"PYTHONWARNINGS": "default"} if warnings else {})}
    if launcher == "warm":
        returncode, output = run_warm_job(["--out", str(out), *args], devices_in(args), timeout, env)
    else:
        assert launcher == "lightning", launcher
        command = [sys.executable, str(WORKERS / "fit.py"), "--out", str(out), *args]
        returncode, output = run_bounded(command, timeout, env=env)
    result_file = out / "result.json"
    result = json.loads(result_file.read_text()) if returncode == 0 and result_file.exists() else None
    return RunResult(returncode, output, result)


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank, so hooks can run their collectives in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = dist.group.WORLD
    yield
    dist.destroy_process_group()
    # Torch's hooks chain callbacks that hold the group (PowerSGD's capture it), and gloo releases a finished
    # callback on its own run-loop thread, just after the future is set. Had that callback held the last reference,
    # ~ProcessGroupGloo would run there and join its own thread: std::system_error, abort (exit 134, or 139; about 1
    # run of this file in 10, seen under gdb). Holding the group here until those releases are done makes this
    # thread's reference the last one.
    time.sleep(0.2)
    del group
