"""Configure: the learning rate when a resumed run's global batch differs from its checkpoint's (``lr_scaling``).

By default a resume keeps the optimisation it continues: on another number of ranks the checkpoint's global batch is
kept (the split planned again for it), and a global batch the user fixed must agree with it. With
``HeteroStrategy(lr_scaling="linear" | "sqrt")`` the job's own global batch is used instead (the loader's batch
times the new number of ranks, or the one given), and the learning rate follows it, by a published rule, with
``k = new global batch / old``:

- ``"linear"``: ``lr * k`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD": SGD's update per sample is kept).
- ``"sqrt"``: ``lr * sqrt(k)`` (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms": the rule for Adam and RMSprop).

Decoupled weight decay (AdamW; ``torch.optim.Adam(decoupled_weight_decay=True)``) multiplies the weights by
``1 - lr * weight_decay`` every step, so over an epoch of ``N / B`` steps they decay by about
``exp(-lr * weight_decay * N / B)``. Wang and Aitchison 2024 ("How to set AdamW's weight decay as you scale model and
dataset size") keep that timescale: ``lr * weight_decay`` scales by ``k``, so ``weight_decay`` scales by
``k / lr factor``: unchanged under the linear rule, ``sqrt(k)`` under the square-root rule. A coupled L2 penalty
(``weight_decay`` of SGD, Adam) is part of the gradient and is left alone.

Pure decisions here; :mod:`lightning_hetero.train.lr_scaling` applies one to the optimizers and schedulers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

LR_RULES = ("linear", "sqrt")


def check_lr_scaling(lr_scaling: Any, sync: str = "every_step", pipeline: Any = None) -> Optional[str]:
    """Constructor check of ``lr_scaling``: None, ``"linear"`` or ``"sqrt"``, with every-step data parallelism."""
    if lr_scaling is None:
        return None
    if lr_scaling not in LR_RULES:
        raise ValueError(
            f"`lr_scaling={lr_scaling!r}` must be None (default: a resume keeps the checkpoint's global batch and"
            f" learning rate), 'linear' (lr times k = new global batch / old, for SGD) or 'sqrt' (lr times sqrt(k),"
            " for Adam)."
        )
    if sync != "every_step":
        raise ValueError(
            f"`lr_scaling={lr_scaling!r}` with `sync={sync!r}`: each rank steps its own optimizer on its own"
            " micro-batches between merges, so there is no global batch per step to scale by. Drop `lr_scaling`."
        )
    if pipeline is not None:
        raise ValueError(
            f"`lr_scaling={lr_scaling!r}` with `pipeline=...`: a pipeline's checkpoint does not record its global"
            " batch, so a change could not be told. Drop `lr_scaling` (a resume keeps the global batch)."
        )
    return str(lr_scaling)


@dataclass(frozen=True)
class LrScaling:
    """The rule applied to a resume from a global batch of ``old`` samples to one of ``new``."""

    rule: str
    old: int
    new: int

    @property
    def ratio(self) -> float:
        return self.new / self.old

    @property
    def lr_factor(self) -> float:
        return self.ratio if self.rule == "linear" else math.sqrt(self.ratio)

    @property
    def decoupled_decay_factor(self) -> float:
        """What decoupled weight decay is multiplied by, so that ``lr * weight_decay`` scales by ``k``."""
        return self.ratio / self.lr_factor

    def describe(self, decoupled: bool) -> str:
        decay = (
            f", decoupled weight decay x{self.decoupled_decay_factor:.4g} (lr x weight decay x{self.ratio:.4g},"
            " the same decay per epoch)"
            if decoupled
            else ""
        )
        return (
            f"HeteroStrategy: the global batch changed from the checkpoint's {self.old} to {self.new} samples"
            f" (x{self.ratio:.4g}); lr_scaling={self.rule!r}: learning rate x{self.lr_factor:.4g}{decay}"
        )


def lr_scaling_for(rule: Optional[str], old: Optional[int], new: int) -> Optional[LrScaling]:
    """The scaling a resume from ``old`` samples per step to ``new`` needs (None: no rule, no change, or no record)."""
    if rule is None or old is None or old == new:
        return None
    return LrScaling(rule, old, new)
