"""Output a person can read: third-party messages that a user of this strategy cannot act on, silenced at their source.

Every rank of a run used to print DeepSpeed's accelerator guess and op-build message, its warning about an "untested"
optimizer (any optimizer but Adam), torch's deprecation of a function DeepSpeed calls, a deprecation inside Lightning,
and Lightning's advertising tips. None of these tells the user anything to do. Each is matched by its logger (or
warning category) and the start of its text, and dropped only while the strategy's own code runs: its constructor
(DeepSpeed is imported there) and the trainer calls it launches (:class:`QuietLauncher`). Everything else, the user's
warnings and the actionable ones of Lightning and DeepSpeed included, passes unchanged. The one exception is
Lightning's tips, printed while the Trainer is built, between our calls: their filter stays on once a HeteroStrategy
exists.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any, Callable

from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

# Logger name -> starts of messages dropped while the strategy's code runs.
_LOG_NOISE = {
    # On a CPU-only run the CPU accelerator is the only choice; on GPUs DeepSpeed does not print it.
    "DeepSpeed": ("Setting accelerator to CPU", "**** You are using ZeRO with an untested optimizer"),
    # Printed once per rank and trainer call; the plan table says how many ranks run.
    "lightning.pytorch.strategies.deepspeed": ("initializing deepspeed distributed",),
}
# Lightning's advertising, printed while the Trainer is built (not during a call of ours).
_ADVERTS = {"lightning.pytorch.utilities.rank_zero": ("💡 Tip:",)}
# (category, regular expression for the start of the message) of warnings dropped while the strategy's code runs.
_WARNING_NOISE = (
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),  # DeepSpeed's call, torch's warning
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),  # inside Lightning's loop, torch's warning
)
# Lines DeepSpeed writes with print() while it initialises communication.
_PRINT_NOISE = ("deepspeed_shm_comm_op built successfully",)


class _DropMessages(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_advert_filters: list[tuple[logging.Logger, _DropMessages]] = []


def silence_adverts() -> None:
    """Drop Lightning's tips from now on (idempotent)."""
    if not _advert_filters:
        for name, starts in _ADVERTS.items():
            logger, dropping = logging.getLogger(name), _DropMessages(starts)
            logger.addFilter(dropping)
            _advert_filters.append((logger, dropping))


@contextlib.contextmanager
def third_party_noise_silenced() -> Iterator[None]:
    """Drop the known third-party noise (loggers, warnings) for the duration of the block."""
    # getLogger creates a logger that does not exist yet; DeepSpeed's logger factory configures that same object
    # on import and keeps its filters.
    added = [(logging.getLogger(name), _DropMessages(starts)) for name, starts in _LOG_NOISE.items()]
    for logger, dropping in added:
        logger.addFilter(dropping)
    try:
        with warnings.catch_warnings():
            for category, message in _WARNING_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        for logger, dropping in added:
            logger.removeFilter(dropping)


@contextlib.contextmanager
def prints_dropped() -> Iterator[None]:
    """Drop DeepSpeed's known print() lines from stdout for the duration of the block; other lines pass."""
    target = sys.stdout
    with contextlib.redirect_stdout(_LineFilter(target, _PRINT_NOISE)) as stream:
        try:
            yield
        finally:
            stream.flush()


class _LineFilter(io.TextIOBase):
    def __init__(self, target: Any, drop: tuple[str, ...]) -> None:
        self.target = target
        self.drop = drop
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            if not any(noise in line for noise in self.drop):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending and not any(noise in self._pending for noise in self.drop):
            self.target.write(self._pending)
        self._pending = ""
        self.target.flush()


class QuietLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for script-based ranks, with the known noise silenced during each trainer call.

    Every trainer call (fit, validate, test, predict) runs inside ``launch`` on every rank, so this is the scope of
    "the strategy's own calls" (the processes it starts run their own trainer calls through the same launcher).
    """

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        with third_party_noise_silenced():
            return super().launch(function, *args, trainer=trainer, **kwargs)
