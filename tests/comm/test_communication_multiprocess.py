"""Compression and hierarchical reduction end to end: CPU ranks (gloo), each run bounded by a timeout.

What the user relies on: whatever travels compressed, every rank holds the same parameters after every step; half
precision on the wire stays close to uncompressed training; PowerSGD and top-k (error feedback) still train the model;
a checkpoint keeps the compression state, so a resumed run continues as the uninterrupted one; reducing inside the
nodes first gives the flat result with half the bytes between 2 nodes of 2 ranks, counted per rank in the run report,
the monitor's metrics and rank_<r>.json.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import WORKERS, run_fit

sys.path.insert(0, str(WORKERS))

from common import IndexedRegression, full_data_loss  # noqa: E402

from lightning_hetero.recover.checkpoint import MANIFEST_NAME  # noqa: E402

pytestmark = pytest.mark.multiprocess

SAMPLES = 64
# Unequal micro-batches and accumulation: the loss weights apply before the exchange, compressed or not.
COMMON = ["--samples", str(SAMPLES), "--batch-sizes", "10", "6", "--accumulate", "2", "--record-every-step"]
# Half precision on the wire: each reduced gradient is rounded to fp16 (11 bits) or bf16 (8 bits) once per step.
HALF_TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2}
TWO_NODES = {"LIGHTNING_HETERO_EMULATE_NODES": "2"}


def per_step(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "per_step.jsonl").read_text().splitlines()]


def params(record: dict) -> torch.Tensor:
    return torch.tensor(record["params"])


def fit(out: Path, stage: int, strategy: dict, *extra: str, env=None):
    run = run_fit(out, "--stage", str(stage), *COMMON, "--strategy-args", json.dumps(strategy), *extra, env=env)
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    out = tmp_path_factory.mktemp("uncompressed")
    fit(out, 0, {}, "--max-epochs", "4")
    return per_step(out)


@pytest.mark.parametrize(("compression", "stage"), [("fp16", 2), ("bf16", 0)])
def test_half_precision_on_the_wire_stays_close_to_uncompressed(compression, stage, uncompressed, tmp_path):
    """DeepSpeed's communication_data_type, at ZeRO-2 (inside its optimizer) and ZeRO-0 (its post-step exchange)."""
    run = fit(tmp_path, stage, {"compression": compression}, "--max-epochs", "4")
    records = per_step(tmp_path)
    assert len(records) == len(uncompressed)
    assert max(record["spread"] for record in records) == 0.0  # every rank, every step
    difference = max((params(a) - params(b)).abs().max().item() for a, b in zip(records, uncompressed))
    assert 0 < difference < HALF_TOLERANCE[compression], difference  # rounded (not skipped), and only rounded
    config = json.loads((tmp_path / "hetero" / "rank_1.json").read_text())["deepspeed_config"]
    assert config["communication_data_type"] == compression
    assert compression in run.output  # the plan's communication line


# The error bound (on by default) checks every other step here, so that it raises within these 8 steps: every rank
# must raise alike, and a resume must continue at the raised setting. A wider model than the default's (whose 8x4
# matrix PowerSGD sends whole from rank 2 on, more than the budget less the checks, which sample every entry here).
WIDER = ["--depth", "2", "--hidden", "32"]
HOOKS = [
    ("powersgd", {"start_powerSGD_iter": 2, "error_check_every": 2, "max_bytes_fraction": 1.0}),
    ("topk", {"ratio": 0.1, "error_check_every": 2, "max_bytes_fraction": 1.0}),
]


def error_bound(out: Path) -> dict:
    return json.loads(next(out.rglob("report.json")).read_text())["communication"]["error_bound"]


@pytest.fixture(scope="module")
def uncompressed_wider(tmp_path_factory):
    out = tmp_path_factory.mktemp("uncompressed_wider")
    fit(out, 0, {}, "--max-epochs", "4", *WIDER)
    return per_step(out)


@pytest.mark.parametrize(("compression", "options"), HOOKS)
def test_powersgd_and_topk_keep_ranks_in_sync_and_train(compression, options, uncompressed_wider, tmp_path):
    uncompressed = uncompressed_wider
    strategy = {"compression": compression, "compression_options": options}
    run = fit(tmp_path, 0, strategy, "--max-epochs", "4", *WIDER)
    records = per_step(tmp_path)
    assert max(record["spread"] for record in records) == 0.0  # the same raises on every rank, at the same step
    checks = error_bound(tmp_path)["checks"]
    measured = [check for check in checks if not check["estimated"]]
    assert measured[0]["step"] == (2 if compression == "powersgd" else 0)  # the first compressed step
    for check, following in zip(measured, measured[1:]):  # every 2 steps, and the step after a raise
        assert following["step"] == check["step"] + (1 if check["raised_to"] else 2)
    estimated = [check["step"] for check in checks if check["estimated"]]
    assert estimated == ([1] if compression == "powersgd" else [])  # PowerSGD's last uncompressed step
    assert any(check["raised_to"] for check in checks), checks
    assert f"HeteroStrategy: {compression}'s relative error" in run.output  # said when raised
    assert (params(records[-1]) - params(uncompressed[-1])).abs().max().item() > 1e-4  # it did compress
    dataset, architecture = IndexedRegression(SAMPLES), {"depth": 2, "hidden": 32}
    start = full_data_loss(dataset, params(uncompressed[0]), **architecture)
    ours = full_data_loss(dataset, params(records[-1]), **architecture)
    reference = full_data_loss(dataset, params(uncompressed[-1]), **architecture)
    assert ours < 0.5 * start, (start, ours)  # it trains
    assert ours < 1.25 * reference, (ours, reference)  # and nearly as well as uncompressed


@pytest.mark.parametrize(("compression", "options"), HOOKS)
def test_compression_state_survives_a_checkpoint_and_the_resume_continues_exactly(compression, options, tmp_path):
    """Error feedback (both), PowerSGD's warm-started Q and its random state: saved per rank, restored."""
    strategy = {"compression": compression, "compression_options": options}
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    # 2 optimizer steps an epoch; PowerSGD compresses from step 3 on, so the state at step 4 holds its error feedback.
    fit(uninterrupted, 0, strategy, "--max-epochs", "4", "--checkpoint-every", "4", *WIDER)
    checkpoint = uninterrupted / "ckpt" / "epoch=1-step=4.ckpt"
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    assert {"compression/rank_0.pt", "compression/rank_1.pt"} <= set(manifest["files"])
    fit(resumed, 0, strategy, "--max-epochs", "4", "--ckpt-path", str(checkpoint), *WIDER)
    records, continued = per_step(uninterrupted), per_step(resumed)
    after = records[8:]  # one record per batch (2 batches a step): those after the checkpoint's step 4
    assert [r["step"] for r in continued] == [r["step"] for r in after] and len(after) == 8
    for ours, theirs in zip(continued, after):
        assert (params(ours) - params(theirs)).abs().max().item() < 1e-6
    assert error_bound(resumed)["checks"] == error_bound(uninterrupted)["checks"]  # the raised setting continues


def test_hierarchical_reduction_equals_flat_with_half_the_bytes_between_nodes(tmp_path):
    """4 ranks as 2 emulated nodes of 2; uncompressed, so the two reductions differ only in summation order."""
    runs = {}
    for hierarchical in (False, True):
        out = tmp_path / str(hierarchical)
        run = run_fit(
            out,
            "--devices",
            "4",
            "--stage",
            "0",
            "--samples",
            "56",
            "--batch-sizes",
            "5",
            "3",
            "4",
            "2",
            "--record-every-step",
            "--monitor",
            "--strategy-args",
            json.dumps({"hierarchical": hierarchical}),
            env=TWO_NODES,
        )
        assert run.returncode == 0, run.output[-3000:]
        hetero = next(out.rglob("report.json")).parent  # in the CSV logger's version directory
        runs[hierarchical] = (per_step(out), json.loads((hetero / "report.json").read_text()), hetero)
    (flat, flat_report, _), (ours, report, hetero) = runs[False], runs[True]
    assert max(record["spread"] for record in ours) == 0.0
    assert max((params(a) - params(b)).abs().max().item() for a, b in zip(ours, flat)) < 1e-6
    assert report["communication"]["hierarchical"] and not flat_report["communication"]["hierarchical"]
    assert report["communication"]["nodes"] == [0, 0, 1, 1]
    gradient_bytes = 4 * params(ours[0]).numel()  # fp32 gradients of every parameter
    for step, flat_step in zip(report["steps"], flat_report["steps"]):
        # Flat: each rank sends its gradients to a group spanning both nodes. Hierarchical: only the leaders (0, 2)
        # do; the others send theirs to their leader, inside the node. (+16 bytes a rank: the logged loss's sync.)
        assert flat_step["inter_node_bytes"] == [gradient_bytes + 16] * 4
        assert step["inter_node_bytes"] == [gradient_bytes + 16, 16, gradient_bytes + 16, 16]
        assert step["intra_node_bytes"] == [gradient_bytes] * 4  # the non-leaders' reduce, the leaders' broadcast
    logged_loss_sync = 4 * 16
    between = report["communication"]["inter_node_bytes_per_step"] - logged_loss_sync
    assert between == (flat_report["communication"]["inter_node_bytes_per_step"] - logged_loss_sync) / 2
    rank_1 = json.loads((hetero / "rank_1.json").read_text())
    assert rank_1["wire_bytes_per_step"]["inter_node_bytes"] == [16.0] * len(report["steps"])
    with open(next(hetero.parent.rglob("metrics.csv"))) as handle:
        rows = list(csv.DictReader(handle))
    name = "hetero/rank_0/inter_node_bytes"
    logged = [float(row[name]) for row in rows if row.get(name)]
    assert logged == [gradient_bytes + 16.0] * len(report["steps"])


def test_hierarchical_reduction_equals_flat_on_uneven_nodes(tmp_path):
    """3 ranks as nodes {0, 1} and {2}: the leaders scale their node's sum by nodes / ranks, which only an uneven
    topology tells apart from dividing by the node's size."""
    records = {}
    for hierarchical in (False, True):
        out = tmp_path / str(hierarchical)
        run = run_fit(
            out,
            "--devices",
            "3",
            "--stage",
            "0",
            "--samples",
            "48",
            "--batch-sizes",
            "5",
            "3",
            "4",
            "--record-every-step",
            "--strategy-args",
            json.dumps({"hierarchical": hierarchical}),
            env=TWO_NODES,
        )
        assert run.returncode == 0, run.output[-3000:]
        records[hierarchical] = per_step(out)
    assert "hierarchical on (hierarchical=True): 2 nodes" in run.output
    assert max(record["spread"] for record in records[True]) == 0.0
    pairs = zip(records[True], records[False])
    assert max((params(a) - params(b)).abs().max().item() for a, b in pairs) < 1e-6
