"""Unit tests for runtime/quiet.py: known third-party noise is dropped inside the block, nothing else is."""

from __future__ import annotations

import logging
import os
import warnings

from lightning_hetero.runtime import quiet


class Recorder(logging.Handler):
    """Records what reaches a logger's handlers (DeepSpeed's logger does not propagate to the root, caplog's)."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(logger_name)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> Recorder:
        self.logger.addHandler(self)
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def test_known_log_messages_are_dropped_only_inside_the_block():
    logger = logging.getLogger("DeepSpeed")
    with Recorder("DeepSpeed") as recorder, quiet.third_party_noise_silenced():
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("a DeepSpeed warning the user can act on")
    assert recorder.messages == ["a DeepSpeed warning the user can act on"]
    with Recorder("DeepSpeed") as recorder:
        logger.warning("Setting accelerator to CPU.")  # outside the strategy's calls: untouched
    assert recorder.messages == ["Setting accelerator to CPU."]


def test_known_warnings_are_dropped_at_their_source_only():
    """Filtered by category, message and the module that issues them: the same text from elsewhere still shows."""
    message = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet._filter_warning_noise()  # what install_lasting_filters adds, in front of "always"
        warnings.warn_explicit(message, FutureWarning, "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.train")
        warnings.warn_explicit(message, UserWarning, "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)  # (issued from this module)
    assert [(str(w.message), w.category) for w in caught] == [
        (message, FutureWarning),  # another module
        (message, UserWarning),  # another category
        ("the user's own warning", UserWarning),
    ]


def test_lightning_tips_are_dropped_once_a_strategy_exists():
    quiet.install_lasting_filters()
    quiet.install_lasting_filters()  # idempotent
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(isinstance(f, quiet._DropMessages) for f in logger.filters) == 1
    with Recorder("lightning.pytorch.utilities.rank_zero") as recorder:
        logger.info("💡 Tip: For seamless cloud logging ...")
        logger.info("GPU available: False, used: False")
    assert recorder.messages == ["GPU available: False, used: False"]


def test_lightnings_srun_hint_is_hidden_outside_a_slurm_job_only(tmp_path, monkeypatch):
    """With Slurm installed (`srun` on PATH), every run printed Lightning's "srun ... not used" hint, the main job's
    included. Outside a Slurm job it is hidden; inside an allocation that did not use srun it is the right advice."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for name in ("SLURM_NTASKS", "SLURM_JOB_NAME", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)

    def hints() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monkeypatch.setenv("SLURM_JOB_ID", "7")  # a job: the hint stays
            quiet.hide_the_srun_hint_outside_slurm_jobs()
            SLURMEnvironment._validate_srun_used()
            monkeypatch.delenv("SLURM_JOB_ID")  # no job: hidden
            quiet.hide_the_srun_hint_outside_slurm_jobs()
            SLURMEnvironment._validate_srun_used()
        return [str(w.message)[:40] for w in caught]

    assert hints() == ["The `srun` command is available on your "]
