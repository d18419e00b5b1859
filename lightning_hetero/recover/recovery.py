"""Recover: the strategy's one handle on surviving a lost, failed or signalled rank and on resuming.

:class:`Recovery` is called at Lightning's points: setup (watch the peers, stop every rank together on SIGTERM),
``save_checkpoint`` / ``remove_checkpoint`` / ``load_checkpoint`` (complete-or-ignored checkpoints, resuming on
another number of ranks or from another strategy's file), ``on_exception`` (say which rank failed and how) and
teardown. DeepSpeed forces checkpoints through the strategy rather than a Lightning ``CheckpointIO`` plugin: its
engine writes and reads the per-rank shards itself, so each method wraps the parent's (passed in) instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_hetero.recover import by_name, checkpoint, elastic, failures, into_pipeline, liveness, refusal, universal
from lightning_hetero.recover import from_deepspeed as resume_deepspeed
from lightning_hetero.recover import from_lightning as resume_lightning
from lightning_hetero.recover.stopping import (
    StopOnSigterm,
    exit_code_for,
    requeue_slurm_job,
    slurm_job_id,
)
from lightning_hetero.runtime.collectives import Collectives
from lightning_hetero.runtime.safe_load import (
    check_checkpoint_directory,
    check_package_files,
    load_lightning_file,
    unpickles_in_full,
)
from lightning_hetero.runtime.shutdown import exit_with_if_uncaught, requested_exit_code

Load = Callable[..., dict[str, Any]]


class Recovery:
    """One strategy's recovery across its trainer calls (writer locks are held until teardown)."""

    def __init__(self, peer_timeout: Optional[float]) -> None:
        self.peer_timeout = peer_timeout
        self.rank, self.world_size = 0, 1
        self.collectives = Collectives(1, torch.device("cpu"))
        self._trainer_calls = 0
        self._watchdog: Optional[liveness.PeerWatchdog] = None
        self._stop_on_sigterm: Optional[StopOnSigterm] = None
        self._writer_locks: dict[Path, checkpoint.WriterLock] = {}  # rank 0's, per checkpoint directory

    def join(self, collectives: Collectives, rank: int) -> None:
        self.collectives, self.rank, self.world_size = collectives, rank, collectives.world_size

    # ------------------------------------------------------------------ a rank lost, failed or signalled

    def watch_peers(self) -> None:
        """From here to teardown, a rank whose process is gone stops the others (:mod:`.liveness`)."""
        self._trainer_calls += 1  # every rank makes the same trainer calls: the same keys for one call
        if self.world_size == 1 or self.peer_timeout is None:
            return
        rank, world_size = self.rank, self.world_size
        self._watchdog = liveness.PeerWatchdog(
            liveness.store_connector(),
            rank,
            world_size,
            self.peer_timeout,
            liveness.run_id(self._trainer_calls),
            read_failures=lambda store: failures.recorded_in(store, world_size, exclude=rank),
        )
        self._watchdog.start()

    @property
    def run(self) -> str:
        """Names this trainer call's keys in the rendezvous store (the same on every rank, new on a restart)."""
        return liveness.run_id(self._trainer_calls)

    @staticmethod
    def connect_to_store() -> Any:
        """A new client of the job's rendezvous store (its own connection: never the heartbeat's)."""
        return liveness.store_connector()()

    def stop_together_on_sigterm(self, trainer: Any, device: torch.device, at_each_step: bool = True) -> None:
        """Before Lightning registers its signal handlers for this run (after the strategy's setup). Without
        ``at_each_step`` the ranks agree at :meth:`agree_on_stop` only (asynchronous merges: their steps differ);
        with it, at training steps paced by their own agreements (see :class:`StopOnSigterm`)."""
        previous = self._stop_on_sigterm
        self._stop_on_sigterm = StopOnSigterm(lambda flag: self.collectives.reduce_in_place(flag, "max"), device)
        self._stop_on_sigterm.install(trainer, at_each_step)
        self._stop_on_sigterm.take_pending(previous)

    def agree_on_stop(self) -> None:
        """Every rank at once: stop together (SIGTERMException) if any was signalled."""
        if self._stop_on_sigterm is not None:
            self._stop_on_sigterm.stop_if_any_rank_was_signalled()

    def on_exception(self, exception: BaseException, trainer: Any) -> None:
        """Say on every rank which rank failed and how (see :mod:`.failures`); no collective here."""
        exit_code_for(exception)
        if requested_exit_code(exception) == refusal.EXIT_CODE_WILL_FAIL_AGAIN:
            refusal.record_for_torchrun(exception)
        if self._stop_on_sigterm is not None and self._stop_on_sigterm.stopped_every_rank(exception):
            self._save_before_exit(trainer)
            if self._stop_on_sigterm.requeue_wanted() and self.rank == 0:
                job = slurm_job_id()
                rank_zero_info(f"HeteroStrategy: {requeue_slurm_job(job) if job else 'no Slurm job to requeue'}.")
        if not isinstance(exception, Exception) or self.world_size == 1:
            return
        if not failures.is_lost_peer_error(exception):
            failures.publish_failure(self.rank, exception)
            return
        watchdog = self._watchdog
        found: dict[int, str]
        if watchdog is not None and watchdog.store_silent_for() > 2 * liveness.HEARTBEAT_SECONDS:
            found, reachable = {}, False  # the heartbeat already waits on the store: do not wait on it here too
        else:
            found, reachable = failures.read_failures(self.world_size, exclude=self.rank)
        explanation = failures.lost_peer_explanation(self.rank, found, reachable)
        first = exception.args[0] if exception.args else ""
        exception.args = (f"{explanation}\n{first}", *exception.args[1:])
        if not found:  # a peer (or the store's host) is gone without an error of its own: as the watchdog says
            exit_with_if_uncaught(exception, liveness.EXIT_CODE_PEER_LOST)

    def _save_before_exit(self, trainer: Any) -> None:
        """A SIGTERM stopped every rank before the same step: save where `fit(ckpt_path="last")` finds it."""
        path = elastic.interrupt_checkpoint_path(trainer)
        if path is None:
            rank_zero_warn(
                "HeteroStrategy: stopped by SIGTERM without saving: the Trainer has no ModelCheckpoint"
                ' (`enable_checkpointing=False`). Add one to resume with `fit(ckpt_path="last")`.'
            )
            return
        trainer.save_checkpoint(path)
        rank_zero_info(f"HeteroStrategy: stopped by SIGTERM at step {trainer.global_step}; saved {path}.")

    def teardown(self, finished: bool) -> None:
        """``finished``: the trainer call ended normally (not interrupted), so a peer's exit is no loss."""
        for lock in self._writer_locks.values():
            lock.release()
        self._writer_locks.clear()
        if self._watchdog is not None:
            self._watchdog.stop(finished=finished)
            self._watchdog = None

    # ------------------------------------------------------------------ checkpoints

    def save(self, target: Path, write: Callable[[Path], None], facts: Callable[[], dict[str, Any]]) -> None:
        """Complete or ignored: staged, listed in a manifest, published atomically (see :mod:`.checkpoint`).
        ``write(directory)`` is DeepSpeed's save of this rank's part; ``facts()`` what the manifest records."""
        elastic.save_atomically(
            target, write, facts, self.rank == 0, self.collectives.gather_or_raise, self._hold_writer_lock
        )

    @staticmethod
    def write_with_deferred_errors(engine: Any, write: Callable[[], None], is_global_zero: bool) -> None:
        """A failed file write is raised after DeepSpeed's save has run its collectives to the end."""
        with elastic.DeferredWriteErrors(engine) as deferred:
            write()
        deferred.raise_first()
        deferred.write_latest(is_global_zero)

    def _hold_writer_lock(self, directory: Path) -> None:
        """Rank 0 saves into ``directory`` for this trainer call only if no other job does (released at teardown)."""
        lock = self._writer_locks.setdefault(directory.resolve(), checkpoint.WriterLock(directory))
        lock.acquire()

    def remove(self, path: Path, remove: Callable[[Path], None]) -> None:
        if self.rank == 0:
            elastic.prune_unless_only(path, remove)

    def choose(self, path: Path, weights_only: Optional[bool] = None) -> tuple[Path, dict[str, Any]]:
        """The checkpoint to resume from: rank 0 verifies the files against their checksums (once, not on every
        rank), that the package's own files hold tensors and containers only (before any rank reads its own), and,
        unless the user trusts the checkpoint (``weights_only=False``, see
        :func:`~lightning_hetero.runtime.safe_load.unpickles_in_full`), that DeepSpeed's pickle nothing but its own
        classes, before DeepSpeed's engine unpickles them in full; the choice, or its error, reaches every rank in one
        gather; with its manifest (for a directory that Lightning's DeepSpeedStrategy wrote, the facts read from its
        files: :mod:`.from_deepspeed`)."""
        in_full = unpickles_in_full(weights_only)

        def choose_on_rank_0() -> Any:
            choice = resume_deepspeed.choose_checkpoint(path, in_full)
            # (each rank reads its own: checked here for all)
            check_package_files(checkpoint.package_files(Path(choice[0])))
            if not in_full:
                check_checkpoint_directory(Path(choice[0]))
            return choice

        _, choices = self.collectives.gather_or_raise(
            "choosing the checkpoint to resume from", lambda: (None, choose_on_rank_0() if self.rank == 0 else None)
        )
        chosen, warning, foreign = Path(choices[0][0]), choices[0][1], choices[0][2]
        if warning:
            rank_zero_warn(warning)
        if foreign is not None:
            rank_zero_info(resume_deepspeed.describe(chosen, foreign))
            return chosen, foreign
        return chosen, checkpoint.read_manifest(chosen) or {}

    def load_on_another_world_size(
        self, chosen: Path, manifest: dict[str, Any], engine: Any, load: Load, weights_only: Optional[bool] = None
    ) -> Any:
        """A checkpoint of another number of ranks: ZeRO-0 keeps whole states on every rank; ZeRO-1/2/3 go through
        DeepSpeed's universal format (rank 0 converts, once; its result or error reaches every rank), for any optimizer
        whose state is per parameter (:mod:`.universal`; another is refused on every rank first). ``weights_only``:
        Lightning's; unless the user trusts the checkpoint, its files are read weights-only, DeepSpeed's classes
        allowed."""
        in_full = unpickles_in_full(weights_only)
        if not elastic.needs_universal(manifest, self.world_size):
            rank_zero_info(
                f"HeteroStrategy: {chosen} was saved by {manifest.get('world_size')} ranks; this job has"
                f" {self.world_size}: at ZeRO-0 every rank's file holds the whole state, loaded as it is."
            )
            return load(str(chosen))
        elastic.check_convertible(chosen, manifest, self.world_size, in_full)
        _, results = self.collectives.gather_or_raise(
            "converting the checkpoint",
            lambda: (None, elastic.convert_to_universal(chosen, in_full) if self.rank == 0 else None),
        )
        directory, seconds = results[0]
        how = f"converted to DeepSpeed's universal format in {seconds:.2f} s" if seconds is not None else "using the"
        rank_zero_info(
            f"HeteroStrategy: {chosen} was saved by {manifest['world_size']} ranks; this job has {self.world_size}:"
            f" {how} universal copy in {directory}."
        )
        engine_config = engine._config
        engine_config.load_universal_checkpoint = True  # read at load time only; a plain checkpoint needs it off
        # DeepSpeed's ZeRO-1/2 loader reads every state the universal copy holds; its ZeRO-3 loader only Adam's.
        zero3 = engine.zero_optimization_stage() == 3 and engine.optimizer is not None
        try:
            with universal.loading_zero3(engine.optimizer, in_full) if zero3 else contextlib.nullcontext():
                loaded = load(str(directory))
        finally:
            engine_config.load_universal_checkpoint = False
        # (DeepSpeed's universal load leaves the module's buffers alone: they come from the checkpoint's own file.)
        universal.restore_buffers(engine.module, chosen / checkpoint.deepspeed_tag(chosen), in_full)
        return loaded

    @staticmethod
    def resume_from_pipeline(
        chosen: Path,
        manifest: dict[str, Any],
        module: Any,
        engine: Any,
        optimizer_parameters: list[tuple[str, Any]],
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """A pipeline's checkpoint into training without ``pipeline``: every rank's blocks and optimizer state merged
        by parameter name into this rank's module and DeepSpeed's optimizer (any ZeRO stage), and the trainer's state
        (loops, callbacks, schedulers, the loader's position in global samples) as the pipeline saved it."""
        weights, named = by_name.whole_state(chosen)
        resume_lightning.load_module_weights(module, weights, strict=module.strict_loading)
        if engine.optimizer is not None and optimizer_parameters:
            indexed = by_name.indexed_optimizer_state(named, optimizer_parameters)
            resume_lightning.load_optimizer_state(engine, optimizer_parameters, indexed, weights)
        saved = manifest.get("pipeline") or {}
        rank_zero_info(
            f"HeteroStrategy: continuing from {chosen}, a checkpoint of {saved.get('stages')} pipeline stages"
            f" (boundaries {saved.get('boundaries')}), as the whole model on every rank, by parameter name."
        )
        return load_lightning_file(chosen / by_name.CLIENT_FILE, weights_only)

    @staticmethod
    def resume_from_lightning_file(
        path: Path,
        module: Any,
        engine: Any,
        optimizer_parameters: list[tuple[str, Any]],
        order: Optional[Any],
        global_batch_size: Optional[int],
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Continue from a Lightning checkpoint file another strategy wrote (see :mod:`.from_lightning`).
        ``order``: the training loader's global order (None for a stream or no loader), to place the epoch;
        ``weights_only``: Lightning's argument (None: weights-only, see :mod:`~lightning_hetero.runtime.safe_load`)."""
        resume_deepspeed.explain_a_file_inside_a_checkpoint(path)  # (a DeepSpeed folder's part: not a Lightning file)
        # (every rank reads it: none waits for another)
        saved = resume_lightning.read_lightning_checkpoint(path, weights_only)
        resume_lightning.load_module_weights(module, saved["state_dict"], strict=module.strict_loading)
        optimizer_states = saved.get("optimizer_states") or []
        if optimizer_states and engine.optimizer is not None and optimizer_parameters:
            resume_lightning.load_optimizer_state(
                engine, optimizer_parameters, optimizer_states[0], saved["state_dict"]
            )
        elif engine.optimizer is not None:
            rank_zero_warn(f"HeteroStrategy: {path} holds no optimizer state; the optimizer starts afresh.")
        if order is not None and global_batch_size is not None:
            state = resume_lightning.loader_state_for(saved, global_batch_size, len(order), order.seed)
            if state is not None:
                saved = resume_lightning.with_loader_state(saved, state)
                if not order.shuffles:
                    rank_zero_warn(
                        f"HeteroStrategy: {path} stopped in the middle of an epoch. DDP shuffled that epoch"
                        " (Lightning's DistributedSampler); this unshuffled loader keeps its own order, so the rest of"
                        " the epoch is not exactly the samples DDP had not used (later epochs are whole). Give the"
                        " loader `shuffle=True` to continue DDP's epoch exactly."
                    )
        rank_zero_info(
            f"HeteroStrategy: continuing from {path}, a Lightning checkpoint file (weights, optimizer"
            " state, loops and data position restored)."
        )
        return saved


def manifest_facts(
    saved: dict[str, Any],
    world_size: int,
    batch_sizes: Optional[tuple[int, ...]],
    global_samples: Optional[int],
    zero_stage: int,
    engine: Any,
    devices: list[str],
    communication: dict[str, Any],
    sync: Optional[str] = None,
) -> dict[str, Any]:
    """What a checkpoint's manifest records besides its files (see :func:`.checkpoint.write_manifest`): at ZeRO-0
    also the optimizer's parameter names, which its indexed state needs to be read by name (a pipeline resumes it:
    :mod:`.into_pipeline`); ``sync``: local training's mode (None: every step), whose ranks each hold their own
    optimizer state."""
    names = into_pipeline.optimizer_parameter_names(engine.module, engine.optimizer) if zero_stage == 0 else None
    return {
        **({"sync": sync} if sync is not None else {}),
        **({into_pipeline.NAMES_KEY: names} if names is not None else {}),
        "world_size": world_size,
        "global_step": saved.get("global_step"),
        "epoch": saved.get("epoch"),
        # Position in the epoch, in global samples (rank-independent: resumable on any number of ranks).
        "global_samples": global_samples,
        "batch_sizes": list(batch_sizes) if batch_sizes is not None else None,
        "zero_stage": zero_stage,
        "optimizer": type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__,
        "devices": devices,
        "communication": communication,
    }
