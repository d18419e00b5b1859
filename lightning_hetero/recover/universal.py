"""Recover: a ZeRO 1-3 checkpoint of N ranks in DeepSpeed's universal layout, for every optimizer whose state is per
parameter, so that it loads on M ranks with that state (SGD's momentum, Adam's moments, RMSprop's, Adagrad's sums...).

Why not DeepSpeed's own converter (``python -m deepspeed.checkpoint.ds_to_universal``, 0.19.8): it reads Adam's
``exp_avg`` and ``exp_avg_sq`` by name, so an SGD or RMSprop checkpoint fails with KeyError 'exp_avg', NAdam's with
"narrow() cannot be applied to a 0-dim tensor", and AdamW(amsgrad=True)'s ``max_exp_avg_sq`` is left out (the resumed
run then fails at its first step with KeyError 'max_exp_avg_sq'). Its ZeRO-3 loader loads those two names only, too
(:func:`load_zero3`). Its ZeRO-1/2 loader is generic: it loads every ``<key>.pt`` a parameter's folder holds.
(deepspeedai/DeepSpeed#8608 reports the same, open for 0.19.8.)

This converts as DeepSpeed's converter does, for whatever the state holds: every rank's flat partition of the fp32
master weights and of each state tensor is cut into the pieces that belong to each parameter, and a parameter's
pieces, in rank order, are the whole parameter (:func:`zero12_pieces`, :func:`zero3_pieces`, :func:`assemble`). What
can be converted is decided by :func:`classify_state`: a tensor shaped like the flat partition holds one value per
element of the parameters; ``step`` (a number) is the same for every parameter of the group; anything else (a number
that is not the step, such as NAdam's ``mu_product``; LBFGS's history; a tensor of another shape) has no per-element
meaning to re-partition for another number of ranks, and is refused (:func:`refusal`).

The layout written is DeepSpeed's (what its converter writes and its loaders read)::

    <output>/../latest_universal          the tag (DeepSpeed's loader reads it)
    <output>/*model_states.pt             the checkpoint's own (Lightning's client state, the buffers)
    <output>/zero/optimizer_state.pt      rank 0's optimizer state without its partitions, with the param groups
    <output>/zero/<param>/<key>.pt        {"param": the whole parameter's tensor, "cat_dim": 0}: "fp32" and each key
    <output>/zero/<param>/step.pt         the step, where the optimizer keeps one
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.runtime.safe_load import load_deepspeed_file

FP32 = "fp32"  # DeepSpeed's name for the fp32 master weights in the universal layout (constants.FP32_WEIGHT_KEY)
STEP = "step"
Piece = tuple[int, int, int]  # (rank, offset in that rank's flat partition, number of elements)

_OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_RANK_0_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


@dataclass(frozen=True)
class StateKeys:
    """What one parameter group's optimizer state holds in a ZeRO checkpoint (flat, one partition per rank)."""

    per_parameter: tuple[str, ...]  # tensors shaped like the flat partition: one value per element of the parameters
    step: bool  # a `step` number, the same for every parameter of the group
    refused: tuple[str, ...]  # entries with no per-element meaning, each as "'key' (what it is)"


def classify_state(state: Mapping[str, Any], partition_numel: int) -> StateKeys:
    """Which entries of a group's ``state`` (as the ZeRO optimizer keeps it over its flat partition of
    ``partition_numel`` elements) can be cut per parameter and put together again for another number of ranks."""
    per_parameter, refused, step = [], [], False
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == partition_numel:
            if key == FP32 or not re.fullmatch(r"[\w.-]+", str(key)):
                # Each key becomes a file beside DeepSpeed's own "fp32.pt", which its loader reads by name.
                refused.append(f"{key!r} (a name the universal layout cannot hold)")
            else:
                per_parameter.append(key)
        elif key == STEP and _is_number(value):
            step = True
        else:
            refused.append(f"{key!r} ({_describe(value, partition_numel)})")
    return StateKeys(tuple(per_parameter), step, tuple(refused))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def _describe(value: Any, partition_numel: int) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return "a number that is not the step"
        return f"a tensor of shape {tuple(value.shape)}, not one value per parameter element ({partition_numel})"
    if isinstance(value, (int, float)):
        return "a number that is not the step"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} entries"
    return f"a {type(value).__name__}"


def refusal(
    path: Path, optimizer: str, stage: int, saved_world_size: Any, world_size: int, groups: Sequence[StateKeys]
) -> Optional[str]:
    """Why checkpoint ``path`` cannot be resumed on ``world_size`` ranks; None when it can."""
    refused = sorted({entry for group in groups for entry in group.refused})
    if not refused:
        return None
    return (
        f"Checkpoint {path} was saved by {saved_world_size} ranks with ZeRO-{stage}; this job has {world_size}. ZeRO"
        f" splits the optimizer state by rank, and resuming on another number of ranks cuts it per parameter and"
        f" splits it again, but the {optimizer} optimizer keeps state that is not per parameter:"
        f" {', '.join(refused)}. Resume on {saved_world_size} ranks; or, where the number of ranks may change, train"
        " with ZeRO-0 (every rank keeps the whole optimizer state) or with an optimizer whose state is one tensor per"
        " parameter and a step (SGD, Adam, AdamW, RMSprop, Adagrad...)."
    )


def zero12_pieces(slice_mappings: Sequence[Mapping[str, Any]]) -> dict[str, list[Piece]]:
    """Where each parameter of one ZeRO-1/2 parameter group lies in the ranks' flat partitions.

    ``slice_mappings[r]`` is rank r's ``param_slice_mappings`` entry for the group: name -> DeepSpeed's
    ``fragment_address`` (``start`` in the rank's partition, ``numel``). ZeRO-1/2 flatten the group's parameters into
    one vector and split it evenly by rank, so a parameter cut by a rank boundary goes on at offset 0 of the next
    rank: its pieces in rank order are the whole parameter, flattened (as DeepSpeed's extract_zero_shards and
    _merge_zero_shards put it together).
    """
    pieces: dict[str, list[Piece]] = {}
    for rank, mapping in enumerate(slice_mappings):
        for name, address in mapping.items():
            pieces.setdefault(name, []).append((rank, int(address.start), int(address.numel)))
    return pieces


def zero3_pieces(shapes: Sequence[tuple[str, Sequence[int]]], world_size: int) -> dict[str, list[Piece]]:
    """Where each parameter of one ZeRO-3 sub-group lies in the ranks' flat partitions.

    ZeRO-3 partitions every parameter by itself: ``ceil(numel / world_size)`` elements per rank, the last rank's
    piece padded with zeros; a rank's flat partition is its piece of each parameter of the sub-group, in order
    (``shapes``: the sub-group's parameters with their full shapes, as the checkpoint's ``param_shapes`` lists them).
    """
    pieces: dict[str, list[Piece]] = {}
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world_size)
        pieces[name] = [
            (rank, offset, min(per_rank, numel - rank * per_rank))
            for rank in range(world_size)
            if numel - rank * per_rank > 0
        ]
        offset += per_rank
    return pieces


def assemble(name: str, pieces: Sequence[Piece], flats: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """Parameter ``name`` (of ``shape``) put together from its ``pieces`` of the ranks' flat partitions ``flats``."""
    numel = math.prod(shape)
    held = sum(piece[2] for piece in pieces)
    if held != numel or any(offset + count > flats[rank].numel() for rank, offset, count in pieces):
        raise ValueError(
            f"The checkpoint's partitions do not hold parameter {name} of shape {tuple(shape)} ({numel} elements):"
            f" its pieces {list(pieces)} hold {held}, in partitions of {[flat.numel() for flat in flats]} elements."
        )
    if not pieces:
        return torch.zeros(tuple(shape), dtype=flats[0].dtype if flats else torch.float32)
    return torch.cat([flats[rank].reshape(-1).narrow(0, offset, count) for rank, offset, count in pieces]).view(shape)


# ---------------------------------------------------------------------------------------------- the checkpoint's files


class _Partitions:
    """A ZeRO checkpoint tag's per-rank optimizer files, each opened when first needed and memory-mapped: a
    parameter's pieces are read when it is put together, so converting holds one parameter's state in memory, not
    every rank's. ``in_full``: the user trusts the checkpoint; else each file is read weights-only with DeepSpeed's
    own classes allowed, its globals checked first (:func:`~lightning_hetero.runtime.safe_load.load_deepspeed_file`)."""

    def __init__(self, tag: Path, in_full: bool = False) -> None:
        from deepspeed.checkpoint import constants

        self.c, self.tag, self.in_full = constants, tag, in_full
        files: dict[int, Path] = {}
        for path in tag.iterdir():
            match = _OPTIMIZER_FILE.match(path.name)
            if match:
                if int(match.group(2)) != 0:
                    raise ValueError(f"{path}: a tensor- or pipeline-parallel checkpoint; HeteroStrategy writes none")
                files[int(match.group(1))] = path
        if not files or sorted(files) != list(range(len(files))):
            raise ValueError(f"{tag} does not hold one ZeRO optimizer file per rank (found ranks {sorted(files)})")
        self.files, self.world_size = files, len(files)
        self._states: dict[int, Mapping[str, Any]] = {}

    def _load(self, path: Path) -> Any:
        # (mmap keeps the tensors on disk until a piece of them is read)
        return load_deepspeed_file(path, self.in_full, mmap=True)

    def state(self, rank: int) -> Mapping[str, Any]:
        if rank not in self._states:
            self._states[rank] = self._load(self.files[rank])[self.c.OPTIMIZER_STATE_DICT]
        return self._states[rank]

    @property
    def stage(self) -> int:
        return int(self.state(0).get(self.c.ZERO_STAGE, 1))

    def group_states(self, rank: int) -> list[Mapping[str, Any]]:
        """Rank ``rank``'s optimizer state of each (sub-)group, over its flat partition."""
        c, state = self.c, self.state(rank)
        groups = range(len(self.fp32_flats(rank)))
        if self.stage <= 2:
            base = state[c.BASE_OPTIMIZER_STATE]
            if not isinstance(base, dict):
                raise ValueError(f"{self.tag}: a ZeRO `elastic_checkpoint`, whose optimizer state is not torch's")
            return [base["state"].get(group, {}) for group in groups]
        return [state[c.OPTIMIZER_STATE_DICT]["state"].get(group, {}) for group in groups]

    def fp32_flats(self, rank: int) -> list[torch.Tensor]:
        c, state = self.c, self.state(rank)
        return list(state[c.SINGLE_PARTITION_OF_FP32_GROUPS] if self.stage <= 2 else state[c.FP32_FLAT_GROUPS])

    def partition_numels(self, rank: int) -> list[int]:
        """Each group's flat partition as the optimizer held it (ZeRO-1/2 save the fp32 weights without the last rank's
        padding, and the optimizer state with it)."""
        flats = self.fp32_flats(rank)
        paddings = self.state(rank).get(self.c.GROUP_PADDINGS) if self.stage <= 2 else None
        return [flat.numel() + (paddings[group] if paddings else 0) for group, flat in enumerate(flats)]

    def state_keys(self, rank: int = 0) -> list[StateKeys]:
        states, numels = self.group_states(rank), self.partition_numels(rank)
        return [classify_state(state, numel) for state, numel in zip(states, numels)]

    def param_shapes(self) -> list[Mapping[str, Any]]:
        """The full shape of every parameter, per (sub-)group, from the model-states file."""
        return self._load(rank_0_model_states(self.tag))[self.c.PARAM_SHAPES]

    def pieces(self, group: int, param_shapes: Sequence[Mapping[str, Any]]) -> dict[str, list[Piece]]:
        if self.stage <= 2:
            ranks = range(self.world_size)
            return zero12_pieces([self.state(rank)[self.c.PARAM_SLICE_MAPPINGS][group] for rank in ranks])
        return zero3_pieces(list(param_shapes[group].items()), self.world_size)

    def global_state(self) -> dict[str, Any]:
        """DeepSpeed's ``zero/optimizer_state.pt``: rank 0's optimizer state without its partitions, with the param
        groups (hyper-parameters) at the top, where its loaders read them."""
        c, state = self.c, self.state(0)
        if self.stage <= 2:
            partitioned = {c.BASE_OPTIMIZER_STATE, c.PARAM_SLICE_MAPPINGS, c.SINGLE_PARTITION_OF_FP32_GROUPS}
            groups = state[c.BASE_OPTIMIZER_STATE][c.PARAM_GROUPS]
        else:
            partitioned = {c.FP32_FLAT_GROUPS, c.OPTIMIZER_STATE_DICT}
            groups = state[c.OPTIMIZER_STATE_DICT][c.PARAM_GROUPS]
        return {**{key: value for key, value in state.items() if key not in partitioned}, c.PARAM_GROUPS: groups}


def state_keys(tag: Path, in_full: bool = False) -> list[StateKeys]:
    """What each parameter group's optimizer state holds in checkpoint tag folder ``tag`` (rank 0's file, opened
    memory-mapped: its tensors' shapes are read, not their data; ``in_full``: the user trusts the checkpoint)."""
    return _Partitions(tag, in_full).state_keys()


def convert(tag: Path, output: Path, in_full: bool = False) -> None:
    """Write checkpoint tag folder ``tag`` (a ZeRO 1-3 checkpoint of any number of ranks) into ``output`` in DeepSpeed's
    universal layout (see the module's docstring), and ``latest_universal`` beside ``output`` (``in_full``: the user
    trusts the checkpoint; else its files are read weights-only, DeepSpeed's own classes allowed)."""
    from deepspeed.checkpoint import constants

    partitions = _Partitions(tag, in_full)
    ranks = range(partitions.world_size)
    layouts = [partitions.state_keys(rank) for rank in ranks]
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"{tag}: the ranks' optimizer states hold different entries: {layouts}")
    refused = sorted({entry for keys in layouts[0] for entry in keys.refused})
    if refused:  # (the resume checks this first, on every rank, saying what to do: see refusal)
        raise ValueError(f"{tag}: optimizer state that is not per parameter cannot be converted: {', '.join(refused)}")
    param_shapes = partitions.param_shapes()
    shapes = {name: shape for group in param_shapes for name, shape in group.items()}
    zero = output / "zero"
    for group, keys in enumerate(layouts[0]):
        states = [partitions.group_states(rank)[group] for rank in ranks]
        flats = {FP32: [partitions.fp32_flats(rank)[group] for rank in ranks]}
        flats.update({key: [state[key] for state in states] for key in keys.per_parameter})
        step = _common_step(tag, [state[STEP] for state in states]) if keys.step else None
        for name, pieces in partitions.pieces(group, param_shapes).items():
            folder = zero / name
            folder.mkdir(parents=True, exist_ok=True)
            for key, by_rank in flats.items():
                whole = assemble(name, pieces, by_rank, shapes[name])
                torch.save({constants.PARAM: whole, constants.CAT_DIM: 0}, folder / f"{key}.pt")
            if step is not None:
                torch.save(step, folder / f"{STEP}.pt")
    zero.mkdir(parents=True, exist_ok=True)
    torch.save(partitions.global_state(), zero / "optimizer_state.pt")
    for model_file in tag.glob("*model_states.pt"):
        _link_or_copy(model_file, output / model_file.name)
    (output.parent / "latest_universal").write_text(output.name)


def rank_0_model_states(tag: Path) -> Path:
    """Rank 0's model-states file in checkpoint tag folder ``tag`` (``mp_rank_00_...`` below ZeRO-3,
    ``zero_pp_rank_0_...`` at ZeRO-3)."""
    model_file = next((tag / name for name in _RANK_0_MODEL_STATES if (tag / name).is_file()), None)
    if model_file is None:
        raise ValueError(f"{tag} holds no model-states file ({' or '.join(_RANK_0_MODEL_STATES)})")
    return model_file


def restore_buffers(module: torch.nn.Module, tag: Path, in_full: bool = False) -> list[str]:
    """Copy the buffers of checkpoint tag folder ``tag`` (rank 0's model-states file: every buffer whole, at any ZeRO
    stage) into ``module``'s; the names restored. DeepSpeed's universal load reads the parameters from the
    per-parameter files and skips the module's state dict (``DeepSpeedEngine._load_checkpoint``: ``if not
    self.load_universal_checkpoint(): self.load_module_state_dict(...)``), so without this a BatchNorm's running
    statistics or a step counter would come back as a fresh model's. A buffer the model does not register as
    persistent is in no state dict and is left as the model made it."""
    model_file = rank_0_model_states(tag)
    # (memory-mapped: at ZeRO 1-2 the file holds every parameter too, and only the buffers are read)
    saved = load_deepspeed_file(model_file, in_full, mmap=True)["module"]
    restored = []
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name])
                restored.append(name)
    return restored


def _common_step(tag: Path, steps: Sequence[Any]) -> Any:
    values = [float(step) for step in steps]
    if any(value != values[0] for value in values):
        raise ValueError(f"{tag}: the ranks' optimizer steps differ ({values}); the checkpoint is not one job's")
    return steps[0]


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (the model states of ZeRO-1/2 are the whole model's weights)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


# ------------------------------------------------------------------------------------------------- the ZeRO-3 load


@contextlib.contextmanager
def loading_zero3(optimizer: Any, in_full: bool = False) -> Iterator[None]:
    """Inside the block, DeepSpeed's ZeRO-3 ``optimizer`` loads a universal checkpoint with :func:`load_zero3`
    (``in_full``: the user trusts the checkpoint)."""
    if getattr(optimizer, "swap_optimizer", False):
        raise ResumeRefused(
            "A ZeRO-3 checkpoint resumed on another number of ranks with the optimizer offloaded to NVMe: its state is"
            " swapped in by DeepSpeed's own loader, which reads Adam's state only. Resume on the checkpoint's number of"
            " ranks, or offload the optimizer to the CPU instead of NVMe."
        )
    optimizer._load_universal_checkpoint = lambda folder, optimizer_states, from_fp32: load_zero3(
        optimizer, folder, optimizer_states, from_fp32, in_full
    )
    try:
        yield
    finally:
        optimizer.__dict__.pop("_load_universal_checkpoint", None)


def load_zero3(
    optimizer: Any, folder: str, load_optimizer_states: bool, load_from_fp32_weights: bool, in_full: bool = False
) -> None:
    """DeepSpeed's ZeRO-3 universal load for every per-parameter state the checkpoint holds.

    DeepSpeed's own (``load_hp_checkpoint_state_from_checkpoint_dir_stage3``, 0.19.8) loads "fp32", "exp_avg" and
    "exp_avg_sq" by name and reads the step from rank 0's Adam state: an SGD checkpoint fails there. This loads the
    weights with DeepSpeed's module loader (its fp32 partitions and the module's), then each state key the parameters'
    folders hold: every parameter's partition of it, cut for this rank by DeepSpeed's ``load_hp_checkpoint_state``,
    into the flat state of its sub-group, as DeepSpeed's loader does for Adam's two. The files this reads itself are
    read weights-only with DeepSpeed's own classes allowed, unless ``in_full`` (the user trusts the checkpoint).
    """
    from deepspeed.checkpoint import constants

    optimizer.load_module_checkpoint_state_from_checkpoint_dir_stage3(folder, load_from_fp32_weights)
    if not load_optimizer_states:
        return
    zero = Path(folder) / "zero"
    global_state = load_deepspeed_file(zero / "optimizer_state.pt", in_full)
    optimizer._load_global_state_stage3(global_state)  # the loss scaler
    base = optimizer.optimizer
    for sub_group, parameters in enumerate(optimizer.fp16_groups):
        flat = optimizer.fp32_partitioned_groups_flat[sub_group]
        folders = [zero / optimizer.param_names[parameter] for parameter in parameters]
        keys = sorted({file.stem for file in folders[0].glob("*.pt")} - {FP32, STEP})
        for key in keys:
            whole, offset = torch.zeros_like(flat), 0
            for parameter, parameter_folder in zip(parameters, folders):
                piece = optimizer.load_hp_checkpoint_state(str(parameter_folder), key, param=parameter)
                whole.narrow(0, offset, piece.numel()).copy_(piece)
                offset += piece.numel()
            base.state[flat][key] = whole
        if (folders[0] / f"{STEP}.pt").is_file():
            base.state[flat][STEP] = load_deepspeed_file(folders[0] / f"{STEP}.pt", in_full)
    for group, saved in zip(base.param_groups, global_state[constants.PARAM_GROUPS]):
        group.update({key: value for key, value in saved.items() if key != "params"})
