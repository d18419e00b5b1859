"""Memory-sized optimizer shards in data-parallel training: the pure decisions and the checks before any collective
(:mod:`lightning_hetero.split.optimizer_shards`, :mod:`lightning_hetero.train.optimizer_shards`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_hetero import HeteroStrategy
from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM
from lightning_hetero.recover import by_name
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.split.optimizer_shards import (
    MANIFEST_KEY,
    MemoryShards,
    load_named_shards,
    optimizer_rooms,
    plan_line,
    shards_resume_refusal,
    shares_misfit,
    shares_to_move,
)
from lightning_hetero.split.training import DataParallelTraining
from lightning_hetero.train.optimizer_shards import same_dtype_groups, shard_fractions, shards_refusal

KiB, MiB = 2**10, 2**20


def test_the_room_is_the_headroom_less_the_model_and_the_activations_or_half_kept_when_unmeasured():
    free = [100 * MiB, 10 * MiB, None]
    measured = optimizer_rooms(free, model_bytes=2 * MiB, activation_bytes=[1 * MiB, 3 * MiB, 5 * MiB])
    assert measured == [MEMORY_HEADROOM * 100 * MiB - 3 * MiB, MEMORY_HEADROOM * 10 * MiB - 5 * MiB, None]
    unmeasured = optimizer_rooms(free, model_bytes=2 * MiB, activation_bytes=None)
    assert unmeasured[:2] == [0.5 * MEMORY_HEADROOM * 100 * MiB - 2 * MiB, 0.5 * MEMORY_HEADROOM * 10 * MiB - 2 * MiB]


@given(
    rooms=st.lists(st.integers(min_value=0, max_value=10**9), min_size=2, max_size=8).filter(lambda r: sum(r) > 0),
    state=st.integers(min_value=0, max_value=10**9),
)
def test_shares_in_proportion_to_the_rooms_fit_every_rank_exactly_when_the_state_fits_all_rooms_together(rooms, state):
    fractions, _ = shard_fractions(rooms, "memory")
    misfit = shares_misfit(rooms, fractions, state)
    assert (misfit is None) == (state <= sum(rooms) * (1 + 1e-9))


def test_a_misfit_names_the_rank_its_share_and_its_room():
    assert shares_misfit([10 * MiB, 1 * MiB], [0.5, 0.5], 4 * MiB) == (
        "rank 1 would hold 2.00 MiB of the optimizer state with 1.00 MiB left after the model, its gradients and"
        " activations"
    )
    assert shares_misfit([None, None], [0.5, 0.5], 4 * MiB) is None


def test_the_plan_line_says_each_share_why_and_the_rooms():
    line = plan_line([30 * MiB, 10 * MiB], (0.75, 0.25), "in proportion to the memory", [300, 100], stage=2)
    assert line == (
        "optimizer state and its gradients sharded by memory (in proportion to the memory): rank 0 75 %, rank 1 25 %;"
        " left after the model, gradients and activations: 30.0 MiB, 10.0 MiB"
    )
    assert plan_line([None, None], (0.5, 0.5), "equal shares", [1, 1], stage=1).startswith(
        "optimizer state sharded by memory (equal shares): rank 0 50 %, rank 1 50 %"
    )


def test_a_misfit_is_refused_on_an_emulated_device_and_warned_on_a_real_one():
    module = torch.nn.Linear(100, 100)  # 10,100 parameters: Adam's state 80.8 KB
    shards = MemoryShards(rank=0, world_size=2, stage=1)
    trainer = type("Trainer", (), {"gradient_clip_val": 0.5})()
    with pytest.raises(ValueError, match=r"rank 1 cannot hold the model, its gradients and its micro-batch's"):
        shards.start(module, [MiB, -KiB], emulated=True, config={}, trainer=trainer)
    warning = shards.start(module, [MiB, -KiB], emulated=False, config={}, trainer=trainer)
    assert warning is not None and "the fit may run out of memory (rank 1 holds none of the state)" in warning
    assert shards._set.share_bytes()[1] == 0
    config: dict = {}
    warning = shards.start(module, [40 * KiB, 10 * KiB], emulated=False, config=config, trainer=trainer)
    assert warning is not None and "rank 0 would hold" in warning and "the fit may run out of memory" in warning
    assert (shards.max_norm, config["gradient_clipping"]) == (0.5, 0.0)  # the whole model's clipping is the package's
    with pytest.raises(ValueError, match="an out-of-memory error on a real device"):
        shards.start(module, [40 * KiB, 10 * KiB], emulated=True, config={}, trainer=trainer)
    assert shards.start(module, [400 * KiB, 100 * KiB], emulated=True, config={}, trainer=trainer) is None
    assert shards.description.startswith("optimizer state sharded by memory (in proportion to the memory left")


def test_frozen_parameters_weigh_nothing_in_the_shares():
    module = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    module[0].requires_grad_(False)  # (a frozen backbone: 90 % of the bytes, no optimizer state)
    shards = MemoryShards(rank=0, world_size=2, stage=2)
    trainer = type("Trainer", (), {"gradient_clip_val": 0.0})()
    shards.start(module, [900 * KiB, 100 * KiB], emulated=False, config={}, trainer=trainer)
    held = shards._set.share_bytes()
    assert held == [1000 * 4, 10 * 4]  # the trained head's weight and bias, 90 % and 10 % of the trained bytes
    assert "rank 0 99 %, rank 1 1 %" in shards.description


def test_a_replan_moves_the_shares_when_a_target_changes_by_five_points_or_the_shares_stop_fitting():
    assert not shares_to_move([0.5, 0.5], [0.53, 0.47], [MiB, MiB], MiB)
    assert shares_to_move([0.5, 0.5], [0.55, 0.45], [MiB, MiB], MiB)
    assert shares_to_move([0.5, 0.5], [0.52, 0.48], [0.6 * MiB, 0.49 * MiB], MiB)  # (0.5 no longer fits rank 1)
    assert shares_to_move([0.5, 0.5], [0.3, 0.3, 0.4], [MiB] * 3, MiB)  # (another number of ranks)


def test_same_dtype_groups_keep_the_order_of_first_appearance():
    a, b, c = torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)
    assert [[id(t) for t in group] for group in same_dtype_groups([a, b, c])] == [[id(a), id(c)], [id(b)]]


def test_the_arguments_run_deepspeed_at_zero_0_and_refuse_what_the_shards_cannot_run():
    strategy = HeteroStrategy(stage=2, shards="memory")
    assert strategy.settings.shards_by_memory and strategy.settings.stage == 2
    assert strategy.config["zero_optimization"]["stage"] == 0
    assert not HeteroStrategy(stage=2).settings.shards_by_memory  # (DeepSpeed's even shards stay the default)
    assert shards_refusal("memory", 2, pipeline=False) is None
    assert "Pass `stage=1` or `stage=2`" in shards_refusal("memory", 0, pipeline=False)
    settings = HeteroStrategy(stage=1, shards="memory").settings
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*Use `precision='32-true'`"):
        DataParallelTraining.check_trainer(settings, None, "16-mixed", 2)
    DataParallelTraining.check_trainer(settings, None, "32-true", 2)


def test_a_sharded_checkpoint_is_refused_by_deepspeeds_zero_1_to_3_and_read_with_shards_or_at_zero_0(tmp_path):
    refusal = shards_resume_refusal(tmp_path, {"zero_stage": 2}, sharded_now=True, zero_stage=0)
    assert refusal is not None and "Resume it without `shards` (at `stage=2`)" in refusal
    assert shards_resume_refusal(tmp_path, {"zero_stage": 0}, sharded_now=True, zero_stage=0) is None
    manifest = {MANIFEST_KEY: {"ranks": [0, 1]}}
    refusal = shards_resume_refusal(tmp_path, manifest, sharded_now=False, zero_stage=2)
    assert refusal is not None and "Resume it with `shards='memory'`" in refusal and "or at `stage=0`" in refusal
    assert shards_resume_refusal(tmp_path, manifest, sharded_now=True, zero_stage=0) is None
    assert shards_resume_refusal(tmp_path, manifest, sharded_now=False, zero_stage=0) is None
    assert shards_resume_refusal(tmp_path, {}, sharded_now=False, zero_stage=2) is None


def saved_shards(directory: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two ranks' Adam shards of a two-layer model, each rank's state for its own layer only."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    for rank, layer in enumerate(module):
        optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
        module(torch.randn(2, 3)).sum().backward()
        for parameter in module.parameters():
            if not any(parameter is p for p in layer.parameters()):
                parameter.grad = None
        optimizer.step()
        torch.save(
            {"optimizer": by_name.named_optimizer_state(module, optimizer)},
            directory / by_name.SHARD_FILE.format(rank=rank),
        )
        module.zero_grad(set_to_none=True)
    return module, torch.optim.Adam(module.parameters(), lr=0.1)


def test_every_name_is_taken_from_the_file_that_holds_it_less_those_another_rank_owns(tmp_path):
    module, optimizer = saved_shards(tmp_path)
    order = list(module.named_parameters())
    load_named_shards(tmp_path, {MANIFEST_KEY: {"ranks": [0, 1]}}, module, optimizer, order, skipped=set())
    assert len(optimizer.state) == 4  # every parameter's state, from the two files
    fresh = torch.optim.Adam(module.parameters(), lr=0.1)
    load_named_shards(tmp_path, {MANIFEST_KEY: {"ranks": [0, 1]}}, module, fresh, order, skipped={"0.weight"})
    assert {name for name, p in order if p in fresh.state} == {"0.bias", "1.weight", "1.bias"}


def test_a_missing_shard_file_is_refused_naming_it(tmp_path):
    module, optimizer = saved_shards(tmp_path)
    (tmp_path / by_name.SHARD_FILE.format(rank=1)).unlink()
    with pytest.raises(ResumeRefused, match=r"holds no optimizer_shard_rank1\.pt: that rank's optimizer state is lost"):
        load_named_shards(
            tmp_path, {MANIFEST_KEY: {"ranks": [0, 1]}}, module, optimizer, list(module.named_parameters()), set()
        )


@pytest.mark.multiprocess
def test_a_replan_moves_the_shares_and_the_optimizer_state_and_training_stays_one_process_s(tmp_path):
    """Two gloo ranks (tests/workers/shards_replan.py): rank 0 holds most of the state until the rooms turn round
    after 3 Adam steps; the shares move and 3 more steps end within 1e-6 of one process (Adam's moments travelled).
    The model has a frozen layer (no state anywhere) and a float64 parameter (reduced and sent in its own dtype)."""
    import json
    import sys

    from conftest import run_bounded

    worker = Path(__file__).parents[1] / "workers" / "shards_replan.py"
    code, output = run_bounded([sys.executable, str(worker), str(tmp_path / "store")], timeout=120)
    assert code == 0, output[-3000:]
    result = json.loads(output.strip().splitlines()[-1])
    before, after = result["before"], result["after"]
    assert before[0] > before[1] and after[0] < after[1]
    held = [set(names) for names in result["held"]]
    assert not held[0] & held[1] and len(held[0] | held[1]) == 7  # every trained parameter's state on one rank
    assert not any(name.startswith("frozen.") for name in held[0] | held[1])
    assert result["line"].startswith("HeteroStrategy re-plan: the optimizer state's shards move, ")
    assert result["difference"] <= 1e-6
