"""The job's pipeline parallelism, from the placement at setup to the report at the end.

:class:`PipelineTraining` is the job's one object for a model split into stages (``HeteroStrategy(pipeline=...)``):
it measures the blocks on every rank and places them by speed and memory (:mod:`lightning_hetero.pipeline.placement`),
installs this rank's stage (:class:`~lightning_hetero.pipeline.stage.Pipeline`), runs each step's schedule, moves
blocks when the ranks' measured times say so, and saves and loads each rank's blocks by name
(:mod:`lightning_hetero.pipeline.state`). What it refuses before the process group exists is
:func:`check_pipeline_job`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hetero.emulate import memory
from lightning_hetero.pipeline import state as pipeline_state
from lightning_hetero.pipeline.blocks import (
    BlockMeasurement,
    check_chain_order,
    first_batch,
    measure_blocks,
    training_bytes,
)
from lightning_hetero.pipeline.chain import block_of, check_chain_shape
from lightning_hetero.pipeline.description import describe_pipeline
from lightning_hetero.pipeline.last_stage_metrics import LastStageMetrics
from lightning_hetero.pipeline.optimizer_shards import shard_rooms, sharded_costs
from lightning_hetero.pipeline.options import PipelineChoice, pipeline_job_refusal, replicas_of
from lightning_hetero.pipeline.placement import (
    BlockCosts,
    StagePlacement,
    block_costs,
    in_flight,
    pipeline_shares,
    place_stages,
    replan_stages,
    stage_seconds_under,
)
from lightning_hetero.pipeline.report import describe_stages, summarize_stages
from lightning_hetero.pipeline.stage import Pipeline
from lightning_hetero.precision.nonfinite import NonFiniteGuard
from lightning_hetero.recover import checkpoint, elastic, into_pipeline
from lightning_hetero.recover.recovery import Recovery
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.recover.resume import Route, file_route, resume_route
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.safe_load import unpickles_in_full
from lightning_hetero.split.decisions.split import micro_batch_sizes
from lightning_hetero.train.loaders import loader_batch_size
from lightning_hetero.train.mode import Backward, LoadCheckpoint, Surveyed, UserStep, WriteCheckpoint
from lightning_hetero.train.optimizer_shards import OptimizerShards, ShardedSet, shard_fractions
from lightning_hetero.train.sharding import BatchListeners, DataSharding
from lightning_hetero.train.streams import is_stream
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.publish import report_directory


def check_pipeline_job(choice: PipelineChoice, trainer: Any, precision: str, world_size: int) -> None:
    """What a pipeline cannot run (yet), raised at setup on every rank before the process group exists (the
    trainer's precision, manual optimization, evaluation outside a fit, a chain that cannot be split)."""
    replicas_of(choice, world_size)
    if trainer is None:
        return
    module = trainer.lightning_module
    fitting = trainer.state.fn == TrainerFn.FITTING  # (validate, test and predict run through the stages too)
    refusal = pipeline_job_refusal(precision, module.automatic_optimization or not fitting)
    if refusal:
        raise ValueError(refusal)
    if not is_overridden("configure_model", module):  # (else the chain exists only later: checked at setup)
        # (an evaluation's stages may be its fit's, which split the chain: checked again when placed)
        check_chain_shape(module, choice, stage_kept=not fitting)
    if not any(isinstance(c, LastStageMetrics) for c in trainer.callbacks):
        # First, before the callbacks that read the metrics (Lightning runs checkpoint callbacks last).
        trainer.callbacks.insert(0, LastStageMetrics())


class PipelineTraining:
    """This rank's part of the pipelines: its stage (``pipeline``), and what it needs of the job, each named: the
    ranks, their collectives, the data sharding, the loss weights (evaluation batches), the emulation, the
    recovery's atomic save, and the re-plan settings. What the setup survey established (every rank's precision,
    device facts and emulated memory) comes with :meth:`start`. A :class:`~lightning_hetero.train.mode.TrainingMode`."""

    exchanges_each_step = True

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        rank: int,
        world_size: int,
        collectives: Collectives,
        sharding: DataSharding,
        loss_weights: LossWeights,
        emulation: Any,
        recovery: Recovery,
        nonfinite: NonFiniteGuard,
        rebalance: Optional[bool],
        rebalance_window: int,
        rebalance_threshold: float,
        loss_reduction: str,
        earlier_placement: Optional[StagePlacement] = None,
        loss_scale: Callable[[], Optional[float]] = lambda: None,
        parameters_arrived: Callable[[list[torch.nn.Parameter]], None] = lambda parameters: None,
        shard_optimizer: bool = False,
        shards: str = "equal",
    ) -> None:
        self.pipeline = pipeline
        # ZeRO-1 over the copies (`stage=1`): each rank steps its share of its stage's parameters and of the outside
        # modules', sized by `shards` (pipeline/optimizer_shards.py); built at start, once the stages are placed.
        self._shard_optimizer, self._shards_choice = shard_optimizer, shards
        self.shards: Optional[OptimizerShards] = None
        # The placement of this strategy's last trainer call: the blocks each rank kept, which an evaluation reuses.
        self._earlier_placement = earlier_placement
        # The fp16 loss scale (the precision plugin's, the same on every rank; None without an fp16 rank): an fp16
        # stage multiplies its backward by it (its gradient hooks divide it out of its parameters' gradients) and
        # divides it out of the gradient it sends to the stage before, which sees unscaled gradients only.
        self._loss_scale = loss_scale
        self._scales_backward = False  # this rank computes in fp16, from start()
        # Told the parameters of blocks a re-plan moved here (new tensors): an fp16 rank's gradient hooks take them on.
        self._parameters_arrived = parameters_arrived
        self._rank, self._world_size = rank, world_size
        self._collectives, self._sharding, self._loss_weights = collectives, sharding, loss_weights
        self._emulation, self._recovery, self._nonfinite = emulation, recovery, nonfinite
        self._step_norm: Optional[float] = None  # the optimizer step's agreed gradient norm, once computed
        self._rebalance, self._rebalance_window, self._rebalance_threshold = (
            rebalance,
            rebalance_window,
            rebalance_threshold,
        )
        self._loss_reduction = loss_reduction
        self._device_facts: list[Any] = []  # every rank's, from start()
        self.replans: list[dict[str, Any]] = []  # this fit's block moves (the report's)
        self._samples = 0  # this pipeline's samples of the batch in hand
        self._global_samples = 0  # the global batch's (short at an epoch's end)
        self._replan: Any = None  # (re-planning on, block costs, micro-batches, micro-batch), from start()
        self._replan_blocked = False
        self._placed_at_batch = 0  # the batches trained (pipeline.step_times) when the blocks were last placed
        self._engine: Optional[Any] = None  # DeepSpeed's, from attach to detach
        self._max_norm = 0.0  # gradient clipping over every stage (0: none), from start()
        self._accumulated = 1  # the Trainer's accumulate_grad_batches, from start()
        self._batches_since_step = 0  # this optimizer step's batches trained so far

    @staticmethod
    def check_trainer(settings: Any, trainer: Optional[Any], precision: str, world_size: int) -> None:
        """What a pipeline cannot run (yet), refused on every rank before the process group exists
        (:func:`check_pipeline_job`)."""
        check_pipeline_job(settings.pipeline, trainer, precision, world_size)

    def start(
        self,
        global_batch_size: int,
        module: LightningModule,
        device: torch.device,
        zero_stage: int,
        fitting: bool,
        surveyed: Surveyed,
        config: dict[str, Any],
    ) -> int:
        """Pipeline parallelism (pipeline/stage.py): the blocks measured on every rank (unless ``boundaries`` are
        given), placed on the stages by speed and memory, and this rank's stage kept; then the plan is printed.
        ``surveyed``: every rank's precision, device facts and emulated memory, from the setup survey. Outside a fit
        the stages are placed without measuring (:meth:`_place_for_evaluation`). Gradient clipping is taken over
        from DeepSpeed, whose engine would clip each stage by its own norm: ``config``'s ``gradient_clipping`` (else
        the Trainer's ``gradient_clip_val``) is the whole model's, and the engine's is set to 0."""
        if not fitting:
            return self._place_for_evaluation(module, surveyed)
        trainer = module.trainer
        given = config.get("gradient_clipping")
        self._max_norm = float(given if given is not None else (trainer.gradient_clip_val or 0.0))
        config["gradient_clipping"] = 0.0
        self._accumulated = trainer.accumulate_grad_batches
        self._batches_since_step = 0
        # Every rank clips by the same norm and accumulates alike, or the norm's all-reduce would meet another call.
        settings = self._collectives.gather_objects((self._max_norm, self._accumulated))
        if len(set(settings)) > 1:
            raise ValueError(
                "HeteroStrategy(pipeline=...): the ranks' gradient clipping and `accumulate_grad_batches` differ"
                f" (per rank: {settings}); every stage must clip by the whole model's norm and accumulate alike. Give"
                " every rank the same `Trainer(gradient_clip_val=..., accumulate_grad_batches=...)`."
            )
        precisions, device_facts = surveyed.precisions, surveyed.device_facts
        memory_byte_ceilings = surveyed.memory_byte_ceilings
        pipeline, choice = self.pipeline, self.pipeline.choice
        self._device_facts = list(device_facts)
        replicas = replicas_of(choice, self._world_size)
        self._scales_backward = precisions[self._rank] == "16-mixed"
        replica_batch = micro_batch_sizes(global_batch_size, replicas)[0]  # (until the shares are known)
        micro_batches = choice.micro_batches_for(replica_batch)
        micro_batch = -(-replica_batch // micro_batches)
        chain, names = check_chain_shape(module, choice)
        blocks = [block_of(chain, name) for name in names]
        loader = self._sharding.requested_training_loader
        if is_stream(loader):  # (every rank has the same loader: every rank raises)
            raise ValueError(
                "HeteroStrategy(pipeline=...) with an IterableDataset: every stage of a pipeline must take the same"
                " samples, which a stream per rank cannot give. Use a map-style Dataset (with `__getitem__`)."
            )
        emulator, rank = self._emulation.emulator, self._rank

        def check() -> tuple[None, None]:
            # The whole model runs here, before it is split: a chain that cannot be split fails on every rank.
            probe = first_batch(loader, 1, device, move_data_to_device)
            check_chain_order(module, blocks, names, choice.blocks, probe, device)
            return None, None

        def measure_in_turn(turn: int) -> tuple[None, Optional[dict[str, Any]]]:
            return None, measure() if turn == rank else None

        def measure() -> dict[str, Any]:
            batch = first_batch(loader, micro_batch, device, move_data_to_device)
            return measure_blocks(module, blocks, batch, micro_batch, device, emulator).to_dict()

        self._collectives.gather_or_raise("checking the chain of blocks", check)
        measured = None
        if choice.boundaries is None:
            hosts = [facts.hostname for facts in device_facts]
            if len(set(hosts)) == len(hosts):  # one rank per machine: all measure at once
                gathered = self._collectives.gather_or_raise("measuring the blocks", lambda: (None, measure()))[1]
            else:
                # Ranks that share a machine measure in turns: at once, they slowed each other's block times
                # unevenly (memory bandwidth, shared cores), which misplaced a block in one run of three.
                gathered = [
                    self._collectives.gather_or_raise(
                        f"measuring the blocks (rank {turn})", functools.partial(measure_in_turn, turn)
                    )[1][turn]
                    for turn in range(self._world_size)
                ]
            measured = [BlockMeasurement.from_dict(m) for m in gathered]
        own_costs = self._block_costs(measured, module, blocks, memory_byte_ceilings)  # (each rank's own memory)
        # Every pipeline keeps the first one's placement: its ranks stand for their stage's copies, and with `stage=1`
        # a rank holds its share of the optimizer state.
        costs = sharded_costs(own_costs, choice.stages, replicas, self._shard_optimizer, self._shards_choice)
        placement = place_stages(
            costs,
            choice.stages,
            choice.schedule,
            micro_batches,
            micro_batch,
            choice.boundaries,
            ranks=tuple(range(choice.stages)),
            search_orders=replicas == 1,
            last_rank=0,
            chunks=choice.virtual_stages,
        )
        if measured is not None and replicas > 1:  # a faster pipeline takes more samples
            pipeline.shares = pipeline_shares(costs, placement, replicas, global_batch_size)
        else:
            pipeline.shares = tuple(micro_batch_sizes(global_batch_size, replicas))
        micro_batch = -(-max(pipeline.shares) // micro_batches)
        uneven = sorted({choice.micro_batches_for(share) for share in pipeline.shares} - {micro_batches})
        if choice.schedule == "interleaved" and any(count % choice.stages for count in uneven):
            rank_zero_warn(
                f"HeteroStrategy(pipeline=...): a pipeline's share of the batch {list(pipeline.shares)} makes"
                f" {uneven} micro-batches, not a multiple of the {choice.stages} stages: its steps run GPipe's order"
                " over the chunks (all forwards, then all backwards), holding every micro-batch's activations. Give"
                f" the pipelines at least {micro_batches} samples each (a larger batch), or fewer `micro_batches`."
            )
        pipeline.install(module, placement, replicas, global_batch_size)
        shard_lines = self._shard_optimizer_state(module, own_costs, placement, micro_batches, micro_batch)
        # Blocks follow what the ranks measure, as the batch split does: on when placed by measurement, unless off.
        # (not between an interleaved pipeline's chunks: refused when asked for, off by default)
        self._replan = (
            choice.boundaries is None and self._rebalance is not False and choice.virtual_stages == 1,
            costs,
            micro_batches,
            micro_batch,
        )
        self._placed_at_batch = 0
        if self._rank == 0:
            described = describe_pipeline(
                placement,
                names,
                choice,
                replicas,
                micro_batches,
                micro_batch,
                measured,
                costs.memory_bytes if memory_byte_ceilings else None,
                pipeline.shares,
                pooled_memory=self._shard_optimizer and self._shards_choice == "memory" and replicas > 1,
            )
            rank_zero_info("\n".join([described, *shard_lines]))
        return micro_batch

    def _shard_optimizer_state(
        self,
        module: LightningModule,
        own_costs: BlockCosts,
        placement: StagePlacement,
        micro_batches: int,
        micro_batch: int,
    ) -> list[str]:
        """With ``stage=1``: this rank's shards of the optimizer state (its stage's over the pipelines holding it,
        sized by ``shards``; the outside modules' over every rank, equal), and the plan's lines saying who holds
        what and why. Every rank decides every stage's shares from the same gathered costs."""
        self.shards = None
        if not self._shard_optimizer:
            return []
        pipeline, choice = self.pipeline, self.pipeline.choice
        layout, stage_of_chain = pipeline.layout, pipeline.stage_of_chain
        assert layout is not None and stage_of_chain is not None
        lines, sets = [], []
        for stage in range(choice.stages):
            ranks = layout.stage_ranks(stage)
            held = in_flight(choice.schedule, stage, choice.stages, micro_batches, choice.virtual_stages) * micro_batch
            rooms = shard_rooms(own_costs, placement, stage, ranks, held)
            short = [(r, room) for r, room in zip(ranks, rooms) if room is not None and room < 0]
            if len(ranks) > 1 and self._shards_choice == "memory" and short:
                rank, room = short[0]
                raise ValueError(
                    f"HeteroStrategy(pipeline=..., stage=1, shards='memory'): rank {rank} cannot hold stage {stage}'s"
                    f" parameters, gradients and activations ({-room / 2**20:.1f} MiB over its memory) before any"
                    " optimizer state. Use more stages, fewer micro-batch samples, or `shards='equal'`."
                )
            fractions, reason = shard_fractions(rooms, self._shards_choice)
            if len(ranks) > 1:
                left = "" if rooms[0] is None else "; MiB left after activations: "
                left += ", ".join(f"{room / 2**20:.1f}" for room in rooms if room is not None)
                shares = ", ".join(f"rank {r} {100 * f:.0f} %" for r, f in zip(ranks, fractions))
                lines.append(f"  optimizer state of stage {stage} sharded ({reason}): {shares}{left}")
            if stage == pipeline.stage and len(ranks) > 1:
                names, parameters = self._stage_parameters(module)
                sets.append(ShardedSet(names, parameters, ranks, pipeline.stage_group, fractions, reason))
        outside_ids = {id(p) for p in pipeline.outside}
        outside = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) in outside_ids]
        if outside and self._world_size > 1:
            everyone = list(range(self._world_size))
            equal = tuple(1.0 / self._world_size for _ in everyone)
            names, parameters = [n for n, _ in outside], [p for _, p in outside]
            sets.append(ShardedSet(names, parameters, everyone, None, equal, "equal shares"))
            lines.append(
                f"  optimizer state of the modules outside the chain sharded over all {self._world_size} ranks, equal"
            )
        self.shards = OptimizerShards(self._rank, sets)
        return lines

    def _stage_parameters(self, module: LightningModule) -> tuple[list[str], list[torch.nn.Parameter]]:
        """This rank's blocks' trained parameters and their names, in the chain's order."""
        stage_of_chain = self.pipeline.stage_of_chain
        assert stage_of_chain is not None
        held = {id(p) for p in stage_of_chain.parameters()}
        named = [(n, p) for n, p in module.named_parameters() if id(p) in held and p.requires_grad]
        return [n for n, _ in named], [p for _, p in named]

    def _block_costs(
        self,
        measured: Optional[list[BlockMeasurement]],
        module: LightningModule,
        blocks: list[torch.nn.Module],
        memory_byte_ceilings: Optional[list[Optional[int]]],
    ) -> BlockCosts:
        """The placement's input (:func:`~lightning_hetero.pipeline.placement.block_costs`): the blocks' measured
        times (None: one second each), their training state and the rest of the model's, every rank's memory."""
        return block_costs(
            measured,
            len(blocks),
            self._world_size,
            [training_bytes(block) for block in blocks],
            training_bytes(module) - sum(training_bytes(block) for block in blocks),
            memory.capped_free_bytes([None] * self._world_size, memory_byte_ceilings),
        )

    def _place_for_evaluation(self, module: LightningModule, surveyed: Surveyed) -> int:
        """``validate``, ``test`` or ``predict``: the stages placed without measuring (an evaluation runs no
        backward, and no training loader is there to measure with): the placement of this strategy's last trainer
        call (a fit's), whose blocks this rank kept; else the given ``boundaries``; else equal numbers of blocks per
        stage, within each device's memory. A checkpoint (``ckpt_path``) is loaded after, by parameter name, into
        whatever placement this is. Returns the micro-batch DeepSpeed's inference engine is told (it runs none)."""
        pipeline, choice = self.pipeline, self.pipeline.choice
        self._device_facts = list(surveyed.device_facts)
        replicas = replicas_of(choice, self._world_size)
        placement = self._earlier_placement  # (its blocks are the ones this rank kept)
        chain, names = check_chain_shape(module, choice, stage_kept=placement is not None)
        blocks = [block_of(chain, name) for name in names]
        source = "as this strategy's last trainer call placed them"
        if placement is None:
            own_costs = self._block_costs(None, module, blocks, surveyed.memory_byte_ceilings)
            costs = sharded_costs(own_costs, choice.stages, replicas, False, "equal")  # (each stage's least memory)
            placement = place_stages(
                costs,
                choice.stages,
                choice.schedule,
                boundaries=choice.boundaries,
                ranks=tuple(range(choice.stages)),
                search_orders=False,
                last_rank=0,
                chunks=choice.virtual_stages,
            )
            source = "at the given boundaries" if choice.boundaries else "in equal numbers (not measured outside a fit)"
        pipeline.shares = tuple(micro_batch_sizes(replicas, replicas))  # (no training loader is cut)
        pipeline.install(module, placement, replicas, 0)
        if self._rank == 0:
            stage_lines = describe_pipeline(placement, names, choice, replicas, 1, 1, None).splitlines()[1:]
            rank_zero_info(
                f"HeteroStrategy pipeline for evaluation: {choice.stages} stages x {replicas} pipeline(s), blocks"
                f" placed {source}:\n" + "\n".join(stage_lines)
            )
        return 1

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> None:
        return None  # (start printed the placement; the report finds its directory at the end)

    @contextlib.contextmanager
    def engine_built(self) -> Iterator[None]:
        """Around ``deepspeed.initialize``: with a pipeline, the engine's broadcast of every parameter from rank 0 is
        skipped (ranks hold different blocks; the pipeline broadcast each part within its own group already)."""
        from deepspeed.runtime.engine import DeepSpeedEngine

        original = DeepSpeedEngine._broadcast_model
        DeepSpeedEngine._broadcast_model = lambda engine: None
        try:
            yield
        finally:
            DeepSpeedEngine._broadcast_model = original

    def attach(self, engine: Any) -> None:
        """DeepSpeed's engine exists: the pipeline sums the gradients itself (per stage, and the modules outside the
        chain over every rank), so the engine's reduction is replaced by nothing (after the emulation's wrapper of it,
        which it replaces too)."""
        self._emulation.around_deepspeed_exchanges(engine)
        engine.allreduce_gradients = lambda *args, **kwargs: None
        self._engine = engine
        if engine.optimizer is None:  # (an evaluation's engine: Lightning removed every module hook before it)
            assert self.pipeline.stage_of_chain is not None
            self.pipeline.stage_of_chain.hook()
        if engine.optimizer is not None:
            if self.shards is not None:  # (an optimizer that made state for every parameter when it was built)
                self.shards.drop_unowned_state(engine.optimizer)
            engine.step = self._agreed_step(engine.step, engine.module)
            self._nonfinite.agreed_nonfinite = lambda: not math.isfinite(self._agreed_norm())

    def _agreed_norm(self) -> float:
        """The whole model's gradient norm for the optimizer step under way, agreed over every stage (one all-reduce
        of a number, at the first call of the step on every rank): an fp16 job's precision plugin asks first (an inf
        that only a later stage received is an overflow too), then the step clips by it and skips on it."""
        if self._step_norm is None:
            self._step_norm = self.pipeline.gradient_norm()
        return self._step_norm

    def _agreed_step(self, step: Callable[..., Any], module: torch.nn.Module) -> Callable[..., Any]:
        """DeepSpeed's step after the whole model's gradient norm is agreed: when it is not finite every stage skips
        the step (the non-finite guard, or an fp16 job's precision plugin, reads it), else the gradients are clipped
        by it when clipping is on. The next batch starts an optimizer step's accumulation."""

        def agreed(*args: Any, **kwargs: Any) -> Any:
            norm = self._agreed_norm()
            if self._max_norm > 0 and math.isfinite(norm):  # (a skipped step's gradients are left as they are)
                self.pipeline.clip_gradients(module, self._max_norm, norm)
            self._batches_since_step = 0
            shards = self.shards
            if shards is not None:  # (ZeRO-1: each rank steps what it owns, then the owners broadcast it)
                shards.drop_unowned_gradients()
            try:
                result = step(*args, **kwargs)
                if shards is not None:
                    shards.gather_parameters()
                return result
            finally:
                self._step_norm = None

        return agreed

    def detach(self) -> None:
        self.pipeline.uninstall()
        self._engine = None
        self._nonfinite.agreed_nonfinite = lambda: False

    def shard(self, dataloader: DataLoader, trainer: Any) -> Any:
        """Every stage of a pipeline takes the same samples: the split is over the pipelines."""
        pipeline = self.pipeline
        listeners = BatchListeners(
            self._batch_ready,
            self._loss_weights.evaluation_batch,
            self._loss_weights.forget_evaluation_batch,
            lambda: None,
        )
        evaluation = [loader_batch_size(dataloader) or 1] * pipeline.replicas
        return self._sharding.shard(
            dataloader,
            trainer,
            pipeline.replica_batch_sizes(),
            self._collectives,
            pipeline.replica,
            listeners,
            evaluation_split=evaluation,
        )

    def batch_received(self, batch: Any, trainer: Any) -> Any:
        return batch

    def _batch_ready(self, local_samples: int, global_samples: int) -> None:
        self._samples, self._global_samples = local_samples, global_samples

    def _move_blocks_if_due(self, global_step: int, optimizer: Any) -> None:
        """Every ``rebalance_window`` steps: each rank's compute over the last window (the steps two after the last
        move on) against what the placement predicted; the same decision on every rank from the gathered factors,
        and the blocks moved, state and all, before this step (:mod:`lightning_hetero.pipeline.placement`)."""
        pipeline, replan = self.pipeline, self._replan
        assert pipeline.placement is not None and pipeline.layout is not None
        window = self._rebalance_window
        if replan is None or not replan[0] or global_step == 0 or global_step % window or self._world_size == 1:
            return
        enabled, costs, micro_batches, micro_batch = replan
        # (each optimizer step trains `accumulate_grad_batches` batches, each with its own entry in step_times)
        batches, per_step = len(pipeline.step_times), self._accumulated
        first = max(batches - window * per_step, self._placed_at_batch + 2 * per_step)
        recent = [compute for compute, _ in pipeline.step_times[first:batches]]
        stages = pipeline.layout.stages
        own = replace(pipeline.placement, ranks=tuple(pipeline.replica * stages + r for r in pipeline.placement.ranks))
        predicted = stage_seconds_under(costs, own)[pipeline.stage] * pipeline.shares[pipeline.replica]
        factor = statistics.median(recent) / predicted if recent and predicted > 0 else None
        factors = self._collectives.gather_objects(factor)
        if any(f is None for f in factors):
            return  # (too few steps under this placement yet)
        if len(optimizer.param_groups) != 1:
            if not self._replan_blocked:
                self._replan_blocked = True
                rank_zero_warn(
                    f"HeteroStrategy(pipeline=...): the optimizer has {len(optimizer.param_groups)} parameter groups;"
                    " blocks stay where they were placed (a moved block's parameters would not know their group)."
                    " Pass `rebalance=False` to silence this, or use one parameter group."
                )
            return
        layout = pipeline.layout
        slots = [max(factors[layout.rank_of(p, s)] for p in range(layout.replicas)) for s in range(layout.stages)]
        # (the placement's costs hold every rank; its ranks, the first pipeline's, stand for their stage's copies)
        by_rank = [1.0] * self._world_size
        for stage, slot_factor in enumerate(slots):
            by_rank[layout.order[stage]] = slot_factor
        decision = replan_stages(
            costs,
            pipeline.placement,
            by_rank,
            self._rebalance_threshold,
            pipeline.choice.schedule,
            micro_batches,
            micro_batch,
        )
        if decision.placement is None:
            return
        self._parameters_arrived(pipeline.move_blocks(decision.placement, optimizer))
        if self.shards is not None and pipeline.replicas > 1:  # (the stage's set: the first, when the stage has copies)
            assert self._engine is not None  # (a training step runs with the engine attached)
            self.shards.reassign(0, *self._stage_parameters(self._engine.module), optimizer)
        self._placed_at_batch = len(pipeline.step_times)
        self.replans.append(
            {"step": global_step, "boundaries": list(decision.placement.boundaries), "reason": decision.reason}
        )
        rank_zero_info(f"HeteroStrategy pipeline re-plan before step {global_step}: {decision.reason}")

    def training_step(self, batch: Any, user_step: UserStep, trainer: Any) -> torch.Tensor:
        """One training step through the stages: every micro-batch forward and backward, then the gradient sums.
        Returns the global batch's loss (on every rank, for the progress bar)."""
        pipeline, engine, global_step = self.pipeline, self._engine, trainer.global_step
        assert engine is not None  # (attach() ran: Lightning steps only after setting the engine up)
        module, optimizer = engine.module, engine.optimizer
        self._emulation.at_step(global_step)
        if self._batches_since_step == 0:  # (blocks move between optimizer steps, never inside an accumulation)
            self._move_blocks_if_due(global_step, optimizer)
        samples = self._samples
        reduction = self._loss_reduction
        global_batch = self._global_samples or pipeline.global_batch  # (the last batch may be short)

        def weight_of(micro_batch_samples: int) -> float:
            return micro_batch_samples / global_batch if reduction == "mean" else 1.0

        micro_batches = pipeline.micro_batches_of(batch, samples)
        # With accumulate_grad_batches, the earlier batches' gradients (summed already) stay out of this batch's sums.
        earlier = pipeline.set_aside_gradients(module)
        slowed, accumulated = self._emulation.slowed, self._accumulated
        scale = (self._loss_scale() or 1.0) if self._scales_backward else 1.0
        if self._batches_since_step == 0:
            self._step_norm = None  # (a new optimizer step's gradients)
        loss = pipeline.run_step(micro_batches, user_step, weight_of, slowed, engine.backward, accumulated, scale)
        self._nonfinite.loss_computed(loss)  # (the global batch's, the same on every rank)
        pipeline.reduce_gradients()
        pipeline.add_back(earlier)
        pipeline.hold_gradients(module)
        self._batches_since_step += 1
        return loss

    def save_checkpoint(
        self, target: Path, saved: dict[str, Any], write: WriteCheckpoint, zero_stage: int, engine: Any
    ) -> None:
        """Each rank's blocks and optimizer state by name, rank 0's trainer state: staged, manifested, atomic
        (``write``, DeepSpeed's save of the whole engine, is not used: a stage's files are its blocks')."""
        pipeline = self.pipeline
        placement, layout = pipeline.placement, pipeline.layout
        assert placement is not None and layout is not None

        def write_this_rank(directory: Path) -> None:
            pipeline_state.save_stage(directory, self._rank, engine.module, engine.optimizer, saved)

        def facts() -> dict[str, Any]:
            return {
                "world_size": self._world_size,
                "global_step": saved.get("global_step"),
                "epoch": saved.get("epoch"),
                "zero_stage": 0,
                "optimizer": type(engine.optimizer).__name__,
                "devices": [facts.describe() for facts in self._device_facts],
                "pipeline": {
                    "stages": pipeline.choice.stages,
                    "replicas": layout.replicas,
                    "boundaries": list(placement.boundaries),
                    "stage_ranks": list(placement.ranks),
                },
            }

        self._recovery.save(target, write_this_rank, facts)

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
        """A checkpoint into this pipeline run: a pipeline's, whatever its boundaries and number of pipelines, or a
        data-parallel one at any ZeRO stage (``weights_only``: Lightning's, for the trainer's state it holds); a
        Lightning file or local training's is refused."""
        if path.is_file():  # (a Lightning checkpoint file: refused)
            file_route(path, pipeline=True)
        chosen, manifest = self._recovery.choose(path, weights_only)
        route = resume_route(
            chosen,
            manifest,
            pipeline=True,
            local=None,
            world_size=self._world_size,
            zero_stage=zero_stage,
            stage_is_automatic=stage_is_automatic,
        )
        if self.pipeline.placement is None or self.pipeline.layout is None:
            raise ResumeRefused(
                f"HeteroStrategy(pipeline=...) cannot load {chosen} before the stages are placed: resume it with"
                " `trainer.fit(model, ckpt_path=...)`, which places them first."
            )
        fitting = engine.optimizer is not None  # (an evaluation's engine has none)
        # With `stage=1` each rank loads the state of the parameters it owns only (never the whole stage's at once).
        skipped = self.shards.unowned_names() if self.shards is not None else set()
        if route is Route.INTO_PIPELINE:
            return self._load_data_parallel(chosen, manifest, engine, fitting, weights_only, skipped)
        return self._load_pipeline(chosen, manifest, engine, fitting, weights_only, skipped)

    def _load_pipeline(
        self,
        chosen: Path,
        manifest: dict[str, Any],
        engine: Any,
        fitting: bool,
        weights_only: Optional[bool],
        skipped: set[str],
    ) -> dict[str, Any]:
        """A pipeline's own checkpoint, whatever its boundaries and number of pipelines."""
        assert self.pipeline.placement is not None and self.pipeline.layout is not None
        saved = manifest["pipeline"]
        rank_zero_info(
            f"HeteroStrategy: {'resuming' if fitting else 'loading for evaluation'} the pipeline checkpoint {chosen}"
            f" (boundaries {saved['boundaries']}, "
            f"{saved['replicas']} pipeline(s)) on boundaries {list(self.pipeline.placement.boundaries)}"
            f" and {self.pipeline.layout.replicas} pipeline(s), by parameter name."
        )
        return pipeline_state.load_stage(chosen, engine.module, engine.optimizer, weights_only, skipped)

    def _load_data_parallel(
        self,
        chosen: Path,
        manifest: dict[str, Any],
        engine: Any,
        fitting: bool,
        weights_only: Optional[bool],
        skipped: set[str],
    ) -> dict[str, Any]:
        """A data-parallel checkpoint (any ZeRO stage, any number of ranks) into this pipeline: each rank takes its
        blocks, the modules outside the chain and their optimizer state by name (:mod:`~lightning_hetero.recover.
        into_pipeline`; ZeRO 1-3 through DeepSpeed's universal copy, which rank 0 makes once), and the trainer's
        state as saved (the loader's position is in global samples, whatever the split)."""
        in_full = unpickles_in_full(weights_only)
        if (chosen / checkpoint.LOCAL_STATE_DIRNAME).is_dir():  # (saved before manifests recorded `sync`)
            raise ResumeRefused(
                f"Checkpoint {chosen} was saved by local SGD / DiLoCo: each rank trained on its own and holds its own"
                " optimizer state, which no stage can take. Resume it with the same `sync` and without `pipeline`."
            )
        universal_copy = None
        stage = manifest.get("zero_stage", 0)
        if stage > 0:
            into_pipeline.check_readable_by_name(chosen, manifest, in_full)
            _, results = self._collectives.gather_or_raise(
                "converting the checkpoint",
                lambda: (None, elastic.convert_to_universal(chosen, in_full) if self._rank == 0 else None),
            )
            universal_copy = results[0][0]
        model, named, client = into_pipeline.data_parallel_state(chosen, manifest, universal_copy, in_full)
        pipeline_state.load_named_state(chosen, model, named, engine.module, engine.optimizer, skipped)
        assert self.pipeline.placement is not None
        rank_zero_info(
            f"HeteroStrategy: {'resuming' if fitting else 'loading for evaluation'} {chosen}, a data-parallel"
            f" checkpoint (ZeRO-{stage}, {manifest.get('world_size')} ranks), on boundaries"
            f" {list(self.pipeline.placement.boundaries)}, by parameter name."
        )
        return client

    def backward(self, closure_loss: Tensor, backward: Backward, trainer: Any, zero_stage: int) -> None:
        """Lightning's backward of the step: the schedule ran it; its gradients go back on the parameters."""
        self.pipeline.return_gradients()

    def optimizer_step(self, step: Callable[[], Any], backward: Backward, trainer: Any, closure: Any) -> Any:
        """Lightning's optimizer step; then the non-finite guard counts it (the stages skip alike, so a run of
        skipped steps stops every rank together, and `skipped_steps` lists them)."""
        result = step()
        self._nonfinite.step_ended(trainer.global_step)
        return result

    def synchronize(self, counted: bool) -> None:
        pass  # (the stages' gradients were summed at each step: one model)

    def link_wait_seconds(self) -> float:
        return 0.0  # (the stages' exchanges are inside the step)

    def evaluation_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A validation step through the stages (forward only); the last stage's output, None on the others."""
        return self.pipeline.evaluation_step(batch, user_step)

    def prediction_step(self, batch: Any, user_step: Callable[[Any], Any]) -> Any:
        """A predict step through the stages: the prediction on each pipeline's last stage (rank 0 holds the first
        pipeline's), None on the other stages."""
        return self.pipeline.evaluation_step(batch, user_step)

    def sampler_replicas(self, rank: int, world_size: int) -> tuple[int, int]:
        """Every stage of a pipeline takes the same samples: `predict`'s data is split over the pipelines (pipeline
        ``p`` is ranks ``p*S .. p*S+S-1`` whatever the placement: known before the stages are placed)."""
        stages = self.pipeline.choice.stages
        return world_size // stages, rank // stages

    def write_report(self, trainer: Any, plugin: Any) -> None:
        """Every rank's stage times gathered; rank 0 prints the per-stage summary and writes it as JSON."""
        pipeline = self.pipeline
        gathered = self._collectives.gather_objects((pipeline.stage, pipeline.step_times))
        directory = report_directory(trainer, self._collectives.gather_objects)  # (a pipeline writes no plan file)
        if self._rank != 0:
            return
        summary = summarize_stages([times for _, times in gathered], [stage for stage, _ in gathered])
        assert pipeline.placement is not None
        summary.update(
            boundaries=list(pipeline.placement.boundaries),
            stage_ranks=list(pipeline.placement.ranks),
            replans=self.replans,
        )
        rank_zero_info(describe_stages(summary))
        if directory is None:  # (no logger and no folder named: printed only)
            return
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "pipeline_report.json").write_text(json.dumps(summary, indent=1))
        rank_zero_info(f"written to {directory / 'pipeline_report.json'}")
