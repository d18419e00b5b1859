"""The results page of ``benchmarks/overhead.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "What HeteroStrategy costs beside DDP: `benchmarks/overhead.py`"
INTRO = (
    "Two identical CPU ranks (one thread each, gloo) train an MLP 256-1024-1024-10 (1.3 M parameters, Adam) on a "
    "global batch of 512, split 256/256, under four strategies, each fit a job of its own started by Lightning's "
    'launcher: `Trainer(strategy="ddp")`; `HeteroStrategy()` with no stage (*default*: the lowest stage that fits, '
    "ZeRO-0 here); `HeteroStrategy(stage=0)`; `HeteroStrategy(stage=2)`. A *pair* (a round) runs the four back to "
    "back, their order rotating from pair to pair, and every ratio is taken within a pair. Each fit measures on rank "
    "0 the median wall time between the starts of two training steps from step 20 on (*step*), the time from the "
    "process's start (the OS's record) to the first training step (*start-up*), and each rank's peak resident "
    "memory (ru_maxrss). With `--plain` each pair also times the same model in plain loops without Lightning or "
    "the package (`torch.distributed.run`): torch's DistributedDataParallel and DeepSpeed's engine at ZeRO 0 and 2. "
    "The how-to page is [The drop-in contract](../drop-in.md)."
)

HETERO_NAMES = {"default": "default", "zero0": "stage=0", "zero2": "stage=2"}
NAMES = {"ddp": "DDP", **HETERO_NAMES}
MIB = 2**20

AGAINST_DDP = (
    Column("step / DDP's", "step_ratio"),
    Column("start-up beyond DDP's, s", "startup_extra_seconds", ".2f"),
    Column("peak memory beyond DDP's, rank 0, MiB", "extra_peak_mib", ".0f"),
)
ABSOLUTE = (
    Column("step, ms", "step_ms", ".1f"),
    Column("start-up, s", "startup_seconds", ".2f"),
    Column("peak memory rank 0, MiB", "peak_mib_0", ".0f"),
    Column("peak memory rank 1, MiB", "peak_mib_1", ".0f"),
)
PLAIN = (
    Column("plain loop's step / plain DDP's", "plain_step_ratio"),
    Column("plain loop's step, ms", "plain_step_ms", ".1f"),
)


def _name(record: dict[str, Any], strategy: str) -> str:
    """The strategy as the page writes it, with the stage the default chose in the run's pairs."""
    if strategy != "default":
        return NAMES[strategy]
    stages = sorted({str(pair["default"].get("zero_stage")) for pair in record["runs"]})
    return f"default (ZeRO-{'/'.join(stages)})"


def _setting(record: dict[str, Any], name: str) -> str:
    setting = record["setting"]
    return f"{name}, {setting['steps']} steps, global batch {setting['global_batch']}"


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/overhead.py``'s runs: each HeteroStrategy fit over DDP's of the same pair, every strategy's own
    figures, and (with ``--plain``) DeepSpeed's plain loops over DDP's; a row per strategy of each run."""
    against: list[Row] = []
    absolute: list[Row] = []
    plain: list[Row] = []
    for path in files:
        record = record_of(path)
        pairs = record["runs"]
        note = record.get("note", "")
        for strategy in NAMES:
            name = _name(record, strategy)
            values = {
                "step_ms": [pair[strategy]["step_seconds"] * 1e3 for pair in pairs],
                "startup_seconds": [pair[strategy]["startup_seconds"] for pair in pairs],
                "peak_mib_0": [pair[strategy]["peak_bytes"][0] / MIB for pair in pairs],
                "peak_mib_1": [pair[strategy]["peak_bytes"][1] / MIB for pair in pairs],
            }
            absolute.append(row_of(path, record, _setting(record, name), values, note if strategy == "ddp" else ""))
        for strategy in HETERO_NAMES:
            values = {
                "step_ratio": [pair[f"{strategy}_step_ratio"] for pair in pairs],
                "startup_extra_seconds": [pair[f"{strategy}_startup_extra_seconds"] for pair in pairs],
                "extra_peak_mib": [
                    (pair[strategy]["peak_bytes"][0] - pair["ddp"]["peak_bytes"][0]) / MIB for pair in pairs
                ],
            }
            row_note = note if strategy == "default" else ""
            against.append(row_of(path, record, _setting(record, _name(record, strategy)), values, row_note))
        if record["setting"].get("plain"):
            for strategy in ("ddp", "zero0", "zero2"):
                values = {
                    "plain_step_ratio": [
                        pair["plain_step_seconds"][strategy] / pair["plain_step_seconds"]["ddp"] for pair in pairs
                    ],
                    "plain_step_ms": [pair["plain_step_seconds"][strategy] * 1e3 for pair in pairs],
                }
                name = "torch DDP" if strategy == "ddp" else f"DeepSpeed ZeRO-{strategy[-1]}"
                plain.append(row_of(path, record, _setting(record, name), values))
    found = []
    if against:
        intro = (
            "Each HeteroStrategy fit against the DDP fit of the same pair: its step time over DDP's (1: no cost), "
            "its start-up less DDP's, and rank 0's peak memory less DDP's."
        )
        found.append(Section("HeteroStrategy beside DDP", intro, AGAINST_DDP, tuple(against), "overhead.png"))
    if absolute:
        intro = "Each strategy's own figures, over the pairs of a run (DDP included)."
        found.append(
            Section(
                "Each strategy's figures", intro, ABSOLUTE, tuple(absolute), "overhead_absolute.png", reference=None
            )
        )
    if plain:
        intro = (
            "`--plain`: the same model and per-rank batch in a plain loop on each rank of `torch.distributed.run`, "
            "without Lightning or the package: torch's DistributedDataParallel, and DeepSpeed's engine "
            "(`deepspeed.initialize`, contiguous gradients and overlap off) at ZeRO 0 and 2; the ratio is over the "
            "plain DDP loop of the same pair: what DeepSpeed's ZeRO itself costs."
        )
        found.append(Section("DeepSpeed in plain loops", intro, PLAIN, tuple(plain), "overhead_plain.png"))
    return found
