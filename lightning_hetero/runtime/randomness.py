"""Random number generator state, saved and put back: work done outside training (profiling, inspecting the data
order) must leave dropout masks, augmentations and shuffles exactly as they would have been."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, Optional

import torch


@contextlib.contextmanager
def preserved_random_state(device: Optional[torch.device] = None) -> Iterator[None]:
    """Put Python's, numpy's and torch's global generators (and ``device``'s CUDA generator) back on exit."""
    python_rng = random.getstate()
    torch_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    numpy_rng = _numpy_rng_state()
    try:
        yield
    finally:
        random.setstate(python_rng)
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None and device is not None:  # (taken only for a CUDA device)
            torch.cuda.set_rng_state(cuda_rng, device)
        if numpy_rng is not None:
            import numpy

            numpy.random.set_state(numpy_rng)


def _numpy_rng_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()
