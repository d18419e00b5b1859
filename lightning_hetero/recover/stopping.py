"""Recover: a SIGTERM to any rank stops every rank at the same training step, with an exit code that says so.

Lightning's own handling leaves a scheduler believing the job finished: its SIGTERM handler broadcasts rank 0's flag
(a collective inside a signal handler) and its loops then raise ``SIGTERMException()``, a ``SystemExit`` with code 0.
A SIGTERM to rank 0 made every rank exit 0 after an unfinished fit; one to another rank never reached rank 0.

Here the handler only sets a flag (it takes the place of Lightning's notifier before Lightning registers its
handlers, so it is the handler from the first moment of the run). Where Lightning broadcast rank 0's flag at every
training step, the ranks all-reduce their flags with MAX instead (one small collective in its place, no extra one):
a signal to any rank stops all of them before the same step, each raising ``SIGTERMException(EXIT_CODE_INTERRUPTED)``
with ``trainer.received_sigterm`` set. A single process has no such collective; there the flag is Lightning's own,
which its loop checks after each step. The strategy then saves ``last.ckpt`` on every rank together (see
:meth:`StopOnSigterm.stopped_every_rank`), so the restarted job loses no step. Lightning's ``on_exception`` callbacks
run as before (``OnExceptionCheckpoint`` sees the same exception type), and the process exits with 143 = 128 +
SIGTERM, the code a shell gives a process ended by SIGTERM, which torchrun and Slurm read as "not finished". A SIGTERM
during validation is acted on at the next agreement; one after the last agreement lets the fit finish. A later SIGTERM
before the first was acted on (a rank stuck where no agreement comes) ends the process at once, with the same code.

The ranks agree at every step until their pace is known, then about once per ``STOP_CHECK_SECONDS`` of training
(:func:`steps_between_stop_checks`): Lightning's per-step collective made the host wait for the device and for the
other ranks at every step (Lightning issue 21487), which a short step pays in full. Each agreement carries each rank's
wall time per step since the last one; its maximum, the same on every rank, sets the next agreement's step, so every
rank agrees at the same steps without a collective of its own. A SIGTERM within ``REPEATED_SIGNAL_SECONDS`` of the
first is the same request (under srun, Slurm and then torchrun's agent both signal a worker).

Slurm's requeue signal (SIGUSR1 under Lightning's ``SLURMEnvironment``, or ``#SBATCH --signal=USR1@...``) takes the
same path: Lightning's own handler saved ``hpc_ckpt_<n>.ckpt`` from inside the signal handler, whose collectives could
meet another rank inside a ``sync_dist`` reduce and deadlock (1 in 4 tries in issue 19), and resumed from it only with
``ckpt_path=None``. Here the handler only remembers; at the next agreement every rank stops, saves ``last.ckpt``
(what ``fit(ckpt_path="last")`` resumes) and rank 0 asks Slurm to requeue the job (``scontrol requeue``, bounded).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_CODE_INTERRUPTED = 128 + int(signal.SIGTERM)
# The flag the ranks agree on (the first value they all-reduce): nothing, a stop, a stop and a Slurm requeue.
_STOP, _REQUEUE = 1, 2
REQUEUE_TIMEOUT_SECONDS = 60
# How much training a stop may come after its signal, at most, once the steps' pace is known (more when the steps slow
# down in between, and any validation in between as before): far below the grace period of a scheduler's SIGTERM (30 s
# by default in Kubernetes and Slurm).
STOP_CHECK_SECONDS = 1.0
# ... and in steps, so that steps that turn much slower before the next agreement cannot stretch it far.
MAX_STEPS_BETWEEN_STOP_CHECKS = 20
# A SIGTERM this soon after the first is the same request: under srun, Slurm signals every process of the step and
# torchrun's agent then forwards its own to its workers. Only a later one means "stuck: exit now".
REPEATED_SIGNAL_SECONDS = 5.0


def steps_between_stop_checks(seconds_per_step: float) -> int:
    """How many training steps from one agreement on a stop to the next: as many as fit in ``STOP_CHECK_SECONDS`` at
    ``seconds_per_step`` (the slowest rank's wall time per step since the last agreement), between 1 and
    ``MAX_STEPS_BETWEEN_STOP_CHECKS``; 1 while it is not known (0)."""
    if not seconds_per_step > 0:  # (not known yet; NaN included)
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_STOP_CHECKS, int(STOP_CHECK_SECONDS / seconds_per_step * (1 + 1e-9))))


class StopOnSigterm:
    """The flag a SIGTERM sets, and the ranks' agreement on it at paced training steps."""

    def __init__(
        self,
        all_reduce_max: Callable[[torch.Tensor], None],
        device: torch.device,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._all_reduce_max = all_reduce_max
        self._device = device
        self._clock = clock
        self._trainer: Any = None
        self.requested = False
        self.requeue_requested = False  # Slurm's requeue signal
        self._agreed = False
        self.requeue_agreed = False
        self._requested_at: Optional[float] = None
        self._steps_started = self._next_check = 0
        self._last_check: Optional[tuple[int, float]] = None  # the step and the time of the last agreement

    def install(self, trainer: Any, at_each_step: bool = True) -> None:
        """Take the place of Lightning's SIGTERM notifier and of its per-step broadcast of rank 0's flag.

        Called before Lightning registers its signal handlers for the run: it builds them from the connector's
        ``_sigterm_notifier_fn`` at that moment, so the instance attribute set here is what it registers.
        """
        self._trainer = trainer
        self.requested = self._agreed = self.requeue_requested = self.requeue_agreed = False
        self._requested_at, self._last_check = None, None
        self._steps_started = self._next_check = 0
        trainer._signal_connector._sigterm_notifier_fn = self.on_sigterm
        # Registered by Lightning for Slurm's requeue signal (SLURMEnvironment with auto_requeue): its own saved a
        # checkpoint inside the handler.
        trainer._signal_connector._slurm_sigusr_handler_fn = self.on_requeue_signal
        # Lightning calls this at the start of every training step on every rank (when the world has several ranks);
        # where the ranks' steps are not in step (asynchronous merges) they agree at the merges instead.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = self.step_starts if at_each_step else lambda: None

    def step_starts(self) -> None:
        """A training step starts on every rank: agree on a stop if this is one of the steps that do.

        Each rank sends, with its flag, its wall time per step since the last agreement (all of it: steps, loading,
        callbacks, validation); the maximum, the same on every rank after the all-reduce, sets the next agreement's
        step. So every rank agrees at the same steps, without a collective of its own.
        """
        self._steps_started += 1
        if self._steps_started <= self._next_check:
            return
        now = self._clock()
        pace = 0.0
        if self._last_check is not None:
            step, when = self._last_check
            pace = (now - when) / (self._steps_started - step)
        slowest_pace = self._agree(pace)
        self._last_check = (self._steps_started, self._clock())
        self._next_check = self._steps_started - 1 + steps_between_stop_checks(slowest_pace)

    def on_sigterm(self, signum: int, frame: Any) -> None:
        # A signal handler runs between two bytecodes of the main thread, possibly inside a collective's Python
        # frame: it must not communicate, only remember.
        now = self._clock()
        if self._requested_at is not None:
            if self._agreed or now - self._requested_at < REPEATED_SIGNAL_SECONDS:
                return  # the same request again (or the stop is under way, saving): acted on as the first
            # A later SIGTERM: the first was not acted on (this rank is stuck, e.g. in a collective whose peer is
            # stuck too, so no agreement comes): end the process now, as SIGTERM does without a handler.
            print(
                "HeteroStrategy: a second SIGTERM while the ranks had not agreed on the first; exiting now with"
                f" code {EXIT_CODE_INTERRUPTED} without saving.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_CODE_INTERRUPTED)
        self.requested, self._requested_at = True, now
        if self._trainer is not None and self._trainer.world_size == 1:
            self._trainer._signal_connector.received_sigterm = True  # Lightning's loop stops after this step

    def on_requeue_signal(self, signum: int, frame: Any) -> None:
        # As on_sigterm: remember only. (A second one changes nothing: the first is acted on at the next agreement.)
        self.requeue_requested = self.requested = True
        if self._requested_at is None:
            self._requested_at = self._clock()
        if self._trainer is not None and self._trainer.world_size == 1:
            self._trainer._signal_connector.received_sigterm = True

    def stop_if_any_rank_was_signalled(self) -> None:
        """Every rank at once: stop together (SIGTERMException) if any was signalled."""
        self._agree(0.0)

    def _agree(self, pace: float) -> float:
        """One all-reduce (MAX) of this rank's flag and ``pace``: stop together if any rank was signalled; else the
        largest pace."""
        own = _REQUEUE if self.requeue_requested else _STOP if self.requested else 0
        values = torch.tensor([float(own), pace], dtype=torch.float64, device=self._device)
        self._all_reduce_max(values)
        flag, slowest_pace = (float(value) for value in values.tolist())
        if flag:
            self._trainer._signal_connector.received_sigterm = True  # what callbacks read
            self._agreed = True
            self.requeue_agreed = int(flag) == _REQUEUE
            raise SIGTERMException(EXIT_CODE_INTERRUPTED)
        return slowest_pace

    def requeue_wanted(self) -> bool:
        """Whether the agreed stop came from Slurm's requeue signal (on any rank)."""
        if self._trainer is not None and self._trainer.world_size == 1:
            return self.requeue_requested
        return self.requeue_agreed

    def stopped_every_rank(self, exception: BaseException) -> bool:
        """Whether ``exception`` is the stop a SIGTERM caused on every rank at the same step boundary (so that all
        of them can still save a checkpoint together)."""
        if not isinstance(exception, SIGTERMException) or self._trainer is None:
            return False
        if self._trainer.world_size == 1 and self.requested:
            self._agreed = True  # (one process agrees with itself: a later SIGTERM must not end the save)
        return self._agreed

    def take_pending(self, previous: Optional[StopOnSigterm]) -> None:
        """A signal the previous trainer call's ranks had not yet agreed on (it came after their last agreement, as
        the fit finished) carries over to this call's first agreement, rather than being lost with the instance."""
        if previous is None or not previous.requested or previous._agreed:
            return
        self.requested, self.requeue_requested = True, previous.requeue_requested
        self._requested_at = previous._requested_at
        if self._trainer is not None and self._trainer.world_size == 1:
            self._trainer._signal_connector.received_sigterm = True


def slurm_job_id(environment: Optional[dict[str, str]] = None) -> Optional[str]:
    """The job to requeue: ``<array job>_<task>`` in an array job, else ``SLURM_JOB_ID`` (None outside Slurm)."""
    environment = dict(os.environ) if environment is None else environment
    array_job = environment.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{environment.get('SLURM_ARRAY_TASK_ID', '')}" if array_job else environment.get("SLURM_JOB_ID")
    return job if job and re.fullmatch(r"[0-9_]+", job) else None


def requeue_slurm_job(job_id: str, timeout: float = REQUEUE_TIMEOUT_SECONDS) -> str:
    """``scontrol requeue <job>``, bounded by ``timeout``; what happened, for the log (never raises)."""
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return f"could not requeue Slurm job {job_id}: `scontrol` is not on PATH"
    except subprocess.TimeoutExpired:
        return f"could not requeue Slurm job {job_id}: `scontrol requeue` did not answer within {timeout:.0f} s"
    if result.returncode != 0:
        return f"requeueing Slurm job {job_id} failed ({result.returncode}): {result.stderr.strip()[-500:]}"
    return f"requeued Slurm job {job_id}"


def exit_code_for(exception: BaseException) -> None:
    """Give a ``SIGTERMException`` raised without a code (Lightning's own) the interrupted exit code."""
    if isinstance(exception, SIGTERMException) and not exception.code:
        exception.code = EXIT_CODE_INTERRUPTED
