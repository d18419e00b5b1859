"""Private names of Lightning, DeepSpeed and torch that the package patches, reads or calls, in one list.

Each one is a bet on the versions this package pins: ``tests/runtime/test_internals.py`` checks that every name still
resolves, so an upgrade that removes one fails there, with this list, instead of somewhere inside a run.
Not listed: public functions the package wraps (torch.distributed's collectives in ``wire.py``, a LightningModule's
methods while profiling, ``DeepSpeedEngine.save_checkpoint``), and the CUDA device properties ``pci_*`` that
``devices.py`` reads with a default (a CPU build of torch has no ``_CudaDeviceProperties`` to check).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Internal:
    module: str  # where the name lives
    # Attribute path inside the module: "Class.method"; "Class().attribute" for an attribute that a new instance has;
    # "Class#attribute" for one the class's code sets on its instances (``self.attribute = ...``) where an instance
    # cannot be made without a whole run (DeepSpeed's engine and optimizers).
    name: str
    use: str  # "patched" (replaced for a while), "read" or "called"
    by: str  # the package module that uses it
    why: str
    undone: str = ""  # where a patch is put back


SHM_OP_BUILDER = Internal(
    "deepspeed.comm.torch", "build_shm_op", "patched", "runtime/startup.py",
    "DeepSpeed's CPU backend JIT-builds a shared-memory op (a compiler, ~30 s, a lock that waits for ever) on every"
    " init (TorchBackend.__init__ looks the function up in its module); training never uses the op",
    "at the end of the strategy's process-group init",
)  # fmt: skip

DEEPSPEED_AUTOTUNER_MLFLOW = Internal(
    "deepspeed.autotuning.autotuner", "has_mlflow", "read", "runtime/startup.py",
    "DeepSpeed's autotuner imports MLflow at DeepSpeed's import when it can (0.9 s and 104 MiB per rank): DeepSpeed is"
    " imported with MLflow hidden, so this stays False; MLflow is importable again at once",
)  # fmt: skip

DEFAULT_STORE = Internal(
    "torch.distributed.distributed_c10d", "_get_default_store", "called", "recover/failures.py",
    "the rendezvous store of the default process group, where a failing rank records its error for the others",
)  # fmt: skip

_DEFERRED = (
    "a failed disk write of DeepSpeed's save is deferred past the barrier that ends the save (raised there, one rank"
    " left for the next collective while the others waited in the barrier); patched on the engine's instances"
)
_UNDONE = "when DeepSpeed's save returns (DeferredWriteErrors.__exit__)"
CHECKPOINT_WRITES = (
    Internal("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.save", "patched",
             "recover/elastic.py", _DEFERRED, _UNDONE),
    Internal("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.makedirs",
             "patched", "recover/elastic.py", _DEFERRED, _UNDONE),
    Internal("deepspeed.runtime.engine", "DeepSpeedEngine._copy_recovery_script", "patched", "recover/elastic.py",
             _DEFERRED,
             _UNDONE),
)  # fmt: skip

LAYER_SYNC = Internal(
    "lightning.pytorch.strategies.ddp", "DDPStrategy()._layer_sync", "read", "strategy.py",
    "where the Trainer puts `sync_batchnorm=True` (TorchSyncBatchNorm); DeepSpeedStrategy never applies it, DDPStrategy"
    " does in setup, so the strategy applies it at the same point (on gloo, the package's own in its place)",
)  # fmt: skip
SETUP_MODEL = Internal(
    "lightning.pytorch.strategies.deepspeed", "DeepSpeedStrategy._setup_model", "patched", "strategy.py",
    "overridden: the point of DeepSpeedStrategy.setup after the profile and before DeepSpeed wraps the module, where"
    " the layer sync is applied",
    "a subclass override, nothing to put back",
)  # fmt: skip

LIGHTNING_CHECKPOINT_LOAD = Internal(
    "lightning.pytorch.core.saving", "pl_load", "patched", "recover/export.py",
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
             "called", "recover/from_lightning.py", "maps each parameter into the optimizer state it creates; "
             + _FOREIGN_RESUME),
    Internal("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition", "called",
             "recover/from_lightning.py", "a parameter's slice of a ZeRO-3 partition (its set_full_hp_param misses the"
             " padding of a last partition); " + _FOREIGN_RESUME),
    Internal("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._get_param_partition_rank", "called",
             "recover/from_lightning.py", _FOREIGN_RESUME),
)  # fmt: skip

_FABRIC_DS = "lightning.fabric.strategies.deepspeed"
_DEEPSPEED_STRATEGY_RESUME = (
    "a checkpoint directory of Lightning's DeepSpeedStrategy (no manifest) resumed, or a path that is no checkpoint"
    " explained in DeepSpeedStrategy's own words"
)
DEEPSPEED_STRATEGY_RESUME = (
    Internal(_FABRIC_DS, "_is_deepspeed_checkpoint", "called", "recover/from_deepspeed.py",
             "DeepSpeedStrategy's test for a checkpoint folder; " + _DEEPSPEED_STRATEGY_RESUME),
    Internal(_FABRIC_DS, "_validate_checkpoint_directory", "called", "recover/from_deepspeed.py",
             "raises DeepSpeedStrategy's FileNotFoundError naming the folder to load instead; "
             + _DEEPSPEED_STRATEGY_RESUME),
)  # fmt: skip

_OVERRIDE = "a subclass override, nothing to put back"
_PL_DS = "lightning.pytorch.strategies.deepspeed"
_PL_DDP = "lightning.pytorch.strategies.ddp"
STRATEGY_HOOKS = (
    Internal("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher", "read",
             "strategy.py, runtime/quiet.py",
             "the launcher the parent configures, swapped for QuietLauncher (its subclass) so that each trainer call"
             " runs with third-party noise silenced"),
    Internal(_PL_DDP, "DDPStrategy._configure_launcher", "patched", "strategy.py", "overridden to put QuietLauncher"
             " in place of the parent's launcher", _OVERRIDE),
    Internal(_PL_DDP, "DDPStrategy#_launcher", "patched", "strategy.py", "replaced by QuietLauncher", _OVERRIDE),
    Internal(_PL_DS, "DeepSpeedStrategy._init_deepspeed_distributed", "patched", "strategy.py", "overridden: under"
             " torchrun a per-attempt process group first, then the parent's init without the shm op build",
             _OVERRIDE),
    Internal(_PL_DDP, "DDPStrategy._get_process_group_backend", "called", "strategy.py",
             "the backend of the process group the strategy opens itself"),
    Internal(_PL_DDP, "DDPStrategy#_timeout", "read", "strategy.py", "the process group's timeout"),
    Internal(_PL_DS, "DeepSpeedStrategy._init_config_if_needed", "patched", "strategy.py", "overridden: the config is"
             " formatted on every trainer call (the micro-batch depends on it), not once per strategy", _OVERRIDE),
    Internal(_PL_DS, "DeepSpeedStrategy#_config_initialized", "patched", "strategy.py",
             "set after each per-call format, as the parent does", _OVERRIDE),
    Internal(_PL_DS, "DeepSpeedStrategy._format_config", "patched", "strategy.py", "overridden: measure, plan and set"
             " this rank's micro-batch before the parent formats, then check that the ranks' configs agree",
             _OVERRIDE),
    Internal(_PL_DDP, "DDPStrategy#_forward_redirection", "patched", "strategy.py", "wrapped in AutocastInside after"
             " init_deepspeed (each rank's autocast inside the engine)", "put back at teardown"),
    Internal("lightning.pytorch.strategies.strategy", "_ForwardRedirection", "read", "precision/plugin.py",
             "the redirection AutocastInside wraps; its call signature is relied on"),
    Internal("lightning.fabric.utilities.types", "_PATH", "read", "strategy.py", "a type alias in signatures"),
)  # fmt: skip

_PL_DATA = "lightning.pytorch.trainer.connectors.data_connector"
TRAINER_STATE = (
    Internal("lightning.pytorch.trainer.trainer", "Trainer#_accelerator_connector", "read", "train/sharding.py",
             "where Trainer(use_distributed_sampler=...) is kept"),
    Internal("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector#"
             "use_distributed_sampler", "patched", "train/sharding.py",
             "forced off while the strategy shards the training"
             " data itself (Lightning would put in a DistributedSampler); the user's value is kept for predict",
             "at teardown"),
    Internal("lightning.pytorch.loops.fit_loop", "_FitLoop#_data_source", "read", "train/sharding.py",
             "the training loader is requested from it at setup (to profile and plan) and handed back to the loop"),
    Internal(_PL_DATA, "_request_dataloader", "called", "train/sharding.py", "requests train_dataloader() as Lightning"
             " does, inside _format_config, before the loop asks"),
    Internal(_PL_DATA, "_DataLoaderSource.is_defined", "called", "train/sharding.py", "no training loader: no profile"),
    Internal(_PL_DATA, "_DataLoaderSource.dataloader", "patched", "train/sharding.py",
             "shadowed on the instance so that"
             " the loader requested at setup is served once (the user's hook runs once per fit)",
             "deleted from the instance once served"),
    Internal("lightning.pytorch.core.module", "LightningModule#_trainer", "read", "strategy.py, precision/plugin.py",
             "whether a trainer is attached, without the .trainer property raising"),
    Internal("lightning.pytorch.trainer.trainer", "Trainer#_signal_connector", "read", "recover/stopping.py",
             "Lightning's SIGTERM handling, whose notifier is replaced and whose flag is set"),
    Internal("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._sigterm_notifier_fn",
             "patched", "recover/stopping.py", "shadowed on the instance before Lightning registers its handlers: the"
             " handler only sets a flag (no collective inside a signal handler)",
             "never: the instance lives for one Trainer"),
    Internal("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector._slurm_sigusr_handler_fn",
             "patched", "recover/stopping.py", "shadowed on the instance before Lightning registers its handlers:"
             " Slurm's requeue signal only sets a flag (Lightning's saved a checkpoint, with collectives, in it)",
             "never: the instance lives for one Trainer"),
    Internal("lightning.pytorch.trainer.connectors.signal_connector", "_SignalConnector#received_sigterm", "patched",
             "recover/stopping.py", "set once the ranks agreed to stop, so that callbacks see trainer.received_sigterm",
             "never: it is Lightning's own flag"),
    Internal("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop._broadcast_sigterm_tensor",
             "patched", "recover/stopping.py",
             "shadowed on the trainer's epoch loop by an all-reduce MAX of every rank's"
             " flag (Lightning broadcasts rank 0's and exits 0)", "never: the instance lives for one Trainer"),
    Internal("lightning.pytorch.utilities._pytree", "_tree_flatten", "read", "runtime/quiet.py",
             "its module's name is the"
             " module= of a warnings filter for the LeafSpec deprecation it raises; a rename stops the filter"),
    Internal("lightning.fabric.utilities.data", "_set_sampler_epoch", "read", "train/order.py",
             "finds GlobalOrder through"
             " batch_sampler.sampler and calls its set_epoch: HeteroBatchSampler keeps that attribute name"),
    Internal("lightning.fabric.utilities.types", "_Stateful", "read", "train/loaders.py, train/streams.py",
             "the protocol by which"
             " CombinedLoader saves and restores the loaders' data position (state_dict/load_state_dict)"),
    Internal("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer#_coalesce_grad_reduction", "patched",
             "train/micro_batches.py", "set during a rank's micro-batches before its last, so ZeRO-2 keeps their"
             " gradients local and the last backward reduces the sum (the flag DeepSpeed's coalesce_grad_reduction"
             " sets, which refuses the unmanaged accumulation the strategy runs)", "after each such backward"),
    Internal("deepspeed.runtime.engine", "DeepSpeedEngine#inside_no_sync_ctxt", "patched", "train/micro_batches.py",
             "set with the flag above: the engine's end-of-backward reduction (which also clears the gradients) is"
             " skipped for those micro-batches", "after each such backward"),
    Internal("deepspeed.runtime.engine", "DeepSpeedEngine#enable_backward_allreduce", "patched", "job.py",
             "switched off for local SGD / DiLoCo: ZeRO-0's step then updates each rank from its own gradients (the"
             " ranks merge at synchronizations instead)", "never: the engine lives for one fit"),
    Internal("lightning.pytorch.trainer.trainer", "Trainer._results", "read", "strategy.py",
             "the logged results of the batch in hand, whose batch size micro-steps set to each micro-batch's"),
    Internal("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultCollection#batch_size",
             "patched", "strategy.py", "a metric logged in a micro-batch counts that micro-batch's samples in the"
             " epoch mean (Lightning would take the whole batch's)", "by Lightning at the next batch's start"),
    Internal("lightning.pytorch.loops.fit_loop", "_FitLoop.on_load_checkpoint", "read", "recover/from_lightning.py",
             "the fit loop's checkpoint layout (combined_loader state, batch and epoch progress) that a DDP .ckpt"
             " resume reads and writes"),
)  # fmt: skip

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
_POPPED = "popped from the instance's __dict__ when the fit ends"
ENGINE_STATE = (
    Internal(_DS_ENGINE, "DeepSpeedEngine#_config", "read", "recover/recovery.py", "the config whose"
             " load_universal_checkpoint is switched around a load on another number of ranks"),
    Internal("deepspeed.runtime.config", "DeepSpeedConfig#load_universal_checkpoint", "patched", "recover/recovery.py",
             "on while the converted universal checkpoint loads", "off after the load"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#basic_optimizer", "read", "recover/recovery.py",
             "the user's optimizer class, written to the manifest (named when a resume on another number of ranks"
             " refuses its state)"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#checkpoint_engine", "read", "recover/elastic.py",
             "whose save and makedirs DeferredWriteErrors defers"),
    Internal(_DS_ENGINE, "DeepSpeedEngine.allreduce_gradients", "patched",
             "comm/communication.py, emulate/slowdown.py, job.py",
             "the ZeRO-0 exchange: replaced by a comm hook or the hierarchical reduction, or a no-op under a pipeline"
             " (which sums its stages' gradients itself); " + _EMULATION, _POPPED),
    Internal(_DS_ENGINE, "DeepSpeedEngine._broadcast_model", "patched", "job.py",
             "a no-op while a pipeline's engine is built: its ranks hold different blocks, which the pipeline"
             " broadcasts within each stage's group itself", "restored after deepspeed.initialize"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#_is_gradient_accumulation_boundary", "patched", "precision/plugin.py",
             "forced on around the ZeRO-3 flush; " + _PARAMETER_ORDER, "restored after the flush"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#inside_no_sync_ctxt", "patched", "precision/plugin.py",
             "on while a step's backward passes run, as the engine's no_sync does; " + _PARAMETER_ORDER,
             "off before the flush"),
    Internal(_DS_ENGINE, "DeepSpeedEngine._flush_coalesced_reduction_zero3", "called", "precision/plugin.py",
             _PARAMETER_ORDER),
    Internal(_DS_ENGINE, "DeepSpeedEngine._flush_coalesced_reduction_zero12", "called", "precision/plugin.py",
             _PARAMETER_ORDER),
    Internal(_DS_ENGINE, "DeepSpeedEngine#skipped_steps", "read", "precision/nonfinite.py",
             "a step skipped for non-finite"
             " gradients is counted, and a streak stops the run"),
    Internal(_DS_ENGINE, "DeepSpeedEngine._take_model_step", "read", "precision/plugin.py, precision/nonfinite.py",
             "at ZeRO-0 it reads optimizer.overflow on the user's optimizer, which the agreed skip sets"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#has_moe_layers", "read", "comm/communication.py",
             "a hooked exchange refuses MoE"),
    Internal(_DS_ENGINE, "DeepSpeedEngine#gradient_average", "read", "comm/communication.py",
             "a hooked exchange (which averages) refuses a summing gradient_allreduce_op"),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3._overflow_check_and_loss_scale_update", "patched",
             "precision/plugin.py", _AGREED_SKIP, _POPPED),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3._loss_scale_update_and_overflow_cleanup", "called",
             "precision/plugin.py", _AGREED_SKIP),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#overflow", "patched", "precision/plugin.py", _AGREED_SKIP,
             "DeepSpeed resets it every step"),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#_coalesce_grad_reduction", "patched", "precision/plugin.py",
             _PARAMETER_ORDER, "off for the flush and when the fit ends"),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#fp32_partitioned_groups_flat", "read", "recover/from_lightning.py",
             _FOREIGN_RESUME),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
             "patched", "emulate/slowdown.py", _EMULATION, _NEVER),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3.reduce_ready_partitions_and_remove_grads", "patched",
             "emulate/slowdown.py", _EMULATION, _NEVER),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#optimizer", "read", "recover/from_lightning.py", _FOREIGN_RESUME),
    Internal("deepspeed.runtime.base_optimizer", "ZeROOptimizer.set_gradient_accumulation_boundary", "called",
             "precision/plugin.py", _PARAMETER_ORDER),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer.check_overflow", "patched", "precision/plugin.py", _AGREED_SKIP,
             _POPPED),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#check_grad_overflow", "patched", "precision/plugin.py",
             "forced on so that an fp32 step still calls check_overflow; " + _AGREED_SKIP, "restored after the step"),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#overflow", "patched", "precision/plugin.py", _AGREED_SKIP,
             "DeepSpeed resets it every step"),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#_coalesce_grad_reduction", "patched", "precision/plugin.py",
             _PARAMETER_ORDER, "off for the flush and when the fit ends"),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer.overlapping_partition_gradients_reduce_epilogue", "patched",
             "precision/plugin.py", "the end-of-backward epilogue runs only at the flush; " + _PARAMETER_ORDER,
             _POPPED),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer.reduce_ipg_grads", "patched", "emulate/slowdown.py", _EMULATION, _NEVER),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer.reduce_ready_partitions_and_remove_grads", "patched",
             "emulate/slowdown.py",
             _EMULATION, _NEVER),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#single_partition_of_fp32_groups", "read", "recover/from_lightning.py",
             _FOREIGN_RESUME),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#_hp_optimizer_states_linked", "patched", "recover/from_lightning.py",
             "reset so that the optimizer state created for a foreign resume is linked again; " + _FOREIGN_RESUME,
             "DeepSpeed sets it again when it links"),
    Internal(_DS_Z12, "DeepSpeedZeroOptimizer#optimizer", "read", "recover/from_lightning.py", _FOREIGN_RESUME),
    Internal("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer.get_grads_for_reduction", "read",
             "comm/communication.py",
             "probes for DeepSpeed's bf16 optimizer, which reduces its own copies (a hooked exchange is refused)"),
    Internal("deepspeed.comm.comm", "cdb", "read", "comm/wire.py", "DeepSpeed's comm backend, whose bound collectives"
             " the wire meter wraps"),
    Internal("deepspeed.comm.torch", "TorchBackend#all_gather_function", "patched", "comm/wire.py",
             "torch's all_gather_into_tensor as DeepSpeed bound it at init, wrapped to be counted",
             "WireMeter.uninstall"),
    Internal("deepspeed.comm.torch", "TorchBackend#reduce_scatter_function", "patched", "comm/wire.py",
             "torch's reduce_scatter_tensor as DeepSpeed bound it at init, wrapped to be counted",
             "WireMeter.uninstall"),
    Internal("deepspeed.runtime.config", "_reject_removed_config_keys", "called", "plan/deepspeed_config.py",
             "DeepSpeed's own message for a removed config key"),
    Internal("deepspeed.runtime.config", "DeepSpeedConfig._initialize_params", "called", "plan/deepspeed_config.py",
             "run on a recording dict to find unknown keys and each value's default type (skipped if missing)"),
    Internal("deepspeed.runtime.config_utils", "DeepSpeedConfigModel", "read", "plan/deepspeed_config.py",
             "its subclasses' fields suggest the closest name for a misspelt section key"),
    Internal("deepspeed.runtime.zero.partition_parameters", "Init._convert_to_deepspeed_param", "read",
             "plan/deepspeed_config.py, recover/from_lightning.py",
             "sets ds_shape (a ZeRO-3 parameter's full shape, in the model"
             " signature) and ds_id (partitioned: read through GatheredParameters)"),
    Internal("deepspeed.utils.zero_to_fp32", "get_model_state_file", "called", "recover/export.py",
             "the model-states file of a checkpoint tag"),
)  # fmt: skip

_ZERO3_UNIVERSAL = (
    "a ZeRO-3 resume on another number of ranks loads every per-parameter optimizer state of the universal copy"
    " (DeepSpeed's ZeRO-3 loader loads Adam's exp_avg and exp_avg_sq only)"
)
UNIVERSAL_LOAD = (
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3._load_universal_checkpoint", "patched", "recover/universal.py",
             "replaced on the instance by load_zero3: " + _ZERO3_UNIVERSAL, "popped from the instance after the load"),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3.load_module_checkpoint_state_from_checkpoint_dir_stage3", "called",
             "recover/universal.py", "DeepSpeed's own load of the fp32 and module partitions; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state", "called", "recover/universal.py",
             "this rank's partition of a parameter's state, cut as DeepSpeed cuts it; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3._load_global_state_stage3", "called", "recover/universal.py",
             "the loss scaler; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#fp16_groups", "read", "recover/universal.py",
             "the parameters of each sub-group, in the order of its flat partition; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#fp32_partitioned_groups_flat", "read", "recover/universal.py",
             "each sub-group's flat partition, whose optimizer state is loaded; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#param_names", "read", "recover/universal.py",
             "a parameter's folder in the universal copy; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#optimizer", "read", "recover/universal.py",
             "the user's optimizer, whose state and param groups are loaded; " + _ZERO3_UNIVERSAL),
    Internal(_DS_Z3, "DeepSpeedZeroOptimizer_Stage3#swap_optimizer", "read", "recover/universal.py",
             "an optimizer swapped to NVMe is refused (its state is loaded by DeepSpeed's own loader only)"),
)  # fmt: skip

_POWER_SGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
_POWER_SGD_STATE = "PowerSGD's state, cleared when the buckets change and saved in checkpoints (error feedback)"
_EARLIER_ENGINE_HOOKS = (
    "the forward hooks a ZeRO-3 engine of an earlier trainer call left on the modules (DeepSpeed's, told by their"
    " module) are removed before a profile and before each engine is built; torch keeps them in these per-module"
    " tables by hook id"
)
TORCH_STATE = (
    Internal("torch.amp.autocast_mode", "autocast#_enabled", "read", "measure/cpu.py",
             "whether CPU autocast accepted a dtype (it disables itself with a warning otherwise)"),
    Internal("torch.nn.modules.batchnorm", "_BatchNorm", "called", "train/sync_batchnorm.py",
             "the base class of every BatchNorm (torch's SyncBatchNorm included): subclassed by the gloo sync BatchNorm,"
             " and what `sync_batchnorm=True` converts"),
    *(Internal("torch.nn", f"Module().{name}", "patched", "measure/partitioned.py", _EARLIER_ENGINE_HOOKS,
               "never: the hooks belong to an engine that is gone; the new one registers its own")
      for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                   "_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    Internal("torch.nn", "Module()._modules", "read", "train/pipeline.py",
             "a chain's blocks by name, in order, and the place where a block another stage holds is replaced (a"
             " ModuleDict's keys and a Sequential's indices alike)"),
    Internal("torch.utils._python_dispatch", "TorchDispatchMode", "called", "measure/operators.py",
             "subclassed to record each aten operator of one forward + backward with its FLOPs and bytes (the GPU"
             " roofline's inputs); FlopCounterMode, the public counter, is one such mode"),
    Internal("torch.utils._pytree", "tree_flatten", "called", "measure/operators.py",
             "the tensors among an operator's arguments and outputs (nested lists and dicts), to count their bytes"),
    *(Internal("torch._ops", f"OpOverload#{name}", "read", "measure/operators.py", why) for name, why in (
        ("_overloadpacket", "the operator's packet, the key of torch's FLOP formulas (flop_registry)"),
        ("_schema", "which arguments an operator writes: an in-place operator moves bytes, a view none"))),
    *(Internal("torch", f"ops.aten.{name}", "called", "measure/operators.py",
               "counted as CUDA's flash attention: CPU's kernel of the same bytes and FLOPs (its formula is the CUDA"
               " kernel's in flop_registry)") for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward")),
    *(Internal("torch.nn.functional", name, "patched", "measure/operators.py",
               "while counting a step's operators (launched_as_on_cuda), replaced by the fused kernel CUDA runs"
               " (nn.Dropout and nn.MultiheadAttention look it up there at each call); public, but patched",
               "at the end of the count") for name in ("dropout", "scaled_dot_product_attention")),
    *(Internal(_POWER_SGD, f"PowerSGDState#{name}", "patched", "comm/communication.py, comm/compression.py",
    _POWER_SGD_STATE,
               "restored from the checkpoint")
      for name in ("error_dict", "p_memory_dict", "q_memory_dict", "iter", "rng", "total_numel_before_compression",
                   "total_numel_after_compression", "next_stats_report")),
)  # fmt: skip

INTERNALS = (
    SHM_OP_BUILDER, DEEPSPEED_AUTOTUNER_MLFLOW, DEFAULT_STORE, *CHECKPOINT_WRITES, LAYER_SYNC, SETUP_MODEL,
    LIGHTNING_CHECKPOINT_LOAD, *FOREIGN_RESUME, *DEEPSPEED_STRATEGY_RESUME, *STRATEGY_HOOKS, *TRAINER_STATE,
    *ENGINE_STATE, *UNIVERSAL_LOAD, *TORCH_STATE,
)  # fmt: skip


def resolve(internal: Internal) -> Any:
    """The object ``internal`` names; AttributeError or ImportError when this version no longer has it.

    For ``Class#attribute``: the class, once its code (or a base class's) is seen to set ``self.attribute``."""
    target: Any = importlib.import_module(internal.module)
    path, _, instance_attribute = internal.name.partition("#")
    for part in path.split("."):
        if part.endswith("()"):  # an attribute that instances get in __init__: look at a new instance
            target = getattr(target, part[:-2])()
        else:
            target = getattr(target, part)
    if instance_attribute and not _sets_on_instances(target, instance_attribute):
        raise AttributeError(f"{target.__qualname__} no longer sets `self.{instance_attribute}`")
    return target


def _sets_on_instances(cls: type, attribute: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(attribute)}\s*(?::[^=]*)?=[^=]")
    for klass in cls.__mro__:
        with contextlib.suppress(OSError, TypeError):  # builtins and C types have no source
            if pattern.search(inspect.getsource(klass)):
                return True
    return False


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
