"""Watch: what this rank did in every training step, measured in the loop without a collective.

For each training step a rank records its local compute and the step's wall time. Compute is the profiler's clock
(:func:`~.emulate.slowdown.compute_clock`: the thread's CPU time on CPU, synchronised wall time on CUDA) from
the moment its loader starts fetching the batch to the end of backward, plus the delay an emulated slower device
paid in between; the clock stands still while the thread waits in a gloo collective. The step's wall time runs from
that fetch to the end of its last backward or optimizer step. The fetch's wall time that the host thread did not spend
computing (the loader's worker processes were behind, storage was slow, the dataset slept) is the rank's wait for its
data: counted apart from compute, because more workers or a prefetch removes it where a faster device would not. What
is neither is waiting for the slowest rank in the gradient exchange and the host's own work (the optimizer update).

Where the strategy times DeepSpeed's gradient exchange (:meth:`StepMeter.exchange_entered` / ``exchange_left``), a
record also holds the rank's arrival at it and its wall time inside it. The arrival is the wall time from the end of
the previous step's exchange (which every rank leaves together; the fetch in a fit's first step) to this step's first
exchange, its wait for data and its time blocked in other collectives before it left out (a ``sync_dist`` log waits
there for the others): the rank's whole own work of the step on the wall clock (its optimizer update, its loop, its
compute), with whatever held its process besides (a CPU quota, another process on its core), which its compute clock
does not see. The rank the others wait for arrives last (:func:`~.report.late_rank_summary`). Where
the kernel counts it (Linux's run delay, :func:`~.emulate.slowdown.held_clock`), a record also holds the rank's wall
time runnable but not running, held by a CPU quota or behind another process on its core: a fetch held so is not a
wait for data.

Records are kept until the ranks exchange them, every ``window`` steps, in one small gather the strategy does; every
rank then holds the same numbers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_hetero.runtime.tracing import Span, open_span
from lightning_hetero.split.decisions.replan import DEFAULT_WINDOW

# A step's bytes on the wire, per rank: inside its node, and to groups that span nodes (see wire.py).
WIRE_KINDS = ("intra_node_bytes", "inter_node_bytes")
# A gatherer of one float64 tensor per rank (the same shape on every rank), e.g. torch.distributed.all_gather.
TensorGather = Callable[[Tensor], list[Tensor]]


@dataclass(frozen=True)
class StepRecord:
    step: int  # index of the training step in this fit (0, 1, ...)
    batch_size: int  # this rank's micro-batch
    compute_seconds: float
    step_seconds: float
    intra_node_bytes: float = 0.0  # what this rank put on the wire in the step, inside its node (see wire.py)
    inter_node_bytes: float = 0.0  # ... and to groups spanning nodes
    micro_steps: int = 1  # the micro-batches it took them in
    link_wait_seconds: float = 0.0  # local SGD / DiLoCo: its wall time waiting for merges' exchanges
    data_wait_seconds: float = 0.0  # its wall time waiting for its loader to produce the batch
    arrival_seconds: float = 0.0  # wall time from its batch ready to its first gradient exchange (0: none timed)
    exchange_seconds: float = 0.0  # its wall time inside the gradient exchange (waiting for the others included)
    held_seconds: float = 0.0  # its wall time runnable but not running (a CPU quota, a process on its core)

    @property
    def wait_seconds(self) -> float:
        """The step's wall time waiting for the other ranks (and in the host's own work)."""
        return max(0.0, self.step_seconds - self.compute_seconds - self.data_wait_seconds)


class StepMeter:
    """Per-step compute and wall time of one rank, from calls at the loop's points (no Lightning in here).

    ``compute_clock`` is the rank's compute clock; ``emulated_seconds`` the emulated delay paid so far (it advances
    the wall clock, not the compute clock, and counts as compute of the emulated device); ``wire_bytes`` the bytes
    this rank has put on the wire so far (inside its node, between nodes); ``host_clock`` the CPU time of the thread
    that fetches (None: the compute clock, which is that on CPU; on CUDA the compute clock is wall time, so a stalled
    fetch would count as compute without it).
    """

    def __init__(
        self,
        compute_clock: Callable[[], float],
        emulated_seconds: Callable[[], float] = lambda: 0.0,
        wall_clock: Callable[[], float] = time.perf_counter,
        wire_bytes: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
        link_wait: Callable[[], float] = lambda: 0.0,
        host_clock: Optional[Callable[[], float]] = None,
        held_clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._compute_clock = compute_clock
        self._host_clock = host_clock or compute_clock
        self._held_clock = held_clock
        self._held_at_fetch = 0.0
        self._emulated_seconds = emulated_seconds
        self._wall_clock = wall_clock
        self._wire_bytes = wire_bytes
        self._wire_at_fetch = (0.0, 0.0)
        self._link_wait = link_wait
        self._link_wait_at_fetch = 0.0
        # The open step: wall, compute clock and emulated delay at its fetch; its compute so far; its last activity;
        # the host clock at its fetch; its wait for data; the part of that wait the compute clock counted.
        self._open: Optional[list[float]] = None
        self._batch_size = 0
        self._micro_steps = 1
        self._steps = 0
        self.pending: list[StepRecord] = []
        self._fetching: Optional[Span] = None  # the fetch, as a range of a profiler trace (only while one records)
        # The open step's gradient exchange: wall time at its first entry, inside so far, the open entry's start; the
        # wall time its arrival counts from; how deep in nested entries; when the last exchange (any step's) ended
        self._exchange: list[Optional[float]] = [None, 0.0, None]
        self._arrival_from = 0.0
        self._exchange_depth = 0
        self._last_exchange_end: Optional[float] = None
        # Time blocked in other collectives of the open step before its first gradient exchange (a `sync_dist` log,
        # an agreement: waiting for the others there is not this rank's own work), and the open one's start
        self._blocked_before_arrival = 0.0
        self._blocked_since: Optional[float] = None

    def fetch_started(self) -> None:
        """The loader starts producing the next batch: the previous step (if any) is complete."""
        self._close()
        # The compute clock first: on CUDA it waits for the device, whose work of the last step is not this fetch's.
        compute = self._compute_clock()
        self._open = [self._wall_clock(), compute, self._emulated_seconds(), 0.0, 0.0, self._host_clock(), 0.0, 0.0]
        self._fetching = open_span("fetch the batch (its wall time not computed: the wait for data)")
        self._held_at_fetch = self._held_clock()
        self._wire_at_fetch = self._wire_bytes()
        self._link_wait_at_fetch = self._link_wait()
        self._exchange, self._exchange_depth = [None, 0.0, None], 0
        self._arrival_from = self._open[0] if self._last_exchange_end is None else self._last_exchange_end
        self._blocked_before_arrival, self._blocked_since = 0.0, None

    def collective(self, entered: bool) -> None:
        """A blocking collective of the open step starts (``entered``) or ends: before the step's first gradient
        exchange, the time in it is waiting for the others, left out of the rank's arrival."""
        if self._open is None or self._exchange[0] is not None or self._exchange_depth:
            return
        if entered:
            self._blocked_since = self._wall_clock()
        elif self._blocked_since is not None:
            self._blocked_before_arrival += self._wall_clock() - self._blocked_since
            self._blocked_since = None

    def exchange_entered(self) -> None:
        """This rank enters a gradient exchange of the open step (nested entries count once)."""
        self._exchange_depth += 1
        if self._exchange_depth == 1 and self._open is not None:
            now = self._wall_clock()
            if self._exchange[0] is None:
                self._exchange[0] = now
            self._exchange[2] = now

    def exchange_left(self) -> None:
        self._exchange_depth = max(0, self._exchange_depth - 1)
        start = self._exchange[2]
        if self._exchange_depth == 0 and start is not None:
            now = self._wall_clock()
            self._exchange[1] = (self._exchange[1] or 0.0) + now - start
            self._exchange[2], self._last_exchange_end = None, now

    def batch_ready(self, batch_size: int, micro_steps: int = 1) -> None:
        """The loader handed over the batch: the fetch's wall time the host did not compute was a wait for data."""
        self._batch_size, self._micro_steps = batch_size, micro_steps
        self._end_fetching()
        if self._open is not None:
            host = self._host_clock() - self._open[5]
            emulated = self._emulated_seconds() - self._open[2]  # a delay an emulated device paid is compute
            held = self._held_clock() - self._held_at_fetch  # held by the kernel while it fetched: not the loader's
            self._open[6] = max(0.0, self._wall_clock() - self._open[0] - host - emulated - held)
            self._open[7] = min(self._open[6], max(0.0, self._compute_clock() - self._open[1] - host))

    def backward_ended(self) -> None:
        if self._open is not None:
            compute = self._compute_clock() - self._open[1] + self._emulated_seconds() - self._open[2] - self._open[7]
            self._open[3] = max(self._open[3], compute)  # manual optimization: several backward passes per step
            self._open[4] = self._wall_clock()

    def optimizer_step_ended(self) -> None:
        if self._open is not None:
            self._open[4] = self._wall_clock()

    def training_ended(self) -> None:
        self._close()

    def fit_ended(self) -> None:
        """The next fit's first step counts its arrival from its own fetch (not this fit's last exchange)."""
        self._close()
        self._last_exchange_end = None

    def take(self) -> list[StepRecord]:
        records, self.pending = self.pending, []
        return records

    def _end_fetching(self) -> None:
        if self._fetching is not None:
            self._fetching.end()
            self._fetching = None

    def _close(self) -> None:
        self._end_fetching()
        if self._open is None:
            return
        wall_start, _, _, compute, wall_end, _, data_wait, _ = self._open
        self._open = None
        # Every batch gets a record (compute 0 if no backward ran), so every rank holds as many as the others.
        step_seconds = max(compute + data_wait, wall_end - wall_start) if wall_end else compute + data_wait
        first_entry, inside, _ = self._exchange
        blocked = self._blocked_before_arrival
        arrival = max(0.0, first_entry - self._arrival_from - data_wait - blocked) if first_entry is not None else 0.0
        (intra_start, inter_start), (intra, inter) = self._wire_at_fetch, self._wire_bytes()
        self.pending.append(
            StepRecord(
                self._steps,
                self._batch_size,
                compute,
                step_seconds,
                intra - intra_start,
                inter - inter_start,
                self._micro_steps,
                self._link_wait() - self._link_wait_at_fetch,
                data_wait,
                arrival,
                inside or 0.0,
                max(0.0, self._held_clock() - self._held_at_fetch),
            )
        )
        self._steps += 1


# DeepSpeed's gradient exchanges, on its engine and its ZeRO optimizers (runtime/deepspeed_internals.py lists them):
# the ZeRO-0/1 reduction at the step (or a comm hook in its place), a ZeRO-1/2/3 bucket reduced during backward.
_ENGINE_EXCHANGES = ("allreduce_gradients",)
_OPTIMIZER_EXCHANGES = ("reduce_ipg_grads", "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")


def time_deepspeed_exchanges(engine: Any, meter: StepMeter) -> None:
    """Every gradient exchange of ``engine`` enters and leaves ``meter``'s open step (wrapped on the instances, after
    any replacement of ``engine.allreduce_gradients``, so that it is the one timed)."""
    owners = [(engine, _ENGINE_EXCHANGES), (getattr(engine, "optimizer", None), _OPTIMIZER_EXCHANGES)]
    for owner, names in owners:
        for name in names:
            method = getattr(owner, name, None) if owner is not None else None
            if callable(method):
                setattr(owner, name, _timed(method, meter))


def _timed(method: Callable[..., Any], meter: StepMeter) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        meter.exchange_entered()
        try:
            return method(*args, **kwargs)
        finally:
            meter.exchange_left()

    return timed


class RunWatch:
    """This rank's meter, and every rank's steps of the fit gathered so far (the same list on every rank).

    The training loader calls :meth:`before_fetch` before it fetches each batch, on every rank; every ``window``
    batches the ranks exchange their pending records there in one gather (every rank fetches the same number of
    batches, so they all reach it). ``exchange_seconds`` is what the exchanges cost this rank.
    """

    def __init__(self, meter: StepMeter, window: int = DEFAULT_WINDOW) -> None:
        self.meter = meter
        self.window = window
        self.steps: list[dict[str, Any]] = []
        self.exchange_seconds = 0.0
        self.fetched = 0  # training batches fetched so far in this fit: the index of the step about to start
        self.tracer: Optional[Any] = None  # a StepTracer (watch/trace.py) with HeteroStrategy(trace=...)

    def before_fetch(self, all_gather: TensorGather, after_exchange: Optional[Callable[[], None]] = None) -> bool:
        """Close the previous step, exchange every ``window`` steps (then call ``after_exchange``), open the next.

        True when an exchange ran. Both happen between two steps' measurements: their cost is counted apart.
        """
        self.meter.training_ended()
        if self.tracer is not None and self.fetched > 0:
            self.tracer.step_closed(self.fetched - 1)
        exchanged = self.window > 0 and self.fetched > 0 and self.fetched % self.window == 0
        if exchanged:
            self._exchange(all_gather)
            if after_exchange is not None:
                after_exchange()
        if self.tracer is not None:
            self.tracer.step_opens(self.fetched)
        self.meter.fetch_started()
        self.fetched += 1
        return exchanged

    def finish(self, all_gather: TensorGather) -> list[dict[str, Any]]:
        self.meter.fit_ended()
        if self.tracer is not None:
            self.tracer.stop()  # (a fit shorter than the chosen steps: what it recorded)
        self._exchange(all_gather)
        return self.steps

    def _exchange(self, all_gather: TensorGather) -> None:
        # One tensor collective: every rank holds as many records as the others (one per fetched batch), so the
        # shapes agree; no pickling, as an object gather would need.
        start = time.perf_counter()
        packed = pack_records(self.meter.take())
        if self.window == 0:
            # Window 0: the ranks' steps are not in step (asynchronous merges) and the records are exchanged once, at
            # the end, with as many on every rank: a rank that took fewer steps is padded with empty ones (no samples,
            # no compute), so the k-th entry pairs each rank's k-th step and the totals are every rank's.
            counts = [int(count[0, 0]) for count in all_gather(torch.full((1, _FIELDS), float(len(packed))))]
            padding = torch.zeros(max(counts) - len(packed), _FIELDS, dtype=packed.dtype)
            padding[:, 0] = torch.arange(len(packed), max(counts), dtype=packed.dtype)  # (the step's index)
            packed = torch.cat([packed, padding])
        gathered = all_gather(packed)
        self.steps.extend(job_steps([unpack_records(packed) for packed in gathered]))
        self.exchange_seconds += time.perf_counter() - start


_FIELDS = 12


def pack_records(records: Sequence[StepRecord]) -> Tensor:
    """Records as one ``[n, 12]`` float64 tensor (step, batch size, compute, step seconds, intra- and inter-node
    bytes, micro-steps, the wait on the link in merges, the wait for data, the arrival at the gradient exchange, the
    time inside it, and the time held by the kernel) for a tensor gather."""
    rows = [
        [
            r.step,
            r.batch_size,
            r.compute_seconds,
            r.step_seconds,
            r.intra_node_bytes,
            r.inter_node_bytes,
            r.micro_steps,
            r.link_wait_seconds,
            r.data_wait_seconds,
            r.arrival_seconds,
            r.exchange_seconds,
            r.held_seconds,
        ]
        for r in records
    ]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(records), _FIELDS)


def unpack_records(packed: Tensor) -> list[StepRecord]:
    return [
        StepRecord(
            int(row[0]),
            int(row[1]),
            row[2],
            row[3],
            row[4],
            row[5],
            int(row[6]),
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
        )
        for row in packed.tolist()
    ]


def balance_efficiency(compute_seconds: Sequence[float]) -> float:
    """``sum(compute) / (W * max(compute))`` over the ranks of a step: 1.0 when all compute as long as the slowest."""
    slowest = max(compute_seconds)
    return sum(compute_seconds) / (len(compute_seconds) * slowest) if slowest > 0 else 1.0


def job_steps(records_by_rank: Sequence[Sequence[StepRecord]]) -> list[dict[str, Any]]:
    """Every rank's records of the same steps, as one entry per step (the ``steps`` of the run report)."""
    counts = {len(records) for records in records_by_rank}
    if len(counts) != 1:
        raise ValueError(f"the ranks recorded different numbers of steps: {[len(r) for r in records_by_rank]}")
    return [
        {
            "step": same_step[0].step,
            "batch_sizes": [record.batch_size for record in same_step],
            "micro_steps": [record.micro_steps for record in same_step],
            "compute_seconds": [record.compute_seconds for record in same_step],
            "wait_seconds": [record.wait_seconds for record in same_step],
            "step_seconds": max(record.step_seconds for record in same_step),
            "intra_node_bytes": [record.intra_node_bytes for record in same_step],
            "inter_node_bytes": [record.inter_node_bytes for record in same_step],
            "link_wait_seconds": [record.link_wait_seconds for record in same_step],
            "data_wait_seconds": [record.data_wait_seconds for record in same_step],
            "arrival_seconds": [record.arrival_seconds for record in same_step],
            "exchange_seconds": [record.exchange_seconds for record in same_step],
            "held_seconds": [record.held_seconds for record in same_step],
        }
        for same_step in zip(*records_by_rank)
    ]


def step_metrics(step: dict[str, Any], prefix: str = "hetero") -> dict[str, float]:
    """One step of the run report as flat metrics: each rank's and the job's (see callbacks.HeteroMonitor)."""
    global_batch = sum(step["batch_sizes"])
    metrics = {
        f"{prefix}/samples_per_second": global_batch / step["step_seconds"] if step["step_seconds"] > 0 else 0.0,
        f"{prefix}/balance_efficiency": balance_efficiency(step["compute_seconds"]),
        f"{prefix}/inter_node_bytes": float(sum(step.get("inter_node_bytes", ()))),
    }
    for rank, (size, compute, wait) in enumerate(
        zip(step["batch_sizes"], step["compute_seconds"], step["wait_seconds"])
    ):
        steps = step["micro_steps"][rank] if "micro_steps" in step else 1
        metrics[f"{prefix}/rank_{rank}/micro_batch"] = float(-(-size // steps))  # its largest
        metrics[f"{prefix}/rank_{rank}/micro_steps"] = float(steps)
        # (a global batch of 0: a step in which an asynchronous rank's micro-batch was taken over, padded)
        metrics[f"{prefix}/rank_{rank}/share"] = size / (global_batch or 1)
        metrics[f"{prefix}/rank_{rank}/compute_ms"] = compute * 1e3
        metrics[f"{prefix}/rank_{rank}/wait_ms"] = wait * 1e3
        metrics[f"{prefix}/rank_{rank}/samples_per_second"] = size / compute if compute > 0 else 0.0
    for rank, waited in enumerate(step.get("link_wait_seconds", ())):
        metrics[f"{prefix}/rank_{rank}/link_wait_ms"] = waited * 1e3
    for rank, waited in enumerate(step.get("data_wait_seconds", ())):
        metrics[f"{prefix}/rank_{rank}/data_wait_ms"] = waited * 1e3
    if any(step.get("arrival_seconds", ())):  # (a step with a timed gradient exchange)
        for rank, (arrival, inside) in enumerate(zip(step["arrival_seconds"], step["exchange_seconds"])):
            metrics[f"{prefix}/rank_{rank}/arrival_ms"] = arrival * 1e3
            metrics[f"{prefix}/rank_{rank}/exchange_ms"] = inside * 1e3
    for kind in WIRE_KINDS:
        for rank, sent in enumerate(step.get(kind, ())):
            metrics[f"{prefix}/rank_{rank}/{kind}"] = float(sent)
    return metrics
