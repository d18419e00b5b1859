"""The results page of ``benchmarks/checkpoint_checksums.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Section, record_of, row_of

TITLE = "What the checkpoint checksums cost: `benchmarks/checkpoint_checksums.py`"
INTRO = (
    "A checkpoint directory shaped like a 2-rank ZeRO-2 DeepSpeed checkpoint (one model-states file and one "
    "optimizer-states file per rank, `torch.save` of fp32 tensors, a third of the bytes each) is written into "
    "`benchmarks/` (the disk, not a tmpfs), then timed once per repeat, a fresh checkpoint each: *write* is the "
    "`torch.save` of its files; *sizes* is listing every file's size (the manifest as format 1 had it); *manifest* "
    "is `checkpoint.write_manifest`, sizes and the CRC-32 of every file, which rank 0 runs at every save; *verify* "
    "is `checkpoint.incompleteness(verify_checksums=True)`, what a resume reads, with the files in the page cache "
    "(warm) and again after dropping it (cold, as after a restart; root only). The checksums' cost at a save is "
    "*manifest* - *sizes*. The how-to page is [Fault tolerance](../fault-tolerance.md#complete-or-ignored-checkpoints)."
)

CHECKSUM_COLUMNS = (
    Column("checksums at a save, s per GB", "save_per_gb", ".2f"),
    Column("checksums / writing the files", "save_over_write", ".3f"),
    Column("verify at a resume, warm, s per GB", "verify_per_gb", ".2f"),
    Column("verify at a resume, cold, s per GB", "verify_cold_per_gb", ".2f"),
    Column("writing the files, s per GB", "write_per_gb", ".2f"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/checkpoint_checksums.py``'s runs: one section, a row per run of the script, each figure over its
    repeats, in seconds per GB of checkpoint (the checkpoint's size is the run's setting)."""
    rows = []
    for path in files:
        record = record_of(path)
        gigabytes = record["setting"]["bytes"] / 1e9
        repeats = record["repeats"]

        def per_gb(key: str, repeats: list = repeats, gigabytes: float = gigabytes) -> list:
            return [None if repeat[key] is None else repeat[key] / gigabytes for repeat in repeats]

        values = {
            "save_per_gb": per_gb("manifest_extra"),
            "save_over_write": [repeat["manifest_extra"] / repeat["write"] for repeat in repeats],
            "verify_per_gb": per_gb("verify"),
            "verify_cold_per_gb": per_gb("verify_cold"),
            "write_per_gb": per_gb("write"),
        }
        setting = f"{gigabytes:.2f} GB in 3 files"
        if not record["setting"]["page_cache_dropped"]:
            setting += ", page cache not dropped (not root)"
        rows.append(row_of(path, record, setting, values, record.get("note", "")))
    if not rows:
        return []
    intro = (
        "Seconds per GB of checkpoint, each repeat a fresh checkpoint. *checksums at a save* is what the CRC-32s "
        "add to rank 0's manifest (`write_manifest` less listing the sizes); *checksums / writing the files* is that "
        "over the repeat's `torch.save` of the files, what DeepSpeed's save costs at least. *verify* is what a "
        "resume reads: warm from the page cache, cold after dropping it (no value where the run could not)."
    )
    return [
        Section(
            "The CRC-32 of every file: at a save and at a resume",
            intro,
            CHECKSUM_COLUMNS,
            tuple(rows),
            "checkpoint_checksums.png",
            reference=None,
        )
    ]
