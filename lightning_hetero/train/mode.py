"""Train: the lifecycle every way of training implements, which the job calls at Lightning's hook points.

A run trains one way, chosen by its settings: data parallel on the uneven split (:mod:`lightning_hetero.split`),
local training, with its synchronizations or asynchronous merges (:mod:`lightning_hetero.local`), or a pipeline of
stages (:mod:`lightning_hetero.pipeline`). Each is a :class:`TrainingMode`: the job builds the one its settings chose
once the ranks exist, and calls it; nothing above it asks which mode is running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from torch import Tensor

# The user's training_step on one micro-batch and its sample count (None: the whole batch, no micro-steps).
UserStep = Callable[[Any, Optional[int]], Any]
# Lightning's backward (the engine's) of one loss, its optimizer and arguments bound (what it returns is unused).
Backward = Callable[[Tensor], object]
# The parent strategy's writing (DeepSpeed's save of this rank's files into a directory) and loading of a checkpoint.
WriteCheckpoint = Callable[[Path], None]
LoadCheckpoint = Callable[[str], Any]


@dataclass(frozen=True)
class Surveyed:
    """What every rank told the others at setup, that a mode starts from: each rank's precision, its device facts,
    and its emulated memory ceiling (None where not emulated; the list None where no rank's is)."""

    precisions: Sequence[str]
    device_facts: Sequence[Any]
    memory_byte_ceilings: Optional[list[Optional[int]]]


class TrainingMode(Protocol):
    """One way of training, from a trainer call's setup to its end. Every method is called on every rank at the same
    lifecycle point; the job calls each once the ranks exist (``join``), with the engine from :meth:`attach` on.

    ``exchanges_each_step`` says whether the ranks meet at every optimizer step: a mode whose ranks meet only at
    merges has no per-step window for the watch, and a signalled stop is agreed at a merge."""

    exchanges_each_step: bool

    @staticmethod
    def check_trainer(settings: Any, trainer: Optional[Any], precision: str, world_size: int) -> None:
        """What the mode refuses of the trainer (``precision``: its plugin's), on every rank before the process group
        exists."""
        ...

    def start(
        self,
        global_batch_size: int,
        module: Any,
        device: torch.device,
        zero_stage: int,
        fitting: bool,
        surveyed: Surveyed,
        config: dict[str, Any],
    ) -> int:
        """Plan this trainer call (the split, local steps or the stages); returns this rank's micro-batch. ``config``:
        the DeepSpeed config this rank's engine will be built from, before Lightning fills in its defaults (a mode
        sets the entries it takes over)."""
        ...

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> Optional[Path]:
        """Print and write the plan; returns the directory the run report goes to (None: the mode finds its own)."""
        ...

    def engine_built(self) -> AbstractContextManager[None]:
        """Around ``deepspeed.initialize``."""
        ...

    def attach(self, engine: Any) -> None:
        """DeepSpeed's engine exists: the mode's part of it is installed (undone by :meth:`detach`)."""
        ...

    def detach(self) -> None:
        """The trainer call ends."""
        ...

    def shard(self, dataloader: Any, trainer: Any) -> Any:
        """A torch DataLoader rebuilt for this rank (training by the split, evaluation equally)."""
        ...

    def batch_received(self, batch: Any, trainer: Any) -> Any:
        """A training batch as the strategy moves it to the device, before the user's batch hooks."""
        ...

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> Any:
        """Lightning's ``training_step``."""
        ...

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        """Lightning's ``backward`` of the step's loss."""
        ...

    def optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        """Lightning's optimizer step (``step`` runs ``closure``: training_step and backward)."""
        ...

    def synchronize(self, counted: bool) -> None:
        """One model on every rank now (before a checkpoint, a validation in a fit, the end of a fit), if the mode
        lets ranks drift apart; ``counted``: its exchange counts in the report."""
        ...

    def link_wait_seconds(self) -> float:
        """This rank's time so far waiting on the link for merges that run beside training (0 where the exchange is
        inside the step, timed there), for the watch."""
        ...

    def evaluation_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A validation or test step."""
        ...

    def prediction_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A predict step: its output (None on a rank that holds no output of its own)."""
        ...

    def sampler_replicas(self, rank: int, world_size: int) -> tuple[int, int]:
        """(the replicas, this rank's index) that Lightning's distributed sampler splits `predict`'s data over."""
        ...

    def write_report(self, trainer: Any, plugin: Any) -> None:
        """Every rank hands in its records; rank 0 writes the run report."""
        ...

    def save_checkpoint(
        self, target: Path, saved: dict[str, Any], write: WriteCheckpoint, zero_stage: int, engine: Any
    ) -> None:
        """This rank's part of a checkpoint, complete or ignored."""
        ...

    def load_checkpoint(
        self,
        path: Path,
        load: LoadCheckpoint,
        module: Any,
        zero_stage: int,
        stage_is_automatic: bool,
        engine: Any,
        weights_only: Optional[bool],
    ) -> dict[str, Any]:
        """Resume ``path`` (a checkpoint directory, or another strategy's file); returns the client state."""
        ...
