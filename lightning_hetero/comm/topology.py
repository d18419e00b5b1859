"""Topology: which ranks share a node, whether to reduce hierarchically, and an emulated slow link between nodes.

Pure decisions over the gathered device facts (each rank's host name): ranks on one host form a node, numbered in
the order their first rank appears; a node's leader is its lowest rank. A hierarchical reduction (see
:mod:`~.comm.compression`) sums inside each node first, exchanges between the leaders only, and broadcasts
back inside the node, so only one rank per node puts its gradients on the slow link between nodes.

Two test and demo aids, read from the environment like the speed emulation (:mod:`lightning_hetero.emulate.slowdown`):

* ``LIGHTNING_HETERO_EMULATE_NODES=2``: the ranks form that many nodes of consecutive ranks (4 ranks: {0, 1} and
  {2, 3}), whatever their hosts;
* ``LIGHTNING_HETERO_EMULATE_LINK=1,0.5``: the link between nodes carries 1 Gbit/s with 0.5 ms latency. Every
  collective whose group spans nodes then costs, on every rank in it, the latency plus the bytes that the busiest node
  sends across the link divided by the bandwidth (:func:`link_seconds`), slept after the collective is issued. The
  bytes are those of :mod:`~.comm.wire`'s count: each rank's payload, so a flat all-reduce over 2 nodes of
  2 ranks puts 2 payloads through each node's link, a hierarchical one 1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

NODES_ENV_VAR = "LIGHTNING_HETERO_EMULATE_NODES"
LINK_ENV_VAR = "LIGHTNING_HETERO_EMULATE_LINK"


@dataclass(frozen=True)
class Topology:
    """``nodes[r]`` is the node of global rank ``r`` (0, 1, ... in order of first appearance)."""

    nodes: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def ranks_on(self, node: int) -> tuple[int, ...]:
        return tuple(rank for rank, owner in enumerate(self.nodes) if owner == node)

    @property
    def node_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each node's ranks, node by node (one pass: the cluster planner builds topologies of 10,000 ranks)."""
        groups: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for rank, node in enumerate(self.nodes):
            groups[node].append(rank)
        return tuple(tuple(group) for group in groups)

    @property
    def leaders(self) -> tuple[int, ...]:
        """The lowest rank of each node, node by node: the ranks that talk across nodes in a hierarchical reduction."""
        return tuple(group[0] for group in self.node_groups)

    def spans_nodes(self, ranks: Sequence[int]) -> bool:
        return len({self.nodes[rank] for rank in ranks}) > 1

    def describe(self) -> str:
        return " | ".join(f"node {node}: ranks {list(group)}" for node, group in enumerate(self.node_groups))


def topology_from_hosts(hostnames: Sequence[str], emulated_nodes: Optional[int] = None) -> Topology:
    """Ranks grouped by host, or into ``emulated_nodes`` blocks of consecutive ranks (as even as they divide)."""
    world_size = len(hostnames)
    if emulated_nodes is not None:
        if emulated_nodes > world_size:
            raise ValueError(
                f"`{NODES_ENV_VAR}={emulated_nodes}` asks for more nodes than the job's {world_size} ranks: give at"
                f" most {world_size}."
            )
        return Topology(tuple(rank * emulated_nodes // world_size for rank in range(world_size)))
    order: dict[str, int] = {}
    return Topology(tuple(order.setdefault(host, len(order)) for host in hostnames))


def emulated_nodes_from_environment() -> Optional[int]:
    text = os.environ.get(NODES_ENV_VAR)
    if text is None or not text.strip():
        return None
    try:
        nodes = int(text)
    except ValueError:
        nodes = 0
    if nodes < 1:
        raise ValueError(f"`{NODES_ENV_VAR}={text!r}` is not a whole number of nodes >= 1, e.g. `{NODES_ENV_VAR}=2`.")
    return nodes


@dataclass(frozen=True)
class SlowLink:
    """An emulated link between nodes: ``gbit_per_second`` of bandwidth and ``latency_ms`` per collective."""

    gbit_per_second: float
    latency_ms: float = 0.0

    def seconds(self, crossing_bytes: float) -> float:
        return self.latency_ms / 1e3 + crossing_bytes * 8 / (self.gbit_per_second * 1e9)


def slow_link_from_environment() -> Optional[SlowLink]:
    text = os.environ.get(LINK_ENV_VAR)
    if text is None or not text.strip():
        return None
    example = f"`{LINK_ENV_VAR}=1,0.5` (1 Gbit/s, 0.5 ms)"
    parts = [part.strip() for part in text.split(",")]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or values[0] <= 0 or (len(values) == 2 and values[1] < 0):
        raise ValueError(
            f"`{LINK_ENV_VAR}={text!r}` is not a bandwidth in Gbit/s > 0 and an optional latency in ms >= 0:"
            f" e.g. {example}."
        )
    return SlowLink(*values)


def link_crossing_bytes(topology: Topology, group: Sequence[int], sender_bytes: dict[int, float]) -> float:
    """The bytes the busiest node of ``group`` sends across the link in one collective (0 if it stays in a node).

    ``sender_bytes[r]`` is what rank ``r`` contributes. Bytes sent by a node's ranks leave it through its one link;
    the collective lasts as long as the busiest link needs.
    """
    if not topology.spans_nodes(group):
        return 0.0
    per_node: dict[int, float] = {}
    for rank in group:
        per_node[topology.nodes[rank]] = per_node.get(topology.nodes[rank], 0.0) + sender_bytes.get(rank, 0.0)
    return max(per_node.values())


def check_hierarchical(value: Any) -> Union[str, bool]:
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        return value
    raise ValueError(
        f'`hierarchical={value!r}` is not one of "auto", True, False: True reduces inside each node first and sends'
        ' one payload per node between nodes; "auto" (default) does so when there are several nodes with several'
        " ranks each."
    )


def decide_hierarchical(requested: Union[str, bool], topology: Topology) -> tuple[bool, str]:
    """Whether to reduce hierarchically, and why (shown in the plan and the run report).

    A stage that cannot be hooked was refused earlier (``compression.check_exchange``) for ``True``; ``"auto"`` on such
    a stage is decided there too, so this only weighs the topology.
    """
    shared = [group for group in topology.node_groups if len(group) > 1]
    if requested is False:
        return False, "off (hierarchical=False)"
    if topology.num_nodes == 1:
        return False, "off: all ranks are on one node"
    if not shared:
        return False, "off: every node has one rank, so a hierarchical reduction would send the same bytes"
    why = f"{topology.num_nodes} nodes ({topology.describe()}): one payload per node crosses between nodes"
    if requested is True:
        return True, f"on (hierarchical=True): {why}"
    return True, f"on (auto): {why}"


def emulated_topology() -> tuple[Optional[int], Optional[SlowLink]]:
    """The emulated nodes and slow link between them, read from the environment once per trainer call (in the setup
    gather, so that a bad value is raised on every rank and one rank's different value is named)."""
    return emulated_nodes_from_environment(), slow_link_from_environment()
