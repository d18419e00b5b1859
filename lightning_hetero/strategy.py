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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hetero.comm.compression import check_exchange
from lightning_hetero.job import HeteroJob
from lightning_hetero.measure.partitioned import drop_deepspeed_hooks
from lightning_hetero.plan.deepspeed_config import (
    CPU_ZERO_SETTINGS,
    check_config_argument,
    config_disagreements,
    default_config_stage,
    disagreement_message,
    rank_config,
    with_cpu_zero_settings,
)
from lightning_hetero.plan.replan import DEFAULT_THRESHOLD, DEFAULT_WINDOW
from lightning_hetero.plan.stages import check_pipeline_config
from lightning_hetero.plan.zero_stage import resume_stage_mismatch
from lightning_hetero.precision.job import attach_to_engine
from lightning_hetero.precision.nonfinite import DEFAULT_MAX_NONFINITE_STEPS
from lightning_hetero.precision.plugin import HeteroPrecision
from lightning_hetero.recover import elastic, from_deepspeed, liveness
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime import quiet, startup
from lightning_hetero.runtime.shutdown import register_exit_cleanup
from lightning_hetero.settings import HeteroSettings
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.loaders import HeteroDataLoader
from lightning_hetero.train.micro_batches import raise_if_unreduced, reduction_held_back, step_loss
from lightning_hetero.train.streams import HeteroStreamLoader
from lightning_hetero.train.sync_batchnorm import layer_sync_for


# Trainer precisions in which DeepSpeed keeps half-precision parameters and gradients beside an fp32 master copy.
HALF_PRECISION_ENGINES = ("16-mixed", "bf16-mixed", "16-true", "bf16-true")

# Registered names: the default, one per ZeRO stage, and the CPU-offload variants Lightning registers for DeepSpeed.
PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("hetero", "DeepSpeed ZeRO with per-rank micro-batches", {}),
    *((f"hetero_stage_{stage}", f"HeteroStrategy at ZeRO stage {stage}", {"stage": stage}) for stage in range(4)),
    ("hetero_stage_2_offload", "HeteroStrategy at ZeRO stage 2, optimizer offloaded to the CPU",
     {"stage": 2, "offload_optimizer": True}),
    ("hetero_stage_3_offload", "HeteroStrategy at ZeRO stage 3, optimizer and parameters offloaded to the CPU",
     {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
)  # fmt: skip


class HeteroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism where every rank has its own micro-batch.

    Args:
        stage: ZeRO stage 0-3. Default None: at setup, the lowest stage at which the model, its gradients and
            optimizer state and the planned micro-batch's activations fit every device (the plan output says why; see
            :mod:`lightning_hetero.plan.zero_stage`); 0 with ``sync="local_sgd"`` or ``"diloco"`` and with a
            compression hook. With a ``config`` dict the config's ``zero_optimization.stage`` wins; ``stage`` only
            fills it in when the config leaves it unset, and a config that sets none without ``stage`` is ZeRO-0, as
            DeepSpeed and DeepSpeedStrategy read it. DeepSpeedStrategy's ``zero_optimization=False`` is ``stage=0``.
        global_batch_size: samples per step across all ranks. Default: the training loader's ``batch_size`` times
            the world size (what DDP would use), or the sum of ``batch_sizes``.
        batch_sizes: each rank's micro-batch, in global rank order; they sum to the global batch.
        weights: relative capability per rank; the global batch is split in proportion (each rank >= 1 sample).
        micro_steps: forward/backward passes per optimizer step on each rank, e.g. ``[3, 1]``: rank ``r`` takes its
            samples in ``k_r`` micro-batches and the optimizer steps once all are done, so a fast device with little
            memory still takes the share its speed deserves. With ``batch_sizes`` those are the micro-batches (the
            global batch is ``sum(b_r * k_r)``); otherwise each rank's share is cut into ``k_r`` micro-batches that
            differ by at most one sample. The update is the full-batch one either way. Default None: 1 everywhere,
            unless the automatic split finds a memory ceiling that binds (then the planner picks ``k_r``). Ranks may
            differ at ZeRO 0-2 (they reduce once per step); ZeRO-3 needs the same count everywhere. Memory ceilings
            can be emulated with ``LIGHTNING_HETERO_EMULATE_MEMORY=64,16`` (samples per micro-batch, per rank).
        loss_reduction: ``"mean"`` (default) when ``training_step`` returns the mean loss over its batch, ``"sum"``
            when it returns the sum. Each rank's loss is weighted so that the update is DDP's whatever the split:
            ``b_r * W / B`` for a mean, 1 for a sum (see :func:`lightning_hetero.plan.split.loss_weight`).
        emulate_speeds: a test and demo aid: one speed in (0, 1] per rank; a rank with speed ``f`` stretches its
            local compute to ``1/f`` of its duration (see :mod:`~.emulate.slowdown`). A drift is a schedule
            ``{global step: speeds}`` starting at 0, e.g. ``{0: [1.0, 1.0], 200: [1.0, 0.4]}``. Also read from the
            environment variable ``LIGHTNING_HETERO_EMULATE_SPEEDS=1.0,0.4`` (a schedule:
            ``1.0,1.0;200:1.0,0.4``); the argument wins.
        rebalance: re-plan the split during training from what each rank measures (see
            :mod:`lightning_hetero.plan.replan`). Default None: on for the automatic split, off when ``batch_sizes`` or
            ``weights`` fix it (True then starts from the fixed split, assuming time proportional to the batch).
        rebalance_window: training steps between two exchanges of the ranks' measurements (default 20): the
            re-plan decisions, the run report's and the HeteroMonitor's updates happen at that rhythm.
        rebalance_threshold: the predicted gain a new split needs over the current one (default 0.05: 5 % faster).
        peer_timeout: seconds without a heartbeat from a rank after which the others stop, naming it, with exit code
            75 (default 30; see :mod:`lightning_hetero.recover.liveness`). A rank that is busy (a long checkpoint write,
            profiling) keeps beating; only a process that is gone or frozen stops. None: wait as long as the
            process group's timeout.
        device_precision: each rank's own precision (see :mod:`lightning_hetero.precision.choice`). None (default): the
            Trainer's ``precision`` on every rank. ``"auto"``: bf16 autocast where the device computes in bf16 (CUDA
            compute capability >= 8.0, CPUs with AMX or AVX512-BF16), fp16 autocast on other CUDA devices, fp32
            otherwise. Or one of ``"bf16-mixed"``, ``"16-mixed"``, ``"32-true"`` per rank. DeepSpeed and the
            collectives stay fp32; fp16 ranks share one dynamic loss scale, and an overflow on any rank skips that
            step on every rank. Needs the Trainer's default ``precision="32-true"``.
        compression: how gradients travel (see :mod:`lightning_hetero.comm.compression`): None (default) uncompressed;
            ``"fp16"`` / ``"bf16"`` in half precision (every stage); ``"powersgd"`` (torch's PowerSGD, error feedback)
            or ``"topk"`` (the largest entries, error feedback); or a DDP comm hook ``hook(state, bucket)`` /
            ``(hook, state)``. Hooks need ``stage=0``: ZeRO-1/2/3 reduce inside DeepSpeed's optimizer.
        compression_options: the mode's settings: ``PowerSGDState``'s arguments for ``"powersgd"`` (default
            ``{"matrix_approximation_rank": 1, "start_powerSGD_iter": 10}``), ``{"ratio": 0.01}`` for ``"topk"``.
        hierarchical: reduce inside each node first, send one payload per node between nodes, broadcast back
            (see :mod:`~.comm.communication`). ``"auto"`` (default): at ZeRO-0 when there are several nodes, some
            with several ranks. True needs ``stage=0``. Nodes are the ranks' hosts, or
            ``LIGHTNING_HETERO_EMULATE_NODES=2`` (a test aid, with ``LIGHTNING_HETERO_EMULATE_LINK``; see
            :mod:`lightning_hetero.comm.topology`).
        max_nonfinite_steps: optimizer steps in a row skipped for non-finite gradients (a NaN or inf loss on any
            rank) after which the run stops on every rank, naming the ranks whose loss was non-finite, when there is
            no loss scale to lower (fp32, bf16; with fp16 a skip lowers the scale). Default 3; None: never stop.
            Skipped steps are counted in the run report and by HeteroMonitor either way (see
            :mod:`lightning_hetero.precision.nonfinite`).
        sync: ``"every_step"`` (default): gradients are exchanged at every step. ``"local_sgd"`` / ``"diloco"``: each
            rank trains on its own, with its own optimizer, and every ``sync_every`` training steps (and at each
            epoch's end) the ranks merge their parameter deltas weighted by the samples each trained on: a plain
            average (local SGD) or an outer SGD with Nesterov momentum on it (DiLoCo). A fast rank takes
            ``inner_steps[r]`` inner steps per training step (planned from the profiles: as many of its micro-batches
            as it computes while the slowest rank computes one). Needs ``stage=0`` (see
            :mod:`lightning_hetero.plan.local_steps`).
        sync_every: training steps between two synchronizations (``sync="local_sgd"`` / ``"diloco"``).
        inner_steps: each rank's inner steps per training step, e.g. ``[2, 1]``; default: planned from the profiles.
        sync_options: DiLoCo's outer optimizer, ``{"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}``.
        pipeline: split the model, not only the batch: ``{"stages": 2, "blocks": "net"}`` runs the chain of blocks
            at the module's attribute ``net`` (an ``nn.Sequential``, or a ``ModuleList``/``ModuleDict`` applied in
            order) as ``stages`` stages on as many ranks, each holding only its blocks; more ranks form pipelines side
            by side that share the global batch. ``boundaries`` (the first block of each stage after the first) fixes
            the split, else the blocks are measured on every rank and placed by speed and memory; ``schedule``
            ``"1f1b"`` (default) or ``"gpipe"``; ``micro_batches`` per pipeline and step (default: twice the stages).
            The contract and what is refused: :mod:`lightning_hetero.train.pipeline`.
        config: a DeepSpeed config dict or JSON path, as for :class:`DeepSpeedStrategy`. It must not set the
            micro-batch, the train batch or ``gradient_accumulation_steps``; the strategy owns them.
        **kwargs: any other :class:`DeepSpeedStrategy` argument. Those that only build the default DeepSpeed config
            are ignored, with a warning, when ``config`` is given.

    With neither ``batch_sizes`` nor ``weights`` the split is automatic: every rank benchmarks its own training
    step at fit start, and the planner picks the integer split that minimises the slowest rank's predicted step time
    within each device's memory; then, every ``rebalance_window`` steps, the split follows what the ranks measure.
    """

    strategy_name = "hetero"

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
        **kwargs: Any,
    ) -> None:
        user_config = config is not None or self.DEEPSPEED_ENV_VAR in os.environ
        if not user_config:  # (with a config, DeepSpeedStrategy ignores these arguments too: the warning names them)
            stage = default_config_stage(stage, kwargs)
        settings = HeteroSettings.from_arguments(
            stage, global_batch_size, batch_sizes, weights, micro_steps, emulate_speeds, loss_reduction, rebalance,
            rebalance_window, rebalance_threshold, peer_timeout, device_precision, compression, compression_options,
            hierarchical, max_nonfinite_steps, sync, sync_every, inner_steps, sync_options, pipeline,
        )  # fmt: skip
        config = check_config_argument(config)
        quiet.install_lasting_filters()
        quiet.hide_the_srun_hint_outside_slurm_jobs()
        # The parent imports DeepSpeed, which prints its accelerator guess (and imports MLflow: see runtime/startup.py).
        with quiet.third_party_noise_silenced(), startup.deepspeed_imported_without_mlflow():
            super().__init__(stage=settings.zero_stage, config=config, **kwargs)
        if user_config:
            settings.reconcile_user_config(self.config, kwargs)
        # No stage named: setup chooses the lowest that fits (plan/zero_stage.py); a config's stage is the user's.
        self._automatic_stages = None if user_config else settings.automatic_stages(kwargs)
        if settings.pipeline is not None:
            check_pipeline_config(self.config)
        check_exchange(settings.compression, settings.hierarchical, self._zero_stage(), self.config)
        self.settings = settings
        self.job = HeteroJob(settings)
        self.job.split.follow(self._follow_the_split)
        # Formatting adds keys (gradient_accumulation_steps...) that the parent refuses to see twice; each
        # trainer call (validate, then fit) formats a fresh copy of what the user gave.
        self._base_config = copy.deepcopy(self.config)
        # DeepSpeed's GPU-minded ZeRO defaults are replaced on CPU (setup_environment) unless the user chose them.
        self._cpu_zero_defaults = not user_config and not (CPU_ZERO_SETTINGS.keys() & kwargs.keys())
        self._buffer_sync: Optional[BufferSync] = None
        self._optimizer_parameters: list[tuple[str, Any]] = []
        self._plain_redirection = self._forward_redirection
        self._before_configure_model = False  # inside model_sharded_context's entry
        # This step's micro-batches after the first, with training_step's other arguments: run in `backward`.
        self._later_micro_batches: tuple[list, tuple, dict] = ([], (), {})

    # What the run established, for users and the monitor (see HeteroJob).
    plan = property(lambda self: self.job.split.plan, doc="The split in force.")
    prediction = property(lambda self: self.job.split.prediction, doc="The planner's predicted step times.")
    profiles = property(lambda self: self.job.profiles, doc="Every rank's profile (automatic split only).")
    device_facts = property(lambda self: self.job.device_facts, doc="Every rank's device facts.")
    precisions = property(lambda self: self.job.precisions, doc="Every rank's precision.")
    communication = property(lambda self: self.job.communication, doc="How gradients travel.")
    watcher = property(lambda self: self.job.watcher, doc="What the fit measured and re-planned (HeteroMonitor).")
    watch = property(lambda self: self.job.watcher.run if self.job.watcher else None, doc="Every rank's steps.")
    replans = property(lambda self: self.job.watcher.replans if self.job.watcher else [], doc="This fit's re-plans.")
    skipped_steps = property(lambda self: list(self.job.nonfinite.skipped), doc="Steps skipped for non-finite grads.")

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # False, as for DDP: Lightning's loop accumulates (each loss divided by k, the optimizer stepped after k batches
        # and at the end of an epoch), so global_step, LR schedulers and checkpoints count optimizer updates. The
        # DeepSpeed config follows it (plan/deepspeed_config.lightning_owns_accumulation).
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
        # Our own names, Lightning's DeepSpeed presets with the prefix "hetero" (the parent's "deepspeed*" names
        # belong to DeepSpeedStrategy): `Trainer(strategy="hetero_stage_3")`, or `strategy: hetero_stage_3` in a CLI
        # YAML once the package is imported.
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
        # Checked before the process group exists: every rank raises the same error, none waits. (`world_size`
        # comes from the cluster environment, which is only filled in by setup_distributed.)
        plugin = self.precision_plugin  # (ours, from an earlier trainer call, is fine)
        trainer_precision = (
            None if isinstance(plugin, HeteroPrecision) else (str(plugin.precision), type(plugin).__name__)
        )
        self.settings.check_job(self._launched_world_size(), self.root_device.type, self.config,
                                self._layer_sync is not None, trainer_precision)  # fmt: skip
        if self.settings.pipeline is not None:
            self.job.check_pipeline_job(self._trainer(), str(plugin.precision), self._launched_world_size())
        if self.root_device.type == "cpu":
            if self._cpu_zero_defaults:
                self._base_config = with_cpu_zero_settings(self._base_config)
            # DeepSpeed takes `root_device.index` as its device rank and Lightning checks that the indices count
            # 0..n-1; CPU devices carry no index, so give them one (torch ignores it for tensors).
            assert self.parallel_devices is not None
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        trainer = self._trainer()
        if trainer is not None:
            self.job.sharding.take_over_distributed_sampling(trainer)
        # Skip DeepSpeedStrategy.setup_environment: its only addition is refusing every accelerator but CUDA.
        DDPStrategy.setup_environment(self)
        # Without this a gloo job can abort at exit after a successful fit (exit code -6; see shutdown.py). Lightning
        # destroys the process group at exit for NCCL only, and only on its own init path, which DeepSpeed bypasses.
        register_exit_cleanup()
        self.job.join(self.global_rank, self.world_size, self.root_device, trainer, lambda: self.precision_plugin,
                      sync_batchnorm=self._layer_sync is not None)  # fmt: skip

    def _launched_world_size(self) -> int:
        """The job's number of ranks as the launch states it, before the process group exists: nodes times
        processes per node (Lightning's launcher, torchrun, Slurm). An engine that starts one process per worker
        itself (Ray Train) says it through its cluster environment instead."""
        return self.num_nodes * self.num_processes

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:
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
        fitting = trainer.state.fn == TrainerFn.FITTING
        global_batch_size = self.job.survey(trainer, fitting, module, self.root_device,
                                            str(self.precision_plugin.precision), self._zero_stage())  # fmt: skip
        own_plugin = self.job.plugin_for_this_rank(self.precision_plugin)
        if own_plugin is not None:  # ranks of their own precisions: it replaces the Trainer's (Lightning's plug point)
            self.precision_plugin = own_plugin
        if self._automatic_stages is not None:
            half = own_plugin is None and str(self.precision_plugin.precision) in HALF_PRECISION_ENGINES
            self.config["zero_optimization"]["stage"] = self.job.choose_zero_stage(
                global_batch_size, module, fitting, self._automatic_stages, half
            )
        self.job.configure_communication(self.config)
        pipeline = self.job.pipeline is not None  # (only fit reaches here then: check_pipeline_job refused the rest)
        if pipeline:
            micro_batch = self.job.start_pipeline(global_batch_size, module, self.root_device)
        else:
            if fitting:
                self.job.start_the_split(global_batch_size, self._zero_stage(), module)
            micro_batch = self.job.split.micro_batch
        self.config["train_micro_batch_size_per_gpu"] = micro_batch
        super()._format_config()
        self.config = rank_config(self.config, micro_batch)
        lines = config_disagreements(self.job.collectives.gather_objects(self.config))
        if lines:
            raise ValueError(disagreement_message(lines))
        if fitting and not pipeline:  # (a pipeline printed its own plan)
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
        # After the profile (which must run the module's own BatchNorms: a SyncBatchNorm would communicate from each
        # rank's probe, with different batch sizes) and before DeepSpeed wraps the module: where DDPStrategy.setup
        # applies `Trainer(sync_batchnorm=True)` (DDPStrategy.teardown reverts it). Torch's SyncBatchNorm needs NCCL;
        # on gloo the package's own (train/sync_batchnorm.py) takes its place.
        trainer = self._trainer()
        if self._layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
            self._layer_sync = layer_sync_for(self._layer_sync, backend)
            model = self._layer_sync.apply(model)
        return super()._setup_model(model)

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        # The optimizer's parameters in its own order, before DeepSpeed replaces them with flat partitions: what a
        # torch optimizer state saved by another strategy is indexed by (see recover/from_lightning.py).
        names = {id(p): n for n, p in self.lightning_module.named_parameters()} if self.lightning_module else {}
        groups = optimizer.param_groups if optimizer is not None else []
        self._optimizer_parameters = [(names.get(id(p), ""), p) for g in groups for p in g["params"]]
        with self.job.engine_built():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def init_deepspeed(self) -> None:
        # A ZeRO-3 engine of an earlier trainer call (a test before the fit) left its hooks on the modules; running
        # them beside the new engine's broke its first step ("pop from an empty deque", also under DeepSpeedStrategy).
        drop_deepspeed_hooks(self.lightning_module)
        super().init_deepspeed()
        engine, plugin = self.deepspeed_engine, self.precision_plugin
        self._forward_redirection = attach_to_engine(plugin, engine, self.root_device, self._plain_redirection)
        self.job.attach(engine, plugin)
        if self.world_size > 1 and engine.optimizer is not None and self.job.pipeline is None:
            self._buffer_sync = BufferSync(
                engine.module.buffers(), lambda flat: torch.distributed.broadcast(flat, src=0)
            )

    # ------------------------------------------------------------------ data and steps

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, (HeteroDataLoader, HeteroStreamLoader)):
            return dataloader
        return self.job.shard(dataloader, self._trainer())

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (see :mod:`lightning_hetero.train.weights`)."""
        return self.job.loss_weights.current(self.job.split.plan)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        job = self.job
        if job.pipeline is not None:
            trainer = self._trainer()

            def forward(batch: Any, samples: int) -> Any:
                trainer._results.batch_size = samples  # its metrics count its samples in the epoch mean
                return super(HeteroStrategy, self).training_step(batch, *args[1:], **kwargs)

            engine = self.deepspeed_engine
            return job.pipeline_step(args[0], forward, engine.backward, engine.module, trainer.global_step,
                                     engine.optimizer)
        job.training_step_starts(self._trainer().global_step)
        with job.loss_weights.weighted_sync(), job.emulation.slowed(), job.communication.counting():
            if self._buffer_sync:  # rank 0's buffers on every rank before the forward, as DDP's broadcast_buffers
                job.collectives.before_each()
                self._buffer_sync.sync()
            # With micro-steps (train/micro_batches.py) the first micro-batch goes to Lightning's closure, and the
            # others run in `backward`: Lightning zeroes the gradients between training_step and backward.
            (first, samples), *later = job.micro_batches_of(args[0])
            self._later_micro_batches = (later, args[1:], kwargs)
            output = self._micro_batch_step(first, samples, not later, args[1:], kwargs)
        job.loss_weights.step_returned(output)
        return output

    def _micro_batch_step(self, batch: Any, samples: Optional[int], last: bool, rest: tuple, kwargs: dict) -> Any:
        """The user's training_step on one micro-batch (``samples`` None: the whole batch, no micro-steps). Only the
        rank's last one makes collectives (see train/micro_batches.py)."""
        job = self.job
        if samples is None:
            output = super().training_step(batch, *rest, **kwargs)
            job.micro_batch_returned(None, output)
            return output
        job.loss_weights.micro_batch(samples)
        self._trainer()._results.batch_size = samples  # its metrics count its samples in the epoch mean
        with contextlib.nullcontext() if last else job.micro_batch_guard.early_micro_batch():
            output = super().training_step(batch, *rest, **kwargs)
        job.micro_batch_returned(samples, output)
        if step_loss(output) is None:
            raise RuntimeError(
                "HeteroStrategy: `training_step` returned None (skip this batch) for one of this rank's micro-batches"
                " (`micro_steps`, or the inner steps of `sync`). The other ranks would still run theirs and wait for"
                " this one. Skip inside the step instead (e.g. return `loss * 0`), or train without them."
            )
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self.job.pipeline is not None:  # every micro-batch's backward ran in the pipeline's schedule
            self.job.pipeline_backward()
            return closure_loss
        if self.job.local is not None:  # the other micro-batches are inner steps of their own (optimizer_step)
            self._weighted_backward(closure_loss, optimizer, True, *args, **kwargs)
            return closure_loss
        later, rest, step_kwargs = self._later_micro_batches
        self._later_micro_batches = ([], (), {})
        self._weighted_backward(closure_loss, optimizer, not later, *args, **kwargs)
        normalize = self._trainer().accumulate_grad_batches  # as Lightning's closure divides the first one
        job = self.job
        for index, (batch, samples) in enumerate(later):
            last = index == len(later) - 1
            with job.loss_weights.weighted_sync(), job.emulation.slowed(), job.communication.counting():
                output = self._micro_batch_step(batch, samples, last, rest, step_kwargs)
            self._weighted_backward(step_loss(output) / normalize, optimizer, last, *args, **kwargs)
        if later and self._zero_stage() == 2:
            raise_if_unreduced(self.lightning_module)
        return closure_loss

    def _weighted_backward(self, loss: Tensor, optimizer: Any, last: bool, *args: Any, **kwargs: Any) -> None:
        # DeepSpeed averages ranks equally; weighting the loss makes that average the full-batch mean. A rank's
        # micro-batches before its last keep their gradients local (train/micro_batches.py).
        self.job.nonfinite.loss_computed(loss)
        held_back = contextlib.nullcontext() if last else reduction_held_back(self.deepspeed_engine)
        with self.job.emulation.slowed(), self.job.communication.counting(), held_back:
            super().backward(loss * self.current_loss_weight(), optimizer, *args, **kwargs)
        self.job.watcher.meter.backward_ended()  # type: ignore[union-attr]

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.job.pipeline is not None:
            return super().optimizer_step(*args, **kwargs)
        with self.job.communication.counting():  # (the closure, training_step and backward, runs inside)
            result = super().optimizer_step(*args, **kwargs)
            if self.job.local is not None:
                self._local_inner_steps(args[0] if args else kwargs.get("optimizer"))
        self.job.watcher.meter.optimizer_step_ended()  # type: ignore[union-attr]
        self.job.nonfinite.step_ended(self._trainer().global_step)  # may stop every rank, together
        return result

    def _local_inner_steps(self, optimizer: Any) -> None:
        """Local SGD / DiLoCo: this rank's other micro-batches of the step, each an inner step of its own (the first
        went through Lightning's closure), then the synchronization when it is due."""
        job, engine = self.job, self.deepspeed_engine
        later, rest, step_kwargs = self._later_micro_batches
        self._later_micro_batches = ([], (), {})
        for index, (batch, samples) in enumerate(later):
            engine.zero_grad()
            with job.loss_weights.weighted_sync(), job.emulation.slowed():
                output = self._micro_batch_step(batch, samples, index == len(later) - 1, rest, step_kwargs)
            self._weighted_backward(step_loss(output), optimizer, True)
            with job.emulation.slowed():
                engine.step()
        job.local_step_done(job.loss_weights.batch_samples() or 0, self._trainer().is_last_batch)

    @override
    def on_train_end(self) -> None:
        with self.job.communication.counting():
            self.job.synchronize_local_training()  # every rank ends the fit with the same parameters
        self.job.training_ends()  # (its checks' gathers are bookkeeping, not the exchange the report counts)
        super().on_train_end()
        self.job.write_report(self._trainer(), self.precision_plugin)

    @override
    def on_validation_start(self) -> None:
        # Local SGD / DiLoCo: validation during a fit sees one model, the ranks' merged parameters (at an epoch's end
        # they are merged already; a `val_check_interval` inside an epoch or `limit_train_batches` merges here).
        trainer = self._trainer()
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            with self.job.communication.counting():
                self.job.synchronize_local_training()
        super().on_validation_start()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.job.pipeline is not None:
            parent = super().validation_step
            return self.job.pipeline_evaluation_step(args[0], lambda batch: parent(batch, *args[1:], **kwargs))
        with self.job.loss_weights.weighted_sync(evaluating=True):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.job.loss_weights.weighted_sync(evaluating=True):
            return super().test_step(*args, **kwargs)

    # An emulated slow rank reaches a collective (e.g. a `self.log(..., sync_dist=True)` inside training_step) only
    # after its stretched compute, as a slower device would; paying later would let its peers run ahead.

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Inside a step a "mean" is weighted by each rank's samples (:class:`~.train.weights.LossWeights`). In a
        micro-batch before the rank's last (``micro_steps``) nothing is reduced: the last one's value is logged."""
        if self.job.micro_batch_guard.early:
            return tensor
        self.job.collectives.before_each()
        return self.job.loss_weights.reduce(tensor, group, reduce_op, super().reduce)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self.job.micro_batch_guard.refuse_collective("all_gather")
        self.job.collectives.before_each()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.job.micro_batch_guard.refuse_collective("broadcast")
        self.job.collectives.before_each()
        return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.job.micro_batch_guard.refuse_collective("barrier")
        self.job.collectives.before_each()
        super().barrier(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say on every rank which rank failed and how (see :mod:`lightning_hetero.recover.failures`)."""
        super().on_exception(exception)
        self.job.recovery.on_exception(exception, self._trainer())

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (see :mod:`~.recover.checkpoint`)."""
        recovery, parent_save = self.job.recovery, super().save_checkpoint
        if self.job.pipeline is not None:  # each rank's blocks by name (recover/pipeline_state.py)
            self.job.save_pipeline_checkpoint(Path(self.broadcast(str(filepath))), checkpoint, self.deepspeed_engine)
            return

        # Local SGD / DiLoCo: a checkpoint holds synchronized parameters (one model), each rank's own optimizer state.
        self.job.synchronize_local_training()

        def write(directory: Path) -> None:
            save = lambda: parent_save(checkpoint, directory, storage_options)  # noqa: E731
            recovery.write_with_deferred_errors(self.deepspeed_engine, save, self.is_global_zero)
            self.job.communication.save(directory, self.global_rank)  # per-rank error feedback, in the manifest
            if self.job.local is not None:
                self.job.local.save(directory, self.global_rank)

        facts = lambda: self.job.manifest_facts(checkpoint, self._zero_stage(), self.deepspeed_engine)  # noqa: E731
        recovery.save(Path(self.broadcast(str(filepath))), write, facts)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.job.recovery.remove(Path(filepath), super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        job, path, module = self.job, Path(checkpoint_path), self.lightning_module
        # DeepSpeed restores the checkpoint after the strategy's setup, where the training loader was requested:
        # the model or datamodule state it restores may change what `train_dataloader()` returns, so the fit loop
        # asks again, as under DDP.
        job.sharding.forget_served_loader(self._trainer())
        if job.pipeline is not None and path.is_file():
            raise ResumeRefused(
                f"HeteroStrategy(pipeline=...) cannot resume {path}, a Lightning checkpoint file: a pipeline resumes"
                " its own checkpoint directories for now. Resume it without `pipeline`."
            )
        if path.is_file():  # a .ckpt file another strategy (DDP...) wrote
            plan = job.split.plan
            return job.recovery.resume_from_lightning_file(path, module, self.deepspeed_engine,
                                                           self._optimizer_parameters, job.training_order(),
                                                           plan.global_batch_size if plan else None)  # fmt: skip
        chosen, manifest = job.recovery.choose(path)
        if job.pipeline is not None or manifest.get("pipeline"):
            return job.load_pipeline_checkpoint(chosen, manifest, self.deepspeed_engine)
        mismatch = resume_stage_mismatch(manifest.get("zero_stage"), self._zero_stage(),
                                         self._automatic_stages is not None, str(chosen))  # fmt: skip
        if mismatch:  # (every rank has the manifest: every rank raises; every restart would too)
            raise ResumeRefused(mismatch)
        if from_deepspeed.is_deepspeed_strategys(manifest):  # Lightning's DeepSpeedStrategy wrote it (no manifest)
            client_state = self._load_checkpoint_directory(chosen, manifest, *args, **kwargs)
            return from_deepspeed.with_data_position(client_state, manifest, job.training_order())
        return self._load_checkpoint_directory(chosen, manifest, *args, **kwargs)

    def _load_checkpoint_directory(self, chosen: Path, manifest: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        job, module = self.job, self.lightning_module
        same_world_size = manifest.get("world_size", self.world_size) == self.world_size
        if job.local is not None and not same_world_size:
            raise ResumeRefused(
                f"Checkpoint {chosen} was trained on {manifest.get('world_size')} ranks with `sync="
                f"{self.settings.sync!r}`, and each rank's own optimizer state is in it: resume it on as many ranks."
            )
        job.communication.load(chosen, self.global_rank, manifest, same_world_size)
        if same_world_size:
            client_state = super().load_checkpoint(str(chosen), *args, **kwargs)
            if job.local is not None:
                job.load_local_training(chosen)
            return client_state
        job.keep_the_checkpoints_global_batch(chosen, manifest, self._zero_stage(), module)
        parent_load = super().load_checkpoint
        load = lambda directory: parent_load(directory, *args, **kwargs)  # noqa: E731
        return job.recovery.load_on_another_world_size(chosen, manifest, self.deepspeed_engine, load)

    @override
    def teardown(self) -> None:
        self.job.detach(self.precision_plugin, self._trainer())
        self._buffer_sync = None
        self._forward_redirection = self._plain_redirection
        super().teardown()

    def _trainer(self) -> Any:
        """The Trainer this strategy runs under, or None (not attached yet, or already detached)."""
        return self.lightning_module._trainer if self.lightning_module is not None else None

    def _zero_stage(self) -> int:
        return self.config["zero_optimization"]["stage"]
