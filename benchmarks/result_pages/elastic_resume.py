"""The results page of ``benchmarks/elastic_resume.py`` (rendered by ``benchmarks/render.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from result_pages import Column, Section, record_of, row_of

TITLE = "An elastic job that loses a node: `benchmarks/elastic_resume.py`"
INTRO = (
    "Two torchrun agents on 127.0.0.1 (c10d rendezvous, `--nnodes=1:2 --nproc-per-node=1 --max-restarts=3`, "
    "torchrun's default rendezvous timeouts unless the setting names `--rdzv-conf`) train `tests/workers/fit.py` "
    'for 40 steps (global batch 16, a checkpoint every 5 steps, `fit(ckpt_path="last")`). Once the 2-rank '
    "checkpoint of step 5 is published, the second agent and its worker are SIGKILLed (a lost node); the first "
    "re-rendezvouses alone and its worker resumes on 1 rank, or is refused. A round is one such job: the seconds "
    "from the kill to the survivor's exit, its exit code, how many workers failed after the kill (the first lost "
    "its peer; the others are refused attempts), and, when the job finished, the largest parameter difference "
    "from one process trained on the same global batches. The how-to page is "
    "[Fault tolerance](../fault-tolerance.md#a-resume-on-fewer-or-more-devices)."
)

ELASTIC_COLUMNS = (
    Column("seconds from the kill to the survivor's exit", "seconds_after_kill", ".1f"),
    Column("survivor's exit code", "survivor_exit_code", ".0f"),
    Column("workers failed after the kill", "failures", ".0f"),
    Column("largest parameter difference from one process", "max_param_difference", ".1e"),
)


def sections(files: Sequence[Path]) -> list[Section]:
    """``benchmarks/elastic_resume.py``'s runs: one section, a row per run of the script (one optimizer, stage and
    rendezvous setting), each figure over its jobs."""
    rows = []
    for path in files:
        record = record_of(path)
        jobs = record["runs"]
        values = {
            "seconds_after_kill": [job["seconds_after_kill"] for job in jobs],
            "survivor_exit_code": [job["survivor_exit_code"] for job in jobs],
            "failures": [len(job["worker_failures"]) for job in jobs],
            "max_param_difference": [job.get("max_param_difference") for job in jobs],
        }
        setting = record["setting"]
        described = f"{setting['optimizer']}, ZeRO-{setting['stage']}, rendezvous: {setting['rdzv_conf']}"
        codes = "; ".join(", ".join(map(str, job["worker_failures"])) or "none" for job in jobs)
        note = " ".join(filter(None, [record.get("note", ""), f"The failed workers' exit codes, job by job: {codes}."]))
        rows.append(row_of(path, record, described, values, note))
    if not rows:
        return []
    intro = (
        "Exit code 0: the survivor resumed the 2-rank checkpoint on 1 rank and finished the 40 steps; otherwise "
        "torchrun gave up after its restarts (a refused resume exits 78 on every attempt). The seconds hold "
        "torchrun's re-rendezvous (`last_call_timeout`, 30 s by default, at each restart), the workers' start and "
        "what they then run (the resume and the 35 steps left, or a refused attempt). The parameter difference is "
        "left out where the job did not finish."
    )
    return [
        Section(
            "A node lost: resumed on 1 rank, or refused",
            intro,
            ELASTIC_COLUMNS,
            tuple(rows),
            "elastic_resume.png",
            reference=None,
        )
    ]
