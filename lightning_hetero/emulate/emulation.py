"""Emulate: the strategy's one handle on emulated speeds; :class:`NoEmulation` when none are asked for.

The strategy calls the same methods either way (stretch this compute, pay before this collective, the speed from
this step on), so that no code path asks whether emulation is on.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Union

import torch

from lightning_hetero.emulate.slowdown import SlowdownEmulator, SpeedSchedule


class Emulation:
    """This rank's emulated device: its speed follows ``schedule`` by optimizer step (see :mod:`.slowdown`)."""

    def __init__(self, schedule: SpeedSchedule, rank: int, device: torch.device) -> None:
        self.schedule = schedule
        self.rank = rank
        self.emulator: Optional[SlowdownEmulator] = SlowdownEmulator(schedule.at(0)[rank], device)

    def at_step(self, step: int) -> None:
        """A drift schedule: the emulated device's speed from this optimizer step on."""
        assert self.emulator is not None
        self.emulator.speed = self.schedule.at(step)[self.rank]

    def slowed(self) -> contextlib.AbstractContextManager:
        """Local compute inside is stretched to ``1 / speed`` of its duration."""
        assert self.emulator is not None
        return self.emulator.slowed()

    def catch_up(self) -> None:
        """Pay the stretched compute owed so far: a slower device would reach the next collective only now."""
        assert self.emulator is not None
        self.emulator.catch_up()

    @property
    def added_seconds(self) -> float:
        assert self.emulator is not None
        return self.emulator.added_seconds

    def around_deepspeed_exchanges(self, engine: Any) -> None:
        assert self.emulator is not None
        self.emulator.around_deepspeed_exchanges(engine)


class NoEmulation:
    """Emulation off: every call is a no-op, and profiles and steps are measured as they are."""

    emulator: Optional[SlowdownEmulator] = None
    schedule: Optional[SpeedSchedule] = None
    added_seconds = 0.0

    def at_step(self, step: int) -> None:
        pass

    def slowed(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def catch_up(self) -> None:
        pass

    def around_deepspeed_exchanges(self, engine: Any) -> None:
        pass


def emulation_for(schedule: Optional[SpeedSchedule], rank: int, device: torch.device) -> Union[Emulation, NoEmulation]:
    return Emulation(schedule, rank, device) if schedule is not None else NoEmulation()
