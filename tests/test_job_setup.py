"""JobSetup's decision at a resume whose global batch differs from the checkpoint's, on stand-in inputs (no process
group): what is kept, what is refused, what is scaled, and what is said."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_hetero.configure.lr_scaling import LrScaling
from lightning_hetero.job_setup import JobSetup
from lightning_hetero.recover.refusal import ResumeRefused

CHECKPOINT = Path("/checkpoints/epoch=0-step=3.ckpt")


def setup_for(current=8, rule=None, fixed=None, fitting=True, local=None):
    settings = SimpleNamespace(lr_scaling=rule, global_batch_size=fixed, batch_sizes=None)
    plan = SimpleNamespace(global_batch_size=current, batch_sizes=(current,))
    split = SimpleNamespace(plan=plan, batch_sizes=(current,))
    setup = JobSetup(settings, split, sharding=None, communication=None, loss_check=None, local=local)
    setup.fitting = fitting
    setup.started = []
    setup.start_the_split = lambda size, stage, module: setup.started.append(size)
    return setup


@pytest.fixture
def said(monkeypatch):
    lines = []
    monkeypatch.setattr("lightning_hetero.job_setup.rank_zero_info", lines.append)
    return lines


def test_without_a_rule_another_world_size_keeps_the_checkpoints_batch_and_the_same_ranks_say_the_change(said):
    setup = setup_for()
    setup.settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, same_world_size=False)
    assert setup.started == [16] and setup.pending_lr_scaling is None
    setup = setup_for()
    setup.settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, same_world_size=True)
    assert setup.started == [] and setup.pending_lr_scaling is None
    assert "the global batch is 8 samples, the checkpoint's 16; the learning rate is the checkpoint's" in said[-1]


def test_a_fixed_batch_that_differs_is_refused_naming_both_fixes():
    with pytest.raises(ResumeRefused, match=r"Pass `global_batch_size=16` .* or `lr_scaling='linear'` or `'sqrt'`"):
        setup_for(fixed=8).settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, False)


@pytest.mark.parametrize("same_world_size", [False, True])
def test_with_a_rule_the_jobs_batch_is_kept_and_the_rate_scaled_once_at_the_first_step(said, same_world_size):
    setup = setup_for(rule="sqrt", fixed=8)
    setup.settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, same_world_size)
    assert setup.started == [] and setup.pending_lr_scaling == LrScaling("sqrt", 16, 8)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.01, weight_decay=0.1)
    trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[])
    setup.scale_learning_rate(trainer)
    setup.scale_learning_rate(trainer)  # every optimizer step asks; the second finds nothing pending
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**0.5)
    assert said[-1].startswith("HeteroStrategy: the global batch changed from the checkpoint's 16 to 8 samples")


def test_a_checkpoint_that_records_no_batch_is_named_when_a_rule_was_asked_for(said):
    setup = setup_for(rule="linear")
    setup.settle_the_global_batch(CHECKPOINT, {}, 0, None, same_world_size=True)
    assert setup.pending_lr_scaling is None
    assert f"checkpoint {CHECKPOINT} does not record its global batch" in said[-1]
    setup_for().settle_the_global_batch(CHECKPOINT, {}, 0, None, same_world_size=True)
    assert len(said) == 1  # without a rule there is nothing to say


def test_outside_fit_and_with_local_sgd_nothing_is_pending_or_said(said):
    """validate/test(ckpt_path=...) after a fit keep its plan: no scaling, no line; a scaling left from before goes.
    Local SGD's plan (micro-batch x inner steps, re-planned) differs from its checkpoint's as a rule: no line."""
    setup = setup_for(rule="sqrt", fitting=False)
    setup.pending_lr_scaling = LrScaling("sqrt", 16, 8)
    setup.settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, same_world_size=True)
    assert setup.pending_lr_scaling is None
    setup_for(local=object()).settle_the_global_batch(CHECKPOINT, {"batch_sizes": [8, 8]}, 0, None, True)
    assert said == []
