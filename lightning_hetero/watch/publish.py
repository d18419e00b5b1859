"""Watch: where a fit's plan records and run report are written, and their copy in a tracking logger's run.

Lightning's convention: with a logger, a run's files go beside the logger's; without one, nothing is written unless
the user names a folder. So with a file logger (CSV, TensorBoard) they go to ``hetero/`` in the run's own log
directory, which Lightning versions per run. A tracking logger (MLflow, W&B...) has no such directory: Lightning's
``trainer.log_dir`` is then the logger's ``save_dir``, its store root (``./mlruns``), where a ``hetero/`` folder is
what MLflow reports as a malformed experiment on every search, and the next run overwrites it. There they go to
``<default_root_dir>/hetero/<logger name>_<run>/`` instead, and at the end of the fit rank 0 adds that folder to the
logger's run: MLflow's run artifacts (under ``hetero/``), W&B's run files. With ``Trainer(logger=False)`` (or
``fast_dev_run``, whose DummyLogger keeps no files) they go to
``<default_root_dir>/hetero/`` only when ``default_root_dir`` was given (a folder other than the working directory,
Lightning's default): a run started inside a repository leaves nothing there. The plan and the run report's summary
are printed either way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger

from lightning_hetero.watch.watcher import PLAN_DIRNAME


def report_directory(trainer: Any, gather: Callable[[Any], list[Any]]) -> Optional[Path]:
    """The same directory on every rank, rank 0's (``gather``: every rank's object, in rank order, e.g. the job's
    :meth:`~lightning_hetero.runtime.collectives.Collectives.gather_objects`; a tracking logger names its run on rank 0
    only, and each rank compares ``default_root_dir`` with its own working directory, which may differ by node), or
    None when nothing is to be written (no logger, no folder named). Every rank must call it."""
    # (`fast_dev_run` puts a DummyLogger in place of the loggers: it keeps no files, as no logger)
    loggers = [logger for logger in trainer.loggers if not isinstance(logger, DummyLogger)]
    if not loggers:
        named = trainer.default_root_dir if names_a_folder(trainer.default_root_dir) else None
        root = gather(named)[0]
        return None if root is None else Path(root) / PLAN_DIRNAME
    if isinstance(loggers[0], (TensorBoardLogger, CSVLogger)):
        return Path(trainer.log_dir or trainer.default_root_dir) / PLAN_DIRNAME
    run = gather(run_name(loggers[0]) if trainer.is_global_zero else None)[0]
    return Path(trainer.default_root_dir) / PLAN_DIRNAME / run


def names_a_folder(default_root_dir: Any) -> bool:
    """Whether a Trainer's ``default_root_dir`` is a folder the user named: Lightning puts the working directory there
    when none was given (so one given as the working directory itself reads as not given)."""
    try:
        return Path(default_root_dir).resolve() != Path.cwd().resolve()
    except OSError:  # (a working directory deleted under the process)
        return True


def run_name(logger: Any) -> str:
    """``<name>_<version>`` of a logger's run, safe as a folder name. The run is started first (W&B names its run
    only then; Lightning would start it at the first logged metric anyway)."""
    logger.experiment  # noqa: B018
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{logger.name}_{logger.version}")


def publish_to_loggers(trainer: Any, directory: Path) -> list[str]:
    """Rank 0: the folder's files as the run's artifacts in each logger that keeps them; the loggers it went to."""
    published = []
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifacts(logger.run_id, str(directory), artifact_path=PLAN_DIRNAME)
            published.append("MLflow")
        elif isinstance(logger, WandbLogger):
            logger.experiment.save(str(directory / "*"), base_path=str(directory.parent), policy="now")
            published.append("W&B")
    return published
