"""Re-plan during training: the glue between the loop, the measurements and the split the training loader cuts.

:class:`SplitFollower` runs where the training loader is about to fetch a batch, a global-batch boundary that every
rank reaches at the same step: it lets the watch close the last step and exchange records every window, asks the
:class:`~lightning_hetero.plan.replan.Rebalancer` (pure decisions) whether to switch, and if so hands the new split to the
loader's batch sampler and to the strategy (``on_switch``), all before the batch is cut. A fit resumed from a
checkpoint takes up the split the checkpoint recorded first, when re-planning is on.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hetero.plan.replan import Rebalancer, Replan
from lightning_hetero.watch.meter import RunWatch, TensorGather


class SplitFollower:
    """Called by the training loader before each batch (its ``on_fetch``); see the module docstring.

    ``rebalancer`` is None when re-planning is off: the watch still measures and exchanges, for the run report.
    ``on_switch(batch_sizes)`` is called on every rank whenever the split changes.
    """

    def __init__(
        self,
        watch: RunWatch,
        all_gather: TensorGather,
        rebalancer: Optional[Rebalancer],
        on_switch: Callable[[tuple[int, ...]], None],
    ) -> None:
        self.watch = watch
        self.rebalancer = rebalancer
        self._all_gather = all_gather
        self._on_switch = on_switch
        self.loader: Optional[Any] = None  # the training loader: a HeteroDataLoader or a HeteroStreamLoader
        self.decision_seconds = 0.0  # what deciding cost this rank (the run report counts it with the exchanges)

    @property
    def replans(self) -> list[Replan]:
        return self.rebalancer.replans if self.rebalancer is not None else []

    def before_fetch(self) -> None:
        if self.loader is not None and self.rebalancer is not None:
            restored = self.loader.take_checkpoint_split()
            if restored is not None:
                self._resume_with(restored)
        self.watch.before_fetch(self._all_gather, after_exchange=self._decide)

    def _decide(self) -> None:
        """Right after an exchange: every rank holds the same steps and takes the same decision."""
        if self.loader is None or self.rebalancer is None:
            return
        started = time.perf_counter()
        replan = self.rebalancer.consider(self.watch.steps, self.watch.fetched)  # the step about to be fetched
        if replan is not None:
            rank_zero_info(
                f"HeteroStrategy re-plan before step {replan.step}: micro-batches {list(replan.batch_sizes)}"
                f" (predicted {replan.predicted_gain:.0%} faster than {list(self._current())})"
            )
            self._switch(replan.batch_sizes)
        self.decision_seconds += time.perf_counter() - started

    def _resume_with(self, split: tuple[int, ...]) -> None:
        """Take up the checkpoint's split if it fits this job (same world size and global batch); else re-plan on."""
        assert self.rebalancer is not None
        current = self._current()
        if split == current or len(split) != len(current) or sum(split) != sum(current):
            return
        self.rebalancer.adopt(split, self.watch.fetched)  # from the step about to be fetched
        self._switch(split)
        rank_zero_info(f"HeteroStrategy resumes with the checkpoint's micro-batches {list(split)}")

    def _current(self) -> tuple[int, ...]:
        assert self.loader is not None
        return self.loader.hetero_batch_sampler.batch_sizes

    def _switch(self, split: tuple[int, ...]) -> None:
        assert self.loader is not None
        self.loader.hetero_batch_sampler.use_split(split)
        self._on_switch(split)
