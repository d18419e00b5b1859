"""Emulated memory ceilings (LIGHTNING_HETERO_EMULATE_MEMORY): parsed, applied to profiles, and enforced."""

from __future__ import annotations

import pytest

from lightning_hetero.emulate.memory import (
    ENV_VAR,
    check_ceilings,
    describe_overflow,
    emulated_ceilings_from_environment,
    lower_ceiling,
)


def test_ceilings_are_read_per_rank(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert emulated_ceilings_from_environment() is None
    monkeypatch.setenv(ENV_VAR, "64, -,16")
    assert emulated_ceilings_from_environment() == (64, None, 16)
    check_ceilings((64, None, 16), 3)
    with pytest.raises(ValueError, match="has 3 entries but the job has 2 ranks"):
        check_ceilings((64, None, 16), 2)


@pytest.mark.parametrize("text", ["0,4", "4,x", "4,2.5", "4,,"])
def test_a_bad_ceiling_names_the_variable_and_the_entry(monkeypatch, text):
    monkeypatch.setenv(ENV_VAR, text)
    with pytest.raises(ValueError, match=f"{ENV_VAR}=.*is not a micro-batch ceiling"):
        emulated_ceilings_from_environment()


def test_the_lower_ceiling_wins():
    assert lower_ceiling(None, None) is None
    assert lower_ceiling(40, None) == 40 and lower_ceiling(None, 16) == 16 and lower_ceiling(40, 16) == 16


def test_a_micro_batch_over_its_ceiling_is_refused_with_the_micro_steps_that_would_fit():
    assert describe_overflow([30, 10], [2, 1], (16, None)) is None
    assert describe_overflow([30, 10], [1, 1], None) is None
    message = describe_overflow([30, 10], [1, 1], (16, None))
    assert "Rank 0's micro-batch of 30 samples" in message and "at least 2 micro-steps" in message
    local = describe_overflow([16, 8], [2, 1], (4, None), local_training=True)
    assert "Rank 0's micro-batch of 8 samples (16 in 2 micro-steps)" in local
    assert "micro-batches of at most 4 samples (`batch_sizes=[...]`" in local
