"""The main job: train the spiral classifier on CPU with 2 ranks, one of them emulated 2.5x slower.

    python examples/train_spirals.py                          # automatic split, rank 1 emulated at speed 0.4
    python examples/train_spirals.py --batch-sizes 64 64      # the equal split DDP would use, for comparison
    python examples/train_spirals.py --emulate-speeds 1 1     # identical ranks: the automatic split stays equal

Rank 0 prints the plan table (rank, device, micro-batch, share, measured samples/s, predicted step time and the
predicted speedup over an equal split), the measured training throughput, and the validation loss and accuracy
before and after training.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a clone

from lightning.pytorch import Callback, Trainer, seed_everything  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage 0-3")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128, help="loader batch size; global batch = this x devices")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--weights", type=float, nargs="+", default=None, help="relative speed per rank")
    split.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="micro-batch per rank")
    parser.add_argument(
        "--emulate-speeds", type=float, nargs="+", default=None,
        help="speed in (0, 1] per rank (default: 1.0 0.4 with 2 devices, none otherwise)",
    )  # fmt: skip
    parser.add_argument("--root", default="runs/spirals", help="log directory (plan and per-rank configs go here)")
    args = parser.parse_args()
    if args.emulate_speeds is None and args.devices == 2:
        args.emulate_speeds = [1.0, 0.4]

    seed_everything(0)
    data = SpiralDataModule(batch_size=args.batch_size)
    model = SpiralClassifier()
    timer = StepTimer()
    strategy = HeteroStrategy(
        stage=args.stage, weights=args.weights, batch_sizes=args.batch_sizes, emulate_speeds=args.emulate_speeds
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        default_root_dir=args.root,
        callbacks=[timer],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, datamodule=data, verbose=False)[0]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]
    if trainer.is_global_zero:
        step = statistics.median(timer.times[5:] or timer.times)
        global_batch = strategy.plan.global_batch_size
        print(f"training            {global_batch / step:.0f} samples/s (median step {step * 1e3:.1f} ms)")
        print(f"validation loss     {before['val_loss']:.3f} -> {after['val_loss']:.3f}")
        print(f"validation accuracy {before['val_acc']:.1%} -> {after['val_acc']:.1%}")


if __name__ == "__main__":
    main()
