"""`lightning-hetero plan`'s GPU model held against published training speeds and batch sizes.

    python benchmarks/planner_validation.py          # the table: about 5 minutes on 2 idle cores
    python benchmarks/planner_validation.py --fit    # also re-fit the catalog's constants on the calibration rows
                                                     # (written to benchmarks/planner_fit.json)
    python benchmarks/planner_validation.py --out /tmp/planner_validation.json

The published rows (benchmarks/published_figures.json, each with its source file at a commit) are per-GPU training
throughput with mixed precision on one GPU: Lambda's deeplearning-benchmark (NVIDIA's PyTorch examples run by
Lambda on 10 GPU kinds: ResNet-50, BERT-base and BERT-large SQuAD at 384 tokens) and NVIDIA's DeepLearningExamples
(ResNet-50 v1.5 and BERT-large SQuAD, PyTorch). The models are written in benchmarks/published_models.py and measured
here exactly as `lightning-hetero plan` measures a user's model (simulate/workload.py: each operator's FLOPs and
bytes at two small batches, the saved activations, this CPU's timing at capped sizes).

Calibration rows (Lambda's ResNet-50 and BERT-base) fit the catalog's constants: one matrix-product efficiency for
every kind, a bandwidth efficiency per kind, the share of fp32 activation bytes mixed precision keeps. Held-out rows
never enter the fit: a held-out model (BERT-large) and a held-out source (NVIDIA's).

For each row: predicted samples/s at the row's batch (the step model's line for one device of the kind) against the
published figure; the largest micro-batch the planner allows against the row's batch (which that run shows fits);
for each source and model, every kind's speed relative to the A100-80GB, predicted against published. Then the
split the planner makes for A100-80GB + V100-16GB + A10 on ResNet-50 at a global batch of 768, against the split
the published speeds imply (samples in proportion to speed: every device done at once), and the time and memory
`lightning-hetero plan` takes here for ResNet-50 and BERT-base at a global batch of 1,024 over 3 GPUs.

Printed, and written to ``--out`` (default ``benchmarks/results/planner_validation.json``): the run's command, commit,
machine and date, its setting (the clusters, the catalog's constants it ran with), every row's figures (with the
predicted over the published speed, and the predicted over the published speed relative to the A100-80GB), the split,
the linearity checks, the timing of `plan` and the models measured. A run worth keeping is committed as
``benchmarks/measured/planner_validation_<what>.json`` and rendered by ``python benchmarks/render.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from jobs import run_facts  # noqa: E402  (benchmarks/jobs.py: benchmarks/ is no package)

from lightning_hetero.simulate import catalog, device_model  # noqa: E402
from lightning_hetero.simulate import predict as step_model  # noqa: E402
from lightning_hetero.simulate.cluster import load_cluster_text  # noqa: E402
from lightning_hetero.simulate.step_options import Options  # noqa: E402
from lightning_hetero.split.decisions.planner import plan_min_max  # noqa: E402

MODELS = {
    "resnet50": "published_models:ResNet50",
    "bert-base": "published_models:BertBase",
    "bert-large": "published_models:BertLarge",
}
REFERENCE_KIND = "A100-80GB"
SPLIT_CLUSTER = "nodes:\n  - devices: [{kind: A100-80GB}, {kind: V100-16GB}, {kind: A10}]\n"
LAPTOP_CLUSTER = "nodes:\n  - devices: [{kind: A100-80GB}, {kind: V100-16GB}, {kind: T4}]\n"


def load_rows() -> list[dict]:
    with open(os.path.join(HERE, "published_figures.json")) as handle:
        return json.load(handle)["rows"]


def measure(name: str):
    """The model's Workload, measured as `lightning-hetero plan` measures it (at its sizes for 1,024 over 3)."""
    import published_models

    from lightning_hetero.measure.rank_profile import probe_sizes
    from lightning_hetero.simulate.workload import measure_workload

    model = getattr(published_models, MODELS[name].split(":")[1])()
    return measure_workload(model, model.train_dataloader(), name, probe_sizes(1024, 3))


def linearity(name: str, sizes: tuple[int, ...]) -> list[dict]:
    """The counts at ``sizes`` against the lines `plan` extrapolates from micro-batches 2 and 4: FLOPs, bytes moved
    and saved activations of a step (the laptop's extrapolation holds if these agree)."""
    import published_models

    from lightning_hetero.measure.operators import operator_lines
    from lightning_hetero.simulate.workload import COUNT_SIZES, _step_counts

    model = getattr(published_models, MODELS[name].split(":")[1])()
    loader = model.train_dataloader()

    def counts(size: int):
        return _step_counts(model, loader.collate_fn([loader.dataset[i % len(loader.dataset)] for i in range(size)]))

    small, large = COUNT_SIZES
    at_small, at_large = counts(small), counts(large)
    lines = operator_lines(at_small.records, at_large.records, small, large)
    saved_slope = (at_large.saved_bytes - at_small.saved_bytes) / (large - small)
    checks = []
    for size in sizes:
        measured = counts(size)
        flops = sum(op.flops + op.flops_per_sample * size for op in lines)
        moved = sum(op.bytes + op.bytes_per_sample * size for op in lines)
        saved = at_small.saved_bytes + saved_slope * (size - small)
        checks.append(
            {
                "model": name,
                "batch": size,
                "flops_error": flops / measured.flops - 1,
                "bytes_error": moved / sum(r[1] for r in measured.records) - 1,
                "saved_error": saved / measured.saved_bytes - 1,
            }
        )
    return checks


def predicted(row: dict, workload, kind=None) -> tuple[float, int]:
    """(samples/s at the row's batch, the largest micro-batch the planner allows) for one device of the row's kind."""
    kind = kind or catalog.lookup(row["kind"])
    cost = device_model.device_cost(kind, workload, Options(global_batch_size=row["batch"], zero_stage=0), 1)
    return row["batch"] / (cost.fixed + cost.per_sample * row["batch"]), cost.max_batch


def room_bytes(row: dict, workload) -> float:
    """What one device of the row's kind has for activations: its usable memory less the state and DeepSpeed's
    buffer."""
    kind = catalog.lookup(row["kind"])
    return device_model.usable_memory_bytes(kind) - device_model.rank_state_bytes(workload.parameters, 0, 1)


def allowed_batch(row: dict, workload, share: float) -> int:
    """The largest micro-batch one device of the row's kind allows if mixed precision keeps ``share`` of the fp32
    activation bytes (what :func:`~lightning_hetero.simulate.device_model.device_cost` computes with its constant)."""
    return math.floor(room_bytes(row, workload) / (share * workload.activation_bytes_per_sample))


def fit(rows: list[dict], workloads: dict) -> dict:
    """The catalog's constants that best fit the calibration rows (least squares of log speed errors)."""
    calibration = [r for r in rows if r["role"] == "calibration"]
    kinds = sorted({r["kind"] for r in calibration})
    best = None
    saved = device_model.MATMUL_EFFICIENCY  # (gpu_seconds reads it as a global of device_model)
    for matmul in [x / 20 for x in range(10, 21)]:  # 0.50 ... 1.00 of the tensor-core peak
        device_model.MATMUL_EFFICIENCY = matmul
        fitted, total = {}, 0.0
        for name in kinds:
            rows_of = [r for r in calibration if r["kind"] == name]

            def loss(efficiency: float, name: str = name, rows_of: list[dict] = rows_of) -> float:
                kind = replace(catalog.lookup(name), bandwidth_efficiency=efficiency)
                return sum(
                    math.log(predicted(r, workloads[r["model"]], kind)[0] / r["samples_per_second"]) ** 2
                    for r in rows_of
                )

            low, high = 0.05, 1.5  # golden-section search: the loss is unimodal in the efficiency
            for _ in range(40):
                a, b = high - 0.618 * (high - low), low + 0.618 * (high - low)
                low, high = (low, b) if loss(a) < loss(b) else (a, high)
            fitted[name] = round((low + high) / 2, 2)
            total += loss(fitted[name])
        if best is None or total < best[0]:
            best = (total, matmul, fitted)
    device_model.MATMUL_EFFICIENCY = saved

    # Mixed precision's share of the fp32 activations: the one that brings every calibration row's largest micro-batch
    # closest to the largest batch its published runs show fits, never above it.
    def worst(share: float) -> float:
        ratios = [allowed_batch(r, workloads[r["model"]], share) / r["shown_to_fit"] for r in calibration]
        return math.inf if max(ratios) > 1 else max(abs(math.log(max(ratio, 1e-9))) for ratio in ratios)

    share = min((x / 1000 for x in range(400, 901, 5)), key=worst)
    return {
        "MATMUL_EFFICIENCY": best[1],
        "BANDWIDTH_EFFICIENCY": best[2],
        "DEFAULT_BANDWIDTH_EFFICIENCY": round(statistics.median(best[2].values()), 2),
        # the most the calibration batches allow for every row (so that no planned batch exceeds what ran)
        "HALF_PRECISION_ACTIVATIONS": share,
    }


def table(rows: list[dict], workloads: dict) -> list[dict]:
    results = []
    for row in rows:
        speed, max_batch = predicted(row, workloads[row["model"]])
        results.append(
            {
                **{k: row[k] for k in ("role", "source", "model", "kind", "samples_per_second", "batch")},
                "predicted": speed,
                "error": speed / row["samples_per_second"] - 1,
                "max_batch": max_batch,
                "shown_to_fit": row["shown_to_fit"],
                "room_gib": room_bytes(row, workloads[row["model"]]) / 2**30,
                "max_batch_ratio": max_batch / row["shown_to_fit"],
                "predicted_over_published": speed / row["samples_per_second"],
            }
        )
    for result in results:  # speed relative to the reference kind of the same source and model
        reference = next(
            (
                r
                for r in results
                if (r["source"], r["model"], r["kind"]) == (result["source"], result["model"], REFERENCE_KIND)
            ),
            None,
        )
        if reference is None or reference is result:
            result["ratio_error"] = None
            result["relative_predicted_over_published"] = None
            continue
        published = result["samples_per_second"] / reference["samples_per_second"]
        result["ratio_error"] = (result["predicted"] / reference["predicted"]) / published - 1
        # the kind's speed relative to the reference kind's, predicted over published (1: the ratio is right)
        result["relative_predicted_over_published"] = (result["predicted"] / reference["predicted"]) / published
    return results


def _slowest(samples, speeds) -> float:
    return max(n / s for n, s in zip(samples, speeds))


def split_check(rows: list[dict], workload) -> dict:
    """The planner's split of 768 ResNet-50 samples over A100-80GB + V100-16GB + A10 against the published speeds'."""
    cluster = load_cluster_text(SPLIT_CLUSTER)
    plan = step_model.predict(cluster, workload, Options(global_batch_size=768, zero_stage=0))
    speeds = {r["kind"]: r["samples_per_second"] for r in rows if r["source"] == "Lambda" and r["model"] == "resnet50"}
    published = [speeds[d.kind.name] for d in cluster.devices]
    # the published speeds as cost lines (no fixed part): the min-max split they imply
    from lightning_hetero.measure.cost import CostModel

    implied = plan_min_max([CostModel(0.0, 1 / s) for s in published], 768).batch_sizes
    planned = [d.samples for d in plan.devices]
    return {
        "kinds": [d.kind.name for d in cluster.devices],
        "planned": planned,
        "implied": list(implied),
        "error": [p / i - 1 for p, i in zip(planned, implied)],
        # the step the planned split takes at the published speeds, against the best split's
        "step_cost": _slowest(planned, published) / _slowest(implied, published) - 1,
    }


WITH_PEAK = """
import resource, sys
from lightning_hetero.simulate.command import main
code = main(sys.argv[2:])
print(f"peak KiB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
sys.exit(code)
"""


def laptop_check() -> list[dict]:
    """`lightning-hetero plan` for ResNet-50 and BERT-base at 1,024 over 3 GPUs: wall time and peak memory here."""
    results = []
    with tempfile.TemporaryDirectory() as directory:
        cluster = os.path.join(directory, "cluster.yaml")
        with open(cluster, "w") as handle:
            handle.write(LAPTOP_CLUSTER)
        for name in ("resnet50", "bert-base"):
            arguments = ["plan", "--cluster", cluster, "--model", MODELS[name], "--global-batch-size", "1024", "--json"]
            # the planner run in a child that prints its own peak resident set when it is done
            command = [sys.executable, "-c", WITH_PEAK, *arguments]
            started = time.perf_counter()
            environment = {**os.environ, "PYTHONPATH": ROOT}
            done = subprocess.run(command, cwd=HERE, capture_output=True, text=True, env=environment)
            seconds = time.perf_counter() - started
            peak = int(done.stderr.strip().splitlines()[-1].rpartition("peak KiB ")[2] or 0) if done.stderr else 0
            if done.returncode != 0:
                raise SystemExit(f"plan failed for {name}: {done.stderr[-2000:]}")
            plan = json.loads(done.stdout)
            results.append(
                {
                    "model": name,
                    "seconds": seconds,
                    "peak_rss_gib": peak / 2**20,
                    "samples": [d["samples"] for d in plan["devices"]],
                }
            )
    return results


def show(results: list[dict], split: dict, laptop: list[dict], linearity_checks: list[dict], fitted) -> str:
    lines = []
    for role in ("calibration", "held out"):
        chosen = [r for r in results if r["role"] == role]
        header = f"{'source':<7} {'model':<11} {'kind':<15} {'published':>9} {'predicted':>9} {'error':>7}"
        header += f" {'vs A100-80GB':>12}  {'batch':>6} {'fits':>6} {'max batch':>9} {'ratio':>6}"
        lines += [f"\n{role} rows", header]
        for r in chosen:
            ratio = "" if r["ratio_error"] is None else f"{r['ratio_error']:+.0%}"
            lines.append(
                f"{r['source']:<7} {r['model']:<11} {r['kind']:<15} {r['samples_per_second']:>9.1f}"
                f" {r['predicted']:>9.1f}"
                f" {r['error']:>+7.0%} {ratio:>12}  {r['batch']:>6} {r['shown_to_fit']:>6} {r['max_batch']:>9}"
                f" {r['max_batch_ratio']:>6.2f}"
            )
        errors = [abs(r["error"]) for r in chosen]
        ratios = [abs(r["ratio_error"]) for r in chosen if r["ratio_error"] is not None]
        batches = [r["max_batch_ratio"] for r in chosen]
        lines.append(
            f"{role}: |error| median {statistics.median(errors):.0%}, max {max(errors):.0%}; speed relative to the"
            f" A100-80GB |error| median {statistics.median(ratios):.0%}, max {max(ratios):.0%}; the planner's largest"
            f" micro-batch / the largest published runs show fits: {min(batches):.2f} to {max(batches):.2f}"
        )
    # How consistent the published batches are with any memory model linear in the batch: the largest batch shown to
    # fit per GiB left after the state, DeepSpeed's buffer and the context, across kinds (one model: one ratio).
    for model in MODELS:
        density = [
            r["shown_to_fit"] / r["room_gib"] for r in results if r["model"] == model and r["source"] == "Lambda"
        ]
        lines.append(
            f"{model}: the largest published batch per GiB of room ranges {min(density):.1f} to {max(density):.1f}"
            f" across kinds: any one bytes-per-sample that never allows more than a published run used allows at most"
            f" {min(density) / max(density):.2f} of it on some kind"
        )
    every = [abs(r["error"]) for r in results]
    lines.append(f"\nall rows: |error| median {statistics.median(every):.0%}")
    lines.append(
        f"\nsplit of 768 ResNet-50 samples over {' + '.join(split['kinds'])}: planned {split['planned']}, the published"
        f" speeds imply {split['implied']} ({', '.join(f'{e:+.1%}' for e in split['error'])}); the planned split's step"
        f" at the published speeds is {split['step_cost']:+.1%} against the implied one's"
    )
    for check in linearity_checks:
        lines.append(
            f"{check['model']} counted at a batch of {check['batch']} against the lines from 2 and 4: FLOPs"
            f" {check['flops_error']:+.2%}, bytes {check['bytes_error']:+.2%}, saved activations"
            f" {check['saved_error']:+.2%}"
        )
    for run in laptop:
        lines.append(
            f"plan {run['model']} at a global batch of 1,024 over A100-80GB + V100-16GB + T4: {run['seconds']:.1f} s,"
            f" peak memory {run['peak_rss_gib']:.2f} GiB here, split {run['samples']}"
        )
    if fitted:
        lines.append("\nfitted on the calibration rows (paste into simulate/catalog.py and simulate/device_model.py):")
        lines += [f"  {key} = {value}" for key, value in fitted.items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="re-fit the catalog's constants on the calibration rows")
    parser.add_argument("--no-laptop", action="store_true", help="skip timing `lightning-hetero plan` itself")
    parser.add_argument("--workloads", help="a pickle of the measured models to reuse (written if absent)")
    parser.add_argument("--out", type=Path, default=Path(HERE) / "results" / "planner_validation.json")
    args = parser.parse_args(argv)
    facts = run_facts("benchmarks/planner_validation.py", argv if argv is not None else sys.argv[1:], Path(ROOT))
    # the catalog's constants this run's predictions are made with (--fit only prints and writes what it fits)
    constants = {
        "MATMUL_EFFICIENCY": device_model.MATMUL_EFFICIENCY,
        "BANDWIDTH_EFFICIENCY": dict(catalog.BANDWIDTH_EFFICIENCY),
        "DEFAULT_BANDWIDTH_EFFICIENCY": catalog.DEFAULT_BANDWIDTH_EFFICIENCY,
        "HALF_PRECISION_ACTIVATIONS": device_model.HALF_PRECISION_ACTIVATIONS,
    }
    rows = load_rows()
    # first, while this process is small: a child's peak memory counts what it inherits at the fork
    laptop = [] if args.no_laptop else laptop_check()
    started = time.perf_counter()
    reused = bool(args.workloads and os.path.exists(args.workloads))
    if reused:
        with open(args.workloads, "rb") as handle:
            workloads = pickle.load(handle)
    else:
        workloads = {name: measure(name) for name in MODELS}
        if args.workloads:
            with open(args.workloads, "wb") as handle:
                pickle.dump(workloads, handle)
    measured_in = time.perf_counter() - started
    fitted = fit(rows, workloads) if args.fit else None
    results = table(rows, workloads)
    split = split_check(rows, workloads["resnet50"])
    linearity_checks = linearity("resnet50", (8, 32)) + linearity("bert-base", (8,))
    print(show(results, split, laptop, linearity_checks, fitted))
    print(f"\n(the three models measured here in {measured_in:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if fitted:  # tracked: tests/simulate/test_predict.py checks that the catalog carries these figures
        with open(os.path.join(HERE, "planner_fit.json"), "w") as handle:
            json.dump(fitted, handle, indent=1)
    setting = {
        "published": "benchmarks/published_figures.json",
        "models": MODELS,
        "reference_kind": REFERENCE_KIND,
        "split": {"cluster": SPLIT_CLUSTER, "model": "resnet50", "global_batch": 768},
        "laptop": None if args.no_laptop else {"cluster": LAPTOP_CLUSTER, "global_batch": 1024},
        "workloads_from": args.workloads if reused else None,
        "constants": constants,
    }
    with open(args.out, "w") as handle:
        json.dump(
            {
                **facts,
                "setting": setting,
                "measured_in_seconds": None if reused else measured_in,
                "rows": results,
                "split": split,
                "laptop": laptop,
                "fitted": fitted,
                "linearity": linearity_checks,
                "workloads": {
                    n: {
                        "flops_per_sample": w.flops_per_sample,
                        "activation_bytes_per_sample": w.activation_bytes_per_sample,
                        "operators": len(w.operators),
                    }
                    for n, w in workloads.items()
                },
            },
            handle,
            indent=1,
        )


if __name__ == "__main__":
    main()
