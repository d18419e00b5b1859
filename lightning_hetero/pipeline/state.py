"""Recover: a pipeline's checkpoint, by parameter name, so that it resumes on any boundaries and number of ranks.

Each rank holds different blocks, so DeepSpeed's own save (rank 0 writes "the" model) does not fit. Each rank writes
``pipeline_rank{r}.pt``: its module's ``state_dict()`` (its blocks under the model's names, ``net.3.weight``, and the
modules outside the chain) and its optimizer's state keyed by parameter name (any optimizer whose state is per
parameter: SGD's momentum, Adam's moments and step). Rank 0 also writes what Lightning's checkpoint holds besides
(loops, epoch, callbacks, schedulers, the training loader's position). The files go through the same staged,
manifested, atomic save as every checkpoint of the package (:mod:`~lightning_hetero.recover.elastic`).

On resume each rank reads every file and keeps the names it holds now: another ``boundaries`` (a re-planned split)
or another number of pipelines resumes exactly. A name no file holds, or an optimizer whose state has no per-parameter
form, is refused on every rank with what to do.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_hetero.recover.by_name import (  # noqa: F401 (whole_model_state: this module's documented name)
    CLIENT_FILE,
    EXCLUDED,
    RANK_FILE,
    named_optimizer_state,
    whole_model_state,
    whole_state,
)
from lightning_hetero.runtime.safe_load import load_lightning_file


def save_stage(directory: Path, rank: int, module: nn.Module, optimizer: Any, trainer_state: dict[str, Any]) -> None:
    """This rank's part of the checkpoint (rank 0: with the trainer's state)."""
    torch.save(
        {"model": module.state_dict(), "optimizer": named_optimizer_state(module, optimizer)},
        directory / RANK_FILE.format(rank=rank),
    )
    if rank == 0:
        torch.save({k: v for k, v in trainer_state.items() if k not in EXCLUDED}, directory / CLIENT_FILE)


def load_stage(
    directory: Path,
    module: nn.Module,
    optimizer: Any,
    weights_only: Optional[bool] = None,
    skipped: Collection[str] = (),
) -> dict[str, Any]:
    """This rank's parameters and optimizer state (``optimizer`` None: none) from every rank's file, by name; returns
    the trainer's state.

    The rank files hold tensors and plain containers (read weights-only); the trainer's state holds what the user's
    module and callbacks saved (its hyper-parameters may be a ``Path``, a config object), so it is read as Lightning
    reads a ``.ckpt``, as ``weights_only`` (``Trainer.fit``'s) asks.
    """
    model, named = whole_state(directory)
    load_named_state(directory, model, named, module, optimizer, skipped)
    return load_lightning_file(directory / CLIENT_FILE, weights_only)


def load_named_state(
    source: Path,
    model: dict[str, Any],
    named: dict[str, Any],
    module: nn.Module,
    optimizer: Any,
    skipped: Collection[str] = (),
) -> None:
    """This rank's parameters, buffers and optimizer state (``optimizer`` None: none) out of the whole model's
    ``model`` and ``named`` optimizer state, by name: a pipeline's checkpoint (:func:`whole_state`) or a data-parallel
    one (:mod:`lightning_hetero.recover.into_pipeline`), ``source``. ``skipped``: parameters whose optimizer state
    another rank keeps (``stage=1``'s shards)."""
    wanted = module.state_dict()
    missing = [name for name in wanted if name not in model]
    if missing:
        raise ValueError(
            f"The checkpoint {source} holds no {missing[:5]}: it was saved from another model. Resume it with the"
            " model it was trained with."
        )
    module.load_state_dict({name: model[name] for name in wanted})
    if optimizer is not None:  # (None: `validate`, `test` or `predict`, whose engine has no optimizer)
        state = {name: value for name, value in named["state"].items() if name not in skipped}
        _load_optimizer(module, optimizer, state, named["param_groups"])


def _load_optimizer(module: nn.Module, optimizer: Any, state: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    names = {id(p): n for n, p in module.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The pipeline checkpoint's optimizer has {len(groups)} parameter groups, this run's"
            f" {len(optimizer.param_groups)}: `configure_optimizers` changed. Resume with the same optimizer."
        )
    index = 0
    rebuilt_groups = []
    for group, saved in zip(optimizer.param_groups, groups):
        count = len(group["params"])
        rebuilt_groups.append(
            {**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(index, index + count))}
        )
        index += count
    rebuilt_state = {i: state[name] for i, name in enumerate(ordered) if name in state}
    optimizer.load_state_dict({"state": rebuilt_state, "param_groups": rebuilt_groups})
