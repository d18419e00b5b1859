"""Per-device precision, the decisions: which precision each rank computes in, and the job's agreed loss scale.

A mixed cluster mixes precisions: bf16 where the device computes in bf16 (CUDA compute capability >= 8.0, CPUs with
AMX or AVX512-BF16), fp16 on CUDA devices without bf16, fp32 elsewhere. DeepSpeed's own fp16/bf16 modes are one
setting for the whole job (set differently per rank they crash or finish silently wrong, see
``shared/design/facts.md``), so every rank keeps DeepSpeed's engine, master weights and collectives in fp32 and
only the rank's own compute runs under ``torch.autocast`` (:mod:`lightning_hetero.precision.plugin` does that).

fp16 gradients underflow without a loss scale, and a scale that is too large overflows. The scale is one value for
the whole job: an fp16 rank multiplies its loss by it and divides its gradients by it before they are exchanged,
and an overflow on any rank makes every rank skip that optimizer step and halve the scale together
(:class:`DynamicLossScale`), so the ranks never diverge.

Everything here is pure: argument checks (each error names the argument, its value and the fix) and decisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final, Optional, Union

from lightning_hetero.measure.facts import DeviceFacts
from lightning_hetero.runtime.checks import check_one_per_rank, per_rank_list

BF16: Final = "bf16-mixed"  # (Final: typed as the literal Lightning's precision arguments take)
FP16: Final = "16-mixed"
FP32: Final = "32-true"
PRECISIONS = (BF16, FP16, FP32)
AUTO = "auto"
# What a user may mean by another Lightning precision string, and why it is not offered per rank.
_REFUSED = {
    "bf16-true": "bf16-true makes the weights themselves bf16 (and so the collectives); use 'bf16-mixed'",
    "16-true": "16-true makes the weights themselves fp16 (and so the collectives); use '16-mixed'",
    "transformer-engine": "Transformer Engine precision is not offered per rank; use 'bf16-mixed' or '16-mixed'",
    "64-true": "fp64 ranks would need fp64 collectives; use '32-true'",
}
_ALIASES = {"bf16": BF16, "16": FP16, "32": FP32, 16: FP16, 32: FP32}

DevicePrecision = Optional[Union[str, tuple[str, ...]]]


def check_device_precision(value: Any) -> DevicePrecision:
    """``device_precision`` as given to the constructor: None, ``"auto"``, or one precision per rank (a tuple).

    Lightning's short forms (``"bf16"``, ``16``, ``"32"``) are read as the mixed forms Lightning maps them to.
    """
    if value is None or value == AUTO:
        return value
    example = f"['{BF16}', '{FP32}']"
    if isinstance(value, str):
        raise ValueError(
            f"`device_precision={value!r}` is neither 'auto' nor a list: give 'auto' (each device its best), None (the"
            f" Trainer's `precision` on every rank), or one precision per rank, e.g. `device_precision={example}`."
        )
    entries = per_rank_list("device_precision", value, example)
    if not entries:
        raise ValueError(f"`device_precision=[]` is empty: give one precision per rank, e.g. {example}.")
    chosen = []
    for rank, entry in enumerate(entries):
        entry = _ALIASES.get(entry, entry) if isinstance(entry, (str, int)) and not isinstance(entry, bool) else entry
        if entry in PRECISIONS:
            chosen.append(entry)
            continue
        why = _REFUSED.get(entry) if isinstance(entry, str) else None
        raise ValueError(
            f"`device_precision[{rank}]={entry!r}` is not a per-rank precision"
            f"{f' ({why})' if why else ''}: use one of {list(PRECISIONS)}."
        )
    return tuple(chosen)


def check_rank_count(setting: DevicePrecision, world_size: int) -> None:
    if isinstance(setting, tuple):
        check_one_per_rank(
            f"`device_precision={list(setting)}`",
            len(setting),
            world_size,
            "Give one precision per rank in global rank order, or 'auto'.",
        )


def check_trainer_precision(setting: DevicePrecision, trainer_precision: str, plugin_name: str) -> None:
    """``device_precision`` replaces the Trainer's one-for-all precision; both at once is an error.

    ``plugin_name`` is the class of the precision plugin the Trainer built: a user's own plugin is refused too, since
    this strategy brings its own.
    """
    if setting is None:
        return
    if trainer_precision != FP32:
        raise ValueError(
            f"`Trainer(precision={trainer_precision!r})` sets one precision for every rank, and"
            f" `HeteroStrategy(device_precision={_show(setting)})` sets one per rank: drop one. Keep the Trainer's"
            " default `precision='32-true'` to use `device_precision` (the engine and the collectives stay fp32 and"
            " each rank computes under its own autocast), or drop `device_precision` for one precision everywhere."
        )
    if plugin_name != "DeepSpeedPrecision":
        raise ValueError(
            f"`HeteroStrategy(device_precision={_show(setting)})` brings its own precision plugin, but the Trainer was"
            f" given `{plugin_name}`: drop that plugin from `Trainer(plugins=...)`, or drop `device_precision`."
        )


def check_config_precision(setting: DevicePrecision, config: Optional[Mapping[str, Any]]) -> None:
    """A DeepSpeed config that turns on DeepSpeed's own fp16/bf16 or autocast conflicts with per-rank precision."""
    if setting is None or not config:
        return
    for key in ("fp16", "bf16", "bfloat16", "torch_autocast"):
        section = config.get(key)
        if isinstance(section, Mapping) and section.get("enabled"):
            raise ValueError(
                f"The DeepSpeed config enables `{key}` and `HeteroStrategy(device_precision={_show(setting)})` is"
                f" given: drop one. `{key}` is one precision for every rank, in DeepSpeed's engine and its collectives;"
                " with `device_precision` the engine stays fp32 and each rank computes under its own autocast. Remove"
                f" the `{key}` section (or set `enabled: false`), or drop `device_precision`."
            )


def best_precision(facts: DeviceFacts) -> str:
    """``"auto"``: bf16 where the hardware computes in bf16, fp16 on CUDA devices without it, fp32 otherwise.

    fp16 is not chosen for a CPU: CPUs have no fast fp16 kernels (measured on this project's AVX512-BF16 machine:
    about 13x slower than fp32), and bf16 emulated in software is slower than fp32 too.
    """
    if facts.bf16_native and facts.supports_bf16 is not False:
        return BF16
    if facts.kind == "cuda" and facts.supports_fp16:
        return FP16
    return FP32


def rank_precision(setting: DevicePrecision, rank: int, facts: DeviceFacts) -> str:
    """The precision rank ``rank`` trains in; an error when its device cannot run the one it was given."""
    if setting is None:
        raise ValueError("rank_precision needs a device_precision setting (None means the Trainer's precision)")
    chosen = best_precision(facts) if setting == AUTO else setting[rank]
    problem = unsupported(chosen, facts)
    if problem:
        raise ValueError(
            f"`device_precision[{rank}]={chosen!r}` cannot run on rank {rank}'s device ({facts.describe()}): {problem}."
            f" Give that rank '{best_precision(facts)}', or use `device_precision='auto'`."
        )
    return chosen


def unsupported(precision: str, facts: DeviceFacts) -> Optional[str]:
    """Why ``precision`` cannot run on the device, or None. Unknown support (None) is not a refusal."""
    if precision == BF16 and facts.supports_bf16 is False:
        return "it has no bf16 support (CUDA needs compute capability 8.0 or newer)"
    if precision == FP16 and facts.supports_fp16 is False:
        return "it has no fp16 support"
    return None


def slow_precision(precision: str, facts: DeviceFacts) -> Optional[str]:
    """Why ``precision`` runs but slowly on this device (worth a warning), or None."""
    if precision == FP16 and facts.kind == "cpu":
        return "CPUs have no fast fp16 kernels: fp16 autocast on a CPU is much slower than fp32"
    if precision == BF16 and facts.kind == "cpu" and not facts.bf16_native:
        return "this CPU has neither AMX nor AVX512-BF16, so bf16 is emulated and slower than fp32"
    if precision == BF16 and facts.kind == "cuda" and facts.bf16_native is False:
        return "this GPU computes bf16 by emulation (compute capability below 8.0); '16-mixed' is its fast precision"
    return None


def needs_loss_scale(precisions: Sequence[str]) -> bool:
    """Whether the job needs the agreed loss scale (and its one all-gather per optimizer step): any fp16 rank."""
    return FP16 in precisions


def gradient_order_may_differ(precisions: Sequence[str], device_types: Sequence[str]) -> bool:
    """Whether ranks may produce their gradients in different orders: their autocasts differ.

    Autocast inserts casts into the autograd graph, which changes the order in which backward reaches the parameters.
    Ranks under the same autocast (the same precision on the same device type) build the same graph; fp32 ranks
    build the plain graph on any device; the same precision on another device type casts other operations.
    """
    autocasts = {(precision, "any" if precision == FP32 else kind) for precision, kind in zip(precisions, device_types)}
    return len(autocasts) > 1


def reduces_in_parameter_order(precisions: Sequence[str], device_types: Sequence[str], zero_stage: int) -> bool:
    """Whether the job must make ZeRO reduce in parameter order (and so hold every full gradient until the step).

    ZeRO-2/3 reduce in the order gradients arrive, which differs between ranks whose autocasts differ; ZeRO-0/1
    reduce in parameter order at the step anyway (see ``precision_plugin.ParameterOrderReduction``).
    """
    return zero_stage >= 2 and gradient_order_may_differ(precisions, device_types)


# DeepSpeedStrategy's arguments for DeepSpeed's own fp16 loss scaling.
FP16_LOSS_SCALE_ARGUMENTS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def unused_fp16_arguments(given: Mapping[str, Any], trainer_precision: str, config: Mapping[str, Any]) -> Optional[str]:
    """What to say when DeepSpeedStrategy's fp16 loss-scale arguments (``given``: those of
    :data:`FP16_LOSS_SCALE_ARGUMENTS` passed) do nothing: DeepSpeedStrategy writes them into DeepSpeed's ``fp16``
    section only with ``precision="16-mixed"`` or ``"16-true"`` and a config without its own ``fp16`` section, and
    drops them without a word otherwise (a test reading ``config["fp16"]`` then fails with a bare KeyError)."""
    if not given:
        return None
    shown = ", ".join(f"`{name}={value!r}`" for name, value in given.items())
    if trainer_precision in ("16-mixed", "16-true"):
        if "fp16" not in config:
            return None
        why = "the DeepSpeed config has its own `fp16` section, which wins"
    else:
        why = (
            f"`precision={trainer_precision!r}` runs no fp16 engine (the fp16 ranks of `device_precision` share the"
            " package's own dynamic loss scale, docs/precision.md)"
        )
    return (
        f"HeteroStrategy: {shown} set DeepSpeed's fp16 loss scaling, and {why}: they have no effect. Remove them, or"
        " train with `precision='16-mixed'`."
    )


@dataclass
class DynamicLossScale:
    """The job's loss scale, identical on every rank because every rank updates it with the same agreed overflow.

    As ``torch.amp.GradScaler``: start at ``2**16``; an overflow skips the step and multiplies the scale by
    ``backoff_factor``; ``growth_interval`` steps in a row without one multiply it by ``growth_factor``. An overflow
    at ``min_scale`` means the fp16 forward itself overflows, which no scale fixes: :meth:`update` raises then.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0  # optimizer steps since the last overflow or growth
    skipped_steps: int = 0  # over the whole run, checkpoints included

    def update(self, overflow: bool) -> bool:
        """Account for one optimizer step; returns whether it is skipped (that is, whether it overflowed)."""
        if overflow:
            if self.scale <= self.min_scale:
                raise FloatingPointError(
                    f"fp16 overflow at the minimum loss scale {self.min_scale:g}: the fp16 computation itself"
                    " overflows (values beyond 65504), which no loss scale fixes."
                )
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
            return True
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            if key in self.__dataclass_fields__:
                setattr(self, key, value)


def _show(setting: DevicePrecision) -> str:
    return repr(list(setting)) if isinstance(setting, tuple) else repr(setting)
