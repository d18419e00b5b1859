"""What the ranks' agreement on a stop costs a short step: at every step (as Lightning's), or paced.

    python benchmarks/stop_checks.py                 # 2 fits of 600 steps, 13 pairs each (about 15 s per fit)
    python benchmarks/stop_checks.py --runs 3 --pin

Two CPU ranks of the same speed train the examples' spiral classifier (width ``--hidden``, 4 blocks, a global batch
of ``--global-batch``, Adam, ZeRO-0, the equal split, re-planning off; one torch thread per rank). Before each
training step Lightning calls the loop's ``_broadcast_sigterm_tensor``, which the package replaces with the ranks'
agreement on a stop (a small all-reduce, :mod:`lightning_hetero.recover.stopping`). Phases of ``PHASE_STEPS``
steps take turns in the same fit:

    every step   the agreement at every step, as Lightning's broadcast was and the package's was until 2026-11-27
    paced        the package's: every step until the ranks know their pace, then about once a second (at most every
                 ``MAX_STEPS_BETWEEN_STOP_CHECKS`` steps), each agreement carrying the ranks' time per step since
                 the last

The figure is each pair of neighbouring phases' ratio of the median wall time between two steps' starts on rank 0
(over each phase's second half): how much longer a step takes when the ranks agree at every step. The ranks exchange
their step records every 20 steps, as long as a phase, so the exchanges fall on both kinds in turn.

Results are printed and written to ``--out`` (default ``benchmarks/results/stop_checks.json``): every fit's pairs,
with the command, the commit, the machine and the date; a run worth keeping is committed as
``benchmarks/measured/stop_checks_<what>.json`` and rendered by ``python benchmarks/render.py``
(``docs/results/stop_checks.md``). Each fit's log stays in ``benchmarks/results/stop_checks_runs/`` (``--work``).
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
# The package beside this script, not an installed one: a run (and each fit, which runs this file) measures the
# checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from data_stall import pin_to_own_core  # noqa: E402
from jobs import run_facts, run_job  # noqa: E402

DEFAULT_OUT = HERE / "results" / "stop_checks.json"
DEFAULT_WORK = HERE / "results" / "stop_checks_runs"  # (gitignored, wherever --out is: benchmarks/measured/ too)
PHASE_STEPS = 20  # the rebalance window too: each kind of phase gets every other exchange
FIT_TIMEOUT = 600


def phase_kind(step: int) -> str:
    return ("every step", "paced")[(step // PHASE_STEPS) % 2]


def pair_ratios(starts: list[float]) -> list[dict[str, float]]:
    """Rank 0's step start times -> per pair of phases (the first pair left out: the plan's first steps), the median
    interval between starts over each phase's second half, and their ratio (every step over paced)."""
    intervals = [later - earlier for earlier, later in zip(starts, starts[1:])]
    pairs = []
    for start in range(2 * PHASE_STEPS, len(intervals) - 2 * PHASE_STEPS + 1, 2 * PHASE_STEPS):
        every = statistics.median(intervals[start + PHASE_STEPS // 2 : start + PHASE_STEPS - 1])
        paced = statistics.median(intervals[start + PHASE_STEPS + PHASE_STEPS // 2 : start + 2 * PHASE_STEPS - 1])
        pairs.append(
            {"first_step": start, "every_step_ms": every * 1e3, "paced_ms": paced * 1e3, "ratio": every / paced}
        )
    return pairs


def fit(steps: int, hidden: int, global_batch: int, out: Path, pin: bool) -> None:
    """One Trainer.fit on every rank, the two kinds of phase taking turns; rank 0 writes its steps' start times."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from examples.spirals import SpiralClassifier, SpiralDataModule
    from lightning_hetero import HeteroStrategy
    from lightning_hetero.recover.stopping import StopOnSigterm
    from lightning_hetero.split.decisions import replan

    torch.set_num_threads(1)
    if pin:  # (the cores the driver may use: rank 1 starts from rank 0's process, pinned by then)
        cores = [int(core) for core in os.environ["STOP_CHECKS_CORES"].split(",")]
        pin_to_own_core(int(os.environ.get("LOCAL_RANK", "0")), cores)
    paced = StopOnSigterm.step_starts

    def every_step_or_paced(self: Any) -> None:
        """In an "every step" phase the step about to start is always one that agrees (the package's own code runs
        the agreement, so both kinds send the same values)."""
        if phase_kind(self._steps_started) == "every step":
            self._next_check = self._steps_started
        paced(self)

    StopOnSigterm.step_starts = every_step_or_paced
    replan.Rebalancer.consider = lambda self, steps, next_step: None  # the plan's split throughout

    class StepStarts(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.times.append(time.perf_counter())

    class LeanSpirals(SpiralClassifier):
        """The examples' classifier without logging its loss every step (a collective under sync_dist)."""

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            points, labels = batch
            return torch.nn.functional.cross_entropy(self(points), labels)

    seed_everything(0)
    starts = StepStarts()
    half = global_batch // 2
    strategy = HeteroStrategy(stage=0, batch_sizes=[global_batch - half, half], rebalance_window=PHASE_STEPS)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
        callbacks=[starts],
    )
    data = SpiralDataModule(batch_size=half, train_samples=global_batch * steps, val_samples=512)
    trainer.fit(LeanSpirals(hidden=hidden, depth=4), data)
    if trainer.global_rank == 0:
        (out / "starts.json").write_text(json.dumps(starts.times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600, help="training steps per fit")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--pin", action="store_true", help="each rank's threads on a core of its own")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="each fit's folder (its log)")
    parser.add_argument("--fit", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        steps, hidden, global_batch, out, pin = args.fit
        fit(int(steps), int(hidden), int(global_batch), Path(out), pin == "pin")
        return
    if args.steps < 6 * PHASE_STEPS:
        parser.error(f"--steps {args.steps}: give at least {6 * PHASE_STEPS} (two pairs of {PHASE_STEPS}-step phases)")
    facts = run_facts("benchmarks/stop_checks.py", sys.argv[1:], HERE)
    os.environ["STOP_CHECKS_CORES"] = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
    runs = []
    for run in range(args.runs):
        out = args.work / f"run{run}"
        out.mkdir(parents=True, exist_ok=True)
        setting = [str(args.steps), str(args.hidden), str(args.global_batch), str(out), "pin" if args.pin else "-"]
        run_job(
            [sys.executable, __file__, "--fit", *setting], out / "log.txt", dict(os.environ), FIT_TIMEOUT, f"run {run}"
        )
        pairs = pair_ratios(json.loads((out / "starts.json").read_text()))
        runs.append(pairs)
        each = ", ".join(f"{pair['ratio']:.3f}" for pair in pairs)
        print(
            f"run {run}: agreeing at every step / paced, per pair: {each} (median"
            f" {statistics.median(pair['ratio'] for pair in pairs):.3f}; paced steps"
            f" {statistics.median(pair['paced_ms'] for pair in pairs):.2f} ms)",
            flush=True,
        )
    ratios = [pair["ratio"] for pairs in runs for pair in pairs]
    result = {
        **facts,
        "setting": {
            "ranks": 2,
            "hidden": args.hidden,
            "global_batch": args.global_batch,
            "steps": args.steps,
            "phase_steps": PHASE_STEPS,
            "pinned": args.pin,
            "fits": args.runs,
        },
        "runs": runs,  # per fit, every pair of phases: its first step, both medians (ms) and their ratio
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(
        f"a step with the agreement at every step takes {result['median_ratio']:.3f}x the paced one (median of"
        f" {len(ratios)} pairs; {sum(r > 1 for r in ratios)} above 1); written to {args.out}"
    )


if __name__ == "__main__":
    main()
