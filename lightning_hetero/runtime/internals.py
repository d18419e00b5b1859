"""Private names of Lightning, DeepSpeed and torch that the package patches, reads or calls, in one list.

Each one is a bet on the versions this package pins: ``tests/runtime/test_internals.py`` checks that every name still
resolves, so an upgrade that removes one fails there, with this list, instead of somewhere inside a run.
Not listed: public functions the package wraps (torch.distributed's collectives in ``wire.py``, a LightningModule's
methods while profiling, ``DeepSpeedEngine.save_checkpoint``), and the CUDA device properties ``pci_*`` that
``devices.py`` reads with a default (a CPU build of torch has no ``_CudaDeviceProperties`` to check).

The entries are kept by library, a new one in its library's module: :mod:`.lightning_internals`,
:mod:`.deepspeed_internals` and :mod:`.torch_internals`; the record type and the means to resolve or patch a name are
in :mod:`.internal_access`. This module gathers the three lists into the one the test checks.
"""

from __future__ import annotations

from lightning_hetero.runtime.deepspeed_internals import DEEPSPEED_INTERNALS
from lightning_hetero.runtime.lightning_internals import LIGHTNING_INTERNALS
from lightning_hetero.runtime.torch_internals import TORCH_INTERNALS

INTERNALS = (*LIGHTNING_INTERNALS, *DEEPSPEED_INTERNALS, *TORCH_INTERNALS)
