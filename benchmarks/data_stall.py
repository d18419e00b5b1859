"""A rank whose data loader stalls: the split that counts the wait for data against the split that ignores it.

    python benchmarks/data_stall.py                  # 3 fits of 6 phases (41 s on 2 cores)
    python benchmarks/data_stall.py --runs 5 --stall-ms 5
    python benchmarks/data_stall.py --sweep          # the ceiling: fixed splits in turn (see below)

Two CPU ranks of the same speed train the examples' spiral classifier (width ``--hidden``, 4 blocks, without logging
its loss every step; a global batch of 128, Adam, ZeRO-0). Rank 1's loader is ``--stall-ms`` (default 5 ms) behind on
every batch: its collate function sleeps that long, as a loader whose host has too few cores or slow storage makes
the rank wait.

Each fit alternates two kinds of phase of ``PHASE_STEPS`` training steps, re-planning every 10 steps:

    ignoring   the split of a job that ignores the stall. ``--baseline equal`` (the default): the equal split, as
               the plan gives two ranks of the same speed (and as DDP or DeepSpeed would run them), re-planning off
               for the phase. ``--baseline compute``: the re-planner as it was before it counted the wait for data,
               its refit given the steps with the wait set to 0, so it balances compute alone. (That one is not a
               clean baseline: it starts from the counting phase's split and moves back only by steps worth more
               than its noise margin, and the stalled rank's compute per sample is a few per cent slower after each
               sleep, so it keeps part of the counting phase's shift: shares of 0.22-0.55 for the stalled rank.)
    counting   the re-planner as it is: each rank's time per step is its compute plus its wait for data, and the
               stalled rank gets fewer samples

The two kinds take turns in the same process, a few seconds apart, so a slow minute of the shared machine hits both
alike (separate fits of each kind differed by up to 20 % between pairs here). A phase is measured over its last
``MEASURED_STEPS`` steps, after its re-plans have settled. The figures, per pair of neighbouring phases: each one's
median step time (the report's ``step_seconds``: the slowest rank's wall time from fetching its batch to the end of
its optimizer step) and their ratio (the speedup of counting the wait); the busiest rank's compute plus wait (the
part a split moves); the stalled rank's share of the batch; and whether the run report names the stall.

``--pin`` runs each rank's threads on a core of its own, as two hosts would. Unpinned, the two ranks share this
machine's two cores, and while the stalled rank sleeps the other rank's helper threads (gloo's, the heartbeat) run
on its core: the stall then costs the pair less than it would cost two hosts (the equal split's step was 16.2 ms
unpinned against 18.4 ms pinned in two sweeps of the same hour, the best split's 13.6 and 12.9 ms).

``--keep-cores-awake`` keeps a busy loop at the idle scheduling policy on each core while the fits run (``awake.py``):
on this virtual machine a core that went idle (the stalled rank asleep, a rank blocked waiting for the other) takes
2.5-3 ms to wake for the thread its peer wakes, a cost that lands in every step's exchange whatever the split
(``collective_latency.py`` measures it apart from the package).

``--sweep`` measures the ceiling instead: one fit whose phases of ``--sweep-phase-steps`` steps (default 40) run
fixed splits in turn (``--sweep-shares``: the stalled rank's share in sixteenths of the global batch, default 8 5 3 2
1, re-planning off), each split's step time the median of its phases' medians (each over the phase's second half);
the figure is each split's speedup over the equal one: what a fixed split gave on this machine and model, whatever
the re-planner does. With ``--sweep-phase-steps 10`` the splits change every window, so two splits alternate
every 150 ms or so, closer than the machine's slow and fast spells.

The JSON (``--out``; default ``benchmarks/results/data_stall.json``, ``data_stall_sweep.json`` with ``--sweep``) holds
the command, the commit, the machine and the date, the setting, and every phase and pair of every fit (with
``--sweep``, every phase's median step of every split); a run worth keeping is committed as
``benchmarks/measured/data_stall_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from awake import cores_kept_awake  # noqa: E402
from jobs import checkout_first, run_facts, run_job  # noqa: E402

DEFAULT_OUT = HERE / "results" / "data_stall.json"
DEFAULT_SWEEP_OUT = HERE / "results" / "data_stall_sweep.json"
GLOBAL_BATCH = 128
STEPS_PER_EPOCH = 100
STALLED_RANK = 1
FIT_TIMEOUT = 600
WINDOW = 10  # steps between exchanges of the ranks' records, and so between re-plan points
PHASE_STEPS, MEASURED_STEPS = 60, 20
KINDS = ("ignoring", "counting")  # phase 0 ignores, phase 1 counts, ...
# The classifier's width. At 384 the whole global batch's compute (about 7 ms here) exceeds the 5 ms stall, so the
# best split is inside (the stalled rank keeps some samples) and hides about half the stall; with a narrower model the
# best split gives the stalled rank one sample, and the per-step work no split removes (about 2 ms of the loop's own
# compute on each rank, 2-3 ms after backward) leaves less to gain.
HIDDEN = 384


# The sweep's fixed splits by default, as the stalled rank's share of the global batch in sixteenths, in turn; a phase
# is a whole number of windows (a split changes only where the re-planner decides, every WINDOW steps)
SWEEP_SHARES, SWEEP_PHASE_STEPS = (8, 5, 3, 2, 1), 40


def kind_of_step(step: int) -> str:
    return KINDS[(step // PHASE_STEPS) % 2]


def sweep_split(step: int, global_batch: int, shares: tuple[int, ...], phase_steps: int) -> tuple[int, int]:
    """The sweep's split in force from training step ``step`` (the stalled rank is rank 1)."""
    stalled = global_batch * shares[(step // phase_steps) % len(shares)] // 16
    return global_batch - stalled, stalled


def sweep_setting(text: str) -> tuple[tuple[int, ...], int]:
    """The sweep's shares and phase steps from the fit's argument ``sweep:<phase steps>:<share>,<share>...``."""
    _, phase_steps, shares = text.split(":")
    return tuple(int(share) for share in shares.split(",")), int(phase_steps)


def pin_to_own_core(rank: int, cores: list[int]) -> None:
    """Every thread of this process on core ``cores[rank]`` alone (its threads so far; later ones inherit it).
    ``cores``: those the driver may use, read before any rank pinned itself (rank 1 starts from rank 0's process)."""
    core = {cores[rank % len(cores)]}
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), core)


def fit(
    epochs: int,
    stall_seconds: float,
    hidden: int,
    global_batch: int,
    out: Path,
    sweep: str = "-",
    baseline: str = "equal",
) -> None:
    """One Trainer.fit on every rank, its phases taking turns (``sweep``: fixed splits, :func:`sweep_setting`); the
    run report is written to ``out/hetero``."""
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader, default_collate

    from examples.spirals import SpiralClassifier, SpiralDataModule
    from lightning_hetero import HeteroStrategy
    from lightning_hetero.split.decisions import replan

    torch.set_num_threads(1)  # one core's worth per rank, as one device
    if os.environ.get("DATA_STALL_PIN"):
        cores = [int(core) for core in os.environ["DATA_STALL_PIN"].split(",")]
        pin_to_own_core(int(os.environ.get("LOCAL_RANK", "0")), cores)

    class StalledCollate:
        """The default collate, ``seconds`` late on rank ``rank`` (asked in the process, at each batch)."""

        def __init__(self, rank: int, seconds: float) -> None:
            self.rank, self.seconds = rank, seconds

        def __call__(self, samples: list[Any]) -> Any:
            if dist.is_initialized() and dist.get_rank() == self.rank:
                time.sleep(self.seconds)
            return default_collate(samples)

    class StalledSpirals(SpiralDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(
                self.train_set,
                batch_size=self.hparams.batch_size,
                shuffle=True,
                collate_fn=StalledCollate(STALLED_RANK, stall_seconds),
            )

    class LeanSpirals(SpiralClassifier):
        """The examples' classifier without logging its loss every step (a collective under sync_dist)."""

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            points, labels = batch
            return torch.nn.functional.cross_entropy(self(points), labels)

    counting_refit, counting_consider = replan.refit_cost_models, replan.Rebalancer.consider

    def phased_refit(base: Any, steps: Any, window: int, micro_steps: bool = False) -> Any:
        """In an ignoring phase, the refit sees no wait for data (the step about to start decides the phase)."""
        if steps and kind_of_step(steps[-1]["step"] + 1) == "ignoring":
            steps = [{**step, "data_wait_seconds": [0.0] * len(step["batch_sizes"])} for step in steps]
        return counting_refit(base, steps, window, micro_steps)

    def phase_split(rebalancer: Any, sizes: tuple[int, int], next_step: int, phase_steps: int) -> Any:
        """A phase's split from its first step on (re-planning off): the re-plan that puts it in force, if any."""
        if next_step % phase_steps or sizes == tuple(rebalancer.split):
            return None
        rebalancer.adopt(sizes, next_step)
        rebalancer.replans.append(replan.Replan(next_step, sizes, 0.0))
        return rebalancer.replans[-1]

    def equal_or_counting(self: Any, steps: Any, next_step: int) -> Any:
        """``--baseline equal``: an ignoring phase runs the equal split from its first step; a counting phase
        re-plans as the package does."""
        if kind_of_step(next_step) == "counting":
            return counting_consider(self, steps, next_step)
        return phase_split(self, (global_batch - global_batch // 2, global_batch // 2), next_step, PHASE_STEPS)

    if baseline == "compute":
        replan.refit_cost_models = phased_refit  # (Rebalancer.consider looks it up in the module)
    else:
        replan.Rebalancer.consider = equal_or_counting

    def fixed_split(self: Any, steps: Any, next_step: int) -> Any:
        """The sweep: the phase's split from its first step on, whatever the steps measured."""
        return phase_split(self, sweep_split(next_step, global_batch, shares, phase_steps), next_step, phase_steps)

    if sweep != "-":
        shares, phase_steps = sweep_setting(sweep)
        replan.Rebalancer.consider = fixed_split

    seed_everything(0)
    strategy = HeteroStrategy(stage=0, rebalance_window=WINDOW)
    data = StalledSpirals(batch_size=global_batch // 2, train_samples=global_batch * STEPS_PER_EPOCH, val_samples=512)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(LeanSpirals(hidden=hidden, depth=4), data)


# ---------------------------------------------------------------------------------------------- analysis (pure)


def phase_figures(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """A phase's measured steps: the median step time, the busiest rank's compute plus wait, the split at its end."""
    return {
        "kind": kind_of_step(steps[0]["step"]),
        "first_step": steps[0]["step"],
        "median_step_ms": statistics.median(step["step_seconds"] for step in steps) * 1e3,
        "median_busy_ms": statistics.median(
            max(c + w for c, w in zip(step["compute_seconds"], step["data_wait_seconds"])) for step in steps
        )
        * 1e3,
        "batch_sizes": steps[-1]["batch_sizes"],
        "stalled_rank_share": steps[-1]["batch_sizes"][STALLED_RANK] / sum(steps[-1]["batch_sizes"]),
    }


def sweep_figures(steps: list[dict[str, Any]], phase_steps: int = SWEEP_PHASE_STEPS) -> dict[str, Any]:
    """Per fixed split (the stalled rank's samples): each phase's median step time over its second half, the median
    of those, and its speedup over the equal split's. The first phase is left out: it runs the plan's split, the
    sweep's first switch being at the end of it."""
    per_split: dict[int, list[float]] = {}
    for start in range(phase_steps, len(steps) - phase_steps + 1, phase_steps):
        half = steps[start + phase_steps // 2 : start + phase_steps]
        median = statistics.median(step["step_seconds"] for step in half) * 1e3
        per_split.setdefault(half[-1]["batch_sizes"][STALLED_RANK], []).append(median)
    equal = statistics.median(per_split[max(per_split)])
    return {
        str(stalled): {
            "phase_step_ms": times,
            "median_step_ms": statistics.median(times),
            "speedup_over_equal": equal / statistics.median(times),
        }
        for stalled, times in sorted(per_split.items(), reverse=True)
    }


def run_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Each complete phase's figures, and each pair of neighbouring phases' speedup (counting over ignoring)."""
    steps = report["steps"]
    phases = [
        phase_figures(steps[start + PHASE_STEPS - MEASURED_STEPS : start + PHASE_STEPS])
        for start in range(0, len(steps) - PHASE_STEPS + 1, PHASE_STEPS)
    ]
    pairs = []
    for ignoring, counting in zip(phases[0::2], phases[1::2]):
        pairs.append(
            {
                "step_speedup": ignoring["median_step_ms"] / counting["median_step_ms"],
                "busy_speedup": ignoring["median_busy_ms"] / counting["median_busy_ms"],
                "ignoring": ignoring,
                "counting": counting,
            }
        )
    summary = report["summary"]
    return {
        "phases": phases,
        "pairs": pairs,
        "data_wait_ms_per_step": [wait * 1e3 for wait in summary.get("data_wait_seconds_per_step", [])],
        "report_names_the_stall": summary.get("data_stalled_ranks") == [STALLED_RANK],
        "replans": [(replan["step"], replan["batch_sizes"]) for replan in report["replans"]],
    }


# ---------------------------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--phases", type=int, default=6, help="phases per fit (an even number: pairs)")
    parser.add_argument("--stall-ms", type=float, default=5.0)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--out", type=Path, help=f"default {DEFAULT_OUT} ({DEFAULT_SWEEP_OUT.name} with --sweep)")
    parser.add_argument("--sweep", action="store_true", help="fixed splits in turn: the best split's speedup")
    parser.add_argument("--sweep-epochs", type=int, default=15, help="with --sweep: the fit's epochs")
    parser.add_argument(
        "--sweep-shares",
        type=int,
        nargs="+",
        default=list(SWEEP_SHARES),
        help="with --sweep: the stalled rank's shares in turn, in sixteenths of the global batch",
    )
    parser.add_argument(
        "--sweep-phase-steps",
        type=int,
        default=SWEEP_PHASE_STEPS,
        help=f"with --sweep: the steps each split runs in turn (a multiple of {WINDOW})",
    )
    parser.add_argument(
        "--baseline",
        choices=("equal", "compute"),
        default="equal",
        help="the ignoring phases' split: the equal one, or the re-planner that balances compute alone",
    )
    parser.add_argument("--pin", action="store_true", help="each rank's threads on a core of its own")
    parser.add_argument(
        "--keep-cores-awake",
        action="store_true",
        help="an idle-priority busy loop on every core while the fits run (see awake.py)",
    )
    parser.add_argument("--fit", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        epochs, stall, hidden, global_batch, out, sweep, baseline = args.fit
        fit(int(epochs), float(stall), int(hidden), int(global_batch), Path(out), sweep, baseline)
        return
    args.facts = run_facts("benchmarks/data_stall.py", sys.argv[1:], HERE)
    if args.out is None:
        args.out = DEFAULT_SWEEP_OUT if args.sweep else DEFAULT_OUT
    if args.pin:
        os.environ["DATA_STALL_PIN"] = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
    if args.sweep:
        if args.sweep_phase_steps <= 0 or args.sweep_phase_steps % WINDOW:
            parser.error(
                f"--sweep-phase-steps {args.sweep_phase_steps}: a split changes only every {WINDOW} steps;"
                f" give a positive multiple of {WINDOW}"
            )
        if not all(0 < share <= 8 for share in args.sweep_shares) or 8 not in args.sweep_shares:
            parser.error(
                f"--sweep-shares {args.sweep_shares}: each share is 1 to 8 sixteenths, and 8 (the equal"
                " split, the speedups' reference) is one of them"
            )
    with cores_kept_awake(args.keep_cores_awake):
        (sweep_main if args.sweep else phases_main)(args)


def phases_main(args: argparse.Namespace) -> None:
    """``--runs`` fits whose phases take turns; prints and writes each pair's figures."""
    epochs = -(-args.phases * PHASE_STEPS // STEPS_PER_EPOCH)
    runs = []
    for run in range(args.runs):
        out = args.out.parent / "data_stall_runs" / f"run{run}"
        out.mkdir(parents=True, exist_ok=True)
        setting = [
            str(epochs),
            str(args.stall_ms / 1e3),
            str(args.hidden),
            str(args.global_batch),
            str(out),
            "-",
            args.baseline,
        ]
        command = [sys.executable, __file__, "--fit", *setting]
        run_job(command, out / "log.txt", checkout_first(HERE.parent), FIT_TIMEOUT, f"run {run}")
        figures = run_figures(json.loads((out / "hetero" / "report.json").read_text()))
        runs.append(figures)
        for index, pair in enumerate(figures["pairs"]):
            ignoring, counting = pair["ignoring"], pair["counting"]
            print(
                f"run {run} pair {index}: step {ignoring['median_step_ms']:.2f} ms ignoring the stall ->"
                f" {counting['median_step_ms']:.2f} ms counting it ({pair['step_speedup']:.2f}x; the busiest rank's"
                f" compute + wait {pair['busy_speedup']:.2f}x); the stalled rank's share"
                f" {ignoring['stalled_rank_share']:.2f} -> {counting['stalled_rank_share']:.2f}",
                flush=True,
            )
        print(
            f"run {run}: wait for data per step {[round(w, 2) for w in figures['data_wait_ms_per_step']]} ms;"
            f" the report names rank {STALLED_RANK}: {figures['report_names_the_stall']}",
            flush=True,
        )
    speedups = [pair["step_speedup"] for run in runs for pair in run["pairs"]]
    run_medians = [statistics.median(pair["step_speedup"] for pair in run["pairs"]) for run in runs]
    result = {
        **args.facts,
        "setting": {
            "mode": "phases",
            "ranks": 2,
            "stalled_rank": STALLED_RANK,
            "stall_ms": args.stall_ms,
            "baseline": args.baseline,
            "pinned": args.pin,
            "cores_kept_awake": args.keep_cores_awake,
            "hidden": args.hidden,
            "global_batch": args.global_batch,
            "window": WINDOW,
            "phase_steps": PHASE_STEPS,
            "measured_steps": MEASURED_STEPS,
            "phases": args.phases,
        },
        "runs": runs,
        "step_speedups": speedups,
        "run_median_step_speedups": run_medians,
        "median_step_speedup": statistics.median(speedups),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"step speedup from counting the wait for data, every pair: {', '.join(f'{s:.2f}x' for s in speedups)};"
        f" per run (median) {', '.join(f'{s:.2f}x' for s in run_medians)}; median of all"
        f" {result['median_step_speedup']:.2f}x; written to {args.out}"
    )


def sweep_main(args: argparse.Namespace) -> None:
    """``--sweep``: one fit of fixed splits in turn; prints and writes each split's step time and speedup."""
    out = args.out.parent / "data_stall_runs" / "sweep"
    out.mkdir(parents=True, exist_ok=True)
    setting = [str(args.sweep_epochs), str(args.stall_ms / 1e3), str(args.hidden), str(args.global_batch), str(out)]
    sweep = f"sweep:{args.sweep_phase_steps}:{','.join(str(share) for share in args.sweep_shares)}"
    run_job(
        [sys.executable, __file__, "--fit", *setting, sweep, "-"],
        out / "log.txt",
        checkout_first(HERE.parent),
        FIT_TIMEOUT,
        "sweep",
    )
    steps = json.loads((out / "hetero" / "report.json").read_text())["steps"]
    figures = sweep_figures(steps, args.sweep_phase_steps)
    for stalled, split in figures.items():
        print(
            f"the stalled rank at {stalled} of {args.global_batch} samples: step"
            f" {', '.join(f'{t:.2f}' for t in split['phase_step_ms'])} ms (median {split['median_step_ms']:.2f});"
            f" {split['speedup_over_equal']:.3f}x the equal split"
        )
    best = max(split["speedup_over_equal"] for split in figures.values())
    result = {
        **args.facts,
        "setting": {
            "mode": "sweep",
            "ranks": 2,
            "stalled_rank": STALLED_RANK,
            "window": WINDOW,
            "stall_ms": args.stall_ms,
            "pinned": args.pin,
            "cores_kept_awake": args.keep_cores_awake,
            "hidden": args.hidden,
            "global_batch": args.global_batch,
            "epochs": args.sweep_epochs,
            "phase_steps": args.sweep_phase_steps,
            "shares_in_sixteenths": args.sweep_shares,
        },
        "splits": figures,
        "best_speedup_over_equal": best,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"the best fixed split: {best:.3f}x the equal split; written to {args.out}")


if __name__ == "__main__":
    main()
