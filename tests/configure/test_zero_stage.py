"""The ZeRO stage when none is named (:mod:`lightning_hetero.configure.zero_stage`): the lowest every device fits."""

from __future__ import annotations

import pytest

from lightning_hetero.configure.zero_stage import (
    UNPROFILED_ACTIVATION_SHARE,
    ModelSize,
    choose_stage,
    model_state_bytes,
    shared_free_bytes,
)
from lightning_hetero.measure.rank_profile import MEMORY_HEADROOM

MILLION = ModelSize(1_000_000, 1_000_000)  # 16 MB at ZeRO-0 in fp32 with Adam's state


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, 16e6), (1, 8e6 + 8e6 / 4), (2, 4e6 + 12e6 / 4), (3, 16e6 / 4)],
)
def test_the_state_per_stage_shards_optimizer_then_gradients_then_parameters(stage, expected):
    assert model_state_bytes(MILLION, stage, 4) == pytest.approx(expected)


def test_half_precision_engines_hold_half_parameters_and_an_fp32_master_and_frozen_parameters_train_nothing():
    half = ModelSize(1_000_000, 1_000_000, half_precision_engine=True)
    assert model_state_bytes(half, 0, 2) == pytest.approx(2e6 + 2e6 + 12e6)
    frozen = ModelSize(1_000_000, 0)
    assert model_state_bytes(frozen, 0, 2) == pytest.approx(4e6)


def fits_exactly(stage: int, world: int = 4, activations: float = 1e6) -> float:
    """The free memory at which ``stage`` just fits with ``activations``."""
    return (model_state_bytes(MILLION, stage, world) + activations) / MEMORY_HEADROOM


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_lowest_stage_that_fits_every_device_is_chosen(stage):
    tight = fits_exactly(stage) * 1.001
    free = [100e9, tight, 100e9, 100e9]
    choice = choose_stage(MILLION, 4, free, [1e6] * 4)
    assert choice.stage == stage and choice.spare_bytes >= 0
    assert choice.reason.startswith(f"ZeRO stage {stage} (auto): the model, its gradients and optimizer state")
    if stage > 0:  # the reason says why the stage below did not fit, naming the rank
        assert "at ZeRO stage 0 rank 1 would need" in choice.reason


def test_nothing_fits_gives_the_highest_allowed_stage_and_says_so():
    choice = choose_stage(MILLION, 4, [1e6] * 4, [1e6] * 4)
    assert choice.stage == 3 and "do not fit at any stage" in choice.reason and "offload" in choice.reason
    assert choice.spare_bytes < 0
    restricted = choose_stage(MILLION, 4, [1e6] * 4, [1e6] * 4, allowed=(0, 1, 2))
    assert restricted.stage == 2


def test_allowed_stages_are_respected():
    assert choose_stage(MILLION, 4, [100e9] * 4, [1e6] * 4, allowed=(2, 3)).stage == 2
    assert choose_stage(MILLION, 4, [100e9] * 4, [1e6] * 4, allowed=(3,)).stage == 3


def test_without_a_profile_half_the_room_is_kept_for_activations():
    just_enough = model_state_bytes(MILLION, 0, 2) / (MEMORY_HEADROOM * UNPROFILED_ACTIVATION_SHARE)
    assert choose_stage(MILLION, 2, [just_enough * 1.01] * 2, None).stage == 0
    assert choose_stage(MILLION, 2, [just_enough * 0.99] * 2, None).stage == 1


def test_unknown_free_memory_is_taken_to_fit_and_evaluation_holds_only_the_parameters():
    assert choose_stage(MILLION, 2, [None, None], None).stage == 0
    assert "no rank's free memory is known" in choose_stage(MILLION, 2, [None, None], None).reason
    assert choose_stage(MILLION, 2, [None, 100e9], [1e6, 1e6]).stage == 0
    # 5 MB free: training's 16 MB does not fit at ZeRO-0, evaluation's 4 MB of parameters does.
    assert choose_stage(MILLION, 2, [5e6 / MEMORY_HEADROOM] * 2, None, training=True).stage > 0
    evaluation = choose_stage(
        MILLION, 2, [5e6 / MEMORY_HEADROOM / UNPROFILED_ACTIVATION_SHARE] * 2, None, training=False
    )
    assert evaluation.stage == 0 and evaluation.reason.startswith("ZeRO stage 0 (auto): the model (")


def test_ranks_on_one_device_share_its_free_memory():
    devices = [("a", "cpu", None), ("a", "cpu", None), ("b", "cuda", 0), ("b", "cuda", 1)]
    assert shared_free_bytes([10.0, 10.0, 8.0, None], devices) == [5.0, 5.0, 8.0, None]


def test_a_checkpoint_of_another_stage_is_refused_naming_the_stage_to_pass():
    from lightning_hetero.configure.zero_stage import resume_stage_mismatch

    assert resume_stage_mismatch(2, 2, True, "ckpt") is None and resume_stage_mismatch(None, 0, True, "ckpt") is None
    message = resume_stage_mismatch(2, 0, True, "ckpt")
    assert "saved at ZeRO stage 2, and this run is at ZeRO stage 0 (chosen automatically" in message
    assert "Pass `stage=2` (or `strategy='hetero_stage_2'`)" in message
    assert "chosen automatically" not in resume_stage_mismatch(3, 1, False, "ckpt")
