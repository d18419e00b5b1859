"""Exchange: the job's gradient exchange, DeepSpeed's own or one that runs DDP comm hooks, flat or hierarchical.

DeepSpeed has no ``register_comm_hook``. At ZeRO-0, with Lightning owning accumulation, the engine reduces every
gradient once per optimizer step, at its step, through ``engine.allreduce_gradients()``
(``buffered_allreduce_fallback``). An instance attribute of that name shadows the method: :class:`HookedExchange`
puts the gradients into buckets shaped like DDP's (``buffer()``, ``gradients()`` as views into it, ``index()``,
``is_last()``, ``parameters()``), which is all torch's hooks use, and runs the hook on each. ZeRO-1/2/3 reduce inside
their optimizer; :func:`lightning_hetero.comm.compression.check_exchange` refuses a hook there.

Hierarchical (:class:`NodeGroups`): each node sums its ranks' buckets onto its leader (one reduce inside the node),
the leaders run the hook among themselves (compression applies only on this slow hop), and each leader broadcasts
the result inside its node. Leaders scale their node's sum by ``nodes / world size`` first, so the hook's average over
leaders is the average over all ranks, as in the flat exchange.

:class:`Communication` is what the strategy holds: the checked arguments, the decisions taken at setup (topology,
hierarchical or not), the wire meter, the hooked exchange and its state in checkpoints.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor

from lightning_hetero.comm import compression as compress
from lightning_hetero.comm.error_bound import ErrorBoundState
from lightning_hetero.comm.topology import SlowLink, Topology, decide_hierarchical
from lightning_hetero.comm.wire import WireMeter
from lightning_hetero.runtime.safe_load import load_package_file

BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
STATE_DIRNAME = "compression"  # per-rank hook state inside a checkpoint directory


class GradientBucket:
    """A bucket of gradients with the interface of ``torch.distributed.GradBucket`` that torch's hooks use."""

    def __init__(self, index: int, parameters: Sequence[torch.nn.Parameter], is_last: bool) -> None:
        self._index = index
        self._parameters = list(parameters)
        self._is_last = is_last
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._parameters]
        self._buffer = torch.cat([grad.detach().reshape(-1) for grad in grads])

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        """Replace the buffer, as DDP's does (torch's ``fp16_compress_wrapper`` hands the inner hook an fp16 one)."""
        self._buffer = buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._parameters

    def gradients(self) -> list[Tensor]:
        """Views into the buffer, shaped like each gradient (hooks write their result through them)."""
        views, offset = [], 0
        for parameter in self._parameters:
            shape = parameter.shape if parameter.dim() else (1,)  # (DDP's buckets hold 0-dim gradients as (1,))
            views.append(self._buffer[offset : offset + parameter.numel()].view(shape))
            offset += parameter.numel()
        return views

    def write_back(self) -> None:
        for parameter, view in zip(self._parameters, self.gradients()):
            if parameter.grad is None:
                parameter.grad = view.reshape(parameter.shape).to(parameter.dtype)
            else:
                parameter.grad.copy_(view.reshape(parameter.shape))


def forget_bucket_state(state: Any) -> None:
    """Drop per-bucket state (error feedback, PowerSGD's P and Q) when the buckets change."""
    if isinstance(state, ErrorBoundState):  # its byte budget counts the buckets it sees; the rest is the inner state's
        state.shapes.clear()
        state.shapes_complete = False
        state = state.inner_state
    for slot in ("error_dict", "p_memory_dict", "q_memory_dict"):
        if isinstance(getattr(state, slot, None), dict):
            getattr(state, slot).clear()


def bucket_parameters(parameters: Sequence[torch.nn.Parameter], cap_bytes: int = BUCKET_CAP_BYTES) -> list[list[Any]]:
    """Consecutive parameters with the same dtype and device, up to ``cap_bytes`` a bucket (one at least)."""
    buckets: list[list[Any]] = []
    size = 0
    for parameter in parameters:
        nbytes = parameter.numel() * parameter.element_size()
        last = buckets[-1] if buckets else None
        same_kind = last is not None and (last[0].dtype, last[0].device) == (parameter.dtype, parameter.device)
        if last is not None and same_kind and size + nbytes <= cap_bytes:
            last.append(parameter)
            size += nbytes
        else:
            buckets.append([parameter])
            size = nbytes
    return buckets


class NodeGroups:
    """The process groups of a hierarchical reduction; every rank creates all of them, in the same order."""

    def __init__(self, topology: Topology, rank: int) -> None:
        self.world_size = len(topology.nodes)
        self.num_nodes = topology.num_nodes
        node_groups = topology.node_groups
        created = [dist.new_group(list(ranks)) for ranks in node_groups]
        mine = topology.nodes[rank]
        self.node_ranks = node_groups[mine]
        self.node_group = created[mine]
        self.leader = self.node_ranks[0]
        self.is_leader = rank == self.leader
        self.leaders_group = dist.new_group(list(topology.leaders))


class HookedExchange:
    """Replaces ``engine.allreduce_gradients``: every gradient averaged over the ranks through ``hook``.

    DeepSpeed calls it after every backward too; like its own method it exchanges only at the accumulation boundary
    (``is_boundary()``: while the engine's step runs, as Lightning owns accumulation), once per optimizer step, so a
    compressing hook sees each step's gradients once. ``should_skip()`` is true for a step every rank has agreed to
    skip (an fp16 overflow): nothing is exchanged, so no inf reaches the hook's error feedback.
    """

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        hook: compress.Hook,
        state: Any,
        nodes: Optional[NodeGroups] = None,
        is_boundary: Callable[[], bool] = lambda: True,
        should_skip: Callable[[], bool] = lambda: False,
        cap_bytes: int = BUCKET_CAP_BYTES,
    ) -> None:
        self.hook = hook
        self.state = state
        self.nodes = nodes
        self.is_boundary = is_boundary
        self.should_skip = should_skip
        self.parameters = list(parameters)
        self.cap_bytes = cap_bytes
        self.buckets = self._current_buckets()

    def _current_buckets(self) -> list[list[Any]]:
        # As DeepSpeed, every step: a parameter frozen or unfrozen during training (fine-tuning schedules) leaves or
        # joins the exchange; empty ones carry nothing.
        trained = [p for p in self.parameters if p.requires_grad and p.numel() > 0]
        return bucket_parameters(trained, self.cap_bytes)

    def __call__(self, *args: Any, **kwargs: Any) -> None:  # DeepSpeed passes bucket_size; our buckets are DDP's
        if not self.is_boundary() or self.should_skip():
            return
        buckets = self._current_buckets()
        if [[id(p) for p in b] for b in buckets] != [[id(p) for p in b] for b in self.buckets]:
            # The same on every rank (same model, same freezing). Per-bucket state no longer fits the buckets.
            forget_bucket_state(self.state)
            self.buckets = buckets
        for index, parameters in enumerate(self.buckets):
            bucket = GradientBucket(index, parameters, is_last=index == len(self.buckets) - 1)
            self._reduce(bucket)
            bucket.write_back()

    def _reduce(self, bucket: GradientBucket) -> None:
        nodes = self.nodes
        if nodes is None:
            self._run_hook(bucket)
            return
        alone = len(nodes.node_ranks) == 1
        if not alone:
            dist.reduce(bucket.buffer(), dst=nodes.leader, group=nodes.node_group)
        if nodes.is_leader:
            bucket.buffer().mul_(nodes.num_nodes / nodes.world_size)  # so the leaders' mean is the mean of all ranks
            self._run_hook(bucket)
        if not alone:
            dist.broadcast(bucket.buffer(), src=nodes.leader, group=nodes.node_group)

    def _run_hook(self, bucket: GradientBucket) -> None:
        result = self.hook(self.state, bucket).wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
        if result is not bucket.buffer():
            bucket.set_buffer(result.to(bucket.parameters()[0].dtype))


class Communication:
    """The job's communication: compression, hierarchical reduction, bytes on the wire, emulated slow link."""

    def __init__(self, choice: compress.CompressionChoice, hierarchical: Union[str, bool]) -> None:
        self.choice = choice
        self.requested_hierarchical = hierarchical
        self.hierarchical = False
        self.hierarchical_reason = "not decided yet"
        self.topology: Optional[Topology] = None
        self.link: Optional[SlowLink] = None
        self.meter: Optional[WireMeter] = None
        self.exchange: Optional[HookedExchange] = None
        self._undo: Optional[Callable[[], None]] = None
        # Told when a blocking collective of a training step starts (True) and ends (False): the step meter's
        self.collective_observer: Optional[Callable[[bool], None]] = None
        self.send_hold: Callable[[float], float] = lambda payload: (
            0.0
        )  # (an emulated slow sender: emulate/emulation.py)

    def arguments(self) -> dict[str, Any]:
        """What must agree between ranks."""
        return {"compression": self.choice.describe(), "hierarchical": self.requested_hierarchical}

    def setup(
        self,
        topology: Topology,
        link: Optional[SlowLink],
        config: dict[str, Any],
        stage: int,
        rank: int,
        exchange_elsewhere: Optional[str] = None,
    ) -> None:
        """``exchange_elsewhere``: why the gradients are exchanged by another part of the package (memory-sized
        shards reduce them to their owners), None when DeepSpeed's exchange (or this one's hook) runs."""
        self.topology, self.link = topology, link
        blocker = compress.hierarchical_blocker(self.choice, config)
        if exchange_elsewhere is not None:  # (True was refused in the constructor)
            self.hierarchical, self.hierarchical_reason = False, f"off: {exchange_elsewhere}"
        elif blocker and self.requested_hierarchical == "auto":  # (True was refused in the constructor)
            self.hierarchical, self.hierarchical_reason = False, f"off: {blocker}"
        elif stage in compress.HOOK_STAGES:
            self.hierarchical, self.hierarchical_reason = decide_hierarchical(self.requested_hierarchical, topology)
        else:  # (True was refused in the constructor)
            self.hierarchical = False
            self.hierarchical_reason = f"off: ZeRO-{stage} reduces inside DeepSpeed's optimizer (stage 0 only)"
        self.meter = WireMeter(rank, topology, link)
        self.meter.observer = self.collective_observer
        self.meter.send_hold = self.send_hold

    @property
    def hooked(self) -> Optional[str]:
        return compress.hooked_exchange_reason(self.choice, self.hierarchical)

    def deepspeed_entries(self) -> dict[str, Any]:
        return compress.deepspeed_entries(self.choice, self.hooked is not None)

    def reading(self) -> tuple[float, float]:
        """Bytes on the wire so far (inside the node, between nodes)."""
        return self.meter.reading() if self.meter is not None else (0.0, 0.0)

    def counting(self) -> contextlib.AbstractContextManager:
        return self.meter.counting() if self.meter is not None else contextlib.nullcontext()

    def in_background(self) -> contextlib.AbstractContextManager:
        """Asynchronous collectives issued inside pay an emulated slow link at their wait (see wire.py)."""
        return self.meter.in_background() if self.meter is not None else contextlib.nullcontext()

    def attach(self, engine: Any, rank: int, should_skip: Callable[[], bool]) -> None:
        """After DeepSpeed's init, on every rank: the hooked exchange replaces DeepSpeed's (creates process groups)."""
        if self.hooked is None:
            return
        compress.check_hookable(
            self.hooked,
            deepspeed_fp16=engine.fp16_enabled(),
            deepspeed_bf16=engine.bfloat16_enabled() or hasattr(engine.optimizer, "get_grads_for_reduction"),
            torch_autocast=engine.torch_autocast_enabled(),
            moe=bool(getattr(engine, "has_moe_layers", False)),
            averages=bool(getattr(engine, "gradient_average", True)),
        )
        assert self.topology is not None
        nodes = NodeGroups(self.topology, rank) if self.hierarchical else None
        hook, state = compress.builtin_hook(self.choice, nodes.leaders_group if nodes is not None else None)
        self.exchange = HookedExchange(
            engine.module.parameters(), hook, state, nodes, engine.is_gradient_accumulation_boundary, should_skip
        )
        engine.allreduce_gradients = self.exchange
        if isinstance(state, ErrorBoundState):  # its checks are recorded at the optimizer step (a resume's too)
            state.step_label = lambda: int(getattr(engine, "global_steps", state.steps_done))
        self._undo = lambda: engine.__dict__.pop("allreduce_gradients", None)

    def detach(self) -> None:
        if self.meter is not None:
            self.meter.uninstall()  # (installed by the first counting(), kept for the fit)
        if self._undo is not None:
            self._undo()
        self._undo = None

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_facts(self) -> dict[str, Any]:
        """What the manifest records, so that a resume can tell whether the saved hook state fits this job."""
        return {
            "compression": self.choice.describe(),
            "hierarchical": self.hierarchical,
            "nodes": list(self.topology.nodes) if self.topology is not None else None,
            "hook_state": self.exchange is not None and compress.hook_state_dict(self.exchange.state) is not None,
        }

    def save(self, directory: Path, rank: int) -> None:
        """This rank's hook state (error feedback differs by rank) into the checkpoint directory being staged."""
        saved = compress.hook_state_dict(self.exchange.state) if self.exchange is not None else None
        if saved is not None:
            (directory / STATE_DIRNAME).mkdir(parents=True, exist_ok=True)
            torch.save(saved, directory / STATE_DIRNAME / f"rank_{rank}.pt")

    def load(self, directory: Path, rank: int, manifest: dict[str, Any], same_world_size: bool) -> None:
        """Restore this rank's hook state when the checkpoint's fits this job; otherwise it starts afresh."""
        if self.exchange is None or compress.hook_state_dict(self.exchange.state) is None:
            return  # nothing to restore (a plain or half-precision exchange, a custom hook without state_dict)
        saved = manifest.get("communication")
        if saved is not None and not saved.get("hook_state"):
            saved = None
        fresh = compress.restore_blocker(saved, self.checkpoint_facts(), same_world_size)
        if fresh is not None:
            if rank == 0:
                message = f"HeteroStrategy: the {self.choice.describe()} state starts afresh: {fresh}."
                warnings.warn(message, stacklevel=2)
            return
        state = load_package_file(Path(directory) / STATE_DIRNAME / f"rank_{rank}.pt")
        device = self.exchange.parameters[0].device if self.exchange.parameters else torch.device("cpu")
        compress.load_hook_state_dict(self.exchange.state, move_data_to_device(state, device))

    def error_bound(self) -> Optional[ErrorBoundState]:
        """The compression's error bound (``max_error``), where this rank runs the hook; else None (in a hierarchical
        reduction only the node leaders do)."""
        exchange = self.exchange
        if exchange is None or (exchange.nodes is not None and not exchange.nodes.is_leader):
            return None
        return exchange.state if isinstance(exchange.state, ErrorBoundState) else None

    def summary(self) -> dict[str, Any]:
        bound = self.error_bound()
        return {
            "compression": self.choice.describe(),
            "error_bound": bound.summary() if bound is not None else None,
            "exchange": self.hooked or "DeepSpeed's",
            "hierarchical": self.hierarchical,
            "hierarchical_reason": self.hierarchical_reason,
            "topology": self.topology.describe() if self.topology is not None else None,
            "nodes": list(self.topology.nodes) if self.topology is not None else None,
            "emulated_link": None if self.link is None else vars(self.link),
        }

    def plan_line(self) -> str:
        link = f"; emulated link {self.link.gbit_per_second:g} Gbit/s, {self.link.latency_ms:g} ms" if self.link else ""
        return (
            f"communication: {self.choice.describe() or 'uncompressed'}, {'hooked' if self.hooked else 'DeepSpeed'}"
            f" exchange; hierarchical {self.hierarchical_reason}{link}"
        )
