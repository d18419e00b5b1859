"""How the plan reads (simulate/show.py): ratios and sizes in words a person reads right."""

from __future__ import annotations

from lightning_hetero.simulate.show import _faster_or_slower, _size


def test_a_slower_cluster_is_said_as_how_much_slower():
    assert _faster_or_slower(1.25) == "1.25x faster"
    assert _faster_or_slower(0.86) == "1.16x slower"  # (it read "0.86x slower")


def test_sizes_take_their_unit():
    assert [_size(v) for v in (130373.4e3, 26.7e3, 512, 2.5e9)] == ["130.4 MB", "26.7 kB", "512 B", "2.5 GB"]
