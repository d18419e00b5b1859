"""Recover: a fit continues from a Lightning checkpoint file written under another strategy (DDP, one device).

A user switching to ``strategy="hetero"`` mid-training has a ``.ckpt`` file: ``state_dict`` (the module), the torch
optimizer's ``state_dict`` (per parameter index), the loops' progress, the LR schedulers, the callbacks. DeepSpeed
reads only its own checkpoint directories, so the strategy restores such a file itself, after DeepSpeed built its
engine, and hands the rest to Lightning as a checkpoint:

* the module's weights, on every rank (under ZeRO-3 through DeepSpeed's gathered parameters), and the fp32 master
  weights DeepSpeed keeps for the optimizer (ZeRO 1-3);
* the optimizer state: at ZeRO-0 DeepSpeed steps the user's own optimizer, which loads the state as saved; at ZeRO
  1-3 each parameter's state tensors (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``...) go into
  DeepSpeed's partitions through its public tensor-fragment API, and the step count into each partition's state;
* the data position: the file's progress in the epoch (batches done, each ``loader batch size x ranks`` samples, DDP's
  global batch, with this job's number of ranks) becomes the training loader's state, so the epoch continues where it
  stopped. DDP shuffles the training data with ``randperm(seed + epoch)`` and takes each global batch as one block of
  it, as this strategy does with a shuffling loader: then the rest of the epoch is exactly the samples DDP had not
  used. (An unshuffled loader keeps its own order here, so that epoch's rest differs; the later epochs are whole.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.safe_load import UnsafeCheckpointFile, load_lightning_file
from lightning_hetero.train.order import STATE_EPOCH, STATE_NUM_SAMPLES, STATE_SAMPLES_CONSUMED, STATE_SEED

# Where Lightning keeps the fit loop's state, and the training loader's state inside it (lightning 2.x).
_LOOPS, _FIT_LOOP = "loops", "fit_loop"


def read_lightning_checkpoint(path: Path, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The dict of a Lightning ``.ckpt`` file, loaded as Lightning's ``weights_only`` asks (None: weights-only, see
    :mod:`~lightning_hetero.runtime.safe_load`); a clear error when the file is not one, or holds what weights-only
    loading refuses."""
    try:
        checkpoint = load_lightning_file(path, weights_only)
    except UnsafeCheckpointFile as error:
        raise ResumeRefused(str(error)) from None
    except Exception as error:  # noqa: BLE001 - reported with the path
        message = f"`ckpt_path` {path} is a file that does not load as a Lightning checkpoint: {error}."
        raise ResumeRefused(message) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise ResumeRefused(
            f"`ckpt_path` {path} is neither a HeteroStrategy checkpoint directory nor a Lightning checkpoint file (no"
            " `state_dict` in it)."
        )
    return checkpoint


def batches_done_in_epoch(checkpoint: dict[str, Any]) -> int:
    """The training batches of its current epoch the file's fit had trained on (0 at an epoch's end).

    "processed", not "completed": a checkpoint saved in ``on_train_batch_end`` (ModelCheckpoint's
    ``every_n_train_steps``) counts the batch just trained as processed and not yet completed.
    """
    progress = checkpoint.get(_LOOPS, {}).get(_FIT_LOOP, {}).get("epoch_loop.batch_progress", {})
    current = progress.get("current", {}) if isinstance(progress, dict) else {}
    return int(current.get("processed", 0) or 0)


def loader_state_for(
    checkpoint: dict[str, Any], global_batch: int, num_samples: int, seed: int
) -> Optional[dict[str, int]]:
    """The training loader's state that continues the file's epoch: None when the epoch had ended (it starts the
    next one whole) or was not begun."""
    done = batches_done_in_epoch(checkpoint)
    if done == 0:
        return None
    epoch = int(
        checkpoint.get(_LOOPS, {})
        .get(_FIT_LOOP, {})
        .get("epoch_progress", {})
        .get("current", {})
        .get("completed", checkpoint.get("epoch", 0))
    )
    return {
        STATE_EPOCH: epoch,
        STATE_SAMPLES_CONSUMED: min(done * global_batch, num_samples),
        STATE_NUM_SAMPLES: num_samples,
        STATE_SEED: seed,
    }


def with_loader_state(checkpoint: dict[str, Any], loader_state: dict[str, int]) -> dict[str, Any]:
    """``checkpoint`` with ``loader_state`` where Lightning restores a stateful training loader from."""
    fit_loop = checkpoint.setdefault(_LOOPS, {}).setdefault(_FIT_LOOP, {})
    fit_loop.setdefault("state_dict", {})["combined_loader"] = [loader_state]
    return checkpoint


def load_module_weights(module: torch.nn.Module, state_dict: dict[str, Any], strict: bool) -> None:
    """The file's weights into ``module`` on every rank (ZeRO-3: gathered, set on rank 0, partitioned again)."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    gathered: Any = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)
    with gathered:
        module.load_state_dict(state_dict, strict=strict)


def load_optimizer_state(
    engine: Any, parameters: Sequence[tuple[str, torch.nn.Parameter]], saved: dict[str, Any], weights: dict[str, Any]
) -> None:
    """A torch optimizer's ``state_dict`` (saved for ``parameters``, named and in the optimizer's order) into
    DeepSpeed's optimizer; ``weights`` (the file's ``state_dict``) give the fp32 master weights."""
    if engine.zero_optimization_stage() == 0:
        engine.optimizer.load_state_dict(saved)  # DeepSpeed steps the user's own optimizer at ZeRO-0
        return
    saved_ids = [index for group in saved["param_groups"] for index in group["params"]]
    if len(saved_ids) != len(parameters):
        raise ResumeRefused(
            f"The checkpoint's optimizer has {len(saved_ids)} parameters and this model's {len(parameters)}: it was"
            " saved for another model or another configure_optimizers()."
        )
    zero = engine.optimizer
    base = zero.optimizer  # the user's optimizer, over DeepSpeed's flat fp32 partitions
    _create_state(base, _flat_partitions(zero), next(iter(saved["state"].values()), {}))
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2: map the parameters into it
    if link is not None:
        zero._hp_optimizer_states_linked = False
        link()
    for group, saved_group in zip(base.param_groups, saved["param_groups"]):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    set_full = _set_zero3_full if hasattr(zero, "fp32_partitioned_groups_flat") else _set_zero12_full
    for (name, parameter), index in zip(parameters, saved_ids):
        full = weights[name]  # (a ZeRO-3 parameter holds only its partition)
        set_full(zero, parameter, full, None)  # the master weights DeepSpeed steps
        for key, value in saved["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == full.shape:
                set_full(zero, parameter, value, key)


def _set_zero12_full(zero: Any, parameter: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if key is None:
        safe_set_full_fp32_param(parameter, value.float())
    else:
        safe_set_full_optimizer_state(parameter, value.float(), key)


def _set_zero3_full(zero: Any, parameter: torch.nn.Parameter, value: torch.Tensor, key: Optional[str]) -> None:
    """DeepSpeed's ``set_full_hp_param`` for ZeRO-3, with the padding it misses: a parameter whose size is not a
    multiple of the ranks has a padded last partition ("start (1) + length (1) exceeds dimension size (1)")."""
    partition, _ = zero._get_fp32_opt_state_partition(parameter, release_swap_buffers=True, optim_state_key=key)
    start = partition.numel() * zero._get_param_partition_rank(parameter)
    piece = value.detach().float().flatten()[start : start + partition.numel()]
    with torch.no_grad():
        partition.zero_()
        partition[: piece.numel()].copy_(piece)


def _flat_partitions(zero: Any) -> list[torch.Tensor]:
    """The flat fp32 partitions DeepSpeed's ZeRO optimizer steps (one per parameter group or sub-group)."""
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        return list(zero.fp32_partitioned_groups_flat)
    return list(zero.single_partition_of_fp32_groups)  # ZeRO-1/2


def _create_state(base: torch.optim.Optimizer, partitions: list[torch.Tensor], example: dict[str, Any]) -> None:
    """The optimizer's state for each flat partition, shaped after one parameter's saved state (a torch optimizer
    creates it at its first step; DeepSpeed's tensor-fragment API writes into it)."""
    for partition in partitions:
        base.state[partition] = {
            key: torch.zeros_like(partition)
            if isinstance(value, torch.Tensor) and value.dim()
            else (value.clone() if isinstance(value, torch.Tensor) else value)
            for key, value in example.items()
        }
