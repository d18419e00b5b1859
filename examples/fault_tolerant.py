"""A fault-tolerant job: the spiral classifier with checkpoints every N steps and `fit(ckpt_path="last")`.

The same command starts the job and continues it after any interruption, from the last complete checkpoint:

    torchrun --nproc-per-node=2 --max-restarts=3 examples/fault_tolerant.py          # torchrun restarts lost workers
    torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d \
             --rdzv-endpoint=$HEAD_NODE:29500 --rdzv-id=job1 examples/fault_tolerant.py  # elastic, 1 to 4 nodes
    python examples/fault_tolerant.py                                                # Lightning's launcher, 2 ranks

Kill a worker with SIGKILL while it trains (`kill -9 <pid>`): under torchrun the job restarts and finishes; with
Lightning's launcher every rank exits (code 75 names the lost rank, or the launcher's kill) and running the command
again continues. SIGTERM (preemption) saves `last.ckpt` at the next step and exits 143. On a different number of
devices (`--nproc-per-node=1`), or when an elastic job loses or gains a node, the checkpoint is converted to
DeepSpeed's universal format and the global batch kept. The devices and nodes come from the launcher
(`launched_layout`): an elastic job's number of nodes changes between restarts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere in a clone

from lightning.pytorch import Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy, launched_layout  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="ranks when not launched by torchrun")
    parser.add_argument("--train-samples", type=int, default=6000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--root", default="runs/fault_tolerant")
    parser.add_argument("--stage", type=int, help="ZeRO stage (default: HeteroStrategy's)")
    parser.add_argument(
        "--no-rebalance",
        action="store_true",
        help="keep the first plan's split: a resumed run then makes the updates of an uninterrupted"
        " one to the last bit (a re-plan driven by measured times changes the sum order)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        help="each rank's micro-batch, summing to 256 (a fixed split: no profile, no re-plan, so a resumed run makes"
        " the updates of an uninterrupted one to the last bit)",
    )
    args = parser.parse_args()

    seed_everything(0, verbose=False)  # the same data order on every attempt: a resume continues it exactly
    devices, num_nodes = launched_layout(args.devices)  # torchrun's (elastic: they change), else Lightning's launcher
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        # A global batch that does not depend on the number of ranks: a resume on other devices keeps it.
        strategy=HeteroStrategy(
            global_batch_size=256,
            batch_sizes=args.batch_sizes,
            stage=args.stage,
            rebalance=False if args.no_rebalance else None,
        ),
        max_epochs=args.epochs,
        default_root_dir=args.root,
        callbacks=[
            ModelCheckpoint(dirpath=Path(args.root) / "checkpoints", save_last=True, every_n_train_steps=args.every)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = SpiralDataModule(batch_size=128, train_samples=args.train_samples)
    trainer.fit(SpiralClassifier(), datamodule=data, ckpt_path="last")
    if trainer.is_global_zero:
        print(f"finished at step {trainer.global_step}: val acc {float(trainer.callback_metrics['val_acc']):.1%}")


if __name__ == "__main__":
    main()
