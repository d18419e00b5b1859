"""Train: local SGD and DiLoCo, the synchronization (see :mod:`lightning_hetero.local.inner_steps` for the idea).

:class:`LocalTraining` keeps, for one fit, the parameters as they were at the last synchronization (the anchor), the
samples this rank trained on since, and DiLoCo's outer optimizer. Between synchronizations DeepSpeed's engine steps
this rank's own (inner) optimizer on its own gradients (its exchange switched off). At a synchronization every rank
sends its pseudo-gradient ``anchor - parameters`` weighted by its share of the samples trained on since the last one
(one all-reduce of the sample counts, one of the weighted deltas, in fp32 or the ``compression`` half precision; with
``compression="int8"``/``"int4"`` a gather of each rank's quantized delta instead, see :mod:`~.comm.quantize`), and
every rank applies the same outer step to the anchor: ``anchor - average`` for local SGD (the sample-weighted average
of the ranks' parameters), an outer SGD step with the average as its gradient for DiLoCo. Every rank then holds the
same parameters, which become the next anchor. With ``sync_options={"fragments": F}`` (streaming) the model's values
are cut into F contiguous fragments of equal size (inside a tensor where one ends there,
:mod:`~lightning_hetero.local.fragments`) that merge in turn, one every ``sync_every / F`` steps, each weighted by the
samples since its own last merge; between its merges a fragment trains on, so 1/F of the model crosses the wire at a
time. The anchor, and DiLoCo's outer optimizer, hold one tensor per piece of a parameter tensor (the tensor itself where
it is not cut).

With ``sync_options={"overlap": True}`` a merge inside an epoch does not wait for the link. The ranks sum their
sample counts (a few bytes), start the exchange of their weighted progress in the background and train on;
``"overlap_steps": k`` training steps later (1 by default, at most the next merge) each rank waits for it and applies
its outer step, stale by k steps (as streaming DiLoCo's overlap; the step is counted, not the arrival, so every rank
applies it at the same step). Meanwhile each rank trains on from the outer step its own progress would give if it
were the average (eager DiLoCo, Kale et al. 2025; the outer optimizer's state left alone), or with ``"eager": False``
from its own parameters; when the average arrives, its parameters become the new anchor, the same on every rank, plus
what the rank trained since it sent. An epoch's end, a checkpoint and a validation wait for the merge in flight and
then merge what the ranks trained since, so they see one model. It keeps one more copy of the parameters (what each
rank trained from since it last sent; docs/local-sgd.md compares the two stand-ins over 20 seeds).

A checkpoint is a synchronization (the strategy synchronizes before saving), so what it must add to DeepSpeed's files
is per rank: each rank's inner optimizer state (DeepSpeed's ZeRO-0 checkpoint holds rank 0's only), the outer
optimizer state, the count of training steps and a quantized merge's error feedback, restored by :meth:`load`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.comm import quantize
from lightning_hetero.local.fragments import Piece, due_fragments, fragment_pieces
from lightning_hetero.recover.checkpoint import LOCAL_STATE_DIRNAME
from lightning_hetero.runtime.safe_load import load_package_file

STATE_DIRNAME = LOCAL_STATE_DIRNAME  # (each rank's file in it: rank_<r>.pt)
_DTYPES = {None: torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# Starts one exchange of a merge in the background: ``(tensor, quantized)`` -> a wait; the tensor is summed over the
# ranks in place (the wait returns None), or quantized, gathered (the wait returns every rank's, in rank order).
Background = Callable[[Tensor, bool], Callable[[], Any]]


@dataclass
class InFlightMerge:
    """A merge sent and not yet applied: the pieces it merges, and a wait for the ranks' average."""

    pieces: list[int]
    average: Callable[[], Tensor]
    sent_at: int  # the training step (of the fit) it was sent after


class LocalTraining:
    """This rank's side of local SGD / DiLoCo for one strategy (``outer``: DiLoCo's settings, None for local SGD;
    ``fragments``: the streaming merge's, 1 merges every parameter at once; ``overlap``: None waits for each merge,
    else the training steps after which a merge sent in the background is applied; ``eager``: meanwhile the rank trains
    on from its own progress's outer step, else from its own parameters)."""

    def __init__(
        self,
        mode: str,
        sync_every: int,
        outer: Optional[dict[str, Any]],
        compression: Optional[str],
        fragments: int = 1,
        overlap: Optional[int] = None,
        eager: bool = True,
    ) -> None:
        self.mode, self.sync_every, self.outer_settings = mode, sync_every, outer
        self.fragments, self.overlap_steps, self.eager = fragments, overlap, eager
        self.overlap = overlap is not None
        self.wire_dtype = _DTYPES.get(compression, torch.float32)
        self.quantized_bits: Optional[int] = quantize.BITS.get(compression or "")
        # What rounding left out of this rank's quantized deltas so far, one value per parameter value in the model's
        # order: added to its next merge (None: nothing yet).
        self.error_feedback: Optional[Tensor] = None
        self.steps_done = 0  # training steps of this fit (Lightning batches, the same count on every rank)
        self.synchronizations = 0  # merges (of one fragment or more)
        # Per fragment, since its last merge: the samples this rank trained on, and the training steps (the same on
        # every rank: what decides an extra synchronization).
        self._samples: list[int] = [0] * fragments
        self._steps: list[int] = [0] * fragments
        self._pieces: list[Piece] = []  # the parameter tensors' pieces (local/fragments.py)
        self._bounds: list[tuple[int, int]] = [(0, 0)]  # each fragment's pieces [begin, end)
        self._parameters: list[torch.nn.Parameter] = []
        self._anchor: list[Tensor] = []  # per piece
        # Overlap: what each piece trained from since its last merge was sent (without overlap, the anchor)
        self._base: list[Tensor] = []
        self._in_flight: Optional[InFlightMerge] = None
        # Wall time this rank waited for its merges' exchanges (the link), not for the other ranks to reach a merge
        self.link_wait_seconds = 0.0
        self._outer: Optional[torch.optim.SGD] = None
        self._outer_parameters: list[torch.nn.Parameter] = []  # DiLoCo: the anchor as the outer optimizer's
        self._inner: Any = None
        # Reads the inner steps in force (the split's), which a checkpoint records: set by the job.
        self.inner_steps: Optional[Callable[[], tuple[int, ...]]] = None

    @property
    def samples_since_sync(self) -> int:
        """The samples this rank trained on since the least recently merged fragment's merge."""
        return max(self._samples)

    @samples_since_sync.setter
    def samples_since_sync(self, samples: int) -> None:
        self._samples = [samples] * self.fragments

    @property
    def steps_since_sync(self) -> int:
        """Training steps since the least recently merged fragment's merge (0: every rank holds the same model)."""
        return max(self._steps)

    @steps_since_sync.setter
    def steps_since_sync(self, steps: int) -> None:
        self._steps = [steps] * self.fragments

    def attach(self, parameters: list[torch.nn.Parameter], inner_optimizer: Any) -> None:
        """DeepSpeed's engine exists: anchor the parameters it trains, create the outer optimizer over the anchor.
        The fragments are cut here, the same on every rank (the same model); too many for its values is refused
        before any collective."""
        uncut = [index for index, p in enumerate(parameters) if not p.is_contiguous()]  # (a piece is a view)
        self._pieces, self._bounds = fragment_pieces([p.numel() for p in parameters], self.fragments, uncut)
        self._parameters, self._inner = parameters, inner_optimizer
        self._anchor = [self._values(piece).clone() for piece in range(len(self._pieces))]
        self._base = [anchor.clone() for anchor in self._anchor] if self.overlap else []
        self._in_flight = None
        self.samples_since_sync = self.steps_since_sync = 0
        self.error_feedback = None  # (a resume restores its own, in load)
        self._outer = None
        if self.outer_settings is not None:
            settings = self.outer_settings
            self._outer_parameters = [torch.nn.Parameter(anchor, requires_grad=False) for anchor in self._anchor]
            self._anchor = [p.data for p in self._outer_parameters]
            self._outer = torch.optim.SGD(
                self._outer_parameters,
                lr=settings["outer_lr"],
                momentum=settings["outer_momentum"],
                nesterov=settings["nesterov"],
            )

    def detach(self) -> None:
        """The fit ended (a merge still in flight after a failure is dropped: its peers may be gone)."""
        self._parameters, self._anchor, self._outer, self._inner = [], [], None, None
        self._outer_parameters, self._base, self._in_flight = [], [], None

    @property
    def merge_pending(self) -> bool:
        """Whether a synchronization would change anything: a rank trained since a fragment's merge, or a merge is
        still in flight (overlap)."""
        return self.steps_since_sync > 0 or self._in_flight is not None

    def step_done(
        self,
        samples: int,
        last_of_epoch: bool,
        all_reduce: Callable[[Tensor], None],
        gather: Optional[Callable[[Tensor], list[Tensor]]] = None,
        start: Optional[Background] = None,
    ) -> bool:
        """A training step ended on this rank after ``samples`` samples: merge the fragments that are due (every
        ``sync_every`` steps each, in turn, and all at the end of an epoch; the same decision on every rank). True if
        any did. With overlap, a merge inside an epoch is sent through ``start`` and applied ``overlap`` steps later."""
        self.steps_done += 1
        self._steps = [steps + 1 for steps in self._steps]
        self._samples = [done + samples for done in self._samples]
        in_flight = self._in_flight
        if in_flight is not None and self.steps_done - in_flight.sent_at >= (self.overlap_steps or 0):
            self._finish_in_flight()  # (the same step on every rank: a count of steps, not the arrival)
        due = due_fragments(self.steps_done, self.sync_every, self.fragments, last_of_epoch)
        if not due:
            return False
        if self.overlap and not last_of_epoch:
            assert start is not None, "an overlapped merge starts its exchange in the background"
            self._finish_in_flight()
            if self._parameters:
                self._in_flight = self._send(sorted(due), all_reduce, start, background=True)
            return True
        self.synchronize(all_reduce, gather, due)
        return True

    def synchronize(
        self,
        all_reduce: Callable[[Tensor], None],
        gather: Optional[Callable[[Tensor], list[Tensor]]] = None,
        fragments: Optional[Sequence[int]] = None,
    ) -> None:
        """The outer step of ``fragments`` on every rank, waited for; when None, of every fragment trained since its
        last merge (before a checkpoint or an evaluation: a fragment just merged is not merged again, which would
        move DiLoCo's anchor by its momentum alone). A merge in flight is applied first. ``all_reduce`` sums a
        tensor over the ranks in place; ``gather`` returns every rank's tensor in rank order, needed by a quantized
        merge."""
        self._finish_in_flight()
        if fragments is None:
            fragments = [fragment for fragment in range(self.fragments) if self._steps[fragment] > 0]
        if self._parameters and fragments:

            def blocking(tensor: Tensor, quantized: bool) -> Callable[[], Any]:
                if not quantized:
                    all_reduce(tensor)
                    return lambda: None
                assert gather is not None, "a quantized merge gathers the ranks' deltas"
                gathered = gather(tensor)
                return lambda: gathered

            self._in_flight = self._send(sorted(fragments), all_reduce, blocking)
            self._finish_in_flight()

    def _send(
        self, merging: list[int], all_reduce: Callable[[Tensor], None], start: Background, background: bool = False
    ) -> InFlightMerge:
        """Start the merge of the fragments ``merging``: the ranks' sample counts (summed now: they weigh what is
        sent), then this rank's weighted progress since each fragment was last sent, through ``start``
        (``background``: applied later, the rank taking the eager step meanwhile if :attr:`eager`)."""
        pieces = [index for fragment in merging for index in range(*self._bounds[fragment])]
        device = self._anchor[0].device  # (NCCL reduces CUDA tensors only)
        counts = torch.tensor(
            [float(self._samples[fragment]) for fragment in merging], dtype=torch.float64, device=device
        )
        all_reduce(counts)
        with torch.no_grad():
            weighted_parts = []
            for fragment, total in zip(merging, counts.tolist()):
                share = self._samples[fragment] / total if total > 0 else 0.0
                begin, end = self._bounds[fragment]
                delta = torch.cat([self._progress(index).reshape(-1) for index in range(begin, end)])
                weighted_parts.append(delta.double() * share)
            weighted = torch.cat(weighted_parts)
            for index in pieces if self.overlap else ():  # what trains on from here is the next merge's
                if background and self.eager:  # until the average arrives: the outer step of its own progress
                    self._values(index).copy_(self._eager_anchor(index, self._progress(index)))
                self._base[index].copy_(self._values(index))
            dtype = functools.reduce(torch.promote_types, [self._anchor[index].dtype for index in pieces])
            if self.quantized_bits is None:
                on_wire = weighted.to(self.wire_dtype)
                wait = self._timed_exchange(start, on_wire, False)

                def average() -> Tensor:
                    wait()
                    return on_wire.to(dtype)

            else:
                # (quantized on the CPU: the gather returns CPU tensors; the feedback stays there, as it is saved)
                payload, scales = self._quantize(weighted.float().cpu(), pieces)
                payloads = self._timed_exchange(start, payload, True)
                scale_lists = self._timed_exchange(start, scales, True)
                numel, bits = weighted.numel(), self.quantized_bits

                def average() -> Tensor:
                    total = torch.zeros(numel, dtype=torch.float64)
                    for rank_payload, rank_scales in zip(payloads(), scale_lists()):
                        total += quantize.dequantize(rank_payload, rank_scales, bits, numel).double()
                    return total.to(device, dtype)

        for fragment in merging:
            self._samples[fragment] = self._steps[fragment] = 0
        return InFlightMerge(pieces, average, self.steps_done)

    def _timed_exchange(self, start: Background, tensor: Tensor, quantized: bool) -> Callable[[], Any]:
        """``start(tensor, quantized)``, with the time spent in it and in its wait added to :attr:`link_wait_seconds`
        (every rank has reached the merge by then: the sum of the sample counts waited for the last one)."""
        started = time.perf_counter()
        wait = start(tensor, quantized)
        self.link_wait_seconds += time.perf_counter() - started

        def waited() -> Any:
            started = time.perf_counter()
            result = wait()
            self.link_wait_seconds += time.perf_counter() - started
            return result

        return waited

    def _finish_in_flight(self) -> None:
        """Wait for the merge in flight, if any, and apply its outer step: the anchor moves on every rank alike; each
        rank's parameters become the new anchor with what the rank trained since the merge was sent on top."""
        merge, self._in_flight = self._in_flight, None
        if merge is None:
            return
        average = merge.average()
        with torch.no_grad():
            offset = 0
            for index in merge.pieces:
                anchor = self._anchor[index]
                pseudo_gradient = average[offset : offset + anchor.numel()].view_as(anchor)
                offset += anchor.numel()
                if self._outer is None:
                    anchor.sub_(pseudo_gradient)
                else:
                    self._outer_parameters[index].grad = pseudo_gradient.clone()
            if self._outer is not None:
                self._outer.step()  # (SGD leaves the parameters without a gradient, the other fragments', as they are)
                self._outer.zero_grad(set_to_none=True)
            for index in merge.pieces:
                parameter, anchor = self._values(index), self._anchor[index]
                if self.overlap:
                    trained_since = self._base[index] - parameter
                    parameter.copy_(anchor - trained_since)
                    self._base[index].copy_(anchor)
                else:
                    parameter.copy_(anchor)
        self.synchronizations += 1

    def _eager_anchor(self, index: int, progress: Tensor) -> Tensor:
        """Piece ``index``'s anchor after the outer step (torch's SGD, the outer optimizer's, its state untouched)
        this rank would take if its own ``progress`` were the ranks' average: eager DiLoCo's stand-in."""
        anchor = self._anchor[index]
        if self._outer is None:
            return anchor - progress  # local SGD's outer step is the average itself
        group = self._outer.param_groups[0]
        step, momentum = progress, group["momentum"]
        if momentum:
            buffer = self._outer.state.get(self._outer_parameters[index], {}).get("momentum_buffer")
            buffer = progress.clone() if buffer is None else buffer * momentum + progress
            step = progress + momentum * buffer if group["nesterov"] else buffer
        return anchor - group["lr"] * step

    def _values(self, index: int) -> Tensor:
        """Piece ``index`` of this rank's parameters, written through: the tensor itself when it is whole."""
        tensor, begin, end = self._pieces[index]
        parameter = self._parameters[tensor].detach()
        return parameter if end - begin == parameter.numel() else parameter.view(-1)[begin:end]

    def _progress(self, index: int) -> Tensor:
        """What piece ``index`` trained since it was last sent (the anchor is its base without overlap)."""
        base = self._base[index] if self.overlap else self._anchor[index]
        return base - self._values(index)

    def _quantize(self, weighted: Tensor, pieces: list[int]) -> tuple[Tensor, Tensor]:
        """This rank's weighted deltas of ``pieces`` with its error feedback added, quantized; what rounding left out
        becomes the feedback of those pieces for their next merge (kept in the model's order of values)."""
        assert self.quantized_bits is not None
        if self.error_feedback is None:
            self.error_feedback = torch.zeros(sum(p.numel() for p in self._parameters), dtype=torch.float32)
        starts = [0, *itertools.accumulate(end - begin for _, begin, end in self._pieces)]
        ranges = [(starts[index], starts[index + 1]) for index in pieces]
        return quantize.quantize_with_feedback(weighted, self.error_feedback, ranges, self.quantized_bits)

    # ------------------------------------------------------------------ checkpoints (taken at a synchronization)

    def state(self) -> dict[str, Any]:
        assert self._in_flight is None, "a checkpoint is taken at a synchronization, with no merge in flight"
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
        state = load_package_file(path)
        self.steps_done, self.synchronizations = state["steps_done"], state["synchronizations"]
        if self._inner is not None and state["inner"] is not None:
            self._inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for index, copy in itertools.chain(enumerate(self._anchor), enumerate(self._base)):  # (base: overlap's)
                copy.copy_(self._values(index))
        if self._outer is not None and state["outer"] is not None:
            _check_outer_pieces(state["outer"], self._anchor, directory)
            self._outer.load_state_dict(state["outer"])
        self.error_feedback = state.get("error_feedback")  # (None in a checkpoint of an unquantized run)
        values = sum(parameter.numel() for parameter in self._parameters)
        if self.error_feedback is not None and self.error_feedback.numel() != values:
            raise ValueError(
                f"Checkpoint {directory} holds rank {rank}'s quantized-merge error feedback for"
                f" {self.error_feedback.numel()} parameter values, and the model trains {values}: it was written"
                " for another model. Resume it with the model it was trained with."
            )
        self.samples_since_sync = self.steps_since_sync = 0
        return tuple(state["inner_steps"]) if state.get("inner_steps") else None


def _check_outer_pieces(outer: dict[str, Any], anchor: list[Tensor], directory: Path) -> None:
    """DiLoCo's saved outer state fits this fit's pieces (torch's SGD checks their count only, not their shapes)."""
    saved = [outer["state"].get(index, {}).get("momentum_buffer") for index in outer["param_groups"][0]["params"]]
    shapes = [tuple(buffer.shape) if buffer is not None else tuple(piece.shape) for buffer, piece in zip(saved, anchor)]
    if len(saved) != len(anchor) or shapes != [tuple(piece.shape) for piece in anchor]:
        raise ValueError(
            f"Checkpoint {directory} holds DiLoCo's outer momentum for {len(saved)} parameter pieces, not this fit's"
            f" {len(anchor)} (or of other shapes): it was written with other `sync_options['fragments']`. Resume it"
            " with the fragments it was written with; one written before fragments were cut inside tensors (its"
            " outer state per tensor) resumes with fragments=1."
        )
