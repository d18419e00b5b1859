"""A SIGTERM or Slurm's requeue signal: remembered in the handler, agreed by the ranks at paced training steps, then
the job stops together (and is requeued)."""

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
    REPEATED_SIGNAL_SECONDS,
    STOP_CHECK_SECONDS,
    StopOnSigterm,
    requeue_slurm_job,
    slurm_job_id,
    steps_between_stop_checks,
)


def fake_trainer(world_size: int = 2) -> SimpleNamespace:
    connector = SimpleNamespace(received_sigterm=False)
    return SimpleNamespace(
        world_size=world_size, _signal_connector=connector, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace())
    )


@pytest.mark.parametrize(("own", "other", "requeue"), [("usr1", None, True), (None, 2, True), ("term", 1, False)])
def test_the_ranks_agree_on_a_stop_and_whether_to_requeue(own, other, requeue):
    """Rank 0 got SIGUSR1 (or SIGTERM, or nothing) and the other rank's flag is ``other``: both stop at the next
    agreement, and requeue if any rank got the requeue signal."""

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
    ("seconds_per_step", "expected"),
    [
        (0.0, 1),  # not known yet: every step, as Lightning
        (float("nan"), 1),
        (2.0, 1),  # a step longer than the bound: every step
        (STOP_CHECK_SECONDS, 1),
        (0.3, 3),  # 3 steps (0.9 s) fit in the bound, 4 would not
        (0.25, 4),
        (0.2, 5),  # (1.0 / 0.2 is 4.999... in floating point: not one fewer)
        (0.1, 10),
        (0.001, MAX_STEPS_BETWEEN_STOP_CHECKS),  # short steps: capped in steps
    ],
)
def test_the_agreements_come_about_once_per_bound_of_training_time(seconds_per_step, expected):
    assert steps_between_stop_checks(seconds_per_step) == expected


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(others_pace, others_flag=lambda step: 0):
    """A StopOnSigterm installed per step on a fake clock, in a world whose other rank sends its pace, ``others_pace``
    (0 at its first agreement, as every rank), and ``others_flag(step)`` (step: this rank's step count) to each
    all-reduce; returns it, its trainer, its clock and the steps at which it agreed, with the pace it sent."""
    agreed_at: list[tuple[int, float]] = []
    clock = FakeClock()
    stop = StopOnSigterm(lambda values: None, torch.device("cpu"), clock)

    def all_reduce_max(values: torch.Tensor) -> None:
        agreed_at.append((stop._steps_started, float(values[1])))
        pace = others_pace if agreed_at[:-1] else 0.0
        other = torch.tensor([float(others_flag(stop._steps_started)), pace], dtype=torch.float64)
        values.copy_(torch.maximum(values, other))

    stop._all_reduce_max = all_reduce_max
    trainer = fake_trainer()
    stop.install(trainer)
    return stop, trainer, clock, agreed_at


def test_the_ranks_agree_every_step_until_the_pace_is_known_then_about_once_a_second_of_training():
    """Lightning calls the epoch loop's ``_broadcast_sigterm_tensor`` at each training step's start. Ours agrees at
    step 1 (no pace yet) and 2, each carrying this rank's wall time per step since the last agreement; the other
    rank's pace (0.2 s a step) is the slower, so every rank next agrees 5 steps on (1 s); when this rank's steps slow
    to 0.5 s (from step 10), the agreements carry that and come every 3, then every 2 steps."""
    stop, trainer, clock, agreed_at = paced(others_pace=0.2)
    for step in range(1, 20):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # what Lightning calls
        clock.now += 0.1 if step < 10 else 0.5
    assert [step for step, _ in agreed_at] == [1, 2, 7, 12, 15, 17, 19]
    assert [round(pace, 3) for _, pace in agreed_at] == [0.0, 0.1, 0.1, 0.26, 0.5, 0.5, 0.5]


def test_what_the_pace_counts_is_everything_between_two_agreements():
    """A long pause between steps (validation, a slow loader, a callback) counts in the pace: at 1 ms a step the
    agreements come every 20 steps, and the one after a 9.98 s validation carries 0.5 s a step, so the next comes 2
    steps on."""
    stop, trainer, clock, agreed_at = paced(others_pace=0.0)
    for step in range(1, 50):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        clock.now += 0.001 + (9.98 if step == 30 else 0.0)
    assert [step for step, _ in agreed_at] == [1, 2, 22, 42, 44]
    assert agreed_at[3][1] == pytest.approx((20 * 0.001 + 9.98) / 20)


def test_a_signal_between_agreements_stops_every_rank_at_the_next_one():
    """The other rank is signalled at its step 4; at 0.2 s a step the agreements are at steps 1, 2 and 7: this rank
    stops at step 7, raising with the stop agreed, and no step in between ran an agreement."""
    stop, trainer, clock, agreed_at = paced(others_pace=0.2, others_flag=lambda step: int(step >= 4))
    for _ in range(6):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        clock.now += 0.2
    with pytest.raises(SIGTERMException) as stopped:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert [step for step, _ in agreed_at] == [1, 2, 7] and stop.stopped_every_rank(stopped.value)
    assert trainer._signal_connector.received_sigterm and not stop.requeue_wanted()


def test_a_repeated_sigterm_is_the_same_request_and_a_later_one_exits(monkeypatch):
    """Under srun, Slurm signals a torchrun worker and torchrun's agent forwards its own: a second SIGTERM within
    REPEATED_SIGNAL_SECONDS changes nothing (it used to end the process at once, without saving). One later, before
    any agreement, means the rank is stuck: the process exits 143. Once the stop is agreed (saving), none exits."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop, trainer, clock, _ = paced(others_pace=0.0)
    stop.on_sigterm(signal.SIGTERM, None)
    clock.now += REPEATED_SIGNAL_SECONDS - 0.5
    stop.on_sigterm(signal.SIGTERM, None)
    assert stop.requested and exits == []
    clock.now += 1.0
    stop.on_sigterm(signal.SIGTERM, None)
    assert exits == [EXIT_CODE_INTERRUPTED]
    exits.clear()
    with pytest.raises(SIGTERMException):
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    clock.now += 60.0
    stop.on_sigterm(signal.SIGTERM, None)
    assert exits == []


def test_one_process_saving_its_stop_is_not_ended_by_a_later_sigterm(monkeypatch):
    """One process has no agreement: once Lightning's loop stopped on the flag and the strategy saves, a SIGTERM
    later than REPEATED_SIGNAL_SECONDS changes nothing (it used to end the save with os._exit)."""
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    clock = FakeClock()
    stop, trainer = StopOnSigterm(lambda values: None, torch.device("cpu"), clock), fake_trainer(world_size=1)
    stop.install(trainer)
    stop.on_sigterm(signal.SIGTERM, None)
    assert trainer._signal_connector.received_sigterm  # Lightning's loop stops after this step
    assert stop.stopped_every_rank(SIGTERMException(EXIT_CODE_INTERRUPTED))  # the strategy saves now
    clock.now += 60.0
    stop.on_sigterm(signal.SIGTERM, None)
    assert exits == []


@pytest.mark.parametrize("agreed_before", [False, True])
def test_a_signal_after_the_last_agreement_of_a_fit_carries_over_to_the_next_trainer_call(agreed_before):
    """A SIGTERM after a fit's last agreement lets that fit finish; the next trainer call's instance takes it up, and
    the ranks stop at its first agreement. One the previous call already acted on is not acted on again."""
    previous, _, _, _ = paced(others_pace=0.0)
    previous.on_requeue_signal(signal.SIGUSR1, None)
    if agreed_before:
        with pytest.raises(SIGTERMException):
            previous.step_starts()
    stop, trainer, _, agreed_at = paced(others_pace=0.0)
    stop.take_pending(previous)
    if agreed_before:
        stop.step_starts()
        assert not stop.requested and agreed_at == [(1, 0.0)]
        return
    with pytest.raises(SIGTERMException):
        stop.step_starts()
    assert stop.requeue_wanted() and trainer._signal_connector.received_sigterm


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
