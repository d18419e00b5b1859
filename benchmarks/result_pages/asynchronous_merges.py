"""The results page of ``benchmarks/asynchronous_merges.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from result_pages import Column, Row, Section

TITLE = "Asynchronous merges by speed against the synchronous merge: `benchmarks/asynchronous_merges.py`"
INTRO = (
    "The setting of `benchmarks/local_sgd.py`: two CPU ranks at emulated speeds [1.0, 0.4], each its own emulated "
    "node, a 1 Gbit/s link with 0.5 ms latency, the wide spiral classifier (2.1 M parameters), Adam, 8192 training "
    "samples in micro-batches of 64, DiLoCo with a merge every 8 training steps. Rank 1 slows 3x (to 0.133) after "
    "its 110th micro-batch, about the middle of the default 6 epochs (unless the run says *no drift*). Each round "
    "fits, back to back in alternating order and both seeded with the round's number, *synchronous* DiLoCo (inner "
    "steps planned and re-planned from what the ranks measure) and *asynchronous* DiLoCo "
    '(`sync_options={"asynchronous": True}`: each rank trains the micro-batches it has time for, a merge every 8 x '
    "2 micro-batches claimed). A wait is taken after the drift: synchronous, the fast rank's time in each training "
    "step beyond its compute (an upper bound: its own optimizer steps and the merges' exchanges included); "
    "asynchronous, each rank's time in each merge less the least any rank spent in it. The script's docstring says "
    "how each figure is taken; the how-to page is [Asynchronous merges by "
    "speed](../local-sgd.md#asynchronous-merges-by-speed)."
)

PAIR_COLUMNS = (
    Column("asynchronous / synchronous, final val loss", "loss_ratio"),
    Column("the same, mean val loss of the last 3 epochs", "last3_ratio"),
    Column("asynchronous / synchronous, training seconds", "seconds_ratio"),
)
WAIT_COLUMNS = (
    Column("most wait / slowed rank's step", "most_wait_over_slow_step", ".2f"),
    Column("median wait / slowed rank's step", "median_wait_over_slow_step", ".2f"),
    Column(
        "most wait for the slowed rank / its micro-batch waited for, inside an epoch",
        "most_wait_over_step_waited_for",
    ),
    Column(
        "most wait for the slowed rank / its micro-batch waited for, at an epoch's end",
        "most_wait_at_epoch_ends_over_step_waited_for",
    ),
    Column("most wait / slowed rank's micro-batch cycle, inside an epoch", "most_wait_over_slow_cycle", ".2f"),
    Column(
        "most wait / slowed rank's micro-batch cycle, at an epoch's end",
        "most_wait_at_epoch_ends_over_slow_cycle",
        ".2f",
    ),
)
FIT_COLUMNS = (
    Column("final val loss", "final_val_loss", ".4f"),
    Column("mean val loss, last 3 epochs", "last3_val_loss", ".4f"),
    Column("training seconds", "train_seconds", ".1f"),
    Column("slowed rank's step after the drift (ms)", "slow_step_ms", ".0f"),
    Column("samples an epoch", "samples_per_epoch", ".0f"),
    Column("claims taken over", "claims_taken_over", ".0f"),
)
FITS = ("synchronous", "asynchronous")


def fit_figure(fit: dict[str, Any], key: str) -> Optional[float]:
    """One fit's ``key`` in a round (None where the fit has none: the synchronous fit's claims and cycles)."""
    if key == "slow_step_ms":
        return fit["slow_step_seconds"] * 1e3
    if key == "claims_taken_over":  # (each rank's count: their sum)
        return None if fit.get(key) is None else float(sum(fit[key]))
    return fit.get(key)


def pair_figure(run: dict[str, Any], key: str) -> float:
    """One round's ratio of the asynchronous fit over the synchronous one."""
    if key == "seconds_ratio":
        return run["asynchronous"]["train_seconds"] / run["synchronous"]["train_seconds"]
    return run[key]


def setting_of(setting: dict[str, Any]) -> str:
    """What a run held fixed: the drift first (the strip plot's label), then the learning rate and the epochs."""
    parts = ["drift" if setting.get("drift", True) else "no drift"]
    if setting.get("anneal"):
        parts.append("annealed lr")
    epochs = setting["epochs"]
    parts.append(f"{epochs} epoch{'s' if epochs != 1 else ''}")
    if setting.get("again"):
        parts.append("fits of an earlier run analysed again")
    return ", ".join(parts)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/asynchronous_merges.py``'s runs: the pair's ratios (a row per run of the script), the waits for
    the slowed rank and each fit's own figures (a row per fit of each run), each figure over the run's rounds."""
    pairs: list[Row] = []
    waits: list[Row] = []
    fits: list[Row] = []
    for path in files:
        record = json.loads(path.read_text())
        rounds, setting = record["runs"], setting_of(record["setting"])
        commit, date, note = record.get("commit", ""), record.get("started", "")[:10], record.get("note", "")
        values = {column.key: [pair_figure(run, column.key) for run in rounds] for column in PAIR_COLUMNS}
        pairs.append(Row(path.name, commit, date, setting, values, note))
        for name in FITS:
            for columns, rows in ((WAIT_COLUMNS, waits), (FIT_COLUMNS, fits)):
                values = {column.key: [fit_figure(run[name], column.key) for run in rounds] for column in columns}
                rows.append(Row(path.name, commit, date, f"{name}, {setting}", values))
    if not pairs:
        return []
    return [
        Section(
            "Asynchronous against synchronous",
            "Each round's asynchronous fit over the synchronous fit of the same seed. Both depend on timing (the "
            "synchronous inner steps are re-planned from what the ranks measure, the claims go to whoever asks), so "
            "one seed does not end at one loss; at a constant learning rate the final loss jumps from epoch to "
            "epoch, with an annealed one (`--anneal`) each fit ends converged.",
            PAIR_COLUMNS,
            tuple(pairs),
            "asynchronous_merges_pair.png",
        ),
        Section(
            "The wait for the slowed rank",
            "After the drift, over the slowed rank's median time for one of its steps (a micro-batch with its "
            "optimizer step): the most and the median wait. Asynchronous only: each wait for the slowed rank (the "
            "merges it reached last) over its micro-batch waited for (from the start of its last micro-batch to the "
            "merge; by the claims' rule at most 1 inside an epoch, to the measure's precision), and any rank's "
            "most wait over the slowed rank's median time from one micro-batch to the next (a typical one; the one "
            "waited for can be longer); each inside the epochs and at their ends.",
            WAIT_COLUMNS,
            tuple(waits),
            "asynchronous_merges_waits.png",
        ),
        Section(
            "Each fit",
            "The final validation loss and the mean of the last three; the wall time from the start of training to "
            "the last validation; the slowed rank's median step after the drift; the samples each epoch trained "
            "(the run report's batch sizes: 8192 is every sample once); and the claims a faster rank took over from "
            "a slower one that had drawn them ahead (asynchronous, all ranks together).",
            FIT_COLUMNS,
            tuple(fits),
            "asynchronous_merges_fits.png",
            reference=None,
            log=True,
        ),
    ]
