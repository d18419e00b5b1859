"""One process: a ZeRO-2 fit saves a checkpoint directory; `weights_only=True` then resumes it and loads it with
`load_from_checkpoint` (only DeepSpeed's own classes inside), and both refuse it once a file that runs code on
unpickling lies among its files. Writes what happened to `result.json` in the folder given (tests/runtime/
test_safe_load.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from conftest import crafted  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

from examples.spirals import SpiralClassifier, SpiralDataModule  # noqa: E402
from lightning_hetero import HeteroStrategy  # noqa: E402


def fit(root: Path, steps: int, ckpt_path=None, weights_only=None) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=HeteroStrategy(stage=2),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    data = SpiralDataModule(batch_size=16, train_samples=128, val_samples=16)
    trainer.fit(SpiralClassifier(hidden=16, depth=1), data, ckpt_path=ckpt_path, weights_only=weights_only)
    return trainer


def outcome(action) -> str:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"
    return "ok"


def main() -> None:
    out = Path(sys.argv[1])
    saved = out / "saved.ckpt"
    fit(out / "first", 2).save_checkpoint(saved)
    result = {
        "resume": outcome(lambda: fit(out / "resume", 3, saved, weights_only=True)),
        "load": outcome(lambda: SpiralClassifier.load_from_checkpoint(saved, weights_only=True)),
    }
    marker = out / "ran"
    crafted(saved / "checkpoint" / "extra_states.pt", marker)
    result["crafted_resume"] = outcome(lambda: fit(out / "crafted", 3, saved, weights_only=True))
    result["crafted_load"] = outcome(lambda: SpiralClassifier.load_from_checkpoint(saved, weights_only=True))
    result["ran"] = marker.exists()
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
