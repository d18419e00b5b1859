"""The simulator's pipeline prediction against runs on this machine (README, "Planning a cluster").

    python benchmarks/pipeline_simulator_validation.py               # 3 runs (about 2 minutes on 2 cores)

The model is ``examples.spirals:SpiralChain`` (12 residual blocks of 256 in ``blocks``), global batch 128, 2 CPU
ranks of one thread, rank 1 emulated at 0.4, 1F1B with 4 micro-batches: ``configs/spirals_pipeline.yaml`` for one
epoch. The prediction: ``lightning-hetero plan`` with a cluster file of two one-core CPUs, the second at speed 0.4,
and ``--pipeline-blocks blocks``. Compared: the blocks on the slow device, and the schedule's time per step (the
report's median from step 2 on, the longest rank's compute and waiting) against the predicted step. Printed and
written to ``benchmarks/results/pipeline_simulator_validation.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "pipeline_simulator_validation.json"
CLUSTER = "nodes:\n  - devices: [{kind: cpu, cores: 1}, {kind: cpu, cores: 1, speed: 0.4}]\n"


def predict(scratch: Path) -> dict:
    cluster = scratch / "cluster.yaml"
    cluster.write_text(CLUSTER)
    command = [
        shutil.which("lightning-hetero") or "lightning-hetero",
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
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300, check=True)
    return json.loads(result.stdout)["pipeline"]


def run(scratch: Path, index: int) -> dict:
    root = scratch / f"run{index}"
    command = [
        shutil.which("lightning-hetero") or "lightning-hetero",
        "fit",
        "--config",
        "configs/spirals_pipeline.yaml",
        "--trainer.max_epochs=1",
        f"--trainer.default_root_dir={root}",
    ]
    subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    (report,) = root.rglob("pipeline_report.json")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        predicted = predict(scratch)
        slow_predicted = next(len(s["blocks"]) for s in predicted["stages"] if s["rank"] == 1)
        runs = [run(scratch, i) for i in range(args.runs)]
    rows = []
    for report in runs:
        slow_stage = report["stage_ranks"].index(1)
        edges = [0, *report["boundaries"], 12]
        slow_blocks = edges[slow_stage + 1] - edges[slow_stage]
        error = report["schedule_ms_median"] / predicted["step_ms"] - 1
        rows.append(
            {
                "slow_blocks": slow_blocks,
                "schedule_ms": report["schedule_ms_median"],
                "step_error": error,
                "replans": len(report["replans"]),
            }
        )
    print(f"predicted: {slow_predicted} blocks on the slow rank, step {predicted['step_ms']:.1f} ms")
    for row in rows:
        print(
            f"measured: {row['slow_blocks']} blocks on the slow rank, schedule {row['schedule_ms']:.1f} ms"
            f" (prediction {row['step_error']:+.0%}), {row['replans']} re-plan(s)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"predicted": predicted, "runs": rows, "date": time.strftime("%Y-%m-%d")}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    sys.exit(main())
