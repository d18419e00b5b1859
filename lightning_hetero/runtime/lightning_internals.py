"""Runtime: the private names of Lightning that the package patches, reads or calls (see :mod:`.internals`).

One list per library, so that a Lightning upgrade is checked against this file alone; each entry says where the
package uses the name, why, and where a patch is put back.
"""

from __future__ import annotations

from lightning_hetero.runtime.deepspeed_internals import FOREIGN_RESUME_WHY
from lightning_hetero.runtime.internal_access import Internal

LAYER_SYNC = Internal(
    "lightning.pytorch.strategies.ddp",
    "DDPStrategy()._layer_sync",
    "read",
    "strategy.py",
    "where the Trainer puts `sync_batchnorm=True` (TorchSyncBatchNorm); DeepSpeedStrategy never applies it, DDPStrategy"
    " does in setup, so the strategy applies it at the same point (on gloo, the package's own in its place)",
)
SETUP_MODEL = Internal(
    "lightning.pytorch.strategies.deepspeed",
    "DeepSpeedStrategy._setup_model",
    "patched",
    "strategy.py",
    "overridden: the point of DeepSpeedStrategy.setup after the profile and before DeepSpeed wraps the module, where"
    " the layer sync is applied",
    "a subclass override, nothing to put back",
)

LIGHTNING_CHECKPOINT_LOAD = Internal(
    "lightning.pytorch.core.saving",
    "pl_load",
    "patched",
    "recover/export.py",
    "the loader LightningModule.load_from_checkpoint calls: a HeteroStrategy checkpoint directory is read as the dict"
    " of a Lightning .ckpt file (it raised IsADirectoryError); every other path goes to Lightning's loader",
    "never: installed when the package is imported, and it only adds the directory case",
)

# (the DeepSpeed side of the same resume: deepspeed_internals.FOREIGN_RESUME)
FOREIGN_RESUME_HOOK = Internal(
    "lightning.pytorch.strategies.deepspeed",
    "DeepSpeedStrategy._setup_model_and_optimizer",
    "patched",
    "strategy.py",
    "overridden to note the optimizer's parameter order before DeepSpeed flattens it; " + FOREIGN_RESUME_WHY,
    "a subclass override, nothing to put back",
)

_FABRIC_DS = "lightning.fabric.strategies.deepspeed"
_DEEPSPEED_STRATEGY_RESUME = (
    "a checkpoint directory of Lightning's DeepSpeedStrategy (no manifest) resumed, or a path that is no checkpoint"
    " explained in DeepSpeedStrategy's own words"
)
DEEPSPEED_STRATEGY_RESUME = (
    Internal(
        _FABRIC_DS,
        "_is_deepspeed_checkpoint",
        "called",
        "recover/from_deepspeed.py",
        "DeepSpeedStrategy's test for a checkpoint folder; " + _DEEPSPEED_STRATEGY_RESUME,
    ),
    Internal(
        _FABRIC_DS,
        "_validate_checkpoint_directory",
        "called",
        "recover/from_deepspeed.py",
        "raises DeepSpeedStrategy's FileNotFoundError naming the folder to load instead; " + _DEEPSPEED_STRATEGY_RESUME,
    ),
)

_OVERRIDE = "a subclass override, nothing to put back"
_PL_DS = "lightning.pytorch.strategies.deepspeed"
_PL_DDP = "lightning.pytorch.strategies.ddp"
STRATEGY_HOOKS = (
    Internal(
        "lightning.pytorch.strategies.launchers",
        "_SubprocessScriptLauncher",
        "read",
        "strategy.py, runtime/quiet.py",
        "the launcher the parent configures, swapped for QuietLauncher (its subclass) so that each trainer call"
        " runs with third-party noise silenced",
    ),
    Internal(
        _PL_DDP,
        "DDPStrategy._configure_launcher",
        "patched",
        "strategy.py",
        "overridden to put QuietLauncher in place of the parent's launcher",
        _OVERRIDE,
    ),
    Internal(_PL_DDP, "DDPStrategy#_launcher", "patched", "strategy.py", "replaced by QuietLauncher", _OVERRIDE),
    Internal(
        _PL_DS,
        "DeepSpeedStrategy._init_deepspeed_distributed",
        "patched",
        "strategy.py",
        "overridden: under torchrun a per-attempt process group first, then the parent's init without the shm op build",
        _OVERRIDE,
    ),
    Internal(
        _PL_DDP,
        "DDPStrategy._get_process_group_backend",
        "called",
        "strategy.py",
        "the backend of the process group the strategy opens itself",
    ),
    Internal(_PL_DDP, "DDPStrategy#_timeout", "read", "strategy.py", "the process group's timeout"),
    Internal(
        _PL_DS,
        "DeepSpeedStrategy._init_config_if_needed",
        "patched",
        "strategy.py",
        "overridden: the config is"
        " formatted on every trainer call (the micro-batch depends on it), not once per strategy",
        _OVERRIDE,
    ),
    Internal(
        _PL_DS,
        "DeepSpeedStrategy#_config_initialized",
        "patched",
        "strategy.py",
        "set after each per-call format, as the parent does",
        _OVERRIDE,
    ),
    Internal(
        _PL_DS,
        "DeepSpeedStrategy._format_config",
        "patched",
        "strategy.py",
        "overridden: measure, plan and set"
        " this rank's micro-batch before the parent formats, then check that the ranks' configs agree",
        _OVERRIDE,
    ),
    Internal(
        _PL_DDP,
        "DDPStrategy#_forward_redirection",
        "patched",
        "strategy.py",
        "wrapped in AutocastInside after init_deepspeed (each rank's autocast inside the engine)",
        "put back at teardown",
    ),
    Internal(
        "lightning.pytorch.strategies.strategy",
        "_ForwardRedirection",
        "read",
        "precision/plugin.py",
        "the redirection AutocastInside wraps; its call signature is relied on",
    ),
    Internal("lightning.fabric.utilities.types", "_PATH", "read", "strategy.py", "a type alias in signatures"),
)

_PL_DATA = "lightning.pytorch.trainer.connectors.data_connector"
TRAINER_STATE = (
    Internal(
        "lightning.pytorch.trainer.trainer",
        "Trainer#_accelerator_connector",
        "read",
        "train/sharding.py",
        "where Trainer(use_distributed_sampler=...) is kept",
    ),
    Internal(
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector#use_distributed_sampler",
        "patched",
        "train/sharding.py",
        "forced off while the strategy shards the training"
        " data itself (Lightning would put in a DistributedSampler); the user's value is kept for predict",
        "at teardown",
    ),
    Internal(
        "lightning.pytorch.loops.fit_loop",
        "_FitLoop#_data_source",
        "read",
        "train/sharding.py",
        "the training loader is requested from it at setup (to profile and plan) and handed back to the loop",
    ),
    Internal(
        _PL_DATA,
        "_request_dataloader",
        "called",
        "train/sharding.py",
        "requests train_dataloader() as Lightning does, inside _format_config, before the loop asks",
    ),
    Internal(_PL_DATA, "_DataLoaderSource.is_defined", "called", "train/sharding.py", "no training loader: no profile"),
    Internal(
        _PL_DATA,
        "_DataLoaderSource.dataloader",
        "patched",
        "train/sharding.py",
        "shadowed on the instance so that"
        " the loader requested at setup is served once (the user's hook runs once per fit)",
        "deleted from the instance once served",
    ),
    Internal(
        "lightning.pytorch.core.module",
        "LightningModule#_trainer",
        "read",
        "strategy.py, precision/plugin.py",
        "whether a trainer is attached, without the .trainer property raising",
    ),
    Internal(
        "lightning.pytorch.trainer.trainer",
        "Trainer#_signal_connector",
        "read",
        "recover/stopping.py",
        "Lightning's SIGTERM handling, whose notifier is replaced and whose flag is set",
    ),
    Internal(
        "lightning.pytorch.trainer.connectors.signal_connector",
        "_SignalConnector._sigterm_notifier_fn",
        "patched",
        "recover/stopping.py",
        "shadowed on the instance before Lightning registers its handlers: the"
        " handler only sets a flag (no collective inside a signal handler)",
        "never: the instance lives for one Trainer",
    ),
    Internal(
        "lightning.pytorch.trainer.connectors.signal_connector",
        "_SignalConnector._slurm_sigusr_handler_fn",
        "patched",
        "recover/stopping.py",
        "shadowed on the instance before Lightning registers its handlers:"
        " Slurm's requeue signal only sets a flag (Lightning's saved a checkpoint, with collectives, in it)",
        "never: the instance lives for one Trainer",
    ),
    Internal(
        "lightning.pytorch.trainer.connectors.signal_connector",
        "_SignalConnector#received_sigterm",
        "patched",
        "recover/stopping.py",
        "set once the ranks agreed to stop, so that callbacks see trainer.received_sigterm",
        "never: it is Lightning's own flag",
    ),
    Internal(
        "lightning.pytorch.loops.training_epoch_loop",
        "_TrainingEpochLoop._broadcast_sigterm_tensor",
        "patched",
        "recover/stopping.py",
        "shadowed on the trainer's epoch loop by an all-reduce MAX of every rank's flag and pace, at paced steps"
        " (Lightning broadcasts rank 0's at every step and exits 0)",
        "never: the instance lives for one Trainer",
    ),
    Internal(
        "lightning.pytorch.utilities._pytree",
        "_tree_flatten",
        "read",
        "runtime/quiet.py",
        "its module's name is the"
        " module= of a warnings filter for the LeafSpec deprecation it raises; a rename stops the filter",
    ),
    Internal(
        "lightning.fabric.utilities.data",
        "_set_sampler_epoch",
        "read",
        "train/order.py, local/claims.py",
        "finds GlobalOrder through batch_sampler.sampler and calls its set_epoch: HeteroBatchSampler and"
        " ClaimingBatchSampler keep that attribute name (the claims' counter is named by the epoch)",
    ),
    Internal(
        "lightning.fabric.utilities.types",
        "_Stateful",
        "read",
        "train/loaders.py, train/streams.py",
        "the protocol by which"
        " CombinedLoader saves and restores the loaders' data position (state_dict/load_state_dict)",
    ),
    Internal(
        "lightning.pytorch.trainer.trainer",
        "Trainer._results",
        "read",
        "strategy.py",
        "the logged results of the batch in hand, whose batch size micro-steps set to each micro-batch's",
    ),
    Internal(
        "lightning.pytorch.trainer.connectors.logger_connector.result",
        "_ResultCollection#batch_size",
        "patched",
        "strategy.py",
        "a metric logged in a micro-batch counts that micro-batch's samples in the"
        " epoch mean (Lightning would take the whole batch's)",
        "by Lightning at the next batch's start",
    ),
    Internal(
        "lightning.pytorch.trainer.trainer",
        "Trainer()._val_check_time_interval",
        "read",
        "local/claims_refusal.py",
        "a time-based `val_check_interval` (each rank's clock would validate it at its own step), which"
        " asynchronous merges refuse; `trainer.val_check_interval` is not set then",
    ),
    Internal(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint()._every_n_train_steps",
        "read",
        "local/claims_refusal.py",
        "a checkpoint every N training steps, which asynchronous merges refuse (the ranks' steps are not in step)",
    ),
    Internal(
        "lightning.pytorch.callbacks.model_checkpoint",
        "ModelCheckpoint()._train_time_interval",
        "read",
        "local/claims_refusal.py",
        "a checkpoint at a time interval, which asynchronous merges refuse likewise",
    ),
    Internal(
        "lightning.pytorch.loops.fit_loop",
        "_FitLoop.on_load_checkpoint",
        "read",
        "recover/from_lightning.py",
        "the fit loop's checkpoint layout (combined_loader state, batch and epoch progress) that a DDP .ckpt"
        " resume reads and writes",
    ),
)

# Lightning 2.6 hands `Trainer.fit(weights_only=...)` to `strategy.load_checkpoint` only for a strategy that restores
# before setup: DeepSpeed's (and this one) restore after it, where `_run` calls `_restore_modules_and_callbacks`
# without it, so the argument did nothing.
TRAINER_RUN = Internal(
    "lightning.pytorch.trainer.trainer",
    "Trainer._run",
    "read",
    "runtime/safe_load.py",
    "its argument `weights_only` (the trainer call's), read from its frame when Lightning hands the strategy's"
    " load_checkpoint none: Lightning 2.6 drops it for strategies that restore the checkpoint after setup",
)

LIGHTNING_INTERNALS = (
    LAYER_SYNC,
    SETUP_MODEL,
    LIGHTNING_CHECKPOINT_LOAD,
    FOREIGN_RESUME_HOOK,
    TRAINER_RUN,
    *DEEPSPEED_STRATEGY_RESUME,
    *STRATEGY_HOOKS,
    *TRAINER_STATE,
)
