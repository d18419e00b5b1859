"""What a DDP user pays for HeteroStrategy on identical devices: step time, start-up time and memory.

    python benchmarks/overhead.py                       # 5 pairs (about 8 minutes on 2 cores)
    python benchmarks/overhead.py --pairs 2 --steps 120
    python benchmarks/overhead.py --out /tmp/overhead.json

The same model (an MLP 256-1024-1024-10, 1.3 M parameters, Adam), global batch 512 and 2 identical CPU ranks (one
thread each) train under three strategies, each a separate job started by Lightning's launcher:

    ddp      Trainer(strategy="ddp"), what a user would pick instead
    default  HeteroStrategy(batch_sizes=[256, 256]): no stage given, the lowest that fits (ZeRO-0 here)
    zero0    HeteroStrategy(stage=0, batch_sizes=[256, 256]), the equal split
    zero2    HeteroStrategy(stage=2, batch_sizes=[256, 256])

The four run back to back in each pair, their order rotating from pair to pair, so that the machine's slow changes
hit them alike; every ratio is taken within a pair. Measured in each job, on rank 0 (rank 1's memory too):

    step       the median wall time between the starts of two training steps, from step 20 on
    start-up   from the process's start (the OS's record) to the start of the first training step
    memory     each rank's peak resident memory (ru_maxrss)

Targets: step ratio (hetero / ddp) <= 1.03; start-up within 3 s of DDP's. With ``--plain``, each pair also times the
same model in plain loops without Lightning or this package (``torch.distributed.run``, 2 ranks): torch's
DistributedDataParallel, and DeepSpeed's engine at ZeRO 0 and 2 (``deepspeed.initialize``, contiguous gradients and
overlap off): what DeepSpeed's ZeRO itself costs beside DDP, apart from the package. Results are printed; the JSON
(``--out``, default ``benchmarks/results/overhead.json``) holds every pair's figures with the command, the commit, the
machine and the date. A run worth keeping is committed as ``benchmarks/measured/overhead_<what>.json`` and rendered by
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
from typing import Any

HERE = Path(__file__).resolve().parent
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from jobs import checkout_first, run_facts, run_job  # noqa: E402  (benchmarks/jobs.py)

DEFAULT_OUT = HERE / "results" / "overhead.json"
STRATEGIES = ("ddp", "default", "zero0", "zero2")
HETERO = STRATEGIES[1:]
PLAIN = ("ddp", "zero0", "zero2")  # the plain loops: torch DDP and DeepSpeed's engine at a stage
GLOBAL_BATCH = 512
STEADY_FROM = 20
FIT_TIMEOUT = 600


def fit(strategy: str, steps: int, out: Path) -> None:
    """One Trainer.fit on every rank (Lightning's launcher re-runs this command for rank 1)."""
    import resource

    import psutil
    import torch
    import torch.distributed
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)  # one core's worth per rank, as one device

    class MLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Timing(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.starts.append(time.time())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
            peaks = [torch.zeros_like(peak) for _ in range(trainer.world_size)]
            torch.distributed.all_gather(peaks, peak)
            if trainer.is_global_zero:
                steps = [b - a for a, b in zip(self.starts, self.starts[1:])][STEADY_FROM:]
                started = psutil.Process().create_time()
                config = getattr(trainer.strategy, "config", None) or {}
                (out / "timing.json").write_text(
                    json.dumps(
                        {
                            "zero_stage": config.get("zero_optimization", {}).get("stage"),
                            "step_seconds": statistics.median(steps),
                            "startup_seconds": self.starts[0] - started,
                            "peak_bytes": [float(p.item()) for p in peaks],
                        }
                    )
                )

    seed_everything(0)
    data = TensorDataset(torch.randn(GLOBAL_BATCH * 8, 256), torch.randint(0, 10, (GLOBAL_BATCH * 8,)))
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // 2, shuffle=True)
    if strategy == "ddp":
        chosen: Any = "ddp"
    else:
        from lightning_hetero import HeteroStrategy

        stage = None if strategy == "default" else int(strategy[-1])
        chosen = HeteroStrategy(stage=stage, batch_sizes=[GLOBAL_BATCH // 2] * 2)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=chosen,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Timing()],
        default_root_dir=out,
    )
    trainer.fit(MLP(), loader)


def plain_loop(strategy: str, steps: int, out: Path) -> None:
    """The same model and per-rank batch in a plain training loop, on each rank of ``torch.distributed.run``."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(GLOBAL_BATCH // 2, 256), torch.randint(0, 10, (GLOBAL_BATCH // 2,))
    if strategy == "ddp":
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(network)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step() -> None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    else:
        import deepspeed

        from lightning_hetero.runtime import startup

        with startup.without_shared_memory_comm_op():
            deepspeed.init_distributed("gloo")
        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // 2,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": int(strategy[-1]), "contiguous_gradients": False, "overlap_comm": False},
        }
        engine, *_ = deepspeed.initialize(
            model=network, optimizer=torch.optim.Adam(network.parameters(), lr=1e-3), config=config
        )

        def step() -> None:
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()

    starts = []
    for _ in range(steps):
        starts.append(time.time())
        step()
    if int(os.environ["RANK"]) == 0:
        seconds = [b - a for a, b in zip(starts, starts[1:])][STEADY_FROM:]
        (out / "timing.json").write_text(json.dumps({"step_seconds": statistics.median(seconds)}))


def timed_child(command: list[str], what: str, out: Path) -> dict[str, Any]:
    """Run one measured fit in a process session of its own (killed whole past FIT_TIMEOUT; its output in
    ``out/fit.log``); the timing.json it wrote in ``out``."""
    # this checkout's package in every rank, whoever starts it (Lightning's launcher, torch.distributed.run)
    environment = checkout_first(HERE.parent, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # (a session of its own: a fit past its deadline is killed with every rank it started; its output is in the log)
    run_job(command, out / "fit.log", environment, FIT_TIMEOUT, what)
    return json.loads((out / "timing.json").read_text())


def run_plain(strategy: str, steps: int, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--plain-fit",
        strategy,
        "--steps",
        str(steps),
        "--fit-out",
        str(out),
    ]
    return timed_child(command, f"plain {strategy}", out)["step_seconds"]


def run_fit(strategy: str, steps: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", strategy, "--steps", str(steps), "--fit-out", str(out)]
    return timed_child(command, strategy, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plain", action="store_true", help="also time plain loops (DDP, DeepSpeed ZeRO 0 and 2)")
    parser.add_argument("--fit", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--plain-fit", choices=PLAIN, help=argparse.SUPPRESS)
    parser.add_argument("--fit-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit:
        fit(args.fit, args.steps, args.fit_out)
        return
    if args.plain_fit:
        plain_loop(args.plain_fit, args.steps, args.fit_out)
        return
    facts = run_facts("benchmarks/overhead.py", sys.argv[1:], HERE)
    runs: list[dict[str, Any]] = []
    work = args.out.parent / "overhead_runs"
    for pair in range(args.pairs):
        shift = pair % len(STRATEGIES)
        order = STRATEGIES[shift:] + STRATEGIES[:shift]  # rotate who goes first
        figures = {name: run_fit(name, args.steps, work / f"pair{pair}_{name}") for name in order}
        ddp = figures["ddp"]
        row = {"pair": pair, "order": list(order), **{name: figures[name] for name in STRATEGIES}}
        for name in HETERO:
            row[f"{name}_step_ratio"] = figures[name]["step_seconds"] / ddp["step_seconds"]
            row[f"{name}_startup_extra_seconds"] = figures[name]["startup_seconds"] - ddp["startup_seconds"]
        if args.plain:
            plain = {
                name: run_plain(name, args.steps, work / f"pair{pair}_plain_{name}") for name in order if name in PLAIN
            }
            row["plain_step_seconds"] = plain
            for name in ("zero0", "zero2"):
                row[f"plain_{name}_step_ratio"] = plain[name] / plain["ddp"]
            print(
                f"pair {pair} plain loops: step ms "
                + ", ".join(f"{n} {plain[n] * 1e3:.1f}" for n in PLAIN)
                + f"; ratio zero0 {row['plain_zero0_step_ratio']:.3f}, zero2 {row['plain_zero2_step_ratio']:.3f}",
                flush=True,
            )
        runs.append(row)
        print(
            f"pair {pair} ({', '.join(order)}): step ms "
            + ", ".join(f"{name} {figures[name]['step_seconds'] * 1e3:.1f}" for name in STRATEGIES)
            + f"; ratio default (ZeRO-{figures['default']['zero_stage']}) {row['default_step_ratio']:.3f}, zero0"
            f" {row['zero0_step_ratio']:.3f}, zero2 {row['zero2_step_ratio']:.3f}; start-up s "
            + ", ".join(f"{name} {figures[name]['startup_seconds']:.1f}" for name in STRATEGIES),
            flush=True,
        )
    summary: dict[str, Any] = {"default_zero_stages": sorted({r["default"]["zero_stage"] for r in runs})}
    for name in HETERO:
        summary[name] = {
            "step_ratio_median": statistics.median(r[f"{name}_step_ratio"] for r in runs),
            "step_ratios": [round(r[f"{name}_step_ratio"], 4) for r in runs],
            "startup_extra_seconds_median": statistics.median(r[f"{name}_startup_extra_seconds"] for r in runs),
            "startup_extra_seconds": [round(r[f"{name}_startup_extra_seconds"], 2) for r in runs],
        }
        if args.plain and name in PLAIN:
            summary[name]["plain_step_ratio_median"] = statistics.median(r[f"plain_{name}_step_ratio"] for r in runs)
            summary[name]["plain_step_ratios"] = [round(r[f"plain_{name}_step_ratio"], 4) for r in runs]
    for name in STRATEGIES:
        summary.setdefault("peak_mib_per_rank", {})[name] = [
            round(statistics.median(r[name]["peak_bytes"][rank] for r in runs) / 2**20) for rank in (0, 1)
        ]
        summary.setdefault("startup_seconds_median", {})[name] = round(
            statistics.median(r[name]["startup_seconds"] for r in runs), 2
        )
        summary.setdefault("step_ms_median", {})[name] = round(
            statistics.median(r[name]["step_seconds"] for r in runs) * 1e3, 2
        )
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "ranks": 2,
        "threads_per_rank": 1,
        "model": "MLP 256-1024-1024-10, Adam lr 1e-3",
        "global_batch": GLOBAL_BATCH,
        "batch_sizes": [GLOBAL_BATCH // 2] * 2,
        "steps": args.steps,
        "steady_from": STEADY_FROM,
        "pairs": args.pairs,
        "strategies": list(STRATEGIES),
        "plain": args.plain,
    }
    args.out.write_text(json.dumps({**facts, "setting": setting, "runs": runs, "summary": summary}, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
