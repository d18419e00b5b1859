"""Recover: a data-parallel checkpoint read by parameter name, for a pipeline to resume (each rank keeps its blocks).

A data-parallel checkpoint is DeepSpeed's: the optimizer state is indexed (ZeRO-0: the client optimizer's
``state_dict``, whose indices follow its parameter groups) or cut into flat partitions (ZeRO 1-3). A pipeline's
ranks hold different blocks and resume by parameter name (:mod:`lightning_hetero.pipeline.state`), so the checkpoint
is read into the by-name form a pipeline's own checkpoint has (:mod:`.by_name`):

- ZeRO-0: the module as saved, and the optimizer's state with each index replaced by the name the manifest recorded
  for it at save time (``optimizer_parameter_names``; a checkpoint saved before the names were recorded is refused,
  with what to do);
- ZeRO 1-3: DeepSpeed's universal copy (:mod:`.universal`, converted once, by rank 0), which holds each parameter's
  fp32 weights and optimizer state in a folder of its name; the buffers come from the model-states file.

The trainer's state (loops, the loader's position in global samples, callbacks, schedulers) is the client state
Lightning saved beside DeepSpeed's own entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lightning_hetero.recover import by_name, checkpoint
from lightning_hetero.recover.by_name import SHARDS_KEY
from lightning_hetero.recover.export import _DEEPSPEED_STATES
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.safe_load import load_deepspeed_file

NAMES_KEY = "optimizer_parameter_names"  # the manifest's: per parameter group, the names in the optimizer's order
_PREFIX = "_forward_module."  # (Lightning < 2.1 saved the module under its wrapper's prefix)


def optimizer_parameter_names(module: Any, optimizer: Any) -> Optional[list[list[str]]]:
    """What a ZeRO-0 manifest records: each parameter group's parameter names, in the optimizer's order (None when a
    parameter is not the module's: the state could not be named)."""
    if optimizer is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    return None if any(name is None for group in groups for name in group) else groups  # type: ignore[return-value]


def check_readable_by_name(chosen: Path, manifest: dict[str, Any], in_full: bool = False) -> None:
    """Every rank, before rank 0 converts a ZeRO 1-3 checkpoint: refuse an optimizer whose state is not per
    parameter (DeepSpeed's flat partitions cannot be cut per parameter for it), saying what to do instead."""
    from lightning_hetero.recover import universal

    keys = universal.state_keys(chosen / checkpoint.deepspeed_tag(chosen), in_full)
    refused = sorted({entry for group in keys for entry in group.refused})
    if refused:
        raise ResumeRefused(
            f"Checkpoint {chosen} (data parallel, ZeRO-{manifest.get('zero_stage')}) cannot continue as a pipeline:"
            f" a stage takes its blocks' optimizer state by parameter name, and the {manifest.get('optimizer')}"
            f" optimizer keeps state that is not per parameter ({', '.join(refused)}). Resume it without `pipeline`."
        )


def data_parallel_state(
    chosen: Path, manifest: dict[str, Any], universal_copy: Optional[Path], in_full: bool = False
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The checkpoint ``chosen`` (data parallel, any ZeRO stage) by name: the whole model's ``state_dict``, the
    optimizer's ``{"state": {name: ...}, "param_groups": [{..., "params": [names]}]}``, and the trainer's state.
    ``universal_copy``: the directory DeepSpeed's universal copy is in, its tag folder inside (ZeRO 1-3;
    :func:`.elastic.convert_to_universal` made it); ``in_full``: the user trusts the checkpoint (else DeepSpeed's
    files load weights-only)."""
    tag = chosen / checkpoint.deepspeed_tag(chosen)
    stage = manifest.get("zero_stage", 0)
    if stage == 0:
        states = load_deepspeed_file(tag / "mp_rank_00_model_states.pt", in_full)
        model = {name.removeprefix(_PREFIX): value for name, value in states["module"].items()}
        if SHARDS_KEY in manifest:  # (memory-sized shards: each rank's optimizer state by name, in its own file)
            named = by_name.merged_shard_state(chosen, len(manifest[SHARDS_KEY].get("ranks") or []))
        else:
            named = _named_zero_0_state(chosen, manifest, states.get("optimizer"))
    else:
        assert universal_copy is not None, "ZeRO 1-3 are read from the universal copy"
        from lightning_hetero.recover.universal import rank_0_model_states

        states = load_deepspeed_file(rank_0_model_states(tag), in_full)
        model, named = _named_universal_state(universal_copy / tag.name, states, in_full)
    client = {key: value for key, value in states.items() if key not in _DEEPSPEED_STATES}
    return model, named, client


def _named_zero_0_state(chosen: Path, manifest: dict[str, Any], saved: Optional[dict[str, Any]]) -> dict[str, Any]:
    if not saved:
        return {"state": {}, "param_groups": []}
    if not {"state", "param_groups"} <= set(saved):
        raise ResumeRefused(
            f"Checkpoint {chosen} (data parallel, ZeRO-0) holds the optimizer state of DeepSpeed's own fp16/bf16"
            f" optimizer (keys {sorted(saved)[:4]}), not a torch optimizer's: a pipeline cannot take it by name. Resume"
            " it without `pipeline`."
        )
    names = manifest.get(NAMES_KEY)
    if names is None:
        raise ResumeRefused(
            f"Checkpoint {chosen} (data parallel, ZeRO-0) records no names for its optimizer's parameters: it was"
            " saved before they were recorded, and its optimizer state is indexed. Resume it once without `pipeline`"
            " and save again (the new checkpoint records them), then resume that one with `pipeline`."
        )
    if [len(group) for group in names] != [len(group["params"]) for group in saved["param_groups"]]:
        raise ResumeRefused(
            f"Checkpoint {chosen}: its manifest's parameter names ({[len(g) for g in names]} per group) do not match"
            f" its optimizer state ({[len(g['params']) for g in saved['param_groups']]}): the checkpoint was altered."
        )
    flat = [name for group in names for name in group]
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": list(group_names)}
        for group, group_names in zip(saved["param_groups"], names)
    ]
    return {"state": {flat[index]: value for index, value in saved["state"].items()}, "param_groups": groups}


def _named_universal_state(
    universal_copy: Path, states: dict[str, Any], in_full: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each parameter's folder in the universal copy: ``fp32.pt`` its weights, ``step.pt`` the step, every other file a
    per-element state (``exp_avg``...); the groups' membership from the model-states file's ``param_shapes``, their
    hyper-parameters from ``zero/optimizer_state.pt``."""
    from deepspeed.checkpoint import constants

    zero = universal_copy / "zero"
    hyper = load_deepspeed_file(zero / "optimizer_state.pt", in_full)[constants.PARAM_GROUPS]
    # (buffers: from the module as saved, which ZeRO 1-2 hold whole and ZeRO-3 leaves out; its parameters are stale)
    model = {name.removeprefix(_PREFIX): value for name, value in (states.get("module") or {}).items()}
    state: dict[str, Any] = {}
    groups = []
    for group_hyper, shapes in zip(hyper, states[constants.PARAM_SHAPES]):
        names = []
        for name in shapes:
            folder = zero / name
            own = name.removeprefix(_PREFIX)
            names.append(own)
            model[own] = load_deepspeed_file(folder / "fp32.pt", in_full)[constants.PARAM]
            entries = {}
            for path in sorted(folder.glob("*.pt")):
                if path.stem == "fp32":
                    continue
                value = load_deepspeed_file(path, in_full)
                entries[path.stem] = value if path.stem == "step" else value[constants.PARAM]
            if entries:
                state[own] = entries
        groups.append({**{k: v for k, v in group_hyper.items() if k != "params"}, "params": names})
    return model, {"state": state, "param_groups": groups}
