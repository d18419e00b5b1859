"""Runtime: the private names of torch that the package patches, reads or calls (see :mod:`.internals`).

One list per library, so that a torch upgrade is checked against this file alone; each entry says where the package
uses the name, why, and where a patch is put back.
"""

from __future__ import annotations

from lightning_hetero.runtime.internal_access import Internal

DEFAULT_STORE = Internal(
    "torch.distributed.distributed_c10d",
    "_get_default_store",
    "called",
    "recover/failures.py",
    "the rendezvous store of the default process group, where a failing rank records its error for the others",
)

_POWER_SGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
_POWER_SGD_STATE = "PowerSGD's state, cleared when the buckets change and saved in checkpoints (error feedback)"
_EARLIER_ENGINE_HOOKS = (
    "the forward hooks a ZeRO-3 engine of an earlier trainer call left on the modules (DeepSpeed's, told by their"
    " module) are removed before a profile and before each engine is built; torch keeps them in these per-module"
    " tables by hook id"
)
TORCH_STATE = (
    Internal(
        "torch.amp.autocast_mode",
        "autocast#_enabled",
        "read",
        "measure/cpu.py",
        "whether CPU autocast accepted a dtype (it disables itself with a warning otherwise)",
    ),
    Internal(
        "torch.nn.modules.batchnorm",
        "_BatchNorm",
        "called",
        "train/sync_batchnorm.py",
        "the base class of every BatchNorm (torch's SyncBatchNorm included): subclassed by the gloo sync"
        " BatchNorm, and what `sync_batchnorm=True` converts",
    ),
    *(
        Internal(
            "torch.nn",
            f"Module().{name}",
            "patched",
            "measure/partitioned.py",
            _EARLIER_ENGINE_HOOKS,
            "never: the hooks belong to an engine that is gone; the new one registers its own",
        )
        for name in (
            "_forward_pre_hooks",
            "_forward_hooks",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
        )
    ),
    Internal(
        "torch.nn",
        "Module()._modules",
        "read",
        "pipeline/chain.py, pipeline/stage.py, pipeline/training.py",
        "a chain's blocks by name, in order, and the place where a block another stage holds is replaced (a"
        " ModuleDict's keys and a Sequential's indices alike)",
    ),
    Internal(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "called",
        "measure/operators.py, pipeline/blocks.py",
        "subclassed to record each aten operator of one forward + backward with its FLOPs and bytes (the GPU"
        " roofline's inputs; FlopCounterMode, the public counter, is one such mode), and to tag each tensor a"
        " pipeline's chain makes with the block it was made in (a skip connection between stages is refused)",
    ),
    Internal(
        "torch.utils._pytree",
        "tree_leaves",
        "called",
        "pipeline/blocks.py",
        "the tensors among an operator's arguments and outputs, and among a block's outputs (nested containers)",
    ),
    Internal(
        "torch.utils._pytree",
        "tree_flatten",
        "called",
        "measure/operators.py",
        "the tensors among an operator's arguments and outputs (nested lists and dicts), to count their bytes",
    ),
    *(
        Internal("torch._ops", f"OpOverload#{name}", "read", "measure/operators.py", why)
        for name, why in (
            ("_overloadpacket", "the operator's packet, the key of torch's FLOP formulas (flop_registry)"),
            ("_schema", "which arguments an operator writes: an in-place operator moves bytes, a view none"),
        )
    ),
    *(
        Internal(
            "torch",
            f"ops.aten.{name}",
            "called",
            "measure/operators.py",
            "counted as CUDA's flash attention: CPU's kernel of the same bytes and FLOPs (its formula is the CUDA"
            " kernel's in flop_registry)",
        )
        for name in (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_backward",
        )
    ),
    *(
        Internal(
            "torch.nn.functional",
            name,
            "patched",
            "measure/operators.py",
            "while counting a step's operators (launched_as_on_cuda), replaced by the fused kernel CUDA runs"
            " (nn.Dropout and nn.MultiheadAttention look it up there at each call); public, but patched",
            "at the end of the count",
        )
        for name in ("dropout", "scaled_dot_product_attention")
    ),
    *(
        Internal(
            _POWER_SGD,
            f"PowerSGDState#{name}",
            "patched",
            "comm/communication.py, comm/compression.py",
            _POWER_SGD_STATE,
            "restored from the checkpoint",
        )
        for name in (
            "error_dict",
            "p_memory_dict",
            "q_memory_dict",
            "iter",
            "rng",
            "total_numel_before_compression",
            "total_numel_after_compression",
            "next_stats_report",
        )
    ),
    *(
        Internal(_POWER_SGD, f"PowerSGDState#{name}", "read", "comm/error_bound.py", why)
        for name, why in (
            ("start_powerSGD_iter", "the steps of plain all-reduce before PowerSGD compresses (no check before)"),
            ("min_compression_rate", "which matrices PowerSGD compresses, for the payload within max_bytes_fraction"),
        )
    ),
    Internal(
        _POWER_SGD,
        "PowerSGDState#matrix_approximation_rank",
        "patched",
        "comm/error_bound.py",
        "raised by the error bound (max_error) while the compression's error is above it; the warm-started P and"
        " Q are dropped with it (their shapes follow the rank)",
        "restored from the checkpoint",
    ),
)

NESTED_SCHEDULERS = tuple(
    Internal(
        "torch.optim.lr_scheduler",
        f"{owner}#_schedulers",
        "read",
        "train/lr_scaling.py",
        "the schedulers a SequentialLR or ChainedScheduler steps, each from its own base_lrs, which lr_scaling"
        " scales too (scaling the outer one's alone was undone at the next step)",
    )
    for owner in ("SequentialLR", "ChainedScheduler")
)

TORCH_INTERNALS = (DEFAULT_STORE, *TORCH_STATE, *NESTED_SCHEDULERS)
