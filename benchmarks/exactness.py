"""Figures for "same result as one process": HeteroStrategy on CPU vs one process on the same global batches.

    python benchmarks/exactness.py            # ZeRO 0-3, 2 ranks with micro-batches [3, 13], SGD with momentum
    python benchmarks/exactness.py --stages 2 --cases plain --out /tmp/exactness.json

For each stage and case it runs the test worker (tests/workers/fit.py: 2 ranks, gloo; this checkout's package first
on its PYTHONPATH), rebuilds the same training in one plain torch process (DDP's update), and prints the largest
absolute parameter difference. The JSON (``--out``, default ``benchmarks/results/exactness.json``) holds every case
and stage (each parameter's difference too) with the command, the commit, the machine and the date; a run worth
keeping is committed as ``benchmarks/measured/exactness_<what>.json`` and rendered by ``python
benchmarks/render.py``. The cases:

- plain: 4 steps, mean loss;
- accumulate: `Trainer(accumulate_grad_batches=3)`, 2 epochs of 4 batches (windows of 3 and 1 per epoch);
- manual-accumulate: manual optimization, backward on loss / 2, a step every 2 batches;
- sum-loss: the loss is a sum over the batch, `loss_reduction="sum"`, 3 steps;
- sum-loss-as-mean: the same model with the default `loss_reduction="mean"`: the error that rule prevents.

The test suite asserts <= 1e-5 for the first four; this script reports the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "workers"))

import torch  # noqa: E402
from common import IndexedRegression, reference_training  # noqa: E402
from jobs import checkout_first, run_facts, run_job  # noqa: E402  (benchmarks/jobs.py)

LOGS = Path(tempfile.gettempdir()) / "lightning_hetero_exactness"  # each fit's output, by case and stage

# case -> (worker arguments, reference_training arguments, global batches trained)
CASES = {
    "plain": ([], {}, 4),
    "accumulate": (["--accumulate", "3", "--max-epochs", "2"], {"accumulate": 3, "batches_per_epoch": 4}, 8),
    "manual-accumulate": (["--manual", "--accumulate", "2"], {"accumulate": 2}, 4),
    "sum-loss": (["--loss-reduction", "sum", "--max-steps", "3"], {"sum_over_ranks": 2}, 3),
    "sum-loss-as-mean": (["--model-reduction", "sum", "--max-steps", "3"], {"sum_over_ranks": 2}, 3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[3, 13])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "exactness.json")
    args = parser.parse_args()
    facts = run_facts("benchmarks/exactness.py", sys.argv[1:], REPO)
    # The worker and the rank Lightning starts from it import this checkout's package, not the installed one.
    environment = checkout_first(REPO)
    LOGS.mkdir(parents=True, exist_ok=True)
    global_batch = sum(args.batch_sizes)
    samples = 4 * global_batch
    dataset = IndexedRegression(samples)
    batches = [list(range(k * global_batch, (k + 1) * global_batch)) for k in range(4)]
    rows = []
    for case in args.cases:
        worker_args, reference_args, count = CASES[case]
        reference = reference_training(dataset, (batches * 2)[:count], **reference_args)
        for stage in args.stages:
            with tempfile.TemporaryDirectory() as tmp:
                command = [
                    sys.executable,
                    str(REPO / "tests" / "workers" / "fit.py"),
                    "--out",
                    tmp,
                    "--stage",
                    str(stage),
                    "--devices",
                    str(len(args.batch_sizes)),
                    "--samples",
                    str(samples),
                    "--batch-sizes",
                    *map(str, args.batch_sizes),
                    *worker_args,
                ]
                # (a session of its own: past its deadline the worker is killed with the rank it started; its log
                # outlives the temporary folder, for a failure to point at)
                log = LOGS / f"{case}-zero{stage}.log"
                run_job(command, log, environment, 300, f"{case} at ZeRO-{stage}")
                result = json.loads((Path(tmp) / "result.json").read_text())
            differences = {
                name: (torch.tensor(result["params"][f"network.{name}"], dtype=torch.float64) - value.double())
                .abs()
                .max()
                .item()
                for name, value in reference.items()
            }
            difference = max(differences.values())
            rows.append(
                {
                    "case": case,
                    "stage": stage,
                    "batch_sizes": args.batch_sizes,
                    "max_abs_diff": difference,
                    "max_abs_diff_per_parameter": differences,
                }
            )
            sizes = args.batch_sizes
            print(f"{case:18s} ZeRO-{stage}  micro-batches {sizes}  max |param - DDP param| = {difference:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "ranks": len(args.batch_sizes),
        "batch_sizes": args.batch_sizes,
        "samples": samples,
        "optimizer": "SGD, lr 0.05, momentum 0.9",
        "stages": args.stages,
        "cases": args.cases,
        "case_arguments": {case: CASES[case][0] for case in args.cases},
    }
    args.out.write_text(json.dumps({**facts, "setting": setting, "runs": rows}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
