"""Re-plan: a bounded search of the split on the measured step, for what the cost model does not explain.

The re-planner's cost model is each rank's time per step (its compute, or its arrival at the gradient exchange where
that is longer, :mod:`~lightning_hetero.watch.meter`) scaled from its profile's line. Some slowness it does not
explain: a rank held by a CPU quota pays part of it after the exchange (its optimizer update), which the line does
not scale with the samples; a step is more than the ranks' own work. There the split can still be searched on what
it is meant to shorten: the step itself, which every rank measures.

:class:`StepSearch` is fed one window at a time (the steps between two exchanges of the ranks' records, all under
one split), with pure arithmetic and no clock: every rank takes the same decisions.

1. A window's **level** is the median of its step times, the first step after a switch left out (the loader's
   read-ahead), with the median's standard error from their spread.
2. The search runs only where the cost model leaves the step unexplained (:func:`cost_model_leaves_unexplained`: a
   rank held beyond the others, or every rank waiting long inside the exchange while the kernel holds one rank
   longer than the rest). It **starts** when one rank reaches
   the exchange later than another by more than the noise of their arrivals allows (:func:`late_and_early`: the
   difference of their medians over the window), or, where the ranks arrive together but every one waits long inside
   the exchange (a throttle that lands there), one rank's wall time is far less explained by its compute than
   another's (:func:`held_and_free`): evidence of which way to move. On identical ranks, or under ``emulate_speeds``,
   a rank late at the exchange is late by what no split removes, and the cost model explains the step: there the
   search does not run.
3. A **trial** moves ``move`` samples from the late rank to the earliest (the first an eighth of the global batch).
   It is kept only when its level is lower than the best split's by ``threshold`` plus ``TRIAL_SIGMAS`` standard
   errors of the difference, so noise alone hardly ever moves the split (a trial neither clearly faster nor clearly
   slower is measured for up to ``TRIAL_WINDOWS`` windows, pooled, and the best split again in turn with it); then
   the next trial moves as much the same way. A trial that is not kept (too far, or within the noise) halves the
   move, from the best split.
4. It **settles** below ``smallest`` (or after ``max_trials``): the best split stays. While settled, two windows in a
   row whose levels differ from the settled one the same way by ``drift`` and beyond the noise margin, or in which
   the same rank is evidently late (a throttle that comes or goes), start it again.

The split changes only between steps (the caller adopts it at a window's end), so every global batch is still
whole and every sample used once while it searches.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

# Standard errors of a difference of levels a trial must clear (with the relative threshold) to be kept: one-sided,
# a move the late rank's arrivals already point to (about 1 in 40 trials of no gain is kept by noise alone)...
TRIAL_SIGMAS = 2.0
# ... and that a settled level must differ by to count as a drift, or a late rank to be late (two-sided, no prior).
NOISE_MARGIN_SIGMAS = 3.0
# A rank is late by at least this many seconds and this share of the window's level (not the exchange's jitter).
LATE_SECONDS, LATE_LEVEL_SHARE = 1e-3, 0.03
# Every rank waiting inside the exchange for at least this share of the step: the cost model does not explain it...
EXCHANGE_SHARE = 0.25
# A rank whose wall time before the exchange exceeds its compute by this share of the step more than another rank's
# does is held by something its compute clock does not see (a CPU quota, another process on its core). A difference,
# not a ratio: every rank's loop pays about the same work besides its compute (the loader's hand-over, Lightning's
# hooks, the update) whatever its share, and over a small compute that work alone makes a large ratio (an emulated
# slow device's fast peer read as held, its arrivals then counted and the re-plan delayed).
HELD_STEP_SHARE = 0.15
# A rank the kernel held (runnable, not running) longer than another by this share of the step is still under what held
# it before (a CPU quota), though its arrival no longer shows it.
KERNEL_HELD_STEP_SHARE = 0.05
# A trial neither clearly faster nor clearly slower is measured for up to this many windows (pooled) before it is
# judged on what it has.
TRIAL_WINDOWS = 3
# A median's standard error is sqrt(pi / 2) times the mean's for normal data; MAD * 1.4826 estimates sigma.
_MEDIAN_EFFICIENCY, _MAD_TO_SIGMA = 1.2533, 1.4826


@dataclass(frozen=True)
class Window:
    """One window's steps under one split: the split, the level of its step time and the level's standard error,
    the ranks that arrived last and first at the exchange (None: no rank was consistently late) and by how much, and
    the rank held beyond the others (:func:`held_beyond_others`)."""

    split: tuple[int, ...]
    level: float
    error: float
    late: Optional[int] = None
    early: Optional[int] = None
    lateness: float = 0.0  # the late rank's median arrival less the early rank's (0 where not from the arrivals)
    lateness_error: float = 0.0  # ... its standard error
    held: Optional[int] = None  # the rank held beyond the others by what its compute clock does not see, if any


def level_of(step_seconds: Sequence[float]) -> tuple[float, float]:
    """The median of ``step_seconds`` and its standard error (from the median absolute deviation)."""
    level = statistics.median(step_seconds)
    if len(step_seconds) < 2:
        return level, math.inf
    spread = _MAD_TO_SIGMA * statistics.median(abs(value - level) for value in step_seconds)
    return level, _MEDIAN_EFFICIENCY * spread / math.sqrt(len(step_seconds))


def late_and_early(arrivals: Sequence[Sequence[float]], level: float) -> tuple[Optional[int], Optional[int]]:
    """The rank with the latest median arrival at the exchange over the steps (``arrivals[t][r]``) and the rank with
    the earliest, when the difference of their medians is beyond the noise (``NOISE_MARGIN_SIGMAS`` standard errors of
    it), and at least ``LATE_SECONDS`` and ``LATE_LEVEL_SHARE`` of ``level``; (None, None) otherwise."""
    late, early, _, _ = lateness_of(arrivals, level)
    return late, early


def lateness_of(arrivals: Sequence[Sequence[float]], level: float) -> tuple[Optional[int], Optional[int], float, float]:
    """:func:`late_and_early`, with the difference of the two ranks' median arrivals and its standard error (0, 0
    where no rank is late)."""
    timed = [step for step in arrivals if len(step) > 1 and min(step) > 0]
    if len(timed) < 2:
        return None, None, 0.0, 0.0
    ranks = range(len(timed[0]))
    levels = [level_of([step[rank] for step in timed]) for rank in ranks]
    late = max(ranks, key=lambda rank: levels[rank][0])
    early = min(ranks, key=lambda rank: levels[rank][0])
    lateness, error = levels[late][0] - levels[early][0], math.hypot(levels[late][1], levels[early][1])
    if lateness < max(LATE_SECONDS, LATE_LEVEL_SHARE * level, NOISE_MARGIN_SIGMAS * error):
        return None, None, 0.0, 0.0
    return late, early, lateness, error


def unexplained_seconds(steps: Sequence[dict[str, Any]]) -> list[float]:
    """Each rank's median wall time before the gradient exchange that its compute does not explain (its arrival
    minus its compute), over the ``steps`` (report entries) in which every rank's arrival and compute were measured;
    empty where none was."""
    timed = [
        step
        for step in steps
        if len(step.get("arrival_seconds", ())) > 1
        and min(step["arrival_seconds"]) > 0
        and min(step["compute_seconds"]) > 0
    ]
    if not timed:
        return []
    ranks = range(len(timed[0]["arrival_seconds"]))
    return [
        statistics.median(step["arrival_seconds"][rank] - step["compute_seconds"][rank] for step in timed)
        for rank in ranks
    ]


def held_beyond_others(steps: Sequence[dict[str, Any]], step_time: float) -> tuple[Optional[int], Optional[int]]:
    """The rank whose wall time before the exchange its compute explains least (:func:`unexplained_seconds`) and the
    rank it explains most, when the first's unexplained time exceeds the second's by at least ``LATE_SECONDS`` and
    ``HELD_STEP_SHARE`` of ``step_time``; (None, None) otherwise."""
    unexplained = unexplained_seconds(steps)
    if not unexplained:
        return None, None
    ranks = range(len(unexplained))
    most, least = max(ranks, key=unexplained.__getitem__), min(ranks, key=unexplained.__getitem__)
    if unexplained[most] - unexplained[least] < max(LATE_SECONDS, HELD_STEP_SHARE * step_time):
        return None, None
    return most, least


def kernel_holds_more(steps: Sequence[dict[str, Any]], rank: int) -> bool:
    """Whether the kernel held ``rank`` (runnable, not running: its ``held_seconds``) longer per step than the rank it
    held least, by at least ``LATE_SECONDS`` and ``KERNEL_HELD_STEP_SHARE`` of the median step, over the ``steps``
    (report entries); False where it was not measured. A rank under a CPU quota shows it even at a share small enough
    that its work fits the quota before the exchange (at 40 %, with 1-50 of 512 samples: 3-5 ms of a 20 ms step, the
    other rank 0.2 ms), where its arrival no longer does."""
    timed = [step for step in steps if len(step.get("held_seconds", ())) > rank and step.get("step_seconds")]
    if len(timed) < 3:
        return False
    ranks = range(len(timed[0]["held_seconds"]))
    held = [statistics.median(step["held_seconds"][other] for step in timed) for other in ranks]
    step_time = statistics.median(step["step_seconds"] for step in timed)
    return held[rank] - min(held) >= max(LATE_SECONDS, KERNEL_HELD_STEP_SHARE * step_time)


def held_and_free(steps: Sequence[dict[str, Any]], level: float) -> tuple[Optional[int], Optional[int]]:
    """Where every rank waits long inside the exchange (the least of the ranks' times in it is at least
    ``EXCHANGE_SHARE`` of the level: the step is not the slowest rank's own work, as the cost model has it), the rank
    held beyond the others (:func:`held_beyond_others`: a CPU quota that lands in the exchange and the update as much
    as in its compute) and the one held least; (None, None) otherwise."""
    timed = [step for step in steps if len(step.get("exchange_seconds", ())) > 1 and min(step["arrival_seconds"]) > 0]
    if len(timed) < 2 or statistics.median(min(step["exchange_seconds"]) for step in timed) < EXCHANGE_SHARE * level:
        return None, None
    return held_beyond_others(timed, level)


def cost_model_leaves_unexplained(steps: Sequence[dict[str, Any]]) -> bool:
    """Whether the re-planner's cost model leaves the step unexplained over these ``steps`` (report entries under the
    split in use): some rank is held beyond the others by what its compute clock does not see
    (:func:`held_beyond_others`), or every rank waits long inside the exchange (``EXCHANGE_SHARE`` of the median step)
    while the kernel holds one rank longer than the others (:func:`kernel_holds_more`: a quota that lands in the
    exchange). Elsewhere the cost model balances what the ranks take. A rank late at the exchange is then late by what
    no split removes (an emulated delay paid just before it, a core the machine's other work lands on), and a long
    exchange that no rank's hold explains is the all-reduce's own time (5.6 of a 19.6 ms step under `emulate_speeds`
    here, or a slow link's sends): the search would try splits that are no faster, at a cost (3-10 % of the step on
    identical ranks and under `emulate_speeds`; a new split's first step is several times the others')."""
    timed = [step for step in steps if len(step.get("arrival_seconds", ())) > 1 and min(step["arrival_seconds"]) > 0]
    if len(timed) < 3:
        return False
    step_time = statistics.median(step["step_seconds"] for step in timed)
    if held_beyond_others(timed, step_time)[0] is not None:
        return True
    inside = [min(step.get("exchange_seconds", (0.0,))) for step in timed]
    if statistics.median(inside) < EXCHANGE_SHARE * step_time:
        return False
    return any(kernel_holds_more(timed, rank) for rank in range(len(timed[0]["arrival_seconds"])))


def window_of(steps: Sequence[dict[str, Any]]) -> Optional[Window]:
    """A :class:`Window` from report steps (the run report's entries) all under one split, the first left out;
    None when fewer than 3 remain, or they are not under one split. Its late and early ranks are the arrivals' at the
    exchange (:func:`late_and_early`), else the held and free ones where every rank waits in it
    (:func:`held_and_free`)."""
    kept = list(steps[1:])
    if len(kept) < 3 or len({tuple(step["batch_sizes"]) for step in kept}) != 1:
        return None
    level, error = level_of([step["step_seconds"] for step in kept])
    late, early, lateness, lateness_error = lateness_of([step.get("arrival_seconds", ()) for step in kept], level)
    if late is None:
        late, early = held_and_free(kept, level)
    held = held_beyond_others(kept, level)[0] if all("compute_seconds" in step for step in kept) else None
    return Window(tuple(kept[0]["batch_sizes"]), level, error, late, early, lateness, lateness_error, held)


def moved(
    split: Sequence[int], source: int, target: int, samples: int, ceiling: Optional[int] = None
) -> Optional[tuple[int, ...]]:
    """``split`` with ``samples`` moved from rank ``source`` to rank ``target``, leaving ``source`` at least one and
    ``target`` within its memory ``ceiling``; None when it cannot move any."""
    samples = min(samples, split[source] - 1, ceiling - split[target] if ceiling is not None else samples)
    if samples < 1 or source == target:
        return None
    result = list(split)
    result[source] -= samples
    result[target] += samples
    return tuple(result)


@dataclass
class StepSearch:
    """The search's state between windows (see the module docstring); :meth:`decide` is the whole decision."""

    global_batch: int
    ceilings: tuple[Optional[int], ...] = ()  # each rank's memory ceiling in samples (None, or none given: no limit)
    threshold: float = 0.01  # a trial is kept only this much faster (plus the noise margin)
    drift: float = 0.05  # a settled level that moves this much (and beyond the noise margin) starts a new search
    max_trials: int = 12  # trials per search, at most: the exploration's budget
    first_move: int = 0  # samples the first trial moves (0: an eighth of the global batch)
    smallest: int = 0  # the search settles below this move (0: a 64th of the global batch, at least 1)
    best: Optional[Window] = None
    trial: Optional[tuple[int, ...]] = None
    direction: Optional[tuple[int, int]] = None  # (from rank, to rank)
    move: int = 0
    trials: int = 0
    drifting: int = 0  # while settled, the last window's sign of drift: +1 slower, -1 faster, 2 + r rank r late; 0
    searches: int = 0  # searches started
    _measured: Optional[Window] = None  # the trial's windows so far, pooled
    _windows: int = 0  # ... how many
    _best_windows: int = 0  # windows pooled into the best split's level
    _rechecking: bool = False  # the best split is being measured again for an undecided trial
    said: Optional[str] = None  # "started" or "settled" by the last decision (for the caller's line), else None
    settled: bool = False
    # The window the search settled on (its late rank and lateness, which do not start it again while they last)
    _settled_on: Optional[Window] = None
    history: list[dict[str, Any]] = field(default_factory=list)  # each decision, for the report

    def __post_init__(self) -> None:
        self.first_move = self.first_move or max(1, self.global_batch // 8)
        self.smallest = self.smallest or max(1, self.global_batch // 64)

    @property
    def holds(self) -> bool:
        """The split in use is the search's: it is measuring a trial, or it kept one (measured faster than where the
        cost model left it). The cost model's re-plans wait until a drift starts the search again."""
        return self.trial is not None or self._rechecking or any(entry.get("kept") for entry in self._this_search())

    def _this_search(self) -> list[dict[str, Any]]:
        return self.history[len(self.history) - self.trials :] if self.trials else []

    def reset(self) -> None:
        """The split was changed by something else (the cost model's re-plan, a checkpoint): start from nothing."""
        self.best, self.trial, self.direction, self.settled = None, None, None, False
        self.move, self.trials, self.drifting, self._measured, self._windows = 0, 0, 0, None, 0
        self._best_windows, self._rechecking, self._settled_on = 0, False, None

    def decide(self, window: Window) -> Optional[tuple[int, ...]]:
        """The split to run from the next step on, given the window just measured (under the split in use); None
        keeps it."""
        self.said = None
        was_settled = self.settled
        decided = self._decide(window)
        if self.settled and not was_settled and self.searches:
            self.said = "settled"
        return decided

    def _decide(self, window: Window) -> Optional[tuple[int, ...]]:
        if self._rechecking:  # the best split measured again, for a trial that its one window could not decide
            self._rechecking = False
            if self.best is None or window.split != self.best.split:
                self.reset()
                return None
            self.best, self._best_windows = _pooled(self.best, window), self._best_windows + 1
            return self._verdict(on_trial=False)
        if self.trial is not None:
            if window.split != self.trial:  # (the split was changed by something else meanwhile)
                self.reset()
                return None
            self._measured = _pooled(self._measured, window) if self._measured is not None else window
            self._windows += 1
            return self._verdict(on_trial=True)
        if self.best is None or window.split != self.best.split:
            self.best, self.settled, self._best_windows = window, False, 1
            return self._start(window)
        if self.settled:
            # A drift: the level moved, or a rank is evidently late, the same way two windows in a row (a throttle
            # that lifts may leave the settled split's step as it was, with the other rank now the late one).
            late = window.late if self._late_anew(window) else None
            sign = self._drift_sign(window, self.best) or (2 + late if late is not None else 0)
            if sign and sign == self.drifting:
                self.best, self.settled, self.trials, self.drifting, self._best_windows = window, False, 0, 0, 1
                return self._start(window)
            self.drifting = sign
            if not sign:
                self.best = _pooled(self.best, window)
            return None
        return self._start(window)

    def _start(self, window: Window) -> Optional[tuple[int, ...]]:
        if window.late is None or window.early is None:
            self._settle()  # (nothing says which way: stay)
            return None
        self.direction, self.searches = (window.late, window.early), self.searches + 1
        # Toward a held rank, a quarter of the first move: past the share its quota carries its step jumps by a
        # period of the quota, so a large trial lands beyond and costs a window of slow steps; from it, the full one.
        self.move = max(self.smallest, self.first_move // 4) if window.early == window.held else self.first_move
        self.said = "started"
        return self._try()

    def _settle(self) -> None:
        self.settled, self.trial, self._settled_on = True, None, self.best

    def _late_anew(self, window: Window) -> bool:
        """A rank is evidently late in ``window`` (under the settled split), and not as it already was when the search
        settled there (the same rank, late by no more than then beyond the noise): a settled split that leaves the
        same rank last by the same margin is what the search found best, and searching again from it would try
        the moves it has just measured (a held rank given more past its quota's share, every few windows)."""
        if window.late is None:
            return False
        settled_on = self._settled_on
        if settled_on is None or settled_on.late != window.late:
            return True
        margin = max(LATE_SECONDS, NOISE_MARGIN_SIGMAS * math.hypot(window.lateness_error, settled_on.lateness_error))
        return window.lateness > settled_on.lateness + margin

    def _try(self) -> Optional[tuple[int, ...]]:
        assert self.best is not None and self.direction is not None
        while self.move >= self.smallest and self.trials < self.max_trials:
            target = self.direction[1]
            ceiling = self.ceilings[target] if target < len(self.ceilings) else None
            trial = moved(self.best.split, *self.direction, self.move, ceiling)
            if trial is not None:
                self.trial, self.trials = trial, self.trials + 1
                self.history.append({"search": self.searches, "tried": list(trial), "from": list(self.best.split)})
                return trial
            self.move //= 2
        self._settle()
        return None

    def _verdict(self, on_trial: bool) -> Optional[tuple[int, ...]]:
        """Keep the trial (faster beyond the margin), drop it (slower beyond it, or undecided with every window
        measured), or measure on: the trial again, or the best split again (``on_trial``: the split in use is the
        trial's, else the best's)."""
        assert self.best is not None and self.trial is not None and self._measured is not None
        measured, margin = self._measured, self._margin(self._measured, self.best, TRIAL_SIGMAS)
        faster = measured.level < self.best.level * (1 - self.threshold) - margin
        slower = measured.level > self.best.level + margin
        if not (faster or slower):
            if self._windows < TRIAL_WINDOWS:
                return None if on_trial else self.trial  # (one more window of the trial)
            if self._best_windows < TRIAL_WINDOWS:
                self._rechecking = True  # (one more window of the best split: the two measured in turns)
                return self.best.split
        trial_windows, self.trial, self._measured, self._windows = self._windows, None, None, 0
        if faster:
            self.history[-1]["kept"] = True
            self.best, self._best_windows = measured, trial_windows
            return self._try()
        self.history[-1]["kept"] = False
        self.move //= 2
        following = self._try()
        if following is not None:
            return following
        return self.best.split if on_trial else None  # (back to the best split, or already on it)

    def _margin(self, a: Window, b: Window, sigmas: float = NOISE_MARGIN_SIGMAS) -> float:
        return sigmas * math.hypot(a.error, b.error)

    def _drift_sign(self, window: Window, settled: Window) -> int:
        """+1 (-1): ``window`` is slower (faster) than the settled level by ``drift`` and beyond the noise; else 0."""
        difference = window.level - settled.level
        beyond = abs(difference) > max(self.drift * settled.level, self._margin(window, settled))
        return (1 if difference > 0 else -1) if beyond else 0


def _pooled(a: Window, b: Window) -> Window:
    """Two windows of the same split as one level (inverse-variance weighted), so a settled level firms up."""
    if not (math.isfinite(a.error) and math.isfinite(b.error)) or a.error == 0 or b.error == 0:
        return b
    wa, wb = 1 / a.error**2, 1 / b.error**2
    level = (a.level * wa + b.level * wb) / (wa + wb)
    return replace(b, level=level, error=1 / math.sqrt(wa + wb))
