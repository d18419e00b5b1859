"""Recover: a resume refused for what it was given fails the same way on every restart, and says so.

A checkpoint that cannot continue on this job's number of ranks or with these arguments (optimizer state that is not
per parameter, local training's per-rank state, a fixed global batch, an incomplete checkpoint named explicitly) is
refused on every attempt of the same command. torchrun's elastic agent restarts its workers after any failure, whatever
their exit code, up to ``--max-restarts`` (torch 2.13, ``SimpleElasticAgent._invoke_run``), and there is no documented
way for a worker to tell it not to (pytorch/pytorch#133877, open). Closing the rendezvous
(``RendezvousHandler.set_closed``, documented as the way for one node to end the job) is the agents' API: a worker has
no rendezvous handler and no rendezvous endpoint, and closing it would also end an elastic job whose lost node may come
back (on as many ranks as the checkpoint's, the resume works). So a refused resume

* exits with :data:`EXIT_CODE_WILL_FAIL_AGAIN` (78, sysexits' EX_CONFIG; 75, EX_TEMPFAIL, is a lost peer's, which a
  restart cures), which torchrun's failure summary lists for each worker and any other launcher returns;
* says in its message that a restart on as many ranks fails the same way, and under torchrun how many restarts are
  left (:func:`will_fail_again`);
* is written to the worker's torchrun error file, so that the summary's root cause is this message
  (:func:`record_for_torchrun`);
* happens when the checkpoint is first read, before any step (and, for optimizer state, before any conversion): each
  attempt fails within seconds of its start. What torchrun then spends is its own rendezvous waiting per restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Optional

from lightning_hetero.runtime.shutdown import exit_with_if_uncaught

EXIT_CODE_WILL_FAIL_AGAIN = 78


class ResumeRefused(ValueError):
    """A resume refused for its checkpoint, arguments or number of ranks: the process exits with
    :data:`EXIT_CODE_WILL_FAIL_AGAIN` (when the exception ends it) and the message says a restart cannot help."""

    def __init__(self, message: str, environ: Optional[Mapping[str, str]] = None) -> None:
        super().__init__(f"{message} {will_fail_again(os.environ if environ is None else environ)}")
        exit_with_if_uncaught(self, EXIT_CODE_WILL_FAIL_AGAIN)


def will_fail_again(environ: Mapping[str, str]) -> str:
    """What to tell the user and a launcher's wrapper: this attempt and every restart like it fail the same way."""
    note = (
        "A restart of the same command on as many ranks fails the same way, so this process exits with code"
        f" {EXIT_CODE_WILL_FAIL_AGAIN} (retrying cannot help)."
    )
    if "TORCHELASTIC_MAX_RESTARTS" not in environ:
        return note
    left = int(environ["TORCHELASTIC_MAX_RESTARTS"]) - int(environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if left <= 0:
        return note
    return (
        f"{note} torchrun restarts its workers after any failure, whatever their exit code: it will try {left} more"
        f" time{'s' if left > 1 else ''} (--max-restarts), each refused like this one unless the number of ranks"
        " changes. Stop the job (or the agents) and fix the cause."
    )


def record_for_torchrun(exception: BaseException) -> None:
    """Under torchrun, write ``exception`` to this worker's error file (``TORCHELASTIC_ERROR_FILE``, set by the agent)
    with torch's ``ErrorHandler``, as its ``@record`` would: the agent's failure summary then shows the message as the
    root cause instead of "error_file: <N/A>" (a Lightning script is rarely decorated with ``@record``)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(exception)
