"""Settings: every argument and environment variable of a run, checked once, and the check that the ranks agree.

:meth:`HeteroSettings.from_arguments` runs in ``HeteroStrategy.__init__`` (no world size, no process group yet: a
mistake fails in the constructor); :meth:`HeteroSettings.check_job` runs at setup on every rank before any
collective, once the world size and the devices are known; :meth:`HeteroSettings.agreement` is what the ranks
gather and compare (:func:`check_ranks_agree`) before anything depends on them. Each check is a pure function of the
stage it belongs to; this module only says when each runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_hetero.comm import compression, topology
from lightning_hetero.comm.compression import CompressionChoice
from lightning_hetero.configure.deepspeed_config import check_user_config, raise_if_arguments_differ, user_config_stage
from lightning_hetero.configure.lr_scaling import check_lr_scaling
from lightning_hetero.configure.model_agreement import model_disagreement
from lightning_hetero.emulate import memory
from lightning_hetero.emulate.emulation import check_slowdown
from lightning_hetero.emulate.slowdown import ENV_VAR as EMULATE_ENV_VAR
from lightning_hetero.emulate.slowdown import SpeedSchedule, emulated_speeds
from lightning_hetero.local.inner_steps import (
    LOCAL_MODES,
    check_inner_steps_length,
    check_sync_arguments,
    sync_asynchronous,
    sync_eager,
    sync_fragments,
    sync_overlap,
    sync_refusal,
)
from lightning_hetero.pipeline.options import (
    PipelineChoice,
    check_pipeline_argument,
    check_pipeline_config,
    pipeline_argument_refusal,
)
from lightning_hetero.precision import choice as precision
from lightning_hetero.precision.nonfinite import check_max_nonfinite_steps
from lightning_hetero.recover import liveness
from lightning_hetero.runtime.checks import check_loss_reduction, check_one_per_rank, check_stage
from lightning_hetero.split.decisions.micro_steps import micro_steps_refusal
from lightning_hetero.split.decisions.replan import check_rebalance_arguments
from lightning_hetero.split.decisions.split import check_split_arguments, resolve_split
from lightning_hetero.train.loaders import loader_batch_size
from lightning_hetero.train.optimizer_shards import (
    check_shards,
    check_shards_config,
    default_shards,
    shards_refusal,
)
from lightning_hetero.watch.trace import check_trace

# Arguments of DeepSpeedStrategy that only build its default DeepSpeed config: a user config replaces them all.
DEFAULT_CONFIG_ARGUMENTS = frozenset(
    {
        "zero_optimization",
        "offload_optimizer",
        "offload_parameters",
        "offload_params_device",
        "nvme_path",
        "params_buffer_count",
        "params_buffer_size",
        "max_in_cpu",
        "offload_optimizer_device",
        "optimizer_buffer_count",
        "block_size",
        "queue_depth",
        "single_submit",
        "overlap_events",
        "thread_count",
        "pin_memory",
        "sub_group_size",
        "contiguous_gradients",
        "overlap_comm",
        "allgather_partitions",
        "reduce_scatter",
        "allgather_bucket_size",
        "reduce_bucket_size",
        "zero_allow_untested_optimizer",
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
    }
)


@dataclass(frozen=True)
class HeteroSettings:
    """The strategy's arguments, checked (see ``HeteroStrategy``'s docstring for what each means)."""

    stage: Optional[int]
    global_batch_size: Optional[int]
    batch_sizes: Optional[tuple[int, ...]]
    weights: Optional[tuple[float, ...]]
    micro_steps: Optional[tuple[int, ...]]
    loss_reduction: str
    rebalance: Optional[bool]
    rebalance_window: int
    rebalance_threshold: float
    peer_timeout: Optional[float]
    device_precision: precision.DevicePrecision
    compression: CompressionChoice
    hierarchical: Union[str, bool]
    max_nonfinite_steps: Optional[int]
    speed_schedule: Optional[SpeedSchedule]  # emulated speeds (the argument, else the environment variable)
    sync: str = "every_step"  # local SGD / DiLoCo (local/inner_steps.py)
    sync_every: int = 1
    inner_steps: Optional[tuple[int, ...]] = None
    outer: Optional[dict[str, Any]] = None  # DiLoCo's outer optimizer settings
    fragments: int = 1  # the streaming merge: fragments of the parameters merged in turn
    overlap: Optional[int] = None  # merges sent in the background, applied this many training steps later
    eager: bool = True  # overlap: each rank trains on from its own progress's outer step until the average arrives
    asynchronous: bool = False  # merges by speed: each rank trains what it has time for (local/claims.py)
    pipeline: Optional[PipelineChoice] = None  # the model split into stages (pipeline/stage.py)
    lr_scaling: Optional[str] = None  # a resume on another global batch scales the lr (configure/lr_scaling.py)
    trace: Optional[tuple[int, ...]] = None  # the training steps a profiler trace records (watch/trace.py)
    emulate_slowdown: str = "compute"  # how an emulated slower rank is slower (emulate/emulation.py)
    shards: str = "equal"  # a pipeline's `stage=1` optimizer shards: sized by memory, or equal (optimizer_shards.py)

    @classmethod
    def from_arguments(
        cls,
        *,
        stage: Optional[int],
        global_batch_size: Optional[int],
        batch_sizes: Optional[Sequence[int]],
        weights: Optional[Sequence[float]],
        micro_steps: Optional[Sequence[int]],
        emulate_speeds: Any,
        loss_reduction: str,
        rebalance: Optional[bool],
        rebalance_window: int,
        rebalance_threshold: float,
        peer_timeout: Optional[float],
        device_precision: Any,
        compression_mode: Any,
        compression_options: Any,
        hierarchical: Any,
        max_nonfinite_steps: Optional[int],
        sync: str = "every_step",
        sync_every: int = 1,
        inner_steps: Optional[Sequence[int]] = None,
        sync_options: Optional[dict[str, Any]] = None,
        pipeline: Any = None,
        lr_scaling: Optional[str] = None,
        trace: Any = None,
        emulate_slowdown: Any = None,
        shards: Any = None,
    ) -> HeteroSettings:
        """Every argument checked, each error naming the argument, its value and the fix (keyword-only: twenty
        arguments, two of which swapped would otherwise pass unnoticed)."""
        schedule, both_given = emulated_speeds(emulate_speeds)
        if both_given:
            rank_zero_warn(both_given)
        if stage is not None:
            check_stage(stage)
        check_loss_reduction(loss_reduction)
        check_split_arguments(global_batch_size, batch_sizes, weights, micro_steps)
        check_rebalance_arguments(rebalance, rebalance_window, rebalance_threshold)
        liveness.check_peer_timeout(peer_timeout)
        check_max_nonfinite_steps(max_nonfinite_steps)
        outer = check_sync_arguments(sync, sync_every, inner_steps, sync_options, rebalance)
        # What the arguments alone refuse (the stage a user config sets, precisions and the module are checked at
        # setup, in the survey).
        refusal = sync_refusal(
            sync,
            stage if stage is not None else 0,
            compression.check_compression(compression_mode, compression_options).mode,
            [],
            micro_steps,
            weights,
            global_batch_size,
            hierarchical,
            automatic_optimization=True,
        )
        if refusal:
            raise ValueError(refusal)
        pipeline_choice = check_pipeline_argument(pipeline)
        compression_choice = compression.check_compression(compression_mode, compression_options)
        exchange = (
            f"compression={compression_mode!r}"
            if compression_choice.mode is not None
            else ("hierarchical=True" if hierarchical is True else None)
        )
        refusal = shards_refusal(
            check_shards(shards), stage, pipeline_choice is not None, local=sync in LOCAL_MODES, exchange=exchange
        )
        if refusal is None and shards == "memory" and pipeline_choice is None and device_precision is not None:
            refusal = (
                "HeteroStrategy(shards='memory', device_precision=...): memory-sized shards train in 32-bit on every"
                " rank for now. Leave out `device_precision`, or `shards`."
            )
        if refusal:
            raise ValueError(refusal)
        if pipeline_choice is not None and pipeline_choice.schedule == "interleaved" and rebalance:
            raise ValueError(
                "HeteroStrategy(pipeline={'schedule': 'interleaved', ...}, rebalance=True): blocks do not move between"
                " the chunks of an interleaved pipeline yet; they stay where they were placed. Leave out `rebalance`,"
                " or use `schedule='1f1b'`."
            )
        if pipeline_choice is not None:
            refusal = pipeline_argument_refusal(
                stage=stage,
                sync=sync,
                batch_sizes=batch_sizes,
                weights=weights,
                micro_steps=micro_steps,
                loss_reduction=loss_reduction,
                compression=compression_mode,
                hierarchical=hierarchical,
                device_precision=device_precision,
                rebalance=rebalance,
            )
            if refusal:
                raise ValueError(refusal)
        return cls(
            stage=stage,
            global_batch_size=global_batch_size,
            batch_sizes=tuple(batch_sizes) if batch_sizes is not None else None,
            weights=tuple(weights) if weights is not None else None,
            micro_steps=tuple(int(k) for k in micro_steps) if micro_steps is not None else None,
            loss_reduction=loss_reduction,
            rebalance=rebalance,
            rebalance_window=int(rebalance_window),
            rebalance_threshold=float(rebalance_threshold),
            peer_timeout=None if peer_timeout is None else float(peer_timeout),
            device_precision=precision.check_device_precision(device_precision),
            compression=compression.check_compression(compression_mode, compression_options),
            hierarchical=topology.check_hierarchical(hierarchical),
            max_nonfinite_steps=max_nonfinite_steps,
            speed_schedule=schedule,
            sync=sync,
            sync_every=int(sync_every),
            inner_steps=tuple(int(k) for k in inner_steps) if inner_steps is not None else None,
            outer=outer,
            fragments=sync_fragments(sync_options, int(sync_every)) if sync in LOCAL_MODES else 1,
            overlap=sync_overlap(sync_options, int(sync_every)) if sync in LOCAL_MODES else None,
            eager=sync_eager(sync_options),
            asynchronous=sync in LOCAL_MODES and sync_asynchronous(sync_options, inner_steps, rebalance, batch_sizes),
            pipeline=pipeline_choice,
            lr_scaling=check_lr_scaling(lr_scaling, sync, pipeline_choice),
            trace=check_trace(trace, pipeline_choice),
            emulate_slowdown=check_slowdown(emulate_slowdown),
            shards=default_shards(shards, stage, pipeline_choice is not None),
        )

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the DeepSpeed config starts with: the one given; else 0 for local SGD / DiLoCo (each rank
        keeps its whole optimizer state) and for a hooked exchange (compression hooks, ``hierarchical=True``: ZeRO-0
        only); else the lowest stage :meth:`automatic_stages` allows, until setup chooses among them."""
        if self.pipeline is not None:
            return 0  # (each stage's engine runs ZeRO-0; with `stage=1` the pipeline shards the optimizer state itself)
        if self.shards_by_memory:
            return 0  # (the package shards the optimizer state itself: split/optimizer_shards.py)
        if self.stage is not None:
            return self.stage
        if self.local or self._needs_stage_0 or self.pipeline is not None:
            return 0
        stages = self.automatic_stages({})
        assert stages is not None  # (no stage, local training, hook or pipeline settles it: checked above)
        return stages[0]

    @property
    def shards_by_memory(self) -> bool:
        """Data-parallel training whose optimizer state the package shards by memory (``stage=1 or 2,
        shards="memory"``): DeepSpeed's engine runs ZeRO-0 and :mod:`lightning_hetero.split.optimizer_shards`
        reduces each gradient to its owner."""
        return self.shards == "memory" and self.pipeline is None and not self.local

    @property
    def _needs_stage_0(self) -> bool:
        return self.compression.needs_hook or self.hierarchical is True

    def automatic_stages(self, deepspeed_arguments: dict[str, Any]) -> Optional[tuple[int, ...]]:
        """The stages setup chooses among when the user named none (:mod:`~lightning_hetero.configure.zero_stage`: the
        lowest that fits), or None when the stage is settled: given, set by a DeepSpeed config, or implied (local
        training, a hooked exchange, `zero_optimization=False`). Offloading names its stages: the optimizer state
        from ZeRO-2, the parameters at ZeRO-3; unequal `micro_steps` rule out ZeRO-3."""
        if self.stage is not None or self.local or self._needs_stage_0 or self.pipeline is not None:
            return None  # (`shards="memory"` needs a given stage: shards_refusal)
        if deepspeed_arguments.get("zero_optimization") is False:
            return None
        if deepspeed_arguments.get("offload_parameters"):
            return (3,)
        stages: tuple[int, ...] = (2, 3) if deepspeed_arguments.get("offload_optimizer") else (0, 1, 2, 3)
        if self.micro_steps is not None and len(set(self.micro_steps)) > 1:
            stages = tuple(stage for stage in stages if stage < 3) or stages  # (ZeRO-3 offload: refused at setup)
        return stages

    @property
    def local(self) -> bool:
        """Local SGD or DiLoCo: ranks train on their own between synchronizations."""
        return self.sync in LOCAL_MODES

    @property
    def profiles_needed(self) -> bool:
        """Every rank profiles its step: the automatic split, or the inner steps of local training unless given."""
        if self.pipeline is not None:  # (the blocks are measured instead: pipeline/stage.py)
            return False
        return self.split_is_automatic and not (self.local and (self.inner_steps is not None or self.asynchronous))

    @property
    def split_is_automatic(self) -> bool:
        """Neither ``batch_sizes`` nor ``weights``: every rank profiles its step and the planner splits."""
        return self.batch_sizes is None and self.weights is None

    @property
    def fixed_split_is_unequal(self) -> bool:
        """A split the user fixed whose ranks' micro-batches differ (``batch_sizes``, ``weights`` or ``micro_steps``
        not all equal): there a mean and a summed loss train differently."""
        given = self.batch_sizes if self.batch_sizes is not None else self.weights
        if given is None:
            return False
        return len(set(given)) > 1 or (self.micro_steps is not None and len(set(self.micro_steps)) > 1)

    def rebalancing(self, profiled: bool, world_size: int) -> bool:
        """Re-plan the split during the fit: on for the automatic split unless off, off for a fixed one unless on."""
        wanted = self.rebalance if self.rebalance is not None else profiled
        return wanted and world_size > 1 and not self.local and self.pipeline is None

    def settle_stage(self, config: dict[str, Any]) -> Optional[str]:
        """Write the ZeRO stage a user's DeepSpeed config runs at into ``config`` (the strategy's own copy: the user's
        dict stays as given); returns the warning to show when ``stage`` loses to the config's. A config without a
        stage is ZeRO-0, as DeepSpeed reads it (not the default stage)."""
        zero = config.setdefault("zero_optimization", {})
        # (a pipeline's engines run ZeRO-0 whatever `stage` says: its `stage=1` shards the optimizer state itself)
        if self.shards_by_memory and zero.get("stage", 0) != 0:
            raise ValueError(
                f"HeteroStrategy(shards='memory', config=...): the DeepSpeed config sets zero_optimization.stage"
                f"={zero['stage']}, but memory-sized shards are the package's own, on DeepSpeed's ZeRO-0 engine. Leave"
                f" the stage out of the config (`stage={self.stage}` says it), or leave out `shards`."
            )
        zero["stage"], stage_warning = user_config_stage(
            zero.get("stage"), self.zero_stage if self.pipeline or self.shards_by_memory else self.stage
        )
        return stage_warning

    def reconcile_user_config(self, config: dict[str, Any], deepspeed_arguments: dict[str, Any]) -> None:
        """A user's DeepSpeed config: checked, its stage settled, and the arguments it replaces said."""
        check_user_config(config)
        stage_warning = self.settle_stage(config)
        zero = config["zero_optimization"]
        if stage_warning:
            rank_zero_warn(stage_warning)
        if zero["stage"] in (0, 1) and zero.get("overlap_comm"):
            rank_zero_warn(
                f"HeteroStrategy: the DeepSpeed config's `zero_optimization.overlap_comm=True` is switched off for"
                f" ZeRO-{zero['stage']}: Lightning's loop owns gradient accumulation, and DeepSpeed allows overlap_comm"
                " there only with ZeRO-2 and 3 (ZeRO-0/1 reduce once per optimizer step either way)."
            )
        ignored = sorted(DEFAULT_CONFIG_ARGUMENTS & deepspeed_arguments.keys())
        if ignored:
            rank_zero_warn(
                f"HeteroStrategy: a DeepSpeed `config` was given, so these arguments are ignored: {ignored}."
                " Put those settings into the config instead."
            )
        precision.check_config_precision(self.device_precision, config)
        compression.check_config_compression(self.compression, config)

    def settle_config(
        self, config: dict[str, Any], deepspeed_arguments: dict[str, Any], user_config: bool
    ) -> Optional[tuple[int, ...]]:
        """The DeepSpeed config the parent built (a user's, checked and its stage settled) against the arguments;
        returns the ZeRO stages setup chooses among (:meth:`automatic_stages`), None when the stage is settled."""
        if user_config:
            self.reconcile_user_config(config, deepspeed_arguments)
        if self.pipeline is not None:
            check_pipeline_config(config)
        if self.shards_by_memory:
            check_shards_config(config, self.stage)
        compression.check_exchange(self.compression, self.hierarchical, config["zero_optimization"]["stage"], config)
        return None if user_config else self.automatic_stages(deepspeed_arguments)

    def check_job(
        self,
        world_size: int,
        device_type: str,
        config: dict[str, Any],
        sync_batchnorm: bool,
        trainer_precision: Optional[tuple[str, str]],
    ) -> None:
        """What needs the world size and the device, before the process group exists: every rank raises the same
        error and none waits in a collective for another. ``trainer_precision``: the Trainer's precision and its
        plugin's class name (None when the plugin is already the strategy's own, from an earlier trainer call)."""
        known_global_batch = self.global_batch_size
        if known_global_batch is None and self.batch_sizes is not None:
            known_global_batch = self.fixed_global_batch_size()
        # With the global batch unknown until the loader is read, only the length of `micro_steps` is checked here.
        steps = self.micro_steps if known_global_batch is not None else None
        if steps is None and self.micro_steps is not None and len(self.micro_steps) != world_size:
            steps = self.micro_steps
        resolve_split(world_size, known_global_batch or world_size, self.batch_sizes, self.weights, steps)
        refusal = micro_steps_refusal(
            self.micro_steps,
            config["zero_optimization"]["stage"],
            self.loss_reduction,
            automatic_optimization=True,
            sync_batchnorm=sync_batchnorm,
        )
        if refusal:
            raise ValueError(refusal)
        memory.check_ceilings(memory.emulated_ceilings_from_environment(), world_size)
        check_inner_steps_length(self.inner_steps, world_size)
        precision.check_rank_count(self.device_precision, world_size)
        compression.check_zero_plus_plus(config, device_type)
        if trainer_precision is not None:
            precision.check_trainer_precision(self.device_precision, *trainer_precision)
        if self.speed_schedule is not None:
            check_one_per_rank(
                f"`emulate_speeds={self.speed_schedule.to_json()}` (or {EMULATE_ENV_VAR})",
                self.speed_schedule.world_size,
                world_size,
                "Give one speed per rank.",
            )
        if sync_batchnorm and self.local:
            raise ValueError(
                f"`Trainer(sync_batchnorm=True)` with `sync={self.sync!r}`: between two merges each rank trains its own"
                " model, with its own number of inner steps, so there is no global batch to normalize over. Remove"
                " `sync_batchnorm=True` (each rank's BatchNorm then normalizes over its own micro-batches), or train"
                " with `sync='every_step'`."
            )

    def check_fit(
        self,
        *,
        zero_stage: int,
        precision: str,
        automatic_optimization: bool,
        sync_batchnorm: bool,
        accumulate_grad_batches: int,
    ) -> None:
        """What a fit refuses once the module, the trainer and this rank's precision are known: at setup, inside the
        survey's gather, so a refusal on one rank is raised on every rank. The same checks as the constructor's and
        :meth:`check_job`'s, with what those could not know yet (the module's optimization, the stage a config set,
        the rank's precision)."""
        refusal = micro_steps_refusal(
            self.micro_steps, zero_stage, self.loss_reduction, automatic_optimization, sync_batchnorm
        )
        if refusal:
            raise ValueError(refusal)
        if not self.local:
            return
        if accumulate_grad_batches > 1:
            raise ValueError(
                f"`Trainer(accumulate_grad_batches={accumulate_grad_batches})` with `sync={self.sync!r}`: each rank"
                " steps its own optimizer on every micro-batch. Raise `sync_every` (fewer synchronizations) or the"
                " batch size instead."
            )
        refusal = sync_refusal(
            self.sync,
            zero_stage,
            self.compression.mode,
            [precision],
            self.micro_steps,
            self.weights,
            self.global_batch_size,
            self.hierarchical,
            automatic_optimization,
        )
        if refusal:
            raise ValueError(refusal)

    def global_batch_size_for(self, loader: Any, world_size: int) -> int:
        """The argument, else the sum of ``batch_sizes``, else what DDP would use: the loader's batch per rank (per
        pipeline with ``pipeline``: every stage of one takes the same samples)."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        if self.batch_sizes is not None:
            return self.fixed_global_batch_size()
        batch_size = loader_batch_size(loader) if isinstance(loader, DataLoader) else None
        if batch_size is None:
            raise ValueError(
                "HeteroStrategy cannot infer the global batch: the training loader is not a DataLoader with a"
                f" `batch_size` (got {type(loader).__name__}). Pass `HeteroStrategy(global_batch_size=...)` or"
                " `batch_sizes=[...]`."
            )
        if self.pipeline is not None and world_size % self.pipeline.stages == 0:
            return batch_size * (world_size // self.pipeline.stages)  # the loader's batch per pipeline
        return batch_size * world_size

    def fixed_global_batch_size(self) -> int:
        """The global batch ``batch_sizes`` (with ``micro_steps``) make: the sum of ``b_r * k_r``."""
        assert self.batch_sizes is not None
        steps = self.micro_steps or (1,) * len(self.batch_sizes)
        return sum(b * k for b, k in zip(self.batch_sizes, steps))

    def agreement(
        self,
        global_batch_size: Optional[int],
        communication_arguments: dict[str, Any],
        emulated_topology: tuple[Optional[int], Optional[topology.SlowLink]],
    ) -> dict[str, Any]:
        """What every rank must have been given alike, as JSON."""
        return {
            "global_batch_size": global_batch_size,
            "batch_sizes": list(self.batch_sizes) if self.batch_sizes is not None else None,
            "weights": list(self.weights) if self.weights is not None else None,
            "micro_steps": list(self.micro_steps) if self.micro_steps is not None else None,
            "sync": [
                self.sync,
                self.sync_every,
                [*(self.inner_steps or [])],
                self.outer,
                self.fragments,
                self.overlap,
                self.eager,
                self.asynchronous,
            ],
            "emulate_memory": memory.emulated_ceilings_from_environment(),
            "emulate_memory_bytes": memory.emulated_byte_ceilings_from_environment(),
            "emulate_speeds": self.speed_schedule.to_json() if self.speed_schedule else None,
            "emulate_slowdown": self.emulate_slowdown,
            "loss_reduction": self.loss_reduction,
            "rebalance": [self.rebalance, self.rebalance_window, self.rebalance_threshold],
            "lr_scaling": self.lr_scaling,
            "trace": list(self.trace or []),
            "peer_timeout": self.peer_timeout,
            "max_nonfinite_steps": self.max_nonfinite_steps,
            "device_precision": self.device_precision,
            **communication_arguments,
            "emulate_nodes": emulated_topology[0],
            "emulate_link": str(emulated_topology[1]),
        }


def check_ranks_agree(agreements: list[dict[str, Any]], models: list[Any]) -> None:
    """Every rank was given the same arguments and builds the same model; else every rank raises, naming who differs."""
    raise_if_arguments_differ(agreements)
    different_models = model_disagreement(models)
    if different_models:
        raise ValueError(different_models)
