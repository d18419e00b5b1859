"""Compression: what travels between ranks, chosen and checked as pure decisions, and the hooks that compress it.

``HeteroStrategy(compression=...)``:

* ``"fp16"`` / ``"bf16"``: gradients travel in half precision. DeepSpeed does it itself at every ZeRO stage
  (``communication_data_type``); when the exchange is ours (a hierarchical reduction), torch's
  ``fp16_compress_hook`` / ``bf16_compress_hook`` do it between the nodes.
* ``"powersgd"``: torch's PowerSGD (``ddp_comm_hooks.powerSGD_hook``) with its own state object (error feedback,
  warm start, an uncompressed warm-up of ``start_powerSGD_iter`` steps); ``compression_options`` are
  ``PowerSGDState``'s arguments.
* ``"topk"``: each rank sends the largest ``ratio`` of its entries (values and int32 indices) and keeps what it did not
  send as error feedback for the next step (:func:`~lightning_hetero.comm.topk.topk_hook`).
* Both keep their loss (:mod:`~lightning_hetero.comm.error_bound`): every few steps the compressed average is checked
  against the exact one on a sample, and the rank (ratio) doubles while the error is above ``max_error`` (default
  0.02; None for a fixed setting), within ``max_bytes_fraction`` of uncompressed bytes.
* ``"int8"`` / ``"int4"``: with ``sync="local_sgd"`` or ``"diloco"`` only, the pseudo-gradient of a merge travels as
  8- or 4-bit integers with a scale per block and error feedback (:mod:`~.comm.quantize`).
* any callable ``hook(state, bucket) -> Future[Tensor]`` with torch's DDP comm-hook signature, or a ``(hook, state)``
  pair. Without a state it is given the exchange's process group, as torch's default hooks expect.

Hooks see a bucket of gradients that are already weighted by each rank's share of the global batch (the strategy
weights the loss), so an unequal split stays exact in meaning: a hook averages, and the average is the full-batch
gradient. They run in DeepSpeed's gradient exchange (:mod:`~.comm.communication`), which only ZeRO-0 leaves
reachable: ZeRO-1/2/3 reduce inside DeepSpeed's optimizer (``average_tensor``, ``allreduce_bucket``), with no hook.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hetero.comm.error_bound import (
    ERROR_BOUND_KEYS,
    ErrorBoundState,
    check_error_bound_options,
    error_bounded_hook,
)
from lightning_hetero.comm.topk import TOPK_DEFAULTS, TopKState, topk_hook

HALF_MODES = {"fp16": "fp16", "bf16": "bf16"}  # DeepSpeed's communication_data_type names
HOOK_MODES = ("powersgd", "topk")
QUANTIZED_MODES = ("int8", "int4")  # the local modes' merges only (comm/quantize.py)
MODES = (*HALF_MODES, *HOOK_MODES, *QUANTIZED_MODES)
HOOK_STAGES = (0,)  # ZeRO stages whose gradient exchange can be hooked
# PowerSGD's defaults here: torch's, except a warm-up of 10 uncompressed steps instead of 1000, which would hide the
# compression in all but long runs (torch suggests about 10 % of training); pass start_powerSGD_iter to change it.
POWERSGD_DEFAULTS: dict[str, Any] = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10}
Hook = Callable[[Any, Any], "torch.futures.Future[Tensor]"]


@dataclass(frozen=True)
class CompressionChoice:
    """A checked ``compression`` argument. ``mode`` is None, one of :data:`MODES`, or ``"custom"``."""

    mode: Optional[str] = None
    options: Mapping[str, Any] = field(default_factory=dict)
    hook: Optional[Hook] = None
    hook_state: Any = None

    @property
    def needs_hook(self) -> bool:
        """Whether the gradient exchange itself must be replaced (only ZeRO-0's can be)."""
        return self.mode in HOOK_MODES or self.mode == "custom"

    @property
    def name(self) -> Optional[str]:
        """The mode as the user gave it, or the custom hook's name."""
        if self.mode == "custom":
            return getattr(self.hook, "__qualname__", repr(self.hook))
        return self.mode

    def describe(self) -> Optional[str]:
        """A description that is the same on every rank for the same argument (callables compare by identity)."""
        if self.mode == "custom":
            assert self.hook is not None
            return f"custom hook {getattr(self.hook, '__module__', '?')}.{getattr(self.hook, '__qualname__', '?')}"
        if self.mode is None:
            return None
        return f"{self.mode} {dict(self.options)}" if self.options else self.mode


def check_compression(compression: Any, options: Optional[Mapping[str, Any]] = None) -> CompressionChoice:
    """``compression`` and ``compression_options`` checked, with the defaults filled in. Raised in the constructor."""
    if options is not None and not isinstance(options, Mapping):
        raise ValueError(f"`compression_options={options!r}` must be a dict of the compression's settings.")
    given = dict(options or {})
    if compression is None:
        if given:
            raise ValueError(f"`compression_options={given}` was given without `compression`: set one, or drop it.")
        return CompressionChoice()
    if isinstance(compression, tuple) and len(compression) == 2 and callable(compression[0]):
        _no_options("a custom hook", given)
        return CompressionChoice("custom", {}, compression[0], compression[1])
    if callable(compression):
        _no_options("a custom hook", given)
        return CompressionChoice("custom", {}, compression)
    mode = compression.lower() if isinstance(compression, str) else None
    if mode in HALF_MODES or mode in QUANTIZED_MODES:
        _no_options(f"compression={compression!r}", given)
        return CompressionChoice(mode)
    if mode == "powersgd":
        return CompressionChoice(mode, _powersgd_options(given))
    if mode == "topk":
        return CompressionChoice(mode, _topk_options(given))
    raise ValueError(
        f"`compression={compression!r}` is not one of {list(MODES)}, a DDP comm hook `hook(state, bucket)` or a"
        " `(hook, state)` pair. Use None (default) for uncompressed gradients."
    )


def _no_options(what: str, given: dict[str, Any]) -> None:
    if given:
        raise ValueError(f"`compression_options={given}` has nothing to set for {what}: drop it.")


def _powersgd_options(given: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if "process_group" in given:
        raise ValueError(
            "`compression_options` sets `process_group`; the strategy gives PowerSGD its group (all ranks, or the"
            " node leaders in a hierarchical reduction). Drop it."
        )
    bound = _bound_options("powersgd", given)
    options = {**POWERSGD_DEFAULTS, **{key: value for key, value in given.items() if key not in ERROR_BOUND_KEYS}}
    try:
        PowerSGDState(process_group=None, **options)  # torch's own checks, with no process group needed
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"`compression_options={given}` is not valid for compression='powersgd' ({error}). The keys are"
            " PowerSGDState's arguments, e.g. `{'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}`, and"
            f" the error bound's {sorted(ERROR_BOUND_KEYS)}."
        ) from None
    return {**options, **bound}


def _bound_options(mode: str, given: dict[str, Any]) -> dict[str, Any]:
    """The error bound's part of the options: its settings, or ``max_error: None`` when it is off."""
    return check_error_bound_options(mode, given) or {"max_error": None}


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A hook mode's options as (its state's arguments, the error bound's settings; empty when off)."""
    inner = {key: value for key, value in options.items() if key not in ERROR_BOUND_KEYS}
    bound = {key: value for key, value in options.items() if key in ERROR_BOUND_KEYS}
    return inner, bound if bound.get("max_error") is not None else {}


def _topk_options(given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(TOPK_DEFAULTS) - ERROR_BOUND_KEYS)
    if unknown:
        raise ValueError(
            f"`compression_options` has {unknown} for compression='topk'; its options are `ratio` and the error"
            f" bound's {sorted(ERROR_BOUND_KEYS)}."
        )
    options = {**TOPK_DEFAULTS, **{key: value for key, value in given.items() if key not in ERROR_BOUND_KEYS}}
    ratio = options["ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(
            f"`compression_options={{'ratio': {ratio!r}}}` for compression='topk' must be a fraction in (0, 1]: the"
            " share of each bucket's entries every rank sends, e.g. 0.01."
        )
    return {**options, **_bound_options("topk", given)}


def check_exchange(
    choice: CompressionChoice, hierarchical: Union[str, bool], stage: int, config: Optional[Mapping[str, Any]] = None
) -> None:
    """Refuse what ZeRO ``stage`` cannot do: a hooked exchange (a hook mode, or ``hierarchical=True``) beyond ZeRO-0;
    and ``hierarchical=True`` where it cannot apply (:func:`hierarchical_blocker`)."""
    blocker = hierarchical_blocker(choice, config or {})
    if hierarchical is True and blocker:
        raise ValueError(f"`hierarchical=True` cannot apply: {blocker}. Use hierarchical='auto' or False.")
    if stage in HOOK_STAGES:
        return
    reason = (
        f"ZeRO-{stage} reduces gradients inside DeepSpeed's optimizer, where no hook reaches them; only ZeRO stage"
        f" {', '.join(map(str, HOOK_STAGES))} runs its exchange through one"
    )
    if choice.needs_hook:
        raise ValueError(
            f"`compression={choice.name!r}` needs `stage=0`: {reason}. Use stage=0, or compression='fp16' or"
            " 'bf16', which work at every stage."
        )
    if hierarchical is True:
        raise ValueError(f"`hierarchical=True` needs `stage=0`: {reason}. Use stage=0, or hierarchical='auto'/False.")


def hierarchical_blocker(choice: CompressionChoice, config: Mapping[str, Any]) -> Optional[str]:
    """Why a hierarchical reduction cannot run for this job (``"auto"`` then stays flat), or None."""
    if choice.mode == "custom" and choice.hook_state is not None:
        # Only the leaders run the hook in a hierarchical reduction; a state the user built names its own group
        # (usually every rank), which the other ranks would never join.
        return "a custom hook given with its own state runs on the process group that state names"
    if choice.mode is None and "communication_data_type" in config:
        return (
            f"the DeepSpeed config's `communication_data_type={config['communication_data_type']!r}` is applied by"
            " DeepSpeed's own exchange (use compression='fp16'/'bf16' to compress between nodes)"
        )
    return None


def check_hookable(
    what: str, deepspeed_fp16: bool, deepspeed_bf16: bool, torch_autocast: bool, moe: bool, averages: bool
) -> None:
    """Refuse DeepSpeed modes whose gradients a hooked exchange would handle wrongly. Raised at the same point on
    every rank (after DeepSpeed's init), from the same config."""
    reasons = []
    if deepspeed_fp16 or deepspeed_bf16 or torch_autocast:
        # DeepSpeed's fp16 reduces loss-scaled gradients (an overflow would put inf into the error feedback, and the
        # feedback would be kept in scaled units); its bf16 optimizer reduces its own fp32 copies, not .grad.
        reasons.append(
            "DeepSpeed's own mixed precision is on (the Trainer's `precision` or the config's fp16 / bf16 /"
            " torch_autocast); use `device_precision=...` instead, which keeps DeepSpeed and the exchange in fp32"
        )
    if moe:
        reasons.append("the model has MoE layers, whose expert gradients DeepSpeed reduces over expert groups")
    if not averages:
        reasons.append("the config sets `gradient_allreduce_op` to sum; hooks average")
    if reasons:
        raise ValueError(f"{what} replaces DeepSpeed's gradient exchange, but {'; '.join(reasons)}.")


def restore_blocker(
    saved: Optional[Mapping[str, Any]], current: Mapping[str, Any], same_world_size: bool
) -> Optional[str]:
    """Why a checkpoint's hook state cannot continue in this job (it then starts afresh), or None.

    Decided from the checkpoint's manifest, which every rank reads, so every rank decides the same. The state belongs
    to one compression, one set of ranks and one role per rank (leader or not): any difference starts afresh.
    """
    if not same_world_size:
        return "the checkpoint was saved by another number of ranks, whose error feedback does not map to these"
    if saved is None:
        return "the checkpoint has none"
    for key, label in (("compression", "compression"), ("hierarchical", "hierarchical"), ("nodes", "nodes")):
        if saved.get(key) != current.get(key):
            return f"it was saved with {label} {saved.get(key)!r}, this job has {current.get(key)!r}"
    return None


# The parts of a hook state that are progress, not settings: restored from a checkpoint (settings come from the
# job's arguments, which must describe the same compression).
PROGRESS_SLOTS = frozenset(
    {
        "error_dict",
        "p_memory_dict",
        "q_memory_dict",
        "iter",
        "rng",
        "total_numel_before_compression",
        "total_numel_after_compression",
        "next_stats_report",
    }
)


def hooked_exchange_reason(choice: CompressionChoice, hierarchical: bool) -> Optional[str]:
    """Why the strategy replaces DeepSpeed's gradient exchange with its own, or None when DeepSpeed's runs."""
    if choice.needs_hook:
        return f"compression {choice.describe()}"
    if hierarchical:
        return "hierarchical reduction"
    return None


def deepspeed_entries(choice: CompressionChoice, hooked: bool) -> dict[str, Any]:
    """The DeepSpeed config entries for ``choice``: half-precision communication when DeepSpeed does the exchange."""
    if choice.mode in HALF_MODES and not hooked:
        return {"communication_data_type": HALF_MODES[choice.mode]}
    return {}


def check_config_compression(choice: CompressionChoice, config: Mapping[str, Any]) -> None:
    """A DeepSpeed config that also sets the wire's dtype would make two answers to one question."""
    if choice.mode is not None and "communication_data_type" in config:
        raise ValueError(
            f"Both `compression={choice.name!r}` and the DeepSpeed config's `communication_data_type="
            f"{config['communication_data_type']!r}` say how gradients travel. Keep one: compression='fp16'/'bf16'"
            " sets communication_data_type itself."
        )


def check_zero_plus_plus(config: Mapping[str, Any], device_type: str) -> None:
    """ZeRO++'s quantized weights and gradients run on CUDA kernels only; on CPU DeepSpeed fails mid-step."""
    zero = config.get("zero_optimization", {}) or {}
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if zero.get(key) and device_type != "cuda":
            raise ValueError(
                f"The DeepSpeed config sets `zero_optimization.{key}=True`, which needs CUDA (DeepSpeed's quantization"
                f" kernels); this job runs on {device_type!r}. Remove it there; `zero_hpz_partition_size` (ZeRO++'s"
                " hierarchical weight partition) works on every device."
            )
    if zero.get("zero_quantized_gradients") and zero.get("stage") != 3:
        raise ValueError(
            f"The DeepSpeed config sets `zero_optimization.zero_quantized_gradients=True` with stage"
            f" {zero.get('stage')}; DeepSpeed quantizes gradients at ZeRO-3 only. Use stage 3 or remove it."
        )


# ------------------------------------------------------------------ hooks


def builtin_hook(choice: CompressionChoice, hooked_group: Optional[Any]) -> tuple[Hook, Any]:
    """The hook and its state for ``choice`` on ``hooked_group`` (None: every rank; else the node leaders)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    if choice.mode in HOOK_MODES:
        inner, bound = split_options(choice.options)
        hook: Hook
        state: Any
        if choice.mode == "powersgd":
            hook, state = powerSGD_hook, PowerSGDState(process_group=hooked_group, **inner)
        else:
            hook, state = topk_hook, TopKState(hooked_group, **inner)
        return (error_bounded_hook, ErrorBoundState(choice.mode, hook, state, bound)) if bound else (hook, state)
    if choice.mode == "fp16":
        return default_hooks.fp16_compress_hook, hooked_group
    if choice.mode == "bf16":
        return default_hooks.bf16_compress_hook, hooked_group
    if choice.mode == "custom":
        assert choice.hook is not None
        return choice.hook, choice.hook_state if choice.hook_state is not None else hooked_group
    return default_hooks.allreduce_hook, hooked_group


def hook_state_dict(state: Any) -> Optional[dict[str, Any]]:
    """What of a hook's state survives a checkpoint: PowerSGD's and top-k's slots (error feedback, warm start, step
    count, random state), or a custom state's own ``state_dict()``; None when there is nothing to keep. An error
    bound's progress (its checks, the setting it raised) is kept around its inner state's."""
    if isinstance(state, ErrorBoundState):
        return {**state.progress(), "inner": hook_state_dict(state.inner_state)}
    if hasattr(state, "__slots__") and not isinstance(state, dist.ProcessGroup):
        saved = {slot: getattr(state, slot) for slot in state.__slots__ if slot in PROGRESS_SLOTS}
        if isinstance(saved.get("rng"), np.random.RandomState):  # (as plain data: the file loads weights-only)
            saved["rng"] = random_state_as_data(saved["rng"])
        return saved
    if callable(getattr(state, "state_dict", None)):
        return state.state_dict()
    return None


def random_state_as_data(generator: np.random.RandomState) -> dict[str, Any]:
    """A numpy ``RandomState`` (PowerSGD's) as tensors and numbers, which ``torch.load(weights_only=True)`` reads."""
    kind, keys, position, has_gauss, cached_gaussian = generator.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # (the legacy form: a tuple)
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def random_state_from_data(data: dict[str, Any]) -> np.random.RandomState:
    generator = np.random.RandomState()
    keys = data["keys"].numpy().astype(np.uint32)
    generator.set_state((data["kind"], keys, data["position"], data["has_gauss"], data["cached_gaussian"]))
    return generator


def load_hook_state_dict(state: Any, saved: dict[str, Any]) -> None:
    """Restore :func:`hook_state_dict`'s result into ``state``, keeping its process group."""
    if isinstance(state, ErrorBoundState):
        state.restore_progress(saved)
        load_hook_state_dict(state.inner_state, saved["inner"])
        return
    if hasattr(state, "__slots__") and not isinstance(state, dist.ProcessGroup):
        for slot, value in saved.items():
            if slot in PROGRESS_SLOTS and slot in state.__slots__:
                if slot == "rng" and isinstance(value, dict):
                    value = random_state_from_data(value)
                setattr(state, slot, value)
    elif callable(getattr(state, "load_state_dict", None)):
        state.load_state_dict(saved)
