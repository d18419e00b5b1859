"""The step model (:mod:`lightning_hetero.simulate.predict`): memory per ZeRO stage, the gradient exchange over the
links, each device's cost model, and the plan: pure functions checked against hand-computed figures."""

from __future__ import annotations

import pytest

from lightning_hetero.plan.planner import plan_min_max
from lightning_hetero.simulate.catalog import GIB, cpu_kind
from lightning_hetero.simulate.cluster import load_cluster_text
from lightning_hetero.simulate.predict import (
    DEFAULT_GPU_EFFICIENCY,
    KERNEL_LAUNCH_SECONDS,
    Options,
    device_cost,
    efficiency_from_profile,
    exchange,
    gradient_payload_bytes,
    model_state_bytes,
    predict,
)
from lightning_hetero.simulate.workload import Workload

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


def test_a_gpu_s_cost_is_its_flops_at_its_precision_s_peak_and_its_kernel_launches():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: A100-80GB}]\n")
    cost = device_cost(cluster.devices[0].kind, WORKLOAD, Options(global_batch_size=8), 1)
    assert cost.per_sample == pytest.approx(6e9 / (312e12 * DEFAULT_GPU_EFFICIENCY))
    assert cost.fixed == pytest.approx(100 * KERNEL_LAUNCH_SECONDS)
    # bf16 activations are half of fp32's, within 80 % of the memory after the model's 16 MB of state
    assert cost.max_batch == int((80 * GIB * 0.8 - 16e6) // 25e6)


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
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: RTX-4090, memory: 1GB}, {kind: A100-80GB}]\n")
    options = Options(global_batch_size=512)
    planned, equal = predict(cluster, WORKLOAD, options), predict(cluster, WORKLOAD, options, equal=True)
    small = planned.devices[0]
    assert small.micro_steps > 1 and small.memory_bytes <= 1e9 * 0.8
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
