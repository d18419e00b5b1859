"""Measure: a rank's cost model: predicted step time ``fixed + per_sample * b`` and the largest micro-batch that
fits in its memory, as a profile or a re-plan measures them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lightning_hetero.runtime.checks import is_int as _is_int
from lightning_hetero.runtime.checks import is_real as _is_real

# ---------------------------------------------------------------------------------------------------------------------
# Planner: the split of one global batch that minimises the slowest rank's predicted step time.
#
# Every rank waits for the slowest at each optimizer step, so the step takes max_r time_r(b_r). `plan_min_max` finds
# integer sizes minimising that maximum exactly. It never loops over samples: it searches the one number that decides
# the answer, the time level below which every sample is taken (see `_lowest_sufficient_level`), in at most 64
# feasibility checks of O(W) time evaluations each (a few more per rank only where rounding flattens its times), and
# only ever compares values that `CostModel.time` itself returns, so floating-point rounding cannot make it disagree
# with an evaluation of the split it returns.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Predicted step time of one rank as a function of its micro-batch size ``b``: ``fixed + per_sample * b`` seconds.

    ``fixed`` is what a step costs whatever the batch (optimizer step, communication, launch overheads), ``per_sample``
    the cost of one more sample, and ``max_batch`` the largest micro-batch that fits in the device's memory (None: no
    ceiling known). The fields are stored as ``float``/``int`` so that every rank evaluates the same IEEE expression.
    """

    fixed: float
    per_sample: float
    max_batch: Optional[int] = None

    def __post_init__(self) -> None:
        if not _is_real(self.fixed) or not math.isfinite(self.fixed) or self.fixed < 0:
            raise ValueError(
                f"CostModel `fixed={self.fixed!r}` must be a finite number of seconds >= 0 (the part of a step that"
                " does not depend on the micro-batch size)."
            )
        if not _is_real(self.per_sample) or not math.isfinite(self.per_sample) or self.per_sample <= 0:
            raise ValueError(
                f"CostModel `per_sample={self.per_sample!r}` must be a finite number of seconds > 0 (what one more"
                " sample adds to a step); a rank whose step time does not grow with its batch cannot be balanced."
            )
        if self.max_batch is not None:
            if not _is_int(self.max_batch):
                raise ValueError(
                    f"CostModel `max_batch={self.max_batch!r}` must be an integer (the largest micro-batch that fits"
                    " in the device's memory) or None when no ceiling is known."
                )
            if self.max_batch < 1:
                raise ValueError(
                    f"CostModel `max_batch={self.max_batch}`: the device cannot hold even one sample, so it cannot"
                    " take part in data-parallel training. Leave it out of the job, or free memory on it (a larger"
                    " ZeRO stage, offloading, activation checkpointing)."
                )
        # An int `fixed` or `per_sample` would make time() exact integer arithmetic, whose values the planner's search
        # over floats could step over; store floats so time() is one IEEE expression everywhere.
        object.__setattr__(self, "fixed", float(self.fixed))
        object.__setattr__(self, "per_sample", float(self.per_sample))

    def time(self, batch_size: int) -> float:
        """Predicted seconds for one step with a micro-batch of ``batch_size`` samples (ignores ``max_batch``)."""
        return self.fixed + self.per_sample * batch_size

    def largest_batch_within(self, time_limit: float, cap: int) -> int:
        """The largest ``b <= min(cap, max_batch)`` with ``time(b) <= time_limit``; 0 if even one sample is too slow.

        The closed form ``(time_limit - fixed) / per_sample`` can be off by rounding, so it is only a starting guess:
        the answer is settled by comparing ``time(b)`` itself, which never decreases as ``b`` grows (IEEE
        multiplication and addition are monotone), using a galloping search that costs two evaluations when the guess
        is right and O(log(error)) otherwise.
        """
        high = cap if self.max_batch is None else min(cap, self.max_batch)
        if high < 1:
            return 0
        quotient = (time_limit - self.fixed) / self.per_sample
        # `quotient >= high` also catches inf; below 1 start from 0 and let the search try b = 1 itself.
        if quotient >= high:
            guess = high
        elif quotient >= 1:
            guess = int(quotient)
        else:
            guess = 0
        return last_true(lambda b: self.time(b) <= time_limit, guess, high)


def last_true(holds, guess: int, high: int) -> int:
    """The largest ``k`` in ``[0, high]`` with ``holds(k)``, for a ``holds`` that is true up to some point, then false.

    ``holds(0)`` is taken to be true and never called. Gallops from ``guess`` (doubling steps towards the boundary),
    then bisects the bracket found, so a good guess costs one or two calls.
    """
    if guess == 0 or holds(guess):
        good, step = guess, 1
        while True:
            probe = good + step
            if probe > high:
                bad = high + 1
                break
            if not holds(probe):
                bad = probe
                break
            good, step = probe, step * 2
    else:
        bad, step = guess, 1
        while True:
            probe = bad - step
            if probe < 1:
                good = 0
                break
            if holds(probe):
                good = probe
                break
            bad, step = probe, step * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        if holds(middle):
            good = middle
        else:
            bad = middle
    return good
