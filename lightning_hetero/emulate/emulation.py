"""Emulate: the strategy's one handle on emulated speeds; :class:`NoEmulation` when none are asked for.

Three ways to be slower (``emulate_slowdown``): ``"compute"`` (:class:`Emulation`) stretches the rank's local compute
in proportion to its micro-batch (:mod:`.slowdown`); ``"process"`` (:class:`ProcessEmulation`) holds the rank's whole
process to a fraction of a core, its loop, optimizer and exchange included (:mod:`.throttle`); ``"sends"``
(:class:`SendsEmulation`) puts what the rank sends on a slower link, its compute untouched. The strategy calls the
same methods either way (stretch this compute, pay before this collective, hold this send, the speed from this step
on, stop), so that no code path asks whether emulation is on or how.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Union

import torch

from lightning_hetero.emulate import throttle
from lightning_hetero.emulate.slowdown import SlowdownEmulator, SpeedSchedule

SLOWDOWNS = ("compute", "process", "sends")
SLOWDOWN_ENV_VAR = "LIGHTNING_HETERO_EMULATE_SLOWDOWN"
# Under "sends", a rank of speed f sends on a link of f times this bandwidth (the emulated link's between nodes,
# LIGHTNING_HETERO_EMULATE_LINK, where given): 1 Gbit/s, a common Ethernet link between hosts.
REFERENCE_GBIT_PER_SECOND = 1.0


def send_hold_seconds(payload_bytes: float, speed: float, gbit_per_second: float) -> float:
    """How much longer ``payload_bytes`` take on a link of ``speed`` times ``gbit_per_second`` than on one of
    ``gbit_per_second``: ``(1 / speed - 1) x payload / bandwidth`` (0 at speed 1; a latency is paid either way)."""
    return (1.0 / speed - 1.0) * payload_bytes * 8 / (gbit_per_second * 1e9)


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

    def send_seconds(self, payload_bytes: float) -> float:
        return 0.0

    def stop(self) -> None:
        pass


class _NothingStretched:
    """The calls that stretch compute or hold sends, as no-ops: for emulation off and for the emulations that slow a
    rank another way (their profile measures the rank as it is: no ``emulator``)."""

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

    def send_seconds(self, payload_bytes: float) -> float:
        return 0.0

    def stop(self) -> None:
        pass


class NoEmulation(_NothingStretched):
    """Emulation off: every call is a no-op, and profiles and steps are measured as they are."""


class ProcessEmulation(_NothingStretched):
    """This rank's whole process held to its emulated speed of a core (:mod:`.throttle`): nothing in the loop is
    stretched; the kernel's CPU quota (or a helper's duty cycle) stops the process wherever it runs out."""

    schedule: SpeedSchedule

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


class SendsEmulation(_NothingStretched):
    """This rank's sends on a slower link (``emulate_slowdown="sends"``): at speed ``f`` its payload in each collective
    of a training step is held back before it is issued for what a link of ``f`` times ``gbit_per_second`` would take
    longer (:func:`send_hold_seconds`), so the other ranks wait for it inside the collective, as for a slow network
    card or a congested uplink. Its compute and loop are untouched: the profile sees an equal device. (What a rank
    sends per step is its gradients' payload, whatever its share of the batch: a smaller share lets it start sending
    earlier, no more.)"""

    schedule: SpeedSchedule

    def __init__(self, schedule: SpeedSchedule, rank: int, gbit_per_second: float) -> None:
        self.schedule, self.rank, self.gbit_per_second = schedule, rank, gbit_per_second
        self.speed = schedule.at(0)[rank]

    def at_step(self, step: int) -> None:
        self.speed = self.schedule.at(step)[self.rank]

    def send_seconds(self, payload_bytes: float) -> float:
        """The time to hold back a send of ``payload_bytes`` before it is issued."""
        return send_hold_seconds(payload_bytes, self.speed, self.gbit_per_second)


def emulation_for(
    schedule: Optional[SpeedSchedule],
    rank: int,
    device: torch.device,
    slowdown: str = "compute",
    send_gbit_per_second: float = REFERENCE_GBIT_PER_SECOND,
) -> Union[Emulation, ProcessEmulation, SendsEmulation, NoEmulation]:
    """This rank's emulation: ``slowdown`` is how a slower rank is slower (see the module docstring);
    ``send_gbit_per_second``: the link a rank of speed 1 sends on under ``"sends"``."""
    if schedule is None:
        return NoEmulation()
    if slowdown == "process":
        return ProcessEmulation(schedule, rank)
    if slowdown == "sends":
        return SendsEmulation(schedule, rank, send_gbit_per_second)
    return Emulation(schedule, rank, device)


def check_slowdown(value: object) -> str:
    """``emulate_slowdown`` (the argument, or the environment variable without one), checked."""
    if value is None:
        value = os.environ.get(SLOWDOWN_ENV_VAR, "").strip() or "compute"
    if value not in SLOWDOWNS:
        raise ValueError(
            f'`emulate_slowdown={value!r}` (or {SLOWDOWN_ENV_VAR}) is not one of {list(SLOWDOWNS)}: "compute"'
            ' stretches a slower rank\'s compute (the default), "process" holds its whole process to a fraction of'
            ' a core (a CPU quota: its loop, optimizer and exchange slowed too), "sends" puts what it sends on a'
            " slower link."
        )
    return str(value)
