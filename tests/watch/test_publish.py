"""Where the plan and run report go (lightning_hetero/watch/publish.py): Lightning's convention, with a fake trainer."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import DummyLogger

from lightning_hetero.watch import publish


class Gather:
    """One rank of two whose rank 0 gives ``rank_0`` (what the job's gather hands every rank)."""

    def __init__(self, rank_0=None, rank=0) -> None:
        self.rank_0, self.rank = rank_0, rank

    def __call__(self, value):
        return [value if self.rank == 0 else self.rank_0, value]


class Trainer:
    def __init__(self, default_root_dir, loggers=()) -> None:
        self.default_root_dir, self.loggers = str(default_root_dir), list(loggers)
        self.log_dir = self.loggers[0].log_dir if self.loggers else self.default_root_dir


def report_directory(trainer, gather=None):
    return publish.report_directory(trainer, gather or Gather())


def test_without_a_logger_only_a_folder_the_user_named_gets_the_files(tmp_path, monkeypatch):
    """No logger, and `default_root_dir` Lightning's default (the working directory): nothing is written (issue 51,
    item 4: the files landed in the directory the run was started from). `fast_dev_run`'s DummyLogger keeps no files
    either (it put them under hetero/_/ there). A folder named, or a file logger: the files go there."""
    monkeypatch.chdir(tmp_path)
    assert report_directory(Trainer(os.getcwd())) is None
    assert report_directory(Trainer(os.getcwd(), [DummyLogger()])) is None
    assert report_directory(Trainer(tmp_path / "runs")) == tmp_path / "runs" / "hetero"
    assert report_directory(Trainer(tmp_path / "runs", [DummyLogger()])) == tmp_path / "runs" / "hetero"
    logger = CSVLogger(tmp_path / "logs")
    assert report_directory(Trainer(os.getcwd(), [logger])) == Path(logger.log_dir) / "hetero"


def test_every_rank_takes_rank_0s_answer(tmp_path, monkeypatch):
    """A rank whose working directory differs (another node's) takes rank 0's answer: a rank that wrote nowhere while
    another wrote would disagree on `trace=` (refused where nothing is written) and leave the other in a collective."""
    monkeypatch.chdir(tmp_path)
    elsewhere = Trainer(tmp_path)  # (tmp_path is rank 0's working directory)
    monkeypatch.chdir("/")
    assert report_directory(elsewhere, Gather(rank_0=None, rank=1)) is None
    named = Trainer(tmp_path / "runs")
    assert report_directory(named, Gather(rank_0=str(tmp_path / "runs"), rank=1)) == tmp_path / "runs" / "hetero"
