"""HeteroStrategy without processes: argument checks, config reconciliation, registration, world-size checks."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import StrategyRegistry

from lightning_hetero import HeteroStrategy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "`stage=4` is not a ZeRO stage"),
        ({"stage": True}, "`stage=True` is not a ZeRO stage"),
        ({"batch_sizes": [4, 4], "weights": [1.0, 1.0]}, "both `batch_sizes=[4, 4]` and `weights=[1.0, 1.0]`"),
        ({"batch_sizes": [0, 3]}, "`batch_sizes=[0, 3]` holds [0]"),
        ({"batch_sizes": [2.5, 3]}, "holds [2.5]"),
        ({"batch_sizes": [3, 13], "global_batch_size": 15}, "sums to 16 but `global_batch_size=15`"),
        ({"weights": [1.0, float("nan")]}, "holds [nan]"),
        ({"weights": [1.0, -0.5]}, "holds [-0.5]"),
        ({"global_batch_size": 0}, "`global_batch_size=0` must be a positive integer"),
        ({"config": {"gradient_accumulation_steps": 2}}, "`gradient_accumulation_steps=2`"),
        ({"config": {"train_micro_batch_size_per_gpu": 8}}, "`train_micro_batch_size_per_gpu=8`"),
        ({"config": {"train_batch_size": 64}}, "`train_batch_size=64`"),
        ({"config": {"zero_optimization": {"stage": 7}}}, "`zero_optimization.stage=7`"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=None) as error:
        HeteroStrategy(**kwargs)
    assert message in str(error.value)


def test_config_stage_wins_over_the_argument_and_says_so():
    with pytest.warns(UserWarning, match=r"`zero_optimization.stage=3` wins over `stage=1`"):
        strategy = HeteroStrategy(stage=1, config={"zero_optimization": {"stage": 3}})
    assert strategy.config["zero_optimization"]["stage"] == 3


def test_stage_fills_a_config_that_leaves_it_unset():
    strategy = HeteroStrategy(stage=3, config={"bf16": {"enabled": False}})
    assert strategy._zero_stage() == 3 and strategy.config == {"bf16": {"enabled": False}}  # (the user's dict as given)
    # A config that names no stage means ZeRO-0, as to DeepSpeed; no automatic choice overrides a user's config.
    assert HeteroStrategy(config={})._automatic_stages is None


def test_a_config_without_a_stage_is_zero_0_as_deepspeed_reads_it(tmp_path, monkeypatch):
    # DeepSpeed and Lightning's DeepSpeedStrategy run such a config at ZeRO-0; ZeRO-2 here made a plain torch optimizer
    # fail with DeepSpeed's "untested ZeRO Optimizer" (the fit is tests/compat/test_deepspeed_strategy_users.py).
    # The stage is settled in the strategy's own copy: `strategy.config` stays the dict given, as under
    # DeepSpeedStrategy (issue 51: a config from PL_DEEPSPEED_CONFIG_PATH came back with the stage added).
    assert HeteroStrategy(config={})._zero_stage() == 0
    assert HeteroStrategy(config={"zero_optimization": {}})._zero_stage() == 0
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 0.5}')
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    strategy = HeteroStrategy()
    assert strategy.config == {"gradient_clipping": 0.5} and strategy._zero_stage() == 0


def test_deepspeedstrategys_zero_off_switch_is_zero_0():
    # It crashed the constructor with a bare KeyError: 'zero_optimization'.
    strategy = HeteroStrategy(zero_optimization=False)
    assert strategy.config["zero_optimization"]["stage"] == 0
    assert strategy.settings.stage == 0


def test_arguments_that_a_config_replaces_are_named_in_a_warning():
    with pytest.warns(UserWarning, match=r"ignored: \['offload_optimizer', 'reduce_bucket_size'\]"):
        HeteroStrategy(config={}, offload_optimizer=True, reduce_bucket_size=10)


def test_default_config_uses_the_stage_argument():
    assert HeteroStrategy(stage=3).config["zero_optimization"]["stage"] == 3
    assert HeteroStrategy(stage=3)._automatic_stages is None


def test_without_a_stage_setup_chooses_among_the_stages_the_arguments_allow():
    assert HeteroStrategy()._automatic_stages == (0, 1, 2, 3)
    assert HeteroStrategy().config["zero_optimization"]["stage"] == 0  # until setup chooses
    assert HeteroStrategy(offload_optimizer=True)._automatic_stages == (2, 3)
    assert HeteroStrategy(offload_optimizer=True, offload_parameters=True)._automatic_stages == (3,)
    assert HeteroStrategy(micro_steps=[2, 1])._automatic_stages == (0, 1, 2)
    # Settled by the arguments: a compression hook and local SGD need ZeRO-0.
    assert HeteroStrategy(compression="powersgd")._automatic_stages is None
    assert HeteroStrategy(compression="powersgd").config["zero_optimization"]["stage"] == 0
    assert HeteroStrategy(sync="local_sgd")._automatic_stages is None


def test_registered_as_hetero_and_selected_by_name():
    assert "hetero" in StrategyRegistry
    trainer = Trainer(strategy="hetero", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HeteroStrategy)
    # The parent's names still belong to the parent.
    assert StrategyRegistry["deepspeed"]["strategy"].__name__ == "DeepSpeedStrategy"


@pytest.mark.parametrize(
    ("name", "stage", "offload_optimizer", "offload_parameters"),
    [
        ("hetero_stage_0", 0, False, False),
        ("hetero_stage_1", 1, False, False),
        ("hetero_stage_2", 2, False, False),
        ("hetero_stage_3", 3, False, False),
        ("hetero_stage_2_offload", 2, True, False),
        ("hetero_stage_3_offload", 3, True, True),
    ],
)
def test_presets_are_registered_as_lightnings_deepspeed_presets_are(name, stage, offload_optimizer, offload_parameters):
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, HeteroStrategy)
    zero = trainer.strategy.config["zero_optimization"]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == offload_optimizer and ("offload_param" in zero) == offload_parameters
    # The parent's preset of the same stage stays DeepSpeed's.
    if stage:
        assert StrategyRegistry[f"deepspeed_stage_{stage}"]["strategy"].__name__ == "DeepSpeedStrategy"


def _strategy_for_world(world_size: int, **kwargs) -> HeteroStrategy:
    strategy = HeteroStrategy(**kwargs)
    strategy.accelerator = CPUAccelerator()
    strategy.parallel_devices = [torch.device("cpu")] * world_size
    return strategy


@pytest.mark.parametrize(
    ("world_size", "kwargs", "message"),
    [
        (3, {"batch_sizes": [4, 12]}, "`batch_sizes=[4, 12]` has 2 entries but the job has 3 ranks"),
        (3, {"weights": [1.0, 0.5]}, "`weights=[1.0, 0.5]` has 2 entries but the job has 3 ranks"),
        (3, {"global_batch_size": 2}, "`global_batch_size=2` is smaller than the world size 3"),
    ],
)
def test_world_size_mistakes_fail_before_the_process_group_starts(world_size, kwargs, message):
    strategy = _strategy_for_world(world_size, **kwargs)
    with pytest.raises(ValueError) as error:
        strategy.setup_environment()  # would initialise the process group next: it must not get there
    assert message in str(error.value)
    assert not torch.distributed.is_initialized()


def test_no_way_to_infer_the_global_batch_is_a_clear_error():
    from torch.utils.data import DataLoader

    strategy = HeteroStrategy()
    with pytest.raises(ValueError, match=r"cannot infer the global batch.*got list.*global_batch_size="):
        strategy.settings.global_batch_size_for([[1, 2], [3, 4]], world_size=2)  # a plain iterable, not a DataLoader
    with pytest.raises(ValueError, match=r"cannot infer the global batch.*got DataLoader"):
        strategy.settings.global_batch_size_for(DataLoader(list(range(8)), batch_size=None), world_size=2)
    assert HeteroStrategy(global_batch_size=48).settings.global_batch_size_for(None, world_size=2) == 48
    assert HeteroStrategy(batch_sizes=[3, 13]).settings.global_batch_size_for(None, world_size=2) == 16


def test_an_emulated_slow_rank_pays_its_delay_before_every_collective():
    """A slow device reaches a collective (e.g. ``self.log(..., sync_dist=True)`` in training_step) only after its
    stretched compute; the emulator's owed delay must be paid first, or the other ranks would run ahead."""
    events: list[str] = []

    class RecordingEmulator:
        def catch_up(self) -> None:
            events.append("catch_up")

    strategy = HeteroStrategy()
    strategy.job.emulation = RecordingEmulator()
    value = torch.tensor([2.0])
    # Without a process group each collective returns its input; what matters is the delay paid before it.
    assert torch.equal(strategy.reduce(value), value)
    assert torch.equal(strategy.all_gather(value), value)
    assert strategy.broadcast("obj") == "obj"
    strategy.barrier()
    assert events == ["catch_up"] * 4


@pytest.mark.parametrize("stage", [0, 1])
def test_overlap_comm_in_a_user_config_is_switched_off_for_zero_0_and_1_with_a_warning(stage):
    with pytest.warns(UserWarning, match=rf"`zero_optimization.overlap_comm=True` is switched off for ZeRO-{stage}"):
        HeteroStrategy(config={"zero_optimization": {"stage": stage, "overlap_comm": True}})


def test_lightning_accumulates_gradients_as_with_ddp():
    assert HeteroStrategy().handles_gradient_accumulation is False


@pytest.mark.parametrize("name", ["hetero", "hetero_stage_3"])
def test_fabric_says_that_hetero_needs_the_trainer(name):
    from lightning.fabric import Fabric

    with pytest.raises(NotImplementedError, match=r"HeteroStrategy runs under Lightning's Trainer, not Fabric.*Use"):
        Fabric(strategy=name, accelerator="cpu", devices=2)
