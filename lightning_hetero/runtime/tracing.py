"""Runtime: the package's phases as named ranges in a profiler trace (``HeteroStrategy(trace=...)``).

While a trace records (:class:`lightning_hetero.watch.trace.StepTracer` turns it on for the chosen steps), each
phase runs inside ``torch.profiler.record_function("hetero: <phase>")``, which torch's profiler writes into the
Chrome/Perfetto trace, and, on CUDA, inside an NVTX range of the same name, which Nsight Systems shows. Outside a
recording a phase costs one flag test: nothing is recorded.

The phases: fetching the batch (the wait for data), ``training_step`` (the forward), the backward, each collective
of the exchange (where a rank waits for the slowest), the optimizer step (Lightning's: its closure runs the forward
and the backward), inside it the optimizer update (DeepSpeed's step after the closure: the exchange at ZeRO's
boundary and the optimizer), and local SGD's merges.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

PREFIX = "hetero: "
_state = {"recording": False, "nvtx": False}


def start_recording(nvtx: bool) -> None:
    """Phases are recorded from now on (``nvtx``: also as NVTX ranges, on CUDA)."""
    _state.update(recording=True, nvtx=nvtx)


def stop_recording() -> None:
    _state.update(recording=False, nvtx=False)


def recording() -> bool:
    return _state["recording"]


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """The block as the range ``hetero: <name>`` while a trace records."""
    if not _state["recording"]:
        yield
        return
    span = Span(name)
    try:
        yield
    finally:
        span.end()


class Span:
    """A range opened now and closed by :meth:`end` (at another hook than the one that opened it)."""

    def __init__(self, name: str) -> None:
        self._nvtx = _state["nvtx"]
        self._range: Optional[Any] = torch.profiler.record_function(PREFIX + name)
        self._range.__enter__()
        if self._nvtx:
            torch.cuda.nvtx.range_push(PREFIX + name)

    def end(self) -> None:
        if self._range is None:
            return
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._range.__exit__(None, None, None)
        self._range = None


def traced(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``function`` as the phase ``name`` each time it runs (while a trace records); ``function`` itself when it is
    that already (an engine attached again in a later trainer call)."""
    if getattr(function, "hetero_phase", None) == name:
        return function

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with phase(name):
            return function(*args, **kwargs)

    run.hetero_phase = name  # type: ignore[attr-defined]
    return run


def open_span(name: str) -> Optional[Span]:
    """A :class:`Span` while a trace records; None otherwise."""
    return Span(name) if _state["recording"] else None
