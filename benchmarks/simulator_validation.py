"""How far `lightning-hetero plan`'s predictions are from what the package measures, on this machine.

    python benchmarks/simulator_validation.py             # 7 configurations, one fit each: about 4 minutes
    python benchmarks/simulator_validation.py --runs 3    # every configuration 3 times (order rotated)
    python benchmarks/simulator_validation.py --configurations 0 3 --out /tmp/simulator_validation.json  # two of them

Each configuration is a real fit of the examples' spiral classifier (global batch 256, 80 steps, automatic split,
one thread per rank, gloo) on emulated hardware: speeds by ``emulate_speeds``, nodes and a slow link between them
by ``LIGHTNING_HETERO_EMULATE_NODES`` / ``_LINK``. The same hardware is written as a cluster file (printed with
``--show-clusters``): each rank a 1-core CPU of this machine's ISA and clock with its emulated ``speed``, the link
between ranks on one node measured here first (a gloo all-reduce between 2 processes at two sizes), the emulated
link as ``inter_node``. The simulator measures the model here (as ``lightning-hetero plan`` does) and predicts,
calibrated (``--calibrate``) by one more fit that is not among the configurations: 2 ranks at equal speed with fixed
micro-batches 176/80, ZeRO-0.

Measured, from each run's report over its last 20 steps (each a figure within one run, so the machine's drift
between runs does not enter the split):

    balancing     the split that equalises the ranks' measured compute: each rank's profiled line scaled to its
                  measured compute, then the package's exact planner (what the re-planner computes, without the
                  5 % gain it waits for before it moves: a run's own split can sit anywhere in that band)
    used          the split the run trained its last steps with
    meas.         the median step time (``step_seconds``)

    error         max over ranks of |predicted share - balancing share| / balancing share
    points        the same difference in percentage points of the global batch (a rank of 4 % is 10 samples)
    step ms       the predicted step time, at the predicted split and at the run's own split ("at used": the step
                  model alone, without the split's difference); "error" columns against the measured one

Targets (issue 21): split within 10 %, step time within 20 %. Printed, and written to ``--out`` (default
``benchmarks/results/simulator_validation.json``): the run's command, commit, machine and date, its setting, the link
and the model measured here, the calibration, and every fit's figures (its predicted and measured splits and step
times, the errors above, and the same as ratios, predicted over measured). The fits run the package of this checkout
(first on ``sys.path`` and ``PYTHONPATH``), not an installed one. A run worth keeping is committed as
``benchmarks/measured/simulator_validation_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
# The package beside this script, not an installed one: a run measures the checkout it is run from (a worktree).
sys.path.insert(0, str(ROOT))
from jobs import checkout_first, run_facts, run_job  # noqa: E402  (benchmarks/jobs.py: benchmarks/ is no package)

DEFAULT_OUT = HERE / "results" / "simulator_validation.json"
GLOBAL_BATCH = 256
STEPS = 80
SETTLED = 20  # the last steps, over which the measured split and step time are taken
FIT_TIMEOUT = 300
LINK = (1.0, 0.1)  # the emulated link between nodes: Gbit/s, ms

# name, speeds per rank, ZeRO stage, compression, emulated nodes (None: one node)
CONFIGURATIONS = [
    ("2 ranks, ZeRO-0", [1.0, 0.4], 0, None, None),
    ("2 ranks, ZeRO-2", [1.0, 0.4], 2, None, None),
    ("2 ranks, ZeRO-0, fp16", [1.0, 0.4], 0, "fp16", None),
    ("2 ranks, 1 : 0.6, ZeRO-0", [1.0, 0.6], 0, None, None),
    ("4 ranks, ZeRO-0", [1.0, 0.4, 1.0, 0.4], 0, None, None),
    ("4 ranks, 2x2 nodes, ZeRO-0", [1.0, 0.4, 1.0, 0.4], 0, None, 2),
    ("4 ranks, 2x2 nodes, ZeRO-0, fp16", [1.0, 0.4, 1.0, 0.4], 0, "fp16", 2),
]


# ---------------------------------------------------------------------------------------------- one fit (--fit)


def fit(configuration: dict[str, Any], out: Path) -> None:
    import torch
    from lightning.pytorch import Trainer, seed_everything

    sys.path.insert(0, str(ROOT))
    from examples.spirals import SpiralClassifier, SpiralDataModule
    from lightning_hetero import HeteroStrategy

    torch.set_num_threads(1)
    seed_everything(0)
    strategy = HeteroStrategy(
        stage=configuration["stage"],
        global_batch_size=None if configuration.get("batch_sizes") else GLOBAL_BATCH,
        batch_sizes=configuration.get("batch_sizes"),
        emulate_speeds=configuration["speeds"],
        compression=configuration["compression"],
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=len(configuration["speeds"]),
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(SpiralClassifier(), SpiralDataModule(batch_size=GLOBAL_BATCH // len(configuration["speeds"])))


def launch(configuration: dict[str, Any], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    # the checkout first for the fit and every rank it starts, whatever they import before this script's path
    environment = checkout_first(ROOT)
    if configuration["nodes"]:
        environment["LIGHTNING_HETERO_EMULATE_NODES"] = str(configuration["nodes"])
        environment["LIGHTNING_HETERO_EMULATE_LINK"] = f"{LINK[0]},{LINK[1]}"
    command = [sys.executable, __file__, "--fit", json.dumps(configuration), str(out)]
    run_job(command, out / "log.txt", environment, FIT_TIMEOUT, configuration["name"])
    world = len(configuration["speeds"])
    report = json.loads((out / "hetero" / "report.json").read_text())
    profiles = [json.loads((out / "hetero" / f"rank_{r}.json").read_text())["profile"] for r in range(world)]
    if any(profile is None for profile in profiles):
        return {}  # fixed batch_sizes (the calibration run): nothing profiled, nothing to balance
    return measured_figures(report, profiles)


def measured_figures(report: dict[str, Any], profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run measured over its last steps (pure).

    ``balancing``: the split that equalises the ranks' measured compute, as the package's re-planner computes it (each
    rank's profiled line scaled to its measured compute, then the exact min-max planner) but without its hysteresis:
    the re-planner moves only for a predicted gain of 5 % or more, so the split a run ends with can sit anywhere in
    that band. ``used``: the split the run ran its last steps with.
    """
    from lightning_hetero.measure.cost import CostModel
    from lightning_hetero.split.decisions.planner import plan_min_max

    settled = report["steps"][-SETTLED:]
    world = len(profiles)
    used = [round(statistics.median(step["batch_sizes"][r] for step in settled)) for r in range(world)]
    compute = [statistics.median(step["compute_seconds"][r] for step in settled) for r in range(world)]
    costs = []
    for profile, batch, seconds in zip(profiles, used, compute):
        scale = seconds / (profile["fixed_seconds"] + profile["seconds_per_sample"] * batch)
        costs.append(CostModel(profile["fixed_seconds"] * scale, profile["seconds_per_sample"] * scale))
    return {
        "used": used,
        "balancing": list(plan_min_max(costs, sum(used)).batch_sizes),
        "step_ms": 1e3 * statistics.median(step["step_seconds"] for step in settled),
        "compute_ms": [1e3 * seconds for seconds in compute],
    }


# ------------------------------------------------------------------------------------------ this machine's link


def _link_worker(rank: int, port: int, sizes: list[int], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    timings = {}
    for size in sizes:
        tensor = torch.ones(size // 4)
        for _ in range(5):
            dist.all_reduce(tensor)
        samples = []
        for _ in range(30):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - start)
        timings[size] = statistics.median(samples)
    if rank == 0:
        queue.put(timings)
    dist.destroy_process_group()


def measure_local_link() -> tuple[float, float]:
    """(bytes/s, seconds) of a 2-rank gloo all-reduce here: ``time(V) = 2 * latency + V / bandwidth``."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sizes = [4096, 4 * 1024 * 1024]
    context = mp.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_link_worker, args=(r, port, sizes, queue)) for r in range(2)]
    for worker in workers:
        worker.start()
    timings = queue.get(timeout=120)
    for worker in workers:
        worker.join(timeout=30)
    small, large = sizes
    bandwidth = (large - small) / (timings[large] - timings[small])
    latency = max(0.0, (timings[small] - small / bandwidth) / 2)
    return bandwidth, latency


# ---------------------------------------------------------------------------------------------- the prediction


def cluster_text(configuration: dict[str, Any], kind: Any, link: tuple[float, float]) -> str:
    """The configuration's hardware as a cluster file: a 1-core CPU of this machine per rank, at its emulated speed
    times its part of this machine's cores when there are more ranks than cores (4 ranks on 2 cores: half each)."""
    _, isa, ghz = kind.cpu
    share = min(1.0, (os.cpu_count() or 1) / len(configuration["speeds"]))
    speeds = [round(speed * share, 4) for speed in configuration["speeds"]]
    nodes = configuration["nodes"] or 1
    per_node = len(speeds) // nodes
    bandwidth, latency = link
    lines = ["nodes:"]
    for node in range(nodes):
        devices = ", ".join(
            f"{{kind: cpu, cores: 1, isa: {isa}, ghz: {ghz}, speed: {speed}}}"
            for speed in speeds[node * per_node : (node + 1) * per_node]
        )
        lines.append(f"  - devices: [{devices}]")
        lines.append(f"    link: {{bandwidth: {bandwidth * 8 / 1e9:.3f}Gbit, latency: {latency * 1e6:.1f}us}}")
    if nodes > 1:
        lines.append(f"inter_node: {{bandwidth: {LINK[0]}Gbit, latency: {LINK[1]}ms}}")
    return "\n".join(lines) + "\n"


def predict(configuration: dict[str, Any], workload: Any, link: tuple[float, float], loop: Any) -> tuple[str, Any]:
    """The configuration's cluster file and the simulator's prediction for it."""
    from lightning_hetero.simulate.cluster import load_cluster_text
    from lightning_hetero.simulate.predict import predict
    from lightning_hetero.simulate.step_options import Options

    text = cluster_text(configuration, workload.here_kind, link)
    options = Options(
        global_batch_size=GLOBAL_BATCH,
        zero_stage=configuration["stage"],
        compression=configuration["compression"],
        loop=loop,
        precision="32-true",  # the fits train in the Trainer's precision (no device_precision)
    )
    return text, predict(load_cluster_text(text, configuration["name"]), workload, options)


def compare(prediction: Any, measured: dict[str, Any]) -> dict[str, Any]:
    """The prediction beside the measurement (pure): the split against the balancing one, the step time at the run's
    own split (the step model alone) and at the predicted split (the whole prediction)."""
    split = [device.samples for device in prediction.devices]
    total = sum(split)
    shares = [(p / total, m / total) for p, m in zip(split, measured["balancing"])]
    beside_compute = prediction.step_seconds - prediction.compute_seconds
    at_used = max(device.cost.time(b) for device, b in zip(prediction.devices, measured["used"])) + beside_compute
    worst = max(shares, key=lambda share: abs(share[0] - share[1]) / share[1])  # the rank of split_error
    return {
        "predicted_split": split,
        "predicted_step_ms": 1e3 * prediction.step_seconds,
        "predicted_step_ms_at_used_split": 1e3 * at_used,
        "split_error": max(abs(p - m) / m for p, m in shares),
        "share_points": 100 * max(abs(p - m) for p, m in shares),
        "step_error": (prediction.step_seconds * 1e3 - measured["step_ms"]) / measured["step_ms"],
        "step_error_at_used_split": (at_used * 1e3 - measured["step_ms"]) / measured["step_ms"],
        # the same as ratios, predicted over measured (1: a right prediction); for the split, the share of the rank
        # whose split_error it is, predicted over balancing
        "split_predicted_over_balancing": worst[0] / worst[1],
        "step_predicted_over_measured": prediction.step_seconds * 1e3 / measured["step_ms"],
        "step_at_used_split_predicted_over_measured": at_used * 1e3 / measured["step_ms"],
    }


def measure_here(world_size: int) -> Any:
    """The model measured here as `lightning-hetero plan` measures it for a cluster of ``world_size`` devices."""
    import torch

    sys.path.insert(0, str(ROOT))
    from examples.spirals import SpiralClassifier, SpiralDataModule
    from lightning_hetero.measure.rank_profile import probe_sizes
    from lightning_hetero.simulate.workload import measure_workload, training_loader

    torch.set_num_threads(1)  # as each rank of the fits runs
    data = SpiralDataModule(batch_size=GLOBAL_BATCH // world_size)
    model = SpiralClassifier()
    loader = training_loader(model, data)
    sizes = probe_sizes(GLOBAL_BATCH, world_size)
    return measure_workload(model, loader, "examples.spirals:SpiralClassifier", sizes)


# Equal speeds at unequal micro-batches: two points of the loop's compute line, so its fixed part and its factor
# over the step measured here can both be told.
CALIBRATION = {
    "name": "calibration: 2 ranks 1 : 1 at 176/80, ZeRO-0",
    "speeds": [1.0, 1.0],
    "stage": 0,
    "compression": None,
    "nodes": None,
    "batch_sizes": [176, 80],
}


def calibrate(work: Path, workloads: dict[int, Any], link: tuple[float, float]) -> Any:
    """The loop's costs beyond the profiled step, from a run that is not one of the validated configurations."""
    from lightning_hetero.simulate.calibration import loop_from_run
    from lightning_hetero.simulate.cluster import Link

    out = work / "calibration"
    launch(CALIBRATION, out)
    return loop_from_run(str(out / "hetero"), workloads[2], Link(*link))


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'configuration':34s} {'predicted':>15s} {'balancing':>15s} {'used':>15s} {'error':>6s} {'points':>6s}"
        f" {'step ms':>7s} {'at used':>7s} {'meas.':>6s} {'error':>7s} {'at used':>7s}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        show = lambda split: "/".join(str(round(n)) for n in split)  # noqa: E731
        lines.append(
            f"{row['name']:34s} {show(row['predicted_split']):>15s} {show(row['measured']['balancing']):>15s}"
            f" {show(row['measured']['used']):>15s} {row['split_error']:>6.1%} {row['share_points']:>6.1f}"
            f" {row['predicted_step_ms']:>7.1f} {row['predicted_step_ms_at_used_split']:>7.1f}"
            f" {row['measured']['step_ms']:>6.1f} {row['step_error']:>+7.1%} {row['step_error_at_used_split']:>+7.1%}"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per configuration: the median of each error over its runs, and every run's figure."""
    lines = ["", "per configuration, median over runs (every run):"]
    for name in dict.fromkeys(row["name"] for row in rows):
        mine = [row for row in rows if row["name"] == name]
        parts = []
        for key, label, fmt in [
            ("split_error", "split", "{:.0%}"),
            ("step_error", "step", "{:+.0%}"),
            ("step_error_at_used_split", "step at used split", "{:+.0%}"),
        ]:
            values = [row[key] for row in mine]
            parts.append(
                f"{label} {fmt.format(statistics.median(values))} ({', '.join(fmt.format(v) for v in values)})"
            )
        lines.append(f"  {name:34s} " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--configurations",
        type=int,
        nargs="+",
        help="only these configurations, by their index in CONFIGURATIONS from 0 (default: all 7)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lightning_hetero_simulator_validation"))
    parser.add_argument("--show-clusters", action="store_true")
    parser.add_argument("--fit", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fit:
        fit(json.loads(args.fit[0]), Path(args.fit[1]))
        return
    facts = run_facts("benchmarks/simulator_validation.py", argv if argv is not None else sys.argv[1:], ROOT)
    chosen = args.configurations if args.configurations is not None else range(len(CONFIGURATIONS))
    configurations = [
        {"name": name, "speeds": speeds, "stage": stage, "compression": compression, "nodes": nodes}
        for name, speeds, stage, compression, nodes in (CONFIGURATIONS[index] for index in chosen)
    ]
    link = measure_local_link()
    print(f"this machine's gloo all-reduce between 2 processes: {link[0] * 8 / 1e9:.2f} Gbit/s, {link[1] * 1e6:.0f} us")
    workloads = {world: measure_here(world) for world in sorted({len(c["speeds"]) for c in configurations})}
    for world, workload in workloads.items():
        print(
            f"the model measured here for {world} devices: {workload.flops_per_sample / 1e6:.2f} MFLOP per sample,"
            f" fixed {workload.here_fixed_seconds * 1e3:.2f} ms, {workload.here_seconds_per_sample * 1e6:.1f} us per"
            " sample"
        )
    loop = calibrate(args.work, workloads, link)
    print(
        f"calibrated on 2 equal ranks at 176/80: compute in the loop {loop.loop_compute_seconds * 1e3:.2f} ms +"
        f" {loop.compute_factor:.2f} x the step measured here, {loop.step_overhead_seconds * 1e3:.2f} ms of loop"
        " overhead per step"
    )
    rows = []
    for run in range(args.runs):
        shift = run % len(configurations)
        for configuration in configurations[shift:] + configurations[:shift]:
            text, prediction = predict(configuration, workloads[len(configuration["speeds"])], link, loop)
            if args.show_clusters and run == 0:
                print(f"# {configuration['name']}\n{text}")
            measured = launch(configuration, args.work / f"run{run}" / configuration["name"].replace(" ", "_"))
            row = {"name": configuration["name"], "run": run, "measured": measured, **compare(prediction, measured)}
            rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    print(summary(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    calibration = {
        "loop_compute_seconds": loop.loop_compute_seconds,
        "compute_factor": loop.compute_factor,
        "step_overhead_seconds": loop.step_overhead_seconds,
    }
    setting = {
        "global_batch": GLOBAL_BATCH,
        "steps": STEPS,
        "settled": SETTLED,
        "emulated_link": {"gbit_per_s": LINK[0], "latency_ms": LINK[1]},
        "runs": args.runs,
        "configurations": configurations,
        "calibration_fit": CALIBRATION,
    }
    measured_here = {
        world: {
            "flops_per_sample": workload.flops_per_sample,
            "here_fixed_seconds": workload.here_fixed_seconds,
            "here_seconds_per_sample": workload.here_seconds_per_sample,
        }
        for world, workload in workloads.items()
    }
    record = {**facts, "setting": setting, "link": link, "workloads": measured_here, "calibration": calibration}
    args.out.write_text(json.dumps({**record, "rows": rows}, indent=1))
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
