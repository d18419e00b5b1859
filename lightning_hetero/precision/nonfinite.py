"""Watch: optimizer steps skipped for non-finite gradients are counted, and a run that only produces them stops.

A NaN or inf loss on one rank makes every rank's reduced gradient non-finite. ZeRO-1/2/3 then skip the optimizer step
(DeepSpeed's overflow path, agreed across ranks, counted in ``engine.skipped_steps``); ZeRO-0 stepped with the
non-finite gradient and every parameter became NaN. Either way the job went on and exited 0 with ``global_step``
counting steps that changed nothing, and nothing was said.

:class:`NonFiniteGuard` makes it visible and bounded:

* at ZeRO-0 the step is skipped too, the way the other stages skip (through the optimizer's ``overflow`` flag, which
  DeepSpeed's engine counts): the reduced gradients are the same on every rank, so every rank decides alike without
  a collective;
* every skipped step is recorded (the run report and :class:`~lightning_hetero.HeteroMonitor` show them);
* with no loss scale to lower (fp32, bf16: a skip there is never an fp16 overflow that a smaller scale fixes),
  ``max_nonfinite_steps`` skipped steps in a row stop the run on every rank at the same step, with an error naming
  the ranks whose loss was non-finite and the step it began. Ranks agree on skips, so they reach that point together;
  the one gather that names the ranks happens only then.

Per step it costs a local ``isfinite`` of the loss (no synchronisation) and, at ZeRO-0 only, a norm of the reduced
gradients; the loss flags are read only on skipped steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.precision.plugin import skip_agreed_overflows
from lightning_hetero.runtime.checks import check_positive_int

DEFAULT_MAX_NONFINITE_STEPS = 3


def check_max_nonfinite_steps(value: Any) -> None:
    if value is not None:
        check_positive_int(
            "max_nonfinite_steps",
            value,
            " (optimizer steps in a row skipped for non-finite gradients"
            " before the run stops, when there is no loss scale to lower) or None to never stop. The"
            f" default is {DEFAULT_MAX_NONFINITE_STEPS}.",
        )


def gradients_are_finite(parameters: Any) -> bool:
    """Whether every gradient is finite (a norm over all of them, fused per device and dtype; one synchronisation)."""
    gradients = [p.grad for p in parameters if p.grad is not None]
    if not gradients:
        return True
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None:
        norm = total_norm(gradients, norm_type=2.0)
    else:  # pragma: no cover - older torch
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in gradients]))
    return bool(torch.isfinite(norm))


def streak_message(streak: list[int], first_nonfinite: list[Optional[int]], precision: str, limit: int) -> str:
    """Why the run stops: ``streak`` the skipped global steps in a row, ``first_nonfinite[r]`` the first of them in
    which rank r's loss was non-finite (None: its loss stayed finite)."""
    ranks = [(rank, step) for rank, step in enumerate(first_nonfinite) if step is not None]
    if ranks:
        which = "; ".join(f"rank {rank} from step {step}" for rank, step in ranks)
        where = f"The loss was non-finite (NaN or inf) on {which}: check that rank's data and model"
    else:
        where = "Every rank's loss was finite, so a gradient overflowed: check the model's numerics"
    return (
        f"HeteroStrategy: {len(streak)} optimizer steps in a row (steps {streak[0]} to {streak[-1]}) had non-finite"
        f" gradients and were skipped, and in {precision} there is no loss scale to lower, so the run stops instead"
        f" of going on without learning. {where} (a division by zero, log(0), a bad sample), or lower the learning"
        f" rate. `HeteroStrategy(max_nonfinite_steps=...)` sets how many in a row are tolerated (now {limit})."
    )


class NonFiniteStepsError(FloatingPointError):
    """Raised on every rank at the same step when too many optimizer steps in a row were skipped."""


class NonFiniteGuard:
    """Counts the steps skipped for non-finite gradients and stops a run that keeps producing them.

    Called at the strategy's points: :meth:`attach` after DeepSpeed built its engine, :meth:`loss_computed` with
    every loss before backward, :meth:`step_ended` after every optimizer step, :meth:`detach` at teardown.
    ``gather_ints(values)`` gathers one int64 tensor per rank (only when the run stops).
    """

    def __init__(self, limit: Optional[int], gather_ints: Callable[[Tensor], list[Tensor]]) -> None:
        self.limit = limit
        self._gather = gather_ints
        self.skipped: list[int] = []  # global steps whose optimizer step was skipped, this fit
        self._engine: Any = None
        self._undo: Optional[Callable[[], None]] = None
        self._skipped_before = 0
        self._loss_nonfinite: Optional[Tensor] = None  # this rank, since the last optimizer step (on its device)
        self._streak: list[int] = []
        self._first_nonfinite: Optional[int] = None
        self._has_loss_scale = False
        self._precision = "fp32"
        # Local SGD / DiLoCo: this rank's index; its steps are its own, so a stop is decided and said by it alone.
        self.rank_local: Optional[int] = None
        # Whether the ranks agreed that this step's gradients are not finite somewhere (a pipeline's stages hold
        # different parameters: one stage's inf is not in the others' gradients, so they agree on the whole model's
        # norm; see pipeline/training.py). Read when the optimizer steps, beside this rank's own gradients.
        self.agreed_nonfinite: Callable[[], bool] = lambda: False

    def attach(self, engine: Any, has_loss_scale: bool, skipping_installed: bool, precision: str) -> None:
        """``skipping_installed``: the precision plugin already decides the steps to skip (fp16 ranks)."""
        self._engine = engine
        self._skipped_before = engine.skipped_steps
        self._has_loss_scale = has_loss_scale or engine.fp16_enabled()
        self._precision = precision
        self.skipped, self._streak, self._first_nonfinite = [], [], None
        if engine.optimizer is None or skipping_installed or engine.zero_optimization_stage() != 0:
            return  # not training, or the step is skipped already (the plugin's agreement, DeepSpeed's ZeRO 1-3)
        if engine.fp16_enabled() or engine.bfloat16_enabled():
            # DeepSpeed's own fp16/bf16 (`Trainer(precision="bf16-mixed")`...): its optimizer wrapper skips a non-finite
            # step itself and the engine counts it; it is also built without any optimizer, for validate and test.
            return
        parameters = [p for p in engine.module.parameters() if p.requires_grad]
        skips = lambda: self.agreed_nonfinite() or not gradients_are_finite(parameters)  # noqa: E731
        self._undo = skip_agreed_overflows(engine.optimizer, skips)

    def detach(self) -> None:
        if self._undo is not None:
            self._undo()
            self._undo = None
        self._engine = None

    def loss_computed(self, loss: Tensor) -> None:
        nonfinite = ~torch.isfinite(loss.detach()).all()
        self._loss_nonfinite = nonfinite if self._loss_nonfinite is None else self._loss_nonfinite | nonfinite

    def step_ended(self, step: int) -> None:
        """After optimizer step number ``step`` (the trainer's ``global_step`` while the step runs)."""
        if self._engine is None:
            return
        skipped_now = self._engine.skipped_steps
        loss_nonfinite, self._loss_nonfinite = self._loss_nonfinite, None
        if skipped_now == self._skipped_before:
            self._streak, self._first_nonfinite = [], None
            return
        self._skipped_before = skipped_now
        self.skipped.append(step)
        self._streak.append(step)
        if self._first_nonfinite is None and loss_nonfinite is not None and bool(loss_nonfinite):
            self._first_nonfinite = step
        if self._has_loss_scale or self.limit is None or len(self._streak) < self.limit:
            return
        first = torch.tensor([-1 if self._first_nonfinite is None else self._first_nonfinite], dtype=torch.int64)
        if self.rank_local is not None:  # (no gather: the other ranks did not skip these steps)
            per_rank = [-1] * self.rank_local + [int(first.item())]
        else:
            per_rank = [int(t.item()) for t in self._gather(first)]
        raise NonFiniteStepsError(
            streak_message(self._streak, [None if s < 0 else s for s in per_rank], self._precision, self.limit)
        )

    def summary(self) -> dict[str, Any]:
        return {"skipped_steps": list(self.skipped), "max_nonfinite_steps": self.limit}
