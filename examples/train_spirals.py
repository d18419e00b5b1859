"""The main job: train the spiral classifier on CPU with 2 ranks, one of them emulated 2.5x slower.

    python examples/train_spirals.py                          # automatic split, rank 1 emulated at speed 0.4
    python examples/train_spirals.py --no-baseline            # only the automatic split (half the time)
    python examples/train_spirals.py --emulate-speeds 1 1     # identical ranks: the automatic split stays equal
    python examples/train_spirals.py --weights 1 0.4          # a split from given weights instead of profiling
    python examples/train_spirals.py --device-precision bf16-mixed 32-true   # real difference, no emulation

Rank 0 prints the plan table (rank, device, micro-batch, share, measured samples/s, predicted compute per step and
the predicted speedup over an equal split). Then, unless ``--no-baseline``, the same training runs again with the
equal split that DDP would use, on the same (emulated) hardware, so that the measured speedup is printed beside the
validation loss and accuracy of both runs and before training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a clone

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy  # noqa: E402

# The profiling cost is quoted against a run of this many steps (the target: under 3 % of it).
REFERENCE_STEPS = 500


class StepTimer(Callback):
    """Wall time between consecutive training batches (the ranks move in lockstep, so rank 0's is the job's)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._last = None  # validation runs between epochs: not a training step

    def median_step(self) -> float:
        return statistics.median(self.times[5:] or self.times)  # the first steps warm up

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        # Progress, one line per epoch from rank 0 (the progress bar is off: its redraws fill a log).
        if trainer.sanity_checking or trainer.state.fn != "fit" or not trainer.is_global_zero or not self.times:
            return
        metrics = trainer.callback_metrics
        print(
            f"  epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: val loss {float(metrics['val_loss']):.3f},"
            f" val acc {float(metrics['val_acc']):.1%}, median step {self.median_step() * 1e3:.1f} ms",
            flush=True,
        )


def train(args: argparse.Namespace, strategy: HeteroStrategy, root: str) -> dict:
    """One run from the same initial model and data order: validate, fit, validate."""
    seed_everything(0, verbose=False)
    data = SpiralDataModule(batch_size=args.batch_size)
    model = SpiralClassifier()
    timer = StepTimer()
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        default_root_dir=root,
        callbacks=[timer],
        logger=CSVLogger(root),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, datamodule=data, verbose=False)[0]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]
    step = timer.median_step()
    # The slowest rank's compute per step, as every rank measured it during training (the run report): what the split
    # balances, apart from the gradient exchange and optimizer time that any split pays alike.
    compute = None
    report_file = Path(trainer.log_dir) / "hetero" / "report.json"
    if trainer.is_global_zero and report_file.exists():
        steps = json.loads(report_file.read_text())["steps"]
        compute = statistics.median(max(record["compute_seconds"]) for record in steps)
    return {
        "is_global_zero": trainer.is_global_zero,
        "split": "/".join(map(str, strategy.plan.batch_sizes)),
        "samples_per_second": strategy.plan.global_batch_size / step,
        "step": step,
        "compute": compute,
        "before": before,
        "after": after,
        "profiling": max(p.wall_seconds for p in strategy.profiles) if strategy.profiles else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default: the lowest that fits, chosen at setup)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="loader batch size; global batch = this x devices")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--weights", type=float, nargs="+", default=None, help="relative speed per rank")
    split.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="micro-batch per rank")
    parser.add_argument(
        "--emulate-speeds",
        type=float,
        nargs="+",
        default=None,
        help="speed in (0, 1] per rank (default: 1.0 0.4 with 2 devices, none otherwise)",
    )
    parser.add_argument(
        "--device-precision",
        nargs="+",
        default=None,
        help="'auto' or one of bf16-mixed, 16-mixed, 32-true per rank: each rank trains in its own precision, a real"
        " difference in speed on a CPU with AVX512-BF16 or AMX (no speed emulation unless --emulate-speeds is given)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the second run with the equal split")
    parser.add_argument("--root", default="runs/spirals", help="log directory (plan and per-rank configs go here)")
    args = parser.parse_args()
    device_precision = args.device_precision
    if device_precision == ["auto"]:
        device_precision = "auto"
    if args.emulate_speeds is None and args.devices == 2 and device_precision is None:
        args.emulate_speeds = [1.0, 0.4]
    same_hardware = {"stage": args.stage, "emulate_speeds": args.emulate_speeds, "device_precision": device_precision}

    strategy = HeteroStrategy(weights=args.weights, batch_sizes=args.batch_sizes, **same_hardware)
    runs = {"hetero": train(args, strategy, args.root)}
    if not args.no_baseline:
        # What DDP (or Lightning's DeepSpeedStrategy) does: every rank the loader's batch size.
        equal = [args.batch_size] * args.devices
        strategy = HeteroStrategy(batch_sizes=equal, **same_hardware)
        runs["equal (DDP)"] = train(args, strategy, str(Path(args.root) / "equal-split"))

    first = runs["hetero"]
    if not first["is_global_zero"]:
        return
    print(f"\n{'run':12s}  micro-batches  samples/s  median step  slowest compute  val loss  val acc")
    before, after = first["before"], first["after"]
    print(f"{'before':12s}  {'':54s}  {before['val_loss']:8.3f}  {before['val_acc']:7.1%}")
    for name, run in runs.items():
        compute = f"{run['compute'] * 1e3:12.1f} ms" if run["compute"] is not None else f"{'':15s}"
        print(
            f"{name:12s}  {run['split']:13s}  {run['samples_per_second']:9.0f}  {run['step'] * 1e3:8.1f} ms"
            f"  {compute}  {run['after']['val_loss']:8.3f}  {run['after']['val_acc']:7.1%}"
        )
    print(f"validation loss     {before['val_loss']:.3f} -> {after['val_loss']:.3f}")
    print(f"validation accuracy {before['val_acc']:.1%} -> {after['val_acc']:.1%}")
    if "equal (DDP)" in runs:
        speedup = first["samples_per_second"] / runs["equal (DDP)"]["samples_per_second"]
        print(f"measured speedup over the equal split: {speedup:.2f}x", end="")
        if first["compute"] and runs["equal (DDP)"]["compute"]:
            balance = runs["equal (DDP)"]["compute"] / first["compute"]
            print(f" (the slowest rank's compute per step: {balance:.2f}x less)", end="")
        print()
    if first["profiling"] is not None:
        share = first["profiling"] / (REFERENCE_STEPS * first["step"])
        print(
            f"profiling cost: {first['profiling']:.2f} s once per fit = {share:.1%} of a {REFERENCE_STEPS}-step run"
            f" at the measured {first['step'] * 1e3:.1f} ms per step"
        )


if __name__ == "__main__":
    main()
