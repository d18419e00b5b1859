"""The results page of ``benchmarks/local_sgd.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from result_pages import Column, Row, Section

TITLE = "What local training saves on a slow link: `benchmarks/local_sgd.py`"
INTRO = (
    "Two CPU ranks at emulated speeds [1.0, 0.4], each its own emulated node, joined by an emulated 1 Gbit/s link "
    "with 0.5 ms latency, train the examples' spiral classifier made wide (two untied 1024-wide blocks, 2.1 M "
    "parameters) with Adam (lr 1e-3) on 8192 samples, validating on 2048 after every epoch. Each round of a run "
    "fits, back to back (the order reversed in every other round), every-step exchange (a global batch of 128 split "
    "by speed, gradients exchanged every step) and local SGD and DiLoCo with a merge every H training steps "
    "(micro-batches of 64, the inner steps planned from the profiles unless the setting fixes them), and with "
    "`--variants` DiLoCo's quantized, streaming and overlapped merges. Every fit trains the same epochs. The target "
    "is every-step training's final validation loss in the same round; a fit's time to it is the wall time from the "
    "start of training to its first validation at or below it; the bytes between nodes are the run report's. What "
    "the options do is on [Local SGD and DiLoCo](../local-sgd.md)."
)

RATIO_COLUMNS = (
    Column("speedup to every_step's final loss", "speedup_to_target"),
    Column("final val loss / every_step's", "final_loss_over_every_step"),
    Column("final val loss / plain DiLoCo's (same H)", "final_loss_over_diloco"),
)
BYTES_COLUMNS = (
    Column("MB between nodes", "wire_mb", ".0f"),
    Column("peak MB in a step", "peak_step_mb", ".2f"),
    Column("peak MB in a step inside an epoch", "peak_inside_epoch_mb", ".2f"),
)
TIME_COLUMNS = (
    Column("seconds to every_step's final loss", "seconds_to_target", ".1f"),
    Column("training seconds", "train_seconds", ".1f"),
    Column("most wait on the link / compute", "link_wait_over_compute", ".3f"),
    Column("final val loss", "final_val_loss", ".4f"),
    Column("final accuracy", "final_val_acc", ".3f"),
    Column("rank 0's inner steps at the end", "rank0_inner_steps", ".0f"),
)
# Figures that are the emulated setting's only: without emulation (``--no-emulation``) a fit's seconds and bytes
# between nodes are not the setting's, so its row leaves them out.
EMULATED_ONLY = {"speedup_to_target", "seconds_to_target", "train_seconds", "link_wait_over_compute"} | {
    column.key for column in BYTES_COLUMNS
}


def plain_diloco(name: str) -> Optional[str]:
    """The plain DiLoCo fit of a DiLoCo variant's H (``diloco H=8 int8`` -> ``diloco H=8``); None for the others."""
    reference = " ".join(name.split()[:2])
    return reference if name.startswith("diloco ") and name != reference else None


def figure(rounds: list[dict[str, Any]], name: str, key: str, emulated: bool) -> list[Optional[float]]:
    """Each round's ``key`` of fit ``name`` (None where a round has none: a target not reached)."""
    if key in EMULATED_ONLY and not emulated:
        return []
    if key == "final_loss_over_diloco":
        reference = plain_diloco(name)
        if reference is None or reference not in rounds[0]:
            return []
        return [run[name]["final_val_loss"] / run[reference]["final_val_loss"] for run in rounds]
    if key == "rank0_inner_steps":  # (the run report's micro-steps per rank at the last step: rank 1 takes 1)
        return [run[name]["inner_steps"][0] if run[name].get("inner_steps") else None for run in rounds]
    return [run[name][key] for run in rounds]


def setting_of(name: str, setting: dict[str, Any]) -> str:
    """A row's setting: the fit's name first (the strip plot's label), then what the run held fixed."""
    epochs = setting["epochs"]
    parts = [name, f"{epochs} epoch{'s' if epochs != 1 else ''}"]
    if setting.get("anneal"):
        parts.append("annealed lr")
    if setting.get("inner_steps"):
        parts.append("inner steps " + " ".join(map(str, setting["inner_steps"])))
    if setting.get("seed_per_run"):
        seeds = setting.get("seeds") or []
        parts.append(f"seeds {seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}" if seeds else "seeded")
    if not setting.get("emulated", True):
        parts.append("not emulated")
    return ", ".join(parts)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/local_sgd.py``'s runs: three sections (against every-step training; bytes between nodes; seconds,
    the link's wait and the losses), a row per fit of each run of the script, each figure over the run's rounds."""
    rows: dict[str, list[Row]] = {"ratios": [], "bytes": [], "time": []}
    for path in files:
        record = json.loads(path.read_text())
        rounds, setting = record["runs"], record["setting"]
        emulated = setting.get("emulated", True)
        date = record.get("started", "")[:10]
        names = [name for name in rounds[0] if name != "target_val_loss"]
        for index, name in enumerate(names):
            note = record.get("note", "") if index == 0 else ""
            for part, columns in (("ratios", RATIO_COLUMNS), ("bytes", BYTES_COLUMNS), ("time", TIME_COLUMNS)):
                values = {column.key: figure(rounds, name, column.key, emulated) for column in columns}
                rows[part].append(
                    Row(path.name, record.get("commit", ""), date, setting_of(name, setting), values, note)
                )
    if not rows["ratios"]:
        return []
    return [
        Section(
            "Against every-step exchange",
            "Each figure over the every-step fit of the same round (DiLoCo's variants also over plain DiLoCo's fit "
            "of the same H and round). *Speedup* is every-step training's time to its own final validation loss over "
            "the fit's time to reach it: a round where the fit never reached it within the epochs counts in no "
            "cell (n says how many did). The final loss at a constant learning rate jumps from epoch to epoch; "
            "with an annealed one (`--anneal`) each fit ends converged.",
            RATIO_COLUMNS,
            tuple(rows["ratios"]),
            "local_sgd_speedup.png",
        ),
        Section(
            "Bytes between the nodes",
            "From each fit's run report: what every rank put on the wire between the two emulated nodes over the "
            "whole fit, the most in one training step, and the most in a step inside an epoch (each epoch's last "
            "step left out: there every streamed fragment merges). Not measured without emulation.",
            BYTES_COLUMNS,
            tuple(rows["bytes"]),
            "local_sgd_bytes.png",
            reference=None,
            log=True,
        ),
        Section(
            "Seconds, the link's wait and the losses",
            "The wall time from the start of training to the first validation at or below every-step training's "
            "final loss (no cell where no round reached it) and to the last validation; the most any rank waited "
            "on the link in merges (once every rank reached the merge) over its compute, from the run report; the "
            "final validation loss and accuracy; the inner steps the fast rank took per training step at the end "
            "(planned from the profiles and re-planned, unless the setting fixes them; every-step training's 1). "
            "Times depend on the machine's load (2 cores, shared); the losses are the same in every round that "
            "plans the same inner steps with the same seed.",
            TIME_COLUMNS,
            tuple(rows["time"]),
            "local_sgd_seconds.png",
            reference=None,
        ),
    ]
