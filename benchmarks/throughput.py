"""Throughput benchmark of HeteroStrategy on CPU: equal split vs automatic split vs a perfectly balanced split.

    python benchmarks/throughput.py                               # every scenario (about 5 minutes on 2 cores)
    python benchmarks/throughput.py --scenarios 2-emulated        # a subset
    python benchmarks/throughput.py --quick                       # smoke run (about 1 minute): noisy figures
    python benchmarks/throughput.py --rounds 3 --steps 60 --out /tmp/throughput.json

Scenarios (ZeRO-2, gloo, ``accelerator="cpu"``, one intra-op thread per rank, global batch B = 1024):

    2-emulated       2 ranks, emulated speeds [1.0, 0.4]
    4-emulated       4 ranks, emulated speeds [1.0, 1.0, 0.5, 0.25]     (asks for 2.75 cores of 2: see README)
    4-emulated-half  4 ranks, emulated speeds [0.5, 0.5, 0.25, 0.125]  (same ratios, 1.4 cores on average)
    2-identical      2 ranks, no emulation (identical hardware)

Two ways to split, each a separate ``Trainer.fit``:

    equal   ``HeteroStrategy(batch_sizes=[B/W] * W)``: what DDP would do
    auto    ``HeteroStrategy(global_batch_size=B)``: every rank profiles its step, the planner splits

Each scenario is one bounded child job (this script re-run with ``--run``; Lightning's subprocess launcher re-runs that
command line for the other ranks) that runs ``--rounds`` rounds of one equal and one auto fit, in ABBA order (equal,
auto, auto, equal, ...), in the same processes. A round's two fits are adjacent in time, so the ratios between them
(auto/equal, auto/ideal) are taken per round and a slow drift of the machine's speed cancels; the table gives the
medians over rounds. Rank 0 gathers every rank's timestamps and writes them, with the plan (``plan.json``), as JSON.

The model is an MLP on synthetic data whose wide hidden layer (512) is applied 4 times with tied weights: much
compute per sample for few parameters (0.3 M), so the ZeRO-2 gradient reduce, parameter all-gather and Adam step stay
small next to the compute; the ``overhead`` column says how small.

Measured per rank and per training step (one machine-wide monotonic clock; ``time.sleep`` is wrapped to count the
seconds the emulator sleeps):

    fetch      previous ``on_train_batch_end`` -> ``on_train_batch_start`` (data loading, loop bookkeeping)
    forward    ``on_train_batch_start`` -> ``on_before_backward`` (``training_step`` including the emulated slowdown
               of the forward)
    backward   ``on_before_backward`` -> the last parameter-gradient hook (autograd's local backward, with any
               emulated slowdown paid before a gradient bucket that filled up during backward was reduced)
    bwd_sleep  seconds slept from the last gradient hook to the step's end: the rest of the emulated backward
               slowdown, "pre" before DeepSpeed's backward returned (the strategy pays it before the gradient reduce)
               or "post" after it (only if the emulation slept after the reduce, which it should not)
    step       rank 0's ``on_train_batch_end`` -> next ``on_train_batch_end`` (the job's step: ranks run in lockstep)

``local = fetch + forward + backward + bwd_sleep`` is everything a rank does on its own in a step, without waiting
for another rank (no collective runs in those intervals: the model logs nothing with ``sync_dist``). A fit's
throughput is ``B / median(step)`` over the measured steps (after ``--warmup``).

The perfectly balanced split ("ideal"), derived per round from its equal and auto fit:

1. Each rank's local time is a line in its micro-batch, ``L_r(b) = a_r + c_r * b``, through its two (micro-batch,
   median local time) points, one per fit. When the two sizes are closer than 5 % (or 8 samples), as on identical
   hardware where the auto split is the equal one, or the slope comes out <= 0 (noise), the line goes through the
   origin instead (``a_r = 0``, ``c_r`` = mean of ``L / b``).
2. The continuous balanced split has every rank finish its local work at the same time ``T``:
   ``sum_r (T - a_r) / c_r = B``, so ``T = (B + sum_r a_r / c_r) / sum_r (1 / c_r)`` and ``b_r = (T - a_r) / c_r``
   (a rank whose ``b_r`` would be negative gets 0 and ``T`` is solved again without it).
3. The rest of a step is not local work: gradient reduce, Adam on the rank's ZeRO partition, parameter all-gather,
   Lightning's bookkeeping. Each fit measures it as ``overhead = median(step) - median over steps of max_r local_r``;
   the ideal adds the mean of the round's two fits' overheads (the details also give it with either one alone).
4. ``ideal step = T + overhead``, ``ideal samples/s = B / ideal step``.

The ideal is an estimate, not a bound: it assumes each rank's local time is linear in its batch and that the overhead
does not depend on the split. The second assumption would fail if the emulation slept a slowed rank's backward
slowdown after the gradient reduce: in a balanced split that sleep would run while the others wait in the all-gather
instead of overlapping their compute. The "emul. tail" column checks that it does not (estimated per step as
``max_r(local_r - post_r) + max_r(post_r) - max_r(local_r)`` with ``post_r`` the sleep after the reduce; it was
about 20 ms per step before the emulator paid the delay before the exchange). With more ranks than cores (4 ranks on
2 cores) a rank's local wall time also depends on how many ranks compute at once, which no per-rank line can capture.

Other processes on the machine: rank 0 reads ``/proc/stat`` at every step's end; the CPU time the machine spent
minus every rank's process CPU time, over a centred window of 5 steps, is the "foreign load" in cores. Only steps
with at most ``--max-foreign-load`` cores of it count; a fit with fewer than 8 such steps is disturbed, and its round
is left out (unless every round is). The per-fit details keep everything, disturbed or not.

Reported per scenario: equal, auto and ideal samples/s, auto/ideal, auto/equal, the auto split's micro-batches, the
planner's predicted speedup over the equal split and the profiling wall time (from ``<root>/hetero/plan.json``), the
overhead share, the emulation tail, the ranks' CPU share, and the rounds used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

SCENARIOS: dict[str, tuple[int, Optional[list[float]]]] = {
    "2-emulated": (2, [1.0, 0.4]),
    "4-emulated": (4, [1.0, 1.0, 0.5, 0.25]),
    # The same ratios at half speed: the four ranks then ask for 1.4 of the 2 cores on average, not 2.75.
    "4-emulated-half": (4, [0.5, 0.5, 0.25, 0.125]),
    "2-identical": (2, None),
}
SPLITS = ("equal", "auto")
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "throughput.json"
# Two-point line fits closer than this are noise-dominated: fall back to a line through the origin.
MIN_RELATIVE_SPREAD = 0.05
MIN_ABSOLUTE_SPREAD = 8
# Foreign load: steps over which it is averaged, and the fewest clean steps a fit needs to be filtered.
FOREIGN_LOAD_WINDOW = 5
MIN_CLEAN_STEPS = 8


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs of the machine have been busy since boot (``/proc/stat``; NaN where there is none)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return math.nan
    # cpu user nice system idle iowait irq softirq steal ...: busy = everything but idle and iowait (and steal,
    # which is time the hypervisor gave to someone else)
    user, nice, system, idle, iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------------------
# One run: this process is one Lightning rank (Lightning re-runs this command line for the others).
# ---------------------------------------------------------------------------------------------------------------------


def fit_order(rounds: int) -> list[str]:
    """Equal and auto fits interleaved ABBA... so that a slow drift of the machine's load hits both alike."""
    order: list[str] = []
    for k in range(rounds):
        order += list(SPLITS) if k % 2 == 0 else list(reversed(SPLITS))
    return order


def single_run(args: argparse.Namespace) -> None:
    """One scenario: ``fit_order(rounds)`` fits, one after the other, in the same processes (one launch)."""
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hetero import HeteroStrategy, split_by_weights

    torch.set_num_threads(1)

    class TiedMLP(LightningModule):
        """Input layer, one wide hidden layer applied ``repeat`` times (tied weights), classifier."""

        def __init__(self, in_features: int, hidden: int, repeat: int, classes: int) -> None:
            super().__init__()
            self.inp = nn.Linear(in_features, hidden)
            self.hidden = nn.Linear(hidden, hidden)
            self.out = nn.Linear(hidden, classes)
            self.repeat = repeat

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.relu(self.inp(x))
            for _ in range(self.repeat):
                x = torch.relu(self.hidden(x))
            return self.out(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    clock = time.perf_counter  # CLOCK_MONOTONIC on Linux: one clock for every process of the machine
    # The emulator stretches compute with time.sleep: count the seconds slept, wherever the strategy sleeps.
    slept = [0.0]
    real_sleep = time.sleep

    def counting_sleep(seconds: float) -> None:
        begin = clock()
        try:
            real_sleep(seconds)
        finally:
            slept[0] += clock() - begin

    time.sleep = counting_sleep
    cpu_clock = time.thread_time  # this thread's CPU time: with one intra-op thread, all of the rank's compute
    process_clock = time.process_time  # every thread of the rank (gloo's too): is waiting in a collective busy?

    class StepRecorder(Callback):
        """Timestamps of every training step on this rank; rank 0 gathers them all at the end of training."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.gathered: Optional[list[Any]] = None
            self._current: dict[str, float] = {}
            self._last_grad = (math.nan, math.nan, math.nan, math.nan)
            self._previous_end: Optional[float] = None
            self._handles: list[Any] = []

        def _grad_hook(self, grad):
            self._last_grad = (clock(), cpu_clock(), process_clock(), slept[0])
            return grad

        def setup(self, trainer, pl_module, stage) -> None:
            # Before strategy.setup: the window up to on_fit_start holds the profiling and DeepSpeed's set-up.
            self.setup_window = {"setup": clock(), "setup_cpu": process_clock(), "setup_busy": machine_busy_seconds()}

        def on_fit_start(self, trainer, pl_module) -> None:
            self.setup_window.update(
                {"fit_start": clock(), "fit_start_cpu": process_clock(), "fit_start_busy": machine_busy_seconds()}
            )

        def on_train_start(self, trainer, pl_module) -> None:
            for p in pl_module.parameters():  # after profiling: its backward passes are not recorded
                if p.requires_grad:
                    self._handles.append(p.register_hook(self._grad_hook))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = clock()
            previous = self._previous_end if self._previous_end is not None else math.nan
            self._current = {"start": now, "previous_end": previous, "start_slept": slept[0]}

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self._current["before_backward"] = clock()
            self._current["before_backward_cpu"] = cpu_clock()
            self._current["before_backward_slept"] = slept[0]
            self._last_grad = (math.nan, math.nan, math.nan, math.nan)

        def on_after_backward(self, trainer, pl_module) -> None:
            self._current["after_backward"] = clock()
            self._current["after_backward_process_cpu"] = process_clock()
            self._current["after_backward_slept"] = slept[0]
            names = ("last_grad", "last_grad_cpu", "last_grad_process_cpu", "last_grad_slept")
            self._current.update(zip(names, self._last_grad))

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self._current["before_optimizer_step"] = clock()
            self._current["before_optimizer_step_process_cpu"] = process_clock()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = clock()
            self._current["end"] = now
            self._current["end_process_cpu"] = process_clock()
            self._current["end_busy"] = machine_busy_seconds()
            self._current["end_slept"] = slept[0]
            self._current["samples"] = float(len(batch[0]))
            self.steps.append(self._current)
            self._previous_end = now

        def on_train_end(self, trainer, pl_module) -> None:
            for handle in self._handles:
                handle.remove()
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, {"steps": self.steps, "setup_window": self.setup_window})
            self.gathered = gathered

    world_size = args.devices
    global_batch = args.global_batch
    max_steps = args.warmup + args.steps + 1  # the first step has no previous end: it only starts the clock
    speeds = [float(s) for s in args.speeds.split(",")] if args.speeds else None
    fits = []
    for index, split in enumerate(fit_order(args.rounds)):
        seed_everything(index)
        num_samples = global_batch * (max_steps + 1)
        dataset = TensorDataset(
            torch.randn(num_samples, args.in_features), torch.randint(0, args.classes, (num_samples,))
        )
        loader = DataLoader(dataset, batch_size=global_batch // world_size, shuffle=False)
        batch_sizes = split_by_weights(global_batch, [1.0] * world_size) if split == "equal" else None
        strategy = HeteroStrategy(
            stage=2, global_batch_size=global_batch, batch_sizes=batch_sizes, emulate_speeds=speeds
        )
        recorder = StepRecorder()
        root = Path(args.root) / f"fit{index}-{split}"
        trainer = Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=max_steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=root,
            callbacks=[recorder],
        )
        model = TiedMLP(args.in_features, args.hidden, args.repeat, args.classes)
        load_before = os.getloadavg()[0]
        fit_started = clock()
        trainer.fit(model, loader)
        fit_seconds = clock() - fit_started
        if trainer.is_global_zero:
            plan = json.loads((root / "hetero" / "plan.json").read_text())
            fits.append(
                {
                    "index": index,
                    "split": split,
                    "plan": {key: plan.get(key) for key in ("source", "batch_sizes", "prediction", "profiles")},
                    "fit_seconds": fit_seconds,
                    "load_average_1min": [load_before, os.getloadavg()[0]],
                    "steps": [rank["steps"] for rank in recorder.gathered],
                    "setup_windows": [rank["setup_window"] for rank in recorder.gathered],
                }
            )
            print(f"fit {index} ({split}): split {plan['batch_sizes']}, {fit_seconds:.1f} s", flush=True)
        del trainer, strategy, model
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if trainer_is_rank_zero():
        result = {
            "world_size": world_size,
            "global_batch_size": global_batch,
            "emulate_speeds": speeds,
            "parameters": sum(
                p.numel() for p in TiedMLP(args.in_features, args.hidden, args.repeat, args.classes).parameters()
            ),
            "torch_threads": torch.get_num_threads(),
            "warmup": args.warmup,
            "fits": fits,
        }
        Path(args.result).write_text(json.dumps(result))


def trainer_is_rank_zero() -> bool:
    import torch.distributed

    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


# ---------------------------------------------------------------------------------------------------------------------
# Analysis: pure functions of the recorded timestamps.
# ---------------------------------------------------------------------------------------------------------------------


def step_phases(record: dict[str, float]) -> dict[str, float]:
    """The intervals of one recorded step (seconds); see the module docstring."""
    phases = {
        "fetch": record["start"] - record["previous_end"],
        "forward": record["before_backward"] - record["start"],
        "backward": record["last_grad"] - record["before_backward"],
        "sleep_in_backward": record["last_grad_slept"] - record["before_backward_slept"],
        "reduce": record["after_backward"] - record["last_grad"],
        # Emulated slowdown slept after autograd's backward: before DeepSpeed's backward returned (pre) or after (post).
        "sleep_pre": record["after_backward_slept"] - record["last_grad_slept"],
        "sleep_post": record["end_slept"] - record["after_backward_slept"],
        "optimizer": record["end"] - record["before_optimizer_step"],
        "backward_cpu": record["last_grad_cpu"] - record["before_backward_cpu"],
        "reduce_process_cpu": record["after_backward_process_cpu"] - record["last_grad_process_cpu"],
        "optimizer_process_cpu": record["end_process_cpu"] - record["before_optimizer_step_process_cpu"],
    }
    phases["bwd_sleep"] = phases["sleep_pre"] + phases["sleep_post"]
    phases["local"] = phases["fetch"] + phases["forward"] + phases["backward"] + phases["bwd_sleep"]
    return phases


def foreign_load(per_rank: list[list[dict[str, float]]], window: int = FOREIGN_LOAD_WINDOW) -> list[float]:
    """Per step (from the second): CPU cores busy with processes other than this job's, over ``window`` steps.

    Machine-wide busy CPU time (``/proc/stat``, read by rank 0 at each step's end) minus the CPU time of every
    rank's process (all its threads) over the same steps, divided by the wall time; centred rolling window because
    ``/proc/stat`` counts in 10 ms ticks. NaN where ``/proc/stat`` is missing.
    """
    rank0 = per_rank[0]
    count = min(len(steps) for steps in per_rank)
    foreign = []
    for i in range(1, count):
        low, high = max(1, i - window // 2), min(count - 1, i + window // 2)
        wall = rank0[high]["end"] - rank0[low - 1]["end"]
        busy = rank0[high]["end_busy"] - rank0[low - 1]["end_busy"]
        ours = sum(steps[high]["end_process_cpu"] - steps[low - 1]["end_process_cpu"] for steps in per_rank)
        foreign.append((busy - ours) / wall)
    return foreign


def setup_foreign_load(fit: dict[str, Any]) -> float:
    """Foreign CPU cores while the fit set up (profiling and DeepSpeed's initialisation), as :func:`foreign_load`."""
    windows = fit["setup_windows"]
    rank0 = windows[0]
    wall = rank0["fit_start"] - rank0["setup"]
    busy = rank0["fit_start_busy"] - rank0["setup_busy"]
    ours = sum(w["fit_start_cpu"] - w["setup_cpu"] for w in windows)
    return (busy - ours) / wall


def summarize_fit(
    fit: dict[str, Any], global_batch: int, warmup: int, max_foreign: Optional[float] = None
) -> dict[str, Any]:
    """Median step, samples/s, per-rank median phases and the non-local overhead of one fit.

    With ``max_foreign``, only the measured steps during which other processes kept at most that many CPU cores busy
    count ("clean" steps); when fewer than ``MIN_CLEAN_STEPS`` are clean, all measured steps count and the summary
    says so (``filtered: False``).
    """
    per_rank = fit["steps"]
    skip = 1 + warmup  # step 0 has no previous end; then the warm-up
    count = min(len(steps) for steps in per_rank)
    foreign = foreign_load(per_rank)  # index i - 1 is step i
    measured = list(range(skip, count))
    if not measured:
        raise RuntimeError("a fit recorded no measured steps: raise --steps")
    kept = measured
    if max_foreign is not None:
        clean = [i for i in measured if not foreign[i - 1] > max_foreign]  # NaN (no /proc/stat) counts as clean
        kept = clean if len(clean) >= MIN_CLEAN_STEPS else measured
    phases = [[step_phases(steps[i]) for i in kept] for steps in per_rank]
    count = len(kept)
    step_times = [per_rank[0][i]["end"] - per_rank[0][i]["previous_end"] for i in kept]
    median_step = statistics.median(step_times)
    median_max_local = statistics.median(max(rank[i]["local"] for rank in phases) for i in range(count))
    # Emulated slowdown slept after DeepSpeed's backward returned ("sleep_post") comes after the ZeRO-2 gradient
    # reduce: a slowed rank that was not the last into the reduce still sleeps afterwards, while the others wait in
    # the optimizer step's all-gather. Lower estimate of that serialised time: (slowest part before it) + (longest
    # such sleep) - (slowest local total); 0 when one rank is the slowest in both, as in an equal split.
    emulation_tail = statistics.median(
        max(rank[i]["local"] - rank[i]["sleep_post"] for rank in phases)
        + max(rank[i]["sleep_post"] for rank in phases)
        - max(rank[i]["local"] for rank in phases)
        for i in range(count)
    )
    ranks = []
    for steps, rank_phases in zip(per_rank, phases):
        medians = {f"{name}_ms": 1e3 * statistics.median(p[name] for p in rank_phases) for name in rank_phases[0]}
        # Share of a CPU this rank's backward got, its emulated sleep left out: below 1 = it competed for a core.
        medians["cpu_share"] = statistics.median(
            p["backward_cpu"] / (p["backward"] - p["sleep_in_backward"]) for p in rank_phases
        )
        ranks.append({"batch_size": int(steps[kept[0]]["samples"]), **medians})
    plan = fit["plan"]
    profiles = plan.get("profiles") or []
    prediction = plan.get("prediction") or {}
    return {
        "index": fit["index"],
        "split": fit["split"],
        "batch_sizes": [rank["batch_size"] for rank in ranks],
        "measured_steps": len(measured),
        "median_step_ms": 1e3 * median_step,
        "step_ms_quartiles": [1e3 * q for q in statistics.quantiles(step_times, n=4)] if len(step_times) > 1 else None,
        "samples_per_second": global_batch / median_step,
        "median_max_local_ms": 1e3 * median_max_local,
        "overhead_ms": 1e3 * (median_step - median_max_local),
        "emulation_tail_ms": 1e3 * emulation_tail,
        "cpu_share": statistics.median(rank["cpu_share"] for rank in ranks),
        "load_average_1min": fit["load_average_1min"],
        "plan_source": plan.get("source"),
        "predicted_speedup": prediction.get("speedup"),
        "predicted_step_ms": 1e3 * prediction["step_seconds"] if "step_seconds" in prediction else None,
        "predicted_equal_step_ms": (
            1e3 * prediction["equal_split_step_seconds"] if "equal_split_step_seconds" in prediction else None
        ),
        "profiling_seconds": max((p["wall_seconds"] for p in profiles), default=None),
        "profiles": [
            {
                "probe_sizes": p["batch_sizes"],
                "probe_ms": [1e3 * s for s in p["seconds"]],
                "fixed_ms": 1e3 * p["fixed_seconds"],
                "per_sample_ms": 1e3 * p["seconds_per_sample"],
            }
            for p in profiles
        ],
        "ranks": ranks,
        "filtered": kept is not measured,
        "kept_steps": len(kept),
        "foreign_cores_median": statistics.median(foreign[i - 1] for i in measured),
        "foreign_cores_kept_median": statistics.median(foreign[i - 1] for i in kept),
        "setup_foreign_cores": setup_foreign_load(fit),
    }


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float, str]:
    """``(a, c, how)``: least-squares ``local(b) = a + c * b`` through (batch, seconds) points; see the docstring."""
    sizes = [b for b, _ in points]
    spread = max(sizes) - min(sizes)
    if spread >= max(MIN_ABSOLUTE_SPREAD, MIN_RELATIVE_SPREAD * max(sizes)):
        mean_b = statistics.mean(sizes)
        mean_t = statistics.mean(t for _, t in points)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b in sizes)
        if slope > 0:
            return mean_t - slope * mean_b, slope, "line"
    return 0.0, statistics.mean(t / b for b, t in points), "through-origin"


def balanced_split(lines: list[tuple[float, float]], global_batch: int) -> tuple[float, list[float]]:
    """Continuous split where every rank's ``a + c * b`` is the same ``T``: ``(T, sizes)``."""
    active = list(range(len(lines)))
    while True:
        finish = (global_batch + sum(lines[r][0] / lines[r][1] for r in active)) / sum(1 / lines[r][1] for r in active)
        sizes = [(finish - lines[r][0]) / lines[r][1] if r in active else 0.0 for r in range(len(lines))]
        negative = [r for r in active if sizes[r] < 0]
        if not negative:
            return finish, sizes
        active = [r for r in active if r not in negative]


def ideal_from_fits(fits: list[dict[str, Any]], global_batch: int) -> dict[str, Any]:
    """The perfectly balanced split's throughput from some fits (steps 1-4 of the module docstring)."""
    world_size = len(fits[0]["ranks"])
    lines, fitted = [], []
    for r in range(world_size):
        points = [(f["ranks"][r]["batch_size"], f["ranks"][r]["local_ms"] / 1e3) for f in fits]
        a, c, how = fit_line(points)
        lines.append((a, c))
        fitted.append({"rank": r, "fixed_ms": 1e3 * a, "per_sample_ms": 1e3 * c, "fit": how})
    finish, sizes = balanced_split(lines, global_batch)
    overhead = {
        s: statistics.median(f["overhead_ms"] for f in fits if f["split"] == s) / 1e3
        for s in SPLITS
        if any(f["split"] == s for f in fits)
    }
    mean_overhead = statistics.mean(overhead.values())
    return {
        "local_lines": fitted,
        "balanced_batch_sizes": sizes,
        "balanced_local_ms": 1e3 * finish,
        "overhead_ms": 1e3 * mean_overhead,
        "step_ms": 1e3 * (finish + mean_overhead),
        "samples_per_second": global_batch / (finish + mean_overhead),
        # The same with one split's overhead only: how much that choice matters (see the README).
        **{f"samples_per_second_with_{s}_overhead": global_batch / (finish + o) for s, o in overhead.items()},
    }


def analyse_scenario(result: dict[str, Any], max_foreign: Optional[float] = None) -> dict[str, Any]:
    """Per round (one equal and one auto fit, adjacent in time): throughputs, the ideal, and their ratios; then the
    medians over the rounds. Ratios are taken within a round, so a slow drift of the machine's speed cancels out.

    With ``max_foreign``, rounds with a fit that had too few clean steps (see :func:`summarize_fit`) are left out,
    unless that would leave none.
    """
    global_batch = result["global_batch_size"]
    fits = [summarize_fit(fit, global_batch, result["warmup"], max_foreign) for fit in result["fits"]]
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for f in fits:
        rounds.setdefault(f["index"] // 2, {})[f["split"]] = f
    rounds = {k: pair for k, pair in rounds.items() if len(pair) == len(SPLITS)}
    if not rounds:
        raise RuntimeError("a scenario needs at least one round of an equal and an auto fit")
    clean = [k for k, pair in rounds.items() if all(f["filtered"] for f in pair.values())]
    used = clean if (clean and max_foreign is not None) else sorted(rounds)
    per_round = []
    for k in used:
        eq, au = rounds[k]["equal"], rounds[k]["auto"]
        ideal = ideal_from_fits([eq, au], global_batch)
        per_round.append(
            {
                "round": k,
                "equal_samples_per_second": eq["samples_per_second"],
                "auto_samples_per_second": au["samples_per_second"],
                "ideal_samples_per_second": ideal["samples_per_second"],
                "auto_over_ideal": au["samples_per_second"] / ideal["samples_per_second"],
                "auto_over_equal": au["samples_per_second"] / eq["samples_per_second"],
                **{
                    f"auto_over_ideal_with_{s}_overhead": (
                        au["samples_per_second"] / ideal[f"samples_per_second_with_{s}_overhead"]
                    )
                    for s in SPLITS
                },
                "ideal": ideal,
            }
        )

    def median_of(key: str) -> float:
        return statistics.median(r[key] for r in per_round)

    used_fits = [f for k in used for f in rounds[k].values()]
    autos = [rounds[k]["auto"] for k in used]
    by_split = {s: [rounds[k][s] for k in used] for s in SPLITS}
    speedups = [f["predicted_speedup"] for f in autos if f["predicted_speedup"] is not None]
    profiling = [f["profiling_seconds"] for f in autos if f["profiling_seconds"] is not None]
    return {
        "equal_samples_per_second": median_of("equal_samples_per_second"),
        "auto_samples_per_second": median_of("auto_samples_per_second"),
        "ideal_samples_per_second": median_of("ideal_samples_per_second"),
        "auto_over_ideal": median_of("auto_over_ideal"),
        "auto_over_equal": median_of("auto_over_equal"),
        **{f"auto_over_ideal_with_{s}_overhead": median_of(f"auto_over_ideal_with_{s}_overhead") for s in SPLITS},
        "auto_batch_sizes": [f["batch_sizes"] for f in autos],
        "plan_sources": [f["plan_source"] for f in autos],
        "predicted_speedup": statistics.median(speedups) if speedups else None,
        "predicted_speedups": speedups,
        "profiling_seconds": statistics.median(profiling) if profiling else None,
        "overhead_ms": {s: statistics.median(f["overhead_ms"] for f in by_split[s]) for s in SPLITS},
        "emulation_tail_ms": {s: statistics.median(f["emulation_tail_ms"] for f in by_split[s]) for s in SPLITS},
        "overhead_fraction": {
            s: statistics.median(f["overhead_ms"] / f["median_step_ms"] for f in by_split[s]) for s in SPLITS
        },
        "cpu_share": statistics.median(f["cpu_share"] for f in used_fits),
        "rounds_used": used,
        "rounds_left_out": [k for k in sorted(rounds) if k not in used],
        "filter_fallback": max_foreign is not None and not clean,
        "kept_fraction": sum(f["kept_steps"] for f in used_fits) / sum(f["measured_steps"] for f in used_fits),
        "samples_per_second_range": {
            s: [min(f["samples_per_second"] for f in by_split[s]), max(f["samples_per_second"] for f in by_split[s])]
            for s in SPLITS
        },
        # One line per rank through every used fit: the steadier estimate of each rank's local cost, for reading.
        "pooled_ideal": ideal_from_fits(used_fits, global_batch),
        "rounds": per_round,
        "fits": fits,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Driver: one bounded child job per scenario, then the table.
# ---------------------------------------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, scenario: str, run_dir: Path) -> dict[str, Any]:
    world_size, speeds = SCENARIOS[scenario]
    run_dir.mkdir(parents=True, exist_ok=True)
    result_path = run_dir / "result.json"
    result_path.unlink(missing_ok=True)
    command = [
        sys.executable, str(Path(__file__).resolve()), "--run",
        "--devices", str(world_size),
        "--rounds", str(args.rounds),
        "--steps", str(args.steps),
        "--warmup", str(args.warmup),
        "--global-batch", str(args.global_batch),
        "--hidden", str(args.hidden),
        "--repeat", str(args.repeat),
        "--in-features", str(args.in_features),
        "--classes", str(args.classes),
        "--root", str(run_dir),
        "--result", str(result_path),
    ]  # fmt: skip
    if speeds:
        command += ["--speeds", ",".join(str(s) for s in speeds)]
    env = dict(os.environ)
    env.pop("LIGHTNING_HETERO_EMULATE_SPEEDS", None)  # the scenario decides, not the caller's environment
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    log_path = run_dir / "log.txt"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # Own process group: Lightning's launcher starts the other ranks as children; a timeout kills them all.
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{scenario} timed out after {args.timeout:.0f} s (log: {log_path})") from None
        finally:
            # Stragglers of a crashed job (a rank stuck in a collective) must not outlive it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.perf_counter() - started
    if returncode != 0 or not result_path.exists():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{scenario} failed (exit {returncode}, log: {log_path}):\n{tail}")
    result = json.loads(result_path.read_text())
    result["launch_seconds"] = wall
    return result


def _splits_text(splits: list[list[int]]) -> str:
    unique = []
    for split in splits:
        if split not in unique:
            unique.append(split)
    return ", ".join("/".join(str(b) for b in split) for split in unique)


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "scenario", "equal s/s", "auto s/s", "ideal s/s", "auto/ideal", "auto/equal", "auto split",
        "pred. speedup", "profiling s", "overhead", "emul. tail", "cpu share", "rounds",
    ]  # fmt: skip
    lines = [header]
    for row in rows:
        a = row["analysis"]
        speedup = a["predicted_speedup"]
        rounds = len(a["rounds_used"]) + len(a["rounds_left_out"])
        lines.append(
            [
                row["scenario"],
                f"{a['equal_samples_per_second']:.0f}",
                f"{a['auto_samples_per_second']:.0f}",
                f"{a['ideal_samples_per_second']:.0f}",
                f"{a['auto_over_ideal']:.3f}",
                f"{a['auto_over_equal']:.3f}",
                _splits_text(a["auto_batch_sizes"]),
                f"{speedup:.2f}x" if speedup is not None else "-",
                f"{a['profiling_seconds']:.2f}" if a["profiling_seconds"] is not None else "-",
                f"{100 * a['overhead_fraction']['equal']:.0f}%/{100 * a['overhead_fraction']['auto']:.0f}%",
                f"{a['emulation_tail_ms']['auto']:.1f} ms",
                f"{a['cpu_share']:.2f}",
                f"{len(a['rounds_used'])}/{rounds}" + ("*" if a["filter_fallback"] else ""),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = (cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        out.append("  ".join(cells))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


TABLE_LEGEND = """\
s/s: samples per second. equal/auto/ideal s/s: medians over the rounds used; auto/ideal and auto/equal: medians of
the per-round ratios (one equal and one auto fit, adjacent in time). auto split: the micro-batches the planner chose,
one per round used. pred. speedup / profiling s: the planner's prediction over the equal split and the slowest rank's
profiling wall time (medians). overhead: the step's non-local share (step - slowest rank's local work), equal/auto
fits. emul. tail: in the auto fits, time the emulated backward slowdown adds after the gradient reduce (should be 0;
see the README). cpu share: CPU time / wall time of the ranks' backward passes, emulated sleep left out (below 1:
competing for a core). rounds: rounds used / run; a round is left out when a fit had fewer than {min_clean} steps with
at most {max_foreign} CPU cores busy with other processes (* = no round was clean: all used)."""


def format_details(rows: list[dict[str, Any]]) -> str:
    """Per round, fit and rank: what the table's figures come from."""
    out = []
    for row in rows:
        a = row["analysis"]
        out.append(
            f"{row['scenario']}: auto/ideal with the equal fits' overhead only"
            f" {a['auto_over_ideal_with_equal_overhead']:.3f}, with the auto fits' only"
            f" {a['auto_over_ideal_with_auto_overhead']:.3f}; overhead equal {a['overhead_ms']['equal']:.1f} ms,"
            f" auto {a['overhead_ms']['auto']:.1f} ms; emulation tail equal {a['emulation_tail_ms']['equal']:.1f} ms,"
            f" auto {a['emulation_tail_ms']['auto']:.1f} ms; rounds used {a['rounds_used']}, left out"
            f" {a['rounds_left_out']}"
        )
        for r in a["rounds"]:
            ideal = r["ideal"]
            lines = "; ".join(
                f"r{fit['rank']} {fit['fixed_ms']:.1f}+{fit['per_sample_ms']:.4f}b"
                + ("" if fit["fit"] == "line" else " (origin)")
                for fit in ideal["local_lines"]
            )
            out.append(
                f"  round {r['round']}: equal {r['equal_samples_per_second']:.0f}, auto"
                f" {r['auto_samples_per_second']:.0f}, ideal {r['ideal_samples_per_second']:.0f} s/s"
                f" (auto/ideal {r['auto_over_ideal']:.3f}, auto/equal {r['auto_over_equal']:.3f}); ideal step"
                f" {ideal['step_ms']:.1f} ms = balanced local {ideal['balanced_local_ms']:.1f} + overhead"
                f" {ideal['overhead_ms']:.1f}; balanced split"
                f" {'/'.join(f'{b:.0f}' for b in ideal['balanced_batch_sizes'])}; local lines (ms) {lines}"
            )
        pooled = a["pooled_ideal"]
        out.append(
            "  pooled over the used fits: balanced split"
            f" {'/'.join(f'{b:.0f}' for b in pooled['balanced_batch_sizes'])}, ideal {pooled['samples_per_second']:.0f}"
            " s/s; local lines (ms) "
            + "; ".join(
                f"r{fit['rank']} {fit['fixed_ms']:.1f}+{fit['per_sample_ms']:.4f}b"
                + ("" if fit["fit"] == "line" else " (origin)")
                for fit in pooled["local_lines"]
            )
        )
        for f in a["fits"]:
            predicted = (
                f"; planner: predicted local step {f['predicted_step_ms']:.1f} ms (equal split"
                f" {f['predicted_equal_step_ms']:.1f}), speedup {f['predicted_speedup']:.2f}x, profiling"
                f" {f['profiling_seconds']:.2f} s with {f['setup_foreign_cores']:.2f} foreign cores"
                if f["predicted_step_ms"] is not None
                else ""
            )
            out.append(
                f"  fit {f['index']} {f['split']:5s} {'/'.join(map(str, f['batch_sizes']))}:"
                f" {f['samples_per_second']:.0f} s/s, median step {f['median_step_ms']:.1f} ms"
                f" (quartiles {'/'.join(f'{q:.0f}' for q in f['step_ms_quartiles'] or [])}),"
                f" max local {f['median_max_local_ms']:.1f} ms, overhead {f['overhead_ms']:.1f} ms"
                f" (emulation tail {f['emulation_tail_ms']:.1f}), cpu share {f['cpu_share']:.2f},"
                f" foreign load {f['foreign_cores_median']:.2f} cores, kept {f['kept_steps']}/{f['measured_steps']}"
                f"{'' if f['filtered'] else ' (too few clean steps)'}{predicted}"
            )
            for r, rank in enumerate(f["ranks"]):
                profile = ""
                if f["profiles"]:
                    p = f["profiles"][r]
                    probes = ", ".join(f"{b}:{t:.0f}" for b, t in zip(p["probe_sizes"], p["probe_ms"]))
                    profile = f" | profile {probes} ms -> {p['fixed_ms']:.1f} + {p['per_sample_ms']:.4f} b"
                out.append(
                    f"    rank {r} b={rank['batch_size']:4d} local {rank['local_ms']:6.1f} ms = fetch"
                    f" {rank['fetch_ms']:.1f} + fwd {rank['forward_ms']:.1f} + bwd {rank['backward_ms']:.1f}"
                    f" (of which emulated sleep {rank['sleep_in_backward_ms']:.1f}) + sleep {rank['bwd_sleep_ms']:.1f}"
                    " (before/after DeepSpeed's backward returned"
                    f" {rank['sleep_pre_ms']:.1f}/{rank['sleep_post_ms']:.1f}); reduce {rank['reduce_ms']:.1f}, opt"
                    f" {rank['optimizer_ms']:.1f}; cpu share {rank['cpu_share']:.2f}{profile}"
                )
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument("--steps", type=int, default=None, help="measured steps per fit (default 40; --quick: 8)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out per fit (default 5; --quick: 3)")
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="equal+auto fit pairs per scenario, interleaved ABBA (default 5; --quick: 1)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a short smoke run: few steps, one round, noisy figures")
    parser.add_argument(
        "--max-foreign-load", type=float, default=0.3,
        help="count only steps during which other processes kept at most this many CPU cores busy (default 0.3;"
        " a negative value counts every step)",
    )  # fmt: skip
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=4, help="times the (tied) hidden layer is applied")
    parser.add_argument("--in-features", type=int, default=64)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="seconds per scenario before its processes are killed (default 120 + 100 per round)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (the runs' logs go next to it)")
    # Single-run mode: what the driver launches (and Lightning re-launches for the other ranks).
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--speeds", default="", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 8 if args.quick else 40
    if args.warmup is None:
        args.warmup = 3 if args.quick else 5
    if args.rounds is None:
        args.rounds = 1 if args.quick else 5
    if args.timeout is None:
        args.timeout = 120.0 + 100.0 * args.rounds
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be at least 2 and --rounds at least 1")
    if args.run:
        single_run(args)
        return

    max_foreign = args.max_foreign_load if args.max_foreign_load >= 0 else None
    run_root = args.out.parent / (args.out.stem + "_runs")
    started = time.perf_counter()
    rows = []
    failures: dict[str, str] = {}
    for scenario in args.scenarios:
        order = " ".join(fit_order(args.rounds))
        print(f"[{time.perf_counter() - started:6.1f} s] {scenario}: fits {order} ...", flush=True)
        try:
            result = launch(args, scenario, run_root / scenario)
        except RuntimeError as error:  # a timeout or a crash: report it, go on with the other scenarios
            print(f"[{time.perf_counter() - started:6.1f} s]   FAILED: {error}", flush=True)
            failures[scenario] = str(error)
            continue
        analysis = analyse_scenario(result, max_foreign)
        print(
            f"[{time.perf_counter() - started:6.1f} s]   "
            + ", ".join(f"{f['split']} {f['samples_per_second']:.0f}" for f in analysis["fits"])
            + f" samples/s; job {result['launch_seconds']:.1f} s",
            flush=True,
        )
        rows.append({"scenario": scenario, "analysis": analysis, "result": result})
    total = time.perf_counter() - started

    table = format_table(rows)
    details = format_details(rows)
    title = (
        f"HeteroStrategy throughput, ZeRO-2 on CPU (gloo), global batch {args.global_batch}, {args.rounds} x (equal +"
        f" auto) fits per scenario, {args.warmup} warm-up + {args.steps} measured steps each, {os.cpu_count()} CPUs"
    )
    print()
    print(title)
    print(table)
    legend = TABLE_LEGEND.format(min_clean=MIN_CLEAN_STEPS, max_foreign=args.max_foreign_load)
    print(legend)
    print()
    print(details)
    print(f"\ntotal wall time {total:.0f} s")
    report = {
        "settings": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
            if key not in ("run", "devices", "speeds", "root", "result")
        },
        "cpu_count": os.cpu_count(),
        "parameters": rows[0]["result"]["parameters"] if rows else None,
        "total_seconds": total,
        "title": title,
        "failures": failures,
        "table": table,
        "legend": legend,
        "scenarios": [
            {
                "scenario": row["scenario"],
                "world_size": row["result"]["world_size"],
                "emulate_speeds": row["result"]["emulate_speeds"],
                "launch_seconds": row["result"]["launch_seconds"],
                **row["analysis"],
            }
            for row in rows
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"written to {args.out}")
    for row in rows:
        a = row["analysis"]
        if SCENARIOS[row["scenario"]][1] is not None:
            name, met = "auto/ideal >= 0.90", a["auto_over_ideal"] >= 0.90
        else:
            name, met = "auto/equal >= 0.95", a["auto_over_equal"] >= 0.95
        print(f"target {row['scenario']}: {name}: {'met' if met else 'MISSED'}")
    if failures:
        print(f"failed: {', '.join(failures)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
