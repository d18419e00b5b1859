"""What one gradient exchange costs on this machine when one rank waits for the other: plain torch, no package.

    python benchmarks/collective_latency.py              # 4 settings x 400 exchanges (about 20 s)
    python benchmarks/collective_latency.py --rounds 1000 --kib 600
    python benchmarks/collective_latency.py --keep-cores-awake   # the same, no core left idle (awake.py)

Two processes (gloo on 127.0.0.1, one intra-op thread each) repeat a round: rank 0 computes for ``--busy-ms``
(4 ms, a busy loop standing in for forward and backward), rank 1 is ``--late-ms`` late (5 ms asleep, as a loader
stall), then both all-reduce ``--kib`` KiB of float32. The figure is the late rank's wall time in the all-reduce: the
exchange itself, plus any delay in waking the rank that arrived first and blocked waiting for it. The settings:

    waiter, pinned       each rank's threads on a core of its own (as two hosts, and as data_stall.py --pin)
    waiter, unpinned     the scheduler places the threads on either core
    no waiter, pinned    the control: rank 0 sleeps as long as rank 1, so neither waits long for the other
    no waiter, unpinned

This is the per-step cost that data_stall.py's split cannot move: on a host where waking a blocked thread takes
microseconds, the late rank's exchange is the copy and the reduction alone (``--keep-cores-awake`` shows how much of
it is the wake-up: see ``awake.py``). Results are printed (median, 90th percentile, and the share of exchanges that
took more than 2 ms); the JSON (``--out``, default ``benchmarks/results/collective_latency.json``) holds every
exchange's time in each setting with those figures, the command, the commit, the machine and the date. A run worth
keeping is committed as ``benchmarks/measured/collective_latency_<what>.json`` and rendered by ``python
benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from awake import cores_kept_awake  # noqa: E402
from jobs import run_facts  # noqa: E402

DEFAULT_OUT = HERE / "results" / "collective_latency.json"
WARMUP_ROUNDS = 50
SLOW_EXCHANGE_MS = 2.0
SETTINGS = (("waiter", True), ("waiter", False), ("no waiter", True), ("no waiter", False))
DEADLINE_SECONDS = 120  # the rendezvous, and each collective, past which a process gives up


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rank_main(rank: int, port: int, setting: tuple[str, bool], args: argparse.Namespace, out: str) -> None:
    """One process: the rounds, and (rank 1) its exchange times written to ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=DEADLINE_SECONDS))
    kind, pinned = setting
    if pinned:  # every thread so far (gloo's included) on the rank-th core this process may use; later ones inherit it
        allowed = sorted(os.sched_getaffinity(0))
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), {allowed[rank % len(allowed)]})
    gradient = torch.zeros(args.kib * 256)
    exchange_ms = []
    for _ in range(WARMUP_ROUNDS + args.rounds):
        if rank == 1 or kind == "no waiter":
            time.sleep(args.late_ms / 1e3)
        else:
            spin(args.busy_ms / 1e3)
        start = time.perf_counter()
        dist.all_reduce(gradient)
        exchange_ms.append((time.perf_counter() - start) * 1e3)
    dist.destroy_process_group()
    if rank == 1:
        Path(out).write_text(json.dumps(exchange_ms[WARMUP_ROUNDS:]))


def figures(exchange_ms: list[float]) -> dict[str, float]:
    ordered = sorted(exchange_ms)
    return {
        "median_ms": statistics.median(ordered),
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
        "share_over_2ms": sum(ms > SLOW_EXCHANGE_MS for ms in ordered) / len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--busy-ms", type=float, default=4.0)
    parser.add_argument("--late-ms", type=float, default=5.0)
    parser.add_argument("--kib", type=int, default=80, help="the gradient's size in KiB (float32)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep-cores-awake", action="store_true", help="an idle-priority busy loop on every core")
    args = parser.parse_args()
    if args.rounds <= 0 or args.kib <= 0:
        parser.error(f"--rounds {args.rounds} and --kib {args.kib}: give positive numbers")
    import torch.multiprocessing as mp

    facts = run_facts("benchmarks/collective_latency.py", sys.argv[1:], HERE)
    results = {}
    for setting in SETTINGS:
        name = f"{setting[0]}, {'pinned' if setting[1] else 'unpinned'}"
        out = args.out.with_name(args.out.stem + ".rank1.tmp")
        out.parent.mkdir(parents=True, exist_ok=True)
        with cores_kept_awake(args.keep_cores_awake):
            mp.start_processes(rank_main, args=(free_port(), setting, args, str(out)), nprocs=2, start_method="spawn")
        exchange_ms = json.loads(out.read_text())
        out.unlink()
        # every exchange of the late rank, in order (to the tenth of a microsecond), beside the figures taken from them
        results[name] = {**figures(exchange_ms), "exchange_ms": [round(ms, 4) for ms in exchange_ms]}
        row = results[name]
        print(
            f"{name:22s} the late rank's all-reduce: median {row['median_ms']:.2f} ms, 90th percentile"
            f" {row['p90_ms']:.2f} ms, over {SLOW_EXCHANGE_MS:.0f} ms in {row['share_over_2ms']:.0%}",
            flush=True,
        )
    setting_text = {
        "rounds": args.rounds,
        "busy_ms": args.busy_ms,
        "late_ms": args.late_ms,
        "kib": args.kib,
        "cores_kept_awake": args.keep_cores_awake,
        "warmup_rounds": WARMUP_ROUNDS,
        "slow_exchange_ms": SLOW_EXCHANGE_MS,
    }
    args.out.write_text(json.dumps({**facts, "setting": setting_text, "results": results}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
