"""Report: what a fit did on every rank, for a person (a printed summary, a plot) and for tools (``report.json``).

At the end of fit rank 0 writes into the run's ``hetero/`` directory:

``report.json`` (format version 1, a user-facing contract)::

    {
      "format_version": 1,
      "world_size": W,
      "steps": [                      # one entry per training step, in order
        {"step": 0,                   # index of the training step in this fit
         "batch_sizes": [b_0, ...],   # each rank's samples of the global batch
         "micro_steps": [k_0, ...],   # ... taken in this many micro-batches (HeteroStrategy(micro_steps=...))
         "compute_seconds": [...],    # each rank's local compute (see lightning_hetero.watch.meter)
         "data_wait_seconds": [...],  # each rank's wait for its loader to produce the batch
         "wait_seconds": [...],       # each rank's step time that was neither (waiting for others, host work)
         "arrival_seconds": [...],    # each rank's wall time from its batch to its first gradient exchange (0: none)
         "exchange_seconds": [...],   # ... and its wall time inside the exchange (waiting for the others included)
         "step_seconds": s},          # the step's wall time: the slowest rank's
        ...],
      "replans": [                    # each change of split during the fit (empty while the split is fixed)
        {"step": k, "batch_sizes": [...], "micro_steps": [...], "predicted_gain": g}, ...],
      "summary": {"steps": n, "samples_per_second": x, "balance_efficiency_start": a,
                  "balance_efficiency_end": b, "replans": r,
                  "measurement_share": m,   # rank 0's time exchanging records and deciding re-plans / step time
                  "replanning": r},         # the split followed the measurements: true, false, null (cannot)
      "precision": {                  # only with HeteroStrategy(device_precision=...)
        "precisions": [p_0, ...],     # each rank's: "bf16-mixed", "16-mixed" or "32-true"
        "loss_scale": s,              # the job's loss scale at the end (null without an fp16 rank)
        "skipped_steps": [            # optimizer steps skipped because an fp16 rank overflowed
          {"step": k, "ranks": [r, ...], "scale_before": s0, "scale": s1}, ...]}
    }

``report.png``: each rank's compute time per step and its share of the global batch, re-plans marked.

Balance efficiency is ``sum(compute) / (W * max(compute))`` over the ranks of a step: 1.0 when every rank computes
for as long as the slowest, ``1/W`` when one rank does all the work. The pure functions build and describe the
report; only :func:`write_report` touches files (and imports matplotlib, with its non-interactive backend).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_hetero.configure.deepspeed_config import format_plan_table
from lightning_hetero.split.decisions.explore import HELD_STEP_SHARE, held_beyond_others, unexplained_seconds
from lightning_hetero.watch.meter import WIRE_KINDS, balance_efficiency

FORMAT_VERSION = 1
# The start and the end of a run, for the summary: this share of its steps (at least one step each).
_EDGE_SHARE = 0.1
# A rank whose wait for its data is at least this share of its compute is named as stalled, with the fix.
DATA_STALL_SHARE = 0.1
# A rank the others wait for: the last at the gradient exchange in at least this share of the steps timed...
LATE_SHARE = 0.6
# ... by a median of at least this much (seconds) and this share of the median step: not the exchange's own jitter.
LATE_SECONDS, LATE_STEP_SHARE = 1e-3, 0.05


def plan_text(
    plan: Any,
    stage: int,
    devices: list[str],
    precisions: list[str],
    profiles: Optional[Sequence[Any]] = None,
    prediction: Optional[dict[str, Any]] = None,
) -> str:
    """The plan as rank 0 prints it at fit start: a row per rank, and the predicted gain when it was profiled.

    ``plan`` is a :class:`~lightning_hetero.split.decisions.split.SplitPlan`, ``profiles`` the ranks'
    :class:`~lightning_hetero.measure.rank_profile.RankProfile` (automatic split only).
    """
    rows = []
    for rank, (device, size, share) in enumerate(zip(devices, plan.batch_sizes, plan.shares())):
        row = {
            "rank": rank,
            "device": device,
            "precision": precisions[rank],
            "micro_batch": size,
            "share": f"{share:.1%}",
            "samples": size,
            "micro_steps": plan.micro_steps[rank],
        }
        if plan.has_micro_steps:
            row["micro_batch"] = plan.micro_batches[rank]
        if profiles is not None and prediction is not None:
            # (the profile's throughput at the micro-batch the rank runs)
            row["throughput"] = f"{profiles[rank].throughput(row['micro_batch']):.0f}"
            row["step"] = f"{prediction['rank_step_seconds'][rank] * 1e3:.1f}"
        rows.append(row)
    columns = [("rank", "rank"), ("device", "device"), ("precision", "precision")]
    if plan.has_micro_steps:  # a rank takes its samples in several micro-batches: say both
        # (local SGD / DiLoCo: each micro-batch is an inner step of its own)
        steps_name = "inner steps" if plan.source in ("local_sgd", "diloco") else "micro-steps"
        columns += [("samples", "samples"), ("micro_steps", steps_name)]
    columns += [("micro_batch", "micro-batch"), ("share", "share")]
    summary = ""
    if profiles is not None and prediction is not None:
        columns += [("throughput", "samples/s"), ("step", "compute ms")]
        # The profile times each rank's own forward + backward: the prediction is the slowest rank's local compute
        # per step; the gradient exchange, the optimizer step and the loop add about the same time to any split.
        summary = (
            f"\npredicted compute per step: {prediction['step_seconds'] * 1e3:.1f} ms with this split,"
            f" {prediction['equal_split_step_seconds'] * 1e3:.1f} ms with an equal split"
            f" (speedup {prediction['speedup']:.2f}x; communication and optimizer time come on top);"
            f" profiling took {max(p.wall_seconds for p in profiles):.2f} s"
        )
    if len(set(plan.batch_sizes)) > 1:
        summary += (
            f"\nmetrics logged with `self.log(...)` without `sync_dist=True` are rank 0's: {plan.batch_sizes[0]} of"
            f" the {plan.global_batch_size} samples of a step here; `sync_dist=True` averages over every rank, weighted"
            " by its samples"
        )
    return (
        f"HeteroStrategy plan ({plan.source}): global batch {plan.global_batch_size}, ZeRO stage {stage}\n"
        f"{format_plan_table(rows, columns)}{summary}"
    )


def build_report(
    steps: list[dict[str, Any]],
    replans: list[dict[str, Any]],
    world_size: int,
    exchange_seconds: Optional[float] = None,
    precision: Optional[dict[str, Any]] = None,
    communication: Optional[dict[str, Any]] = None,
    nonfinite: Optional[dict[str, Any]] = None,
    asynchronous: Optional[dict[str, Any]] = None,
    replanning: Optional[bool] = True,
) -> dict[str, Any]:
    """The run report; ``exchange_seconds`` (rank 0's time exchanging records) gives the measuring cost;
    ``replanning`` whether the split followed the measurements (None: no re-planning of the split exists for this
    job; what the data-stall advice may promise);
    ``nonfinite`` the optimizer steps skipped for non-finite gradients (see :mod:`~.precision.nonfinite`);
    ``asynchronous`` the merges by speed (see :func:`~lightning_hetero.local.claim_decisions.merge_summary`)."""
    built: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "world_size": world_size,
        "steps": steps,
        "replans": replans,
        "summary": {**summarize(steps, replans, exchange_seconds), "replanning": replanning},
    }
    if nonfinite is not None:
        built["nonfinite"] = nonfinite
        built["summary"]["skipped_steps"] = len(nonfinite["skipped_steps"])
    if precision is not None:
        built["precision"] = precision
    if communication is not None:
        built["communication"] = {**communication, **wire_summary(steps)}
    if asynchronous is not None:
        built["asynchronous"] = asynchronous
    return built


def wire_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean bytes on the wire per training step: each rank's, and the job's between nodes."""
    if not steps or "inter_node_bytes" not in steps[0]:
        return {}
    ranks = range(len(steps[0]["inter_node_bytes"]))
    per_rank = {kind: [statistics.fmean(step[kind][rank] for step in steps) for rank in ranks] for kind in WIRE_KINDS}
    return {
        "bytes_per_step": per_rank,
        "inter_node_bytes_per_step": sum(per_rank["inter_node_bytes"]),
        "intra_node_bytes_per_step": sum(per_rank["intra_node_bytes"]),
    }


def summarize(
    steps: list[dict[str, Any]], replans: list[dict[str, Any]], exchange_seconds: Optional[float] = None
) -> dict[str, Any]:
    edge = max(1, round(len(steps) * _EDGE_SHARE))
    efficiencies = [balance_efficiency(step["compute_seconds"]) for step in steps]
    seconds = sum(step["step_seconds"] for step in steps)
    summary = {
        "steps": len(steps),
        "samples_per_second": sum(sum(step["batch_sizes"]) for step in steps) / seconds if seconds > 0 else None,
        "balance_efficiency_start": statistics.median(efficiencies[:edge]) if steps else None,
        "balance_efficiency_end": statistics.median(efficiencies[-edge:]) if steps else None,
        "replans": len(replans),
    }
    if exchange_seconds is not None and seconds > 0:
        summary["measurement_share"] = exchange_seconds / seconds
    summary.update(link_wait_summary(steps))
    summary.update(data_wait_summary(steps))
    summary.update(late_rank_summary(steps))
    return summary


def late_rank_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank the others waited for at the gradient exchange: the last to arrive in at least ``LATE_SHARE`` of the
    steps in which every rank's arrival was timed, by a median of at least ``LATE_SECONDS`` and ``LATE_STEP_SHARE`` of
    the median step; with whether something besides its compute held it
    (:func:`~lightning_hetero.split.decisions.explore.held_beyond_others`), and by how much more than the rank held
    least. Each rank's median arrival, time inside the exchange, time held by the kernel and wall time before the
    exchange its compute does not explain either way; empty when nothing was timed (local SGD's merges, a pipeline, one
    rank)."""
    timed = [step for step in steps if len(step.get("arrival_seconds", ())) > 1 and min(step["arrival_seconds"]) > 0]
    if not timed:
        return {}
    ranks = range(len(timed[0]["arrival_seconds"]))
    arrivals = [statistics.median(step["arrival_seconds"][rank] for step in timed) for rank in ranks]
    inside = [statistics.median(step["exchange_seconds"][rank] for step in timed) for rank in ranks]
    held = [statistics.median(step.get("held_seconds", (0.0,) * len(ranks))[rank] for step in timed) for rank in ranks]
    unexplained = unexplained_seconds(timed) or [0.0] * len(ranks)
    summary: dict[str, Any] = {
        "arrival_seconds_per_step": arrivals,
        "exchange_seconds_per_step": inside,
        "held_seconds_per_step": held,
        "unexplained_seconds_per_step": unexplained,
    }
    lasts = [max(ranks, key=lambda rank: step["arrival_seconds"][rank]) for step in timed]
    late = max(ranks, key=lasts.count)
    share = lasts.count(late) / len(timed)
    lateness = statistics.median(step["arrival_seconds"][late] - min(step["arrival_seconds"]) for step in timed)
    step_time = statistics.median(step["step_seconds"] for step in timed)
    if share >= LATE_SHARE and lateness >= max(LATE_SECONDS, LATE_STEP_SHARE * step_time):
        held_most, _ = held_beyond_others(timed, step_time)
        kernel_held = held[late] - min(held)
        kernel_counted = kernel_held >= max(LATE_SECONDS, HELD_STEP_SHARE * step_time)
        summary["late_rank"] = {
            "rank": late,
            "last_share": share,
            "median_lateness_seconds": lateness,
            "held_beyond_others": held_most == late,
            "held_beyond_others_seconds": unexplained[late] - min(unexplained),
            "kernel_held_beyond_others_seconds": kernel_held,
            "kernel_counted": kernel_counted,
        }
    return summary


def data_wait_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's median wait for its data per step and its ratio to the rank's median compute, and the ranks whose
    wait is at least ``DATA_STALL_SHARE`` of their compute; empty when no rank waited. Medians, so that the first batch
    of an epoch (waiting for the loader's workers to start, which no fix removes) weighs little."""
    if not steps or not any(any(step.get("data_wait_seconds", ())) for step in steps):
        return {}
    ranks = range(len(steps[0]["data_wait_seconds"]))
    waits = [statistics.median(step["data_wait_seconds"][rank] for step in steps) for rank in ranks]
    computes = [statistics.median(step["compute_seconds"][rank] for step in steps) for rank in ranks]
    shares = [wait / compute if compute > 0 else None for wait, compute in zip(waits, computes)]
    stalled = [rank for rank, share in enumerate(shares) if share is not None and share >= DATA_STALL_SHARE]
    return {"data_wait_seconds_per_step": waits, "data_wait_over_compute": shares, "data_stalled_ranks": stalled}


def link_wait_summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Local SGD / DiLoCo: each rank's mean wall time per training step waiting for its merges' exchanges (the link:
    counted once every rank has reached the merge) and its ratio to the rank's compute; empty without merges."""
    if not steps or not any(any(step.get("link_wait_seconds", ())) for step in steps):
        return {}
    ranks = range(len(steps[0]["link_wait_seconds"]))
    waits = [sum(step["link_wait_seconds"][rank] for step in steps) for rank in ranks]
    computes = [sum(step["compute_seconds"][rank] for step in steps) for rank in ranks]
    return {
        "link_wait_seconds_per_step": [wait / len(steps) for wait in waits],
        "link_wait_over_compute": [wait / compute if compute > 0 else None for wait, compute in zip(waits, computes)],
    }


def summary_text(report: dict[str, Any]) -> str:
    summary = report["summary"]
    if not summary["steps"]:
        return "HeteroStrategy run report: no training step was recorded."
    cost = summary.get("measurement_share")
    return (
        f"HeteroStrategy run report: {summary['steps']} steps, {summary['samples_per_second']:.0f} samples/s,"
        f" balance efficiency {summary['balance_efficiency_start']:.2f} at the start ->"
        f" {summary['balance_efficiency_end']:.2f} at the end (1.00 = every rank computes as long as the slowest),"
        f" {summary['replans']} re-plan{'' if summary['replans'] == 1 else 's'}"
        + (f"; measuring cost {cost:.2%} of the step time" if cost is not None else "")
        + _micro_steps_text(report["steps"])
        + _link_wait_text(summary)
        + late_rank_text(summary)
        + data_stall_text(summary)
        + _skipped_text(report.get("nonfinite"))
        + _precision_text(report.get("precision"))
        + _communication_text(report.get("communication"))
        + _asynchronous_text(report.get("asynchronous"))
    )


def _micro_steps_text(steps: list[dict[str, Any]]) -> str:
    """The ranks that took their samples in several micro-batches, at the end of the fit."""
    last = steps[-1].get("micro_steps") if steps else None
    if not last or all(k <= 1 for k in last):  # (0: a rank padded with empty steps, asynchronous merges)
        return ""
    return f"; micro-steps per rank at the end {last}"


def _asynchronous_text(merges: Optional[dict[str, Any]]) -> str:
    if not merges:
        return ""
    waits = ", ".join(f"{wait * 1e3:.0f} ms" for wait in merges["most_wait_seconds"])
    return (
        f"; asynchronous merges: {merges['merges']} merges, micro-batches per rank {merges['micro_batches']}, the most"
        f" a rank waited in one for the last to arrive {waits}"
    )


def _link_wait_text(summary: dict[str, Any]) -> str:
    if "link_wait_seconds_per_step" not in summary:
        return ""
    per_rank = ", ".join(
        f"{wait * 1e3:.1f} ms" + (f" ({share:.0%} of its compute)" if share is not None else "")
        for wait, share in zip(summary["link_wait_seconds_per_step"], summary["link_wait_over_compute"])
    )
    return f"; waiting on the link in merges per step, per rank: {per_rank}"


def late_rank_text(summary: dict[str, Any]) -> str:
    """The rank the others waited for at the gradient exchange, and whether its compute explains it."""
    late = summary.get("late_rank")
    if not late:
        return ""
    why = ""
    if late.get("kernel_counted"):
        why = (
            f": the kernel held it {late['kernel_held_beyond_others_seconds'] * 1e3:.1f} ms per step more than the"
            " rank it held least, runnable but not running (a CPU quota, or another process on its core)"
        )
    elif late.get("held_beyond_others"):
        why = (
            f": its wall time before the exchange exceeds its compute by {late['held_beyond_others_seconds'] * 1e3:.1f}"
            " ms per step more than the other ranks' does, so something besides its compute holds it (a CPU quota,"
            " another process on its core, a slow host)"
        )
    return (
        f"; the others wait for rank {late['rank']}: it reaches the gradient exchange last in"
        f" {late['last_share']:.0%} of the steps, a median {late['median_lateness_seconds'] * 1e3:.1f} ms after the"
        f" first{why}"
    )


def data_stall_text(summary: dict[str, Any]) -> str:
    """The ranks that waited for their data, and what removes the wait."""
    stalled = summary.get("data_stalled_ranks")
    if not stalled:
        return ""
    each = ", ".join(
        f"rank {rank} {summary['data_wait_seconds_per_step'][rank] * 1e3:.1f} ms"
        f" ({summary['data_wait_over_compute'][rank]:.0%} of its compute)"
        for rank in stalled
    )
    split = {
        True: " (re-planning counts the wait in the rank's time and gives it fewer samples)",
        False: " (the split is fixed here; with `rebalance=True` re-planning would count the wait and give it fewer"
        " samples)",
    }.get(summary.get("replanning", True), "")
    return (
        f"; waiting for the data loader per step: {each}. That loader is a bottleneck{split}: more workers on that"
        " host (DataLoader(num_workers=...)), a larger prefetch_factor, or faster storage removes it"
    )


def _skipped_text(nonfinite: Optional[dict[str, Any]]) -> str:
    if not nonfinite or not nonfinite["skipped_steps"]:
        return ""
    skipped = nonfinite["skipped_steps"]
    shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
    steps = f"{len(skipped)} optimizer step{'' if len(skipped) == 1 else 's'}"
    return f"; {steps} skipped for non-finite gradients ({shown})"


def add_rank_wire(path: Path, steps: list[dict[str, Any]], rank: int) -> None:
    """Add this rank's bytes on the wire per step to its ``rank_<r>.json`` (written with the plan)."""
    if not path.is_file() or not steps or "inter_node_bytes" not in steps[0]:
        return
    record = json.loads(path.read_text())
    record["wire_bytes_per_step"] = {kind: [step[kind][rank] for step in steps] for kind in WIRE_KINDS}
    path.write_text(json.dumps(record, indent=2, default=str))


def _communication_text(communication: Optional[dict[str, Any]]) -> str:
    if not communication or "inter_node_bytes_per_step" not in communication:
        return ""
    between = communication["inter_node_bytes_per_step"]
    inside = communication["intra_node_bytes_per_step"]
    hierarchical = "on" if communication["hierarchical"] else "off"
    return (
        f"; on the wire per step: {_megabytes(between)} between nodes, {_megabytes(inside)} inside nodes"
        f" ({communication['compression'] or 'uncompressed'}, hierarchical {hierarchical})"
        + error_bound_text(communication.get("error_bound"))
    )


def error_bound_text(bound: Optional[dict[str, Any]]) -> str:
    """The compression's error at its last check against ``max_error``, and the setting it ended at."""
    if not bound or bound["last_error"] is None:
        return ""
    raised = f" (raised from {bound['start']:g})" if bound["current"] != bound["start"] else ""
    return (
        f"; compression error {bound['last_error']:.3f} at the last of {len(bound['checks'])} checks (max_error"
        f" {bound['max_error']:g}) at {bound['setting']} {bound['current']:g}{raised}"
    )


def _megabytes(value: float) -> str:
    return f"{value / 1e6:.3g} MB"


def _precision_text(precision: Optional[dict[str, Any]]) -> str:
    if precision is None or precision.get("loss_scale") is None:
        return ""
    skipped = precision["skipped_steps"]
    return (
        f"; fp16 loss scale {precision['loss_scale']:g}, {len(skipped)} step{'' if len(skipped) == 1 else 's'}"
        " skipped on every rank for an fp16 overflow"
    )


def write_report(report: dict[str, Any], directory: Path) -> tuple[Path, Path]:
    """``report.json`` and ``report.png`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, png_path = directory / "report.json", directory / "report.png"
    json_path.write_text(json.dumps(report, indent=1))
    _plot(report, png_path)
    return json_path, png_path


def _axis_top(values: list[float]) -> Optional[float]:
    """A y-axis limit that shows the bulk of ``values``; None when no value lies far above it."""
    if len(values) < 20:
        return None
    ordered = sorted(values)
    top = 1.5 * ordered[int(0.98 * (len(ordered) - 1))]
    return top if ordered[-1] > top > 0 else None


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    steps = report["steps"]
    world_size = report["world_size"]
    x = [step["step"] for step in steps]
    figure, (compute_axis, share_axis) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), constrained_layout=True)
    compute_ms = [[step["compute_seconds"][rank] * 1e3 for step in steps] for rank in range(world_size)]
    for rank in range(world_size):
        compute_axis.plot(x, compute_ms[rank], label=f"rank {rank}", lw=1)
    compute_axis.set_ylabel("compute per step (ms)")
    compute_axis.set_title("Each rank's compute per training step: balanced when the lines meet")
    top = _axis_top([value for values in compute_ms for value in values])
    if top is not None:
        # One outlier step (a garbage collection, a page fault) would flatten every line: leave it off the axis.
        above = sum(value > top for values in compute_ms for value in values)
        compute_axis.set_ylim(0, top)
        label = f"{above} outlier{'' if above == 1 else 's'} above the axis"
        compute_axis.annotate(label, (0.01, 0.97), xycoords="axes fraction", va="top", fontsize="small")
    bottom = [0.0] * len(steps)
    for rank in range(world_size):  # stacked shares, constant within a step (a re-plan is a step change)
        # (a step in which no rank trained: an asynchronous rank's micro-batch taken over, padded beside nothing)
        share = [step["batch_sizes"][rank] / (sum(step["batch_sizes"]) or 1) for step in steps]
        top_edge = [low + part for low, part in zip(bottom, share)]
        share_axis.fill_between(x, bottom, top_edge, step="post", alpha=0.8, label=f"rank {rank}")
        bottom = top_edge
    share_axis.set_ylim(0, 1)
    share_axis.set_ylabel("share of the global batch")
    share_axis.set_xlabel("training step")
    for replan in report["replans"]:
        for axis in (compute_axis, share_axis):
            axis.axvline(replan["step"], color="black", ls="--", lw=1)
        compute_axis.annotate("re-plan", (replan["step"], 1), xycoords=("data", "axes fraction"), va="top")
    compute_axis.legend(loc="upper right", fontsize="small")
    summary = report["summary"]
    if summary["steps"]:
        figure.suptitle(
            f"{summary['steps']} steps, {summary['samples_per_second']:.0f} samples/s, balance efficiency"
            f" {summary['balance_efficiency_start']:.2f} -> {summary['balance_efficiency_end']:.2f},"
            f" {summary['replans']} re-plan{'' if summary['replans'] == 1 else 's'}"
        )
    figure.savefig(path, dpi=100)
    plt.close(figure)
