"""The job: the facade the strategy calls at Lightning's lifecycle points, and the one owner of a run's state.

:class:`HeteroJob` holds, for one strategy across its trainer calls, what the ranks established at setup (device
facts, precisions, profiles, the data seed), the split in force, the capabilities every way of training shares
(collectives, emulation, data sharding, loss weights, watch, recovery, non-finite steps, communication), and the one
training mode its settings chose (:func:`mode_class`): data parallel (:mod:`lightning_hetero.split.training`), local
training (:mod:`lightning_hetero.local.training`) or a pipeline (:mod:`lightning_hetero.pipeline.training`). Each
method is one lifecycle point: the shared part, then the mode's (:class:`~lightning_hetero.train.mode.TrainingMode`);
the strategy keeps only Lightning's hook order and the DeepSpeed overrides. The setup survey and the start of a fit
are :mod:`.job_setup`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hetero.comm.communication import Communication
from lightning_hetero.comm.topology import slow_link_from_environment
from lightning_hetero.configure.deepspeed_config import config_disagreements, disagreement_message
from lightning_hetero.emulate.emulation import (
    REFERENCE_GBIT_PER_SECOND,
    Emulation,
    NoEmulation,
    ProcessEmulation,
    SendsEmulation,
    emulation_for,
)
from lightning_hetero.job_setup import JobSetup
from lightning_hetero.local.claims import REBUILT_LOADERS
from lightning_hetero.local.training import AsynchronousTrainingMode, LocalTrainingMode, local_training_state
from lightning_hetero.pipeline.stage import Pipeline
from lightning_hetero.pipeline.training import PipelineTraining
from lightning_hetero.precision.job import loss_scale_value
from lightning_hetero.precision.nonfinite import NonFiniteGuard
from lightning_hetero.precision.plugin import HeteroPrecision
from lightning_hetero.recover import checkpoint
from lightning_hetero.recover.recovery import Recovery
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.tracing import traced
from lightning_hetero.settings import HeteroSettings
from lightning_hetero.split.optimizer_shards import MemoryShards
from lightning_hetero.split.steps import RankParts
from lightning_hetero.split.training import DataParallelTraining
from lightning_hetero.train.micro_batches import MicroBatchGuard
from lightning_hetero.train.mode import Backward, Surveyed, TrainingMode, UserStep
from lightning_hetero.train.sharding import DataSharding
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.loss_reduction import LossReductionCheck
from lightning_hetero.watch.watcher import Watcher

ModeClass = Union[
    type[DataParallelTraining], type[LocalTrainingMode], type[AsynchronousTrainingMode], type[PipelineTraining]
]


def mode_class(settings: HeteroSettings) -> ModeClass:
    """The way of training ``settings`` chose: the one place that asks (the settings refused every mix of them)."""
    if settings.pipeline is not None:
        return PipelineTraining
    if settings.local and settings.asynchronous:
        return AsynchronousTrainingMode
    if settings.local:
        return LocalTrainingMode
    return DataParallelTraining


class HeteroJob:
    """This rank's view of the job. The training mode and the objects that need the ranks and the device are set up
    in :meth:`join`; ``follow_split(micro_batch)`` is told each time the split in force changes this rank's
    micro-batch."""

    def __init__(self, settings: HeteroSettings, follow_split: Callable[[int], None] = lambda micro_batch: None):
        self.settings = settings
        self.mode_class = mode_class(settings)
        self.communication = Communication(settings.compression, settings.hierarchical)
        self.rank, self.world_size = 0, 1
        self.emulation: Union[Emulation, ProcessEmulation, SendsEmulation, NoEmulation] = NoEmulation()
        self.collectives = Collectives(1, torch.device("cpu"), lambda: self.emulation.catch_up())
        self.split = SplitInForce(rank=0)
        self.split.follow(follow_split)
        self.sharding = DataSharding()
        self.loss_weights = LossWeights(settings.loss_reduction)
        self.micro_batch_guard = MicroBatchGuard()
        # Local SGD / DiLoCo's state (local/merges.py): the setup plans its inner steps, the mode merges with it.
        self.local = local_training_state(settings)
        self.loss_weights.local = self.local is not None
        self.recovery = Recovery(settings.peer_timeout)
        self.nonfinite = NonFiniteGuard(settings.max_nonfinite_steps, lambda t: self.collectives.gather_tensor(t))
        caught_up = lambda t: self.collectives.gather_tensor(t, catch_up=True)  # noqa: E731
        self.loss_check = LossReductionCheck(settings.loss_reduction, caught_up, rank_zero_warn)
        self.watcher: Optional[Watcher] = None
        # What the ranks told each other at setup (every rank holds the same), and the planning that reads it.
        self.setup = JobSetup(settings, self.split, self.sharding, self.communication, self.loss_check, self.local)
        self.mode: Optional[TrainingMode] = None  # the way of training, from join()
        self.engine: Optional[Any] = None  # DeepSpeed's engine of this trainer call, from attach()
        self._optimizer_parameters: list[tuple[str, Any]] = []  # (name, parameter) in the optimizer's order
        self._precision_plugin: Callable[[], Any] = lambda: None  # the strategy's (it is replaced at setup)

    # What the run established, for users and the monitor (HeteroStrategy's properties of the same names).
    plan = property(lambda self: self.split.plan, doc="The split in force.")
    prediction = property(lambda self: self.split.prediction, doc="The planner's predicted step times.")
    watch = property(lambda self: self.watcher.run if self.watcher else None, doc="Every rank's steps.")
    replans = property(lambda self: self.watcher.replans if self.watcher else [], doc="This fit's re-plans.")
    skipped_steps = property(lambda self: list(self.nonfinite.skipped), doc="Steps skipped for non-finite grads.")
    profiles = property(lambda self: self.setup.profiles, doc="Every rank's profile (automatic split only).")
    device_facts = property(lambda self: self.setup.device_facts, doc="Every rank's device facts.")
    precisions = property(lambda self: self.setup.precisions, doc="Every rank's precision.")

    @property
    def pipeline_stage(self) -> Optional[Pipeline]:
        """This rank's stage of a pipeline (None in another mode)."""
        return self.mode.pipeline if isinstance(self.mode, PipelineTraining) else None

    @property
    def pipeline_replans(self) -> list[dict[str, Any]]:
        """This fit's moves of a pipeline's blocks."""
        return self.mode.replans if isinstance(self.mode, PipelineTraining) else []

    def _mode(self) -> TrainingMode:
        if self.mode is None:  # (a lifecycle point before any setup, `strategy.load_checkpoint` alone: one rank's)
            self.watcher = self.watcher or self._new_watcher(torch.device("cpu"))
            self.mode = self._build_mode(torch.device("cpu"), self.watcher)
        return self.mode

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
        self.mode_class.check_trainer(self.settings, trainer, str(plugin.precision), world_size)
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
        """The process group exists: each capability learns its rank, the world size and the device, and the training
        mode is built. ``plugin``: a callable returning the strategy's precision plugin (it is replaced at setup);
        ``sync_batchnorm``: `Trainer(sync_batchnorm=True)`; ``collectives``: the job's (a test's fake; default: the
        default group's)."""
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
        self.watcher = self._new_watcher(device)
        self.setup.join(rank, world_size, self.collectives, self.emulation, self.watcher)
        self.communication.collective_observer = self.watcher.meter.collective  # (time blocked before the exchange)
        self.communication.send_hold = self.emulation.send_seconds
        self.watcher.loss_scale = lambda: loss_scale_value(plugin())
        self._precision_plugin = plugin
        if trainer is not None:
            at_each_step = self.mode_class.exchanges_each_step
            self.recovery.stop_together_on_sigterm(trainer, device, at_each_step=at_each_step)
        self.mode = self._build_mode(device, self.watcher)

    def _new_watcher(self, device: torch.device) -> Watcher:
        """The watch of this trainer call's steps; a mode whose ranks meet only at merges exchanges its records at
        the end only (window 0)."""
        window = self.settings.rebalance_window if self.mode_class.exchanges_each_step else 0
        watcher = Watcher(
            device,
            window,
            lambda: self.emulation.added_seconds,
            self.communication.reading,
            self.collectives.gather_tensor,
            lambda: self._mode().link_wait_seconds(),
            self.settings.trace,
        )
        watcher.skipped_steps = lambda: list(self.nonfinite.skipped)
        return watcher

    def _build_mode(self, device: torch.device, watcher: Watcher) -> TrainingMode:
        """The training mode of :func:`mode_class`, given each input it needs by name."""
        settings, kind = self.settings, self.mode_class
        if kind is PipelineTraining:
            assert settings.pipeline is not None
            # (a point-to-point wait has a deadline; without a watchdog, torch's default's 30 min)
            timeout = settings.peer_timeout or 1800.0
            # (an evaluation after a fit keeps the fit's stages: each rank holds its own blocks only)
            earlier = self.mode.pipeline.placement if isinstance(self.mode, PipelineTraining) else None
            return PipelineTraining(
                Pipeline(settings.pipeline, self.rank, self.world_size, device, timeout),
                rank=self.rank,
                world_size=self.world_size,
                collectives=self.collectives,
                sharding=self.sharding,
                loss_weights=self.loss_weights,
                emulation=self.emulation,
                recovery=self.recovery,
                nonfinite=self.nonfinite,
                rebalance=settings.rebalance,
                rebalance_window=settings.rebalance_window,
                rebalance_threshold=settings.rebalance_threshold,
                loss_reduction=settings.loss_reduction,
                earlier_placement=earlier,
                loss_scale=lambda: loss_scale_value(self._precision_plugin()),
                parameters_arrived=self._parameters_arrived,
                shard_optimizer=settings.stage == 1,
                shards=settings.shards,
            )
        parts = RankParts(
            rank=self.rank,
            world_size=self.world_size,
            collectives=self.collectives,
            emulation=self.emulation,
            watcher=watcher,
            communication=self.communication,
            split=self.split,
            sharding=self.sharding,
            loss_weights=self.loss_weights,
            micro_batch_guard=self.micro_batch_guard,
            nonfinite=self.nonfinite,
            loss_check=self.loss_check,
            recovery=self.recovery,
        )
        could_replan = settings.rebalancing(profiled=True, world_size=self.world_size)
        order = lambda: self._optimizer_parameters  # noqa: E731
        if kind is DataParallelTraining:
            shards = (
                MemoryShards(self.rank, self.world_size, settings.stage or 0) if settings.shards_by_memory else None
            )
            return DataParallelTraining(parts, self.setup, could_replan, order, shards)
        assert self.local is not None and settings.sync is not None
        load_local = self.setup.load_local_training
        if kind is AsynchronousTrainingMode:
            return AsynchronousTrainingMode(
                parts, self.setup, could_replan, order, self.local, settings.sync, load_local, settings.sync_every
            )
        return LocalTrainingMode(parts, self.setup, could_replan, order, self.local, settings.sync, load_local)

    def _parameters_arrived(self, parameters: list[torch.nn.Parameter]) -> None:
        """Parameters that joined this rank's module during a fit (a pipeline's moved blocks): this rank's precision
        plugin takes them on (an fp16 rank unscales their gradients)."""
        plugin = self._precision_plugin()
        if isinstance(plugin, HeteroPrecision):
            plugin.parameters_arrived(parameters)

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
        then the mode's split, inner steps or stages); ``config`` gets the stage and the exchange's entries. Returns
        this rank's own precision plugin (None: keep the Trainer's) and its micro-batch."""
        fitting = trainer.state.fn == TrainerFn.FITTING
        zero = config["zero_optimization"]
        global_batch_size = self.setup.survey(trainer, fitting, module, device, str(precision.precision), zero["stage"])
        own_plugin = self.setup.plugin_for_this_rank(precision)
        half = own_plugin is None and half_precision_engine
        if automatic_stages is not None:
            zero["stage"] = self.setup.choose_zero_stage(global_batch_size, module, fitting, automatic_stages, half)
        else:
            self.setup.check_given_stage_fits(global_batch_size, module, fitting, zero["stage"], half)
        self.setup.configure_communication(config)
        setup = self.setup
        surveyed = Surveyed(setup.precisions, setup.device_facts, setup.memory_byte_ceilings)
        micro_batch = self._mode().start(global_batch_size, module, device, zero["stage"], fitting, surveyed, config)
        return own_plugin, micro_batch

    def check_configs_agree(self, config: dict[str, Any]) -> None:
        """Every rank's finished DeepSpeed config agrees where it must (one gather; every rank raises alike)."""
        lines = config_disagreements(self.collectives.gather_objects(config))
        if lines:
            raise ValueError(disagreement_message(lines))

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> None:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON."""
        self._mode().write_plan(trainer, config)

    @contextlib.contextmanager
    def engine_built(self, module: Any, optimizer: Any) -> Iterator[None]:
        """Around ``deepspeed.initialize`` (the mode's part: a pipeline skips the engine's broadcast of rank 0's
        parameters); the optimizer's parameters kept in its order, which another strategy's optimizer state is
        indexed by."""
        if optimizer is not None:  # (an evaluation's engine has none: the last fit's order stays)
            names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
            self._optimizer_parameters = [
                (names.get(id(p), ""), p) for g in optimizer.param_groups for p in g["params"]
            ]
        with self._mode().engine_built():
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
        self._mode().attach(engine)
        if own_precision:  # (a mode's agreement that the step is not finite counts as an fp16 overflow: pipelines)
            plugin.agreed_nonfinite = lambda: self.nonfinite.agreed_nonfinite()

    def detach(self, plugin: Any, trainer: Optional[Any]) -> None:
        """The trainer call ends: the patches are undone (the engine's traced step dies with it), the watch stops."""
        if isinstance(plugin, HeteroPrecision):
            plugin.detach()
        self.communication.detach()
        self.nonfinite.detach()
        if self.mode is not None:
            self.mode.detach()
        if self.watcher is not None:  # (a rank that raised while a trace recorded: what it has is written)
            self.watcher.stop_tracing()
        self.recovery.teardown(finished=trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED)
        self.sharding.forget_served_loader(trainer)  # (a fit that failed before its loop asked for it: not the next's)
        self.emulation.stop()  # (a throttled process runs freely between trainer calls)
        self.engine = None

    # ------------------------------------------------------------------ data and steps

    def shard(self, dataloader: Any, trainer: Any) -> Any:
        """A loader rebuilt for this rank by the mode (a loader the strategy already rebuilt, or none of torch's, is
        returned as it is)."""
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, REBUILT_LOADERS):
            return dataloader
        return self._mode().shard(dataloader, trainer)

    def batch_received(self, batch: Any, trainer: Any) -> Any:
        """A training batch as the strategy moves it to the device, before the user's batch hooks."""
        return self._mode().batch_received(batch, trainer) if self.mode is not None else batch

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (see :mod:`lightning_hetero.train.weights`)."""
        return self.loss_weights.current(self.split.plan)

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> Any:
        return self._mode().training_step(batch, user_step, trainer)

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        self._mode().backward(closure_loss, backward, trainer, zero_stage)

    def optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any = None) -> Any:
        """Lightning's optimizer step (``step``, with its closure), as the mode takes it."""
        return self._mode().optimizer_step(step, backward, trainer, closure)

    def validation_starts(self, trainer: Any) -> None:
        """Validation during a fit sees one model: a mode whose ranks drift apart merges them first (at an epoch's end
        they are merged already; a `val_check_interval` inside an epoch or `limit_train_batches` merges here)."""
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._mode().synchronize(counted=True)

    def training_ends(self) -> None:
        """The fit's training loop ends on every rank: one model on every rank; then the loss check decides on the
        steps it has, if not yet (bookkeeping gathers, not counted)."""
        self._mode().synchronize(counted=True)
        self.loss_check.fit_ends()

    def evaluation_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A validation or test step, as the mode takes it."""
        return self._mode().evaluation_step(batch, user_step)

    def prediction_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A predict step, as the mode takes it."""
        return self._mode().prediction_step(batch, user_step)

    def sampler_replicas(self) -> Optional[tuple[int, int]]:
        """(replicas, this rank's index) for Lightning's distributed sampler, which shards `predict`'s data (the
        package shards the other loaders itself); None before a trainer call set the mode up."""
        return self.mode.sampler_replicas(self.rank, self.world_size) if self.mode is not None else None

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
        self._mode().write_report(trainer, plugin)

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
        mode = self._mode()
        mode.synchronize(counted=False)  # (a checkpoint holds one model; its exchange is not training's)
        mode.save_checkpoint(target, saved, write, zero_stage, engine)

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
        """Resume ``path`` (a checkpoint directory, or another strategy's file) as the mode takes it; ``load``:
        DeepSpeed's load (the parent strategy's); ``weights_only``: Lightning's, for a file."""
        # DeepSpeed restores the checkpoint after setup requested the training loader, and the state it restores may
        # change what `train_dataloader()` returns: the fit loop asks again, as under DDP.
        self.sharding.forget_served_loader(trainer)
        return self._mode().load_checkpoint(path, load, module, zero_stage, stage_is_automatic, engine, weights_only)
