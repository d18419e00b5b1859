"""The job: one owner of a run's state, and the wiring between the stages' objects.

:class:`HeteroJob` holds, for one strategy across its trainer calls, what the ranks established at setup (device
facts, precisions, profiles, the data seed), the split in force, and one object per capability (collectives,
emulation, data sharding, loss weights, watch, recovery, non-finite steps, communication). The strategy calls it at
Lightning's lifecycle points and keeps only Lightning's hook order and the DeepSpeed overrides; nothing here knows
Lightning's or DeepSpeed's strategy classes.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_hetero.comm import topology
from lightning_hetero.comm.communication import Communication
from lightning_hetero.emulate.emulation import Emulation, NoEmulation, emulation_for
from lightning_hetero.measure.blocks import (
    BlockMeasurement,
    check_chain_order,
    first_batch,
    measure_blocks,
    training_bytes,
)
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.measure.partitioned import partitioned_parameters, whole_parameters
from lightning_hetero.measure.profiler import RankProfile
from lightning_hetero.measure.survey import JobSurvey, RankSurvey, profile_rank
from lightning_hetero.plan.deepspeed_config import model_signature
from lightning_hetero.emulate import memory
from lightning_hetero.plan.initial import InitialPlan, initial_plan, rebalancer_for, within_emulated_memory
from lightning_hetero.plan.zero_stage import ModelSize, StageChoice, choose_stage, shared_free_bytes
from lightning_hetero.plan.micro_steps import automatic_micro_steps_allowed, micro_steps_refusal
from lightning_hetero.plan.local_steps import InnerStepsRebalancer, describe_sync, plan_inner_steps, sync_refusal
from lightning_hetero.plan.split import SplitPlan, micro_batch_sizes
from lightning_hetero.plan.stages import (
    block_costs,
    describe_pipeline,
    pipeline_job_refusal,
    pipeline_shares,
    place_stages,
    replan_stages,
    replicas_of,
    stage_seconds_under,
)
from lightning_hetero.precision.choice import rank_precision
from lightning_hetero.precision.job import gradient_bytes_held_until_step, job_plugin, loss_scale_value
from lightning_hetero.precision.nonfinite import NonFiniteGuard
from lightning_hetero.precision.plugin import HeteroPrecision, autocast_for
from lightning_hetero.recover import pipeline_state
from lightning_hetero.recover.recovery import Recovery, manifest_facts
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.settings import HeteroSettings, check_ranks_agree
from lightning_hetero.train.local_sgd import LocalTraining
from lightning_hetero.train.micro_batches import MicroBatchGuard, split_batch, step_loss
from lightning_hetero.train.pipeline import LastStageMetrics, Pipeline, check_chain_shape
from lightning_hetero.train.loaders import loader_batch_size
from lightning_hetero.train.order import GlobalOrder, agreed_seed, local_seed
from lightning_hetero.train.sharding import BatchListeners, DataSharding, check_trainable
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.sync_batchnorm import small_batchnorm_warning
from lightning_hetero.train.streams import is_stream
from lightning_hetero.train.weights import LossWeights
from lightning_hetero.watch.loss_reduction import LossReductionCheck
from lightning_hetero.watch.pipeline_report import describe_stages, summarize_stages
from lightning_hetero.watch.publish import publish_to_loggers, report_directory
from lightning_hetero.watch.watcher import JobFacts, Watcher


def _mib_list(values: Sequence[Optional[int]]) -> list:
    return ["-" if v is None else round(v / 2**20, 1) for v in values]


class HeteroJob:
    """This rank's view of the job. Objects that need the job (ranks, device) are set up in :meth:`join`."""

    def __init__(self, settings: HeteroSettings) -> None:
        self.settings = settings
        self.communication = Communication(settings.compression, settings.hierarchical)
        self.rank, self.world_size = 0, 1
        self.emulation: Union[Emulation, NoEmulation] = NoEmulation()
        self.collectives = Collectives(1, torch.device("cpu"), lambda: self.emulation.catch_up())
        self.split = SplitInForce(rank=0)
        self.sharding = DataSharding()
        self.loss_weights = LossWeights(settings.loss_reduction)
        self.micro_batch_guard = MicroBatchGuard()
        self.local: Optional[LocalTraining] = None  # local SGD / DiLoCo (train/local_sgd.py)
        self.pipeline: Optional[Pipeline] = None  # the model split into stages (train/pipeline.py), from join()
        self._pipeline_samples = 0
        self._pipeline_global_samples = 0
        self._pipeline_replan_blocked = False
        self._pipeline_replan: Optional[tuple] = None
        self._pipeline_placed_at = 0
        self.pipeline_replans: list[dict[str, Any]] = []
        self._inner_steps_rebalancer: Optional[InnerStepsRebalancer] = None
        if settings.local:
            self.local = LocalTraining(settings.sync, settings.sync_every, settings.outer, settings.compression.mode)
            self.loss_weights.local = True
        self.recovery = Recovery(settings.peer_timeout)
        self.nonfinite = NonFiniteGuard(settings.max_nonfinite_steps, lambda t: self.collectives.gather_tensor(t))
        self.loss_check = LossReductionCheck(settings.loss_reduction, self._gather_after_catch_up, rank_zero_warn)
        self.watcher: Optional[Watcher] = None
        # What the ranks told each other at setup (every rank holds the same).
        self.device_facts: list[DeviceFacts] = []
        self.precisions: list[str] = []
        self.profiles: Optional[list[RankProfile]] = None
        self._identical_devices = True
        self.memory_ceilings: Optional[list[Optional[int]]] = None  # emulated, per rank (emulate/memory.py)
        self.memory_byte_ceilings: Optional[list[Optional[int]]] = None  # (the same, in bytes of device memory)
        self.sync_batchnorm = False
        self.stage_choice: Optional[StageChoice] = None  # the automatic ZeRO stage of this trainer call, and why
        self._report_directory: Optional[Path] = None  # where this fit's plan and report go (watch/publish.py)
        self._emulated_topology: tuple[Optional[int], Optional[topology.SlowLink]] = (None, None)

    def join(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        trainer: Optional[Any],
        plugin: Any,
        sync_batchnorm: bool = False,
    ) -> None:
        """The process group exists: each capability learns its rank, the world size and the device.
        ``plugin``: a callable returning the strategy's precision plugin (it is replaced at setup);
        ``sync_batchnorm``: `Trainer(sync_batchnorm=True)` (every rank then makes as many forward passes)."""
        self.rank, self.world_size = rank, world_size
        self.sync_batchnorm = sync_batchnorm
        self.emulation = emulation_for(self.settings.speed_schedule, rank, device)
        self.collectives = Collectives(world_size, device, lambda: self.emulation.catch_up())
        self.recovery.join(self.collectives, rank)
        self.recovery.watch_peers()
        self.split.rank = rank
        self.loss_weights.join(rank, world_size, self.collectives.sum)
        self.watcher = Watcher(device, self.settings.rebalance_window, lambda: self.emulation.added_seconds,
                               self.communication.reading, self.collectives.gather_tensor)  # fmt: skip
        self.watcher.skipped_steps = lambda: list(self.nonfinite.skipped)
        self.watcher.loss_scale = lambda: loss_scale_value(plugin())
        if trainer is not None:
            self.recovery.stop_together_on_sigterm(trainer, device)
        choice = self.settings.pipeline
        if choice is not None:  # (a point-to-point wait has a deadline; without a watchdog, torch's default's 30 min)
            timeout = self.settings.peer_timeout or 1800.0
            self.pipeline = Pipeline(choice, rank, world_size, device, timeout)

    # ------------------------------------------------------------------ measure, plan, configure

    def survey(
        self, trainer: Any, fitting: bool, module: Any, device: torch.device, trainer_precision: str, zero_stage: int
    ) -> int:
        """The setup gather: every rank's arguments, data-order seed, model, device facts, precision and (automatic
        split) profile, checked to agree. Returns the global batch (0 outside fit)."""
        settings = self.settings
        # A ZeRO-3 model whose parameters are partitioned is profiled whole, once the ranks have agreed: gathering it
        # is a collective (measure/partitioned.py).
        profile_in_survey = fitting and settings.profiles_needed and not partitioned_parameters(module)

        def survey_this_rank() -> tuple[None, dict[str, Any]]:
            loader = self.sharding.request_training_loader(trainer) if fitting else None
            global_batch_size = settings.global_batch_size_for(loader, self.world_size) if fitting else None
            if fitting:
                check_trainable(loader, global_batch_size, self.world_size, settings.loss_reduction,  # type: ignore[arg-type]
                                module.automatic_optimization)  # fmt: skip
                refusal = micro_steps_refusal(settings.micro_steps, zero_stage, settings.loss_reduction,
                                              module.automatic_optimization, self.sync_batchnorm)  # fmt: skip
                if refusal:
                    raise ValueError(refusal)
            facts = collect_device_facts(device)
            precision = trainer_precision
            if settings.device_precision is not None:  # may refuse this rank's device: raised on every rank
                precision = rank_precision(settings.device_precision, self.rank, facts)
            profile = None
            if fitting and settings.local and trainer.accumulate_grad_batches > 1:
                raise ValueError(
                    f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})` with `sync="
                    f"{settings.sync!r}`: each rank steps its own optimizer on every micro-batch. Raise `sync_every`"
                    " (fewer synchronizations) or the batch size instead."
                )
            if fitting and settings.local:
                refusal = sync_refusal(settings.sync, zero_stage, settings.compression.mode, [precision],
                                       settings.micro_steps, settings.weights, settings.global_batch_size,
                                       settings.hierarchical, module.automatic_optimization)  # fmt: skip
                if refusal:
                    raise ValueError(refusal)
            if profile_in_survey:
                profile = self._profile(module, loader, global_batch_size, device, precision)  # type: ignore[arg-type]
            self._emulated_topology = settings.emulated_topology()
            agreement = settings.agreement(global_batch_size, self.communication.arguments(), self._emulated_topology)
            return None, RankSurvey(
                agreement, local_seed(), model_signature(module), facts, precision, profile
            ).to_dict()

        gathered = self.collectives.gather_or_raise("setup", survey_this_rank)[1]
        job = JobSurvey([RankSurvey.from_dict(entry) for entry in gathered])
        check_ranks_agree([rank.agreement for rank in job.ranks], [rank.model for rank in job.ranks])
        if fitting and settings.profiles_needed and not profile_in_survey:
            job = self._profile_partitioned(job, module, device)
        self.sharding.data_seed = agreed_seed([rank.seed for rank in job.ranks])
        self.device_facts, self.precisions = job.device_facts, job.precisions
        self.memory_ceilings = job.ranks[self.rank].agreement["emulate_memory"]
        self.memory_byte_ceilings = job.ranks[self.rank].agreement.get("emulate_memory_bytes")
        if fitting:
            self.profiles = within_emulated_memory(job.profiles, self.memory_ceilings)
            self._identical_devices = job.identical_devices(emulated=settings.speed_schedule is not None)
        return job.ranks[self.rank].agreement["global_batch_size"] or 0

    def _profile(self, module: Any, loader: Any, global_batch_size: int, device: torch.device, precision: str) -> Any:
        autocast = autocast_for(precision, device.type)  # measured as it will train
        return profile_rank(module, loader, global_batch_size, self.world_size, device, self.emulation.emulator,
                            autocast)  # fmt: skip

    def _profile_partitioned(self, job: JobSurvey, module: Any, device: torch.device) -> JobSurvey:
        """Every rank's profile of a model ZeRO-3 has partitioned, its parameters gathered whole for it."""
        loader = self.sharding.requested_training_loader
        global_batch_size = job.ranks[self.rank].agreement["global_batch_size"]
        precision = job.ranks[self.rank].precision
        with whole_parameters(module):
            profiles = self.collectives.gather_or_raise(
                "profiling", lambda: (None, self._profile(module, loader, global_batch_size, device, precision))
            )[1]
        return JobSurvey([replace(rank, profile=profile) for rank, profile in zip(job.ranks, profiles)])

    def plugin_for_this_rank(self, current: Any) -> Optional[HeteroPrecision]:
        """This rank's plugin when ranks have their own precisions (``device_precision``); None: keep ``current``."""
        return job_plugin(self.settings.device_precision, self.precisions, self.rank, self.device_facts,
                          self.collectives.gather_tensor, current)  # fmt: skip

    def configure_communication(self, config: dict[str, Any]) -> None:
        """Nodes from the ranks' hosts (or the emulated ones), and the exchange's settings in the DeepSpeed config."""
        hosts = [facts.hostname for facts in self.device_facts]
        emulated_nodes, slow_link = self._emulated_topology
        nodes = topology.topology_from_hosts(hosts, emulated_nodes)
        stage = config["zero_optimization"]["stage"]
        self.communication.setup(nodes, slow_link, config, stage, self.rank)
        config.update(self.communication.deepspeed_entries())

    def choose_zero_stage(
        self,
        global_batch_size: int,
        module: torch.nn.Module,
        fitting: bool,
        allowed: Sequence[int],
        half_precision_engine: bool,
    ) -> int:
        """The lowest of ``allowed`` ZeRO stages at which every rank's model state and activations fit its memory
        (:func:`~lightning_hetero.plan.zero_stage.choose_stage`; the same decision on every rank: what it reads was
        gathered). Its reason goes into the plan output."""
        parameters = list(module.parameters())
        size = ModelSize(sum(p.numel() for p in parameters), sum(p.numel() for p in parameters if p.requires_grad),
                         half_precision_engine)  # fmt: skip
        profiles = self.profiles if fitting else None
        free = [p.free_bytes for p in profiles] if profiles else [f.free_memory_bytes for f in self.device_facts]
        devices = [(f.hostname, f.kind, f.index if f.kind == "cuda" else None) for f in self.device_facts]
        activations = None
        if profiles and all(p.bytes_per_sample is not None for p in profiles):
            # The planned micro-batches (the planner's memory ceilings leave the model's state out).
            plan = self._plan_start(global_batch_size, allowed[0], module).plan
            largest = [max(micro_batch_sizes(b, k)) for b, k in zip(plan.batch_sizes, plan.micro_steps)]
            activations = [p.bytes_per_sample * b for p, b in zip(profiles, largest)]  # type: ignore[operator]
        # (an emulated ceiling is one rank's own device: applied after the host's memory is shared among its ranks)
        room = memory.capped_free_bytes(shared_free_bytes(free, devices), self.memory_byte_ceilings)
        choice = choose_stage(size, self.world_size, room, activations, allowed, fitting)
        if self.memory_byte_ceilings is not None and choice.spare_bytes is not None and choice.spare_bytes < 0:
            # (an emulated device that a real run would overflow: refused, as a real one would fail)
            raise ValueError(
                f"HeteroStrategy: {choice.reason.split('; the fit may run out of memory')[0]}, with the device memory"
                f" {memory.ENV_VAR} gives ({_mib_list(self.memory_byte_ceilings)} MiB): an out-of-memory error on a"
                " real device. Split the model instead of only the batch: `pipeline={'stages': ..., 'blocks': ...}`"
                " (each rank then holds only its stage's blocks), or give the ranks more memory."
            )
        self.stage_choice = choice
        return choice.stage

    def _plan_start(self, global_batch_size: int, zero_stage: int, module: torch.nn.Module) -> InitialPlan:
        settings = self.settings
        held = gradient_bytes_held_until_step(settings.device_precision, self.precisions, self.device_facts,
                                              zero_stage, module)  # fmt: skip
        unequal_steps = automatic_micro_steps_allowed(
            zero_stage, settings.loss_reduction, module.automatic_optimization, self.sync_batchnorm
        )
        return initial_plan(self.world_size, global_batch_size, settings.batch_sizes, settings.weights,
                            self.profiles, settings.loss_reduction, self._identical_devices, held,
                            settings.micro_steps, unequal_steps)  # fmt: skip

    def start_the_split(self, global_batch_size: int, zero_stage: int, module: torch.nn.Module) -> None:
        """The split this fit starts with and the re-planner that follows it (both planned again when a resume on
        another number of ranks keeps the checkpoint's global batch)."""
        settings = self.settings
        if settings.local:
            self._start_local_training(global_batch_size)
            return
        held = gradient_bytes_held_until_step(settings.device_precision, self.precisions, self.device_facts,
                                              zero_stage, module)  # fmt: skip
        unequal_steps = automatic_micro_steps_allowed(
            zero_stage, settings.loss_reduction, module.automatic_optimization, self.sync_batchnorm
        )
        start = self._plan_start(global_batch_size, zero_stage, module)
        if start.warning:
            rank_zero_warn(start.warning)
        smallest = [min(micro_batch_sizes(b, k)) for b, k in zip(start.plan.batch_sizes, start.plan.micro_steps)]
        few_samples = small_batchnorm_warning(smallest, module, self.sync_batchnorm)
        if few_samples:
            rank_zero_warn(few_samples)
        overflow = memory.describe_overflow(start.plan.batch_sizes, start.plan.micro_steps, self.memory_ceilings)
        if overflow:  # (every rank holds the same plan and ceilings: every rank raises it)
            raise ValueError(overflow)
        self.split.start(start.plan, start.prediction)
        # The profile's doubled batch already told mean from sum (start.warning); without it the first steps tell.
        profiled = self.profiles is not None and all(p.loss_ratio is not None for p in self.profiles)
        self.loss_check.start(self.world_size > 1 and not profiled and bool(module.automatic_optimization))
        rebalancer = None
        if settings.rebalancing(profiled=self.profiles is not None, world_size=self.world_size):
            window, threshold = settings.rebalance_window, settings.rebalance_threshold
            rebalancer = rebalancer_for(start.plan, self.profiles, held, window, threshold,
                                        fixed_micro_steps=settings.micro_steps is not None,
                                        unequal_micro_steps=unequal_steps, ceilings=self.memory_ceilings)  # fmt: skip
        assert self.watcher is not None
        self.watcher.follow(self.split, rebalancer)

    def start_pipeline(self, global_batch_size: int, module: torch.nn.Module, device: torch.device) -> int:
        """Pipeline parallelism (train/pipeline.py): the blocks measured on every rank (unless ``boundaries`` are
        given), placed on the stages by speed and memory, and this rank's stage kept; then the plan is printed."""
        pipeline, choice = self.pipeline, self.settings.pipeline
        assert pipeline is not None and choice is not None
        replicas = replicas_of(choice, self.world_size)
        if "16-mixed" in self.precisions:  # (every rank has every rank's precision: every rank raises)
            raise ValueError(
                f"HeteroStrategy(pipeline=...) with ranks in '16-mixed' (precisions {list(self.precisions)}): fp16's"
                " loss scaling is not built into the pipeline's backward. Give those ranks 'bf16-mixed' or"
                " '32-true' in `device_precision`."
            )
        replica_batch = micro_batch_sizes(global_batch_size, replicas)[0]  # (until the shares are known)
        micro_batches = choice.micro_batches_for(replica_batch)
        micro_batch = -(-replica_batch // micro_batches)
        chain, names = check_chain_shape(module, choice)
        blocks = [chain._modules[name] for name in names]
        loader = self.sharding.requested_training_loader
        if is_stream(loader):  # (every rank has the same loader: every rank raises)
            raise ValueError(
                "HeteroStrategy(pipeline=...) with an IterableDataset: every stage of a pipeline must take the same"
                " samples, which a stream per rank cannot give. Use a map-style Dataset (with `__getitem__`)."
            )
        emulator = self.emulation.emulator

        def check() -> tuple[None, None]:
            # The whole model runs here, before it is split: a chain that cannot be split fails on every rank.
            probe = first_batch(loader, 1, device, move_data_to_device)
            check_chain_order(module, blocks, names, choice.blocks, probe, device)
            return None, None

        def measure() -> dict[str, Any]:
            batch = first_batch(loader, micro_batch, device, move_data_to_device)
            return measure_blocks(module, blocks, batch, micro_batch, device, emulator).to_dict()

        self.collectives.gather_or_raise("checking the chain of blocks", check)
        measured = None
        if choice.boundaries is None:
            hosts = [facts.hostname for facts in self.device_facts]
            if len(set(hosts)) == len(hosts):  # one rank per machine: all measure at once
                gathered = self.collectives.gather_or_raise("measuring the blocks", lambda: (None, measure()))[1]
            else:
                # Ranks that share a machine measure in turns: at once, they slowed each other's block times
                # unevenly (memory bandwidth, shared cores), which misplaced a block in one run of three.
                gathered = [
                    self.collectives.gather_or_raise(
                        f"measuring the blocks (rank {turn})", lambda turn=turn: (None, measure() if turn == self.rank else None)
                    )[1][turn]
                    for turn in range(self.world_size)
                ]  # fmt: skip
            measured = [BlockMeasurement.from_dict(m) for m in gathered]
        costs = block_costs(measured, len(names), self.world_size, [training_bytes(block) for block in blocks],
                            training_bytes(module) - sum(training_bytes(block) for block in blocks),
                            memory.capped_free_bytes([None] * self.world_size, self.memory_byte_ceilings))  # fmt: skip
        placement = place_stages(costs, choice.stages, choice.schedule, micro_batches, micro_batch, choice.boundaries,
                                 ranks=tuple(range(choice.stages)), search_orders=replicas == 1,
                                 last_rank=0)  # fmt: skip
        if measured is not None and replicas > 1:  # a faster pipeline takes more samples
            pipeline.shares = pipeline_shares(costs, placement, replicas, global_batch_size)
        else:
            pipeline.shares = tuple(micro_batch_sizes(global_batch_size, replicas))
        micro_batch = -(-max(pipeline.shares) // micro_batches)
        pipeline.install(module, placement, replicas, global_batch_size)
        settings = self.settings
        # Blocks follow what the ranks measure, as the batch split does: on when placed by measurement, unless off.
        self._pipeline_replan = (choice.boundaries is None and settings.rebalance is not False, costs,
                                 micro_batches, micro_batch)  # fmt: skip
        self._pipeline_placed_at = 0
        if self.rank == 0:
            described = describe_pipeline(placement, names, choice, replicas, micro_batches, micro_batch, measured,
                                          costs.memory_bytes if self.memory_byte_ceilings else None,
                                          pipeline.shares)  # fmt: skip
            rank_zero_info(described)
        return micro_batch

    def check_pipeline_job(self, trainer: Any, precision: str, world_size: int) -> None:
        """What a pipeline cannot run (yet), raised at setup on every rank before the process group exists."""
        choice = self.settings.pipeline
        assert choice is not None
        replicas_of(choice, world_size)
        if trainer is None:
            return
        module = trainer.lightning_module
        evaluating = trainer.state.fn != TrainerFn.FITTING  # (a fit's validation runs through the stages)
        refusal = pipeline_job_refusal(precision, trainer.gradient_clip_val, trainer.accumulate_grad_batches,
                                       module.automatic_optimization, evaluating)  # fmt: skip
        if refusal:
            raise ValueError(refusal)
        if not is_overridden("configure_model", module):  # (else the chain exists only later: checked at setup)
            check_chain_shape(module, choice)
        if not any(isinstance(c, LastStageMetrics) for c in trainer.callbacks):
            # First, before the callbacks that read the metrics (Lightning runs checkpoint callbacks last).
            trainer.callbacks.insert(0, LastStageMetrics())

    @contextlib.contextmanager
    def engine_built(self) -> Iterator[None]:
        """Around ``deepspeed.initialize``: with a pipeline, the engine's broadcast of every parameter from rank 0 is
        skipped (ranks hold different blocks; the pipeline broadcast each part within its own group already)."""
        if self.pipeline is None:
            yield
            return
        from deepspeed.runtime.engine import DeepSpeedEngine

        original = DeepSpeedEngine._broadcast_model
        DeepSpeedEngine._broadcast_model = lambda engine: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            DeepSpeedEngine._broadcast_model = original  # type: ignore[method-assign]

    def _move_blocks_if_due(self, global_step: int, optimizer: Any) -> None:
        """Every ``rebalance_window`` steps: each rank's compute over the last window (the steps two after the last
        move on) against what the placement predicted; the same decision on every rank from the gathered factors,
        and the blocks moved, state and all, before this step (:mod:`lightning_hetero.plan.stages`)."""
        pipeline, replan = self.pipeline, self._pipeline_replan
        assert pipeline is not None and pipeline.placement is not None and pipeline.layout is not None
        window = self.settings.rebalance_window
        if replan is None or not replan[0] or global_step == 0 or global_step % window or self.world_size == 1:
            return
        enabled, costs, micro_batches, micro_batch = replan
        first = max(global_step - window, self._pipeline_placed_at + 2)
        recent = [compute for compute, _ in pipeline.step_times[first:global_step]]
        stages = pipeline.layout.stages
        own = replace(pipeline.placement, ranks=tuple(pipeline.replica * stages + r for r in pipeline.placement.ranks))
        predicted = stage_seconds_under(costs, own)[pipeline.stage] * pipeline.shares[pipeline.replica]
        factor = statistics.median(recent) / predicted if recent and predicted > 0 else None
        factors = self.collectives.gather_objects(factor)
        if any(f is None for f in factors):
            return  # (too few steps under this placement yet)
        if len(optimizer.param_groups) != 1:
            if not self._pipeline_replan_blocked:
                self._pipeline_replan_blocked = True
                rank_zero_warn(
                    f"HeteroStrategy(pipeline=...): the optimizer has {len(optimizer.param_groups)} parameter groups;"
                    " blocks stay where they were placed (a moved block's parameters would not know their group)."
                    " Pass `rebalance=False` to silence this, or use one parameter group."
                )
            return
        layout = pipeline.layout
        slots = [max(factors[layout.rank_of(p, s)] for p in range(layout.replicas)) for s in range(layout.stages)]
        by_rank = [0.0] * layout.stages
        for stage, slot_factor in enumerate(slots):
            by_rank[layout.order[stage]] = slot_factor
        decision = replan_stages(costs, pipeline.placement, by_rank, self.settings.rebalance_threshold,
                                 pipeline.choice.schedule, micro_batches, micro_batch)  # fmt: skip
        if decision.placement is None:
            return
        pipeline.move_blocks(decision.placement, optimizer)
        self._pipeline_placed_at = global_step
        self.pipeline_replans.append({"step": global_step, "boundaries": list(decision.placement.boundaries),
                                      "reason": decision.reason})  # fmt: skip
        rank_zero_info(f"HeteroStrategy pipeline re-plan before step {global_step}: {decision.reason}")

    def pipeline_step(
        self, batch: Any, forward: Any, backward: Any, module: torch.nn.Module, global_step: int, optimizer: Any
    ) -> torch.Tensor:
        """One training step through the stages: every micro-batch forward and backward, then the gradient sums.
        Returns the global batch's loss (on every rank, for the progress bar)."""
        pipeline = self.pipeline
        assert pipeline is not None
        self.emulation.at_step(global_step)
        self._move_blocks_if_due(global_step, optimizer)
        samples = self._pipeline_samples
        reduction = self.settings.loss_reduction
        global_batch = self._pipeline_global_samples or pipeline.global_batch  # (the last batch may be short)

        def weight_of(micro_batch_samples: int) -> float:
            return micro_batch_samples / global_batch if reduction == "mean" else 1.0

        micro_batches = pipeline.micro_batches_of(batch, samples)
        loss = pipeline.run_step(micro_batches, forward, weight_of, self.emulation.slowed, backward)
        pipeline.reduce_gradients()
        pipeline.hold_gradients(module)
        return loss

    def save_pipeline_checkpoint(self, target: Path, saved: dict[str, Any], engine: Any) -> None:
        """Each rank's blocks and optimizer state by name, rank 0's trainer state: staged, manifested, atomic."""
        pipeline = self.pipeline
        assert pipeline is not None and pipeline.placement is not None and pipeline.layout is not None

        def write(directory: Path) -> None:
            pipeline_state.save_stage(directory, self.rank, engine.module, engine.optimizer, saved)

        def facts() -> dict[str, Any]:
            return {
                "world_size": self.world_size, "global_step": saved.get("global_step"), "epoch": saved.get("epoch"),
                "zero_stage": 0, "optimizer": type(engine.optimizer).__name__,
                "devices": [facts.describe() for facts in self.device_facts],
                "pipeline": {"stages": pipeline.choice.stages, "replicas": pipeline.layout.replicas,
                             "boundaries": list(pipeline.placement.boundaries),
                             "stage_ranks": list(pipeline.placement.ranks)},
            }  # fmt: skip

        self.recovery.save(target, write, facts)

    def load_pipeline_checkpoint(self, chosen: Path, manifest: dict[str, Any], engine: Any) -> dict[str, Any]:
        """A pipeline checkpoint into this pipeline run, whatever its boundaries and number of pipelines."""
        if self.pipeline is None:
            raise ResumeRefused(
                f"Checkpoint {chosen} was saved with `pipeline` (each rank's blocks apart): resume it with `pipeline`;"
                " a pipeline checkpoint into a run without one is not built yet."
            )
        if not manifest.get("pipeline"):
            raise ResumeRefused(
                f"Checkpoint {chosen} was saved without `pipeline`: resume it without `pipeline`; a checkpoint of"
                " data-parallel training into a pipeline is not built yet."
            )
        saved = manifest["pipeline"]
        rank_zero_info(
            f"HeteroStrategy: resuming the pipeline checkpoint {chosen} (boundaries {saved['boundaries']}, "
            f"{saved['replicas']} pipeline(s)) on boundaries {list(self.pipeline.placement.boundaries)}"  # type: ignore[union-attr]
            f" and {self.pipeline.layout.replicas} pipeline(s), by parameter name."  # type: ignore[union-attr]
        )
        return pipeline_state.load_stage(chosen, engine.module, engine.optimizer)

    def pipeline_evaluation_step(self, batch: Any, forward: Any) -> Any:
        """A validation step through the stages (forward only); the last stage's output, None on the others."""
        assert self.pipeline is not None
        return self.pipeline.evaluation_step(batch, forward)

    def pipeline_backward(self) -> None:
        """Lightning's backward of the step: the schedule ran it; its gradients go back on the parameters."""
        assert self.pipeline is not None
        self.pipeline.return_gradients()

    def _start_local_training(self, global_batch_size: int) -> None:
        """Local SGD / DiLoCo: each rank's micro-batch (``batch_sizes``, else the loader's batch) taken
        ``inner_steps[r]`` times per training step: the user's counts, else as many as its profile says it computes
        while the slowest rank computes one."""
        settings = self.settings
        micro = settings.batch_sizes or (max(1, global_batch_size // self.world_size),) * self.world_size
        if settings.inner_steps is not None:
            steps = settings.inner_steps
        elif self.profiles is not None:
            steps = plan_inner_steps([profile.cost_model() for profile in self.profiles], micro)
        else:
            steps = (1,) * self.world_size
        plan = SplitPlan(tuple(b * k for b, k in zip(micro, steps)), f"{settings.sync}", tuple(steps))
        overflow = memory.describe_overflow(plan.batch_sizes, plan.micro_steps, self.memory_ceilings, True)
        if overflow:  # (each inner step holds one micro-batch: it must fit, as in every-step training)
            raise ValueError(overflow)
        self.split.start(plan, None)
        assert self.watcher is not None
        # Inner steps the user did not fix follow what the ranks measure, as the split does (one decision on all).
        rebalancer = None
        if settings.inner_steps is None and settings.rebalance is not False and self.world_size > 1:
            rebalancer = InnerStepsRebalancer(micro, steps, settings.rebalance_window)
        self._inner_steps_rebalancer = rebalancer
        assert self.local is not None
        self.local.inner_steps = lambda: self.split.plan.micro_steps  # type: ignore[union-attr]
        self.watcher.follow(self.split, rebalancer)

    def load_local_training(self, directory: Path) -> None:
        """Local training resumes: each rank's own state, and the inner steps the checkpoint ran with."""
        assert self.local is not None
        restored = self.local.load(directory, self.rank)
        if restored is not None and self._inner_steps_rebalancer is not None:
            self._inner_steps_rebalancer.restored = restored

    def local_step_done(self, samples: int, last_of_epoch: bool) -> None:
        """Local training: a training step ended; the ranks synchronize when it is time (one decision on all)."""
        if self.local is None:
            return
        self.collectives.before_each()  # an emulated slow rank reaches the synchronization when a slow device would
        self.local.step_done(samples, last_of_epoch, self._sum_in_place)

    def training_ends(self) -> None:
        """The fit's training loop ends on every rank (after local training's last synchronization): the loss check
        decides on the steps it has, if it has not yet."""
        self.loss_check.fit_ends()

    def _gather_after_catch_up(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.collectives.before_each()
        return self.collectives.gather_tensor(tensor)

    def synchronize_local_training(self) -> None:
        """Local training: synchronize now if any rank trained since the last synchronization (before a checkpoint,
        at the end of a fit); every rank calls it at the same point and decides alike (a step count, not samples)."""
        if self.local is not None and self.local.steps_since_sync > 0:
            self.collectives.before_each()
            self.local.synchronize(self._sum_in_place)

    @staticmethod
    def _sum_in_place(tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)

    def keep_the_checkpoints_global_batch(
        self, path: Path, manifest: dict[str, Any], zero_stage: int, module: torch.nn.Module
    ) -> None:
        """A resume on another number of ranks continues the same optimisation: the checkpoint's global batch.

        The default global batch (the loader's batch size times the ranks) follows the world size, so it is replaced
        by the checkpoint's and the split is planned again for it; one the user fixed must agree.
        """
        assert self.split.plan is not None
        saved, current = sum(manifest.get("batch_sizes") or []) or None, self.split.plan.global_batch_size
        if saved is None or saved == current:
            return
        if self.settings.global_batch_size is not None or self.settings.batch_sizes is not None:
            raise ResumeRefused(
                f"Checkpoint {path} was trained with a global batch of {saved} samples; this job's is {current}."
                f" Pass `global_batch_size={saved}` to continue the same optimisation (the split over this job's"
                " ranks is planned for it)."
            )
        self.start_the_split(saved, zero_stage, module)
        rank_zero_info(
            f"HeteroStrategy: keeping the checkpoint's global batch of {saved} on {self.world_size} ranks:"
            f" micro-batches {list(self.split.batch_sizes)}."
        )

    def attach(self, engine: Any, plugin: Any) -> None:
        """DeepSpeed's engine exists: the capabilities that act inside it attach (undone by :meth:`detach`)."""
        own_precision = isinstance(plugin, HeteroPrecision)
        skipping = (lambda: plugin.skips_this_step) if own_precision else (lambda: False)
        self.communication.attach(engine, self.rank, skipping)
        scaled = own_precision and plugin.loss_scale is not None
        precisions = ", ".join(sorted(set(self.precisions))) or str(plugin.precision)
        self.nonfinite.attach(engine, has_loss_scale=scaled, skipping_installed=scaled, precision=precisions)
        self.emulation.around_deepspeed_exchanges(engine)
        if self.local is not None and engine.optimizer is not None:
            # No exchange at the step: each rank steps its own optimizer on its own gradients until a synchronization.
            engine.enable_backward_allreduce = False
            self.local.attach([p for p in engine.module.parameters() if p.requires_grad], engine.optimizer)
            self.nonfinite.rank_local = self.rank
        if self.pipeline is not None:
            # The pipeline sums the gradients itself (per stage, and the outside modules over every rank).
            engine.allreduce_gradients = lambda *args, **kwargs: None

    def detach(self, plugin: Any, trainer: Optional[Any]) -> None:
        """The trainer call ends: every patch is undone, the peers' watch stops, the served loader is forgotten."""
        if isinstance(plugin, HeteroPrecision):
            plugin.detach()
        self.communication.detach()
        self.nonfinite.detach()
        if self.local is not None:
            self.local.detach()
        if self.pipeline is not None:
            self.pipeline.uninstall()
        self.recovery.teardown(finished=trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED)
        # A fit that failed before its loop asked for the training loader must not hand it to the next fit.
        self.sharding.forget_served_loader(trainer)
        self._report_directory = None

    # ------------------------------------------------------------------ data

    def shard(self, dataloader: DataLoader, trainer: Any) -> Any:
        """A loader rebuilt for this rank: the training loader by the split in force, evaluation loaders equally."""
        assert self.watcher is not None
        training = trainer.state.stage == RunningStage.TRAINING
        listeners = BatchListeners(self.training_batch, self.loss_weights.evaluation_batch,
                                   self.loss_weights.forget_evaluation_batch, self.watcher.before_fetch)  # fmt: skip
        if self.pipeline is not None:
            # Every stage of a pipeline takes the same samples: the split is over the pipelines.
            pipeline = self.pipeline
            listeners = BatchListeners(self._pipeline_batch, self.loss_weights.evaluation_batch,
                                       self.loss_weights.forget_evaluation_batch, lambda: None)  # fmt: skip
            split = pipeline.replica_batch_sizes()
            evaluation = [loader_batch_size(dataloader) or 1] * pipeline.replicas
            return self.sharding.shard(dataloader, trainer, split, self.collectives, pipeline.replica, listeners,
                                       evaluation_split=evaluation)  # fmt: skip
        split = self.split.batch_sizes if training else None
        loader = self.sharding.shard(dataloader, trainer, split, self.collectives, self.rank, listeners)
        if training:
            self.split.cut_by(loader)
        return loader

    def _pipeline_batch(self, local_samples: int, global_samples: int) -> None:
        # This pipeline's samples of the batch in hand, and the global batch's (short at an epoch's end).
        self._pipeline_samples, self._pipeline_global_samples = local_samples, global_samples

    def training_batch(self, local_samples: int, global_samples: int) -> None:
        self.loss_weights.training_batch(local_samples, global_samples)
        assert self.watcher is not None
        self.watcher.meter.batch_ready(local_samples, self.split.micro_steps)

    def training_step_starts(self, global_step: int) -> None:
        self.emulation.at_step(global_step)  # a drift schedule: the emulated speed from this step on
        self.loss_check.step_starts()  # (its gathers come here, at the same step on every rank)
        self.loss_weights.step_started()
        stream = self.sharding.training_stream
        if stream is not None:
            # Lightning drew this batch a step ahead: the step starts, and takes its counts, now.
            assert self.watcher is not None
            self.watcher.before_fetch()
            self.training_batch(*stream.batch_trained())

    def micro_batch_returned(self, samples: Optional[int], output: Any) -> None:
        """``training_step`` returned ``output`` for ``samples`` of this rank's batch (None: the whole batch)."""
        self.loss_check.loss(samples if samples is not None else self.loss_weights.batch_samples(), step_loss(output))

    def micro_batches_of(self, batch: Any) -> list[tuple[Any, Optional[int]]]:
        """The batch in hand as this rank's micro-batches and their sample counts: itself alone without micro-steps."""
        samples, steps = self.loss_weights.batch_samples(), self.split.micro_steps
        if steps == 1 or samples is None:
            return [(batch, None)]
        sizes = micro_batch_sizes(samples, steps)
        return list(zip(split_batch(batch, sizes), sizes))

    def training_order(self) -> Optional[GlobalOrder]:
        """The global order the training loader will cut (a map-style loader's), to place a restored epoch."""
        loader = self.sharding.requested_training_loader
        if isinstance(loader, DataLoader) and not is_stream(loader):
            return GlobalOrder(loader.batch_sampler.sampler, self.sharding.data_seed or 0)
        return None

    # ------------------------------------------------------------------ records

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> None:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON."""
        assert self.split.plan is not None and self.watcher is not None
        schedule = self.settings.speed_schedule
        line = self.communication.plan_line()
        if self.stage_choice is not None:
            line = f"{self.stage_choice.reason}\n{line}"
        if self.local is not None:
            settings = self.settings
            line += "\n" + describe_sync(
                settings.sync, settings.sync_every, self.split.plan.micro_steps, settings.outer
            )
        job = JobFacts(self.device_facts, self.precisions, self.profiles, schedule.to_json() if schedule else None,
                       self.communication.summary(), line)  # fmt: skip
        reduction = self.settings.loss_reduction
        # (a token mean's weight is taken from each batch's token counts)
        weight = None if reduction == "token_mean" else self.split.plan.loss_weight(self.rank, reduction)
        record = {"loss_weight": weight, "loss_reduction": reduction, "deepspeed_config": config,
                  "zero_stage_choice": self.stage_choice.reason if self.stage_choice else None}  # fmt: skip
        # Decided once per fit (a tracking logger's run name), so the report lands beside the plan.
        self._report_directory = report_directory(trainer)
        self.watcher.write_plan(self._report_directory, self.split, job, record)

    def write_report(self, trainer: Any, plugin: Any) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary."""
        if self.pipeline is not None:
            self._write_pipeline_report(trainer)
            return
        assert self.watcher is not None
        directory = self._report_directory or report_directory(trainer)
        self.watcher.write_report(
            directory,
            self.rank,
            self.world_size,
            precision=plugin.summary() if isinstance(plugin, HeteroPrecision) else None,
            communication=self.communication.summary(),
            nonfinite=self.nonfinite.summary(),
        )
        if self.rank == 0:
            published = publish_to_loggers(trainer, directory)
            if published:
                rank_zero_info(f"HeteroStrategy: the plan and run report are in the {' and '.join(published)} run too.")

    def _write_pipeline_report(self, trainer: Any) -> None:
        """Every rank's stage times gathered; rank 0 prints the per-stage summary and writes it as JSON."""
        pipeline = self.pipeline
        assert pipeline is not None
        gathered = self.collectives.gather_objects((pipeline.stage, pipeline.step_times))
        directory = self._report_directory or report_directory(trainer)
        if self.rank != 0:
            return
        summary = summarize_stages([times for _, times in gathered], [stage for stage, _ in gathered])
        assert pipeline.placement is not None
        summary.update(boundaries=list(pipeline.placement.boundaries), stage_ranks=list(pipeline.placement.ranks),
                       replans=self.pipeline_replans)  # fmt: skip
        rank_zero_info(describe_stages(summary))
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "pipeline_report.json").write_text(json.dumps(summary, indent=1))
        rank_zero_info(f"written to {directory / 'pipeline_report.json'}")

    def manifest_facts(self, saved: dict[str, Any], zero_stage: int, engine: Any) -> dict[str, Any]:
        plan = self.split.plan
        return manifest_facts(
            saved, self.world_size, plan.batch_sizes if plan is not None else None,
            self.split.global_samples_consumed(), zero_stage, engine,
            [facts.describe() for facts in self.device_facts], self.communication.checkpoint_facts(),
        )  # fmt: skip
