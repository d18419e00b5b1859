"""HeteroStrategy: Lightning's DeepSpeedStrategy with a per-rank micro-batch, on CPU and CUDA.

Orchestration only: Lightning's hook order, the setup collectives and the DeepSpeed overrides. At each lifecycle
point it calls :class:`~lightning_hetero.job.HeteroJob`, the one owner of the run's state, whose objects come from
the stage folders (see the package docstring); the arguments are checked once in
:class:`~lightning_hetero.settings.HeteroSettings`.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_hetero.configure.deepspeed_config import (
    CPU_ZERO_SETTINGS,
    check_config_argument,
    default_config_stage,
    logging_batch_size_note,
    rank_config,
    with_cpu_zero_settings,
)
from lightning_hetero.configure.presets import PRESETS
from lightning_hetero.configure.zero_stage import HALF_PRECISION_ENGINES
from lightning_hetero.job import HeteroJob
from lightning_hetero.measure.partitioned import drop_deepspeed_hooks
from lightning_hetero.precision.choice import FP16_LOSS_SCALE_ARGUMENTS, unused_fp16_arguments
from lightning_hetero.precision.job import attach_to_engine
from lightning_hetero.precision.nonfinite import DEFAULT_MAX_NONFINITE_STEPS
from lightning_hetero.recover import elastic, liveness
from lightning_hetero.runtime import quiet, safe_load, startup
from lightning_hetero.runtime.shutdown import register_exit_cleanup
from lightning_hetero.settings import HeteroSettings
from lightning_hetero.split.decisions.replan import DEFAULT_THRESHOLD, DEFAULT_WINDOW
from lightning_hetero.train.sync_batchnorm import with_layer_sync


class HeteroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism where every rank has its own micro-batch.

    Without ``batch_sizes`` or ``weights`` every rank benchmarks its step at fit start, the planner picks the split
    that minimises the slowest rank's step within each device's memory, and the split follows what the ranks measure.

    Args:
        stage: ZeRO stage 0-3. Default: at setup, the lowest that fits every device (the plan says why); 0 with local
            SGD / DiLoCo and compression hooks. A ``config``'s ``zero_optimization.stage`` wins (none there: ZeRO-0).
        global_batch_size: samples per step across all ranks. Default: the training loader's ``batch_size`` times
            the world size (what DDP would use), or the sum of ``batch_sizes``.
        batch_sizes: each rank's micro-batch, in global rank order; they sum to the global batch.
        weights: relative capability per rank; the global batch is split in proportion (each rank >= 1 sample).
        micro_steps: forward/backward passes per optimizer step on each rank, e.g. ``[3, 1]``, for a fast device with
            little memory; the update is the full-batch one. Default: planned where memory binds (ZeRO-3: equal).
        loss_reduction: what ``training_step`` returns: ``"mean"`` (default) or ``"sum"`` over its batch, or
            ``"token_mean"``; each rank's loss is weighted so that the update is DDP's whatever the split.
        emulate_speeds: a test and demo aid: one speed in (0, 1] per rank (a rank with speed ``f`` stretches its
            compute to ``1/f``), or a drift ``{global step: speeds}``; also ``LIGHTNING_HETERO_EMULATE_SPEEDS``.
        emulate_slowdown: how an emulated rank is slower: ``"compute"`` (default: its compute stretched, in proportion
            to its micro-batch) or ``"process"`` (its whole process held to ``f`` of a core by a CPU quota: its loop,
            optimizer and exchange too, as under a container's CPU limit; :mod:`lightning_hetero.emulate.throttle`)
            or ``"sends"`` (what it sends goes on a link of ``f`` times 1 Gbit/s, or of the bandwidth in
            ``LIGHTNING_HETERO_EMULATE_LINK``; its compute untouched); also ``LIGHTNING_HETERO_EMULATE_SLOWDOWN``.
        rebalance: re-plan the split from what each rank measures (default: on unless the split is fixed), every
            ``rebalance_window`` steps (20), to a split predicted ``rebalance_threshold`` (0.05: 5 %) faster.
        peer_timeout: seconds without a heartbeat from a rank after which the others stop, naming it, exit code 75
            (default 30; None: the process group's timeout; :mod:`lightning_hetero.recover.liveness`).
        device_precision: each rank's own precision: ``"auto"`` (bf16 where the device computes in bf16, fp16 on
            other CUDA devices, fp32 otherwise) or one of ``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"`` per rank
            (see :mod:`lightning_hetero.precision.choice`). Needs the Trainer's default ``precision="32-true"``.
        compression: how gradients travel: None (default), ``"fp16"``, ``"bf16"``, ``"powersgd"``, ``"topk"``, or a DDP
            comm hook (``hook(state, bucket)`` or ``(hook, state)``, ZeRO-0): :mod:`lightning_hetero.comm.compression`.
        compression_options: the mode's settings (PowerSGDState's, top-k's ``ratio``), and ``max_error`` (error_bound).
        hierarchical: reduce inside each node first (``"auto"``, default: at ZeRO-0 with several multi-rank nodes).
        max_nonfinite_steps: optimizer steps in a row skipped for non-finite gradients after which the run stops on
            every rank, naming the ranks, when no loss scale can be lowered (default 3; None: never stop).
        sync: ``"every_step"`` (default), or ``"local_sgd"`` / ``"diloco"``: each rank trains on its own and every
            ``sync_every`` steps the ranks merge their deltas weighted by samples, a fast rank taking more inner steps
            (``inner_steps``, e.g. ``[2, 1]``; default: planned) (:mod:`lightning_hetero.local.inner_steps`). ZeRO-0.
        sync_options: DiLoCo's outer optimizer (``outer_lr`` 0.7, ``outer_momentum`` 0.9, ``nesterov`` True),
            ``fragments``, ``overlap``/``overlap_steps``/``eager`` and ``asynchronous`` (see docs/usage.md).
        lr_scaling: ``"linear"`` or ``"sqrt"``: a resume whose global batch differs from the checkpoint's keeps it and
            scales the learning rate (default None: keep the checkpoint's; see
            :mod:`lightning_hetero.configure.lr_scaling`).
        trace: ``{"steps": [20, 21, 22]}``: those training steps recorded by ``torch.profiler`` on every rank, the
            package's phases named, into ``trace_*.json`` beside the run report (:mod:`lightning_hetero.watch.trace`).
        pipeline: split the model, not only the batch: ``{"stages": 2, "blocks": "net"}`` runs the chain of blocks
            at the module's attribute ``net`` as ``stages`` stages placed by speed and memory; optional
            ``boundaries``, ``schedule`` (``"1f1b"``, ``"gpipe"`` or ``"interleaved"`` with ``virtual_stages`` chunks
            per rank), ``micro_batches`` and ``virtual_stages`` (see
            :mod:`lightning_hetero.pipeline.chain`). With ``stage=1`` the pipelines holding a stage shard its
            optimizer state (ZeRO-1: :mod:`lightning_hetero.pipeline.optimizer_shards`).
        shards: how each rank's share of the optimizer state is sized: ``"memory"`` in proportion to the memory it has
            left after the model and its activations (equal where that is equal or unknown), or ``"equal"`` (as
            DeepSpeed). The default is ``"memory"`` for a pipeline's ``stage=1`` and ``"equal"`` elsewhere.
            Data parallel with ``stage=1`` or ``2`` and ``shards="memory"``: DeepSpeed's engine runs ZeRO-0, and the
            package reduces each gradient to the rank that owns it, steps that rank's share with the user's
            optimizer and broadcasts it (:mod:`lightning_hetero.split.optimizer_shards`).
        config: a DeepSpeed config dict or JSON path, as for :class:`DeepSpeedStrategy`. It must not set the
            micro-batch, the train batch or ``gradient_accumulation_steps``; the strategy owns them.
        **kwargs: any other :class:`DeepSpeedStrategy` argument. Those that only build the default DeepSpeed config
            are ignored, with a warning, when ``config`` is given.
    """

    strategy_name = "hetero"
    # DeepSpeedStrategy types it Optional, but its __init__ always sets a dict (the user's or its default one).
    config: dict[str, Any]

    def __init__(
        self,
        stage: Optional[int] = None,
        global_batch_size: Optional[int] = None,
        batch_sizes: Optional[Sequence[int]] = None,
        weights: Optional[Sequence[float]] = None,
        micro_steps: Optional[Sequence[int]] = None,
        config: Optional[Union[_PATH, dict[str, Any]]] = None,
        emulate_speeds: Optional[Union[Sequence[float], dict[int, Sequence[float]]]] = None,
        loss_reduction: str = "mean",
        rebalance: Optional[bool] = None,
        rebalance_window: int = DEFAULT_WINDOW,
        rebalance_threshold: float = DEFAULT_THRESHOLD,
        peer_timeout: Optional[float] = liveness.DEFAULT_PEER_TIMEOUT,
        device_precision: Optional[Union[str, Sequence[str]]] = None,
        compression: Optional[Union[str, Callable[..., Any], tuple[Callable[..., Any], Any]]] = None,
        compression_options: Optional[dict[str, Any]] = None,
        hierarchical: Union[str, bool] = "auto",
        max_nonfinite_steps: Optional[int] = DEFAULT_MAX_NONFINITE_STEPS,
        sync: str = "every_step",
        sync_every: int = 1,
        inner_steps: Optional[Sequence[int]] = None,
        sync_options: Optional[dict[str, Any]] = None,
        pipeline: Optional[dict[str, Any]] = None,
        lr_scaling: Optional[str] = None,
        trace: Optional[dict[str, Any]] = None,
        emulate_slowdown: Optional[str] = None,
        shards: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        user_config = config is not None or self.DEEPSPEED_ENV_VAR in os.environ
        if not user_config:  # (with a config, DeepSpeedStrategy ignores these arguments too: the warning names them)
            stage = default_config_stage(stage, kwargs)
        logging_batch_size = logging_batch_size_note(kwargs)
        if logging_batch_size:
            rank_zero_warn(logging_batch_size)
        settings = HeteroSettings.from_arguments(
            stage=stage,
            global_batch_size=global_batch_size,
            batch_sizes=batch_sizes,
            weights=weights,
            micro_steps=micro_steps,
            emulate_speeds=emulate_speeds,
            loss_reduction=loss_reduction,
            rebalance=rebalance,
            rebalance_window=rebalance_window,
            rebalance_threshold=rebalance_threshold,
            peer_timeout=peer_timeout,
            device_precision=device_precision,
            compression_mode=compression,
            compression_options=compression_options,
            hierarchical=hierarchical,
            max_nonfinite_steps=max_nonfinite_steps,
            sync=sync,
            sync_every=sync_every,
            inner_steps=inner_steps,
            sync_options=sync_options,
            pipeline=pipeline,
            lr_scaling=lr_scaling,
            trace=trace,
            emulate_slowdown=emulate_slowdown,
            shards=shards,
        )
        config = check_config_argument(config)
        quiet.install_lasting_filters()
        quiet.hide_the_srun_hint_outside_slurm_jobs()
        # The parent imports DeepSpeed, which prints its accelerator guess (and imports MLflow: see runtime/startup.py).
        with quiet.third_party_noise_silenced(), startup.deepspeed_imported_without_mlflow():
            super().__init__(stage=settings.zero_stage, config=config, **kwargs)
        # Formatting adds keys (gradient_accumulation_steps...) that the parent refuses to see twice; each
        # trainer call (validate, then fit) formats a fresh copy of what the user gave. `strategy.config` stays the
        # user's dict as given until a trainer call formats it, as under DeepSpeedStrategy.
        self._base_config = copy.deepcopy(self.config)
        # No stage named: setup chooses the lowest that fits (configure/zero_stage.py); a config's stage is the user's.
        self._automatic_stages = settings.settle_config(self._base_config, kwargs, user_config)
        self._user_config = user_config
        self._fp16_arguments = {name: kwargs[name] for name in FP16_LOSS_SCALE_ARGUMENTS if name in kwargs}
        self.settings = settings
        self.job = HeteroJob(settings, self._follow_the_split)
        # DeepSpeed's GPU-minded ZeRO defaults are replaced on CPU (setup_environment) unless the user chose them.
        self._cpu_zero_defaults = not user_config and not (CPU_ZERO_SETTINGS.keys() & kwargs.keys())
        self._plain_redirection = self._forward_redirection
        self._before_configure_model = False  # inside model_sharded_context's entry

    # What the run established, for users and the monitor (see HeteroJob).
    plan = property(lambda self: self.job.plan, doc="The split in force.")
    prediction = property(lambda self: self.job.prediction, doc="The planner's predicted step times.")
    profiles = property(lambda self: self.job.profiles, doc="Every rank's profile (automatic split only).")
    device_facts = property(lambda self: self.job.device_facts, doc="Every rank's device facts.")
    precisions = property(lambda self: self.job.precisions, doc="Every rank's precision.")
    communication = property(lambda self: self.job.communication, doc="How gradients travel.")
    watcher = property(lambda self: self.job.watcher, doc="What the fit measured and re-planned (HeteroMonitor).")
    watch = property(lambda self: self.job.watch, doc="Every rank's steps.")
    replans = property(lambda self: self.job.replans, doc="This fit's re-plans.")
    skipped_steps = property(lambda self: self.job.skipped_steps, doc="Steps skipped for non-finite grads.")
    pipeline = property(lambda self: self.job.pipeline_stage, doc="This rank's stage (``pipeline=...``), or None.")
    pipeline_replans = property(lambda self: self.job.pipeline_replans, doc="This fit's moves of blocks.")

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # False, as for DDP: Lightning's loop accumulates, so global_step, LR schedulers and checkpoints count optimizer
        # updates. The DeepSpeed config follows it (configure/deepspeed_config.lightning_owns_accumulation).
        return False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Any:
        # Lightning enters this for the batches it accumulates. DeepSpeed's `no_sync` (which the parent would call)
        # refuses ZeRO-2/3; the config already makes the step, not the backward, finish the reduction.
        yield

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Lightning's DeepSpeed presets with the prefix "hetero" (the "deepspeed*" names are DeepSpeedStrategy's):
        # `Trainer(strategy="hetero_stage_3")`, or `strategy: hetero_stage_3` in a CLI YAML (the package imported).
        for name, description, arguments in PRESETS:
            strategy_registry.register(name, cls, description=description, override=True, **arguments)

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise RuntimeError(
                f"HeteroStrategy runs on `accelerator='cpu'` or `'cuda'`, not {type(self.accelerator).__name__}."
            )
        if not self._config_initialized:
            # Until the first trainer call `strategy.config` is what the user gave: a change made to it after the
            # constructor counts, as under DeepSpeedStrategy (it was lost: each call formats a copy taken at init).
            self._base_config = copy.deepcopy(self.config)
            if self._user_config:
                self.settings.settle_stage(self._base_config)  # (its warning was shown by the constructor)
            unused = unused_fp16_arguments(self._fp16_arguments, str(self.precision_plugin.precision), self.config)
            if unused:
                rank_zero_warn(unused)
        # Checked before the process group exists: every rank raises the same error, none waits. (`world_size`
        # comes from the cluster environment, which is only filled in by setup_distributed.)
        self.job.check_job(
            self._launched_world_size(),
            self.root_device.type,
            self._base_config,
            self._layer_sync is not None,
            self.precision_plugin,
            self._trainer(),
        )
        if self.root_device.type == "cpu":
            if self._cpu_zero_defaults:
                self._base_config = with_cpu_zero_settings(self._base_config)
            # DeepSpeed takes `root_device.index` as its device rank and Lightning checks that the indices count
            # 0..n-1; CPU devices carry no index, so give them one (torch ignores it for tensors).
            assert self.parallel_devices is not None
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        # Skip DeepSpeedStrategy.setup_environment: its only addition is refusing every accelerator but CUDA.
        DDPStrategy.setup_environment(self)
        # Without this a gloo job can abort at exit after a successful fit (exit code -6; see shutdown.py). Lightning
        # destroys the process group at exit for NCCL only, and only on its own init path, which DeepSpeed bypasses.
        register_exit_cleanup()
        self.job.join(
            self.global_rank,
            self.world_size,
            self.root_device,
            self._trainer(),
            lambda: self.precision_plugin,
            sync_batchnorm=self._layer_sync is not None,
        )

    def _launched_world_size(self) -> int:
        """Nodes times processes per node, before the process group exists (Ray Train's strategy overrides it)."""
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
            assert self.cluster_environment is not None  # (the parent's launcher was built from it)
            # Each trainer call runs inside the launcher on every rank: the scope in which the noise is silenced.
            self._launcher = quiet.QuietLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def _init_deepspeed_distributed(self) -> None:
        assert self.cluster_environment is not None
        elastic.init_process_group_for_this_attempt(
            self._get_process_group_backend(), self.global_rank, self.world_size, self._timeout or default_pg_timeout
        )
        with startup.without_shared_memory_comm_op():
            super()._init_deepspeed_distributed()

    @override
    def _init_config_if_needed(self) -> None:
        # The parent formats once per strategy; the micro-batch depends on the trainer call (fit or not).
        self._format_config()
        self._config_initialized = True

    @override
    def _format_config(self) -> None:
        """Measure, plan, configure: the per-rank DeepSpeed config of this trainer call.

        Two collectives, reached by every rank in the same order whatever its arguments: the first gathers the
        arguments, device facts and (automatic split) profiles, and checks the arguments agree before anything
        depends on them; the second checks the finished configs agree.
        """
        module = self.lightning_module
        assert module is not None
        self.config = copy.deepcopy(self._base_config)
        if self._before_configure_model:  # (see model_sharded_context: no plan before the model exists)
            self.config["train_micro_batch_size_per_gpu"] = 1
            super()._format_config()
            self.config = rank_config(self.config, 1)
            return
        trainer = module.trainer
        half = str(self.precision_plugin.precision) in HALF_PRECISION_ENGINES
        own_plugin, micro_batch = self.job.configure(
            self.config, trainer, module, self.root_device, self.precision_plugin, self._automatic_stages, half
        )
        if own_plugin is not None:  # ranks of their own precisions: it replaces the Trainer's (Lightning's plug point)
            self.precision_plugin = own_plugin
        self.config["train_micro_batch_size_per_gpu"] = micro_batch
        super()._format_config()
        self.config = rank_config(self.config, micro_batch)
        self.job.check_configs_agree(self.config)
        if trainer.state.fn == TrainerFn.FITTING:
            self.job.write_plan(trainer, self.config)

    @contextlib.contextmanager
    @override
    def model_sharded_context(self) -> Any:
        # The parent formats the config here, before `configure_model` builds the layers that the survey profiles (the
        # profile failed with "'NoneType' object is not callable"). What zero.Init reads of it (the stage, the
        # precision) needs no plan, so it gets a provisional micro-batch; setup formats the call's config after.
        self._before_configure_model = True
        try:
            with super().model_sharded_context():
                self._before_configure_model = False
                yield
        finally:
            self._before_configure_model = False

    def _follow_the_split(self, micro_batch: int) -> None:
        """The split changed: DeepSpeed's micro-batch follows (bookkeeping only: its throughput and sample counters,
        its own loader's default batch; the reduction and the optimizer never read it, so a change between two steps
        is safe, and a checkpoint's config tells the truth)."""
        if self.config is not None:
            self.config["train_micro_batch_size_per_gpu"] = micro_batch
        if self.model is not None and hasattr(self.model, "set_train_micro_batch_size"):
            self.deepspeed_engine.set_train_micro_batch_size(micro_batch)

    @override
    def _setup_model(self, model: Any) -> Any:
        # `Trainer(sync_batchnorm=True)` where DDPStrategy.setup applies it (DDPStrategy.teardown reverts it).
        trainer = self._trainer()
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._layer_sync, model = with_layer_sync(self._layer_sync, model, fitting)
        return super()._setup_model(model)

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        with self.job.engine_built(self.lightning_module, optimizer):
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def init_deepspeed(self) -> None:
        # Hooks a ZeRO-3 engine of an earlier trainer call left on the modules broke the new engine's first step.
        assert self.lightning_module is not None
        drop_deepspeed_hooks(self.lightning_module)
        trainer = self._trainer()
        # A fit's engine is built in _setup_model_and_optimizer (wrapped there); validate's, test's and predict's here.
        evaluating = not (trainer is not None and trainer.training)
        with self.job.engine_built(self.lightning_module, None) if evaluating else contextlib.nullcontext():
            super().init_deepspeed()
        engine, plugin = self.deepspeed_engine, self.precision_plugin
        self._forward_redirection = attach_to_engine(plugin, engine, self.root_device, self._plain_redirection)
        self.job.attach(engine, plugin)

    # ------------------------------------------------------------------ data and steps

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.job.shard(dataloader, self._trainer())

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (see :mod:`lightning_hetero.train.weights`)."""
        return self.job.current_loss_weight()

    @override
    def batch_to_device(self, batch: Any, device: Optional[Any] = None, dataloader_idx: int = 0) -> Any:
        batch = self.job.batch_received(batch, self._trainer())
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        parent = super().training_step

        def user_step(batch: Any, samples: Optional[int]) -> Any:
            if samples is not None:  # one micro-batch: its metrics count its samples in the epoch mean
                trainer._results.batch_size = samples
            return parent(batch, *args[1:], **kwargs)

        return self.job.training_step(args[0], user_step, trainer)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        parent = super().backward
        self.job.backward(
            closure_loss, lambda loss: parent(loss, optimizer, *args, **kwargs), self._trainer(), self._zero_stage()
        )
        return closure_loss

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        optimizer, closure = args[0] if args else kwargs.get("optimizer"), args[1] if len(args) > 1 else None
        step, backward = super().optimizer_step, super().backward
        return self.job.optimizer_step(
            lambda: step(*args, **kwargs),
            lambda loss: backward(loss, optimizer),
            self._trainer(),
            closure or kwargs.get("closure"),
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # (the optimizers' and schedulers' states are restored by now, before any step)
        self.job.setup.scale_learning_rate(self._trainer())  # a resume's lr_scaling, said once

    @override
    def on_train_end(self) -> None:
        self.job.training_ends()
        super().on_train_end()
        self.job.write_report(self._trainer(), self.precision_plugin)

    @override
    def on_validation_start(self) -> None:
        self.job.validation_starts(self._trainer())
        super().on_validation_start()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        parent = super().validation_step
        return self.job.evaluation_step(args[0], lambda batch: parent(batch, *args[1:], **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        parent = super().test_step
        return self.job.evaluation_step(args[0], lambda batch: parent(batch, *args[1:], **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        parent = super().predict_step
        return self.job.prediction_step(args[0], lambda batch: parent(batch, *args[1:], **kwargs))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Lightning's sampler shards only `predict`'s data (DataSharding shards the rest): over the mode's replicas.
        replicas = self.job.sampler_replicas()
        if replicas is None:  # (no trainer call has set the job up)
            return super().distributed_sampler_kwargs
        return {"num_replicas": replicas[0], "rank": replicas[1]}

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self.job.reduce(tensor, group, reduce_op, super().reduce)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self.job.before_collective("all_gather")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.job.before_collective("broadcast")
        return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.job.before_collective("barrier")
        super().barrier(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.job.on_exception(exception, self._trainer())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (see :mod:`~.recover.checkpoint`)."""
        parent_save = super().save_checkpoint
        target = Path(self.broadcast(str(filepath)))  # (rank 0's path: a timestamped name differs between ranks)
        write = lambda directory: parent_save(checkpoint, directory, storage_options)  # noqa: E731
        self.job.save_checkpoint(target, checkpoint, write, self._zero_stage(), self.deepspeed_engine)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.job.remove_checkpoint(Path(filepath), super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        parent_load = super().load_checkpoint
        load = lambda directory: parent_load(directory, *args, **kwargs)  # noqa: E731
        return self.job.load_checkpoint(
            Path(checkpoint_path),
            load,
            self.lightning_module,
            self._trainer(),
            self._zero_stage(),
            self._automatic_stages is not None,
            self.deepspeed_engine,
            safe_load.requested_weights_only(args, kwargs),
        )

    @override
    def teardown(self) -> None:
        self.job.detach(self.precision_plugin, self._trainer())
        self._forward_redirection = self._plain_redirection
        super().teardown()

    def _trainer(self) -> Any:
        """The Trainer this strategy runs under, or None (not attached yet, or already detached)."""
        return self.lightning_module._trainer if self.lightning_module is not None else None

    def _zero_stage(self) -> int:
        # (before the first trainer call `config` is the user's dict as given, which may name no stage)
        config = self.config if self._config_initialized else self._base_config
        return config["zero_optimization"]["stage"]
