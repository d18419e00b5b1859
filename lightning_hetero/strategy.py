"""HeteroStrategy: Lightning's DeepSpeedStrategy with a per-rank micro-batch, on CPU and CUDA.

Thin orchestration: the split comes from :mod:`lightning_hetero.plan`, each rank's DeepSpeed config from
:mod:`lightning_hetero.configure`, the data order from :mod:`lightning_hetero.data`. What this class adds to the
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
from typing import Any, Optional, Union

import torch
import torch.distributed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_hetero.configure import (
    check_user_config,
    config_disagreements,
    disagreement_message,
    format_plan_table,
    rank_config,
)
from lightning_hetero.data import HeteroDataLoader, describe_unsupported_loader, loader_batch_size, rebuild_loader
from lightning_hetero.plan import SplitPlan, check_split_arguments, loss_weight, resolve_split, split_by_weights

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


class HeteroStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO data parallelism where every rank has its own micro-batch.

    Args:
        stage: ZeRO stage 0-3 (default 2). With a ``config`` dict the config's ``zero_optimization.stage`` wins;
            ``stage`` only fills it in when the config leaves it unset.
        global_batch_size: samples per step across all ranks. Default: the training loader's ``batch_size`` times
            the world size (what DDP would use), or the sum of ``batch_sizes``.
        batch_sizes: each rank's micro-batch, in global rank order; they sum to the global batch.
        weights: relative capability per rank; the global batch is split in proportion (each rank >= 1 sample).
        config: a DeepSpeed config dict or JSON path, as for :class:`DeepSpeedStrategy`. It must not set the
            micro-batch, the train batch or ``gradient_accumulation_steps``; the strategy owns them.
        **kwargs: any other :class:`DeepSpeedStrategy` argument. Those that only build the default DeepSpeed config
            are ignored, with a warning, when ``config`` is given.

    With neither ``batch_sizes`` nor ``weights`` the global batch is split equally.
    """

    strategy_name = "hetero"

    def __init__(
        self,
        stage: Optional[int] = None,
        global_batch_size: Optional[int] = None,
        batch_sizes: Optional[Sequence[int]] = None,
        weights: Optional[Sequence[float]] = None,
        config: Optional[Union[_PATH, dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            raise ValueError(f"`stage={stage!r}` is not a ZeRO stage. Use 0, 1, 2 or 3 (default {DEFAULT_STAGE}).")
        check_split_arguments(global_batch_size, batch_sizes, weights)
        super().__init__(stage=DEFAULT_STAGE if stage is None else stage, config=config, **kwargs)
        self.global_batch_size = global_batch_size
        self.batch_sizes = list(batch_sizes) if batch_sizes is not None else None
        self.weights = list(weights) if weights is not None else None
        if config is not None or self.DEEPSPEED_ENV_VAR in os.environ:
            self._reconcile_user_config(stage, kwargs)

        # Formatting adds keys (gradient_accumulation_steps...) that the parent refuses to see twice; each
        # trainer call (validate, then fit) formats a fresh copy of what the user gave.
        self._base_config = copy.deepcopy(self.config)
        self.plan: Optional[SplitPlan] = None
        self._user_use_distributed_sampler: Optional[bool] = None
        # (local, global) sample counts of the batch the loop is working on, told by the HeteroDataLoader.
        self._batch_samples: Optional[tuple[int, int]] = None
        self._sync_weight: Optional[int] = None

    def _reconcile_user_config(self, stage: Optional[int], kwargs: dict[str, Any]) -> None:
        assert self.config is not None
        check_user_config(self.config)
        zero = self.config.setdefault("zero_optimization", {})
        config_stage = zero.get("stage")
        if config_stage is None:
            zero["stage"] = DEFAULT_STAGE if stage is None else stage
        elif stage is not None and stage != config_stage:
            rank_zero_warn(f"HeteroStrategy: the DeepSpeed config's `zero_optimization.stage={config_stage}` wins over `stage={stage}`.")
        ignored = sorted(_DEFAULT_CONFIG_ARGUMENTS & kwargs.keys())
        if kwargs.get("logging_batch_size_per_gpu", "auto") != "auto":
            ignored.append("logging_batch_size_per_gpu")
        if ignored:
            rank_zero_warn(
                f"HeteroStrategy: a DeepSpeed `config` was given, so these arguments are ignored: {ignored}."
                " Put those settings into the config instead."
            )

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
        if self.root_device.type == "cpu":
            # DeepSpeed takes `root_device.index` as its device rank and Lightning checks that the indices count
            # 0..n-1; CPU devices carry no index, so give them one (torch ignores it for tensors).
            assert self.parallel_devices is not None
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
        self._take_over_distributed_sampling()
        # Skip DeepSpeedStrategy.setup_environment: its only addition is refusing every accelerator but CUDA.
        DDPStrategy.setup_environment(self)

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
    def _init_config_if_needed(self) -> None:
        # The parent formats once per strategy; the micro-batch depends on the trainer call (fit or not).
        self._format_config()
        self._config_initialized = True

    @override
    def _format_config(self) -> None:
        assert self.lightning_module is not None
        self.config = copy.deepcopy(self._base_config)
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.plan = self._resolve_plan(trainer)
        micro_batch = self.plan.batch_sizes[self.global_rank] if self.plan is not None else 1
        self.config["train_micro_batch_size_per_gpu"] = micro_batch
        super()._format_config()
        self.config = rank_config(self.config, micro_batch)
        devices = self._agree_on_config()
        if fitting and self.plan is not None:
            self._report_plan(trainer, devices)

    def _resolve_plan(self, trainer: Any) -> SplitPlan:
        global_batch_size = self.global_batch_size
        if global_batch_size is None and self.batch_sizes is not None:
            global_batch_size = sum(self.batch_sizes)
        if global_batch_size is None:
            global_batch_size = self._global_batch_from_loader(trainer)
        return resolve_split(self.world_size, global_batch_size, self.batch_sizes, self.weights)

    def _global_batch_from_loader(self, trainer: Any) -> int:
        source = trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        if isinstance(loader, DataLoader):
            problem = describe_unsupported_loader(loader, "training loader")
            if problem:
                raise ValueError(problem)
        batch_size = loader_batch_size(loader) if isinstance(loader, DataLoader) else None
        if batch_size is None:
            raise ValueError(
                "HeteroStrategy cannot infer the global batch: the training loader is not a DataLoader with a"
                f" `batch_size` (got {type(loader).__name__}). Pass `HeteroStrategy(global_batch_size=...)` or"
                " `batch_sizes=[...]`."
            )
        return batch_size * self.world_size

    def _agree_on_config(self) -> list[str]:
        """Gather every rank's config and device; raise on every rank if a shared setting differs."""
        assert self.config is not None
        mine = {"config": self.config, "device": _describe_device(self.root_device)}
        if self.world_size == 1:
            return [mine["device"]]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, mine)
        lines = config_disagreements([entry["config"] for entry in gathered])
        if lines:
            raise ValueError(disagreement_message(lines))
        return [entry["device"] for entry in gathered]

    def _report_plan(self, trainer: Any, devices: list[str]) -> None:
        assert self.plan is not None and self.config is not None
        rows = [
            {"rank": rank, "device": device, "micro_batch": size, "share": f"{share:.1%}"}
            for rank, (device, size, share) in enumerate(zip(devices, self.plan.batch_sizes, self.plan.shares()))
        ]
        log_dir = Path(trainer.log_dir or trainer.default_root_dir) / PLAN_DIRNAME  # log_dir broadcasts: all ranks
        log_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": self.global_rank,
            "device": devices[self.global_rank],
            "plan": {"source": self.plan.source, "global_batch_size": self.plan.global_batch_size, "batch_sizes": list(self.plan.batch_sizes)},
            "loss_weight": self.plan.loss_weight(self.global_rank),
            "deepspeed_config": self.config,
        }
        (log_dir / f"rank_{self.global_rank}.json").write_text(json.dumps(record, indent=2, default=str))
        table = format_plan_table(
            rows, [("rank", "rank"), ("device", "device"), ("micro_batch", "micro-batch"), ("share", "share")]
        )
        rank_zero_info(
            f"HeteroStrategy plan ({self.plan.source}): global batch {self.plan.global_batch_size},"
            f" ZeRO stage {self.config.get('zero_optimization', {}).get('stage', 0)}\n{table}\nwritten to {log_dir}"
        )

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader, HeteroDataLoader):
            return dataloader
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage
        if stage == RunningStage.PREDICTING:
            return dataloader
        training = stage == RunningStage.TRAINING
        name = "training loader" if training else f"{stage.dataloader_prefix if stage else 'evaluation'} loader"
        problem = describe_unsupported_loader(dataloader, name)
        if problem:
            raise ValueError(problem)
        if training:
            assert self.plan is not None
            batch_sizes: Sequence[int] = self.plan.batch_sizes
        else:
            # Evaluation: the DDP-sized global batch, split in the training proportions so steps take as long.
            global_batch = (loader_batch_size(dataloader) or 1) * self.world_size
            batch_sizes = split_by_weights(global_batch, self._split_weights())
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return rebuild_loader(dataloader, batch_sizes, self.global_rank, seed, on_batch=self._on_batch)

    def _split_weights(self) -> Sequence[float]:
        if self.plan is not None:
            return self.plan.batch_sizes
        return self.batch_sizes or self.weights or [1.0] * self.world_size

    def _on_batch(self, local_samples: int, global_samples: int) -> None:
        self._batch_samples = (local_samples, global_samples)

    # ------------------------------------------------------------------ steps

    def current_loss_weight(self) -> float:
        """``b_r * W / B`` for the batch being trained on (the last global batch may be shorter)."""
        if self._batch_samples is not None:
            return loss_weight(*self._batch_samples, self.world_size)
        if self.plan is not None:
            return self.plan.loss_weight(self.global_rank)
        return 1.0

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # DeepSpeed averages ranks equally; weighting the loss makes that average the full-batch mean.
        super().backward(closure_loss * self.current_loss_weight(), optimizer, *args, **kwargs)
        return closure_loss

    @contextlib.contextmanager
    def _weighted_sync(self) -> Iterator[None]:
        self._sync_weight = self._batch_samples[0] if self._batch_samples is not None else None
        try:
            yield
        finally:
            self._sync_weight = None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._weighted_sync():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._weighted_sync():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._weighted_sync():
            return super().test_step(*args, **kwargs)

    @override
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[torch.distributed.ReduceOp, str]] = "mean"
    ) -> Any:
        """Inside a step, a "mean" is weighted by each rank's sample count (``self.log(..., sync_dist=True)``).

        Lightning's epoch-level mean already divides summed values by summed batch sizes; the per-step value is a
        plain mean over ranks, which unequal batches would bias. Outside a step the parent's mean applies.
        """
        weighted = (
            self._sync_weight is not None
            and isinstance(tensor, Tensor)
            and isinstance(reduce_op, str)
            and reduce_op.lower() in ("mean", "avg")
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
        )
        if not weighted:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        weight = float(self._sync_weight)  # type: ignore[arg-type]
        packed = torch.cat([tensor.detach().double().reshape(-1) * weight, tensor.new_tensor([weight], dtype=torch.float64)])
        torch.distributed.all_reduce(packed, op=torch.distributed.ReduceOp.SUM, group=group)
        return (packed[:-1] / packed[-1]).reshape(tensor.shape).to(tensor.dtype if tensor.is_floating_point() else torch.float32)


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads != 1 else ''})"
