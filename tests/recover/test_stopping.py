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
    MAX_STEPS_BETWEEN_STOP_CHECKS,
    STOP_CHECK_SECONDS,
    StopOnSigterm,
    requeue_slurm_job,
    slurm_job_id,
    steps_between_stop_checks,
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


@pytest.mark.parametrize(
    ("recent", "expected"),
    [
        ((), 1),  # nothing measured yet: every step, as Lightning
        ((0.0, 0.0), 1),  # no time measured
        ((float("nan"),), 1),
        ((2.0,), 1),  # a step longer than the bound: every step
        ((STOP_CHECK_SECONDS,), 1),
        ((0.3,), 3),  # 3 steps (0.9 s) fit in the bound, 4 would not
        ((0.25, 0.25, 5.0), 4),  # the median: one slow step does not decide
        ((0.1, 0.1, 0.1, 0.001), 10),
        ((0.001,), MAX_STEPS_BETWEEN_STOP_CHECKS),  # short steps: capped in steps
    ],
)
def test_the_agreements_come_about_once_per_bound_of_training_time(recent, expected):
    assert steps_between_stop_checks(recent) == expected


def paced(recent_step_seconds, flags):
    """A StopOnSigterm installed per step, whose all-reduce records the step at which it ran and takes the other
    ranks' flags from ``flags`` (step -> flag)."""
    agreed_at: list[int] = []
    stop, trainer = None, fake_trainer()

    def all_reduce_max(flag: torch.Tensor) -> None:
        agreed_at.append(stop._steps_started)
        flag.copy_(torch.maximum(flag, torch.tensor([flags.get(stop._steps_started, 0)])))

    stop = StopOnSigterm(all_reduce_max, torch.device("cpu"))
    stop.install(trainer, recent_step_seconds=recent_step_seconds)
    return stop, trainer, agreed_at


def test_the_ranks_agree_at_every_step_until_the_step_times_are_known_then_at_paced_steps():
    """Lightning calls the epoch loop's ``_broadcast_sigterm_tensor`` at each training step's start: ours agrees (one
    collective) at steps 1-3 while no step time is known, then every 5 steps at 0.2 s a step, every step again when
    the steps slow to 2 s, and the step times in force at each agreement decide the next one, the same on every
    rank."""
    times: list[float] = []
    stop, trainer, agreed_at = paced(lambda: times, {})
    for step in range(1, 30):
        if step == 4:
            times[:] = [0.2] * 20  # the ranks' first exchange of step records came in before step 4
        if step == 19:
            times[:] = [2.0] * 20
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # what Lightning calls
    assert agreed_at == [1, 2, 3, 4, 9, 14, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]


def test_a_signal_between_agreements_stops_every_rank_at_the_next_one():
    """Rank 1 is signalled before step 7 (its flag reaches the all-reduce); at 0.2 s a step the agreements are at
    steps 1, 6 and 11: this rank stops at step 11, raising with the stop agreed, and no step in between ran one."""
    stop, trainer, agreed_at = paced(lambda: [0.2] * 10, {step: 1 for step in range(7, 100)})
    for _ in range(10):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    with pytest.raises(SIGTERMException) as stopped:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert agreed_at == [1, 6, 11] and stop.stopped_every_rank(stopped.value)
    assert trainer._signal_connector.received_sigterm and not stop.requeue_wanted()


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
