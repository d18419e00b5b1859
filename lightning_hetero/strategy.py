"""HeteroStrategy: Lightning's DeepSpeedStrategy with a per-rank micro-batch, on CPU and CUDA.

Orchestration only: at each of Lightning's lifecycle points it calls one object per capability, each from its stage
folder (see the package docstring): :class:`~lightning_hetero.settings.HeteroSettings` (the arguments, checked),
:class:`~lightning_hetero.runtime.collectives.Collectives`, the survey of ranks (``measure/``), the initial plan
(``plan/``), :class:`~lightning_hetero.train.split_in_force.SplitInForce` (the one owner of the split), the data
sharding and loss weights (``train/``), :class:`~lightning_hetero.watch.watcher.Watcher` (measure, re-plan, report),
the precision plugin (``precision/``), :class:`~lightning_hetero.comm.communication.Communication`,
:class:`~lightning_hetero.recover.recovery.Recovery` and the emulation (``emulate/``, a null object when off).
What stays here is Lightning's hook order, the setup collectives, and the DeepSpeed overrides.
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
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hetero.comm import topology
from lightning_hetero.comm.communication import Communication
from lightning_hetero.comm.compression import check_exchange
from lightning_hetero.emulate.emulation import NoEmulation, emulation_for
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.measure.profiler import RankProfile
from lightning_hetero.measure.survey import JobSurvey, RankSurvey, profile_rank
from lightning_hetero.plan.deepspeed_config import (
    CPU_ZERO_SETTINGS,
    check_config_argument,
    config_disagreements,
    disagreement_message,
    model_signature,
    rank_config,
    with_cpu_zero_settings,
)
from lightning_hetero.plan.initial import initial_plan, rebalancer_for
from lightning_hetero.plan.replan import DEFAULT_THRESHOLD, DEFAULT_WINDOW
from lightning_hetero.plan.split import SplitPlan
from lightning_hetero.precision.job import (
    attach_to_engine,
    gradient_bytes_held_until_step,
    job_plugin,
    loss_scale_value,
    this_rank_precision,
)
from lightning_hetero.precision.nonfinite import DEFAULT_MAX_NONFINITE_STEPS, NonFiniteGuard
from lightning_hetero.precision.plugin import HeteroPrecision, autocast_for
from lightning_hetero.recover import elastic, liveness
from lightning_hetero.recover.recovery import Recovery, manifest_facts
from lightning_hetero.runtime import quiet, startup
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.shutdown import register_exit_cleanup
from lightning_hetero.settings import DEFAULT_STAGE, HeteroSettings, check_ranks_agree
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.loaders import HeteroDataLoader
from lightning_hetero.train.order import GlobalOrder, agreed_seed, local_seed
from lightning_hetero.train.sharding import BatchListeners, DataSharding, check_trainable
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.streams import HeteroStreamLoader, is_stream
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.meter import RunWatch
from lightning_hetero.watch.watcher import PLAN_DIRNAME, JobFacts, Watcher


class HeteroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism where every rank has its own micro-batch.

    Args:
        stage: ZeRO stage 0-3 (default 2). With a ``config`` dict the config's ``zero_optimization.stage`` wins;
            ``stage`` only fills it in when the config leaves it unset.
        global_batch_size: samples per step across all ranks. Default: the training loader's ``batch_size`` times
            the world size (what DDP would use), or the sum of ``batch_sizes``.
        batch_sizes: each rank's micro-batch, in global rank order; they sum to the global batch.
        weights: relative capability per rank; the global batch is split in proportion (each rank >= 1 sample).
        loss_reduction: ``"mean"`` (default) when ``training_step`` returns the mean loss over its batch, ``"sum"``
            when it returns the sum. Each rank's loss is weighted so that the update is DDP's whatever the split:
            ``b_r * W / B`` for a mean, 1 for a sum (see :func:`lightning_hetero.plan.split.loss_weight`).
        emulate_speeds: a test and demo aid: one speed in (0, 1] per rank; a rank with speed ``f`` stretches its
            local compute to ``1/f`` of its duration (see :mod:`lightning_hetero.emulate.slowdown`). A drift is a schedule
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
            (see :mod:`lightning_hetero.comm.communication`). ``"auto"`` (default): at ZeRO-0 when there are several nodes, some
            with several ranks. True needs ``stage=0``. Nodes are the ranks' hosts, or
            ``LIGHTNING_HETERO_EMULATE_NODES=2`` (a test aid, with ``LIGHTNING_HETERO_EMULATE_LINK``; see
            :mod:`lightning_hetero.comm.topology`).
        max_nonfinite_steps: optimizer steps in a row skipped for non-finite gradients (a NaN or inf loss on any
            rank) after which the run stops on every rank, naming the ranks whose loss was non-finite, when there is
            no loss scale to lower (fp32, bf16; with fp16 a skip lowers the scale). Default 3; None: never stop.
            Skipped steps are counted in the run report and by HeteroMonitor either way (see
            :mod:`lightning_hetero.precision.nonfinite`).
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
        **kwargs: Any,
    ) -> None:
        self.settings = HeteroSettings.from_arguments(
            stage, global_batch_size, batch_sizes, weights, emulate_speeds, loss_reduction, rebalance,
            rebalance_window, rebalance_threshold, peer_timeout, device_precision, compression, compression_options,
            hierarchical, max_nonfinite_steps,
        )  # fmt: skip
        config = check_config_argument(config)
        quiet.install_lasting_filters()
        with quiet.third_party_noise_silenced():  # the parent imports DeepSpeed, which prints its accelerator guess
            super().__init__(stage=DEFAULT_STAGE if stage is None else stage, config=config, **kwargs)
        user_config = config is not None or self.DEEPSPEED_ENV_VAR in os.environ
        if user_config:
            self.settings.reconcile_user_config(self.config, kwargs)
        zero_stage = self.config["zero_optimization"]["stage"]
        check_exchange(self.settings.compression, self.settings.hierarchical, zero_stage, self.config)
        # Formatting adds keys (gradient_accumulation_steps...) that the parent refuses to see twice; each
        # trainer call (validate, then fit) formats a fresh copy of what the user gave.
        self._base_config = copy.deepcopy(self.config)
        # DeepSpeed's GPU-minded ZeRO defaults are replaced on CPU (setup_environment) unless the user chose them.
        self._cpu_zero_defaults = not user_config and not (CPU_ZERO_SETTINGS.keys() & kwargs.keys())
        # One object per capability; those that need the job (ranks, devices) join it in setup_environment.
        self.communication = Communication(self.settings.compression, self.settings.hierarchical)
        self.collectives = Collectives(1, torch.device("cpu"), lambda: self.emulation.catch_up())
        self.emulation: Any = NoEmulation()
        self.split = SplitInForce(rank=0)
        self.split.follow(self._follow_the_split)
        self.sharding = DataSharding()
        self.loss_weights = LossWeights(loss_reduction)
        self.recovery = Recovery(self.settings.peer_timeout)
        self.watcher: Optional[Watcher] = None
        self._nonfinite = NonFiniteGuard(max_nonfinite_steps, lambda tensor: self.collectives.gather_tensor(tensor))
        self._buffer_sync: Optional[BufferSync] = None
        self._optimizer_parameters: list[tuple[str, Any]] = []
        self._plain_redirection = self._forward_redirection
        # What the ranks told each other at setup (every rank holds the same).
        self.device_facts: list[DeviceFacts] = []
        self.precisions: list[str] = []
        self.profiles: Optional[list[RankProfile]] = None
        self._identical_devices = True

    @property
    def plan(self) -> Optional[SplitPlan]:
        """The split in force (see :class:`~lightning_hetero.train.split_in_force.SplitInForce`)."""
        return self.split.plan

    @property
    def prediction(self) -> Optional[dict[str, Any]]:
        """The planner's predicted step times for the initial split (automatic split only)."""
        return self.split.prediction

    @property
    def watch(self) -> Optional[RunWatch]:
        """What every rank did in each training step so far (see :mod:`lightning_hetero.watch.meter`)."""
        return self.watcher.run if self.watcher is not None else None

    @property
    def replans(self) -> list[dict[str, Any]]:
        """The re-plans of this fit so far, as in the run report: ``{"step", "batch_sizes", "predicted_gain"}``."""
        return self.watcher.replans if self.watcher is not None else []

    @property
    def skipped_steps(self) -> list[int]:
        """The optimizer steps of this fit skipped for non-finite gradients (global steps)."""
        return list(self._nonfinite.skipped)

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # False, as for DDP: Lightning's loop accumulates (each loss divided by k, the optimizer stepped after k batches
        # and at the end of an epoch), so global_step, LR schedulers and checkpoints count optimizer updates. The
        # DeepSpeed config follows it (configure.lightning_owns_accumulation).
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
        # Only our own name: the parent's "deepspeed*" names belong to DeepSpeedStrategy.
        strategy_registry.register(
            cls.strategy_name, cls, description="DeepSpeed ZeRO with per-rank micro-batches", override=True
        )

    # ------------------------------------------------------------------ setup

    @override
    def setup_environment(self) -> None:
        if not isinstance(self.accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise RuntimeError(
                f"HeteroStrategy runs on `accelerator='cpu'` or `'cuda'`, not {type(self.accelerator).__name__}."
            )
        # Checked before the process group exists: every rank raises the same error, none waits. (`world_size`
        # comes from the cluster environment, which is only filled in by setup_distributed.)
        plugin = self.precision_plugin  # (ours, from an earlier trainer call, is fine)
        trainer_precision = None if isinstance(plugin, HeteroPrecision) else (str(plugin.precision), type(plugin).__name__)
        self.settings.check_job(self.num_nodes * self.num_processes, self.root_device.type, self.config,
                                self._layer_sync is not None, trainer_precision)  # fmt: skip
        if self.root_device.type == "cpu":
            if self._cpu_zero_defaults:
                self._base_config = with_cpu_zero_settings(self._base_config)
            # DeepSpeed takes `root_device.index` as its device rank and Lightning checks that the indices count
            # 0..n-1; CPU devices carry no index, so give them one (torch ignores it for tensors).
            assert self.parallel_devices is not None
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        trainer = self._trainer()
        if trainer is not None:
            self.sharding.take_over_distributed_sampling(trainer)
        # Skip DeepSpeedStrategy.setup_environment: its only addition is refusing every accelerator but CUDA.
        DDPStrategy.setup_environment(self)
        # Without this a gloo job can abort at exit after a successful fit (exit code -6; see shutdown.py). Lightning
        # destroys the process group at exit for NCCL only, and only on its own init path, which DeepSpeed bypasses.
        register_exit_cleanup()
        self._join_the_job(trainer)

    def _join_the_job(self, trainer: Optional[Any]) -> None:
        """The process group exists: each capability learns its rank, the world size and the device."""
        rank, device = self.global_rank, self.root_device
        self.emulation = emulation_for(self.settings.speed_schedule, rank, device)
        self.collectives = Collectives(self.world_size, device, lambda: self.emulation.catch_up())
        self.recovery.join(self.collectives, rank)
        self.recovery.watch_peers()
        self.split.rank = rank
        self.loss_weights.join(rank, self.world_size, self.collectives.sum)
        self.watcher = Watcher(device, self.settings.rebalance_window, lambda: self.emulation.added_seconds,
                               self.communication.reading, self.collectives.gather_tensor)  # fmt: skip
        self.watcher.skipped_steps = lambda: self.skipped_steps
        self.watcher.loss_scale = lambda: loss_scale_value(self.precision_plugin)
        if trainer is not None:
            self.recovery.stop_together_on_sigterm(trainer, device)

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
        assert self.lightning_module is not None
        self.config = copy.deepcopy(self._base_config)
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        survey = self._survey_the_ranks(trainer, fitting)
        self.sharding.data_seed = agreed_seed([rank.seed for rank in survey.ranks])
        self.device_facts, self.precisions = survey.device_facts, survey.precisions
        plugin = job_plugin(self.settings.device_precision, self.precisions, self.global_rank, self.device_facts,
                            self.collectives.gather_tensor, self.precision_plugin)  # fmt: skip
        if plugin is not None:  # ranks of their own precisions: this rank's plugin replaces the Trainer's
            self.precision_plugin = plugin
        self._set_up_communication()
        if fitting:
            self.profiles = survey.profiles
            self._identical_devices = survey.identical_devices(emulated=self.settings.speed_schedule is not None)
            self._start_the_split(survey.ranks[self.global_rank].agreement["global_batch_size"])
        self.config["train_micro_batch_size_per_gpu"] = self.split.micro_batch
        super()._format_config()
        self.config = rank_config(self.config, self.split.micro_batch)
        lines = config_disagreements(self.collectives.gather_objects(self.config))
        if lines:
            raise ValueError(disagreement_message(lines))
        if fitting:
            self._write_the_plan(trainer)

    def _survey_the_ranks(self, trainer: Any, fitting: bool) -> JobSurvey:
        """Every rank's arguments, data-order seed, device facts and profile (the profile runs user code)."""
        module = self.lightning_module
        settings = self.settings

        def survey() -> tuple[None, dict[str, Any]]:
            loader = self.sharding.request_training_loader(trainer) if fitting else None
            global_batch_size = settings.global_batch_size_for(loader, self.world_size) if fitting else None
            if fitting:
                check_trainable(loader, global_batch_size, self.world_size, settings.loss_reduction,  # type: ignore[arg-type]
                                module.automatic_optimization)  # fmt: skip
            facts = collect_device_facts(self.root_device)
            precision = this_rank_precision(settings.device_precision, self.global_rank, facts,
                                            str(self.precision_plugin.precision))  # fmt: skip
            profile = None
            if fitting and settings.split_is_automatic:
                autocast = autocast_for(precision, self.root_device.type)  # measured as it will train
                profile = profile_rank(module, loader, global_batch_size, self.world_size, self.root_device,  # type: ignore[arg-type]
                                       self.emulation.emulator, autocast)  # fmt: skip
            agreement = settings.agreement(global_batch_size, self.communication.arguments())
            return None, RankSurvey(agreement, local_seed(), model_signature(module), facts, precision, profile).to_dict()

        job = JobSurvey([RankSurvey.from_dict(entry) for entry in self.collectives.gather_or_raise("setup", survey)[1]])
        check_ranks_agree([rank.agreement for rank in job.ranks], [rank.model for rank in job.ranks])
        return job

    def _set_up_communication(self) -> None:
        hosts = [facts.hostname for facts in self.device_facts]
        nodes = topology.topology_from_hosts(hosts, topology.emulated_nodes_from_environment())
        stage = self.config["zero_optimization"]["stage"]
        self.communication.setup(nodes, topology.slow_link_from_environment(), self.config, stage, self.global_rank)
        self.config.update(self.communication.deepspeed_entries())

    def _start_the_split(self, global_batch_size: int) -> None:
        """The split this fit starts with and the re-planner that follows it (both planned again when a resume on
        another number of ranks keeps the checkpoint's global batch)."""
        settings, module = self.settings, self.lightning_module
        assert module is not None
        stage = self.config["zero_optimization"]["stage"]
        held = gradient_bytes_held_until_step(settings.device_precision, self.precisions, self.device_facts, stage,
                                              module)  # fmt: skip
        start = initial_plan(self.world_size, global_batch_size, settings.batch_sizes, settings.weights,
                             self.profiles, settings.loss_reduction, self._identical_devices, held)  # fmt: skip
        if start.warning:
            rank_zero_warn(start.warning)
        self.split.start(start.plan, start.prediction)
        rebalancing = settings.rebalancing(profiled=self.profiles is not None, world_size=self.world_size)
        window, threshold = settings.rebalance_window, settings.rebalance_threshold
        assert self.watcher is not None
        self.watcher.follow(self.split, rebalancer_for(start.plan, self.profiles, held, window, threshold)
                            if rebalancing else None)  # fmt: skip

    def _follow_the_split(self, micro_batch: int) -> None:
        """The split changed (a re-plan, or the one a checkpoint recorded): keep DeepSpeed in step.

        The loss weight needs nothing here: it is derived from every batch's sample counts as the loader hands it
        over. DeepSpeed reads `train_micro_batch_size_per_gpu` (and the `train_batch_size` derived from it) only for
        bookkeeping: its throughput and sample counters, the default batch of its own `deepspeed_io` loader, and
        data-efficiency (random-LTD) settings that this strategy does not use. The gradient reduction and the
        optimizer never read it, so changing it between two steps is safe; it is kept equal to the batch this rank
        gets so that those counters and a checkpoint's config tell the truth.
        """
        if self.config is not None:
            self.config["train_micro_batch_size_per_gpu"] = micro_batch
        if self.model is not None and hasattr(self.model, "set_train_micro_batch_size"):
            self.deepspeed_engine.set_train_micro_batch_size(micro_batch)

    def _write_the_plan(self, trainer: Any) -> None:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON."""
        assert self.split.plan is not None and self.watcher is not None
        schedule = self.settings.speed_schedule
        job = JobFacts(self.device_facts, self.precisions, self.profiles, schedule.to_json() if schedule else None,
                       self.communication.summary(), self.communication.plan_line())  # fmt: skip
        reduction = self.settings.loss_reduction
        # (a token mean's weight is taken from each batch's token counts)
        weight = None if reduction == "token_mean" else self.split.plan.loss_weight(self.global_rank, reduction)
        record = {"loss_weight": weight, "loss_reduction": reduction, "deepspeed_config": self.config}
        self.watcher.write_plan(self._report_directory(trainer), self.split, job, record)

    @staticmethod
    def _report_directory(trainer: Any) -> Path:
        return Path(trainer.log_dir or trainer.default_root_dir) / PLAN_DIRNAME  # log_dir broadcasts: every rank

    @override
    def _setup_model(self, model: Any) -> Any:
        # After the profile (which must run the module's own BatchNorms: a SyncBatchNorm would communicate from each
        # rank's probe, with different batch sizes) and before DeepSpeed wraps the module: where DDPStrategy.setup
        # applies `Trainer(sync_batchnorm=True)` (DDPStrategy.teardown reverts it).
        trainer = self._trainer()
        if self._layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            model = self._layer_sync.apply(model)
        return super()._setup_model(model)

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        # The optimizer's parameters in its own order, before DeepSpeed replaces them with flat partitions: what a
        # torch optimizer state saved by another strategy is indexed by (see recover/from_lightning.py).
        names = {id(p): n for n, p in self.lightning_module.named_parameters()} if self.lightning_module else {}
        groups = optimizer.param_groups if optimizer is not None else []
        self._optimizer_parameters = [(names.get(id(p), ""), p) for g in groups for p in g["params"]]
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        engine, plugin = self.deepspeed_engine, self.precision_plugin
        self._forward_redirection = attach_to_engine(plugin, engine, self.root_device, self._plain_redirection)
        own_precision = isinstance(plugin, HeteroPrecision)
        self.communication.attach(engine, self.global_rank,
                                  (lambda: plugin.skips_this_step) if own_precision else (lambda: False))  # fmt: skip
        scaled = own_precision and plugin.loss_scale is not None
        precisions = ", ".join(sorted(set(self.precisions))) or str(plugin.precision)
        self._nonfinite.attach(engine, has_loss_scale=scaled, skipping_installed=scaled, precision=precisions)
        self.emulation.around_deepspeed_exchanges(engine)
        if self.world_size > 1 and engine.optimizer is not None:
            self._buffer_sync = BufferSync(engine.module.buffers(), lambda flat: torch.distributed.broadcast(flat, src=0))

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, (HeteroDataLoader, HeteroStreamLoader)):
            return dataloader
        trainer = self._trainer()
        training = trainer.state.stage == RunningStage.TRAINING
        assert self.watcher is not None
        listeners = BatchListeners(self._on_training_batch, self.loss_weights.evaluation_batch,
                                   self.loss_weights.forget_evaluation_batch, self.watcher.before_fetch)  # fmt: skip
        split = self.split.batch_sizes if training else None
        loader = self.sharding.shard(dataloader, trainer, split, self.collectives, self.global_rank, listeners)
        if training:
            self.split.cut_by(loader)
        return loader

    def _on_training_batch(self, local_samples: int, global_samples: int) -> None:
        self.loss_weights.training_batch(local_samples, global_samples)
        assert self.watcher is not None
        self.watcher.meter.batch_ready(local_samples)

    # ------------------------------------------------------------------ steps

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (see :mod:`lightning_hetero.train.weights`)."""
        return self.loss_weights.current(self.split.plan)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self.emulation.at_step(self._trainer().global_step)  # a drift schedule: the speed from this step on
        self.loss_weights.step_started()
        stream = self.sharding.training_stream
        if stream is not None:
            # Lightning drew this batch a step ahead: the step starts, and takes its counts, now.
            assert self.watcher is not None
            self.watcher.before_fetch()
            self._on_training_batch(*stream.batch_trained())
        with self.loss_weights.weighted_sync(), self.emulation.slowed(), self.communication.counting():
            if self._buffer_sync:  # rank 0's buffers on every rank before the forward, as DDP's broadcast_buffers
                self.collectives.before_each()
                self._buffer_sync.sync()
            output = super().training_step(*args, **kwargs)
        self.loss_weights.step_returned(output)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # DeepSpeed averages ranks equally; weighting the loss makes that average the full-batch mean.
        self._nonfinite.loss_computed(closure_loss)
        with self.emulation.slowed(), self.communication.counting():
            super().backward(closure_loss * self.current_loss_weight(), optimizer, *args, **kwargs)
        assert self.watcher is not None
        self.watcher.meter.backward_ended()
        return closure_loss

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.communication.counting():  # (the closure, training_step and backward, runs inside)
            result = super().optimizer_step(*args, **kwargs)
        assert self.watcher is not None
        self.watcher.meter.optimizer_step_ended()
        self._nonfinite.step_ended(self._trainer().global_step)  # may stop every rank, together
        return result

    @override
    def on_train_end(self) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary."""
        super().on_train_end()
        plugin = self.precision_plugin
        assert self.watcher is not None
        self.watcher.write_report(
            self._report_directory(self._trainer()),
            self.global_rank,
            self.world_size,
            precision=plugin.summary() if isinstance(plugin, HeteroPrecision) else None,
            communication=self.communication.summary(),
            nonfinite=self._nonfinite.summary(),
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_weights.weighted_sync(evaluating=True):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_weights.weighted_sync(evaluating=True):
            return super().test_step(*args, **kwargs)

    # An emulated slow rank reaches a collective (e.g. a `self.log(..., sync_dist=True)` inside training_step) only
    # after its stretched compute, as a slower device would; paying later would let its peers run ahead.

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        """Inside a step, a "mean" is weighted by each rank's sample count (see :class:`~.train.weights.LossWeights`)."""
        self.collectives.before_each()
        return self.loss_weights.reduce(tensor, group, reduce_op, super().reduce)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self.collectives.before_each()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.collectives.before_each()
        return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.collectives.before_each()
        super().barrier(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say on every rank which rank failed and how (see :mod:`lightning_hetero.recover.failures`)."""
        super().on_exception(exception)
        self.recovery.on_exception(exception, self._trainer())

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (see :mod:`~.recover.checkpoint`)."""

        def write(directory: Path) -> None:
            parent_save = super(HeteroStrategy, self).save_checkpoint
            self.recovery.write_with_deferred_errors(self.deepspeed_engine,
                                                     lambda: parent_save(checkpoint, directory, storage_options),
                                                     self.is_global_zero)  # fmt: skip
            self.communication.save(directory, self.global_rank)  # per-rank error feedback, listed in the manifest

        facts = lambda: manifest_facts(  # noqa: E731
            checkpoint, self.world_size, self.split.plan.batch_sizes if self.split.plan else None,
            self.split.global_samples_consumed(), self.config["zero_optimization"]["stage"], self.deepspeed_engine,
            [facts.describe() for facts in self.device_facts], self.communication.checkpoint_facts(),
        )  # fmt: skip
        self.recovery.save(Path(self.broadcast(str(filepath))), write, facts)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        self.recovery.remove(Path(filepath), super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        trainer = self._trainer()
        if Path(checkpoint_path).is_file():  # a .ckpt file another strategy (DDP...) wrote
            plan = self.split.plan
            saved = self.recovery.resume_from_lightning_file(
                Path(checkpoint_path), self.lightning_module, self.deepspeed_engine, self._optimizer_parameters,
                self._training_order(), plan.global_batch_size if plan is not None else None,
            )  # fmt: skip
            self.sharding.forget_served_loader(trainer)
            return saved
        chosen, manifest = self.recovery.choose(Path(checkpoint_path))
        # DeepSpeed restores the checkpoint after the strategy's setup, where the training loader was requested:
        # the model or datamodule state it restores may change what `train_dataloader()` returns, so the fit loop
        # asks again, as under DDP.
        self.sharding.forget_served_loader(trainer)
        same_world_size = manifest.get("world_size", self.world_size) == self.world_size
        self.communication.load(chosen, self.global_rank, manifest, same_world_size)
        if same_world_size:
            return super().load_checkpoint(str(chosen), *args, **kwargs)
        self._keep_the_checkpoints_global_batch(chosen, manifest)
        parent_load = super().load_checkpoint
        return self.recovery.load_on_another_world_size(chosen, manifest, self.deepspeed_engine,
                                                        lambda path: parent_load(path, *args, **kwargs))  # fmt: skip

    def _training_order(self) -> Optional[GlobalOrder]:
        """The global order the training loader will cut (a map-style loader's), to place a restored epoch."""
        loader = self.sharding.requested_training_loader
        if isinstance(loader, DataLoader) and not is_stream(loader):
            return GlobalOrder(loader.batch_sampler.sampler, self.sharding.data_seed or 0)
        return None

    def _keep_the_checkpoints_global_batch(self, path: Path, manifest: dict[str, Any]) -> None:
        """A resume on another number of ranks continues the same optimisation: the checkpoint's global batch.

        The default global batch (the loader's batch size times the ranks) follows the world size, so it is replaced
        by the checkpoint's and the split is planned again for it; one the user fixed must agree.
        """
        assert self.split.plan is not None
        saved, current = sum(manifest.get("batch_sizes") or []) or None, self.split.plan.global_batch_size
        if saved is None or saved == current:
            return
        if self.settings.global_batch_size is not None or self.settings.batch_sizes is not None:
            raise ValueError(
                f"Checkpoint {path} was trained with a global batch of {saved} samples; this job's is {current}."
                f" Pass `global_batch_size={saved}` to continue the same optimisation (the split over this job's"
                " ranks is planned for it)."
            )
        self._start_the_split(saved)
        rank_zero_info(
            f"HeteroStrategy: keeping the checkpoint's global batch of {saved} on {self.world_size} ranks:"
            f" micro-batches {list(self.split.batch_sizes)}."
        )

    @override
    def teardown(self) -> None:
        if isinstance(self.precision_plugin, HeteroPrecision):
            self.precision_plugin.detach()
        self.communication.detach()
        self._nonfinite.detach()
        self._buffer_sync = None
        self._forward_redirection = self._plain_redirection
        trainer = self._trainer()
        self.recovery.teardown(finished=trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED)
        # A fit that failed before its loop asked for the training loader must not hand it to the next fit.
        self.sharding.forget_served_loader(trainer)
        super().teardown()

    def _trainer(self) -> Any:
        """The Trainer this strategy runs under, or None (not attached yet, or already detached)."""
        return self.lightning_module._trainer if self.lightning_module is not None else None
