"""Watch: is ``training_step``'s loss a mean over its batch or a sum, as ``loss_reduction`` says?

The weight that makes unequal micro-batches train like DDP depends on it (``b_r * W / B`` for a mean, 1 for a sum),
and a wrong ``loss_reduction`` trains differently without any error. The automatic split learns it from its profile
(the loss of a batch given twice: :func:`~lightning_hetero.measure.rank_profile.loss_reduction_mismatch`); with a fixed
split (``batch_sizes``, ``weights``) nothing is profiled, so the first training steps tell instead: with a sum the
ranks' losses grow in proportion to their micro-batches, with a mean they do not.

Per step, the slope of log|loss| against log(samples) across the ranks is about 1 for a sum and 0 for a mean. The
check gathers each rank's first :data:`FIRST_CHECK` steps once (a second time at :data:`LAST_CHECK` if that was not
enough, or at the fit's end if it is shorter) and decides only when the mean slope is on one side of 1/2 beyond
the steps' spread (a one-sided 99.5 % bound), so a loss that varies a lot between batches gives no false warning,
only a later or no verdict.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

FIRST_CHECK, LAST_CHECK = 10, 40  # training steps recorded before each of the (at most two) gathers
MIN_STEPS = 3  # informative steps needed for a verdict (the spread needs a few)
_BOUNDARY = 0.5  # between a mean's slope (0) and a sum's (1)
# Student's t, one-sided 99.5 %, by degrees of freedom (steps - 1); 2.58 beyond the table (the normal's).
_T_995 = {
    2: 9.925,
    3: 5.841,
    4: 4.604,
    5: 4.032,
    6: 3.707,
    7: 3.499,
    8: 3.355,
    9: 3.250,
    10: 3.169,
    15: 2.947,
    20: 2.845,
    30: 2.750,
    40: 2.704,
}


@dataclass(frozen=True)
class LossScaling:
    """How the ranks' losses scaled with their micro-batches over the steps checked."""

    reduction: Optional[str]  # "sum", "mean", or None (undecided: too few informative steps, or too noisy)
    slope: float  # the mean per-step slope of log|loss| on log(samples): ~1 for a sum, ~0 for a mean
    steps: int  # informative steps (ranks with unequal micro-batches, every loss finite, non-zero, of one sign)
    smallest: float  # a step's smallest and largest micro-batch, and their losses (for the message)
    largest: float
    loss_of_smallest: float
    loss_of_largest: float


def _t_bound(degrees: int) -> float:
    known = [d for d in _T_995 if d <= degrees]
    return _T_995[max(known)] if known else math.inf


def loss_scaling(steps: Sequence[Sequence[tuple[float, ...]]]) -> LossScaling:
    """The verdict from ``steps[t][r] = (samples, loss)``: rank ``r``'s micro-batch size and loss at step ``t`` (NaN
    where unknown; a rank that took several micro-batches gives their geometric means).

    A step counts when the ranks' micro-batches differ and every loss is finite, non-zero and of one sign.
    """
    slopes: list[float] = []
    example = (math.nan,) * 4
    for ranks in steps:
        if len(ranks) < 2 or any(not (math.isfinite(s) and math.isfinite(v) and s > 0 and v != 0) for s, v in ranks):
            continue
        if len({math.copysign(1.0, v) for _, v in ranks}) != 1:
            continue
        x = [math.log(s) for s, _ in ranks]
        y = [math.log(abs(v)) for _, v in ranks]
        mean_x, mean_y = statistics.fmean(x), statistics.fmean(y)
        spread = sum((a - mean_x) ** 2 for a in x)
        if spread < 1e-12:  # equal micro-batches: a mean and a sum train alike, and cannot be told apart
            continue
        slopes.append(sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / spread)
        if len(slopes) == 1:
            small, large = min(ranks), max(ranks)
            example = (small[0], large[0], small[1], large[1])
    if not slopes:
        return LossScaling(None, math.nan, 0, *example)
    mean = statistics.fmean(slopes)
    reduction = None
    if len(slopes) >= MIN_STEPS:
        margin = _t_bound(len(slopes) - 1) * statistics.stdev(slopes) / math.sqrt(len(slopes))
        if mean - margin > _BOUNDARY:
            reduction = "sum"
        elif mean + margin < _BOUNDARY:
            reduction = "mean"
    return LossScaling(reduction, mean, len(slopes), *example)


def mismatch_warning(scaling: LossScaling, loss_reduction: str) -> Optional[str]:
    """The warning when the losses say the other reduction than ``loss_reduction`` (None when they agree or say
    nothing)."""
    if scaling.reduction is None or scaling.reduction == loss_reduction:
        return None
    seen = (
        f"over the first {scaling.steps} steps the ranks' losses scaled with their micro-batches at a slope of"
        f" {scaling.slope:.2f}, e.g. {scaling.smallest:g} samples: loss {scaling.loss_of_smallest:.4g},"
        f" {scaling.largest:g} samples: loss {scaling.loss_of_largest:.4g}"
    )
    if scaling.reduction == "sum":
        return (
            f"HeteroStrategy: `training_step`'s loss grows with the batch, as a sum over the batch does ({seen})."
            " But `loss_reduction='mean'`: with unequal micro-batches each rank's loss is weighted for a mean, and the"
            " update differs from DDP's. Pass `HeteroStrategy(loss_reduction='sum')` if the loss is a sum (e.g."
            " `reduction='sum'`), or make `training_step` return the mean."
        )
    return (
        f"HeteroStrategy: `training_step`'s loss does not grow with the batch, as a mean over the batch does ({seen})."
        " But `loss_reduction='sum'`: with unequal micro-batches the update differs from DDP's. Pass"
        " `loss_reduction='mean'` (the default) if the loss is a mean."
    )


class LossReductionCheck:
    """This rank's losses and micro-batch sizes over the fit's first steps, and the check of ``loss_reduction`` on them.

    Every rank calls :meth:`step_starts` at the start of each training step (the gathers happen there, at the same
    step on every rank) and :meth:`fit_ends` at the end of the fit; :meth:`loss` after each micro-batch's
    ``training_step``.
    """

    def __init__(self, loss_reduction: str, gather: Callable[[Tensor], list[Tensor]], warn: Callable[[str], Any]):
        self.loss_reduction = loss_reduction
        self._gather = gather
        self._warn = warn
        self._rows: list[tuple[float, float]] = []
        self._open: Optional[list[tuple[float, float]]] = None  # this step's (samples, |loss| with its sign)
        self._checked_at: set[int] = set()
        self.active = False
        self.verdict: Optional[LossScaling] = None

    def start(self, active: bool) -> None:
        """A fit starts: record its first steps when ``active`` (an unequal split that no profile checked)."""
        self.active = active and self.loss_reduction in ("mean", "sum")
        self._rows, self._open, self._checked_at, self.verdict = [], None, set(), None

    def step_starts(self) -> None:
        if not self.active:
            return
        self._close_step()
        if len(self._rows) in (FIRST_CHECK, LAST_CHECK):
            self._check()
        if self.active:
            self._open = []

    def loss(self, samples: Optional[int], loss: Any) -> None:
        """A micro-batch of ``samples`` gave ``loss`` (what ``training_step`` returned as its loss, or None)."""
        if not self.active or self._open is None:
            return
        value = math.nan
        if isinstance(loss, Tensor) and loss.numel() == 1:
            value = float(loss.detach().float())
        self._open.append((float(samples) if samples else math.nan, value))

    def fit_ends(self) -> None:
        if not self.active:
            return
        self._close_step()
        if len(self._rows) >= MIN_STEPS and len(self._rows) not in self._checked_at:
            self._check()
        self.active = False

    def _close_step(self) -> None:
        if self._open is None:
            return
        micro = self._open
        self._open = None
        usable = [(s, v) for s, v in micro if math.isfinite(s) and math.isfinite(v) and s > 0 and v != 0]
        if not micro or len(usable) != len(micro) or len({math.copysign(1.0, v) for _, v in usable}) != 1:
            self._rows.append((math.nan, math.nan))
            return
        if len(usable) == 1:
            self._rows.append(usable[0])
            return
        # Several micro-batches: their geometric means (a sum's loss still scales with the samples, a mean's not).
        sign = math.copysign(1.0, usable[0][1])
        samples = math.exp(statistics.fmean(math.log(s) for s, _ in usable))
        loss = sign * math.exp(statistics.fmean(math.log(abs(v)) for _, v in usable))
        self._rows.append((samples, loss))

    def _check(self) -> None:
        """One gather of every rank's rows (every rank has as many: the ranks step together)."""
        self._checked_at.add(len(self._rows))
        ranks = self._gather(torch.tensor(self._rows, dtype=torch.float64))
        steps = [[tuple(float(v) for v in rank[t]) for rank in ranks] for t in range(len(self._rows))]
        scaling = loss_scaling(steps)
        self.verdict = scaling
        if scaling.reduction is not None or len(self._rows) >= LAST_CHECK:
            self.active = False
            warning = mismatch_warning(scaling, self.loss_reduction)
            if warning:
                self._warn(warning)
