"""The cluster file and the catalog (:mod:`lightning_hetero.simulate.cluster`, :mod:`.catalog`): what a user writes,
what it becomes, and every mistake named with its line and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_hetero.precision.choice import BF16, FP16, FP32
from lightning_hetero.simulate import catalog
from lightning_hetero.simulate.cluster import (
    ClusterFileError,
    load_cluster_text,
    parse_bandwidth,
    parse_latency,
    parse_memory,
)

# The issue's example, shipped as the README's (comments added).
ISSUE_EXAMPLE = (Path(__file__).resolve().parents[2] / "configs" / "cluster_example.yaml").read_text()


def test_the_issue_example_reads_into_nine_devices_on_three_nodes():
    cluster = load_cluster_text(ISSUE_EXAMPLE)
    assert [d.kind.name for d in cluster.devices] == ["A100-80GB"] * 4 + ["V100-32GB"] * 4 + ["cpu-32c-avx512"]
    assert [d.node for d in cluster.devices] == [0] * 4 + [1] * 4 + [2]
    assert cluster.node_links[0].bandwidth == 200e9 / 8
    assert cluster.inter_node.bandwidth == 10e9 / 8 and cluster.inter_node.latency == pytest.approx(50e-6)
    assert cluster.node_links[2].bandwidth == 200e9 / 8  # the default: PCIe 4.0 x16


@pytest.mark.parametrize(
    ("text", "value"),
    [("10Gbit", 1.25e9), ("10 Gbit/s", 1.25e9), ("25GB/s", 25e9), ("100Mbps", 12.5e6), ("1.6Tbit", 2e11)],
)
def test_bandwidths(text, value):
    assert parse_bandwidth(text, "link") == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("50us", 5e-5), ("0.5ms", 5e-4), ("2s", 2.0), ("100ns", 1e-7)])
def test_latencies(text, value):
    assert parse_latency(text, "latency") == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("80GB", 80e9), ("80GiB", 80 * 2**30), ("512MiB", 2**29)])
def test_memories(text, value):
    assert parse_memory(text, "memory") == pytest.approx(value)


@pytest.mark.parametrize("bad", [10, "10", "10 parsecs", "fast", None, "-1Gbit"])
def test_a_quantity_without_a_known_unit_is_refused_with_an_example(bad):
    with pytest.raises(ValueError, match="link: .*(quantity with a unit.*10Gbit|more than 0)"):
        parse_bandwidth(bad, "link")


def test_every_catalog_kind_has_its_figures_and_a_source():
    for kind in catalog.GPU_KINDS.values():
        assert kind.memory_bytes > 0 and kind.memory_bandwidth > 0 and kind.source
        assert kind.peak_flops[FP32] > 0 and kind.peak_flops[FP16] > kind.peak_flops[FP32]


@pytest.mark.parametrize(
    ("kind", "precision"),
    [("A100-80GB", BF16), ("H100", BF16), ("V100-32GB", FP16), ("T4", FP16), ("RTX-4090", BF16), ("L4", BF16)],
)
def test_precision_is_what_device_precision_auto_would_choose(kind, precision):
    assert catalog.lookup(kind).precision() == precision


def test_a_cpu_trains_in_bf16_only_with_native_bf16_and_never_in_fp16():
    assert catalog.cpu_kind(8, "avx512").precision() == FP32
    assert catalog.cpu_kind(8, "amx").precision() == BF16
    assert catalog.cpu_kind(8, "avx2").peak_flops[FP32] == 8 * 2.5e9 * 32


@pytest.mark.parametrize("name", ["a100 80gb", "A100_80GB", "a100-80gb"])
def test_kind_names_are_matched_loosely(name):
    assert catalog.lookup(name).name == "A100-80GB"


@pytest.mark.parametrize(
    ("reported", "kind"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Intel Xeon", None),
    ],
)
def test_a_reported_device_name_is_its_catalog_kind(reported, kind):
    found = catalog.kind_of_device_name(reported)
    assert (found.name if found else None) == kind


def _error(text: str) -> str:
    with pytest.raises(ClusterFileError) as caught:
        load_cluster_text(text, "cluster.yaml")
    return str(caught.value)


def test_an_unknown_kind_names_the_line_and_the_closest_known_kind():
    message = _error("nodes:\n  - devices:\n      - kind: A100-80G\n        count: 2\n")
    assert message.startswith("cluster.yaml:3:") and "'A100-80G'" in message and "'A100-80GB'" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nodes:\n  - devices: [{kind: H100, cout: 2}]\n", r"cluster.yaml:2: .*no key 'cout'; did you mean 'count'"),
        ("nodes:\n  - devices: [{kind: H100, count: 0}]\n", r"cluster.yaml:2: `count: 0` must be a whole number >= 1"),
        ("nodes:\n  - devices: [{kind: H100}]\n    link: fast\n", r"cluster.yaml:3: .*'fast' is not a quantity"),
        ("nodes:\n  - devices: [{kind: cpu}]\n", r"cluster.yaml:2: a cpu needs `cores:` >= 1"),
        ("nodes:\n  - devices: [{kind: cpu, cores: 4, isa: avx513}]\n", r"closest known is 'avx512'"),
        ("nodes:\n  - devices: [{kind: H100, cores: 4}]\n", r"`cores` describes a cpu"),
        ("nodes:\n  - devices: [{kind: H100, efficiency: 2}]\n", r"fraction of the peak rate, at most 1"),
        ("nodes:\n  - devices: [{kind: H100, tflops: {fp8: 3}}]\n", r"unknown precision 'fp8'"),
        ("nodes:\n  - {devices: [{kind: H100}]}\n  - {devices: [{kind: T4}]}\n", r"needs `inter_node: "),
        ("nodes: []\n", r"cluster.yaml:1: `nodes` must be a list"),
        ("nodes:\n  - {link: 10Gbit}\n", r"cluster.yaml:2: node 0 needs `devices:`"),
        ("nodez: []\n", r"no key 'nodez'; did you mean 'nodes'"),
        ("", r"the file is empty"),
        ("nodes: [\n", r"not valid YAML"),
    ],
)
def test_mistakes_are_named_with_their_line(text, expected):
    import re

    assert re.search(expected, _error(text)), _error(text)


def test_inline_figures_replace_the_catalog_s():
    cluster = load_cluster_text(
        "nodes:\n  - devices: [{kind: T4, memory: 8GB, tflops: {fp16: 30}, efficiency: 0.5, speed: 0.5}]\n"
    )
    kind = cluster.devices[0].kind
    assert kind.memory_bytes == 8e9 and kind.peak_flops[FP16] == 30e12 and kind.peak_flops[FP32] == 8.1e12
    assert kind.efficiency == 0.5 and kind.speed == 0.5
