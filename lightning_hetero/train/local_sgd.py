"""Train: local SGD and DiLoCo, the synchronization (see :mod:`lightning_hetero.plan.local_steps` for the idea).

:class:`LocalTraining` keeps, for one fit, the parameters as they were at the last synchronization (the anchor), the
samples this rank trained on since, and DiLoCo's outer optimizer. Between synchronizations DeepSpeed's engine steps
this rank's own (inner) optimizer on its own gradients (its exchange switched off). At a synchronization every rank
sends its pseudo-gradient ``anchor - parameters`` weighted by its share of the samples trained on since the last one
(one all-reduce of the sample counts, one of the weighted deltas, in fp32 or the ``compression`` half precision; with
``compression="int8"``/``"int4"`` a gather of each rank's quantized delta instead, see :mod:`~.comm.quantize`), and
every rank applies the same outer step to the anchor: ``anchor - average`` for local SGD (the sample-weighted average
of the ranks' parameters), an outer SGD step with the average as its gradient for DiLoCo. Every rank then holds the
same parameters, which become the next anchor.

A checkpoint is a synchronization (the strategy synchronizes before saving), so what it must add to DeepSpeed's files
is per rank: each rank's inner optimizer state (DeepSpeed's ZeRO-0 checkpoint holds rank 0's only), the outer
optimizer state, the count of training steps and a quantized merge's error feedback, restored by :meth:`load`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.comm import quantize
from lightning_hetero.plan.local_steps import is_sync_step

STATE_DIRNAME = "hetero_local_sgd"
_DTYPES = {None: torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class LocalTraining:
    """This rank's side of local SGD / DiLoCo for one strategy (``outer``: DiLoCo's settings, None for local SGD)."""

    def __init__(self, mode: str, sync_every: int, outer: Optional[dict[str, Any]], compression: Optional[str]) -> None:
        self.mode, self.sync_every, self.outer_settings = mode, sync_every, outer
        self.wire_dtype = _DTYPES.get(compression, torch.float32)
        self.quantized_bits: Optional[int] = quantize.BITS.get(compression or "")
        # What rounding left out of this rank's quantized deltas so far: added to its next one (None: nothing yet).
        self.error_feedback: Optional[Tensor] = None
        self.steps_done = 0  # training steps of this fit (Lightning batches, the same count on every rank)
        self.samples_since_sync = 0
        self.steps_since_sync = 0  # (the same on every rank: what decides an extra synchronization)
        self.synchronizations = 0
        self._parameters: list[torch.nn.Parameter] = []
        self._anchor: list[Tensor] = []
        self._outer: Optional[torch.optim.SGD] = None
        self._outer_parameters: list[torch.nn.Parameter] = []  # DiLoCo: the anchor as the outer optimizer's
        self._inner: Any = None
        # Reads the inner steps in force (the split's), which a checkpoint records: set by the job.
        self.inner_steps: Optional[Callable[[], tuple[int, ...]]] = None

    def attach(self, parameters: list[torch.nn.Parameter], inner_optimizer: Any) -> None:
        """DeepSpeed's engine exists: anchor the parameters it trains, create the outer optimizer over the anchor."""
        self._parameters, self._inner = parameters, inner_optimizer
        self._anchor = [p.detach().clone() for p in parameters]
        self.samples_since_sync = self.steps_since_sync = 0
        self.error_feedback = None  # (a resume restores its own, in load)
        self._outer = None
        if self.outer_settings is not None:
            settings = self.outer_settings
            self._outer_parameters = [torch.nn.Parameter(anchor, requires_grad=False) for anchor in self._anchor]
            self._anchor = [p.data for p in self._outer_parameters]
            self._outer = torch.optim.SGD(
                self._outer_parameters, lr=settings["outer_lr"], momentum=settings["outer_momentum"],
                nesterov=settings["nesterov"],
            )  # fmt: skip

    def detach(self) -> None:
        self._parameters, self._anchor, self._outer, self._inner = [], [], None, None
        self._outer_parameters = []

    def step_done(
        self,
        samples: int,
        last_of_epoch: bool,
        all_reduce: Callable[[Tensor], None],
        gather: Optional[Callable[[Tensor], list[Tensor]]] = None,
    ) -> bool:
        """A training step ended on this rank after ``samples`` samples: synchronize when it is time (every
        ``sync_every`` steps and at the end of an epoch, the same decision on every rank). True if it did."""
        self.steps_done += 1
        self.steps_since_sync += 1
        self.samples_since_sync += samples
        if not is_sync_step(self.steps_done, self.sync_every, last_of_epoch):
            return False
        self.synchronize(all_reduce, gather)
        return True

    def synchronize(
        self, all_reduce: Callable[[Tensor], None], gather: Optional[Callable[[Tensor], list[Tensor]]] = None
    ) -> None:
        """The outer step on every rank (``all_reduce`` sums a tensor over the ranks in place; ``gather`` returns
        every rank's tensor in rank order, needed by a quantized merge)."""
        if not self._parameters:
            return
        counts = torch.tensor([float(self.samples_since_sync)], dtype=torch.float64)
        all_reduce(counts)
        total = float(counts.item())
        share = self.samples_since_sync / total if total > 0 else 0.0
        with torch.no_grad():
            deltas = torch.cat([(anchor - p.detach()).reshape(-1) for anchor, p in zip(self._anchor, self._parameters)])
            if self.quantized_bits is None:
                weighted = (deltas.double() * share).to(self.wire_dtype)
                all_reduce(weighted)
                average = weighted.to(deltas.dtype)
            else:
                assert gather is not None, "a quantized merge gathers the ranks' deltas"
                average = self._quantized_sum((deltas.double() * share).float(), gather).to(deltas.dtype)
            offset = 0
            for index, anchor in enumerate(self._anchor):
                size = anchor.numel()
                pseudo_gradient = average[offset : offset + size].view_as(anchor)
                offset += size
                if self._outer is None:
                    anchor.sub_(pseudo_gradient)
                else:
                    self._outer_parameters[index].grad = pseudo_gradient.clone()
            if self._outer is not None:
                self._outer.step()
                self._outer.zero_grad(set_to_none=True)
            for anchor, parameter in zip(self._anchor, self._parameters):
                parameter.copy_(anchor)
        self.samples_since_sync = self.steps_since_sync = 0
        self.synchronizations += 1

    def _quantized_sum(self, weighted: Tensor, gather: Callable[[Tensor], list[Tensor]]) -> Tensor:
        """The sum over the ranks of their weighted deltas, each sent quantized with this rank's error feedback; the
        same sum, in the same order, on every rank."""
        assert self.quantized_bits is not None
        bits, numel = self.quantized_bits, weighted.numel()
        if self.error_feedback is not None:
            weighted = weighted + self.error_feedback
        payload, scales = quantize.quantize(weighted, bits)
        self.error_feedback = weighted - quantize.dequantize(payload, scales, bits, numel)
        total = torch.zeros(numel, dtype=torch.float64)
        for rank_payload, rank_scales in zip(gather(payload), gather(scales)):
            total += quantize.dequantize(rank_payload, rank_scales, bits, numel).double()
        return total.float()

    # ------------------------------------------------------------------ checkpoints (taken at a synchronization)

    def state(self) -> dict[str, Any]:
        return {
            "inner_steps": list(self.inner_steps()) if self.inner_steps is not None else None,
            "steps_done": self.steps_done,
            "synchronizations": self.synchronizations,
            "inner": self._inner.state_dict() if self._inner is not None else None,
            "outer": self._outer.state_dict() if self._outer is not None else None,
            "error_feedback": self.error_feedback,
        }

    def save(self, directory: Path, rank: int) -> None:
        (directory / STATE_DIRNAME).mkdir(parents=True, exist_ok=True)
        torch.save(self.state(), directory / STATE_DIRNAME / f"rank_{rank}.pt")

    def load(self, directory: Path, rank: int) -> Optional[tuple[int, ...]]:
        """This rank's inner optimizer state, the outer state and the step count; the anchor is the loaded
        parameters (a checkpoint holds synchronized ones). Returns the inner steps the checkpoint ran with."""
        path = Path(directory) / STATE_DIRNAME / f"rank_{rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"Checkpoint {directory} has no local-SGD state for rank {rank} ({path.name} in {STATE_DIRNAME}/): it"
                " was not written by a run with the same `sync` on as many ranks. Resume it with the settings it was"
                " trained with."
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.steps_done, self.synchronizations = state["steps_done"], state["synchronizations"]
        if self._inner is not None and state["inner"] is not None:
            self._inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for anchor, parameter in zip(self._anchor, self._parameters):
                anchor.copy_(parameter.detach())
        if self._outer is not None and state["outer"] is not None:
            self._outer.load_state_dict(state["outer"])
        self.error_feedback = state.get("error_feedback")  # (None in a checkpoint of an unquantized run)
        self.samples_since_sync = self.steps_since_sync = 0
        return tuple(state["inner_steps"]) if state.get("inner_steps") else None
