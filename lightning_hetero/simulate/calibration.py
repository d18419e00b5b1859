"""Simulate: what a finished run of the package teaches the step model: each catalog GPU's fraction of peak
(``--profile``: its rank_<r>.json profiles) and the training loop's costs beyond the profiled step (``--calibrate``: a
CPU run of the same model on this machine, its report.json and rank_<r>.json)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

from lightning_hetero.simulate.catalog import with_overrides
from lightning_hetero.simulate.cluster import Cluster, Link, SimulatedDevice
from lightning_hetero.simulate.device_model import efficiency_from_profile
from lightning_hetero.simulate.predict import predict
from lightning_hetero.simulate.step_options import LoopCalibration, Options, calibrate_loop
from lightning_hetero.simulate.workload import Workload


def read_run(directory: str, what: str) -> tuple[Optional[dict[str, Any]], list[dict[str, Any]]]:
    """A run directory's report.json (or None) and its rank_<r>.json files, in rank order."""
    paths = sorted(glob.glob(os.path.join(directory, "rank_*.json")), key=lambda p: int(p.rsplit("_", 1)[1][:-5]))
    if not paths:
        raise ValueError(f"`{what} {directory}` has no rank_<r>.json: give a run's plan directory (runs/.../hetero)")
    ranks = []
    for path in paths:
        with open(path) as handle:
            ranks.append(json.load(handle))
    report_path = os.path.join(directory, "report.json")
    report = None
    if os.path.exists(report_path):
        with open(report_path) as handle:
            report = json.load(handle)
    return report, ranks


def efficiency_by_kind(directory: str, workload: Workload) -> dict[str, float]:
    """The mean fraction of peak per catalog GPU kind in a run's profiles of the same model."""
    _, ranks = read_run(directory, "--profile")
    found: dict[str, list[float]] = {}
    for rank in ranks:
        calibrated = efficiency_from_profile(rank, workload)
        if calibrated is not None:
            found.setdefault(calibrated[0], []).append(calibrated[1])
    return {kind: sum(values) / len(values) for kind, values in found.items()}


def run_cluster(report: dict[str, Any], ranks: list[dict[str, Any]], workload: Workload, link: Link) -> Cluster:
    """The hardware a CPU run on this machine had: a CPU like this one per rank at its emulated speed, its
    (emulated) nodes with ``link`` inside each and its emulated link between them."""
    speeds = ranks[0]["plan"].get("emulate_speeds") or [1.0] * len(ranks)
    communication = report["communication"]
    nodes = communication.get("nodes") or [0] * len(ranks)
    emulated = communication.get("emulated_link")
    between = Link(emulated["gbit_per_second"] * 1e9 / 8, emulated["latency_ms"] / 1e3) if emulated else link
    devices = tuple(
        SimulatedDevice(with_overrides(workload.here_kind, speed=speed), node) for speed, node in zip(speeds, nodes)
    )
    count = max(nodes) + 1
    return Cluster(devices, (link,) * count, between if count > 1 else None)


def loop_from_run(directory: str, workload: Workload, link: Link) -> LoopCalibration:
    """The loop's costs a CPU run of the same model on this machine shows (see :class:`LoopCalibration`)."""
    report, ranks = read_run(directory, "--calibrate")
    if report is None:
        raise ValueError(f"`--calibrate {directory}` has no report.json: give the plan directory of a finished run")
    if any(rank["device"]["kind"] != "cpu" for rank in ranks):
        raise ValueError(f"`--calibrate {directory}` is a GPU run: calibrate the loop with a CPU run of this machine")
    communication = report["communication"]
    options = Options(
        global_batch_size=ranks[0]["plan"]["global_batch_size"],
        zero_stage=ranks[0]["deepspeed_config"]["zero_optimization"]["stage"],
        compression=communication.get("compression"),
        hierarchical=bool(communication.get("hierarchical")),
        precision=ranks[0]["precision"] if len({rank["precision"] for rank in ranks}) == 1 else None,
    )
    predicted = predict(run_cluster(report, ranks, workload, link), workload, options)
    return calibrate_loop(report, ranks, workload, predicted.exchange.seconds + predicted.optimizer_seconds)
