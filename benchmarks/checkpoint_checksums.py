"""What the per-file CRC-32 of the checkpoint manifest costs on a 1 GB checkpoint.

    python benchmarks/checkpoint_checksums.py                 # 1 GB, 3 repeats
    python benchmarks/checkpoint_checksums.py --gigabytes 4 --repeats 1

A checkpoint directory shaped like a 2-rank ZeRO-2 DeepSpeed checkpoint (one model-states file, one optimizer-states
file per rank, torch.save of fp32 tensors) is written, then timed, each ``--repeats`` times:

    write        torch.save of the files (what DeepSpeed's save costs at least)
    sizes        the manifest as format 1 had it: every file's size (no reading)
    manifest     ``checkpoint.write_manifest``: sizes and CRC-32 of every file (rank 0, at every save)
    verify       ``checkpoint.incompleteness(verify_checksums=True)``: what a resume reads (rank 0, once)
    verify cold  the same after dropping the page cache (root only: /proc/sys/vm/drop_caches), as after a restart

The manifest's extra cost is ``manifest - sizes``. Results are printed and written to ``--out`` (default
``benchmarks/results/checkpoint_checksums.json``): every repeat's seconds, with the command, the commit, the machine
and the date; a run worth keeping is committed as ``benchmarks/measured/checkpoint_checksums_<what>.json`` and rendered
by ``python benchmarks/render.py`` (``docs/results/checkpoint_checksums.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/jobs.py (benchmarks/ is no package: its scripts run as files)
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
from jobs import run_facts  # noqa: E402

from lightning_hetero.recover import checkpoint  # noqa: E402

DEFAULT_OUT = HERE / "results" / "checkpoint_checksums.json"


def write_files(directory: Path, total_bytes: int) -> None:
    """A third of the bytes in the model states, the rest in two optimizer-state shards."""
    parts = {"checkpoint/mp_rank_00_model_states.pt": total_bytes // 3}
    for rank in (0, 1):
        parts[f"checkpoint/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = total_bytes // 3
    for name, size in parts.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tensor": torch.randn(size // 4)}, directory / name)
    (directory / "latest").write_text("checkpoint")


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.repeats < 1 or args.gigabytes <= 0:
        parser.error(
            f"--repeats {args.repeats} --gigabytes {args.gigabytes:g}: a run needs at least one repeat of a checkpoint"
            " of more than 0 GB (e.g. --repeats 3 --gigabytes 1)"
        )
    facts = run_facts("benchmarks/checkpoint_checksums.py", sys.argv[1:], HERE)
    figures: dict[str, list[float]] = {"write": [], "sizes": [], "manifest": [], "verify": [], "verify cold": []}
    total = int(args.gigabytes * 1e9)
    # Every repeat's seconds (a fresh checkpoint each); "verify_cold" None where the page cache could not be dropped.
    repeats: list[dict[str, Optional[float]]] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(dir=HERE) as name:
            directory = Path(name)
            figures["write"].append(timed(partial(write_files, directory, total)))
            size = sum(checkpoint.list_files(directory).values())
            figures["sizes"].append(timed(partial(checkpoint.list_files, directory)))
            figures["manifest"].append(timed(partial(checkpoint.write_manifest, directory, {"global_step": 1})))
            verify = partial(checkpoint.incompleteness, directory, verify_checksums=True)
            figures["verify"].append(timed(verify))
            cold = timed(verify) if drop_page_cache() else None
            if cold is not None:
                figures["verify cold"].append(cold)
        last = {what: seconds[-1] for what, seconds in figures.items() if what != "verify cold"}
        extra_seconds = last["manifest"] - last["sizes"]
        repeats.append({**last, "verify_cold": cold, "manifest_extra": extra_seconds})
    for what, seconds in figures.items():
        if seconds:
            runs = "  ".join(f"{s:6.3f} s" for s in seconds)
            print(f"{what:12s} {runs}   median {statistics.median(seconds):.3f} s")
    extra = [m - s for m, s in zip(figures["manifest"], figures["sizes"])]
    print(
        f"checkpoint of {size / 1e9:.2f} GB: the checksums add {statistics.median(extra):.3f} s to a save"
        f" ({statistics.median(extra) / statistics.median(figures['write']):.1%} of writing it)"
    )
    setting = {
        "gigabytes": args.gigabytes,
        "bytes": size,
        "files": 3,  # one model-states file, one optimizer-states file per rank of 2
        "repeats": args.repeats,
        "page_cache_dropped": all(r["verify_cold"] is not None for r in repeats),
    }
    record = {
        **facts,
        "setting": setting,
        "repeats": repeats,
        "bytes": size,
        "seconds": figures,
        "manifest_extra_seconds": extra,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
