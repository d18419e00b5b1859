"""The fixtures of Lightning's tests/tests_pytorch/conftest.py (tag 2.6.5) that lightning_tests.py uses."""

from __future__ import annotations

import os

import lightning.fabric
import lightning.pytorch
import pytest
import torch


@pytest.fixture(autouse=True)
def restore_env_variables():
    backup = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(backup)


@pytest.fixture(autouse=True)
def teardown_process_group():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def cuda_count_1(monkeypatch):
    monkeypatch.setattr(lightning.fabric.accelerators.cuda, "num_cuda_devices", lambda: 1)
    monkeypatch.setattr(lightning.pytorch.accelerators.cuda, "num_cuda_devices", lambda: 1)


@pytest.fixture
def mps_count_0(monkeypatch):
    monkeypatch.setattr(lightning.fabric.accelerators.mps, "_get_all_available_mps_gpus", lambda: [])
    monkeypatch.setattr(lightning.fabric.accelerators.mps.MPSAccelerator, "is_available", lambda *_: False)
