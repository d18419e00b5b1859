"""The pipeline's per-stage summary (pipeline/report.py)."""

from __future__ import annotations

import pytest

from lightning_hetero.pipeline.report import describe_stages, summarize_stages


def test_each_stage_its_compute_its_waiting_and_the_balance():
    # Two pipelines of two stages: ranks 0 and 2 hold stage 1, ranks 1 and 3 stage 0. Two warm-up steps are left out.
    slow, fast = (0.9, 0.0), (0.3, 0.5)
    times = [
        [(5.0, 5.0)] * 2 + [slow] * 3,
        [(5.0, 5.0)] * 2 + [fast] * 3,
        [(5.0, 5.0)] * 2 + [(0.6, 0.1)] * 3,
        [(5.0, 5.0)] * 2 + [(0.2, 0.4)] * 3,
    ]
    summary = summarize_stages(times, [1, 0, 1, 0])
    assert summary["steps"] == 5 and summary["steps_summarized"] == 3
    stage0, stage1 = summary["stages"]
    assert stage0["ranks"] == [1, 3] and stage0["compute_ms_median"] == pytest.approx(300.0)  # the slower pipeline's
    assert stage1["compute_ms_median"] == pytest.approx(900.0) and stage0["waiting_ms_median"] == pytest.approx(500.0)
    assert summary["balance_median"] == pytest.approx((0.3 + 0.9) / (2 * 0.9))
    assert summary["schedule_ms_median"] == pytest.approx(900.0)  # the longest rank's compute and waiting
    assert "the schedule 900.0 ms; stage 0 compute 300.0 ms, waiting 500.0 ms" in describe_stages(summary)


def test_a_fit_without_steps_says_so():
    assert "no step" in describe_stages(summarize_stages([[], []], [0, 1]))
