"""Runtime: what a rank does at start-up in place of DeepSpeed's slower or riskier defaults.

DeepSpeed's CPU communication backend (``deepspeed.comm.torch.TorchBackend.__init__``) JIT-compiles a C++ op,
``deepspeed_shm_comm``, into torch's extension cache (``TORCH_EXTENSIONS_DIR``) on every process-group init. Training
never uses it: only ``inference_all_reduce`` (tensor-parallel inference) does, and that falls back to the process
group's all-reduce when the op is absent. The build costs about 30 s at the first start in each environment (and again
after every switch between two environments with DeepSpeed at different paths), needs a compiler, and runs under
torch's ``FileBaton`` lock, which waits for ever on the lock file a rank killed mid-build leaves behind: every later
DeepSpeed job on the machine then sat at 0 % CPU without a word. So the strategy's process-group init runs with the
builder answering "no op", and nothing is compiled, locked or cached.

DeepSpeed's import also imports MLflow when it is installed: ``deepspeed.autotuning.autotuner`` tries it at import for
the autotuner's own logging, which training never uses. It cost every rank 0.9 s and 104 MiB here (0.25 s and 361
MiB peak with it, 1.11 s and 465 MiB without; MLflow is in the test extra, and many machines have it). So the strategy
imports DeepSpeed with MLflow hidden when neither is imported yet (:func:`deepspeed_imported_without_mlflow`); MLflow
stays importable afterwards (Lightning's ``MLFlowLogger`` imports it as usual), and only DeepSpeed's autotuner has none.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from lightning_hetero.runtime.deepspeed_internals import SHM_OP_BUILDER
from lightning_hetero.runtime.internal_access import patched


def without_shared_memory_comm_op() -> contextlib.AbstractContextManager:
    """DeepSpeed's communication backend starts without building its shared-memory inference op (put back after)."""
    return patched(SHM_OP_BUILDER, _no_op)


def _no_op() -> None:
    return None  # what build_shm_op returns where the op is incompatible: the backend keeps shm_comm_op = None


@contextlib.contextmanager
def deepspeed_imported_without_mlflow() -> Iterator[None]:
    """Inside, DeepSpeed is imported (when neither it nor MLflow is yet) with MLflow hidden from its autotuner."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # an import of it fails as if it were not installed
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            pass  # (Lightning's DeepSpeedStrategy says what is missing)
        finally:
            if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
                del sys.modules["mlflow"]
    yield
