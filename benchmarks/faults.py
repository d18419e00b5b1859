"""How soon every surviving rank exits after a rank, or the host of the rendezvous store, is killed or frozen.

    python benchmarks/faults.py                         # every case once, peer_timeout=10, 2 busy processes as load
    python benchmarks/faults.py --runs 3 --load 0
    python benchmarks/faults.py --cases torchrun:agent:STOP --out /tmp/faults.json

Two CPU ranks train (``tests/workers/fit.py``, ZeRO-2, gloo) under each way of starting them:

    lightning   Lightning's launcher: rank 0 is the process started here, it starts rank 1; rank 0 hosts the store
    env         both ranks started here by hand with env:// variables (MASTER_ADDR...); rank 0 hosts the store
    torchrun    ``torch.distributed.run --standalone``: the agent starts both ranks and hosts the store

Once both ranks have trained three steps, one process gets SIGKILL (gone) or SIGSTOP (frozen: its sockets stay
open): rank 0, rank 1, or the torchrun agent. The survivors are then watched every 50 ms until their processes are
gone (a zombie counts as gone). For each survivor the figure is the seconds from the signal to its end, and what it
said: ``75`` when it printed the package's "exits with code 75" (the watchdog's or a broken collective's message),
or what ended it otherwise (Lightning's launcher ending the job, torchrun stopping the workers). The target is every
survivor gone within ``peer_timeout + 2`` seconds. ``--load N`` runs N busy processes meanwhile (the machine has 2
cores, so the ranks compete for them).

Results are printed and written to ``--out`` (default ``benchmarks/results/faults.json``): every case of every run,
each survivor's seconds and what it said, with the command, the commit, the machine and the date; a run worth keeping
is committed as ``benchmarks/measured/faults_<what>.json`` and rendered by ``python benchmarks/render.py``
(``docs/results/faults.md``). The ranks import the package beside this script (``PYTHONPATH``), so a run from a git
worktree measures that worktree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))  # benchmarks/jobs.py (benchmarks/ is no package: its scripts run as files)
from jobs import checkout_first, run_facts  # noqa: E402

WORKER = REPO / "tests" / "workers" / "fit.py"
DEFAULT_OUT = HERE / "results" / "faults.json"
BATCH_SIZES = ["8", "8"]
CASES = [
    f"{launcher}:{victim}:{how}"
    for launcher in ("lightning", "env", "torchrun")
    for victim in ("rank0", "rank1", *(("agent",) if launcher == "torchrun" else ()))
    for how in ("STOP", "KILL")
]
WATCH_SECONDS = 90.0
POLL_SECONDS = 0.05


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(launcher: str, out: Path, peer_timeout: float) -> list[subprocess.Popen]:
    """The processes started here: [rank 0 (lightning)], [rank 0, rank 1] (env) or [agent] (torchrun)."""
    args = [
        "--out",
        str(out),
        "--batch-sizes",
        *BATCH_SIZES,
        "--max-epochs",
        "100000",
        "--signal-test",
        "--strategy-args",
        json.dumps({"peer_timeout": peer_timeout}),
    ]
    # The package beside this script before an installed one (tests/workers/fit.py puts only its own folder on
    # sys.path): a run from a worktree measures the worktree.
    env = checkout_first(REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    popen = {
        "cwd": REPO,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        "text": True,
        "start_new_session": True,
    }
    if launcher == "lightning":
        return [subprocess.Popen([sys.executable, str(WORKER), *args], env=env, **popen)]
    if launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            "--monitor-interval=0.5",
            str(WORKER),
            *args,
        ]
        return [subprocess.Popen(command, env=env, **popen)]
    port = str(free_port())
    ranks = []
    for rank in (0, 1):
        by_hand = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "LOCAL_WORLD_SIZE": "2",
        }
        ranks.append(subprocess.Popen([sys.executable, str(WORKER), *args], env={**env, **by_hand}, **popen))
    return ranks


def wait_for_training(out: Path, started: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    files = [out / f"pid_rank{rank}" for rank in (0, 1)]
    while not all(f.exists() and f.read_text() for f in files):
        if any(process.poll() is not None for process in started) or time.monotonic() > deadline:
            raise RuntimeError(f"the job did not start training: {[p.poll() for p in started]}")
        time.sleep(0.1)
    return [int(f.read_text()) for f in files]


def running(pid: int) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    return False


def run_case(case: str, peer_timeout: float) -> dict[str, Any]:
    launcher, victim, how = case.split(":")
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory)
        started = start(launcher, out, peer_timeout)
        ranks: list[int] = []
        try:
            ranks = wait_for_training(out, started)
            processes = {"rank0": ranks[0], "rank1": ranks[1], "agent": started[0].pid}
            survivors = {name: pid for name, pid in processes.items() if name != victim and name != "agent"}
            signalled = time.monotonic()
            os.kill(processes[victim], getattr(signal, f"SIG{how}"))
            gone: dict[str, float] = {}
            while len(gone) < len(survivors) and time.monotonic() - signalled < WATCH_SECONDS:
                for name, pid in survivors.items():
                    if name not in gone and not running(pid):
                        gone[name] = time.monotonic() - signalled
                for process in started:
                    process.poll()  # reap what was started here
                time.sleep(POLL_SECONDS)
        finally:
            for process in started:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            for pid in ranks:  # torchrun starts each worker in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        output = "".join(process.communicate()[0] for process in started)
    said = {f"rank{rank}": "75" for rank in re.findall(r"Rank (\d+) exits with code 75", output)}
    if "Forcefully terminating all other processes" in output:
        said.setdefault("rank0", "launcher ended the job")
        said.setdefault("rank1", "launcher ended the job")
    if "SignalException" in output or "Sending process" in output:
        for name in survivors:
            said.setdefault(name, "torchrun stopped it")
    return {
        "case": case,
        "peer_timeout": peer_timeout,
        "seconds": {name: gone.get(name) for name in survivors},
        "said": {name: said.get(name, "?") for name in survivors},
    }


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=CASES, help=f"from {CASES}")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--load", type=int, default=2, help="busy processes running meanwhile")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    facts = run_facts("benchmarks/faults.py", sys.argv[1:], HERE)
    load = busy_processes(args.load)
    results = []
    try:
        for run in range(args.runs):
            for case in args.cases:
                try:
                    result = run_case(case, args.peer_timeout)
                except RuntimeError as error:  # (a job that never started training: recorded, the others go on)
                    results.append({"case": case, "run": run, "seconds": {}, "said": {}, "error": str(error)})
                    print(f"{case:22s} not measured: {error}", flush=True)
                    continue
                results.append({**result, "run": run})
                parts = [
                    f"{name} {'still running' if s is None else f'{s:.1f} s'} ({result['said'][name]})"
                    for name, s in result["seconds"].items()
                ]
                print(f"{case:22s} " + ", ".join(parts), flush=True)
    finally:
        for process in load:
            process.kill()
            process.wait()
    late = [s for r in results for s in r["seconds"].values() if s is None or s > args.peer_timeout + 2]
    every = [s for r in results for s in r["seconds"].values() if s is not None]
    summary = {
        "survivors": len(every) + sum(s is None for r in results for s in r["seconds"].values()),
        "later_than_peer_timeout_plus_2": len(late),
        "cases_not_started": sum("error" in r for r in results),
        "median_seconds": statistics.median(every) if every else None,
        "max_seconds": max(every) if every else None,
    }
    print(f"peer_timeout={args.peer_timeout:g} s, {args.load} busy processes: {json.dumps(summary)}")
    setting = {
        "peer_timeout": args.peer_timeout,
        "target_seconds": args.peer_timeout + 2,
        "load": args.load,
        "cases": args.cases,
        "runs": args.runs,
        "batch_sizes": [int(size) for size in BATCH_SIZES],
        "watch_seconds": WATCH_SECONDS,
        "poll_seconds": POLL_SECONDS,
    }
    # Every case of every run: each survivor's seconds from the signal to its end (None: still running when the
    # watch ended) and what it said.
    record = {**facts, "setting": setting, "results": results, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
