"""The simulator's pipeline prediction against runs on this machine (README, "Planning a cluster").

    python benchmarks/pipeline_simulator_validation.py               # 3 runs (about 2 minutes on 2 cores)
    python benchmarks/pipeline_simulator_validation.py --runs 1 --out /tmp/pipeline_simulator_validation.json

The model is ``examples.spirals:SpiralChain`` (12 residual blocks of 256 in ``blocks``), global batch 128, 2 CPU
ranks of one thread, rank 1 emulated at 0.4, 1F1B with 4 micro-batches: ``configs/spirals_pipeline.yaml`` for one
epoch. The prediction: ``lightning-hetero plan`` with a cluster file of two one-core CPUs, the second at speed 0.4,
and ``--pipeline-blocks blocks``. Compared: the blocks on the slow device, and the schedule's time per step (the
report's median from step 2 on, the longest rank's compute and waiting) against the predicted step. Both the plan and
the fits run the package of this checkout (``python -m lightning_hetero.cli`` with the checkout first on
``PYTHONPATH``), not an installed one.

Printed, and written to ``--out`` (default ``benchmarks/results/pipeline_simulator_validation.json``): the run's
command, commit, machine and date, its setting, the whole prediction and every run's figures (with the predicted
over the measured step and blocks). A run worth keeping is committed as
``benchmarks/measured/pipeline_simulator_validation_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from jobs import checkout_first, run_facts  # noqa: E402  (benchmarks/ is no package: its scripts run as files)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "pipeline_simulator_validation.json"
CLUSTER = "nodes:\n  - devices: [{kind: cpu, cores: 1}, {kind: cpu, cores: 1, speed: 0.4}]\n"
CONFIG = "configs/spirals_pipeline.yaml"
BLOCKS = 12  # SpiralChain's blocks
# The package of this checkout, not an installed one: a run from a worktree measures that worktree.
CLI = [sys.executable, "-m", "lightning_hetero.cli"]


def predict(scratch: Path) -> dict:
    cluster = scratch / "cluster.yaml"
    cluster.write_text(CLUSTER)
    command = [
        *CLI,
        "plan",
        "--cluster",
        str(cluster),
        "--model",
        "examples.spirals:SpiralChain",
        "--data",
        "examples.spirals:SpiralDataModule",
        "--pipeline-blocks",
        "blocks",
        "--json",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=True, env=checkout_first(ROOT)
    )
    return json.loads(result.stdout)["pipeline"]


def run(scratch: Path, index: int) -> dict:
    root = scratch / f"run{index}"
    command = [*CLI, "fit", "--config", CONFIG, "--trainer.max_epochs=1", f"--trainer.default_root_dir={root}"]
    subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600, check=True, env=checkout_first(ROOT))
    (report,) = root.rglob("pipeline_report.json")
    return json.loads(report.read_text())


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    facts = run_facts("benchmarks/pipeline_simulator_validation.py", argv if argv is not None else sys.argv[1:], ROOT)
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        predicted = predict(scratch)
        slow_predicted = next(len(s["blocks"]) for s in predicted["stages"] if s["rank"] == 1)
        runs = [run(scratch, i) for i in range(args.runs)]
    rows = []
    for report in runs:
        slow_stage = report["stage_ranks"].index(1)
        edges = [0, *report["boundaries"], BLOCKS]
        slow_blocks = edges[slow_stage + 1] - edges[slow_stage]
        error = report["schedule_ms_median"] / predicted["step_ms"] - 1
        rows.append(
            {
                "slow_blocks": slow_blocks,
                "schedule_ms": report["schedule_ms_median"],
                "step_error": error,
                "replans": len(report["replans"]),
                "boundaries": report["boundaries"],
                "stage_ranks": report["stage_ranks"],
                # predicted over measured: 1 is a right prediction
                "step_predicted_over_measured": predicted["step_ms"] / report["schedule_ms_median"],
                "slow_blocks_predicted_over_measured": slow_predicted / slow_blocks,
            }
        )
    print(f"predicted: {slow_predicted} blocks on the slow rank, step {predicted['step_ms']:.1f} ms")
    for row in rows:
        print(
            f"measured: {row['slow_blocks']} blocks on the slow rank, schedule {row['schedule_ms']:.1f} ms"
            f" (prediction {row['step_error']:+.0%}), {row['replans']} re-plan(s)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "model": "examples.spirals:SpiralChain",
        "blocks": BLOCKS,
        "config": CONFIG,
        "max_epochs": 1,
        "cluster": CLUSTER,
        "runs": args.runs,
    }
    record = {**facts, "setting": setting, "predicted": predicted, "slow_blocks_predicted": slow_predicted}
    args.out.write_text(json.dumps({**record, "runs": rows}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
