"""`lightning-hetero plan`: plan a mixed cluster before using it.

Reads a cluster file (:mod:`.cluster`), measures the user's training step here (:mod:`.workload`), and prints the plan
the package would make there (:mod:`.predict`): each device's micro-batch, micro-steps, precision, memory and compute
time, the step time and its parts, the speedup over the equal split and over the best homogeneous subset, the bytes
on the wire, and what-ifs (``--drop``, ``--add``, ``--stage``, ``--compression``) against the cluster as described.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace
from typing import Any, Optional

from lightning_hetero.local.inner_steps import (
    check_inner_steps_length,
    check_sync_arguments,
    sync_fragments,
    sync_overlap,
    sync_refusal,
)
from lightning_hetero.simulate import catalog
from lightning_hetero.simulate.calibration import efficiency_by_kind, loop_from_run
from lightning_hetero.simulate.cluster import Cluster, ClusterFileError, SimulatedDevice, load_cluster
from lightning_hetero.simulate.device_model import (
    GPU_CONTEXT_BYTES,
    PLANNING_HEADROOM,
    activation_bytes,
    precision_of,
    usable_memory_bytes,
)
from lightning_hetero.simulate.local_merge import evaluate_local
from lightning_hetero.simulate.memory_fit import memory_fit
from lightning_hetero.simulate.pipeline import ChainShares, chain_shares, describe_pipeline_prediction, predict_pipeline
from lightning_hetero.simulate.predict import Prediction, automatic_stage, predict
from lightning_hetero.simulate.step_options import LoopCalibration, Options

NO_LOOP = LoopCalibration()
DESCRIPTION = (
    "Plan a mixed cluster before using it: reads a cluster file, measures your training step here, and prints the"
    " plan HeteroStrategy would make there (each device's micro-batch, micro-steps, precision, memory and compute"
    " time), the step time and its parts, the speedup over the equal split and over the best single-kind subset, the"
    " bytes on the wire, and what-ifs (--drop, --add, --stage, --compression) against the cluster as described."
)
JSON_DOC = """--json prints one object:
  devices: one entry per device, in rank order: kind, node, samples (per optimizer step), micro_batch (the
           largest of its micro-batches), micro_steps, precision, memory_bytes (predicted use at micro_batch),
           memory_capacity_bytes, compute_ms (its compute per optimizer step), fixed_ms (the part of compute_ms
           that does not grow with its samples: kernel launches, per micro-step)
  step_ms: {total, compute, exchange, optimizer, overhead} (overhead: 0 unless --calibrate gives a run)
  equal_split_step_ms: the same parts for the equal split (DDP's), on the same devices
  speedup_over_equal: the equal split's step time over this plan's
  best_homogeneous: {kind, devices, step_ms, speedup} (the fastest single-kind subset; null if none can train)
  wire: {bytes_per_step, inter_node_bytes_per_step, hierarchical, reason}
  memory_fit: the largest model (trainable parameters, fp32 with Adam) beside each device's planned activations:
           {zero1_even_parameters, zero2_even_parameters (DeepSpeed's even shards), memory_sized_parameters
           (stage=2, shards='memory'), even_limited_by (the device kind with the least room), room_bytes}
  settings: {global_batch_size, zero_stage, zero_stage_reason (why, when --stage was not given), compression,
             devices, nodes, memory_headroom (the fraction of each device's memory a plan leaves free),
             gpu_context_bytes (what a GPU's CUDA context and workspaces take before the plan)}
  what_if: the same keys for the cluster with --drop/--add/--stage/--compression applied, when any is given
  local (with --sync local_sgd or diloco): {sync, sync_every, fragments, overlap_steps, compression, devices:
           [{kind, inner_steps, micro_batch, inner_step_ms}], training_step_ms: {total, compute, link_wait,
           overhead}, link_wait_over_compute, merge: {bytes_per_rank, ms, inter_node_bytes, every_steps},
           samples_per_second, speedup_over_every_step (its samples per second over the plan's above)}
  pipeline (with --pipeline-blocks): {stages: [{stage, kind, rank, blocks, compute_ms_per_micro_batch,
           memory_bytes, memory_capacity_bytes}], replicas, schedule, micro_batches, micro_batch, step_ms,
           transfer_ms, bubble, balance, data_parallel_error (why the batch split cannot train, or null)}"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-hetero plan",
        description=textwrap.fill(DESCRIPTION, 100),
        epilog=JSON_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", required=True, help="the cluster file (YAML; see lightning_hetero/simulate/cluster.py)")
    p.add_argument("--model", required=True, help="MODULE:CLASS of the LightningModule (built with --init-args)")
    p.add_argument("--init-args", default="{}", help="JSON keyword arguments for the model's constructor")
    p.add_argument("--data", help="MODULE:CLASS of a LightningDataModule giving the training samples")
    p.add_argument("--global-batch-size", type=int, help="samples per optimizer step (default: loader batch x devices)")
    p.add_argument("--profile", help="a run's directory with rank_<r>.json files: calibrates those GPU kinds")
    p.add_argument(
        "--calibrate",
        help="the plan directory of a finished CPU run of the same model on this machine: adds the training loop's"
        " costs beyond the step measured here (unequal batch_sizes tell its fixed part from its factor)",
    )
    p.add_argument(
        "--stage", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default: the lowest that fits, as HeteroStrategy)"
    )
    p.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16", "powersgd", "topk", "int8", "int4"),
        help="gradient compression (a what-if); with --sync local_sgd or diloco the merge's: none, fp16, bf16, int8"
        " or int4",
    )
    p.add_argument(
        "--sync",
        choices=("every_step", "local_sgd", "diloco"),
        default="every_step",
        help="also plan local training as HeteroStrategy(sync=...) runs it: inner steps, merges on the link",
    )
    p.add_argument("--sync-every", type=int, help="with --sync: training steps between merges (default 8)")
    p.add_argument(
        "--sync-options",
        default="{}",
        help='with --sync: HeteroStrategy\'s sync_options as JSON, e.g. \'{"fragments": 4, "overlap": true}\'',
    )
    p.add_argument("--inner-steps", type=int, nargs="+", help="with --sync: each rank's inner steps (default: planned)")
    p.add_argument(
        "--precision",
        choices=("auto", "32-true", "bf16-mixed", "16-mixed"),
        default="auto",
        help="every device's precision; auto (default): each device's own, as device_precision='auto' chooses",
    )
    p.add_argument("--drop", action="append", default=[], metavar="KIND", help="what if the devices of KIND left")
    p.add_argument("--add", action="append", default=[], metavar="KIND:N", help="what if N devices of KIND joined")
    p.add_argument("--json", action="store_true", help="print the documented JSON object instead of tables")
    p.add_argument(
        "--pipeline-blocks",
        metavar="NAME",
        help="also plan a pipeline: the model's attribute holding its chain of blocks (as `pipeline`'s"
        " `blocks`); the blocks are measured here",
    )
    p.add_argument("--pipeline-stages", type=int, help="stages per pipeline (default: every device in one pipeline)")
    p.add_argument("--pipeline-schedule", choices=("1f1b", "gpipe"), default="1f1b")
    return p


def main(args: Optional[list[str]] = None) -> int:
    options = parser().parse_args(args)
    try:
        cluster = load_cluster(options.cluster)
        what_if_cluster = apply_what_ifs(cluster, options.drop, options.add)
        compression = None if options.compression in (None, "none") else options.compression
        merge = local_settings(options, compression, [cluster, what_if_cluster])
        workload, global_batch, chain = _measure(options, len(cluster.devices))
    except (ClusterFileError, ValueError) as error:
        print(f"lightning-hetero plan: {error}", file=sys.stderr)
        return 2
    try:
        base = Options(
            global_batch_size=global_batch,
            precision=None if options.precision == "auto" else options.precision,
            zero_stage=None,
            calibrated_efficiency=efficiency_by_kind(options.profile, workload) if options.profile else {},
            loop=loop_from_run(options.calibrate, workload, cluster.node_links[0]) if options.calibrate else NO_LOOP,
        )
    except (OSError, KeyError, ValueError) as error:
        print(f"lightning-hetero plan: {error}", file=sys.stderr)
        return 2
    changed = replace(base, zero_stage=options.stage, compression=None if merge is not None else compression)
    try:
        result = evaluate(cluster, workload, base)
        if merge is not None:
            result["local"] = evaluate_local(cluster, workload, base, merge, result["step_ms"]["total"])
        if changed != base or what_if_cluster is not cluster:
            result["what_if"] = evaluate(what_if_cluster, workload, changed)
            if merge is not None:
                every_step_ms = result["what_if"]["step_ms"]["total"]
                result["what_if"]["local"] = evaluate_local(what_if_cluster, workload, changed, merge, every_step_ms)
    except ValueError as error:
        if chain is None:
            print(f"lightning-hetero plan: {error}", file=sys.stderr)
            return 2
        result = {"data_parallel_error": str(error)}  # (the pipeline may still train it)
    if chain is not None:
        try:
            stages = options.pipeline_stages or len(cluster.devices)
            result["pipeline"] = predict_pipeline(
                cluster, workload, chain, replace(base, zero_stage=0), stages, options.pipeline_schedule
            )
            result["pipeline"]["data_parallel_error"] = result.get("data_parallel_error")
        except ValueError as error:
            print(f"lightning-hetero plan: {error}", file=sys.stderr)
            return 2
    if options.json:
        print(json.dumps(result, indent=1))
    elif "devices" in result:
        print(render(result, workload))
        if "pipeline" in result:
            print("\n" + "\n".join(describe_pipeline_prediction(result["pipeline"], result["step_ms"]["total"], "")))
    else:
        print(f"data parallelism cannot train this here: {result['data_parallel_error']}")
        print("\n".join(describe_pipeline_prediction(result["pipeline"], None, "see above")))
    return 0


def _measure(options: argparse.Namespace, world_size: int) -> tuple[Any, int, Optional[ChainShares]]:
    """The model's workload, measured here at the sizes a run of ``world_size`` ranks would profile, and the global
    batch (``--global-batch-size``, or the loader's batch size on every device, as HeteroStrategy's default)."""
    from lightning_hetero.measure.rank_profile import probe_sizes
    from lightning_hetero.simulate.workload import load_object, measure_workload, training_loader

    try:
        init_args = json.loads(options.init_args)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"`--init-args {options.init_args}` is not JSON ({error}); e.g. '{{\"hidden\": 512}}'"
        ) from None
    if not isinstance(init_args, dict):
        raise ValueError(f"`--init-args {options.init_args}` must be a JSON object of keyword arguments")
    model_class = load_object(options.model, "--model")
    try:
        model = model_class(**init_args)
    except TypeError as error:
        raise ValueError(f"`--model {options.model}` with `--init-args {options.init_args}`: {error}") from None
    datamodule = load_object(options.data, "--data")() if options.data else None
    loader = training_loader(model, datamodule)
    global_batch = options.global_batch_size or (loader.batch_size or 1) * world_size
    workload = measure_workload(model, loader, options.model, probe_sizes(global_batch, world_size))
    chain = None
    if options.pipeline_blocks:
        import torch

        samples = min(16, len(loader.dataset))
        batch = loader.collate_fn([loader.dataset[i] for i in range(samples)])
        chain = chain_shares(model, options.pipeline_blocks, batch, samples, torch.device("cpu"))
    return workload, global_batch, chain


def apply_what_ifs(cluster: Cluster, drop: list[str], add: list[str]) -> Cluster:
    """``cluster`` without the devices of each dropped kind and with the added ones (on a new node each)."""
    if not drop and not add:
        return cluster
    devices = list(cluster.devices)
    for name in drop:
        kept = [d for d in devices if catalog.folded_name(d.kind.name) != catalog.folded_name(name)]
        if len(kept) == len(devices):
            present = sorted({d.kind.name for d in devices})
            raise ValueError(f"`--drop {name}`: the cluster has no device of that kind (it has {', '.join(present)})")
        devices = kept
    links, inter_node = list(cluster.node_links), cluster.inter_node
    for entry in add:
        name, _, count = entry.partition(":")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"`--add {entry}` must be KIND:N with N >= 1, e.g. --add V100-32GB:4")
        kind = next(
            (d.kind for d in cluster.devices if catalog.folded_name(d.kind.name) == catalog.folded_name(name)), None
        )
        try:
            kind = kind or catalog.lookup(name)
        except KeyError as error:
            raise ValueError(f"`--add {entry}`: {error.args[0]}") from None
        links.append(links[0])
        devices += [SimulatedDevice(kind, len(links) - 1)] * int(count)
        inter_node = inter_node or cluster.node_links[0]
    if not devices:
        raise ValueError("the what-ifs leave no device in the cluster")
    used = sorted({d.node for d in devices})
    renumber = {node: index for index, node in enumerate(used)}
    return Cluster(
        tuple(SimulatedDevice(d.kind, renumber[d.node]) for d in devices),
        tuple(links[node] for node in used),
        inter_node if len(used) > 1 else None,
    )


def evaluate(cluster: Cluster, workload, options: Options) -> dict[str, Any]:
    """The plan, the equal split and the best homogeneous subset of ``cluster``, as the JSON keys."""
    stage_reason = None
    if options.zero_stage is None:  # HeteroStrategy's default: the lowest stage that fits this cluster
        choice = automatic_stage(cluster, workload, options)
        options, stage_reason = replace(options, zero_stage=choice.stage), choice.reason
    planned = predict(cluster, workload, options)
    equal = predict(cluster, workload, options, equal=True)
    best = best_homogeneous(cluster, workload, options)
    return {
        "devices": [
            {
                "kind": d.kind,
                "node": d.node,
                "samples": d.samples,
                "micro_batch": d.micro_batch,
                "micro_steps": d.micro_steps,
                "precision": d.precision,
                "memory_bytes": d.memory_bytes,
                "memory_capacity_bytes": d.memory_capacity_bytes,
                "compute_ms": d.compute_seconds * 1e3,
                "fixed_ms": d.micro_steps * d.cost.fixed * 1e3,
            }
            for d in planned.devices
        ],
        "step_ms": _breakdown(planned),
        "equal_split_step_ms": _breakdown(equal),
        "speedup_over_equal": equal.step_seconds / planned.step_seconds,
        "best_homogeneous": None
        if best is None
        else {
            "kind": best[0],
            "devices": best[1],
            "step_ms": _breakdown(best[2]),
            "speedup": best[2].step_seconds / planned.step_seconds,
        },
        "memory_fit": memory_fit(
            [device.kind.name for device in cluster.devices],
            [
                usable_memory_bytes(device.kind) - activation_bytes(workload, d.precision) * d.micro_batch
                for device, d in zip(cluster.devices, planned.devices)
            ],
        ),
        "wire": {
            "bytes_per_step": planned.exchange.wire_bytes,
            "inter_node_bytes_per_step": planned.exchange.inter_node_bytes,
            "hierarchical": planned.exchange.hierarchical,
            "reason": planned.exchange.reason,
        },
        "settings": {
            "global_batch_size": options.global_batch_size,
            "zero_stage": options.zero_stage,
            "zero_stage_reason": stage_reason,
            "compression": options.compression,
            "devices": len(cluster.devices),
            "nodes": cluster.num_nodes,
            "memory_headroom": PLANNING_HEADROOM,
            "gpu_context_bytes": GPU_CONTEXT_BYTES,
        },
    }


def local_settings(
    options: argparse.Namespace, compression: Optional[str], clusters: list[Cluster]
) -> Optional[dict[str, Any]]:
    """``--sync`` and its settings checked as HeteroStrategy checks them, on the devices of ``clusters`` (the
    cluster as described and the what-if's) in the precision each would train in (None: every-step training
    alone). Refused before the model is measured."""
    try:
        sync_options = json.loads(options.sync_options)
    except json.JSONDecodeError as error:
        example = """'{"fragments": 4, "overlap": true}'"""
        raise ValueError(f"`--sync-options {options.sync_options}` is not JSON ({error}); e.g. {example}") from None
    if not isinstance(sync_options, dict):
        raise ValueError(f"`--sync-options {options.sync_options}` must be a JSON object, e.g. '{{\"fragments\": 4}}'")
    stage = options.stage if options.stage is not None else 0
    precision = Options(global_batch_size=1, precision=None if options.precision == "auto" else options.precision)
    precisions = [precision_of(device.kind, precision) for cluster in clusters for device in cluster.devices]
    refusal = sync_refusal(options.sync, stage, compression, precisions, None, None, None, "auto", True)
    if options.sync == "every_step":
        if sync_options or options.inner_steps or options.sync_every is not None:
            raise ValueError(
                "`--sync-every`, `--sync-options` and `--inner-steps` plan local training: give `--sync"
                " local_sgd` or `--sync diloco` with them, or drop them."
            )
        if refusal is not None:
            raise ValueError(refusal)
        return None
    sync_every = options.sync_every if options.sync_every is not None else 8
    check_sync_arguments(options.sync, sync_every, options.inner_steps, sync_options)
    if sync_options.get("asynchronous"):
        raise ValueError(
            "`--sync-options` with `asynchronous`: `plan` predicts merges whose ranks take their planned"
            " inner steps in step; an asynchronous merge follows each rank's speed micro-batch by"
            " micro-batch, which it does not model. Drop `asynchronous`: the prediction with planned"
            " inner steps is the closest (it shares out the samples by speed too)."
        )
    check_inner_steps_length(options.inner_steps, len(clusters[0].devices))
    if refusal is not None:
        raise ValueError(f"{refusal} (`--precision` sets every device's; `--stage` the ZeRO stage)")
    if options.inner_steps and (options.drop or options.add):
        raise ValueError(
            "`--inner-steps` with `--drop`/`--add`: the what-if has other devices. Drop `--inner-steps`"
            " to plan the inner steps of both."
        )
    return {
        "sync": options.sync,
        "sync_every": sync_every,
        "fragments": sync_fragments(sync_options, sync_every),
        "overlap_steps": sync_overlap(sync_options, sync_every),
        "compression": compression,
        "inner_steps": options.inner_steps,
    }


def _breakdown(prediction: Prediction) -> dict[str, float]:
    return {
        "total": prediction.step_seconds * 1e3,
        "compute": prediction.compute_seconds * 1e3,
        "exchange": prediction.exchange.seconds * 1e3,
        "optimizer": prediction.optimizer_seconds * 1e3,
        "overhead": prediction.overhead_seconds * 1e3,
    }


def best_homogeneous(cluster: Cluster, workload, options: Options) -> Optional[tuple[str, int, Prediction]]:
    """The fastest subset of one kind of device (on the nodes they are on), or None if no kind can train alone."""
    best = None
    for name in sorted({d.kind.name for d in cluster.devices}):
        devices = [d for d in cluster.devices if d.kind.name == name]
        used = sorted({d.node for d in devices})
        subset = Cluster(
            tuple(SimulatedDevice(d.kind, used.index(d.node)) for d in devices),
            tuple(cluster.node_links[node] for node in used),
            cluster.inter_node if len(used) > 1 else None,
        )
        if options.global_batch_size < len(devices):
            continue
        try:
            prediction = predict(subset, workload, options)
        except ValueError:  # the kind cannot hold the model, or the batch cannot be cut for it
            continue
        if best is None or prediction.step_seconds < best[2].step_seconds:
            best = (name, len(devices), prediction)
    return best


def render(result: dict[str, Any], workload) -> str:
    from lightning_hetero.simulate.show import render_result

    return render_result(result, workload)
