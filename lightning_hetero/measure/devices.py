"""Measure: the facts of the device a rank trains on, whatever its kind."""

from __future__ import annotations

from typing import Union

import torch

from lightning_hetero.measure.cpu import cpu_facts
from lightning_hetero.measure.cuda import cuda_facts
from lightning_hetero.measure.facts import DeviceFacts, _read


def collect_device_facts(device: Union[torch.device, str]) -> DeviceFacts:
    """Facts about ``device``; for ``cuda`` without an index, about the current CUDA device."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_facts()
    if device.type == "cuda":
        index = device.index
        if index is None:
            # Without a working runtime there is no current device; cuda_facts(0) then notes why torch failed.
            index = _read(torch.cuda.current_device, "current cuda device", [], default=0)
        return cuda_facts(index)
    raise ValueError(f"Cannot describe device type {device.type!r}; expected 'cuda' or 'cpu'.")
