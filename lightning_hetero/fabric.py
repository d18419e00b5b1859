"""Fabric: ``Fabric(strategy="hetero")`` is refused with an error that says why and what to use instead.

HeteroStrategy is built on the Trainer's loop: the split is cut by the training loader the Trainer requests and the
strategy rebuilds, the loss weights are applied in the Trainer's backward, re-plans happen where its loop fetches a
batch, and checkpoints, signals and the run report hang on its lifecycle hooks. Fabric hands the loop to the user, so
none of those points exist there, and a Fabric strategy that accepted the name would silently train with equal
micro-batches. Until the core is shared (a Fabric loop would have to call the split, the weights and the watch
itself), the name is registered in Fabric's registry only to say so.
"""

from __future__ import annotations

from typing import Any

from lightning_hetero.configure.presets import PRESETS


class HeteroFabricStrategy:
    """Stands in Fabric's strategy registry for every HeteroStrategy name; constructing it raises."""

    def __init__(self, **arguments: Any) -> None:
        raise NotImplementedError(
            "HeteroStrategy runs under Lightning's Trainer, not Fabric: it cuts each rank's micro-batch from the"
            " training loader the Trainer builds, weights the loss in the Trainer's backward and re-plans where the"
            " Trainer's loop fetches a batch, and Fabric's loop is yours. Use `Trainer(strategy='hetero')` with a"
            " LightningModule, or `Fabric(strategy='deepspeed')` for DeepSpeed with equal micro-batches."
        )


def register_fabric_names(registry: Any) -> None:
    """Put every HeteroStrategy name into Fabric's registry (there it only raises)."""
    for name, description, _ in PRESETS:
        registry.register(name, HeteroFabricStrategy, description=f"{description} (Trainer only)", override=True)
