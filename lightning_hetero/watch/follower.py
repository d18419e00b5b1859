"""Re-plan during training: the glue between the loop, the measurements and the split the training loader cuts.

:class:`SplitFollower` runs where the training loader is about to fetch a batch, a global-batch boundary that every
rank reaches at the same step: it lets the watch close the last step and exchange records every window, asks the
:class:`~lightning_hetero.split.decisions.replan.Rebalancer` (pure decisions) whether to switch, and if so hands the new
split to the split in force (:class:`~lightning_hetero.train.split_in_force.SplitInForce`, which tells the loader's
batch sampler and DeepSpeed), all before the batch is cut. A fit resumed from a checkpoint takes up the split the
checkpoint recorded first, when re-planning is on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional, Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hetero.split.decisions.explore import StepSearch
from lightning_hetero.split.decisions.replan import Replan
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.watch.meter import RunWatch, TensorGather

# A wait for data per step worth naming in a re-plan's line (below it, timer noise of a loader that keeps up).
STALL_SECONDS = 1e-3


def data_wait_text(replan: Replan) -> str:
    """The ranks whose wait for their loader counted in the re-plan, with what removes it."""
    stalled = [(rank, wait) for rank, wait in enumerate(replan.data_waits) if wait >= STALL_SECONDS]
    if not stalled:
        return ""
    each = ", ".join(f"rank {rank} {wait * 1e3:.1f} ms" for rank, wait in stalled)
    return (
        f"; it counts the ranks' wait for their data loader per step ({each}): more DataLoader workers on that host,"
        " or a larger prefetch_factor, would remove it"
    )


def search_text(search: StepSearch, step: int) -> str:
    """A line when the search on the measured step starts or settles (its trials are in the run report's re-plans)."""
    if search.said == "started" and search.best is not None and search.direction is not None:
        return (
            f"HeteroStrategy before step {step}: rank {search.direction[0]} reaches the gradient exchange later than"
            f" the cost model explains; searching the split on the measured step from {list(search.best.split)}"
        )
    if search.said == "settled" and search.best is not None:
        return (
            f"HeteroStrategy before step {step}: the search on the measured step settled on samples per rank"
            f" {list(search.best.split)} (median step {search.best.level * 1e3:.1f} ms)"
        )
    return ""


class SplitRebalancer(Protocol):
    """What re-plans the split in force from the watch's steps: the data-parallel split's
    :class:`~lightning_hetero.split.decisions.replan.Rebalancer`, or local training's inner steps'
    (:class:`~lightning_hetero.local.inner_steps.InnerStepsRebalancer`). Pure decisions: every rank holds the same."""

    replans: list[Replan]

    def consider(self, steps: Sequence[dict[str, Any]], next_step: int) -> Optional[Replan]: ...

    def micro_steps_of(self, split: Sequence[int]) -> tuple[int, ...]: ...

    def adopt(self, split: Sequence[int], step: int) -> None: ...


class SplitFollower:
    """Called by the training loader before each batch (its ``on_fetch``); see the module docstring.

    ``rebalancer`` is None when re-planning is off: the watch still measures and exchanges, for the run report.
    """

    def __init__(
        self,
        watch: RunWatch,
        all_gather: TensorGather,
        rebalancer: Optional[SplitRebalancer],
        split: SplitInForce,
    ) -> None:
        self.watch = watch
        self.rebalancer = rebalancer
        self._all_gather = all_gather
        self.split = split
        self.decision_seconds = 0.0  # what deciding cost this rank (the run report counts it with the exchanges)

    @property
    def replans(self) -> list[Replan]:
        return self.rebalancer.replans if self.rebalancer is not None else []

    def before_fetch(self) -> None:
        loader = self.split.loader
        if loader is not None and self.rebalancer is not None:
            restored = loader.take_checkpoint_split()
            if restored is not None:
                self._resume_with(restored)
        self.watch.before_fetch(self._all_gather, after_exchange=self._decide)

    def _decide(self) -> None:
        """Right after an exchange: every rank holds the same steps and takes the same decision."""
        if self.split.loader is None or self.rebalancer is None:
            return
        started = time.perf_counter()
        replan = self.rebalancer.consider(self.watch.steps, self.watch.fetched)  # the step about to be fetched
        if replan is not None:
            steps = replan.micro_steps or (1,) * len(replan.batch_sizes)
            in_steps = f" in {list(steps)} micro-batches each" if any(k > 1 for k in steps) else ""
            if replan.source != "search":  # (the search's trials: its start and its end are said below)
                rank_zero_info(
                    f"HeteroStrategy re-plan before step {replan.step}: samples per rank {list(replan.batch_sizes)}"
                    f"{in_steps} (predicted {replan.predicted_gain:.0%} better than {list(self.split.batch_sizes)})"
                    + data_wait_text(replan)
                )
            self.split.use(replan.batch_sizes, micro_steps=steps)
        search = getattr(self.rebalancer, "search", None)
        line = search_text(search, self.watch.fetched) if search is not None else ""
        if line:
            rank_zero_info(line)
        self.decision_seconds += time.perf_counter() - started

    def _resume_with(self, split: tuple[int, ...]) -> None:
        """Take up the checkpoint's split if it fits this job (same world size and global batch); else re-plan on."""
        assert self.rebalancer is not None
        current = self.split.batch_sizes
        if split == current or len(split) != len(current) or sum(split) != sum(current):
            return
        self.rebalancer.adopt(split, self.watch.fetched)  # from the step about to be fetched
        self.split.use(split, micro_steps=self.rebalancer.micro_steps_of(split))
        rank_zero_info(f"HeteroStrategy resumes with the checkpoint's micro-batches {list(split)}")
