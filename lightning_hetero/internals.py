"""Private names of Lightning, DeepSpeed and torch that the package patches, reads or calls, in one list.

Each one is a bet on the versions this package pins: ``tests/test_internals.py`` checks that every name still
resolves, so an upgrade that removes one fails there, with this list, instead of somewhere inside a run.
(Started with issue 17's additions; the names the older modules use are listed as they are moved.)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Internal:
    module: str  # where the name lives
    name: str  # attribute path inside the module ("Class.method"; "Class().attribute" for an instance's attribute)
    use: str  # "patched" (replaced for a while), "read" or "called"
    by: str  # the package module that uses it
    why: str
    undone: str = ""  # where a patch is put back


SHM_OP_BUILDER = Internal(
    "deepspeed.comm.torch", "build_shm_op", "patched", "startup.py",
    "DeepSpeed's CPU backend JIT-builds a shared-memory op (a compiler, ~30 s, a lock that waits for ever) on every"
    " init (TorchBackend.__init__ looks the function up in its module); training never uses the op",
    "at the end of the strategy's process-group init",
)  # fmt: skip

DEFAULT_STORE = Internal(
    "torch.distributed.distributed_c10d", "_get_default_store", "called", "failures.py",
    "the rendezvous store of the default process group, where a failing rank records its error for the others",
)  # fmt: skip

_DEFERRED = (
    "a failed disk write of DeepSpeed's save is deferred past the barrier that ends the save (raised there, one rank"
    " left for the next collective while the others waited in the barrier); patched on the engine's instances"
)
_UNDONE = "when DeepSpeed's save returns (DeferredWriteErrors.__exit__)"
CHECKPOINT_WRITES = (
    Internal("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.save", "patched",
             "elastic.py", _DEFERRED, _UNDONE),
    Internal("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.makedirs",
             "patched", "elastic.py", _DEFERRED, _UNDONE),
    Internal("deepspeed.runtime.engine", "DeepSpeedEngine._copy_recovery_script", "patched", "elastic.py", _DEFERRED,
             _UNDONE),
)  # fmt: skip

LAYER_SYNC = Internal(
    "lightning.pytorch.strategies.ddp", "DDPStrategy()._layer_sync", "read", "strategy.py",
    "where the Trainer puts `sync_batchnorm=True` (TorchSyncBatchNorm); DeepSpeedStrategy never applies it, DDPStrategy"
    " does in setup, so the strategy applies it at the same point (and refuses it off CUDA)",
)  # fmt: skip
SETUP_MODEL = Internal(
    "lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy._setup_model", "patched", "strategy.py",
    "overridden: the point of DeepSpeedStrategy.setup after the profile and before DeepSpeed wraps the module, where"
    " the layer sync is applied",
    "a subclass override, nothing to put back",
)  # fmt: skip

LIGHTNING_CHECKPOINT_LOAD = Internal(
    "lightning.pytorch.core.saving", "pl_load", "patched", "export.py",
    "the loader LightningModule.load_from_checkpoint calls: a HeteroStrategy checkpoint directory is read as the dict"
    " of a Lightning .ckpt file (it raised IsADirectoryError); every other path goes to Lightning's loader",
    "never: installed when the package is imported, and it only adds the directory case",
)  # fmt: skip

_FOREIGN_RESUME = (
    "a Lightning .ckpt of another strategy (DDP) resumed: its torch optimizer state goes into DeepSpeed's flat"
    " partitions (`single_partition_of_fp32_groups` at ZeRO-1/2, `fp32_partitioned_groups_flat` at ZeRO-3, read on"
    " the instance); the multi-process resume test exercises them"
)
FOREIGN_RESUME = (
    Internal("lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy._setup_model_and_optimizer", "patched",
             "strategy.py", "overridden to note the optimizer's parameter order before DeepSpeed flattens it; "
             + _FOREIGN_RESUME, "a subclass override, nothing to put back"),
    Internal("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
             "called", "resume_lightning.py", "maps each parameter into the optimizer state it creates; "
             + _FOREIGN_RESUME),
    Internal("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition", "called",
             "resume_lightning.py", "a parameter's slice of a ZeRO-3 partition (its set_full_hp_param misses the"
             " padding of a last partition); " + _FOREIGN_RESUME),
    Internal("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_param_partition_rank", "called",
             "resume_lightning.py", _FOREIGN_RESUME),
)  # fmt: skip

INTERNALS = (
    SHM_OP_BUILDER, DEFAULT_STORE, *CHECKPOINT_WRITES, LAYER_SYNC, SETUP_MODEL, LIGHTNING_CHECKPOINT_LOAD,
    *FOREIGN_RESUME,
)  # fmt: skip


def resolve(internal: Internal) -> Any:
    """The object ``internal`` names; AttributeError or ImportError when this version no longer has it."""
    target: Any = importlib.import_module(internal.module)
    for part in internal.name.split("."):
        if part.endswith("()"):  # an attribute that instances get in __init__: look at a new instance
            target = getattr(target, part[:-2])()
        else:
            target = getattr(target, part)
    return target


def replace(internal: Internal, replacement: Any) -> None:
    """Put ``replacement`` where ``internal`` (a module-level name) was, for good."""
    *path, name = internal.name.split(".")
    owner: Any = importlib.import_module(internal.module)
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, replacement)


@contextlib.contextmanager
def patched(internal: Internal, replacement: Any) -> Iterator[None]:
    """``internal`` (a module-level name or a class attribute) replaced by ``replacement`` inside the block."""
    owner: Any = importlib.import_module(internal.module)
    *path, name = internal.name.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)
