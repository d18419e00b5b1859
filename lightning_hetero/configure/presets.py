"""Configure: the strategy names registered with Lightning, and the arguments each one stands for.

The default, one per ZeRO stage, and the CPU-offload variants Lightning registers for DeepSpeed, with the prefix
"hetero" (the "deepspeed*" names belong to Lightning's DeepSpeedStrategy): ``Trainer(strategy="hetero_stage_3")``, or
``strategy: hetero_stage_3`` in a CLI YAML once the package is imported.
"""

from __future__ import annotations

from typing import Any

PRESETS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("hetero", "DeepSpeed ZeRO with per-rank micro-batches", {}),
    *((f"hetero_stage_{stage}", f"HeteroStrategy at ZeRO stage {stage}", {"stage": stage}) for stage in range(4)),
    (
        "hetero_stage_2_offload",
        "HeteroStrategy at ZeRO stage 2, optimizer offloaded to the CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    (
        "hetero_stage_3_offload",
        "HeteroStrategy at ZeRO stage 3, optimizer and parameters offloaded to the CPU",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    ),
)
