"""Ray Train: ``RayHeteroStrategy``, the strategy for Ray's Lightning recipe (``pip install lightning-hetero[ray]``).

Ray's recipe builds the Trainer inside each Ray Train worker with ``RayLightningEnvironment`` and passes it through
``ray.train.lightning.prepare_trainer``, which accepts Ray's own strategy classes and their subclasses only. This
class is that subclass; everything else is HeteroStrategy's, with every argument it takes::

    trainer = Trainer(devices="auto", accelerator="auto", strategy=RayHeteroStrategy(batch_sizes=[48, 16]),
                      plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback(), HeteroMonitor()])
    trainer = prepare_trainer(trainer)

What Ray changes, and how it is met here (the strategy module knows nothing of Ray):

- Each Ray worker is one process that Ray started, so Lightning's ``devices="auto"`` sees one device per worker and
  ``num_nodes * devices`` is 1 whatever the cluster. The ranks and the world size come from Ray's context through
  the cluster environment, and the world size the arguments are checked against is Ray's.
- Ray's device on a CPU worker carries no index, which DeepSpeed takes as its device rank: a CPU worker's device is
  ``cpu:<local rank>``, as HeteroStrategy numbers CPU ranks; a CUDA worker's is the GPU Ray gave it.
- Ray's ``RayTrainReportCallback`` saves a checkpoint on every worker into a folder of its own and reports them all;
  HeteroStrategy writes a checkpoint where rank 0 says, so the whole checkpoint (every rank's part, its manifest) is in
  rank 0's folder, which Ray merges into its checkpoint. That needs the workers to share rank 0's folder: one machine
  (tested), or a temporary directory shared by the machines (``TMPDIR``; not tested). Across machines without one,
  the first save stops every rank, saying that a rank does not see rank 0's checkpoint folder.
- Ray passes ``ray.train.get_checkpoint()``'s ``checkpoint.ckpt`` to ``fit(ckpt_path=...)`` after a restart: that is
  the package's checkpoint, resumed as any other, on another number of workers too (Ray's elastic
  ``ScalingConfig(num_workers=(min, max))``) through the package's world-size change.
- ``HeteroMonitor`` puts its latest per-rank figures into ``trainer.callback_metrics``, which Ray's callback reports:
  they reach ``Result.metrics``.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_hetero.strategy import HeteroStrategy

try:
    import ray.train.torch
    from ray.train.lightning import RayDeepSpeedStrategy
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_hetero.ray needs Ray Train: `pip install lightning-hetero[ray]` (or `pip install 'ray[train]'`)."
    ) from error


class RayHeteroStrategy(HeteroStrategy, RayDeepSpeedStrategy):
    """HeteroStrategy inside a Ray Train worker; every argument is :class:`~lightning_hetero.HeteroStrategy`'s."""

    strategy_name = "hetero_ray"

    @property
    @override
    def root_device(self) -> torch.device:
        device = ray.train.torch.get_device()
        if device.type == "cpu":
            return torch.device("cpu", self.local_rank)
        return device

    @override
    def _launched_world_size(self) -> int:
        # One process per Ray worker: the Trainer's devices and nodes say nothing of the job's size, Ray does.
        assert self.cluster_environment is not None
        return self.cluster_environment.world_size()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Built by the user in the worker, never by name (prepare_trainer checks the instance).
        pass
