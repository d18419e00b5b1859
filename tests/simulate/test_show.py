"""How the plan reads (simulate/show.py): ratios and sizes in words a person reads right."""

from __future__ import annotations

from lightning_hetero.simulate.show import _faster_or_slower, _fixed_cost_notes, _node_ranges, _rows, _size


def test_a_slower_cluster_is_said_as_how_much_slower():
    assert _faster_or_slower(1.25) == "1.25x faster"
    assert _faster_or_slower(0.86) == "1.16x slower"  # (it read "0.86x slower")


def test_sizes_take_their_unit():
    assert [_size(v) for v in (130373.4e3, 26.7e3, 512, 2.5e9)] == ["130.4 MB", "26.7 kB", "512 B", "2.5 GB"]


def _device(kind: str, node: int, batch: int) -> dict:
    return {
        "kind": kind,
        "node": node,
        "precision": "bf16-mixed",
        "micro_batch": batch,
        "micro_steps": 1,
        "samples": batch,
        "memory_bytes": 2**30,
        "memory_capacity_bytes": 80 * 2**30,
        "compute_ms": 10.0,
    }


def test_identical_nodes_share_one_row_that_names_them():
    # 512 nodes of 8 devices, two kinds alternating by node: 2 rows (it was one row per node: 522 lines in all)
    devices = [_device("H100" if n % 2 else "A100-80GB", n, 20 if n % 2 else 10) for n in range(512) for _ in range(8)]
    rows = _rows(devices)[2:]
    assert len(rows) == 2
    assert rows[0].split()[:3] == ["2048", "A100-80GB", "256"]  # its 256 nodes, too many to list: counted
    assert _node_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    few = _rows([_device("T4", 3, 4), _device("T4", 4, 4), _device("V100-16GB", 5, 9)])[2:]
    assert [row.split()[:3] for row in few] == [["2", "T4", "3-4"], ["1", "V100-16GB", "5"]]


def test_a_device_bound_by_its_fixed_cost_is_said_to_be_and_why_it_gets_few_samples():
    launch_bound = {**_device("A100-80GB", 0, 1), "compute_ms": 0.62, "fixed_ms": 0.6}
    busy = {**_device("cpu-2c-avx2", 1, 253), "compute_ms": 0.6, "fixed_ms": 0.01}
    notes = _fixed_cost_notes([launch_bound, dict(launch_bound, node=1), busy], 255)
    assert len(notes) == 1  # one note per kind; the CPU, mostly per-sample cost, has none
    assert "each A100-80GB gets 1 sample(s): its step is 97% fixed cost (0.60 ms" in notes[0]
    # a device that still gets a fair share is not noted, whatever its fixed cost
    fair = {**_device("A100-80GB", 0, 849), "compute_ms": 4.1, "fixed_ms": 2.07}
    assert _fixed_cost_notes([fair, busy], 4096) == []
