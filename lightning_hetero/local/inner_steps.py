"""Plan: local SGD and DiLoCo where fast ranks take more inner steps than slow ones between synchronizations.

With ``sync="local_sgd"`` or ``"diloco"`` the ranks exchange no gradient at every step: each trains on its own
micro-batches with its own (inner) optimizer, and every ``sync_every`` (H) training steps the ranks merge what they
learned. A training step (one Lightning batch, the same count on every rank) is one inner step of the slowest rank;
rank ``r`` takes ``inner_steps[r]`` inner steps in it, on ``inner_steps[r]`` micro-batches of its own, so a rank
``m`` times faster does ``m`` times the work in the same time instead of waiting. At a synchronization the ranks
average their pseudo-gradients (parameter deltas since the last one), each weighted by the samples it trained on,
and the outer step applies the average: plainly (local SGD: the weighted average of the parameters), or through an
outer SGD with Nesterov momentum (DiLoCo, Douillard et al. 2023).

Pure functions: the arguments checked, what the job refuses, the inner steps from the ranks' cost models, and the
synchronization schedule.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.runtime.checks import check_one_per_rank, check_positive_int, is_int, is_real, per_rank_list
from lightning_hetero.split.decisions.replan import Replan
from lightning_hetero.split.decisions.split import SplitPlan, split_by_weights

SYNC_MODES = ("every_step", "local_sgd", "diloco")
LOCAL_MODES = ("local_sgd", "diloco")
# DiLoCo's outer optimizer as its paper tuned it (outer SGD with Nesterov momentum, lr 0.7, momentum 0.9).
DILOCO_DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
# Streaming (Douillard et al. 2025): ``fragments`` groups of the parameters merged in turn, one every sync_every /
# fragments steps (1/fragments of the model on the wire at a time; 1 merges all at once). ``overlap``: a merge's
# exchange runs behind the next ``overlap_steps`` training steps (1 by default), each rank meanwhile training on from
# the outer step of its own progress (``eager``, True by default: eager DiLoCo) or its own parameters (local_sgd.py).
STREAMING_KEYS = ("fragments", "overlap", "overlap_steps", "eager")
# Merges by speed (local/claims.py): each rank takes the micro-batches it has time for, and a merge takes what it has.
ASYNCHRONOUS_KEY = "asynchronous"
SYNC_OPTION_KEYS = (*DILOCO_DEFAULTS, *STREAMING_KEYS, ASYNCHRONOUS_KEY)


def check_sync_arguments(
    sync: Any, sync_every: Any, inner_steps: Any, sync_options: Any, rebalance: Any = None
) -> Optional[dict[str, Any]]:
    """Constructor checks of ``sync``, ``sync_every``, ``inner_steps`` and ``sync_options`` (and ``rebalance`` with
    them); returns the outer optimizer's settings (None for local SGD and every-step training)."""
    if sync not in SYNC_MODES:
        raise ValueError(
            f"`sync={sync!r}` is not one of {list(SYNC_MODES)}: 'every_step' (default) exchanges gradients at every"
            " step; 'local_sgd' and 'diloco' train locally and synchronize every `sync_every` steps."
        )
    check_positive_int("sync_every", sync_every, ": the training steps between two synchronizations.")
    local = sync in LOCAL_MODES
    if not local and (sync_every != 1 or inner_steps is not None or sync_options is not None):
        given = "sync_every" if sync_every != 1 else "inner_steps" if inner_steps is not None else "sync_options"
        raise ValueError(
            f"`{given}` is given with `sync={sync!r}`, which exchanges gradients at every step. Use"
            " `sync='local_sgd'` or `sync='diloco'` to synchronize less often, or drop it."
        )
    if inner_steps is not None:
        inner_steps = per_rank_list("inner_steps", inner_steps, "[2, 1]")
        bad = [k for k in inner_steps if not is_int(k) or k < 1]
        if not inner_steps or bad:
            raise ValueError(
                f"`inner_steps={list(inner_steps)}` must hold one whole number >= 1 per rank: the inner steps each"
                " rank takes per training step (1 for the slowest, e.g. [2, 1] for a rank twice as fast)."
            )
    if not local:
        return None
    if rebalance and inner_steps is not None:
        raise ValueError(
            f"`rebalance=True` with `inner_steps={list(inner_steps)}`: inner steps you give are kept. Drop one"
            " (without `inner_steps` they are planned from the profiles and follow what the ranks measure)."
        )
    options = dict(sync_options or {})
    unknown = sorted(set(options) - set(SYNC_OPTION_KEYS))
    if unknown:
        raise ValueError(
            f"`sync_options={sync_options!r}` has {unknown}; the keys are {list(SYNC_OPTION_KEYS)} (DiLoCo's outer"
            " optimizer, and the streaming merge's `fragments`)."
        )
    sync_overlap(options, sync_every)
    for key in (*STREAMING_KEYS, ASYNCHRONOUS_KEY):
        if key != "eager" or sync != "local_sgd":  # (local SGD's eager step is the rank's own parameters: refused)
            options.pop(key, None)
    if sync == "local_sgd":
        if options:
            raise ValueError(
                f"`sync_options={sync_options!r}` is given with `sync='local_sgd'`, whose outer step is the plain"
                " average (so `eager`, the outer step of a rank's own progress, is its own parameters either way)."
                " Use `sync='diloco'` for an outer optimizer, or drop them."
            )
        return None
    settings = {**DILOCO_DEFAULTS, **options}
    for key in ("outer_lr", "outer_momentum"):
        value = settings[key]
        low_ok = value > 0 if key == "outer_lr" else value >= 0
        if not is_real(value) or not math.isfinite(value) or not low_ok or (key == "outer_momentum" and value >= 1):
            raise ValueError(
                f"`sync_options['{key}']={value!r}` must be a finite number"
                f" {'> 0' if key == 'outer_lr' else 'in [0, 1)'} (DiLoCo's default {DILOCO_DEFAULTS[key]})."
            )
    if not isinstance(settings["nesterov"], bool):
        raise ValueError(f"`sync_options['nesterov']={settings['nesterov']!r}` must be True or False.")
    if settings["nesterov"] and settings["outer_momentum"] == 0:
        settings["nesterov"] = False  # (torch refuses Nesterov without momentum; it is plain SGD then)
    return settings


def sync_refusal(
    sync: str,
    stage: int,
    compression_mode: Optional[str],
    precisions: Sequence[str],
    micro_steps: Optional[Sequence[int]],
    weights: Optional[Sequence[float]],
    global_batch_size: Optional[int],
    hierarchical: Any,
    automatic_optimization: bool,
) -> Optional[str]:
    """Why the job cannot train with ``sync`` (None when it can). Checked on every rank before any collective."""
    if sync not in LOCAL_MODES:
        if compression_mode in ("int8", "int4"):
            return (
                f"`compression={compression_mode!r}` with `sync={sync!r}`: int8 and int4 quantize the pseudo-gradient"
                " of a merge (sync='local_sgd' or 'diloco'), not the gradient exchange of every step. Set `sync`, or"
                " for every step use compression='fp16', 'bf16', 'powersgd' or 'topk'."
            )
        return None
    if stage != 0:
        return (
            f"`sync={sync!r}` needs `stage=0`: ZeRO stage {stage} shards the optimizer states (and from stage 2 the"
            " gradients) across the ranks, and a rank that trains on its own needs all of its own."
        )
    if compression_mode not in (None, "fp16", "bf16", "int8", "int4"):
        return (
            f"`sync={sync!r}` with `compression={compression_mode!r}`: between synchronizations no gradient is"
            " exchanged, and the pseudo-gradient travels in fp32, fp16, bf16, int8 or int4 only. Use compression=None,"
            " 'fp16', 'bf16', 'int8' or 'int4'."
        )
    if hierarchical is True:
        return f"`sync={sync!r}` with `hierarchical=True`: the synchronization is one all-reduce. Drop `hierarchical`."
    if "16-mixed" in precisions:
        return (
            f"`sync={sync!r}` with an fp16 rank: its loss scale is agreed by all ranks at every step, and ranks that"
            " train on their own take different numbers of steps. Use bf16 or fp32 on every rank."
        )
    if micro_steps is not None:
        return f"`sync={sync!r}` with `micro_steps`: give the inner steps per rank with `inner_steps` instead."
    if weights is not None or global_batch_size is not None:
        given = "weights" if weights is not None else "global_batch_size"
        return (
            f"`sync={sync!r}` with `{given}`: each rank trains on micro-batches of the training loader's batch size (or"
            " `batch_sizes`), and `inner_steps` says how many per training step. Drop it."
        )
    if not automatic_optimization:
        return (
            f"`sync={sync!r}` with manual optimization: the strategy takes the inner steps. Use automatic optimization."
        )
    return None


def plan_inner_steps(costs: Sequence[CostModel], micro_batches: Sequence[int]) -> tuple[int, ...]:
    """Each rank's inner steps per training step: as many of its micro-batches as it computes while the slowest rank
    computes one (rounded to the nearest whole step, at least 1), from the ranks' cost models."""
    return inner_steps_for([cost.time(b) for cost, b in zip(costs, micro_batches)])


def local_split(
    sync: str,
    world_size: int,
    global_batch_size: int,
    batch_sizes: Optional[Sequence[int]],
    inner_steps: Optional[Sequence[int]],
    costs: Optional[Sequence[CostModel]],
) -> SplitPlan:
    """Each rank's micro-batch (``batch_sizes``, else the loader's batch: the global batch over the ranks) taken
    ``inner_steps[r]`` times per training step: the user's counts, else as many as its cost model says it computes
    while the slowest rank computes one (``costs``: the ranks' profiles), else one each."""
    micro = tuple(batch_sizes) if batch_sizes else (max(1, global_batch_size // world_size),) * world_size
    if inner_steps is not None:
        steps = tuple(inner_steps)
    elif costs is not None:
        steps = plan_inner_steps(costs, micro)
    else:
        steps = (1,) * world_size
    return SplitPlan(tuple(b * k for b, k in zip(micro, steps)), sync, steps)


def sync_fragments(sync_options: Optional[Mapping[str, Any]], sync_every: int) -> int:
    """``sync_options['fragments']`` checked (1 when not given): a whole number that divides ``sync_every``."""
    fragments = (sync_options or {}).get("fragments", 1)
    if not is_int(fragments) or fragments < 1 or sync_every % fragments:
        raise ValueError(
            f"`sync_options['fragments']={fragments!r}` must be a whole number >= 1 that divides `sync_every="
            f"{sync_every}`: one fragment of the parameters merges every sync_every / fragments training steps"
            " (e.g. fragments=4 with sync_every=8: one every 2 steps)."
        )
    return int(fragments)


def sync_overlap(sync_options: Optional[Mapping[str, Any]], sync_every: int) -> Optional[int]:
    """``sync_options['overlap']``, ``['overlap_steps']`` and ``['eager']`` checked: None without overlap, else the
    training steps after which a merge sent in the background is applied: 1 by default, at most the next merge
    (measured in docs/local-sgd.md: at the next merge DiLoCo's final loss about doubled; one step later it held)."""
    options = sync_options or {}
    overlap, steps = options.get("overlap", False), options.get("overlap_steps")
    if not isinstance(overlap, bool):
        raise ValueError(
            f"`sync_options['overlap']={overlap!r}` must be True or False: True sends each merge in the background"
            " while the ranks train on, and applies its outer step one merge later."
        )
    interval = sync_every // sync_fragments(options, sync_every)
    if steps is not None and (not overlap or not is_int(steps) or not 1 <= steps <= interval):
        raise ValueError(
            f"`sync_options['overlap_steps']={steps!r}` must be a whole number from 1 to {interval} (the steps"
            f" between two merges) given with `overlap=True`: a merge sent in the background is applied that many"
            " training steps later (fewer: a fresher model, the link's time hidden behind fewer steps)."
        )
    eager = options.get("eager")
    if "eager" in options and (not overlap or not isinstance(eager, bool)):
        raise ValueError(
            f"`sync_options['eager']={eager!r}` must be True or False, given with `overlap=True`: until a merge sent in"
            " the background arrives, True trains on from the outer step of the rank's own progress (eager DiLoCo),"
            " False from the rank's own parameters."
        )
    if not overlap:
        return None
    return int(steps) if steps is not None else 1


def sync_eager(sync_options: Optional[Mapping[str, Any]]) -> bool:
    """``sync_options['eager']`` (checked by :func:`sync_overlap`), its default where not given."""
    eager = (sync_options or {}).get("eager")
    return True if eager is None else bool(eager)


def sync_asynchronous(
    sync_options: Optional[Mapping[str, Any]],
    inner_steps: Optional[Sequence[int]],
    rebalance: Optional[bool],
    batch_sizes: Optional[Sequence[int]],
) -> bool:
    """``sync_options['asynchronous']`` checked (False when not given): merges by speed, which take the place of the
    inner steps (each rank trains as many micro-batches as it has time for) and of their re-planning."""
    options = sync_options or {}
    asynchronous = options.get(ASYNCHRONOUS_KEY, False)
    if not isinstance(asynchronous, bool):
        raise ValueError(
            f"`sync_options['asynchronous']={asynchronous!r}` must be True or False: True lets each rank train as many"
            " micro-batches as its speed allows between merges, and a merge takes what each rank has."
        )
    if not asynchronous:
        return False
    clashes = {
        "sync_options['overlap']": options.get("overlap", False),
        "sync_options['fragments']": options.get("fragments", 1) != 1,
        "inner_steps": inner_steps is not None,
        "rebalance=True": rebalance is True,
        "batch_sizes": batch_sizes is not None,
    }
    given = [name for name, clash in clashes.items() if clash]
    if given:
        raise ValueError(
            f"`sync_options['asynchronous']=True` with `{given[0]}`: asynchronous merges take the micro-batches each"
            " rank has time for, of the training loader's batch size, merged whole at once (no overlap, no fragments,"
            " no planned inner steps, nothing to re-plan). Drop one of them."
        )
    return True


def is_sync_step(steps_done: int, sync_every: int, last_of_epoch: bool) -> bool:
    """Whether the ranks synchronize after ``steps_done`` training steps of the fit: every ``sync_every``, and at the
    end of each epoch (so that evaluation and the epoch's checkpoint see one model)."""
    return last_of_epoch or steps_done % sync_every == 0


def check_inner_steps_length(inner_steps: Optional[Sequence[int]], world_size: int) -> None:
    if inner_steps is not None:
        check_one_per_rank(
            f"`inner_steps={list(inner_steps)}`",
            len(inner_steps),
            world_size,
            "Give one count per rank, in global rank order.",
        )


def describe_sync(
    sync: str,
    sync_every: int,
    inner_steps: Sequence[int],
    options: Optional[Mapping[str, Any]],
    fragments: int = 1,
    overlap: Optional[int] = None,
    eager: bool = True,
) -> str:
    """One line for the plan: how the ranks synchronize."""
    if sync not in LOCAL_MODES:
        return "gradients exchanged at every step"
    outer = (
        "the sample-weighted average of the parameters"
        if sync == "local_sgd"
        else f"an outer SGD (lr {options['outer_lr']}, momentum {options['outer_momentum']}"  # type: ignore[index]
        f"{', Nesterov' if options['nesterov'] else ''}) on the sample-weighted pseudo-gradient"  # type: ignore[index]
    )
    when = (
        f"every {sync_every} training steps"
        if fragments == 1
        else f"every {sync_every // fragments} training steps, one of {fragments} fragments of the parameters in turn"
        f" (each every {sync_every}),"
    )
    applied = "at the next one" if overlap == sync_every // fragments else f"{overlap} training steps later"
    stand_in = "the outer step of their own progress" if eager and sync == "diloco" else "their own parameters"
    overlapped = (
        f"; each merge is sent in the background while the ranks train on from {stand_in}, its outer step applied"
        f" {applied}"
        " (at an epoch's end, a checkpoint and a validation the ranks wait for it)"
        if overlap is not None
        else ""
    )
    return (
        f"{sync}: each rank trains on its own, inner steps per training step {list(inner_steps)}; {when} and at each"
        f" epoch's end the ranks synchronize with {outer}{overlapped}"
    )


# Windows measured under the current inner steps before they may change (as the split's re-planner waits), and the
# predicted gain in balance a change must bring: timing noise alone must not make the counts wander.
MIN_WINDOWS_BEFORE_CHANGE = 2
MIN_BALANCE_GAIN = 0.05


def balance(inner_steps: Sequence[int], step_seconds: Sequence[float], waits: Sequence[float] = ()) -> float:
    """Predicted ``sum(work) / (W * max(work))`` of a training step when rank r takes ``inner_steps[r]`` inner
    steps of ``step_seconds[r]`` each, after waiting ``waits[r]`` for its batch: 1.0 when no rank waits for another."""
    work = [k * t + w for k, t, w in zip(inner_steps, step_seconds, waits or [0.0] * len(inner_steps))]
    return sum(work) / (len(work) * max(work)) if max(work) > 0 else 1.0


def inner_steps_for(step_seconds: Sequence[float], waits: Sequence[float] = ()) -> tuple[int, ...]:
    """Inner steps from each rank's measured seconds per inner step: as many as it takes while the slowest takes one.
    ``waits``: each rank's wait for its batch per training step (one fetch whatever its inner steps), which the
    others fill with inner steps."""
    waits = waits or [0.0] * len(step_seconds)
    slowest = max(t + w for t, w in zip(step_seconds, waits))
    return tuple(max(1, math.floor((slowest - w) / t + 0.5)) if t > 0 else 1 for t, w in zip(step_seconds, waits))


class InnerStepsRebalancer:
    """Re-plans the inner steps of local training from what the ranks measure, like the split's re-planner
    (:class:`~lightning_hetero.split.decisions.replan.Rebalancer`, same interface for the watch): every exchange of step
    records, each rank's seconds per sample is the median over the steps since the last change of its compute divided by
    its samples (its wait for data per step likewise, which the other ranks fill with inner steps), and the counts
    change when the new ones are predicted to balance the step at least ``MIN_BALANCE_GAIN`` better. Pure arithmetic on
    the exchanged records: every rank takes the same decision.

    The samples of a training step stay the same (the loader's epoch keeps its number of steps, which Lightning
    counted at the start): new counts share them out in proportion to ``inner_steps[r] * micro_batches[r]``, so the
    micro-batches grow or shrink a little instead."""

    def __init__(self, micro_batches: Sequence[int], inner_steps: Sequence[int], window: int) -> None:
        self.micro_batches = tuple(micro_batches)
        self.inner_steps = tuple(inner_steps)
        self.step_samples = sum(b * k for b, k in zip(micro_batches, inner_steps))
        self.window = window
        self.changed_at = 0
        self.replans: list[Replan] = []
        self.restored: Optional[tuple[int, ...]] = None  # the inner steps a checkpoint recorded with its split

    def consider(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]:
        if next_step - self.changed_at < MIN_WINDOWS_BEFORE_CHANGE * self.window:
            return None
        recent = [step for step in steps if step["step"] >= self.changed_at]
        per_step, waits = [], []  # seconds per inner step of the rank's initial micro-batch; its wait for data
        for rank, micro in enumerate(self.micro_batches):
            measured = [step for step in recent if step["compute_seconds"][rank] > 0]
            if not measured:
                return None
            per_step.append(
                statistics.median(s["compute_seconds"][rank] / s["batch_sizes"][rank] * micro for s in measured)
            )
            waits.append(
                statistics.median(s.get("data_wait_seconds", [0.0] * len(self.micro_batches))[rank] for s in measured)
            )
        proposed = inner_steps_for(per_step, waits)
        gain = balance(proposed, per_step, waits) - balance(self.inner_steps, per_step, waits)
        if proposed == self.inner_steps or gain < MIN_BALANCE_GAIN:
            return None
        samples = self.samples_of(proposed)
        if any(n < k for n, k in zip(samples, proposed)):
            return None  # the step's samples cannot give every inner step one
        replan = Replan(next_step, samples, gain, proposed, tuple(waits))
        self.inner_steps, self.changed_at = proposed, next_step
        self.replans.append(replan)
        return replan

    def samples_of(self, inner_steps: Sequence[int]) -> tuple[int, ...]:
        """The training step's samples shared in proportion to each rank's inner steps times its micro-batch."""
        weights = [b * k for b, k in zip(self.micro_batches, inner_steps)]
        return tuple(split_by_weights(self.step_samples, weights, minimum=1))

    def micro_steps_of(self, split: Sequence[int]) -> tuple[int, ...]:
        """The inner steps of a checkpoint's split: those it recorded, else the current ones."""
        return self.restored if self.restored is not None else self.inner_steps

    def adopt(self, split: Sequence[int], step: int) -> None:
        """Run with a checkpoint's split (and the inner steps it recorded) from ``step`` on."""
        self.inner_steps, self.changed_at = self.micro_steps_of(split), step
