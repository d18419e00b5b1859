"""Recover: a HeteroStrategy checkpoint loads into a plain model, as a Lightning ``.ckpt`` file does.

A DeepSpeed checkpoint is a directory of per-rank shards, so ``Model.load_from_checkpoint(".../last.ckpt")`` raised
``IsADirectoryError``. With this package imported, Lightning's loader (``lightning.pytorch.core.saving.pl_load``, which
``load_from_checkpoint`` calls) reads such a directory as the dict a Lightning checkpoint file holds: ``state_dict``
with the whole model in fp32 (gathered from the ZeRO shards; at ZeRO-0 the module as saved) and the rest of what
Lightning saved (hyper-parameters, loops, callbacks). The directory is checked first (manifest, sizes, checksums), so a
damaged one is named instead of failing inside ``torch.load``. Every other path goes to Lightning's loader unchanged.

:func:`save_as_lightning_checkpoint` writes the same dict to a file, which any Lightning loads without this package
(Lightning's own ``convert_zero_checkpoint_to_fp32_state_dict`` does the same for ZeRO 1-3, not for ZeRO-0).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hetero.recover import checkpoint
from lightning_hetero.runtime.internal_access import replace, resolve
from lightning_hetero.runtime.lightning_internals import LIGHTNING_CHECKPOINT_LOAD
from lightning_hetero.runtime.safe_load import check_checkpoint_directory, load_deepspeed_file, unpickles_in_full

# DeepSpeed's own entries in the model-states file; what remains is the client state Lightning saved.
_DEEPSPEED_STATES = frozenset(
    {
        "module",
        "optimizer",
        "lr_scheduler",
        "csr_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "buffer_names",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "checkpoint_parallel_dimensions",
    }
)


def is_hetero_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a local checkpoint directory HeteroStrategy wrote (it holds the manifest)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    return (Path(path) / checkpoint.MANIFEST_NAME).is_file()


def lightning_checkpoint(path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The checkpoint directory ``path`` as the dict of a Lightning ``.ckpt`` file (weights in fp32, on the CPU).
    ``weights_only``: Lightning's argument. Unless it says the user trusts the checkpoint (False; see
    :func:`~lightning_hetero.runtime.safe_load.unpickles_in_full`), every file is checked before anything is
    unpickled (ZeRO 1-3's shards are read by DeepSpeed's own loader, in full), and the file holding Lightning's state
    loads weights-only with DeepSpeed's own classes allowed."""
    path = Path(path)
    damage = checkpoint.incompleteness(path, verify_checksums=True)
    if damage is not None:
        raise ValueError(f"Checkpoint {path} cannot be loaded: {damage}.")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, get_model_state_file

    in_full = unpickles_in_full(weights_only)
    if not in_full:
        check_checkpoint_directory(path)
    tag = checkpoint.deepspeed_tag(path)
    stage = (checkpoint.read_manifest(path) or {}).get("zero_stage", 0)
    client = load_deepspeed_file(Path(get_model_state_file(str(path / tag), stage)), in_full)
    if stage == 0:
        state_dict = client["module"]  # ZeRO-0 saves the whole module as it is
    else:
        # (its progress lines and bars are not for the user)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state_dict = get_fp32_state_dict_from_zero_checkpoint(str(path), tag)
    loaded = {key: value for key, value in client.items() if key not in _DEEPSPEED_STATES}
    # (Lightning < 2.1 saved the module under its wrapper's `_forward_module.` prefix)
    loaded["state_dict"] = {key.removeprefix("_forward_module."): value for key, value in state_dict.items()}
    return loaded


def save_as_lightning_checkpoint(path: Any, output_file: Any, weights_only: Optional[bool] = None) -> Path:
    """Write checkpoint directory ``path`` as one Lightning ``.ckpt`` file that loads without this package
    (``weights_only``: as for :func:`lightning_checkpoint`; False when you trust a checkpoint that holds more than
    plain data)."""
    output = Path(output_file)
    torch.save(lightning_checkpoint(path, weights_only), output)
    return output


def _loading_hetero_checkpoints(load: Callable[..., Any]) -> Callable[..., Any]:
    def load_checkpoint(path_or_url: Any, map_location: Any = None, weights_only: Any = None) -> Any:
        if is_hetero_checkpoint(path_or_url):
            # (CPU tensors; load_from_checkpoint moves the model after)
            return lightning_checkpoint(path_or_url, weights_only)
        return load(path_or_url, map_location=map_location, weights_only=weights_only)

    load_checkpoint.__wrapped__ = load  # type: ignore[attr-defined]
    return load_checkpoint


def install() -> None:
    """Make ``LightningModule.load_from_checkpoint`` read HeteroStrategy checkpoint directories (idempotent)."""
    internal = LIGHTNING_CHECKPOINT_LOAD
    current = resolve(internal)
    if getattr(current, "__wrapped__", None) is None:
        replace(internal, _loading_hetero_checkpoints(current))
