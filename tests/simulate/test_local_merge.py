"""Local SGD / DiLoCo in the cluster simulator (:mod:`lightning_hetero.simulate.local_merge`): the inner steps, a
merge's bytes per compression and fragment count, its time on the link, and what overlap hides; pure functions
checked against hand-computed figures."""

from __future__ import annotations

import pytest

from lightning_hetero.measure.cost import CostModel
from lightning_hetero.simulate.catalog import cpu_kind
from lightning_hetero.simulate.cluster import Cluster, Link, SimulatedDevice
from lightning_hetero.simulate.local_merge import merge_exchange, merge_payload_bytes, plan_local
from lightning_hetero.simulate.workload import Workload

VALUES = 2**20  # a multiple of the quantizer's 256-value blocks
WORKLOAD = Workload(
    name="test",
    parameters=VALUES,
    matrix_shapes=((1024, 1024),),
    flops_per_sample=1e6,
    fixed_flops=0.0,
    operators_per_step=10,
    activation_bytes_per_sample=1e3,
    here_fixed_seconds=0.0,
    here_seconds_per_sample=1e-3,
    here_kind=cpu_kind(1, "avx512", 2.5),
)
GBIT = Link(bandwidth=125e6, latency=5e-4)  # 1 Gbit/s, 0.5 ms: the local-SGD benchmark's emulated link


def two_nodes(link: Link = GBIT, ranks_per_node: int = 1) -> Cluster:
    kind = cpu_kind(1, "avx512", 2.5)
    devices = tuple(SimulatedDevice(kind, node) for node in (0, 1) for _ in range(ranks_per_node))
    return Cluster(devices, (Link(25e9, 1e-5), Link(25e9, 1e-5)), link)


@pytest.mark.parametrize(
    ("compression", "over_fp32"), [(None, 1.0), ("fp16", 0.5), ("bf16", 0.5), ("int8", 0.2539), ("int4", 0.1289)]
)
def test_a_merge_sends_the_values_in_their_wire_format_int8_and_int4_with_a_scale_a_block(compression, over_fp32):
    # int8: a byte a value and 4 bytes of scale per 256 values, (1 + 4/256) / 4 = 0.2539 of fp32; int4: 0.1289
    assert merge_payload_bytes(VALUES, compression) / (4 * VALUES) == pytest.approx(over_fp32, abs=1e-4)


def test_an_all_reduce_of_two_ranks_over_the_link_costs_the_payload_and_the_gather_of_w_ranks_w_minus_1_payloads():
    payload = 8e6
    counts, seconds, crossing = merge_exchange(two_nodes(), payload, quantized=False)
    assert counts == pytest.approx(2 * GBIT.latency)  # the sample counts' all-reduce: latency only
    assert seconds == pytest.approx(payload / GBIT.bandwidth + 2 * GBIT.latency)
    assert crossing == pytest.approx(2 * payload)  # the ring crosses between the nodes both ways
    four = two_nodes(ranks_per_node=2)
    _, gathered, _ = merge_exchange(four, payload, quantized=True)
    _, reduced, _ = merge_exchange(four, payload, quantized=False)
    assert gathered == pytest.approx(3 * (payload / GBIT.bandwidth + 2 * GBIT.latency))  # the blocks, then the scales
    assert reduced == pytest.approx(6 * (payload / 4 / GBIT.bandwidth + GBIT.latency))
    assert merge_exchange(Cluster((four.devices[0],), (Link(25e9),), None), payload, False) == (0.0, 0.0, 0.0)


def plan(**settings):
    costs = [CostModel(fixed=0.0, per_sample=1e-4), CostModel(fixed=0.0, per_sample=2.2e-4)]  # 2.2x apart
    return plan_local(two_nodes(), WORKLOAD, costs, [0.0, 0.0], [64, 64], **settings)


def test_the_inner_steps_are_planned_from_the_speeds_and_the_training_step_is_the_slowest_ranks():
    local = plan(sync_every=8)
    assert local.inner_steps == (2, 1)  # 2.2x faster: 2 micro-batches while the slow rank takes one (rounded)
    assert local.compute_seconds == pytest.approx(64 * 2.2e-4) and local.samples_per_step == 3 * 64
    assert plan(sync_every=8, inner_steps=[3, 1]).compute_seconds == pytest.approx(3 * 64 * 1e-4)


def test_without_overlap_every_merge_is_waited_for_and_fragments_send_a_quarter_as_often_by_four():
    whole, streamed = plan(sync_every=8), plan(sync_every=8, fragments=4)
    assert streamed.merge_bytes_per_rank == pytest.approx(whole.merge_bytes_per_rank / 4)
    assert whole.steps_between_merges == 8 and streamed.steps_between_merges == 2
    assert whole.link_wait_seconds == pytest.approx(whole.merge_seconds / 8)
    assert streamed.link_wait_seconds == pytest.approx(streamed.merge_seconds / 2)
    assert whole.step_seconds == pytest.approx(whole.compute_seconds + whole.merge_seconds / 8)


def test_overlap_hides_the_exchange_behind_k_steps_and_leaves_the_counts_and_what_outlasts_them():
    waited = plan(sync_every=8)
    counts = 2 * GBIT.latency
    exchange = waited.merge_seconds - counts  # 4.2 MB at 1 Gbit/s: 34 ms, about 2.4 steps of 14 ms
    for steps in (1, 2, 4, 8):
        overlapped = plan(sync_every=8, overlap_steps=steps)
        left = max(0.0, exchange - steps * waited.compute_seconds)
        assert overlapped.link_wait_seconds == pytest.approx((counts + left) / 8)
    assert plan(sync_every=8, overlap_steps=8).link_wait_seconds == pytest.approx(counts / 8)  # all hidden


def test_quantized_merges_wait_less_on_the_link_than_fp32():
    fp32, int8, int4 = (plan(sync_every=8, compression=c) for c in (None, "int8", "int4"))
    assert int4.link_wait_seconds < int8.link_wait_seconds < fp32.link_wait_seconds
    assert int8.merge_bytes_per_rank / fp32.merge_bytes_per_rank == pytest.approx(0.2539, abs=1e-4)
