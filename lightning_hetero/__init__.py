"""lightning_hetero: train a Lightning model across heterogeneous devices with DeepSpeed ZeRO.

Importing the package registers ``Trainer(strategy="hetero")`` (and the presets ``hetero_stage_0`` ... ``_3``, with
offload variants) in Lightning's StrategyRegistry, the same names in Fabric's only to say that they need the Trainer
(see :mod:`lightning_hetero.fabric`), and lets
``LightningModule.load_from_checkpoint`` read the checkpoint directories HeteroStrategy writes (see
:mod:`lightning_hetero.recover.export`).

The layout follows a run's flow, one folder per stage, lowest first::

    runtime/    argument checks, collectives, private-internals list, quiet output, start-up, clean exit
    emulate/    slower devices emulated on identical hardware (a test and demo aid)
    measure/    device facts and a profile of the user's step (a cost model per rank)
    split/decisions/
                the split's pure decisions: the arithmetic, the exact planner, micro-steps, the first plan, re-plans
    configure/  each rank's DeepSpeed config and the check of the user's keys, the ZeRO stage that fits, the
                registered names, the resume's learning-rate rule, the check that every rank built the same model
    precision/  each rank's precision: the choice, the Precision plugin, one loss scale, non-finite steps
    comm/       compression, topology, the gradient exchange and the bytes on the wire
    train/      the data order cut into per-rank slices, streams, buffers kept equal, micro-batches, modes' lifecycle
    watch/      per-step measurements, the split that follows them, the run report, the monitor callback
    recover/    checkpoints, resumes, lost or signalled ranks, failures said on every rank

Above the stages, a folder per way of training holds its training mode (``train/mode.py``'s lifecycle, which the job
calls at each hook point), with what belongs to that way alone::

    split/      data parallel on the uneven split: one step's micro-batches, the mode, its report and checkpoints
                (its decisions, in ``split/decisions/``, sit low in the order: the layers above use them too)
    local/      local SGD / DiLoCo and asynchronous merges: inner steps, fragments and claims decided, the merges'
                state, the claiming loader, the modes
    pipeline/   the model split into stages: options, blocks measured, stages placed and re-placed, the stage's
                schedule, its state by block name, its report

    simulate/   the cluster planner: a mixed cluster described in YAML, planned and predicted before it is used

A module imports only from its own folder and the folders listed above it. On top, imported by no folder:
``strategy.py`` (Lightning's hook order and the DeepSpeed overrides) calls only ``job.py``'s HeteroJob, one method
per lifecycle point: the shared part, then the training mode the settings chose (``job_setup.py``: the survey and the
plan of each trainer call); ``settings.py`` checks every argument. ``tests/test_layering.py`` keeps it so.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero.fabric import register_fabric_names
from lightning_hetero.recover import export
from lightning_hetero.recover.elastic import launched_layout
from lightning_hetero.recover.export import save_as_lightning_checkpoint
from lightning_hetero.split.decisions.split import SplitPlan, split_by_weights
from lightning_hetero.strategy import HeteroStrategy
from lightning_hetero.watch.monitor import HeteroMonitor

HeteroStrategy.register_strategies(StrategyRegistry)
register_fabric_names(FABRIC_STRATEGIES)  # `Fabric(strategy="hetero")` says that it needs the Trainer
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
