"""Simulate: the plan as a person reads it: a table with one row per group of identical devices, the step time and
its parts, the speedups, the bytes on the wire, and the what-if beside the cluster as described."""

from __future__ import annotations

from typing import Any

from lightning_hetero.simulate.memory_fit import describe as describe_memory_fit

GIB = 1024**3


def _faster_or_slower(speedup: float) -> str:
    """``1.16x faster`` / ``1.16x slower``: a ratio below 1 said as its inverse ("0.86x slower" read wrong)."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def _size(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _node_ranges(nodes: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8``."""
    ranges: list[list[int]] = []
    for node in sorted(set(nodes)):
        if ranges and node == ranges[-1][1] + 1:
            ranges[-1][1] = node
        else:
            ranges.append([node, node])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def _rows(devices: list[dict[str, Any]]) -> list[str]:
    """One row per group of devices that got the same plan, whatever node they are on (a 4,096-device cluster of a
    few kinds reads in a few rows, not one per node); the row names its nodes."""
    header = f"{'devices':>8}  {'kind':<16} {'nodes':>9}  {'precision':<10} {'micro-batch':>11} {'micro-steps':>11}"
    header += f"  {'memory GiB (use / has)':>22}  {'compute ms':>10}"
    lines = [header, "-" * len(header)]
    key = lambda d: (d["kind"], d["precision"], d["micro_batch"], d["micro_steps"])  # noqa: E731
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for device in devices:  # (in rank order of each group's first device)
        groups.setdefault(key(device), []).append(device)
    # (devices of one group may differ by one sample: micro-batches are cut as evenly as the global batch allows)
    for (kind, precision, batch, steps), group in groups.items():
        first = group[0]
        memory = f"{first['memory_bytes'] / GIB:.1f} / {first['memory_capacity_bytes'] / GIB:.0f}"
        nodes = _node_ranges([d["node"] for d in group])
        nodes = nodes if len(nodes) <= 9 else f"{len({d['node'] for d in group})} nodes"
        lines.append(
            f"{len(group):>8}  {kind:<16} {nodes:>9}  {precision:<10} {batch:>11} {steps:>11}  {memory:>22}"
            f"  {first['compute_ms']:>10.2f}"
        )
    return lines


def _fixed_cost_notes(devices: list[dict[str, Any]], global_batch_size: int) -> list[str]:
    """Why a device got almost no samples: its step is mostly fixed cost (a tiny model on a GPU is bound by kernel
    launches), so the other devices finish many samples in the time its step takes for one."""
    notes, seen = [], set()
    few = max(1, global_batch_size // (10 * len(devices)))  # under a tenth of the equal share
    for device in devices:
        fixed, compute = device.get("fixed_ms", 0.0), device["compute_ms"]
        if device["kind"] in seen or compute <= 0 or fixed < 0.5 * compute or device["samples"] > few:
            continue
        seen.add(device["kind"])
        notes.append(
            f"note: each {device['kind']} gets {device['samples']} sample(s): its step is {fixed / compute:.0%} fixed"
            f" cost ({fixed:.2f} ms whatever its samples: kernel launches on a GPU, Python and operator overheads on"
            " a CPU), in which the other devices finish theirs. A model this small gains little from it; a larger"
            " global batch moves samples onto it."
        )
    return notes


def _step(step: dict[str, float]) -> str:
    parts = f"compute {step['compute']:.2f} + exchange {step['exchange']:.2f} + optimizer {step['optimizer']:.2f}"
    if step["overhead"]:
        parts += f" + loop overhead {step['overhead']:.2f}"
    return f"{step['total']:.2f} ms ({parts})"


def _section(result: dict[str, Any]) -> list[str]:
    settings = result["settings"]
    lines = [
        f"{settings['devices']} devices on {settings['nodes']} node(s), global batch {settings['global_batch_size']},"
        f" ZeRO-{settings['zero_stage']}, compression {settings['compression'] or 'none'}",
        *([settings["zero_stage_reason"]] if settings.get("zero_stage_reason") else []),
        f"memory: a plan fills at most {1 - settings['memory_headroom']:.0%} of each device's memory, less"
        f" {settings['gpu_context_bytes'] / GIB:.1f} GiB on a GPU for the CUDA context and workspaces; the"
        f" {settings['memory_headroom']:.0%} left is headroom for the allocator",
        *_rows(result["devices"]),
        *_fixed_cost_notes(result["devices"], settings["global_batch_size"]),
        f"step: {_step(result['step_ms'])}",
        f"equal split (DDP): {_step(result['equal_split_step_ms'])}: this plan is"
        f" {result['speedup_over_equal']:.2f}x faster",
    ]
    best = result["best_homogeneous"]
    if best is None:
        lines.append("no single kind of device can train this alone")
    else:
        lines.append(
            f"best homogeneous subset: the {best['devices']} x {best['kind']} alone, {_step(best['step_ms'])}:"
            f" the whole cluster is {_faster_or_slower(best['speedup'])}"
        )
    if "memory_fit" in result:
        lines.append(describe_memory_fit(result["memory_fit"]))
    wire = result["wire"]
    lines.append(
        f"on the wire: {wire['bytes_per_step'] / 1e6:.2f} MB per step, {wire['inter_node_bytes_per_step'] / 1e6:.2f}"
        f" MB between nodes; hierarchical reduction {wire['reason']}"
    )
    return lines


def _local_section(local: dict[str, Any]) -> list[str]:
    """Local SGD / DiLoCo (``--sync``): each group of devices' inner steps, the training step, a merge, the speed."""
    overlap, fragments = local["overlap_steps"], local["fragments"]
    streaming = f", in {fragments} fragments (one every {local['merge']['every_steps']} steps)" if fragments > 1 else ""
    lines = [
        f"with sync={local['sync']}: a merge every {local['sync_every']} training steps{streaming}"
        + (f", overlapped (applied {overlap} step(s) after it is sent)" if overlap else ", waited for")
        + f", pseudo-gradients in {local['compression'] or 'fp32'}"
    ]
    groups: dict[tuple, int] = {}
    for device in local["devices"]:
        key = (device["kind"], device["inner_steps"], device["micro_batch"], round(device["inner_step_ms"], 2))
        groups[key] = groups.get(key, 0) + 1
    for (kind, steps, batch, inner_ms), count in groups.items():
        lines.append(f"  {count} x {kind}: {steps} inner step(s) of {batch} samples, {inner_ms:.2f} ms each")
    step, merge = local["training_step_ms"], local["merge"]
    overhead = f" + loop overhead {step['overhead']:.2f}" if step["overhead"] else ""
    lines += [
        f"  training step: {step['total']:.2f} ms (compute {step['compute']:.2f} + waiting on the link"
        f" {step['link_wait']:.2f}{overhead}; the wait is {local['link_wait_over_compute']:.1%} of compute)",
        f"  a merge: {_size(merge['bytes_per_rank'])} a rank, {merge['ms']:.2f} ms on the link,"
        f" {_size(merge['inter_node_bytes'])} between nodes",
        f"  {local['samples_per_second']:,.0f} samples/s: {_faster_or_slower(local['speedup_over_every_step'])} than"
        " the every-step plan above (per sample; its loss per sample is not the same)",
    ]
    return lines


def render_result(result: dict[str, Any], workload: Any) -> str:
    lines = [
        f"model {workload.name}: {workload.parameters:,} parameters, {workload.flops_per_sample / 1e6:.2f} MFLOP per"
        f" sample (forward + backward), {_size(workload.activation_bytes_per_sample)} of activations per sample;"
        f" this CPU reached {workload.here_efficiency:.0%} of its fp32 peak ({workload.here_kind.source})",
        "",
        "the cluster as described:",
        *_section(result),
        *(_local_section(result["local"]) if "local" in result else []),
    ]
    if "what_if" in result:
        what_if = result["what_if"]
        change = result["step_ms"]["total"] / what_if["step_ms"]["total"]
        lines += [
            "",
            "what if:",
            *_section(what_if),
            *(_local_section(what_if["local"]) if "local" in what_if else []),
            f"the what-if's step is {_faster_or_slower(change)} than the cluster's as described",
        ]
    return "\n".join(lines)
