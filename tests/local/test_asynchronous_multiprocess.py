"""Asynchronous merges by speed (``sync_options={"asynchronous": True}``) on two CPU ranks, one emulated 10x slower.

The claims under test: each rank trains the micro-batches it has time for (the fast one most of them), every sample
once per epoch; the ranks' steps are not in step (no collective between merges); and the parameters are those of a
plain-torch DiLoCo that replays what each rank trained between the merges, weighted by samples.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parents[1]))

from common import IndexedRegression, batch_loss, make_network, max_param_difference  # noqa: E402
from conftest import run_fit, sigterm_mid_training  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}


def asynchronous_reference(
    dataset: IndexedRegression, seen: list[list[int]], merges: list[list[dict[str, Any]]], micro: int
) -> dict[str, torch.Tensor]:
    """Rank r trains its micro-batches (``seen[r]`` cut into ``micro`` samples) with its own SGD (lr 0.05, momentum
    0.9); at each merge it has trained the ``micro_batches`` its record says since the last one, and the ranks'
    deltas, weighted by their samples, make DiLoCo's outer step (the ranks' records list the same merges)."""
    start = make_network()
    nets = [copy.deepcopy(start) for _ in seen]
    inner = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9) for net in nets]
    anchor = [torch.nn.Parameter(p.detach().clone()) for p in start.parameters()]
    outer = torch.optim.SGD(anchor, lr=OUTER["outer_lr"], momentum=OUTER["outer_momentum"], nesterov=True)
    position = [0] * len(seen)
    for merge in zip(*merges):
        samples = []
        for rank, (net, optimizer, record) in enumerate(zip(nets, inner, merge)):
            trained = 0
            for _ in range(record["micro_batches"]):
                indices = seen[rank][position[rank] : position[rank] + micro]
                position[rank] += len(indices)
                trained += len(indices)
                optimizer.zero_grad()
                batch_loss(net, dataset.x[indices], dataset.y[indices]).backward()
                optimizer.step()
            samples.append(trained)
        total = sum(samples)
        with torch.no_grad():
            for index, parameter in enumerate(anchor):
                # (as the merge sums them: each rank's fp32 delta weighted in float64, the sum back in fp32)
                parameter.grad = sum(
                    (parameter - list(net.parameters())[index]).double() * (n / total) for n, net in zip(samples, nets)
                ).float()
        outer.step()
        outer.zero_grad()
        with torch.no_grad():
            for net in nets:
                for own, merged in zip(net.parameters(), anchor):
                    own.copy_(merged)
    assert position == [len(s) for s in seen], "the merges' records account for every micro-batch trained"
    names = [name for name, _ in start.named_parameters()]
    return {name: parameter.detach().clone() for name, parameter in zip(names, anchor)}


def asynchronous_args(**strategy: Any) -> list[str]:
    options = {"sync": "diloco", "sync_every": 2, "sync_options": {"asynchronous": True}, **strategy}
    return ["--stage", "0", "--loader-batch-size", "4", "--strategy-args", json.dumps(options)]


@pytest.mark.parametrize("reload", [False, True])
def test_the_fast_rank_trains_what_it_has_time_for_every_sample_once_and_diloco_as_the_reference(tmp_path, reload):
    """64 samples in 16 micro-batches of 4, two epochs; rank 1 is emulated 10x slower. A merge every 2 x 2 = 4
    micro-batches (3 inside each epoch, and the epoch's end), each rank weighted by what it trained since the last.
    ``reload``: Lightning rebuilds the loader at each epoch, and starts it twice at the second epoch's start."""
    run = run_fit(
        tmp_path,
        *asynchronous_args(),
        "--samples",
        "64",
        "--emulate-speeds",
        "1.0",
        "0.1",
        "--max-epochs",
        "2",
        *(["--reload-every", "1"] if reload else []),
    )
    assert run.returncode == 0, run.output[-4000:]
    seen, merges = run.result["seen"], run.result["merges"]
    assert sorted(sum(seen, [])) == sorted(list(range(64)) * 2)  # every sample once an epoch
    assert len(seen[0]) > len(seen[1]) >= 8  # the fast rank took more; each rank its own first micro-batches at least
    assert [[r["epoch"] for r in records] for records in merges] == [[0] * 4 + [1] * 4] * 2  # the same merges
    assert [sum(r["micro_batches"] for r in records) * 4 for records in merges] == [len(s) for s in seen]
    # Not in step: in some merge the fast rank contributed more micro-batches than the slow one (lockstep: equal).
    assert any(fast["micro_batches"] > slow["micro_batches"] for fast, slow in zip(*merges))
    reference = asynchronous_reference(IndexedRegression(64), seen, merges, 4)
    # Relative to the parameters' scale: 32 steps of SGD with momentum and 8 outer Nesterov steps grow them to about
    # 10, and the inner optimizer's rounding (torch's SGD inside DeepSpeed against the reference's) grows with them.
    scale = max(1.0, max(float(value.abs().max()) for value in reference.values()))
    assert max_param_difference(run.result, reference) <= TOLERANCE * scale
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    # The report holds every rank's steps, padded where a rank took fewer: every sample is counted once.
    assert sum(sum(step["batch_sizes"]) for step in report["steps"]) == 128
    assert len(report["steps"]) == len(seen[0]) // 4
    merged = report["asynchronous"]  # each rank's contributions, merge by merge, and its waits
    assert merged["merges"] == 8 and merged["micro_batches"] == [len(s) // 4 for s in seen]
    assert [m["micro_batches"] for m in merged["per_merge"]] == [
        list(pair) for pair in zip(*([r["micro_batches"] for r in records] for records in merges))
    ]
    assert "asynchronous merges: 8 merges, micro-batches per rank" in run.output
    # At each epoch's end the slow rank held a claim drawn ahead, and the fast one (10x) took it over: the slow
    # rank's hooks saw that batch emptied (`seen` is recorded in on_train_batch_start: every sample once above).
    assert merged["claims_given_away"] == merged["claims_taken_over"][::-1] and sum(merged["claims_taken_over"]) >= 1


def test_one_rank_alone_trains_every_micro_batch_and_merges_with_itself(tmp_path):
    """One rank (its process group's store holds the counter): every micro-batch, a merge every 2 x 1 of them."""
    run = run_fit(tmp_path, "--devices", "1", *asynchronous_args(), "--samples", "32")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["seen"] == [list(range(32))]
    assert [record["micro_batches"] for record in run.result["merges"][0]] == [2, 2, 2, 2]


@pytest.mark.fault
def test_a_sigterm_stops_every_rank_at_the_next_merge_with_a_checkpoint_whose_resume_redoes_that_epoch(tmp_path):
    """SIGTERM to the slow rank mid-training: the ranks agree at the next merge (not at a step), save last.ckpt with
    one model and exit 143; the resume trains the interrupted epoch again from its start, every sample once."""
    from lightning_hetero.recover import checkpoint
    from lightning_hetero.recover.stopping import EXIT_CODE_INTERRUPTED

    common = [*asynchronous_args(), "--samples", "160", "--emulate-speeds", "1.0", "0.25", "--record-steps"]
    command = [
        sys.executable,
        str(Path(__file__).parents[1] / "workers" / "fit.py"),
        "--out",
        str(tmp_path),
        *common,
        "--max-epochs",
        "100000",
        "--signal-test",
    ]
    returncode, output, codes = sigterm_mid_training(command, tmp_path, 1, 2)
    assert codes.get(1) == str(EXIT_CODE_INTERRUPTED), (codes, output[-3000:])
    assert codes.get(0, str(EXIT_CODE_INTERRUPTED)) == str(EXIT_CODE_INTERRUPTED), codes
    (last,) = tmp_path.rglob("last.ckpt")
    assert checkpoint.incompleteness(last) is None, output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    epoch = max(r["epoch"] for r in records)  # the epoch the signal interrupted
    resumed = run_fit(tmp_path / "resume", *common, "--max-epochs", str(epoch + 1), "--ckpt-path", str(last))
    assert resumed.returncode == 0, resumed.output[-3000:]
    again = [json.loads(line) for line in (tmp_path / "resume" / "steps.jsonl").read_text().splitlines()]
    assert {r["epoch"] for r in again} == {epoch}
    assert sorted(i for r in again for i in r["indices"]) == list(range(160))  # that epoch again, each sample once


def test_a_resume_from_an_epochs_end_trains_the_next_epoch_in_its_own_order(tmp_path):
    """A fit resumed after epoch 0 (Lightning reads ahead of a loader without a length before it sets the epoch)
    trains epoch 1 in epoch 1's shuffled order, each sample once, as the uninterrupted fit does."""

    def steps(folder: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]

    common = [*asynchronous_args(), "--samples", "64", "--shuffle", "--record-steps"]
    whole = run_fit(tmp_path / "whole", *common, "--max-epochs", "2")
    first = run_fit(tmp_path / "first", *common, "--max-epochs", "1")
    assert whole.returncode == 0 and first.returncode == 0, (whole.output + first.output)[-4000:]
    saved = min((tmp_path / "first").rglob("*.ckpt"), key=lambda path: len(path.parts))  # the epoch's end
    resumed = run_fit(tmp_path / "resumed", *common, "--max-epochs", "2", "--ckpt-path", str(saved))
    assert resumed.returncode == 0, resumed.output[-4000:]
    again = steps(tmp_path / "resumed")
    assert {r["epoch"] for r in again} == {1} and sorted(i for r in again for i in r["indices"]) == list(range(64))
    assert [r["epoch"] for r in resumed.result["merges"][0]] == [1] * 4  # its counter and merges are epoch 1's

    def first_of(records: list[dict[str, Any]], rank: int) -> list[int]:  # a rank's own first claim of epoch 1
        return next(r["indices"] for r in records if r["rank"] == rank and r["epoch"] == 1)

    assert [first_of(again, rank) for rank in (0, 1)] == [first_of(steps(tmp_path / "whole"), rank) for rank in (0, 1)]
