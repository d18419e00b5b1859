"""Watch: what each pipeline stage did during the fit, from the times every rank measured in every step.

Per stage (the ranks holding it, over the pipelines): its compute per step (forward and backward, the emulated speed
included), its waiting (for a neighbour's activation or gradient: the bubble while the pipeline fills and drains,
and any imbalance), and per step the balance of the stages' compute, mean over the slowest (1 = every stage as busy
as the slowest, none waits for another beyond the bubble). Pure: values in, values out.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

SKIPPED_STEPS = 2  # the first steps pay one-time costs (allocation, the first sends)


def summarize_stages(step_times: Sequence[Sequence[Sequence[float]]], stage_of_rank: Sequence[int]) -> dict[str, Any]:
    """``step_times[r]``: rank r's (compute, waiting) seconds per step; ``stage_of_rank[r]``: its stage."""
    steps = min((len(times) for times in step_times), default=0)
    first = SKIPPED_STEPS if steps > SKIPPED_STEPS else 0
    stages = sorted(set(stage_of_rank))
    per_stage = []
    for stage in stages:
        ranks = [r for r, s in enumerate(stage_of_rank) if s == stage]
        compute = [max(step_times[r][i][0] for r in ranks) for i in range(first, steps)]
        waiting = [max(step_times[r][i][1] for r in ranks) for i in range(first, steps)]
        per_stage.append(
            {
                "stage": stage,
                "ranks": ranks,
                "compute_ms_median": 1e3 * statistics.median(compute) if compute else None,
                "waiting_ms_median": 1e3 * statistics.median(waiting) if waiting else None,
            }
        )
    schedule = [max(sum(step_times[r][i]) for r in range(len(step_times))) for i in range(first, steps)]
    balances = []
    for i in range(first, steps):
        computes = [max(step_times[r][i][0] for r, s in enumerate(stage_of_rank) if s == stage) for stage in stages]
        if max(computes) > 0:
            balances.append(sum(computes) / (len(computes) * max(computes)))
    return {
        "steps": steps,
        "steps_summarized": max(0, steps - first),
        "stages": per_stage,
        "balance_median": statistics.median(balances) if balances else None,
        # the schedule's wall time per step (compute and waiting, the longest rank): what the simulator predicts
        "schedule_ms_median": 1e3 * statistics.median(schedule) if schedule else None,
        "balance_per_step": balances,
    }


def describe_stages(summary: dict[str, Any]) -> str:
    if not summary["steps_summarized"]:
        return "HeteroStrategy pipeline report: no step to summarize."
    parts = [
        f"stage {s['stage']} compute {s['compute_ms_median']:.1f} ms, waiting {s['waiting_ms_median']:.1f} ms"
        for s in summary["stages"]
    ]
    return (
        f"HeteroStrategy pipeline report: {summary['steps']} steps; per step (median): the schedule"
        f" {summary['schedule_ms_median']:.1f} ms; {'; '.join(parts)}; balance {summary['balance_median']:.2f} (1.00 ="
        " every stage computes as long as the slowest)"
    )
