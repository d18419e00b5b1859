"""Train: Lightning's loaders, sharded by the strategy instead of by Lightning's DistributedSampler.

Where Lightning's DDP would put a DistributedSampler in (equal shards), the strategy rebuilds each loader around the
global order (:mod:`.order`, :mod:`.loaders`) or the rank's own stream (:mod:`.streams`): the training loader by the
split in force, evaluation loaders equally, as DDP splits them. Prediction keeps Lightning's sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_hetero.configure.deepspeed_config import config_disagreements
from lightning_hetero.runtime.collectives import Collectives
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
from lightning_hetero.train.order import GlobalOrder, local_seed
from lightning_hetero.train.streams import HeteroStreamLoader, is_stream

SampleCounts = Callable[[int, int], None]  # (this rank's samples, the global batch's samples) of a batch


@dataclass(frozen=True)
class BatchListeners:
    """Told as each batch is handed to the loop (the loss weight, the step meter, the split follower)."""

    training_batch: SampleCounts
    evaluation_batch: SampleCounts
    evaluation_stream_draw: Callable[[], None]  # a stream's evaluation batch carries no counts
    before_training_fetch: Optional[Callable[[], None]]  # a global-batch boundary: where the split may change


class DataSharding:
    """The loaders of one strategy, across its trainer calls."""

    def __init__(self) -> None:
        self.data_seed: Optional[int] = None  # rank 0's seed_everything seed: the data order of every rank
        self.requested_training_loader: Any = None  # the user's, as requested at setup (before it is rebuilt)
        self.training_stream: Optional[HeteroStreamLoader] = None  # the training loader, when it reads a stream
        self._user_use_distributed_sampler: Optional[bool] = None
        self._said_order_is_kept = False

    def take_over_distributed_sampling(self, trainer: Any) -> None:
        """Keep Lightning from replacing the user's sampler with a shuffling DistributedSampler (we shard)."""
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

    def request_training_loader(self, trainer: Any) -> Any:
        """The training loader, requested as Lightning requests it, then handed to the fit loop when it asks: the
        user's ``train_dataloader()`` runs once per fit, as under DDP (it may build a random dataset)."""
        source = trainer.fit_loop._data_source
        if not source.is_defined():
            return None
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
        self.requested_training_loader = loader
        return loader

    @staticmethod
    def forget_served_loader(trainer: Optional[Any]) -> None:
        """The fit loop asks ``train_dataloader()`` again (a fit that failed before its loop asked, or a restore
        that may change what it returns)."""
        if trainer is not None:
            trainer.fit_loop._data_source.__dict__.pop("dataloader", None)

    def shard(
        self,
        dataloader: DataLoader,
        trainer: Any,
        training_split: Optional[Sequence[int]],
        collectives: Collectives,
        rank: int,
        listeners: BatchListeners,
        evaluation_split: Optional[Sequence[int]] = None,
    ) -> Union[DataLoader, HeteroDataLoader, HeteroStreamLoader]:
        """``dataloader`` rebuilt for this rank; every rank checks that the ranks' loaders agree. (A pipeline passes
        ``rank`` as its own index, the splits over its pipelines, and ``evaluation_split`` likewise.)"""
        stage = trainer.state.stage
        if stage == RunningStage.PREDICTING:
            return dataloader
        training = stage == RunningStage.TRAINING
        name = "training loader" if training else f"{stage.dataloader_prefix if stage else 'evaluation'} loader"
        if training:
            assert training_split is not None
            batch_sizes: Sequence[int] = training_split
        else:
            # Evaluation is split as DDP splits it: the loader's batch on every rank, the samples padded to a
            # multiple of the ranks, so that every step gives every rank the same number of samples (a user's
            # `self.all_gather` of predictions needs equal shapes; uneven ones abort inside gloo).
            batch_sizes = evaluation_split or [loader_batch_size(dataloader) or 1] * collectives.world_size

        def rebuild() -> tuple[Union[HeteroDataLoader, HeteroStreamLoader], dict[str, Any]]:
            problem = describe_unsupported_loader(dataloader, name)
            if problem:
                raise ValueError(problem)
            if is_stream(dataloader):  # each rank takes its micro-batch from its own stream
                stream = HeteroStreamLoader(
                    dataloader,
                    batch_sizes,
                    rank,
                    collectives.gather_counts,
                    lambda: trainer.current_epoch,
                    on_draw=None if training else listeners.evaluation_stream_draw,
                )
                return stream, {"stream_dataset": type(dataloader.dataset).__name__}
            loader = rebuild_loader(
                dataloader,
                batch_sizes,
                rank,
                self.data_seed if self.data_seed is not None else local_seed(),
                on_batch=listeners.training_batch if training else listeners.evaluation_batch,
                on_fetch=listeners.before_training_fetch if training else None,
                pad=not training,
            )
            return loader, describe_order(loader)

        loader, orders = collectives.gather_or_raise(f"preparing the {name}", rebuild)
        lines = config_disagreements(orders)
        if lines:
            raise ValueError(
                f"HeteroStrategy: the ranks' {name}s differ: " + "; ".join(lines) + ". Every rank must load the same"
                " dataset with the same sampler: the strategy cuts one epoch order into per-rank slices, so different"
                " data would use some samples twice and others never, or make the ranks run different numbers of steps."
            )
        if training:
            self.training_stream = loader if isinstance(loader, HeteroStreamLoader) else None
            self._say_the_order_is_kept(loader)
        return loader

    def _say_the_order_is_kept(self, loader: Any) -> None:
        user_sampler = getattr(getattr(loader.hetero_batch_sampler, "sampler", None), "user_sampler", None)
        if isinstance(user_sampler, SequentialSampler) and not self._said_order_is_kept:
            self._said_order_is_kept = True
            rank_zero_info(
                "HeteroStrategy keeps the training loader's order: it does not shuffle, so every epoch uses the samples"
                " in the same order (DDP's DistributedSampler would shuffle). Pass `shuffle=True` to the DataLoader to"
                " shuffle."
            )

    def training_order(self) -> Optional[GlobalOrder]:
        """The global order the training loader will cut (a map-style loader's), to place a restored epoch."""
        loader = self.requested_training_loader
        if isinstance(loader, DataLoader) and not is_stream(loader):
            batch_sampler = loader.batch_sampler
            assert isinstance(batch_sampler, BatchSampler)  # checked when requested (describe_unsupported_loader)
            return GlobalOrder(batch_sampler.sampler, self.data_seed or 0)
        return None


def check_trainable(
    loader: Any, global_batch_size: int, world_size: int, loss_reduction: str, automatic_optimization: bool
) -> None:
    """What makes a fit impossible, said before profiling (which needs samples) on the rank that sees it."""
    if isinstance(loader, DataLoader) and not is_stream(loader):
        empty = describe_empty_epoch(loader, global_batch_size, world_size, "training loader")
        if empty:
            raise ValueError(empty)
    if loss_reduction == "token_mean" and not automatic_optimization:
        raise ValueError(
            "`HeteroStrategy(loss_reduction='token_mean')` weights each rank's loss by its tokens before"
            " backward, but with manual optimization `training_step` runs its own backward first. Weight the"
            " loss yourself (by this rank's tokens times the world size over all ranks' tokens) and use"
            " loss_reduction='sum', or use automatic optimization."
        )


def _serve_once(source: Any, loader: Any) -> None:
    """Make the next ``source.dataloader()`` return ``loader`` instead of calling the user's hook again."""

    def dataloader() -> Any:
        del source.dataloader  # back to the hook, for `reload_dataloaders_every_n_epochs`
        return loader

    source.dataloader = dataloader
