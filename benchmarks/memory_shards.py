"""Memory-sized optimizer shards against DeepSpeed's ZeRO-1 and ZeRO-2 on identical ranks: bytes on the wire and step.

    python benchmarks/memory_shards.py                 # 3 fits, about 2 minutes on 2 cores
    python benchmarks/memory_shards.py --runs 3        # every fit 3 times (the order reversed every other round)

Setting: 2 CPU ranks of this machine (gloo, one thread each), the same devices, an MLP 256 -> 1024 -> 1024 -> 10
(1.3 M parameters, 5.3 MB of fp32 gradients) with Adam on a teacher-labelled task, a fixed split 32/32, 40 steps;
every fit starts from the same weights and sees the same batches. Three fits per round, back to back:

    zero1     HeteroStrategy(stage=1): DeepSpeed's ZeRO-1, even shards
    zero2     HeteroStrategy(stage=2): DeepSpeed's ZeRO-2, even shards
    memory    HeteroStrategy(stage=2, shards="memory"): the package's shards on DeepSpeed's ZeRO-0 engine (equal here:
              the ranks' memory is the same), a reduce per owner and a broadcast per owner

    bytes / step   the sum over ranks of what each put into the step's collectives (``intra_node_bytes`` of the run
                   report), median over steps 10-39
    step time      median over steps 10-39 of the step's wall time (``step_seconds`` of the run report)
    final loss     cross-entropy of the final weights on 2048 held-out samples

Each figure is read against ZeRO-2's fit of the same round (the step-time ratio is the one to read: the machine is
shared, the bytes and the loss are the same in every round). The JSON (``--out``) holds every run with the command,
the commit, the machine and the date; a run worth keeping is committed as
``benchmarks/measured/memory_shards_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from jobs import run_facts, run_job  # benchmarks/jobs.py (scripts run from this folder)

HERE = Path(__file__).resolve().parent
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
DEFAULT_OUT = HERE / "results" / "memory_shards.json"
CONFIGURATIONS = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "memory": {"stage": 2, "shards": "memory"},
}
BATCH_SIZES = [32, 32]
STEPS = 40
MEASURED_FROM = 10
FIT_TIMEOUT = 420


# ---------------------------------------------------------------------------------------------- one fit (--fit)


def fit(name: str, out: Path) -> None:
    import torch
    from communication import teacher_task  # (the same model and task as the compression benchmark)
    from lightning.pytorch import Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    seed_everything(0)
    model, train, held_out = teacher_task(sum(BATCH_SIZES) * STEPS)
    strategy = HeteroStrategy(batch_sizes=BATCH_SIZES, **CONFIGURATIONS[name])
    trainer = Trainer(
        accelerator="cpu",
        devices=len(BATCH_SIZES),
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(model, DataLoader(train, batch_size=16))
    if trainer.is_global_zero:
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(held_out[0]), held_out[1]).item()
        (out / "result.json").write_text(json.dumps({"final_loss": loss}))


# ---------------------------------------------------------------------------------------------- analysis (pure)


def figures(report: dict[str, Any], final_loss: float) -> dict[str, Any]:
    steps = [step for step in report["steps"] if step["step"] >= MEASURED_FROM]
    return {
        "bytes_per_step": statistics.median(
            sum(step["intra_node_bytes"]) + sum(step["inter_node_bytes"]) for step in steps
        ),
        "step_seconds": statistics.median(step["step_seconds"] for step in steps),
        "final_loss": final_loss,
    }


def table(results: list[dict[str, dict[str, Any]]]) -> str:
    """One row per configuration; several runs are shown as their values separated by '/'."""
    lines = [
        "| configuration | bytes / step (MB) | vs zero2 | step time (ms) | vs zero2 | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name in results[0]:

        def each(key: str, scale: float = 1.0, digits: int = 3, name: str = name) -> str:
            return " / ".join(f"{run[name][key] * scale:.{digits}g}" for run in results)

        def ratio(key: str, name: str = name) -> str:
            return " / ".join(f"{run[name][key] / run['zero2'][key]:.3g}" for run in results)

        lines.append(
            f"| {name} | {each('bytes_per_step', 1e-6)} | {ratio('bytes_per_step')} | {each('step_seconds', 1e3)}"
            f" | {ratio('step_seconds')} | {each('final_loss', digits=4)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- driver


def launch(name: str, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", name, str(out)]
    run_job(command, out / "log.txt", dict(os.environ), FIT_TIMEOUT, name)
    report = json.loads((out / "hetero" / "report.json").read_text())
    return figures(report, json.loads((out / "result.json").read_text())["final_loss"])


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning_hetero_memory_shards"))
    parser.add_argument("--fit", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        fit(args.fit[0], Path(args.fit[1]))
        return
    facts = run_facts("benchmarks/memory_shards.py", argv if argv is not None else sys.argv[1:], HERE)
    names = list(CONFIGURATIONS)
    results = []
    for run in range(args.runs):
        order = names if run % 2 == 0 else list(reversed(names))
        measured: dict[str, dict[str, Any]] = {}
        for name in order:
            started = time.perf_counter()
            measured[name] = launch(name, args.work / f"run{run}" / name)
            got = measured[name]
            print(
                f"run {run + 1}/{args.runs} {name}: {got['bytes_per_step'] / 1e6:.3f} MB per step,"
                f" {got['step_seconds'] * 1e3:.1f} ms per step, final loss {got['final_loss']:.4f}"
                f" ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        results.append({name: measured[name] for name in names})
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {"batch_sizes": BATCH_SIZES, "steps": STEPS, "measured_from": MEASURED_FROM}
    record = {**facts, "setting": setting, "configurations": CONFIGURATIONS, "runs": results, "table": text}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
