"""Atomic checkpoints: staging, manifest, publish, what counts as complete, which one a resume uses, pruning."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import pytest
from conftest import REPO

from lightning_hetero.recover import checkpoint, elastic


def flip_a_byte(path, name="checkpoint/mp_rank_00_model_states.pt"):
    """Damage a file in place without changing its size (bit rot, a bad copy)."""
    content = bytearray((path / name).read_bytes())
    content[len(content) // 2] ^= 0xFF
    (path / name).write_bytes(bytes(content))


def write_checkpoint(directory, step, files=None, manifest=True):
    """A finished DeepSpeed-like checkpoint directory (optionally without its manifest)."""
    directory.mkdir(parents=True, exist_ok=True)  # (DeepSpeed too: every rank writes into the same folder)
    files = files or {"latest": b"checkpoint", "checkpoint/mp_rank_00_model_states.pt": b"x" * 100}
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)
    if manifest:
        checkpoint.write_manifest(directory, {"world_size": 2, "global_step": step})
    return directory


def test_the_manifest_lists_every_file_with_its_size_and_checksum_and_the_facts(tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 7)
    manifest = checkpoint.read_manifest(path)
    assert manifest["files"] == {
        "checkpoint/mp_rank_00_model_states.pt": {"size": 100, "crc32": f"{zlib.crc32(b'x' * 100):08x}"},
        "latest": {"size": 10, "crc32": f"{zlib.crc32(b'checkpoint'):08x}"},
    }
    assert manifest["global_step"] == 7 and manifest["format_version"] == checkpoint.FORMAT_VERSION
    assert checkpoint.incompleteness(path) is None


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / checkpoint.MANIFEST_NAME).unlink(), "has no hetero_manifest.json"),
        (lambda p: (p / checkpoint.MANIFEST_NAME).write_text("{truncated"), "does not read"),
        (lambda p: (p / "latest").unlink(), "latest is missing"),
        (lambda p: (p / "checkpoint/mp_rank_00_model_states.pt").write_bytes(b"x" * 40), "has 40 bytes, the manifest"),
        (
            lambda p: (p / checkpoint.MANIFEST_NAME).write_text(json.dumps({"format_version": 99, "files": {}})),
            "format version 99",
        ),
        (flip_a_byte, "checkpoint/mp_rank_00_model_states.pt does not match its checksum"),
    ],
)
def test_a_damaged_checkpoint_is_incomplete_and_says_why(damage, reason, tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 1)
    damage(path)
    assert reason in checkpoint.incompleteness(path, verify_checksums=True)


def test_a_byte_damaged_in_place_is_found_only_by_reading_the_checksums(tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 1)
    flip_a_byte(path)
    assert checkpoint.incompleteness(path) is None  # the sizes still match: pruning and listing stay cheap
    assert "does not match its checksum" in checkpoint.incompleteness(path, verify_checksums=True)


def test_a_manifest_of_format_1_with_sizes_only_still_reads(tmp_path):
    path = write_checkpoint(tmp_path / "a.ckpt", 1)
    manifest = checkpoint.read_manifest(path)
    files = {name: entry["size"] for name, entry in manifest["files"].items()}
    (path / checkpoint.MANIFEST_NAME).write_text(json.dumps({**manifest, "format_version": 1, "files": files}))
    assert checkpoint.incompleteness(path, verify_checksums=True) is None
    (path / "latest").write_bytes(b"x")
    assert "latest has 1 bytes, the manifest says 10" in checkpoint.incompleteness(path)


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


def test_a_damaged_last_falls_back_past_damaged_ones_to_the_newest_sound_checkpoint(tmp_path):
    """The same-size damage that sizes cannot see: every restart used to choose it again and fail the same way."""
    sound = write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    damaged = write_checkpoint(tmp_path / "epoch=0-step=8.ckpt", 8)
    last = write_checkpoint(tmp_path / "last.ckpt", 8)
    flip_a_byte(last)
    flip_a_byte(damaged, "latest")
    chosen, warning = checkpoint.choose_checkpoint(last)
    assert chosen == sound
    assert f"{last}: checkpoint/mp_rank_00_model_states.pt does not match its checksum" in warning
    assert f"{damaged}: latest does not match its checksum" in warning and f"Resuming from {sound}" in warning


def test_a_damaged_checkpoint_named_explicitly_is_an_error_naming_the_file(tmp_path):
    path = write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    flip_a_byte(path)
    with pytest.raises(ValueError, match="mp_rank_00_model_states.pt does not match its checksum"):
        checkpoint.choose_checkpoint(path)


def test_an_incomplete_last_with_nothing_to_fall_back_on_is_an_error(tmp_path):
    last = write_checkpoint(tmp_path / "last.ckpt", 12, manifest=False)
    with pytest.raises(ValueError, match="cannot be resumed from: it has no hetero_manifest.json.*delete this one"):
        checkpoint.choose_checkpoint(last)


def test_an_incomplete_checkpoint_named_explicitly_is_an_error_naming_the_complete_ones(tmp_path):
    write_checkpoint(tmp_path / "epoch=0-step=4.ckpt", 4)
    broken = write_checkpoint(tmp_path / "epoch=0-step=8.ckpt", 8)
    (broken / "latest").unlink()
    with pytest.raises(
        ValueError, match=r"step=8.ckpt.*latest is missing. Complete checkpoints beside it: epoch=0-step=4"
    ):  # noqa: E501
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


def agree_in_one_process(events):
    """What the strategy's gather-or-raise does, for one rank: run the step, note it."""

    def agree(what, step):
        events.append(what)
        local, shared = step()
        return local, [shared]

    return agree


def test_save_atomically_orders_the_ranks_and_publishes_on_rank_0(tmp_path):
    target = tmp_path / "ckpt" / "last.ckpt"
    events = []

    def write(directory):
        events.append(("write", directory.name))
        write_checkpoint(directory, 5, manifest=False)

    locked = []
    elastic.save_atomically(
        target, write, lambda: {"global_step": 5}, True, agree_in_one_process(events), locked.append
    )
    assert events == [
        "preparing the checkpoint",
        "writing the checkpoint",
        ("write", ".last.ckpt.partial"),
        "publishing the checkpoint",
    ]
    assert locked == [target.parent]
    assert checkpoint.read_manifest(target)["global_step"] == 5 and checkpoint.incompleteness(target) is None
    assert os.listdir(target.parent) == ["last.ckpt"]


def test_a_rank_that_does_not_see_rank_0s_folder_stops_every_rank_before_anyone_writes(tmp_path):
    """A checkpoint folder on each machine's own disk: rank 1 wrote its part into a folder of the same name on its
    machine, rank 0 published without it, and the loss showed only when a resume failed."""
    rank_0_disk, rank_1_disk = tmp_path / "machine_0", tmp_path / "machine_1"
    events, tokens = [], []

    def rank_0_agrees(what, step):
        local, shared = step()
        tokens.append(shared)
        return local, [shared]

    elastic.save_atomically(
        rank_0_disk / "last.ckpt",
        lambda d: write_checkpoint(d, 3, manifest=False),
        lambda: {"global_step": 3},
        True,
        rank_0_agrees,
        lambda d: None,
    )
    # The mark is gone from the published checkpoint and not in its manifest.
    assert elastic.SHARED_FOLDER_MARK not in checkpoint.read_manifest(rank_0_disk / "last.ckpt")["files"]
    assert not (rank_0_disk / "last.ckpt" / elastic.SHARED_FOLDER_MARK).exists()

    def rank_1_agrees(what, step):  # rank 0's token arrives in the gather; rank 1's own disk has no such folder
        events.append(what)
        local, shared = step()
        return local, [tokens[0], shared]

    written = []
    with pytest.raises(RuntimeError, match="does not see the checkpoint folder rank 0 prepared .* Save to shared"):
        elastic.save_atomically(
            rank_1_disk / "last.ckpt", written.append, lambda: {}, False, rank_1_agrees, lambda d: None
        )
    assert written == [] and events == ["preparing the checkpoint", "writing the checkpoint"]


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"),
    ],
)
def test_a_full_disk_while_writing_says_so_removes_the_partial_save_and_keeps_the_previous_one(
    failure, tmp_path, monkeypatch
):
    target = write_checkpoint(tmp_path / "last.ckpt", 4)
    if isinstance(failure, RuntimeError):  # torch's writer does not say why; the file system's free space does
        monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)

    def write(directory):
        (directory / "checkpoint").mkdir(parents=True)
        (directory / "checkpoint" / "part.pt").write_bytes(b"half")
        raise failure

    with pytest.raises(OSError) as error:
        elastic.save_atomically(target, write, lambda: {}, True, agree_in_one_process([]), lambda d: None)
    assert error.value.errno == errno.ENOSPC
    assert f"No space left on device (ENOSPC) while writing checkpoint {target}" in str(error.value)
    assert type(failure).__name__ in str(error.value) and "The partial checkpoint is removed" in str(error.value)
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no staging left behind
    assert checkpoint.choose_checkpoint(target) == (target, None)  # the previous one, complete


def test_another_write_failure_is_raised_as_it_is(tmp_path):
    def write(directory):
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        elastic.save_atomically(tmp_path / "a.ckpt", write, lambda: {}, True, agree_in_one_process([]), lambda d: None)
    assert os.listdir(tmp_path) == []


def test_one_job_at_a_time_holds_a_directory_and_the_refusal_names_the_holder(tmp_path):
    """The lock lies beside the directory, never inside it: a listing of the checkpoints shows checkpoints only
    (Lightning's test_deepspeed_multi_save_same_filepath listed `.hetero_writer.lock` among them)."""
    holder = checkpoint.WriterLock(tmp_path / "ckpt")
    holder.acquire()
    (tmp_path / "ckpt").mkdir()
    assert os.listdir(tmp_path / "ckpt") == [] and checkpoint.writer_lock_path(tmp_path / "ckpt").parent == tmp_path
    holder.release()
    holder = checkpoint.WriterLock(tmp_path)
    holder.acquire()
    holder.acquire()  # again: already held, nothing happens
    other = checkpoint.WriterLock(tmp_path)  # another open file: what a second job has
    expected = rf"another job is saving checkpoints into {tmp_path} \(process {os.getpid()} on"
    with pytest.raises(ValueError, match=expected):
        other.acquire()
    holder.release()
    assert not checkpoint.writer_lock_path(tmp_path).exists()  # nothing left behind
    other.acquire()
    other.release()


@pytest.mark.fault
def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    script = (
        f"import sys, time, pathlib; sys.path.insert(0, {str(REPO)!r})\n"
        "from lightning_hetero.recover import checkpoint\n"
        f"lock = checkpoint.WriterLock(pathlib.Path({str(tmp_path)!r}))\n"
        "lock.acquire(); print('held', flush=True); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match="another job"):
            checkpoint.WriterLock(tmp_path).acquire()
    finally:
        process.kill()
        process.wait(30)
    lock = checkpoint.WriterLock(tmp_path)
    lock.acquire()  # the kernel dropped the dead process's lock
    lock.release()


class FakeEngine:
    """DeepSpeed's engine as DeferredWriteErrors sees it: a save that writes files, then waits at a barrier."""

    class Files:
        def save(self, state_dict, path):
            if Path(path).name.startswith("fail"):
                raise OSError(errno.ENOSPC, "No space left on device")
            Path(path).write_bytes(b"ok")

        def makedirs(self, path, exist_ok=False):
            Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def __init__(self):
        self.checkpoint_engine = self.Files()
        self.reached_barrier = False

    def _copy_recovery_script(self, save_path):
        raise OSError(errno.ENOSPC, "No space left on device (copying zero_to_fp32.py)")

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        self.checkpoint_engine.makedirs(Path(save_dir) / "checkpoint", exist_ok=True)
        for name in ("fail_1.pt", "model.pt", "fail_2.pt"):
            self.checkpoint_engine.save(state_dict={}, path=Path(save_dir) / name)  # as DeepSpeed calls it
        self._copy_recovery_script(save_dir)
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)
        self.reached_barrier = True  # DeepSpeed's closing barrier: every rank must get here


def test_failed_writes_inside_deepspeeds_save_are_raised_after_its_collectives(tmp_path):
    engine = FakeEngine()
    with elastic.DeferredWriteErrors(engine) as deferred:
        engine.save_checkpoint(tmp_path, tag="checkpoint")
    assert engine.reached_barrier and [str(e) for e in deferred.errors] == [
        "[Errno 28] No space left on device",
        "[Errno 28] No space left on device",
        "[Errno 28] No space left on device (copying zero_to_fp32.py)",
    ]
    assert not (tmp_path / "latest").exists()  # written by rank 0 afterwards, where a failure can be shared
    deferred.write_latest(is_global_zero=True)
    assert (tmp_path / "latest").read_text() == "checkpoint" and (tmp_path / "model.pt").exists()
    with pytest.raises(OSError, match="No space left"):
        deferred.raise_first()
    assert not engine.checkpoint_engine.__dict__ and set(engine.__dict__) == {"checkpoint_engine", "reached_barrier"}


def test_a_damaged_checkpoint_directory_is_named_when_loaded_into_a_plain_model(tmp_path):
    from lightning_hetero.recover.export import is_hetero_checkpoint, lightning_checkpoint

    path = write_checkpoint(tmp_path / "last.ckpt", 4)
    flip_a_byte(path)
    assert is_hetero_checkpoint(path) and not is_hetero_checkpoint(tmp_path) and not is_hetero_checkpoint(object())
    with pytest.raises(ValueError, match="cannot be loaded: checkpoint/mp_rank_00_model_states.pt does not match"):
        lightning_checkpoint(path)


def test_a_lightning_checkpoint_files_place_in_its_epoch_becomes_the_loaders_state(tmp_path):
    import torch

    from lightning_hetero.recover import from_lightning as resume_lightning

    def saved(processed, epoch):
        return {
            "state_dict": {},
            "epoch": epoch,
            "loops": {
                "fit_loop": {
                    "epoch_loop.batch_progress": {"current": {"completed": processed - 1, "processed": processed}},
                    "epoch_progress": {"current": {"completed": epoch}},
                }
            },
        }

    state = resume_lightning.loader_state_for(saved(3, 1), global_batch=16, num_samples=96, seed=7)
    assert state == {"epoch": 1, "global_samples_consumed": 48, "num_samples": 96, "seed": 7}
    assert resume_lightning.loader_state_for(saved(0, 2), 16, 96, 7) is None  # at an epoch's end: the next one whole
    placed = resume_lightning.with_loader_state(saved(3, 1), state)
    assert placed["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [state]
    (tmp_path / "weights.pt").write_bytes(b"")
    torch.save({"model": 1}, tmp_path / "other.pt")
    for name, message in [("weights.pt", "does not load as a Lightning checkpoint"), ("other.pt", "no `state_dict`")]:
        with pytest.raises(ValueError, match=message):
            resume_lightning.read_lightning_checkpoint(tmp_path / name)


def test_the_launchers_layout_gives_devices_and_nodes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert elastic.launched_layout(3) == (3, 1)  # Lightning's launcher starts the ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert elastic.launched_layout(3) == (2, 3)  # torchrun: 3 nodes of 2 (an elastic job's count changes)
    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ValueError, match="Give every agent the same `--nproc-per-node`"):
        elastic.launched_layout(3)


def test_the_layout_of_an_srun_step_is_slurms(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_NODES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")  # the batch script has it too, but runs as one process: not a step
    assert elastic.launched_layout(3) == (3, 1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    assert elastic.launched_layout(3) == (2, 2)  # `srun --ntasks-per-node=2` on 2 nodes (Lightning refused devices=3)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "3")
    with pytest.raises(ValueError, match="#SBATCH --ntasks-per-node"):
        elastic.launched_layout(3)


def test_a_parent_the_job_cannot_write_into_puts_the_lock_inside_the_folder(tmp_path, monkeypatch):
    """The lock lies beside the folder; where the parent refuses a new file (EACCES, EPERM, EROFS: a read-only root
    with the folder mounted writable), it goes inside the folder, once, and a second job still finds it there."""
    import builtins

    real_open = builtins.open
    beside = checkpoint.writer_lock_path(tmp_path / "ckpt")

    def read_only_parent(path, *args, **kwargs):
        if Path(path) == beside:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_parent)
    (tmp_path / "ckpt").mkdir()
    holder = checkpoint.WriterLock(tmp_path / "ckpt")
    holder.acquire()
    assert holder.path == tmp_path / "ckpt" / checkpoint.WRITER_LOCK_SUFFIX and not beside.exists()
    with pytest.raises(ValueError, match="another job is saving checkpoints"):
        checkpoint.WriterLock(tmp_path / "ckpt").acquire()
    holder.release()
