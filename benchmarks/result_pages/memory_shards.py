"""The results page of ``benchmarks/memory_shards.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Row, Section

TITLE = "Memory-sized optimizer shards against DeepSpeed's ZeRO-1/2: `benchmarks/memory_shards.py`"
INTRO = (
    "What `HeteroStrategy(stage=2, shards='memory')` costs on identical ranks, where its shards come out equal, "
    "against DeepSpeed's own ZeRO-1 and ZeRO-2: the bytes each step hands to collectives and the step time. The model "
    "is an MLP 256-1024-1024-10 (1.3 M parameters) with Adam; the script's docstring says how each figure is taken. "
    "The bytes follow the package's meter (`lightning_hetero/comm/wire.py`): a reduce-scatter counts each rank's "
    "whole input, a reduce each sender's tensor and a broadcast the source's, so ZeRO's reduce-scatter counts the "
    "gradients once per rank where a ring sends (n-1)/n of them; on the wire of a ring both exchanges move about "
    "2(n-1)/n of the gradients per rank. The how-to page is [Memory-sized shards](../memory-shards.md)."
)

COLUMNS = (
    Column("step time / ZeRO-2", "step_seconds"),
    Column("bytes handed to collectives / ZeRO-2", "bytes_per_step"),
    Column("final loss / ZeRO-2", "final_loss"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """A row per configuration of each file, each figure over ZeRO-2's fit of the same round."""
    rows = []
    for path in files:
        record = json.loads(path.read_text())
        rounds = record["runs"]
        for name in rounds[0]:
            values = {
                column.key: [run[name][column.key] / run["zero2"][column.key] for run in rounds] for column in COLUMNS
            }
            rows.append(
                Row(
                    path.name,
                    record.get("commit", ""),
                    record.get("started", "")[:10],
                    name,
                    values,
                    record.get("note", ""),
                )
            )
    intro = (
        "2 identical CPU ranks (gloo, one thread each), a fixed split 32/32, 40 steps measured from step 10; the three "
        "fits of a round back to back, the order reversed in every other round."
    )
    return [Section("Identical ranks", intro, COLUMNS, tuple(rows), "memory_shards.png")]
