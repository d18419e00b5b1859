"""Wire: the bytes each rank puts on the wire in a training step, inside its node and between nodes.

torch keeps no per-collective byte count for gloo (its flight recorder is NCCL-only) and DeepSpeed's comms logger
sees its own calls only, not those of torch's comm hooks. So while a training step runs (:meth:`WireMeter.counting`),
the collectives of torch.distributed's Python API, and the two that DeepSpeed's comm backend binds at its start,
go through a wrapper that adds up each rank's payload: what the rank contributes (a whole tensor to an all-reduce or
an all-gather, its tensor to a reduce unless it is the destination, a broadcast's tensor on the source only). A
payload to a group that spans nodes counts as between nodes; the algorithm gloo or NCCL picks (ring, tree) is not
modelled. With an emulated slow link (:class:`lightning_hetero.comm.topology.SlowLink`) each collective that spans nodes
is charged ``latency + crossing bytes / bandwidth`` right after it is issued, on every rank in its group; inside
:meth:`WireMeter.in_background`, a collective issued with ``async_op=True`` is charged at its ``wait()`` instead, what
is left of that time since it was issued (the link carries it while the rank computes). An emulated slow sender
(``emulate_slowdown="sends"``, :class:`~lightning_hetero.emulate.emulation.SendsEmulation`) holds its payload back
before the collective is issued (``send_hold``), so the others wait for it inside the collective.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from lightning_hetero.comm.topology import SlowLink, Topology, link_crossing_bytes
from lightning_hetero.runtime.tracing import phase

# (name, the argument holding the payload, who sends it: "all", "not_dst" or "src")
_COLLECTIVES = (
    ("all_reduce", "tensor", "all"),
    ("reduce", "tensor", "not_dst"),
    ("broadcast", "tensor", "src"),
    ("all_gather", "tensor", "all"),
    ("all_gather_into_tensor", "input_tensor", "all"),
    ("all_gather_single", "input_tensor", "all"),
    ("reduce_scatter_tensor", "input", "all"),
    ("reduce_scatter_single", "input", "all"),
    ("reduce_scatter", "input_list", "all"),
    ("all_to_all_single", "input", "all"),
)
# DeepSpeed's comm backend keeps these two as bound functions (TorchBackend.__init__).
_DEEPSPEED_BOUND = {"all_gather_function": "all_gather_into_tensor", "reduce_scatter_function": "reduce_scatter_tensor"}


def payload_bytes(value: Any) -> float:
    if isinstance(value, Tensor):
        return float(value.numel() * value.element_size())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(item) for item in value)
    return 0.0


def senders(who: str, group_ranks: Sequence[int], root: Optional[int]) -> tuple[int, ...]:
    """The ranks of ``group_ranks`` that put the payload on the wire (``root``: the reduce's dst, broadcast's src)."""
    if who == "all" or root is None:
        return tuple(group_ranks)
    if who == "not_dst":
        return tuple(rank for rank in group_ranks if rank != root)
    return (root,)


class WireMeter:
    """This rank's bytes on the wire so far (``intra_node_bytes``, ``inter_node_bytes``) and the link time charged."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        link: Optional[SlowLink] = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.rank = rank
        self.topology = topology
        self.link = link
        self._sleep, self._clock = sleep, clock
        self.intra_node_bytes = 0.0
        self.inter_node_bytes = 0.0
        self.link_seconds = 0.0
        self._depth = 0
        self._group_ranks: dict[Any, tuple[int, ...]] = {}
        # A collective that delegates to another (torch 2.13's all_gather_into_tensor calls all_gather_single) is
        # counted once, at the outer call.
        self._inside = threading.local()
        self._wrappers: dict[str, tuple[Any, Callable[..., Any]]] = {}  # name -> (torch's function, its wrapper)
        self._background = 0  # inside in_background(): asynchronous collectives are charged at their wait
        self._restore: Optional[Callable[[], None]] = None  # while installed
        # Told when a blocking collective of a step starts and ends (the step meter: time blocked waiting for peers)
        self.observer: Optional[Callable[[bool], None]] = None
        # The seconds to hold back this rank's payload of so many bytes before a collective is issued (an emulated
        # slow sender), and the total held so far
        self.send_hold: Callable[[float], float] = lambda payload: 0.0
        self.send_held_seconds = 0.0

    def reading(self) -> tuple[float, float]:
        return self.intra_node_bytes, self.inter_node_bytes

    def record(self, group_ranks: Sequence[int], sending: Sequence[int], payload: float) -> float:
        """Count one collective; return the emulated link's seconds for it (0 without a link or inside a node)."""
        spans = self.topology.spans_nodes(group_ranks)
        if self.rank in sending:
            if spans:
                self.inter_node_bytes += payload
            else:
                self.intra_node_bytes += payload
        if not spans or self.link is None:
            return 0.0
        seconds = self.link.seconds(link_crossing_bytes(self.topology, group_ranks, dict.fromkeys(sending, payload)))
        self.link_seconds += seconds
        return seconds

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count (and charge) every collective issued inside; re-entrant (training_step runs inside optimizer_step).

        Installs the counting wrappers the first time; they stay until :meth:`uninstall` (the hot path only flips a
        depth counter: installing around each step cost a few hundred setattr calls per step)."""
        if self._restore is None:
            self.install()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def in_background(self) -> Iterator[None]:
        """Inside, a collective issued with ``async_op=True`` returns at once and pays the emulated link at its
        ``wait()``, for the part of the link's time that has not passed since it was issued."""
        self._background += 1
        try:
            yield
        finally:
            self._background -= 1

    def install(self) -> None:
        """Wrap torch's collectives (and those DeepSpeed's backend bound) to count while :meth:`counting`."""
        if self._restore is None:
            self._restore = self._install()

    def uninstall(self) -> None:
        """Put torch's and DeepSpeed's collectives back as they were."""
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _install(self) -> Callable[[], None]:
        import torch.distributed.distributed_c10d as c10d

        patched: list[tuple[Any, str, Any]] = []

        def restore() -> None:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)

        try:
            wrappers: dict[str, Any] = {}
            for name, argument, who in _COLLECTIVES:
                original = getattr(c10d, name, None)
                if original is None:
                    continue
                if name not in self._wrappers or self._wrappers[name][0] is not original:
                    self._wrappers[name] = (original, self._wrap(original, argument, who))
                wrappers[name] = self._wrappers[name][1]
                for owner in (dist, c10d):
                    if getattr(owner, name, None) is original:
                        patched.append((owner, name, original))
                        setattr(owner, name, wrappers[name])
            originals = {name: original for _, name, original in patched}
            backend = _deepspeed_backend()
            for attribute, name in _DEEPSPEED_BOUND.items():
                if backend is not None and name in originals and getattr(backend, attribute, None) is originals[name]:
                    patched.append((backend, attribute, originals[name]))
                    setattr(backend, attribute, wrappers[name])
        except BaseException:
            restore()  # never leave torch half-patched
            raise
        return restore

    def _wrap(self, original: Callable[..., Any], argument: str, who: str) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self._depth or getattr(self._inside, "active", False):  # outside a step, or delegated to
                return original(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:  # let torch's own error stand; nothing is sent
                return original(*args, **kwargs)
            group_ranks = self._ranks_of(bound.get("group"))
            root = bound.get("dst", bound.get("src"))
            group_root = bound.get("group_dst", bound.get("group_src"))
            if root is None and group_root is not None:
                root = group_ranks[group_root]
            sending, payload = senders(who, group_ranks, root), payload_bytes(bound.get(argument))
            if self.rank in sending:  # (before the collective: the others wait for this rank inside it)
                hold = self.send_hold(payload)
                if hold > 0:
                    self._sleep(hold)
                    self.send_held_seconds += hold
            self._inside.active = True
            observer = self.observer
            if observer is not None:
                observer(True)
            try:
                with phase(f"exchange: {original.__name__} (waits there for the slowest rank)"):
                    work = original(*args, **kwargs)
            except BaseException:
                if observer is not None:
                    observer(False)
                raise
            finally:
                self._inside.active = False
            seconds = self.record(group_ranks, sending, payload)
            if seconds > 0 and self._background and bound.get("async_op") and work is not None:
                work = LinkDelayedWork(work, self._clock() + seconds, self._sleep, self._clock)
            elif seconds > 0:
                self._sleep(seconds)
            if observer is not None:
                observer(False)
            return work

        return counted

    def _ranks_of(self, group: Optional[Any]) -> tuple[int, ...]:
        if group is None or group is dist.group.WORLD:
            return tuple(range(len(self.topology.nodes)))
        if group not in self._group_ranks:
            self._group_ranks[group] = tuple(dist.get_process_group_ranks(group))
        return self._group_ranks[group]


class LinkDelayedWork:
    """An asynchronous collective on an emulated slow link: its ``wait()`` returns once torch's work is done and the
    link's time since it was issued has passed (``arrives``, on ``clock``)."""

    def __init__(self, work: Any, arrives: float, sleep: Callable[[float], None], clock: Callable[[], float]) -> None:
        self._work, self._arrives, self._sleep, self._clock = work, arrives, sleep, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        done = self._work.wait(*args, **kwargs)
        left = self._arrives - self._clock()
        if left > 0:
            self._sleep(left)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _deepspeed_backend() -> Optional[Any]:
    """DeepSpeed's comm backend in use, or None before ``init_distributed``.

    Read from ``deepspeed.comm.comm``, the module ``init_distributed`` assigns it in: ``deepspeed.comm.cdb`` is the
    copy ``from .comm import *`` made at import, None for good."""
    try:
        import deepspeed.comm.comm as deepspeed_comm
    except ImportError:  # pragma: no cover
        return None
    return getattr(deepspeed_comm, "cdb", None)
