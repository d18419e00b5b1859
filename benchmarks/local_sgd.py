"""Local SGD and DiLoCo against every-step exchange on a slow link between two emulated nodes.

    python benchmarks/local_sgd.py                 # 3 runs of 5 fits each (about 15 minutes on 2 cores)
    python benchmarks/local_sgd.py --runs 1 --epochs 4
    python benchmarks/local_sgd.py --sync-every 8 --variants   # DiLoCo with int8, int4, 4 fragments, overlap too

Two ranks at emulated speeds [1.0, 0.4], each its own emulated node, joined by an emulated 1 Gbit/s link with 0.5 ms
latency (``LIGHTNING_HETERO_EMULATE_NODES=2``, ``LIGHTNING_HETERO_EMULATE_LINK=1,0.5``): every collective between
them is charged ``latency + bytes / bandwidth``. The model is the examples' spiral classifier made wide (two untied
1024-wide blocks, 2.1 M parameters, 8.4 MB of fp32 gradients): at 1 Gbit/s one exchange costs about as much as
several steps of compute, the regime local training is for. Adam (lr 1e-3), ZeRO-0, 8192 training samples,
validation on 2048 after every epoch.

Fits, run back to back in each run (their order alternates between runs):

    every_step    today's training: the automatic split of a global batch of 128, gradients exchanged every step
    local_sgd     micro-batches of 64 per inner step, inner steps planned from the profiles, synchronized every H
    diloco        the same with DiLoCo's outer step (SGD, lr 0.7, Nesterov momentum 0.9)

for H in --sync-every (default 8 and 32); with --variants also

    diloco H fp16              the pseudo-gradient in fp16 (the smallest change to the merge: a control)
    diloco H int8 / int4       the pseudo-gradient quantized (compression="int8" / "int4", error feedback)
    diloco H fragments 4       streaming: 4 fragments merged in turn, one every H/4 steps
    diloco H overlap [int8|int4]   each merge sent in the background, its outer step applied one training step later
    diloco H overlap-H [int8]      the same, applied at the next merge (overlap_steps=H)
    diloco H overlap[-H] no-eager [int8]   the same, each rank training on from its own parameters until the average
                                   arrives (eager=False), not from the outer step of its own progress

``--anneal`` lets the inner optimizer's learning rate fall along a cosine over the epochs (torch's CosineAnnealingLR,
stepped each epoch), so each fit ends converged: at a constant rate the final validation loss jumps 2-4x from one
epoch to the next, and a fit's final loss then says more about where it happened to stop than about its merge.
``--no-emulation`` runs the fits without the emulated speeds, nodes and link: with ``--inner-steps`` fixed, a fit's
arithmetic does not depend on them (checked: the same final loss to the last digit), so its losses are those of the
emulated fit in a third of the time; its seconds and bytes between nodes are then not the setting's.

``--first-seed N`` starts the seeds at N.

``--only NAME ...`` runs those fits alone (and every_step, whose final loss is the target). ``--seed-per-run`` seeds
run r's fits with r (their initial weights and sample order; 0 in every run by default), ``--inner-steps A B`` fixes
every local fit's inner steps: with both, the fits of one run differ by their merge alone, and the runs by the seed
(the final losses of one setting are otherwise the same in every run that plans the same inner steps).

Each fit trains the same number of epochs (every sample once per epoch in
every mode). From each fit: the wall-clock time from the start of training to each validation and its loss and
accuracy; the bytes on the wire from the run report. The figures: the time to reach every_step's final validation
loss (the first validation at or below it), its ratio to every_step's time, and the final loss against every_step's.

The JSON (``--out``, default ``benchmarks/results/local_sgd.json``) holds every run: the command, the commit, the
machine and the date, the setting, and every round's figures for each fit (its validation curve included). A run
worth keeping is committed as ``benchmarks/measured/local_sgd_<what>.json`` and rendered by
``python benchmarks/render.py`` (``docs/results/local_sgd.md``).
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

HERE = Path(__file__).resolve().parent
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jobs import checkout_first, run_facts, run_job  # noqa: E402

DEFAULT_OUT = HERE / "results" / "local_sgd.json"
SPEEDS = [1.0, 0.4]
LINK = "1,0.5"  # 1 Gbit/s, 0.5 ms
TRAIN_SAMPLES, VAL_SAMPLES, MICRO_BATCH = 8192, 2048, 64
FIT_TIMEOUT = 900


def fit(
    mode: str,
    sync_every: int,
    epochs: int,
    out: Path,
    options: Optional[dict[str, Any]] = None,
    seed: int = 0,
    anneal: bool = False,
    emulate: bool = True,
) -> None:
    """One Trainer.fit on every rank; rank 0 writes ``out/curve.json`` (time, loss, accuracy per validation).
    ``anneal``: a cosine learning rate over the ``epochs``; ``emulate``: the setting's speeds, nodes and link."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch import nn

    from examples.spirals import SpiralClassifier, SpiralDataModule
    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)  # one core's worth per rank, as one device
    if emulate:
        os.environ["LIGHTNING_HETERO_EMULATE_NODES"] = "2"
        os.environ["LIGHTNING_HETERO_EMULATE_LINK"] = LINK

    class WideSpirals(SpiralClassifier):
        """The examples' classifier with two untied 1024-wide blocks: many parameters for its compute."""

        def __init__(self) -> None:
            super().__init__(hidden=1024, depth=2, lr=1e-3)
            self.blocks = nn.ModuleList([nn.Linear(1024, 1024) for _ in range(2)])
            del self.block

        def forward(self, points: torch.Tensor) -> torch.Tensor:
            hidden = torch.relu(self.embed(points))
            for block in self.blocks:
                hidden = hidden + torch.tanh(block(hidden))
            return self.head(hidden)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            if not anneal:
                return optimizer
            # (stepped once an epoch: the same rate on every rank also where the ranks' step counts differ)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
            return {"optimizer": optimizer, "lr_scheduler": schedule}

    class Curve(Callback):
        def __init__(self) -> None:
            self.points: list[dict[str, float]] = []
            self.started = 0.0

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.started = time.perf_counter()

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            metrics = trainer.callback_metrics
            self.points.append(
                {
                    "seconds": time.perf_counter() - self.started,
                    "epoch": trainer.current_epoch,
                    "val_loss": float(metrics["val_loss"]),
                    "val_acc": float(metrics["val_acc"]),
                }
            )

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.is_global_zero:
                (out / "curve.json").write_text(json.dumps(self.points))

    seed_everything(seed)  # (the model's initial weights and the sample order; the data set is the same)
    if mode == "every_step":
        strategy = HeteroStrategy(stage=0, emulate_speeds=SPEEDS if emulate else None)
        batch = 2 * MICRO_BATCH  # the loader's batch per rank: a global batch of 128, split by the planner
    else:
        options = dict(options or {})
        speeds = options.pop("emulate_speeds", SPEEDS)  # (a drift: {step: speeds}, the steps as JSON's strings)
        speeds = {int(step): value for step, value in speeds.items()} if isinstance(speeds, dict) else speeds
        speeds = speeds if emulate else None
        strategy = HeteroStrategy(sync=mode, sync_every=sync_every, emulate_speeds=speeds, **options)
        batch = MICRO_BATCH
    data = SpiralDataModule(
        batch_size=batch // 2 if mode == "every_step" else batch, train_samples=TRAIN_SAMPLES, val_samples=VAL_SAMPLES
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        callbacks=[Curve()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    trainer.fit(WideSpirals(), data)
    # Asynchronous merges: each rank's merges (its micro-batches, its time in each).
    claims = getattr(strategy.job.mode, "claims", None)
    if claims is not None:
        (out / f"merges_rank{trainer.global_rank}.json").write_text(json.dumps(claims.merges.records))


# ---------------------------------------------------------------------------------------------- analysis (pure)


def time_to_reach(curve: list[dict[str, float]], target: float) -> Optional[float]:
    """Seconds from the start of training to the first validation at or below ``target`` (None: never)."""
    for point in curve:
        if point["val_loss"] <= target:
            return point["seconds"]
    return None


def wire_megabytes(report: dict[str, Any]) -> float:
    """Bytes every rank put on the wire between nodes during the fit, in MB."""
    return sum(sum(step.get("inter_node_bytes", ())) for step in report["steps"]) / 1e6


def peak_megabytes(report: dict[str, Any]) -> float:
    """The most bytes the ranks put on the wire between nodes in one training step, in MB."""
    return max(sum(step.get("inter_node_bytes", ())) for step in report["steps"]) / 1e6


def peak_inside_epochs_megabytes(report: dict[str, Any], epochs: int) -> float:
    """The same, leaving out each epoch's last step (where every fragment merges, so that validation sees one model):
    the peak of the merges inside an epoch, what streaming divides."""
    steps = report["steps"]
    per_epoch = len(steps) // epochs
    inside = [step for index, step in enumerate(steps) if (index + 1) % per_epoch]
    return max(sum(step.get("inter_node_bytes", ())) for step in inside) / 1e6


def link_wait_share(report: dict[str, Any]) -> Optional[float]:
    """The most any rank waited on the link in merges (once every rank reached the merge), over its compute."""
    shares = report["summary"].get("link_wait_over_compute")
    return max(share for share in shares if share is not None) if shares else None


def analyse_run(fits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    baseline = fits["every_step"]
    target = baseline["curve"][-1]["val_loss"]
    base_time = time_to_reach(baseline["curve"], target)
    figures: dict[str, Any] = {"target_val_loss": target}
    for name, result in fits.items():
        curve, reached = result["curve"], time_to_reach(result["curve"], target)
        figures[name] = {
            "seconds_to_target": reached,
            "speedup_to_target": base_time / reached if reached and base_time else None,
            "final_val_loss": curve[-1]["val_loss"],
            "final_val_acc": curve[-1]["val_acc"],
            "final_loss_over_every_step": curve[-1]["val_loss"] / target,
            "train_seconds": curve[-1]["seconds"],
            "wire_mb": wire_megabytes(result["report"]),
            "peak_step_mb": peak_megabytes(result["report"]),
            "peak_inside_epoch_mb": peak_inside_epochs_megabytes(result["report"], len(curve)),
            "inner_steps": result["report"]["steps"][-1].get("micro_steps"),
            "link_wait_over_compute": link_wait_share(result["report"]),
            "curve": curve,
        }
    return figures


# ---------------------------------------------------------------------------------------------- driver


def launch(
    name: str,
    mode: str,
    sync_every: int,
    epochs: int,
    out: Path,
    options: Optional[dict[str, Any]] = None,
    seed: int = 0,
    anneal: bool = False,
    emulate: bool = True,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--fit", mode, str(sync_every), str(epochs), str(out)]
    command += ["--fit-options", json.dumps(options or {}), "--fit-seed", str(seed)]
    command += ["--anneal"] * anneal + ["--no-emulation"] * (not emulate)
    # (this checkout first for the fit and the ranks Lightning starts from it, whatever the editable install)
    environment = checkout_first(HERE.parent)
    run_job(command, out / "log.txt", environment, FIT_TIMEOUT, name)
    return {
        "curve": json.loads((out / "curve.json").read_text()),
        "report": json.loads((out / "hetero" / "report.json").read_text()),
    }


def run_all(
    runs: int,
    epochs: int,
    sync_every: list[int],
    work: Path,
    variants: bool = False,
    only: Optional[list[str]] = None,
    seed_per_run: bool = False,
    inner_steps: Optional[list[int]] = None,
    anneal: bool = False,
    emulate: bool = True,
    first_seed: int = 0,
) -> list[dict[str, Any]]:
    fits: list[tuple[str, str, int, dict[str, Any]]] = [("every_step", "every_step", 1, {})]
    fits += [(f"{mode} H={h}", mode, h, {}) for mode in ("local_sgd", "diloco") for h in sync_every]
    if variants:
        fits += [
            (f"diloco H={h} {c}", "diloco", h, {"compression": c}) for h in sync_every for c in ("fp16", "int8", "int4")
        ]
        fits += [(f"diloco H={h} fragments 4", "diloco", h, {"sync_options": {"fragments": 4}}) for h in sync_every]
        fits += [
            (
                f"diloco H={h} overlap{' ' + c if c else ''}",
                "diloco",
                h,
                {"sync_options": {"overlap": True}, "compression": c},
            )
            for h in sync_every
            for c in (None, "int8", "int4")
        ]
        fits += [
            (
                f"diloco H={h} overlap-H{' ' + c if c else ''}",
                "diloco",
                h,
                {"sync_options": {"overlap": True, "overlap_steps": h}, "compression": c},
            )
            for h in sync_every
            for c in (None, "int8")
        ]
        fits += [
            (
                f"diloco H={h} overlap{'-H' if steps else ''} no-eager{' ' + c if c else ''}",
                "diloco",
                h,
                {
                    "sync_options": {"overlap": True, "eager": False, **({"overlap_steps": h} if steps else {})},
                    "compression": c,
                },
            )
            for h in sync_every
            for steps in (False, True)
            for c in (None, "int8")
        ]
    if only:
        fits = [fit for fit in fits if fit[0] == "every_step" or fit[0] in only]
    if inner_steps:  # (the same inner steps in every local fit: their losses differ by the merge alone)
        fits = [
            (name, mode, h, {**options, "inner_steps": inner_steps} if mode != "every_step" else options)
            for name, mode, h, options in fits
        ]
    results = []
    for run in range(runs):
        order = fits if run % 2 == 0 else list(reversed(fits))
        started = time.perf_counter()
        seed, folder = first_seed + run if seed_per_run else 0, work / f"run{run}"
        outcome = {
            name: launch(
                name, mode, h, epochs, folder / name.replace(" ", "_").replace("=", ""), options, seed, anneal, emulate
            )
            for name, mode, h, options in order
        }
        figures = analyse_run(outcome)
        results.append(figures)
        print(f"run {run + 1}/{runs} ({time.perf_counter() - started:.0f} s): target {figures['target_val_loss']:.4f}")
        for name, *_ in fits:
            print(f"  {describe(name, figures[name])}")
    return results


def describe(name: str, fit_figures: dict[str, Any]) -> str:
    reached = fit_figures["seconds_to_target"]
    speedup = fit_figures["speedup_to_target"]
    return (
        f"{name}: {'not reached' if reached is None else f'{reached:.1f} s'} to the target"
        f"{'' if speedup is None else f' ({speedup:.2f}x)'}, final val loss {fit_figures['final_val_loss']:.4f}"
        f" ({fit_figures['final_loss_over_every_step']:.3f} of every_step's),"
        f" accuracy {fit_figures['final_val_acc']:.3f},"
        f" {fit_figures['train_seconds']:.1f} s, {fit_figures['wire_mb']:.0f} MB between nodes"
        f" (at most {fit_figures['peak_step_mb']:.2f} MB in a step, {fit_figures['peak_inside_epoch_mb']:.2f} inside"
        " an epoch),"
        f" inner steps {fit_figures['inner_steps']}"
        + (
            f", waiting on the link {fit_figures['link_wait_over_compute']:.1%} of compute"
            if fit_figures.get("link_wait_over_compute") is not None
            else ""
        )
    )


def table(results: list[dict[str, Any]]) -> str:
    names = [name for name in results[0] if name != "target_val_loss"]

    def values(name: str, key: str, form: str) -> str:
        found = [run[name][key] for run in results]
        shown = ", ".join("-" if v is None else form % v for v in found)
        numbers = [v for v in found if v is not None]
        return shown + (f" (median {form % statistics.median(numbers)})" if len(numbers) == len(found) else "")

    lines = [
        "| fit | speedup to every_step's final loss | seconds to it | final val loss / every_step's | final accuracy"
        " | MB between nodes | peak MB in a step | peak MB in a step inside an epoch | waiting on the link / compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        lines.append(
            f"| {name} | {values(name, 'speedup_to_target', '%.2f')} | {values(name, 'seconds_to_target', '%.1f')}"
            f" | {values(name, 'final_loss_over_every_step', '%.3f')} | {values(name, 'final_val_acc', '%.3f')}"
            f" | {values(name, 'wire_mb', '%.0f')} | {values(name, 'peak_step_mb', '%.2f')}"
            f" | {values(name, 'peak_inside_epoch_mb', '%.2f')}"
            f" | {values(name, 'link_wait_over_compute', '%.3f')} |"
        )
    return "\n".join(lines + against_diloco(results))


def against_diloco(results: list[dict[str, Any]]) -> list[str]:
    """Each DiLoCo variant's final loss over plain DiLoCo's (the same H) run by run: with ``--seed-per-run`` and
    ``--inner-steps`` the two differ by their merge alone."""
    lines = []
    for name in results[0]:
        reference = " ".join(name.split()[:2])
        if name.startswith("diloco ") and name != reference and reference in results[0]:
            ratios = [run[name]["final_val_loss"] / run[reference]["final_val_loss"] for run in results]
            shown = ", ".join(f"{ratio:.3f}" for ratio in ratios)
            lines.append(
                f"{name}: final val loss / {reference}'s, run by run: {shown} (median {statistics.median(ratios):.3f})"
            )
    return [""] + lines if lines else []


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--sync-every", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--variants", action="store_true", help="DiLoCo with int8, int4, 4 fragments, overlap too")
    parser.add_argument("--only", nargs="+", help="run these fits alone (with every_step, the target)")
    parser.add_argument("--seed-per-run", action="store_true", help="run r seeds its fits with r (default: 0 in all)")
    parser.add_argument("--inner-steps", type=int, nargs="+", help="every local fit's inner steps (default: planned)")
    parser.add_argument("--first-seed", type=int, default=0, help="with --seed-per-run: run r seeds with this + r")
    parser.add_argument("--anneal", action="store_true", help="a cosine learning rate over the epochs")
    parser.add_argument("--no-emulation", action="store_true", help="no emulated speeds, nodes or link (losses only)")
    parser.add_argument("--fit", nargs=4, metavar=("MODE", "H", "EPOCHS", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--fit-options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--fit-seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        mode, sync_every, epochs, out = args.fit
        fit(
            mode,
            int(sync_every),
            int(epochs),
            Path(out),
            json.loads(args.fit_options),
            args.fit_seed,
            args.anneal,
            not args.no_emulation,
        )
        return
    facts = run_facts("benchmarks/local_sgd.py", argv if argv is not None else sys.argv[1:], HERE)
    work = args.out.parent / "local_sgd_runs"
    results = run_all(
        args.runs,
        args.epochs,
        args.sync_every,
        work,
        args.variants,
        args.only,
        args.seed_per_run,
        args.inner_steps,
        args.anneal,
        not args.no_emulation,
        args.first_seed,
    )
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setting = {
        "rounds": args.runs,
        "epochs": args.epochs,
        "sync_every": args.sync_every,
        "variants": args.variants,
        "only": args.only,
        "fits": [name for name in results[0] if name != "target_val_loss"],
        "anneal": args.anneal,
        "emulated": not args.no_emulation,
        "inner_steps": args.inner_steps,
        "seed_per_run": args.seed_per_run,
        "first_seed": args.first_seed,
        "seeds": [args.first_seed + run if args.seed_per_run else 0 for run in range(args.runs)],
        "speeds": SPEEDS if not args.no_emulation else None,
        "link": LINK if not args.no_emulation else None,
        "train_samples": TRAIN_SAMPLES,
        "val_samples": VAL_SAMPLES,
        "micro_batch": MICRO_BATCH,
    }
    record = {**facts, "setting": setting, "runs": results, "table": text}
    args.out.write_text(json.dumps(record, indent=1))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
