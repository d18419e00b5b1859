"""The main job: train the spiral classifier on CPU with 2 ranks of unequal micro-batches.

    python examples/train_spirals.py                      # 2 ranks, weights 1.0 : 0.4
    python examples/train_spirals.py --batch-sizes 40 88  # explicit micro-batches

Rank 0 prints the plan table (rank, device, micro-batch, share), then the validation loss and accuracy before
and after training.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a clone

from lightning.pytorch import Trainer, seed_everything  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage 0-3")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64, help="loader batch size; global batch = this x devices")
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--weights", type=float, nargs="+", default=None, help="relative speed per rank")
    split.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="micro-batch per rank")
    parser.add_argument("--root", default="runs/spirals", help="log directory (plan and per-rank configs go here)")
    args = parser.parse_args()
    if args.weights is None and args.batch_sizes is None:
        args.weights = [1.0, 0.4] if args.devices == 2 else None

    seed_everything(0)
    data = SpiralDataModule(batch_size=args.batch_size)
    model = SpiralClassifier()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=HeteroStrategy(stage=args.stage, weights=args.weights, batch_sizes=args.batch_sizes),
        max_epochs=args.epochs,
        default_root_dir=args.root,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = trainer.validate(model, datamodule=data, verbose=False)[0]
    trainer.fit(model, datamodule=data)
    after = trainer.validate(model, datamodule=data, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"validation loss     {before['val_loss']:.3f} -> {after['val_loss']:.3f}")
        print(f"validation accuracy {before['val_acc']:.1%} -> {after['val_acc']:.1%}")


if __name__ == "__main__":
    main()
