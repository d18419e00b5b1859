"""Pipeline parallelism against one process: the same global batches, the same update (train/pipeline.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_bounded
from lightning.pytorch import seed_everything

sys.path.insert(0, str(REPO / "tests" / "workers"))

from pipeline_fit import ChainModel, dataset  # noqa: E402

WORKER = REPO / "tests" / "workers" / "pipeline_fit.py"


def one_process(optimizer: str, steps: int, global_batch: int, container: str = "sequential") -> dict[str, torch.Tensor]:
    """The reference: one process, the whole model, the same global batches in the loader's order."""
    seed_everything(1, verbose=False)
    model = ChainModel(optimizer, container)
    (opt,) = [model.configure_optimizers()]
    x, y = dataset().tensors
    for step in range(steps):
        start = (step * global_batch) % len(x)
        loss = torch.nn.functional.mse_loss(model(x[start : start + global_batch]), y[start : start + global_batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def run_pipeline(tmp_path: Path, *arguments: str) -> list[dict[str, torch.Tensor]]:
    out = tmp_path / "out"
    code, output = run_bounded([sys.executable, str(WORKER), "--out", str(out), *arguments], timeout=240, cwd=REPO)
    assert code == 0, output[-4000:]
    return [torch.load(path) for path in sorted(out.glob("rank*.pt"))]


def largest_difference(reference: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]]) -> float:
    """Every parameter of every rank against the reference's of the same name; every name held by some rank."""
    held = set()
    largest = 0.0
    for state in ranks:
        for name, tensor in state.items():
            largest = max(largest, (tensor - reference[name]).abs().max().item())
            held.add(name)
    assert held == set(reference), f"names no rank holds: {set(reference) - held}"
    return largest


CASES = [
    # (devices, stages, boundaries, schedule, optimizer, speeds, micro-batches)
    pytest.param(2, 2, "2", "1f1b", "sgd", None, None, id="2-stages-uneven-1f1b-sgd"),
    pytest.param(2, 2, "4", "gpipe", "adam", None, None, id="2-stages-uneven-gpipe-adam"),
    pytest.param(3, 3, "1,4", "1f1b", "adam", None, 5, id="3-stages-1f1b-adam-5-micro"),
    pytest.param(4, 2, "3", "1f1b", "sgd", "1.0,1.0,0.5,0.5", None, id="2-pipelines-unequal-speed-sgd"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("devices", "stages", "boundaries", "schedule", "optimizer", "speeds", "micro"), CASES)
def test_a_pipeline_updates_as_one_process(tmp_path, devices, stages, boundaries, schedule, optimizer, speeds, micro):
    steps, batch = 4, 12
    arguments = ["--devices", str(devices), "--stages", str(stages), "--boundaries", boundaries, "--schedule",
                 schedule, "--optimizer", optimizer, "--steps", str(steps), "--batch", str(batch)]  # fmt: skip
    if speeds:
        arguments += ["--speeds", speeds]
    if micro:
        arguments += ["--micro-batches", str(micro)]
    ranks = run_pipeline(tmp_path, *arguments)
    assert len(ranks) == devices
    pipelines = devices // stages
    reference = one_process(optimizer, steps, batch * pipelines)
    assert largest_difference(reference, ranks) <= 1e-5
    # Each rank holds only its stage's blocks, under the model's own names.
    blocks_held = [sorted({n.split(".")[1] for n in state if n.startswith("net.")}) for state in ranks]
    assert all(0 < len(held) < 6 for held in blocks_held)
