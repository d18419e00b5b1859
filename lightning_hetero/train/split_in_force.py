"""Train: the one owner of the split in force: which micro-batch each rank trains on, from now on.

A trainer call starts with the initial plan; a re-plan, the split a checkpoint recorded, or a resume that keeps the
checkpoint's global batch changes it, always through :meth:`SplitInForce.use`. Everything else reads it (the loss
weight, the checkpoint's manifest, the run report) or is told by it: the training loader's batch sampler, which cuts
the next global batch, and this rank's micro-batch in the DeepSpeed config and engine (its followers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

from lightning_hetero.split.decisions.split import SplitPlan
from lightning_hetero.train.order import STATE_SAMPLES_CONSUMED


class SplitInForce:
    """The split of the current trainer call, on this rank (every rank holds the same one)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.plan: Optional[SplitPlan] = None
        self.prediction: Optional[dict[str, Any]] = None  # the planner's, for the plan table and report
        # The training loader it cuts (a HeteroDataLoader or HeteroStreamLoader), held weakly: the loader holds the
        # job's listeners, which hold this, and a loader in a reference cycle is freed by the cyclic collector, which
        # tears its worker queues down before the iterator's shutdown can tell the workers to stop: each worker then
        # costs torch's 5 s join timeout (10 s for 2 workers, measured here).
        self._loader: Optional[weakref.ref] = None
        self._followers: list[Callable[[int], None]] = []

    @property
    def loader(self) -> Optional[Any]:
        """The training loader this split cuts, while the trainer keeps it; None before it is built and after."""
        return self._loader() if self._loader is not None else None

    def follow(self, on_micro_batch: Callable[[int], None]) -> None:
        """``on_micro_batch(b)`` is called with this rank's micro-batch whenever the split is set or changes."""
        self._followers.append(on_micro_batch)

    def start(self, plan: SplitPlan, prediction: Optional[dict[str, Any]]) -> None:
        """The split this trainer call starts with (its training loader is cut from it when it is built)."""
        self.plan, self.prediction = plan, prediction
        self._tell_followers()

    def use(self, batch_sizes: Sequence[int], source: str = "re-plan", micro_steps: Sequence[int] = ()) -> None:
        """From the next global batch on, every rank trains on ``batch_sizes`` samples in ``micro_steps`` micro-batches
        (() : one each)."""
        self.plan = SplitPlan(tuple(batch_sizes), source, tuple(micro_steps))
        loader = self.loader
        if loader is not None:
            loader.hetero_batch_sampler.use_split(self.plan.batch_sizes)
        self._tell_followers()

    def cut_by(self, loader: Any) -> None:
        """The training loader was built from this split: later changes reach its batch sampler."""
        self._loader = weakref.ref(loader)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        assert self.plan is not None
        return self.plan.batch_sizes

    @property
    def global_batch_size(self) -> Optional[int]:
        """The samples of one optimizer step across the ranks (None outside fit)."""
        return self.plan.global_batch_size if self.plan is not None else None

    @property
    def micro_batch(self) -> int:
        """This rank's largest micro-batch; 1 outside fit (no plan: evaluation and prediction use their loaders'
        batch)."""
        return self.plan.micro_batches[self.rank] if self.plan is not None else 1

    @property
    def micro_steps(self) -> int:
        """This rank's micro-batches per global batch (1 outside fit)."""
        return self.plan.micro_steps[self.rank] if self.plan is not None else 1

    def global_samples_consumed(self) -> Optional[int]:
        """The position in the epoch in global samples (rank-independent: resumable on any number of ranks)."""
        loader = self.loader
        return loader.state_dict()[STATE_SAMPLES_CONSUMED] if loader is not None else None

    def _tell_followers(self) -> None:
        for follower in self._followers:
            follower(self.micro_batch)
