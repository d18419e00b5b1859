"""The interleaved pipeline schedule against 1F1B: each stage's measured bubble, the step, and the planner's
predicted step against the measured one, on 2 CPU ranks.

    python benchmarks/pipeline_schedules.py                 # 3 pairs (about 2 minutes on 2 cores)
    python benchmarks/pipeline_schedules.py --pairs 5 --speeds 1.0,0.6 --out /tmp/pipeline_schedules.json

A chain of 8 equal blocks (Linear 1024 -> 1024 and tanh) between a small embedding and head; 2 stages placed by
measured speed (the blocks measured on each rank), re-planning off so that both fits keep their first placement;
4 micro-batches of 16 samples per step; 40 steps per fit. With ``--boundary B`` both fits give stage 0 B blocks
instead (the interleaved one cut into chunks), so that the schedules alone differ: placed by measurement, the two
fits of a pair may be placed differently by the measurements' noise. Each pair runs two fits back to back, their
order alternating: ``1f1b`` and ``interleaved`` (2 chunks per rank: each rank holds two non-adjacent parts of the
chain).
Measured in each fit over steps 5-39 (medians):

    step           wall time between the starts of two training steps (rank 0)
    bubble         per stage, its time waiting for a neighbour per step: the schedule's fill and drain, and any
                   imbalance (the stage's step_times in the pipeline report)
    compute        per stage, its forward and backward per step
    predicted      the planner's step for its placement and schedule (the stages' measured per-sample times)

Ratios within a pair: 1f1b / interleaved for the step and for each stage's bubble (over 1: the interleaved schedule
is better), and measured / predicted for each fit. In theory the bubble is (S - 1) / (M + S - 1) of a 1F1B step
(0.2 here) and (S - 1) / (V M + S - 1) interleaved (0.11): the interleaved schedule sends V times as many hand-offs,
which a CPU's gloo transport makes dear. Results are printed and written to ``--out`` (default
``benchmarks/results/pipeline_schedules.json``) with the command, the commit, the machine and the date; a run worth
keeping is committed as ``benchmarks/measured/pipeline_schedules_<what>.json`` and rendered by
``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from jobs import run_facts  # noqa: E402  (benchmarks/ is no package: its scripts run as files)
from pipeline_balance import MICRO_BATCH, MICRO_BATCHES, fit_chain  # noqa: E402  (the same chain)

DEFAULT_OUT = HERE / "results" / "pipeline_schedules.json"
STEPS, FIRST = 40, 5
SCHEDULES = ("1f1b", "interleaved")


def fit(schedule: str, speeds: list[float], boundary: int, out: Path) -> None:
    """One fit (run by Lightning's launcher on both ranks); rank 0 writes the step starts and the prediction, every
    rank its stage's compute and waiting per step."""
    pipeline: dict[str, Any] = {"stages": 2, "blocks": "net", "micro_batches": MICRO_BATCHES, "schedule": schedule}
    if boundary:  # (the same blocks per stage in both fits: the schedules alone differ; nothing is measured)
        pipeline["boundaries"] = [boundary]
    trainer, strategy, starts = fit_chain(pipeline, STEPS, emulate_speeds=speeds, rebalance=False)
    placement = strategy.pipeline.placement
    record = {
        "step_times": strategy.pipeline.step_times,
        "stage": strategy.pipeline.stage,
        "boundaries": list(placement.boundaries),
        "chunks": [[list(c) for c in placement.chunks_of(s)] for s in range(2)],
        # (with `boundaries` the blocks are not measured: no prediction)
        "predicted_step_ms": None if boundary else 1e3 * placement.step_seconds(MICRO_BATCHES, MICRO_BATCH),
    }
    if trainer.global_rank == 0:
        record["starts"] = starts
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def measure(schedule: str, speeds: list[float], boundary: int, directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", schedule, "--fit-out", str(directory)]
    command += ["--speeds", ",".join(str(s) for s in speeds), "--boundary", str(boundary)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the {schedule} fit failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]
    by_stage = sorted(ranks, key=lambda rank: rank["stage"])
    starts = ranks[0]["starts"]
    steps = [b - a for a, b in zip(starts[FIRST : STEPS - 1], starts[FIRST + 1 : STEPS])]
    step_ms = 1e3 * statistics.median(steps)
    predicted = ranks[0]["predicted_step_ms"]
    return {
        "step_ms": step_ms,
        "bubble_ms": [1e3 * statistics.median(t[1] for t in rank["step_times"][FIRST:]) for rank in by_stage],
        "compute_ms": [1e3 * statistics.median(t[0] for t in rank["step_times"][FIRST:]) for rank in by_stage],
        "predicted_step_ms": predicted,
        "measured_over_predicted": step_ms / predicted if predicted else None,
        "boundaries": ranks[0]["boundaries"],
        "chunks": ranks[0]["chunks"],
    }


def _ms(value: Any) -> str:
    return "none: blocks not measured" if value is None else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--speeds", default="1.0,1.0", help="emulate_speeds of the 2 ranks")
    parser.add_argument(
        "--boundary", type=int, default=0, help="stage 1's first block in both fits (0: placed by measured speed)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--fit", choices=SCHEDULES, help=argparse.SUPPRESS)
    parser.add_argument("--fit-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]
    if args.fit:
        fit(args.fit, speeds, args.boundary, args.fit_out)
        return
    facts = run_facts("benchmarks/pipeline_schedules.py", sys.argv[1:], HERE)
    scratch = Path("/tmp/pipeline_schedules_runs")
    pairs = []
    for pair in range(args.pairs):
        order = SCHEDULES if pair % 2 == 0 else tuple(reversed(SCHEDULES))
        runs = {
            schedule: measure(schedule, speeds, args.boundary, scratch / f"pair{pair}_{schedule}") for schedule in order
        }
        plain, interleaved = runs["1f1b"], runs["interleaved"]
        ratios = {
            "step_1f1b_over_interleaved": plain["step_ms"] / interleaved["step_ms"],
            "bubble_1f1b_over_interleaved": [
                a / b if b > 0 else None for a, b in zip(plain["bubble_ms"], interleaved["bubble_ms"])
            ],
        }
        pairs.append({"order": list(order), **runs, **ratios})
        print(
            f"pair {pair} ({', '.join(order)}): step ms 1f1b {plain['step_ms']:.1f} (predicted"
            f" {_ms(plain['predicted_step_ms'])}), interleaved {interleaved['step_ms']:.1f} (predicted"
            f" {_ms(interleaved['predicted_step_ms'])}); boundaries {plain['boundaries']} and {interleaved['chunks']};"
            " per stage bubble ms 1f1b"
            f" {[round(b, 1) for b in plain['bubble_ms']]}, interleaved"
            f" {[round(b, 1) for b in interleaved['bubble_ms']]}; compute ms 1f1b"
            f" {[round(c, 1) for c in plain['compute_ms']]}, interleaved"
            f" {[round(c, 1) for c in interleaved['compute_ms']]}; 1f1b / interleaved step"
            f" {ratios['step_1f1b_over_interleaved']:.3f}",
            flush=True,
        )
    summary = {
        "step_1f1b_over_interleaved": [p["step_1f1b_over_interleaved"] for p in pairs],
        "bubble_1f1b_over_interleaved_stage_0": [p["bubble_1f1b_over_interleaved"][0] for p in pairs],
        "bubble_1f1b_over_interleaved_stage_1": [p["bubble_1f1b_over_interleaved"][1] for p in pairs],
        "measured_over_predicted_1f1b": [p["1f1b"]["measured_over_predicted"] for p in pairs],
        "measured_over_predicted_interleaved": [p["interleaved"]["measured_over_predicted"] for p in pairs],
    }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {**facts, "speeds": speeds, "boundary": args.boundary or None, "pairs": pairs, "summary": summary}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
