"""Settings: the arguments checked once, the checks that need the job, and what the ranks must agree on."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from lightning_hetero.comm import topology
from lightning_hetero.settings import HeteroSettings, check_ranks_agree

DEFAULTS = dict(
    stage=None,
    global_batch_size=None,
    batch_sizes=None,
    weights=None,
    micro_steps=None,
    emulate_speeds=None,
    loss_reduction="mean",
    rebalance=None,
    rebalance_window=20,
    rebalance_threshold=0.05,
    peer_timeout=30.0,
    device_precision=None,
    compression_mode=None,
    compression_options=None,
    hierarchical="auto",
    max_nonfinite_steps=3,
)


def settings(**changes):
    return HeteroSettings.from_arguments(**{**DEFAULTS, **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"stage": 4}, "`stage=4` is not a ZeRO stage"),
        ({"loss_reduction": "avg"}, "`loss_reduction='avg'` is not one of"),
        ({"batch_sizes": [4, 0]}, "batch_sizes"),
        ({"rebalance_window": 0}, "rebalance_window"),
        ({"peer_timeout": float("nan")}, "peer_timeout"),
        ({"max_nonfinite_steps": 0}, "max_nonfinite_steps"),
        ({"device_precision": "fp8"}, "device_precision"),
        ({"compression_mode": "zip"}, "compression"),
        ({"hierarchical": "sometimes"}, "hierarchical"),
        ({"emulate_speeds": [1.0, 2.0]}, "emulate_speeds"),
        ({"micro_steps": [2, 0]}, r"`micro_steps=\[2, 0\]` holds \[0\]"),
        ({"micro_steps": [2.5, 1]}, "micro_steps"),
        ({"micro_steps": []}, "`micro_steps=\\[\\]` is empty"),
        ({"micro_steps": [2, 1], "batch_sizes": [4, 4, 4]}, "different lengths"),
        ({"micro_steps": [2, 1], "batch_sizes": [4, 4], "global_batch_size": 8}, r"makes \(sum of b \* k\) 12"),
    ],
)
def test_each_bad_argument_is_named_in_the_constructors_error(changes, message):
    with pytest.raises(ValueError, match=message):
        settings(**changes)


def test_the_checked_settings_keep_what_was_given_in_plain_types():
    checked = settings(batch_sizes=[3, 5], rebalance_window=10, peer_timeout=None, emulate_speeds=[1.0, 0.5])
    assert checked.batch_sizes == (3, 5) and checked.weights is None and not checked.split_is_automatic
    assert checked.rebalance_window == 10 and checked.peer_timeout is None
    assert checked.speed_schedule.at(0) == (1.0, 0.5)
    assert settings().split_is_automatic


@pytest.mark.parametrize(
    ("rebalance", "profiled", "world_size", "expected"),
    [
        (None, True, 2, True),
        (None, False, 2, False),
        (True, False, 2, True),
        (False, True, 2, False),
        (True, True, 1, False),
        (None, True, 1, False),
    ],
)
def test_re_planning_is_on_for_the_automatic_split_and_as_asked_otherwise_and_never_on_one_rank(
    rebalance, profiled, world_size, expected
):
    assert settings(rebalance=rebalance).rebalancing(profiled, world_size) is expected


def test_the_global_batch_is_the_argument_else_the_split_else_the_loaders_batch_per_rank():
    assert settings(global_batch_size=48).global_batch_size_for(None, 2) == 48
    assert settings(batch_sizes=[3, 13]).global_batch_size_for(None, 2) == 16
    assert settings().global_batch_size_for(DataLoader(list(range(40)), batch_size=8), 3) == 24
    with pytest.raises(ValueError, match="cannot infer the global batch.*got list"):
        settings().global_batch_size_for([[1, 2]], 2)


@pytest.mark.parametrize(
    ("changes", "world_size", "sync_batchnorm", "message"),
    [
        ({"batch_sizes": [4, 4, 4]}, 2, False, "batch_sizes"),
        ({"emulate_speeds": [1.0, 0.5, 0.5]}, 2, False, "has 3 entries but the job has 2 ranks"),
        ({"sync": "local_sgd"}, 2, True, r"sync_batchnorm=True\)` with `sync='local_sgd'`"),
        ({"micro_steps": [2, 1]}, 2, True, r"differ across ranks, and `Trainer\(sync_batchnorm=True\)`"),
        ({"device_precision": ["32-true"] * 3}, 2, False, "device_precision"),
    ],
)
def test_what_needs_the_world_size_is_checked_before_any_collective(changes, world_size, sync_batchnorm, message):
    config = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=message):
        settings(**changes).check_job(world_size, "cpu", config, sync_batchnorm, ("32-true", "Precision"))


def test_the_agreement_holds_every_argument_and_the_environment_and_differing_ranks_are_named(monkeypatch):
    monkeypatch.setenv("LIGHTNING_HETERO_EMULATE_NODES", "2")
    checked = settings(weights=[1.0, 0.5])
    agreement = checked.agreement(24, {"compression": None}, topology.emulated_topology())
    assert agreement["global_batch_size"] == 24 and agreement["weights"] == [1.0, 0.5]
    assert agreement["emulate_nodes"] == 2 and agreement["compression"] is None
    check_ranks_agree([agreement, dict(agreement)], [[("w", "float32")], [("w", "float32")]])
    with pytest.raises(ValueError, match="global_batch_size"):
        check_ranks_agree([agreement, {**agreement, "global_batch_size": 32}], [[], []])
