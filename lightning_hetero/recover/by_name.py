"""Recover: a checkpoint keyed by parameter name, as a pipeline writes it, read whole by another way of training.

A pipeline's ranks hold different blocks, so each writes ``pipeline_rank{r}.pt``: its module's ``state_dict()`` (its
blocks under the model's names, and the modules outside the chain) and its optimizer's state and groups with
parameter names in place of indices (:func:`named_optimizer_state`); rank 0 also writes what Lightning's checkpoint
holds besides (``pipeline_trainer_state.pt``). Every rank's names together are the whole model: a pipeline on other
boundaries keeps the names it holds now (:mod:`lightning_hetero.pipeline.state`), and data-parallel training takes
them all (:func:`whole_state`, :func:`indexed_optimizer_state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.safe_load import load_package_file

RANK_FILE = "pipeline_rank{rank}.pt"
# Data-parallel training with memory-sized shards (split/optimizer_shards.py): each rank's optimizer state by name.
SHARD_FILE = "optimizer_shard_rank{rank}.pt"
SHARDS_KEY = "optimizer_shards"  # the manifest's: the optimizer state is in the shard files (and who held what)
CLIENT_FILE = "pipeline_trainer_state.pt"
EXCLUDED = ("state_dict", "optimizer_states")  # (as DeepSpeedStrategy leaves them out of its client state)


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state and groups with parameter names in place of its indices."""
    names = {id(p): n for n, p in module.named_parameters()}
    saved = optimizer.state_dict()
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    state = {names[id(ordered[index])]: value for index, value in saved["state"].items()}
    groups = []
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        groups.append(
            {
                **{k: v for k, v in saved_group.items() if k != "params"},
                "params": [names[id(p)] for p in group["params"]],
            }
        )
    return {"state": state, "param_groups": groups}


def rank_files(directory: Path) -> list[Path]:
    """Every rank's file of a checkpoint keyed by name, or the refusal saying what the directory is not."""
    files = sorted(Path(directory).glob(RANK_FILE.format(rank="*")))
    if not files or not (Path(directory) / CLIENT_FILE).is_file():
        raise ValueError(
            f"{directory} holds no pipeline checkpoint ({RANK_FILE.format(rank='N')} and {CLIENT_FILE}): it was"
            " saved without `pipeline`. Resume it without `pipeline`, or start this pipeline run afresh."
        )
    return files


def whole_model_state(directory: Path) -> dict[str, Any]:
    """The whole model's ``state_dict`` from a pipeline checkpoint (every rank's blocks, merged by name): what a run
    without ``pipeline`` loads, e.g. ``model.load_state_dict(whole_model_state(path))`` before ``trainer.test``."""
    merged: dict[str, Any] = {}
    for path in sorted(Path(directory).glob(RANK_FILE.format(rank="*"))):
        for name, tensor in load_package_file(path)["model"].items():
            merged.setdefault(name, tensor)  # (the modules outside the chain are in every file, equal)
    if not merged:
        raise ValueError(f"{directory} holds no pipeline checkpoint ({RANK_FILE.format(rank='N')}).")
    return merged


def whole_state(directory: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's file read once and merged by name: the whole model's ``state_dict``, and the optimizer's
    ``{"state": {name: ...}, "param_groups": [{..., "params": [names]}]}``, each group's names from every rank that
    holds some (its hyper-parameters are the same on all)."""
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for path in rank_files(directory):
        part = load_package_file(path)
        for name, tensor in part["model"].items():
            model.setdefault(name, tensor)  # (the modules outside the chain are in every file, equal)
        for name, value in part["optimizer"]["state"].items():
            state.setdefault(name, value)
        for index, group in enumerate(part["optimizer"]["param_groups"]):
            if index == len(groups):
                groups.append({**group, "params": []})
            groups[index]["params"] += [name for name in group["params"] if name not in groups[index]["params"]]
    return model, {"state": state, "param_groups": groups}


def indexed_optimizer_state(named: dict[str, Any], parameters: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``named`` (the optimizer's part of :func:`whole_state`) as a torch ``state_dict`` for an optimizer over
    ``parameters`` ((name, parameter) in its order, its groups one after another): state and groups by index."""
    index_of = {name: index for index, (name, _) in enumerate(parameters)}
    missing = sorted(set(index_of) - {name for group in named["param_groups"] for name in group["params"]})
    if missing:
        raise ResumeRefused(
            f"The pipeline checkpoint's optimizer holds no {missing[:5]}: it was saved for another model or another"
            " `configure_optimizers`. Resume it with the model and optimizer it was trained with."
        )
    groups = []
    for group in named["param_groups"]:
        indices = sorted(index_of[name] for name in group["params"] if name in index_of)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
    state = {index_of[name]: _own_tensors(value) for name, value in named["state"].items() if name in index_of}
    return {"state": state, "param_groups": groups}


def _own_tensors(value: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state with tensors of its own (a loaded file may share one tensor between entries)."""
    return {key: item.clone() if isinstance(item, torch.Tensor) else item for key, item in value.items()}


def merged_shard_state(directory: Path, saved_by: int) -> dict[str, Any]:
    """The optimizer state of a data-parallel checkpoint saved with memory-sized shards, every rank's file merged by
    name (each parameter's state is in its owner's file alone; the groups are in every file, equal). ``saved_by``:
    the number of ranks that saved it, as its manifest says; a file short is refused, naming it."""
    files = {int(path.stem.rsplit("rank", 1)[1]): path for path in Path(directory).glob(SHARD_FILE.format(rank="*"))}
    missing = [rank for rank in range(saved_by) if rank not in files]
    if missing or not files:
        raise ResumeRefused(
            f"The checkpoint {directory} was saved with memory-sized optimizer shards by {saved_by} ranks, and holds"
            f" no {SHARD_FILE.format(rank=missing[0] if missing else 0)}: that rank's optimizer state is lost. Resume"
            " a checkpoint with every file its save wrote."
        )
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for rank in sorted(files):
        part = load_package_file(files[rank])["optimizer"]
        for name, value in part["state"].items():
            state.setdefault(name, value)
        if not groups:
            groups = part["param_groups"]
    return {"state": state, "param_groups": groups}
