"""Three fits in one process, as a notebook runs them (tests/train/test_fit_again.py): after each, with the trainer,
the model and the loaders dropped, what the process holds. Prints one JSON line per fit."""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import weakref
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning.pytorch import Trainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy  # noqa: E402

# Lightning's launcher leaves a thread that watches the ranks it started for 5 s; torch's worker queues a feeder
# thread that ends with them. Both end on their own: wait for them before counting.
TRANSIENT_THREADS = ("child-process-observer", "QueueFeederThread")


def settled_threads(deadline: float = 15.0) -> list[str]:
    stop = time.monotonic() + deadline
    while True:
        names = sorted(t.name for t in threading.enumerate())
        if not any(name in TRANSIENT_THREADS for name in names) or time.monotonic() > stop:
            return names
        time.sleep(0.2)


def main() -> None:
    root = Path(sys.argv[1])
    data = SpiralDataModule(batch_size=64, train_samples=1024, val_samples=256)
    data.setup("fit")
    process = psutil.Process()
    for fit in range(3):
        train = DataLoader(data.train_set, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)
        val = DataLoader(data.val_set, batch_size=64, num_workers=1, persistent_workers=True)
        model = SpiralClassifier()
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=HeteroStrategy(),
            max_epochs=1,
            default_root_dir=root,
            enable_progress_bar=False,
        )
        trainer.fit(model, train, val)
        trainer_ref = weakref.ref(trainer)
        del trainer, model, train, val
        gc.collect()
        print(
            json.dumps(
                {
                    "fit": fit,
                    "trainer_freed": trainer_ref() is None,
                    "threads": settled_threads(),
                    "children": [child.pid for child in process.children(recursive=True)],
                    "open_files": process.num_fds(),
                    "rss_mib": process.memory_info().rss / 2**20,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
