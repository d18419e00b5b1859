"""The job's setup: measure and plan each trainer call, from the ranks' survey to the split a fit starts with.

:class:`JobSetup` runs the setup gather (every rank's arguments, data-order seed, model, device facts, precision and
profile, checked to agree), keeps what it established (every rank holds the same), and plans from it: this rank's
precision plugin, the ZeRO stage, the exchange's settings, the split (or local training's inner steps) and the
re-planner that follows it. The decisions are the stages' pure functions (``measure/``, ``split/decisions/``,
``configure/``, ``precision/``); the refusals are :class:`~lightning_hetero.settings.HeteroSettings`'; this module
orders them and does the gathers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hetero.comm import topology
from lightning_hetero.comm.communication import Communication
from lightning_hetero.configure.lr_scaling import LrScaling, lr_scaling_for
from lightning_hetero.configure.model_agreement import model_signature
from lightning_hetero.configure.zero_stage import (
    FP32_BYTES,
    ModelSize,
    StageChoice,
    choose_stage,
    readable_bytes,
    shared_free_bytes,
)
from lightning_hetero.emulate import memory
from lightning_hetero.local.claims_refusal import describe_asynchronous_refusal
from lightning_hetero.local.inner_steps import InnerStepsRebalancer, describe_sync, local_split
from lightning_hetero.local.merges import LocalTraining
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.measure.partitioned import partitioned_parameters, whole_parameters
from lightning_hetero.measure.profiler import loss_ratio_from_loader
from lightning_hetero.measure.rank_profile import loss_reduction_mismatch
from lightning_hetero.measure.survey import JobSurvey, RankSurvey, profile_rank
from lightning_hetero.precision.choice import rank_precision
from lightning_hetero.precision.job import gradient_bytes_held_until_step, job_plugin
from lightning_hetero.precision.plugin import HeteroPrecision, autocast_for
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.settings import HeteroSettings, check_ranks_agree
from lightning_hetero.split.decisions.initial import InitialPlan, initial_plan, rebalancer_for, within_emulated_memory
from lightning_hetero.split.decisions.micro_steps import automatic_micro_steps_allowed
from lightning_hetero.split.decisions.split import SplitPlan, micro_batch_sizes
from lightning_hetero.split.optimizer_shards import optimizer_rooms
from lightning_hetero.train.lr_scaling import scale_optimizers
from lightning_hetero.train.order import agreed_seed, local_seed
from lightning_hetero.train.sharding import DataSharding, check_trainable
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.train.sync_batchnorm import small_batchnorm_warning
from lightning_hetero.watch.loss_reduction import LossReductionCheck
from lightning_hetero.watch.publish import report_directory
from lightning_hetero.watch.watcher import JobFacts, Watcher


def _sizes(values: Any) -> str:
    """Each rank's emulated device memory, readable ("-": no ceiling)."""
    return ", ".join("-" if v is None else readable_bytes(v) for v in values)


class JobSetup:
    """What the ranks established at setup, and the planning that reads it. Its inputs are named: the ``settings``,
    the ``split`` in force, the data ``sharding``, the ``communication``, the ``loss_check``, and local training
    (``local``, or None); what exists once the process group does (the ranks, their collectives, the emulation and
    the watcher) comes with :meth:`join`."""

    def __init__(
        self,
        settings: HeteroSettings,
        split: SplitInForce,
        sharding: DataSharding,
        communication: Communication,
        loss_check: LossReductionCheck,
        local: Optional[LocalTraining],
    ) -> None:
        self._settings, self._split, self._sharding = settings, split, sharding
        self._communication, self._loss_check, self._local = communication, loss_check, local
        self._rank, self._world_size = 0, 1
        self._collectives: Any = None  # (from join)
        self._emulation: Any = None
        self._watcher: Optional[Watcher] = None
        self.device_facts: list[DeviceFacts] = []
        self.precisions: list[str] = []
        self.profiles: Optional[list[Any]] = None  # every rank's RankProfile (automatic split only)
        self.optimizer_shards_line = ""  # memory-sized shards' line in the plan (split/optimizer_shards.py)
        self.loss_ratios: list[Optional[float]] = []  # every rank's loss on a batch given twice over its own, or None
        self.identical_devices = True
        self.memory_ceilings: Optional[list[Optional[int]]] = None  # emulated, per rank (emulate/memory.py)
        self.memory_byte_ceilings: Optional[list[Optional[int]]] = None  # (the same, in bytes of device memory)
        self.sync_batchnorm = False
        self.stage_choice: Optional[StageChoice] = None  # the automatic ZeRO stage of this trainer call, and why
        self._emulated_topology: tuple[Optional[int], Optional[topology.SlowLink]] = (None, None)
        self._inner_steps_rebalancer: Optional[InnerStepsRebalancer] = None
        self.pending_lr_scaling: Optional[LrScaling] = None  # decided at a resume, applied as training starts
        self.fitting = False  # whether this trainer call fits (set by the survey)

    def join(self, rank: int, world_size: int, collectives: Any, emulation: Any, watcher: Optional[Watcher]) -> None:
        """The process group exists: this rank, the world size, the job's collectives, emulation and watcher."""
        self._rank, self._world_size = rank, world_size
        self._collectives, self._emulation, self._watcher = collectives, emulation, watcher

    # ------------------------------------------------------------------ measure

    def survey(
        self, trainer: Any, fitting: bool, module: Any, device: torch.device, trainer_precision: str, zero_stage: int
    ) -> int:
        """The setup gather: every rank's arguments, data-order seed, model, device facts, precision and (automatic
        split) profile, checked to agree. Returns the global batch (0 outside fit)."""
        settings = self._settings
        # (A scaling that an earlier resumed fit never applied is not this call's.)
        self.fitting, self.pending_lr_scaling = fitting, None
        # A ZeRO-3 model whose parameters are partitioned is profiled whole, once the ranks have agreed: gathering it
        # is a collective (measure/partitioned.py).
        profile_in_survey = fitting and settings.profiles_needed and not partitioned_parameters(module)

        def survey_this_rank() -> tuple[None, dict[str, Any]]:
            loader, global_batch_size = None, None  # (outside fit: none)
            if fitting:
                loader = self._sharding.request_training_loader(trainer)
                global_batch_size = settings.global_batch_size_for(loader, self._world_size)
                check_trainable(
                    loader, global_batch_size, self._world_size, settings.loss_reduction, module.automatic_optimization
                )
            facts = collect_device_facts(device)
            precision = trainer_precision
            if settings.device_precision is not None:  # may refuse this rank's device: raised on every rank
                precision = rank_precision(settings.device_precision, self._rank, facts)
            if fitting:
                settings.check_fit(
                    zero_stage=zero_stage,
                    precision=precision,
                    sync_batchnorm=self.sync_batchnorm,
                    automatic_optimization=module.automatic_optimization,
                    accumulate_grad_batches=trainer.accumulate_grad_batches,
                )
                refusal = (
                    describe_asynchronous_refusal(trainer, loader, module, self._world_size)
                    if settings.asynchronous
                    else None
                )
                if refusal:
                    raise ValueError(refusal)
            profile, loss_ratio = None, None
            if profile_in_survey:  # (in a fit only)
                assert global_batch_size is not None
                profile = self._profile(module, loader, global_batch_size, device, precision)
            elif fitting:
                loss_ratio = self._fixed_split_loss_ratio(module, loader, device, precision, global_batch_size)
            self._emulated_topology = topology.emulated_topology()
            agreement = settings.agreement(global_batch_size, self._communication.arguments(), self._emulated_topology)
            return None, RankSurvey(
                agreement, local_seed(), model_signature(module), facts, precision, profile, loss_ratio
            ).to_dict()

        gathered = self._collectives.gather_or_raise("setup", survey_this_rank)[1]
        surveyed = JobSurvey([RankSurvey.from_dict(entry) for entry in gathered])
        check_ranks_agree([rank.agreement for rank in surveyed.ranks], [rank.model for rank in surveyed.ranks])
        if fitting and settings.profiles_needed and not profile_in_survey:
            surveyed = self._profile_partitioned(surveyed, module, device)
        self._sharding.data_seed = agreed_seed([rank.seed for rank in surveyed.ranks])
        self.device_facts, self.precisions = surveyed.device_facts, surveyed.precisions
        self.memory_ceilings = surveyed.ranks[self._rank].agreement["emulate_memory"]
        self.memory_byte_ceilings = surveyed.ranks[self._rank].agreement.get("emulate_memory_bytes")
        if fitting:
            self.profiles = within_emulated_memory(surveyed.profiles, self.memory_ceilings)
            self.loss_ratios = surveyed.loss_ratios
            self.identical_devices = surveyed.identical_devices(emulated=settings.speed_schedule is not None)
        return surveyed.ranks[self._rank].agreement["global_batch_size"] or 0

    def _profile(self, module: Any, loader: Any, global_batch_size: int, device: torch.device, precision: str) -> Any:
        autocast = autocast_for(precision, device.type)  # measured as it will train
        return profile_rank(
            module, loader, global_batch_size, self._world_size, device, self._emulation.emulator, autocast
        )

    def _fixed_split_loss_ratio(
        self, module: Any, loader: Any, device: torch.device, precision: str, global_batch_size: Optional[int]
    ) -> Optional[float]:
        """A fixed unequal split's check of ``loss_reduction``, once, before the first step (the automatic split's
        profile makes its own): the loss of this rank's micro-batch given twice over its own, without gradients
        (:func:`~lightning_hetero.measure.profiler.loss_ratio_from_loader`). None where it is not needed (one rank,
        an equal split, local training, a pipeline, manual optimization) or cannot be made (a stream, a model ZeRO-3
        has partitioned, a step that fails outside the loop): the first steps' losses tell there instead
        (:class:`~lightning_hetero.watch.loss_reduction.LossReductionCheck`)."""
        settings = self._settings
        if (
            self._world_size == 1
            or not settings.fixed_split_is_unequal
            or settings.local
            or settings.pipeline is not None
            or not module.automatic_optimization
            or settings.loss_reduction not in ("mean", "sum")
            or partitioned_parameters(module)
        ):
            return None
        # (the rank's micro-batch: the ratio is exact at any size, the size only keeps the check within its memory)
        if settings.batch_sizes is not None:
            size = settings.batch_sizes[self._rank]
        elif settings.weights is not None and global_batch_size:
            size = int(global_batch_size * settings.weights[self._rank] / sum(settings.weights))
        else:
            return None
        if settings.micro_steps is not None and size:
            size = micro_batch_sizes(size, settings.micro_steps[self._rank])[0]
        if not size:
            return None
        module.to(device)  # DeepSpeed would move it there next anyway
        try:
            return loss_ratio_from_loader(module, loader, size, device, autocast_for(precision, device.type))
        except Exception:  # noqa: BLE001 - a step that runs only inside Lightning's loop: the slope check decides
            return None

    def _profile_partitioned(self, surveyed: JobSurvey, module: Any, device: torch.device) -> JobSurvey:
        """Every rank's profile of a model ZeRO-3 has partitioned, its parameters gathered whole for it."""
        loader = self._sharding.requested_training_loader
        global_batch_size = surveyed.ranks[self._rank].agreement["global_batch_size"]
        precision = surveyed.ranks[self._rank].precision
        with whole_parameters(module):
            profiles = self._collectives.gather_or_raise(
                "profiling", lambda: (None, self._profile(module, loader, global_batch_size, device, precision))
            )[1]
        return JobSurvey([replace(rank, profile=profile) for rank, profile in zip(surveyed.ranks, profiles)])

    # ------------------------------------------------------------------ configure

    def plugin_for_this_rank(self, current: Any) -> Optional[HeteroPrecision]:
        """This rank's plugin when ranks have their own precisions (``device_precision``); None: keep ``current``."""
        return job_plugin(
            self._settings.device_precision,
            self.precisions,
            self._rank,
            self.device_facts,
            self._collectives.gather_tensor,
            current,
        )

    def configure_communication(self, config: dict[str, Any]) -> None:
        """Nodes from the ranks' hosts (or the emulated ones), and the exchange's settings in the DeepSpeed config."""
        hosts = [facts.hostname for facts in self.device_facts]
        emulated_nodes, slow_link = self._emulated_topology
        nodes = topology.topology_from_hosts(hosts, emulated_nodes)
        stage = config["zero_optimization"]["stage"]
        elsewhere = "memory-sized shards reduce each gradient to its owner" if self._settings.shards_by_memory else None
        self._communication.setup(nodes, slow_link, config, stage, self._rank, elsewhere)
        config.update(self._communication.deepspeed_entries())

    def choose_zero_stage(
        self,
        global_batch_size: int,
        module: LightningModule,
        fitting: bool,
        allowed: tuple[int, ...],
        half_precision_engine: bool,
    ) -> int:
        """The lowest of ``allowed`` ZeRO stages at which every rank's model state and activations fit its memory
        (:func:`~lightning_hetero.configure.zero_stage.choose_stage`; the same decision on every rank: what it reads was
        gathered). Its reason goes into the plan output."""
        size, room, activations = self._memory_view(
            global_batch_size, module, fitting, allowed[0], half_precision_engine
        )
        choice = choose_stage(size, self._world_size, room, activations, allowed, fitting)
        reason = choice.reason.split("; the fit may run out of memory")[0]
        self._refuse_an_emulated_misfit(choice, f"HeteroStrategy: {reason}")
        self.stage_choice = choice
        return choice.stage

    def check_given_stage_fits(
        self, global_batch_size: int, module: LightningModule, fitting: bool, stage: int, half_precision_engine: bool
    ) -> None:
        """A ZeRO stage the user gave to data-parallel training, against emulated device memory: refused when the
        model state and activations do not fit it, as a real device of that memory would fail (real devices are left
        to DeepSpeed). A pipeline places its stages within the memory itself, local training keeps whole states at
        ZeRO-0 by design, and memory-sized shards check their own shares (split/optimizer_shards.py)."""
        settings = self._settings
        if self.memory_byte_ceilings is None or settings.pipeline is not None or settings.local:
            return
        if settings.shards_by_memory:
            return
        size, room, activations = self._memory_view(global_batch_size, module, fitting, stage, half_precision_engine)
        choice = choose_stage(size, self._world_size, room, activations, (stage,), fitting)
        misfit = choice.reason.split("do not fit at any stage (")[-1].split("); the fit may run out of memory")[0]
        self._refuse_an_emulated_misfit(choice, f"HeteroStrategy(stage={stage}): {misfit}")

    def _refuse_an_emulated_misfit(self, choice: StageChoice, what: str) -> None:
        if self.memory_byte_ceilings is not None and choice.spare_bytes is not None and choice.spare_bytes < 0:
            # (an emulated device that a real run would overflow: refused, as a real one would fail). Memory-sized
            # shards keep the whole parameters and gradients on every rank: a way out only below ZeRO-3.
            shards = (
                " shard the optimizer state by memory (`stage=1` or `2`, `shards='memory'`),"
                if choice.stage < 3
                else ""
            )
            raise ValueError(
                f"{what}, with the device memory {memory.ENV_VAR} gives ({_sizes(self.memory_byte_ceilings)}):"
                " an out-of-memory error on a real device. Split the model instead of only the batch:"
                f" `pipeline={{'stages': ..., 'blocks': ...}}` (each rank then holds only its stage's blocks),{shards}"
                " or give the ranks more memory."
            )

    def _memory_view(
        self, global_batch_size: int, module: LightningModule, fitting: bool, stage: int, half_precision_engine: bool
    ) -> tuple[ModelSize, list[Optional[float]], Optional[list[float]]]:
        """The model's size, each rank's free memory (its device's share, within its emulated ceiling) and its
        activations at the micro-batch planned at ``stage`` (None: not measured)."""
        parameters = list(module.parameters())
        size = ModelSize(
            sum(p.numel() for p in parameters),
            sum(p.numel() for p in parameters if p.requires_grad),
            half_precision_engine,
        )

        def planned() -> SplitPlan:  # (the planner's memory ceilings leave the model's state out)
            held, unequal = self._held_bytes(stage, module), self._unequal_steps(stage, module)
            return self._plan_start(global_batch_size, held, unequal).plan

        free, activations = self._free_and_activations(self.profiles if fitting else None, planned)
        return size, free, activations

    def _free_and_activations(
        self, profiles: Optional[list[Any]], plan: Callable[[], SplitPlan]
    ) -> tuple[list[Optional[float]], Optional[list[float]]]:
        """Each rank's free memory (the profile's, else its device facts'; its device's share, within its emulated
        ceiling) and its activations at the largest micro-batch of ``plan()`` (asked only when every profile measured
        its bytes per sample; None: not measured)."""
        free = [p.free_bytes for p in profiles] if profiles else [f.free_memory_bytes for f in self.device_facts]
        activations = None
        if profiles and all(p.bytes_per_sample is not None for p in profiles):
            split = plan()
            largest = [max(micro_batch_sizes(b, k)) for b, k in zip(split.batch_sizes, split.micro_steps)]
            activations = [p.bytes_per_sample * b for p, b in zip(profiles, largest)]
        devices = [(f.hostname, f.kind, f.index if f.kind == "cuda" else None) for f in self.device_facts]
        # (an emulated ceiling is one rank's own device: applied after the host's memory is shared among its ranks)
        return memory.capped_free_bytes(shared_free_bytes(free, devices), self.memory_byte_ceilings), activations

    def optimizer_rooms(self, module: LightningModule) -> tuple[list[Optional[float]], bool]:
        """What each rank's memory leaves for its share of the optimizer state under the split in force
        (:func:`~lightning_hetero.split.optimizer_shards.optimizer_rooms`), and whether the memory is emulated."""
        in_force = self._split.plan
        assert in_force is not None, "the split starts first"
        free, activations = self._free_and_activations(self.profiles, lambda: in_force)
        parameters = list(module.parameters())
        model_bytes = sum(FP32_BYTES * p.numel() * (2 if p.requires_grad else 1) for p in parameters)
        rooms = optimizer_rooms(free, model_bytes, activations)
        return rooms, self.memory_byte_ceilings is not None

    # ------------------------------------------------------------------ plan

    def _held_bytes(self, zero_stage: int, module: torch.nn.Module) -> float:
        return gradient_bytes_held_until_step(
            self._settings.device_precision, self.precisions, self.device_facts, zero_stage, module
        )

    def _unequal_steps(self, zero_stage: int, module: LightningModule) -> bool:
        return automatic_micro_steps_allowed(
            zero_stage, self._settings.loss_reduction, module.automatic_optimization, self.sync_batchnorm
        )

    def _plan_start(self, global_batch_size: int, held_bytes: float, unequal_steps: bool) -> InitialPlan:
        """The split a fit starts with (``held_bytes``: :meth:`_held_bytes`; ``unequal_steps``:
        :meth:`_unequal_steps`, both at the fit's ZeRO stage)."""
        settings = self._settings
        return initial_plan(
            self._world_size,
            global_batch_size,
            settings.batch_sizes,
            settings.weights,
            self.profiles,
            settings.loss_reduction,
            self.identical_devices,
            held_bytes,
            settings.micro_steps,
            unequal_steps,
        )

    def start_the_split(self, global_batch_size: int, zero_stage: int, module: LightningModule) -> None:
        """The split this fit starts with and the re-planner that follows it (both planned again when a resume on
        another number of ranks keeps the checkpoint's global batch)."""
        settings = self._settings
        if settings.local:
            self._start_local_training(global_batch_size)
            return
        held, unequal = self._held_bytes(zero_stage, module), self._unequal_steps(zero_stage, module)
        start = self._plan_start(global_batch_size, held, unequal)
        if start.warning:
            rank_zero_warn(start.warning)
        smallest = [min(micro_batch_sizes(b, k)) for b, k in zip(start.plan.batch_sizes, start.plan.micro_steps)]
        few_samples = small_batchnorm_warning(smallest, module, self.sync_batchnorm)
        if few_samples:
            rank_zero_warn(few_samples)
        overflow = memory.describe_overflow(start.plan.batch_sizes, start.plan.micro_steps, self.memory_ceilings)
        if overflow:  # (every rank holds the same plan and ceilings: every rank raises it)
            raise ValueError(overflow)
        self._split.start(start.plan, start.prediction)
        # A batch given twice tells mean from sum: the automatic split's profile (warned as start.warning) or a fixed
        # split's check before the first step; where no rank could double one, the first steps' losses tell.
        told = any(ratio is not None for ratio in self.loss_ratios)
        if told and self.profiles is None:
            mismatch = loss_reduction_mismatch(
                self.loss_ratios, settings.loss_reduction, "the check before the first step"
            )
            if mismatch:
                rank_zero_warn(mismatch)
        self._loss_check.start(self._world_size > 1 and not told and bool(module.automatic_optimization))
        rebalancer = None
        if settings.rebalancing(profiled=self.profiles is not None, world_size=self._world_size):
            rebalancer = rebalancer_for(
                start.plan,
                self.profiles,
                held,
                settings.rebalance_window,
                settings.rebalance_threshold,
                fixed_micro_steps=settings.micro_steps is not None,
                unequal_micro_steps=unequal,
                ceilings=self.memory_ceilings,
            )
        assert self._watcher is not None  # (joined)
        self._watcher.follow(self._split, rebalancer)

    def _start_local_training(self, global_batch_size: int) -> None:
        """Local SGD / DiLoCo: each rank's micro-batch taken ``inner_steps[r]`` times per training step
        (:func:`~lightning_hetero.local.inner_steps.local_split`); unless given, the inner steps follow what the ranks
        measure, as the split does (one decision on all)."""
        settings = self._settings
        costs = [profile.cost_model() for profile in self.profiles] if self.profiles is not None else None
        # (Asynchronous merges: one micro-batch a training step on every rank, as many steps as each has time for.)
        inner_steps = (1,) * self._world_size if settings.asynchronous else settings.inner_steps
        plan = local_split(settings.sync, self._world_size, global_batch_size, settings.batch_sizes, inner_steps, costs)
        overflow = memory.describe_overflow(plan.batch_sizes, plan.micro_steps, self.memory_ceilings, True)
        if overflow:  # (each inner step holds one micro-batch: it must fit, as in every-step training)
            raise ValueError(overflow)
        self._split.start(plan, None)
        rebalancer = None
        if inner_steps is None and settings.rebalance is not False and self._world_size > 1:
            micro = tuple(b // k for b, k in zip(plan.batch_sizes, plan.micro_steps))
            rebalancer = InnerStepsRebalancer(micro, plan.micro_steps, settings.rebalance_window)
        self._inner_steps_rebalancer = rebalancer
        assert self._local is not None and self._watcher is not None  # (local training, joined)

        def inner_steps_in_force() -> tuple[int, ...]:  # (what a checkpoint records)
            assert self._split.plan is not None
            return self._split.plan.micro_steps

        self._local.inner_steps = inner_steps_in_force
        self._watcher.follow(self._split, rebalancer)

    def load_local_training(self, directory: Path) -> None:
        """Local training resumes: each rank's own state, and the inner steps the checkpoint ran with (nothing to do
        without local training)."""
        if self._local is None:
            return
        restored = self._local.load(directory, self._rank)
        if restored is not None and self._inner_steps_rebalancer is not None:
            self._inner_steps_rebalancer.restored = restored

    def settle_the_global_batch(
        self, path: Path, manifest: dict[str, Any], zero_stage: int, module: LightningModule, same_world_size: bool
    ) -> None:
        """A resume whose global batch differs from the checkpoint's (``manifest``'s split; none: a file).

        By default a resume on another number of ranks continues the same optimisation: the default global batch (the
        loader's batch size times the ranks) follows the world size, so it is replaced by the checkpoint's and the
        split planned again for it; one the user fixed must agree. With ``lr_scaling`` the job's own global batch is
        kept and the learning rate follows it as training starts (:meth:`scale_learning_rate`). On the same ranks
        a changed global batch is the user's: it is kept, and said.
        """
        self.pending_lr_scaling = None
        if self._split.plan is None or not self.fitting:  # (validate/test(ckpt_path=...) keep the last fit's plan)
            return
        saved, current = sum(manifest.get("batch_sizes") or []) or None, self._split.plan.global_batch_size
        rule = self._settings.lr_scaling
        if saved is None and rule is not None:
            rank_zero_info(
                f"HeteroStrategy: checkpoint {path} does not record its global batch: lr_scaling={rule!r}"
                " has nothing to scale from."
            )
        if saved is None or saved == current:
            return
        if rule is not None or same_world_size:
            self.pending_lr_scaling = lr_scaling_for(rule, saved, current)
            if rule is None and self._local is None:  # (local SGD's plan: micro-batch x inner steps, re-planned)
                rank_zero_info(
                    f"HeteroStrategy: the global batch is {current} samples, the checkpoint's {saved};"
                    " the learning rate is the checkpoint's (`lr_scaling='linear'` or `'sqrt'` scales"
                    " it)."
                )
            return
        if self._settings.global_batch_size is not None or self._settings.batch_sizes is not None:
            raise ResumeRefused(
                f"Checkpoint {path} was trained with a global batch of {saved} samples; this job's is {current}."
                f" Pass `global_batch_size={saved}` to continue the same optimisation (the split over this job's"
                f" ranks is planned for it), or `lr_scaling='linear'` or `'sqrt'` to train on with {current} and the"
                " learning rate scaled to it."
            )
        self.start_the_split(saved, zero_stage, module)
        rank_zero_info(
            f"HeteroStrategy: keeping the checkpoint's global batch of {saved} on {self._world_size} ranks:"
            f" micro-batches {list(self._split.batch_sizes)}."
        )

    def scale_learning_rate(self, trainer: Any) -> None:
        """At the start of the resumed fit's training (the optimizers' and schedulers' states are restored by then,
        and no step has run, so a checkpoint saved before the first step records the scaled rates): the scaling
        :meth:`settle_the_global_batch` decided, on every rank's optimizers, said once."""
        scaling, self.pending_lr_scaling = self.pending_lr_scaling, None
        if scaling is not None and trainer is not None:
            schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
            decoupled = scale_optimizers(trainer.optimizers, schedulers, scaling)
            rank_zero_info(scaling.describe(decoupled))

    def plan_lines(self, plan: SplitPlan) -> str:
        """The plan output's lines below the table: the ZeRO stage's reason, the exchange, local training's sync."""
        settings = self._settings
        line = self._communication.plan_line()
        if self.optimizer_shards_line:
            line = f"{self.optimizer_shards_line}\n{line}"
        if self.stage_choice is not None:
            line = f"{self.stage_choice.reason}\n{line}"
        if settings.local:
            line += "\n" + describe_sync(
                settings.sync,
                settings.sync_every,
                plan.micro_steps,
                settings.outer,
                settings.fragments,
                settings.overlap,
                settings.eager,
            )
        return line

    def write_plan(self, trainer: Any, config: dict[str, Any]) -> Optional[Path]:
        """Rank 0 prints the plan table; every rank writes its config (and rank 0 the whole plan) as JSON, in the
        directory returned (decided once per fit: a tracking logger's run name; the report lands beside it; None
        when nothing is written: no logger and no folder named)."""
        assert self._split.plan is not None and self._watcher is not None
        schedule = self._settings.speed_schedule
        facts = JobFacts(
            self.device_facts,
            self.precisions,
            self.profiles,
            schedule.to_json() if schedule else None,
            self._communication.summary(),
            self.plan_lines(self._split.plan),
        )
        reduction = self._settings.loss_reduction
        # (a token mean's weight is taken from each batch's token counts)
        weight = None if reduction == "token_mean" else self._split.plan.loss_weight(self._rank, reduction)
        choice = self.stage_choice.reason if self.stage_choice else None
        record = {
            "loss_weight": weight,
            "loss_reduction": reduction,
            "deepspeed_config": config,
            "zero_stage_choice": choice,
        }
        directory = report_directory(trainer, self._collectives.gather_objects)
        self._watcher.write_plan(directory, self._split, facts, record)
        return directory
