"""Output a person can read: third-party messages that a user of this strategy cannot act on, silenced at their source.

Every rank of a run used to print DeepSpeed's accelerator guess and its warning about an "untested"
optimizer (any optimizer but Adam), torch's deprecation of a function DeepSpeed calls, a deprecation inside Lightning,
and Lightning's advertising tips. None of these tells the user anything to do. Each is matched by its source (logger
name, or warning category and the module that issues it) and the start of its text; everything else, the user's
warnings and the actionable ones of Lightning and DeepSpeed included, passes unchanged.

- Log messages are dropped only while the strategy's own code runs: its constructor (DeepSpeed
  is imported there) and the trainer calls it launches (:class:`QuietLauncher`).
- Lightning's tips (printed while the Trainer is built, between our calls) and the two deprecation warnings (raised
  deep inside a fit) are filtered from the first HeteroStrategy on, by exact source: a ``warnings.catch_warnings``
  around each trainer call would instead throw away every warning filter the user's own code adds during the fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

# Logger name -> starts of messages dropped while the strategy's code runs.
_LOG_NOISE = {
    # On a CPU-only run the CPU accelerator is the only choice; on GPUs DeepSpeed does not print it.
    "DeepSpeed": ("Setting accelerator to CPU", "**** You are using ZeRO with an untested optimizer"),
    # Printed once per rank and trainer call; the plan table says how many ranks run.
    "lightning.pytorch.strategies.deepspeed": ("initializing deepspeed distributed",),
}
# Lightning's advertising, printed while the Trainer is built.
_ADVERTS = {"lightning.pytorch.utilities.rank_zero": ("💡 Tip:",)}
# (category, start of the message, module the warning is attributed to) of deprecations nobody but the library
# authors can act on.
_WARNING_NOISE = (
    # DeepSpeed's ZeRO step calls it; torch warns.
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\.distributed\.c10d_logger"),
    # Lightning's loop builds a LeafSpec; torch warns.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree"),
)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_lasting_filters: list[tuple[logging.Logger, _DropMessages]] = []


def install_lasting_filters() -> None:
    """Drop Lightning's tips and the two deprecation warnings from now on (idempotent)."""
    if _lasting_filters:
        return
    for name, starts in _ADVERTS.items():
        logger, dropping = logging.getLogger(name), _DropMessages(starts)
        logger.addFilter(dropping)
        _lasting_filters.append((logger, dropping))
    _filter_warning_noise()


def _filter_warning_noise() -> None:
    for category, message, module in _WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


SRUN_HINT = r"The `srun` command is available on your system but is not used"


def hide_the_srun_hint_outside_slurm_jobs() -> None:
    """Lightning warns on every run of a machine where Slurm is installed (`srun` on PATH) that `srun` was not used.

    Inside a Slurm allocation without srun that is the right advice (the ranks would not be Slurm's), and it stays.
    Outside one (``SLURM_JOB_ID`` unset: a workstation or a login node with Slurm installed, where a run on this
    machine is what the user asked for) it is noise in every run's output; the filter is added then only, at each
    HeteroStrategy (the Trainer that follows checks for srun).
    """
    if "SLURM_JOB_ID" in os.environ:
        return
    warnings.filterwarnings("ignore", message=SRUN_HINT, category=PossibleUserWarning)


@contextlib.contextmanager
def third_party_noise_silenced() -> Iterator[None]:
    """Drop the known third-party log messages for the duration of the block."""
    # getLogger creates a logger that does not exist yet; DeepSpeed's logger factory configures that same object
    # on import and keeps its filters.
    added = [(logging.getLogger(name), _DropMessages(starts)) for name, starts in _LOG_NOISE.items()]
    for logger, dropping in added:
        logger.addFilter(dropping)
    try:
        yield
    finally:
        for logger, dropping in added:
            logger.removeFilter(dropping)


class QuietLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for script-based ranks, with the known noise silenced during each trainer call.

    Every trainer call (fit, validate, test, predict) runs inside ``launch`` on every rank, so this is the scope of
    "the strategy's own calls" (the processes it starts run their own trainer calls through the same launcher).
    """

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        with third_party_noise_silenced():
            return super().launch(function, *args, trainer=trainer, **kwargs)


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Around the profiler's start: Kineto prints its stages ("USDT: ... profiler_start") to the process's stderr from
    C++, whatever its log level; a person reading the job's output wants the plan and the result."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
