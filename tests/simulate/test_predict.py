"""The step model (:mod:`lightning_hetero.simulate.predict`): memory per ZeRO stage, the gradient exchange over the
links, each device's cost model, and the plan: pure functions checked against hand-computed figures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_hetero.measure.operators import OperatorCost
from lightning_hetero.simulate.catalog import GIB, cpu_kind, with_overrides
from lightning_hetero.simulate.cluster import load_cluster_text
from lightning_hetero.simulate.device_model import (
    GPU_CONTEXT_BYTES,
    HALF_PRECISION_ACTIVATIONS,
    KERNEL_LAUNCH_SECONDS,
    PLANNING_HEADROOM,
    device_cost,
    efficiency_from_profile,
    model_state_bytes,
)
from lightning_hetero.simulate.gradient_exchange import exchange, gradient_payload_bytes
from lightning_hetero.simulate.predict import predict
from lightning_hetero.simulate.step_options import LoopCalibration, Options, calibrate_loop
from lightning_hetero.simulate.workload import Workload
from lightning_hetero.split.decisions.planner import plan_min_max

WORKLOAD = Workload(
    name="test",
    parameters=1_000_000,
    matrix_shapes=((1000, 999), (1000, 1)),
    flops_per_sample=6e9,
    fixed_flops=0.0,
    operators_per_step=100,
    activation_bytes_per_sample=50e6,
    here_fixed_seconds=0.002,
    here_seconds_per_sample=0.1,
    here_kind=cpu_kind(1, "avx512", 2.5),  # 160 GFLOP/s peak: 6e9 / 0.1 = 60 GFLOP/s reached, 37.5 %
)


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, 16e6), (1, 8e6 + 8e6 / 4), (2, 4e6 + 4e6 / 4 + 8e6 / 4), (3, 16e6 / 4)],
)
def test_model_state_per_zero_stage(stage, expected):
    assert model_state_bytes(1_000_000, stage, 4) == pytest.approx(expected)


def test_a_gpu_s_cost_is_the_roofline_of_its_operators_and_its_memory_what_the_plan_may_fill():
    # one matrix product (compute-bound) and one element-wise operator (memory-bound), each a line in the batch
    workload = replace(
        WORKLOAD,
        operators_per_step=2,
        operators=(OperatorCost(0.0, 6e9, 2e6, 1e5, "matmul"), OperatorCost(0.0, 0.0, 1e6, 4e6, "other")),
    )
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: A100-80GB}]\n")
    kind = cluster.devices[0].kind
    cost = device_cost(kind, workload, Options(global_batch_size=8), 1)
    bandwidth = 2039e9 * 0.37  # the A100-80GB's fitted bandwidth efficiency
    # bf16 (auto on an A100): bytes halved; the product at the tensor-core peak, the element-wise op at the bandwidth
    assert cost.per_sample == pytest.approx(max(6e9 / 312e12, 0.5 * 1e5 / bandwidth) + 0.5 * 4e6 / bandwidth)
    assert cost.fixed == pytest.approx(0.5 * 2e6 / bandwidth + 0.5 * 1e6 / bandwidth + 2 * KERNEL_LAUNCH_SECONDS)
    # memory: 90 % of 80 GiB less the CUDA context, the model's 16 MB of state and DeepSpeed's 4 MB gradient buffer
    # (1 M fp32 gradients), at 0.69 of the fp32 activations
    room = 80 * GIB * (1 - PLANNING_HEADROOM) - GPU_CONTEXT_BYTES - 16e6 - 4e6
    assert cost.max_batch == int(room // (50e6 * HALF_PRECISION_ACTIVATIONS))
    # every operator launched pays its launch, also when the lines are totals per kind (two steps that differed)
    totals = replace(workload, operators_per_step=50)
    assert device_cost(kind, totals, Options(global_batch_size=8), 1).fixed == pytest.approx(
        cost.fixed + 48 * KERNEL_LAUNCH_SECONDS
    )
    # fp32 on the same GPU: the product at the plain FP32 rate, the bytes as counted
    fp32 = device_cost(kind, workload, Options(global_batch_size=8, precision="32-true"), 1)
    assert fp32.per_sample == pytest.approx(max(6e9 / 19.5e12, 1e5 / bandwidth) + 4e6 / bandwidth)


def test_a_kind_without_a_fitted_bandwidth_efficiency_takes_the_median_of_those_fitted():
    import statistics

    from lightning_hetero.simulate.catalog import BANDWIDTH_EFFICIENCY, DEFAULT_BANDWIDTH_EFFICIENCY, lookup

    assert DEFAULT_BANDWIDTH_EFFICIENCY == pytest.approx(statistics.median(BANDWIDTH_EFFICIENCY.values()), abs=0.005)
    assert lookup("T4").bandwidth_efficiency is None and lookup("V100-32GB").bandwidth_efficiency == 0.41
    workload = replace(WORKLOAD, operators=(OperatorCost(0.0, 0.0, 0.0, 4e6, "other"),))
    t4 = device_cost(lookup("T4"), workload, Options(global_batch_size=8), 1)
    assert t4.per_sample == pytest.approx(0.5 * 4e6 / (320e9 * DEFAULT_BANDWIDTH_EFFICIENCY))


def test_a_cpu_like_this_one_is_predicted_as_measured_here_and_speed_scales_it():
    cluster = load_cluster_text(
        "nodes:\n  - devices: [{kind: cpu, cores: 1, ghz: 2.5}, {kind: cpu, cores: 1, ghz: 2.5, speed: 0.4}]\n"
    )
    options = Options(global_batch_size=8)
    fast, slow = (device_cost(d.kind, WORKLOAD, options, 2) for d in cluster.devices)
    assert fast.per_sample == pytest.approx(0.1) and fast.fixed == pytest.approx(0.002)
    assert slow.per_sample == pytest.approx(0.25) and slow.fixed == pytest.approx(0.005)


def test_calibrated_and_inline_efficiencies_win_over_the_default():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: H100}, {kind: H100, efficiency: 0.1}]\n")
    calibrated = Options(global_batch_size=8, calibrated_efficiency={"H100": 0.2})
    assert device_cost(cluster.devices[0].kind, WORKLOAD, calibrated, 2).per_sample == pytest.approx(
        6e9 / 989.4e12 / 0.2
    )
    assert device_cost(cluster.devices[1].kind, WORKLOAD, calibrated, 2).per_sample == pytest.approx(
        6e9 / 989.4e12 / 0.1
    )


def test_a_device_that_cannot_hold_the_model_is_refused_with_the_fix():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: T4, memory: 10MB}]\n")
    with pytest.raises(ValueError, match=r"a T4 cannot hold this model at ZeRO-0.*higher `--stage`.*--drop T4"):
        device_cost(cluster.devices[0].kind, WORKLOAD, Options(global_batch_size=8), 1)


def test_gradient_payloads():
    assert gradient_payload_bytes(WORKLOAD, None, {}) == 4e6
    assert gradient_payload_bytes(WORKLOAD, "bf16", {}) == 2e6
    # PowerSGD of rank 2: P and Q of the matrix, the vector uncompressed
    assert gradient_payload_bytes(WORKLOAD, "powersgd", {"matrix_approximation_rank": 2}) == 4 * (2 * 1999 + 1000)
    # torch's rule, as the package's exchange applies it: from the rank where compressing no longer sends
    # min_compression_rate times fewer entries, the matrix travels whole (its rows x cols, not rank x (rows + cols))
    whole = 4 * (1000 * 999 + 1000)
    assert gradient_payload_bytes(WORKLOAD, "powersgd", {"matrix_approximation_rank": 250}) == whole
    assert gradient_payload_bytes(WORKLOAD, "powersgd", {"matrix_approximation_rank": 249}) == 4 * (249 * 1999 + 1000)


TWO_NODES = """\
nodes:
  - {devices: [{kind: H100, count: 2}], link: 400Gbit}
  - {devices: [{kind: H100, count: 2}], link: 400Gbit}
inter_node: {bandwidth: 10Gbit, latency: 50us}
"""


def test_a_flat_ring_runs_at_the_slowest_link_and_hierarchical_sends_one_payload_per_node_between_nodes():
    cluster = load_cluster_text(TWO_NODES)
    flat = exchange(cluster, WORKLOAD, Options(global_batch_size=8, hierarchical=False))
    assert flat.seconds == pytest.approx(2 * 3 / 4 * 4e6 / 1.25e9 + 2 * 3 * 50e-6)
    assert flat.wire_bytes == pytest.approx(2 * 3 * 4e6) and not flat.hierarchical
    tiered = exchange(cluster, WORKLOAD, Options(global_batch_size=8))
    assert tiered.hierarchical and tiered.reason.startswith("on (auto)")
    assert tiered.inter_node_bytes == pytest.approx(2 * 4e6)
    inside = 2 * 4e6 / 50e9 + 2 * 10e-6
    assert tiered.seconds == pytest.approx(inside + 4e6 / 1.25e9 + 2 * 50e-6)
    assert tiered.seconds < flat.seconds


def test_zero_2_reduces_inside_deepspeed_and_topk_needs_stage_0():
    cluster = load_cluster_text(TWO_NODES)
    staged = exchange(cluster, WORKLOAD, Options(global_batch_size=8, zero_stage=2))
    assert not staged.hierarchical and "ZeRO-2" in staged.reason
    with pytest.raises(ValueError, match="`compression='topk'` needs `stage=0`"):
        exchange(cluster, WORKLOAD, Options(global_batch_size=8, zero_stage=2, compression="topk"))
    topk = exchange(cluster, WORKLOAD, Options(global_batch_size=8, compression="topk"))
    assert topk.wire_bytes == pytest.approx(4 * 3 * 0.01 * 1e6 * 8)


def test_the_plan_is_the_min_max_plan_and_beats_the_equal_split_on_mixed_devices():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: A100-80GB, count: 2}, {kind: V100-32GB, count: 2}]\n")
    options = Options(global_batch_size=512)
    planned, equal = predict(cluster, WORKLOAD, options), predict(cluster, WORKLOAD, options, equal=True)
    costs = [d.cost for d in planned.devices]
    assert [d.samples for d in planned.devices] == list(plan_min_max(costs, 512).batch_sizes)
    assert planned.compute_seconds == plan_min_max(costs, 512).predicted_step_time
    assert [d.samples for d in equal.devices] == [128] * 4
    assert planned.step_seconds < equal.step_seconds
    assert planned.exchange == equal.exchange


def test_a_memory_bound_device_takes_micro_steps_and_ddp_accumulates_on_every_rank():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: RTX-4090, memory: 3GB}, {kind: A100-80GB}]\n")
    options = Options(global_batch_size=512)
    planned, equal = predict(cluster, WORKLOAD, options), predict(cluster, WORKLOAD, options, equal=True)
    small = planned.devices[0]
    assert small.micro_steps > 1 and small.memory_bytes <= 3e9 * (1 - PLANNING_HEADROOM) - GPU_CONTEXT_BYTES
    assert {d.micro_steps for d in equal.devices} == {equal.devices[0].micro_steps} and equal.devices[0].micro_steps > 1


def test_a_run_s_rank_file_calibrates_its_kind():
    rank_file = {
        "device": {"kind": "cuda", "name": "NVIDIA A100-SXM4-80GB"},
        "precision": "bf16-mixed",
        "profile": {"seconds_per_sample": 6e9 / 100e12},
    }
    kind, efficiency = efficiency_from_profile(rank_file, WORKLOAD)
    assert kind == "A100-80GB" and efficiency == pytest.approx(100 / 312)
    assert efficiency_from_profile({"device": {"kind": "cpu", "name": "x"}, "profile": {}}, WORKLOAD) is None


HERE = replace(WORKLOAD, here_fixed_seconds=0.001, here_seconds_per_sample=1e-4)


def _run_files(compute: list[float], step: float, batch_sizes: list[int], speeds=None) -> tuple[dict, list[dict]]:
    steps = [
        {"step": i, "batch_sizes": batch_sizes, "compute_seconds": compute, "step_seconds": step} for i in range(30)
    ]
    report = {"steps": steps, "communication": {"nodes": [0, 0], "emulated_link": None, "compression": None}}
    rank = {
        "device": {"kind": "cpu", "name": "cpu"},
        "precision": "32-true",
        "plan": {"global_batch_size": sum(batch_sizes), "emulate_speeds": speeds},
        "profile": None,
        "deepspeed_config": {"zero_optimization": {"stage": 0}},
    }
    return report, [rank, dict(rank)]


def test_unequal_micro_batches_calibrate_the_loop_s_fixed_part_its_factor_and_the_overhead():
    # Here: 1 ms + 0.1 ms per sample. In the loop: 4 ms + 0.15 ms per sample = 2.5 ms + 1.5 x (here's line).
    report, ranks = _run_files([0.004 + 0.00015 * 100, 0.004 + 0.00015 * 50], 0.030, [100, 50])
    loop = calibrate_loop(report, ranks, HERE, exchange_and_optimizer_seconds=0.003)
    assert loop.compute_factor == pytest.approx(1.5)
    assert loop.loop_compute_seconds == pytest.approx(0.0025)
    assert loop.step_overhead_seconds == pytest.approx(0.030 - 0.019 - 0.003)


def test_an_emulated_slow_rank_s_compute_is_taken_at_speed_1():
    report, ranks = _run_files([0.004 + 0.00015 * 100, 2 * (0.004 + 0.00015 * 50)], 0.030, [100, 50], [1.0, 0.5])
    loop = calibrate_loop(report, ranks, HERE, exchange_and_optimizer_seconds=0.003)
    assert loop.compute_factor == pytest.approx(1.5) and loop.loop_compute_seconds == pytest.approx(0.0025)


def test_equal_micro_batches_calibrate_the_fixed_part_only():
    report, ranks = _run_files([0.0165, 0.0165], 0.025, [100, 100])  # here's line gives 11 ms
    loop = calibrate_loop(report, ranks, HERE, exchange_and_optimizer_seconds=0.003)
    assert loop.compute_factor == 1.0 and loop.loop_compute_seconds == pytest.approx(0.0055)


def test_a_calibration_never_makes_the_loop_faster_than_the_step_here_or_the_overhead_negative():
    report, ranks = _run_files([0.005, 0.004], 0.005, [100, 50])  # below here's 11 and 6 ms
    loop = calibrate_loop(report, ranks, HERE, exchange_and_optimizer_seconds=0.003)
    assert loop.compute_factor == 1.0 and loop.loop_compute_seconds == 0.0 and loop.step_overhead_seconds == 0.0


def test_the_calibration_applies_to_cpu_compute_and_to_every_step():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: cpu, cores: 1, ghz: 2.5}, {kind: H100}]\n")
    plain = Options(global_batch_size=64)
    loop = LoopCalibration(loop_compute_seconds=0.003, compute_factor=1.5, step_overhead_seconds=0.004)
    calibrated = Options(global_batch_size=64, loop=loop)
    cpu, gpu = cluster.devices[0].kind, cluster.devices[1].kind
    cost = device_cost(cpu, WORKLOAD, calibrated, 2)
    assert (cost.fixed, cost.per_sample) == pytest.approx((1.5 * 0.002 + 0.003, 1.5 * 0.1))
    slow = device_cost(with_overrides(cpu, speed=0.5), WORKLOAD, calibrated, 2)  # stretches the loop's part too
    assert (slow.fixed, slow.per_sample) == pytest.approx((2 * (1.5 * 0.002 + 0.003), 2 * 1.5 * 0.1))
    assert device_cost(gpu, WORKLOAD, calibrated, 2) == device_cost(gpu, WORKLOAD, plain, 2)
    prediction = predict(cluster, WORKLOAD, calibrated)
    assert prediction.step_seconds == pytest.approx(
        prediction.compute_seconds + prediction.exchange.seconds + prediction.optimizer_seconds + 0.004
    )


def test_one_precision_for_every_device_is_refused_where_a_device_cannot_run_it():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: V100-32GB}, {kind: A100-80GB}]\n")
    fp32 = predict(cluster, WORKLOAD, Options(global_batch_size=64, precision="32-true"))
    assert {d.precision for d in fp32.devices} == {"32-true"}
    with pytest.raises(ValueError, match="`--precision bf16-mixed` cannot run on a V100-32GB: it has no bf16"):
        predict(cluster, WORKLOAD, Options(global_batch_size=64, precision="bf16-mixed"))


def test_the_automatic_stage_is_the_lowest_that_holds_the_state_and_the_planned_activations():
    from lightning_hetero.simulate.predict import automatic_stage

    # 10 M parameters over 4 devices: 160 MB of state at ZeRO-0, 100 MB at ZeRO-1, 70 MB at ZeRO-2; activations 1 MB
    # per sample in fp32, 0.69 MB in the A100's bf16.
    workload = replace(WORKLOAD, parameters=10_000_000, activation_bytes_per_sample=1e6)
    text = "nodes:\n  - devices: [{{kind: A100-80GB, memory: {memory}, count: 4}}]\n"
    roomy = load_cluster_text(text.format(memory="80GB"))
    # the tight device: 96 MB a plan may fill beside its CUDA context and headroom
    tight_bytes = (GPU_CONTEXT_BYTES + 96e6) / (1 - PLANNING_HEADROOM)
    choice = automatic_stage(roomy, workload, Options(global_batch_size=8, zero_stage=None))
    assert choice.stage == 0 and choice.reason.startswith("ZeRO stage 0 (auto)")
    tight = load_cluster_text(text.format(memory=f"{tight_bytes:.0f}B"))  # ZeRO-2's 70 MB and 2 samples fit
    choice = automatic_stage(tight, workload, Options(global_batch_size=8, zero_stage=None))
    assert choice.stage == 2 and "at ZeRO stage 0 rank 0 would need" in choice.reason
    # A compression hook needs ZeRO-0; the predicted plan uses the chosen stage.
    hooked = Options(global_batch_size=8, zero_stage=None, compression="powersgd")
    assert automatic_stage(roomy, workload, hooked).stage == 0
    with pytest.raises(ValueError, match="cannot hold this model at ZeRO-0"):
        automatic_stage(tight, workload, hooked)
    device = predict(roomy, workload, Options(global_batch_size=8, zero_stage=None)).devices[0]
    # ZeRO-0, bf16 activations (mixed precision keeps 0.69 of the fp32 bytes)
    # (and DeepSpeed's gradient buffer: the 10 M fp32 gradients, 40 MB)
    assert device.memory_bytes == pytest.approx(160e6 + 40e6 + device.micro_batch * HALF_PRECISION_ACTIVATIONS * 1e6)


def test_the_catalog_s_fitted_constants_are_the_validation_benchmark_s_last_fit():
    # benchmarks/planner_validation.py --fit writes what the calibration rows give (benchmarks/planner_fit.json); the
    # catalog must carry those figures, or the README's validation table describes another model than the one used.
    import json
    from pathlib import Path

    from lightning_hetero.simulate import catalog

    fitted = json.loads((Path(__file__).parents[2] / "benchmarks/planner_fit.json").read_text())
    assert fitted["BANDWIDTH_EFFICIENCY"] == catalog.BANDWIDTH_EFFICIENCY
    assert fitted["MATMUL_EFFICIENCY"] == catalog.MATMUL_EFFICIENCY
    assert fitted["DEFAULT_BANDWIDTH_EFFICIENCY"] == catalog.DEFAULT_BANDWIDTH_EFFICIENCY
    assert fitted["HALF_PRECISION_ACTIVATIONS"] == HALF_PRECISION_ACTIVATIONS
