"""A checkpoint directory of Lightning's DeepSpeedStrategy: recognised from DeepSpeed's files, its facts read as a
manifest would give them, anything else answered as before (pure parts; the 2-rank resumes are in
tests/compat/test_deepspeed_strategy_users.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import write_deepspeed_checkpoint

from lightning_hetero.recover import checkpoint, from_deepspeed
from lightning_hetero.recover.refusal import ResumeRefused
from lightning_hetero.train.order import STATE_EPOCH, STATE_NUM_SAMPLES, STATE_SAMPLES_CONSUMED, STATE_SEED

ADAM = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2), "step": torch.tensor(3.0)}}}
SGD = {"state": {0: {"momentum_buffer": torch.zeros(2)}}}


@pytest.mark.parametrize(("stage", "optimizer", "name"), [(0, ADAM, "Adam"), (2, ADAM, "Adam"), (3, SGD, "unknown")])
def test_the_facts_of_a_deepspeedstrategy_directory_are_read_from_its_files(tmp_path, stage, optimizer, name):
    path = write_deepspeed_checkpoint(tmp_path / "epoch=0-step=3.ckpt", stage, optimizer_state=optimizer)
    facts = from_deepspeed.deepspeed_strategy_facts(path)
    assert facts is not None and from_deepspeed.is_deepspeed_strategys(facts)
    assert (facts["world_size"], facts["zero_stage"], facts["global_step"], facts["epoch"]) == (2, stage, 3, 0)
    assert facts["batch_sizes"] == [8, 8]  # DeepSpeedStrategy gave each rank the loader's batch
    assert facts["optimizer"].startswith(name)  # (what decides whether another world size can be converted)
    assert from_deepspeed.choose_checkpoint(path) == (str(path), None, facts)


def test_a_directory_with_a_manifest_or_without_every_ranks_files_is_not_taken_for_deepspeedstrategys(tmp_path):
    ours = write_deepspeed_checkpoint(tmp_path / "a.ckpt")
    checkpoint.write_manifest(ours, {"world_size": 2, "global_step": 3})
    assert from_deepspeed.deepspeed_strategy_facts(ours) is None
    assert from_deepspeed.choose_checkpoint(ours) == (str(ours), None, None)  # the package's own, as before
    killed = write_deepspeed_checkpoint(tmp_path / "b.ckpt", skip=["zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    assert from_deepspeed.deepspeed_strategy_facts(killed) is None  # DeepSpeedStrategy writes in place
    (tmp_path / "c.ckpt" / "checkpoint").mkdir(parents=True)
    (tmp_path / "c.ckpt" / "latest").write_text("checkpoint")
    (tmp_path / "c.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)  # not torch's
    assert from_deepspeed.deepspeed_strategy_facts(tmp_path / "c.ckpt") is None
    with pytest.raises(ValueError, match="has no hetero_manifest.json"):
        from_deepspeed.choose_checkpoint(tmp_path / "c.ckpt")


PACKAGES_LOADER_STATE = {"fit_loop": {"state_dict": {"combined_loader": [{STATE_SAMPLES_CONSUMED: 48}]}}}


@pytest.mark.parametrize(
    "what_says_so",
    ["the package's mark", "the package's loader position (before the mark)", "the package's per-rank files"],
)
def test_the_packages_own_checkpoint_without_its_manifest_is_incomplete_never_deepspeedstrategys(
    what_says_so, tmp_path
):
    """A checkpoint the package wrote whose hetero_manifest.json was deleted passed for DeepSpeedStrategy's (same
    layout) and resumed with that format's data position: 8 samples of an epoch were never trained. Now it is what
    any checkpoint without its manifest is: "last" is skipped for the newest complete checkpoint beside it, with a
    warning naming what is missing; the only one, or one named explicitly, is refused."""
    client_state = {
        "the package's mark": {checkpoint.PACKAGE_MARK: {"format_version": checkpoint.FORMAT_VERSION}},
        "the package's loader position (before the mark)": {"loops": PACKAGES_LOADER_STATE},
        "the package's per-rank files": {},
    }[what_says_so]
    older = write_deepspeed_checkpoint(tmp_path / "epoch=0-step=3.ckpt", **client_state)
    checkpoint.write_manifest(older, {"world_size": 2, "global_step": 3})
    last = write_deepspeed_checkpoint(tmp_path / "last.ckpt", **client_state)
    if what_says_so == "the package's per-rank files":
        (last / "hetero_local_sgd").mkdir()
        torch.save({"steps_done": 6}, last / "hetero_local_sgd" / "rank_0.pt")
    assert from_deepspeed.deepspeed_strategy_facts(last) is None
    chosen, warning, facts = from_deepspeed.choose_checkpoint(last)
    assert (chosen, facts) == (str(older), None)
    assert f"skipping checkpoint {last}: it has no hetero_manifest.json" in warning
    shutil.rmtree(older)
    with pytest.raises(ResumeRefused, match=r"last.ckpt, which cannot be resumed from: it has no hetero_manifest"):
        from_deepspeed.choose_checkpoint(last)


def test_a_deepspeedstrategy_checkpoint_with_a_stateful_loader_of_its_own_is_still_deepspeedstrategys(tmp_path):
    """(A loader state that is not the package's global position, such as a stateful loader's own, says nothing.)"""
    loops = {"fit_loop": {"state_dict": {"combined_loader": [{"batches_yielded": 3}]}}}
    path = write_deepspeed_checkpoint(tmp_path / "a.ckpt", loops=loops)
    assert from_deepspeed.is_deepspeed_strategys(from_deepspeed.deepspeed_strategy_facts(path))


def test_a_path_that_is_no_checkpoint_gets_deepspeedstrategys_answer_and_stays_a_value_error(tmp_path):
    """It said "no hetero_manifest.json" of an empty folder, and read a file inside a checkpoint as a Lightning file."""
    with pytest.raises(FileNotFoundError, match="The provided path is not a valid DeepSpeed checkpoint"):
        from_deepspeed.choose_checkpoint(tmp_path / "missing.ckpt")
    path = write_deepspeed_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=f"Try to load using this parent directory instead: {path}"):
        from_deepspeed.choose_checkpoint(path / "checkpoint")
    inside = path / "checkpoint" / "mp_rank_00_model_states.pt"
    with pytest.raises(FileNotFoundError, match=f"a file inside a DeepSpeed checkpoint folder.*instead: {path}"):
        from_deepspeed.explain_a_file_inside_a_checkpoint(inside)
    from_deepspeed.explain_a_file_inside_a_checkpoint(tmp_path / "model.ckpt")  # (not inside one: nothing to say)


class Order:
    def __init__(self, length, shuffles):
        self.length, self.shuffles, self.seed = length, shuffles, 7

    def __len__(self):
        return self.length


def test_the_place_in_the_epoch_comes_from_the_loops_progress_in_deepspeedstrategys_global_batches():
    saved = {"epoch": 0, "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": {"processed": 3}}}}}
    facts = {"batch_sizes": [8, 8]}
    state = from_deepspeed.with_data_position(saved, facts, Order(96, shuffles=True))
    assert state["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {STATE_EPOCH: 0, STATE_SAMPLES_CONSUMED: 48, STATE_NUM_SAMPLES: 96, STATE_SEED: 7}
    ]
    untouched = {"epoch": 1, "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": {"processed": 0}}}}}
    assert from_deepspeed.with_data_position(dict(untouched), facts, Order(96, True)) == untouched  # a whole epoch
    assert from_deepspeed.with_data_position(dict(saved), facts, None) == saved  # not fitting, or a stream
    with pytest.warns(UserWarning, match="this unshuffled loader keeps its own order"):
        from_deepspeed.with_data_position(
            {"loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": {"processed": 1}}}}},
            facts,
            Order(96, shuffles=False),
        )


def test_a_last_checkpoint_that_cannot_be_read_safely_beside_complete_ones_is_skipped_not_refused(tmp_path):
    """A package checkpoint that lost its manifest and whose Lightning state holds more than plain data (a `Path`
    hyper-parameter) cannot be read to find the package's mark: as a "last" beside complete checkpoints it is skipped
    as any incomplete "last" is (found in review); alone, or named explicitly, its refusal names the file."""
    from pathlib import Path

    from lightning_hetero.runtime.safe_load import UnsafeCheckpointFile

    older = write_deepspeed_checkpoint(tmp_path / "epoch=0-step=3.ckpt")
    checkpoint.write_manifest(older, {"world_size": 2, "global_step": 3})
    last = write_deepspeed_checkpoint(tmp_path / "last.ckpt", hyper_parameters={"data": Path("/data")})
    chosen, warning, facts = from_deepspeed.choose_checkpoint(last)
    assert (chosen, facts) == (str(older), None) and "it has no hetero_manifest.json" in warning
    named = write_deepspeed_checkpoint(tmp_path / "step=6.ckpt", hyper_parameters={"data": Path("/data")})
    with pytest.raises(UnsafeCheckpointFile, match=r"step=6.ckpt/checkpoint/mp_rank_00_model_states.pt holds objects"):
        from_deepspeed.choose_checkpoint(named)
