"""Emulation is one handle whether it is on or off: off, every call is a no-op."""

from __future__ import annotations

import time

import torch

from lightning_hetero.emulate.emulation import Emulation, NoEmulation, emulation_for
from lightning_hetero.emulate.slowdown import speed_schedule


def test_without_speeds_the_null_object_changes_nothing():
    emulation = emulation_for(None, rank=0, device=torch.device("cpu"))
    assert isinstance(emulation, NoEmulation) and emulation.emulator is None
    emulation.at_step(5)
    emulation.catch_up()
    emulation.around_deepspeed_exchanges(object())
    with emulation.slowed():
        pass
    assert emulation.added_seconds == 0.0


def test_a_drift_schedule_sets_this_ranks_speed_by_optimizer_step():
    schedule = speed_schedule({0: [1.0, 1.0], 3: [1.0, 0.25]})
    emulation = emulation_for(schedule, rank=1, device=torch.device("cpu"))
    assert isinstance(emulation, Emulation) and emulation.emulator.speed == 1.0
    emulation.at_step(2)
    assert emulation.emulator.speed == 1.0
    emulation.at_step(3)
    assert emulation.emulator.speed == 0.25


def test_a_slowed_block_is_stretched_and_the_delay_counted():
    emulation = emulation_for(speed_schedule([0.5]), rank=0, device=torch.device("cpu"))
    with emulation.slowed():
        deadline = time.thread_time() + 0.02
        while time.thread_time() < deadline:
            pass
    assert emulation.added_seconds > 0.0
