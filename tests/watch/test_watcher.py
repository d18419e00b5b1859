"""The Watcher: the plan records a fit starts with, and the one object HeteroMonitor reads."""

from __future__ import annotations

import json

import torch

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.measure.devices import collect_device_facts
from lightning_hetero.split.decisions.replan import Rebalancer
from lightning_hetero.split.decisions.split import SplitPlan
from lightning_hetero.train.split_in_force import SplitInForce
from lightning_hetero.watch.watcher import JobFacts, Watcher


def watcher():
    return Watcher(
        torch.device("cpu"),
        window=20,
        added_seconds=lambda: 0.0,
        wire_bytes=lambda: None,
        gather_tensor=lambda tensor: [tensor, tensor],
    )


def job_facts():
    facts = collect_device_facts("cpu")
    return JobFacts([facts, facts], ["32-true", "bf16-mixed"], None, [1.0, 0.5], {"compression": None}, "uncompressed")


def test_every_rank_writes_its_record_and_rank_0_the_plan_and_the_table(tmp_path, capsys):
    for rank in (1, 0):
        split = SplitInForce(rank)
        split.start(SplitPlan((10, 6), source="fixed"), None)
        record = {
            "loss_weight": 1.25,
            "loss_reduction": "mean",
            "deepspeed_config": {"zero_optimization": {"stage": 2}},
        }
        watcher().write_plan(tmp_path, split, job_facts(), record)
        written = json.loads((tmp_path / f"rank_{rank}.json").read_text())
        assert written["rank"] == rank and written["plan"]["batch_sizes"] == [10, 6]
        assert written["precision"] == ["32-true", "bf16-mixed"][rank] and written["loss_weight"] == 1.25
        assert written["deepspeed_config"]["zero_optimization"]["stage"] == 2
        assert (tmp_path / "plan.json").exists() == (rank == 0)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["emulate_speeds"] == [1.0, 0.5] and len(plan["devices"]) == 2


def test_the_follower_is_built_once_per_fit_and_takes_a_new_re_planner_and_split():
    watching, split = watcher(), SplitInForce(0)
    split.start(SplitPlan((8, 8), source="auto"), None)
    assert watching.replans == [] and watching.steps == []
    watching.follow(split, None)
    follower = watching.follower
    rebalancer = Rebalancer([CostModel(0.0, 1.0)] * 2, (8, 8), 20, 0.05)
    watching.follow(split, rebalancer)
    assert watching.follower is follower and follower.rebalancer is rebalancer and follower.split is split
    assert watching.skipped_steps() == [] and watching.loss_scale() is None


def test_a_re_plan_line_names_the_ranks_that_wait_for_their_data_and_the_fix():
    from lightning_hetero.split.decisions.replan import Replan
    from lightning_hetero.watch.follower import data_wait_text

    line = data_wait_text(Replan(40, (44, 20), 0.24, (), (0.0002, 0.0051)))
    assert "rank 1 5.1 ms" in line and "rank 0" not in line and "workers" in line
    assert data_wait_text(Replan(40, (44, 20), 0.24, (), (0.0002, 0.0004))) == ""  # a loader that keeps up
    assert data_wait_text(Replan(40, (44, 20), 0.24)) == ""
