"""HeteroJob, the facade the strategy calls: a fit's lifecycle points driven one by one, in one process.

The job is rank 0 of two; its :class:`Collectives` is a fake whose other rank mirrors this one (every gather returns
this rank's part twice, a sum doubles). No process group exists, so a collective that bypassed ``Collectives`` would
fail with torch's "Default process group has not been initialized": every one the fit makes is recorded here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn, TrainerStatus
from torch.utils.data import DataLoader, TensorDataset

from lightning_hetero.job import HeteroJob
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.settings import HeteroSettings

ARGUMENTS = dict(
    stage=0,
    global_batch_size=None,
    batch_sizes=None,
    weights=None,
    micro_steps=None,
    emulate_speeds=None,
    loss_reduction="mean",
    rebalance=None,
    rebalance_window=20,
    rebalance_threshold=0.05,
    peer_timeout=None,
    device_precision=None,
    compression_mode=None,
    compression_options=None,
    hierarchical="auto",
    max_nonfinite_steps=3,
)


class MirrorCollectives(Collectives):
    """Two ranks, the other one a mirror of this one; every collective is recorded by name."""

    def __init__(self) -> None:
        super().__init__(2, torch.device("cpu"))
        self.calls: list[str] = []

    def gather_objects(self, obj):
        self.calls.append("gather_objects")
        return [obj, obj]

    def gather_tensor(self, tensor, catch_up=False):
        self.calls.append("gather_tensor")
        return [tensor.cpu(), tensor.cpu()]

    def sum(self, value):
        self.calls.append("sum")
        return 2 * value

    def reduce_in_place(self, tensor, op="sum", group=None):
        self.calls.append(f"reduce_in_place:{op}")
        if op == "sum":
            tensor.mul_(2)

    def broadcast_in_place(self, tensor, source=0):
        self.calls.append("broadcast_in_place")


class Regression(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_index=0):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)


class Source:
    """The fit loop's data source, as Lightning's ``_DataLoaderSource`` answers the job."""

    def __init__(self, loader: DataLoader) -> None:
        self._loader = loader

    def is_defined(self) -> bool:
        return True

    def dataloader(self) -> DataLoader:
        return self._loader


def fitting_trainer(module, loader, tmp_path, accumulate_grad_batches=1):
    return SimpleNamespace(
        state=SimpleNamespace(fn=TrainerFn.FITTING, stage=RunningStage.TRAINING, status=TrainerStatus.RUNNING),
        fit_loop=SimpleNamespace(_data_source=Source(loader)),
        _accelerator_connector=SimpleNamespace(use_distributed_sampler=True),
        accumulate_grad_batches=accumulate_grad_batches,
        global_step=0,
        is_last_batch=False,
        lightning_module=module,
        loggers=[],
        log_dir=None,
        default_root_dir=str(tmp_path),
        callbacks=[],
        current_epoch=0,
        is_global_zero=True,
    )


def fake_engine(module):
    """What the job reads of DeepSpeed's engine at ZeRO-0 in fp32."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return SimpleNamespace(
        module=module,
        optimizer=optimizer,
        skipped_steps=0,
        fp16_enabled=lambda: False,
        bfloat16_enabled=lambda: False,
        zero_optimization_stage=lambda: 0,
        torch_autocast_enabled=lambda: False,
        checkpoint_engine=SimpleNamespace(save=lambda *a, **k: None, makedirs=lambda *a, **k: None),
        save_checkpoint=lambda *a, **k: None,
        _copy_recovery_script=lambda *a, **k: None,
        global_steps=0,
        global_samples=0,
        step=optimizer.step,  # (wrapped as the trace's optimizer update)
    )


def joined_job(tmp_path, **arguments):
    torch.manual_seed(0)
    module = Regression()
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=4)
    trainer = fitting_trainer(module, loader, tmp_path, arguments.pop("accumulate_grad_batches", 1))
    job = HeteroJob(HeteroSettings.from_arguments(**{**ARGUMENTS, **arguments}))
    collectives = MirrorCollectives()
    config = {"zero_optimization": {"stage": 0}}
    plugin = Precision()
    job.check_job(2, "cpu", config, False, plugin, trainer)
    job.join(0, 2, torch.device("cpu"), None, lambda: plugin, collectives=collectives)
    return job, collectives, trainer, module, loader, config, plugin


def test_a_fit_through_the_job_makes_every_collective_through_collectives_and_weights_this_ranks_loss(tmp_path):
    assert not torch.distributed.is_initialized()
    job, collectives, trainer, module, loader, config, plugin = joined_job(tmp_path, batch_sizes=[3, 5])

    own_plugin, micro_batch = job.configure(config, trainer, module, torch.device("cpu"), plugin, None, False)
    assert own_plugin is None and micro_batch == 3  # rank 0's part of [3, 5]
    assert job.plan.batch_sizes == (3, 5) and collectives.calls[0] == "gather_objects"  # the setup survey
    job.check_configs_agree(config)
    job.write_plan(trainer, config)
    assert json.loads((tmp_path / "hetero" / "plan.json").read_text())["batch_sizes"] == [3, 5]

    engine = fake_engine(module)
    with job.engine_built(module, engine.optimizer):
        pass
    job.attach(engine, plugin)
    sharded = job.shard(loader, trainer)
    assert job.shard(sharded, trainer) is sharded  # (a loader the job rebuilt is kept)

    weighted_losses, logged, steps = [], [], 0

    def user_step(batch, samples):  # a `self.log(..., sync_dist=True)` inside the step: a weighted mean
        plain = lambda *args, **kwargs: pytest.fail("reduced as a plain mean")  # noqa: E731
        logged.append(job.reduce(torch.tensor(2.0), None, "mean", plain).item())
        return module.training_step(batch)

    for batch in sharded:
        assert len(batch[0]) == 3  # this rank's micro-batch of each global batch of 8
        output = job.training_step(batch, user_step, trainer)
        assert logged[-1] == pytest.approx(2.0)  # a weighted mean of the mirror's equal values
        job.backward(output, lambda loss: (weighted_losses.append(loss.item()), loss.backward()), trainer, 0)
        assert weighted_losses[-1] == pytest.approx(output.item() * 3 * 2 / 8)  # b_r * W / B for a mean
        job.optimizer_step(lambda: engine.optimizer.step(), lambda loss: None, trainer)
        engine.optimizer.zero_grad()
        trainer.global_step += 1
        steps += 1
    assert steps == 4  # 32 samples in global batches of 8
    trainer.state.status = TrainerStatus.FINISHED
    job.training_ends()
    job.write_report(trainer, plugin)
    report = json.loads((tmp_path / "hetero" / "report.json").read_text())
    assert report["world_size"] == 2 and len(report["steps"]) == 4  # (each rank told its own 3 samples)

    job.detach(plugin, trainer)
    assert job.engine is None

    # `trainer.save_checkpoint` after the fit: the strategy's engine outlives the trainer call.
    saved = {"global_step": steps, "epoch": 0, "state_dict": module.state_dict()}
    written = []
    job.save_checkpoint(tmp_path / "step=4", saved, written.append, zero_stage=0, engine=engine)
    assert len(written) == 1
    manifest = json.loads((tmp_path / "step=4" / "hetero_manifest.json").read_text())
    assert manifest["batch_sizes"] == [3, 5] and manifest["world_size"] == 2
    loaded = job.load_checkpoint(
        tmp_path / "step=4",
        lambda directory: {"loaded": directory},
        module,
        trainer,
        0,
        stage_is_automatic=False,
        engine=engine,
    )
    assert loaded == {"loaded": str(tmp_path / "step=4")}
    assert not torch.distributed.is_initialized()
    assert {"gather_objects", "gather_tensor", "reduce_in_place:sum"} <= set(collectives.calls)


def test_a_refusal_in_the_survey_is_raised_through_the_gather_on_this_rank(tmp_path):
    job, collectives, trainer, module, _, config, plugin = joined_job(
        tmp_path, sync="local_sgd", accumulate_grad_batches=2
    )
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\)` with `sync='local_sgd'`"):
        job.configure(config, trainer, module, torch.device("cpu"), plugin, None, False)
    assert collectives.calls == ["gather_objects"]  # the other rank learns of it in the same gather


@pytest.mark.parametrize("eager", [True, False])
def test_the_overlaps_stand_in_reaches_the_local_training_and_the_ranks_agreement(eager):
    """``sync_options['eager']`` is what the job's local training takes while a merge is in flight, and one of the
    settings every rank must have been given alike (a rank with the other value would train another algorithm)."""

    def settings_with(options):
        local = {"sync": "diloco", "sync_every": 2, "sync_options": options}
        return HeteroSettings.from_arguments(**{**ARGUMENTS, **local})

    settings = settings_with({"overlap": True, "eager": False} if not eager else {"overlap": True})  # (the default)
    job = HeteroJob(settings)
    assert job.local is not None and job.local.overlap and job.local.eager is eager
    other = settings_with({"overlap": True, "eager": not eager})
    agreed = [s.agreement(None, {}, (None, None)) for s in (settings, other)]
    assert agreed[0]["sync"] != agreed[1]["sync"]
