"""A pipeline on a described cluster (:mod:`lightning_hetero.simulate.pipeline`), against hand-computed figures."""

from __future__ import annotations

import pytest

from lightning_hetero.simulate.catalog import MATMUL_EFFICIENCY, cpu_kind, lookup
from lightning_hetero.simulate.cluster import load_cluster_text
from lightning_hetero.simulate.device_model import usable_memory_bytes
from lightning_hetero.simulate.pipeline import ChainShares, describe_pipeline_prediction, predict_pipeline
from lightning_hetero.simulate.predict import predict
from lightning_hetero.simulate.step_options import Options
from lightning_hetero.simulate.workload import Workload

GIB = 2**30
# 8 equal blocks of 3 GiB of training state each (24 GiB in all, 1.5 G parameters counted with Adam's state).
WORKLOAD = Workload(
    name="big",
    parameters=1_610_612_736,
    matrix_shapes=((1, 1),),
    flops_per_sample=8e12,
    fixed_flops=0.0,
    operators_per_step=0,
    activation_bytes_per_sample=8e6,
    here_fixed_seconds=0.0,
    here_seconds_per_sample=1.0,
    here_kind=cpu_kind(1, "avx512", 2.5),
)
CHAIN = ChainShares(
    names=tuple(str(i) for i in range(8)),
    time_shares=(0.125,) * 8,
    before_share=0.0,
    after_share=0.0,
    parameter_bytes=(3 * GIB,) * 8,
    outside_bytes=0,
    activation_bytes=(10**6,) * 8,
    output_bytes=(4096,) * 8,
)
CLUSTER = "nodes:\n  - devices: [{kind: A100-80GB}, {kind: V100-16GB}]\n    link: 100Gbit\n"


def test_a_model_too_large_for_the_small_device_is_placed_within_each_memory():
    cluster = load_cluster_text(CLUSTER)
    options = Options(global_batch_size=32, zero_stage=0)
    with pytest.raises(ValueError, match="cannot hold this model"):  # data parallelism: 24 GiB on a 16 GiB V100
        predict(cluster, WORKLOAD, options)
    result = predict_pipeline(cluster, WORKLOAD, CHAIN, options, stages=2)
    last, first = result["stages"][1], result["stages"][0]
    assert last["rank"] == 0 and last["kind"] == "A100-80GB"  # rank 0 runs the last stage
    assert [s["stage"] for s in result["stages"]] == [0, 1]  # (the stage's index: it was labelled "device")
    # The V100 holds at most 4 blocks (12 GiB of its 13.4 usable) and is the slower device: it gets fewer blocks.
    assert len(first["blocks"]) + len(last["blocks"]) == 8 and len(first["blocks"]) < 4
    assert first["memory_bytes"] <= usable_memory_bytes(lookup("V100-16GB"))
    micro = result["micro_batch"]
    assert result["micro_batches"] == 4 and micro == 8
    slowest = max(s["compute_ms_per_micro_batch"] for s in result["stages"])
    stages_sum = sum(s["compute_ms_per_micro_batch"] for s in result["stages"])
    link = cluster.node_links[0]  # one boundary: an activation and a gradient per micro-batch, each with latency
    transfer = 2 * 4 * (4096 * 8 / link.bandwidth + link.latency) * 1e3
    assert link.bandwidth == 12.5e9
    assert result["step_ms"] == pytest.approx(3 * slowest + stages_sum + transfer, rel=1e-6)
    lines = describe_pipeline_prediction(result, None, "it does not fit")
    assert "data parallelism cannot train this (it does not fit): the pipeline can" in lines[-1]


def test_stages_that_do_not_divide_the_devices_are_refused():
    with pytest.raises(ValueError, match="cannot form pipelines of 3 stages"):
        predict_pipeline(load_cluster_text(CLUSTER), WORKLOAD, CHAIN, Options(global_batch_size=32), stages=3)


def test_a_gpu_block_time_is_its_share_of_the_flops_at_the_device_rate():
    cluster = load_cluster_text("nodes:\n  - devices: [{kind: A100-80GB, count: 2}]\n")
    result = predict_pipeline(cluster, WORKLOAD, CHAIN, Options(global_batch_size=32, precision="32-true"), stages=2)
    per_sample = 8e12 / (19.5e12 * MATMUL_EFFICIENCY)  # (a workload of FLOPs alone: the roofline's compute side)
    assert [len(s["blocks"]) for s in result["stages"]] == [4, 4]
    assert result["stages"][0]["compute_ms_per_micro_batch"] == pytest.approx(1e3 * per_sample * 0.5 * 8)
