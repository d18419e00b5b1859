"""Runtime: the few collectives the strategy itself makes, outside DeepSpeed's and Lightning's.

Every one is reached by every rank in the same order. :meth:`Collectives.gather_or_raise` is the way to run code that
may fail on one rank only (user code, checks of what only that rank sees): the failure travels in the gather, so
every rank raises instead of the others waiting for the one that failed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, TypeVar, cast

import torch
import torch.distributed
from torch import Tensor

from lightning_hetero.runtime.shutdown import exit_with_if_uncaught, requested_exit_code

T = TypeVar("T")


def describe_failure(exception: BaseException) -> str:
    """An exception as one line that travels between ranks."""
    return f"{type(exception).__name__}: {exception}"


class Collectives:
    """Gathers over the default process group; with one rank, each is the identity and no process group is needed.

    ``before_each`` runs before every collective: an emulated slow rank pays its stretched compute first, as a
    slower device would reach the collective later (see :mod:`lightning_hetero.emulate`).
    """

    def __init__(self, world_size: int, device: torch.device, before_each: Callable[[], None] = lambda: None) -> None:
        self.world_size = world_size
        self.device = device
        self.before_each = before_each

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def gather_tensor(self, tensor: Tensor, catch_up: bool = False) -> list[Tensor]:
        """Every rank's ``tensor`` (the same shape and dtype on every rank), in rank order, on the CPU (``catch_up``:
        after :attr:`before_each`, for a gather inside a training step).

        Gathered on this rank's device: NCCL, the CUDA backend, only moves CUDA tensors (gloo takes either).
        """
        if catch_up:
            self.before_each()
        return self.start_in_background(tensor, gathered=True)()  # (started and waited for at once)

    def gather_counts(self, count: int) -> list[int]:
        """Every rank's integer ``count`` (one small gather)."""
        self.before_each()
        return [int(part.item()) for part in self.gather_tensor(torch.tensor([count], dtype=torch.int64))]

    def sum(self, value: float) -> float:
        """The sum of every rank's ``value`` (float64)."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            self.before_each()
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
        return float(total.item())

    def reduce_in_place(self, tensor: Tensor, op: str = "sum", group: Optional[Any] = None) -> None:
        """``tensor`` becomes the elementwise ``op`` ("sum" or "max") of every rank's (the members of ``group``)."""
        if self.world_size > 1:
            reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
            torch.distributed.all_reduce(tensor, op=reduce_op, group=group)

    def start_in_background(self, tensor: Tensor, gathered: bool = False) -> Callable[[], Any]:
        """Start the sum of ``tensor`` over the ranks in place (``gathered``: the gather of every rank's ``tensor``
        instead) without waiting; returns the wait, which returns the gather's tensors in rank order, on the CPU.
        The process group's timeout bounds the wait, as it bounds a collective that blocks."""
        if self.world_size == 1:
            return (lambda: [tensor]) if gathered else (lambda: None)
        if not gathered:
            summing = torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, async_op=True)

            def summed() -> None:
                summing.wait()

            return summed
        local = tensor.to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        work = torch.distributed.all_gather(parts, local, async_op=True)

        def wait() -> list[Tensor]:
            work.wait()
            return [part.cpu() for part in parts]

        return wait

    def broadcast_in_place(self, tensor: Tensor, source: int = 0) -> None:
        """``tensor`` becomes rank ``source``'s on every rank."""
        if self.world_size > 1:
            torch.distributed.broadcast(tensor, src=source)

    def gather_or_raise(self, what: str, compute: Callable[[], tuple[T, Any]]) -> tuple[T, list[Any]]:
        """Run ``compute`` (local result, shared part) and gather the shared parts; a failure anywhere stops every rank.

        ``compute`` runs user code (loaders, the training step) and checks that may fail on one rank only: the others
        must not wait for it in the gather, so the failure travels in the gather instead and every rank raises.
        """
        try:
            local, shared = compute()
            failure: Optional[BaseException] = None
        except Exception as error:
            local, shared, failure = None, None, error
        failure_text = None if failure is None else describe_failure(failure)
        code = None if failure is None else requested_exit_code(failure)
        gathered = self.gather_objects({"shared": shared, "failure": failure_text, "exit_code": code})
        if failure is not None:
            raise failure
        failed = [(rank, entry) for rank, entry in enumerate(gathered) if entry["failure"]]
        if failed:
            rank, entry = failed[0]
            stopped = RuntimeError(
                f"HeteroStrategy: {what} failed on rank {rank} ({entry['failure']}); every rank stops here."
            )
            if entry["exit_code"] is not None:  # (a refusal that every restart repeats: every rank exits alike)
                exit_with_if_uncaught(stopped, entry["exit_code"])
            raise stopped
        # (None only after a failure, raised above; T may itself be None, so no assert)
        return cast(T, local), [entry["shared"] for entry in gathered]
