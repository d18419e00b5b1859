"""lightning_hetero: train a Lightning model across heterogeneous devices with DeepSpeed ZeRO.

Importing the package registers ``Trainer(strategy="hetero")`` in Lightning's StrategyRegistry.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.callbacks import HeteroMonitor
from lightning_hetero.plan import SplitPlan, split_by_weights
from lightning_hetero.strategy import HeteroStrategy

HeteroStrategy.register_strategies(StrategyRegistry)

__all__ = ["HeteroMonitor", "HeteroStrategy", "SplitPlan", "split_by_weights"]
__version__ = "0.1.0"
