"""The training modes: each way of training implements the one lifecycle the job calls, the settings choose one, and
neither facade (the strategy, the job) asks which mode runs."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lightning_hetero
from lightning_hetero import HeteroStrategy
from lightning_hetero.job import mode_class
from lightning_hetero.local.training import AsynchronousTrainingMode, LocalTrainingMode
from lightning_hetero.pipeline.training import PipelineTraining
from lightning_hetero.split.training import DataParallelTraining
from lightning_hetero.train.mode import TrainingMode

MODES = [DataParallelTraining, LocalTrainingMode, AsynchronousTrainingMode, PipelineTraining]
LIFECYCLE = sorted(
    name for name, member in vars(TrainingMode).items() if not name.startswith("_") and callable(member)
) + ["check_trainer"]


def test_the_lifecycle_is_what_the_job_calls():
    assert {"start", "attach", "training_step", "backward", "optimizer_step", "save_checkpoint"} <= set(LIFECYCLE)


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.__name__)
def test_each_mode_implements_every_lifecycle_method_with_its_parameters(mode):
    for name in set(LIFECYCLE):
        expected = inspect.signature(getattr(TrainingMode, name))
        given = inspect.signature(getattr(mode, name))
        assert list(given.parameters) == list(expected.parameters), f"{mode.__name__}.{name}{given} != {expected}"
    assert isinstance(mode.exchanges_each_step, bool)


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ({}, DataParallelTraining),
        ({"batch_sizes": [3, 5]}, DataParallelTraining),
        ({"sync": "local_sgd", "sync_every": 4}, LocalTrainingMode),
        ({"sync": "diloco", "sync_every": 4}, LocalTrainingMode),
        ({"sync": "diloco", "sync_every": 4, "sync_options": {"asynchronous": True}}, AsynchronousTrainingMode),
        ({"pipeline": {"stages": 2, "blocks": "net"}}, PipelineTraining),
    ],
)
def test_the_settings_choose_one_mode(arguments, expected):
    strategy = HeteroStrategy(**arguments)
    assert mode_class(strategy.job.settings) is expected and strategy.job.mode_class is expected


def test_only_the_asynchronous_mode_lets_ranks_step_apart():
    assert [mode.exchanges_each_step for mode in MODES] == [True, True, False, True]


MODE_WORDS = {"pipeline", "local", "claims", "asynchronous", "sync"}


def test_neither_facade_branches_on_the_mode():
    """The strategy and the job call the mode; only :func:`mode_class` and the mode's construction ask the settings
    which it is (a property for users may still ask the running mode what it is)."""
    package = Path(lightning_hetero.__file__).parent
    found = []
    for name in ("strategy.py", "job.py"):
        tree = ast.parse((package / name).read_text())
        allowed = {
            id(node)
            for function in ast.walk(tree)
            if isinstance(function, ast.FunctionDef) and function.name in ("mode_class", "_build_mode")
            for node in ast.walk(function)
        }
        for node in ast.walk(tree):
            if id(node) in allowed or not isinstance(node, (ast.If, ast.IfExp)):
                continue
            words = {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}
            words |= {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if words & MODE_WORDS:
                found.append(f"{name}:{node.lineno} asks {sorted(words & MODE_WORDS)}")
    assert not found, "a facade branches on the mode:\n" + "\n".join(found)
