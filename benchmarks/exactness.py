"""Figures for "same result as one process": HeteroStrategy on CPU vs one process on the same global batches.

    python benchmarks/exactness.py            # ZeRO 0-3, 2 ranks with micro-batches [3, 13], 4 SGD+momentum steps

For each stage it runs the test worker (tests/workers/fit.py: 2 ranks, gloo), rebuilds the same training in one
plain torch process, and prints the largest absolute parameter difference; results go to
benchmarks/results/exactness.json. The test suite asserts the same bound (1e-5); this script reports the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "workers"))

import torch  # noqa: E402
from common import IndexedRegression, reference_training  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[3, 13])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "exactness.json")
    args = parser.parse_args()
    global_batch = sum(args.batch_sizes)
    samples = 4 * global_batch
    dataset = IndexedRegression(samples)
    steps = [list(range(k * global_batch, (k + 1) * global_batch)) for k in range(4)]
    reference = reference_training(dataset, steps)
    rows = []
    for stage in args.stages:
        with tempfile.TemporaryDirectory() as tmp:
            command = [
                sys.executable, str(REPO / "tests" / "workers" / "fit.py"), "--out", tmp, "--stage", str(stage),
                "--devices", str(len(args.batch_sizes)), "--samples", str(samples),
                "--batch-sizes", *map(str, args.batch_sizes),
            ]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True, timeout=300)
            result = json.loads((Path(tmp) / "result.json").read_text())
        difference = max(
            (torch.tensor(result["params"][f"network.{name}"], dtype=torch.float64) - value.double()).abs().max().item()
            for name, value in reference.items()
        )
        rows.append({"stage": stage, "batch_sizes": args.batch_sizes, "max_abs_param_difference": difference})
        print(f"ZeRO-{stage}  micro-batches {args.batch_sizes}  max |param - one-process param| = {difference:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
