"""Configure: each rank's DeepSpeed config, and the check that the settings which must agree do agree.

Pure functions over plain dicts: DeepSpeed validates a config locally (``train_batch == micro * gas * world``), so
ranks may carry different micro-batches, but everything else (stage, dtypes, buckets, clipping, optimizer) must be
the same everywhere or the collectives mismatch, hang, or (per-rank fp16/bf16) finish silently wrong.

The check of the config's keys against DeepSpeed's is in :mod:`.deepspeed_keys`; the check that the ranks' models
agree is in :mod:`.model_agreement`.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_hetero.configure.deepspeed_keys import check_deepspeed_keys
from lightning_hetero.runtime.checks import check_stage

# Keys that legitimately differ by rank: the micro-batch and what DeepSpeed derives from it.
PER_RANK_KEYS = frozenset({"train_micro_batch_size_per_gpu", "train_batch_size"})
# Keys that say who owns gradient accumulation: Lightning's loop does (see lightning_owns_accumulation).
ACCUMULATION_KEYS = ("gradient_accumulation_steps", "managed_gradient_accumulation")
# Keys whose disagreement DeepSpeed does not catch and that corrupt the result without an error.
_PRECISION_KEYS = ("fp16", "bf16", "torch_autocast", "communication_data_type")


def check_config_argument(config: Any) -> Any:
    """The ``config`` argument as the parent strategy takes it: None, a JSON file's path, or a copy of a dict (the
    strategy fills in and formats its config, and must not change the caller's)."""
    if config is None or isinstance(config, (str, os.PathLike)):
        return config
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ValueError(
        f"`config={config!r}` is a {type(config).__name__}; give a DeepSpeed config as a dict (e.g."
        ' `{"zero_optimization": {"stage": 2}}`) or the path of a JSON file, or leave it out.'
    )


def check_user_config(config: Mapping[str, Any]) -> None:
    """Reject DeepSpeed config entries that Lightning or the strategy own. Raised in the constructor."""
    for key in ACCUMULATION_KEYS:
        if key in config:
            raise ValueError(
                f"The DeepSpeed config sets `{key}={config[key]}`. Lightning's loop owns gradient accumulation"
                " (as with DDP): remove the key and use `Trainer(accumulate_grad_batches=...)`."
            )
    for key in sorted(PER_RANK_KEYS & config.keys()):
        raise ValueError(
            f"The DeepSpeed config sets `{key}={config[key]}`, but HeteroStrategy gives every rank its own"
            " micro-batch. Remove the key and use `HeteroStrategy(global_batch_size=..., batch_sizes=[...])`."
        )
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        # DeepSpeed still reads a bare bool as a deprecated stage switch, but Lightning and the strategy index the
        # section as a dict (`zero_optimization.stage`) and would fail later with an AttributeError.
        raise ValueError(
            f'The DeepSpeed config sets `zero_optimization={zero!r}`; it must be a dict such as `{{"stage": 2}}`.'
        )
    try:
        check_stage(zero.get("stage", 0), "zero_optimization.stage")
    except ValueError as error:
        raise ValueError(f"The DeepSpeed config's {error}") from None
    check_deepspeed_keys(with_offload_switches_read(config))


# The ZeRO sections whose `False` a DeepSpeedStrategy user writes for "no offload" (Lightning's own test config does),
# where DeepSpeed's schema takes a dict or nothing.
_OFFLOAD_SECTIONS = ("offload_optimizer", "offload_param")


def with_offload_switches_read(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` in which ``zero_optimization.offload_optimizer: false`` (or ``offload_param``) is read as
    "no offload", the section left out, as DeepSpeed takes it; DeepSpeed's schema refuses the bare ``False``, which
    DeepSpeedStrategy hands it unchanged. The user's own dict keeps what they wrote."""
    result = copy.deepcopy(dict(config))
    zero = result.get("zero_optimization")
    if isinstance(zero, dict):
        for section in _OFFLOAD_SECTIONS:
            if zero.get(section, None) is False:
                del zero[section]
    return result


# DeepSpeed reads a config without `zero_optimization.stage` as ZeRO-0 (its own default), and so does Lightning's
# DeepSpeedStrategy: a user's config keeps that meaning, whatever stage the strategy picks for a config of its own.
CONFIG_DEFAULT_STAGE = 0


def user_config_stage(config_stage: Optional[int], stage_argument: Optional[int]) -> tuple[int, Optional[str]]:
    """The ZeRO stage a user's DeepSpeed config runs at, and a warning to show (None: nothing to say).

    The config's own ``zero_optimization.stage`` wins over ``stage``; a config that sets none takes ``stage`` when it
    is given, else :data:`CONFIG_DEFAULT_STAGE` (ZeRO-0), as DeepSpeed and Lightning's DeepSpeedStrategy read it: a
    config written for them must not silently shard (a plain torch optimizer would then need
    ``zero_allow_untested_optimizer``).
    """
    if config_stage is None:
        return (CONFIG_DEFAULT_STAGE if stage_argument is None else stage_argument), None
    if stage_argument is not None and stage_argument != config_stage:
        return config_stage, (
            f"HeteroStrategy: the DeepSpeed config's `zero_optimization.stage={config_stage}` wins over"
            f" `stage={stage_argument}`."
        )
    return config_stage, None


def default_config_stage(stage: Optional[int], deepspeed_arguments: dict[str, Any]) -> Optional[int]:
    """The ``stage`` to build the default DeepSpeed config with (no user config), after DeepSpeedStrategy's switch
    ``zero_optimization``, which ``deepspeed_arguments`` loses.

    ``zero_optimization=False`` turns ZeRO off in DeepSpeedStrategy: that is ZeRO-0 here (DeepSpeed's engine without a
    ZeRO optimizer), given to the config as ``stage=0`` since the strategy reads its stage there.
    """
    switch = deepspeed_arguments.pop("zero_optimization", True)
    if switch is True:
        return stage
    if switch is not False:
        raise ValueError(f"`zero_optimization={switch!r}` must be True or False (False: ZeRO off, i.e. `stage=0`).")
    if stage is not None and stage != 0:
        raise ValueError(
            f"`zero_optimization=False` turns ZeRO off, but `stage={stage!r}` asks for ZeRO-{stage}: give one of them"
            " (`stage=0` is ZeRO off)."
        )
    return 0


def logging_batch_size_note(deepspeed_arguments: Mapping[str, Any]) -> Optional[str]:
    """What to say of DeepSpeedStrategy's ``logging_batch_size_per_gpu`` (None: nothing, it was left at "auto").

    DeepSpeedStrategy writes it into DeepSpeed's ``train_micro_batch_size_per_gpu``, which DeepSpeed reads for its
    throughput logging only (Lightning's loader sets the batch). Here that key is each rank's own micro-batch, set
    by the plan, so the value is accepted and not used: said, never dropped without a word.
    """
    value = deepspeed_arguments.get("logging_batch_size_per_gpu", "auto")
    if value == "auto":
        return None
    return (
        f"HeteroStrategy: `logging_batch_size_per_gpu={value!r}` is not used. DeepSpeedStrategy gives it to"
        " DeepSpeed's throughput logging as every rank's micro-batch; here each rank's micro-batch is its own (the"
        " plan table, hetero/rank_<r>.json), and DeepSpeed's `train_micro_batch_size_per_gpu` is set to it on each"
        " rank."
    )


def rank_config(config: Mapping[str, Any], micro_batch_size: int) -> dict[str, Any]:
    """A copy of ``config`` with this rank's micro-batch, accumulation left to Lightning's loop, and offload switched
    off by ``False`` read as DeepSpeed reads it (:func:`with_offload_switches_read`)."""
    result = lightning_owns_accumulation(with_offload_switches_read(config))
    result["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    result.pop("train_batch_size", None)  # DeepSpeed derives it as micro * gas * world on each rank
    return result


def lightning_owns_accumulation(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` in which every ``optimizer.step()`` is an optimizer update, as with DDP.

    Lightning's loop (or the user's own step, in manual optimization) decides when the optimizer steps: after every
    ``accumulate_grad_batches`` batches and at the end of an epoch, with each loss already divided by k. DeepSpeed's
    own accumulation would divide the loss by k a second time and step on its own micro-step count, which does not
    restart with the epoch. So DeepSpeed counts one micro-step per update (``gradient_accumulation_steps=1``) and:

    - ZeRO 0-2 run with ``managed_gradient_accumulation=False``: ``backward`` only accumulates, ``step()`` reduces
      and updates. With DeepSpeed's managed mode every backward would be a boundary, and ZeRO-1/2 then overwrite the
      reduced gradient of the previous backward instead of adding to it (measured: two backward passes before a step
      trained on the second batch only). DeepSpeed allows ``overlap_comm`` in that mode for ZeRO-2 only; ZeRO-0/1
      reduce once per step anyway, so it is switched off there.
    - ZeRO-3 keeps the managed mode (its overlap_comm matters and is refused in the other mode): it reduces and
      partitions in every backward and adds the partitions up, which is exact.
    """
    result = copy.deepcopy(dict(config))
    result["gradient_accumulation_steps"] = 1
    zero = result.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if stage < 3:
        result["managed_gradient_accumulation"] = False
        if stage < 2 and isinstance(zero, dict):
            zero["overlap_comm"] = False
    return result


# ZeRO settings that serve GPUs (a contiguous gradient buffer against memory fragmentation, communication overlapped on
# CUDA streams) and only add copies on a CPU: the strategy's CPU default when the user set neither.
CPU_ZERO_SETTINGS = {"contiguous_gradients": False, "overlap_comm": False}


def with_cpu_zero_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with :data:`CPU_ZERO_SETTINGS` in its ZeRO section (measured on 2 CPU ranks, ZeRO-2: 48.3
    ms per step with DeepSpeed's GPU defaults, 44.5 ms without them; DDP took 36.3 ms)."""
    result = copy.deepcopy(dict(config))
    zero = result.get("zero_optimization")
    if isinstance(zero, dict):
        zero.update(CPU_ZERO_SETTINGS)
    return result


def shared_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a rank's config that must be identical on every rank."""
    return {key: value for key, value in config.items() if key not in PER_RANK_KEYS}


def config_disagreements(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per setting whose value differs between ranks (compared on :func:`shared_settings`).

    Any per-rank mappings can be compared this way (the strategy also compares its arguments and data orders)."""
    flat = [_flatten(shared_settings(config)) for config in configs]
    keys = sorted(set().union(*flat))
    lines = []
    for key in keys:
        values = [f.get(key, "<unset>") for f in flat]
        if any(value != values[0] for value in values[1:]):
            per_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            lines.append(f"{key} ({per_rank})")
    return lines


def disagreement_message(lines: Sequence[str]) -> str:
    message = (
        "HeteroStrategy: the ranks' DeepSpeed configs differ in settings that must agree (only the micro-batch may"
        " differ by rank):\n  " + "\n  ".join(lines)
    )
    if any(line.split(".")[0].split(" ")[0] in _PRECISION_KEYS for line in lines):
        message += (
            "\nDeepSpeed's fp16/bf16 modes set differently per rank make the collectives disagree: the job would crash"
            " or finish silently wrong. Give every rank the same `precision` and DeepSpeed config."
        )
    else:
        message += "\nGive every rank the same strategy arguments and DeepSpeed config."
    return message


def config_fingerprint(config: Mapping[str, Any]) -> str:
    return json.dumps(shared_settings(config), sort_keys=True, default=str)


def format_plan_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table; ``columns`` pairs each row key with its heading."""
    cells = [[heading for _, heading in columns]] + [[str(row.get(key, "")) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def raise_if_arguments_differ(arguments: list[dict[str, Any]]) -> None:
    lines = config_disagreements(arguments)
    if lines:
        raise ValueError(
            f"HeteroStrategy was built with different arguments on different ranks: {'; '.join(lines)}. Every rank"
            " must run the same script with the same arguments (and the same training loader batch size)."
        )
