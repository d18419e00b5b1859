"""The learning-rate rules when a resume changes the global batch (lightning_hetero.configure.lr_scaling)."""

from __future__ import annotations

import math

import pytest

from lightning_hetero.configure.lr_scaling import LrScaling, check_lr_scaling, lr_scaling_for


@pytest.mark.parametrize("old, new", [(16, 8), (8, 16), (96, 128), (128, 96), (7, 1)])
def test_the_factors_follow_each_rule_and_keep_decoupled_decay_per_epoch(old, new):
    k = new / old
    linear, sqrt = LrScaling("linear", old, new), LrScaling("sqrt", old, new)
    assert linear.lr_factor == pytest.approx(k) and sqrt.lr_factor == pytest.approx(math.sqrt(k))
    # AdamW decays by (1 - lr * wd) per step and takes 1/k as many steps per epoch: lr * wd must scale by k.
    for scaling in (linear, sqrt):
        assert scaling.lr_factor * scaling.decoupled_decay_factor == pytest.approx(k)
    assert linear.decoupled_decay_factor == pytest.approx(1.0)
    assert sqrt.decoupled_decay_factor == pytest.approx(math.sqrt(k))


def test_a_scaling_is_needed_only_with_a_rule_a_record_and_a_change():
    assert lr_scaling_for(None, 16, 8) is None  # the default: the checkpoint's learning rate
    assert lr_scaling_for("sqrt", None, 8) is None  # a file that records no global batch
    assert lr_scaling_for("sqrt", 8, 8) is None
    assert lr_scaling_for("linear", 16, 8) == LrScaling("linear", 16, 8)


def test_the_line_says_what_was_scaled():
    line = LrScaling("sqrt", 16, 8).describe(decoupled=True)
    assert "from the checkpoint's 16 to 8 samples (x0.5)" in line and "learning rate x0.7071" in line
    assert "decoupled weight decay x0.7071" in line
    assert "weight decay" not in LrScaling("linear", 16, 8).describe(decoupled=False)


@pytest.mark.parametrize(
    "value, sync, pipeline, message",
    [
        ("Linear", "every_step", None, r"`lr_scaling='Linear'` must be None \(default: a resume keeps"),
        (True, "every_step", None, r"`lr_scaling=True` must be None"),
        ("sqrt", "diloco", None, r"`lr_scaling='sqrt'` with `sync='diloco'`: each rank steps its own optimizer"),
        ("linear", "every_step", {"stages": 2}, r"with `pipeline=...`: a pipeline's checkpoint does not record"),
    ],
)
def test_bad_lr_scaling_is_named_with_the_fix(value, sync, pipeline, message):
    with pytest.raises(ValueError, match=message):
        check_lr_scaling(value, sync, pipeline)


def test_good_lr_scaling_passes():
    assert check_lr_scaling(None) is None
    assert check_lr_scaling(None, "diloco", {"stages": 2}) is None  # off: nothing to refuse
    assert check_lr_scaling("linear") == "linear" and check_lr_scaling("sqrt") == "sqrt"
