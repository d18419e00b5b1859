"""The job: the facade the strategy calls at Lightning's lifecycle points, and the one owner of a run's state.

:class:`HeteroJob` holds, for one strategy across its trainer calls, what the ranks established at setup (device
facts, precisions, profiles, the data seed), the split in force, and one object per capability (collectives,
emulation, data sharding, loss weights, the training steps, watch, recovery, non-finite steps, communication, local
training, the pipeline). Each method is one lifecycle point, handed over to the stages' objects; the strategy keeps
only Lightning's hook order and the DeepSpeed overrides. The setup survey and the start of a fit are :mod:`.job_setup`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hetero.comm.communication import Communication
from lightning_hetero.comm.topology import slow_link_from_environment
from lightning_hetero.emulate.emulation import (
    REFERENCE_GBIT_PER_SECOND,
    Emulation,
    NoEmulation,
    ProcessEmulation,
    SendsEmulation,
    emulation_for,
)
from lightning_hetero.job_setup import JobSetup
from lightning_hetero.pipeline.stage import Pipeline
from lightning_hetero.pipeline.training import PipelineTraining, check_pipeline_job
from lightning_hetero.plan.deepspeed_config import config_disagreements, disagreement_message
from lightning_hetero.precision.job import loss_scale_value
from lightning_hetero.precision.nonfinite import NonFiniteGuard
from lightning_hetero.precision.plugin import HeteroPrecision
from lightning_hetero.recover import checkpoint, from_deepspeed
from lightning_hetero.recover.recovery import Recovery, manifest_facts
from lightning_hetero.recover.resume import Route, file_route, resume_route
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.tracing import phase, traced
from lightning_hetero.settings import HeteroSettings
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.claims import REBUILT_LOADERS, AsynchronousTraining
from lightning_hetero.train.local_sgd import LocalTraining
from lightning_hetero.train.micro_batches import MicroBatchGuard
from lightning_hetero.train.sharding import BatchListeners, DataSharding
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.steps import Backward, TrainingSteps, UserStep
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.loss_reduction import LossReductionCheck
from lightning_hetero.watch.meter import time_deepspeed_exchanges
from lightning_hetero.watch.publish import publish_to_loggers, report_directory
from lightning_hetero.watch.watcher import Watcher


class HeteroJob:
    """This rank's view of the job. Objects that need the job (ranks, device) are set up in :meth:`join`;
    ``follow_split(micro_batch)`` is told each time the split in force changes this rank's micro-batch."""

    def __init__(self, settings: HeteroSettings, follow_split: Callable[[int], None] = lambda micro_batch: None):
        self.settings = settings
        self.communication = Communication(settings.compression, settings.hierarchical)
        self.rank, self.world_size = 0, 1
        self.emulation: Union[Emulation, ProcessEmulation, SendsEmulation, NoEmulation] = NoEmulation()
        self.collectives = Collectives(1, torch.device("cpu"), lambda: self.emulation.catch_up())
        self.split = SplitInForce(rank=0)
        self.split.follow(follow_split)
        self.sharding = DataSharding()
        self.loss_weights = LossWeights(settings.loss_reduction)
        self.micro_batch_guard = MicroBatchGuard()
        self.steps = TrainingSteps(self)
        self.local: Optional[LocalTraining] = None  # local SGD / DiLoCo (train/local_sgd.py)
        self.pipeline: Optional[PipelineTraining] = None  # the model split into stages, from join()
        if settings.local:
            self.local = LocalTraining(
                settings.sync,
                settings.sync_every,
                settings.outer,
                settings.compression.mode,
                settings.fragments,
                settings.overlap,
                settings.eager,
            )
            self.loss_weights.local = True
        self.claims = AsynchronousTraining(self, settings.sync_every) if settings.asynchronous else None
        self.recovery = Recovery(settings.peer_timeout)
        self.nonfinite = NonFiniteGuard(settings.max_nonfinite_steps, lambda t: self.collectives.gather_tensor(t))
        caught_up = lambda t: self.collectives.gather_tensor(t, catch_up=True)  # noqa: E731
        self.loss_check = LossReductionCheck(settings.loss_reduction, caught_up, rank_zero_warn)
        self.watcher: Optional[Watcher] = None
        # What the ranks told each other at setup (every rank holds the same), and the planning that reads it.
        self.setup = JobSetup(settings, self.split, self.sharding, self.communication, self.loss_check, self.local)
        self.engine: Optional[Any] = None  # DeepSpeed's engine of this trainer call, from attach()
        self.report_directory: Optional[Path] = None  # where this fit's plan and report go (watch/publish.py)
        self._optimizer_parameters: list[tuple[str, Any]] = []  # (name, parameter) in the optimizer's order

    # What the run established, for users and the monitor (HeteroStrategy's properties of the same names).
    plan = property(lambda self: self.split.plan, doc="The split in force.")
    prediction = property(lambda self: self.split.prediction, doc="The planner's predicted step times.")
    watch = property(lambda self: self.watcher.run if self.watcher else None, doc="Every rank's steps.")
    replans = property(lambda self: self.watcher.replans if self.watcher else [], doc="This fit's re-plans.")
    skipped_steps = property(lambda self: list(self.nonfinite.skipped), doc="Steps skipped for non-finite grads.")
    profiles = property(lambda self: self.setup.profiles, doc="Every rank's profile (automatic split only).")
    device_facts = property(lambda self: self.setup.device_facts, doc="Every rank's device facts.")
    precisions = property(lambda self: self.setup.precisions, doc="Every rank's precision.")
    pipeline_stage = property(lambda self: self.pipeline.pipeline if self.pipeline else None, doc="This rank's stage.")
    pipeline_replans = property(lambda self: self.pipeline.replans if self.pipeline else [], doc="Blocks moved.")

    # ------------------------------------------------------------------ setup

    def check_job(
        self,
        world_size: int,
        device_type: str,
        config: dict[str, Any],
        sync_batchnorm: bool,
        plugin: Any,
        trainer: Optional[Any],
    ) -> None:
        """What the world size, the device and the trainer refuse, on every rank before the process group exists
        (``plugin``: the strategy's precision plugin; ours, from an earlier trainer call, is not the Trainer's)."""
        given = None if isinstance(plugin, HeteroPrecision) else (str(plugin.precision), type(plugin).__name__)
        self.settings.check_job(world_size, device_type, config, sync_batchnorm, trainer_precision=given)
        if self.settings.pipeline is not None:
            check_pipeline_job(self.settings.pipeline, trainer, str(plugin.precision), world_size)
        if trainer is not None:
            self.sharding.take_over_distributed_sampling(trainer)

    def join(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        trainer: Optional[Any],
        plugin: Any,
        sync_batchnorm: bool = False,
        collectives: Optional[Collectives] = None,
    ) -> None:
        """The process group exists: each capability learns its rank, the world size and the device. ``plugin``: a
        callable returning the strategy's precision plugin (it is replaced at setup); ``sync_batchnorm``:
        `Trainer(sync_batchnorm=True)`; ``collectives``: the job's (a test's fake; default: the default group's)."""
        self.rank, self.world_size = rank, world_size
        self.setup.sync_batchnorm = sync_batchnorm
        self.emulation.stop()  # (an earlier trainer call's, if it did not end through detach)
        link = slow_link_from_environment()  # (an emulated slow sender sends on its speed times this link)
        send_gbit = link.gbit_per_second if link is not None else REFERENCE_GBIT_PER_SECOND
        self.emulation = emulation_for(
            self.settings.speed_schedule, rank, device, self.settings.emulate_slowdown, send_gbit
        )
        self.collectives = collectives or Collectives(world_size, device, lambda: self.emulation.catch_up())
        self.recovery.join(self.collectives, rank)
        self.recovery.watch_peers()
        self.split.rank = rank
        self.loss_weights.join(rank, world_size, self.collectives.sum, self.collectives.reduce_in_place)
        window = 0 if self.claims is not None else self.settings.rebalance_window  # (0: exchanged at the end only)
        self.watcher = Watcher(
            device,
            window,
            lambda: self.emulation.added_seconds,
            self.communication.reading,
            self.collectives.gather_tensor,
            lambda: self.local.link_wait_seconds if self.local is not None else 0.0,
            self.settings.trace,
        )
        self.watcher.skipped_steps = lambda: list(self.nonfinite.skipped)
        self.setup.join(rank, world_size, self.collectives, self.emulation, self.watcher)
        self.communication.collective_observer = self.watcher.meter.collective  # (time blocked before the exchange)
        self.communication.send_hold = self.emulation.send_seconds
        self.watcher.loss_scale = lambda: loss_scale_value(plugin())
        if trainer is not None:
            self.recovery.stop_together_on_sigterm(trainer, device, at_each_step=self.claims is None)
        choice = self.settings.pipeline
        if choice is not None:  # (a point-to-point wait has a deadline; without a watchdog, torch's default's 30 min)
            timeout = self.settings.peer_timeout or 1800.0
            settings = self.settings
            self.pipeline = PipelineTraining(
                Pipeline(choice, rank, world_size, device, timeout),
                rank=rank,
                world_size=world_size,
                collectives=self.collectives,
                sharding=self.sharding,
                loss_weights=self.loss_weights,
                emulation=self.emulation,
                recovery=self.recovery,
                rebalance=settings.rebalance,
                rebalance_window=settings.rebalance_window,
                rebalance_threshold=settings.rebalance_threshold,
                loss_reduction=settings.loss_reduction,
            )

    def configure(
        self,
        config: dict[str, Any],
        trainer: Any,
        module: Any,
        device: torch.device,
        precision: Any,
        automatic_stages: Optional[tuple[int, ...]],
        half_precision_engine: bool,
    ) -> tuple[Any, int]:
        """Measure and plan this trainer call (the setup survey, this rank's precision, the ZeRO stage, the exchange,
        the split or the pipeline's stages); ``config`` gets the stage and the exchange's entries. Returns this rank's
        own precision plugin (None: keep the Trainer's) and its micro-batch."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        zero = config["zero_optimization"]
        global_batch_size = self.setup.survey(trainer, fitting, module, device, str(precision.precision), zero["stage"])
        own_plugin = self.setup.plugin_for_this_rank(precision)
        if automatic_stages is not None:
            half = own_plugin is None and half_precision_engine
            zero["stage"] = self.setup.choose_zero_stage(global_batch_size, module, fitting, automatic_stages, half)
        self.setup.configure_communication(config)
        if self.pipeline is not None:  # (only fit reaches here then: check_pipeline_job refused the rest)
            setup = self.setup
            started = self.pipeline.start(
                global_batch_size, module, device, setup.precisions, setup.device_facts, setup.memory_byte_ceilings
            )
            return own_plugin, started
        if fitting:
            self.setup.start_the_split(global_batch_size, zero["stage"], module)
        return own_plugin, self.split.micro_batch

    def check_configs_agree(self, config: dict[str, Any]) -> None:
        """Every rank's finished DeepSpeed config agrees where it must (one gather; every rank raises alike)."""
        lines = config_disagreements(self.collectives.gather_objects(config))
        if lines:
            raise ValueError(disagreement_message(lines))

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> None:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON."""
        self.report_directory = self.setup.write_plan(trainer, config) if self.pipeline is None else None  # (its own)

    @contextlib.contextmanager
    def engine_built(self, module: Any, optimizer: Any) -> Iterator[None]:
        """Around ``deepspeed.initialize`` (a pipeline skips the engine's broadcast of rank 0's parameters); the
        optimizer's parameters kept in its order, which another strategy's optimizer state is indexed by."""
        names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
        groups = optimizer.param_groups if optimizer is not None else []
        self._optimizer_parameters = [(names.get(id(p), ""), p) for g in groups for p in g["params"]]
        with self.pipeline.engine_built() if self.pipeline is not None else contextlib.nullcontext():
            yield

    def attach(self, engine: Any, plugin: Any) -> None:
        """DeepSpeed's engine exists: the capabilities that act inside it attach (undone by :meth:`detach`)."""
        self.engine = engine
        engine.step = traced(engine.step, "optimizer update (DeepSpeed's step: ZeRO's exchange, the optimizer)")
        own_precision = isinstance(plugin, HeteroPrecision)
        skipping = (lambda: plugin.skips_this_step) if own_precision else (lambda: False)
        self.communication.attach(engine, self.rank, skipping)
        scaled = own_precision and plugin.loss_scale is not None
        precisions = ", ".join(sorted(set(self.setup.precisions))) or str(plugin.precision)
        self.nonfinite.attach(engine, has_loss_scale=scaled, skipping_installed=scaled, precision=precisions)
        if self.watcher is not None and self.pipeline is None:  # (the arrivals at the exchange: watch/meter.py)
            # (inside the emulation's wrapper: an emulated slower rank arrives once it has paid its delay)
            time_deepspeed_exchanges(engine, self.watcher.meter)
        self.emulation.around_deepspeed_exchanges(engine)
        if self.local is not None and engine.optimizer is not None:
            # No exchange at the step: each rank steps its own optimizer on its own gradients until a synchronization.
            engine.enable_backward_allreduce = False
            self.local.attach([p for p in engine.module.parameters() if p.requires_grad], engine.optimizer)
            self.nonfinite.rank_local = self.rank
        if self.pipeline is not None:
            self.pipeline.attach(engine)
        elif self.world_size > 1 and engine.optimizer is not None:
            self.steps.buffer_sync = BufferSync(engine.module.buffers(), self.collectives.broadcast_in_place)

    def detach(self, plugin: Any, trainer: Optional[Any]) -> None:
        """The trainer call ends: the patches are undone (the engine's traced step dies with it), the watch stops."""
        if isinstance(plugin, HeteroPrecision):
            plugin.detach()
        self.communication.detach()
        self.nonfinite.detach()
        if self.local is not None:
            self.local.detach()
        if self.pipeline is not None:
            self.pipeline.detach()
        if self.watcher is not None:  # (a rank that raised while a trace recorded: what it has is written)
            self.watcher.stop_tracing()
        self.recovery.teardown(finished=trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED)
        self.sharding.forget_served_loader(trainer)  # (a fit that failed before its loop asked for it: not the next's)
        self.emulation.stop()  # (a throttled process runs freely between trainer calls)
        self.report_directory, self.engine, self.steps.buffer_sync = None, None, None

    # ------------------------------------------------------------------ data and steps

    def shard(self, dataloader: Any, trainer: Any) -> Any:
        """A loader rebuilt for this rank: the training loader by the split in force, evaluation loaders equally
        (a loader the strategy already rebuilt, or none of torch's, is returned as it is)."""
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, REBUILT_LOADERS):
            return dataloader
        if self.pipeline is not None:
            return self.pipeline.shard(dataloader, trainer)
        assert self.watcher is not None
        training = trainer.state.stage == RunningStage.TRAINING
        listeners = BatchListeners(
            self.training_batch,
            self.loss_weights.evaluation_batch,
            self.loss_weights.forget_evaluation_batch,
            self.watcher.before_fetch,
        )
        split = self.split.batch_sizes if training else None
        loader = self.sharding.shard(dataloader, trainer, split, self.collectives, self.rank, listeners)
        if training and self.claims is not None:  # (asynchronous merges: each rank claims its micro-batches)
            return self.claims.loader(loader, trainer, self.recovery.run, self.recovery.connect_to_store)
        if training:
            self.split.cut_by(loader)
        return loader

    def training_batch(self, local_samples: int, global_samples: int) -> None:
        self.loss_weights.training_batch(local_samples, global_samples)
        assert self.watcher is not None
        self.watcher.meter.batch_ready(local_samples, self.split.micro_steps)

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (see :mod:`lightning_hetero.train.weights`)."""
        return self.loss_weights.current(self.split.plan)

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> Any:
        """Lightning's ``training_step``: through the pipeline's stages, else this rank's first micro-batch."""
        engine = self.engine
        if self.pipeline is not None:
            assert engine is not None  # (attach() ran: Lightning steps only after setting the engine up)
            return self.pipeline.step(
                batch, user_step, engine.backward, engine.module, trainer.global_step, engine.optimizer
            )
        return self.steps.training_step(batch, user_step, trainer.global_step)

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        """Lightning's ``backward``: the pipeline's schedule ran it already; else the weighted backward of this
        rank's micro-batches (:class:`~lightning_hetero.train.steps.TrainingSteps`)."""
        if self.pipeline is not None:
            self.pipeline.backward()
            return
        self.steps.backward(
            closure_loss, backward, trainer.accumulate_grad_batches, zero_stage, trainer.lightning_module
        )

    def optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any = None) -> Any:
        """Lightning's optimizer step (``step``, with its closure), then local training's inner steps; the exchange
        inside is counted, the watch told, and a run of non-finite steps stops every rank together."""
        if self.pipeline is not None:
            return step()
        with self.communication.counting(), phase("optimizer step (its closure: training_step and backward)"):
            result = step() if self.claims is None else self.claims.optimizer_step(step, closure)
            if self.local is not None:
                self.steps.inner_steps(backward, self.engine, trainer.is_last_batch)
        assert self.watcher is not None
        self.watcher.meter.optimizer_step_ended()
        self.nonfinite.step_ended(trainer.global_step)  # may stop every rank, together
        return result

    def synchronize_local_training(self, counted: bool = True) -> None:
        """Local training: synchronize now if any rank trained since the last synchronization (before a checkpoint,
        a validation inside a fit, the end of a fit); every rank calls it at the same point and decides alike.
        ``counted``: the exchange counts in the report (a checkpoint's does not: it is not training's)."""
        if self.local is not None and self.local.merge_pending:
            with self.communication.counting() if counted else contextlib.nullcontext():
                self.collectives.before_each()
                self.local.synchronize(self.collectives.reduce_in_place, self.collectives.gather_tensor)

    def validation_starts(self, trainer: Any) -> None:
        """Local SGD / DiLoCo: validation during a fit sees one model, the ranks' merged parameters (at an epoch's
        end they are merged already; a `val_check_interval` inside an epoch or `limit_train_batches` merges here)."""
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self.synchronize_local_training()

    def training_ends(self) -> None:
        """The fit's training loop ends on every rank: local training synchronizes a last time (one model on every
        rank); then the loss check decides on the steps it has, if not yet (bookkeeping gathers, not counted)."""
        self.synchronize_local_training()
        self.loss_check.fit_ends()

    def evaluation_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A validation or test step: through the pipeline's stages, else with a logged "mean" weighted by samples."""
        if self.pipeline is not None:
            return self.pipeline.evaluation_step(batch, user_step)
        with self.loss_weights.weighted_sync(evaluating=True):
            return user_step(batch)

    def before_collective(self, name: str) -> None:
        """The user's ``all_gather``, ``broadcast`` or ``barrier``: refused in a micro-batch before the rank's last.
        An emulated slow rank reaches any collective (a ``sync_dist`` log too) after its stretched compute, as a
        slower device would; paying later would let its peers run ahead."""
        self.micro_batch_guard.refuse_collective(name)
        self.collectives.before_each()

    def reduce(self, tensor: Any, group: Optional[Any], reduce_op: Any, plain_reduce: Callable[..., Any]) -> Any:
        """Inside a step a "mean" is weighted by each rank's samples (:class:`~.train.weights.LossWeights`). In a
        micro-batch before the rank's last (``micro_steps``), or between asynchronous merges, nothing is reduced."""
        if self.micro_batch_guard.rank_local:
            return tensor
        self.collectives.before_each()
        return self.loss_weights.reduce(tensor, group, reduce_op, plain_reduce)

    def write_report(self, trainer: Any, plugin: Any) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary."""
        if self.pipeline is not None:
            return self.pipeline.write_report(trainer)
        assert self.watcher is not None
        directory = self.report_directory or report_directory(trainer, self.collectives.gather_objects)
        sections: dict[str, Any] = {
            "precision": plugin.summary() if isinstance(plugin, HeteroPrecision) else None,
            "communication": self.communication.summary(),
            "nonfinite": self.nonfinite.summary(),
            "asynchronous": self.claims.summary() if self.claims else None,
            "could_replan": self.settings.rebalancing(profiled=True, world_size=self.world_size),
        }
        self.watcher.write_report(directory, self.rank, self.world_size, **sections)
        published = publish_to_loggers(trainer, directory) if self.rank == 0 and directory is not None else []
        if published:
            rank_zero_info(f"HeteroStrategy: the plan and run report are in the {' and '.join(published)} run too.")

    def on_exception(self, exception: BaseException, trainer: Any) -> None:
        """Say on every rank which rank failed and how (see :mod:`lightning_hetero.recover.failures`)."""
        self.recovery.on_exception(exception, trainer)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, target: Path, saved: dict[str, Any], write: Callable[[Path], None], zero_stage: int, engine: Any
    ) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (:mod:`~.recover.checkpoint`).
        ``write(directory)``: DeepSpeed's save of this rank's files (the parent strategy's); ``engine``: the
        strategy's (it outlives the trainer call: `trainer.save_checkpoint` after a fit)."""
        # (a checkpoint that loses its manifest is still known for the package's: incomplete, never another strategy's)
        saved[checkpoint.PACKAGE_MARK] = {"format_version": checkpoint.FORMAT_VERSION}
        if self.pipeline is not None:  # each rank's blocks by name (pipeline/state.py)
            self.pipeline.save_checkpoint(target, saved, engine)
            return
        # Local SGD / DiLoCo: a checkpoint holds synchronized parameters (one model), each rank's own optimizer state.
        self.synchronize_local_training(counted=False)

        def write_this_rank(directory: Path) -> None:
            self.recovery.write_with_deferred_errors(engine, lambda: write(directory), self.rank == 0)
            self.communication.save(directory, self.rank)  # per-rank error feedback, in the manifest
            if self.local is not None:
                self.local.save(directory, self.rank)

        def facts() -> dict[str, Any]:
            plan = self.split.plan
            return manifest_facts(
                saved,
                self.world_size,
                plan.batch_sizes if plan is not None else None,
                self.split.global_samples_consumed(),
                zero_stage,
                engine,
                [facts.describe() for facts in self.setup.device_facts],
                self.communication.checkpoint_facts(),
            )

        self.recovery.save(target, write_this_rank, facts)

    def remove_checkpoint(self, path: Path, remove: Callable[[Path], None]) -> None:
        self.recovery.remove(path, remove)  # (rank 0 alone, and never the only complete checkpoint)

    def load_checkpoint(
        self,
        path: Path,
        load: Callable[[str], Any],
        module: Any,
        trainer: Optional[Any],
        zero_stage: int,
        stage_is_automatic: bool,
        engine: Any,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Resume ``path`` the way its manifest says (:func:`~lightning_hetero.recover.resume.resume_route`);
        ``load(directory)``: DeepSpeed's load (the parent strategy's); ``weights_only``: Lightning's, for a file."""
        # DeepSpeed restores the checkpoint after setup requested the training loader, and the state it restores may
        # change what `train_dataloader()` returns: the fit loop asks again, as under DDP.
        self.sharding.forget_served_loader(trainer)
        if path.is_file():  # a .ckpt file another strategy (DDP...) wrote
            file_route(path, pipeline=self.pipeline is not None)
            self.setup.settle_the_global_batch(path, {}, zero_stage, module, same_world_size=True)  # (none recorded)
            return self.recovery.resume_from_lightning_file(
                path,
                module,
                engine,
                self._optimizer_parameters,
                self.sharding.training_order(),
                self.split.global_batch_size,
                weights_only,
            )
        chosen, manifest = self.recovery.choose(path, weights_only)
        route = resume_route(
            chosen,
            manifest,
            pipeline=self.pipeline is not None,
            local=self.settings.sync if self.local is not None else None,
            world_size=self.world_size,
            zero_stage=zero_stage,
            stage_is_automatic=stage_is_automatic,
        )
        if route is Route.PIPELINE:
            assert self.pipeline is not None
            return self.pipeline.load_checkpoint(chosen, manifest, engine, weights_only)
        same_world_size = route is Route.SAME_WORLD_SIZE
        self.communication.load(chosen, self.rank, manifest, same_world_size)
        self.setup.settle_the_global_batch(chosen, manifest, zero_stage, module, same_world_size)
        if same_world_size:
            client_state = load(str(chosen))
            self.setup.load_local_training(chosen)  # (local SGD / DiLoCo only)
        else:
            client_state = self.recovery.load_on_another_world_size(chosen, manifest, engine, load, weights_only)
        if from_deepspeed.is_deepspeed_strategys(manifest):  # Lightning's DeepSpeedStrategy wrote it (no manifest)
            return from_deepspeed.with_data_position(client_state, manifest, self.sharding.training_order())
        return client_state
