"""Watch: the strategy's one handle on what a fit measures, re-plans and reports.

:class:`Watcher` holds this rank's step meter and the job's records (:mod:`.meter`), the split follower that re-plans
(:mod:`.follower`), and writes the plan records at the start of a fit and the run report at its end (:mod:`.report`).
:class:`~lightning_hetero.watch.monitor.HeteroMonitor` reads it, and only it, as ``trainer.strategy.watcher``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hetero.emulate.slowdown import compute_clock, held_clock, host_clock
from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.measure.rank_profile import RankProfile
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.watch import report
from lightning_hetero.watch.follower import SplitFollower, SplitRebalancer
from lightning_hetero.watch.meter import RunWatch, StepMeter, TensorGather
from lightning_hetero.watch.trace import StepTracer, traces_text, write_merged

PLAN_DIRNAME = "hetero"  # under the run's log directory: the plan records and the run report


@dataclass(frozen=True)
class JobFacts:
    """What the ranks gathered at setup, for the plan records and the plan table."""

    device_facts: Sequence[DeviceFacts]
    precisions: Sequence[str]
    profiles: Optional[Sequence[RankProfile]]
    emulate_speeds: Any  # the speed schedule as JSON, or None
    communication: dict[str, Any]  # Communication.summary()
    communication_line: str  # Communication.plan_line()


class Watcher:
    """This rank's measurements of a fit, the re-plans, and the files and lines a person reads."""

    def __init__(
        self,
        device: torch.device,
        window: int,
        added_seconds: Callable[[], float],
        wire_bytes: Callable[[], Any],
        gather_tensor: TensorGather,
        link_wait: Callable[[], float] = lambda: 0.0,
        trace: Optional[tuple[int, ...]] = None,
    ) -> None:
        self.meter = StepMeter(
            compute_clock(device),
            added_seconds,
            wire_bytes=wire_bytes,
            link_wait=link_wait,
            host_clock=host_clock(device),
            held_clock=held_clock(),
        )
        self.run = RunWatch(self.meter, window=window)
        self.tracer = StepTracer(trace, device) if trace else None
        self.run.tracer = self.tracer
        self._gather_tensor = gather_tensor
        self.follower: Optional[SplitFollower] = None
        self.skipped_steps: Callable[[], list[int]] = list
        self.loss_scale: Callable[[], Optional[float]] = lambda: None

    def follow(self, split: SplitInForce, rebalancer: Optional[SplitRebalancer]) -> None:
        """Re-plan ``split`` with ``rebalancer`` (None: measure and exchange only, for the report)."""
        if self.follower is None:
            self.follower = SplitFollower(self.run, self._gather_tensor, rebalancer, split)
        self.follower.split, self.follower.rebalancer = split, rebalancer

    def stop_tracing(self) -> None:
        """The trainer call ends (a rank that raised included): a trace still recording stops and is written."""
        if self.tracer is not None:
            try:
                self.tracer.stop()
            except Exception as error:  # (in teardown: never in place of the error that ended the call)
                rank_zero_warn(f"HeteroStrategy: the profiler trace could not be written: {error!r}")

    def before_fetch(self) -> None:
        if self.follower is not None:
            self.follower.before_fetch()

    @property
    def steps(self) -> list[dict[str, Any]]:
        """Every training step so far, as the ranks exchanged them (``report.json``'s ``steps``)."""
        return self.run.steps

    @property
    def replans(self) -> list[dict[str, Any]]:
        """The re-plans of this fit so far, as in the run report: ``{"step", "batch_sizes", "predicted_gain"}``."""
        return [replan.to_dict() for replan in self.follower.replans] if self.follower is not None else []

    def write_plan(
        self, directory: Optional[Path], split: SplitInForce, job: JobFacts, rank_record: dict[str, Any]
    ) -> None:
        """Every rank writes ``rank_<r>.json`` (its device, config, profile); rank 0 ``plan.json`` and prints the
        table. ``directory``: None writes nothing (no logger and no folder named: :mod:`.publish`)."""
        assert split.plan is not None
        rank = split.rank
        if self.tracer is not None:  # (its file goes beside the report, at the last chosen step)
            if directory is None:
                raise ValueError(
                    "HeteroStrategy(trace=...) writes its trace files beside the run report, and this Trainer has no"
                    " logger and no folder to write into. Give it a logger, or `Trainer(default_root_dir=...)`."
                )
            self.tracer.directory, self.tracer.rank, self.tracer.written = directory, rank, None
        plan = {
            "source": split.plan.source,
            "global_batch_size": split.plan.global_batch_size,
            "batch_sizes": list(split.plan.batch_sizes),
            "micro_steps": list(split.plan.micro_steps),
            "prediction": split.prediction,
            "emulate_speeds": job.emulate_speeds,
            "precisions": list(job.precisions),
            "communication": job.communication,
        }
        record = {
            "rank": rank,
            "device": job.device_facts[rank].to_dict(),
            "precision": job.precisions[rank],
            "plan": plan,
            **rank_record,
            "profile": job.profiles[rank].to_dict() if job.profiles else None,
        }
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"rank_{rank}.json").write_text(json.dumps(record, indent=2, default=str))
        if rank != 0:
            return
        everything = {
            **plan,
            "devices": [facts.to_dict() for facts in job.device_facts],
            "profiles": [profile.to_dict() for profile in job.profiles] if job.profiles else None,
        }
        if directory is not None:
            (directory / "plan.json").write_text(json.dumps(everything, indent=2, default=str))
        stage = rank_record["deepspeed_config"].get("zero_optimization", {}).get("stage", 0)
        devices = [facts.describe() for facts in job.device_facts]
        table = report.plan_text(split.plan, stage, devices, list(job.precisions), job.profiles, split.prediction)
        rank_zero_info(f"{table}\n{job.communication_line}" + (f"\nwritten to {directory}" if directory else ""))

    def write_report(
        self, directory: Optional[Path], rank: int, world_size: int, could_replan: bool = False, **sections: Any
    ) -> None:
        """Every rank hands in its last records; rank 0 writes the run report and prints its summary (``directory``:
        None prints it only).

        ``could_replan``: whether ``rebalance=True`` would re-plan this job's split; ``sections``: the report's
        ``precision``, ``communication``, ``nonfinite`` and ``asynchronous`` parts.
        """
        steps = self.run.finish(self._gather_tensor)
        if directory is not None:
            report.add_rank_wire(directory / f"rank_{rank}.json", steps, rank)
        if rank != 0:
            return
        measuring = self.run.exchange_seconds + (self.follower.decision_seconds if self.follower else 0.0)
        followed = self.follower is not None and self.follower.rebalancer is not None
        replanning = True if followed else (False if could_replan else None)
        run_report = report.build_report(
            steps, self.replans, world_size, exchange_seconds=measuring, replanning=replanning, **sections
        )
        if self.tracer is not None and directory is not None:
            run_report["traces"] = write_merged(directory, world_size, self.tracer.steps)
        summary = report.summary_text(run_report) + traces_text(run_report.get("traces"), len(steps))
        if directory is None:
            rank_zero_info(summary)
            return
        json_path, png_path = report.write_report(run_report, directory)
        rank_zero_info(f"{summary}\nwritten to {json_path} and {png_path.name}")
