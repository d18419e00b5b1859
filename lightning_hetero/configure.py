"""Configure: each rank's DeepSpeed config, and the check that the settings which must agree do agree.

Pure functions over plain dicts: DeepSpeed validates a config locally (``train_batch == micro * gas * world``), so
ranks may carry different micro-batches, but everything else (stage, dtypes, buckets, clipping, optimizer) must be
the same everywhere or the collectives mismatch, hang, or (per-rank fp16/bf16) finish silently wrong.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

# Keys that legitimately differ by rank: the micro-batch and what DeepSpeed derives from it.
PER_RANK_KEYS = frozenset({"train_micro_batch_size_per_gpu", "train_batch_size"})
# Keys that say who owns gradient accumulation: Lightning's loop does (see lightning_owns_accumulation).
ACCUMULATION_KEYS = ("gradient_accumulation_steps", "managed_gradient_accumulation")
# Keys whose disagreement DeepSpeed does not catch and that corrupt the result without an error.
_PRECISION_KEYS = ("fp16", "bf16", "torch_autocast", "communication_data_type")


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
            f"The DeepSpeed config sets `zero_optimization={zero!r}`; it must be a dict such as"
            ' `{"stage": 2}`.'
        )
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"The DeepSpeed config sets `zero_optimization.stage={stage!r}`; ZeRO stages are 0, 1, 2 and 3."
        )


def rank_config(config: Mapping[str, Any], micro_batch_size: int) -> dict[str, Any]:
    """A copy of ``config`` with this rank's micro-batch, accumulation left to Lightning's loop."""
    result = lightning_owns_accumulation(config)
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


def shared_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a rank's config that must be identical on every rank."""
    return {key: value for key, value in config.items() if key not in PER_RANK_KEYS}


def config_disagreements(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per setting whose value differs between ranks (compared on :func:`shared_settings`)."""
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
