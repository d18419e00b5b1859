"""Split: data-parallel training on the uneven split, the training mode of a run without ``sync`` or ``pipeline``.

Every rank holds the whole model and trains its own slice of each global batch (the split in force,
:mod:`lightning_hetero.train.split_in_force`), in one or several micro-batches (:mod:`.steps`); DeepSpeed exchanges
the gradients at each step, and the loss weights make that exchange the full-batch mean. Checkpoints are written
atomically with a manifest of the split and the samples consumed, and resumed on the same or another world size
(:mod:`lightning_hetero.recover`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Protocol

import torch
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hetero.precision.plugin import HeteroPrecision
from lightning_hetero.recover import from_deepspeed
from lightning_hetero.recover.recovery import manifest_facts
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.recover.resume import Route, file_route, resume_route
from lightning_hetero.runtime.tracing import phase
from lightning_hetero.split.optimizer_shards import MANIFEST_KEY, MemoryShards, load_named_shards, shards_resume_refusal
from lightning_hetero.split.steps import RankParts, TrainingSteps
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.mode import Backward, LoadCheckpoint, Surveyed, UserStep, WriteCheckpoint
from lightning_hetero.train.sharding import BatchListeners
from lightning_hetero.watch.meter import time_deepspeed_exchanges
from lightning_hetero.watch.publish import publish_to_loggers, report_directory


class SplitSetup(Protocol):
    """What the job's setup (``job_setup.JobSetup``) does for the split: start it at a fit, print and write the plan,
    settle the global batch of a resumed checkpoint, tell the memory each rank leaves for its optimizer state; and
    every rank's device facts, for the checkpoint's manifest."""

    device_facts: list[Any]
    optimizer_shards_line: str

    def optimizer_rooms(self, module: Any) -> tuple[list[Optional[float]], bool]: ...

    def start_the_split(self, global_batch_size: int, zero_stage: int, module: Any) -> None: ...

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> Optional[Path]: ...

    def settle_the_global_batch(
        self, directory: Path, manifest: dict[str, Any], zero_stage: int, module: Any, same_world_size: bool
    ) -> None: ...


class DataParallelTraining:
    """This rank's data-parallel training: its ``parts``, the job's ``setup`` of the split, whether the report says
    the split could be re-planned (``could_replan``), and the optimizer's parameters in its order (``optimizer_order``:
    a callable, set by the job around ``deepspeed.initialize``; another strategy's optimizer state is indexed by it),
    and the optimizer state's memory-sized shards (``memory_shards``, :mod:`.optimizer_shards`; None: DeepSpeed's)."""

    exchanges_each_step = True

    def __init__(
        self,
        parts: RankParts,
        setup: SplitSetup,
        could_replan: bool,
        optimizer_order: Callable[[], list[tuple[str, Any]]],
        memory_shards: Optional[MemoryShards] = None,
    ) -> None:
        self.parts, self._setup, self._could_replan = parts, setup, could_replan
        self.memory_shards = memory_shards
        if memory_shards is not None:  # (a re-planned split changes what each rank's activations leave)
            parts.split.follow(lambda micro_batch: self._split_changed())
        self._optimizer_order = optimizer_order
        self.steps = TrainingSteps(parts)
        self.report_directory: Optional[Path] = None  # where this fit's plan and report go (watch/publish.py)

    # ------------------------------------------------------------------ setup

    @staticmethod
    def check_trainer(settings: Any, trainer: Optional[Any], precision: str, world_size: int) -> None:
        """What this mode refuses of the trainer before the process group exists, beyond what the settings refuse
        (``settings.check_job``): memory-sized shards step a plain torch optimizer, so they train in 32-bit."""
        if getattr(settings, "shards_by_memory", False) and precision not in ("32-true", "32"):
            raise ValueError(
                f"HeteroStrategy(stage={settings.stage}, shards='memory') with `Trainer(precision={precision!r})`:"
                " DeepSpeed's own fp16/bf16 training wraps the optimizer in one of its own, whose state cannot be"
                " sharded by memory. Use `precision='32-true'`, or leave out `shards`."
            )

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
        if fitting:
            self._setup.start_the_split(global_batch_size, zero_stage, module)
            self._start_memory_shards(module, config)
        return self.parts.split.micro_batch

    def _split_changed(self) -> None:
        """The split in force changed during a fit (a re-plan, or a resumed checkpoint's split), between two steps on
        every rank alike: the memory-sized shards follow the rooms it leaves."""
        engine, shards = self.steps.engine, self.memory_shards
        if engine is None or engine.optimizer is None or shards is None or shards.shards is None:
            return  # (the split's start, before the shares are decided, or outside a fit)
        rooms, _ = self._setup.optimizer_rooms(engine.module)
        moved = shards.replan(rooms, engine.optimizer)
        if moved:
            rank_zero_info(moved)
            self._setup.optimizer_shards_line = shards.description

    def _start_memory_shards(self, module: Any, config: dict[str, Any]) -> None:
        """Each rank's share of the optimizer state, from the memory its micro-batch leaves (every rank decides from
        the same gathered facts), said in the plan."""
        shards = self.memory_shards
        self._setup.optimizer_shards_line = ""
        if shards is None:
            return
        rooms, emulated = self._setup.optimizer_rooms(module)
        warning = shards.start(module, rooms, emulated, config, module.trainer)
        if warning:
            rank_zero_warn(warning)
        self._setup.optimizer_shards_line = shards.description

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> Optional[Path]:
        self.report_directory = self._setup.write_plan(trainer, config)
        return self.report_directory

    @contextlib.contextmanager
    def engine_built(self) -> Iterator[None]:
        yield

    def attach(self, engine: Any) -> None:
        """The arrivals at DeepSpeed's exchange are timed (watch/meter.py), inside the emulation's wrapper: an
        emulated slower rank arrives once it has paid its delay. Rank 0's buffers go to every rank before each
        forward."""
        parts = self.parts
        if self.memory_shards is not None:  # (before the exchange is timed and slowed: the reduction is the exchange)
            self.memory_shards.attach(engine, lambda agreed: setattr(parts.nonfinite, "agreed_nonfinite", agreed))
        time_deepspeed_exchanges(engine, parts.watcher.meter)
        parts.emulation.around_deepspeed_exchanges(engine)
        self.steps.engine = engine
        if parts.world_size > 1 and engine.optimizer is not None:
            self.steps.buffer_sync = BufferSync(engine.module.buffers(), parts.collectives.broadcast_in_place)

    def detach(self) -> None:
        self.report_directory, self.steps.engine, self.steps.buffer_sync = None, None, None
        if self.memory_shards is not None:
            self.memory_shards.detach()

    # ------------------------------------------------------------------ data and steps

    def shard(self, dataloader: Any, trainer: Any) -> Any:
        """The training loader cut by the split in force, evaluation loaders equally."""
        parts = self.parts
        training = trainer.state.stage == RunningStage.TRAINING
        loader = self._sharded(dataloader, trainer, training)
        if training:
            parts.split.cut_by(loader)
        return loader

    def _sharded(self, dataloader: DataLoader, trainer: Any, training: bool) -> Any:
        parts = self.parts
        listeners = BatchListeners(
            self.steps.batch_ready,
            parts.loss_weights.evaluation_batch,
            parts.loss_weights.forget_evaluation_batch,
            parts.watcher.before_fetch,
        )
        split = parts.split.batch_sizes if training else None
        return parts.sharding.shard(dataloader, trainer, split, parts.collectives, parts.rank, listeners)

    def batch_received(self, batch: Any, trainer: Any) -> Any:
        return batch

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> Any:
        self.steps.step_starts(trainer.global_step)
        return self.steps.training_step(batch, user_step)

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        """The weighted backward of this rank's micro-batches (:class:`~lightning_hetero.split.steps.TrainingSteps`)."""
        self.steps.backward(
            closure_loss, backward, trainer.accumulate_grad_batches, zero_stage, trainer.lightning_module
        )

    def optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        """Lightning's optimizer step; the exchange inside is counted, the watch told, and a run of non-finite steps
        stops every rank together."""
        parts = self.parts
        with parts.communication.counting(), phase("optimizer step (its closure: training_step and backward)"):
            result = self._optimizer_step(step, backward, trainer, closure)
        parts.watcher.meter.optimizer_step_ended()
        parts.nonfinite.step_ended(trainer.global_step)  # may stop every rank, together
        return result

    def _optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        return step()

    def synchronize(self, counted: bool) -> None:
        pass  # (every step exchanged the gradients: one model on every rank)

    def link_wait_seconds(self) -> float:
        return 0.0  # (the exchange is inside the step: the watch times it there)

    def evaluation_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A validation or test step, with a logged "mean" weighted by samples."""
        with self.parts.loss_weights.weighted_sync(evaluating=True):
            return user_step(batch)

    def prediction_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        return user_step(batch)

    def sampler_replicas(self, rank: int, world_size: int) -> tuple[int, int]:
        return world_size, rank

    def write_report(self, trainer: Any, plugin: Any) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary."""
        parts = self.parts
        directory = self.report_directory or report_directory(trainer, parts.collectives.gather_objects)
        sections: dict[str, Any] = {
            "precision": plugin.summary() if isinstance(plugin, HeteroPrecision) else None,
            "communication": parts.communication.summary(),
            "nonfinite": parts.nonfinite.summary(),
            "asynchronous": self._asynchronous_summary(),
            "could_replan": self._could_replan,
        }
        parts.watcher.write_report(directory, parts.rank, parts.world_size, **sections)
        published = publish_to_loggers(trainer, directory) if parts.rank == 0 and directory is not None else []
        if published:
            rank_zero_info(f"HeteroStrategy: the plan and run report are in the {' and '.join(published)} run too.")

    def _asynchronous_summary(self) -> Optional[dict[str, Any]]:
        return None

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, target: Path, saved: dict[str, Any], write: WriteCheckpoint, zero_stage: int, engine: Any
    ) -> None:
        """Complete or ignored: staged, listed in a manifest of the split and the samples consumed, published
        atomically (:mod:`~lightning_hetero.recover.checkpoint`)."""
        parts = self.parts

        def write_this_rank(directory: Path) -> None:
            parts.recovery.write_with_deferred_errors(engine, lambda: write(directory), parts.rank == 0)
            parts.communication.save(directory, parts.rank)  # per-rank error feedback, in the manifest
            self._save_own_state(directory)
            if self.memory_shards is not None and engine.optimizer is not None:
                # (DeepSpeed's ZeRO-0 save keeps rank 0's optimizer alone; `engine`: the strategy's, which outlives
                # the fit for `trainer.save_checkpoint` after it)
                self.memory_shards.save(directory, engine.module, engine.optimizer)

        def facts() -> dict[str, Any]:
            plan = parts.split.plan
            recorded = manifest_facts(
                saved,
                parts.world_size,
                plan.batch_sizes if plan is not None else None,
                parts.split.global_samples_consumed(),
                zero_stage,
                engine,
                [facts.describe() for facts in self._setup.device_facts],
                parts.communication.checkpoint_facts(),
                sync=self._local_sync(),
            )
            if self.memory_shards is not None and engine.optimizer is not None:
                recorded[MANIFEST_KEY] = self.memory_shards.manifest_entry()
            return recorded

        parts.recovery.save(target, write_this_rank, facts)

    def _save_own_state(self, directory: Path) -> None:
        pass  # (DeepSpeed's files hold the rest of this rank's state)

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
        """Resume ``path`` the way its manifest says (:func:`~lightning_hetero.recover.resume.resume_route`)."""
        parts, setup = self.parts, self._setup
        if path.is_file():  # a .ckpt file another strategy (DDP...) wrote
            file_route(path, pipeline=False)
            setup.settle_the_global_batch(path, {}, zero_stage, module, same_world_size=True)  # (none recorded)
            client_state = parts.recovery.resume_from_lightning_file(
                path,
                module,
                engine,
                self._optimizer_order(),
                parts.sharding.training_order(),
                parts.split.global_batch_size,
                weights_only,
            )
            self._load_optimizer_shares(path, {}, engine)
            return client_state
        chosen, manifest = parts.recovery.choose(path, weights_only)
        refusal = shards_resume_refusal(chosen, manifest, self.memory_shards is not None, zero_stage)
        if refusal:
            raise ResumeRefused(refusal)
        route = resume_route(
            chosen,
            manifest,
            pipeline=False,
            local=self._local_sync(),
            world_size=parts.world_size,
            zero_stage=zero_stage,
            stage_is_automatic=stage_is_automatic,
        )
        if route is Route.FROM_PIPELINE:  # (the whole model by name; the global batch as the loader's state says)
            setup.settle_the_global_batch(chosen, {}, zero_stage, module, same_world_size=True)
            client_state = parts.recovery.resume_from_pipeline(
                chosen, manifest, module, engine, self._optimizer_order(), weights_only
            )
            self._load_optimizer_shares(chosen, {}, engine)
            return client_state
        same_world_size = route is Route.SAME_WORLD_SIZE
        parts.communication.load(chosen, parts.rank, manifest, same_world_size)
        setup.settle_the_global_batch(chosen, manifest, zero_stage, module, same_world_size)
        if same_world_size:
            client_state = load(str(chosen))
            self._load_own_state(chosen)
        else:
            client_state = parts.recovery.load_on_another_world_size(chosen, manifest, engine, load, weights_only)
        self._load_optimizer_shares(chosen, manifest, engine)
        if from_deepspeed.is_deepspeed_strategys(manifest):  # Lightning's DeepSpeedStrategy wrote it (no manifest)
            return from_deepspeed.with_data_position(client_state, manifest, parts.sharding.training_order())
        return client_state

    def _local_sync(self) -> Optional[str]:
        return None  # (not local training: see resume_route)

    def _load_own_state(self, directory: Path) -> None:
        pass

    def _load_optimizer_shares(self, chosen: Path, manifest: dict[str, Any], engine: Any) -> None:
        """After DeepSpeed's load: a checkpoint saved with memory-sized shards gives every rank the state it owns now
        (every name, without shards), by name; with shards, the state of parameters another rank owns is dropped
        (a checkpoint saved without them held it all)."""
        if engine is None or engine.optimizer is None:
            return
        skipped = self.memory_shards.unowned_names() if self.memory_shards is not None else set()
        if MANIFEST_KEY in manifest:
            load_named_shards(chosen, manifest, engine.module, engine.optimizer, self._optimizer_order(), skipped)
        if self.memory_shards is not None and self.memory_shards.shards is not None:
            self.memory_shards.shards.drop_unowned_state(engine.optimizer)
