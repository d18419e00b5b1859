"""Plan: how one global batch of ``B`` samples is split into per-rank micro-batches.

Everything here is a pure function (values in, values out; no process group, no clock), so it is tested
exhaustively and the strategy only calls it. Two groups of checks exist because the constructor does not know the
world size yet: :func:`check_split_arguments` runs in ``HeteroStrategy.__init__``; :func:`resolve_split`
runs at setup on every rank, before any collective, with the world size and the global batch known.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Optional

from lightning_hetero.runtime.checks import check_one_per_rank, check_positive_int, per_rank_list
from lightning_hetero.runtime.checks import is_int as _is_int
from lightning_hetero.runtime.checks import is_real as _is_real


@dataclass(frozen=True)
class SplitPlan:
    """Each rank's samples of one global batch, in how many micro-batches it takes them, and where that came from.

    ``batch_sizes[r]`` is every sample rank ``r`` takes per global batch (what its loader cuts and its loss weight
    counts); with ``micro_steps[r] = k > 1`` it takes them in ``k`` forward/backward passes of
    :func:`micro_batch_sizes` before the optimizer step (a memory ceiling below its share).
    """

    batch_sizes: tuple[int, ...]
    source: str  # "batch_sizes", "weights" or "equal": which argument decided the split
    micro_steps: tuple[int, ...] = ()  # k_r per rank; () means one per rank

    def __post_init__(self) -> None:
        steps = tuple(int(k) for k in self.micro_steps) or (1,) * len(self.batch_sizes)
        if len(steps) != len(self.batch_sizes) or any(k < 1 or k > n for k, n in zip(steps, self.batch_sizes)):
            raise ValueError(
                f"micro_steps {list(steps)} do not fit the samples per rank {list(self.batch_sizes)}: one count per"
                " rank, each between 1 and the rank's samples."
            )
        object.__setattr__(self, "micro_steps", steps)

    @property
    def has_micro_steps(self) -> bool:
        return any(k > 1 for k in self.micro_steps)

    @property
    def micro_batches(self) -> tuple[int, ...]:
        """Each rank's largest micro-batch: what its memory must hold."""
        return tuple(-(-n // k) for n, k in zip(self.batch_sizes, self.micro_steps))

    @property
    def global_batch_size(self) -> int:
        return sum(self.batch_sizes)

    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

    def shares(self) -> tuple[float, ...]:
        total = self.global_batch_size
        return tuple(b / total for b in self.batch_sizes)

    def loss_weight(self, rank: int, loss_reduction: str = "mean") -> float:
        """Factor on rank ``rank``'s loss that makes DeepSpeed's update the one DDP makes: see :func:`loss_weight`."""
        return loss_weight(self.batch_sizes[rank], self.global_batch_size, self.world_size, loss_reduction)


def loss_weight(local_samples: float, global_samples: float, world_size: int, loss_reduction: str = "mean") -> float:
    """The factor on a rank's loss under which DeepSpeed's update is DDP's, whatever the split.

    DeepSpeed divides the summed gradients by the world size ``W`` whatever each rank's batch was. For a loss that is
    the mean over the rank's ``b_r`` samples (``loss_reduction="mean"``), DDP's update is the gradient of the mean over
    all ``B`` samples, so the rank counts ``b_r * W / B`` times its own mean. For a loss that is the sum over its
    samples (``"sum"``), DDP's update is the gradient of the global sum divided by ``W``: exactly DeepSpeed's
    average of the ranks' sums, so the factor is 1. For ``"token_mean"`` the counts are tokens, not samples: a rank
    whose loss is the mean over its ``n_r`` tokens counts ``n_r * W / N`` times, so the update is the gradient of the
    mean over all ``N`` tokens of the global batch (what one process computes on it; DDP's average of per-rank token
    means is not that when the ranks' token counts differ). ``N`` is 0 when no rank has a token: the factor is then 0.
    """
    if loss_reduction == "sum":
        return 1.0
    return local_samples * world_size / global_samples if global_samples else 0.0


def micro_batch_sizes(samples: int, micro_steps: int) -> list[int]:
    """``samples`` cut into ``min(micro_steps, samples)`` micro-batches as equal as possible (the larger first), none
    empty: a short last global batch gives a rank fewer samples than its micro-steps."""
    count = max(1, min(micro_steps, samples))
    size, larger = divmod(samples, count)
    return [size + 1] * larger + [size] * (count - larger)


def split_by_weights(total: int, weights: Sequence[float], minimum: int = 1) -> list[int]:
    """Integer parts of ``total`` proportional to ``weights``, each at least ``minimum``, summing to ``total``.

    Largest-remainder (Hamilton) apportionment: every part is the floor or the ceiling of its exact quota
    ``total * w / sum(w)`` unless the ``minimum`` lifts it. Ties go to the lower rank, so every rank computes the
    same split. Requires ``total >= minimum * len(weights)``.
    """
    count = len(weights)
    if count == 0:
        raise ValueError("split_by_weights needs at least one weight")
    if total < minimum * count:
        raise ValueError(f"cannot split {total} into {count} parts of at least {minimum} each")
    bad = [w for w in weights if not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0]
    if bad:
        raise ValueError(f"split_by_weights needs finite weights > 0, got {list(weights)} (bad: {bad})")
    # Exact rational quotas: no overflow for huge weights, no rounding that could move a part off its floor/ceil or
    # turn a tie into a non-tie (every rank must compute the same split).
    exact = [Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(float(w)) for w in weights]
    weight_sum = sum(exact)
    quotas = [total * w / weight_sum for w in exact]
    parts = [max(minimum, math.floor(q)) for q in quotas]
    excess = sum(parts) - total
    # Too many: take back from the parts furthest above their quota (never below the minimum); on a tie the higher
    # rank gives one back, so the lower rank keeps the larger part as in the hand-out below.
    while excess > 0:
        candidates = [i for i in range(count) if parts[i] > minimum]
        i = max(candidates, key=lambda i: (parts[i] - quotas[i], i))
        parts[i] -= 1
        excess -= 1
    # Too few: hand out to the largest remainders.
    order = sorted(range(count), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[: -excess if excess < 0 else 0]:
        parts[i] += 1
    return parts


def check_split_arguments(
    global_batch_size: Optional[int],
    batch_sizes: Optional[Sequence[int]],
    weights: Optional[Sequence[float]],
    micro_steps: Optional[Sequence[int]] = None,
) -> None:
    """Checks that need no world size: run them in the constructor so a mistake fails before any process starts."""
    if micro_steps is not None:
        micro_steps = positive_integers_per_rank(
            "micro_steps",
            micro_steps,
            "[3, 1]",
            "one count of micro-batches",
            "each rank takes a whole number >= 1 of micro-batches per optimizer step (1: its whole share in one"
            " forward/backward)",
        )
        if batch_sizes is not None and len(per_rank_list("batch_sizes", batch_sizes, "[8, 24]")) != len(micro_steps):
            raise ValueError(
                f"`batch_sizes={list(batch_sizes)}` and `micro_steps={list(micro_steps)}` have different lengths:"
                " give one micro-batch size and one micro-step count per rank, in global rank order."
            )
    if batch_sizes is not None and weights is not None:
        raise ValueError(
            f"HeteroStrategy got both `batch_sizes={batch_sizes!r}` and `weights={weights!r}`."
            " Pass one of them: `batch_sizes` fixes each rank's micro-batch, `weights` derives them."
        )
    if global_batch_size is not None:
        check_positive_int(
            "global_batch_size",
            global_batch_size,
            " (samples per optimizer step across all ranks), or"
            " None to use the training loader's batch_size times the world size.",
        )
    if batch_sizes is not None:
        batch_sizes = positive_integers_per_rank(
            "batch_sizes",
            batch_sizes,
            "[8, 24]",
            "one micro-batch size",
            "every rank needs an integer micro-batch of at least 1. Raise those entries, or leave the rank out of the"
            " job",
        )
        steps = list(micro_steps) if micro_steps is not None else [1] * len(batch_sizes)
        total = sum(b * k for b, k in zip(batch_sizes, steps))
        if global_batch_size is not None and total != global_batch_size:
            described = "sums to" if micro_steps is None else f"with `micro_steps={steps}` makes (sum of b * k)"
            raise ValueError(
                f"`batch_sizes={list(batch_sizes)}` {described} {total} but `global_batch_size="
                f"{global_batch_size}`. Make them agree, or drop `global_batch_size` (it is then the sum)."
            )
    if weights is not None:
        weights = per_rank_list("weights", weights, "[1.0, 0.4]")
        if len(weights) == 0:
            raise ValueError("`weights=[]` is empty: give one relative capability per rank, e.g. [1.0, 0.4].")
        bad_weights = [w for w in weights if not _is_real(w) or not math.isfinite(w) or w <= 0]
        if bad_weights:
            raise ValueError(
                f"`weights={list(weights)}` holds {bad_weights}: each weight must be a finite number > 0"
                " (a relative capability such as 1.0 for the fastest rank and 0.4 for a slower one)."
            )


def positive_integers_per_rank(name: str, value: Any, example: str, what: str, rule: str) -> list[int]:
    """``value`` as a non-empty per-rank list of integers >= 1, or a ValueError naming ``name``, its value, ``rule``."""
    values = per_rank_list(name, value, example)
    if len(values) == 0:
        raise ValueError(f"`{name}=[]` is empty: give {what} per rank, e.g. {example}.")
    bad = [v for v in values if not _is_int(v) or v < 1]
    if bad:
        raise ValueError(f"`{name}={list(values)}` holds {bad}: {rule}.")
    return list(values)


def check_global_batch_covers_ranks(global_batch_size: int, world_size: int) -> None:
    """Every rank needs at least one sample of each global batch."""
    if global_batch_size < world_size:
        raise ValueError(
            f"`global_batch_size={global_batch_size}` is smaller than the world size {world_size}: every rank needs"
            f" at least one sample per step. Use a global batch of at least {world_size}, or fewer devices."
        )


def resolve_split(
    world_size: int,
    global_batch_size: int,
    batch_sizes: Optional[Sequence[int]] = None,
    weights: Optional[Sequence[float]] = None,
    micro_steps: Optional[Sequence[int]] = None,
) -> SplitPlan:
    """The split for a job of ``world_size`` ranks: explicit sizes, sizes derived from weights, or an equal split.

    With ``micro_steps``, ``batch_sizes`` are micro-batches (rank ``r`` takes ``b_r * k_r`` samples per step); a split
    derived from weights or equal gives each rank its share in ``k_r`` micro-batches.
    """
    check_split_arguments(global_batch_size, batch_sizes, weights, micro_steps)
    if micro_steps is not None:
        check_one_per_rank(
            f"`micro_steps={list(micro_steps)}`",
            len(micro_steps),
            world_size,
            "Give exactly one micro-step count per rank, in global rank order.",
        )
    steps = tuple(int(k) for k in micro_steps) if micro_steps is not None else (1,) * world_size
    if batch_sizes is not None:
        check_one_per_rank(
            f"`batch_sizes={list(batch_sizes)}`",
            len(batch_sizes),
            world_size,
            "Give exactly one micro-batch size per rank (in global rank order), or use `weights`.",
        )
    if weights is not None:
        check_one_per_rank(
            f"`weights={list(weights)}`",
            len(weights),
            world_size,
            "Give exactly one weight per rank, in global rank order.",
        )
    check_global_batch_covers_ranks(global_batch_size, world_size)
    if batch_sizes is not None:
        return SplitPlan(tuple(int(b) * k for b, k in zip(batch_sizes, steps)), "batch_sizes", steps)
    source = "weights" if weights is not None else "equal"
    samples = tuple(split_by_weights(global_batch_size, weights if weights is not None else [1.0] * world_size))
    check_every_micro_batch_has_a_sample(samples, steps, f"the {source} split")
    return SplitPlan(samples, source, steps)


def check_every_micro_batch_has_a_sample(samples: Sequence[int], micro_steps: Sequence[int], split: str) -> None:
    """A rank given fewer samples than its micro-steps (by ``split``, e.g. "the equal split") is named."""
    short = [rank for rank, (n, k) in enumerate(zip(samples, micro_steps)) if n < k]
    if short:
        rank = short[0]
        raise ValueError(
            f"`micro_steps={list(micro_steps)}`: {split} gives rank {rank} {samples[rank]} samples of the global batch"
            f" of {sum(samples)} ({list(samples)}), fewer than its {micro_steps[rank]} micro-steps. Lower its"
            " micro-steps, or raise the global batch."
        )
