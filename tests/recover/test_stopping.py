"""Slurm's requeue signal: remembered in the handler, agreed at a step boundary, then the job is requeued."""

from __future__ import annotations

import os
import signal
import stat
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_hetero.recover.stopping import (
    EXIT_CODE_INTERRUPTED,
    StopOnSigterm,
    requeue_slurm_job,
    slurm_job_id,
)


def fake_trainer(world_size: int = 2) -> SimpleNamespace:
    connector = SimpleNamespace(received_sigterm=False)
    return SimpleNamespace(world_size=world_size, _signal_connector=connector,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace()))  # fmt: skip


@pytest.mark.parametrize(("own", "other", "requeue"), [("usr1", None, True), (None, 2, True), ("term", 1, False)])
def test_the_ranks_agree_on_a_stop_and_whether_to_requeue(own, other, requeue):
    """Rank 0 got SIGUSR1 (or SIGTERM, or nothing) and the other rank's flag is ``other``: both stop at the next
    step boundary, and requeue if any rank got the requeue signal."""

    def all_reduce_max(flag: torch.Tensor) -> None:
        flag.copy_(torch.maximum(flag, torch.tensor([other or 0])))

    stop, trainer = StopOnSigterm(all_reduce_max, torch.device("cpu")), fake_trainer()
    stop.install(trainer)
    assert trainer._signal_connector._slurm_sigusr_handler_fn == stop.on_requeue_signal  # Lightning registers this
    if own == "usr1":
        stop.on_requeue_signal(signal.SIGUSR1, None)
    elif own == "term":
        stop.on_sigterm(signal.SIGTERM, None)
    with pytest.raises(SIGTERMException) as stopped:
        stop.stop_if_any_rank_was_signalled()
    assert stopped.value.code == EXIT_CODE_INTERRUPTED and trainer._signal_connector.received_sigterm
    assert stop.stopped_every_rank(stopped.value) and stop.requeue_wanted() == requeue


def test_no_signal_no_stop():
    stop, trainer = StopOnSigterm(lambda flag: None, torch.device("cpu")), fake_trainer()
    stop.install(trainer)
    stop.stop_if_any_rank_was_signalled()  # nothing raised
    assert not stop.requeue_wanted()


def test_lightnings_slurm_handler_is_ours_and_saves_nothing_inside_the_signal():
    """Under SLURMEnvironment Lightning registers its requeue handler for SIGUSR1; after install it is ours, which
    only remembers (Lightning's own saved a checkpoint there, with collectives)."""
    trainer = Trainer(accelerator="cpu", devices=1, plugins=[SLURMEnvironment()], logger=False)
    stop = StopOnSigterm(lambda flag: None, torch.device("cpu"))
    stop.install(trainer)
    trainer.save_checkpoint = lambda *args, **kwargs: pytest.fail("a checkpoint was saved in the signal handler")
    before = signal.getsignal(signal.SIGUSR1)
    trainer._signal_connector.register_signal_handlers()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requeue_requested and stop.requested
        assert trainer._signal_connector.received_sigterm  # one process: Lightning's loop stops after this step
        assert stop.requeue_wanted()
    finally:
        trainer._signal_connector.teardown()
        signal.signal(signal.SIGUSR1, before)


def test_the_job_id_comes_from_slurm():
    assert slurm_job_id({"SLURM_JOB_ID": "1234"}) == "1234"
    assert slurm_job_id({"SLURM_JOB_ID": "1234", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}) == "77_3"
    assert slurm_job_id({}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "12; rm -rf /"}) is None  # never handed to a command


def fake_scontrol(directory, body: str) -> None:
    script = directory / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def test_requeue_calls_scontrol_within_a_deadline_and_says_what_happened(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    fake_scontrol(tmp_path, f'echo "$@" > {tmp_path}/called')
    assert requeue_slurm_job("1234") == "requeued Slurm job 1234"
    assert (tmp_path / "called").read_text().strip() == "requeue 1234"
    fake_scontrol(tmp_path, 'echo "Invalid job id" >&2; exit 1')
    assert requeue_slurm_job("1234") == "requeueing Slurm job 1234 failed (1): Invalid job id"
    fake_scontrol(tmp_path, "exec sleep 30")  # (exec: the process the deadline kills is the one that waits)
    assert "did not answer within 1 s" in requeue_slurm_job("1234", timeout=1.0)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert "`scontrol` is not on PATH" in requeue_slurm_job("1234")
