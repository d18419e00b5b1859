"""lightning_hetero: train a Lightning model across heterogeneous devices with DeepSpeed ZeRO.

Importing the package registers ``Trainer(strategy="hetero")`` in Lightning's StrategyRegistry, and lets
``LightningModule.load_from_checkpoint`` read the checkpoint directories HeteroStrategy writes (see
:mod:`lightning_hetero.export`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero import export
from lightning_hetero.callbacks import HeteroMonitor
from lightning_hetero.elastic import launched_layout
from lightning_hetero.export import save_as_lightning_checkpoint
from lightning_hetero.plan import SplitPlan, split_by_weights
from lightning_hetero.strategy import HeteroStrategy

HeteroStrategy.register_strategies(StrategyRegistry)
export.install()

__all__ = [
    "HeteroMonitor",
    "HeteroStrategy",
    "SplitPlan",
    "launched_layout",
    "save_as_lightning_checkpoint",
    "split_by_weights",
]
__version__ = "0.1.0"
