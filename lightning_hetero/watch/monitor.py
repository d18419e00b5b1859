"""Callbacks: what the strategy measures, logged through the Trainer's own loggers (CSV, TensorBoard, W&B, MLflow...).

:class:`HeteroMonitor` is a thin adapter, as Lightning's ThroughputMonitor is over its meter: the measuring is the
strategy's (:mod:`lightning_hetero.watch.meter`, every rank, exchanged every few steps), this only turns the steps every
rank now holds into metrics. Loggers write on rank 0 only, and rank 0 has every rank's numbers, so each rank's
metrics appear under its own name: ``hetero/rank_<r>/micro_batch`` (its largest), ``micro_steps``, ``share``,
``compute_ms``, ``wait_ms``,
``samples_per_second``, ``arrival_ms`` and ``exchange_ms`` (its own work before the gradient exchange on the wall
clock, and its time inside the exchange), and for the job ``hetero/samples_per_second`` and
``hetero/balance_efficiency``; ``hetero/late_rank`` names the rank the others waited for at the exchange over the
steps exchanged last, when one evidently arrives later
(:func:`~lightning_hetero.split.decisions.explore.late_and_early`). Each re-plan is logged at the step it takes effect
as ``hetero/replan_predicted_gain`` (the new micro-batches show in ``micro_batch`` from that step on). With fp16 ranks
(``device_precision``), ``hetero/loss_scale`` is the job's loss scale after each optimizer step (the same on every rank;
a halving marks a step skipped for an overflow). ``hetero/skipped_steps`` counts the optimizer steps skipped so far for
non-finite gradients, after each step. With PowerSGD or top-k under an error bound
(``compression_options={"max_error": ...}``, the default), ``hetero/compression_error`` is each check's relative error,
logged at its step with ``hetero/compression_rank`` (PowerSGD) or ``hetero/compression_ratio`` (top-k) the step ran
with.

With ``pipeline``, each stage's times instead: ``hetero/stage_<s>/compute_ms`` and ``wait_ms`` (the slowest of the
ranks holding it) and ``hetero/pipeline_balance`` per step, exchanged every 20 steps and at the end of fit.

The latest exchanged step's metrics are also in ``trainer.callback_metrics`` (logged with ``logger=False``), where
callbacks that report elsewhere read them: Ray Train's ``RayTrainReportCallback`` sends them to ``Result.metrics``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from typing_extensions import override

from lightning_hetero.split.decisions.explore import late_and_early
from lightning_hetero.watch.meter import step_metrics
from lightning_hetero.watch.watcher import Watcher

PIPELINE_EXCHANGE_STEPS = 20


def _pipeline(trainer: Any) -> Any:
    """This rank's stage of the pipeline (HeteroStrategy's ``pipeline``), or None."""
    return getattr(trainer.strategy, "pipeline", None)


class HeteroMonitor(Callback):
    """Log every training step of every rank of a :class:`~lightning_hetero.HeteroStrategy` run to the loggers.

    Args:
        prefix: the metrics' name prefix.

    Steps are logged as the ranks exchange them (every 20 steps, and the rest at the end of fit), each at its own
    step index, so the curves are complete but appear in batches. The index continues from the trainer's
    ``global_step`` at the start of the fit, so a resumed run's curves continue where the checkpoint left them (with
    ``accumulate_grad_batches=1`` a step's index is its global step).
    """

    def __init__(self, prefix: str = "hetero") -> None:
        self.prefix = prefix
        self._logged = 0
        self._replans_logged = 0
        self._scale_logged_at = -1
        self._skipped_logged_at = -1
        self._checks_logged = 0
        self._first_step = 0  # the trainer's global step when this fit started (a resume starts past 0)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not isinstance(getattr(trainer.strategy, "watcher", None), Watcher):
            raise ValueError(
                f"HeteroMonitor reads what HeteroStrategy measures, but the Trainer's strategy is"
                f" {type(trainer.strategy).__name__}. Use `Trainer(strategy='hetero')` or remove the callback."
            )
        self._logged = 0
        self._replans_logged = 0
        self._scale_logged_at = -1
        self._skipped_logged_at = -1
        bound = trainer.strategy.communication.error_bound()
        self._checks_logged = len(bound.checks) if bound is not None else 0  # (a resume's were logged before)
        self._first_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if _pipeline(trainer) is not None:
            if trainer.global_step % PIPELINE_EXCHANGE_STEPS == 0:
                self._log_pipeline_steps(trainer)
            return
        latest = self._log_new_steps(trainer)
        if latest:
            self._make_latest_available_to_callbacks(pl_module, latest)
        self._log_loss_scale(trainer)
        self._log_skipped_steps(trainer)
        self._log_compression_checks(trainer)

    def _log_compression_checks(self, trainer: Any) -> None:
        """Each new check of the compression's error (``max_error``), at its step, with the setting it ran at."""
        bound = trainer.strategy.communication.error_bound()
        if bound is None or not trainer.is_global_zero:
            return
        name = f"{self.prefix}/compression_{'rank' if bound.mode == 'powersgd' else 'ratio'}"
        for check in bound.checks[self._checks_logged :]:
            metrics = {f"{self.prefix}/compression_error": check.relative_error, name: check.setting}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=check.step)
        self._checks_logged = len(bound.checks)

    def _log_skipped_steps(self, trainer: Any) -> None:
        step = trainer.global_step - 1  # the optimizer step that just ended (none yet while accumulating)
        if step <= self._skipped_logged_at or not trainer.is_global_zero:
            return
        self._skipped_logged_at = step
        skipped = len(trainer.strategy.watcher.skipped_steps())
        for logger in trainer.loggers:
            logger.log_metrics({f"{self.prefix}/skipped_steps": skipped}, step=step)

    def _log_loss_scale(self, trainer: Any) -> None:
        scale = trainer.strategy.watcher.loss_scale()
        step = trainer.global_step - 1  # the optimizer step that just ended (none yet while accumulating)
        if scale is None or step <= self._scale_logged_at or not trainer.is_global_zero:
            return
        self._scale_logged_at = step
        for logger in trainer.loggers:
            logger.log_metrics({f"{self.prefix}/loss_scale": scale}, step=step)

    @override
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if _pipeline(trainer) is not None:
            self._log_pipeline_steps(trainer)
            return
        self._log_new_steps(trainer)  # the last steps, exchanged when training ended

    def _log_pipeline_steps(self, trainer: Any) -> None:
        """Every rank's stage times since the last exchange (one gather, every rank); rank 0 logs them per stage."""
        pipeline = _pipeline(trainer)
        new = pipeline.step_times[self._logged :]
        gathered = trainer.strategy.job.collectives.gather_objects((pipeline.stage, new))
        self._logged += len(new)
        if not trainer.is_global_zero:
            return
        stages = sorted({stage for stage, _ in gathered})
        for offset in range(min(len(times) for _, times in gathered)):
            metrics: dict[str, float] = {}
            computes = []
            for stage in stages:
                times = [t[offset] for s, t in gathered if s == stage]
                compute, wait = max(c for c, _ in times), max(w for _, w in times)
                metrics[f"{self.prefix}/stage_{stage}/compute_ms"] = 1e3 * compute
                metrics[f"{self.prefix}/stage_{stage}/wait_ms"] = 1e3 * wait
                computes.append(compute)
            if max(computes) > 0:
                metrics[f"{self.prefix}/pipeline_balance"] = sum(computes) / (len(computes) * max(computes))
            step = self._first_step + self._logged - len(new) + offset
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    @staticmethod
    def _make_latest_available_to_callbacks(pl_module: Any, metrics: dict[str, float]) -> None:
        # `trainer.callback_metrics`, which callbacks that report elsewhere read (Ray Train's report callback sends
        # them to `Result.metrics`; EarlyStopping could stop on them). Not to the loggers: they got every step above.
        # Every rank holds the same steps, so every rank logs the same values and none needs a reduction.
        for name, value in metrics.items():
            pl_module.log(name, value, logger=False, on_step=True, on_epoch=False, batch_size=1)

    def _log_new_steps(self, trainer: Any) -> dict[str, float]:
        """Log the steps exchanged since the last call; returns the latest one's metrics (empty if none)."""
        watcher = trainer.strategy.watcher
        steps = watcher.steps[self._logged :]
        self._logged += len(steps)
        replans = watcher.replans[self._replans_logged :]
        self._replans_logged += len(replans)
        latest = step_metrics(steps[-1], self.prefix) if steps else {}
        if not trainer.is_global_zero:
            return latest
        for step in steps:
            metrics = step_metrics(step, self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self._first_step + step["step"])
        if steps:
            level = sorted(step["step_seconds"] for step in steps)[len(steps) // 2]
            late, _ = late_and_early([step.get("arrival_seconds", ()) for step in steps], level)
            if late is not None:
                for logger in trainer.loggers:
                    logger.log_metrics(
                        {f"{self.prefix}/late_rank": float(late)}, step=self._first_step + steps[-1]["step"]
                    )
        for replan in replans:
            if replan.get("source") == "search":  # (a trial of the search on the measured step: nothing predicted)
                continue
            gain = {f"{self.prefix}/replan_predicted_gain": replan["predicted_gain"]}
            for logger in trainer.loggers:
                logger.log_metrics(gain, step=self._first_step + replan["step"])
        return latest
