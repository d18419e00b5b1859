"""HeteroStrategy: Lightning's DeepSpeedStrategy with a per-rank micro-batch, on CPU and CUDA.

Thin orchestration: the split comes from :mod:`lightning_hetero.plan`, each rank's DeepSpeed config from
:mod:`lightning_hetero.plan.deepspeed_config`, the data order from :mod:`lightning_hetero.train`, the measurements and re-plans
during training from :mod:`lightning_hetero.watch.meter` and :mod:`lightning_hetero.watch.follower`, recovery from
:mod:`lightning_hetero.recover.checkpoint` (complete-or-ignored checkpoints), :mod:`lightning_hetero.recover.elastic` (saving,
pruning, resuming on another number of ranks) and :mod:`lightning_hetero.recover.liveness` (a lost rank stops the others).
What this class adds to the
parent is where those are called, the collectives that check the ranks agree, and three corrections that unequal
batches need: the loss weight, the sample-weighted ``sync_dist`` mean, and sampling that respects the user's order.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, SequentialSampler
from typing_extensions import override

from lightning_hetero.comm import compression as compress
from lightning_hetero.comm import topology
from lightning_hetero.comm.communication import Communication
from lightning_hetero.emulate.slowdown import ENV_VAR as EMULATE_ENV_VAR
from lightning_hetero.emulate.slowdown import SlowdownEmulator, compute_clock, emulated_speeds
from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.measure.facts import DeviceFacts, same_model
from lightning_hetero.measure.profiler import RankProfile, loss_reduction_mismatch, probe_sizes, profile_from_loader
from lightning_hetero.plan.deepspeed_config import (
    CPU_ZERO_SETTINGS,
    check_config_argument,
    check_user_config,
    config_disagreements,
    disagreement_message,
    model_disagreement,
    model_signature,
    raise_if_arguments_differ,
    rank_config,
    with_cpu_zero_settings,
)
from lightning_hetero.plan.planner import plan_automatic_split, required_gain
from lightning_hetero.plan.replan import DEFAULT_THRESHOLD, DEFAULT_WINDOW, Rebalancer, check_rebalance_arguments
from lightning_hetero.plan.split import SplitPlan, check_split_arguments, loss_weight, resolve_split
from lightning_hetero.precision import choice as precision
from lightning_hetero.precision.choice import reduces_in_parameter_order
from lightning_hetero.precision.nonfinite import DEFAULT_MAX_NONFINITE_STEPS, NonFiniteGuard, check_max_nonfinite_steps
from lightning_hetero.precision.plugin import AutocastInside, HeteroPrecision, autocast_for
from lightning_hetero.recover import checkpoint, elastic, failures, liveness
from lightning_hetero.recover import from_lightning as resume_lightning
from lightning_hetero.recover.stopping import StopOnSigterm, all_reduce_max, exit_code_for
from lightning_hetero.runtime import quiet, startup
from lightning_hetero.runtime.checks import check_loss_reduction, check_stage, token_count
from lightning_hetero.runtime.shutdown import exit_with_if_uncaught, register_exit_cleanup
from lightning_hetero.train.buffers import BufferSync
from lightning_hetero.train.loaders import (
    HeteroDataLoader,
    describe_empty_epoch,
    describe_order,
    describe_several_training_loaders,
    describe_unsupported_loader,
    loader_batch_size,
    only_loader,
    rebuild_loader,
)
from lightning_hetero.train.order import STATE_SAMPLES_CONSUMED, GlobalOrder, agreed_seed, local_seed
from lightning_hetero.train.streams import HeteroStreamLoader, is_stream
from lightning_hetero.watch import report
from lightning_hetero.watch.follower import SplitFollower
from lightning_hetero.watch.meter import RunWatch, StepMeter

# Arguments of DeepSpeedStrategy that only build its default DeepSpeed config: a user config replaces them all.
_DEFAULT_CONFIG_ARGUMENTS = frozenset(
    {
        "zero_optimization", "offload_optimizer", "offload_parameters", "offload_params_device", "nvme_path",
        "params_buffer_count", "params_buffer_size", "max_in_cpu", "offload_optimizer_device",
        "optimizer_buffer_count", "block_size", "queue_depth", "single_submit", "overlap_events", "thread_count",
        "pin_memory", "sub_group_size", "contiguous_gradients", "overlap_comm", "allgather_partitions",
        "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size", "zero_allow_untested_optimizer",
        "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
    }
)  # fmt: skip
DEFAULT_STAGE = 2
PLAN_DIRNAME = "hetero"
T = TypeVar("T")


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
        schedule, both_given = emulated_speeds(emulate_speeds)
        if both_given:
            rank_zero_warn(both_given)
        if stage is not None:
            check_stage(stage)
        check_loss_reduction(loss_reduction)
        check_split_arguments(global_batch_size, batch_sizes, weights)
        check_rebalance_arguments(rebalance, rebalance_window, rebalance_threshold)
        liveness.check_peer_timeout(peer_timeout)
        check_max_nonfinite_steps(max_nonfinite_steps)
        self.device_precision = precision.check_device_precision(device_precision)
        choice = compress.check_compression(compression, compression_options)
        hierarchical = topology.check_hierarchical(hierarchical)
        config = check_config_argument(config)
        quiet.install_lasting_filters()
        with quiet.third_party_noise_silenced():  # the parent imports DeepSpeed, which prints its accelerator guess
            super().__init__(stage=DEFAULT_STAGE if stage is None else stage, config=config, **kwargs)
        self.global_batch_size = global_batch_size
        self.batch_sizes = list(batch_sizes) if batch_sizes is not None else None
        self.weights = list(weights) if weights is not None else None
        self.loss_reduction = loss_reduction
        self.rebalance = rebalance
        self.rebalance_window = int(rebalance_window)
        self.rebalance_threshold = float(rebalance_threshold)
        self.peer_timeout = None if peer_timeout is None else float(peer_timeout)
        self.max_nonfinite_steps = max_nonfinite_steps
        self._nonfinite = NonFiniteGuard(max_nonfinite_steps, self._all_gather_tensor)
        self._buffer_sync: Optional[BufferSync] = None
        self._step_tokens: Optional[float] = None  # loss_reduction="token_mean": this rank's count in this batch
        self._training_stream: Optional[HeteroStreamLoader] = None  # the training loader, when it reads a stream
        self._optimizer_parameters: list[tuple[str, Any]] = []
        self._requested_training_loader: Any = None  # the user's, as requested at setup (before it is rebuilt)
        self._watchdog: Optional[liveness.PeerWatchdog] = None
        self._writer_locks: dict[Path, checkpoint.WriterLock] = {}  # rank 0's, per checkpoint directory
        self._stop_on_sigterm: Optional[StopOnSigterm] = None
        self._trainer_calls = 0
        self._follower: Optional[SplitFollower] = None
        self._speed_schedule = schedule
        self._emulator: Optional[SlowdownEmulator] = None
        user_config = config is not None or self.DEEPSPEED_ENV_VAR in os.environ
        if user_config:
            self._reconcile_user_config(stage, kwargs)
            precision.check_config_precision(self.device_precision, self.config)
            compress.check_config_compression(choice, self.config)
        compress.check_exchange(choice, hierarchical, self.config["zero_optimization"]["stage"], self.config)
        self.communication = Communication(choice, hierarchical)
        self.precisions: list[str] = []  # every rank's, once set up

        # Formatting adds keys (gradient_accumulation_steps...) that the parent refuses to see twice; each
        # trainer call (validate, then fit) formats a fresh copy of what the user gave.
        self._base_config = copy.deepcopy(self.config)
        # DeepSpeed's GPU-minded ZeRO defaults are replaced on CPU (setup_environment) unless the user chose them.
        self._cpu_zero_defaults = not user_config and not (CPU_ZERO_SETTINGS.keys() & kwargs.keys())
        self.plan: Optional[SplitPlan] = None
        self.profiles: Optional[list[RankProfile]] = None
        self.prediction: Optional[dict[str, Any]] = None
        self.device_facts: list[DeviceFacts] = []
        self._user_use_distributed_sampler: Optional[bool] = None
        # (local, global) sample counts of the batch the loop is working on, told by the HeteroDataLoader.
        self._batch_samples: Optional[tuple[int, int]] = None
        self._eval_batch_samples: Optional[tuple[int, int]] = None  # (those of a map-style evaluation loader)
        self._sync_weight: Optional[int] = None
        self._data_seed: Optional[int] = None  # rank 0's seed_everything seed: the data order of every rank
        self._said_order_is_kept = False
        self._plain_redirection = self._forward_redirection

    def _reconcile_user_config(self, stage: Optional[int], kwargs: dict[str, Any]) -> None:
        assert self.config is not None
        check_user_config(self.config)
        zero = self.config.setdefault("zero_optimization", {})
        config_stage = zero.get("stage")
        if config_stage is None:
            zero["stage"] = DEFAULT_STAGE if stage is None else stage
        elif stage is not None and stage != config_stage:
            rank_zero_warn(
                f"HeteroStrategy: the DeepSpeed config's `zero_optimization.stage={config_stage}` wins over"
                f" `stage={stage}`."
            )
        if zero["stage"] in (0, 1) and zero.get("overlap_comm"):
            rank_zero_warn(
                f"HeteroStrategy: the DeepSpeed config's `zero_optimization.overlap_comm=True` is switched off for"
                f" ZeRO-{zero['stage']}: Lightning's loop owns gradient accumulation, and DeepSpeed allows overlap_comm"
                " there only with ZeRO-2 and 3 (ZeRO-0/1 reduce once per optimizer step either way)."
            )
        ignored = sorted(_DEFAULT_CONFIG_ARGUMENTS & kwargs.keys())
        if kwargs.get("logging_batch_size_per_gpu", "auto") != "auto":
            ignored.append("logging_batch_size_per_gpu")
        if ignored:
            rank_zero_warn(
                f"HeteroStrategy: a DeepSpeed `config` was given, so these arguments are ignored: {ignored}."
                " Put those settings into the config instead."
            )

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        # False, as for DDP: Lightning's loop accumulates (each loss divided by k, the optimizer stepped after k batches
        # and at the end of an epoch), so global_step, LR schedulers and checkpoints count optimizer updates. The
        # DeepSpeed config follows it (configure.lightning_owns_accumulation).
        return False

    @contextlib.contextmanager
    @override
    def block_backward_sync(self) -> Iterator[None]:
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
        # World-size checks before the process group exists: every rank raises the same error, none waits.
        known_global_batch = self.global_batch_size
        if known_global_batch is None and self.batch_sizes is not None:
            known_global_batch = sum(self.batch_sizes)
        # (`world_size` comes from the cluster environment, which is only filled in by setup_distributed.)
        world_size = self.num_nodes * self.num_processes
        resolve_split(world_size, known_global_batch or world_size, self.batch_sizes, self.weights)
        precision.check_rank_count(self.device_precision, world_size)
        compress.check_zero_plus_plus(self.config, self.root_device.type)
        if not isinstance(self.precision_plugin, HeteroPrecision):  # (ours from an earlier trainer call is fine)
            precision.check_trainer_precision(
                self.device_precision, str(self.precision_plugin.precision), type(self.precision_plugin).__name__
            )
        if self._speed_schedule is not None and self._speed_schedule.world_size != world_size:
            raise ValueError(
                f"`emulate_speeds={self._speed_schedule.to_json()}` (or {EMULATE_ENV_VAR}) has"
                f" {self._speed_schedule.world_size} entries but the job has {world_size} ranks. Give one speed per"
                " rank."
            )
        if self._layer_sync is not None and self.root_device.type != "cuda":
            raise ValueError(
                f"`Trainer(sync_batchnorm=True)` needs CUDA: torch's SyncBatchNorm runs on GPUs only, and this job runs"
                f" on {self.root_device.type}. Remove it; HeteroStrategy keeps every rank's BatchNorm statistics equal"
                " anyway, as DDP does, by giving every rank rank 0's buffers before each training step."
            )
        if self.root_device.type == "cpu" and self._cpu_zero_defaults:
            self._base_config = with_cpu_zero_settings(self._base_config)
        if self.root_device.type == "cpu":
            # DeepSpeed takes `root_device.index` as its device rank and Lightning checks that the indices count
            # 0..n-1; CPU devices carry no index, so give them one (torch ignores it for tensors).
            assert self.parallel_devices is not None
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        self._take_over_distributed_sampling()
        # Skip DeepSpeedStrategy.setup_environment: its only addition is refusing every accelerator but CUDA.
        DDPStrategy.setup_environment(self)
        # Without this a gloo job can abort at exit after a successful fit (exit code -6; see shutdown.py). Lightning
        # destroys the process group at exit for NCCL only, and only on its own init path, which DeepSpeed bypasses.
        register_exit_cleanup()
        self._start_watchdog()
        if self._speed_schedule is not None:
            self._emulator = SlowdownEmulator(self._speed_schedule.at(0)[self.global_rank], self.root_device)
        emulator = self._emulator
        meter = StepMeter(
            compute_clock(self.root_device),
            lambda: emulator.added_seconds if emulator else 0.0,
            wire_bytes=self.communication.reading,
        )
        self._watch = RunWatch(meter, window=self.rebalance_window)
        if self.lightning_module is not None:
            # Before Lightning registers its signal handlers for this run (after the strategy's setup).
            self._stop_on_sigterm = StopOnSigterm(all_reduce_max, self.root_device)
            self._stop_on_sigterm.install(self.lightning_module.trainer)

    def _start_watchdog(self) -> None:
        """From here to teardown, a rank whose process is gone stops the others (:mod:`lightning_hetero.recover.liveness`)."""
        self._trainer_calls += 1  # every rank makes the same trainer calls: the same keys for one call
        if self.world_size == 1 or self.peer_timeout is None:
            return
        rank, world_size = self.global_rank, self.world_size
        self._watchdog = liveness.PeerWatchdog(
            liveness.store_connector(),
            rank,
            world_size,
            self.peer_timeout,
            liveness.run_id(self._trainer_calls),
            read_failures=lambda store: failures.recorded_in(store, world_size, exclude=rank),
        )
        self._watchdog.start()

    def _take_over_distributed_sampling(self) -> None:
        """Keep Lightning from replacing the user's sampler with a shuffling DistributedSampler (we shard)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return
        connector = trainer._accelerator_connector
        if self._user_use_distributed_sampler is None:
            self._user_use_distributed_sampler = connector.use_distributed_sampler
            if not connector.use_distributed_sampler:
                rank_zero_warn(
                    "HeteroStrategy shards the training, validation and test data itself (it has to, to split"
                    " unevenly); `Trainer(use_distributed_sampler=False)` only applies to `predict`."
                )
        # Prediction keeps Lightning's sharding (no collectives per step, uneven counts are harmless there).
        predicting = trainer.state.fn == TrainerFn.PREDICTING
        connector.use_distributed_sampler = self._user_use_distributed_sampler if predicting else False

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
        gathered = self._gather_local_measurements(trainer, fitting)
        raise_if_arguments_differ([entry["arguments"] for entry in gathered])
        different_models = model_disagreement([entry["model"] for entry in gathered])
        if different_models:
            raise ValueError(different_models)
        self._data_seed = agreed_seed([entry["seed"] for entry in gathered])
        self.device_facts = [DeviceFacts.from_dict(entry["facts"]) for entry in gathered]
        self._use_device_precisions([entry["precision"] for entry in gathered])
        nodes = topology.topology_from_hosts(
            [facts.hostname for facts in self.device_facts], topology.emulated_nodes_from_environment()
        )
        stage = self.config["zero_optimization"]["stage"]
        link = topology.slow_link_from_environment()
        self.communication.setup(nodes, link, self.config, stage, self.global_rank)
        self.config.update(self.communication.deepspeed_entries())
        if fitting:
            global_batch_size = gathered[self.global_rank]["arguments"]["global_batch_size"]
            profiled = gathered[self.global_rank]["profile"] is not None
            self.profiles = [RankProfile.from_dict(e["profile"]) for e in gathered] if profiled else None
            self.plan, self.prediction = self._decide_split(global_batch_size)
            self._follower = SplitFollower(
                self._watch, self._all_gather_tensor, self._make_rebalancer(), self._use_split
            )

        micro_batch = self.plan.batch_sizes[self.global_rank] if self.plan is not None else 1
        self.config["train_micro_batch_size_per_gpu"] = micro_batch
        super()._format_config()
        self.config = rank_config(self.config, micro_batch)
        configs = self._all_gather(self.config)
        lines = config_disagreements(configs)
        if lines:
            raise ValueError(disagreement_message(lines))
        if fitting:
            self._report_plan(trainer)

    def _gather_local_measurements(self, trainer: Any, fitting: bool) -> list[dict[str, Any]]:
        """Every rank's arguments, data-order seed, device facts and profile (the profile runs user code)."""

        def measure() -> tuple[None, dict[str, Any]]:
            loader = self._training_loader(trainer) if fitting else None
            global_batch_size = self._global_batch_size(loader) if fitting else None
            if isinstance(loader, DataLoader) and not is_stream(loader):
                empty = describe_empty_epoch(loader, global_batch_size, self.world_size, "training loader")
                if empty:  # (before profiling, which needs samples)
                    raise ValueError(empty)
            if fitting and self.loss_reduction == "token_mean" and not self.lightning_module.automatic_optimization:
                raise ValueError(
                    "`HeteroStrategy(loss_reduction='token_mean')` weights each rank's loss by its tokens before"
                    " backward, but with manual optimization `training_step` runs its own backward first. Weight the"
                    " loss yourself (by this rank's tokens times the world size over all ranks' tokens) and use"
                    " loss_reduction='sum', or use automatic optimization."
                )
            facts = collect_device_facts(self.root_device)
            rank_precision = self._rank_precision(facts)  # may refuse this rank's device: raised on every rank
            profile = None
            if fitting and self.batch_sizes is None and self.weights is None:
                autocast = autocast_for(rank_precision, self.root_device.type)  # measured as it will train
                module = self.lightning_module
                assert module is not None
                module.to(self.root_device)  # DeepSpeed would move it there next anyway
                sizes = probe_sizes(global_batch_size, self.world_size)  # type: ignore[arg-type]
                measured = profile_from_loader(module, loader, sizes, self.root_device, self._emulator, autocast)
                profile = measured.to_dict()
            arguments = {
                "global_batch_size": global_batch_size,
                "batch_sizes": self.batch_sizes,
                "weights": self.weights,
                "emulate_speeds": self._speed_schedule.to_json() if self._speed_schedule else None,
                "loss_reduction": self.loss_reduction,
                "rebalance": [self.rebalance, self.rebalance_window, self.rebalance_threshold],
                "peer_timeout": self.peer_timeout,
                "max_nonfinite_steps": self.max_nonfinite_steps,
                "device_precision": self.device_precision,
                **self.communication.arguments(),
                # (read here, so that a bad value is raised on every rank, and one rank's differing value is said)
                "emulate_nodes": topology.emulated_nodes_from_environment(),
                "emulate_link": str(topology.slow_link_from_environment()),
            }
            model = model_signature(self.lightning_module)
            shared = {"arguments": arguments, "seed": local_seed(), "facts": facts.to_dict(), "profile": profile,
                      "model": model}  # fmt: skip
            return None, {**shared, "precision": rank_precision}

        return self._gather_or_raise("setup", measure)[1]

    def _rank_precision(self, facts: DeviceFacts) -> str:
        if self.device_precision is None:  # the Trainer's, on every rank (its plugin is never replaced then)
            return str(self.precision_plugin.precision)
        return precision.rank_precision(self.device_precision, self.global_rank, facts)

    def _use_device_precisions(self, precisions: list[str]) -> None:
        """Every rank's precision is known: with ``device_precision``, this rank's plugin replaces the Trainer's."""
        self.precisions = precisions
        if self.device_precision is None:
            return
        for rank, (chosen, facts) in enumerate(zip(precisions, self.device_facts)):
            slow = precision.slow_precision(chosen, facts)
            if slow:
                rank_zero_warn(f"HeteroStrategy: rank {rank} trains in {chosen!r}, but {slow}.")
        previous = self.precision_plugin
        self.precision_plugin = HeteroPrecision(
            precisions[self.global_rank],
            self.root_device.type,
            tuple(precisions),
            self._all_gather_tensor,
            # One Trainer's later fit continues with the scale it reached (a checkpoint restores its own).
            loss_scale=previous.loss_scale if isinstance(previous, HeteroPrecision) else None,
            device_types=tuple(facts.kind for facts in self.device_facts),
        )

    def _gather_or_raise(self, what: str, compute: Callable[[], tuple[T, Any]]) -> tuple[T, list[Any]]:
        """Run ``compute`` (local result, shared part) and gather the shared parts; a failure anywhere stops every rank.

        ``compute`` runs user code (loaders, the training step) and checks that may fail on one rank only: the others
        must not wait for it in the gather, so the failure travels in the gather instead and every rank raises.
        """
        try:
            local, shared = compute()
            failure: Optional[BaseException] = None
        except Exception as error:
            local, shared, failure = None, None, error
        failure_text = None if failure is None else failures.describe(failure)
        gathered = self._all_gather({"shared": shared, "failure": failure_text})
        if failure is not None:
            raise failure
        failed = [(rank, entry["failure"]) for rank, entry in enumerate(gathered) if entry["failure"]]
        if failed:
            rank, message = failed[0]
            raise RuntimeError(f"HeteroStrategy: {what} failed on rank {rank} ({message}); every rank stops here.")
        return local, [entry["shared"] for entry in gathered]  # type: ignore[return-value]

    @override
    def _setup_model(self, model: Any) -> Any:
        # After the profile (which must run the module's own BatchNorms: a SyncBatchNorm would communicate from each
        # rank's probe, with different batch sizes) and before DeepSpeed wraps the module: where DDPStrategy.setup
        # applies `Trainer(sync_batchnorm=True)` (DDPStrategy.teardown reverts it).
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._layer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            model = self._layer_sync.apply(model)
        return super()._setup_model(model)

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        # The optimizer's parameters in its own order, before DeepSpeed replaces them with flat partitions: what a
        # torch optimizer state saved by another strategy is indexed by (see resume_lightning).
        names = {id(p): n for n, p in self.lightning_module.named_parameters()} if self.lightning_module else {}
        groups = optimizer.param_groups if optimizer is not None else []
        self._optimizer_parameters = [(names.get(id(p), ""), p) for g in groups for p in g["params"]]
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)

    @override
    def init_deepspeed(self) -> None:
        super().init_deepspeed()
        if isinstance(self.precision_plugin, HeteroPrecision):
            self.precision_plugin.attach(self.deepspeed_engine, self.root_device)
            self._forward_redirection = AutocastInside(self._plain_redirection, self.precision_plugin.autocast)
        plugin = self.precision_plugin
        skipping = (lambda: plugin.skips_this_step) if isinstance(plugin, HeteroPrecision) else (lambda: False)
        self.communication.attach(self.deepspeed_engine, self.global_rank, skipping)
        scaled = isinstance(plugin, HeteroPrecision) and plugin.loss_scale is not None
        precisions = ", ".join(sorted(set(self.precisions))) or str(plugin.precision)
        self._nonfinite.attach(self.deepspeed_engine, has_loss_scale=scaled, skipping_installed=scaled,
                               precision=precisions)  # fmt: skip
        if self._emulator is not None:
            self._emulator.around_deepspeed_exchanges(self.deepspeed_engine)
        if self.world_size > 1 and self.deepspeed_engine.optimizer is not None:
            self._buffer_sync = BufferSync(
                self.deepspeed_engine.module.buffers(), lambda flat: torch.distributed.broadcast(flat, src=0)
            )

    def _decide_split(self, global_batch_size: int) -> tuple[SplitPlan, Optional[dict[str, Any]]]:
        if self.profiles is None:
            return resolve_split(self.world_size, global_batch_size, self.batch_sizes, self.weights), None
        resolve_split(self.world_size, global_batch_size)  # the global batch must give every rank a sample
        mismatch = loss_reduction_mismatch([profile.loss_ratio for profile in self.profiles], self.loss_reduction)
        if mismatch:
            rank_zero_warn(mismatch)
        held = self._gradient_bytes_held_until_step()
        costs = [profile.reserving(held).cost_model() for profile in self.profiles]
        # Same-model devices are presumed equally fast unless the profile says otherwise by a wide margin; emulated
        # speeds declare them different (the profiler still has to measure by how much).
        # Ranks computing in different precisions are different devices, whatever the hardware.
        identical = self._speed_schedule is None and same_model(self.device_facts) and len(set(self.precisions)) == 1
        decision = plan_automatic_split(costs, global_batch_size, min_gain=required_gain(identical))
        planned = decision.planned
        source = "auto"
        if decision.kept_equal:
            devices = "same-model devices" if identical else "devices"
            source = f"auto: equal, predicted gain < {decision.min_gain:.0%} on {devices}"
        prediction = {
            "step_seconds": planned.predicted_step_time,
            "rank_step_seconds": list(planned.predicted_times),
            "equal_split_step_seconds": decision.equal_split_step_time,
            "speedup": decision.predicted_speedup,
        }
        return SplitPlan(planned.batch_sizes, source=source), prediction

    def _gradient_bytes_held_until_step(self) -> float:
        """Memory the profile did not see: ranks under different autocasts at ZeRO-2/3 hold every parameter's fp32
        gradient until the step (see :class:`~lightning_hetero.precision.plugin.ParameterOrderReduction`)."""
        stage = (self.config or {}).get("zero_optimization", {}).get("stage", 0)
        kinds = [facts.kind for facts in self.device_facts]
        if self.device_precision is None or not reduces_in_parameter_order(self.precisions, kinds, stage):
            return 0.0
        assert self.lightning_module is not None
        return 4.0 * sum(p.numel() for p in self.lightning_module.parameters() if p.requires_grad)

    def _make_rebalancer(self) -> Optional[Rebalancer]:
        """What re-plans the split during this fit; None when re-planning is off (or there is one rank)."""
        assert self.plan is not None
        rebalancing = self.rebalance if self.rebalance is not None else self.profiles is not None
        if not rebalancing or self.world_size == 1:
            return None
        if self.profiles is not None:
            held = self._gradient_bytes_held_until_step()
            base_costs = [profile.reserving(held).cost_model() for profile in self.profiles]
        else:
            # A split the user fixed, no profile: time proportional to the batch, and no memory ceiling known.
            base_costs = [CostModel(fixed=0.0, per_sample=1.0)] * self.world_size
        return Rebalancer(base_costs, self.plan.batch_sizes, self.rebalance_window, self.rebalance_threshold)

    def _use_split(self, batch_sizes: tuple[int, ...]) -> None:
        """The split changed (a re-plan, or the one a checkpoint recorded): keep the plan and DeepSpeed in step.

        The loss weight needs nothing here: it is derived from every batch's sample counts as the loader hands it
        over. DeepSpeed reads `train_micro_batch_size_per_gpu` (and the `train_batch_size` derived from it) only for
        bookkeeping: its throughput and sample counters, the default batch of its own `deepspeed_io` loader, and
        data-efficiency (random-LTD) settings that this strategy does not use. The gradient reduction and the
        optimizer never read it, so changing it between two steps is safe; it is kept equal to the batch this rank
        gets so that those counters and a checkpoint's config tell the truth.
        """
        self.plan = SplitPlan(tuple(batch_sizes), source="re-plan")
        micro_batch = batch_sizes[self.global_rank]
        if self.config is not None:
            self.config["train_micro_batch_size_per_gpu"] = micro_batch
        if self._deepspeed_engine_ready():
            self.deepspeed_engine.set_train_micro_batch_size(micro_batch)

    def _deepspeed_engine_ready(self) -> bool:
        return self.model is not None and hasattr(self.model, "set_train_micro_batch_size")

    @property
    def replans(self) -> list[dict[str, Any]]:
        """The re-plans of this fit so far, as in the run report: ``{"step", "batch_sizes", "predicted_gain"}``."""
        return [replan.to_dict() for replan in self._follower.replans] if self._follower is not None else []

    def _training_loader(self, trainer: Any) -> Any:
        source = trainer.fit_loop._data_source
        if not source.is_defined():
            return None
        # Requested as Lightning requests it, then handed to the fit loop when it asks: the user's
        # `train_dataloader()` runs once per fit, as under DDP (it may build a random dataset, as BoringModel's does).
        loader = _request_dataloader(source)
        _serve_once(source, loader)
        several = describe_several_training_loaders(loader)
        if several:
            raise ValueError(several)
        loader = only_loader(loader)  # (one loader in a dict or list: the one that is split and profiled)
        if isinstance(loader, DataLoader):
            problem = describe_unsupported_loader(loader, "training loader")
            if problem:
                raise ValueError(problem)
        self._requested_training_loader = loader
        return loader

    def _global_batch_size(self, loader: Any) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.batch_sizes is not None:
            return sum(self.batch_sizes)
        batch_size = loader_batch_size(loader) if isinstance(loader, DataLoader) else None
        if batch_size is None:
            raise ValueError(
                "HeteroStrategy cannot infer the global batch: the training loader is not a DataLoader with a"
                f" `batch_size` (got {type(loader).__name__}). Pass `HeteroStrategy(global_batch_size=...)` or"
                " `batch_sizes=[...]`."
            )
        return batch_size * self.world_size

    def _all_gather_tensor(self, tensor: Tensor) -> list[Tensor]:
        """Every rank's ``tensor`` (the same shape and dtype on every rank), in rank order, on the CPU.

        Gathered on this rank's device: NCCL, the CUDA backend, only moves CUDA tensors (gloo takes either).
        """
        if self.world_size == 1:
            return [tensor]
        local = tensor.to(self.root_device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(gathered, local)
        return [part.cpu() for part in gathered]

    def _gather_counts(self, count: int) -> list[int]:
        """Every rank's sample count for this step of a stream (one small gather per step)."""
        self._before_collective()
        return [int(part.item()) for part in self._all_gather_tensor(torch.tensor([count], dtype=torch.int64))]

    def _all_gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def _report_plan(self, trainer: Any) -> None:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON."""
        assert self.plan is not None and self.config is not None
        log_dir = Path(trainer.log_dir or trainer.default_root_dir) / PLAN_DIRNAME  # log_dir broadcasts: all ranks
        log_dir.mkdir(parents=True, exist_ok=True)
        plan = {
            "source": self.plan.source,
            "global_batch_size": self.plan.global_batch_size,
            "batch_sizes": list(self.plan.batch_sizes),
            "prediction": self.prediction,
            "emulate_speeds": self._speed_schedule.to_json() if self._speed_schedule else None,
            "precisions": self.precisions,
            "communication": self.communication.summary(),
        }
        record = {
            "rank": self.global_rank,
            "device": self.device_facts[self.global_rank].to_dict(),
            "precision": self.precisions[self.global_rank],
            "plan": plan,
            # (a token mean's weight is taken from each batch's token counts)
            "loss_weight": None if self.loss_reduction == "token_mean" else self.plan.loss_weight(
                self.global_rank, self.loss_reduction
            ),
            "loss_reduction": self.loss_reduction,
            "profile": self.profiles[self.global_rank].to_dict() if self.profiles else None,
            "deepspeed_config": self.config,
        }
        (log_dir / f"rank_{self.global_rank}.json").write_text(json.dumps(record, indent=2, default=str))
        if not self.is_global_zero:
            return
        everything = {
            **plan,
            "devices": [facts.to_dict() for facts in self.device_facts],
            "profiles": [profile.to_dict() for profile in self.profiles] if self.profiles else None,
        }
        (log_dir / "plan.json").write_text(json.dumps(everything, indent=2, default=str))
        stage = self.config.get("zero_optimization", {}).get("stage", 0)
        devices = [facts.describe() for facts in self.device_facts]
        table = report.plan_text(self.plan, stage, devices, self.precisions, self.profiles, self.prediction)
        rank_zero_info(f"{table}\n{self.communication.plan_line()}\nwritten to {log_dir}")

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, (HeteroDataLoader, HeteroStreamLoader)):
            return dataloader
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage
        if stage == RunningStage.PREDICTING:
            return dataloader
        training = stage == RunningStage.TRAINING
        name = "training loader" if training else f"{stage.dataloader_prefix if stage else 'evaluation'} loader"

        def rebuild() -> tuple[Union[HeteroDataLoader, HeteroStreamLoader], dict[str, Any]]:
            problem = describe_unsupported_loader(dataloader, name)
            if problem:
                raise ValueError(problem)
            if training:
                assert self.plan is not None
                batch_sizes: Sequence[int] = self.plan.batch_sizes
            else:
                # Evaluation is split as DDP splits it: the loader's batch on every rank, the samples padded to a
                # multiple of the ranks, so that every step gives every rank the same number of samples (a user's
                # `self.all_gather` of predictions needs equal shapes; uneven ones abort inside gloo).
                batch_sizes = [loader_batch_size(dataloader) or 1] * self.world_size
            if is_stream(dataloader):  # each rank takes its micro-batch from its own stream
                # (its counts are taken as each training step begins; see training_step)
                stream = HeteroStreamLoader(
                    dataloader, batch_sizes, self.global_rank, self._gather_counts, lambda: trainer.current_epoch,
                    on_draw=None if training else self._forget_evaluation_counts,
                )  # fmt: skip
                return stream, {"stream_dataset": type(dataloader.dataset).__name__}
            seed = self._data_seed if self._data_seed is not None else local_seed()
            loader = rebuild_loader(
                dataloader,
                batch_sizes,
                self.global_rank,
                seed,
                on_batch=self._on_training_batch if training else self._on_evaluation_batch,
                on_fetch=self._follower.before_fetch if training and self._follower is not None else None,
                pad=not training,
            )
            return loader, describe_order(loader)

        loader, orders = self._gather_or_raise(f"preparing the {name}", rebuild)
        if training and self._follower is not None:
            self._follower.loader = loader
        if training:
            self._training_stream = loader if isinstance(loader, HeteroStreamLoader) else None
        lines = config_disagreements(orders)
        if lines:
            raise ValueError(
                f"HeteroStrategy: the ranks' {name}s differ: " + "; ".join(lines) + ". Every rank must load the same"
                " dataset with the same sampler: the strategy cuts one epoch order into per-rank slices, so different"
                " data would use some samples twice and others never, or make the ranks run different numbers of steps."
            )
        user_sampler = getattr(getattr(loader.hetero_batch_sampler, "sampler", None), "user_sampler", None)
        if training and isinstance(user_sampler, SequentialSampler) and not self._said_order_is_kept:
            self._said_order_is_kept = True
            rank_zero_info(
                "HeteroStrategy keeps the training loader's order: it does not shuffle, so every epoch uses the samples"
                " in the same order (DDP's DistributedSampler would shuffle). Pass `shuffle=True` to the DataLoader to"
                " shuffle."
            )
        return loader

    @property
    def watch(self) -> RunWatch:
        """What every rank did in each training step so far (see :mod:`lightning_hetero.watch.meter`)."""
        return self._watch

    def _on_batch(self, local_samples: int, global_samples: int) -> None:
        self._batch_samples = (local_samples, global_samples)

    def _on_evaluation_batch(self, local_samples: int, global_samples: int) -> None:
        self._eval_batch_samples = (local_samples, global_samples)

    def _forget_evaluation_counts(self) -> None:
        self._eval_batch_samples = None

    def _on_training_batch(self, local_samples: int, global_samples: int) -> None:
        self._on_batch(local_samples, global_samples)
        self._watch.meter.batch_ready(local_samples)

    # ------------------------------------------------------------------ steps

    def current_loss_weight(self) -> float:
        """The loss weight of the batch being trained on (the last global batch may be shorter): ``b_r * W / B``
        for a mean loss, 1 for a summed one, ``n_r * W / N`` in tokens for a token mean (one all-reduce of the
        ranks' token counts per batch)."""
        if self.loss_reduction == "token_mean":
            if self._step_tokens is None:
                raise RuntimeError("HeteroStrategy: the token count of this batch is unknown (no training_step ran).")
            counts = torch.tensor([self._step_tokens], dtype=torch.float64, device=self.root_device)
            if self.world_size > 1:
                self._before_collective()
                torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
            return loss_weight(self._step_tokens, float(counts.item()), self.world_size, self.loss_reduction)
        if self._batch_samples is not None:
            return loss_weight(*self._batch_samples, self.world_size, self.loss_reduction)
        if self.plan is not None:
            return self.plan.loss_weight(self.global_rank, self.loss_reduction)
        return 1.0

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # DeepSpeed averages ranks equally; weighting the loss makes that average the full-batch mean.
        self._nonfinite.loss_computed(closure_loss)
        with self._emulated(), self.communication.counting():
            super().backward(closure_loss * self.current_loss_weight(), optimizer, *args, **kwargs)
        self._watch.meter.backward_ended()
        return closure_loss

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.communication.counting():  # (the closure, training_step and backward, runs inside)
            result = super().optimizer_step(*args, **kwargs)
        self._watch.meter.optimizer_step_ended()
        assert self.lightning_module is not None
        self._nonfinite.step_ended(self.lightning_module.trainer.global_step)  # may stop every rank, together
        return result

    @property
    def skipped_steps(self) -> list[int]:
        """The optimizer steps of this fit skipped for non-finite gradients (global steps)."""
        return list(self._nonfinite.skipped)

    @override
    def on_train_end(self) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary."""
        super().on_train_end()
        steps = self._watch.finish(self._all_gather_tensor)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        directory = Path(trainer.log_dir or trainer.default_root_dir) / PLAN_DIRNAME  # log_dir broadcasts: all ranks
        report.add_rank_wire(directory / f"rank_{self.global_rank}.json", steps, self.global_rank)
        if not self.is_global_zero:
            return
        measuring = self._watch.exchange_seconds + (self._follower.decision_seconds if self._follower else 0.0)
        plugin = self.precision_plugin
        run_report = report.build_report(
            steps,
            self.replans,
            self.world_size,
            exchange_seconds=measuring,
            precision=plugin.summary() if isinstance(plugin, HeteroPrecision) else None,
            communication=self.communication.summary(),
            nonfinite=self._nonfinite.summary(),
        )
        json_path, png_path = report.write_report(run_report, directory)
        rank_zero_info(f"{report.summary_text(run_report)}\nwritten to {json_path} and {png_path.name}")

    def _emulated(self) -> contextlib.AbstractContextManager:
        return self._emulator.slowed() if self._emulator is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _weighted_sync(self, evaluating: bool = False) -> Iterator[None]:
        # An evaluation batch's counts come from its map-style loader as it is handed over; a stream's evaluation
        # batches are read ahead and carry none: their metrics are a plain mean over ranks, as under DDP.
        samples = self._eval_batch_samples if evaluating else self._batch_samples
        self._sync_weight = samples[0] if samples is not None else None
        try:
            yield
        finally:
            self._sync_weight = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._emulator is not None and self._speed_schedule is not None:
            # A drift schedule: the emulated device's speed from this optimizer step on.
            assert self.lightning_module is not None
            self._emulator.speed = self._speed_schedule.at(self.lightning_module.trainer.global_step)[self.global_rank]
        self._step_tokens = None
        if self._training_stream is not None:
            # Lightning drew this batch a step ahead: the step starts, and takes its counts, now.
            if self._follower is not None:
                self._follower.before_fetch()
            self._on_training_batch(*self._training_stream.batch_trained())
        with self._weighted_sync(), self._emulated(), self.communication.counting():
            if self._buffer_sync:  # rank 0's buffers on every rank before the forward, as DDP's broadcast_buffers
                self._before_collective()
                self._buffer_sync.sync()
            output = super().training_step(*args, **kwargs)
        if self.loss_reduction == "token_mean":
            self._step_tokens = token_count(output)  # the weight needs it before backward
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._weighted_sync(evaluating=True):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._weighted_sync(evaluating=True):
            return super().test_step(*args, **kwargs)

    @override
    def reduce(
        self,
        tensor: Any,
        group: Optional[Any] = None,
        reduce_op: Optional[Union[torch.distributed.ReduceOp, str]] = "mean",
    ) -> Any:
        """Inside a step, a "mean" is weighted by each rank's sample count (``self.log(..., sync_dist=True)``).

        Lightning's epoch-level mean divides summed values by summed batch sizes, both averaged over ranks (that part
        only needs the integer average done in floating point); the per-step value is a plain mean over ranks,
        which unequal batches would bias. Outside a step the parent's mean applies.
        """
        self._before_collective()
        is_mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if is_mean and isinstance(tensor, Tensor) and not tensor.is_floating_point():
            # Lightning averages the epoch's summed batch sizes (an integer tensor) across ranks; with unequal
            # shards an integer mean truncates (11 samples on 3 ranks -> 3) and biases every epoch metric. Averaged
            # in torch's default dtype, as DDP's true division does, so the metric divided by it keeps its dtype.
            tensor = tensor.to(torch.get_default_dtype())
        weighted = (
            is_mean
            and self._sync_weight is not None
            and isinstance(tensor, Tensor)
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )
        if not weighted:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        weight = float(self._sync_weight)  # type: ignore[arg-type]
        packed = torch.cat(
            [tensor.detach().double().reshape(-1) * weight, tensor.new_tensor([weight], dtype=torch.float64)]
        )
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM, group=group)
        return (packed[:-1] / packed[-1]).reshape(tensor.shape).to(tensor.dtype)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        self._before_collective()
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._before_collective()
        return super().broadcast(obj, src)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._before_collective()
        super().barrier(*args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say on every rank which rank failed and how (see :mod:`lightning_hetero.recover.failures`); no collective here."""
        super().on_exception(exception)
        exit_code_for(exception)
        if self._stop_on_sigterm is not None and self._stop_on_sigterm.stopped_every_rank(exception):
            self._save_before_exit()
        if not isinstance(exception, Exception) or self.world_size == 1:
            return
        if failures.is_lost_peer_error(exception):
            watchdog = self._watchdog
            if watchdog is not None and watchdog.store_silent_for() > 2 * liveness.HEARTBEAT_SECONDS:
                found, reachable = {}, False  # the heartbeat already waits on the store: do not wait on it here too
            else:
                found, reachable = failures.read_failures(self.world_size, exclude=self.global_rank)
            explanation = failures.lost_peer_explanation(self.global_rank, found, reachable)
            first = exception.args[0] if exception.args else ""
            exception.args = (f"{explanation}\n{first}", *exception.args[1:])
            if not found:  # a peer (or the store's host) is gone without an error of its own: as the watchdog says
                exit_with_if_uncaught(exception, liveness.EXIT_CODE_PEER_LOST)
        else:
            failures.publish_failure(self.global_rank, exception)

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (see :mod:`~.checkpoint`)."""
        target = Path(self.broadcast(str(filepath)))

        def write(directory: Path) -> None:
            # A failed file write is raised after DeepSpeed's save has run its collectives to the end.
            with elastic.DeferredWriteErrors(self.deepspeed_engine) as deferred:
                super(HeteroStrategy, self).save_checkpoint(checkpoint, directory, storage_options)
            deferred.raise_first()
            deferred.write_latest(self.is_global_zero)
            self.communication.save(directory, self.global_rank)  # per-rank error feedback, listed in the manifest

        elastic.save_atomically(
            target,
            write,
            lambda: self._manifest_facts(checkpoint),
            self.is_global_zero,
            self._gather_or_raise,
            self._hold_writer_lock,
        )

    def _hold_writer_lock(self, directory: Path) -> None:
        """Rank 0 saves into ``directory`` for this trainer call only if no other job does (released at teardown)."""
        lock = self._writer_locks.setdefault(directory.resolve(), checkpoint.WriterLock(directory))
        lock.acquire()

    def _manifest_facts(self, saved: dict[str, Any]) -> dict[str, Any]:
        loader = self._follower.loader if self._follower is not None else None
        engine = self.deepspeed_engine
        return {
            "world_size": self.world_size,
            "global_step": saved.get("global_step"),
            "epoch": saved.get("epoch"),
            # Position in the epoch, in global samples (rank-independent: resumable on any number of ranks).
            "global_samples": loader.state_dict()[STATE_SAMPLES_CONSUMED] if loader is not None else None,
            "batch_sizes": list(self.plan.batch_sizes) if self.plan is not None else None,
            "zero_stage": self.config["zero_optimization"]["stage"],
            "optimizer": type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
            "devices": [facts.describe() for facts in self.device_facts],
            "communication": self.communication.checkpoint_facts(),
        }

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            elastic.prune_unless_only(Path(filepath), super().remove_checkpoint)

    def _save_before_exit(self) -> None:
        """A SIGTERM stopped every rank before the same step: save where `fit(ckpt_path="last")` finds it."""
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        path = elastic.interrupt_checkpoint_path(trainer)
        if path is None:
            rank_zero_warn(
                "HeteroStrategy: stopped by SIGTERM without saving: the Trainer has no ModelCheckpoint"
                " (`enable_checkpointing=False`). Add one to resume with `fit(ckpt_path=\"last\")`."
            )
            return
        trainer.save_checkpoint(path)
        rank_zero_info(f"HeteroStrategy: stopped by SIGTERM at step {trainer.global_step}; saved {path}.")

    def _resume_from_lightning_file(self, path: Path) -> dict[str, Any]:
        """Continue from a Lightning checkpoint file another strategy wrote (see :mod:`~.resume_lightning`)."""
        saved = resume_lightning.read_lightning_checkpoint(path)  # every rank reads it: none waits for another
        module, engine = self.lightning_module, self.deepspeed_engine
        assert module is not None
        resume_lightning.load_module_weights(module, saved["state_dict"], strict=module.strict_loading)
        optimizer_states = saved.get("optimizer_states") or []
        if optimizer_states and engine.optimizer is not None and self._optimizer_parameters:
            resume_lightning.load_optimizer_state(
                engine, self._optimizer_parameters, optimizer_states[0], saved["state_dict"]
            )
        elif engine.optimizer is not None:
            rank_zero_warn(f"HeteroStrategy: {path} holds no optimizer state; the optimizer starts afresh.")
        # The training loader is built after the restore: its state goes where Lightning hands it over then.
        loader = self._requested_training_loader
        if isinstance(loader, DataLoader) and not is_stream(loader) and self.plan is not None:
            order = GlobalOrder(loader.batch_sampler.sampler, self._data_seed or 0)  # (what the loader will cut)
            state = resume_lightning.loader_state_for(saved, self.plan.global_batch_size, len(order), order.seed)
            if state is not None:
                saved = resume_lightning.with_loader_state(saved, state)
                if not order.shuffles:
                    rank_zero_warn(
                        f"HeteroStrategy: {path} stopped in the middle of an epoch. DDP shuffled that epoch"
                        " (Lightning's DistributedSampler); this unshuffled loader keeps its own order, so the rest of"
                        " the epoch is not exactly the samples DDP had not used (later epochs are whole). Give the"
                        " loader `shuffle=True` to continue DDP's epoch exactly."
                    )
        rank_zero_info(f"HeteroStrategy: continuing from {path}, a Lightning checkpoint file (weights, optimizer"
                       " state, loops and data position restored).")  # fmt: skip
        self._forget_served_loader()
        return saved

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if Path(checkpoint_path).is_file():  # a .ckpt file another strategy (DDP...) wrote
            return self._resume_from_lightning_file(Path(checkpoint_path))
        # Rank 0 verifies the checkpoint's files against their checksums (once, not on every rank) and the choice, or
        # its error, reaches every rank in one gather.
        _, choices = self._gather_or_raise(
            "choosing the checkpoint to resume from",
            lambda: (None, checkpoint.choose_checkpoint(Path(checkpoint_path)) if self.is_global_zero else None),
        )
        chosen, warning = Path(choices[0][0]), choices[0][1]
        if warning:
            rank_zero_warn(warning)
        # DeepSpeed restores the checkpoint after the strategy's setup, where the training loader was requested:
        # the model or datamodule state it restores may change what `train_dataloader()` returns, so the fit loop
        # asks again, as under DDP.
        self._forget_served_loader()
        manifest = checkpoint.read_manifest(chosen) or {}
        same_world_size = manifest.get("world_size", self.world_size) == self.world_size
        self.communication.load(chosen, self.global_rank, manifest, same_world_size)
        if same_world_size:
            return super().load_checkpoint(str(chosen), *args, **kwargs)
        self._keep_the_checkpoints_global_batch(chosen, manifest)
        if not elastic.needs_universal(manifest, self.world_size):  # ZeRO-0 keeps whole states on every rank
            return super().load_checkpoint(str(chosen), *args, **kwargs)
        elastic.check_convertible(chosen, manifest, self.world_size)
        # Rank 0 converts; its result (or its error) reaches every rank in the one gather.
        _, results = self._gather_or_raise(
            "converting the checkpoint",
            lambda: (None, elastic.convert_to_universal(chosen) if self.is_global_zero else None),
        )
        directory, seconds = results[0]
        how = f"converted to DeepSpeed's universal format in {seconds:.1f} s" if seconds is not None else "using the"
        rank_zero_info(
            f"HeteroStrategy: {chosen} was saved by {manifest['world_size']} ranks; this job has {self.world_size}:"
            f" {how} universal copy in {directory}."
        )
        engine_config = self.deepspeed_engine._config
        engine_config.load_universal_checkpoint = True  # read at load time only; a plain checkpoint needs it off
        try:
            return super().load_checkpoint(str(directory), *args, **kwargs)
        finally:
            engine_config.load_universal_checkpoint = False

    def _keep_the_checkpoints_global_batch(self, path: Path, manifest: dict[str, Any]) -> None:
        """A resume on another number of ranks continues the same optimisation: the checkpoint's global batch.

        The default global batch (the loader's batch size times the ranks) follows the world size, so it is replaced
        by the checkpoint's and the split is planned again for it; one the user fixed must agree.
        """
        assert self.plan is not None
        saved = sum(manifest.get("batch_sizes") or []) or None
        if saved is None or saved == self.plan.global_batch_size:
            return
        if self.global_batch_size is not None or self.batch_sizes is not None:
            raise ValueError(
                f"Checkpoint {path} was trained with a global batch of {saved} samples; this job's is"
                f" {self.plan.global_batch_size}. Pass `global_batch_size={saved}` to continue the same optimisation"
                " (the split over this job's ranks is planned for it)."
            )
        plan, self.prediction = self._decide_split(saved)
        self._use_split(plan.batch_sizes)
        self.plan = plan
        self._follower = SplitFollower(self._watch, self._all_gather_tensor, self._make_rebalancer(), self._use_split)
        rank_zero_info(
            f"HeteroStrategy: keeping the checkpoint's global batch of {saved} on {self.world_size} ranks:"
            f" micro-batches {list(plan.batch_sizes)}."
        )

    @override
    def teardown(self) -> None:
        if isinstance(self.precision_plugin, HeteroPrecision):
            self.precision_plugin.detach()
        self.communication.detach()
        self._nonfinite.detach()
        self._buffer_sync = None
        self._forward_redirection = self._plain_redirection
        for lock in self._writer_locks.values():
            lock.release()
        self._writer_locks.clear()
        if self._watchdog is not None:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            self._watchdog.stop(finished=trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED)
            self._watchdog = None
        # A fit that failed before its loop asked for the training loader must not hand it to the next fit.
        self._forget_served_loader()
        super().teardown()

    def _forget_served_loader(self) -> None:
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            self.lightning_module.trainer.fit_loop._data_source.__dict__.pop("dataloader", None)

    def _before_collective(self) -> None:
        # An emulated slow rank reaches a collective (e.g. a `self.log(..., sync_dist=True)` inside training_step)
        # only after its stretched compute, as a slower device would; paying later would let its peers run ahead.
        if self._emulator is not None:
            self._emulator.catch_up()


def _serve_once(source: Any, loader: Any) -> None:
    """Make the next ``source.dataloader()`` return ``loader`` instead of calling the user's hook again."""

    def dataloader() -> Any:
        del source.dataloader  # back to the hook, for `reload_dataloaders_every_n_epochs`
        return loader

    source.dataloader = dataloader
