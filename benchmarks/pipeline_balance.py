"""A pipeline's stages placed by measured speed against the equal-blocks split, on 2 CPU ranks at emulated speeds.

    python benchmarks/pipeline_balance.py                  # 3 pairs (about 2 minutes on 2 cores)
    python benchmarks/pipeline_balance.py --pairs 5 --out /tmp/pipeline_balance.json

A chain of 8 equal blocks (Linear 1024 -> 1024 and tanh) between a small embedding and head; 2 ranks, rank 1 emulated
at 0.4 of rank 0's speed (``emulate_speeds=[1.0, 0.4]``); 1F1B, 4 micro-batches of 16 samples per step. Each pair runs
two fits back to back (their order alternating): ``equal`` with ``boundaries=[4]`` (4 blocks per stage) and
``placed`` without boundaries (the blocks measured on each rank and placed by the planner, then re-planned every 20
steps from what the ranks measure). Measured in each fit over steps 25-49 (after the first re-plan point; the
placed fit's steps 5-19, as first placed, are printed too):

    step        median wall time between the starts of two training steps (rank 0)
    slowest     median compute of the slower stage per step: the pipeline's pace without the step's fixed costs
    balance     per step, the mean of the two stages' compute over the larger (1 = both stages as busy), median

Targets (issue 30): equal / placed >= 1.3 within each pair; the placed step within 10 % of the balanced one
(balance >= 0.9). Results are printed and written to ``--out`` (default ``benchmarks/results/pipeline_balance.json``)
with the command, the commit, the machine and the date; a run worth keeping is committed as
``benchmarks/measured/pipeline_balance_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from jobs import run_facts  # noqa: E402  (benchmarks/ is no package: its scripts run as files)

DEFAULT_OUT = HERE / "results" / "pipeline_balance.json"
WIDTH, BLOCKS, MICRO_BATCHES, MICRO_BATCH, STEPS = 1024, 8, 4, 16, 50
REPLAN_WINDOW = 20  # HeteroStrategy's default rebalance_window: the placed fit may move blocks at steps 20 and 40


def fit_chain(pipeline: dict[str, Any], steps: int, **strategy_arguments: Any) -> tuple[Any, Any, list[float]]:
    """One fit of the chain (run by Lightning's launcher on both ranks) under ``HeteroStrategy(pipeline=pipeline,
    **strategy_arguments)`` for ``steps`` steps: the trainer, the strategy, and the wall time at each training step's
    start (also used by ``benchmarks/pipeline_schedules.py``)."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(HERE.parent))
    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    seed_everything(0, verbose=False)

    class Chain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(32, WIDTH)
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)])
            self.head = nn.Linear(WIDTH, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.net(self.embed(x))), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.001)

    class StepStarts(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    global_batch = MICRO_BATCHES * MICRO_BATCH
    data = TensorDataset(torch.randn(global_batch * 8, 32), torch.randn(global_batch * 8, 1))
    strategy = HeteroStrategy(pipeline=pipeline, **strategy_arguments)
    starts = StepStarts()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[starts],
    )
    trainer.fit(Chain(), DataLoader(data, batch_size=global_batch, shuffle=True))
    return trainer, strategy, starts.starts


def fit(kind: str, out: Path) -> None:
    """One fit (run by Lightning's launcher on both ranks); rank 0 writes the step starts, every rank its stage's
    compute and waiting per step."""
    pipeline: dict[str, Any] = {"stages": 2, "blocks": "net", "micro_batches": MICRO_BATCHES}
    if kind == "equal":
        pipeline["boundaries"] = [BLOCKS // 2]
    trainer, strategy, starts = fit_chain(pipeline, STEPS, emulate_speeds=[1.0, 0.4])
    pipeline_state = strategy.pipeline
    record = {
        "step_times": pipeline_state.step_times,
        "stage": pipeline_state.stage,
        "replans": strategy.pipeline_replans,
        "boundaries": list(pipeline_state.placement.boundaries),
        "stage_ranks": list(pipeline_state.placement.ranks),
    }
    if trainer.global_rank == 0:
        record["starts"] = starts
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def measure(kind: str, directory: Path) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", kind, "--fit-out", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the {kind} fit failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]
    starts = ranks[0]["starts"]

    def window(first: int, last: int) -> tuple[float, float]:
        steps = [b - a for a, b in zip(starts[first:last], starts[first + 1 : last + 1])]
        balances = []
        for step in range(first, last):
            computes = [rank["step_times"][step][0] for rank in ranks]
            balances.append(sum(computes) / (len(computes) * max(computes)))
        return 1e3 * statistics.median(steps), statistics.median(balances)

    first_step, first_balance = window(5, REPLAN_WINDOW)  # as placed at the start
    step, balance = window(REPLAN_WINDOW + 5, STEPS - 1)  # after the first re-plan point
    # The pipeline's pace without the step's fixed costs (optimizer, all-reduce, Lightning's loop): its slowest stage.
    slowest = 1e3 * statistics.median(
        max(rank["step_times"][i][0] for rank in ranks) for i in range(REPLAN_WINDOW + 5, STEPS - 1)
    )
    return {
        "step_ms": step,
        "balance": balance,
        "first_step_ms": first_step,
        "first_balance": first_balance,
        "slowest_stage_ms": slowest,
        "boundaries": ranks[0]["boundaries"],
        "stage_ranks": ranks[0]["stage_ranks"],
        "replans": ranks[0]["replans"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--fit", choices=("equal", "placed"), help=argparse.SUPPRESS)
    parser.add_argument("--fit-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        fit(args.fit, args.fit_out)
        return
    facts = run_facts("benchmarks/pipeline_balance.py", sys.argv[1:], HERE)
    scratch = Path("/tmp/pipeline_balance_runs")
    pairs = []
    for pair in range(args.pairs):
        order = ("equal", "placed") if pair % 2 == 0 else ("placed", "equal")
        runs = {kind: measure(kind, scratch / f"pair{pair}_{kind}") for kind in order}
        ratio = runs["equal"]["step_ms"] / runs["placed"]["step_ms"]
        compute_ratio = runs["equal"]["slowest_stage_ms"] / runs["placed"]["slowest_stage_ms"]
        pairs.append(
            {
                "order": order,
                **{k: v for k, v in runs.items()},
                "equal_over_placed": ratio,
                "slowest_stage_equal_over_placed": compute_ratio,
            }
        )
        placed = runs["placed"]
        print(
            f"pair {pair} ({', '.join(order)}): step ms equal {runs['equal']['step_ms']:.1f} (balance"
            f" {runs['equal']['balance']:.3f}), placed {placed['step_ms']:.1f} (balance {placed['balance']:.3f};"
            f" at the start {placed['first_step_ms']:.1f} ms, balance {placed['first_balance']:.3f}; final boundaries"
            f" {placed['boundaries']} on ranks {placed['stage_ranks']},"
            f" re-plans {[r['step'] for r in placed['replans']]});"
            f" equal / placed {ratio:.3f} (slowest stage's compute {compute_ratio:.3f})",
            flush=True,
        )
    summary = {
        "equal_over_placed": [p["equal_over_placed"] for p in pairs],
        "slowest_stage_equal_over_placed": [p["slowest_stage_equal_over_placed"] for p in pairs],
        "placed_balance": [p["placed"]["balance"] for p in pairs],
        "median_equal_over_placed": statistics.median(p["equal_over_placed"] for p in pairs),
        "median_placed_balance": statistics.median(p["placed"]["balance"] for p in pairs),
    }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**facts, "pairs": pairs, "summary": summary}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
