"""A rank slowed everywhere: its whole process held by the kernel to a fraction of a core (a CPU quota).

    python benchmarks/throttled.py                         # rank 1 at 40 %: a sweep, then 5 rounds (about 15 min)
    python benchmarks/throttled.py --limits 0.25 0.4 0.6 --pairs 5
    python benchmarks/throttled.py --limits 1.0 --sweep-shares 256 --steps 500 --measured 1 500  # identical ranks
    python benchmarks/throttled.py --form neighbour --limits 0.5          # a busy process on rank 1's core
    python benchmarks/throttled.py --form intermittent --steps 600        # the quota from step 100 to step 300
    python benchmarks/throttled.py --form emulated --limits 0.4           # the package's emulate_slowdown="process"
    python benchmarks/throttled.py --form sends --limits 0.4              # the package's emulate_slowdown="sends"
    python benchmarks/throttled.py --regression /path/to/older/checkout   # emulate_speeds=[1.0, 0.4]: older vs now

Two CPU ranks, each pinned to a core of its own (one intra-op thread), train a 64-512-512-10 MLP with AdamW on a
global batch of 512 (ZeRO-0). Rank 1 is slowed by this script from a callback in its process, the package not told,
as it is not told of a container's CPU limit (``--form``): its process held to ``--limits`` of its core by the kernel's
CFS quota (4 ms per 10 ms for 0.4: :mod:`lightning_hetero.emulate.throttle`, a cgroup of its own as root, else a
SIGSTOP/SIGCONT duty cycle), the same only from step 100 to step 300, or a busy process sharing its core. Each fit runs
``--steps`` training steps; its figure is the median wall time between the starts of the ``--measured`` steps on
rank 0 (the first ones left out: the automatic split starts from the plan's equal split and re-plans from step 40).

For each limit: a sweep of fixed splits (rank 1's share of the 512 samples, ``--sweep-shares``, re-planning off)
finds the best fixed split; then ``--pairs`` rounds, each running back to back: the package's automatic split (as a
user runs it: profiled, re-planned every 20 steps), Lightning's DDPStrategy (256 samples each), and the best fixed
split. Every fit's figure goes to the JSON (``--out``), with the machine, the commit and the command; the printout
gives every round and each variant's median over the rounds, and the ratios: automatic over best fixed, DDP over
automatic (the speedup).

``--form emulated`` has the package slow rank 1 itself, ``HeteroStrategy(emulate_speeds=[1.0, limit],
emulate_slowdown="process")``, in the automatic and fixed fits (DDP's fit gets the script's quota, the same kernel
mechanism): what a user sees who tries the package on identical hardware. ``--form sends`` has the package hold back
rank 1's sends (``emulate_slowdown="sends"``: each payload by (1/limit - 1) x its bytes / 1 Gbit/s), a delay no split
removes; there is no DDP fit (DDP cannot be slowed so), and the rounds run the automatic split and the best fixed one.

``--regression DIR`` compares instead, in pairs of fits back to back (in alternating order), another checkout's
automatic split with this one's under the package's own emulation (``emulate_speeds=[1.0, --emulated-speed]``, no
quota): what the changes cost where the cost model already explained the step. With ``--regression-limit L`` the
pairs run under the quota instead (rank 1 held to L of its core): two versions of the package compared where the
best fixed split is too flat to tell them apart by separate runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# (the checkout whose package a fit imports: another one's for --regression, else this one)
sys.path.insert(0, os.environ.get("THROTTLED_PACKAGE") or str(HERE.parent))

from jobs import commit_of, run_job  # noqa: E402

DEFAULT_OUT = HERE / "results" / "throttled.json"
GLOBAL_BATCH = 512
STEPS = 170
FIRST_MEASURED, LAST_MEASURED = 40, 160
THROTTLED_RANK = 1
FIT_TIMEOUT = 300
# The intermittent form: the quota holds rank 1 from the first of these steps to the second.
INTERMITTENT = (100, 300)
# A neighbour: a busy loop that ends by itself once the rank it shares a core with is gone.
NEIGHBOUR = """
import os, sys
rank = int(sys.argv[1])
while True:
    for _ in range(100000):
        pass
    try:
        os.kill(rank, 0)
    except ProcessLookupError:
        break
"""


def pin_to_own_core(rank: int, cores: list[int]) -> None:
    """Every thread of this process on ``cores[rank]`` alone (later threads inherit it)."""
    core = {cores[rank % len(cores)]}
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), core)


def fit(variant: str, limit: float, out: Path, steps: int = STEPS) -> None:
    """One Trainer.fit on every rank (the Lightning launcher starts rank 1); rank 0 writes ``out/steps.json``."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    pin_to_own_core(rank, [int(core) for core in os.environ["THROTTLED_CORES"].split(",")])

    form = os.environ.get("THROTTLED_FORM", "quota")

    class Throttled(Callback):
        """Rank 1 slowed by the script (the package is not told), by ``form``: "quota", its process held to ``limit``
        of its core from setup on; "intermittent", the same from step ``STEPS_ON`` to ``STEPS_OFF`` only; "neighbour",
        a busy process on its core from setup on (the kernel shares the core between the two)."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.held, self.neighbour = None, None
            if trainer.global_rank != THROTTLED_RANK or (limit >= 1.0 and form != "neighbour"):
                return
            if form in ("emulated", "sends") and isinstance(trainer.strategy, HeteroStrategy):
                return  # (the package slows the rank itself: emulate_slowdown)
            if form == "sends":
                return  # (DDP is not run in this form)
            if form in ("quota", "emulated"):
                self.hold()
            elif form == "neighbour":
                core = os.sched_getaffinity(0)
                self.neighbour = subprocess.Popen(
                    [sys.executable, "-c", NEIGHBOUR, str(os.getpid())],
                    preexec_fn=lambda: os.sched_setaffinity(0, core),
                )

        def hold(self) -> None:
            from lightning_hetero.emulate import throttle

            self.held = throttle.start_throttle(limit)

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if form != "intermittent" or trainer.global_rank != THROTTLED_RANK:
                return
            if trainer.global_step == INTERMITTENT[0] and self.held is None:
                self.hold()
            elif trainer.global_step == INTERMITTENT[1] and self.held is not None:
                self.held.stop()
                self.held = None

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if self.held is not None:
                self.held.stop()
            if self.neighbour is not None:
                self.neighbour.kill()
                self.neighbour.wait()

    class StepStarts(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 512),
                torch.nn.ReLU(),
                torch.nn.Linear(512, 512),
                torch.nn.ReLU(),
                torch.nn.Linear(512, 10),
            )

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    samples = GLOBAL_BATCH * (steps + 10)
    data = TensorDataset(
        torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // 2, shuffle=True)
    # The package's own emulation of rank 1 (--form emulated / sends): emulate_speeds with emulate_slowdown
    emulation: dict[str, Any] = {}
    if form in ("emulated", "sends") and limit < 1.0:
        emulation = {"emulate_speeds": [1.0, limit], "emulate_slowdown": "process" if form == "emulated" else "sends"}
    if variant == "ddp":
        strategy: Any = DDPStrategy(process_group_backend="gloo")
    elif variant.startswith("emulated:"):  # the package's own emulation: rank 1's compute stretched
        strategy = HeteroStrategy(stage=0, emulate_speeds=[1.0, float(variant.split(":")[1])])
    elif variant == "auto":
        strategy = HeteroStrategy(stage=0, **emulation)  # (as a user runs it: re-planned every 20 steps)
    else:
        sizes = [int(size) for size in variant.split(":")[1].split(",")]
        strategy = HeteroStrategy(stage=0, batch_sizes=sizes, **emulation)
    starts = StepStarts()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=out,
        callbacks=[Throttled(), starts],
    )
    trainer.fit(MLP(), loader)
    if trainer.global_rank == 0:
        report = out / "hetero" / "report.json"
        result = {"step_starts": starts.starts}
        if report.is_file():
            run_report = json.loads(report.read_text())
            result["batch_sizes"] = [step["batch_sizes"] for step in run_report["steps"]]
            result["report_steps"] = [step["step"] for step in run_report["steps"]]
            result["late_rank"] = run_report["summary"].get("late_rank")
            result["replans"] = run_report["replans"]
        (out / "steps.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- analysis (pure)


def median_step_ms(starts: list[float], first: int = FIRST_MEASURED, last: int = LAST_MEASURED) -> float:
    """The median wall time between the starts of steps ``first`` to ``last``, in ms."""
    gaps = [b - a for a, b in zip(starts[first:last], starts[first + 1 : last + 1])]
    return statistics.median(gaps) * 1e3


def mean_step_ms(starts: list[float], first: int = FIRST_MEASURED, last: int = LAST_MEASURED) -> float:
    """The mean wall time per step from the start of step ``first`` to the start of step ``last``, in ms: what the
    fit's throughput over those steps is (its slow steps, a re-plan's first ones, count in full)."""
    last = min(last, len(starts) - 1)
    return (starts[last] - starts[first]) / (last - first) * 1e3


def away_from_start(
    starts: list[float], report_steps: list[int], batch_sizes: list[list[int]], replans: list[dict[str, Any]]
) -> dict[str, Any]:
    """What the fit's steps away from its starting split cost, measured within the fit (so the machine's drift
    between fits does not hide it): each such step's time over the median step under the starting split, summed by
    what moved the split there ("search": the search on the measured step; "model": the cost model's re-plan), as a
    share of the fit's whole time. On identical ranks the starting (equal) split is the best one, so this is what
    exploring costs there. The step times are rank 0's, between the starts of consecutive steps."""
    times = {step: starts[step + 1] - starts[step] for step in range(len(starts) - 1)}
    split_at = {step: tuple(sizes) for step, sizes in zip(report_steps, batch_sizes) if step in times}
    if not split_at:
        return {}
    first = min(split_at)
    reference = split_at[first]
    at_reference = [times[step] for step, split in split_at.items() if split == reference]
    reference_level = statistics.median(at_reference)
    moved_by = {replan["step"]: replan.get("source") or "model" for replan in replans}
    source, excess, away = "plan", {}, {}
    for step in sorted(split_at):
        source = moved_by.get(step, source)
        if split_at[step] != reference:
            excess[source] = excess.get(source, 0.0) + times[step] - reference_level
            away[source] = away.get(source, 0) + 1
    total = sum(times[step] for step in split_at)
    return {
        "starting_split": list(reference),
        "starting_split_median_step_ms": reference_level * 1e3,
        "steps_away": away,
        "share_of_fit": {source: value / total for source, value in excess.items()},
        "share_of_fit_total": sum(excess.values()) / total,
    }


def spread(values: list[float]) -> str:
    """``median [min, max]`` of ratios, as the printout gives them."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def best_fixed(sweep: dict[str, float]) -> str:
    """The fixed split (``"fixed:b0,b1"``) with the shortest median step."""
    return min(sweep, key=sweep.__getitem__)


def fixed_variant(throttled_share: int) -> str:
    return f"fixed:{GLOBAL_BATCH - throttled_share},{throttled_share}"


# ---------------------------------------------------------------------------------------------- driver


def run_fit(
    variant: str,
    limit: float,
    work: Path,
    cores: list[int],
    steps: int = STEPS,
    measured: tuple[int, int] = (FIRST_MEASURED, LAST_MEASURED),
    package: Optional[Path] = None,
    form: str = "quota",
) -> dict[str, Any]:
    """One fit (``package``: the checkout whose lightning_hetero it imports, default this one)."""
    out = work / f"{variant.replace(':', '_').replace(',', '_')}_{time.time_ns()}"
    out.mkdir(parents=True)
    environment = {**os.environ, "PYTHONWARNINGS": "ignore", "THROTTLED_CORES": ",".join(map(str, cores))}
    environment["THROTTLED_FORM"] = form
    if package is not None:
        environment["THROTTLED_PACKAGE"] = str(package)
        environment["PYTHONPATH"] = f"{package}{os.pathsep}{environment.get('PYTHONPATH', '')}"
    command = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--limit",
        str(limit),
        "--work",
        str(out),
        "--steps",
        str(steps),
    ]
    started = time.perf_counter()
    run_job(command, out / "log.txt", environment, FIT_TIMEOUT, f"{variant} at limit {limit}")
    result = json.loads((out / "steps.json").read_text())
    first, last = measured
    figure = {
        "variant": variant,
        "limit": limit,
        "median_step_ms": median_step_ms(result["step_starts"], first, last),
        "mean_step_ms": mean_step_ms(result["step_starts"], first, last),
        # (the second half of the measured steps: where the automatic split has long settled)
        "late_median_step_ms": median_step_ms(result["step_starts"], (first + last) // 2, last),
        "seconds": time.perf_counter() - started,
    }
    if "batch_sizes" in result:
        figure["final_batch_sizes"] = result["batch_sizes"][-1]
        figure["late_rank"] = result["late_rank"]
        figure["replans"] = len(result["replans"])
        figure["replan_steps"] = [
            (replan["step"], replan["batch_sizes"], replan.get("source")) for replan in result["replans"]
        ]
        figure["away_from_start"] = away_from_start(
            result["step_starts"], result["report_steps"], result["batch_sizes"], result["replans"]
        )
    return figure


def regression(args: argparse.Namespace, cores: list[int]) -> None:
    """This checkout's automatic split against ``args.regression``'s, rank 1 at ``emulate_speeds=[1.0, s]`` (the
    package's own emulation: compute stretched), no quota; or, with ``--regression-limit``, rank 1 held by the
    script's CPU quota to that share of its core. A pair of fits back to back per round."""
    if args.regression_limit is not None:
        variant, limit, label = "auto", args.regression_limit, f"quota {args.regression_limit}"
    else:
        variant, limit, label = f"emulated:{args.emulated_speed}", 1.0, f"emulated speed {args.emulated_speed}"
    rounds = []
    for pair in range(args.pairs):
        # (in alternating order: a machine that slows down or speeds up within a pair does not favour one side)
        if pair % 2 == 0:
            before = run_fit(variant, limit, args.work, cores, args.steps, tuple(args.measured), args.regression)
            now = run_fit(variant, limit, args.work, cores, args.steps, tuple(args.measured))
        else:
            now = run_fit(variant, limit, args.work, cores, args.steps, tuple(args.measured))
            before = run_fit(variant, limit, args.work, cores, args.steps, tuple(args.measured), args.regression)
        rounds.append({"before": before, "now": now, "first": "before" if pair % 2 == 0 else "now"})
        print(
            f"{label} round {pair + 1}: before {before['median_step_ms']:.1f} ms"
            f" (split {before.get('final_batch_sizes')}), now {now['median_step_ms']:.1f} ms (split"
            f" {now.get('final_batch_sizes')}): now/before {now['median_step_ms'] / before['median_step_ms']:.3f}",
            flush=True,
        )
    ratios = [r["now"]["median_step_ms"] / r["before"]["median_step_ms"] for r in rounds]
    mean_ratios = [r["now"]["mean_step_ms"] / r["before"]["mean_step_ms"] for r in rounds]
    print(f"now/before: by the median step {spread(ratios)}, by the mean step {spread(mean_ratios)}")
    record = {
        "command": " ".join(sys.argv),
        "commit": commit_of(HERE),
        "before_commit": commit_of(args.regression),
        "machine": platform.node(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "regression": str(args.regression),
        "regression_limit": args.regression_limit,
        "rounds": rounds,
        "now_over_before": ratios,
        "mean_now_over_before": mean_ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits", type=float, nargs="+", default=[0.4])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--sweep-shares", type=int, nargs="+", default=[256, 192, 128, 96, 64, 32])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning_hetero_throttled"))
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per fit")
    parser.add_argument(
        "--measured",
        type=int,
        nargs=2,
        default=[FIRST_MEASURED, LAST_MEASURED],
        help="the steps whose median is each fit's figure",
    )
    parser.add_argument(
        "--regression",
        type=Path,
        help="another checkout: its automatic split against this one's,"
        " under the package's own emulation (--emulated-speed), in pairs",
    )
    parser.add_argument("--emulated-speed", type=float, default=0.4)
    parser.add_argument(
        "--regression-limit",
        type=float,
        help="with --regression: compare under the script's CPU quota at this share of rank 1's core instead",
    )
    parser.add_argument(
        "--form",
        choices=["quota", "intermittent", "neighbour", "emulated", "sends"],
        default="quota",
        help="how rank 1 is slowed: its CPU quota (--limits) from the start, the same only from step"
        f" {INTERMITTENT[0]} to {INTERMITTENT[1]}, a busy process on its core, the package's own"
        " emulate_slowdown='process', or its emulate_slowdown='sends'",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return fit(args.worker, args.limit, args.work, args.steps)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if args.regression is not None:
        return regression(args, cores)
    record: dict[str, Any] = {
        "form": args.form,
        "command": " ".join(sys.argv),
        "commit": commit_of(HERE),
        "machine": platform.node(),
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "limits": {},
    }
    for limit in args.limits:
        sweep, sweep_figures = {}, []
        for share in args.sweep_shares:
            figure = run_fit(
                fixed_variant(share), limit, args.work, cores, args.steps, tuple(args.measured), None, args.form
            )
            sweep[figure["variant"]] = figure["median_step_ms"]
            sweep_figures.append(figure)
            late = (figure.get("late_rank") or {}).get("rank")
            print(
                f"limit {limit}: sweep {figure['variant']}: {figure['median_step_ms']:.1f} ms (mean"
                f" {figure['mean_step_ms']:.1f} ms; the report's late rank: {late})",
                flush=True,
            )
        best = best_fixed(sweep)
        rounds = []
        # (DDP cannot be slowed in its sends: that form compares the automatic split with the best fixed one only)
        variants = [("auto", "auto"), ("ddp", "ddp"), ("best fixed", best)]
        if args.form == "sends":
            variants = [("auto", "auto"), ("best fixed", best)]
        for pair in range(args.pairs):
            figures = {
                name: run_fit(variant, limit, args.work, cores, args.steps, tuple(args.measured), None, args.form)
                for name, variant in variants
            }
            if "ddp" not in figures:
                figures["ddp"] = {"median_step_ms": math.nan, "mean_step_ms": math.nan}
            rounds.append(figures)
            auto, ddp, fixed = (figures[name]["median_step_ms"] for name in ("auto", "ddp", "best fixed"))
            means = [figures[name]["mean_step_ms"] for name in ("auto", "ddp", "best fixed")]
            print(
                f"limit {limit} round {pair + 1}: auto {auto:.1f} ms (split {figures['auto'].get('final_batch_sizes')},"
                f" late rank {(figures['auto'].get('late_rank') or {}).get('rank')}), DDP {ddp:.1f} ms, best fixed"
                f" {best} {fixed:.1f} ms: auto/best {auto / fixed:.3f}, DDP/auto {ddp / auto:.3f}; means"
                f" {means[0]:.1f} / {means[1]:.1f} / {means[2]:.1f} ms: auto/best {means[0] / means[2]:.3f}, DDP/auto"
                f" {means[1] / means[0]:.3f}",
                flush=True,
            )
        medians = {name: statistics.median(r[name]["median_step_ms"] for r in rounds) for name in rounds[0]}
        over_best = [r["auto"]["median_step_ms"] / r["best fixed"]["median_step_ms"] for r in rounds]
        speedups = [r["ddp"]["median_step_ms"] / r["auto"]["median_step_ms"] for r in rounds]
        print(
            f"limit {limit}: medians {', '.join(f'{k} {v:.1f} ms' for k, v in medians.items())}; auto/best fixed"
            f" {spread(over_best)}, DDP/auto {spread(speedups)}",
            flush=True,
        )
        mean_over_best = [r["auto"]["mean_step_ms"] / r["best fixed"]["mean_step_ms"] for r in rounds]
        mean_speedups = [r["ddp"]["mean_step_ms"] / r["auto"]["mean_step_ms"] for r in rounds]
        print(
            f"limit {limit}: by the mean step: auto/best fixed {spread(mean_over_best)}, DDP/auto"
            f" {spread(mean_speedups)}",
            flush=True,
        )
        record["limits"][str(limit)] = {
            "sweep_ms": sweep,
            "sweep": sweep_figures,
            "mean_auto_over_best": mean_over_best,
            "mean_ddp_over_auto": mean_speedups,
            "best_fixed": best,
            "rounds": rounds,
            "medians_ms": medians,
            "auto_over_best": over_best,
            "ddp_over_auto": speedups,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))  # (after each limit: what ran survives a later failure)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
