"""Measure: the job's survey of its ranks at setup: what each rank tells the others in the one setup gather.

Each rank sends a :class:`RankSurvey` (its arguments, data seed, model signature, device facts, precision and, for
the automatic split, the profile of its own training step); every rank then holds the same :class:`JobSurvey` and
plans from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_hetero.emulate.slowdown import SlowdownEmulator
from lightning_hetero.measure.facts import DeviceFacts, same_model
from lightning_hetero.measure.profiler import profile_from_loader
from lightning_hetero.measure.rank_profile import RankProfile, probe_sizes


@dataclass(frozen=True)
class RankSurvey:
    agreement: dict[str, Any]  # what every rank must have been given alike (HeteroSettings.agreement)
    seed: int  # this rank's seed_everything seed (0 when none was set)
    model: Any  # the model's signature (parameter names, shapes, dtypes)
    facts: DeviceFacts
    precision: str  # the precision this rank trains in
    profile: Optional[RankProfile]  # its training step, measured (automatic split only)
    # A fixed unequal split's check of the loss: its loss on a micro-batch given twice over its own (1: a mean, 2: a
    # sum); None where nothing was checked (the automatic split's profile holds its own).
    loss_ratio: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "arguments": self.agreement,
            "seed": self.seed,
            "model": self.model,
            "facts": self.facts.to_dict(),
            "precision": self.precision,
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "loss_ratio": self.loss_ratio,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankSurvey:
        profile = data["profile"]
        return cls(
            agreement=data["arguments"],
            seed=data["seed"],
            model=data["model"],
            facts=DeviceFacts.from_dict(data["facts"]),
            precision=data["precision"],
            profile=RankProfile.from_dict(profile) if profile is not None else None,
            loss_ratio=data.get("loss_ratio"),
        )


@dataclass(frozen=True)
class JobSurvey:
    """Every rank's survey, in rank order; every rank holds the same one."""

    ranks: Sequence[RankSurvey]

    @property
    def device_facts(self) -> list[DeviceFacts]:
        return [rank.facts for rank in self.ranks]

    @property
    def precisions(self) -> list[str]:
        return [rank.precision for rank in self.ranks]

    @property
    def profiles(self) -> Optional[list[RankProfile]]:
        """Every rank's profile, or None when the split is not automatic (no rank profiled)."""
        profiles = [rank.profile for rank in self.ranks if rank.profile is not None]
        return profiles if len(profiles) == len(self.ranks) else None

    @property
    def loss_ratios(self) -> list[Optional[float]]:
        """Every rank's loss on a batch given twice over its own: from its profile (automatic split) or the fixed
        split's check; None for a rank that measured none."""
        return [rank.profile.loss_ratio if rank.profile is not None else rank.loss_ratio for rank in self.ranks]

    def identical_devices(self, emulated: bool) -> bool:
        """Same-model devices computing in one precision, with no emulated speeds declaring them different."""
        return not emulated and same_model(self.device_facts) and len(set(self.precisions)) == 1


def profile_rank(
    module: Any,
    loader: Any,
    global_batch_size: int,
    world_size: int,
    device: torch.device,
    emulator: Optional[SlowdownEmulator],
    autocast: Callable[[], Any],
) -> RankProfile:
    """This rank's own training step, measured as it will train (its autocast, its emulated speed)."""
    module.to(device)  # DeepSpeed would move it there next anyway
    sizes = probe_sizes(global_batch_size, world_size)
    return profile_from_loader(module, loader, sizes, device, emulator, autocast)
