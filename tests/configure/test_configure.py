"""Unit tests for configure/deepspeed_config.py: per-rank DeepSpeed configs and the check that shared settings agree."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from lightning_hetero.configure.deepspeed_config import (
    PER_RANK_KEYS,
    check_user_config,
    config_disagreements,
    config_fingerprint,
    default_config_stage,
    disagreement_message,
    format_plan_table,
    lightning_owns_accumulation,
    logging_batch_size_note,
    rank_config,
    shared_settings,
    user_config_stage,
)

BASE = {
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "offload_optimizer": {"device": "cpu"}},
    "bf16": {"enabled": True},
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}},
}

# ---------------------------------------------------------------------------------------------- check_user_config


@pytest.mark.parametrize(
    ("config", "mentions"),
    [
        ({"gradient_accumulation_steps": 4}, ["gradient_accumulation_steps=4", "accumulate_grad_batches"]),
        ({"managed_gradient_accumulation": True}, ["managed_gradient_accumulation=True", "accumulate_grad_batches"]),
        ({"train_batch_size": 64}, ["train_batch_size=64", "batch_sizes"]),
        ({"train_micro_batch_size_per_gpu": 8}, ["train_micro_batch_size_per_gpu=8", "batch_sizes"]),
        ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage=4", "0, 1, 2 or 3"]),
        ({"zero_optimization": {"stage": -1}}, ["zero_optimization.stage=-1"]),
        ({"zero_optimization": {"stage": "2"}}, ["zero_optimization.stage='2'"]),
        ({"zero_optimization": {"stage": True}}, ["zero_optimization.stage=True"]),
        ({"zero_optimization": True}, ["zero_optimization=True"]),
        ({"zero_optimization": None}, ["zero_optimization=None"]),
    ],
)
def test_check_user_config_rejects_owned_keys_and_bad_stage(config, mentions):
    with pytest.raises(ValueError) as info:
        check_user_config({**BASE, **config})
    for part in mentions:
        assert part in str(info.value)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_check_user_config_accepts_valid_configs(stage):
    assert check_user_config({**BASE, "zero_optimization": {"stage": stage}}) is None
    assert check_user_config({}) is None  # no zero section: stage 0
    assert check_user_config({"zero_optimization": {}}) is None  # no stage: DeepSpeed's default


@pytest.mark.parametrize(
    ("config_stage", "stage_argument", "stage", "warns"),
    [
        (None, None, 0, False),  # no stage in the config: ZeRO-0, as DeepSpeed and DeepSpeedStrategy read it
        (None, 3, 3, False),  # the argument fills in what the config leaves unset
        (None, 0, 0, False),
        (2, None, 2, False),  # the config's stage wins
        (1, 1, 1, False),
        (3, 1, 3, True),  # ... and says so when the argument differs
        (0, 2, 0, True),
    ],
)
def test_a_user_configs_stage_keeps_the_meaning_deepspeed_gives_it(config_stage, stage_argument, stage, warns):
    settled, warning = user_config_stage(config_stage, stage_argument)
    assert settled == stage
    assert (warning is not None) == warns
    if warns:
        assert f"`zero_optimization.stage={config_stage}` wins over `stage={stage_argument}`" in warning


@pytest.mark.parametrize(
    ("stage", "arguments", "expected", "left"),
    [
        (None, {}, None, {}),
        (3, {"zero_optimization": True, "offload_optimizer": True}, 3, {"offload_optimizer": True}),
        (None, {"zero_optimization": False}, 0, {}),  # DeepSpeedStrategy's "ZeRO off"
        (0, {"zero_optimization": False}, 0, {}),
        (2, {"logging_batch_size_per_gpu": "auto"}, 2, {"logging_batch_size_per_gpu": "auto"}),
    ],
)
def test_deepspeedstrategys_zero_switch_is_zero_0_for_the_default_config(stage, arguments, expected, left):
    assert default_config_stage(stage, arguments) == expected
    assert arguments == left  # the switch is consumed: the default config is built at the stage returned


@pytest.mark.parametrize(
    ("stage", "arguments", "message"),
    [
        (3, {"zero_optimization": False}, "`zero_optimization=False` turns ZeRO off, but `stage=3` asks for ZeRO-3"),
        (None, {"zero_optimization": "no"}, "`zero_optimization='no'` must be True or False"),
    ],
)
def test_deepspeedstrategy_arguments_the_strategy_cannot_honour_are_refused_by_name(stage, arguments, message):
    with pytest.raises(ValueError) as error:
        default_config_stage(stage, arguments)
    assert message in str(error.value)


def test_a_fixed_logging_batch_size_is_accepted_and_said_to_be_unused():
    """DeepSpeedStrategy gives `logging_batch_size_per_gpu` to DeepSpeed's throughput logging as every rank's
    micro-batch; here each rank's is its own. It was refused (issue 51, item 3); now it is accepted and said."""
    assert (
        logging_batch_size_note({}) is None and logging_batch_size_note({"logging_batch_size_per_gpu": "auto"}) is None
    )
    note = logging_batch_size_note({"logging_batch_size_per_gpu": 10})
    assert note is not None and "`logging_batch_size_per_gpu=10` is not used" in note
    assert "each rank's micro-batch is its own" in note


def test_offload_switched_off_with_false_is_read_as_no_offload_and_the_users_dict_keeps_it():
    """Lightning's own test config writes `offload_optimizer: false` for "no offload"; DeepSpeed's schema takes a dict
    or nothing. It was refused in the constructor (issue 51, item 3); now it is checked and handed to DeepSpeed as no
    offload, and the user's dict is left as written."""
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": False, "offload_param": False}}
    check_user_config(config)
    assert config["zero_optimization"]["offload_optimizer"] is False
    assert rank_config(config, 4)["zero_optimization"] == {"stage": 2}
    on = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert rank_config(on, 4)["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    with pytest.raises(ValueError, match="offload_optimizer=True"):
        check_user_config({"zero_optimization": {"stage": 2, "offload_optimizer": True}})


# ---------------------------------------------------------------------------------------------- rank_config


def test_rank_config_sets_micro_batch_drops_train_batch_and_copies():
    config = {**copy.deepcopy(BASE), "train_batch_size": 99, "train_micro_batch_size_per_gpu": 1}
    before = copy.deepcopy(config)
    result = rank_config(config, 24)
    assert result["train_micro_batch_size_per_gpu"] == 24
    assert type(result["train_micro_batch_size_per_gpu"]) is int
    assert "train_batch_size" not in result
    assert config == before  # the input is untouched
    # A deep copy: editing the result's nested sections does not reach the caller's config.
    result["zero_optimization"]["stage"] = 3
    result["optimizer"]["params"]["betas"].append(0.5)
    assert config == before
    # Every other setting is carried over; accumulation is left to Lightning.
    carried = {k: v for k, v in rank_config(BASE, 8).items() if k not in PER_RANK_KEYS}
    assert carried == lightning_owns_accumulation(BASE)


@pytest.mark.parametrize(
    ("stage", "managed", "overlap_comm"), [(0, False, False), (1, False, False), (2, False, True), (3, True, True)]
)
def test_lightning_owns_accumulation_per_stage(stage, managed, overlap_comm):
    """One DeepSpeed micro-step per optimizer update; ZeRO 0-2 reduce in step() (DeepSpeed's unmanaged mode, which
    allows overlap_comm with ZeRO-2 only); ZeRO-3 stays managed and keeps overlap_comm."""
    config = {"zero_optimization": {"stage": stage, "overlap_comm": True}, "gradient_clipping": 1.0}
    result = lightning_owns_accumulation(config)
    assert result["gradient_accumulation_steps"] == 1
    assert result.get("managed_gradient_accumulation", True) is managed
    assert result["zero_optimization"]["overlap_comm"] is overlap_comm
    assert result["gradient_clipping"] == 1.0
    assert config["zero_optimization"]["overlap_comm"] is True  # the input is untouched
    # No zero section at all is stage 0.
    assert lightning_owns_accumulation({})["managed_gradient_accumulation"] is False


# ---------------------------------------------------------------------------------------------- disagreements


def test_config_disagreements_none_when_only_per_rank_keys_differ():
    configs = [rank_config(BASE, 8), rank_config(BASE, 24), {**rank_config(BASE, 3), "train_batch_size": 12}]
    assert config_disagreements(configs) == []
    assert len({config_fingerprint(c) for c in configs}) == 1
    assert "train_micro_batch_size_per_gpu" not in shared_settings(configs[0])
    assert shared_settings(configs[0]) == lightning_owns_accumulation(BASE)


def test_config_disagreements_finds_nested_differences():
    other = copy.deepcopy(BASE)
    other["bf16"]["enabled"] = False
    other["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    lines = config_disagreements([rank_config(BASE, 8), rank_config(other, 24)])
    assert len(lines) == 2
    assert lines[0].startswith("bf16.enabled") and "rank 0: True" in lines[0] and "rank 1: False" in lines[0]
    assert lines[1].startswith("zero_optimization.offload_optimizer.device")
    assert "rank 0: cpu" in lines[1] and "rank 1: nvme" in lines[1]
    assert config_fingerprint(rank_config(BASE, 8)) != config_fingerprint(rank_config(other, 8))


def test_config_disagreements_reports_keys_missing_on_some_ranks():
    missing = copy.deepcopy(BASE)
    del missing["gradient_clipping"]
    del missing["bf16"]
    lines = config_disagreements([BASE, BASE, missing])
    assert lines == [
        "bf16.enabled (rank 0: True, rank 1: True, rank 2: <unset>)",
        "gradient_clipping (rank 0: 1.0, rank 1: 1.0, rank 2: <unset>)",
    ]


def test_config_disagreements_single_rank_and_equal_lists():
    assert config_disagreements([BASE]) == []
    changed = copy.deepcopy(BASE)
    changed["optimizer"]["params"]["betas"] = [0.9, 0.95]
    lines = config_disagreements([BASE, changed])
    assert lines == ["optimizer.params.betas (rank 0: [0.9, 0.999], rank 1: [0.9, 0.95])"]


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c["bf16"].update(enabled=False),
        lambda c: c.update(fp16={"enabled": True}),
        lambda c: c.update(communication_data_type="fp32"),
        lambda c: c.update(torch_autocast={"enabled": True}),
    ],
)
def test_disagreement_message_warns_about_precision(change):
    other = copy.deepcopy(BASE)
    change(other)
    lines = config_disagreements([BASE, other])
    assert lines
    message = disagreement_message(lines)
    assert "fp16/bf16" in message and "silently wrong" in message
    for line in lines:
        assert line in message


def test_disagreement_message_without_precision_keys():
    other = copy.deepcopy(BASE)
    other["gradient_clipping"] = 0.5
    other["zero_optimization"]["reduce_bucket_size"] = 1e8
    lines = config_disagreements([BASE, other])
    message = disagreement_message(lines)
    assert "silently wrong" not in message
    assert "gradient_clipping (rank 0: 1.0, rank 1: 0.5)" in message
    assert "zero_optimization.reduce_bucket_size" in message
    assert "same strategy arguments" in message


def test_disagreement_message_not_fooled_by_precision_words_in_values():
    # A value mentioning "bf16" (or a dotted value) on a non-precision key is not a precision disagreement.
    lines = config_disagreements([{"comment": "bf16 run"}, {"comment": "fp16.run"}])
    assert "silently wrong" not in disagreement_message(lines)


def test_config_fingerprint_is_order_independent():
    reordered = dict(reversed(list(BASE.items())))
    assert config_fingerprint(BASE) == config_fingerprint(reordered)
    assert json.loads(config_fingerprint({**BASE, "train_micro_batch_size_per_gpu": 3})) == json.loads(json.dumps(BASE))


# ---------------------------------------------------------------------------------------------- format_plan_table


def test_format_plan_table_aligns_columns():
    columns = [("rank", "rank"), ("device", "device"), ("micro_batch", "micro-batch"), ("share", "share")]
    rows = [
        {"rank": 0, "device": "cuda:0 NVIDIA H100 80GB HBM3", "micro_batch": 48, "share": "75.0%"},
        {"rank": 1, "device": "cpu (2 threads)", "micro_batch": 16, "share": "25.0%"},
        {"rank": 10, "device": "x", "micro_batch": 1234567, "share": ""},
    ]
    table = format_plan_table(rows, columns)
    lines = table.split("\n")
    assert len(lines) == 2 + len(rows)
    header, rule, body = lines[0], lines[1], lines[2:]
    starts = [header.index(heading) for _, heading in columns]
    assert starts == sorted(starts) and starts[0] == 0
    # The rule has one dash run per column, starting where the column starts.
    assert [i for i, ch in enumerate(rule) if ch == "-" and (i == 0 or rule[i - 1] == " ")] == starts
    for row, line in zip(rows, body):
        for (key, _), start in zip(columns, starts):
            assert line[start:].startswith(str(row[key]))
            if str(row[key]):
                assert start == 0 or line[start - 2 : start] == "  "  # two spaces at least before every column
    # Each column is as wide as its widest cell, and no line has trailing blanks.
    assert rule.split("  ") == ["-" * 4, "-" * len(rows[0]["device"]), "-" * len("micro-batch"), "-" * len("share")]
    assert all(line == line.rstrip() for line in lines)


def test_format_plan_table_missing_keys_and_no_rows():
    table = format_plan_table([{"a": 1}], [("a", "A"), ("b", "B")])
    assert table.split("\n") == ["A  B", "-  -", "1"]
    assert format_plan_table([], [("a", "alpha")]).split("\n") == ["alpha", "-----"]


def test_model_signatures_name_the_first_difference_between_ranks():
    from torch import nn

    from lightning_hetero.configure.model_agreement import model_disagreement, model_signature

    def model(width=8, frozen=False, dtype=None, extra=False):
        network = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 1))
        if dtype is not None:
            network[2].to(dtype)
        network[0].bias.requires_grad_(not frozen)
        if extra:
            network.append(nn.Linear(1, 1))
        return model_signature(network)

    same = model()
    assert model_disagreement([same, model(), model()]) is None
    assert "parameter `0.weight` has shape (8, 4) on rank 0, (16, 4) on rank 2" in model_disagreement(
        [same, same, model(width=16)]
    )
    assert "parameter `0.bias` has requires_grad True on rank 0, False on rank 1" in model_disagreement(
        [same, model(frozen=True)]
    )
    assert "parameter `2.weight` has dtype 'torch.float32' on rank 0, 'torch.float64' on rank 1" in (
        model_disagreement([same, model(dtype=torch.float64)])
    )
    assert "rank 1 has parameter `3.weight`, which rank 0 lacks" in model_disagreement([same, model(extra=True)])
    assert "rank 0 has parameter `3.weight`, which rank 1 lacks" in model_disagreement([model(extra=True), same])
    swapped = [same[1], same[0], *same[2:]]
    assert "another order: position 0 is parameter `0.weight` on rank 0, parameter `0.bias` on rank 1" in (
        model_disagreement([same, swapped])
    )
    # Buffers count too (the strategy keeps them in step across ranks).
    assert model_signature(nn.BatchNorm1d(3))[-1] == ("buffer", "num_batches_tracked", (), "torch.int64", False)


def test_deepspeeds_gpu_minded_zero_defaults_give_way_on_cpu_unless_the_user_chose_them():
    from lightning_hetero import HeteroStrategy
    from lightning_hetero.configure.deepspeed_config import with_cpu_zero_settings

    config = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True}}
    assert with_cpu_zero_settings(config)["zero_optimization"] == {
        "stage": 2,
        "contiguous_gradients": False,
        "overlap_comm": False,
    }
    assert config["zero_optimization"]["overlap_comm"] is True  # a copy
    assert HeteroStrategy()._cpu_zero_defaults
    assert not HeteroStrategy(contiguous_gradients=True)._cpu_zero_defaults
    assert not HeteroStrategy(config={"zero_optimization": {"stage": 2}})._cpu_zero_defaults
