"""Exchange: tensors sent from one pipeline stage to the next, each wait bounded by a deadline.

A stage sends each micro-batch's activation forward and receives its gradient back
(:mod:`lightning_hetero.pipeline.stage`). Each tensor travels as two messages: a fixed-size header (dtype, shape) and
the data, so the receiver allocates what arrives whatever the micro-batch's size. Sends are asynchronous (1F1B needs a
stage to go on while its send is in flight; a blocking send of two neighbours to each other would wait for ever);
every wait, for a receive or for the sends before the step ends, has the deadline ``timeout_seconds``: a dead or
frozen neighbour stops this rank with an error naming it instead of leaving it waiting.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

MAX_DIMENSIONS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)


class PeerTimeout(RuntimeError):
    """A neighbouring stage did not send, or take, a tensor within the deadline."""


def header_of(tensor: Tensor, key: int = 0) -> Tensor:
    """The dtype and shape of ``tensor`` as a fixed-size int64 header, and the message's ``key``."""
    if tensor.dim() > MAX_DIMENSIONS or tensor.dtype not in DTYPES:
        raise ValueError(
            f"HeteroStrategy(pipeline=...): a stage's output of dtype {tensor.dtype} and {tensor.dim()} dimensions"
            f" cannot cross a stage boundary (at most {MAX_DIMENSIONS} dimensions, a dtype of {list(DTYPES)})."
        )
    shape = list(tensor.shape) + [0] * (MAX_DIMENSIONS - tensor.dim())
    return torch.tensor([DTYPES.index(tensor.dtype), tensor.dim(), *shape, key], dtype=torch.int64)


def empty_from(header: Tensor, device: torch.device) -> Tensor:
    dtype_index, dimensions, *shape = (int(v) for v in header.tolist()[:-1])
    return torch.empty(shape[:dimensions], dtype=DTYPES[dtype_index], device=device)


HEADER_LENGTH = 3 + MAX_DIMENSIONS


class PeerLink:
    """Point-to-point sends and receives over the default process group, every wait with a deadline."""

    def __init__(self, device: torch.device, timeout_seconds: float) -> None:
        self.device = device
        self.timeout = timedelta(seconds=timeout_seconds)
        self._pending: list[tuple[Any, int, str, list[Tensor]]] = []  # (work, peer, what, tensors kept alive)
        # Messages that arrived before the one awaited, by (peer, key): the interleaved schedule receives from a peer
        # in another order than the peer sends (a peer's messages arrive in its order; a key names each).
        self._arrived: dict[tuple[int, int], Tensor] = {}

    def send(self, tensor: Tensor, peer: int, what: str, key: int = 0) -> None:
        """``tensor`` to rank ``peer`` without waiting; ``key`` names the message to a receiver that may await
        another first (the same key twice between two ranks in one step: in order)."""
        data = tensor.detach().to(self.device).contiguous()
        if data.dtype in (torch.bfloat16, torch.float16):
            # Stages may train in different precisions (`device_precision`): a boundary carries fp32, and each
            # stage's autocast casts what it computes in (as DeepSpeed's fp32 collectives do between such ranks).
            data = data.float()
        header = header_of(data, key).to(self.device)
        for part in (header, data):
            self._pending.append((dist.isend(part, peer), peer, what, [part]))

    def receive(self, peer: int, what: str, key: int = 0) -> Tensor:
        """Message ``key`` from rank ``peer``: those the peer sent before it are kept for their own receive."""
        while (peer, key) not in self._arrived:
            header = torch.empty(HEADER_LENGTH, dtype=torch.int64, device=self.device)
            self._wait(dist.irecv(header, peer), peer, f"the header of {what}")
            data = empty_from(header.cpu(), self.device)
            self._wait(dist.irecv(data, peer), peer, what)
            arrived = int(header[-1])
            if (peer, arrived) in self._arrived:
                raise RuntimeError(f"HeteroStrategy(pipeline=...): rank {peer} sent message {arrived} twice")
            self._arrived[(peer, arrived)] = data
        return self._arrived.pop((peer, key))

    def flush(self) -> None:
        """Every send handed over (before the step's reduction, which must not overtake them)."""
        pending, self._pending = self._pending, []
        for work, peer, what, _ in pending:
            self._wait(work, peer, f"the sending of {what}")

    def _wait(self, work: Any, peer: int, what: str) -> None:
        try:
            completed = work.wait(self.timeout)
        except RuntimeError as error:
            raise self._timeout(peer, what, error) from error
        if completed is False:
            raise self._timeout(peer, what, None)

    def _timeout(self, peer: int, what: str, error: Optional[BaseException]) -> PeerTimeout:
        seconds = self.timeout.total_seconds()
        detail = f" ({error})" if error is not None else ""
        return PeerTimeout(
            f"HeteroStrategy(pipeline=...): rank {dist.get_rank()} stopped waiting for {what} with rank {peer}"
            f" (deadline {seconds:g} s): that rank is dead, frozen or stopped with an error{detail}. Every rank"
            " stops; resume from the last checkpoint (`peer_timeout` sets the deadline)."
        )
