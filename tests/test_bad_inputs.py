"""Mistakes at every place a user can make them, each caught early with a message that names the argument and value.

One table per way in: the constructor, a DeepSpeed config, the emulation environment variable, the `lightning-hetero`
CLI's YAML (all caught before any process starts), and setup on 2 ranks (every process must exit, in bounded time,
with the message on every rank). Multi-process cases elsewhere: differing training sets, DeepSpeed configs differing
by rank and an IterableDataset (tests/test_strategy_multiprocess.py).
"""

from __future__ import annotations

import math
import time

import pytest
from conftest import REPO, run_fit

from lightning_hetero import HeteroStrategy
from lightning_hetero.emulate.slowdown import ENV_VAR

CONSTRUCTOR = [
    ({"stage": 4}, "`stage=4` is not a ZeRO stage"),
    ({"stage": 2.0}, "`stage=2.0` is not a ZeRO stage"),
    ({"stage": True}, "`stage=True` is not a ZeRO stage"),
    ({"stage": "2"}, "`stage='2'` is not a ZeRO stage"),
    ({"batch_sizes": 8}, "`batch_sizes=8` is not a list"),
    ({"batch_sizes": {0: 8, 1: 8}}, "`batch_sizes={0: 8, 1: 8}` is a mapping"),
    ({"batch_sizes": "8,8"}, "`batch_sizes='8,8'` is not a list"),
    ({"batch_sizes": [0, 3]}, "`batch_sizes=[0, 3]` holds [0]"),
    ({"batch_sizes": [2.5, 3]}, "`batch_sizes=[2.5, 3]` holds [2.5]"),
    ({"batch_sizes": []}, "`batch_sizes=[]` is empty"),
    ({"batch_sizes": [3, 13], "global_batch_size": 15}, "sums to 16 but `global_batch_size=15`"),
    ({"batch_sizes": [4, 4], "weights": [1.0, 1.0]}, "both `batch_sizes=[4, 4]` and `weights=[1.0, 1.0]`"),
    ({"weights": 0.4}, "`weights=0.4` is not a list"),
    ({"weights": {1.0, 0.4}}, "is not a list"),
    ({"weights": [1.0, math.nan]}, "`weights=[1.0, nan]` holds [nan]"),
    ({"weights": [1.0, -0.5]}, "`weights=[1.0, -0.5]` holds [-0.5]"),
    ({"global_batch_size": 0}, "`global_batch_size=0` must be a positive integer"),
    ({"global_batch_size": 64.0}, "`global_batch_size=64.0` must be a positive integer"),
    ({"emulate_speeds": 0.4}, "`emulate_speeds=0.4` is not a list"),
    ({"emulate_speeds": [1.0, 1.5]}, "`emulate_speeds=[1.0, 1.5]` holds [1.5]"),
    ({"emulate_speeds": [1.0, 0]}, "`emulate_speeds=[1.0, 0]` holds [0]"),
    ({"loss_reduction": "avg"}, "`loss_reduction='avg'` is not one of ['mean', 'sum', 'token_mean']"),
    ({"rebalance": "auto"}, "`rebalance='auto'` must be True, False or None"),
    ({"rebalance_window": 0}, "`rebalance_window=0` must be a positive integer"),
    ({"rebalance_threshold": -0.05}, "`rebalance_threshold=-0.05` must be a finite number >= 0"),
    ({"lr_scaling": "square_root"}, "`lr_scaling='square_root'` must be None (default: a resume keeps"),
    ({"lr_scaling": "linear", "sync": "local_sgd"}, "`lr_scaling='linear'` with `sync='local_sgd'`: each rank steps"),
    ({"trace": [20, 21]}, "`trace=[20, 21]` must be a dict with the key 'steps'"),
    ({"trace": {"steps": [3, 3]}}, "`trace['steps']=[3, 3]` must hold distinct whole numbers >= 0"),
    ({"device_precision": "bf16-mixed"}, "`device_precision='bf16-mixed'` is neither 'auto' nor a list"),
    ({"device_precision": ["bf16-true", "32-true"]}, "`device_precision[0]='bf16-true'` is not a per-rank precision"),
    ({"device_precision": ["bf16-mixed", "fp8"]}, "`device_precision[1]='fp8'` is not a per-rank precision: use one"),
    ({"device_precision": []}, "`device_precision=[]` is empty"),
    ({"device_precision": {0: "bf16-mixed"}}, "`device_precision={0: 'bf16-mixed'}` is a mapping"),
    (
        {"device_precision": "auto", "config": {"bf16": {"enabled": True}}},
        "The DeepSpeed config enables `bf16` and `HeteroStrategy(device_precision='auto')` is given: drop one",
    ),
    (
        {"device_precision": ["16-mixed", "32-true"], "config": {"fp16": {"enabled": True}}},
        "The DeepSpeed config enables `fp16`",
    ),
    (
        {"device_precision": "auto", "config": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}},
        "The DeepSpeed config enables `torch_autocast`",
    ),
    (
        {"compression": "gzip"},
        "`compression='gzip'` is not one of ['fp16', 'bf16', 'powersgd', 'topk', 'int8', 'int4']",
    ),
    ({"compression": "powersgd", "stage": 2}, "`compression='powersgd'` needs `stage=0`: ZeRO-2 reduces gradients"),
    ({"compression": "topk", "stage": 3}, "needs `stage=0`: ZeRO-3 reduces gradients"),
    ({"compression": "topk", "compression_options": {"ratio": 2}}, "must be a fraction in (0, 1]"),
    ({"hierarchical": "yes"}, "`hierarchical='yes'` is not one of"),
    ({"hierarchical": True, "stage": 1}, "`hierarchical=True` needs `stage=0`"),
    ({"hierarchical": True, "stage": 0, "compression": (print, object())}, "a custom hook given with its own state"),
    ({"compression": "fp16", "config": {"communication_data_type": "bf16"}}, "Keep one"),
    ({"peer_timeout": math.nan}, "`peer_timeout=nan` must be a finite number of seconds >= 5"),
    ({"peer_timeout": math.inf}, "`peer_timeout=inf` must be a finite number of seconds >= 5"),
    ({"config": [1, 2]}, "`config=[1, 2]` is a list; give a DeepSpeed config as a dict"),
    ({"zero_optimization": False, "stage": 3}, "`zero_optimization=False` turns ZeRO off, but `stage=3` asks for"),
    ({"max_nonfinite_steps": 0}, "`max_nonfinite_steps=0` must be a positive integer"),
    ({"max_nonfinite_steps": 2.5}, "`max_nonfinite_steps=2.5` must be a positive integer"),
    ({"sync": "sometimes"}, "`sync='sometimes'` is not one of ['every_step', 'local_sgd', 'diloco']"),
    ({"sync": "diloco", "sync_every": 0}, "`sync_every=0` must be a positive integer"),
    ({"sync_every": 8}, "`sync_every` is given with `sync='every_step'`"),
    ({"sync": "diloco", "inner_steps": [2, 0]}, "`inner_steps=[2, 0]` must hold one whole number >= 1 per rank"),
    ({"sync": "diloco", "sync_options": {"outer_lr": -1}}, "`sync_options['outer_lr']=-1` must be a finite number"),
    ({"sync": "local_sgd", "sync_options": {"outer_lr": 0.7}}, "is given with `sync='local_sgd'`"),
    ({"sync": "diloco", "rebalance": True, "inner_steps": [2, 1]}, "`rebalance=True` with `inner_steps=[2, 1]`"),
    ({"sync": "diloco", "compression": "topk", "stage": 0}, "`sync='diloco'` with `compression='topk'`"),
    ({"compression": "int8"}, "`compression='int8'` with `sync='every_step'`: int8 and int4 quantize the pseudo-grad"),
    ({"sync": "diloco", "sync_every": 6, "sync_options": {"fragments": 4}}, "`sync_options['fragments']=4` must be a"),
    ({"sync": "diloco", "sync_options": {"overlap": "yes"}}, "`sync_options['overlap']='yes'` must be True or False"),
    ({"sync": "diloco", "compression": "int4", "compression_options": {"block": 64}}, "has nothing to set for"),
    ({"sync": "diloco", "stage": 1}, "`sync='diloco'` needs `stage=0`: ZeRO stage 1 shards"),
    ({"sync": "local_sgd", "micro_steps": [2, 1]}, "`sync='local_sgd'` with `micro_steps`"),
    ({"sync": "local_sgd", "weights": [1.0, 0.4]}, "`sync='local_sgd'` with `weights`"),
    ({"micro_steps": 3}, "`micro_steps=3` is not a list"),
    ({"micro_steps": [3, 0]}, "`micro_steps=[3, 0]` holds [0]"),
    ({"micro_steps": [1.5, 1]}, "`micro_steps=[1.5, 1]` holds [1.5]"),
    ({"micro_steps": []}, "`micro_steps=[]` is empty"),
    ({"micro_steps": [3, 1], "batch_sizes": [4, 4, 4]}, "`batch_sizes=[4, 4, 4]` and `micro_steps=[3, 1]` have"),
    ({"micro_steps": [3, 1], "batch_sizes": [4, 4], "global_batch_size": 8}, "makes (sum of b * k) 16 but"),
    ({"pipeline": 2}, "HeteroStrategy(pipeline=2): give a dict, e.g. `pipeline={'stages': 2, 'blocks': 'net'}`"),
    ({"pipeline": {"stages": 2, "blocks": "net", "stage": 2}}, "unknown keys ['stage']; the keys are ['stages',"),
    ({"pipeline": {"stages": 1, "blocks": "net"}}, "`stages` 1 must be an integer >= 2"),
    ({"pipeline": {"stages": 2}}, "`blocks` None must name the LightningModule's attribute that holds the chain"),
    ({"pipeline": {"stages": 2, "blocks": "net[0]"}}, "`blocks` 'net[0]' must name the LightningModule's attribute"),
    ({"pipeline": {"stages": 3, "blocks": "net", "boundaries": [4, 2]}}, "`boundaries` [4, 2] must be 2 increasing"),
    ({"pipeline": {"stages": 2, "blocks": "net", "boundaries": [0]}}, "`boundaries` [0] must be 1 increasing block"),
    ({"pipeline": {"stages": 2, "blocks": "net", "boundaries": 3}}, "`boundaries` 3 must be a list of 1 block"),
    (
        {"pipeline": {"stages": 2, "blocks": "net", "schedule": "zb"}},
        "`schedule` 'zb' must be one of ['1f1b', 'gpipe', 'interleaved']",
    ),
    (
        {"pipeline": {"stages": 2, "blocks": "net", "schedule": "interleaved", "virtual_stages": 1}},
        "`virtual_stages` 1 must be an integer from 2 to 32 with the interleaved schedule",
    ),
    (
        {"pipeline": {"stages": 2, "blocks": "net", "virtual_stages": 2}},
        "`virtual_stages` 2 goes with `schedule='interleaved'` only",
    ),
    (
        {"pipeline": {"stages": 2, "blocks": "net", "schedule": "interleaved", "micro_batches": 3}},
        "`micro_batches` 3 must be a multiple of `stages` 2 with the interleaved schedule",
    ),
    (
        {"pipeline": {"stages": 2, "blocks": "net", "schedule": "interleaved"}, "rebalance": True},
        "blocks do not move between the chunks of an interleaved pipeline yet",
    ),
    ({"shards": "memory"}, "HeteroStrategy(shards='memory', stage=None): memory-sized shards split the optimizer"),
    ({"shards": "memory", "stage": 3}, "ZeRO-3's parameter shards are DeepSpeed's, equal. Pass `stage=1` or `stage=2`"),
    ({"shards": "memory", "stage": 0, "sync": "diloco"}, "HeteroStrategy(sync=..., shards='memory'): local training"),
    ({"shards": "memory", "stage": 2, "compression": "fp16"}, "which `compression='fp16'` would change. Leave out"),
    ({"shards": "memory", "stage": 1, "compression": "powersgd"}, "HeteroStrategy(shards='memory', compression="),
    ({"shards": "memory", "stage": 1, "hierarchical": True}, "which `hierarchical=True` would change"),
    ({"shards": "memory", "stage": 1, "device_precision": "auto"}, "memory-sized shards train in 32-bit on every"),
    ({"shards": "memory", "stage": 2, "offload_optimizer": True}, "with `offload_optimizer`: memory-sized shards"),
    (
        {"shards": "memory", "stage": 1, "config": {"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}},
        "with a DeepSpeed config that sets `optimizer`: each rank's share is stepped by the torch optimizer",
    ),
    (
        {"shards": "memory", "stage": 1, "config": {"zero_optimization": {"stage": 2}}},
        "the DeepSpeed config sets zero_optimization.stage=2, but memory-sized shards are the package's own",
    ),
    ({"pipeline": {"stages": 2, "blocks": "net", "micro_batches": 0}}, "`micro_batches` 0 must be an integer >= 1"),
    ({"pipeline": {"stages": 2, "blocks": "net"}, "stage": 3}, "HeteroStrategy(pipeline=..., stage=3): not with a"),
    ({"pipeline": {"stages": 2, "blocks": "net"}, "batch_sizes": [4, 4]}, "(pipeline=..., batch_sizes=[4, 4]): not"),
    ({"pipeline": {"stages": 2, "blocks": "net"}, "sync": "diloco"}, "(pipeline=..., sync='diloco'): not with a"),
    ({"pipeline": {"stages": 2, "blocks": "net"}, "compression": "fp16"}, "(pipeline=..., compression='fp16')"),
    (
        {"pipeline": {"stages": 2, "blocks": "net"}, "config": {"zero_optimization": {"stage": 2}}},
        "a DeepSpeed config that sets `zero_optimization.stage=2`",
    ),
    (
        {"pipeline": {"stages": 2, "blocks": "net"}, "offload_optimizer": True},
        "a DeepSpeed config that sets `zero_optimization.offload_optimizer`",
    ),
]

DEEPSPEED_CONFIG = [
    ({"zero_optimisation": {"stage": 3}}, "`zero_optimisation` (did you mean `zero_optimization`?)"),
    ({"steps_per_prnt": 10}, "`steps_per_prnt` (did you mean `steps_per_print`?)"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "`zero_optimization.overlap_com` is not a DeepSpeed"),
    ({"fp16": {"enabled": True, "loss_scal": 0}}, "`fp16.loss_scal` is not a DeepSpeed setting (did you mean"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devic": "cpu"}}}, "`zero_optimization.offload_optim"),
    ({"zero_optimization": {"stage": 2.0}}, "`zero_optimization.stage=2.0` is not a ZeRO stage"),
    ({"zero_optimization": True}, "`zero_optimization=True`; it must be a dict"),
    ({"gradient_accumulation_steps": 2}, "`gradient_accumulation_steps=2`. Lightning's loop owns"),
    ({"train_micro_batch_size_per_gpu": 8}, "`train_micro_batch_size_per_gpu=8`, but HeteroStrategy gives"),
    ({"amp": {"enabled": True}}, "NVIDIA Apex AMP integration has been removed"),
    ({"gradient_clipping": "1.0"}, "`gradient_clipping='1.0'` (str) must be a number"),
    ({"wall_clock_breakdown": "yes"}, "`wall_clock_breakdown='yes'` (str) must be true or false"),
    ({"prescale_gradients": 1}, "`prescale_gradients=1` (int) must be true or false"),
]

ENVIRONMENT = [
    ("1.0,,0.4", f"`{ENV_VAR}='1.0,,0.4'` has an empty entry (position 1)"),
    ("1.0,abc", f"`{ENV_VAR}='1.0,abc'` is not a comma-separated list of numbers"),
    ("1.0,2", f"`{ENV_VAR}=[1.0, 2.0]` holds [2.0]"),
    (" , ", f"`{ENV_VAR}=','` is empty"),
]


@pytest.mark.parametrize(("kwargs", "message"), CONSTRUCTOR + [({"config": c}, m) for c, m in DEEPSPEED_CONFIG])
def test_constructor_and_deepspeed_config_mistakes_fail_in_the_constructor(kwargs, message):
    with pytest.raises(ValueError) as error:
        HeteroStrategy(**kwargs)
    assert message in str(error.value)


def test_a_config_dict_is_not_changed_by_the_strategy():
    config = {"gradient_clipping": 0.5}
    HeteroStrategy(config=config, stage=3)
    assert config == {"gradient_clipping": 0.5}


def test_emulated_speeds_given_twice_say_which_wins(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1.0,0.5")
    with pytest.warns(UserWarning, match=r"`emulate_speeds=\[1.0, 0.4\]` is given and .* the argument wins"):
        strategy = HeteroStrategy(emulate_speeds=[1.0, 0.4])
    assert strategy.settings.speed_schedule.at(0) == (1.0, 0.4)


@pytest.mark.parametrize(("value", "message"), ENVIRONMENT)
def test_environment_variable_mistakes_fail_in_the_constructor(value, message, monkeypatch):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError) as error:
        HeteroStrategy()
    assert message in str(error.value)


CLI_YAML = [
    ("{stage: 7}", "`stage=7` is not a ZeRO stage"),
    ("{weights: [1.0, -1.0]}", "`weights=[1.0, -1.0]` holds [-1.0]"),
    ("{loss_reduction: avg}", "`loss_reduction='avg'` is not one of"),
    ("{emulate_speeds: [1.0, 2.0]}", "`emulate_speeds=[1.0, 2.0]` holds [2.0]"),
    ("{config: {zero_optimisation: {stage: 3}}}", "did you mean `zero_optimization`?"),
    ("{batch_sizes: 8}", 'Parser key "batch_sizes"'),  # jsonargparse checks the annotated type first
    ("{micro_steps: [2, 0]}", "`micro_steps=[2, 0]` holds [0]"),
]


@pytest.mark.parametrize(("init_args", "message"), CLI_YAML)
def test_cli_yaml_mistakes_fail_before_any_process_starts(init_args, message, tmp_path, monkeypatch, capsys):
    from lightning_hetero.cli import main

    config = tmp_path / "bad.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  strategy:\n    class_path: lightning_hetero.HeteroStrategy\n"
        f"    init_args: {init_args}\nmodel:\n  class_path: examples.spirals.SpiralClassifier\n"
        "data:\n  class_path: examples.spirals.SpiralDataModule\n"
    )
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("sys.argv", ["lightning-hetero"])
    # jsonargparse exits on a value of the wrong type; our constructor's error reaches the user as raised.
    with pytest.raises((SystemExit, ValueError)) as stop:
        main(["fit", "--config", str(config)])
    if isinstance(stop.value, SystemExit):
        assert stop.value.code != 0
    assert message in str(stop.value) + capsys.readouterr().err


SETUP = [
    (["--batch-sizes", "4", "4", "8"], "`batch_sizes=[4, 4, 8]` has 3 entries but the job has 2 ranks"),
    (["--emulate-speeds", "1", "0.5", "0.5"], "has 3 entries but the job has 2 ranks. Give one speed per rank"),
    (["--global-batch-size", "1"], "`global_batch_size=1` is smaller than the world size 2"),
    (["--rank-1-strategy-args", '{"loss_reduction": "sum"}'], "loss_reduction (rank 0: mean, rank 1: sum)"),
    (
        ["--precision", "bf16-mixed", "--strategy-args", '{"device_precision": "auto"}'],
        "`Trainer(precision='bf16-mixed')` sets one precision for every rank, and"
        " `HeteroStrategy(device_precision='auto')` sets one per rank: drop one.",
    ),
    (
        ["--strategy-args", '{"device_precision": ["bf16-mixed", "32-true", "32-true"]}'],
        "has 3 entries but the job has 2 ranks. Give one precision per rank",
    ),
    (["--rank-1-strategy-args", '{"device_precision": "auto"}'], "device_precision (rank 0: None, rank 1: auto)"),
    (["--rank-1-strategy-args", '{"compression": "fp16"}'], "compression (rank 0: None, rank 1: fp16)"),
    (
        ["--strategy-args", '{"config": {"zero_optimization": {"stage": 3, "zero_quantized_weights": true}}}'],
        "`zero_optimization.zero_quantized_weights=True`, which needs CUDA",
    ),
    # (the automatic split: before profiling, which divided by the dataset's length)
    (["--samples", "0"], "The training loader gives no training step: its dataset (or sampler) is empty"),
    (["--samples", "1", "--batch-sizes", "4", "4"], "it has 1 sample, fewer than the 2 ranks, so no step"),
    (["--samples", "7", "--drop-last"], "it has 7 samples, fewer than the global batch of 16, and `drop_last=True`"),
    (
        ["--loss-reduction", "token_mean", "--model-reduction", "mean", "--batch-sizes", "8", "8"],
        "needs `training_step` to return the number of tokens its loss is the mean over",
    ),
    (
        ["--loss-reduction", "token_mean", "--model-reduction", "mean", "--manual"],
        "with manual optimization `training_step` runs its own backward",
    ),
    (
        ["--stage", "2", "--strategy-args", '{"sync": "diloco"}'],
        "`sync='diloco'` needs `stage=0`: ZeRO stage 2 shards the optimizer states",
    ),
    (
        ["--stage", "0", "--strategy-args", '{"sync": "local_sgd", "inner_steps": [2, 1, 1]}'],
        "`inner_steps=[2, 1, 1]` has 3 entries but the job has 2 ranks",
    ),
    (
        ["--stage", "0", "--accumulate", "2", "--strategy-args", '{"sync": "diloco"}'],
        "`Trainer(accumulate_grad_batches=2)` with `sync='diloco'`",
    ),
    (["--strategy-args", '{"micro_steps": [3, 1, 1]}'], "`micro_steps=[3, 1, 1]` has 3 entries but the job has 2"),
    (
        ["--stage", "3", "--strategy-args", '{"micro_steps": [3, 1]}'],
        "`micro_steps=[3, 1]` differ across ranks, which ZeRO stage 3 cannot run",
    ),
    (
        ["--loss-reduction", "token_mean", "--tokens", "--strategy-args", '{"micro_steps": [2, 1]}'],
        "`micro_steps=[2, 1]` with `loss_reduction='token_mean'`",
    ),
    (["--manual", "--strategy-args", '{"micro_steps": [2, 1]}'], "`micro_steps=[2, 1]` with manual optimization"),
    (
        ["--strategy-args", '{"micro_steps": [9, 1]}'],
        "`micro_steps=[9, 1]`: the automatic split gives rank 0 8 samples of the global batch of 16 ([8, 8]), fewer",
    ),
    (["--two-loaders", "--batch-sizes", "8", "8"], "The training data is a dict of 2 loaders (first, second)."),
    (
        ["--sync-batchnorm", "--batchnorm", "--strategy-args", '{"micro_steps": [2, 1]}'],
        "`micro_steps=[2, 1]` differ across ranks, and `Trainer(sync_batchnorm=True)` exchanges BatchNorm statistics",
    ),
    (
        ["--hidden-on-rank-1", "16", "--batch-sizes", "8", "8"],
        "the ranks' models differ: parameter `network.0.weight` has shape (8, 4) on rank 0, (16, 4) on rank 1",
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("args", "message"), SETUP)
def test_setup_mistakes_on_two_ranks_stop_every_process_with_the_message(args, message, tmp_path):
    started = time.monotonic()
    run = run_fit(tmp_path, *args, timeout=90)
    assert run.returncode != 0
    assert run.output.count(message) == 2, run.output[-3000:]  # said by both ranks
    assert time.monotonic() - started < 90
