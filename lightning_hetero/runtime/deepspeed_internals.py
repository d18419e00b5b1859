"""Runtime: the private names of DeepSpeed that the package patches, reads or calls (see :mod:`.internals`).

One list per library, so that a DeepSpeed upgrade is checked against this file alone; each entry says where the
package uses the name, why, and where a patch is put back.
"""

from __future__ import annotations

from lightning_hetero.runtime.internal_access import Internal

SHM_OP_BUILDER = Internal(
    "deepspeed.comm.torch",
    "build_shm_op",
    "patched",
    "runtime/startup.py",
    "DeepSpeed's CPU backend JIT-builds a shared-memory op (a compiler, ~30 s, a lock that waits for ever) on every"
    " init (TorchBackend.__init__ looks the function up in its module); training never uses the op",
    "at the end of the strategy's process-group init",
)

DEEPSPEED_AUTOTUNER_MLFLOW = Internal(
    "deepspeed.autotuning.autotuner",
    "has_mlflow",
    "read",
    "runtime/startup.py",
    "DeepSpeed's autotuner imports MLflow at DeepSpeed's import when it can (0.9 s and 104 MiB per rank): DeepSpeed is"
    " imported with MLflow hidden, so this stays False; MLflow is importable again at once",
)

_DEFERRED = (
    "a failed disk write of DeepSpeed's save is deferred past the barrier that ends the save (raised there, one rank"
    " left for the next collective while the others waited in the barrier); patched on the engine's instances"
)
_UNDONE = "when DeepSpeed's save returns (DeferredWriteErrors.__exit__)"
CHECKPOINT_WRITES = (
    Internal(
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
        "TorchCheckpointEngine.save",
        "patched",
        "recover/elastic.py",
        _DEFERRED,
        _UNDONE,
    ),
    Internal(
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
        "TorchCheckpointEngine.makedirs",
        "patched",
        "recover/elastic.py",
        _DEFERRED,
        _UNDONE,
    ),
    Internal(
        "deepspeed.runtime.engine",
        "DeepSpeedEngine._copy_recovery_script",
        "patched",
        "recover/elastic.py",
        _DEFERRED,
        _UNDONE,
    ),
)

FOREIGN_RESUME_WHY = (
    "a Lightning .ckpt of another strategy (DDP) resumed: its torch optimizer state goes into DeepSpeed's flat"
    " partitions (`single_partition_of_fp32_groups` at ZeRO-1/2, `fp32_partitioned_groups_flat` at ZeRO-3, read on"
    " the instance); the multi-process resume test exercises them"
)
# (the Lightning side of the same resume: lightning_internals.FOREIGN_RESUME_HOOK)
FOREIGN_RESUME = (
    Internal(
        "deepspeed.runtime.zero.stage_1_and_2",
        "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
        "called",
        "recover/from_lightning.py",
        "maps each parameter into the optimizer state it creates; " + FOREIGN_RESUME_WHY,
    ),
    Internal(
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition",
        "called",
        "recover/from_lightning.py",
        "a parameter's slice of a ZeRO-3 partition (its set_full_hp_param misses the"
        " padding of a last partition); " + FOREIGN_RESUME_WHY,
    ),
    Internal(
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3._get_param_partition_rank",
        "called",
        "recover/from_lightning.py",
        FOREIGN_RESUME_WHY,
    ),
)

# Gradients kept local: a rank's micro-batches before its last, and local SGD's steps (the ranks merge later).
LOCAL_GRADIENTS = (
    Internal(
        "deepspeed.runtime.zero.stage_1_and_2",
        "DeepSpeedZeroOptimizer#_coalesce_grad_reduction",
        "patched",
        "train/micro_batches.py",
        "set during a rank's micro-batches before its last, so ZeRO-2 keeps their"
        " gradients local and the last backward reduces the sum (the flag DeepSpeed's coalesce_grad_reduction"
        " sets, which refuses the unmanaged accumulation the strategy runs)",
        "after each such backward",
    ),
    Internal(
        "deepspeed.runtime.engine",
        "DeepSpeedEngine#inside_no_sync_ctxt",
        "patched",
        "train/micro_batches.py",
        "set with the flag above: the engine's end-of-backward reduction (which also clears the gradients) is"
        " skipped for those micro-batches",
        "after each such backward",
    ),
    Internal(
        "deepspeed.runtime.engine",
        "DeepSpeedEngine#enable_backward_allreduce",
        "patched",
        "job.py",
        "switched off for local SGD / DiLoCo: ZeRO-0's step then updates each rank from its own gradients (the"
        " ranks merge at synchronizations instead)",
        "never: the engine lives for one fit",
    ),
)

_DS_ENGINE = "deepspeed.runtime.engine"
_DS_Z12 = "deepspeed.runtime.zero.stage_1_and_2"
_DS_Z3 = "deepspeed.runtime.zero.stage3"
_AGREED_SKIP = (
    "a step skipped on every rank when any rank's gradients are not finite, with one loss scale: the overflow check"
    " is replaced on the optimizer instance by the agreed decision"
)
_PARAMETER_ORDER = (
    "ranks under different autocasts produce gradients in different orders: the reduction is coalesced and flushed"
    " in parameter order before the step"
)
_EMULATION = "an emulated slow device pays its delay before a reduction, not inside it (wrapped on the instance)"
_NEVER = "never: the instance lives for one fit"
_TIMED = "each rank's arrival at the gradient exchange and its time inside are measured (wrapped on the instance)"
_POPPED = "popped from the instance's __dict__ when the fit ends"
ENGINE_STATE = (
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#_config",
        "read",
        "recover/recovery.py",
        "the config whose load_universal_checkpoint is switched around a load on another number of ranks",
    ),
    Internal(
        "deepspeed.runtime.config",
        "DeepSpeedConfig#load_universal_checkpoint",
        "patched",
        "recover/recovery.py",
        "on while the converted universal checkpoint loads",
        "off after the load",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#basic_optimizer",
        "read",
        "recover/recovery.py",
        "the user's optimizer class, written to the manifest (named when a resume on another number of ranks"
        " refuses its state)",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#checkpoint_engine",
        "read",
        "recover/elastic.py",
        "whose save and makedirs DeferredWriteErrors defers",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine.allreduce_gradients",
        "patched",
        "comm/communication.py, emulate/slowdown.py, pipeline/training.py, watch/meter.py",
        "the ZeRO-0 exchange: replaced by a comm hook or the hierarchical reduction, or a no-op under a pipeline"
        " (which sums its stages' gradients itself); " + _EMULATION + "; " + _TIMED,
        _POPPED,
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine._broadcast_model",
        "patched",
        "pipeline/training.py",
        "a no-op while a pipeline's engine is built: its ranks hold different blocks, which the pipeline"
        " broadcasts within each stage's group itself",
        "restored after deepspeed.initialize",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#_is_gradient_accumulation_boundary",
        "patched",
        "precision/plugin.py",
        "forced on around the ZeRO-3 flush; " + _PARAMETER_ORDER,
        "restored after the flush",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#inside_no_sync_ctxt",
        "patched",
        "precision/plugin.py",
        "on while a step's backward passes run, as the engine's no_sync does; " + _PARAMETER_ORDER,
        "off before the flush",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine._flush_coalesced_reduction_zero3",
        "called",
        "precision/plugin.py",
        _PARAMETER_ORDER,
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine._flush_coalesced_reduction_zero12",
        "called",
        "precision/plugin.py",
        _PARAMETER_ORDER,
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#skipped_steps",
        "read",
        "precision/nonfinite.py",
        "a step skipped for non-finite gradients is counted, and a streak stops the run",
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine._take_model_step",
        "read",
        "precision/plugin.py, precision/nonfinite.py",
        "at ZeRO-0 it reads optimizer.overflow on the user's optimizer, which the agreed skip sets",
    ),
    Internal(
        _DS_ENGINE, "DeepSpeedEngine#has_moe_layers", "read", "comm/communication.py", "a hooked exchange refuses MoE"
    ),
    Internal(
        _DS_ENGINE,
        "DeepSpeedEngine#gradient_average",
        "read",
        "comm/communication.py",
        "a hooked exchange (which averages) refuses a summing gradient_allreduce_op",
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update",
        "patched",
        "precision/plugin.py",
        _AGREED_SKIP,
        _POPPED,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3._loss_scale_update_and_overflow_cleanup",
        "called",
        "precision/plugin.py",
        _AGREED_SKIP,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#overflow",
        "patched",
        "precision/plugin.py",
        _AGREED_SKIP,
        "DeepSpeed resets it every step",
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#_coalesce_grad_reduction",
        "patched",
        "precision/plugin.py",
        _PARAMETER_ORDER,
        "off for the flush and when the fit ends",
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#fp32_partitioned_groups_flat",
        "read",
        "recover/from_lightning.py",
        FOREIGN_RESUME_WHY,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
        "patched",
        "emulate/slowdown.py, watch/meter.py",
        _EMULATION + "; " + _TIMED,
        _NEVER,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads",
        "patched",
        "emulate/slowdown.py",
        _EMULATION,
        _NEVER,
    ),
    Internal(
        _DS_Z3, "DeepSpeedZeroOptimizer_Stage3#optimizer", "read", "recover/from_lightning.py", FOREIGN_RESUME_WHY
    ),
    Internal(
        "deepspeed.runtime.base_optimizer",
        "ZeROOptimizer.set_gradient_accumulation_boundary",
        "called",
        "precision/plugin.py",
        _PARAMETER_ORDER,
    ),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer.check_overflow", "patched", "precision/plugin.py", _AGREED_SKIP, _POPPED),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer#check_grad_overflow",
        "patched",
        "precision/plugin.py",
        "forced on so that an fp32 step still calls check_overflow; " + _AGREED_SKIP,
        "restored after the step",
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer#overflow",
        "patched",
        "precision/plugin.py",
        _AGREED_SKIP,
        "DeepSpeed resets it every step",
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer#_coalesce_grad_reduction",
        "patched",
        "precision/plugin.py",
        _PARAMETER_ORDER,
        "off for the flush and when the fit ends",
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer.overlapping_partition_gradients_reduce_epilogue",
        "patched",
        "precision/plugin.py",
        "the end-of-backward epilogue runs only at the flush; " + _PARAMETER_ORDER,
        _POPPED,
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer.reduce_ipg_grads",
        "patched",
        "emulate/slowdown.py, watch/meter.py",
        _EMULATION + "; " + _TIMED,
        _NEVER,
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads",
        "patched",
        "emulate/slowdown.py",
        _EMULATION,
        _NEVER,
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer#single_partition_of_fp32_groups",
        "read",
        "recover/from_lightning.py",
        FOREIGN_RESUME_WHY,
    ),
    Internal(
        _DS_Z12,
        "DeepSpeedZeroOptimizer#_hp_optimizer_states_linked",
        "patched",
        "recover/from_lightning.py",
        "reset so that the optimizer state created for a foreign resume is linked again; " + FOREIGN_RESUME_WHY,
        "DeepSpeed sets it again when it links",
    ),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#optimizer", "read", "recover/from_lightning.py", FOREIGN_RESUME_WHY),
    Internal(
        "deepspeed.runtime.bf16_optimizer",
        "BF16_Optimizer.get_grads_for_reduction",
        "read",
        "comm/communication.py",
        "probes for DeepSpeed's bf16 optimizer, which reduces its own copies (a hooked exchange is refused)",
    ),
    Internal(
        "deepspeed.comm.comm",
        "cdb",
        "read",
        "comm/wire.py",
        "DeepSpeed's comm backend, whose bound collectives the wire meter wraps",
    ),
    Internal(
        "deepspeed.comm.torch",
        "TorchBackend#all_gather_function",
        "patched",
        "comm/wire.py",
        "torch's all_gather_into_tensor as DeepSpeed bound it at init, wrapped to be counted",
        "WireMeter.uninstall",
    ),
    Internal(
        "deepspeed.comm.torch",
        "TorchBackend#reduce_scatter_function",
        "patched",
        "comm/wire.py",
        "torch's reduce_scatter_tensor as DeepSpeed bound it at init, wrapped to be counted",
        "WireMeter.uninstall",
    ),
    Internal(
        "deepspeed.runtime.config",
        "_reject_removed_config_keys",
        "called",
        "configure/deepspeed_keys.py",
        "DeepSpeed's own message for a removed config key",
    ),
    Internal(
        "deepspeed.runtime.config",
        "DeepSpeedConfig._initialize_params",
        "called",
        "configure/deepspeed_keys.py",
        "run on a recording dict to find unknown keys and each value's default type (skipped if missing)",
    ),
    Internal(
        "deepspeed.runtime.config_utils",
        "DeepSpeedConfigModel",
        "read",
        "configure/deepspeed_keys.py",
        "its subclasses' fields suggest the closest name for a misspelt section key",
    ),
    Internal(
        "deepspeed.runtime.zero.partition_parameters",
        "Init._convert_to_deepspeed_param",
        "read",
        "configure/model_agreement.py, recover/from_lightning.py",
        "sets ds_shape (a ZeRO-3 parameter's full shape, in the model"
        " signature) and ds_id (partitioned: read through GatheredParameters)",
    ),
    Internal(
        "deepspeed.utils.zero_to_fp32",
        "get_model_state_file",
        "called",
        "recover/export.py",
        "the model-states file of a checkpoint tag",
    ),
)

_ZERO3_UNIVERSAL = (
    "a ZeRO-3 resume on another number of ranks loads every per-parameter optimizer state of the universal copy"
    " (DeepSpeed's ZeRO-3 loader loads Adam's exp_avg and exp_avg_sq only)"
)
UNIVERSAL_LOAD = (
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint",
        "patched",
        "recover/universal.py",
        "replaced on the instance by load_zero3: " + _ZERO3_UNIVERSAL,
        "popped from the instance after the load",
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3.load_module_checkpoint_state_from_checkpoint_dir_stage3",
        "called",
        "recover/universal.py",
        "DeepSpeed's own load of the fp32 and module partitions; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state",
        "called",
        "recover/universal.py",
        "this rank's partition of a parameter's state, cut as DeepSpeed cuts it; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3._load_global_state_stage3",
        "called",
        "recover/universal.py",
        "the loss scaler; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#fp16_groups",
        "read",
        "recover/universal.py",
        "the parameters of each sub-group, in the order of its flat partition; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#fp32_partitioned_groups_flat",
        "read",
        "recover/universal.py",
        "each sub-group's flat partition, whose optimizer state is loaded; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#param_names",
        "read",
        "recover/universal.py",
        "a parameter's folder in the universal copy; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#optimizer",
        "read",
        "recover/universal.py",
        "the user's optimizer, whose state and param groups are loaded; " + _ZERO3_UNIVERSAL,
    ),
    Internal(
        _DS_Z3,
        "DeepSpeedZeroOptimizer_Stage3#swap_optimizer",
        "read",
        "recover/universal.py",
        "an optimizer swapped to NVMe is refused (its state is loaded by DeepSpeed's own loader only)",
    ),
)

DEEPSPEED_INTERNALS = (
    SHM_OP_BUILDER,
    DEEPSPEED_AUTOTUNER_MLFLOW,
    *CHECKPOINT_WRITES,
    *FOREIGN_RESUME,
    *LOCAL_GRADIENTS,
    *ENGINE_STATE,
    *UNIVERSAL_LOAD,
)
