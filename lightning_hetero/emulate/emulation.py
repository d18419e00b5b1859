"""Emulate: the strategy's one handle on emulated speeds; :class:`NoEmulation` when none are asked for.

Two ways to be slower (``emulate_slowdown``): ``"compute"`` (:class:`Emulation`) stretches the rank's local compute in
proportion to its micro-batch (:mod:`.slowdown`); ``"process"`` (:class:`ProcessEmulation`) holds the rank's whole
process to a fraction of a core, its loop, optimizer and exchange included (:mod:`.throttle`). The strategy calls the
same methods either way (stretch this compute, pay before this collective, the speed from this step on, stop), so
that no code path asks whether emulation is on or how.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Union

import torch

from lightning_hetero.emulate import throttle
from lightning_hetero.emulate.slowdown import SlowdownEmulator, SpeedSchedule

SLOWDOWNS = ("compute", "process")
SLOWDOWN_ENV_VAR = "LIGHTNING_HETERO_EMULATE_SLOWDOWN"


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

    def stop(self) -> None:
        pass


class ProcessEmulation:
    """This rank's whole process held to its emulated speed of a core (:mod:`.throttle`): nothing in the loop is
    stretched; the kernel's CPU quota (or a helper's duty cycle) stops the process wherever it runs out."""

    emulator: Optional[SlowdownEmulator] = None  # (the profiler measures the throttled process as it is)
    added_seconds = 0.0

    def __init__(self, schedule: SpeedSchedule, rank: int) -> None:
        self.schedule = schedule
        self.rank = rank
        self.speed = 1.0
        self.throttle: Optional[throttle.Throttle] = None
        self.at_step(0)

    def at_step(self, step: int) -> None:
        """The speed from this optimizer step on (a drift schedule); the limit changes only when it does."""
        speed = self.schedule.at(step)[self.rank]
        if speed == self.speed:
            return
        self.speed = speed
        if speed >= 1.0:
            self.stop()
        elif self.throttle is None:
            self.throttle = throttle.start_throttle(speed)
        else:
            self.throttle.set_speed(speed)

    def stop(self) -> None:
        """The process runs freely again (the trainer call ends)."""
        if self.throttle is not None:
            self.throttle.stop()
            self.throttle = None
        self.speed = 1.0

    def slowed(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def catch_up(self) -> None:
        pass

    def around_deepspeed_exchanges(self, engine: Any) -> None:
        pass


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

    def stop(self) -> None:
        pass


def emulation_for(
    schedule: Optional[SpeedSchedule], rank: int, device: torch.device, slowdown: str = "compute"
) -> Union[Emulation, ProcessEmulation, NoEmulation]:
    """This rank's emulation: ``slowdown`` is how a slower rank is slower (see the module docstring)."""
    if schedule is None:
        return NoEmulation()
    return ProcessEmulation(schedule, rank) if slowdown == "process" else Emulation(schedule, rank, device)


def check_slowdown(value: object) -> str:
    """``emulate_slowdown`` (the argument, or the environment variable without one), checked."""
    if value is None:
        value = os.environ.get(SLOWDOWN_ENV_VAR, "").strip() or "compute"
    if value not in SLOWDOWNS:
        raise ValueError(
            f'`emulate_slowdown={value!r}` (or {SLOWDOWN_ENV_VAR}) is not one of {list(SLOWDOWNS)}: "compute"'
            ' stretches a slower rank\'s compute (the default), "process" holds its whole process to a fraction of'
            " a core (a CPU quota: its loop, optimizer and exchange slowed too)."
        )
    return str(value)
