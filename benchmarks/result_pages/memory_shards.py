"""The results page of ``benchmarks/memory_shards.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "Memory-sized optimizer shards: `benchmarks/memory_shards.py`"
INTRO = (
    "What `HeteroStrategy(stage=2, shards='memory')` costs on identical ranks, where its shards come out equal, "
    "against DeepSpeed's own ZeRO-1 and ZeRO-2; and, where a small device cannot hold its even share, against the "
    "alternatives (a pipeline; DeepSpeed's even ZeRO-2 and micro-steps are refused there). The model is an MLP "
    "256-1024-1024-10 (1.3 M parameters) with Adam on 2 CPU ranks; the script's docstring says how each figure is "
    "taken. The bytes follow the package's meter (`lightning_hetero/comm/wire.py`): a reduce-scatter counts each "
    "rank's whole input, a reduce each sender's tensor and a broadcast the source's, so ZeRO's reduce-scatter counts "
    "the gradients once per rank where a ring sends (n-1)/n of them; on the wire of a ring both exchanges move about "
    "2(n-1)/n of the gradients per rank. The how-to page is [Memory-sized shards](../memory-shards.md)."
)

IDENTICAL_COLUMNS = (
    Column("step time / ZeRO-2", "step_seconds"),
    Column("bytes handed to collectives / ZeRO-2", "bytes_per_step"),
    Column("final loss / ZeRO-2", "final_loss"),
)
SMALL_DEVICE_COLUMNS = (Column("step time / memory-sized shards", "step_seconds"),)


def sections(files: Sequence[Path]) -> list[Section]:
    """A section per scenario, a row per configuration that trained, each figure over the round's reference fit."""
    rows: dict[str, list[Row]] = {"identical": [], "small-device": []}
    refusals: dict[str, str] = {}
    for path in files:
        record = json.loads(path.read_text())
        scenario, reference, rounds = record["scenario"], record["reference"], record["runs"]
        columns = IDENTICAL_COLUMNS if scenario == "identical" else SMALL_DEVICE_COLUMNS
        for name in rounds[0]:
            if "refused" in rounds[0][name]:
                refusals[name] = rounds[0][name]["refused"].split(", with the device memory")[0]
                continue
            values = {
                column.key: [run[name][column.key] / run[reference][column.key] for run in rounds] for column in columns
            }
            date = record.get("started", "")[:10]
            rows[scenario].append(Row(path.name, record.get("commit", ""), date, name, values, record.get("note", "")))
    refused = "; ".join(f"`{name}` refused: {message}" for name, message in sorted(refusals.items()))
    return [
        Section(
            "Identical ranks",
            "2 identical CPU ranks (gloo, one thread each), a fixed split 32/32, 40 steps measured from step 10; the "
            "three fits of a round back to back, the order reversed in every other round.",
            IDENTICAL_COLUMNS,
            tuple(rows["identical"]),
            "memory_shards.png",
        ),
        Section(
            "A small device",
            "The same ranks with `LIGHTNING_HETERO_EMULATE_MEMORY=200MiB,30MiB`: rank 1's device cannot hold an even "
            "ZeRO-2 share of Adam's state. Memory-sized shards give it about 1 % of the state; the pipeline places the "
            "blocks by speed and memory (each rank holds its blocks' whole state). The step is the time between two "
            f"training batches' starts on rank 0. {refused}.",
            SMALL_DEVICE_COLUMNS,
            tuple(rows["small-device"]),
            "memory_shards_small_device.png",
        ),
    ]
