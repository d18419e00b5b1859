"""The results page of ``benchmarks/planner_validation.py`` (rendered by ``benchmarks/render.py``). A row's setting
starts with what its plot's label shows (up to the first comma): the GPU kind."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from result_pages import Column, Row, Section, record_of, row_of

TITLE = "The planner's GPU model against published figures: `benchmarks/planner_validation.py`"
INTRO = (
    "`lightning-hetero plan`'s model of a GPU held against published per-GPU training throughput with mixed "
    "precision on one GPU (`benchmarks/published_figures.json`, each figure with its source file at a commit): "
    "Lambda's deeplearning-benchmark (NVIDIA's PyTorch examples on 10 kinds: ResNet-50, BERT-base and BERT-large "
    "SQuAD at 384 tokens) and NVIDIA's DeepLearningExamples (ResNet-50 v1.5 and BERT-large SQuAD). The models "
    "(`benchmarks/published_models.py`) are measured on this machine as `plan` measures a user's model; each "
    "prediction is the step model's samples per second at the row's batch for one device of the kind, with the "
    "catalog's constants as the run found them (its JSON's `setting.constants`). Lambda's ResNet-50 and BERT-base "
    "rows are the calibration rows those constants were fitted on (`--fit`); BERT-large (a model not fitted) and "
    "NVIDIA's rows (a source not fitted) are held out. A cell is one figure of one row of one run of the script "
    "(n=1): a GPU's prediction comes from the model's counted FLOPs and bytes, not from this CPU's timing, so it "
    "changes with the code and the catalog, not with the machine or its load (`plan`'s own time and memory do). "
    "The how-to page is [Planning a cluster](../planning.md)."
)

MODEL_NAMES = {"resnet50": "ResNet-50", "bert-base": "BERT-base", "bert-large": "BERT-large"}
SPEED_COLUMNS = (
    Column("samples/s, predicted / published", "predicted_over_published"),
    Column("speed relative to the A100-80GB, predicted / published", "relative_predicted_over_published"),
    Column("largest micro-batch allowed / largest published run", "max_batch_ratio"),
)
SPLIT_COLUMNS = (
    Column("samples, planned / implied by the published speeds", "samples"),
    Column("step at the published speeds, planned split / implied split", "step"),
)
LINEARITY_COLUMNS = (
    Column("FLOPs, from the lines / counted", "flops"),
    Column("bytes moved, from the lines / counted", "bytes"),
    Column("saved activations, from the lines / counted", "saved"),
)
PLAN_COLUMNS = (
    Column("`plan`'s wall time, s", "seconds", ".1f"),
    Column("`plan`'s peak memory, GiB", "peak_rss_gib", ".2f"),
)


def _values(figures: dict[str, Any], columns: Sequence[Column]) -> dict[str, list[float]]:
    """Each column's one value (none where the figure is null: the reference kind's relative speed)."""
    return {c.key: [] if figures.get(c.key) is None else [float(figures[c.key])] for c in columns}


def sections(files: Sequence[Path]) -> list[Section]:
    """A section per source and model of the published rows (a row per GPU kind of each run of the script), then the
    split, the linearity of the counts `plan` extrapolates, and what `plan` itself takes here."""
    speed: dict[tuple[str, str, str], list[Row]] = {}
    split: list[Row] = []
    linearity: list[Row] = []
    plan: list[Row] = []
    for path in files:
        record = record_of(path)
        for row in record["rows"]:
            setting = f"{row['kind']}, batch {row['batch']}, {row['samples_per_second']:g} samples/s published"
            group = (row["source"], row["model"], row["role"])
            speed.setdefault(group, []).append(row_of(path, record, setting, _values(row, SPEED_COLUMNS)))
        planned = record["split"]
        for kind, samples, implied in zip(planned["kinds"], planned["planned"], planned["implied"]):
            values = {"samples": [samples / implied]}
            split.append(row_of(path, record, f"{kind}, {samples} planned, {implied} implied", values))
        split.append(row_of(path, record, "the step", {"step": [1 + planned["step_cost"]]}))
        for check in record["linearity"]:
            setting = f"{MODEL_NAMES.get(check['model'], check['model'])} at a batch of {check['batch']}"
            values = {key: [1 + check[f"{key}_error"]] for key in ("flops", "bytes", "saved")}
            linearity.append(row_of(path, record, setting, values))
        for run in record["laptop"]:
            setting = f"{MODEL_NAMES.get(run['model'], run['model'])} at a global batch of 1024 over 3 GPUs"
            plan.append(row_of(path, record, setting, _values(run, PLAN_COLUMNS)))
    found = []
    order = {name: index for index, name in enumerate(MODEL_NAMES)}
    for (source, model, role), rows in sorted(speed.items(), key=lambda g: (g[0][0], order.get(g[0][1], 99))):
        name = MODEL_NAMES.get(model, model)
        found.append(
            Section(
                f"{name}, {source}'s figures ({role})",
                f"{source}'s published samples/s of {name} on one GPU of each kind, at the batch the row ran. 1 is a "
                "right prediction. *Relative to the A100-80GB*: the kind's speed over the A100-80GB's of the same "
                "source and model, predicted over published (what decides a split; none for the A100-80GB itself). "
                "*Largest micro-batch*: what the planner allows on the kind against the largest batch a published "
                "run of that kind and model used (it fits; above 1 the planner allows what no published run shows).",
                SPEED_COLUMNS,
                tuple(rows),
                f"planner_validation_{source.lower()}_{model}.png",
            )
        )
    if split:
        found.append(
            Section(
                "A split of 768 ResNet-50 samples over A100-80GB + V100-16GB + A10",
                "The samples the planner gives each device against those the published speeds imply (Lambda's "
                "ResNet-50: samples in proportion to speed, every device done at once), and the step the planned "
                "split takes at the published speeds over the implied split's (1 is the best split).",
                SPLIT_COLUMNS,
                tuple(split),
                "planner_validation_split.png",
            )
        )
    if linearity:
        found.append(
            Section(
                "The counts `plan` extrapolates",
                "`plan` counts a step's FLOPs, bytes moved and saved activations at micro-batches 2 and 4 and "
                "extrapolates them as lines: each at a larger batch, from the lines over counted there (1: linear).",
                LINEARITY_COLUMNS,
                tuple(linearity),
                "planner_validation_linearity.png",
            )
        )
    if plan:
        found.append(
            Section(
                "What `plan` takes here",
                "`lightning-hetero plan` for the model at a global batch of 1,024 over A100-80GB + V100-16GB + T4, run "
                "in a child process on this machine: its wall time and its peak resident memory.",
                PLAN_COLUMNS,
                tuple(plan),
                "planner_validation_plan.png",
                reference=None,
            )
        )
    return found
