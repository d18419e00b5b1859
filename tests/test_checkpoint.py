"""Atomic checkpoints: staging, manifest, publish, what counts as complete, which one a resume uses, pruning."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from lightning_hetero import checkpoint, elastic


def write_checkpoint(directory, step, files=None, manifest=True):
    """A finished DeepSpeed-like checkpoint directory (optionally without its manifest)."""
    directory.mkdir(parents=True)
    files = files or {"latest": b"checkpoint", "checkpoint/mp_rank_00_model_states.pt": b"x" * 100}
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    if manifest:
        checkpoint.write_manifest(directory, {"world_size": 2, "global_step": step})
    return directory


def test_the_manifest_lists_every_file_with_its_size_and_the_facts(tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 7)
    manifest = checkpoint.read_manifest(path)
    assert manifest["files"] == {"checkpoint/mp_rank_00_model_states.pt": 100, "latest": 10}
    assert manifest["global_step"] == 7 and manifest["format_version"] == checkpoint.FORMAT_VERSION
    assert checkpoint.incompleteness(path) is None


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / checkpoint.MANIFEST_NAME).unlink(), "has no hetero_manifest.json"),
        (lambda p: (p / checkpoint.MANIFEST_NAME).write_text("{truncated"), "does not read"),
        (lambda p: (p / "latest").unlink(), "latest is missing"),
        (lambda p: (p / "checkpoint/mp_rank_00_model_states.pt").write_bytes(b"x" * 40), "has 40 bytes, the manifest"),
        (lambda p: (p / checkpoint.MANIFEST_NAME).write_text(json.dumps({"format_version": 99, "files": {}})),
         "format version 99"),
    ],  # fmt: skip
)
def test_a_damaged_checkpoint_is_incomplete_and_says_why(damage, reason, tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 1)
    damage(path)
    assert reason in checkpoint.incompleteness(path)


def test_a_file_or_a_missing_path_is_not_a_checkpoint(tmp_path):
    (tmp_path / "file.ckpt").write_text("a single-file checkpoint")
    assert "is a file" in checkpoint.incompleteness(tmp_path / "file.ckpt")
    assert "does not exist" in checkpoint.incompleteness(tmp_path / "none.ckpt")


def test_files_derived_later_do_not_make_a_checkpoint_incomplete(tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 1)
    (path / checkpoint.DERIVED_DIRNAME).mkdir()
    (path / checkpoint.DERIVED_DIRNAME / "converted.pt").write_bytes(b"y")
    assert checkpoint.incompleteness(path) is None


def test_publish_replaces_the_previous_checkpoint_in_one_step(tmp_path):
    target = write_checkpoint(tmp_path / "last.ckpt", 1)
    staging = write_checkpoint(checkpoint.staging_path(target), 2)
    assert staging.name == ".last.ckpt.partial"  # not matched by Lightning's last*.ckpt search
    checkpoint.publish(staging, target)
    assert checkpoint.read_manifest(target)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # the old one deleted, nothing staged left


def test_publish_without_atomic_exchange_goes_through_a_replaced_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_exchange", lambda first, second: False)  # e.g. NFS
    target = write_checkpoint(tmp_path / "last.ckpt", 1)
    checkpoint.publish(write_checkpoint(checkpoint.staging_path(target), 2), target)
    assert checkpoint.read_manifest(target)["global_step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_a_save_interrupted_before_publishing_leaves_the_previous_last_and_is_cleared_next_time(tmp_path):
    target = write_checkpoint(tmp_path / "last.ckpt", 1)
    staging = checkpoint.staging_path(target)
    (staging / "checkpoint").mkdir(parents=True)  # killed while writing: no manifest
    assert checkpoint.choose_checkpoint(target) == (target, None)
    checkpoint.remove_stale_staging(target)
    assert not staging.exists()


def test_an_incomplete_last_falls_back_to_the_newest_complete_checkpoint_with_a_warning(tmp_path):
    write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    newest = write_checkpoint(tmp_path / "epoch=0-step=8.ckpt", 8)
    last = write_checkpoint(tmp_path / "last.ckpt", 12, manifest=False)  # written in place by another tool, killed
    chosen, warning = checkpoint.choose_checkpoint(last)
    assert chosen == newest
    assert str(last) in warning and "has no hetero_manifest.json" in warning and str(newest) in warning


def test_an_incomplete_last_with_nothing_to_fall_back_on_is_an_error(tmp_path):
    last = write_checkpoint(tmp_path / "last.ckpt", 12, manifest=False)
    with pytest.raises(ValueError, match="cannot be resumed from: it has no hetero_manifest.json.*delete this one"):
        checkpoint.choose_checkpoint(last)


def test_an_incomplete_checkpoint_named_explicitly_is_an_error_naming_the_complete_ones(tmp_path):
    write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    broken = write_checkpoint(tmp_path / "epoch=0-step=8.ckpt", 8)
    (broken / "latest").unlink()
    with pytest.raises(ValueError, match=r"step=8.ckpt.*latest is missing. Complete checkpoints beside it: epoch=0-step=4"):  # noqa: E501
        checkpoint.choose_checkpoint(broken)


def test_complete_checkpoints_are_ordered_by_global_step(tmp_path):
    later = write_checkpoint(tmp_path / "b.ckpt", 20)
    earlier = write_checkpoint(tmp_path / "a.ckpt", 3)
    write_checkpoint(tmp_path / "c.ckpt", 30, manifest=False)
    assert checkpoint.complete_checkpoints(tmp_path) == [earlier, later]


def test_pruning_never_removes_the_only_complete_checkpoint(tmp_path):
    only = write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    write_checkpoint(tmp_path / "epoch=0-step=8.ckpt", 8, manifest=False)  # incomplete: not a replacement
    removed = []
    with pytest.warns(UserWarning, match="only complete checkpoint"):
        assert not elastic.prune_unless_only(only, removed.append)
    assert removed == []
    write_checkpoint(tmp_path / "epoch=0-step=12.ckpt", 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert elastic.prune_unless_only(only, removed.append)
    assert removed == [only]


def test_save_atomically_orders_the_ranks_and_publishes_on_rank_0(tmp_path):
    target = tmp_path / "ckpt" / "last.ckpt"
    events = []

    def write(directory):
        events.append(("write", directory.name))
        write_checkpoint(directory, 5, manifest=False)

    elastic.save_atomically(target, write, lambda: {"global_step": 5}, True, lambda: events.append("barrier"))
    assert events == ["barrier", ("write", ".last.ckpt.partial"), "barrier", "barrier"]
    assert checkpoint.read_manifest(target)["global_step"] == 5 and checkpoint.incompleteness(target) is None
    assert os.listdir(target.parent) == ["last.ckpt"]
