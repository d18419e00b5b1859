"""What compression and hierarchical reduction save between nodes, and what they cost in loss.

    python benchmarks/communication.py                  # 8 fits, about 6 minutes on 2 cores
    python benchmarks/communication.py --runs 2         # every fit twice (the order reversed the second time)
    python benchmarks/communication.py --modes none powersgd --out /tmp/communication.json

Setting: 4 ranks on this machine as 2 emulated nodes of 2 (``LIGHTNING_HETERO_EMULATE_NODES=2``) joined by an
emulated 1 Gbit/s link with 0.1 ms latency (``LIGHTNING_HETERO_EMULATE_LINK=1,0.1``: every collective that spans the
nodes sleeps ``latency + bytes the busiest node sends / bandwidth``; see ``lightning_hetero/comm/topology.py``). ZeRO-0
(the stage whose exchange takes hooks), gloo, one thread per rank, an MLP 256 -> 1024 -> 1024 -> 10 (1.3 M
parameters, 5.3 MB of fp32 gradients), Adam, a fixed unequal split 20/12/20/12 of a global batch of 64, 60 steps on a
teacher-labelled classification task; every fit starts from the same weights and sees the same batches.

For each compression (none; fp16; powersgd and topk with the package's defaults: rank 1 (ratio 0.01) after 10
uncompressed steps, raised while the error checked every 5 steps is above max_error 0.1, within a tenth of the
uncompressed bytes; powersgd-fixed: rank 1 without the bound), flat and hierarchical:

    bytes between nodes   per step, the sum over ranks of what each put into collectives that span the nodes
                          (``inter_node_bytes`` of the run report), median over steps 15-59: after PowerSGD's warm-up
    step time             median over steps 15-59 of the step's wall time (``step_seconds`` of the run report)
    final loss            cross-entropy of the final weights on 2048 held-out samples (rank 0, after fit)

Ratios are against the uncompressed flat fit of the same run; the losses are deterministic, the times are not (2
cores, shared): the step-time ratio is the figure to read, taken between fits run one after the other. The JSON
(``--out``) holds every run with the command, the commit, the machine and the date; a run worth keeping is committed
as ``benchmarks/measured/communication_<what>.json`` and rendered by ``python benchmarks/render.py``.
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
DEFAULT_OUT = HERE / "results" / "communication.json"
MODES = ("none", "fp16", "powersgd", "powersgd-fixed", "topk")
BATCH_SIZES = [20, 12, 20, 12]
STEPS = 60
MEASURED_FROM = 15  # PowerSGD compresses from step 10 on
LINK = "1,0.1"  # Gbit/s, ms
FIT_TIMEOUT = 420
# powersgd and topk run with the package's defaults: PowerSGD's rank 1 (top-k's ratio 0.01), raised while the error
# is above max_error 0.1 within a tenth of the uncompressed bytes. powersgd-fixed is rank 1 without the error bound.
OPTIONS: dict[str, dict] = {"powersgd-fixed": {"max_error": None}}
COMPRESSION = {"none": None, "powersgd-fixed": "powersgd"}


# ---------------------------------------------------------------------------------------------- one fit (--fit)


def fit(mode: str, hierarchical: bool, out: Path, model_name: str = "mlp") -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    seed_everything(0)
    if model_name != "mlp":
        model, train, held_out = spirals(model_name, sum(BATCH_SIZES) * STEPS)
    else:
        model, train, held_out = teacher_task(sum(BATCH_SIZES) * STEPS)
    compression = COMPRESSION.get(mode, mode)
    strategy = HeteroStrategy(
        stage=0,
        batch_sizes=BATCH_SIZES,
        compression=compression,
        compression_options=OPTIONS.get(mode),
        hierarchical=hierarchical,
    )
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


def spirals(model_name: str, samples: int) -> tuple[Any, Any, Any]:
    """The examples' spiral classifier: its default (``spirals``: width 256, one block applied 12 times, lr 3e-3) or
    the wide one of the local-SGD benchmark (``wide-spirals``: width 1024, 2 applications, lr 1e-3)."""
    sys.path.insert(0, str(HERE.parent))
    from examples.spirals import SpiralClassifier, make_spirals

    model = SpiralClassifier() if model_name == "spirals" else SpiralClassifier(hidden=1024, depth=2, lr=1e-3)
    return model, make_spirals(samples, seed=0), make_spirals(2048, seed=1).tensors


def teacher_task(samples: int) -> tuple[Any, Any, Any]:
    import torch
    from lightning.pytorch import LightningModule
    from torch import nn
    from torch.utils.data import TensorDataset

    teacher = nn.Sequential(nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 10))
    inputs = torch.randn(samples + 2048, 256)
    with torch.no_grad():
        labels = teacher(inputs).argmax(dim=1)
    train = TensorDataset(inputs[:-2048], labels[:-2048])
    held_out = (inputs[-2048:], labels[-2048:])

    class WideMLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return WideMLP(), train, held_out


# ---------------------------------------------------------------------------------------------- analysis (pure)


def figures(report: dict[str, Any], final_loss: float) -> dict[str, Any]:
    steps = [step for step in report["steps"] if step["step"] >= MEASURED_FROM]
    communication = report["communication"]
    return {
        "inter_node_bytes_per_step": statistics.median(sum(step["inter_node_bytes"]) for step in steps),
        "intra_node_bytes_per_step": statistics.median(sum(step["intra_node_bytes"]) for step in steps),
        "inter_node_bytes_mean": statistics.fmean(sum(step["inter_node_bytes"]) for step in steps),
        "step_seconds": statistics.median(step["step_seconds"] for step in steps),
        "final_loss": final_loss,
        "error_bound": {
            key: (communication.get("error_bound") or {}).get(key) for key in ("start", "current", "last_error")
        },
        "exchange": communication["exchange"],
        "hierarchical": communication["hierarchical"],
    }


def table(results: list[dict[str, dict[str, Any]]]) -> str:
    """One row per configuration; several runs are shown as their values separated by '/'."""
    lines = [
        "| compression | reduction | bytes between nodes / step | vs none flat | step time (ms) | vs none flat |"
        " final loss | vs none flat |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in results[0]:
        mode, reduction = name.split("/")

        def each(key: str, scale: float = 1.0, digits: int = 3, name: str = name) -> str:
            return " / ".join(f"{run[name][key] * scale:.{digits}g}" for run in results)

        def ratio(key: str, name: str = name) -> str:
            return " / ".join(f"{run[name][key] / run['none/flat'][key]:.3g}" for run in results)

        megabytes = each("inter_node_bytes_per_step", 1e-6)
        lines.append(
            f"| {mode} | {reduction} | {megabytes} MB | {ratio('inter_node_bytes_per_step')}"
            f" | {each('step_seconds', 1e3)} | {ratio('step_seconds')} | {each('final_loss', digits=4)}"
            f" | {ratio('final_loss')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- driver


def launch(mode: str, hierarchical: bool, out: Path, model_name: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", mode, str(hierarchical), str(out), model_name]
    environment = {**os.environ, "LIGHTNING_HETERO_EMULATE_NODES": "2", "LIGHTNING_HETERO_EMULATE_LINK": LINK}
    run_job(command, out / "log.txt", environment, FIT_TIMEOUT, f"{mode} (hierarchical={hierarchical})")
    report = json.loads((out / "hetero" / "report.json").read_text())
    return figures(report, json.loads((out / "result.json").read_text())["final_loss"])


def _name(configuration: tuple[str, bool]) -> str:
    mode, hierarchical = configuration
    return f"{mode}/{'hierarchical' if hierarchical else 'flat'}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    parser.add_argument("--out", type=Path, help=f"default {DEFAULT_OUT} (communication_<model>.json for the spirals)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning_hetero_communication"))
    parser.add_argument("--model", choices=("mlp", "spirals", "wide-spirals"), default="mlp")
    parser.add_argument("--fit", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        mode, hierarchical, out, model_name = args.fit
        fit(mode, hierarchical == "True", Path(out), model_name)
        return
    if args.out is None:
        args.out = DEFAULT_OUT if args.model == "mlp" else DEFAULT_OUT.with_name(f"communication_{args.model}.json")
    facts = run_facts("benchmarks/communication.py", argv if argv is not None else sys.argv[1:], HERE)
    modes = ["none"] + [mode for mode in args.modes if mode != "none"]
    configurations = [(mode, hierarchical) for mode in modes for hierarchical in (False, True)]
    results = []
    for run in range(args.runs):
        order = configurations if run % 2 == 0 else list(reversed(configurations))
        measured: dict[str, dict[str, Any]] = {}
        for mode, hierarchical in order:
            name = _name((mode, hierarchical))
            started = time.perf_counter()
            work = args.work / args.model / f"run{run}" / name.replace("/", "_")
            measured[name] = launch(mode, hierarchical, work, args.model)
            got = measured[name]
            print(
                f"run {run + 1}/{args.runs} {name}: {got['inter_node_bytes_per_step'] / 1e6:.3f} MB between nodes per"
                f" step ({got['inter_node_bytes_mean'] / 1e6:.3f} MB mean), {got['step_seconds'] * 1e3:.1f} ms per"
                f" step, final loss {got['final_loss']:.4f}, error bound {got['error_bound']}"
                f" ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        results.append({name: measured[name] for name in map(_name, configurations)})
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "model": args.model,
        "batch_sizes": BATCH_SIZES,
        "steps": STEPS,
        "measured_from": MEASURED_FROM,
        "link": LINK,
    }
    record = {**facts, "setting": setting, "options": OPTIONS, "runs": results, "table": text}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
