"""Recovery's own decisions, against fake collectives: who chooses the checkpoint, who prunes, what a manifest says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hetero.recover import checkpoint
from lightning_hetero.recover.recovery import Recovery, manifest_facts
from lightning_hetero.runtime.collectives import Collectives


def recovery(rank, world_size=2, rank_0_answer=None):
    """A Recovery whose gathers hand every rank rank 0's shared part (``rank_0_answer`` on ranks other than 0)."""
    collectives = Collectives(world_size, torch.device("cpu"))

    def gather(mine):
        first = mine if rank == 0 else {"shared": rank_0_answer, "failure": None}
        return [first] + [mine] * (world_size - 1)

    collectives.gather_objects = gather
    result = Recovery(peer_timeout=None)
    result.join(collectives, rank)
    return result


def test_only_rank_0_prunes_and_never_the_only_complete_checkpoint(tmp_path):
    removed = []
    recovery(1).remove(tmp_path / "a.ckpt", removed.append)
    assert removed == []
    recovery(0).remove(tmp_path / "a.ckpt", removed.append)  # not a complete checkpoint: nothing to protect
    assert removed == [tmp_path / "a.ckpt"]


def test_rank_0_chooses_the_checkpoint_and_every_rank_resumes_from_its_choice(tmp_path):
    with pytest.raises(ValueError):
        recovery(0).choose(tmp_path / "missing.ckpt")
    chosen, manifest = recovery(1, rank_0_answer=(str(tmp_path / "x.ckpt"), None, None)).choose(tmp_path / "last.ckpt")
    assert chosen == Path(tmp_path / "x.ckpt") and manifest == {}  # (rank 1 never looked at the files itself)
    assert checkpoint.read_manifest(tmp_path / "x.ckpt") is None


def test_the_manifest_records_the_split_the_position_and_the_optimizer():
    class Engine:
        basic_optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])

    facts = manifest_facts({"global_step": 4, "epoch": 0}, 2, (10, 6), 64, 2, Engine(), ["cpu", "cpu"], {"hook": 0})
    assert facts == {
        "world_size": 2,
        "global_step": 4,
        "epoch": 0,
        "global_samples": 64,
        "batch_sizes": [10, 6],
        "zero_stage": 2,
        "optimizer": "Adam",
        "devices": ["cpu", "cpu"],
        "communication": {"hook": 0},
    }


def test_one_rank_or_no_peer_timeout_starts_no_watchdog_and_teardown_releases_the_locks(tmp_path):
    single = Recovery(peer_timeout=30.0)
    single.watch_peers()
    assert single._watchdog is None
    lonely = recovery(0)
    lonely.watch_peers()  # peer_timeout=None
    assert lonely._watchdog is None
    lonely._hold_writer_lock(tmp_path)
    assert lonely._writer_locks
    lonely.teardown(finished=True)
    assert not lonely._writer_locks


@pytest.mark.parametrize("kind", ["local training", "exchange hook"])
def test_rank_0_checks_every_ranks_own_files_before_any_rank_reads_its_own(tmp_path, kind):
    """A checkpoint whose rank 1 file (local SGD's state, or the compressed exchange's error feedback) was replaced
    by one that runs code (the manifest written after, so the checksums agree): rank 0's choice refuses it, so every
    rank stops in the same gather, before rank 1 alone would refuse its file and leave the others waiting until the
    watchdog ended them (exit 75). Nothing runs."""
    from conftest import crafted

    from lightning_hetero.comm.communication import STATE_DIRNAME as HOOK_STATE_DIRNAME
    from lightning_hetero.local.merges import STATE_DIRNAME as LOCAL_STATE_DIRNAME
    from lightning_hetero.runtime.safe_load import UnsafeCheckpointFile

    STATE_DIRNAME = LOCAL_STATE_DIRNAME if kind == "local training" else HOOK_STATE_DIRNAME
    saved = tmp_path / "step=4.ckpt"
    (saved / STATE_DIRNAME).mkdir(parents=True)
    torch.save({"steps_done": 4}, saved / STATE_DIRNAME / "rank_0.pt")
    crafted(saved / STATE_DIRNAME / "rank_1.pt", tmp_path / "ran", steps_done=4)
    checkpoint.write_manifest(saved, {"world_size": 2})
    with pytest.raises(
        UnsafeCheckpointFile, match=rf"{STATE_DIRNAME}/rank_1.pt holds objects .*builtins.exec.*altered"
    ):
        recovery(0).choose(saved)
    assert not (tmp_path / "ran").exists()
    torch.save({"steps_done": 4}, saved / STATE_DIRNAME / "rank_1.pt")
    checkpoint.write_manifest(saved, {"world_size": 2})
    assert recovery(0).choose(saved)[0] == saved
