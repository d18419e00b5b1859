"""Throughput of HeteroStrategy on CPU: the equal split (what DDP does) against the automatic split with re-planning.

    python benchmarks/throughput.py                       # 5 runs of every scenario (about 15 minutes on 2 cores)
    python benchmarks/throughput.py --runs 1 --scenarios 2-drift
    python benchmarks/throughput.py --out /tmp/throughput.json

Scenarios (ZeRO-2, gloo, one thread per rank, global batch 512):

    2-emulated   2 ranks, emulated speeds [1.0, 0.4]            equal fit and auto fit, adjacent in time
    2-identical  2 ranks, no emulation                          equal fit and auto fit, adjacent in time
    2-drift      2 ranks, [1.0, 1.0] until step 100, then [1.0, 0.4]           auto fit only (240 steps)
    4-emulated   4 ranks on the 2 cores, [1.0, 1.0, 0.5, 0.25]  equal fit and auto fit
    2-memory     2 ranks, [1.0, 0.4], the fast rank's memory emulated to hold 128 samples (a quarter of the batch):
                 the automatic split in one micro-batch per rank (``micro_steps=[1, 1]``: capped at 128) and with
                 micro-steps (the planner's choice), adjacent in time
    2-precision  2 ranks, no emulation, ``device_precision=["bf16-mixed", "32-true"]``: rank 0 computes under bf16
                 autocast (faster where the CPU has bf16 instructions), rank 1 in fp32; equal fit and auto fit

Every fit is a separate bounded job (this script re-run with ``--fit``; Lightning's launcher re-runs that command
line for the other ranks), and everything is measured by the strategy itself: the figures come from the run report
(``hetero/report.json``) that every fit writes, so the benchmark measures what a user's report shows.

From a report's steps, for each training step:

    throughput     ``B / step_seconds`` (the step's wall time, as the slowest rank saw it)
    ideal ratio    the step's time if the same ranks had computed the same global batch perfectly balanced, over the
                   measured step time: ``(B / sum_r (b_r / compute_r) + overhead) / step_seconds`` with
                   ``overhead = step_seconds - max_r compute_r``. ``b_r / compute_r`` is rank r's measured rate in
                   that step; balanced, every rank computes ``B / sum_r rate_r``. It assumes compute proportional to
                   the micro-batch, which flatters the ideal a little (a fixed part per step cannot be shrunk), so the
                   ratio is, if anything, on the low side. Taken within one step, machine noise cancels.

A fit's figures are medians over its *steady* steps: from step 60 on (the automatic split's first two windows of 20
steps are its re-plans' earliest chance) or, for the drift, from 50 steps after the drift. The auto/equal ratio is
taken between two fits run back to back (their order alternates between runs) to cancel the machine's slow changes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # (the benchmarks' shared helpers, whatever the working directory)
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
from jobs import commit_of  # noqa: E402

DEFAULT_OUT = HERE / "results" / "throughput.json"
GLOBAL_BATCH = 512
STEPS = 240
STEADY_FROM = 60  # the automatic split may re-plan at steps 40 and 60 at the earliest
DRIFT_AT = 100
DRIFT_SETTLED = 50  # the target: balanced again within 50 steps of the drift
SCENARIOS: dict[str, dict[str, Any]] = {
    "2-emulated": {"devices": 2, "speeds": [1.0, 0.4], "splits": ["equal", "auto"]},
    "2-identical": {"devices": 2, "speeds": None, "splits": ["equal", "auto"]},
    "2-drift": {"devices": 2, "speeds": {0: [1.0, 1.0], DRIFT_AT: [1.0, 0.4]}, "splits": ["auto"]},
    "4-emulated": {"devices": 4, "speeds": [1.0, 1.0, 0.5, 0.25], "splits": ["equal", "auto"]},
    "2-memory": {"devices": 2, "speeds": [1.0, 0.4], "memory": "128,-", "splits": ["capped", "micro"]},
    "2-precision": {"devices": 2, "speeds": None, "precision": ["bf16-mixed", "32-true"], "splits": ["equal", "auto"]},
}
FIT_TIMEOUT = 420


# ---------------------------------------------------------------------------------------------- one fit (--fit)


def fit(scenario: str, split: str, out: Path) -> None:
    """One Trainer.fit of the scenario on every rank; rank 0's strategy writes ``out/hetero/report.json``."""
    import torch
    from lightning.pytorch import LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)  # one core's worth per rank, as one device
    settings = SCENARIOS[scenario]
    world = settings["devices"]

    class TiedMLP(LightningModule):
        """A 256-wide hidden layer applied 4 times with tied weights: much compute per sample, few parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.inp, self.hidden, self.out = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            h = torch.relu(self.inp(x))
            for _ in range(4):
                h = torch.relu(self.hidden(h))
            return nn.functional.cross_entropy(self.out(h), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    seed_everything(0)
    data = TensorDataset(torch.randn(GLOBAL_BATCH * 16, 64), torch.randint(0, 10, (GLOBAL_BATCH * 16,)))
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // world, shuffle=True)
    kwargs: dict[str, Any] = {"global_batch_size": GLOBAL_BATCH}
    if split == "equal":
        kwargs["batch_sizes"] = [GLOBAL_BATCH // world] * world
    if split == "capped":  # the automatic split, one micro-batch per rank: within the memory ceiling
        kwargs["micro_steps"] = [1] * world
    if "memory" in settings:  # (read by every rank: Lightning's launcher starts the others with this environment)
        os.environ["LIGHTNING_HETERO_EMULATE_MEMORY"] = settings["memory"]
    if settings["speeds"] is not None:
        kwargs["emulate_speeds"] = settings["speeds"]
    if "precision" in settings:
        kwargs["device_precision"] = settings["precision"]
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=HeteroStrategy(**kwargs),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(TiedMLP(), loader)


# ---------------------------------------------------------------------------------------------- analysis (pure)


def ideal_ratio(step: dict[str, Any]) -> float:
    """The perfectly balanced step time over the measured one (1.0: this step could not have been faster)."""
    rates = [size / compute for size, compute in zip(step["batch_sizes"], step["compute_seconds"]) if compute > 0]
    if len(rates) != len(step["batch_sizes"]) or step["step_seconds"] <= 0:
        return float("nan")
    overhead = step["step_seconds"] - max(step["compute_seconds"])
    return (sum(step["batch_sizes"]) / sum(rates) + overhead) / step["step_seconds"]


def steady_figures(report: dict[str, Any], start: int) -> dict[str, Any]:
    """Median throughput, ideal ratio and slowest rank's compute over the steps from ``start`` on, and the split they
    ran with."""
    steps = [step for step in report["steps"] if step["step"] >= start]
    return {
        "samples_per_second": statistics.median(sum(s["batch_sizes"]) / s["step_seconds"] for s in steps),
        "ideal_ratio": statistics.median(ideal_ratio(s) for s in steps),
        "slowest_compute_seconds": statistics.median(max(s["compute_seconds"]) for s in steps),
        "final_split": report["steps"][-1]["batch_sizes"],
        "replans": report["replans"],
        "measurement_share": report["summary"].get("measurement_share"),
    }


def drift_figures(report: dict[str, Any], drift_at: int = DRIFT_AT, settled: int = DRIFT_SETTLED) -> dict[str, Any]:
    """Before the drift, after it has settled, and how many steps after it the split first changed."""
    after = [replan["step"] - drift_at for replan in report["replans"] if replan["step"] >= drift_at]

    def ratio_between(begin: int, end: int) -> float:
        return statistics.median(ideal_ratio(s) for s in report["steps"] if begin <= s["step"] < end)

    return {
        **steady_figures(report, drift_at + settled),
        "ideal_ratio_before_drift": ratio_between(STEADY_FROM, drift_at),
        # The 50 steps that follow the target's 50: already balanced again there?
        "ideal_ratio_settling": ratio_between(drift_at + settled, drift_at + 2 * settled),
        "steps_to_first_replan": after[0] if after else None,
        "replans_before_drift": sum(replan["step"] < drift_at for replan in report["replans"]),
    }


def analyse_run(scenario: str, reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if scenario == "2-drift":
        return {"auto": drift_figures(reports["auto"])}
    if scenario == "2-memory":
        figures = {split: steady_figures(report, STEADY_FROM) for split, report in reports.items()}
        figures["micro_steps"] = reports["micro"]["steps"][-1].get("micro_steps")
        figures["micro_over_capped"] = figures["micro"]["samples_per_second"] / figures["capped"]["samples_per_second"]
        return figures
    figures = {split: steady_figures(report, STEADY_FROM) for split, report in reports.items()}
    figures["auto_over_equal"] = figures["auto"]["samples_per_second"] / figures["equal"]["samples_per_second"]
    # How much less the slowest rank computes per step: what the split changes, whatever the fixed part of a step
    figures["equal_over_auto_slowest_compute"] = (
        figures["equal"]["slowest_compute_seconds"] / figures["auto"]["slowest_compute_seconds"]
    )
    return figures


# ---------------------------------------------------------------------------------------------- driver


def launch(scenario: str, split: str, out: Path) -> dict[str, Any]:
    """Run one fit as a bounded job (its whole process group is killed on timeout); its run report."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", scenario, split, str(out)]
    with open(out / "log.txt", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=FIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            raise RuntimeError(f"{scenario}/{split} did not finish in {FIT_TIMEOUT} s; see {out / 'log.txt'}") from None
    if process.returncode != 0:
        raise RuntimeError(f"{scenario}/{split} failed ({process.returncode}); see {out / 'log.txt'}")
    return json.loads((out / "hetero" / "report.json").read_text())


def run_all(scenarios: list[str], runs: int, work: Path) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
    for run in range(runs):
        for name in scenarios:
            splits = SCENARIOS[name]["splits"]
            order = splits if run % 2 == 0 else list(reversed(splits))  # ABBA across runs
            started = time.perf_counter()
            reports = {split: launch(name, split, work / name / f"run{run}" / split) for split in order}
            figures = analyse_run(name, reports)
            results[name].append(figures)
            print(f"run {run + 1}/{runs} {name}: {describe(name, figures)} ({time.perf_counter() - started:.0f} s)")
    return results


def describe(name: str, figures: dict[str, Any]) -> str:
    if name == "2-memory":
        micro, capped = figures["micro"], figures["capped"]
        return (
            f"micro-steps {micro['samples_per_second']:.0f} samples/s, split {micro['final_split']} in micro-steps"
            f" {figures['micro_steps']}; capped {capped['samples_per_second']:.0f} samples/s, split"
            f" {capped['final_split']}; micro/capped {figures['micro_over_capped']:.3f}"
        )
    auto = figures["auto"]
    text = f"auto {auto['samples_per_second']:.0f} samples/s, {auto['ideal_ratio']:.3f} of ideal"
    text += f", split {auto['final_split']}, {len(auto['replans'])} re-plans"
    if name == "2-drift":
        return text + f", first re-plan {auto['steps_to_first_replan']} steps after the drift"
    equal = figures["equal"]
    text += f"; equal {equal['samples_per_second']:.0f} samples/s, {equal['ideal_ratio']:.3f} of ideal"
    text += f"; slowest rank's compute equal/auto {figures['equal_over_auto_slowest_compute']:.3f}"
    return text + f"; auto/equal {figures['auto_over_equal']:.3f}"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    def runs_of(values: list[float]) -> str:
        return ", ".join(f"{value:.2f}" for value in values) + f" (median {statistics.median(values):.2f})"

    lines = ["| scenario | measure | every run (median) | target |", "|---|---|---|---|"]
    for name, runs in results.items():
        if name == "2-memory":
            ratios = runs_of([run["micro_over_capped"] for run in runs])
            lines.append(f"| {name} | micro-steps / capped (samples/s) | {ratios} | >= 1.3 |")
            for split in ("micro", "capped"):
                speeds = ", ".join(f"{run[split]['samples_per_second']:.0f}" for run in runs)
                lines.append(f"| {name} | {split} samples/s | {speeds} | |")
            splits = "; ".join(f"{run['micro']['final_split']} in {run['micro_steps']}" for run in runs)
            lines.append(f"| {name} | micro-steps: final split in micro-steps | {splits} | |")
            lines.append(
                f"| {name} | capped: final split | {'; '.join(str(r['capped']['final_split']) for r in runs)} | |"
            )
            continue
        autos = [run["auto"] for run in runs]
        if name == "2-drift":
            lines.append(
                f"| {name} | auto / ideal, {DRIFT_SETTLED}+ steps after the drift | "
                f"{runs_of([a['ideal_ratio'] for a in autos])} | >= 0.90 every run |"
            )
            settling = f"{DRIFT_AT + DRIFT_SETTLED}-{DRIFT_AT + 2 * DRIFT_SETTLED - 1}"
            lines.append(
                f"| {name} | auto / ideal, steps {settling} | {runs_of([a['ideal_ratio_settling'] for a in autos])} | |"
            )
            lines.append(
                f"| {name} | auto / ideal before the drift (steps {STEADY_FROM}-{DRIFT_AT - 1}) | "
                f"{runs_of([a['ideal_ratio_before_drift'] for a in autos])} | |"
            )
            before = ", ".join(str(a["replans_before_drift"]) for a in autos)
            lines.append(f"| {name} | re-plans before the drift (identical ranks until then) | {before} | |")
            steps = [a["steps_to_first_replan"] for a in autos]
            lines.append(f"| {name} | steps from the drift to the first re-plan | {', '.join(map(str, steps))} | |")
            continue
        target = ">= 0.90 every run" if name == "2-emulated" else ""
        lines.append(f"| {name} | auto / ideal | {runs_of([a['ideal_ratio'] for a in autos])} | {target} |")
        lines.append(f"| {name} | equal / ideal | {runs_of([r['equal']['ideal_ratio'] for r in runs])} | |")
        target = ">= 0.97 median" if name == "2-identical" else ""
        ratios = runs_of([run["auto_over_equal"] for run in runs])
        lines.append(f"| {name} | auto / equal (samples/s) | {ratios} | {target} |")
        speeds = ", ".join(f"{auto['samples_per_second']:.0f}" for auto in autos)
        lines.append(f"| {name} | auto samples/s | {speeds} | |")
        replans = ", ".join(str(len(auto["replans"])) for auto in autos)
        lines.append(f"| {name} | auto re-plans per run | {replans} | |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--fit", nargs=3, metavar=("SCENARIO", "SPLIT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        scenario, split, out = args.fit
        fit(scenario, split, Path(out))
        return
    work = args.out.parent / "throughput_runs"
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results = run_all(args.scenarios, args.runs, work)
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(["benchmarks/throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit_of(HERE),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "started": started,
        "runs": args.runs,
        "results": results,
        "table": text,
    }
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
