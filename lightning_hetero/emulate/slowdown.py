"""Heterogeneity emulation: make identical hardware behave like slower devices (a test and demo aid).

A rank with speed ``f`` (0 < f <= 1) sleeps ``(1/f - 1)`` times the local compute it just did, so its forward and
backward take ``1/f`` as long, in proportion to its own batch. Only local compute is stretched: the clock is this
thread's CPU time on CPU, which does not advance while the thread blocks in a gloo collective, so time spent
waiting for other ranks is not multiplied. On CUDA the clock is synchronised wall time; there, ZeRO-2/3 backward
passes contain gradient reduction, which is stretched too (ZeRO-0/1 communicate outside forward and backward).

DeepSpeed's own host-side work inside backward (ZeRO-2/3 gradient bucketing in the gradient hooks, the
post-backward reduction) is not compute of the emulated device, so the strategy excludes it (:meth:`excluded`):
otherwise a slow rank would pay a stretched per-parameter overhead that no profile of the model can see.
Before a call that communicates, the rank first sleeps what it owes for the compute so far (:meth:`catch_up`): on a
slower device the gradients reach the exchange later, so the other ranks wait at the collective. Sleeping only at
the end of the backward pass would put the delay after the exchange, where it hides behind the next step's compute
instead of holding the others back. It sleeps there only, not in every per-parameter hook: on a CPU, compute right
after a thread wakes up runs slower (cold caches): a sleep per parameter made a rank at speed 0.125 compute 20 %
more per step than one sleep per pass, as in its profile, and the stretch multiplied that into a fixed cost the
planner could not see.

The profiler is not told the factors: it measures the stretched compute like any other.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_hetero.runtime.checks import is_int, per_rank_list

ENV_VAR = "LIGHTNING_HETERO_EMULATE_SPEEDS"
# DeepSpeed's methods that reduce a bucket of gradients when it fills up during backward (ZeRO-2, ZeRO-3).
_DEEPSPEED_BUCKET_REDUCES = ("reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")


def parse_speeds(text: str, source: str = ENV_VAR) -> tuple[float, ...]:
    """``"1.0,0.4"`` -> ``(1.0, 0.4)``, checked. An empty entry (``"1.0,,0.4"``) is an error, not a skipped rank."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"`{source}={text!r}` is empty: give one speed per rank, e.g. `{source}=1.0,0.4`.")
    if "" in parts:
        raise ValueError(
            f"`{source}={text!r}` has an empty entry (position {parts.index('')}): give exactly one number per rank,"
            f" e.g. `{source}=1.0,0.4`."
        )
    try:
        speeds = tuple(float(part) for part in parts)
    except ValueError:
        raise ValueError(
            f"`{source}={text!r}` is not a comma-separated list of numbers, one per rank (no empty entries)."
            f" Example: `{source}=1.0,0.4`."
        ) from None
    check_speeds(speeds, source)
    return speeds


def check_speeds(speeds: Sequence[float], source: str = "emulate_speeds") -> None:
    speeds = per_rank_list(source, speeds, "[1.0, 0.4]")
    if len(speeds) == 0:
        raise ValueError(f"`{source}` is empty: give one speed per rank, e.g. [1.0, 0.4].")
    bad = [s for s in speeds if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s)]
    bad += [s for s in speeds if s not in bad and not 0 < s <= 1]
    if bad:
        raise ValueError(
            f"`{source}={list(speeds)}` holds {bad}: each speed must be in (0, 1] (1.0 = this hardware, 0.4 = 2.5x"
            " slower). Emulation can only slow a rank down; scale the list so the fastest rank is 1.0."
        )


def speeds_from_environment() -> Optional[SpeedSchedule]:
    text = os.environ.get(ENV_VAR, "").strip()
    return parse_schedule(text) if text else None


def emulated_speeds(argument: Any) -> tuple[Optional[SpeedSchedule], Optional[str]]:
    """The speed schedule from the ``emulate_speeds`` argument or, without one, the environment variable; and a
    warning when both are given (the argument wins)."""
    if argument is None:
        return speeds_from_environment(), None
    schedule = speed_schedule(argument)
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return schedule, None
    return schedule, (
        f"HeteroStrategy: `emulate_speeds={schedule.to_json()}` is given and {ENV_VAR}={text!r} is set; the argument"
        " wins and the environment variable is ignored. Unset one of them."
    )


@dataclass(frozen=True)
class SpeedSchedule:
    """Emulated speeds that change at given global steps: ``changes[i] = (step, speeds per rank)``, from step 0.

    A plain list of speeds is the schedule ``{0: speeds}``. A change takes effect at the training step whose
    ``global_step`` (optimizer steps done before it) reaches its step: this is how a device that drifts (throttles,
    gets a neighbour job) is emulated.
    """

    changes: tuple[tuple[int, tuple[float, ...]], ...]

    @property
    def world_size(self) -> int:
        return len(self.changes[0][1])

    def at(self, step: int) -> tuple[float, ...]:
        current = self.changes[0][1]
        for begin, speeds in self.changes:
            if begin > step:
                break
            current = speeds
        return current

    def to_json(self) -> Any:
        """A list when the speeds never change (as the user most often writes them), else ``{step: speeds}``."""
        if len(self.changes) == 1:
            return list(self.changes[0][1])
        return {str(step): list(speeds) for step, speeds in self.changes}


def speed_schedule(value: Any, source: str = "emulate_speeds") -> SpeedSchedule:
    """A checked :class:`SpeedSchedule` from a list of speeds or a mapping ``{global step: speeds}``."""
    if not isinstance(value, Mapping):
        check_speeds(value, source)
        return SpeedSchedule(((0, tuple(float(s) for s in value)),))
    steps = list(value)
    bad_steps = [step for step in steps if not is_int(step) or step < 0]
    if bad_steps or not steps:
        raise ValueError(
            f"`{source}={dict(value)!r}` is a schedule whose keys must be global steps (integers >= 0), got"
            f" {bad_steps or 'none'}. Example: `{source}={{0: [1.0, 1.0], 200: [1.0, 0.4]}}`."
        )
    if 0 not in steps:
        raise ValueError(
            f"`{source}={dict(value)!r}` does not say the speeds at step 0: add a `0: [...]` entry (the speeds until"
            " the first change)."
        )
    changes = []
    for step in sorted(steps):
        check_speeds(value[step], f"{source}[{step}]")
        changes.append((int(step), tuple(float(s) for s in value[step])))
    lengths = {len(speeds) for _, speeds in changes}
    if len(lengths) > 1:
        raise ValueError(
            f"`{source}={dict(value)!r}` gives different numbers of ranks at different steps"
            f" ({', '.join(f'step {step}: {len(speeds)}' for step, speeds in changes)}): give every step one speed"
            " per rank."
        )
    return SpeedSchedule(tuple(changes))


def parse_schedule(text: str, source: str = ENV_VAR) -> SpeedSchedule:
    """``"1.0,1.0;200:1.0,0.4"`` -> speeds 1.0,1.0 from step 0 and 1.0,0.4 from step 200, checked."""
    schedule: dict[int, tuple[float, ...]] = {}
    for position, part in enumerate(text.split(";")):
        step_text, separator, speeds_text = part.rpartition(":")
        if not separator:
            step_text = "0" if position == 0 else ""
        try:
            step = int(step_text.strip())
        except ValueError:
            raise ValueError(
                f"`{source}={text!r}`: entry {position + 1} ({part.strip()!r}) must be `STEP:speeds` (only the first"
                f" entry may leave out its step, meaning 0). Example: `{source}=1.0,1.0;200:1.0,0.4`."
            ) from None
        if step in schedule:
            raise ValueError(f"`{source}={text!r}` gives step {step} twice.")
        schedule[step] = parse_speeds(speeds_text, source)
    return speed_schedule(schedule, source)


def compute_clock(device: torch.device) -> Callable[[], float]:
    """A clock that advances with this rank's local compute only (see the module docstring)."""
    if device.type == "cuda":

        def cuda_clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return cuda_clock
    # With one intra-op thread all compute runs on this thread; with more, the process's CPU time counts the
    # OpenMP workers too (and a little gloo work, which is why one thread is preferred).
    return time.thread_time if torch.get_num_threads() == 1 else time.process_time


def host_clock(device: torch.device) -> Callable[[], float]:
    """The CPU time of the thread that fetches the batches: the time it waited for its loader does not advance it.

    On CPU that is the compute clock; on CUDA the compute clock is wall time, so it is the thread's own CPU time."""
    return time.thread_time if device.type == "cuda" else compute_clock(device)


def held_clock() -> Callable[[], float]:
    """The calling thread's time runnable but not running, in seconds (Linux's ``/proc/thread-self/schedstat``, its
    run delay): held by the kernel's CPU quota (a container's CPU limit) or waiting for its core behind another
    process. Neither its compute clock nor a wait for data advances it. A clock that stays at 0 where the kernel keeps
    no such count (a process stopped by a signal is not runnable, so a stop/continue duty cycle does not show here).

    The file is opened once per thread and read again in place (``os.pread`` at 0: the kernel writes it anew), 2 us a
    read here against 20 us for an open, a read and a close; the meter reads it three times a step. A descriptor
    names the thread that opened it (``/proc/thread-self`` resolves then), so each thread keeps its own."""
    opened = threading.local()

    def run_delay() -> float:
        try:
            schedstat = getattr(opened, "schedstat", None)
            if schedstat is None or schedstat.pid != os.getpid():  # (a forked child: its own thread, not the parent's)
                schedstat = opened.schedstat = _ThreadFile("/proc/thread-self/schedstat")
            return int(os.pread(schedstat.descriptor, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    return run_delay


class _ThreadFile:
    """A file held open by one thread's local state, closed when that state goes (the thread ends)."""

    __slots__ = ("descriptor", "pid")

    def __init__(self, path: str) -> None:
        self.descriptor = os.open(path, os.O_RDONLY)
        self.pid = os.getpid()  # (a child forked after it opened inherits the descriptor, which names this thread)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.descriptor)


class SlowdownEmulator:
    """Stretches the local compute inside :meth:`slowed` blocks to ``1/speed`` of its duration."""

    def __init__(self, speed: float, device: torch.device) -> None:
        check_speeds([speed], "speed")
        self.speed = speed
        self._clock = compute_clock(device)
        self.added_seconds = 0.0
        self._excluded_seconds = 0.0
        # The open (outermost) excluded() block: (compute clock, wall clock) at its start.
        self._exclusion_start: Optional[tuple[float, float]] = None
        # The open slowed() block: (compute clock, wall clock, excluded seconds) at its start and what it has paid.
        self._block: Optional[list[float]] = None

    def _owed(self) -> float:
        if self._block is None:
            return 0.0
        start, wall_start, excluded_before, paid = self._block
        # The process's CPU time counts every intra-op thread: parallel compute is not longer than its wall time.
        # Sleeping advances the wall clock only, so the minimum stays the compute while any is left to pay.
        compute = min(self._clock() - start, time.perf_counter() - wall_start - paid)
        compute -= self._excluded_seconds - excluded_before + self._open_exclusion()
        return (1.0 / self.speed - 1.0) * max(0.0, compute) - paid

    def _elapsed_since(self, start: float, wall_start: float) -> float:
        # Measured like slowed() measures compute, so that the subtraction compares like with like.
        return min(self._clock() - start, time.perf_counter() - wall_start)

    def _open_exclusion(self) -> float:
        """Excluded work done so far in an excluded() block that has not ended (a catch_up inside one)."""
        return 0.0 if self._exclusion_start is None else self._elapsed_since(*self._exclusion_start)

    def catch_up(self) -> None:
        """Sleep now for the compute done so far in the open :meth:`slowed` block (a no-op outside one)."""
        extra = self._owed()
        if extra > 0:
            time.sleep(extra)
            self.added_seconds += extra
            assert self._block is not None
            self._block[3] += extra

    @contextlib.contextmanager
    def slowed(self) -> Iterator[None]:
        if self._block is not None:
            # Nested (manual optimization: backward inside training_step): part of the open block, whose clock
            # already counts this compute; a block of its own would stretch it twice.
            try:
                yield
            finally:
                self.catch_up()
            return
        self._block = [self._clock(), time.perf_counter(), self._excluded_seconds, 0.0]
        try:
            yield
        finally:
            self.catch_up()
            self._block = None

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Work inside a :meth:`slowed` block that a slower device would not do slower (host-side bookkeeping).

        Nested blocks (a bucket reduce inside a gradient hook) count once, as part of the outermost one.
        """
        if self._exclusion_start is not None:
            yield
            return
        self._exclusion_start = (self._clock(), time.perf_counter())
        try:
            yield
        finally:
            self._excluded_seconds += self._open_exclusion()
            self._exclusion_start = None

    def at_host_speed(self, owner: object, name: str, pay_first: bool = True) -> bool:
        """Make ``owner.name`` (an instance attribute shadows the method) run :meth:`excluded`, after a
        :meth:`catch_up` when ``pay_first``: a gradient exchange waits for the emulated compute before it and is not
        stretched itself; ``pay_first=False`` is for bookkeeping that does not communicate. False if ``owner`` has
        no such method."""
        method = getattr(owner, name, None)
        if not callable(method):
            return False

        def wrapper(*args: object, **kwargs: object) -> object:
            if pay_first:
                self.catch_up()
            with self.excluded():
                return method(*args, **kwargs)

        setattr(owner, name, wrapper)
        return True

    def around_deepspeed_exchanges(self, engine: Any) -> None:
        """DeepSpeed's gradient bookkeeping runs on the host at host speed, whatever the emulated device, and the
        emulated delay is paid before each gradient exchange, where a slower device would hold peers back: the
        post-backward (or, at ZeRO-0, the step's) reduction and, in ZeRO-1/2/3, a bucket reduced when it fills up
        during backward. The per-parameter hooks only fill buckets, so nothing is paid there. (Call after any
        replacement of ``engine.allreduce_gradients``, so that it is the one wrapped.)"""
        self.at_host_speed(engine, "allreduce_gradients")
        optimizer = engine.optimizer
        if optimizer is not None:
            self.at_host_speed(optimizer, "reduce_ready_partitions_and_remove_grads", pay_first=False)
            for bucket_reduce in _DEEPSPEED_BUCKET_REDUCES:
                self.at_host_speed(optimizer, bucket_reduce)
