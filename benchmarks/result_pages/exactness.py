"""The results page of ``benchmarks/exactness.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "The same result as one process: `benchmarks/exactness.py`"
INTRO = (
    "Two CPU ranks (gloo) with unequal micro-batches (3 and 13 of a global batch of 16 by default) train the test "
    "suite's small regression network with SGD (lr 0.05, momentum 0.9) under HeteroStrategy at each ZeRO stage, "
    "through the test worker `tests/workers/fit.py`; the same training is rebuilt in one plain torch process on the "
    "whole global batches (DDP's update). The figure is the largest absolute difference, over every parameter "
    "element, between the two final sets of weights: one fit per stage and case, so each cell is a single value "
    "(n=1). The cases: *plain* (4 steps, mean loss), *accumulate* (`accumulate_grad_batches=3`, 2 epochs of 4 "
    "batches), *manual-accumulate* (manual optimization, a step every 2 batches), *sum-loss* (a summed loss with "
    "`loss_reduction='sum'`, 3 steps) and *sum-loss-as-mean* (the same summed loss left at the default "
    "`loss_reduction='mean'`: the error that setting prevents). The how-to page is [The split](../split.md)."
)

EXACT_CASES = ("plain", "accumulate", "manual-accumulate", "sum-loss")
DIFFERENCE = (Column("largest parameter difference from one process", "max_abs_diff", ".1e"),)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/exactness.py``'s runs: the cases that must match one process, and the summed loss taken as a
    mean; a row per case and ZeRO stage of each run of the script."""
    exact: list[Row] = []
    wrong: list[Row] = []
    for path in files:
        record = record_of(path)
        sizes = "+".join(str(size) for size in record["setting"]["batch_sizes"])
        for index, run in enumerate(record["runs"]):
            setting = f"{run['case']} at ZeRO-{run['stage']}, micro-batches {sizes}"
            note = record.get("note", "") if index == 0 else ""
            row = row_of(path, record, setting, {"max_abs_diff": [run["max_abs_diff"]]}, note)
            (exact if run["case"] in EXACT_CASES else wrong).append(row)
    found = []
    if exact:
        intro = (
            "Every figure here should be float32 rounding: the test suite asserts at most 1e-5 for these cases "
            "(`TOLERANCE` in `tests/test_strategy_multiprocess.py`)."
        )
        found.append(
            Section("Against one process", intro, DIFFERENCE, tuple(exact), "exactness.png", reference=None, log=True)
        )
    if wrong:
        intro = (
            "A loss summed over the batch but declared a mean (the default `loss_reduction='mean'`): the strategy "
            "weights rank r's loss by `b_r * W / B`, as a mean needs, which weights a sum wrongly when the "
            "micro-batches differ. This is the difference `loss_reduction='sum'` removes."
        )
        found.append(
            Section(
                "A summed loss taken as a mean",
                intro,
                DIFFERENCE,
                tuple(wrong),
                "exactness_sum_as_mean.png",
                reference=None,
                log=True,
            )
        )
    return found
