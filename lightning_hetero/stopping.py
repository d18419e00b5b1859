"""Recover: a SIGTERM to any rank stops every rank at the same training step, with an exit code that says so.

Lightning's own handling leaves a scheduler believing the job finished: its SIGTERM handler broadcasts rank 0's flag
(a collective inside a signal handler) and its loops then raise ``SIGTERMException()``, a ``SystemExit`` with code 0.
A SIGTERM to rank 0 made every rank exit 0 after an unfinished fit; one to another rank never reached rank 0.

Here the handler only sets a flag. Once per training step, where Lightning broadcast rank 0's flag, the ranks
all-reduce their flags with MAX instead (the same one-element collective, so no extra one): a signal to any rank
stops all of them before the same step, each raising ``SIGTERMException(EXIT_CODE_INTERRUPTED)``. Lightning's
``on_exception`` callbacks run as before (``OnExceptionCheckpoint`` sees the same exception type), and the process
exits with 143 = 128 + SIGTERM, the code a shell gives a process ended by SIGTERM, which torchrun and Slurm read as
"not finished". A SIGTERM during validation is acted on at the next training step; one after the last training
step lets the fit finish.
"""

from __future__ import annotations

import signal
from typing import Any, Callable

import torch
import torch.distributed
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_CODE_INTERRUPTED = 128 + int(signal.SIGTERM)


class StopOnSigterm:
    """The flag a SIGTERM sets, and the per-step agreement of all ranks on it."""

    def __init__(self, all_reduce_max: Callable[[torch.Tensor], None], device: torch.device) -> None:
        self._all_reduce_max = all_reduce_max
        self._device = device
        self.requested = False

    def on_sigterm(self, signum: int, frame: Any) -> None:
        # A signal handler runs between two bytecodes of the main thread, possibly inside a collective's Python
        # frame: it must not communicate, only remember.
        self.requested = True

    def install(self, trainer: Any) -> bool:
        """Take the place of Lightning's SIGTERM notifier (after Lightning registered its handlers for this run) and of
        its per-step broadcast. False where Lightning registered nothing (not the main thread, Windows)."""
        self.requested = False
        handler = signal.getsignal(signal.SIGTERM)
        epoch_loop = trainer.fit_loop.epoch_loop
        if not isinstance(handler, _HandlersCompose) or not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
            return False
        notifier = _SignalConnector._sigterm_notifier_fn
        handler.signal_handlers = [
            self.on_sigterm if getattr(h, "__func__", None) is notifier else h for h in handler.signal_handlers
        ]
        # Lightning calls this at the start of every training step on every rank (when the world has several ranks).
        epoch_loop._broadcast_sigterm_tensor = self.stop_if_any_rank_was_signalled
        return True

    def stop_if_any_rank_was_signalled(self) -> None:
        flag = torch.tensor([int(self.requested)], device=self._device)
        self._all_reduce_max(flag)
        if flag.item():
            raise SIGTERMException(EXIT_CODE_INTERRUPTED)


def all_reduce_max(tensor: torch.Tensor) -> None:
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
