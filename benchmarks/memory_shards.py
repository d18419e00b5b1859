"""Memory-sized optimizer shards against DeepSpeed's ZeRO-1/2 on identical ranks, and against a pipeline and
micro-steps where a small device cannot hold its even share.

    python benchmarks/memory_shards.py                           # identical ranks: 3 fits, about 2 minutes
    python benchmarks/memory_shards.py --runs 3                  # every fit 3 times (the order reversed every other)
    python benchmarks/memory_shards.py --scenario small-device   # a 200 MiB device beside a 30 MiB one (emulated)

Setting: 2 CPU ranks of this machine (gloo, one thread each), an MLP 256 -> 1024 -> 1024 -> 10 (1.3 M parameters,
5.3 MB of fp32 gradients) with Adam on a teacher-labelled task, a fixed split 32/32, 40 steps; every fit starts from
the same weights and sees the same batches. The fits of a round run back to back.

Scenario ``identical`` (the same devices):

    zero2        HeteroStrategy(stage=2): DeepSpeed's ZeRO-2, even shards
    zero1        HeteroStrategy(stage=1): DeepSpeed's ZeRO-1, even shards
    memory       HeteroStrategy(stage=2, shards="memory"): the package's shards on DeepSpeed's ZeRO-0 engine (equal
                 here: the ranks' memory is the same), a reduce per owner and a broadcast per owner

Scenario ``small-device`` (``LIGHTNING_HETERO_EMULATE_MEMORY=200MiB,30MiB``: rank 1's device reports 30 MiB; without
a profile half of a room is kept for activations, so at even ZeRO-2 rank 1 would need 13.2 MB of its 12.6 MB):

    memory       HeteroStrategy(stage=2, shards="memory"): rank 1 holds about 1 % of the state
    pipeline     HeteroStrategy(pipeline={"stages": 2, "blocks": "net"}): each rank holds its blocks' whole state
    zero2        HeteroStrategy(stage=2): refused before training (recorded with its message)
    micro-steps  HeteroStrategy(stage=2, micro_steps=[1, 4]), rank 1 in 4 micro-batches of 8: refused the same way
                 (recorded): micro-steps shrink the activations, not the optimizer state

    bytes / step   the sum over ranks of what each put into the step's collectives (``intra_node_bytes`` of the run
                   report), median over steps 10-39 (not for a pipeline: its report has no per-step bytes)
    step time      median over steps 10-39 of the time between two training batches' starts on rank 0 (the same for
                   a pipeline, whose run report differs)
    final loss     cross-entropy of the final weights on 2048 held-out samples (not taken for the pipeline, whose rank 0
                   holds its own stage's blocks only)

Each figure is read against the round's reference configuration (ZeRO-2 on identical ranks; memory-sized shards on
the small device). The step-time ratio is the one to read: the machine is shared; the bytes and the loss are the same
in every round. The JSON (``--out``) holds every run with the command, the commit, the machine and the date; a run
worth keeping is committed as ``benchmarks/measured/memory_shards_<scenario>.json`` and rendered by
``python benchmarks/render.py``.
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
RESULTS = HERE / "results"
SCENARIOS: dict[str, dict[str, Any]] = {
    "identical": {
        "memory": None,
        "reference": "zero2",
        "configurations": {
            "zero2": {"stage": 2},
            "zero1": {"stage": 1},
            "memory": {"stage": 2, "shards": "memory"},
        },
    },
    "small-device": {
        "memory": "200MiB,30MiB",
        "reference": "memory",
        "configurations": {
            "memory": {"stage": 2, "shards": "memory"},
            "pipeline": {"pipeline": {"stages": 2, "blocks": "net"}},
            "zero2": {"stage": 2},
            "micro-steps": {"stage": 2, "micro_steps": [1, 4]},
        },
    },
}
BATCH_SIZES = [32, 32]
STEPS = 40
MEASURED_FROM = 10
FIT_TIMEOUT = 420


# ---------------------------------------------------------------------------------------------- one fit (--fit)


def fit(scenario: str, name: str, out: Path) -> None:
    import torch
    from communication import teacher_task  # (the same model and task as the compression benchmark)
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    seed_everything(0)
    model, train, held_out = teacher_task(sum(BATCH_SIZES) * STEPS)
    arguments = dict(SCENARIOS[scenario]["configurations"][name])
    if "pipeline" not in arguments:  # (one pipeline takes the whole batch in its micro-batches)
        # (micro-steps: rank 1's 32 samples in 4 micro-batches of 8)
        arguments["batch_sizes"] = [32, 8] if "micro_steps" in arguments else BATCH_SIZES
    starts: list[float] = []

    class StepStarts(Callback):
        """Each training batch's start on this rank: the step time, measured alike for every configuration."""

        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.perf_counter())

    trainer = Trainer(
        accelerator="cpu",
        devices=len(BATCH_SIZES),
        strategy=HeteroStrategy(**arguments),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[StepStarts()],
    )
    trainer.fit(model, DataLoader(train, batch_size=16))
    if trainer.is_global_zero:
        loss = None  # (a pipeline's rank 0 holds its own stage's blocks only: no whole model to evaluate)
        if "pipeline" not in arguments:
            with torch.no_grad():
                loss = nn.functional.cross_entropy(model(held_out[0]), held_out[1]).item()
        (out / "result.json").write_text(json.dumps({"final_loss": loss, "starts": starts}))


# ---------------------------------------------------------------------------------------------- analysis (pure)


def figures(report: Optional[dict[str, Any]], result: dict[str, Any]) -> dict[str, Any]:
    """A fit's figures from its run report (None: a pipeline's, which has no per-step bytes) and rank 0's result."""
    starts = result["starts"]
    steps = [b - a for a, b in zip(starts[MEASURED_FROM:-1], starts[MEASURED_FROM + 1 :])]
    bytes_per_step = None
    if report is not None:
        measured = [step for step in report["steps"] if step["step"] >= MEASURED_FROM]
        bytes_per_step = statistics.median(
            sum(step["intra_node_bytes"]) + sum(step["inter_node_bytes"]) for step in measured
        )
    return {
        "bytes_per_step": bytes_per_step,
        "step_seconds": statistics.median(steps),
        "final_loss": result["final_loss"],
    }


def table(results: list[dict[str, dict[str, Any]]], reference: str) -> str:
    """One row per configuration; several runs are shown as their values separated by '/'; a refused one says so."""
    lines = [
        f"| configuration | bytes / step (MB) | vs {reference} | step time (ms) | vs {reference} | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name in results[0]:
        if "refused" in results[0][name]:
            lines.append(f"| {name} | refused: {results[0][name]['refused'][:160]} | | | | |")
            continue

        def each(key: str, scale: float = 1.0, digits: int = 3, name: str = name) -> str:
            values = [run[name][key] for run in results]
            return " / ".join("n/a" if v is None else f"{v * scale:.{digits}g}" for v in values)

        def ratio(key: str, name: str = name) -> str:
            values = [(run[name][key], run[reference][key]) for run in results]
            return " / ".join("n/a" if v is None or r is None else f"{v / r:.3g}" for v, r in values)

        lines.append(
            f"| {name} | {each('bytes_per_step', 1e-6)} | {ratio('bytes_per_step')} | {each('step_seconds', 1e3)}"
            f" | {ratio('step_seconds')} | {each('final_loss', digits=4)} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- driver


def launch(scenario: str, name: str, out: Path) -> dict[str, Any]:
    """One fit's figures, or ``{"refused": its message}`` for a configuration refused before training."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", scenario, name, str(out)]
    memory = SCENARIOS[scenario]["memory"]
    environment = {**os.environ, **({"LIGHTNING_HETERO_EMULATE_MEMORY": memory} if memory else {})}
    try:
        run_job(command, out / "log.txt", environment, FIT_TIMEOUT, name)
    except RuntimeError:
        refusal = [line for line in (out / "log.txt").read_text().splitlines() if "ValueError: " in line]
        if not refusal:
            raise
        return {"refused": refusal[-1].split("ValueError: ", 1)[1]}
    report_file = out / "hetero" / "report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    return figures(report, json.loads((out / "result.json").read_text()))


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="identical")
    parser.add_argument("--out", type=Path, help=f"default {RESULTS}/memory_shards_<scenario>.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning_hetero_memory_shards"))
    parser.add_argument("--fit", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        fit(args.fit[0], args.fit[1], Path(args.fit[2]))
        return
    out = args.out or RESULTS / f"memory_shards_{args.scenario}.json"
    facts = run_facts("benchmarks/memory_shards.py", argv if argv is not None else sys.argv[1:], HERE)
    scenario = SCENARIOS[args.scenario]
    names = list(scenario["configurations"])
    results = []
    for run in range(args.runs):
        order = names if run % 2 == 0 else list(reversed(names))
        measured: dict[str, dict[str, Any]] = {}
        for name in order:
            started = time.perf_counter()
            measured[name] = got = launch(args.scenario, name, args.work / args.scenario / f"run{run}" / name)
            if "refused" in got:
                print(f"run {run + 1}/{args.runs} {name}: refused: {got['refused']}", flush=True)
                continue
            megabytes = "n/a" if got["bytes_per_step"] is None else f"{got['bytes_per_step'] / 1e6:.3f}"
            print(
                f"run {run + 1}/{args.runs} {name}: {megabytes} MB per step,"
                f" {got['step_seconds'] * 1e3:.1f} ms per step, final loss {got['final_loss']}"
                f" ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        results.append({name: measured[name] for name in names})
    text = table(results, scenario["reference"])
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = {"batch_sizes": BATCH_SIZES, "steps": STEPS, "measured_from": MEASURED_FROM}
    record = {
        **facts,
        "scenario": args.scenario,
        "setting": {**setting, "emulated_memory": scenario["memory"]},
        "configurations": scenario["configurations"],
        "reference": scenario["reference"],
        "runs": results,
        "table": text,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
