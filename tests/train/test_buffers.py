"""Buffers stay the same on every rank, as under DDP (broadcast_buffers): rank 0's before every training forward."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import WORKERS, run_fit
from torch import nn

from lightning_hetero.train.buffers import BufferSync

sys.path.insert(0, str(WORKERS))
from common import IndexedRegression  # noqa: E402


def test_every_buffer_takes_rank_0s_values_one_broadcast_per_dtype():
    rank0, rank1 = nn.BatchNorm1d(3), nn.BatchNorm1d(3)
    rank0.running_mean += torch.tensor([1.0, 2.0, 3.0])
    rank0.num_batches_tracked += 7
    rank1.running_var *= 5
    flats_of_rank0 = [
        torch.cat([b.reshape(-1) for b in rank0.buffers() if b.dtype == dtype])
        for dtype in (torch.float32, torch.int64)
    ]
    broadcasts = []

    def broadcast(flat):  # what torch.distributed.broadcast(flat, src=0) leaves on rank 1
        broadcasts.append(flat.dtype)
        flat.copy_(flats_of_rank0[len(broadcasts) - 1])

    sync = BufferSync(rank1.buffers(), broadcast)
    assert sync
    sync.sync()
    assert broadcasts == [torch.float32, torch.int64]
    for mine, theirs in zip(rank1.buffers(), rank0.buffers()):
        assert torch.equal(mine, theirs)


def test_a_model_without_buffers_costs_nothing():
    assert not BufferSync(nn.Linear(3, 1).buffers(), lambda flat: pytest.fail("no broadcast expected"))


@pytest.mark.multiprocess
def test_batchnorm_statistics_and_a_counter_are_rank_0s_on_every_rank_at_every_step(tmp_path):
    """Unequal micro-batches 3/13 for 4 steps. Each step's forward starts from the same buffers on both ranks (they
    drifted apart before: BatchNorm statistics 0.6 apart, a sample counter by 10 per step), and they are rank 0's: the
    running mean is the moving average of rank 0's slices, the counter counts rank 0's samples (DDP's rule)."""
    run = run_fit(tmp_path, "--batch-sizes", "3", "13", "--samples", "64", "--batchnorm")
    assert run.returncode == 0, run.output[-3000:]
    rank0, rank1 = run.result["buffer_traces"]
    assert len(rank0) == 4 and rank0 == rank1
    dataset, running = IndexedRegression(64), torch.zeros(4)
    for step, trace in enumerate(rank0):
        assert trace["samples_seen"] == 3 * step
        assert torch.allclose(torch.tensor(trace["running_mean"]), running, atol=1e-6), step
        running = 0.9 * running + 0.1 * dataset.x[16 * step : 16 * step + 3].mean(dim=0)  # BatchNorm's momentum
