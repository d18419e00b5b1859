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
from conftest import run_fit  # noqa: E402

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


def test_the_fast_rank_trains_what_it_has_time_for_every_sample_once_and_diloco_as_the_reference(tmp_path):
    """64 samples in 16 micro-batches of 4, two epochs; rank 1 is emulated 10x slower. A merge every 2 x 2 = 4
    micro-batches (3 inside each epoch, and the epoch's end), each rank weighted by what it trained since the last."""
    run = run_fit(tmp_path, *asynchronous_args(), "--samples", "64", "--emulate-speeds", "1.0", "0.1",
                  "--max-epochs", "2")  # fmt: skip
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


def test_one_rank_alone_trains_every_micro_batch_and_merges_with_itself(tmp_path):
    """One rank (its process group's store holds the counter): every micro-batch, a merge every 2 x 1 of them."""
    run = run_fit(tmp_path, "--devices", "1", *asynchronous_args(), "--samples", "32")
    assert run.returncode == 0, run.output[-4000:]
    assert run.result["seen"] == [list(range(32))]
    assert [record["micro_batches"] for record in run.result["merges"][0]] == [2, 2, 2, 2]
