"""A data-parallel checkpoint read by parameter name for a pipeline (:mod:`lightning_hetero.recover.into_pipeline`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hetero.recover.into_pipeline import NAMES_KEY, data_parallel_state, optimizer_parameter_names
from lightning_hetero.recover.refusal import ResumeRefused


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    # Two groups, in an order that is not the module's: indices only mean something with the names beside them.
    optimizer = torch.optim.Adam(
        [{"params": [model[1].weight, model[0].bias]}, {"params": [model[0].weight, model[1].bias], "lr": 0.5}]
    )
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def zero_0_checkpoint(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Path:
    """What DeepSpeed writes at ZeRO-0 (the module, the client optimizer's state_dict, its own entries) beside
    Lightning's client state."""
    (directory / "checkpoint").mkdir(parents=True)
    (directory / "latest").write_text("checkpoint")
    states = {
        "module": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "ds_version": "0.19.8",
        "global_steps": 1,
        "epoch": 0,
        "global_step": 1,
        "loops": {"fit_loop": {}},
    }
    torch.save(states, directory / "checkpoint" / "mp_rank_00_model_states.pt")
    return directory


def test_a_zero_0_checkpoint_is_read_by_the_names_its_manifest_recorded(tmp_path):
    model, optimizer = model_and_optimizer()
    names = optimizer_parameter_names(model, optimizer)
    assert names == [["1.weight", "0.bias"], ["0.weight", "1.bias"]]
    chosen = zero_0_checkpoint(tmp_path, model, optimizer)
    weights, named, client = data_parallel_state(chosen, {"zero_stage": 0, NAMES_KEY: names}, None)
    assert weights.keys() == model.state_dict().keys()
    for name, parameter in model.named_parameters():
        assert torch.equal(named["state"][name]["exp_avg"], optimizer.state[parameter]["exp_avg"])
    assert [group["params"] for group in named["param_groups"]] == names
    assert [group["lr"] for group in named["param_groups"]] == [0.001, 0.5]
    assert client == {"epoch": 0, "global_step": 1, "loops": {"fit_loop": {}}}  # (DeepSpeed's own entries left out)


def test_a_zero_0_checkpoint_without_names_or_with_other_counts_is_refused_with_what_to_do(tmp_path):
    model, optimizer = model_and_optimizer()
    chosen = zero_0_checkpoint(tmp_path, model, optimizer)
    with pytest.raises(ResumeRefused, match="records no names .* Resume it once without `pipeline` and save again"):
        data_parallel_state(chosen, {"zero_stage": 0}, None)
    with pytest.raises(ResumeRefused, match=r"\[1, 2\] per group.*\[2, 2\].*altered"):
        data_parallel_state(chosen, {"zero_stage": 0, NAMES_KEY: [["1.weight"], ["0.weight", "1.bias"]]}, None)


def test_deepspeed_s_own_fp16_optimizer_state_is_refused(tmp_path):
    model, optimizer = model_and_optimizer()
    chosen = zero_0_checkpoint(tmp_path, model, optimizer)
    path = chosen / "checkpoint" / "mp_rank_00_model_states.pt"
    states = torch.load(path)
    states["optimizer"] = {"optimizer_state_dict": states["optimizer"], "loss_scaler": 1.0}
    torch.save(states, path)
    with pytest.raises(ResumeRefused, match="DeepSpeed's own fp16/bf16 optimizer"):
        data_parallel_state(chosen, {"zero_stage": 0, NAMES_KEY: [["a"]]}, None)


def test_an_optimizer_over_parameters_outside_the_module_records_no_names():
    model, _ = model_and_optimizer()
    stranger = nn.Parameter(torch.zeros(2))
    assert optimizer_parameter_names(model, torch.optim.SGD([stranger, *model.parameters()], lr=0.1)) is None
    assert optimizer_parameter_names(model, None) is None


def test_a_zero_2_checkpoint_whose_optimizer_state_is_not_per_parameter_is_refused_with_what_to_do(
    tmp_path, monkeypatch
):
    """NAdam's `mu_product` has no per-element meaning: a pipeline cannot take its state by name. The refusal says to
    resume without `pipeline` (not "on as many ranks", the other-world-size advice)."""
    from lightning_hetero.recover import universal
    from lightning_hetero.recover.into_pipeline import check_readable_by_name

    (tmp_path / "latest").write_text("checkpoint")
    groups = [universal.StateKeys(("exp_avg", "exp_avg_sq"), True, ("'mu_product' (a number that is not the step)",))]
    monkeypatch.setattr(universal, "state_keys", lambda tag, in_full=False: groups)
    with pytest.raises(ResumeRefused, match=r"ZeRO-2\) cannot continue as a pipeline.*NAdam.*mu_product.*without"):
        check_readable_by_name(tmp_path, {"zero_stage": 2, "optimizer": "NAdam"})
    monkeypatch.setattr(
        universal, "state_keys", lambda tag, in_full=False: [universal.StateKeys(("exp_avg",), True, ())]
    )
    check_readable_by_name(tmp_path, {"zero_stage": 2, "optimizer": "Adam"})


def test_a_checkpoint_of_memory_sized_shards_is_read_from_every_rank_s_shard_file(tmp_path):
    """DeepSpeed's file holds rank 0's share alone; the state comes from each rank's file, by name."""
    from lightning_hetero.recover import by_name

    model, optimizer = model_and_optimizer()
    everything = by_name.named_optimizer_state(model, optimizer)
    owners = {"1.weight": 0, "0.bias": 0, "0.weight": 1, "1.bias": 1}
    chosen = zero_0_checkpoint(tmp_path, model, torch.optim.Adam(model.parameters()))  # (DeepSpeed's: no state)
    for rank in (0, 1):
        share = {name: value for name, value in everything["state"].items() if owners[name] == rank}
        torch.save(
            {"optimizer": {"state": share, "param_groups": everything["param_groups"]}},
            chosen / by_name.SHARD_FILE.format(rank=rank),
        )
    manifest = {"zero_stage": 0, by_name.SHARDS_KEY: {"ranks": [0, 1]}}
    _, named, _ = data_parallel_state(chosen, manifest, None)
    for name, parameter in model.named_parameters():
        assert torch.equal(named["state"][name]["exp_avg"], optimizer.state[parameter]["exp_avg"])
    (chosen / by_name.SHARD_FILE.format(rank=1)).unlink()
    with pytest.raises(ResumeRefused, match="holds no optimizer_shard_rank1.pt"):
        data_parallel_state(chosen, manifest, None)
