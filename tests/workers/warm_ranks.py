"""A process that imports torch, Lightning, DeepSpeed and the package once, then forks every rank of each test job.

Why: a rank of `fit.py` spends about 3.5 s of CPU importing before it trains for one or two, and Lightning's launcher
starts rank 1 only once rank 0 has imported; most of a 2-rank test job was imports, one after the other. Forked from
this process, the ranks of a job start at once with everything imported, as fresh as a new process: nothing here
trains, initialises a process group, runs a parallel op or starts a thread before forking (OpenBLAS's pool, started by
numpy's import, is fork-safe).

Each rank is launched the way torchrun or a cluster launches one (``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` in its environment, which Lightning reads as "processes created externally"), so
Lightning's subprocess launcher does not start more. The job process plays the part of that launcher: the job's code is
rank 0's; when another rank ends with a non-zero code it kills the rest (SIGKILL), as Lightning's child-process observer
does every 5 s; it waits for every rank (as the test waited for the end of the output every rank wrote to).

Protocol: ``python warm_ranks.py SOCKET``. The socket appears once the imports are done. A client sends one JSON line
``{"script", "argv", "env", "cwd", "log", "ranks", "result"}`` (``script``: a key of ``ENTRIES``) and gets back one
line, the job's pid, which is also its process group (kill that group to stop the job). Every rank writes its stdout
and stderr into ``log``; when the last rank has ended, the job writes ``{"returncode": rank 0's code, "codes": every
rank's}`` to ``result`` (atomically). Codes are as `subprocess` reports them (-N: killed by signal N). The server
exits when its parent (pytest) is gone, killing the jobs it started, and so it does on SIGTERM.

A rank ends as a fresh process does, less the interpreter's teardown (see ``run_rank``); the tests that start fresh
processes (the CLI, the example, torchrun, Ray, Slurm, one pipeline case) keep that teardown covered.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

WORKERS = Path(__file__).parent
sys.path.insert(0, str(WORKERS))

STARTUP_FILTERS = list(warnings.filters)  # what a fresh interpreter starts with, before any module adds its own

import deepspeed  # noqa: E402, F401
import fit  # noqa: E402  (torch, Lightning, the package and the test models, imported once for every rank)
import matplotlib  # noqa: E402
import pipeline_fit  # noqa: E402

import lightning_hetero.strategy  # noqa: E402, F401

# The run report's plot (rank 0, at the end of every fit) imports pyplot with this backend: a second of a 2-second job.
matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402, F401


def run_pytest() -> None:
    """`python -m pytest ARGS` on a rank (Lightning's standalone tests, each rank running the same ones)."""
    import pytest

    raise SystemExit(pytest.main(sys.argv[1:]))


# The worker scripts a job may run, by name: what each runs after its imports.
ENTRIES = {"fit": fit.entry, "pipeline_fit": pipeline_fit.main, "pytest": run_pytest}

# The filters that imports added (each inserted in front of the startup ones): a fresh rank has them in front of those
# from PYTHONWARNINGS, which it reads before importing anything.
# Some modules append theirs instead (requests and urllib3, which DeepSpeed imports where they are installed): a fresh
# rank has those after the startup ones.
_FRONT = next(
    (i for i in range(len(warnings.filters) + 1) if warnings.filters[i : i + len(STARTUP_FILTERS)] == STARTUP_FILTERS),
    None,
)
assert _FRONT is not None, "an import removed or reordered the interpreter's own warning filters"
IMPORT_FILTERS = list(warnings.filters[:_FRONT])
APPENDED_FILTERS = list(warnings.filters[_FRONT + len(STARTUP_FILTERS) :])

OBSERVER_PERIOD = 5.0  # Lightning's _ChildProcessObserver sleep_period


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def warning_filters_for(pythonwarnings: str) -> list:
    """The filter list a fresh interpreter with this PYTHONWARNINGS has once the same modules are imported."""
    warnings.filters[:] = []
    warnings._processoptions([option for option in pythonwarnings.split(",") if option])
    from_environment = list(warnings.filters)
    return IMPORT_FILTERS + from_environment + STARTUP_FILTERS + APPENDED_FILTERS


def become_rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: the environment, streams, warnings and rank a freshly started rank would have."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(request["ranks"]),
    )
    os.chdir(request["cwd"])
    sys.argv = [str(WORKERS / f"{request['script']}.py"), *request["argv"]]  # (pytest: argv[0] is not read)
    warnings.filters[:] = warning_filters_for(os.environ.get("PYTHONWARNINGS", ""))
    warnings._filters_mutated()
    # Lightning reads the rank from the environment when it is imported, which happened here before there was a rank
    import lightning.fabric.utilities.rank_zero as fabric_rank_zero
    import lightning_utilities.core.rank_zero as utilities_rank_zero

    fabric_rank_zero.rank_zero_only.rank = utilities_rank_zero.rank_zero_only.rank = rank
    for number in (signal.SIGCHLD, signal.SIGTERM):  # (Python starts with SIGPIPE ignored; so it stays)
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def run_job(request: dict) -> dict:
    """In the job's process (its own process group): fork the ranks, watch them as Lightning's launcher would, write
    the result. Returns (the request) only in a rank's child, which then runs the rank (see ``__main__``)."""
    port = free_port()
    Path(request["log"]).touch()
    ranks = {}
    for rank in range(request["ranks"]):
        pid = os.fork()
        if pid == 0:
            become_rank(request, rank, port)
            return request
        ranks[pid] = rank
    codes: dict[int, int] = {}
    started = time.monotonic()
    next_observation = started + OBSERVER_PERIOD
    while len(codes) < len(ranks):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[ranks[pid]] = exit_code(status)
            continue
        if time.monotonic() >= next_observation:
            next_observation += OBSERVER_PERIOD
            if any(code != 0 for rank, code in codes.items() if rank != 0):
                for other, rank in ranks.items():
                    if rank not in codes:
                        os.kill(other, signal.SIGKILL)
        time.sleep(0.05)
    result = Path(request["result"])
    partial = result.with_suffix(".partial")
    partial.write_text(json.dumps({"returncode": codes[0], "codes": [codes[r] for r in sorted(codes)]}))
    partial.replace(result)
    os._exit(0)


def reap(jobs: set[int]) -> None:
    """Forget the jobs that ended (their result is a file), so that only running ones are ever killed."""
    for job in list(jobs):
        if os.waitpid(job, os.WNOHANG)[0]:
            jobs.discard(job)


def serve(path: str) -> dict:
    """Accept jobs until the parent is gone. Returns (the job's request) only in a rank's child."""
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".binding")
    server.listen(16)
    os.replace(path + ".binding", path)  # the client sees the socket only once it listens
    server.settimeout(1.0)
    jobs: set[int] = set()
    stopping = []
    signal.signal(signal.SIGTERM, lambda number, frame: stopping.append(number))
    while os.getppid() == parent and not stopping:
        reap(jobs)
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        with connection:
            request = json.loads(connection.makefile().readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                connection.close()
                os.setsid()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                return run_job(request)  # a rank
            jobs.add(pid)
            connection.sendall(f"{pid}\n".encode())
    reap(jobs)
    for job in jobs:  # pytest is gone or done: stop the jobs it started that still run
        try:
            os.killpg(job, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os._exit(0)


def run_rank(entry) -> None:
    """Run the rank (what `python SCRIPT.py ARGS` runs after its imports), then end as the interpreter ends, less its
    teardown: wait for the threads that are not daemons, run the exit handlers, flush, exit with the code Python would
    give. Why: the interpreter's teardown of everything imported before the fork writes to every page the ranks share
    with this server, a copy of hundreds of MB per rank: 1.5 to 2 s of a 2-second job (measured), while a fresh
    process's teardown leaves nothing behind that a test could see (the exit handlers close Lightning's loggers and
    the process group)."""
    code: int = 0
    interrupted = False
    try:
        entry()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # `sys.exit("message")`: Python prints it and exits with 1
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # Python prints it and ends such a process by SIGINT itself (-2 to its parent)
        sys.excepthook(*sys.exc_info())
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # (what Py_FinalizeEx calls first: join non-daemon threads)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # what C and C++ code printed into its stdio buffers (teardown would flush them)
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)  # (as a fresh process: sys.exit(-1) is 255)


if __name__ == "__main__":
    # Every object imported so far lives as long as the server: out of the collector's sight, a rank's collections do
    # not touch (and so copy) the pages it shares with this process.
    gc.freeze()
    job = serve(sys.argv[1])
    run_rank(ENTRIES[job["script"]])  # this process is now a rank
