"""A ZeRO checkpoint's optimizer state, cut per parameter for another number of ranks (lightning_hetero/recover/
universal.py): which state entries are per parameter, where each parameter lies in the ranks' flat partitions, the
files written, and the refusal with what to do. The conversion's numbers against uninterrupted runs are in
test_elastic.py."""

from __future__ import annotations

import argparse
import math
import random
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from lightning_hetero.recover import elastic, universal
from lightning_hetero.recover.refusal import EXIT_CODE_WILL_FAIL_AGAIN, ResumeRefused
from lightning_hetero.runtime.shutdown import requested_exit_code

FragmentAddress = namedtuple("fragment_address", ["numel", "start"])  # DeepSpeed's (deepspeed.utils.tensor_fragment)

# What each torch optimizer keeps for one flat parameter of 10 elements, after two steps, as DeepSpeed's ZeRO optimizer
# keeps it for a rank's flat partition: (per-parameter keys, a step, the refused keys).
OPTIMIZER_STATES = {
    ("SGD", (("momentum", 0.9),)): (("momentum_buffer",), False, ()),
    ("SGD", ()): ((), False, ()),  # no momentum: no state
    ("Adam", ()): (("exp_avg", "exp_avg_sq"), True, ()),
    ("AdamW", (("amsgrad", True),)): (("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), True, ()),
    ("Adamax", ()): (("exp_avg", "exp_inf"), True, ()),
    ("RAdam", ()): (("exp_avg", "exp_avg_sq"), True, ()),
    ("Adadelta", ()): (("square_avg", "acc_delta"), True, ()),
    ("Adagrad", ()): (("sum",), True, ()),
    ("RMSprop", (("momentum", 0.5), ("centered", True))): (("square_avg", "momentum_buffer", "grad_avg"), True, ()),
    ("Rprop", ()): (("prev", "step_size"), True, ()),
    ("Adafactor", ()): (("variance",), True, ()),  # a flat partition is a vector: one variance per element
    ("NAdam", ()): (("exp_avg", "exp_avg_sq"), True, ("'mu_product' (a number that is not the step)",)),
    ("ASGD", ()): (("ax",), True, ("'eta' (a number that is not the step)", "'mu' (a number that is not the step)")),
}


@pytest.mark.parametrize(("name", "options"), list(OPTIMIZER_STATES), ids=lambda x: str(x))
def test_which_entries_of_each_torch_optimizers_state_are_per_parameter(name, options):
    parameter = torch.nn.Parameter(torch.randn(10))
    optimizer = getattr(torch.optim, name)([parameter], lr=0.1, **dict(options))
    for _ in range(2):
        (parameter**2).sum().backward()
        optimizer.step()
    keys = universal.classify_state(optimizer.state[parameter], 10)
    assert (keys.per_parameter, keys.step, keys.refused) == OPTIMIZER_STATES[(name, options)]


def test_lbfgs_history_is_refused_entry_by_entry():
    parameter = torch.nn.Parameter(torch.randn(10))
    optimizer = torch.optim.LBFGS([parameter], lr=0.1)

    def closure():
        optimizer.zero_grad()
        loss = (parameter**2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    keys = universal.classify_state(optimizer.state[parameter], 10)
    refused = " ".join(keys.refused)
    for entry in ("'old_dirs' (a list of", "'ro' (a list of", "'n_iter' (a number that is not the step)", "'H_diag'"):
        assert entry in refused
    assert not keys.step  # LBFGS counts `n_iter`, not a `step`


def test_a_state_entry_is_per_parameter_only_when_shaped_like_the_flat_partition():
    state = {
        "momentum_buffer": torch.zeros(12),
        "other_shape": torch.zeros(3, 4),  # 12 elements, not one per element of the flat partition
        "shorter": torch.zeros(11),
        "step": torch.tensor(3.0),
        "fp32": torch.zeros(12),  # would overwrite DeepSpeed's master weights in the universal layout
        "none": None,
    }
    keys = universal.classify_state(state, 12)
    assert keys.per_parameter == ("momentum_buffer",)
    assert keys.step
    assert keys.refused == (
        "'other_shape' (a tensor of shape (3, 4), not one value per parameter element (12))",
        "'shorter' (a tensor of shape (11,), not one value per parameter element (12))",
        "'fp32' (a name the universal layout cannot hold)",
        "'none' (a NoneType)",
    )
    assert universal.classify_state({"step": 7}, 5) == universal.StateKeys((), True, ())
    assert universal.classify_state({"step": [1, 2]}, 5).refused == ("'step' (a list of 2 entries)",)


def test_the_refusal_names_the_checkpoint_the_optimizer_its_state_and_what_to_do(tmp_path):
    groups = [universal.StateKeys(("exp_avg",), True, ("'mu_product' (a number that is not the step)",))] * 2
    message = universal.refusal(tmp_path / "last.ckpt", "NAdam", 2, 2, 1, groups)
    assert message.startswith(f"Checkpoint {tmp_path / 'last.ckpt'} was saved by 2 ranks with ZeRO-2; this job has 1.")
    said = "the NAdam optimizer keeps state that is not per parameter: 'mu_product' (a number that is not the step)."
    assert said in message
    assert message.count("mu_product") == 1  # once, however many groups hold it
    assert "Resume on 2 ranks; or, where the number of ranks may change, train with ZeRO-0" in message
    assert universal.refusal(tmp_path, "SGD", 2, 2, 1, [universal.StateKeys(("momentum_buffer",), False, ())]) is None


# ----------------------------------------------------------------------------- where a parameter lies in the partitions


def zero12_layout(shapes, world_size, alignment=2):
    """DeepSpeed's ZeRO-1/2 layout of one parameter group (stage_1_and_2.py): the parameters flattened into one vector,
    padded to a multiple of ``world_size * alignment``, split evenly by rank; each rank's ``param_slice_mappings`` entry
    for the group. Returns (the full parameters, each rank's flat partition, each rank's mapping)."""
    generator = torch.Generator().manual_seed(sum(math.prod(s) for s in shapes) + world_size)
    full = {f"p{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}
    flat = torch.cat([t.flatten() for t in full.values()])
    padded = math.ceil(flat.numel() / (world_size * alignment)) * world_size * alignment
    flat = torch.cat([flat, torch.full((padded - flat.numel(),), float("nan"))])  # padding: never read
    per_rank = padded // world_size
    mappings, begin = [{} for _ in range(world_size)], 0
    for name, tensor in full.items():
        end = begin + tensor.numel()
        for rank in range(world_size):
            low, high = max(begin, rank * per_rank), min(end, (rank + 1) * per_rank)
            if low < high:
                mappings[rank][name] = FragmentAddress(numel=high - low, start=low - rank * per_rank)
        begin = end
    return full, list(flat.split(per_rank)), mappings


def zero3_layout(shapes, world_size):
    """DeepSpeed's ZeRO-3 layout of one sub-group: each parameter partitioned by itself, ceil(numel / ranks) elements
    per rank, the last rank's piece padded; a rank's flat partition is its piece of each parameter in order."""
    generator = torch.Generator().manual_seed(sum(math.prod(s) for s in shapes) * 7 + world_size)
    full = {f"p{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}
    flats = [[] for _ in range(world_size)]
    for tensor in full.values():
        per_rank = math.ceil(tensor.numel() / world_size)
        padded = torch.cat([tensor.flatten(), torch.full((per_rank * world_size - tensor.numel(),), float("nan"))])
        for rank in range(world_size):
            flats[rank].append(padded[rank * per_rank : (rank + 1) * per_rank])
    return full, [torch.cat(pieces) for pieces in flats]


def random_shapes(rng):
    return [tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_zero12_partitions_put_together_give_back_every_parameter(world_size):
    rng = random.Random(world_size)
    for _ in range(20):
        shapes = random_shapes(rng)
        full, flats, mappings = zero12_layout(shapes, world_size)
        pieces = universal.zero12_pieces(mappings)
        assert list(pieces) == list(full)
        for name, tensor in full.items():
            assert torch.equal(universal.assemble(name, pieces[name], flats, tensor.shape), tensor)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_zero3_partitions_put_together_give_back_every_parameter(world_size):
    rng = random.Random(world_size)
    for _ in range(20):
        shapes = random_shapes(rng)
        full, flats = zero3_layout(shapes, world_size)
        pieces = universal.zero3_pieces(list(zip(full, shapes)), world_size)
        for name, tensor in full.items():
            assert torch.equal(universal.assemble(name, pieces[name], flats, tensor.shape), tensor)


def test_the_pieces_of_the_tests_two_rank_model_as_deepspeed_saved_them():
    """Read from the 2-rank checkpoints of the tests' model (Linear(4, 8), Tanh, Linear(8, 1): 49 parameters)."""
    shapes = [
        ("network.0.weight", (8, 4)),
        ("network.0.bias", (8,)),
        ("network.2.weight", (1, 8)),
        ("network.2.bias", (1,)),
    ]
    # ZeRO-3: 16 + 4 + 4 + 1 = 25 elements per rank; the 1-element bias on rank 0 only (rank 1 holds its padding).
    assert universal.zero3_pieces(shapes, 2) == {
        "network.0.weight": [(0, 0, 16), (1, 0, 16)],
        "network.0.bias": [(0, 16, 4), (1, 16, 4)],
        "network.2.weight": [(0, 20, 4), (1, 20, 4)],
        "network.2.bias": [(0, 24, 1)],
    }
    # ZeRO-1/2: 49 elements padded to 52, 26 per rank (DeepSpeed's param_slice_mappings, as saved).
    mappings = [
        {"network.0.weight": FragmentAddress(26, 0)},
        {
            "network.0.weight": FragmentAddress(6, 0),
            "network.0.bias": FragmentAddress(8, 6),
            "network.2.weight": FragmentAddress(8, 14),
            "network.2.bias": FragmentAddress(1, 22),
        },
    ]
    assert universal.zero12_pieces(mappings) == {
        "network.0.weight": [(0, 0, 26), (1, 0, 6)],
        "network.0.bias": [(1, 6, 8)],
        "network.2.weight": [(1, 14, 8)],
        "network.2.bias": [(1, 22, 1)],
    }


def test_pieces_that_do_not_hold_the_parameter_are_an_error_naming_it():
    flats = [torch.zeros(4), torch.zeros(4)]
    with pytest.raises(ValueError, match=r"do not hold parameter w of shape \(2, 3\) \(6 elements\).*hold 5"):
        universal.assemble("w", [(0, 0, 4), (1, 0, 1)], flats, (2, 3))
    with pytest.raises(ValueError, match="do not hold parameter w"):
        universal.assemble("w", [(0, 2, 4), (1, 0, 2)], flats, (2, 3))  # past the end of rank 0's partition


# ------------------------------------------------------------------------------ the files


def write_zero_checkpoint(tag, stage, world_size, state_for_rank, shapes):
    """A ZeRO checkpoint tag folder as DeepSpeed 0.19.8 writes one (the entries the conversion reads), for one parameter
    group whose parameters have ``shapes``; ``state_for_rank(flat_like)`` is a rank's optimizer state."""
    from deepspeed.checkpoint import constants as c
    from deepspeed.utils.tensor_fragment import fragment_address

    tag.mkdir(parents=True)
    names = [f"layer.{i}" for i in range(len(shapes))]
    if stage <= 2:
        full, flats, mappings = zero12_layout(shapes, world_size)
    else:
        full, flats = zero3_layout(shapes, world_size)
    full = dict(zip(names, full.values()))
    param_shapes = [dict(zip(names, (torch.Size(s) for s in shapes)))]
    model_states = {c.PARAM_SHAPES: param_shapes, "module": {n: t for n, t in full.items()} if stage <= 2 else {}}
    model_file = "mp_rank_00_model_states.pt" if stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save(model_states, tag / model_file)
    for rank in range(world_size):
        flat = flats[rank]
        state = state_for_rank(flat)
        groups = [{"lr": 0.5, "momentum": 0.9, "params": [0]}]
        if stage <= 2:
            last = rank == world_size - 1
            padding = int(torch.isnan(flat).sum()) if last else 0
            optimizer = {
                c.BASE_OPTIMIZER_STATE: {"state": {0: state}, c.PARAM_GROUPS: groups},
                c.SINGLE_PARTITION_OF_FP32_GROUPS: [flat[: flat.numel() - padding]],
                c.GROUP_PADDINGS: [padding],
                c.ZERO_STAGE: stage,
                c.PARAM_SLICE_MAPPINGS: [
                    {names[int(k[1:])]: fragment_address(v.numel, v.start) for k, v in mappings[rank].items()}
                ],
                "loss_scaler": "scaler",
                "ds_version": "0.19.8",
            }
        else:
            optimizer = {
                c.OPTIMIZER_STATE_DICT: {"state": {0: state}, c.PARAM_GROUPS: groups},
                c.FP32_FLAT_GROUPS: [flat],
                c.ZERO_STAGE: stage,
                "partition_count": world_size,
                "loss_scaler": "scaler",
            }
        torch.save({c.OPTIMIZER_STATE_DICT: optimizer}, tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return full


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_three_rank_checkpoint_is_written_in_deepspeeds_universal_layout_with_every_state(stage, tmp_path):
    shapes = [(5, 3), (5,), (2, 5), (1,)]
    # Every state is a known function of the weights, so each can be checked where it lands.
    full = write_zero_checkpoint(
        tmp_path / "ckpt" / "tag",
        stage,
        3,
        lambda flat: {"momentum_buffer": 2 * flat, "sum": -flat, "step": torch.tensor(4.0)},
        shapes,
    )
    out = tmp_path / "universal" / "tag"
    universal.convert(tmp_path / "ckpt" / "tag", out)
    assert (tmp_path / "universal" / "latest_universal").read_text() == "tag"
    for name, weights in full.items():
        folder = out / "zero" / name
        assert sorted(p.name for p in folder.iterdir()) == ["fp32.pt", "momentum_buffer.pt", "step.pt", "sum.pt"]
        for key, factor in (("fp32", 1), ("momentum_buffer", 2), ("sum", -1)):
            saved = torch.load(folder / f"{key}.pt", weights_only=False)
            assert saved["cat_dim"] == 0 and torch.equal(saved["param"], factor * weights), (name, key)
        assert torch.load(folder / "step.pt", weights_only=False) == 4.0
    optimizer_state = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)
    assert optimizer_state["param_groups"] == [{"lr": 0.5, "momentum": 0.9, "params": [0]}]
    assert optimizer_state["loss_scaler"] == "scaler"
    assert not {"base_optimizer_state", "single_partition_of_fp32_groups", "fp32_flat_groups"} & set(optimizer_state)
    model_file = next((tmp_path / "ckpt" / "tag").glob("*model_states.pt"))
    assert (out / model_file.name).read_bytes() == model_file.read_bytes()


DATA = Path(__file__).parent.parent / "data"
DEEPSPEED_WRITTEN = {  # real checkpoints of the tests' model, 2 ranks, Adam (see each folder's HOW.md)
    2: DATA / "before_the_redesign" / "epoch=0-step=4.ckpt" / "checkpoint",
    3: DATA / "zero3_adam_two_ranks" / "checkpoint",
}


@pytest.mark.parametrize("stage", sorted(DEEPSPEED_WRITTEN))
def test_for_adam_the_conversion_writes_what_deepspeeds_own_converter_writes(stage, tmp_path):
    """Checkpoints DeepSpeed wrote (ZeRO-2, ZeRO-3), converted here and by DeepSpeed's ds_to_universal (which reads
    Adam's state): the same weights and moments for every parameter, and the same step. ZeRO-3's converter writes bare
    flat tensors and keeps the step in optimizer_state.pt, where its own loader reads it."""
    from deepspeed.checkpoint import ds_to_universal

    source = DEEPSPEED_WRITTEN[stage]
    ours, theirs = tmp_path / "ours" / "tag", tmp_path / "deepspeed" / "tag"
    universal.convert(source, ours)
    ds_to_universal.main(
        argparse.Namespace(
            input_folder=str(source),
            output_folder=str(theirs),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )
    parameters = sorted(p.name for p in (theirs / "zero").iterdir() if p.is_dir())
    assert parameters == sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
    assert len(parameters) == 4
    for name in parameters:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            mine = torch.load(ours / "zero" / name / f"{key}.pt", weights_only=False)["param"]
            reference = torch.load(theirs / "zero" / name / f"{key}.pt", weights_only=False)
            reference = reference["param"] if isinstance(reference, dict) else reference
            assert mine.numel() == reference.numel() and torch.equal(mine.flatten(), reference.flatten()), (name, key)
        step = torch.load(ours / "zero" / name / "step.pt", weights_only=False)
        if stage <= 2:
            assert torch.equal(step, torch.load(theirs / "zero" / name / "step.pt", weights_only=False))
        else:
            global_state = torch.load(theirs / "zero" / "optimizer_state.pt", weights_only=False)
            assert torch.equal(step, global_state["optimizer_state_dict"]["state"][0]["step"])
    ours_global = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=False)
    theirs_global = torch.load(theirs / "zero" / "optimizer_state.pt", weights_only=False)
    assert ours_global["param_groups"] == theirs_global["param_groups"]
    assert str(ours_global["loss_scaler"]) == str(theirs_global["loss_scaler"])
    assert (tmp_path / "ours" / "latest_universal").read_text() == "tag"


def test_a_checkpoint_whose_state_is_not_per_parameter_is_refused_on_every_rank_before_converting(tmp_path):
    checkpoint_dir = tmp_path / "last.ckpt"

    def nadam_like(flat):
        return {"exp_avg": flat.clone(), "mu_product": torch.tensor(0.9), "step": 3}

    write_zero_checkpoint(checkpoint_dir / "tag", 2, 2, nadam_like, [(4, 4)])
    (checkpoint_dir / "latest").write_text("tag")
    manifest = {"world_size": 2, "zero_stage": 2, "optimizer": "NAdam"}
    with pytest.raises(ResumeRefused) as refused:
        elastic.check_convertible(checkpoint_dir, manifest, 3)
    message = str(refused.value)
    assert f"Checkpoint {checkpoint_dir} was saved by 2 ranks with ZeRO-2; this job has 3." in message
    assert "the NAdam optimizer keeps state that is not per parameter: 'mu_product'" in message
    assert "Resume on 2 ranks" in message and "exits with code 78 (retrying cannot help)" in message
    assert requested_exit_code(refused.value) == EXIT_CODE_WILL_FAIL_AGAIN
    with pytest.raises(ValueError, match="cannot be converted: 'mu_product'"):
        universal.convert(checkpoint_dir / "tag", tmp_path / "out" / "tag")
    manifest_sgd = {**manifest, "optimizer": "SGD"}
    write_zero_checkpoint(tmp_path / "sgd" / "tag", 2, 2, lambda flat: {"momentum_buffer": flat.clone()}, [(4, 4)])
    (tmp_path / "sgd" / "latest").write_text("tag")
    elastic.check_convertible(tmp_path / "sgd", manifest_sgd, 3)  # accepted


def test_a_conversion_that_fails_leaves_nothing_half_written(tmp_path):
    checkpoint_dir = tmp_path / "last.ckpt"
    write_zero_checkpoint(checkpoint_dir / "tag", 2, 2, lambda flat: {"momentum_buffer": flat[:-1].clone()}, [(3, 3)])
    (checkpoint_dir / "latest").write_text("tag")
    with pytest.raises(ValueError, match="cannot be converted"):
        elastic.convert_to_universal(checkpoint_dir)
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == ["latest", "tag"]
