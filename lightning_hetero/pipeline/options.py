"""Plan: the ``pipeline`` argument checked (:class:`PipelineChoice`), and what a pipeline cannot run with (yet).

Each check runs before any collective, in the constructor (the argument, the strategy's other arguments, the DeepSpeed
config) or at setup (the number of ranks, the trainer call), and its message names what to change. Apart from the
placement (:mod:`lightning_hetero.pipeline.placement`): none of it needs the blocks' costs, and the settings check the
argument without the search.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

SCHEDULES = ("1f1b", "gpipe", "interleaved")
MAX_VIRTUAL_STAGES = 32  # (a message's key between two ranks holds the chunk in 6 bits: stage.Pipeline._key)


@dataclass(frozen=True)
class PipelineChoice:
    """The checked ``pipeline`` argument: ``stages`` per pipeline, the chain's attribute path ``blocks``, fixed
    ``boundaries`` (None: placed by the blocks' measured costs), the ``schedule``, ``micro_batches`` per step and,
    for the interleaved schedule, ``virtual_stages``: the chunks of the chain each rank holds (1 otherwise)."""

    stages: int
    blocks: str
    boundaries: Optional[tuple[int, ...]] = None
    schedule: str = "1f1b"
    micro_batches: Optional[int] = None  # None: twice the stages, so the bubble is at most a third of the step
    virtual_stages: int = 1

    def micro_batches_for(self, samples: int) -> int:
        return max(1, min(samples, self.micro_batches or 2 * self.stages))

    def describe(self) -> str:
        where = f"boundaries {list(self.boundaries)}" if self.boundaries else "boundaries placed by speed and memory"
        schedule = self.schedule + (f" ({self.virtual_stages} chunks per rank)" if self.virtual_stages > 1 else "")
        return f"{self.stages} stages of `{self.blocks}`, {where}, {schedule}"


PIPELINE_KEYS = ("stages", "blocks", "boundaries", "schedule", "micro_batches", "virtual_stages")


def check_pipeline_argument(value: Any) -> Optional[PipelineChoice]:
    """``pipeline`` checked in the constructor, with a message naming the key, its value and the fix."""
    if value is None:
        return None
    if isinstance(value, PipelineChoice):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(
            f"HeteroStrategy(pipeline={value!r}): give a dict, e.g. `pipeline={{'stages': 2, 'blocks': 'net'}}`"
            " (`blocks`: the attribute holding the chain of blocks, an nn.Sequential, ModuleList or ModuleDict)."
        )
    unknown = sorted(set(value) - set(PIPELINE_KEYS))
    if unknown:
        raise ValueError(f"HeteroStrategy(pipeline=...): unknown keys {unknown}; the keys are {list(PIPELINE_KEYS)}.")
    stages = value.get("stages")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `stages` {stages!r} must be an integer >= 2 (the model's parts per"
            " pipeline); without a pipeline leave out `pipeline`."
        )
    blocks = value.get("blocks")
    if not isinstance(blocks, str) or not blocks or any(not part.isidentifier() for part in blocks.split(".")):
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `blocks` {blocks!r} must name the LightningModule's attribute that holds"
            " the chain, e.g. 'net' or 'model.layers'."
        )
    boundaries = value.get("boundaries")
    if boundaries is not None:
        if not isinstance(boundaries, Sequence) or any(
            isinstance(b, bool) or not isinstance(b, int) for b in boundaries
        ):
            raise ValueError(
                f"HeteroStrategy(pipeline=...): `boundaries` {boundaries!r} must be a list of {stages - 1} block"
                " indices: the first block of each stage after the first."
            )
        if len(boundaries) != stages - 1 or list(boundaries) != sorted(set(boundaries)) or min(boundaries) < 1:
            raise ValueError(
                f"HeteroStrategy(pipeline=...): `boundaries` {list(boundaries)} must be {stages - 1} increasing block"
                f" indices >= 1 for {stages} stages (the first block of each stage after the first)."
            )
        boundaries = tuple(boundaries)
    schedule = value.get("schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise ValueError(f"HeteroStrategy(pipeline=...): `schedule` {schedule!r} must be one of {list(SCHEDULES)}.")
    micro_batches = value.get("micro_batches")
    if micro_batches is not None and (
        isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1
    ):
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `micro_batches` {micro_batches!r} must be an integer >= 1 (each"
            " pipeline's batch is cut into that many micro-batches per step); leave it out for twice the stages."
        )
    virtual_stages = value.get("virtual_stages", 2 if schedule == "interleaved" else 1)
    if schedule == "interleaved":
        if (
            isinstance(virtual_stages, bool)
            or not isinstance(virtual_stages, int)
            or not 2 <= virtual_stages <= MAX_VIRTUAL_STAGES
        ):
            raise ValueError(
                f"HeteroStrategy(pipeline=...): `virtual_stages` {virtual_stages!r} must be an integer from 2 to"
                f" {MAX_VIRTUAL_STAGES} with the interleaved schedule (the chunks of the chain each rank holds); leave"
                " it out for 2."
            )
        if micro_batches is not None and micro_batches % stages:
            raise ValueError(
                f"HeteroStrategy(pipeline=...): `micro_batches` {micro_batches} must be a multiple of `stages` {stages}"
                " with the interleaved schedule (its micro-batches go round the stages in groups of `stages`); use"
                f" {stages * max(1, round(micro_batches / stages))}, or leave it out for {2 * stages}."
            )
    elif virtual_stages != 1:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): `virtual_stages` {virtual_stages!r} goes with `schedule='interleaved'`"
            f" only; with {schedule!r} each rank holds one contiguous part of the chain. Leave it out."
        )
    return PipelineChoice(stages, blocks, boundaries, schedule, micro_batches, virtual_stages)


def replicas_of(choice: PipelineChoice, world_size: int) -> int:
    """How many pipelines side by side ``world_size`` ranks form; raised at setup, before any collective."""
    if world_size % choice.stages:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): {world_size} ranks cannot form pipelines of `stages` {choice.stages};"
            f" use a number of ranks that is a multiple of {choice.stages}, or `stages` that divides {world_size}."
        )
    return world_size // choice.stages


def pipeline_argument_refusal(**arguments: Any) -> Optional[str]:
    """Why the strategy's other arguments cannot go with ``pipeline`` (yet), or None. Checked in the constructor."""
    refused = {
        "stage": (
            "ZeRO-2/3 inside a stage are not built yet: each stage holds its own blocks whole (`stage=1` shards the"
            " optimizer state over the pipelines holding a stage)",
            lambda v: v not in (None, 0, 1),
        ),
        "sync": ("local SGD / DiLoCo between pipelines is not built", lambda v: v != "every_step"),
        "batch_sizes": ("the pipelines share the global batch equally for now", lambda v: v is not None),
        "weights": ("the pipelines share the global batch equally for now", lambda v: v is not None),
        "micro_steps": ("a pipeline cuts its batch into `micro_batches` itself", lambda v: v is not None),
        "loss_reduction": ("a token mean needs each micro-batch's token count", lambda v: v == "token_mean"),
        "compression": ("the pipeline sums its gradients itself, uncompressed", lambda v: v is not None),
        "hierarchical": ("the pipeline sums its gradients itself, in flat groups", lambda v: v is True),
    }
    for name, (why, is_refused) in refused.items():
        value = arguments.get(name)
        if is_refused(value):
            return (
                f"HeteroStrategy(pipeline=..., {name}={value!r}): not with a pipeline: {why}. Leave out `{name}`,"
                " or train without `pipeline`."
            )
    return None


def check_pipeline_config(config: Mapping[str, Any]) -> None:
    """A DeepSpeed config (the user's, or the one ``stage``/``offload_*`` made) that a pipeline cannot run: each
    stage holds its blocks whole, at ZeRO-0, without offloading. Raised in the constructor."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    offloaded = [key for key in ("offload_optimizer", "offload_param") if isinstance(zero, Mapping) and zero.get(key)]
    if stage or offloaded:
        what = f"`zero_optimization.stage={stage}`" if stage else f"`zero_optimization.{offloaded[0]}`"
        raise ValueError(
            f"HeteroStrategy(pipeline=...) with a DeepSpeed config that sets {what}: each stage's engine runs at"
            " ZeRO-0, nothing offloaded. Leave the stage and offloading out of the config;"
            " `HeteroStrategy(pipeline=..., stage=1)` shards the optimizer state over the pipelines that hold a stage."
        )


def pipeline_job_refusal(precision: str, automatic_optimization: bool) -> Optional[str]:
    """Why this trainer call cannot run with a pipeline (yet), or None; checked at setup on every rank, before any
    collective (every rank sees the same trainer). Gradient clipping and `accumulate_grad_batches` run: the norm is
    taken over every stage (:meth:`~lightning_hetero.pipeline.stage.Pipeline.gradient_norm`), and each batch's
    gradients are added to the accumulated ones after its own sums. ``automatic_optimization``: the module's, in a
    fit (an evaluation runs no backward: pass True)."""
    if precision not in ("32-true", "32"):
        return (
            f"HeteroStrategy(pipeline=...) with `Trainer(precision={precision!r})`: the stages train in 32-bit"
            " for now. Use `precision='32-true'`, or train without `pipeline`."
        )
    if not automatic_optimization:
        return (
            "HeteroStrategy(pipeline=...) with manual optimization: the pipeline runs the backward of every"
            " micro-batch itself. Use automatic optimization."
        )
    return None
