"""Simulate: a cluster described in YAML, read into devices, nodes and links; a mistake names its line.

::

    nodes:
      - {devices: [{kind: A100-80GB, count: 4}], link: 200Gbit}
      - {devices: [{kind: V100-32GB, count: 4}], link: 200Gbit}
      - {devices: [{kind: cpu, cores: 32, count: 1}]}
    inter_node: {bandwidth: 10Gbit, latency: 50us}

A device entry names a ``kind`` of the catalog (:mod:`.catalog`) or ``cpu`` (with ``cores``, ``isa``, ``ghz``), a
``count``, and may replace any figure inline: ``memory``, ``memory_bandwidth``, ``tflops`` (a number, or one per
precision: ``{fp32: ..., bf16: ..., fp16: ...}``), ``efficiency`` (the fraction of peak a step reaches) and ``speed``
(a factor on the rate, as ``LIGHTNING_HETERO_EMULATE_SPEEDS`` gives). A node's ``link`` is the bandwidth between its
devices (default 200 Gbit/s, PCIe 4.0 x16), optionally ``{bandwidth: ..., latency: ...}``.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from lightning_hetero.precision.choice import BF16, FP16, FP32
from lightning_hetero.simulate.catalog import (
    CPU_DEFAULTS,
    CPU_ISAS,
    TERA,
    DeviceKind,
    cpu_kind,
    lookup,
    with_overrides,
)

DEFAULT_INTRA_NODE = "200Gbit"  # PCIe 4.0 x16, about 25 GB/s each way
DEFAULT_INTRA_NODE_LATENCY = "10us"


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes per second
    latency: float = 0.0  # seconds per message

    def describe(self) -> str:
        return f"{self.bandwidth * 8 / 1e9:g} Gbit/s, {self.latency * 1e6:g} us"


@dataclass(frozen=True)
class SimulatedDevice:
    kind: DeviceKind
    node: int


@dataclass(frozen=True)
class Cluster:
    devices: tuple[SimulatedDevice, ...]
    node_links: tuple[Link, ...]  # one per node: between its devices
    inter_node: Optional[Link]  # None with one node

    @property
    def num_nodes(self) -> int:
        return len(self.node_links)

    def ranks_on(self, node: int) -> tuple[int, ...]:
        return tuple(rank for rank, device in enumerate(self.devices) if device.node == node)


class ClusterFileError(ValueError):
    """A mistake in a cluster file, with the file and line in its message."""


# ----------------------------------------------------------------------------------------------------- units (pure)

_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_BANDWIDTH_UNITS = {
    "gbit": 1e9 / 8,
    "gbit/s": 1e9 / 8,
    "gbps": 1e9 / 8,
    "gb/s": 1e9,
    "gbyte/s": 1e9,
    "mbit": 1e6 / 8,
    "mbit/s": 1e6 / 8,
    "mbps": 1e6 / 8,
    "mb/s": 1e6,
    "tbit": 1e12 / 8,
    "tbit/s": 1e12 / 8,
    "tb/s": 1e12,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_MEMORY_UNITS = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_quantity(value: Any, units: dict[str, float], what: str, example: str) -> float:
    """``value`` ("10Gbit", "50us", "80GB") in base units (bytes/s, seconds, bytes); a ``ValueError`` otherwise."""
    match = re.fullmatch(_NUMBER + r"([A-Za-zµ/]+)\s*", str(value)) if isinstance(value, str) else None
    unit = match and match.group(2).lower()
    if not match or unit not in units:
        raise ValueError(
            f"{what}: {value!r} is not a quantity with a unit; write it like {example!r} (units:"
            f" {', '.join(sorted(units))})"
        )
    number = float(match.group(1))
    if not math.isfinite(number):
        raise ValueError(f"{what}: {value!r} is not finite")
    return number * units[unit]


def parse_bandwidth(value: Any, what: str) -> float:
    bandwidth = parse_quantity(value, _BANDWIDTH_UNITS, what, "10Gbit")
    if bandwidth <= 0:
        raise ValueError(f"{what}: {value!r} must be more than 0")
    return bandwidth


def parse_latency(value: Any, what: str) -> float:
    return parse_quantity(value, _TIME_UNITS, what, "50us")


def parse_memory(value: Any, what: str) -> float:
    memory = parse_quantity(value, _MEMORY_UNITS, what, "80GB")
    if memory <= 0:
        raise ValueError(f"{what}: {value!r} must be more than 0")
    return memory


# ---------------------------------------------------------------------------------------- YAML with line numbers


class _Located(dict):
    """A YAML mapping that remembers its line and each key's line."""

    line: int
    key_lines: dict[str, int]


def _build(node: yaml.Node, loader: Any) -> Any:
    if isinstance(node, yaml.MappingNode):
        mapping = _Located()
        mapping.line, mapping.key_lines = node.start_mark.line + 1, {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            mapping[key] = _build(value_node, loader)
            mapping.key_lines[key] = key_node.start_mark.line + 1
        return mapping
    if isinstance(node, yaml.SequenceNode):
        return [_build(item, loader) for item in node.value]
    return loader.construct_object(node)


def load_cluster_text(text: str, source: str = "<cluster>") -> Cluster:
    """The cluster a YAML text describes; a :class:`ClusterFileError` naming ``source`` and the line otherwise."""
    # libyaml's parser where PyYAML was built with it: a cluster of a thousand nodes parses in a tenth of the time.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise ClusterFileError(f"{source}: the file is empty; it needs `nodes:` (see lightning-hetero plan --help)")
        document = _build(root, loader)
    except yaml.YAMLError as error:
        raise ClusterFileError(f"{source}: not valid YAML: {error}") from None
    finally:
        loader.dispose()
    return _ClusterReader(source).read(document)


def load_cluster(path: str) -> Cluster:
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:  # (a missing file was a raw traceback)
        raise ClusterFileError(
            f"`--cluster {path}`: {error.strerror or error}. Give the path of a cluster file (YAML; an example:"
            " configs/cluster_example.yaml)."
        ) from None
    return load_cluster_text(text, path)


class _ClusterReader:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: Any, message: str, key: Optional[str] = None) -> ClusterFileError:
        line = None
        if isinstance(where, _Located):
            line = where.line if key is None else where.key_lines.get(key, where.line)
        return ClusterFileError(f"{self.source}:{line}: {message}" if line else f"{self.source}: {message}")

    def mapping(self, value: Any, what: str, parent: Any, allowed: tuple[str, ...]) -> _Located:
        if not isinstance(value, _Located):
            raise self.fail(parent, f"{what} must be a mapping (`key: value` entries), got {value!r}")
        for key in value:
            if key not in allowed:
                closest = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.0)
                raise self.fail(value, f"{what} has no key {key!r}; did you mean {closest[0]!r}?", key)
        return value

    def read(self, root: Any) -> Cluster:
        root = self.mapping(root, "the cluster", None, ("nodes", "inter_node"))
        nodes = root.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise self.fail(root, "`nodes` must be a list with one entry per node", "nodes")
        devices, links = [], []
        for index, node in enumerate(nodes):
            node = self.mapping(node, f"node {index}", root, ("devices", "link", "name"))
            links.append(self.link(node, "link", DEFAULT_INTRA_NODE, DEFAULT_INTRA_NODE_LATENCY))
            entries = node.get("devices")
            if not isinstance(entries, list) or not entries:
                raise self.fail(node, f"node {index} needs `devices:`, a list of {{kind: ..., count: ...}}", "devices")
            for entry in entries:
                kind, count = self.device(entry, node)
                devices += [SimulatedDevice(kind, index)] * count
        inter_node = None
        if len(links) > 1:
            if "inter_node" not in root:
                raise self.fail(
                    root, "a cluster of several nodes needs `inter_node: {bandwidth: 10Gbit, latency: 50us}`"
                )
            inter_node = self.link(root, "inter_node", None, "0us")
        return Cluster(tuple(devices), tuple(links), inter_node)

    def link(self, parent: _Located, key: str, default: Optional[str], default_latency: str) -> Link:
        value = parent.get(key, default)
        latency: Any = default_latency
        if isinstance(value, _Located):
            self.mapping(value, f"`{key}`", parent, ("bandwidth", "latency"))
            if "bandwidth" not in value:
                raise self.fail(value, f"`{key}` needs a `bandwidth`, e.g. 10Gbit")
            value, latency = value["bandwidth"], value.get("latency", default_latency)
        try:
            return Link(parse_bandwidth(value, f"`{key}`"), parse_latency(latency, f"`{key}` latency"))
        except ValueError as error:
            raise self.fail(parent, str(error), key) from None

    def device(self, entry: Any, node: _Located) -> tuple[DeviceKind, int]:
        allowed = (
            "kind",
            "count",
            "cores",
            "isa",
            "ghz",
            "memory",
            "memory_bandwidth",
            "tflops",
            "efficiency",
            "speed",
        )
        entry = self.mapping(entry, "a device entry", node, allowed)
        if "kind" not in entry:
            raise self.fail(entry, "a device entry needs `kind:` (a catalog kind such as A100-80GB, or cpu)")
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise self.fail(entry, f"`count: {count!r}` must be a whole number >= 1", "count")
        try:
            kind = self.base_kind(entry)
            kind = with_overrides(
                kind,
                memory_bytes=_maybe(entry, "memory", parse_memory),
                memory_bandwidth=_maybe(entry, "memory_bandwidth", parse_bandwidth),
                peak_flops=_maybe(entry, "tflops", _parse_tflops),
                efficiency=_maybe(entry, "efficiency", _positive_fraction),
                speed=_maybe(entry, "speed", _positive_number),
            )
        except KeyError as error:
            raise self.fail(entry, error.args[0], "kind") from None
        except _EntryError as error:
            raise self.fail(entry, error.message, error.key) from None
        return kind, count

    def base_kind(self, entry: _Located) -> DeviceKind:
        if str(entry["kind"]).lower() != "cpu":
            for key in ("cores", "isa", "ghz"):
                if key in entry:
                    raise _EntryError(key, f"`{key}` describes a cpu; {entry['kind']!r} is a GPU kind")
            return lookup(entry["kind"])
        cores = entry.get("cores")
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise _EntryError("cores" if "cores" in entry else "kind", f"a cpu needs `cores:` >= 1, got {cores!r}")
        isa = entry.get("isa", CPU_DEFAULTS["isa"])
        if isa not in CPU_ISAS:
            closest = difflib.get_close_matches(str(isa), list(CPU_ISAS), n=1, cutoff=0.0)[0]
            raise _EntryError(
                "isa", f"unknown `isa: {isa!r}`; the closest known is {closest!r} ({', '.join(CPU_ISAS)})"
            )
        ghz = _maybe(entry, "ghz", _positive_number) or CPU_DEFAULTS["ghz"]
        return cpu_kind(cores, isa, ghz)


class _EntryError(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key, self.message = key, message


def _maybe(entry: _Located, key: str, parse) -> Any:
    if key not in entry:
        return None
    try:
        return parse(entry[key], f"`{key}`")
    except ValueError as error:
        raise _EntryError(key, str(error)) from None


def _positive_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what}: {value!r} must be a number > 0")
    return float(value)


def _positive_fraction(value: Any, what: str) -> float:
    number = _positive_number(value, what)
    if number > 1:
        raise ValueError(f"{what}: {value!r} is a fraction of the peak rate, at most 1")
    return number


_PRECISION_KEYS = {"fp32": FP32, "bf16": BF16, "fp16": FP16}


def _parse_tflops(value: Any, what: str) -> dict[str, float]:
    if isinstance(value, dict):
        unknown = [key for key in value if key not in _PRECISION_KEYS]
        if unknown:
            raise ValueError(f"{what}: unknown precision {unknown[0]!r}; give fp32, bf16 and/or fp16")
        return {_PRECISION_KEYS[key]: _positive_number(rate, f"{what}.{key}") * TERA for key, rate in value.items()}
    rate = _positive_number(value, what) * TERA
    return {FP32: rate}
